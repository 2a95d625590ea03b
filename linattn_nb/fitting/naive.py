"""Reference of the fitting losses from explicit ``N x N`` matrices (float64, NumPy; small N only)."""
from __future__ import annotations

import numpy as np

from ..attention import softmax_attention


def weights_loss_naive(fq, fk, q, k, *, scale, causal, floor=0.0, kl=False):
    """Mean over rows of ``-sum_j P_ij log T_ij`` (minus the softmax entropy when ``kl``).

    ``P`` = softmax weights of ``scale * q k^T``, ``L`` = linear weights ``fq fk^T`` over their row sums,
    ``T = (1 - floor) max(L, 0) + floor / n_i``; causal rows see keys ``j <= i``.  Inputs ``(B, N, .)``.
    """
    q, k, fq, fk = (np.asarray(x, dtype=np.float64) for x in (q, k, fq, fk))
    b, n, _ = q.shape
    s = scale * np.einsum("bid,bjd->bij", q, k)
    a = np.einsum("bif,bjf->bij", fq, fk)
    mask = np.tril(np.ones((n, n), dtype=bool)) if causal else np.ones((n, n), dtype=bool)
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    a = np.where(mask, a, 0.0)
    den = a.sum(axis=-1, keepdims=True)
    count = mask.sum(axis=-1)[None, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (1.0 - floor) * np.maximum(a / den, 0.0) + floor / count
        terms = np.where(p > 0, -p * np.log(np.where(p > 0, t, 1.0)), 0.0)
        rows = terms.sum(axis=-1)
        dead = np.log(count[..., 0] / floor) if floor > 0 else np.inf
        rows = np.where(den[..., 0] > 0, rows, dead)
        if kl:
            rows = rows + np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(axis=-1)
    return float(rows.mean()) if rows.size else float("nan")


def output_loss_naive(lin_out, q, k, v, *, scale, causal):
    """Mean squared difference between ``lin_out`` and softmax attention's output (explicit weights)."""
    target = softmax_attention(q, k, v, causal=causal, scale=scale, method="quadratic")
    return float(np.mean((np.asarray(lin_out, dtype=np.float64) - target) ** 2))
