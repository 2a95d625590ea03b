"""Argument checks and buffers shared by the state objects and the state file format.

A private module with public names: :mod:`linattn_nb.state.linear`,
:mod:`linattn_nb.state.kvcache` and :mod:`linattn_nb.state.fileformat` import
them from here.
"""
from __future__ import annotations

import numpy as np

from .. import _validate as V

#: The dtypes a state (or a KV cache) can hold.
STATE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)


def check_dim(name, x) -> int:
    """A dimension: an integer >= 1 (TypeError for non-integers, ValueError below 1)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an integer >= 1, got {type(x).__name__}")
    if x < 1:
        raise ValueError(f"{name} must be >= 1, got {x}")
    return int(x)


def check_batch_shape(batch_shape) -> tuple:
    """``batch_shape`` as a tuple of non-negative ints (an int is a 1-tuple)."""
    if isinstance(batch_shape, (int, np.integer)) and not isinstance(batch_shape, (bool, np.bool_)):
        batch_shape = (batch_shape,)
    try:
        bs = tuple(batch_shape)
    except TypeError:
        raise TypeError(f"batch_shape must be a tuple of integers, got {type(batch_shape).__name__}") from None
    for x in bs:
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 0:
            raise ValueError(f"batch_shape must hold non-negative integers, got {bs}")
    return tuple(int(x) for x in bs)


def check_state_dtype(dtype) -> np.dtype:
    """float32 or float64 (the state's accumulation precision)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32 or float64, got {dtype!r}") from None
    if dt not in STATE_DTYPES:
        raise TypeError(f"dtype must be float32 or float64 (the state's accumulation precision), got {dt}")
    return dt


def work_dtype(dtype: np.dtype) -> np.dtype:
    """float16 inputs are computed in float32 (Numba has no float16 on the CPU)."""
    return F32 if dtype == F16 else dtype


def check_shapes(batch_shape, pairs) -> int:
    """pairs: [(name, array, last_dim)]: batch shape, last dims and equal T (axis -2). Returns T."""
    nb = len(batch_shape)
    T = None
    for name, x, last in pairs:
        shp = tuple(x.shape)
        if len(shp) != nb + 2 or shp[:nb] != batch_shape or shp[-1] != last:
            label = "value_dim" if name == "v" else "key_dim"
            raise ValueError(
                f"{name} must have shape {batch_shape + ('T', last)} (batch_shape {batch_shape}, "
                f"T tokens, {label} {last}), got {shp}"
            )
        if T is None:
            T = shp[-2]
        elif shp[-2] != T:
            raise ValueError(
                f"{', '.join(n for n, _, _ in pairs)} must have the same number of tokens T (axis -2), "
                f"got shapes {', '.join(str(tuple(a.shape)) for _, a, _ in pairs)}"
            )
    return int(T)


def host_tokens(batch_shape, pairs):
    """Host arrays of ``pairs`` [(name, array_like, last_dim)], checked: float dtypes, shapes
    ``(*batch_shape, T, last_dim)`` with one T.  Returns ``(arrays, T, promoted dtype)``."""
    arrs = []
    for n, x, last in pairs:
        x = V.as_host_array(n, x)
        V.check_float_dtype(n, x.dtype)
        arrs.append((n, x, last))
    T = check_shapes(batch_shape, arrs)
    return arrs, T, np.dtype(np.result_type(*[a.dtype for _, a, _ in arrs]))


def aligned_zeros(shape, dtype, align=64):
    """Zeros whose data starts on a cache-line boundary (NumPy only guarantees 16 bytes):
    a decode step streams every row of S, and unaligned 256-byte rows touch five lines, not four."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    buf = np.zeros(n * dtype.itemsize + align, dtype=np.uint8)
    off = (-buf.ctypes.data) % align
    return buf[off:off + n * dtype.itemsize].view(dtype).reshape(shape)


def raise_nonfinite(name):
    """The error of a decode call whose input ``name`` holds NaN or inf (nothing was changed)."""
    raise ValueError(f"{name} contains non-finite values (NaN or inf); nothing was changed. "
                     "Pass check_finite=False to skip this check")
