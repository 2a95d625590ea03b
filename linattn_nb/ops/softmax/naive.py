"""Naive NumPy softmax attention (ground truth): explicit ``N x N`` scores."""
from __future__ import annotations

import numpy as np


def softmax_attention_quadratic(q, k, v, *, causal, scale):
    """``softmax(scale * q k^T [+ causal mask]) v`` in float64, per batch entry.

    q, k: (B, N, D); v: (B, N, M).  Returns (B, N, M) float64.  ``scale * q`` is formed first (as in the
    blocked kernel), so scores that are finite in float64 are finite here although ``q . k`` may not be;
    scores that overflow give NaN or inf silently (the caller checks the result).
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    B, N, _ = q.shape
    out = np.empty((B, N, v.shape[-1]))
    for b in range(B):
        with np.errstate(over="ignore", invalid="ignore"):
            s = (scale * q[b]) @ k[b].T  # q scaled first (as the blocked kernel): q . k alone may overflow
            if causal:
                s = np.where(np.tril(np.ones((N, N), dtype=bool)), s, -np.inf)
            s = s - s.max(axis=-1, keepdims=True)
            w = np.exp(s)
            w /= w.sum(axis=-1, keepdims=True)
            out[b] = w @ v[b]
    return out
