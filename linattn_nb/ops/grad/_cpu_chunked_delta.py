"""GEMM-shaped chunks of the delta rules' CPU backward (kernel of :func:`linattn_nb.ops.grad.cpu.backward_chunked`).

Design: ``docs/design-cpu.md``, "Chunked backward of the delta rules".
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ... import config
from .._codes import RULE_DECAY, RULE_DELTA
from .._gemm import gemm
from .._twins import serial_and_parallel
from ._cpu_chunked import copy_state, copy_state_t, map_chunk, normalise_row, rows_finite, start_adjoint


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def chunk_decays(lg, b, s0, n, fa, fb, fe, Gam):
    """The decays of tokens [s0, s0 + n) of sequence ``b`` (float64; gated delta and decay rules).

    ``fa[t] = a_t``, ``fb[t] = a_0 ... a_t``, ``Gam[t, s] = a_{s+1} ... a_t``
    for ``s <= t`` (1 on the diagonal), ``fe[s] = Gam[n - 1, s]``.  Running
    products of factors in [0, 1]: no division, exact zeros across a reset.
    """
    for t in range(n):
        fa[t] = math.exp(lg[b, s0 + t, 0])
    fb[0] = fa[0]
    for t in range(1, n):
        fb[t] = fb[t - 1] * fa[t]
    for t in range(n):
        Gam[t, t] = 1.0
        for s in range(t - 1, -1, -1):
            Gam[t, s] = Gam[t, s + 1] * fa[s + 1]
    for s in range(n):
        fe[s] = Gam[n - 1, s]


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _rows(v1, b, s0, n, U):
    """U[:n] <- the rows [s0, s0 + n) of sequence b of v1."""
    for t in range(n):
        for m in range(v1.shape[2]):
            U[t, m] = v1[b, s0 + t, m]


@njit(fastmath=config.FASTMATH, cache=config.CACHE, error_model="numpy")  # 1/0 -> inf, as the forward
def decay_norm_rows(qf, g, z, T, QK, GU, g1, dq, Gam, fb, b, s0, r0, n, eps, floor):
    """The decay rule's normalised outputs, rows ``[r0, n)`` of one chunk: from ``QK = Q K^T``, ``GU = G V^T``
    (their columns ``s <= t`` read) and ``T = G S^T`` (undecayed, ``S``, ``z`` the chunk-start state and
    normaliser sum), each row's
    ``den = b_t q_t . z + sum_s Gam_ts QK_ts`` and ``g . num`` (the same with ``T``, ``GU``); writes
    ``g1``'s rows, ``GU <- r GU + c`` (what ``g1 [V 1]^T`` gives) and ``dq <- r T + c z`` (``g1 S^T``, before
    the decay).  Returns ``(g_finite, results_finite)`` as the additive rule's
    (:func:`linattn_nb.ops.grad._cpu_chunked_norm._rows`)."""
    F = qf.shape[2]
    wt = GU.dtype.type
    wz = wt(0.0)
    g_chk = wz  # sums of g * 0 (normalise_row)
    res_ok = True
    for t in range(r0, n):
        qr = qf[b, s0 + t]
        tr = T[t]
        den = 0.0
        gn = 0.0
        for s in range(t + 1):
            a = Gam[t, s] * np.float64(QK[t, s])
            den += a
            gn += a * np.float64(GU[t, s])
        d2 = 0.0
        g2 = 0.0
        for i in range(F):
            x = np.float64(qr[i])
            d2 += x * z[i]
            g2 += x * np.float64(tr[i])
        den += fb[t] * d2
        gn += fb[t] * g2
        r, c, fits, chk = normalise_row(den, gn, eps, floor, g[b, s0 + t], g1[b, s0 + t])
        res_ok &= fits
        g_chk += chk
        rw = wt(r)
        cw = wt(c)
        for s in range(t + 1):
            GU[t, s] = rw * GU[t, s] + cw
        dqr = dq[b, s0 + t]
        for i in range(F):
            dqr[i] = rw * tr[i] + c * z[i]
    return g_chk == wz, res_ok


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def decay_dq_rows(qf, dq, fb, db, b, s0, r0, n):
    """Rows [s0 + r0, s0 + n) of sequence ``b`` of ``dq``, holding ``S g1_t`` (the chunk-start state's read,
    undecayed): ``db[t] = q_t . S g1_t`` (``dL/db_t``, float64), then ``dq_t <- b_t S g1_t``.  Returns
    ``sum_t b_t db[t]``, the pairs that reach the chunk's rows through ``S``."""
    A = 0.0
    for t in range(r0, n):
        x = 0.0
        h = fb[t]
        for i in range(qf.shape[2]):
            y = dq[b, s0 + t, i]
            x += np.float64(qf[b, s0 + t, i]) * y
            dq[b, s0 + t, i] = h * y
        db[t] = x
        A += h * x
    return A


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def decayed_triangles(QK, GU, Gam, dG, r0, n, gated):
    """Rows ``[r0, n)`` of ``QK`` and ``GU`` (columns [0, n)) <- their lower triangles, times ``Gam`` where
    ``gated``, which then first writes ``dG[t, s] = GU_ts QK_ts`` (float64; ``dL/dGam_ts`` where ``GU`` holds
    ``g1 U^T``)."""
    for t in range(r0, n):
        if gated:
            for s in range(t + 1):
                dG[t, s] = np.float64(GU[t, s]) * np.float64(QK[t, s])
                h = Gam[t, s]
                QK[t, s] = QK[t, s] * h
                GU[t, s] = GU[t, s] * h
        for s in range(t + 1, n):
            QK[t, s] = 0.0
            GU[t, s] = 0.0


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def pair_factors(dG, db, Gam, fa, GamT, dGT, pv, dfac, b, s0, n):
    """``dfac[b, s0 + j, 0] = dL/da_j`` from one chunk's weights: ``dG[t, s] = dL/dGam_ts`` (s <= t, the
    intra-chunk pairs) and ``db[t] = dL/db_t`` (the chunk-start state's weight on row t), with
    ``dGam_ts/da_j = Gam_{t,j} Gam_{j-1,s}`` for ``s < j <= t`` (``s = -1``: ``b``).  No division: a
    factor of 0 gives its exact gradient."""
    for t in range(n):
        pv[t] = db[t]
        for s in range(t + 1):
            GamT[s, t] = Gam[t, s]
            dGT[s, t] = dG[t, s]
    for j in range(n):
        x = 0.0
        gr = GamT[j]
        for t in range(j, n):
            x += gr[t] * pv[t]
        dfac[b, s0 + j, 0] = x
        aj = fa[j]
        dr = dGT[j]
        for t in range(j + 1, n):
            pv[t] = aj * pv[t] + dr[t]


#: Row block of the triangular solves: the rows of a block see the earlier blocks through one GEMM,
#: each other within the block through short vector loops.
SOLVE_BLOCK = 16


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def chunk_wy(gated, kf, v1, lg, b, s0, n, Sw, fb, Gam, KS, Yt, KK, Am, U):
    """The WY/UT values of one chunk from its start state ``Sw`` (F, M'), working dtype.

    ``KS = K S``, ``KK = K K^T``, ``Am = tril(Gam * KK, -1)`` (strict lower
    triangle only; the delta rule passes ``KK`` itself as ``Am``), ``Yt =
    [V 1] - diag(b) K S - Am U`` (the residual each token writes, ``y_t =
    v_t - a_t k_t^T S_{t-1}``) and ``U = diag(beta) Yt``, by forward
    substitution in row blocks (``L U = diag(beta) Y``, ``L = I + diag(beta)
    Am``).  Without decay ``fb`` and ``Gam`` are unused (all ones).
    """
    F = kf.shape[2]
    M1 = v1.shape[2]
    C = KK.shape[0]
    ko = (b * kf.shape[1] + s0) * F
    gemm(0, 0, n, M1, F, 1.0, kf, ko, F, Sw, 0, M1, 0.0, KS, 0, M1)
    gemm(0, 1, n, n, F, 1.0, kf, ko, F, kf, ko, F, 0.0, KK, 0, C)
    wd = KK.dtype.type
    for t in range(n):
        yr = Yt[t]
        kr = KS[t]
        if gated:
            h = wd(fb[t])
            for m in range(M1):
                yr[m] = v1[b, s0 + t, m] - h * kr[m]
            for j in range(t):
                Am[t, j] = KK[t, j] * wd(Gam[t, j])
        else:
            for m in range(M1):
                yr[m] = v1[b, s0 + t, m] - kr[m]
    for r0 in range(0, n, SOLVE_BLOCK):
        r1 = min(r0 + SOLVE_BLOCK, n)
        if r0 > 0:
            gemm(0, 0, r1 - r0, M1, r0, -1.0, Am, r0 * C, C, U, 0, M1, 1.0, Yt, r0 * M1, M1)
        for t in range(r0, r1):
            yr = Yt[t]
            for j in range(r0, t):
                c = Am[t, j]
                ur = U[j]
                for m in range(M1):
                    yr[m] -= c * ur[m]
            bt = wd(lg[b, s0 + t, 1])
            ur = U[t]
            for m in range(M1):
                ur[m] = bt * yr[m]


def _delta_backward(qf, kf, v1, H0, g1, dHN, has_dHN, rule, lg, C, ck, Ys, KKs, have, dq, dk, dv, dH0, dfac, dbeta,
                    proto, g, eps, floor, flags, xq, xk, mcode):
    """Two passes over the chunks of each sequence of the flattened batch (``docs/design-cpu.md``).

    qf, kf (B, N, F), v1, g1 (B, N, M') of the working dtype; H0, dHN (B, F, M')
    float64; lg (B, N, 2) (log-decay, beta), (B, N, 1) for the decay rule, which runs
    with ``U = [V 1]`` and no transform (Ys, KKs then (B, P, 0, .)).  Pass 1 writes,
    pass 2 reads: ck (B, P, F, M') the chunk-start states in the working dtype, Ys
    (B, P, C, M') and KKs (B, P, C, C) each chunk's residuals and ``K K^T``; ``have``:
    the forward saved them already (:func:`linattn_nb.ops.causal.chunked.causal_chunked`),
    so pass 1 is skipped.  Every element of dq, dk, dv, dH0, dfac and dbeta is written.

    Normalised outputs (the decay rule only): ``g`` (B, N, M) the gradient of the outputs instead of a
    given ``g1``, which pass 2 then writes chunk by chunk before it reads it (``g1 = [g / den | -(g . num)
    / den^2]``, each row's normaliser and ``g . num`` from the chunk's own products; ``eps`` the floor
    where ``floor``; ``flags[b]`` as :func:`linattn_nb.ops.grad._cpu_chunked_norm._normalized_backward`'s).
    ``g`` of shape (1, 0, 0): ``g1`` is given.  ``xq``, ``xk``, ``mcode``: the map's VJP on each chunk's
    complete rows of ``dq`` and ``dk`` and its flag, as
    :func:`linattn_nb.ops.grad._cpu_chunked_norm._normalized_backward`'s (normalised outputs only).
    """
    B, N, F = qf.shape
    M1 = v1.shape[2]
    wt = proto.dtype
    nch = (N + C - 1) // C
    gated = rule != RULE_DELTA  # decays: the gated delta and decay rules
    wy = rule != RULE_DECAY  # the WY/UT transform: the delta rules
    maps = xq.shape[1] > 0
    for b in prange(B):
        H = np.empty((F, M1))
        for i in range(F):
            for m in range(M1):
                H[i, m] = H0[b, i, m]
        Rw = np.empty((F, M1), wt)
        Rt = np.empty((M1, F), wt)  # R and S transposed: products with R^T, S^T on the right as BLAS's NN form
        St = np.empty((M1, F), wt)
        part = np.empty((F, M1), wt)
        Am = np.zeros((C, C), wt)
        QK = np.zeros((C, C), wt)
        GU = np.zeros((C, C), wt)
        Da = np.zeros((C, C), wt)
        KS = np.empty((C, M1), wt)
        U = np.empty((C, M1), wt)
        dU = np.empty((C, M1), wt)
        X = np.empty((C, M1), wt)
        dY = np.empty((C, M1), wt)
        W1 = np.empty((C, M1), wt)
        W2 = np.empty((C, M1), wt)
        Kw = np.empty((C, F), wt)
        Gam = np.ones((C, C))
        dG = np.zeros((C, C))
        GamT = np.zeros((C, C))  # Gam and dG transposed for the factor gradient's loops (contiguous rows)
        dGT = np.zeros((C, C))
        dv2 = dv.reshape((B * N, M1))
        fa = np.ones(C)
        fb = np.ones(C)
        fe = np.ones(C)
        db = np.zeros(C)
        pv = np.zeros(C)
        norm = g.shape[1] > 0
        Tn = np.empty((C if norm else 0, F), wt)
        z = np.empty(F)
        g_ok = True
        res_ok = True
        # ------------------------------------------------------------------
        # pass 1, chunks in order: the chunk-start states and each chunk's Yt, K K^T
        # ------------------------------------------------------------------
        for c in range(0 if have else nch):
            s0 = c * C
            n = min(C, N - s0)
            ko = (b * N + s0) * F
            Sw = ck[b, c]
            copy_state(H, Sw)
            KK = KKs[b, c]
            if gated:
                chunk_decays(lg, b, s0, n, fa, fb, fe, Gam)
                if wy:
                    chunk_wy(True, kf, v1, lg, b, s0, n, Sw, fb, Gam, KS, Ys[b, c], KK, Am, U)
                # H <- b_{n-1} H + (e * K)^T U (the decay rule: U = [V 1], read in place)
                for t in range(n):
                    h = fe[t]
                    for i in range(F):
                        Kw[t, i] = h * kf[b, s0 + t, i]
                if wy:
                    gemm(1, 0, F, M1, n, 1.0, Kw, 0, F, U, 0, M1, 0.0, part, 0, M1)
                else:
                    gemm(1, 0, F, M1, n, 1.0, Kw, 0, F, v1, (b * N + s0) * M1, M1, 0.0, part, 0, M1)
                tot = fb[n - 1]
                for i in range(F):
                    for m in range(M1):
                        H[i, m] = tot * H[i, m] + part[i, m]
            else:
                chunk_wy(False, kf, v1, lg, b, s0, n, Sw, fb, Gam, KS, Ys[b, c], KK, KK, U)
                gemm(1, 0, F, M1, n, 1.0, kf, ko, F, U, 0, M1, 0.0, part, 0, M1)
                for i in range(F):
                    for m in range(M1):
                        H[i, m] += part[i, m]
        # ------------------------------------------------------------------
        # pass 2, chunks in reverse: the adjoint R of the chunk-end state
        # ------------------------------------------------------------------
        R = H  # the final state is not needed: its storage holds the adjoint
        start_adjoint(R, dHN, b, has_dHN)
        for c in range(nch - 1, -1, -1):
            s0 = c * C
            n = min(C, N - s0)
            qo = (b * N + s0) * F
            vo = (b * N + s0) * M1
            Sw = ck[b, c]
            copy_state(R, Rw)
            copy_state_t(R, Rt)
            copy_state_t(Sw, St)
            Yt = Ys[b, c]
            KK = KKs[b, c]
            if wy:
                for t in range(n):  # U = diag(beta) Yt
                    bt = wt.type(lg[b, s0 + t, 1])
                    ur = U[t]
                    yr = Yt[t]
                    for m in range(M1):
                        ur[m] = bt * yr[m]
            else:
                _rows(v1, b, s0, n, U)
            if gated:
                chunk_decays(lg, b, s0, n, fa, fb, fe, Gam)
                if wy:
                    for t in range(n):
                        for j in range(t):
                            Am[t, j] = KK[t, j] * Gam[t, j]
            else:
                Am = KK  # the delta rule: its strict lower triangle is all the solves read
            # QK -> tril(Gam * Q K^T) (the outputs' intra weights), GU -> tril(Gam * G U^T)
            gemm(0, 1, n, n, F, 1.0, qf, qo, F, kf, qo, F, 0.0, QK, 0, C)
            if norm:
                # the chunk's rows of g1 from g: T = G S^T and GU = G V^T first (M columns), then per row
                go = (b * N + s0) * (M1 - 1)
                gemm(0, 0, n, F, M1 - 1, 1.0, g, go, M1 - 1, St, 0, F, 0.0, Tn, 0, F)
                gemm(0, 1, n, n, M1 - 1, 1.0, g, go, M1 - 1, v1, vo, M1, 0.0, GU, 0, C)
                for i in range(F):
                    z[i] = Sw[i, M1 - 1]
                ok_g, ok_r = decay_norm_rows(qf, g, z, Tn, QK, GU, g1, dq, Gam, fb, b, s0, 0, n, eps, floor)
                g_ok &= ok_g
                res_ok &= ok_r
            else:
                gemm(0, 1, n, n, M1, 1.0, g1, vo, M1, U, 0, M1, 0.0, GU, 0, C)
            decayed_triangles(QK, GU, Gam, dG, 0, n, gated)
            # dq = diag(b) G S^T + tril(Gam * G U^T) K (normalised: G S^T written by decay_norm_rows)
            if not norm:
                gemm(0, 0, n, F, M1, 1.0, g1, vo, M1, St, 0, F, 0.0, dq, qo, F)
            if gated:
                decay_dq_rows(qf, dq, fb, db, b, s0, 0, n)
            gemm(0, 0, n, F, n, 1.0, GU, 0, C, kf, qo, F, 1.0, dq, qo, F)
            # dk = tril(Gam * G U^T)^T Q + diag(e) U R^T (+ the two terms below)
            gemm(1, 0, n, F, n, 1.0, GU, 0, C, qf, qo, F, 0.0, dk, qo, F)
            # dU = diag(e) K R + tril(Gam * Q K^T)^T G (the decay rule: dv = dU, written in dv's rows)
            Du = dU if wy else dv2
            du0 = 0 if wy else b * N + s0
            gemm(0, 0, n, M1, F, 1.0, kf, qo, F, Rw, 0, M1, 0.0, Du, du0 * M1, M1)
            if gated:
                for s in range(n):
                    x = 0.0
                    h = fe[s]
                    dr = Du[du0 + s]
                    ur = U[s]
                    wr = W1[s]
                    for m in range(M1):
                        x += np.float64(dr[m]) * np.float64(ur[m])
                        dr[m] = h * dr[m]
                        wr[m] = h * ur[m]
                    if s < n - 1:
                        dG[n - 1, s] += x  # e_s = Gam[n - 1, s]
                gemm(0, 0, n, F, M1, 1.0, W1, 0, M1, Rt, 0, F, 1.0, dk, qo, F)
            else:
                gemm(0, 0, n, F, M1, 1.0, U, 0, M1, Rt, 0, F, 1.0, dk, qo, F)
            gemm(1, 0, n, M1, n, 1.0, QK, 0, C, g1, vo, M1, 1.0, Du, du0 * M1, M1)
            if wy:
                # back substitution L^T dY = diag(beta) dU in row blocks, last first;
                # X_t = sum_{j > t} Am[j, t] dY_j (later blocks by one GEMM, the block's own rows by vector loops)
                for r1 in range(n, 0, -SOLVE_BLOCK):
                    r0 = max(0, r1 - SOLVE_BLOCK)
                    if r1 < n:
                        gemm(1, 0, r1 - r0, M1, n - r1, 1.0, Am, r1 * C + r0, C, dY, r1 * M1, M1, 0.0, X, r0 * M1, M1)
                    else:
                        for t in range(r0, r1):
                            for m in range(M1):
                                X[t, m] = 0.0
                    for t in range(r1 - 1, r0 - 1, -1):
                        bt = lg[b, s0 + t, 1]
                        btw = wt.type(bt)
                        x = 0.0
                        xr = X[t]
                        ur = dU[t]
                        yr = Yt[t]
                        dr = dY[t]
                        for m in range(M1):
                            r = ur[m] - xr[m]
                            x += np.float64(yr[m]) * np.float64(r)
                            dr[m] = btw * r
                        dbeta[b, s0 + t] = x
                        for s in range(r0, t):
                            cc = Am[t, s]
                            xs = X[s]
                            for m in range(M1):
                                xs[m] += cc * dr[m]
                for t in range(n):
                    for m in range(M1):
                        dv[b, s0 + t, m] = dY[t, m]
                # dAm = -dY U^T (strict lower); dk += (E + E^T) K with E = Gam * dAm
                gemm(0, 1, n, n, M1, -1.0, dY, 0, M1, U, 0, M1, 0.0, Da, 0, C)
                for t in range(n):
                    for s in range(t):
                        d = Da[t, s]
                        if gated:
                            dG[t, s] += np.float64(d) * np.float64(KK[t, s])
                            d = d * Gam[t, s]
                        Da[t, s] = d
                        Da[s, t] = d
                    Da[t, t] = 0.0
                gemm(0, 0, n, F, n, 1.0, Da, 0, C, kf, qo, F, 1.0, dk, qo, F)
            # through Y = [V 1] - diag(b) K S: dk -= diag(b) dY S^T, db -= k . (dY S^T); R update below
            if gated:
                if wy:
                    gemm(0, 0, n, F, M1, 1.0, dY, 0, M1, St, 0, F, 0.0, Kw, 0, F)
                    for t in range(n):
                        h = fb[t]
                        x = 0.0
                        for i in range(F):
                            y = Kw[t, i]
                            x += np.float64(y) * np.float64(kf[b, s0 + t, i])
                            dk[b, s0 + t, i] -= h * y
                        db[t] -= x
                        for m in range(M1):
                            W2[t, m] = h * dY[t, m]
                x = 0.0
                for i in range(F):
                    for m in range(M1):
                        x += R[i, m] * np.float64(Sw[i, m])
                db[n - 1] += x
                for t in range(n):
                    h = fb[t]
                    for m in range(M1):
                        W1[t, m] = h * g1[b, s0 + t, m]
                # R <- b_{n-1} R + Q^T diag(b) G - K^T diag(b) dY
                gemm(1, 0, F, M1, n, 1.0, qf, qo, F, W1, 0, M1, 0.0, part, 0, M1)
                if wy:
                    gemm(1, 0, F, M1, n, -1.0, kf, qo, F, W2, 0, M1, 1.0, part, 0, M1)
                tot = fb[n - 1]
                for i in range(F):
                    for m in range(M1):
                        R[i, m] = tot * R[i, m] + part[i, m]
                pair_factors(dG, db, Gam, fa, GamT, dGT, pv, dfac, b, s0, n)
            else:
                gemm(0, 0, n, F, M1, -1.0, dY, 0, M1, St, 0, F, 1.0, dk, qo, F)
                # R <- R + Q^T G - K^T dY
                gemm(1, 0, F, M1, n, 1.0, qf, qo, F, g1, vo, M1, 0.0, part, 0, M1)
                gemm(1, 0, F, M1, n, -1.0, kf, qo, F, dY, 0, M1, 1.0, part, 0, M1)
                for i in range(F):
                    for m in range(M1):
                        R[i, m] += part[i, m]
            if maps:  # the chunk's rows of dq, dk and dv are complete
                res_ok &= map_chunk(xq, qf, dq, mcode, b, s0, n)
                res_ok &= map_chunk(xk, kf, dk, mcode, b, s0, n)
                res_ok &= rows_finite(dv, b, s0, n, M1 - 1)
        for i in range(F):
            for m in range(M1):
                dH0[b, i, m] = R[i, m]
        if norm or maps:
            flags[b, 0] = not g_ok
            flags[b, 1] = not res_ok


delta_backward_kernel_serial, delta_backward_kernel = serial_and_parallel(
    _delta_backward, fastmath=config.FASTMATH, cache=config.CACHE)
