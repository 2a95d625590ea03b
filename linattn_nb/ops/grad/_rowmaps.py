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
from .._common import rescale_needed, scale_exponent
from .._vec import elu1, is_finite

#: Map codes whose features and VJP are computed here.
ROW_CODES = (KERNEL_CODE_L2, KERNEL_CODE_SILU_L2)


#: Rows per task of the parallel loops (each task holds one row's map values in a buffer).
_ROWS = 64

#: The kernels' flags: the row sums may be reassociated (so that they vectorise) and products fused into
#: additions; no ``arcp`` (every ``s / |s|`` stays a division) and no ``nnan``/``ninf`` (non-finite inputs
#: keep their results and the finite check is not folded away).
_FLAGS = {"reassoc", "contract", "nsz"}

#: A SiLU row with an ``|y|`` above this takes the scalar path (:func:`_silu_scalar`): the branch-free exp
#: flushes ``exp(-|y|)`` to 0 below -708.3 (where the scalar one is subnormal), and at +-inf its
#: formulas give NaN where the limits are wanted.
_BIG = 700.0


@njit(fastmath=False, cache=config.CACHE)
def _silu_scalar(y):
    """``(s, ds/dy)`` in float64 for SiLU, one exp: ``s = y sigmoid(y)`` (-0 for very negative y),
    ``s' = sigmoid(y) (1 + y sigmoid(-y))`` with both sigmoids from ``exp(-|y|)``, so neither loses digits
    at large ``|y|``; the limits 1 and 0 at +-inf."""
    if math.isinf(y):
        return (y, 1.0) if y > 0 else (-0.0, 0.0)
    e = math.exp(-abs(y))
    if y >= 0:
        sig, sig_neg = 1.0 / (1.0 + e), e / (1.0 + e)
    else:
        sig, sig_neg = e / (1.0 + e), 1.0 / (1.0 + e)
    return y * sig, sig * (1.0 + y * sig_neg)


@njit(fastmath={"contract"}, cache=config.CACHE, error_model="numpy")
def _silu_fast(y):
    """:func:`_silu_scalar` without branches (selects, the vectorisable exp, one division), for
    ``|y| <= _BIG``; NaN propagates.  ``error_model="numpy"``: no zero check on the divisor."""
    e = elu1(-abs(y))  # exp(-|y|) in (0, 1]
    inv = 1.0 / (1.0 + e)
    ep = e * inv
    pos = y >= 0.0
    sig = inv if pos else ep
    sig_neg = ep if pos else inv
    return y * sig, sig * (1.0 + y * sig_neg)


@njit(cache=config.CACHE)
def _row_exponent(s):
    """:func:`~linattn_nb.ops._common.scale_exponent` of the row ``s``'s largest magnitude."""
    mx = 0.0
    for i in range(s.shape[0]):
        a = abs(s[i])
        if a > mx:  # NaN skipped
            mx = a
    return scale_exponent(mx)


@njit(cache=config.CACHE)
def _rescale(s, ss):
    """Scale the row ``s`` in place by the power of two of :func:`_row_exponent` (exact); return its new
    sum of squares and the exponent ``e`` (``(ss, 0)`` back, unscaled, for a zero or non-finite row).

    For a row whose float64 sum of squares overflowed or lost squares to underflow (``rescale_needed``):
    ``s / |s|`` is the same for the scaled row ``s'``, and the VJP's ``1 / |s|`` is ``ldexp(1 / |s'|, -e)``.
    """
    e = _row_exponent(s)
    if e == 0:
        return ss, 0
    ss = 0.0
    for i in range(s.shape[0]):
        y = math.ldexp(s[i], -e)
        s[i] = y
        ss += y * y
    return ss, e


@njit(parallel=True, fastmath=_FLAGS, cache=config.CACHE, error_model="numpy")
def _features_kernel(x, out, silu):
    R, D = x.shape
    tasks = (R + _ROWS - 1) // _ROWS
    ok = np.ones(tasks, dtype=np.bool_)
    for t in prange(tasks):
        s = np.empty(D)
        good = True
        for r in range(t * _ROWS, min(R, (t + 1) * _ROWS)):
            ss = 0.0
            if silu:
                big = False
                for i in range(D):
                    y = np.float64(x[r, i])
                    good &= is_finite(y)
                    big |= abs(y) > _BIG
                    v = _silu_fast(y)[0]
                    s[i] = v
                    ss += v * v
                if big:
                    ss = 0.0
                    for i in range(D):
                        v = _silu_scalar(np.float64(x[r, i]))[0]
                        s[i] = v
                        ss += v * v
            else:
                for i in range(D):
                    y = np.float64(x[r, i])
                    good &= is_finite(y)
                    s[i] = y
                    ss += y * y
            if rescale_needed(ss):
                ss = _rescale(s, ss)[0]
            nrm = math.sqrt(ss)
            if nrm > 0:
                for i in range(D):
                    out[r, i] = s[i] / nrm
            else:
                for i in range(D):
                    out[r, i] = 0.0
        ok[t] = good
    return ok.all()


@njit(parallel=True, fastmath=_FLAGS, cache=config.CACHE, error_model="numpy")
def _vjp_kernel(x, g, out, silu):
    R, D = x.shape
    tasks = (R + _ROWS - 1) // _ROWS
    ok = np.ones(tasks, dtype=np.bool_)
    for t in prange(tasks):
        # one allocation for both rows: their distance, which the vectorised loops check at run time, is
        # then always D (two allocations a few bytes apart took the scalar path on some calls and not on
        # others, and float64 sums came out different in the last bit from call to call)
        buf = np.empty((2, D))
        f = buf[0]
        ds = buf[1]
        good = True
        for r in range(t * _ROWS, min(R, (t + 1) * _ROWS)):
            ss = 0.0
            if silu:
                big = False
                for i in range(D):
                    y = np.float64(x[r, i])
                    big |= abs(y) > _BIG
                    v, d = _silu_fast(y)
                    f[i] = v
                    ds[i] = d
                    ss += v * v
                if big:
                    ss = 0.0
                    for i in range(D):
                        v, d = _silu_scalar(np.float64(x[r, i]))
                        f[i] = v
                        ds[i] = d
                        ss += v * v
            else:
                for i in range(D):
                    y = np.float64(x[r, i])
                    f[i] = y
                    ss += y * y
            e = 0
            if rescale_needed(ss):
                ss, e = _rescale(f, ss)
            nrm = math.sqrt(ss)
            if not nrm > 0:
                for i in range(D):
                    out[r, i] = 0.0  # a zero row: zero features, zero gradient
                good &= nrm == 0  # a NaN norm (a NaN input) gives zeros that are not the gradient
                continue
            fg = 0.0
            for i in range(D):
                v = f[i] / nrm  # the features
                f[i] = v
                fg += v * np.float64(g[r, i])
            # into f first: written straight over g beside the finite flag, the loop lost its vector form
            if silu:
                for i in range(D):
                    f[i] = (np.float64(g[r, i]) - f[i] * fg) / nrm * ds[i]
            else:
                for i in range(D):
                    f[i] = (np.float64(g[r, i]) - f[i] * fg) / nrm
            if e != 0:
                for i in range(D):
                    f[i] = math.ldexp(f[i], -e)  # 1 / |s| of the unscaled row
            for i in range(D):
                y = out.dtype.type(f[i])
                out[r, i] = y
                good &= is_finite(y)  # as stored: float64 results may overflow float32 only there
        ok[t] = good
    return ok.all()


def _own(g, dtype):
    """Whether ``g`` can take the results: a writeable C-contiguous ``dtype`` array (its reshape a view)."""
    return isinstance(g, np.ndarray) and g.dtype == dtype and g.flags.c_contiguous and g.flags.writeable


def _rows(x):
    return x.reshape((-1, x.shape[-1])) if x.size else x.reshape((0, x.shape[-1]))


def features(x, code, dtype, out=None):
    """``(phi(x), finite)``: the ``l2``/``silu_l2`` features of ``x`` (..., N, D) as a C-contiguous ``dtype``
    array (``x`` first cast to ``dtype``), and whether every element of ``x`` is finite; written into ``out``
    when it is such an array."""
    xw = np.ascontiguousarray(x, dtype=dtype)
    if out is None or out.shape != xw.shape or out.dtype != dtype or not out.flags.c_contiguous:
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
    return vjp_checked(x, g, code, dtype, overwrite)[0]


def vjp_checked(x, g, code, dtype, overwrite=False, check=True):
    """``(vjp(x, g, ...), finite)``: as :func:`vjp`, and whether every element of the result is finite
    (False too for a row whose norm is NaN, whose zeros stand in for a gradient that is not defined);
    ``check`` is accepted for the elementwise maps' signature (the flag costs nothing here)."""
    xw = np.ascontiguousarray(x, dtype=dtype)
    gw = np.ascontiguousarray(g).reshape(xw.shape)  # in its own dtype: a float64 gradient stays float64
    out = gw if overwrite and _own(g, dtype) else np.empty(xw.shape, dtype=dtype)
    ok = True
    if xw.size:
        ok = bool(_vjp_kernel(_rows(xw), _rows(gw), _rows(out), code == KERNEL_CODE_SILU_L2))
    return out, ok
