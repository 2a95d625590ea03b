"""CUDA kernels of the backward launchers (:mod:`linattn_nb.ops.grad.cuda`).

See ``docs/cuda_kernels.md``, "Backward kernels".
"""
from __future__ import annotations

import math

from numba import config as _nbconfig
from numba import cuda, float64

from ... import config
from .._codes import RULE_DECAY, RULE_DELTA, RULE_GATE, RULE_GATED_DELTA

_SIM = bool(getattr(_nbconfig, "ENABLE_CUDASIM", 0))
_CACHE = bool(config.CACHE) and not _SIM


_BACKWARD_KERNELS: dict = {}


def causal_backward_kernel(MB: int):
    """The causal backward kernel for blocks of ``MB`` state columns (every update rule).

    Grid ``(B, ceil(M' / MB))``, any number of threads (:func:`backward_threads`).  The
    arguments, scratch and partial results: ``docs/cuda_kernels.md``, "Backward kernels".
    """
    MB = int(MB)
    kern = _BACKWARD_KERNELS.get(MB)
    if kern is not None:
        return kern

    @cuda.jit(cache=_CACHE)
    def kernel(qf, kf, v1, g1, H0, dHN, has_dhn, lf, ck, hs, D, dv, pq, pk, pf, pb, L, nchunks, rule):
        sg = cuda.shared.array(MB, float64)  # g_t of the block's columns
        sv = cuda.shared.array(MB, float64)  # v1_t
        sw = cuda.shared.array(MB, float64)  # k_t^T D[:, m]
        su = cuda.shared.array(MB, float64)  # delta rules: k_t^T H_{t-1}[:, m]
        sf = cuda.shared.array(MB, float64)  # the column's share of the scalar dfactor
        sb = cuda.shared.array(MB, float64)  # the column's share of dbeta
        N = qf.shape[1]
        F = qf.shape[2]
        M1 = v1.shape[2]
        tid = cuda.threadIdx.x
        nth = cuda.blockDim.x
        b = cuda.blockIdx.x
        cb = cuda.blockIdx.y
        m0 = cb * MB
        nb = min(MB, M1 - m0)
        delta = rule == RULE_DELTA or rule == RULE_GATED_DELTA
        gate = rule == RULE_GATE
        scalar_factor = rule == RULE_DECAY or rule == RULE_GATED_DELTA

        for j in range(tid, nb, nth):  # D = dH_N
            m = m0 + j
            for i in range(F):
                D[b, i, m] = dHN[b, i, m] if has_dhn else 0.0

        # Chunks 0 .. nchunks - 2 forward (checkpoints), then nchunks - 1 .. 0 in reverse.
        for it in range(2 * nchunks - 1):
            fwd = it < nchunks - 1
            c = it if fwd else 2 * nchunks - 2 - it
            t0 = c * L
            nl = min(L, N - t0)
            # ---- the chunk's token states from its checkpoint (hs[b, s]: before token t0 + s),
            # one thread per column; forward: the state after the chunk is the next checkpoint
            for j in range(tid, nb, nth):
                m = m0 + j
                for i in range(F):
                    hs[b, 0, i, m] = H0[b, i, m] if c == 0 else ck[b, c - 1, i, m]
                for s in range(nl):
                    t = t0 + s
                    vm = float64(v1[b, t, m])
                    a = math.exp(float(lf[b, t, 0])) if scalar_factor else 1.0
                    if delta:
                        beta = lf[b, t, 1]
                        u = 0.0
                        for i in range(F):
                            u += float64(kf[b, t, i]) * hs[b, s, i, m]
                        for i in range(F):
                            ki = float64(kf[b, t, i])
                            hs[b, s + 1, i, m] = a * (hs[b, s, i, m] - beta * ki * u) + beta * ki * vm
                    else:
                        for i in range(F):
                            ai = math.exp(float(lf[b, t, i])) if gate else a
                            hs[b, s + 1, i, m] = ai * hs[b, s, i, m] + float64(kf[b, t, i]) * vm
                if fwd:
                    for i in range(F):
                        ck[b, c, i, m] = hs[b, nl, i, m]
            if fwd:
                continue
            cuda.syncthreads()
            # ---- the adjoint through the chunk's tokens, from the last
            for s in range(nl - 1, -1, -1):
                t = t0 + s
                a = math.exp(float(lf[b, t, 0])) if scalar_factor else 1.0
                beta = lf[b, t, 1] if delta else 0.0
                # column phase: D += q g^T, sums over rows
                for j in range(tid, nb, nth):
                    m = m0 + j
                    gm = float64(g1[b, t, m])
                    vm = float64(v1[b, t, m])
                    sg[j] = gm
                    sv[j] = vm
                    w = 0.0
                    u = 0.0
                    dp = 0.0
                    for i in range(F):
                        d = D[b, i, m] + float64(qf[b, t, i]) * gm  # dL/dH_t
                        D[b, i, m] = d
                        ki = float64(kf[b, t, i])
                        w += ki * d
                        if delta:
                            u += ki * hs[b, s, i, m]
                        if scalar_factor:
                            dp += d * hs[b, s, i, m]
                    sw[j] = w
                    su[j] = u
                    if delta:
                        dv[b, t, m] = beta * w
                        sb[j] = w * (vm - a * u)
                        sf[j] = dp - beta * w * u
                    else:
                        dv[b, t, m] = w
                        sf[j] = dp
                cuda.syncthreads()
                # row phase: sums over the block's columns, then row i of D back through token t
                for i in range(tid, F, nth):
                    ki = float64(kf[b, t, i])
                    ai = math.exp(float(lf[b, t, i])) if gate else a
                    xq = 0.0
                    xk = 0.0
                    xf = 0.0
                    for j in range(nb):
                        m = m0 + j
                        d = D[b, i, m]
                        p = hs[b, s, i, m]
                        xq += hs[b, s + 1, i, m] * sg[j]
                        if delta:
                            xk += beta * d * sv[j] - a * beta * (d * su[j] + p * sw[j])
                            D[b, i, m] = a * (d - beta * ki * sw[j])
                        else:
                            xk += d * sv[j]
                            if gate:
                                xf += d * p
                            D[b, i, m] = ai * d
                    pq[cb, b, t, i] = xq
                    pk[cb, b, t, i] = xk
                    if gate:
                        pf[cb, b, t, i] = xf
                if tid == 0 and (scalar_factor or delta):
                    xf = 0.0
                    xb = 0.0
                    for j in range(nb):
                        xf += sf[j]
                        xb += sb[j]
                    if scalar_factor:
                        pf[cb, b, t, 0] = xf
                    if delta:
                        pb[cb, b, t, 0] = xb
                cuda.syncthreads()

    _BACKWARD_KERNELS[MB] = kernel
    return kernel


#: Most threads per block of the causal backward kernel: it needs about 150 registers per
#: thread at sm_90 (ptxas, in the PTX test), so 256 threads use under 40k of a block's 64k.
MAX_BACKWARD_THREADS = 256


def backward_threads(F: int, MB: int) -> int:
    """Threads per block of the causal backward kernel: one per row and per column of a block (a
    multiple of 32), at most :data:`MAX_BACKWARD_THREADS` and ``config.CUDA_MAX_THREADS`` (the
    loops stride by the block size, so any count is correct)."""
    want = -(-max(int(F), int(MB), 1) // 32) * 32
    return max(1, min(MAX_BACKWARD_THREADS, int(config.CUDA_MAX_THREADS), want))


@cuda.jit(cache=_CACHE)
def sum_blocks_kernel(src, dst):
    """``dst[b, t, w] = sum over cb of src[cb, b, t, w]`` (in float64, cast to dst's dtype).

    src (nCB, B, N, W) float64: the partials of the column blocks; dst (B, N, W).
    """
    ncb, B, N, W = src.shape
    total = B * N * W
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for idx in range(start, total, stride):
        w = idx % W
        bt = idx // W
        t = bt % N
        b = bt // N
        acc = 0.0
        for cb in range(ncb):
            acc += src[cb, b, t, w]
        dst[b, t, w] = acc


@cuda.jit(cache=_CACHE)
def aggregate_sums_kernel(qf, kf, v1, g1, H0, dHN, has_dhn, H, R):
    """Per state element, in float64: ``H = H0 + sum_t k_t v1_t^T``, ``R = dH_N + sum_t q_t g_t^T``.

    qf, kf (B, N, F), v1, g1 (B, N, M'): any float dtype and strides; H0, H,
    R (B, F, M') float64; dHN (B, F, M') float64, read when ``has_dhn``.
    """
    B, N, F = qf.shape
    M1 = v1.shape[2]
    total = B * F * M1
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for idx in range(start, total, stride):
        m = idx % M1
        bi = idx // M1
        i = bi % F
        b = bi // F
        h = float64(H0[b, i, m])
        r = float64(dHN[b, i, m]) if has_dhn else 0.0
        for t in range(N):
            h += float64(kf[b, t, i]) * float64(v1[b, t, m])
            r += float64(qf[b, t, i]) * float64(g1[b, t, m])
        H[b, i, m] = h
        R[b, i, m] = r


@cuda.jit(cache=_CACHE)
def aggregate_grads_kernel(kf, v1, g1, H, R, dq, dk, dv):
    """The non-causal gradients from ``H`` and ``R`` (:func:`aggregate_sums_kernel`), sums in float64.

    Per (b, t): rows ``i < F`` give ``dq[b, t, i] = H[b, i, :] g_t`` and
    ``dk[b, t, i] = R[b, i, :] v1_t``; columns ``m`` give ``dv[b, t, m] =
    k_t^T R[b, :, m]``.  dq, dk (B, N, F), dv (B, N, M'): the working dtype.
    """
    B, N, F = kf.shape
    M1 = v1.shape[2]
    per = F + M1
    total = B * N * per
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for idx in range(start, total, stride):
        bt = idx // per
        x = idx - bt * per
        b = bt // N
        t = bt - b * N
        if x < F:
            xq = 0.0
            xk = 0.0
            for m in range(M1):
                xq += H[b, x, m] * float64(g1[b, t, m])
                xk += R[b, x, m] * float64(v1[b, t, m])
            dq[b, t, x] = xq
            dk[b, t, x] = xk
        else:
            m = x - F
            acc = 0.0
            for i in range(F):
                acc += float64(kf[b, t, i]) * R[b, i, m]
            dv[b, t, m] = acc
