"""The chunkwise-parallel CPU form of the DPLR recurrence (``method="chunked"``): GEMMs per chunk.

The WY/UT form generalised to a diagonal and a low-rank part per step; chunks end
before the cumulative diagonal leaves float64's range.  Design: ``docs/dplr.md``, "Kernels".
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ... import config
from ..._blas import single_threaded_blas
from .._codes import NORM_FLOOR, NORM_NONE
from .cpu import factor_step, write_step

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


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _chunk(fq, dg, A, Bv, KW, VW, out, b, t0, T, h, gc, gv, X, E, Ee, Zh, Zk, AKm, QEm, V, R, Ot, Hn, norm,
           eps):  # pragma: no cover - compiled
    """Tokens [t0, t0 + T) of sequence b from the state h (F, M + 1), updated in place; ``dg`` the
    diagonal (``exp(ld)``).  Scratch, for S = T r steps and P = T w writes: gc (T, F) gamma, gv (2, F);
    X (S + T, F) = [A^ ; Q^], E (S + P, F) = [B^ ; K^], Ee (S + P, F) the end state's rows,
    Zh (S + T, M + 1) = X h, Zk (S + T, S + P) = X E^T, AKm (S, P) and QEm (T, S + P) the masked
    products, V (S + P, M + 1) = [W ; U], R (S, M + 1), Ot (T, M + 1), Hn (F, M + 1).  Returns False
    when an output is not finite."""
    F = h.shape[0]
    M1 = h.shape[1]
    M = M1 - 1
    r = A.shape[2]
    W = dg.shape[2]
    w = KW.shape[2]
    S = T * r
    P = T * w
    # gamma: the running product of the diagonals (>= exp(LOG_CUT) within a chunk: no underflow)
    if W > 1:
        for f in range(F):
            gc[0, f] = dg[b, t0, f]
        for i in range(1, T):
            for f in range(F):
                gc[i, f] = gc[i - 1, f] * dg[b, t0 + i, f]
    elif W == 1:
        g = 1.0
        for i in range(T):
            g *= dg[b, t0 + i, 0]
            for f in range(F):
                gc[i, f] = g
    else:
        gc[:T] = 1.0
    inv = gv[0]
    ratio = gv[1]
    for i in range(T):
        t = t0 + i
        for f in range(F):
            inv[f] = 1.0 / gc[i, f]
            ratio[f] = gc[T - 1, f] * inv[f]  # gamma_C / gamma_s <= 1: both factors in range
        for j in range(r):
            s = i * r + j
            if j == 0 and i == 0:
                for f in range(F):
                    X[s, f] = A[b, t, j, f]
            elif j == 0:
                for f in range(F):
                    X[s, f] = A[b, t, j, f] * gc[i - 1, f]
            else:
                for f in range(F):
                    X[s, f] = A[b, t, j, f] * gc[i, f]
            for f in range(F):
                E[s, f] = Bv[b, t, j, f] * inv[f]
                Ee[s, f] = Bv[b, t, j, f] * ratio[f]
        for jj in range(w):
            s = S + i * w + jj
            for f in range(F):
                E[s, f] = KW[b, t, jj, f] * inv[f]
                Ee[s, f] = KW[b, t, jj, f] * ratio[f]
            for m in range(M):
                V[s, m] = VW[b, t, jj, m]
            V[s, M] = 1.0
        for f in range(F):
            X[S + i, f] = fq[b, t, f] * gc[i, f]
    np.dot(X, h, Zh)  # [A^ h ; Q^ h]
    np.dot(X, E.T, Zk)  # [A^ B^T, A^ K^T ; Q^ B^T, Q^ K^T]
    for s in range(S):
        # the writes step s reads: after each step (w = r) the first s, after each token's last
        # step (w = 1) one per token whose last step is before s
        nq = s if w == r else s // r
        for q in range(nq):
            AKm[s, q] = Zk[s, S + q]
        for q in range(nq, P):
            AKm[s, q] = 0.0
    np.dot(AKm, V[S:], R)
    # forward substitution: W_s = A^_s h + (A^ K^T U)_s + sum_{s' < s} (a^_s . b^_s') W_s'
    for s in range(S):
        for m in range(M1):
            V[s, m] = Zh[s, m] + R[s, m]
        for s2 in range(s):
            c = Zk[s, s2]
            if c != 0.0:
                for m in range(M1):
                    V[s, m] += c * V[s2, m]
    # the read-outs: a token's own steps and writes included
    for i in range(T):
        for s in range((i + 1) * r):
            QEm[i, s] = Zk[S + i, s]
        for s in range((i + 1) * r, S):
            QEm[i, s] = 0.0
        for q in range((i + 1) * w):
            QEm[i, S + q] = Zk[S + i, S + q]
        for q in range((i + 1) * w, P):
            QEm[i, S + q] = 0.0
    np.dot(QEm, V, Ot)
    ok = True
    for i in range(T):
        p = Ot[i]
        for m in range(M1):
            p[m] += Zh[S + i, m]
        if not _emit(p, out, b, t0 + i, M, norm, eps):
            ok = False
    np.dot(Ee.T, V, Hn)
    for f in range(F):
        ge = gc[T - 1, f]
        for m in range(M1):
            h[f, m] = ge * h[f, m] + Hn[f, m]
    return ok


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def dplr_chunked_kernel(fq, ld, dg, A, Bv, KW, VW, H, out, norm, eps, C):  # pragma: no cover - compiled
    """As :func:`linattn_nb.ops.dplr.cpu.dplr_scan`, in chunks of ``C`` steps (``max(1, C // r)`` tokens);
    ``dg = exp(ld)`` (computed once, vectorised, outside)."""
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
        gv = np.empty((2, F))
        S, P = Ct * r, Ct * w
        X = np.empty((S + Ct, F))
        E = np.empty((S + P, F))
        Ee = np.empty((S + P, F))
        Zh = np.empty((S + Ct, M1))
        Zk = np.empty((S + Ct, S + P))
        AKm = np.empty((S, P))
        QEm = np.empty((Ct, S + P))
        V = np.empty((S + P, M1))
        R = np.empty((S, M1))
        Ot = np.empty((Ct, M1))
        Hn = np.empty((F, M1))
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
                    factor_step(h, A[b, t, j], Bv[b, t, j], ld[b, t], j, W, p, d, F, M1)
                    if w == r or j == r - 1:
                        write_step(h, KW[b, t, j if w == r else 0], VW[b, t, j if w == r else 0], F, M)
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
            if T == Ct:
                ok = _chunk(fq, dg, A, Bv, KW, VW, out, b, t0, T, h, gc, gv, X, E, Ee, Zh, Zk, AKm, QEm, V, R, Ot,
                            Hn, norm, eps)
            else:
                s1, p1 = T * r, T * w  # a shorter chunk: scratch of its size (np.dot wants whole arrays)
                ok = _chunk(fq, dg, A, Bv, KW, VW, out, b, t0, T, h, gc, gv, np.empty((s1 + T, F)),
                            np.empty((s1 + p1, F)), np.empty((s1 + p1, F)), np.empty((s1 + T, M1)),
                            np.empty((s1 + T, s1 + p1)), np.empty((s1, p1)), np.empty((T, s1 + p1)),
                            np.empty((s1 + p1, M1)), np.empty((s1, M1)), np.empty((T, M1)), np.empty((F, M1)), norm, eps)
            if not ok:
                bad[b] = 1
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
        return dplr_chunked_kernel(fq, ld, np.exp(ld), A, Bv, KW, VW, H, out, np.int64(norm), float(eps), np.int64(C))
