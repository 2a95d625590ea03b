"""The CPU scan of the DPLR recurrence and its checkpointed backward: one float64 state per sequence.

The transition ``D + b a^T`` is never formed (``docs/dplr.md``); arrays as in :mod:`linattn_nb.ops.dplr`.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ... import config
from .._codes import NORM_FLOOR, NORM_NONE
from .._twins import pick, serial_and_parallel


def _dplr_scan(fq, ld, A, Bv, KW, VW, H, out, norm, eps):  # pragma: no cover - compiled
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
            for m in range(M + 1):
                p[m] = 0.0
            for i in range(F):  # the read-out, a row at a time (contiguous)
                fi = fq[b, t, i]
                if fi != 0.0:
                    for m in range(M + 1):
                        p[m] += fi * h[i, m]
            den = max(p[M], eps) if norm == NORM_FLOOR else p[M]
            ok = True
            for m in range(M):
                o = p[m] if norm == NORM_NONE else p[m] / den
                out[b, t, m] = o
                ok = ok and math.isfinite(o)
            if not ok:
                bad[b] = 1
        for i in range(F):
            for m in range(M + 1):
                if not math.isfinite(h[i, m]):
                    bad[b] = 1
    return bad


dplr_scan_serial, dplr_scan_parallel = serial_and_parallel(_dplr_scan, fastmath=config.FASTMATH, cache=config.CACHE)


def pick_kernel(serial, parallel, fq, A, VW, weight=1):
    """The serial or the batch-parallel twin of a DPLR kernel for features ``fq`` (B, N, F), rows ``A``
    (B, N, r, F) and values ``VW`` (B, N, ., M): the parallel one from
    :data:`linattn_nb.config.CPU_CHUNKED_SERIAL_MAX_WORK` multiply-adds (``B N r F (M + 1)``, times
    ``weight``: the scan kernels' :data:`~linattn_nb.config.DPLR_SCAN_WORK_WEIGHT` and
    :data:`~linattn_nb.config.DPLR_SCAN_BACKWARD_WORK_WEIGHT`) and two sequences on,
    where a parallel region pays for itself.  Small calls (and the tests' short sequences) then never
    compile the parallel kernels, about twice the serial one's compile time."""
    B, N, F = fq.shape
    work = B * N * max(1, A.shape[2]) * F * (VW.shape[3] + 1) * weight
    return pick(serial, parallel, items=B, work=work, limit="CPU_CHUNKED_SERIAL_MAX_WORK")


def dplr_scan(fq, ld, A, Bv, KW, VW, H, out, norm, eps):
    """:func:`_dplr_scan` (arguments and result as there) by its serial or batch-parallel kernel
    (:func:`pick_kernel`)."""
    kernel = pick_kernel(dplr_scan_serial, dplr_scan_parallel, fq, A, VW, config.DPLR_SCAN_WORK_WEIGHT)
    return kernel(fq, ld, A, Bv, KW, VW, H, out, norm, eps)


def _dplr_scan_backward(fq, ld, A, Bv, KW, VW, H0, dout, dH, norm, eps, C):  # pragma: no cover - compiled
    """Gradients of the scan in reverse time, from a state kept every ``C`` tokens (each stretch run again).

    ``dout`` (B, N, M) the outputs' adjoint, ``dH`` (B, F, M + 1) the final state's; returns
    ``(dfq, ddiag, dA, dBv, dKW, dVW, dH0)`` float64, ``ddiag`` (B, N, W) with respect to
    ``exp(ld)`` (finite at a reset).  Memory per sequence: ``N / C + C (r + 1)`` states.
    """
    B, N, F = fq.shape
    M = VW.shape[3]
    r = A.shape[2]
    W = ld.shape[2]
    w = KW.shape[2]
    M1 = M + 1
    # the results zeroed here, not in a helper: in this parallel kernel Numba zeroes them in parallel
    # (one thread zeroing 165 MB of results made the chunked backward 25% slower at B·H = 16, N = 4096)
    dfq = np.zeros((B, N, F))
    ddiag = np.zeros((B, N, ld.shape[2]))
    dA = np.zeros(A.shape)
    dBv = np.zeros(Bv.shape)
    dKW = np.zeros(KW.shape)
    dVW = np.zeros(VW.shape)
    dH0 = np.zeros((B, F, M1))
    nck = (N + C - 1) // C if N > 0 else 0
    for b in prange(B):
        ck = np.empty((nck + 1, F, M1))
        seg = np.empty((C, r + 1, F, M1))  # per token: the state before each factor, then after the token
        p = np.empty(M1)
        d = np.ones(F)
        G = dH[b].copy()
        h = H0[b].copy()
        # forward: the checkpoints
        for t in range(N):
            if t % C == 0:
                ck[t // C] = h
            for j in range(r):
                factor_step(h, A[b, t, j], Bv[b, t, j], ld[b, t], j, W, p, d, F, M1)
                if w == r or j == r - 1:
                    write_step(h, KW[b, t, j if w == r else 0], VW[b, t, j if w == r else 0], F, M)
        # reverse
        dp = np.empty(M1)
        for s in range(nck - 1, -1, -1):
            t0 = s * C
            t1 = min(N, t0 + C)
            reverse_tokens(fq, ld, A, Bv, KW, VW, dout, b, t0, t1 - t0, ck[s], h, G, seg, p, dp, d, dfq, ddiag, dA,
                           dBv, dKW, dVW, norm, eps)
        dH0[b] = G
    return dfq, ddiag, dA, dBv, dKW, dVW, dH0


dplr_scan_backward_serial, dplr_scan_backward_parallel = serial_and_parallel(
    _dplr_scan_backward, fastmath=config.FASTMATH, cache=config.CACHE)


def dplr_scan_backward(fq, ld, A, Bv, KW, VW, H0, dout, dH, norm, eps, C):
    """:func:`_dplr_scan_backward` (arguments and results as there) by its serial or batch-parallel kernel
    (:func:`pick_kernel`)."""
    kernel = pick_kernel(dplr_scan_backward_serial, dplr_scan_backward_parallel, fq, A, VW,
                         config.DPLR_SCAN_BACKWARD_WORK_WEIGHT)
    return kernel(fq, ld, A, Bv, KW, VW, H0, dout, dH, norm, eps, C)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def reverse_tokens(fq, ld, A, Bv, KW, VW, dout, b, a0, T, hstart, h, G, run, p, dp, d, dfq, ddiag, dA, dBv, dKW, dVW,
                 norm, eps):  # pragma: no cover - compiled
    """Tokens [a0, a0 + T) of sequence b in reverse, from the state ``hstart`` before them: their states
    again into ``run`` (T, r + 1, F, M + 1; ``h`` scratch), then :func:`token_backward` from the last."""
    F, M1 = h.shape
    M = M1 - 1
    r = A.shape[2]
    W = ld.shape[2]
    w = KW.shape[2]
    h[:, :] = hstart
    for t in range(a0, a0 + T):
        for j in range(r):
            run[t - a0, j] = h
            factor_step(h, A[b, t, j], Bv[b, t, j], ld[b, t], j, W, p, d, F, M1)
            if w == r or j == r - 1:
                write_step(h, KW[b, t, j if w == r else 0], VW[b, t, j if w == r else 0], F, M)
        run[t - a0, r] = h
    for t in range(a0 + T - 1, a0 - 1, -1):
        token_backward(fq, A, Bv, KW, VW, ld, dout, b, t, run[t - a0], G, p, dp, dfq, ddiag, dA, dBv, dKW, dVW, norm,
                       eps)


@njit(fastmath=config.FASTMATH, cache=config.CACHE, inline="always")
def factor_step(h, a, bv, ldt, j, W, p, d, F, M1):  # pragma: no cover - compiled
    """h <- (D + b a^T) h for the first factor of a token (D = exp(ld)), (I + b a^T) h after it."""
    for m in range(M1):
        acc = 0.0
        for i in range(F):
            acc += a[i] * h[i, m]
        p[m] = acc
    for i in range(F):
        di = math.exp(ldt[i if W > 1 else 0]) if (j == 0 and W > 0) else 1.0
        bi = bv[i]
        for m in range(M1):
            h[i, m] = di * h[i, m] + bi * p[m]


@njit(fastmath=config.FASTMATH, cache=config.CACHE, inline="always")
def write_step(h, kw, vw, F, M):  # pragma: no cover - compiled
    """h += kw [vw 1]^T."""
    for i in range(F):
        ki = kw[i]
        if ki != 0.0:
            for m in range(M):
                h[i, m] += ki * vw[m]
            h[i, M] += ki


@njit(fastmath=config.FASTMATH, cache=config.CACHE, inline="always")
def token_backward(fq, A, Bv, KW, VW, ld, dout, b, t, st, G, p, dp, dfq, ddiag, dA, dBv, dKW, dVW, norm,
                   eps):  # pragma: no cover - compiled
    """Token t of sequence b in reverse: ``st`` (r + 1, F, M + 1) the states before each of its factors
    and after it, ``G`` (F, M + 1) the adjoint of the state after it, updated in place to the adjoint of
    the state before it; its gradients are written (``ddiag`` added to) at t.  Scratch: p, dp (M + 1)."""
    F = fq.shape[2]
    M = VW.shape[3]
    M1 = M + 1
    r = A.shape[2]
    W = ld.shape[2]
    w = KW.shape[2]
    hp = st[r]
    # the read-out o_t = phi(q_t)^T H_t (/ den)
    if norm == NORM_NONE:
        for i in range(F):
            acc = 0.0
            for m in range(M):
                G[i, m] += fq[b, t, i] * dout[b, t, m]
                acc += hp[i, m] * dout[b, t, m]
            dfq[b, t, i] = acc
    else:
        den = 0.0
        for i in range(F):
            den += fq[b, t, i] * hp[i, M]
        floored = norm == NORM_FLOOR and den < eps
        dd = max(den, eps) if norm == NORM_FLOOR else den
        dden = 0.0
        for m in range(M):
            num = 0.0
            for i in range(F):
                num += fq[b, t, i] * hp[i, m]
            dden -= dout[b, t, m] * num / (dd * dd)
        if floored:
            dden = 0.0
        for i in range(F):
            acc = hp[i, M] * dden
            for m in range(M):
                g = dout[b, t, m] / dd
                G[i, m] += fq[b, t, i] * g
                acc += hp[i, m] * g
            G[i, M] += fq[b, t, i] * dden
            dfq[b, t, i] = acc
    for j in range(r - 1, -1, -1):
        hin = st[j]
        if w == r or j == r - 1:
            jj = j if w == r else 0
            for i in range(F):
                acc = G[i, M]
                for m in range(M):
                    acc += G[i, m] * VW[b, t, jj, m]
                dKW[b, t, jj, i] = acc
            for m in range(M):
                acc = 0.0
                for i in range(F):
                    acc += G[i, m] * KW[b, t, jj, i]
                dVW[b, t, jj, m] = acc
        # p = a^T hin; H1 = d * hin + b p^T
        for m in range(M1):
            acc = 0.0
            for i in range(F):
                acc += A[b, t, j, i] * hin[i, m]
            p[m] = acc
        for m in range(M1):
            dp[m] = 0.0
        for i in range(F):
            bi = Bv[b, t, j, i]
            accb = 0.0
            for m in range(M1):
                accb += G[i, m] * p[m]
                dp[m] += bi * G[i, m]
            dBv[b, t, j, i] = accb
        if j == 0 and W > 0:
            for i in range(F):
                di = math.exp(ld[b, t, i if W > 1 else 0])
                acc = 0.0
                for m in range(M1):
                    acc += G[i, m] * hin[i, m]
                    G[i, m] *= di
                ddiag[b, t, i if W > 1 else 0] += acc
        for i in range(F):
            ai = A[b, t, j, i]
            acc = 0.0
            for m in range(M1):
                acc += hin[i, m] * dp[m]
                G[i, m] += ai * dp[m]
            dA[b, t, j, i] = acc
