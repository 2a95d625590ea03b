"""The chunkwise-parallel CPU form of the DPLR recurrence (``method="chunked"``): GEMMs per chunk.

The WY/UT form generalised to a diagonal and a low-rank part per step, in the working dtype of
``fq`` (float32 or float64) with the float64 state carried between chunks; chunks end before the
cumulative diagonal leaves that dtype's range.  Design: ``docs/dplr.md``, "Kernels".
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ... import config
from ..._blas import single_threaded_blas
from .._codes import KERNEL_CODE_L2, NORM_FLOOR, NORM_NONE
from .._common import l2_row, phi
from .._gemm import gemm
from .._twins import serial_and_parallel
from .._vec import elu1
from .cpu import factor_step, pick_kernel, write_step

#: The lowest cumulative log-diagonal (per feature) a chunk spans, by working dtype: ``1 / gamma``
#: (``e^600``, ``e^40``) stays far inside float64's (float32's) range.  A token whose own
#: log-diagonal is below it runs by the scan.
LOG_CUT = -600.0
LOG_CUT32 = -40.0


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def elementwise_features(x, out, code):  # pragma: no cover - compiled
    """out (R, D) <- the elementwise feature map ``code`` of x (R, D), in out's dtype."""
    wt = out.dtype.type
    for i in prange(x.shape[0]):
        for j in range(x.shape[1]):
            out[i, j] = phi(wt(x[i, j]), code)


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def row_features(x, out, code):  # pragma: no cover - compiled
    """out (R, D) <- the row map ``code`` (``l2``, ``silu_l2``; the kernels' form) of x (R, 1, D), in out's dtype."""
    R, D = out.shape
    wt = out.dtype.type
    for c in prange((R + 63) // 64):
        row = np.empty(D)
        for i in range(c * 64, min(R, c * 64 + 64)):
            s = 0.0
            if code == KERNEL_CODE_L2:  # the plain float64 sum of squares: one pass, no rescaling
                for j in range(D):
                    y = np.float64(x[i, 0, j])
                    s += y * y
            if 1e-290 < s < math.inf:  # in range (always for float32 rows that are finite and not zero)
                r = 1.0 / math.sqrt(s)
                for j in range(D):
                    out[i, j] = wt(x[i, 0, j] * r)
            else:  # silu_l2, or a zero, non-finite or extreme row: the scaled form
                l2_row(x, i, 0, row, code)
                for j in range(D):
                    out[i, j] = row[j]


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _emit(p, out, b, t, M, norm, eps):  # pragma: no cover - compiled
    """Write the read-out ``p`` (M + 1) of token t; False when an output is not finite."""
    den = max(p[M], eps) if norm == NORM_FLOOR else p[M]
    r = 1.0 / den if norm != NORM_NONE else 1.0
    z = 0.0
    for m in range(M):
        out[b, t, m] = p[m] * r
        z += out[b, t, m] * 0.0  # NaN for a NaN or inf as stored (past float32's range too)
    return z == 0.0 and math.isfinite(r)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _update(h, hn, hw, Hn, ge):  # pragma: no cover - compiled
    """hn <- ge h + Hn (float64) and hw <- hn in the working dtype, in one pass; False when Hn is not
    finite (h untouched: the caller keeps h as the state)."""
    F, M1 = h.shape
    wt = hw.dtype.type
    z = 0.0
    for f in range(F):
        g = ge[f]
        for m in range(M1):
            x = Hn[f, m]
            z += x * 0.0  # NaN for a NaN or inf
            y = g * h[f, m] + x
            hn[f, m] = y
            hw[f, m] = wt(y)
    return z == 0.0


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _begin(T, lg, gc, h, hw, fresh):  # pragma: no cover - compiled
    """A chunk's start: gc[:T] = gamma, the exp of the cumulative logs lg[1:T + 1] (>= exp(cut): no
    underflow), and hw = h in the working dtype unless ``fresh`` (the last chunk's update wrote it)."""
    wt = hw.dtype.type
    for i in range(T):
        for f in range(gc.shape[1]):
            gc[i, f] = elu1(lg[i + 1, f])
    if not fresh:
        hf, hwf = h.reshape(-1), hw.reshape(-1)
        for j in range(hf.shape[0]):
            hwf[j] = wt(hf[j])


@njit(fastmath=config.FASTMATH, cache=config.CACHE, error_model="numpy")
def _chunk(fq, A, Bv, KW, VW, out, b, t0, T, h, hn, fresh, lg, gc, gv, hw, X, E, Ee, Zh, Zk, V, Hn, norm,
           eps):  # pragma: no cover - compiled
    """Tokens [t0, t0 + T) of sequence b from the float64 state h (F, M + 1), the new state written to
    hn (and to hw in the working dtype; ``fresh``: hw holds h already); ``lg`` (T + 1, F) their
    cumulative log-diagonals.  Scratch: gc (T, F) and gv (2, F) float64; in the
    working dtype, row blocks as needed (S = T r steps, P = T w writes): hw (F, M + 1) = h,
    X (S + T, F) = [A^ ; Q^], E (S + P, F) = [B^ ; K^], Ee (S + P, F) the end state's rows,
    Zh (S + T, M + 1) = X h, Zk (S + T, LZ) = X E^T, V (S + P, M + 1) = [W ; U], Hn (F, M + 1).
    Returns False (h the state, not hn and hw) when an output, the state's update or a row of a, b is
    not finite."""
    F, M1 = h.shape
    M = M1 - 1
    r = A.shape[2]
    w = KW.shape[2]
    S, P = T * r, T * w
    LZ = Zk.shape[1]
    wt = X.dtype.type
    zero = wt(0.0)
    _begin(T, lg, gc, h, hw, fresh)
    inv, ratio = gv[0], gv[1]
    za = 0.0
    for i in range(T):
        t = t0 + i
        for f in range(F):
            inv[f] = 1.0 / gc[i, f]
            ratio[f] = gc[T - 1, f] * inv[f]  # gamma_C / gamma_s <= 1: both factors in range
        for j in range(r):
            s = i * r + j
            if j == 0 and i == 0:
                for f in range(F):
                    X[s, f] = wt(A[b, t, j, f])
            elif j == 0:
                for f in range(F):
                    X[s, f] = wt(A[b, t, j, f] * gc[i - 1, f])
            else:
                for f in range(F):
                    X[s, f] = wt(A[b, t, j, f] * gc[i, f])
            for f in range(F):
                bf = Bv[b, t, j, f]
                E[s, f] = wt(bf * inv[f])
                Ee[s, f] = wt(bf * ratio[f])
                za += A[b, t, j, f] * 0.0 + bf * 0.0  # NaN for a NaN or inf in a, b
        for jj in range(w):
            s = S + i * w + jj
            for f in range(F):
                kf = KW[b, t, jj, f]
                E[s, f] = wt(kf * inv[f])
                Ee[s, f] = wt(kf * ratio[f])
            for m in range(M):
                V[s, m] = wt(VW[b, t, jj, m])
            V[s, M] = wt(1.0)
        for f in range(F):
            X[S + i, f] = wt(fq[b, t, f] * gc[i, f])
    gemm(0, 0, S + T, M1, F, 1.0, X, 0, F, hw, 0, M1, 0.0, Zh, 0, M1)  # [A^ h ; Q^ h]
    gemm(0, 1, S + T, S + P, F, 1.0, X, 0, F, E, 0, F, 0.0, Zk, 0, LZ)  # [A^ B^T, A^ K^T ; Q^ B^T, Q^ K^T]
    for s in range(S):
        # the writes step s reads: after each step (w = r) the first s, after each token's last
        # step (w = 1) one per token whose last step is before s
        for q in range(s if w == r else s // r, P):
            Zk[s, S + q] = zero
    for i in range(T):  # the read-outs: a token's own steps and writes included
        for s in range((i + 1) * r, S):
            Zk[S + i, s] = zero
        for q in range((i + 1) * w, P):
            Zk[S + i, S + q] = zero
    gemm(0, 0, S, M1, P, 1.0, Zk, S, LZ, V, S * M1, M1, 1.0, Zh, 0, M1)  # + tril(A^ K^T) U
    # forward substitution: W_s = (A^ h + A^ K^T U)_s + sum_{s' < s} (a^_s . b^_s') W_s'
    for s in range(S):
        for m in range(M1):
            V[s, m] = Zh[s, m]
        for s2 in range(s):
            c = Zk[s, s2]
            for m in range(M1):
                V[s, m] += c * V[s2, m]
    gemm(0, 0, T, M1, S + P, 1.0, Zk, S * LZ, LZ, V, 0, M1, 1.0, Zh, S * M1, M1)
    ok = True
    for i in range(T):
        if not _emit(Zh[S + i], out, b, t0 + i, M, norm, eps):
            ok = False
    gemm(1, 0, F, M1, S + P, 1.0, Ee, 0, F, V, 0, M1, 0.0, Hn, 0, M1)
    return _update(h, hn, hw, Hn, gc[T - 1]) and ok and za == 0.0


@njit(fastmath=config.FASTMATH, cache=config.CACHE, error_model="numpy")
def _chunk_keyed(fq, K, cb, cw, VW, out, b, t0, T, h, hn, fresh, lg, gc, gv, hw, X, E, Ee, Zh, Zk, V, Hn,
                 norm, eps):  # pragma: no cover - compiled
    """:func:`_chunk` for the keyed form (``a = D k``, ``b = cb k``, ``kw = cw k``, a write per step):
    the rows of B^ and K^ are one block K0 = k / gamma scaled by cb and cw, so one Gram block G = X K0^T
    serves both, and the solve carries Y_s = cb_s W_s + cw_s U_s, what the read-outs and the state
    update take: O = Q^ h + tril(G_q) Y, H_C = gamma_C h + (gamma_C / gamma_s k_s)^T Y, with
    W_s = (A^ h)_s + sum_{s' < s} G_ss' Y_s'.  Scratch as :func:`_chunk` (E = K0, Ee its end-state rows,
    V = Y, their first S rows)."""
    F, M1 = h.shape
    M = M1 - 1
    r = K.shape[2]
    S = T * r
    LZ = Zk.shape[1]
    wt = X.dtype.type
    zero = wt(0.0)
    _begin(T, lg, gc, h, hw, fresh)
    inv, ratio = gv[0], gv[1]
    za = 0.0
    for i in range(T):
        t = t0 + i
        for f in range(F):
            inv[f] = 1.0 / gc[i, f]
            ratio[f] = gc[T - 1, f] * inv[f]
        for j in range(r):
            s = i * r + j
            za += cb[b, t, j] * 0.0 + cw[b, t, j] * 0.0
            for f in range(F):
                kf = K[b, t, j, f]
                X[s, f] = wt(kf * gc[i, f])  # a^_s = D_t^[j = 0] k_s gamma_{s-1} = k_s gamma_t
                E[s, f] = wt(kf * inv[f])
                Ee[s, f] = wt(kf * ratio[f])
                za += kf * 0.0
        for f in range(F):
            X[S + i, f] = wt(fq[b, t, f] * gc[i, f])
    gemm(0, 0, S + T, M1, F, 1.0, X, 0, F, hw, 0, M1, 0.0, Zh, 0, M1)  # [A^ h ; Q^ h]
    gemm(0, 1, S + T, S, F, 1.0, X, 0, F, E, 0, F, 0.0, Zk, 0, LZ)  # G = [A^ ; Q^] K0^T
    for s in range(S):  # W_s, then Y_s in its place
        i = s // r
        j = s - i * r
        for m in range(M1):
            V[s, m] = Zh[s, m]
        for s2 in range(s):
            c = Zk[s, s2]
            for m in range(M1):
                V[s, m] += c * V[s2, m]
        sb, sw = wt(cb[b, t0 + i, j]), wt(cw[b, t0 + i, j])
        for m in range(M):
            V[s, m] = sb * V[s, m] + sw * wt(VW[b, t0 + i, j, m])
        V[s, M] = sb * V[s, M] + sw
    for i in range(T):  # a read-out sees its token's own steps
        for s in range((i + 1) * r, S):
            Zk[S + i, s] = zero
    gemm(0, 0, T, M1, S, 1.0, Zk, S * LZ, LZ, V, 0, M1, 1.0, Zh, S * M1, M1)
    ok = True
    for i in range(T):
        if not _emit(Zh[S + i], out, b, t0 + i, M, norm, eps):
            ok = False
    gemm(1, 0, F, M1, S, 1.0, Ee, 0, F, V, 0, M1, 0.0, Hn, 0, M1)
    return _update(h, hn, hw, Hn, gc[T - 1]) and ok and za == 0.0


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def chunk_extent(ld, b, t0, Ct, lg, cut, strong):  # pragma: no cover - compiled
    """``(T, up)``: the next chunk of sequence b takes tokens [t0, t0 + T), T <= Ct, stopping before a
    token that takes a feature's cumulative log-diagonal below ``cut`` or has one below ``strong``;
    ``lg[1:]`` holds the cumulative log-diagonals of the tokens read (the first one not taken
    included), ``up`` counts their log-diagonals > 0 (an error of the caller's; NaN fails the results)."""
    N, W = ld.shape[1], ld.shape[2]
    T = 0
    up = 0
    while T < Ct and t0 + T < N:
        if W > 0:
            low = 0.0
            weak = True
            for f in range(lg.shape[1]):
                y = ld[b, t0 + T, f if W > 1 else 0]
                x = lg[T, f] + y
                lg[T + 1, f] = x
                low = min(low, x)
                up += 1 if y > 0.0 else 0
                weak = weak and not y < strong
            if not (weak and low >= cut):
                break
        T += 1
    return T, up


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _scan_token(fq, ld, A, Bv, KW, VW, cb, cw, out, b, t, h, p, d, rows, norm, eps):  # pragma: no cover - compiled
    """Token t of sequence b by the scan on the float64 state h; False when an output is not finite.
    The keyed form's rows are made in ``rows`` (3, F)."""
    F, M1 = h.shape
    M = M1 - 1
    r = A.shape[2]
    w = KW.shape[2]
    W = ld.shape[2]
    for j in range(r):
        if cb.shape[0] > 0:  # keyed: a = D_t^[j = 0] k, b = cb k, kw = cw k
            for f in range(F):
                kf = float(A[b, t, j, f])
                rows[0, f] = kf * math.exp(ld[b, t, f if W > 1 else 0]) if (j == 0 and W > 0) else kf
                rows[1, f] = cb[b, t, j] * kf
                rows[2, f] = cw[b, t, j] * kf
            factor_step(h, rows[0], rows[1], ld[b, t], j, W, p, d, F, M1)
            write_step(h, rows[2], VW[b, t, j], F, M)
            continue
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
    return _emit(p, out, b, t, M, norm, eps)


def _dplr_chunked(fq, ld, A, Bv, KW, VW, cb, cw, H, out, norm, eps, C, cut):  # pragma: no cover - compiled
    """As :func:`linattn_nb.ops.dplr.cpu.dplr_scan`, in chunks of ``C`` steps (``max(1, C // r)``
    tokens) in ``fq``'s dtype, each ending before a feature's cumulative log-diagonal passes ``cut``."""
    B, N, F = fq.shape
    M = VW.shape[3]
    M1 = M + 1
    r = A.shape[2]
    w = KW.shape[2]
    Ct = max(1, C // r)
    S0, P0 = Ct * r, Ct * w
    dt = fq.dtype
    bad = np.zeros(B, np.uint8)
    for b in prange(B):
        h = H[b]
        h2 = np.empty((F, M1))  # a chunk's new state; h and h2 swap on success
        swaps = 0
        fresh = False  # hw holds h in the working dtype
        p = np.empty(M1)
        d = np.ones(F)
        rows = np.empty((3, F))
        lg = np.zeros((Ct + 1, F))
        gc = np.empty((Ct, F))
        gv = np.empty((2, F))
        hw = np.empty((F, M1), dt)
        X = np.empty((S0 + Ct, F), dt)
        E = np.empty((S0 + P0, F), dt)
        Ee = np.empty((S0 + P0, F), dt)
        Zh = np.empty((S0 + Ct, M1), dt)
        Zk = np.empty((S0 + Ct, S0 + P0), dt)
        V = np.empty((S0 + P0, M1), dt)
        Hn = np.empty((F, M1), dt)
        t0 = 0
        while t0 < N:
            # the chunk's tokens [t0, t0 + T): stop before a token that takes a feature below cut
            T, up = chunk_extent(ld, b, t0, Ct, lg, cut, -math.inf)
            if up > 0:
                bad[b] |= 2
            if T == 0:  # a reset (or a decay below cut in one token): the scan, one token
                if not _scan_token(fq, ld, A, Bv, KW, VW, cb, cw, out, b, t0, h, p, d, rows, norm, eps):
                    bad[b] = 1
                fresh = False
                t0 += 1
                continue
            if cb.shape[0] > 0:
                ok = _chunk_keyed(fq, A, cb, cw, VW, out, b, t0, T, h, h2, fresh, lg, gc, gv, hw, X, E, Ee, Zh, Zk, V,
                                  Hn, norm, eps)
            else:
                ok = _chunk(fq, A, Bv, KW, VW, out, b, t0, T, h, h2, fresh, lg, gc, gv, hw, X, E, Ee, Zh, Zk, V, Hn,
                            norm, eps)
            fresh = ok
            if ok:
                h, h2 = h2, h
                swaps += 1
            else:
                # not finite (in float32: products out of range, a growing state): again by the scan
                for t in range(t0, t0 + T):
                    if not _scan_token(fq, ld, A, Bv, KW, VW, cb, cw, out, b, t, h, p, d, rows, norm, eps):
                        bad[b] = 1
            t0 += T
        if swaps % 2 == 1:  # the state is in the scratch: back into H[b]
            h2[:, :] = h
            h = h2
        for i in range(F):
            for m in range(M1):
                if not math.isfinite(h[i, m]):
                    bad[b] = 1
    return bad


dplr_chunked_serial, dplr_chunked_parallel = serial_and_parallel(_dplr_chunked, fastmath=config.FASTMATH,
                                                                 cache=config.CACHE)


def dplr_chunked(fq, ld, A, Bv, KW, VW, H, out, norm, eps, cb=None, cw=None):
    """:func:`linattn_nb.ops.dplr.cpu.dplr_scan`'s arguments and result (a (B,) uint8 flag: 1 where a
    sequence's outputs or state hold NaN or inf, | 2 where its ``ld`` holds a value > 0), in chunks of
    :data:`linattn_nb.config.DPLR_CHUNK` steps; the working dtype is ``fq``'s (float32 or float64; the
    other arrays are read in theirs), ``H`` (float64) is updated in place to the final states.

    The keyed form (``cb``, ``cw`` given, (B, N, r)): ``A`` (= ``Bv`` = ``KW``) holds the keys ``k``
    (B, N, r, F), one write per sub-step, and the rows are made from them as a chunk reads them:
    ``a_tj = D_t^[j = 0] k_tj`` (the token's diagonal in its first sub-step's ``a``), ``b_tj = cb_tj
    k_tj``, ``kw_tj = cw_tj k_tj``."""
    C = max(1, config.knob_int("DPLR_CHUNK"))
    cut = LOG_CUT if fq.dtype == np.float64 else LOG_CUT32
    if cb is None:
        cb = cw = np.empty((0, 0, 0))
    else:
        cb, cw = (np.ascontiguousarray(x, dtype=np.float64) for x in (cb, cw))
    with single_threaded_blas():  # BLAS inside prange: OpenBLAS off its own threads
        kernel = pick_kernel(dplr_chunked_serial, dplr_chunked_parallel, fq, A, VW)
        return kernel(fq, ld, A, Bv, KW, VW, cb, cw, H, out, np.int64(norm), float(eps), np.int64(C), cut)
