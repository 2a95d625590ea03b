"""Device workspaces reused across calls, device-side zeroing and the finiteness counters.

See ``docs/cuda_kernels.md``, "Workspaces and finiteness counters".
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict

import numpy as np
from numba import cuda

from .. import config
from ._cuda_common import unravel4
from .cuda.plan import helper_grid

__all__ = ["workspace", "zeros", "fill", "counters", "count_nonfinite", "count_out_of_range", "rule_input",
           "raise_if_nonfinite", "discard_counts", "clear", "stats", "CHECK_SLOTS", "SLOT"]

#: The names of the check counters, in the order errors name them: NaN/inf entries of q, k, v and
#: a device initial state; entries of a device ``log_decay`` (``beta``) that are NaN or > 0 (outside [0, 2]).
CHECK_SLOTS = ("q", "k", "v", "initial_state.S", "initial_state.z", "decay", "log_decay", "beta")
#: The errors of the range-checked slots (:func:`count_out_of_range`, :func:`rule_input`); the others
#: count NaN/inf.
_RANGE_ERRORS = {"decay": "decay factors must lie in [0, 1] (0 resets the state) and not be NaN: {n} value(s) do not",
                 "log_decay": "log_decay must be <= 0 (-inf resets the state) and not NaN: {n} value(s) are not",
                 "beta": "beta (the write strength) must lie in [0, 2] and not be NaN: {n} value(s) do not"}
#: :func:`rule_input`'s conversions: name -> (mode, lo, hi); mode 0 copies a log-factor, 1 takes the
#: log of a linear factor, 2 copies a value that is not a log-factor.
_RULE_INPUTS = {"decay": (1, 0.0, 1.0), "log_decay": (0, -math.inf, 0.0), "beta": (2, 0.0, 2.0)}
#: Slot index of each name of :data:`CHECK_SLOTS`.
SLOT = {name: i for i, name in enumerate(CHECK_SLOTS)}

_SIM = bool(getattr(__import__("numba").config, "ENABLE_CUDASIM", 0))
_LOCK = threading.Lock()
_POOL: "OrderedDict[tuple, object]" = OrderedDict()
_STATS = {"hits": 0, "misses": 0, "bytes": 0}
_LOCAL = threading.local()
_KERNELS = {}


def _context_key():
    """A hashable key of the current CUDA context (the simulator has one)."""
    ctx = cuda.current_context()
    if _SIM:
        return ("sim", int(getattr(ctx, "id", 0)))
    handle = getattr(ctx, "handle", None)
    try:
        hv = int(getattr(handle, "value", handle))
    except Exception:  # pragma: no cover - exotic handle types
        hv = id(ctx)
    return (int(ctx.device.id), hv)


def workspace(tag, shape, dtype):
    """A C-contiguous device array of ``shape`` and ``dtype`` for a temporary of one call; contents undefined.
    The same array comes back for the next request with the same ``tag`` (the buffer's role: buffers alive
    at the same time need different tags), shape and dtype from the same thread and CUDA context."""
    shape = tuple(int(s) for s in shape)
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    limit = max(0, int(config.CUDA_WORKSPACE_BYTES))
    if nbytes > limit:  # too large to keep (or the pool is off): a plain allocation
        with _LOCK:
            _STATS["misses"] += 1
        return cuda.device_array(shape, dtype=dt)
    key = (tag, shape, dt.str, _context_key(), threading.get_ident())
    with _LOCK:
        arr = _POOL.get(key)
        if arr is not None:
            _POOL.move_to_end(key)
            _STATS["hits"] += 1
            _trim(limit)
            return arr
        _STATS["misses"] += 1
    arr = cuda.device_array(shape, dtype=dt)
    with _LOCK:
        if key not in _POOL:
            _POOL[key] = arr
            _STATS["bytes"] += nbytes
        _trim(limit)
    return arr


def _trim(limit):
    """Free the least recently used buffers while the pool holds more than ``limit`` bytes (lock held;
    the most recent buffer, at most ``limit`` bytes itself, stays)."""
    while _STATS["bytes"] > limit and len(_POOL) > 1:
        _, old = _POOL.popitem(last=False)
        _STATS["bytes"] -= int(old.size) * np.dtype(old.dtype).itemsize


def clear() -> None:
    """Drop every pooled workspace (their memory is freed once no kernel uses them)."""
    with _LOCK:
        _POOL.clear()
        _STATS["bytes"] = 0


def stats() -> dict:
    """``{"hits", "misses", "bytes", "buffers"}``: requests served from the pool, allocations, bytes held."""
    with _LOCK:
        return dict(_STATS, buffers=len(_POOL))


# ---------------------------------------------------------------------------
# Device-side fill and finiteness counting
# ---------------------------------------------------------------------------
def _fill_py(x, value):
    """x[j] = value for every entry of the 1-d array x (grid-stride)."""
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for j in range(start, x.size, stride):
        x[j] = value


def _count4_py(x, counters, slot):
    """counters[slot] += number of NaN/inf entries of the 4-d array x (any strides; grid-stride)."""
    A, Bn, N, F = x.shape
    total = A * Bn * N * F
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    bad = 0
    for idx in range(start, total, stride):
        a0, a1, t, i = unravel4(idx, Bn, N, F)
        y = x[a0, a1, t, i] + 0.0  # float64: float16 compares without local memory, float64 exactly
        if not (y == y and abs(y) < math.inf):  # NaN or inf (comparisons only: no FP exception)
            bad += 1
    if bad:
        cuda.atomic.add(counters, slot, bad)


def _count_range_py(x, lo, hi, counters, slot):
    """counters[slot] += number of entries of the 1-d float array x that are NaN or outside [lo, hi]."""
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    bad = 0
    for j in range(start, x.size, stride):
        y = x[j]
        if not (y >= lo and y <= hi):  # NaN fails both
            bad += 1
    if bad:
        cuda.atomic.add(counters, slot, bad)


def _rule_input_py(x, dst, mode, lo, hi, reset, counters, slot):
    """dst (C-contiguous 1-d float64) <- the 4-d array x (B1, B2, N, W), any strides (0 broadcasts), in
    the working form of a rule input (``mode`` as :data:`_RULE_INPUTS`; a log-factor at or below ``reset``
    stored as -inf); an entry NaN or outside [lo, hi] is stored as NaN and counted in counters[slot]."""
    A, Bn, N, W = x.shape
    s0, s1, s2, s3 = x.strides
    total = A * Bn * N * W
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    bad = 0
    for idx in range(start, total, stride):
        a0, a1, t, i = unravel4(idx, Bn, N, W)
        y = x[a0, a1, t, i] + 0.0  # float64
        if not (y >= lo and y <= hi):  # NaN fails both
            # counted once per element of the caller's array: a broadcast one (stride 0) at index 0 only
            if (s0 != 0 or a0 == 0) and (s1 != 0 or a1 == 0) and (s2 != 0 or t == 0) and (s3 != 0 or i == 0):
                bad += 1
            dst[idx] = math.nan
            continue
        if mode == 1:
            y = -math.inf if y == 0.0 else math.log(y)
        if mode != 2 and y <= reset:
            y = -math.inf
        dst[idx] = y
    if bad:
        cuda.atomic.add(counters, slot, bad)


def _kernels():
    if not _KERNELS:
        _KERNELS["fill"] = cuda.jit(_fill_py)
        _KERNELS["count4"] = cuda.jit(_count4_py)
        _KERNELS["count_range"] = cuda.jit(_count_range_py)
        _KERNELS["rule_input"] = cuda.jit(_rule_input_py)
    return _KERNELS


def fill(x, value=0):
    """Set every entry of the C-contiguous device array ``x`` to ``value`` (one kernel; returns ``x``)."""
    if x.size:
        flat = x.reshape(int(x.size))
        _kernels()["fill"][helper_grid(x.size)](flat, np.dtype(x.dtype).type(value))
    return x


def zeros(shape, dtype=np.float64, tag=None):
    """A device array zeroed on the device: a new one (``tag`` None), else :func:`workspace`'s."""
    shape = tuple(int(s) for s in shape)
    x = cuda.device_array(shape, dtype=np.dtype(dtype)) if tag is None else workspace(tag, shape, dtype)
    return fill(x, 0)


def counters():
    """The calling thread's int32 device array of :data:`CHECK_SLOTS` counters (zero between calls); marks
    a read as due for :func:`raise_if_nonfinite`."""
    ctx = _context_key()
    per_context = _LOCAL.__dict__.setdefault("counters", {})
    arr = per_context.get(ctx)
    if arr is None:
        arr = per_context[ctx] = zeros((len(CHECK_SLOTS),), np.int32)
    _LOCAL.due = True
    return arr


def count_nonfinite(name, x4) -> None:
    """Add the NaN/inf entries of the 4-d device array ``x4`` to the counter ``name`` (one kernel, no read)."""
    c = counters()
    if x4.size:
        _kernels()["count4"][helper_grid(x4.size)](x4, c, SLOT[name])


def count_out_of_range(name, x, lo, hi) -> None:
    """Add the entries of the C-contiguous float32 or float64 device array ``x`` that are NaN or outside
    [lo, hi] to the counter ``name`` (one kernel, no read: :func:`raise_if_nonfinite` reads it)."""
    c = counters()
    if x.size:
        _kernels()["count_range"][helper_grid(x.size)](x.reshape(int(x.size)), float(lo), float(hi), c,
                                                       SLOT[name])


def rule_input(name, x4, shape):
    """A pooled C-contiguous float64 workspace of ``shape`` holding the rule input ``name`` read from the
    4-d device view ``x4`` (any float dtype and strides, 0 for broadcast axes), converted on the device by
    :func:`_rule_input_py` (``decay`` to its log, log-factors at or below ``_codes.LOG_RESET`` to -inf);
    entries out of range go to the counter ``name``.  Valid until this thread's next call with that shape.
    """
    from ._codes import LOG_RESET

    mode, lo, hi = _RULE_INPUTS[name]
    dst = workspace("rule_input." + name, shape, np.float64)
    c = counters()
    if dst.size:
        _kernels()["rule_input"][helper_grid(dst.size)](x4, dst.reshape(int(dst.size)), np.int64(mode),
                                                  float(lo), float(hi), float(LOG_RESET), c, SLOT[name])
    return dst


def raise_if_nonfinite() -> None:
    """Read the counters once (when a kernel counted since the last read); ValueError naming the first
    non-zero counter of :data:`CHECK_SLOTS` (the counters are zeroed first)."""
    if not getattr(_LOCAL, "due", False):
        return
    _LOCAL.due = False
    c = _LOCAL.counters[_context_key()]
    host = c.copy_to_host()
    if not host.any():
        return
    fill(c, 0)
    for name, n in zip(CHECK_SLOTS, host):
        if n:
            raise ValueError(_RANGE_ERRORS[name].format(n=int(n)) if name in _RANGE_ERRORS else
                             f"{name} contains {int(n)} non-finite value(s) (NaN or inf); "
                             "pass check_finite=False to skip this check")


def discard_counts() -> None:
    """Zero the counters without reading them (a call that failed before its read; one kernel)."""
    if getattr(_LOCAL, "due", False):
        _LOCAL.due = False
        fill(_LOCAL.counters[_context_key()], 0)
