"""Backward of non-causal linear attention on the CPU (the ``aggregate`` method).

``R = sum_t phi(q_t) g_t^T (+ dH_N)``, ``dq_t = H g_t``, ``dk_s = R v1_s``,
``dv1_s = R^T phi(k_s)``, ``dH0 = R``: the sums over tokens are GEMMs accumulated
in float64 (no O(N) drift in float32), the broadcasts GEMMs in the working dtype.
"""
from __future__ import annotations

import numpy as np

from . import Grads


def _sum_outer(a, b):
    """``sum_t a_t b_t^T`` per batch entry, (B, N, X) x (B, N, Y) -> (B, X, Y) float64."""
    return np.matmul(np.swapaxes(a, 1, 2).astype(np.float64), b.astype(np.float64))


def noncausal_backward(qf, kf, v1, H0, g1, dHN=None, *, inputs=None):
    """Gradients of non-causal linear attention (the backward launcher contract of :mod:`linattn_nb.ops.grad`)."""
    if inputs:
        raise ValueError("non-causal attention has the additive rule only: inputs must be None")
    work = qf.dtype
    H = np.asarray(H0, np.float64) + _sum_outer(kf, v1)
    R = _sum_outer(qf, g1)
    if dHN is not None:
        R += np.asarray(dHN, np.float64)
    Hw, Rw = H.astype(work), R.astype(work)
    dq = np.matmul(g1, np.swapaxes(Hw, 1, 2))
    dk = np.matmul(v1, np.swapaxes(Rw, 1, 2))
    dv = np.matmul(kf, Rw)
    return Grads(dq, dk, dv, R)
