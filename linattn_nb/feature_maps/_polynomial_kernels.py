"""Compiled rows of the polynomial maps, Taylor-2 and DPFP, and their VJPs (``_polynomial.py``).

The NumPy forms there are the reference: these give the same features bit for bit (the same
products, rounded once to the output dtype), DPFP's VJP bit for bit too and Taylor-2's up to the
order of its sums, in one parallel pass over rows instead of NumPy's gathers of ``d(d+1)/2`` columns
or rolls of the row (which were over a third of a DPFP layer's and half of a Taylor-2 layer's
training step: docs/theory.md, the Taylor features).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .. import config

#: Rows per task (each task holds one row's scaled inputs in a buffer).
_ROWS = 32
_HALF = 1.0 / math.sqrt(2.0)


@njit(parallel=True, cache=config.CACHE)
def taylor2_rows(x, root, out):  # pragma: no cover - compiled
    """out (R, 1 + d + d(d+1)/2) <- [1, x', x'_a x'_b (a <= b, row-major; 1/sqrt(2) on a = b)] with
    x' = x root in float64, rounded to out's dtype."""
    R, d = x.shape
    wt = out.dtype.type
    for t in prange((R + _ROWS - 1) // _ROWS):
        xs = np.empty(d)
        for r in range(t * _ROWS, min(R, (t + 1) * _ROWS)):
            out[r, 0] = wt(1.0)
            for k in range(d):
                y = np.float64(x[r, k]) * root
                xs[k] = y
                out[r, 1 + k] = wt(y)
            p = 1 + d
            for a in range(d):
                ya = xs[a]
                out[r, p] = wt(ya * ya * _HALF)
                for b in range(a + 1, d):
                    out[r, p + b - a] = wt(ya * xs[b] * 1.0)
                p += d - a


@njit(parallel=True, cache=config.CACHE)
def taylor2_vjp_rows(x, g, root, out):  # pragma: no cover - compiled
    """out (R, d) <- the gradient with respect to x of the features' gradient g (R, 1 + d + d(d+1)/2),
    in float64 (g read in its own dtype), rounded to out's dtype."""
    R, d = x.shape
    wt = out.dtype.type
    for t in prange((R + _ROWS - 1) // _ROWS):
        buf = np.empty((2, d))
        xs = buf[0]
        dx = buf[1]
        for r in range(t * _ROWS, min(R, (t + 1) * _ROWS)):
            for k in range(d):
                xs[k] = np.float64(x[r, k]) * root
                dx[k] = np.float64(g[r, 1 + k])
            p = 1 + d
            for a in range(d):
                ya = xs[a]
                ga = np.float64(g[r, p]) * _HALF  # x'_a^2 / sqrt(2)
                acc = ga * ya
                dx[a] += ga * ya
                for b in range(a + 1, d):
                    gab = np.float64(g[r, p + b - a])
                    acc += gab * xs[b]
                    dx[b] += gab * ya
                dx[a] += acc
                p += d - a
            for k in range(d):
                out[r, k] = wt(dx[k] * root)


@njit(parallel=True, cache=config.CACHE)
def dpfp_rows(x, nu, out):  # pragma: no cover - compiled
    """out (R, 2 d nu) <- DPFP(nu) of x (R, d): r = relu([x, -x]), block j - 1 holds r_i r_{(i + j) mod 2d},
    in x's dtype (as the NumPy form), stored in out's."""
    R, d = x.shape
    d2 = 2 * d
    wt = out.dtype.type
    zero = x.dtype.type(0.0)
    for t in prange((R + _ROWS - 1) // _ROWS):
        r = np.empty(d2, x.dtype)
        for row in range(t * _ROWS, min(R, (t + 1) * _ROWS)):
            for k in range(d):  # relu as np.maximum: NaN stays NaN
                y = x[row, k]
                r[k] = y if not y < zero else zero
                r[d + k] = -y if not -y < zero else zero
            for j in range(1, nu + 1):
                base = (j - 1) * d2
                for i in range(d2):
                    i2 = i + j if i + j < d2 else i + j - d2
                    out[row, base + i] = wt(r[i] * r[i2])


@njit(parallel=True, cache=config.CACHE)
def dpfp_vjp_rows(x, g, nu, out):  # pragma: no cover - compiled
    """out (R, d) <- the gradient with respect to x of the features' gradient g (R, 2 d nu), in float64
    in the NumPy form's order of operations, rounded to out's dtype."""
    R, d = x.shape
    d2 = 2 * d
    wt = out.dtype.type
    for t in prange((R + _ROWS - 1) // _ROWS):
        buf = np.empty((2, d2))
        r = buf[0]
        dr = buf[1]
        for row in range(t * _ROWS, min(R, (t + 1) * _ROWS)):
            for k in range(d):
                y = np.float64(x[row, k])
                r[k] = y if not y < 0.0 else 0.0
                r[d + k] = -y if not -y < 0.0 else 0.0
            for i in range(d2):
                dr[i] = 0.0
            for j in range(1, nu + 1):
                base = (j - 1) * d2
                for i in range(d2):
                    ip = i + j if i + j < d2 else i + j - d2  # roll(r, -j)[i]
                    im = i - j if i >= j else i - j + d2  # roll(g r, j)[i]
                    dr[i] += np.float64(g[row, base + i]) * r[ip] + np.float64(g[row, base + im]) * r[im]
            for k in range(d):
                y = np.float64(x[row, k])
                hp = 1.0 if y > 0.0 else 0.0  # heaviside(s, 0) of s = y and of s = -y
                hm = 1.0 if -y > 0.0 else 0.0
                out[row, k] = wt(dr[k] * hp - dr[d + k] * hm)
