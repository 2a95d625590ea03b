"""Device-array views for the kernels: strided, 4-d and flat views without copies, and the vector loads
they allow (``docs/cuda_kernels.md``, "Global addressing")."""
from __future__ import annotations

import numpy as np
from numba import cuda

from .plan import VEC_QK, VEC_V


def is_sim_array(x) -> bool:
    """True for the simulator's device arrays (``FakeCUDAArray``)."""
    return type(x).__name__ == "FakeCUDAArray" and type(x).__module__.startswith("numba.cuda.simulator")


def strided_view(x, shape, strides):
    """A view of device array ``x`` (element 0 kept) with new shape and byte strides."""
    shape = tuple(int(s) for s in shape)
    strides = tuple(int(s) for s in strides)
    if is_sim_array(x):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(np.lib.stride_tricks.as_strided(x._ary, shape, strides))
    cai = x.__cuda_array_interface__
    desc = {
        "shape": shape,
        "strides": strides,
        "data": (cai["data"][0], False),
        "typestr": np.dtype(x.dtype).str,
        "version": 2,
    }
    return cuda.from_cuda_array_interface(desc, owner=x, sync=False)


def as_4d(x):
    """View a device array of shape (..., N, F) as (B1, B2, N, F) without copying, or None: the last
    leading dimension becomes B2 and the ones before it merge into B1, which needs nested strides (any
    contiguous array, the usual transposes).  ValueError for negative strides."""
    shape = tuple(int(s) for s in x.shape)
    strides = tuple(int(s) for s in x.strides)
    if any(s < 0 for s in strides):
        raise ValueError(
            "device arrays with negative strides are not supported; make a contiguous copy first"
        )
    if len(shape) < 2:
        raise ValueError(f"expected at least 2 dimensions, got shape {shape}")
    n, f = shape[-2:]
    sn, sf = strides[-2:]
    # dimensions of size 1 take no part in addressing: drop them
    lead = [(d, s) for d, s in zip(shape[:-2], strides[:-2]) if d != 1]
    if len(shape) == 4 and len(lead) == 2:
        return x
    b2, s2 = lead[-1] if lead else (1, n * sn)
    rest = lead[:-1]
    for (d0, s0), (d1, s1) in zip(rest[:-1], rest[1:]):
        if s0 != s1 * d1:
            return None
    if rest:
        b1 = int(np.prod([d for d, _ in rest]))
        s1 = rest[-1][1]
    else:
        b1, s1 = 1, b2 * s2
    return strided_view(x, (b1, b2, n, f), (s1, s2, sn, sf))


def flat_view(x):
    """``(view, strides)`` of device array ``x`` for the sequence kernel: a 1-d view from its first
    element over every element it addresses (no copy), and its strides in elements (0 for a dimension
    of size 1).  ValueError for a negative stride or one that is not a multiple of the item size."""
    item = np.dtype(x.dtype).itemsize
    shape = tuple(int(d) for d in x.shape)
    strides = tuple(int(s) if d > 1 else 0 for d, s in zip(shape, x.strides))
    if any(s < 0 or s % item for s in strides):
        raise ValueError(f"device arrays need non-negative strides that are whole multiples of the item size "
                         f"({item} bytes); got strides {tuple(int(s) for s in x.strides)} for shape {shape}: "
                         "make a contiguous copy first")
    es = tuple(s // item for s in strides)
    span = 0 if 0 in shape else 1 + sum((d - 1) * s for d, s in zip(shape, es))
    return strided_view(x, (span,), (item,)), es


def data_pointer(x) -> int:
    """Address of device array ``x``'s first element (the simulator: of its host memory)."""
    if is_sim_array(x):
        return int(x._ary.__array_interface__["data"][0])
    return int(x.__cuda_array_interface__["data"][0])


def vector_bits(q, k, v, strides, F: int, M: int, MB: int) -> int:
    """The ``vec`` bits of :func:`seq_kernel` the 4-d views ``q, k, v`` allow (``strides`` in elements):
    ``VEC_QK`` when every group of four features of q and k is aligned as ``_cuda_common.load4``
    declares (unit feature stride, ``F`` and the other strides multiples of 4, an aligned first
    element), ``VEC_V`` when v's are, with ``M`` and ``MB`` multiples of 4."""
    from .._cuda_common import VEC_ALIGN

    def ok(x, es, width):
        align = VEC_ALIGN.get(np.dtype(x.dtype).itemsize * 8)
        return (align is not None and width % 4 == 0 and es[3] in (0, 1) and all(s % 4 == 0 for s in es[:3])
                and data_pointer(x) % align == 0)

    bits = VEC_QK if ok(q, strides[0], F) and ok(k, strides[1], F) else 0
    if ok(v, strides[2], M) and MB % 4 == 0:
        bits |= VEC_V
    return bits


def sequence_span(shape, strides) -> int:
    """Elements one (N, F) sequence of a 4-d array spans: the largest offset + 1 (0 if empty)."""
    n, f = (int(d) for d in shape[-2:])
    sn, sf = (int(s) for s in strides[-2:])
    return 0 if n == 0 or f == 0 else 1 + (n - 1) * sn + (f - 1) * sf
