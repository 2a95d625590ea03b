"""The elementwise feature maps of the CPU kernels, defined once.

:func:`phi` is the map every CPU kernel applies to raw ``q`` and ``k`` (``code`` > 0), built from
the vectorisable forms of :mod:`linattn_nb.ops._vec`; the row maps (``l2``, ``silu_l2``) are
computed a row at a time by :func:`l2_row`.
"""
from __future__ import annotations

import math

from numba import njit

from .. import config
import numpy as np

from ._codes import (KERNEL_CODE_ELU, KERNEL_CODE_L2, KERNEL_CODE_RELU, KERNEL_CODE_SILU_L2, KERNEL_CODE_SQUARED_RELU,
                     SS_TINY)
from ._vec import elu1, is_finite, relu, relu2, silu, to_work


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def phi(x, code):
    """Feature map ``code`` (:mod:`linattn_nb.ops._codes`) on one element, in ``x``'s own dtype.

    ELU+1, ReLU, squared ReLU, else the identity; NaN propagates.  The branch on
    ``code`` is loop-invariant in the callers' loops, so each map's loop still vectorises.
    """
    if code == KERNEL_CODE_ELU:
        return elu1(x)
    if code == KERNEL_CODE_RELU:
        return relu(x)
    if code == KERNEL_CODE_SQUARED_RELU:
        return relu2(x)
    return x


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def is_row_map(code):
    """Whether feature map ``code`` works on whole rows (the L2 maps), not element by element."""
    return code == KERNEL_CODE_L2 or code == KERNEL_CODE_SILU_L2


@njit(cache=config.CACHE)
def rescale_needed(ss):
    """Whether a row's float64 sum of squares ``ss`` overflowed or may have lost squares to underflow
    (below :data:`~linattn_nb.ops._codes.SS_TINY`; False for NaN, which propagates)."""
    return ss < SS_TINY or ss > 1.7976931348623157e308


@njit(cache=config.CACHE)
def scale_exponent(mx):
    """``e`` with ``mx`` (a row's largest magnitude) in ``[2^(e-1), 2^e)``, so that ``ldexp(y, -e)`` is exact
    for every element ``y`` and the row's largest is in [0.5, 1); 0 where ``mx`` is 0, inf or NaN."""
    if mx > 0.0 and mx <= 1.7976931348623157e308:
        return math.frexp(mx)[1]
    return 0


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def l2_row(src, b, t, dst, code):
    """dst (F,) float64 <- ``y / ||y||`` with ``y = src[b, t]`` (code L2) or its SiLU (code SILU_L2).

    The SiLU in the working dtype of ``src`` (again in float64 when every value is
    below 1e-30 in magnitude); no epsilon: the row is scaled by its largest magnitude
    before the squares are summed in float64 (a row of subnormals by a power of two
    first), so overflowing and underflowing rows still normalise; a zero row gives
    zeros, NaN propagates.  Returns whether every element read is finite.
    """
    F = dst.shape[0]
    ok = True
    if code == KERNEL_CODE_SILU_L2:
        # SiLU in the working dtype (float32 for float16/float32: its exp
        # vectorises on AVX2, float64's does not), into float64
        for i in range(F):
            x = to_work(src[b, t, i])
            ok &= is_finite(x)
            dst[i] = silu(x)
    else:
        for i in range(F):  # separate simple loops: each one vectorises
            x = to_work(src[b, t, i])
            ok &= is_finite(x)
            dst[i] = x
    mx = 0.0
    for i in range(F):
        mx = max(mx, abs(dst[i]))  # NaN is skipped here and caught by the sum below
    if code == KERNEL_CODE_SILU_L2 and mx < 1e-30:
        # every SiLU value tiny (a row of x below -80, or of zeros): the float32
        # exp flushes below -87.3, so the row is taken again in float64
        for i in range(F):
            dst[i] = silu(np.float64(to_work(src[b, t, i])))
        mx = 0.0
        for i in range(F):
            mx = max(mx, abs(dst[i]))
    if 0.0 < mx < SS_TINY:
        # a row of subnormals (float64): 1 / mx would overflow, so the row is scaled by a power of two first
        e = scale_exponent(mx)
        for i in range(F):
            dst[i] = math.ldexp(dst[i], -e)
        mx = math.ldexp(mx, -e)
    inv = 1.0 / mx if mx > 0.0 else 0.0
    s = 0.0
    for i in range(F):
        y = dst[i] * inv
        s += y * y
    r = 0.0 if s == 0.0 else 1.0 / np.sqrt(s)  # s >= 1 unless the row is zero; NaN stays NaN
    for i in range(F):
        dst[i] = (dst[i] * inv) * r
    return ok
