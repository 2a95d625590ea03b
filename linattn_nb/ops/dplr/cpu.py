"""The CPU scan of the DPLR recurrence: one float64 state per sequence, sequences in parallel.

Per token and sub-step the state moves through ``D + b a^T`` without forming the (F, F) matrix:
``p = a^T H`` (one pass over H), then ``H_i <- d_i H_i + b_i p`` row by row, then the write.  Cost
``O(r F (M + 1))`` a token, like the delta rule's.  Arrays as in :mod:`linattn_nb.ops.dplr`.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ... import config
from .._codes import NORM_FLOOR, NORM_NONE


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def dplr_scan(fq, ld, A, Bv, KW, VW, H, out, norm, eps):  # pragma: no cover - compiled
    """Run every sequence from its state ``H[b]`` (float64, updated in place to the final state),
    writing ``out`` (B, N, M) in its own dtype.  Returns a (B,) uint8 flag: 1 where the sequence's
    outputs or state hold NaN or inf."""
    B, N, F = fq.shape
    M = VW.shape[3]
    r = A.shape[2]
    W = ld.shape[2]
    w = KW.shape[2]
    bad = np.zeros(B, np.uint8)
    for b in prange(B):
        h = H[b]
        p = np.empty(M + 1)
        d = np.ones(F)
        for t in range(N):
            for j in range(r):
                for m in range(M + 1):
                    p[m] = 0.0
                for i in range(F):
                    ai = A[b, t, j, i]
                    if ai != 0.0:
                        for m in range(M + 1):
                            p[m] += ai * h[i, m]
                if j == 0 and W > 0:
                    for i in range(F):
                        d[i] = math.exp(ld[b, t, i if W > 1 else 0])
                else:
                    for i in range(F):
                        d[i] = 1.0
                for i in range(F):
                    di = d[i]
                    bi = Bv[b, t, j, i]
                    if di != 1.0:
                        for m in range(M + 1):
                            h[i, m] = di * h[i, m] + bi * p[m]
                    elif bi != 0.0:
                        for m in range(M + 1):
                            h[i, m] += bi * p[m]
                if w == r or j == r - 1:
                    jj = j if w == r else 0
                    for i in range(F):
                        ki = KW[b, t, jj, i]
                        if ki != 0.0:
                            for m in range(M):
                                h[i, m] += ki * VW[b, t, jj, m]
                            h[i, M] += ki
            den = 0.0
            for i in range(F):
                den += fq[b, t, i] * h[i, M]
            if norm == NORM_FLOOR:
                den = max(den, eps)
            for m in range(M):
                acc = 0.0
                for i in range(F):
                    acc += fq[b, t, i] * h[i, m]
                o = acc if norm == NORM_NONE else acc / den
                out[b, t, m] = o
                if not math.isfinite(out[b, t, m]):
                    bad[b] = 1
        for i in range(F):
            for m in range(M + 1):
                if not math.isfinite(h[i, m]):
                    bad[b] = 1
    return bad
