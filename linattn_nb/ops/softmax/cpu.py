"""Numba CPU kernel of softmax attention, blocked with a running max.

(batch entry, query block) tasks run in parallel, each streaming over key blocks
with a running row maximum, normaliser and unnormalised accumulator (the online
softmax of Milakov & Gimelshein 2018); memory per task O(block_q (block_k + M)).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ... import config
from ..._blas import single_threaded_blas
from .._finite import new_flags, report
from .._twins import pick, serial_and_parallel
from .._vec import is_finite


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _softmax_task(task, q, k, v, out, scale, causal, block_q, block_k, flags):
    """One task of :func:`_softmax`: query block ``task % nqb`` (interleaved) of sequence ``task // nqb``.

    A function of its own, not the ``prange`` body: Numba compiles a parallel loop body differently
    fresh and from the disk cache (numba/numba#10617), so the twins' float64 results differed in the
    last bit; a called function is the same machine code in both.
    """
    B, N, D = q.shape
    M = v.shape[2]
    nqb = (N + block_q - 1) // block_q
    # Interleave cheap and expensive query blocks so that the contiguous
    # ranges prange hands each thread carry similar causal work.
    b = task // nqb
    r = task % nqb
    if r % 2 == 0:
        qb = r // 2
    else:
        qb = nqb - 1 - r // 2
    q0 = qb * block_q
    q1 = min(N, q0 + block_q)
    nq = q1 - q0
    qs = np.empty((nq, D), dtype=q.dtype)
    inputs_ok = True
    for i in range(nq):
        for d in range(D):
            x = q[b, q0 + i, d]
            qs[i, d] = x * scale
            inputs_ok &= is_finite(x)
        for d in range(D):
            inputs_ok &= is_finite(k[b, q0 + i, d])
        for mm in range(M):
            inputs_ok &= is_finite(v[b, q0 + i, mm])
    mrow = np.full(nq, -np.inf)
    lrow = np.zeros(nq)
    acc = np.zeros((nq, M), dtype=q.dtype)
    kend = q1 if causal else N
    for k0 in range(0, kend, block_k):
        k1 = min(kend, k0 + block_k)
        s = np.dot(qs, k[b, k0:k1].T)
        nk = k1 - k0
        for i in range(nq):
            lim = nk
            if causal:
                lim = max(0, min(nk, q0 + i + 1 - k0))
            mx = mrow[i]
            for j in range(lim):
                if s[i, j] > mx:
                    mx = s[i, j]
            alpha = np.exp(mrow[i] - mx) if mrow[i] > -np.inf else 0.0
            tot = 0.0
            for j in range(lim):
                p = np.exp(s[i, j] - mx)
                s[i, j] = p
                tot += p
            for j in range(lim, nk):
                s[i, j] = 0.0
            lrow[i] = lrow[i] * alpha + tot
            mrow[i] = mx
            for mm in range(M):
                acc[i, mm] *= alpha
        acc += np.dot(s, v[b, k0:k1])
    results_ok = True  # outputs and row normalisers
    for i in range(nq):
        inv = 1.0 / lrow[i]
        results_ok &= is_finite(lrow[i])
        for mm in range(M):
            out[b, q0 + i, mm] = acc[i, mm] * inv
            results_ok &= is_finite(out[b, q0 + i, mm])
    flags[task, 0] = not inputs_ok
    flags[task, 1] = not results_ok


def _softmax(q, k, v, out, scale, causal, block_q, block_k, flags):
    """q (B, N, D), k (B, N, D), v (B, N, M) -> out (B, N, M); serial and parallel twins.

    ``flags`` (B * ceil(N / block_q), 2) uint8 <- per task, whether an element of its
    query block's rows of q, k or v is NaN or inf (one extra O(N) pass for k and v),
    and whether an output or a row normaliser is.
    """
    B, N, D = q.shape
    nqb = (N + block_q - 1) // block_q
    ntask = B * nqb
    for task in prange(ntask):
        # np.int64: one compilation of the task for both twins (prange's index is unsigned)
        _softmax_task(np.int64(task), q, k, v, out, scale, causal, block_q, block_k, flags)


softmax_kernel_serial, softmax_kernel = serial_and_parallel(_softmax, fastmath=config.FASTMATH, cache=config.CACHE)


def softmax_blocked(q, k, v, out, *, causal, scale, block_q=None, block_k=None, check_finite=False):
    """Launcher for :data:`softmax_kernel`; block sizes default to config.

    Below ``config.SOFTMAX_SERIAL_MAX_WORK`` (B * N * N * (D + M), halved when causal)
    or with a single task the serial kernel runs.  ``check_finite``: ValueError naming
    the first of q, k, v holding NaN or inf, or
    :class:`~linattn_nb.ops._finite.NonFiniteResult` for finite inputs whose outputs
    are not; raised after the kernel ran (``out`` then unspecified).
    """
    block_q = config.knob_int("SOFTMAX_BLOCK_Q") if block_q is None else int(block_q)
    block_k = config.knob_int("SOFTMAX_BLOCK_K") if block_k is None else int(block_k)
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be >= 1, got block_q={block_q}, block_k={block_k}")
    B, N, D = q.shape
    work = B * N * N * (D + v.shape[2]) // (2 if causal else 1)
    kernel = pick(softmax_kernel_serial, softmax_kernel, items=B * -(-N // block_q), work=work,
                  limit="SOFTMAX_SERIAL_MAX_WORK")
    flags = new_flags(B * -(-N // block_q))
    with single_threaded_blas(kernel is softmax_kernel):  # np.dot inside prange: OpenBLAS off its own threads
        kernel(q, k, v, out, float(scale), bool(causal), np.int64(block_q), np.int64(block_k), flags)
    report(flags, (("q", q), ("k", k), ("v", v)), check_finite=check_finite)
    return out
