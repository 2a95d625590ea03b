"""Naive NumPy reference of causal linear attention (ground truth for tests).

Builds the explicit lower-triangular ``N x N`` weight matrix per batch entry,
in float64, exactly as "Transformers are RNNs" (Katharopoulos et al. 2020,
Eqs. 10-12) writes it: token ``t`` attends to tokens ``0..t`` (itself
included).  The state ``(S, z)`` taken and returned here is the ``H = [S | z]``
of the kernels' contract split in two.
"""
from __future__ import annotations

import numpy as np


def causal_linear_quadratic(qf, kf, v, *, eps, S0=None, z0=None):
    """Causal linear attention from explicit weights.

    Parameters
    ----------
    qf, kf : ndarray, shape (B, N, F)
        Features phi(q), phi(k).
    v : ndarray, shape (B, N, M)
    eps : float or None
        Floor of the normaliser (``den = max(den, eps)``); None divides raw.
    S0, z0 : ndarray, shape (B, F, M) and (B, F), optional
        Initial state (context absorbed before token 0).

    Returns
    -------
    out : ndarray (B, N, M) float64
    S, z : final state, float64
    """
    qf = np.asarray(qf, dtype=np.float64)
    kf = np.asarray(kf, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    B, N, F = qf.shape
    M = v.shape[-1]
    S = np.zeros((B, F, M)) if S0 is None else np.array(S0, dtype=np.float64)
    z = np.zeros((B, F)) if z0 is None else np.array(z0, dtype=np.float64)
    out = np.empty((B, N, M))
    for b in range(B):
        A = np.tril(qf[b] @ kf[b].T)
        if np.isfinite(v[b]).all():
            num = A @ v[b]
        else:  # row by row: in A @ v a NaN/inf of a later token leaks into earlier rows as 0 * NaN
            num = np.array([A[t, : t + 1] @ v[b, : t + 1] for t in range(N)]).reshape(N, M)
        num = num + qf[b] @ S[b]
        den = A.sum(axis=-1) + qf[b] @ z[b]
        if eps is not None:
            den = np.maximum(den, eps)
        with np.errstate(divide="ignore", invalid="ignore"):
            out[b] = num / den[:, None]
        S[b] += kf[b].T @ v[b]
        z[b] += kf[b].sum(axis=0)
    return out, S, z
