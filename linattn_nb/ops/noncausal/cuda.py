"""CUDA launcher of non-causal linear attention: aggregate, then query.

Launcher contract as in :mod:`linattn_nb.ops.causal.cuda`.  Three launches:
(1) the state increment ``sum phi(k_j) v_j^T``, ``sum phi(k_j)`` of every
chunk of ``config.CUDA_CHUNK_SIZE`` tokens, in parallel over (batch, chunk,
column block); (2) the sum over chunks plus the initial state, in float64,
which is the final state; (3) every token reads that state:
``o_i = phi(q_i)^T S / max(phi(q_i)^T z, eps)`` (Katharopoulos et al. 2020,
Eq. 7), in parallel over (batch, chunk of queries, column block).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ... import config
from .. import _cuda_kernels as K
from ..causal.cuda import _prepare, _seq


def noncausal_aggregate_cuda(q, k, v, S, z, out, *, code, eps, chunk_size=None):
    """Non-causal linear attention on the GPU (see the module docstring)."""
    L = int(config.CUDA_CHUNK_SIZE if chunk_size is None else chunk_size)
    if L < 1:
        raise ValueError(f"chunk_size must be >= 1, got {L}")
    q4, k4, v4, o4, B, B2, N, F, M, acc = _prepare(q, k, v, S, z, out)
    if N == 0 or B == 0:
        return out
    nc = -(-N // L)
    kern, nth, nmb = _seq(F, M, acc)
    clip = eps is not None
    e = float(eps if clip else 0.0)
    dt = np.dtype(acc)
    Hc = cuda.device_array((B * nc, F, M + 1), dtype=dt)
    Htot = cuda.device_array((B, F, M + 1), dtype=dt)
    kern[(B * nc, nmb), nth](q4, k4, v4, o4, Hc, Hc, N, L, nc, 1, B2, int(code), e, clip,
                             False, True, False, True)
    K.chunk_scan_states_kernel[K.helper_grid(B * F * (M + 1))](Hc, S, z, Htot, nc, False, True)
    kern[(B * nc, nmb), nth](q4, k4, v4, o4, Htot, Htot, N, L, nc, nc, B2, int(code), e, clip,
                             True, False, True, False)
    return out
