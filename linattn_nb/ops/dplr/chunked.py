"""The chunkwise-parallel CPU form of the DPLR recurrence (``method="chunked"``): GEMMs per chunk.

Each token's ``r`` sub-steps are flattened into a sequence of steps (the diagonal ``D`` at a token's
first step only, the read-out at its last).  Within a chunk of steps starting from the state
``H0``, with ``gamma_t = prod_{s <= t} d_s`` (per feature, cumulative within the chunk), the state
is ``H_t = gamma_t * (H0 + sum_{s <= t} b_s / gamma_s w_s^T + kw_s / gamma_s [vw_s 1]^T)`` where
``w_t = a_t^T H_{t-1}`` (the WY/UT form of the delta rule's chunked algorithm, Yang et al. 2024,
generalised to a diagonal and a low-rank part per step).  With ``a^_t = a_t gamma_{t-1}``,
``b^_t = b_t / gamma_t``, ``k^_t = kw_t / gamma_t``, ``q^_t = phi(q_t) gamma_t`` and
``U = [VW 1]``:

* ``W = (I - tril(A^ B^T, -1))^{-1} (A^ H0 + tril(A^ K^T, -1) U)`` (one unit lower-triangular
  solve, forward substitution);
* ``O = Q^ H0 + tril(Q^ B^T) W + tril(Q^ K^T) U`` (the diagonal included);
* ``H_C = gamma_C H0 + (gamma_C / gamma_s b_s)^T W + (gamma_C / gamma_s kw_s)^T U`` (every ratio <= 1).

The divisions by ``gamma`` stay in range: a chunk ends before a token whose cumulative log-diagonal
(any feature) would fall below :data:`LOG_CUT` within it, and a token whose own log-diagonal does
(a reset, ``-inf``, included) is applied by the scan, from the state, on its own: ``D + b a^T`` with
``D = 0`` still reads the state through ``a``.  No difference of cumulative logs spans a reset.
Chunks hold whole tokens (``max(1, C // r)`` of them, ``C`` steps); the state is float64.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ... import config
from ..._blas import single_threaded_blas
from .._codes import NORM_FLOOR, NORM_NONE
from .cpu import _factor, _write

#: The lowest cumulative log-diagonal (per feature) a chunk spans: ``exp(600)`` ~ 1e260 keeps
#: ``b / gamma`` in float64's range.  A token whose own log-diagonal is below it runs by the scan.
LOG_CUT = -600.0


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _emit(p, out, b, t, M, norm, eps):  # pragma: no cover - compiled
    """Write the read-out ``p`` (M + 1) of token t; False when an output is not finite."""
    den = max(p[M], eps) if norm == NORM_FLOOR else p[M]
    ok = True
    for m in range(M):
        o = p[m] if norm == NORM_NONE else p[m] / den
        out[b, t, m] = o
        ok = ok and math.isfinite(o)
    return ok


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def dplr_chunked_kernel(fq, ld, A, Bv, KW, VW, H, out, norm, eps, C):  # pragma: no cover - compiled
    """As :func:`linattn_nb.ops.dplr.cpu.dplr_scan`, in chunks of ``C`` steps (``max(1, C // r)`` tokens)."""
    B, N, F = fq.shape
    M = VW.shape[3]
    M1 = M + 1
    r = A.shape[2]
    W = ld.shape[2]
    w = KW.shape[2]
    Ct = max(1, C // r)
    bad = np.zeros(B, np.uint8)
    for b in prange(B):
        h = H[b]
        p = np.empty(M1)
        d = np.ones(F)
        lg = np.zeros((Ct + 1, F))
        gc = np.empty((Ct, F))
        t0 = 0
        while t0 < N:
            # the chunk's tokens [t0, t0 + T): stop before a token that takes a feature below LOG_CUT
            T = 0
            while T < Ct and t0 + T < N:
                if W > 0:
                    low = False
                    for f in range(F):
                        x = lg[T, f] + ld[b, t0 + T, f if W > 1 else 0]
                        lg[T + 1, f] = x
                        if not x >= LOG_CUT:
                            low = True
                    if low:
                        break
                T += 1
            if T == 0:
                # a reset (or a decay below LOG_CUT in one token): the scan, one token
                t = t0
                for j in range(r):
                    _factor(h, A[b, t, j], Bv[b, t, j], ld[b, t], j, W, p, d, F, M1)
                    if w == r or j == r - 1:
                        _write(h, KW[b, t, j if w == r else 0], VW[b, t, j if w == r else 0], F, M)
                for m in range(M1):
                    p[m] = 0.0
                for i in range(F):
                    fi = fq[b, t, i]
                    if fi != 0.0:
                        for m in range(M1):
                            p[m] += fi * h[i, m]
                if not _emit(p, out, b, t, M, norm, eps):
                    bad[b] = 1
                t0 += 1
                continue
            S = T * r
            P = T * w
            SP = S + P
            Ah = np.empty((S, F))
            E = np.empty((SP, F))  # [B^ ; K^]
            Ee = np.empty((SP, F))  # [gamma_C / gamma_s b_s ; gamma_C / gamma_s kw_s]
            Qh = np.empty((T, F))
            V = np.empty((SP, M1))  # [W ; U]
            for i in range(T):
                t = t0 + i
                for f in range(F):
                    gc[i, f] = math.exp(lg[i + 1, f]) if W > 0 else 1.0
                for f in range(F):
                    gp = 1.0 if i == 0 else gc[i - 1, f]
                    g = gc[i, f]
                    inv = 1.0 / g
                    ratio = math.exp(lg[T, f] - lg[i + 1, f]) if W > 0 else 1.0
                    for j in range(r):
                        s = i * r + j
                        Ah[s, f] = A[b, t, j, f] * (gp if j == 0 else g)
                        bv = Bv[b, t, j, f]
                        E[s, f] = bv * inv
                        Ee[s, f] = bv * ratio
                    for jj in range(w):
                        s = S + i * w + jj
                        kv = KW[b, t, jj, f]
                        E[s, f] = kv * inv
                        Ee[s, f] = kv * ratio
                    Qh[i, f] = fq[b, t, f] * g
                for jj in range(w):
                    s = S + i * w + jj
                    for m in range(M):
                        V[s, m] = VW[b, t, jj, m]
                    V[s, M] = 1.0
            AB = np.dot(Ah, E[:S].T)  # (S, S)
            AK = np.dot(Ah, E[S:].T)  # (S, P)
            # the writes a step reads: those of earlier steps
            for s in range(S):
                for q in range(P):
                    ws = (q // w) * r + (q % w if w == r else r - 1)
                    if ws >= s:
                        AK[s, q] = 0.0
            R = np.dot(Ah, h) + np.dot(AK, V[S:])
            # forward substitution: W_s = R_s + sum_{s' < s} (a^_s . b^_s') W_s'
            for s in range(S):
                for m in range(M1):
                    V[s, m] = R[s, m]
                for s2 in range(s):
                    c = AB[s, s2]
                    if c != 0.0:
                        for m in range(M1):
                            V[s, m] += c * V[s2, m]
            QE = np.dot(Qh, E.T)  # (T, S + P)
            for i in range(T):
                for s in range((i + 1) * r, S):
                    QE[i, s] = 0.0
                for q in range((i + 1) * w, P):
                    QE[i, S + q] = 0.0
            O = np.dot(Qh, h) + np.dot(QE, V)
            for i in range(T):
                if not _emit(O[i], out, b, t0 + i, M, norm, eps):
                    bad[b] = 1
            Hn = np.dot(Ee.T, V)
            for f in range(F):
                ge = gc[T - 1, f]
                for m in range(M1):
                    h[f, m] = ge * h[f, m] + Hn[f, m]
            t0 += T
        for i in range(F):
            for m in range(M1):
                if not math.isfinite(h[i, m]):
                    bad[b] = 1
    return bad


def dplr_chunked(fq, ld, A, Bv, KW, VW, H, out, norm, eps):
    """:func:`linattn_nb.ops.dplr.cpu.dplr_scan`'s arguments and result (a (B,) uint8 flag: 1 where a
    sequence's outputs or state hold NaN or inf), in chunks of :data:`linattn_nb.config.DPLR_CHUNK`
    steps; ``H`` (float64) is updated in place to the final states."""
    C = max(1, int(config.DPLR_CHUNK))
    with single_threaded_blas():  # np.dot inside prange: OpenBLAS off its own threads
        return dplr_chunked_kernel(fq, ld, A, Bv, KW, VW, H, out, np.int64(norm), float(eps), np.int64(C))
