"""Compiled rows of the Taylor-2 map and its VJP (:class:`linattn_nb.feature_maps.Taylor2FeatureMap`).

The NumPy forms in ``_polynomial.py`` are the reference: these give the same features bit for bit
(the same float64 products, rounded once to the output dtype) and the same VJP up to the order of
its sums, in one parallel pass over rows instead of NumPy's gathers of ``d(d+1)/2`` columns (which
were most of a Taylor-2 layer's training step: docs/theory.md, the Taylor features).
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
