"""Naive NumPy reference of non-causal linear attention.

Every query attends to every key through the explicit ``N x N`` kernel matrix
``phi(Q) phi(K)^T`` (Katharopoulos et al. 2020, Eq. 7), computed in float64.
"""
from __future__ import annotations

import numpy as np

from ..causal.naive import float64_problem


def noncausal_linear_quadratic(qf, kf, v, *, eps, S0=None, z0=None, normalize=True):
    """Non-causal linear attention from explicit weights.

    Parameters and returns as :func:`linattn_nb.ops.causal.naive.causal_linear_quadratic`;
    the initial state, when given, is context seen by every query.
    """
    qf, kf, v, S, z, out = float64_problem(qf, kf, v, S0, z0)
    B, N, F = qf.shape
    for b in range(B):
        A = qf[b] @ kf[b].T
        num = A @ v[b] + qf[b] @ S[b]
        den = A.sum(axis=-1) + qf[b] @ z[b] if normalize else np.ones(N)
        if eps is not None and normalize:
            den = np.maximum(den, eps)
        with np.errstate(divide="ignore", invalid="ignore"):
            out[b] = num / den[:, None]
        S[b] += kf[b].T @ v[b]
        z[b] += kf[b].sum(axis=0)
    return out, S, z
