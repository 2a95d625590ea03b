"""Helper kernels of the CUDA launchers: state packing and casts, the chunk combine, copies.

Grid-stride kernels over plain arrays (cached on disk), launched with
:func:`linattn_nb.ops.cuda.plan.helper_grid`.  See ``docs/cuda_kernels.md``, "Accumulation dtype".
"""
from __future__ import annotations

import math

from numba import cuda, float64

from .._codes import RULE_ADDITIVE
from .._cuda_common import carry, unravel4
from .plan import CACHE


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _state_index(idx, F, M1):
    """C-order index -> (b, i, col) of a (B, F, M + 1) packed state."""
    b = idx // (F * M1)
    rem = idx - b * (F * M1)
    i = rem // M1
    return b, i, rem - i * M1


@cuda.jit(cache=CACHE)
def state_copy_kernel(S, z, H, pack):
    """``pack``: H[b, :, :M] = S[b], H[b, :, M] = z[b] (cast to H's dtype);
    else the inverse, into S, z (cast to their dtype)."""
    B, F, M = S.shape
    M1 = M + 1
    total = B * F * M1
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for idx in range(start, total, stride):
        b, i, col = _state_index(idx, F, M1)
        if pack:
            if col < M:
                H[b, i, col] = S[b, i, col]
            else:
                H[b, i, col] = z[b, i]
        elif col < M:
            S[b, i, col] = H[b, i, col]
        else:
            z[b, i] = H[b, i, col]


@cuda.jit(cache=CACHE)
def cast_copy_kernel(src, dst):
    """dst[...] = src[...] (cast to dst's dtype) for (n, F, M + 1) states of equal shape:
    the caller's float64 state to and from a float32 accumulation state."""
    n, F, M1 = src.shape
    total = n * F * M1
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for idx in range(start, total, stride):
        b, i, col = _state_index(idx, F, M1)
        dst[b, i, col] = src[b, i, col]


@cuda.jit(cache=CACHE)
def chunk_factors_kernel(lf, L, nchunks, Af):
    """Every chunk's total factor (B * nchunks, W) float64: ``Af[b * nchunks + c, w] = exp(sum lf[b, t, w])``.

    The sum runs in float64 and is never differenced: a reset (``-inf``) in the chunk
    gives exactly 0, no NaN.  Chunk ``c`` is tokens ``[c L, min(N, (c + 1) L))``.
    """
    B, N, W = lf.shape
    total = B * nchunks * W
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for idx in range(start, total, stride):
        w = idx % W
        bc = idx // W
        b = bc // nchunks
        c = bc - b * nchunks
        acc = 0.0
        for t in range(c * L, min(N, (c + 1) * L)):
            acc += float(lf[b, t, w])  # float64 (the simulator would keep a float32 lf in float32)
        Af[bc, w] = math.exp(acc)


@cuda.jit(cache=CACHE)
def chunk_scan_states_kernel(Hc, H, Htot, Af, nchunks, exclusive, write_tot, rule):
    """Combine the chunks' contributions ``Hc`` (B * nchunks, F, M + 1) with the initial state ``H``.

    ``H`` becomes the final state; ``Af`` every chunk's total factor (not read by
    the additive rule); each element goes through the chunks with the rule's
    :func:`linattn_nb.ops._cuda_common.carry`.  ``exclusive``: Hc <- the state before
    each chunk; ``write_tot``: Htot <- the final state too, in Htot's dtype.
    """
    B, F, M1 = H.shape
    W = Af.shape[1]
    total = B * F * M1
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for idx in range(start, total, stride):
        b, i, col = _state_index(idx, F, M1)
        w = i if W > 1 else 0
        run = float64(H[b, i, col])
        for c in range(nchunks):
            h = float64(Hc[b * nchunks + c, i, col])
            if exclusive:
                Hc[b * nchunks + c, i, col] = run
            f = 1.0
            if rule != RULE_ADDITIVE:
                f = Af[b * nchunks + c, w]
            run = carry(rule, run, h, f)
        H[b, i, col] = run
        if write_tot:
            Htot[b, i, col] = run


@cuda.jit(cache=CACHE)
def pack_column_kernel(src, dst, w):
    """``dst[b, t, w] = src[b, t]``: one per-token input (B, N), any strides, into column ``w``
    of the (B, N, W) float64 array the sequence kernel reads (the delta rules' log-decay and beta)."""
    B, N = src.shape
    total = B * N
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for idx in range(start, total, stride):
        b = idx // N
        t = idx - b * N
        dst[b, t, w] = src[b, t]


@cuda.jit(cache=CACHE)
def copy4d_kernel(src, dst):
    """dst[...] = src[...] for 4-d arrays of equal shape, any strides and dtypes."""
    A, Bn, N, F = src.shape
    total = A * Bn * N * F
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for idx in range(start, total, stride):
        b1, b2, t, i = unravel4(idx, Bn, N, F)
        dst[b1, b2, t, i] = src[b1, b2, t, i]
