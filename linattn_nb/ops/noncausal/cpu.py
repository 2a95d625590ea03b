"""Numba CPU kernel of non-causal linear attention: aggregate, then query.

Kernel: :func:`noncausal_kernel`; launcher: :func:`noncausal_aggregate`.
Both phases work on blocks of ``config.CPU_NONCAUSAL_BLOCK`` tokens so the
inner work is GEMM-shaped (``np.dot`` -> BLAS) and the feature map is applied
per block (scratch O(block * F), no full-size copy of phi(q) or phi(k)).
Block partial sums are accumulated into the state in the state's dtype
(float64 by default).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ... import config
from .._common import phi


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def noncausal_kernel(q, k, v, S, z, out, code, eps, clip, block):
    """q, k (B, N, F); v (B, N, M); S (B, F, M), z (B, F) in/out; out (B, N, M)."""
    B, N, F = q.shape
    M = v.shape[2]
    for b in prange(B):
        Sb = S[b]
        zb = z[b]
        buf = np.empty((block, F), dtype=q.dtype)
        # aggregate: S += phi(K_c)^T V_c, z += colsum phi(K_c)
        for s0 in range(0, N, block):
            n = min(block, N - s0)
            fk = buf[:n]
            for t in range(n):
                for i in range(F):
                    x = phi(k[b, s0 + t, i], code)
                    fk[t, i] = x
                    zb[i] += x
            part = np.dot(fk.T, v[b, s0:s0 + n])
            for i in range(F):
                for m in range(M):
                    Sb[i, m] += part[i, m]
        # query: out_c = phi(Q_c) S / phi(Q_c) z
        Sc = Sb.astype(q.dtype)
        for s0 in range(0, N, block):
            n = min(block, N - s0)
            fq = buf[:n]
            for t in range(n):
                for i in range(F):
                    fq[t, i] = phi(q[b, s0 + t, i], code)
            num = np.dot(fq, Sc)
            for t in range(n):
                den = 0.0
                for i in range(F):
                    den += fq[t, i] * zb[i]
                if clip and den < eps:
                    den = eps
                for m in range(M):
                    out[b, s0 + t, m] = num[t, m] / den


def noncausal_aggregate(q, k, v, S, z, out, *, code, eps, block=None):
    """Launcher for :func:`noncausal_kernel`."""
    clip = eps is not None
    block = int(config.CPU_NONCAUSAL_BLOCK if block is None else block)
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    noncausal_kernel(q, k, v, S, z, out, np.int64(code), float(eps if clip else 0.0), clip, np.int64(block))
    return out
