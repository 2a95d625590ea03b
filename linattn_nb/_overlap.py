"""Does a call's ``out=`` share memory with anything the call reads?  One check for every entry point.

Conservative like :func:`numpy.may_share_memory` (intersecting byte ranges), for host and GPU
arrays; design: docs/frontend.md, "``out=`` that overlaps an input".
"""
from __future__ import annotations

import numpy as np

from .device import is_device_array, is_simulator_array


def _host_view(x):
    """``x`` as a NumPy array that shares its memory, or None (not an array, or a copy would be needed)."""
    if isinstance(x, np.ndarray):
        return x
    if is_simulator_array(x):
        return np.asarray(x._ary)
    if hasattr(x, "__array_interface__"):
        try:
            return np.asarray(x)
        except Exception:
            return None
    if type(x).__module__.startswith("torch") and hasattr(x, "numpy"):
        try:  # a CPU tensor (one that requires grad too): the view of its storage
            return x.detach().numpy()
        except Exception:
            return None
    return None


def _device_span(x):
    """``(lo, hi)`` byte addresses spanned by a GPU array, or None (empty, or no array interface)."""
    try:
        cai = x.__cuda_array_interface__
    except Exception:
        return None
    shape = tuple(int(s) for s in cai["shape"])
    if any(s == 0 for s in shape):
        return None
    itemsize = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    if strides is None:  # C-contiguous
        strides = np.cumprod((itemsize,) + shape[:0:-1], dtype=np.int64)[::-1].tolist()
    ptr = int(cai["data"][0])
    lo = ptr + sum(st * (n - 1) for st, n in zip(strides, shape) if st < 0)
    hi = ptr + sum(st * (n - 1) for st, n in zip(strides, shape) if st > 0) + itemsize
    return lo, hi


def may_overlap(a, b) -> bool:
    """True when arrays ``a`` and ``b`` may share memory (host or GPU; False for non-arrays)."""
    if a is None or b is None:
        return False
    if is_device_array(a) or is_device_array(b):
        if not (is_device_array(a) and is_device_array(b)):
            return False  # one on the host, one on the GPU
        sa, sb = _device_span(a), _device_span(b)
        return sa is not None and sb is not None and sa[0] < sb[1] and sb[0] < sa[1]
    ha, hb = _host_view(a), _host_view(b)
    if ha is None or hb is None or ha.size == 0 or hb.size == 0:
        return False
    return bool(np.may_share_memory(ha, hb))


def out_overlaps(out, reads) -> bool:
    """True when ``out`` may share memory with any array of ``reads`` (an iterable; non-arrays ignored)."""
    if out is None:
        return False
    return any(may_overlap(out, x) for x in reads)


def _state_arrays(state):
    if state is None:
        return ()
    if isinstance(state, tuple):
        return tuple(state[:2])
    return tuple(getattr(state, name, None) for name in ("S", "z"))


def map_arrays(fmap) -> tuple:
    """The arrays a feature map reads: its parameters and any array it holds (e.g. a random projection)."""
    if fmap is None:
        return ()
    found = []
    get = getattr(fmap, "parameters", None)
    if callable(get):
        try:
            found += list(dict(get()).values())
        except Exception:
            pass
    found += [x for x in vars(fmap).values() if isinstance(x, np.ndarray)] if hasattr(fmap, "__dict__") else []
    return tuple(found)


def call_reads(*arrays, initial_state=None, fmap=None) -> tuple:
    """Everything a call reads: ``arrays`` (q, k, v, the rule's inputs, ``grad_out`` ...), the arrays of
    ``initial_state`` (a LinearState, a tuple ``(S, z[, position])`` or an object with ``.S``, ``.z``) and
    those of the feature map ``fmap``."""
    return tuple(arrays) + _state_arrays(initial_state) + map_arrays(fmap)
