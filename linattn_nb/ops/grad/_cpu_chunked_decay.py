"""The normalised decay rule's CPU backward in two passes that keep the states of a few chunks only (kernel
of :func:`linattn_nb.ops.grad.cpu.backward_chunked_normalized` for the decay rule; the chunks: see
:func:`linattn_nb.ops.grad.cpu.decay_anchors`).

Design: ``docs/design-cpu.md``, "Chunked backward of normalised outputs" ("The decay rule").
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ... import config
from .._gemm import gemm
from .._twins import serial_and_parallel
from .._vec import is_finite
from ._cpu_chunked import copy_state, copy_state_t, intra_columns, map_chunk, rows_finite, start_adjoint
from ._cpu_chunked_delta import chunk_decays, decay_dq_rows, decay_norm_rows, decayed_triangles, pair_factors


def _decay_backward(qf, kf, v1, g, H0, dHN, has_dHN, lg, C, bs, anchors, slot, eps, floor, g1, dq, dk, dv, dH0, dfac,
                    flags, xq, xk, mcode, proto):
    """Two passes over the chunks of each sequence, as the additive rule's fused kernel
    (:func:`linattn_nb.ops.grad._cpu_chunked_norm._normalized_backward`), with the decays.

    The first pass (chunks in order, with the state ``S_c`` before each) writes ``g1``'s rows, ``dq``, the
    intra-chunk parts of ``dk`` and ``dv`` and each factor's gradient from the pairs within its chunk and
    from ``S_c``; the reverse pass (with the adjoint ``R_{c+1}`` after each chunk) adds the parts through
    ``R_{c+1}``.  One term pairs the two: ``tau_c = tot_c <R_{c+1}, S_c>``, the gradient of the log of the
    chunk's total decay ``tot_c`` along the state, which every factor of the chunk receives (``tau_c / a_j``
    for ``dL/da_j``).  Rather than keep every ``S_c`` for it, the reverse pass carries ``U_c``, the
    weighted sum of the query-key pairs whose key comes before chunk c and whose query comes at or after
    it: ``U_{c+1} = tau_c + B_c`` and ``U_c = tau_c + A_c``, where ``A_c = sum_t b_t q_t . S_c g1_t`` (the
    pairs that reach the chunk's rows through ``S_c``, first pass) and ``B_c = sum_s e_s k_s . R_{c+1}
    v1_s`` (the pairs that leave its keys through ``R_{c+1}``, reverse pass), from ``U_N = <dH_N, S_N>``.
    Each subtraction ``tau_c = U_{c+1} - B_c`` costs about eps (|A|, |B|) of a chunk, and those errors add
    up as a random walk; so some chunks (anchors: ``slot[b, c] >= 0``) keep their ``S_c`` in
    ``anchors[b, slot[b, c]]`` (working dtype), where ``<R_{c+1}, S_c>`` is computed from it, and the walk
    starts again.  The launcher makes an anchor of every few chunks and of every chunk whose ``tot_c`` is
    below :data:`linattn_nb.config.BACKWARD_DECAY_CARRY_MIN`, so that ``tau_c / a_j`` never divides the
    carried rounding by a small factor (an anchor's term needs no division: a factor of 0 gets its exact
    gradient).

    Other arguments as the additive kernel's, with ``lg`` (B, N, 1) the log-decays and ``dfac`` (B, N, 1)
    float64 receiving ``dL/da``; ``g`` of shape (1, 0, 0): ``g1`` is given (unnormalised outputs, or a
    caller that has ``dL/d[num | den]``), and ``flags`` stay as they are.
    """
    B, N, F = qf.shape
    M1 = v1.shape[2]
    M = M1 - 1
    wt = proto.dtype
    nch = (N + C - 1) // C
    maps = xq.shape[1] > 0
    norm = g.shape[1] > 0
    for b in prange(B):
        H = np.empty((F, M1))
        H[:, :] = H0[b]
        Hw = np.empty((F, M1), wt)
        Ht = np.empty((M1, F), wt)  # S^T in the first pass, R^T in the second: products as BLAS's NN form
        part = np.empty((F, M1), wt)
        QK = np.zeros((C, C), wt)
        GU = np.zeros((C, C), wt)
        T = np.empty((C, F), wt)
        X = np.empty((C, M1), wt)
        Kw = np.empty((C, F), wt)
        Vw = np.empty((C, M1), wt)
        Gam = np.ones((C, C))
        dG = np.zeros((C, C))
        GamT = np.zeros((C, C))
        dGT = np.zeros((C, C))
        fa = np.ones(C)
        fb = np.ones(C)
        fe = np.ones(C)
        db = np.zeros(C)
        pv = np.zeros(C)
        z = np.empty(F)
        Ac = np.empty(nch)
        g_ok = True
        res_ok = True
        # ------------------------------------------------------------------
        # pass 1, chunks in order: g1, dq, the intra-chunk parts of dk and dv, the factors' own pairs
        # ------------------------------------------------------------------
        for c in range(nch):
            s0 = c * C
            n = min(C, N - s0)
            qo = (b * N + s0) * F
            vo = (b * N + s0) * M1
            go = (b * N + s0) * M
            chunk_decays(lg, b, s0, n, fa, fb, fe, Gam)
            copy_state_t(H, Ht)
            if slot[b, c] >= 0:  # an anchor: <R_{c+1}, S_c> from S_c itself in the reverse pass
                copy_state(H, anchors[b, slot[b, c]])
            if norm:
                for i in range(F):
                    z[i] = H[i, M]
                # T = G S^T: the chunk-start state read by each gradient row
                gemm(0, 0, n, F, M, 1.0, g, go, M, Ht, 0, F, 0.0, T, 0, F)
            else:  # g1 given: dq = g1 S^T
                gemm(0, 0, n, F, M1, 1.0, g1, vo, M1, Ht, 0, F, 0.0, dq, qo, F)
            # Row blocks of bs: block [r0, ce) needs QK and GU up to its own last column only, so the upper
            # triangle is computed for the diagonal blocks only (as the additive rule's kernel)
            Ac[c] = 0.0
            for r0 in range(0, n, bs):
                ce = min(r0 + bs, n)
                gemm(0, 1, ce - r0, ce, F, 1.0, qf, qo + r0 * F, F, kf, qo, F, 0.0, QK, r0 * C, C)
                if norm:
                    # g1's rows from g: GU = G V^T (M columns) and T, then per row
                    gemm(0, 1, ce - r0, ce, M, 1.0, g, go + r0 * M, M, v1, vo, M1, 0.0, GU, r0 * C, C)
                    ok_g, ok_r = decay_norm_rows(qf, g, z, T, QK, GU, g1, dq, Gam, fb, b, s0, r0, ce, eps, floor)
                    g_ok &= ok_g
                    res_ok &= ok_r
                else:  # GU = g1 V1^T
                    gemm(0, 1, ce - r0, ce, M1, 1.0, g1, vo + r0 * M1, M1, v1, vo, M1, 0.0, GU, r0 * C, C)
                # dG = dL/dGam (GU = g1 V1^T now); QK, GU -> their decayed lower triangles
                decayed_triangles(QK, GU, Gam, dG, r0, ce, True)
                # dq's rows hold S g1 (either branch): db = dL/db_t = q_t . S g1_t, then dq = b_t S g1_t
                Ac[c] += decay_dq_rows(qf, dq, fb, db, b, s0, r0, ce)
                # dq += tril(Gam * g1 V1^T) K
                gemm(0, 0, ce - r0, F, ce, 1.0, GU, r0 * C, C, kf, qo, F, 1.0, dq, qo + r0 * F, F)
            # column blocks: dk = tril(Gam * g1 V1^T)^T Q and dv = tril(Gam * Q K^T)^T g1 over the rows at or
            # below each block
            intra_columns(GU, QK, qf, g1, dk, dv, qo, vo, n, bs)
            pair_factors(dG, db, Gam, fa, GamT, dGT, pv, dfac, b, s0, n)
            if maps:  # dq's rows are complete
                res_ok &= map_chunk(xq, qf, dq, mcode, b, s0, n)
            # S <- tot S + (e * K)^T V1
            for t in range(n):
                h = fe[t]
                for i in range(F):
                    Kw[t, i] = h * kf[b, s0 + t, i]
            gemm(1, 0, F, M1, n, 1.0, Kw, 0, F, v1, vo, M1, 0.0, part, 0, M1)
            tot = fb[n - 1]
            for i in range(F):
                for m in range(M1):
                    H[i, m] = tot * H[i, m] + part[i, m]
        for i in range(F):
            for m in range(M1):
                res_ok &= is_finite(H[i, m])
        # ------------------------------------------------------------------
        # pass 2, chunks in reverse: R, the inter-chunk parts of dk and dv and of the factor gradient
        # ------------------------------------------------------------------
        U = 0.0  # <dH_N, S_N>: the final state's pairs
        if has_dHN:
            for i in range(F):
                for m in range(M1):
                    U += dHN[b, i, m] * H[i, m]
        R = H  # the final state is no longer needed: its storage holds the adjoint
        start_adjoint(R, dHN, b, has_dHN)
        for c in range(nch - 1, -1, -1):
            s0 = c * C
            n = min(C, N - s0)
            qo = (b * N + s0) * F
            vo = (b * N + s0) * M1
            chunk_decays(lg, b, s0, n, fa, fb, fe, Gam)
            copy_state(R, Hw)
            copy_state_t(R, Ht)
            # X = K R: dv += e * X; pv[s] = k_s . R v1_s = dL/de_s
            gemm(0, 0, n, M1, F, 1.0, kf, qo, F, Hw, 0, M1, 0.0, X, 0, M1)
            Bc = 0.0
            for s in range(n):
                x = 0.0
                h = fe[s]
                xr = X[s]
                dr = dv[b, s0 + s]
                ur = v1[b, s0 + s]
                wr = Vw[s]
                for m in range(M1):
                    y = xr[m]
                    u = ur[m]
                    x += np.float64(y) * np.float64(u)
                    dr[m] += h * y
                    wr[m] = h * u
                pv[s] = x
                Bc += h * x
            # dk += (e * V1) R^T
            gemm(0, 0, n, F, M1, 1.0, Vw, 0, M1, Ht, 0, F, 1.0, dk, qo, F)
            tot = fb[n - 1]
            # tau = tot <R, S_c>: at an anchor from S_c itself (where the carried sums' rounding, a random
            # walk over the chunks since the last anchor, starts again), else from the carried pair sums
            anchor = slot[b, c] >= 0
            x = 0.0
            if anchor:
                Sa = anchors[b, slot[b, c]]
                for i in range(F):
                    for m in range(M1):
                        x += R[i, m] * np.float64(Sa[i, m])
                tau = tot * x
            else:
                tau = U - Bc
            U = tau + Ac[c]
            # dL/da_j += Gam_{n-1,j} (sum_{s<j} Gam_{j-1,s} dL/de_s + b_{j-1} <R, S_c>), the last term
            # tau / a_j where carried (the launcher's floor on tot keeps a_j away from 0)
            y = 0.0
            for j in range(n):
                if anchor:
                    d = Gam[n - 1, j] * (y + (fb[j - 1] if j > 0 else 1.0) * x)
                else:
                    d = Gam[n - 1, j] * y + tau / fa[j]
                dfac[b, s0 + j, 0] += d
                y = fa[j] * y + pv[j]
            # R <- tot R + Q^T (b * g1)
            for t in range(n):
                h = fb[t]
                for m in range(M1):
                    Vw[t, m] = h * g1[b, s0 + t, m]
            gemm(1, 0, F, M1, n, 1.0, qf, qo, F, Vw, 0, M1, 0.0, part, 0, M1)
            for i in range(F):
                for m in range(M1):
                    R[i, m] = tot * R[i, m] + part[i, m]
            if maps:  # dk's and dv's rows are complete
                res_ok &= map_chunk(xk, kf, dk, mcode, b, s0, n)
                res_ok &= rows_finite(dv, b, s0, n, M)
        for i in range(F):
            for m in range(M1):
                dH0[b, i, m] = R[i, m]
        if norm or maps:
            flags[b, 0] = not g_ok
            flags[b, 1] = not res_ok


decay_backward_kernel_serial, decay_backward_kernel = serial_and_parallel(
    _decay_backward, fastmath=config.FASTMATH, cache=config.CACHE, error_model="numpy")
