"""The normalised additive rule's CPU backward with no forward before it (kernel of
:func:`linattn_nb.ops.grad.cpu.backward_chunked_normalized`).

Design: ``docs/design-cpu.md``, "Chunked backward of normalised outputs".
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ... import config
from .._gemm import gemm
from .._twins import serial_and_parallel
from .._vec import is_finite
from ._cpu_chunked import (add_into, additive_reverse_chunk, copy_state_t, intra_columns, map_chunk, normalise_row,
                           rows_finite, start_adjoint)


@njit(fastmath=config.FASTMATH, cache=config.CACHE, error_model="numpy")  # 1/0 -> inf, as the forward
def _rows(qf, g, z, T, Am, Pm, g1, dq, b, s0, r0, ce, eps, floor):
    """Rows [r0, ce) of the chunk at ``s0``: each row's normaliser and ``g . num`` from the products the
    gradient needs anyway, then ``g1 = [g / den | -(g . num) / den^2]``, ``Pm`` (``G V^T``) -> ``dA``
    (masked) and ``dq``'s inter-chunk part ``T / den + c z`` (``z`` the normaliser sum before the chunk,
    float64).  Returns ``(g_finite, results_finite)``."""
    F = qf.shape[2]
    wt = Pm.dtype.type
    wz = wt(0.0)
    g_chk = wz  # sums of g * 0 (normalise_row)
    res_ok = True
    for t in range(r0, ce):
        qr = qf[b, s0 + t]
        gr = g[b, s0 + t]
        ar = Am[t]
        pr = Pm[t]
        tr = T[t]
        den = 0.0
        gn = 0.0
        for s in range(t + 1):
            a = np.float64(ar[s])
            den += a
            gn += a * np.float64(pr[s])
        for i in range(F):
            x = np.float64(qr[i])
            den += x * z[i]
            gn += x * np.float64(tr[i])
        # a float32 normaliser or g . num beyond float32 asks for the float64 recomputation, as an overflowed
        # forward does (normalise_row)
        r, c, fits, chk = normalise_row(den, gn, eps, floor, gr, g1[b, s0 + t])
        res_ok &= fits
        g_chk += chk
        rw = wt(r)
        cw = wt(c)
        for s in range(t + 1):
            pr[s] = rw * pr[s] + cw
        for s in range(t + 1, ce):
            pr[s] = wz
            ar[s] = wz
        dqr = dq[b, s0 + t]
        for i in range(F):
            dqr[i] = rw * tr[i] + c * z[i]
    return g_chk == wz, res_ok


def _normalized_backward(qf, kf, v1, g, H0, dHN, has_dHN, eps, floor, C, bs, g1, dq, dk, dv, dH0, flags, xq, xk,
                         mcode, proto):
    """Two passes over the chunks of each sequence (``docs/design-cpu.md``).

    qf, kf (B, N, F), v1 (B, N, M + 1), g (B, N, M) of the working dtype; H0, dHN (B, F, M + 1) float64;
    C the chunk size, bs the row block of its intra-chunk products.  Writes every element of g1 (the
    gradient of ``[num | den]``, (B, N, M + 1)), dq, dk, dv (B, N, M + 1) and dH0; ``flags[b]`` gets
    whether a ``g`` element read was NaN or inf (column 0) and whether a normaliser, ``g . num`` or the
    final state was (column 1).

    ``xq``, ``xk`` (B, N, F) the inputs of an elementwise map ``mcode``
    (:func:`~linattn_nb.ops.grad._cpu_chunked.map_span`), or of shape (1, 0, 0): with them, ``dq`` and
    ``dk`` are the gradients of those inputs, each chunk's rows passed through the map's VJP once
    complete, and column 1 of ``flags`` also says whether a stored ``dq``, ``dk`` or ``dv[..., :M]``
    element is NaN or inf (the pass over them that the caller would run).
    """
    B, N, F = qf.shape
    M1 = v1.shape[2]
    M = M1 - 1
    wt = proto.dtype
    nch = (N + C - 1) // C
    maps = xq.shape[1] > 0
    for b in prange(B):
        H = np.empty((F, M1))
        H[:, :] = H0[b]
        Hw = np.empty((F, M1), wt)
        Ht = np.empty((M1, F), wt)
        part = np.empty((F, M1), wt)
        Pm = np.empty((C, C), wt)
        Am = np.empty((C, C), wt)
        T = np.empty((C, F), wt)
        z = np.empty(F)
        g_ok = True
        res_ok = True
        # pass 1, chunks in order: H; the normalisers and g1; dq; the intra-chunk parts of dk and dv
        for c in range(nch):
            s0 = c * C
            n = min(C, N - s0)
            qo = (b * N + s0) * F
            vo = (b * N + s0) * M1
            go = (b * N + s0) * M
            copy_state_t(H, Ht)
            for i in range(F):
                z[i] = H[i, M]
            # T = G S^T: the chunk-start state read by each gradient row
            gemm(0, 0, n, F, M, 1.0, g, go, M, Ht, 0, F, 0.0, T, 0, F)
            for r0 in range(0, n, bs):
                ce = min(r0 + bs, n)
                # rows [r0, ce) of A = Q K^T and P0 = G V^T, columns up to ce only
                gemm(0, 1, ce - r0, ce, F, 1.0, qf, qo + r0 * F, F, kf, qo, F, 0.0, Am, r0 * C, C)
                gemm(0, 1, ce - r0, ce, M, 1.0, g, go + r0 * M, M, v1, vo, M1, 0.0, Pm, r0 * C, C)
                ok_g, ok_r = _rows(qf, g, z, T, Am, Pm, g1, dq, b, s0, r0, ce, eps, floor)
                g_ok &= ok_g
                res_ok &= ok_r
                # dq += dA K
                gemm(0, 0, ce - r0, F, ce, 1.0, Pm, r0 * C, C, kf, qo, F, 1.0, dq, qo + r0 * F, F)
            # column blocks: dk = dA^T Q and dv = A^T g1 over the rows at or below each block
            intra_columns(Pm, Am, qf, g1, dk, dv, qo, vo, n, bs)
            if maps:  # dq's rows are complete
                res_ok &= map_chunk(xq, qf, dq, mcode, b, s0, n)
            # H += K^T [V 1]
            gemm(1, 0, F, M1, n, 1.0, kf, qo, F, v1, vo, M1, 0.0, part, 0, M1)
            add_into(H, part)
        for i in range(F):
            for m in range(M1):
                res_ok &= is_finite(H[i, m])
        # pass 2, chunks in reverse: R, the inter-chunk parts of dk and dv
        R = H
        start_adjoint(R, dHN, b, has_dHN)
        for c in range(nch - 1, -1, -1):
            s0 = c * C
            n = min(C, N - s0)
            qo = (b * N + s0) * F
            additive_reverse_chunk(qf, kf, v1, g1, R, Hw, Ht, part, dk, dv, qo, (b * N + s0) * M1, n)
            if maps:  # dk's and dv's rows are complete
                res_ok &= map_chunk(xk, kf, dk, mcode, b, s0, n)
                res_ok &= rows_finite(dv, b, s0, n, M)
        for i in range(F):
            for m in range(M1):
                dH0[b, i, m] = R[i, m]
        flags[b, 0] = not g_ok
        flags[b, 1] = not res_ok


normalized_backward_kernel_serial, normalized_backward_kernel = serial_and_parallel(
    _normalized_backward, fastmath=config.FASTMATH, cache=config.CACHE)
