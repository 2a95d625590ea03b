"""The short causal depthwise convolution of the torch layer (``LinearAttention(conv_size=K)``) on the CPU.

``y[b, t, c] = bias[c] + sum_j w[c, j] x[b, t - (K - 1) + j, c]`` (terms before the first token
are 0): ``torch.nn.Conv1d(C, C, K, groups=C, padding=K - 1)`` with its first N outputs, written for
the layer's (B, N, C) layout, so neither pass transposes, and with a backward that is one pass of
vector FMAs (torch's depthwise convolution backward was about a sixth of a training step).
Float32 or float64; the weight and bias gradients are summed in float64.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import config
from .._blas import parallel_entry

#: Tokens per parallel task.
_ROWS = 64


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def _forward(x, w, bias, y):  # pragma: no cover - compiled
    B, N, C = x.shape
    K = w.shape[0]
    wt = y.dtype.type
    per = (N + _ROWS - 1) // _ROWS
    for task in prange(B * per):
        b = task // per
        t0 = (task - b * per) * _ROWS
        acc = np.empty(C)
        for t in range(t0, min(N, t0 + _ROWS)):
            for c in range(C):
                acc[c] = bias[c]
            for j in range(K):
                s = t - (K - 1) + j
                if s >= 0:
                    for c in range(C):
                        acc[c] += w[j, c] * x[b, s, c]
            for c in range(C):
                y[b, t, c] = wt(acc[c])


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def _backward(x, w, g, dx, dwp, dbp):  # pragma: no cover - compiled
    """dx (B, N, C); the per-task partial sums of the weight's (tasks, K, C) and the bias's (tasks, C)
    gradients, float64.  ``w`` is (K, C) here (as in :func:`_forward`): every inner loop runs along C."""
    B, N, C = x.shape
    K = w.shape[0]
    wt = dx.dtype.type
    per = (N + _ROWS - 1) // _ROWS
    for task in prange(B * per):
        b = task // per
        t0 = (task - b * per) * _ROWS
        acc = np.empty(C)
        dw = dwp[task]
        db = dbp[task]
        dw[:, :] = 0.0
        db[:] = 0.0
        for t in range(t0, min(N, t0 + _ROWS)):
            for c in range(C):
                acc[c] = 0.0
                db[c] += g[b, t, c]
            # y[t'] reads x[t] through tap j = t - t' + K - 1: t' = t + K - 1 - j
            for j in range(K):
                s = t + (K - 1) - j
                if s < N:
                    for c in range(C):
                        acc[c] += w[j, c] * g[b, s, c]
                s = t - (K - 1) + j  # the weight: y[t] against x[s]
                if s >= 0:
                    for c in range(C):
                        dw[j, c] += g[b, t, c] * x[b, s, c]
            for c in range(C):
                dx[b, t, c] = wt(acc[c])


def _check(x, w):
    if x.ndim != 3 or w.ndim != 2 or w.shape[0] != x.shape[2]:
        raise ValueError(f"x must be (B, N, C) and w (C, K) with x's C, got {x.shape} and {w.shape}")
    if x.dtype not in (np.float32, np.float64):
        raise TypeError(f"x must be float32 or float64, got {x.dtype}")


@parallel_entry
def short_conv(x, w, bias=None):
    """``y`` (B, N, C), x's dtype: the causal depthwise convolution of ``x`` (B, N, C) with taps ``w`` (C, K)
    (``w[:, K - 1]`` on the current token) and ``bias`` (C,) or None."""
    _check(x, w)
    x = np.ascontiguousarray(x)
    y = np.empty_like(x)
    b = np.zeros(x.shape[2]) if bias is None else np.asarray(bias, np.float64)
    if y.size:
        _forward(x, np.ascontiguousarray(np.asarray(w, np.float64).T), b, y)
    return y


@parallel_entry
def short_conv_vjp(x, w, g):
    """``(dx, dw, db)``: the gradients of :func:`short_conv` for the output gradient ``g`` (B, N, C); dx in
    x's dtype, dw (C, K) and db (C,) float64."""
    _check(x, w)
    x, g = np.ascontiguousarray(x), np.ascontiguousarray(g, dtype=x.dtype)
    if g.shape != x.shape:
        raise ValueError(f"g must have x's shape {x.shape}, got {g.shape}")
    B, N, C = x.shape
    K = w.shape[1]
    tasks = B * ((N + _ROWS - 1) // _ROWS)
    dx = np.empty_like(x)
    dwp, dbp = np.empty((tasks, K, C)), np.empty((tasks, C))
    if x.size:
        _backward(x, np.ascontiguousarray(np.asarray(w, np.float64).T), g, dx, dwp, dbp)
    return dx, dwp.sum(axis=0).T.copy(), dbp.sum(axis=0)
