"""CUDA launchers of causal linear attention: ``scan`` and ``chunked``.

Both follow the launcher contract of :mod:`linattn_nb.ops.registry`, on
device arrays::

    launcher(q, k, v, S, z, out, *, code, eps) -> out

q, k : (B, N, F) or (B1, B2, N, F) device arrays (any non-negative strides;
raw inputs when ``code`` > 0, the elementwise map is applied in the kernel),
v, out : (B, N, M) or (B1, B2, N, M), S : (B, F, M) and z : (B, F) float64
device arrays, C-contiguous, updated in place from the initial to the final
state.  Any dtype mix of float16/32/64; accumulation in float32, or float64
when an input is float64 (see :mod:`linattn_nb.ops._cuda_kernels`).

* ``scan``: one block per (batch entry, block of value columns) walks the
  sequence; parallelism B x ceil(M / config.CUDA_VALUE_COLS) blocks.
* ``chunked``: three launches. (1) the state increment of every chunk of
  ``config.CUDA_CHUNK_SIZE`` tokens, in parallel over (batch, chunk, column
  block); (2) an exclusive prefix over chunks in float64, plus the initial
  state, which also gives the final state; (3) every chunk runs the scan from
  its own starting state, in parallel.  Parallelism B x chunks x column
  blocks, for long sequences with few batch entries (Yang et al. 2024, GLA,
  Sec. 2.2, for the chunk decomposition).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ... import config
from .. import _cuda_kernels as K


def _prepare(q, k, v, S, z, out):
    views = []
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        x4 = K.as_4d(x)
        if x4 is None:
            raise ValueError(f"{name}: the leading dimensions of shape {tuple(x.shape)} cannot be merged "
                             "into one batch axis without a copy")
        views.append(x4)
    q4, k4, v4, o4 = views
    B1, B2, N, F = (int(s) for s in q4.shape)
    M = int(v4.shape[3])
    B = B1 * B2
    if tuple(S.shape) != (B, F, M) or tuple(z.shape) != (B, F):
        raise ValueError(f"state shapes {tuple(S.shape)}, {tuple(z.shape)} do not match (B={B}, F={F}, M={M})")
    acc = K.acc_name(q.dtype, k.dtype, v.dtype)
    return q4, k4, v4, o4, B, B2, N, F, M, acc


def _seq(F, M, acc):
    """(kernel, threads per block, column blocks) for the launch configuration in config."""
    R, C, G, MB, T = K.seq_config(F, M, np.dtype(acc).itemsize)
    return K.seq_kernel(R, C, G, MB, T, acc), K.threads_per_block(R, C, G, MB), -(-M // MB)


def causal_scan_cuda(q, k, v, S, z, out, *, code, eps):
    """Causal scan on the GPU; see the module docstring for the contract."""
    q4, k4, v4, o4, B, B2, N, F, M, acc = _prepare(q, k, v, S, z, out)
    if N == 0 or B == 0:
        return out
    kern, nth, nmb = _seq(F, M, acc)
    clip = eps is not None
    H = cuda.device_array((B, F, M + 1), dtype=np.dtype(acc))
    Hout = cuda.device_array((B, F, M + 1), dtype=np.dtype(acc))
    grid = K.helper_grid(B * F * (M + 1))
    K.state_copy_kernel[grid](S, z, H, True)
    kern[(B, nmb), nth](q4, k4, v4, o4, H, Hout, N, N, 1, 1, B2, int(code),
                        float(eps if clip else 0.0), clip, True, True, True, True)
    K.state_copy_kernel[grid](S, z, Hout, False)
    return out


def causal_chunked_cuda(q, k, v, S, z, out, *, code, eps, chunk_size=None):
    """Chunkwise-parallel causal attention on the GPU (module docstring).

    ``chunk_size`` defaults to ``config.CUDA_CHUNK_SIZE``; a sequence of one
    chunk runs :func:`causal_scan_cuda`.
    """
    L = int(config.CUDA_CHUNK_SIZE if chunk_size is None else chunk_size)
    if L < 1:
        raise ValueError(f"chunk_size must be >= 1, got {L}")
    q4, k4, v4, o4, B, B2, N, F, M, acc = _prepare(q, k, v, S, z, out)
    if N == 0 or B == 0:
        return out
    nc = -(-N // L)
    if nc == 1:
        return causal_scan_cuda(q, k, v, S, z, out, code=code, eps=eps)
    kern, nth, nmb = _seq(F, M, acc)
    clip = eps is not None
    e = float(eps if clip else 0.0)
    Hc = cuda.device_array((B * nc, F, M + 1), dtype=np.dtype(acc))
    # (1) per-chunk sums of phi(k) v^T and phi(k)
    kern[(B * nc, nmb), nth](q4, k4, v4, o4, Hc, Hc, N, L, nc, 1, B2, int(code), e, clip,
                             False, True, False, True)
    # (2) exclusive prefix over chunks + initial state; final state into S, z
    K.chunk_scan_states_kernel[K.helper_grid(B * F * (M + 1))](Hc, S, z, Hc, nc, True, False)
    # (3) every chunk scans from its own starting state
    kern[(B * nc, nmb), nth](q4, k4, v4, o4, Hc, Hc, N, L, nc, 1, B2, int(code), e, clip,
                             True, True, True, False)
    return out
