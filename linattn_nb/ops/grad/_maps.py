"""The elementwise feature maps of the kernels, for the gradient front end: features and their VJP.

For the maps the kernels apply inline (ELU+1, ReLU, squared ReLU) one parallel
pass in the working dtype, with the forward kernels' per-element map and a
finiteness check, replaces NumPy's several passes.  The row maps ``l2`` and
``silu_l2`` have theirs in :mod:`linattn_nb.ops.grad._rowmaps`; every other map
keeps its NumPy form (:class:`linattn_nb.feature_maps.FeatureMap`).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ... import config
from .._codes import KERNEL_CODE_ELU, KERNEL_CODE_RELU, KERNEL_CODE_SQUARED_RELU
from .._common import phi
from .._vec import is_finite

#: Map codes with a per-element derivative here.
ELEMENTWISE_CODES = (KERNEL_CODE_ELU, KERNEL_CODE_RELU, KERNEL_CODE_SQUARED_RELU)
#: Those whose derivative the fused backwards take from the features alone
#: (:func:`linattn_nb.ops.grad._cpu_chunked.map_span`).
FROM_FEATURES = (KERNEL_CODE_ELU, KERNEL_CODE_RELU)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def dphi(x, code):
    """Derivative of map ``code`` at ``x`` (the conventions of the NumPy ``_df``: the slope of the side
    where the map is constant at a kink, 1 for ELU+1 at 0); NaN propagates."""
    if code == KERNEL_CODE_ELU:
        return x - x + 1 if x >= 0 else phi(x, code)  # exp(x) below 0: the feature itself
    if code == KERNEL_CODE_RELU:
        return x - x + 1 if x > 0 else (x - x)  # NaN - NaN: NaN propagates
    if code == KERNEL_CODE_SQUARED_RELU:
        return 2 * x if x > 0 else (x - x)
    return x - x + 1


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def _features_kernel(x, out, code):
    R, D = x.shape
    ok = np.ones(R, dtype=np.bool_)
    for r in prange(R):
        good = True
        for i in range(D):
            xi = x[r, i]
            out[r, i] = phi(xi, code)
            good &= (xi - xi) == 0  # finite: inf - inf and NaN - NaN are NaN
        ok[r] = good
    return ok.all()


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def _vjp_kernel(x, g, out, code):
    """``out = g * phi'(x)`` (``out`` may be ``g``)."""
    R, D = x.shape
    for r in prange(R):
        for i in range(D):
            out[r, i] = g[r, i] * dphi(x[r, i], code)


#: Rows per task of :func:`_vjp_checked_kernel`.
_ROWS = 64


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def _vjp_checked_kernel(x, g, out, code):
    """:func:`_vjp_kernel`, and whether every result, as stored, is finite.

    Each row goes through a buffer: written straight over ``g`` with the finite flag beside it, the loop
    lost its vector form (12 against 1.2 ms for 4M float32 elements, measured)."""
    R, D = x.shape
    tasks = (R + _ROWS - 1) // _ROWS
    ok = np.ones(tasks, dtype=np.bool_)
    for t in prange(tasks):
        buf = np.empty(D, out.dtype)
        good = True
        for r in range(t * _ROWS, min(R, (t + 1) * _ROWS)):
            for i in range(D):
                buf[i] = g[r, i] * dphi(x[r, i], code)
            for i in range(D):
                y = buf[i]
                out[r, i] = y
                good &= is_finite(y)  # as stored: a float64 product may overflow float32 only there
        ok[t] = good
    return ok.all()


def _own(g, dtype):
    """Whether ``g`` can take the results: a writeable C-contiguous ``dtype`` array (its reshape a view)."""
    return isinstance(g, np.ndarray) and g.dtype == dtype and g.flags.c_contiguous and g.flags.writeable


def _rows(x):
    return x.reshape((-1, x.shape[-1])) if x.size else x.reshape((0, x.shape[-1]))


def features(x, code, dtype, out=None):
    """``(phi(x), finite)``: features of ``x`` (..., N, D) as a C-contiguous ``dtype`` array, and whether
    every element of ``x`` is finite; written into ``out`` when it is such an array."""
    xw = np.ascontiguousarray(x, dtype=dtype)
    if out is None or out.shape != xw.shape or out.dtype != dtype or not out.flags.c_contiguous:
        out = np.empty(xw.shape, dtype=dtype)
    if xw.size == 0:
        return out, True
    ok = _features_kernel(_rows(xw), _rows(out), int(code))
    return out, bool(ok)


def vjp(x, g, code, dtype, overwrite=False):
    """``g * phi'(x)`` (shape of ``x``) in ``dtype``; written over ``g`` when ``overwrite`` and ``g`` is a
    C-contiguous ``dtype`` array (each element reads only its own ``g``)."""
    return vjp_checked(x, g, code, dtype, overwrite, check=False)[0]


def vjp_checked(x, g, code, dtype, overwrite=False, check=True):
    """``(vjp(x, g, ...), finite)``: as :func:`vjp`, and whether every element of the result is finite
    (None when not ``check``: the kernel without the flag, a little quicker)."""
    xw = np.ascontiguousarray(x, dtype=dtype)
    gw = np.ascontiguousarray(g, dtype=dtype).reshape(xw.shape)
    out = gw if overwrite and _own(g, dtype) else np.empty(xw.shape, dtype=dtype)
    if not check:
        if xw.size:
            _vjp_kernel(_rows(xw), _rows(gw), _rows(out), int(code))
        return out, None
    ok = True
    if xw.size:
        ok = bool(_vjp_checked_kernel(_rows(xw), _rows(gw), _rows(out), int(code)))
    return out, ok
