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
def _pass(src, w, bias, dst, back, x, dwp, dbp):  # pragma: no cover - compiled
    """dst (B, N, C) <- the convolution of src with taps w (K, C: every inner loop runs along C) plus bias,
    forward in time; ``back``: src is the output gradient and dst the input's (the taps run backward in
    time), and the per-task float64 partial sums of the weight's (tasks, K, C) and the bias's (tasks, C)
    gradients (against ``x``) go into dwp and dbp."""
    B, N, C = src.shape
    K = w.shape[0]
    wt = dst.dtype.type
    per = (N + _ROWS - 1) // _ROWS
    for task in prange(B * per):
        b = task // per
        t0 = (task - b * per) * _ROWS
        acc = np.empty(C)
        if back:
            dwp[task] = 0.0
            dbp[task] = 0.0
        for t in range(t0, min(N, t0 + _ROWS)):
            for c in range(C):
                acc[c] = bias[c]
            for j in range(K):
                # forward: y[t] reads x[t - (K - 1) + j]; backward: x[t] feeds y[t + (K - 1) - j]
                s = t + (K - 1) - j if back else t - (K - 1) + j
                if 0 <= s < N:
                    for c in range(C):
                        acc[c] += w[j, c] * src[b, s, c]
            for c in range(C):
                dst[b, t, c] = wt(acc[c])
            if back:
                dw = dwp[task]
                for c in range(C):
                    dbp[task, c] += src[b, t, c]
                for j in range(K):
                    s = t - (K - 1) + j
                    if s >= 0:
                        for c in range(C):
                            dw[j, c] += src[b, t, c] * x[b, s, c]


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
        _pass(x, np.ascontiguousarray(np.asarray(w, np.float64).T), b, y, False, x, np.empty((0, 0, 0)),
              np.empty((0, 0)))
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
        _pass(g, np.ascontiguousarray(np.asarray(w, np.float64).T), np.zeros(C), dx, True, x, dwp, dbp)
    return dx, dwp.sum(axis=0).T.copy(), dbp.sum(axis=0)
