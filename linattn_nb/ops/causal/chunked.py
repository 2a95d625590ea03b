"""Chunkwise-parallel causal linear attention on the CPU (``method="chunked"``).

For each chunk of ``C`` tokens (Yang et al. 2024, GLA, Sec. 2.2 and Alg. 1;
Sun et al. 2023, RetNet), with ``Q_c = phi(q)``, ``K_c = phi(k)`` of the chunk
and the state ``(S, z)`` of everything before it::

    A   = tril(Q_c K_c^T)                      (C x C, diagonal included)
    out = (Q_c S + A V_c) / (Q_c z + rowsum(A))
    S  += K_c^T V_c,   z += colsum(K_c)

How the products are laid out (each is one BLAS ?gemm call, made directly on
scratch sub-blocks through :mod:`linattn_nb.ops._gemm`):

* ``X = [Q_c | A]`` (C x (F + C)) and ``R = [S z ; V_c 1]`` ((F + C) x
  (M + 1)): one product ``X R`` gives the numerators (first M columns) and
  the normalisers (last column: ``Q_c z + rowsum(A)``) together.
* The chunk's rows are taken ``block`` at a time: rows ``[r, r + block)``
  need ``A`` and ``V_c`` only up to row ``r + block``, so the products skip
  most of the masked upper triangle (a chunk of 24 in blocks of 8 computes
  2/3 of the full C x C work).
* ``K_c^T [V_c 1]`` gives the state and normaliser increments at once.
* The chunk's q, k and v rows are read in one token-by-token pass
  (:func:`linattn_nb.ops._blocks.load_chunk`) that applies the feature map
  and fills ``X``, ``phi(K_c)`` and the value rows of ``R`` together.

Measured on one core here (2026-11-29, float32, B*H = 16, N = 4096, D = M =
64, interleaved medians): this layout 24.7 ms against 26.8 ms for the previous
four ``np.dot`` calls per chunk (separate products, full triangle, normaliser
in a Numba loop) -- 8% faster; reading q, k and v in one pass then took it
to 22.0 ms (24.1 ms for separate passes, interleaved in one process, outputs
bit-identical); products of these sizes run at 105-115
GFLOP/s per core through OpenBLAS, against 47 for a 4-row register-blocked
Numba loop.  The BLAS is pinned to one thread while the kernel runs
(:mod:`linattn_nb.ops._blas`): OpenBLAS otherwise starts its own threads
inside every Numba thread.  The feature map is applied per chunk into
per-thread scratch, so memory beyond the inputs and the output is O(C^2 +
C (F + M) + F M) per thread: no N x N matrix, no per-token state, no
full-size phi(q), phi(k).

Precision: the products run in the working dtype (float32 for float16 and
float32 inputs, float64 for float64) while ``S`` and ``z`` are carried across
chunks in float64 (the state arrays the launcher is given), so the error does
not grow with the sequence length.  float16 inputs are read as ``uint16``
bits and converted per chunk (hardware F16C through :mod:`linattn_nb.ops._vec`);
the output is rounded to float16 once, from the float32 result.  A value
block holding NaN or inf (possible with ``check_finite=False``) takes an
explicit loop that sums over ``j <= t`` only, so that ``0 * NaN`` in the
masked triangle does not reach earlier rows.

Kernels cached on disk do not see edits to the helper modules they inline
(``_blocks.py``, ``_vec.py``, ``_common.py``, ``_gemm.py``): clear
``__pycache__`` after changing those.

Parallelism: over the flattened batch (``B`` = batch x heads) when ``B`` is at
least the thread count.  Below that the sequence is split too: each sequence
into ``P`` segments; a first pass sums ``phi(K)^T V`` over the pieces before
the last segment (in parallel), a prefix over those sums -- starting from the
initial state -- gives every segment its starting state, and a second pass runs
all ``B * P`` segments in parallel.  The result equals the batch-parallel one
to float64 round-off in the state.
"""
from __future__ import annotations

import contextlib

import numba
import numpy as np
from numba import njit, prange

from ... import config
from ..._blas import single_threaded_blas
from .._blocks import load_chunk
from .._gemm import gemm
from .._twins import serial_and_parallel
from .._vec import as_kernel_array, put3, work_dtype


# ---------------------------------------------------------------------------
# per-chunk helpers (inlined into the kernel by LLVM)
# ---------------------------------------------------------------------------
@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _init_scratch(S64, z64, R, F, M):
    """R = [S z ; . 1]: the state (working dtype) over the value rows' column of ones."""
    one = R.dtype.type(1.0)
    for i in range(F):
        for m in range(M):
            R[i, m] = S64[i, m]
        R[i, M] = z64[i]
    for t in range(F, R.shape[0]):
        R[t, M] = one


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _absorb(S64, z64, part, R, F, M):
    """(S64, z64) += part = phi(K_c)^T [V_c 1], in float64; R's state rows follow."""
    for i in range(F):
        for m in range(M):
            s = S64[i, m] + part[i, m]
            S64[i, m] = s
            R[i, m] = s
        zz = z64[i] + part[i, M]
        z64[i] = zz
        R[i, M] = zz


@njit(fastmath=config.FASTMATH, cache=config.CACHE, error_model="numpy")  # 1/0 -> inf, not an exception
def _span(q, k, v, out, b, s_begin, s_end, S64, z64, code, eps, clip, bs, X, R, fk, o, part):
    """Chunked recurrence over tokens [s_begin, s_end) of sequence b from state (S64, z64), in place.

    Scratch (working dtype), for chunk size C = fk.shape[0]:
    X (C, F + C) = [phi(Q_c) | A], R (F + C, M + 1) = [S z ; V_c 1],
    fk (C, F) = phi(K_c), o (C, M + 1), part (F, M + 1).
    """
    F = q.shape[2]
    M = v.shape[2]
    C = fk.shape[0]
    LX = F + C
    M1 = M + 1
    zero = X.dtype.type(0.0)
    _init_scratch(S64, z64, R, F, M)
    for s0 in range(s_begin, s_end, C):
        n = min(C, s_end - s0)
        finite = load_chunk(q, k, v, b, s0, n, X, fk, R, F, code, True)
        # Row blocks of bs: block r needs A and V_c only up to its own last
        # row, so the upper triangle is computed for the diagonal blocks only.
        for r0 in range(0, n, bs):
            ce = min(r0 + bs, n)
            # A[r0:ce, :ce] = phi(Q) phi(K)^T, then the causal mask (diagonal kept)
            gemm(0, 1, ce - r0, ce, F, 1.0, X, r0 * LX, LX, fk, 0, F, 0.0, X, r0 * LX + F, LX)
            for t in range(r0, ce):
                for j in range(t + 1, ce):
                    X[t, F + j] = zero
            if finite:
                # [phi(Q) | A] [S z ; V 1]: numerators and normalisers at once
                gemm(0, 0, ce - r0, M1, F + ce, 1.0, X, r0 * LX, LX, R, 0, M1, 0.0, o, r0 * M1, M1)
        if not finite:
            # a NaN/inf value must not reach earlier rows through 0 * NaN in the
            # masked upper triangle: sum over j <= t only (check_finite=False)
            for t in range(n):
                for m in range(M1):
                    acc = zero
                    for i in range(F):
                        acc += X[t, i] * R[i, m]
                    for j in range(t + 1):
                        acc += X[t, F + j] * R[F + j, m]
                    o[t, m] = acc
        for t in range(n):
            den = o[t, M]
            if clip and den < eps:
                den = eps
            r = 1.0 / den
            for m in range(M):
                put3(out, b, s0 + t, m, o[t, m] * r)
        # state update: the product in the working dtype, the sum in float64
        gemm(1, 0, F, M1, n, 1.0, fk, 0, F, R, F * M1, M1, 0.0, part, 0, M1)
        _absorb(S64, z64, part, R, F, M)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _sum_span(k, v, b, s_begin, s_end, S64, z64, code, R, fk, part):
    """(S64, z64) += sum of phi(K)^T [V 1] over [s_begin, s_end), chunk by chunk exactly as :func:`_span`."""
    F = k.shape[2]
    M = v.shape[2]
    C = fk.shape[0]
    M1 = M + 1
    _init_scratch(S64, z64, R, F, M)
    for s0 in range(s_begin, s_end, C):
        n = min(C, s_end - s0)
        load_chunk(k, k, v, b, s0, n, fk, fk, R, F, code, False)
        gemm(1, 0, F, M1, n, 1.0, fk, 0, F, R, F * M1, M1, 0.0, part, 0, M1)
        _absorb(S64, z64, part, R, F, M)


# ---------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------
@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _sum_item(it, k, v, Sp, zp, wt, code, C, P, sub):
    """Pass 1, work item ``it``: piece ``j`` of sequence ``b`` (pieces split segments 0..P-2)."""
    N, F = k.shape[1], k.shape[2]
    M = v.shape[2]
    npc = Sp.shape[1]
    b = it // npc
    j = it % npc
    p = j // sub
    r = j % sub
    nch = (N + C - 1) // C
    c0 = p * nch // P
    c1 = (p + 1) * nch // P
    lo = c0 + r * (c1 - c0) // sub
    hi = c0 + (r + 1) * (c1 - c0) // sub
    # chunks of C tokens, as in pass 2, so the working-dtype parts are the same numbers
    R = np.empty((F + C, M + 1), wt)
    fk = np.empty((C, F), wt)
    part = np.empty((F, M + 1), wt)
    Sp[b, j] = 0.0
    zp[b, j] = 0.0
    _sum_span(k, v, b, lo * C, min(hi * C, N), Sp[b, j], zp[b, j], code, R, fk, part)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _span_item(it, q, k, v, Sst, zst, out, wt, code, eps, clip, C, bs):
    """Pass 2, work item ``it``: segment ``p`` of sequence ``b`` from state (Sst[b, p], zst[b, p])."""
    N, F = q.shape[1], q.shape[2]
    M = v.shape[2]
    P = Sst.shape[1]
    b = it // P
    p = it % P
    nch = (N + C - 1) // C
    lo = (p * nch // P) * C
    hi = min(((p + 1) * nch // P) * C, N)
    X = np.zeros((C, F + C), wt)
    R = np.empty((F + C, M + 1), wt)
    fk = np.empty((C, F), wt)
    o = np.empty((C, M + 1), wt)
    part = np.empty((F, M + 1), wt)
    _span(q, k, v, out, b, lo, hi, Sst[b, p], zst[b, p], code, eps, clip, bs, X, R, fk, o, part)


def _chunked_pass(mode, q, k, v, Sst, zst, out, proto, code, eps, clip, C, sub, bs):
    """One pass of the chunked causal kernel over its work items.

    q, k : (B, N, F) float32/float64, or uint16 (float16 bits); raw inputs when
    ``code`` > 0, features when 0 (float32 features may come with float16
    values).  v : (B, N, M), out : (B, N, M) of the value type (uint16 for
    float16).  proto : empty array of the working dtype.  C : chunk size,
    bs : row block of the intra-chunk products.

    ``mode`` 0 (pass 1): ``Sst`` (B, (P-1)*sub, F, M) and ``zst`` (B, (P-1)*sub, F)
    float64 receive the sums of phi(K)^T V and phi(K) over each piece of the
    segments 0..P-2 (``P`` = pieces // sub + 1).
    ``mode`` 1 (pass 2): ``Sst`` (B, P, F, M) and ``zst`` (B, P, F) float64 hold
    the state at the start of each of the P segments of every sequence; each
    segment's outputs are written and its state is advanced in place to the
    segment's end (so ``Sst[:, P-1]`` ends as the final state).

    Compiled twice (:mod:`linattn_nb.ops._twins`): :data:`chunked_kernel`
    runs the items in parallel, :data:`chunked_kernel_serial` on the calling
    thread (small problems: a parallel region costs more than the work there;
    measured 18 ms per call under load with the OpenMP layer against 0.1 ms of
    work at N = 128).
    """
    B = q.shape[0]
    wt = proto.dtype
    nitems = B * Sst.shape[1]
    for it in prange(nitems):
        if mode == 0:
            _sum_item(it, k, v, Sst, zst, wt, code, C, Sst.shape[1] // sub + 1, sub)
        else:
            _span_item(it, q, k, v, Sst, zst, out, wt, code, eps, clip, C, bs)


chunked_kernel_serial, chunked_kernel = serial_and_parallel(_chunked_pass, fastmath=config.FASTMATH,
                                                            cache=config.CACHE)


# ---------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------
def plan(batch: int, n: int, *, chunk: int, threads: int | None = None, seq_parallel=None):
    """Segments per sequence ``P`` and pass-1 pieces per segment ``sub`` for a call.

    Sequence parallelism is used when the flattened batch is smaller than the
    thread count (``seq_parallel=None``), and only when every segment gets at
    least ``config.CPU_CHUNKED_MIN_SEGMENT_CHUNKS`` chunks.
    """
    T = int(threads if threads is not None else numba.get_num_threads())
    nch = -(-n // chunk) if n > 0 else 0
    if seq_parallel is None:
        seq_parallel = batch < T
    if not seq_parallel or batch <= 0 or nch == 0:
        return 1, 1
    P = max(2, -(-T // batch))
    P = min(P, nch // max(1, int(config.CPU_CHUNKED_MIN_SEGMENT_CHUNKS)))
    if P < 2:
        return 1, 1
    sub = max(1, -(-T // (batch * (P - 1))))
    return P, sub


def causal_chunked(q, k, v, S, z, out, *, code, eps, chunk=None, block=None, seq_parallel=None):
    """Launcher of :func:`chunked_kernel` (uniform method-table signature).

    Parameters
    ----------
    q, k : ndarray (B, N, F)
    v : ndarray (B, N, M)
        float16, float32 or float64, all of one dtype (or float32 features
        ``q``, ``k`` with float16 ``v``).
    S, z : ndarray (B, F, M), (B, F) float64
        Initial state, overwritten with the final state.
    out : ndarray (B, N, M)
        Same dtype as the inputs; written.
    code : int
        Inline feature map (0 = inputs already are features).
    eps : float or None
        Normaliser floor (None: raw division).
    chunk : int, optional
        Chunk size; default from :func:`linattn_nb.config.cpu_chunk_size`.
    block : int, optional
        Row block of the intra-chunk products (clipped to [1, chunk]);
        default from :func:`linattn_nb.config.cpu_chunk_block`.
    seq_parallel : bool, optional
        Force (True) or forbid (False) splitting sequences across threads;
        default: split when B is below the thread count.
    """
    B, N, F = q.shape
    M = v.shape[2]
    if N == 0 or B == 0:
        return out
    C = int(chunk if chunk is not None else config.cpu_chunk_size(N, F, M, q.dtype))
    if C < 1:
        raise ValueError(f"chunk must be >= 1, got {C}")
    C = min(C, N)  # no scratch beyond the sequence
    bs = max(1, min(C, int(block if block is not None else config.cpu_chunk_block(C, F, M, q.dtype))))
    P, sub = plan(B, N, chunk=C, seq_parallel=seq_parallel)
    small = B * P == 1 or B * N * F * M < int(config.CPU_CHUNKED_SERIAL_MAX_WORK)
    kernel = chunked_kernel_serial if small and seq_parallel is not True else chunked_kernel
    wt = work_dtype(q.dtype)
    clip = eps is not None
    qk, kk, vk = (as_kernel_array(np.ascontiguousarray(x)) for x in (q, k, v))
    ok = as_kernel_array(out)
    proto = np.empty(0, wt)
    args = (np.int64(code), float(eps if clip else 0.0), clip, np.int64(C), np.int64(sub), np.int64(bs))
    # BLAS pinned to one thread inside the parallel kernel only: there, its own
    # threads would oversubscribe the cores; on the calling thread alone they
    # may help, and the pinning costs 10-20 us, a tenth of a small call.
    with single_threaded_blas() if kernel is chunked_kernel else contextlib.nullcontext():
        if P == 1:
            # batch-parallel: the state arrays are the segment states
            S4 = np.ascontiguousarray(S).reshape(B, 1, F, M)
            z3 = np.ascontiguousarray(z).reshape(B, 1, F)
            kernel(np.int64(1), qk, kk, vk, S4, z3, ok, proto, *args)
            if not np.shares_memory(S4, S):
                S[...] = S4.reshape(B, F, M)
            if not np.shares_memory(z3, z):
                z[...] = z3.reshape(B, F)
            return out
        # pass 1: state sums of the pieces before the last segment
        Sp = np.empty((B, (P - 1) * sub, F, M))
        zp = np.empty((B, (P - 1) * sub, F))
        kernel(np.int64(0), qk, kk, vk, Sp, zp, ok, proto, *args)
        # prefix over segments, starting from the initial state
        Sst = np.empty((B, P, F, M))
        zst = np.empty((B, P, F))
        Sst[:, 0] = S
        zst[:, 0] = z
        Sseg = Sp.reshape(B, P - 1, sub, F, M).sum(axis=2)
        zseg = zp.reshape(B, P - 1, sub, F).sum(axis=2)
        for p in range(1, P):
            Sst[:, p] = Sst[:, p - 1] + Sseg[:, p - 1]
            zst[:, p] = zst[:, p - 1] + zseg[:, p - 1]
        # pass 2: all segments in parallel
        kernel(np.int64(1), qk, kk, vk, Sst, zst, ok, proto, *args)
    S[...] = Sst[:, P - 1]
    z[...] = zst[:, P - 1]
    return out
