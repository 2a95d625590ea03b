"""The row maps of DeltaNet (``l2``, ``silu_l2``) for the gradient front end: features and their VJP.

One parallel pass per row in the working dtype, with the norm taken in float64 as in
:class:`linattn_nb.feature_maps.L2FeatureMap`, replaces NumPy's float64 passes over the whole
array (the row maps' features and VJP were most of a delta-rule VJP's time).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ... import config
from .._codes import KERNEL_CODE_L2, KERNEL_CODE_SILU_L2

#: Map codes whose features and VJP are computed here.
ROW_CODES = (KERNEL_CODE_L2, KERNEL_CODE_SILU_L2)


#: Rows per task of the parallel loops (each task holds one row's map values in a buffer).
_ROWS = 64


@njit(fastmath=False, cache=config.CACHE, inline="always")
def _pre(y, silu):
    """``(s, ds/dy)`` in float64 for the map before the normalisation: ``s = y`` or SiLU(y), one exp.

    SiLU: ``s = y sigmoid(y)`` (-0 for very negative y), ``s' = sigmoid(y) (1 + y sigmoid(-y))`` with both
    sigmoids from ``exp(-|y|)``, so neither loses digits at large ``|y|``; the limits 1 and 0 at +-inf.
    """
    if not silu:
        return y, 1.0
    if math.isinf(y):
        return (y, 1.0) if y > 0 else (-0.0, 0.0)
    e = math.exp(-abs(y))
    if y >= 0:
        sig, sig_neg = 1.0 / (1.0 + e), e / (1.0 + e)
    else:
        sig, sig_neg = e / (1.0 + e), 1.0 / (1.0 + e)
    return y * sig, sig * (1.0 + y * sig_neg)


@njit(parallel=True, fastmath=False, cache=config.CACHE)
def _features_kernel(x, out, silu):
    R, D = x.shape
    tasks = (R + _ROWS - 1) // _ROWS
    ok = np.ones(tasks, dtype=np.bool_)
    for t in prange(tasks):
        s = np.empty(D)
        good = True
        for r in range(t * _ROWS, min(R, (t + 1) * _ROWS)):
            ss = 0.0
            for i in range(D):
                y = np.float64(x[r, i])
                good &= (y - y) == 0  # finite: inf - inf and NaN - NaN are NaN
                s[i] = _pre(y, silu)[0]
                ss += s[i] * s[i]
            nrm = math.sqrt(ss)
            for i in range(D):
                out[r, i] = s[i] / nrm if nrm > 0 else 0.0
        ok[t] = good
    return ok.all()


@njit(parallel=True, fastmath=False, cache=config.CACHE)
def _vjp_kernel(x, g, out, silu):
    R, D = x.shape
    tasks = (R + _ROWS - 1) // _ROWS
    for t in prange(tasks):
        s = np.empty(D)
        ds = np.empty(D)
        for r in range(t * _ROWS, min(R, (t + 1) * _ROWS)):
            ss = 0.0
            for i in range(D):
                s[i], ds[i] = _pre(np.float64(x[r, i]), silu)
                ss += s[i] * s[i]
            nrm = math.sqrt(ss)
            if not nrm > 0:
                for i in range(D):
                    out[r, i] = 0.0  # a zero row: zero features, zero gradient
                continue
            fg = 0.0
            for i in range(D):
                fg += s[i] / nrm * np.float64(g[r, i])
            for i in range(D):
                out[r, i] = (np.float64(g[r, i]) - s[i] / nrm * fg) / nrm * ds[i]


def _own(g, dtype):
    """Whether ``g`` can take the results: a writeable C-contiguous ``dtype`` array (its reshape a view)."""
    return isinstance(g, np.ndarray) and g.dtype == dtype and g.flags.c_contiguous and g.flags.writeable


def _rows(x):
    return x.reshape((-1, x.shape[-1])) if x.size else x.reshape((0, x.shape[-1]))


def features(x, code, dtype):
    """``(phi(x), finite)``: the ``l2``/``silu_l2`` features of ``x`` (..., N, D) as a C-contiguous ``dtype``
    array (``x`` first cast to ``dtype``), and whether every element of ``x`` is finite."""
    xw = np.ascontiguousarray(x, dtype=dtype)
    out = np.empty(xw.shape, dtype=dtype)
    if xw.size == 0:
        return out, True
    ok = _features_kernel(_rows(xw), _rows(out), code == KERNEL_CODE_SILU_L2)
    return out, bool(ok)


def vjp(x, g, code, dtype, overwrite=False):
    """The gradient with respect to ``x`` (shape of ``x``, in ``dtype``) of the features' gradient ``g``:
    ``(g - f (f . g)) / |s| * s'(x)`` per row, ``s`` the map before the norm and ``f = s / |s|``; written
    over ``g`` when ``overwrite`` and ``g`` is a C-contiguous ``dtype`` array (a row reads all of its ``g``
    before it writes)."""
    xw = np.ascontiguousarray(x, dtype=dtype)
    gw = np.ascontiguousarray(g).reshape(xw.shape)  # in its own dtype: a float64 gradient stays float64
    out = gw if overwrite and _own(g, dtype) else np.empty(xw.shape, dtype=dtype)
    if xw.size:
        _vjp_kernel(_rows(xw), _rows(gw), _rows(out), code == KERNEL_CODE_SILU_L2)
    return out
