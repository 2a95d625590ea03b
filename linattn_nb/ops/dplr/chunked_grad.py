"""The chunkwise CPU backward of the DPLR recurrence: the chunk form of :mod:`.chunked`, in reverse.

Same arguments and results as :func:`linattn_nb.ops.dplr.cpu.dplr_scan_backward`, in float64 GEMMs per
chunk instead of a token at a time.  Design and derivation: ``docs/dplr.md``, "Gradients".
"""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from ... import config
from ..._blas import single_threaded_blas
from .._codes import NORM_FLOOR, NORM_NONE
from .._gemm import gemm
from .._twins import serial_and_parallel
from .._vec import elu1
from .chunked import LOG_CUT, chunk_extent
from .cpu import dplr_scan_backward, factor_step, pick_kernel, reverse_tokens, write_step

_CHUNK, _RUN = 0, 1  # segment kinds: a chunk of GEMMs, a run of scan tokens

#: A token with a log-diagonal below this (in any feature) runs by the scan.  In a chunk, ``d ld_t``
#: comes out of a sum of terms the size of the other gradients, so its absolute error is ``eps`` times
#: theirs; the gradient with respect to ``exp(ld_t)`` divides it by ``exp(ld_t)``, which would leave it
#: ``eps * e^-ld_t`` off relatively (1e-3 at ld = -30, measured).  Above ``-4`` that is at most
#: about ``55 eps`` (1.2e-14).
LOG_STRONG = -4.0


@njit(fastmath=config.FASTMATH, cache=config.CACHE, error_model="numpy")
def _forward(fq, A, Bv, KW, VW, b, t0, T, h, lg, gc, X, E, Zh, Zk, V, reads):  # pragma: no cover - compiled
    """One chunk's forward quantities in float64 from its start state ``h`` (F, M + 1) and cumulative
    log-diagonals ``lg`` (T + 1, F): gc (T, F) = exp(lg[1:]); X = [A^ ; Q^] (S + T rows); E = [B^ ; K^]
    (S + P rows); Zk = X E^T with what a row does not see zeroed; V = [W ; U] (W solved); Zh = [R ; O]
    with R = A^ h + Zk_AK U (the solve's right side) and O the read-outs' [numerator | normaliser].
    Without ``reads`` only the first S rows (what the end state needs)."""
    F, M1 = h.shape
    M = M1 - 1
    r = A.shape[2]
    w = KW.shape[2]
    S, P = T * r, T * w
    LZ = Zk.shape[1]
    for i in range(T):
        for f in range(F):
            gc[i, f] = elu1(lg[i + 1, f])  # exp (lg <= 0), vectorised
    for i in range(T):
        t = t0 + i
        for j in range(r):
            s = i * r + j
            for f in range(F):
                g = 1.0 if (j == 0 and i == 0) else (gc[i - 1, f] if j == 0 else gc[i, f])
                X[s, f] = A[b, t, j, f] * g
                E[s, f] = Bv[b, t, j, f] / gc[i, f]
        for jj in range(w):
            s = S + i * w + jj
            for f in range(F):
                E[s, f] = KW[b, t, jj, f] / gc[i, f]
            for m in range(M):
                V[s, m] = VW[b, t, jj, m]
            V[s, M] = 1.0
        for f in range(F):
            X[S + i, f] = fq[b, t, f] * gc[i, f]
    R = S + T if reads else S
    gemm(0, 0, R, M1, F, 1.0, X, 0, F, h, 0, M1, 0.0, Zh, 0, M1)
    gemm(0, 1, R, S + P, F, 1.0, X, 0, F, E, 0, F, 0.0, Zk, 0, LZ)
    _mask(Zk, T, r, w, reads)
    gemm(0, 0, S, M1, P, 1.0, Zk, S, LZ, V, S * M1, M1, 1.0, Zh, 0, M1)
    for s in range(S):  # W_s = R_s + sum_{s' < s} (a^_s . b^_s') W_s'
        for m in range(M1):
            V[s, m] = Zh[s, m]
        for s2 in range(s):
            c = Zk[s, s2]
            for m in range(M1):
                V[s, m] += c * V[s2, m]
    if reads:
        gemm(0, 0, T, M1, S + P, 1.0, Zk, S * LZ, LZ, V, 0, M1, 1.0, Zh, S * M1, M1)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _mask(Z, T, r, w, reads):  # pragma: no cover - compiled
    """Zero what each row of Z (S + T, S + P) does not see: a step s sees the steps before it and the
    writes made before it (after each step when w = r, after each token's last step when w = 1); a
    token's read-out sees its own steps and writes."""
    S, P = T * r, T * w
    for s in range(S):
        for s2 in range(s, S):
            Z[s, s2] = 0.0
        for q in range(s if w == r else s // r, P):
            Z[s, S + q] = 0.0
    for i in range(T if reads else 0):
        for s in range((i + 1) * r, S):
            Z[S + i, s] = 0.0
        for q in range((i + 1) * w, P):
            Z[S + i, S + q] = 0.0


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _advance_chunk(fq, A, Bv, KW, VW, b, t0, T, h, lg, gc, X, E, Zh, Zk, V, Hn):  # pragma: no cover - compiled
    """h <- the state after the chunk's T tokens."""
    F, M1 = h.shape
    r = A.shape[2]
    w = KW.shape[2]
    S, P = T * r, T * w
    _forward(fq, A, Bv, KW, VW, b, t0, T, h, lg, gc, X, E, Zh, Zk, V, False)
    gemm(1, 0, F, M1, S + P, 1.0, E, 0, F, V, 0, M1, 0.0, Hn, 0, M1)
    for f in range(F):
        g = gc[T - 1, f]
        for m in range(M1):
            h[f, m] = g * (h[f, m] + Hn[f, m])


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _advance_token(ld, A, Bv, KW, VW, b, t, h, p, d):  # pragma: no cover - compiled
    """h <- the state after token t, by the scan."""
    F, M1 = h.shape
    r = A.shape[2]
    w = KW.shape[2]
    W = ld.shape[2]
    for j in range(r):
        factor_step(h, A[b, t, j], Bv[b, t, j], ld[b, t], j, W, p, d, F, M1)
        if w == r or j == r - 1:
            write_step(h, KW[b, t, j if w == r else 0], VW[b, t, j if w == r else 0], F, M1 - 1)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _lg(ld, b, t0, T, lg):  # pragma: no cover - compiled
    """lg[1:T + 1] <- the cumulative log-diagonals of tokens [t0, t0 + T) (lg[0] = 0)."""
    W = ld.shape[2]
    for f in range(lg.shape[1]):
        lg[0, f] = 0.0
    for i in range(T):
        for f in range(lg.shape[1]):
            lg[i + 1, f] = lg[i, f] + (ld[b, t0 + i, f if W > 1 else 0] if W > 0 else 0.0)


@njit(fastmath=config.FASTMATH, cache=config.CACHE, error_model="numpy")
def _reverse_chunk(fq, ld, A, Bv, KW, VW, dout, b, t0, T, h, hend, G, lg, gc, dlg, X, E, Zh, Zk, V, Dm, DV, dZ,
                   dX, dE, dHt, dh, dfq, ddiag, dA, dBv, dKW, dVW, norm, eps):  # pragma: no cover - compiled
    """The chunk's gradients from ``G`` (F, M + 1), the adjoint of its end state ``hend``; G is replaced by
    the adjoint of its start state ``h``.  With H_end = gamma_C (h + E^T V) and the quantities of
    :func:`_forward`, in GEMMs: dV = E dH~ + Zk_Q^T dO (+ the solve's transpose for W), dZ = (D V^T)
    masked, dX = dZ E + D h^T, dE = dZ^T X + V dH~^T, dh = X^T D + dH~, with D = [dR ; dO]."""
    F, M1 = h.shape
    M = M1 - 1
    r = A.shape[2]
    w = KW.shape[2]
    W = ld.shape[2]
    S, P = T * r, T * w
    LZ = Zk.shape[1]
    _forward(fq, A, Bv, KW, VW, b, t0, T, h, lg, gc, X, E, Zh, Zk, V, True)
    for i in range(T):  # the read-outs' adjoints [d numerator | d normaliser]
        t = t0 + i
        if norm == NORM_NONE:
            for m in range(M):
                Dm[S + i, m] = dout[b, t, m]
            Dm[S + i, M] = 0.0
        else:
            den = Zh[S + i, M]
            dd = max(den, eps) if norm == NORM_FLOOR else den
            dden = 0.0
            for m in range(M):
                Dm[S + i, m] = dout[b, t, m] / dd
                dden -= dout[b, t, m] * Zh[S + i, m] / (dd * dd)
            Dm[S + i, M] = 0.0 if (norm == NORM_FLOOR and den < eps) else dden
    gT = gc[T - 1]
    for i in range(T + 1):
        for f in range(F):
            dlg[i, f] = 0.0
    for f in range(F):
        acc = 0.0
        for m in range(M1):
            dHt[f, m] = gT[f] * G[f, m]
            acc += G[f, m] * hend[f, m]
        dlg[T, f] = acc
    gemm(0, 0, S + P, M1, F, 1.0, E, 0, F, dHt, 0, M1, 0.0, DV, 0, M1)  # E dH~
    gemm(1, 0, S + P, M1, T, 1.0, Zk, S * LZ, LZ, Dm, S * M1, M1, 1.0, DV, 0, M1)  # + Zk_Q^T dO
    for s in range(S - 1, -1, -1):  # dR_s = dW_s + sum_{s' > s} (a^_s' . b^_s) dR_s'
        for m in range(M1):
            Dm[s, m] = DV[s, m]
        for s2 in range(s + 1, S):
            c = Zk[s2, s]
            for m in range(M1):
                Dm[s, m] += c * Dm[s2, m]
    gemm(1, 0, P, M1, S, 1.0, Zk, S, LZ, Dm, 0, M1, 1.0, DV, S * M1, M1)  # dU += Zk_AK^T dR
    gemm(0, 1, S + T, S + P, M1, 1.0, Dm, 0, M1, V, 0, M1, 0.0, dZ, 0, LZ)
    _mask(dZ, T, r, w, True)
    gemm(0, 0, S + T, F, S + P, 1.0, dZ, 0, LZ, E, 0, F, 0.0, dX, 0, F)
    gemm(0, 1, S + T, F, M1, 1.0, Dm, 0, M1, h, 0, M1, 1.0, dX, 0, F)
    gemm(1, 0, S + P, F, S + T, 1.0, dZ, 0, LZ, X, 0, F, 0.0, dE, 0, F)
    gemm(0, 1, S + P, F, M1, 1.0, V, 0, M1, dHt, 0, M1, 1.0, dE, 0, F)
    gemm(1, 0, F, M1, S + T, 1.0, X, 0, F, Dm, 0, M1, 0.0, dh, 0, M1)
    for f in range(F):
        for m in range(M1):
            G[f, m] = dh[f, m] + dHt[f, m]
    # back to the rows' own arguments; each gamma factor's log-derivative into dlg
    for i in range(T):
        t = t0 + i
        for j in range(r):
            s = i * r + j
            k = i if j == 0 else i + 1  # the row's factor is exp(lg[k]) (none for the very first step)
            for f in range(F):
                g = 1.0 if (j == 0 and i == 0) else (gc[i - 1, f] if j == 0 else gc[i, f])
                dA[b, t, j, f] = dX[s, f] * g
                dlg[k, f] += dX[s, f] * X[s, f]
                dBv[b, t, j, f] = dE[s, f] / gc[i, f]
                dlg[i + 1, f] -= dE[s, f] * E[s, f]
        for jj in range(w):
            s = S + i * w + jj
            for f in range(F):
                dKW[b, t, jj, f] = dE[s, f] / gc[i, f]
                dlg[i + 1, f] -= dE[s, f] * E[s, f]
            for m in range(M):
                dVW[b, t, jj, m] = DV[s, m]
        for f in range(F):
            dfq[b, t, f] = dX[S + i, f] * gc[i, f]
            dlg[i + 1, f] += dX[S + i, f] * X[S + i, f]
    if W > 0:  # d ld_t = sum over the chunk's later factors; ddiag is with respect to exp(ld_t)
        for i in range(T - 1, 0, -1):
            for f in range(F):
                dlg[i, f] += dlg[i + 1, f]
        for i in range(T):
            t = t0 + i
            if W > 1:
                for f in range(F):
                    ddiag[b, t, f] += dlg[i + 1, f] / elu1(ld[b, t, f])
            else:
                acc = 0.0
                for f in range(F):
                    acc += dlg[i + 1, f]
                ddiag[b, t, 0] += acc / elu1(ld[b, t, 0])


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _sequence(fq, ld, A, Bv, KW, VW, H0, dout, dH, norm, eps, cut, b, dfq, ddiag, dA, dBv, dKW, dVW, dH0, seg0, segT,
              kind, ck, buf, run, lg, gc, dlg, X, E, Zh, Zk, V, Dm, DV, dZ, dX, dE, dHt, dh, Hn, p, dp,
              d):  # pragma: no cover - compiled
    """Sequence b's gradients (see :func:`_dplr_chunked_backward`) with the work arrays given;
    False (its gradients not all written) where its state is not finite."""
    N, F = fq.shape[1], fq.shape[2]
    M = VW.shape[3]
    M1 = M + 1
    Ct = run.shape[0]
    K = buf.shape[0]
    ncap = ck.shape[0]
    h = H0[b].copy()
    # forward: the segments, each group's first state in ck, the last group's states in buf
    n = 0
    t0 = 0
    while t0 < N:
        T = chunk_extent(ld, b, t0, Ct, lg, cut, LOG_STRONG)[0]
        if T == 0:  # a scan token: joins the run before it while that holds fewer than Ct tokens
            if n > 0 and kind[n - 1] == _RUN and segT[n - 1] < Ct:
                segT[n - 1] += 1
            else:
                if n >= ncap * K - K:
                    break
                seg0[n], segT[n], kind[n] = t0, 1, _RUN
                if n % K == 0:
                    ck[n // K] = h
                buf[n % K] = h
                n += 1
            _advance_token(ld, A, Bv, KW, VW, b, t0, h, p, d)
            t0 += 1
            continue
        if n >= ncap * K - K:
            break
        seg0[n], segT[n], kind[n] = t0, T, _CHUNK
        if n % K == 0:
            ck[n // K] = h
        buf[n % K] = h
        n += 1
        _advance_chunk(fq, A, Bv, KW, VW, b, t0, T, h, lg, gc, X, E, Zh, Zk, V, Hn)
        t0 += T
    finite = t0 >= N
    for f in range(F):
        for m in range(M1):
            finite = finite and math.isfinite(h[f, m])
    if not finite:
        return False
    groups = (n + K - 1) // K
    ck[groups] = h
    G = dH[b].copy()
    for gi in range(groups - 1, -1, -1):
        lo = gi * K
        hi = min(n, lo + K)
        if gi < groups - 1:  # the group's states again, from its stored first one
            h[:, :] = ck[gi]
            for s in range(lo, hi):
                buf[s - lo] = h
                if kind[s] == _RUN:
                    for t in range(seg0[s], seg0[s] + segT[s]):
                        _advance_token(ld, A, Bv, KW, VW, b, t, h, p, d)
                else:
                    _lg(ld, b, seg0[s], segT[s], lg)
                    _advance_chunk(fq, A, Bv, KW, VW, b, seg0[s], segT[s], h, lg, gc, X, E, Zh, Zk, V, Hn)
        for s in range(hi - 1, lo - 1, -1):
            hend = buf[s + 1 - lo] if s + 1 < hi else ck[gi + 1]
            a0, T = seg0[s], segT[s]
            if kind[s] == _CHUNK:
                _lg(ld, b, a0, T, lg)
                _reverse_chunk(fq, ld, A, Bv, KW, VW, dout, b, a0, T, buf[s - lo], hend, G, lg, gc, dlg, X, E,
                               Zh, Zk, V, Dm, DV, dZ, dX, dE, dHt, dh, dfq, ddiag, dA, dBv, dKW, dVW, norm, eps)
            else:
                reverse_tokens(fq, ld, A, Bv, KW, VW, dout, b, a0, T, buf[s - lo], h, G, run, p, dp, d, dfq, ddiag, dA,
                             dBv, dKW, dVW, norm, eps)
    dH0[b] = G
    return True


def _dplr_chunked_backward(fq, ld, A, Bv, KW, VW, H0, dout, dH, norm, eps, C, K, cut, P):  # pragma: no cover
    """:func:`linattn_nb.ops.dplr.cpu.dplr_scan_backward` in chunks of ``C`` steps, plus a (B,) uint8
    flag: 1 where a sequence was not done (a state not finite), for the caller to run by the scan.
    Segments are chunks, ending before a feature's cumulative log-diagonal passes ``cut``, and runs of
    up to a chunk's tokens by the scan (a token whose log-diagonal is below :data:`LOG_STRONG`, a
    reset among them).  ``K`` segments share a stored state; each group is run again from it in
    reverse.  ``P`` workers, each with its own work arrays, take every P-th sequence."""
    B, N, F = fq.shape
    M = VW.shape[3]
    M1 = M + 1
    r = A.shape[2]
    w = KW.shape[2]
    Ct = max(1, C // r)
    S0, P0 = Ct * r, Ct * w
    # the results zeroed here, not in a helper: in this parallel kernel Numba zeroes them in parallel
    # (one thread zeroing 165 MB of results made the chunked backward 25% slower at B·H = 16, N = 4096)
    dfq = np.zeros((B, N, F))
    ddiag = np.zeros((B, N, ld.shape[2]))
    dA = np.zeros(A.shape)
    dBv = np.zeros(Bv.shape)
    dKW = np.zeros(KW.shape)
    dVW = np.zeros(VW.shape)
    dH0 = np.zeros((B, F, M1))
    todo = np.zeros(B, np.uint8)
    ncap = N // K + 2
    for c in prange(P):
        seg0 = np.empty(N + 1, np.int64)
        segT = np.empty(N + 1, np.int64)
        kind = np.empty(N + 1, np.uint8)
        ck = np.empty((ncap, F, M1))
        buf = np.empty((K, F, M1))
        run = np.empty((Ct, r + 1, F, M1))
        lg = np.zeros((Ct + 1, F))
        gc = np.empty((Ct, F))
        dlg = np.empty((Ct + 1, F))
        X = np.empty((S0 + Ct, F))
        E = np.empty((S0 + P0, F))
        Zh = np.empty((S0 + Ct, M1))
        Zk = np.empty((S0 + Ct, S0 + P0))
        V = np.empty((S0 + P0, M1))
        Dm = np.empty((S0 + Ct, M1))
        DV = np.empty((S0 + P0, M1))
        dZ = np.empty((S0 + Ct, S0 + P0))
        dX = np.empty((S0 + Ct, F))
        dE = np.empty((S0 + P0, F))
        dHt = np.empty((F, M1))
        dh = np.empty((F, M1))
        Hn = np.empty((F, M1))
        p = np.empty(M1)
        dp = np.empty(M1)
        d = np.ones(F)
        for b in range(c, B, P):
            if not _sequence(fq, ld, A, Bv, KW, VW, H0, dout, dH, norm, eps, cut, b, dfq, ddiag, dA, dBv, dKW, dVW,
                             dH0, seg0, segT, kind, ck, buf, run, lg, gc, dlg, X, E, Zh, Zk, V, Dm, DV, dZ, dX, dE, dHt,
                             dh, Hn, p, dp, d):
                todo[b] = 1
    return dfq, ddiag, dA, dBv, dKW, dVW, dH0, todo


dplr_chunked_backward_serial, dplr_chunked_backward_parallel = serial_and_parallel(
    _dplr_chunked_backward, fastmath=config.FASTMATH, cache=config.CACHE)


def dplr_chunked_backward(fq, ld, A, Bv, KW, VW, H0, dout, dH, norm, eps, C=None, K=None):
    """:func:`linattn_nb.ops.dplr.cpu.dplr_scan_backward`'s arguments (but ``C``: chunk steps, default
    :data:`linattn_nb.config.DPLR_BACKWARD_CHUNK`) and results, in float64 chunks.  A sequence whose
    state is not finite runs by the scan backward, so the results are always those of the recurrence.

    ``K``: segments per stored state (default: as many as :data:`linattn_nb.config.DPLR_WORK_BYTES`
    holds, at least ``sqrt(N)``, at most the segments a sequence without scan tokens has), so a
    sequence keeps ``N / K + K`` states."""
    B, N, F = fq.shape
    M1 = VW.shape[3] + 1
    C = max(1, config.knob_int("DPLR_BACKWARD_CHUNK") if C is None else int(C))
    if K is None:
        plain = 2 * (-(-N // max(1, C // A.shape[2]))) + 2
        K = min(plain, max(math.isqrt(max(N, 1)), int(config.DPLR_WORK_BYTES) // (F * M1 * 8)))
    K = max(1, min(int(K), max(N, 1)))
    kernel = pick_kernel(dplr_chunked_backward_serial, dplr_chunked_backward_parallel, fq, A, VW)
    P = max(1, min(B, numba.get_num_threads())) if kernel is dplr_chunked_backward_parallel else 1
    with single_threaded_blas():
        *res, todo = kernel(fq, ld, A, Bv, KW, VW, H0, dout, dH, np.int64(norm), float(eps), np.int64(C), np.int64(K),
                            LOG_CUT, np.int64(P))
    rows = np.flatnonzero(todo)
    if rows.size:
        Cs = config.cpu_backward_checkpoint(N, F, M1, 8)
        part = dplr_scan_backward(fq[rows], ld[rows], A[rows], Bv[rows], KW[rows], VW[rows], H0[rows], dout[rows],
                                  dH[rows], norm, eps, Cs)
        for full, sub in zip(res, part):
            full[rows] = sub
    return tuple(res)
