"""CUDA kernels of recurrent decoding: state step, query and prefill.

State layout on the GPU: ``S`` (B, F, M) (canonical), ``z`` (B, F), in the
state dtype; ``feat`` (B, 3, F) is scratch in the state dtype.  Inputs q, k
(B, T, D) are raw (``code`` > 0: the elementwise map is applied inline) or
features (code 0); v (B, T, M); out (B, T, M).

* step: one block per batch entry, ``config.CUDA_STEP_THREADS`` threads.  Per
  token: threads stride over the features (phi(k), phi(q), z update, the
  terms of the normaliser into ``feat``), ``syncthreads``, then one thread per
  output coordinate m updates column m of S and reads it (a warp touches
  consecutive m: coalesced), ``syncthreads``.  Every thread runs the same
  token loop, so the barriers are uniform.
* query: the same without the update.
* prefill: one thread per (b, i, m) accumulates ``sum_t phi(k_ti) v_tm`` in a
  register and adds it to S once; z by the m = 0 threads.  No atomics, no
  barriers.

The kernels are plain Python functions (``*_py``, :data:`PYTHON_KERNELS`)
wrapped with ``cuda.jit`` on first use, so that importing this module touches
no GPU and the tests can compile them to PTX (``numba.cuda.compile_ptx``).
Accumulators are float64 for the normaliser and the state dtype for the
numerator, as on the CPU.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ... import config
from .._cuda_common import phi


# The elementwise map: linattn_nb.ops._cuda_common.phi (inlined device
# function; ``zero``/``one`` of the state dtype keep float32 kernels in float32).


def state_step_py(q, k, v, S, z, out, feat, code, eps, zero, one):
    """One block per batch entry b; per token: features (strided over i), barrier, columns m."""
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    T = q.shape[1]
    F = S.shape[1]
    M = S.shape[2]
    for t in range(T):
        for i in range(tid, F, nt):
            a = phi(k[b, t, i], code, zero, one)
            c = phi(q[b, t, i], code, zero, one)
            feat[b, 0, i] = a
            feat[b, 1, i] = c
            zi = z[b, i] + feat[b, 0, i]
            z[b, i] = zi
            feat[b, 2, i] = feat[b, 1, i] * zi
        cuda.syncthreads()
        den = 0.0
        for i in range(F):
            den += feat[b, 2, i]
        if den < eps:  # eps = -inf: no floor
            den = eps
        for m in range(tid, M, nt):
            w = v[b, t, m]
            acc = zero
            for i in range(F):
                s = S[b, i, m] + feat[b, 0, i] * w
                S[b, i, m] = s
                acc += feat[b, 1, i] * s
            out[b, t, m] = acc / den
        cuda.syncthreads()


def state_query_py(q, S, z, out, feat, code, eps, zero, one):
    """As the step, without the update: every query reads the same state."""
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    T = q.shape[1]
    F = S.shape[1]
    M = S.shape[2]
    for t in range(T):
        for i in range(tid, F, nt):
            c = phi(q[b, t, i], code, zero, one)
            feat[b, 1, i] = c
            feat[b, 2, i] = feat[b, 1, i] * z[b, i]
        cuda.syncthreads()
        den = 0.0
        for i in range(F):
            den += feat[b, 2, i]
        if den < eps:
            den = eps
        for m in range(tid, M, nt):
            acc = zero
            for i in range(F):
                acc += feat[b, 1, i] * S[b, i, m]
            out[b, t, m] = acc / den
        cuda.syncthreads()


def state_prefill_py(k, v, S, z, code, zero, one):
    """Thread (b, i, m): S[b, i, m] += sum_t phi(k[b, t, i]) v[b, t, m]; z by the m = 0 threads."""
    b = cuda.blockIdx.x
    i = cuda.blockIdx.y
    m = cuda.blockIdx.z * cuda.blockDim.x + cuda.threadIdx.x
    T = k.shape[1]
    M = S.shape[2]
    if m < M:
        acc = zero
        for t in range(T):
            a = phi(k[b, t, i], code, zero, one)
            acc += a * v[b, t, m]
        S[b, i, m] += acc
    if m == 0:
        zi = z[b, i]
        for t in range(T):
            a = phi(k[b, t, i], code, zero, one)
            zi += a
        z[b, i] = zi


def first_nonfinite_py(x, flag, which):
    """flag[0] = which when any element of the 3-D array x is NaN or inf."""
    j = cuda.grid(1)
    if j < x.size:
        T = x.shape[1]
        D = x.shape[2]
        bb = j // (T * D)
        r = j - bb * T * D
        t = r // D
        d = r - t * D
        y = x[bb, t, d]
        if y * 0 != 0:
            flag[0] = which


PYTHON_KERNELS = {"state_step": state_step_py, "state_query": state_query_py,
                  "state_prefill": state_prefill_py, "first_nonfinite": first_nonfinite_py}
_JIT = {}


def kernels():
    """``cuda.jit`` kernels (compiled lazily per signature on first launch)."""
    if not _JIT:
        for name, fn in PYTHON_KERNELS.items():
            _JIT[name] = cuda.jit(fn)
    return _JIT


def _eps(eps):
    return -math.inf if eps is None else float(eps)


def _threads():
    nt = int(config.CUDA_STEP_THREADS)
    if nt < 1:
        raise ValueError(f"config.CUDA_STEP_THREADS must be >= 1, got {nt}")
    return nt


def check_nonfinite(*arrays):
    """0 when the 3-D device arrays are all finite, else the 1-based index of the first bad one.

    One counting kernel per array and one device-to-host copy (a sync).
    """
    K = kernels()["first_nonfinite"]
    flag = cuda.to_device(np.zeros(1, dtype=np.int64))
    nt = _threads()
    for which in range(len(arrays), 0, -1):
        x = arrays[which - 1]
        if x.size:
            K[(x.size + nt - 1) // nt, nt](x, flag, which)
    return int(flag.copy_to_host()[0])


def state_step(q, k, v, S, z, out, feat, *, code, eps):
    """Launch the step kernel: one block per batch entry."""
    B = q.shape[0]
    if B == 0 or q.shape[1] == 0:
        return out
    kernels()["state_step"][B, _threads()](q, k, v, S, z, out, feat, np.int64(code), _eps(eps),
                                            S.dtype.type(0), S.dtype.type(1))
    return out


def state_query(q, S, z, out, feat, *, code, eps):
    """Launch the query kernel: one block per batch entry, the state unchanged."""
    B = q.shape[0]
    if B == 0 or q.shape[1] == 0:
        return out
    kernels()["state_query"][B, _threads()](q, S, z, out, feat, np.int64(code), _eps(eps),
                                             S.dtype.type(0), S.dtype.type(1))
    return out


def state_prefill(k, v, S, z, *, code):
    """Launch the prefill kernel: one thread per (batch entry, feature, value column)."""
    B, T, _ = k.shape
    F = S.shape[1]
    M = S.shape[2]
    if B == 0 or T == 0:
        return
    nt = min(_threads(), max(32, M))
    grid = (B, F, (M + nt - 1) // nt)
    kernels()["state_prefill"][grid, nt](k, v, S, z, np.int64(code), S.dtype.type(0), S.dtype.type(1))
