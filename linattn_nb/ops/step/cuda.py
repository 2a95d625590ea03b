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
* query: the same without the update, with the output mode ``norm`` (any
  rule's state).
* prefill: one thread per (b, i, m) accumulates ``sum_t phi(k_ti) v_tm`` in a
  register and adds it to S once; z by the m = 0 threads.  No atomics, no
  barriers.
* delta_step: the delta rules (delta, gated delta), step and prefill
  (``read=False``); see :func:`delta_step_py`.
* rule_step, rule_prefill: the same for the rules with a factor per token
  (decay, gate) and for ``normalize=False``.  ``lg`` (B, T, G)
  float64 holds the log-factors: G = 0 none (factor 1), G = 1 one per token
  (decay), G = F one per feature (gate); ``exp(-inf) = 0`` resets exactly.
  The step keeps each token's factors in a fourth scratch row (``feat`` is
  (B, 4, F)); the prefill thread runs the recurrence of its element
  ``s <- a_t s + phi(k_t) v_t`` in a register.  ``norm`` is the output mode
  of :func:`linattn_nb.ops._codes.norm_mode`.

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
from .._codes import KERNEL_CODE_L2, KERNEL_CODE_SILU_L2, NORM_FLOOR, NORM_NONE, norm_mode
from .._cuda_common import phi


# The elementwise map: linattn_nb.ops._cuda_common.phi (inlined device
# function; ``zero``/``one`` of the state dtype keep float32 kernels in float32).
# The row maps (l2, silu_l2) divide each token's row by its norm: every thread
# that needs a feature of the row computes the norm itself (``row_norm``, a
# loop over the row, like the normaliser's sum every thread does), so the
# kernels need no extra barrier.


@cuda.jit(device=True, inline=True)
def pre_l2(x, code):
    """An element before the row's L2 normalisation, in float64: SiLU for ``silu_l2``, else itself."""
    y = 1.0 * x
    if code == KERNEL_CODE_SILU_L2:
        y = y / (1.0 + math.exp(-y))  # exp overflow: y / inf = -0, as the NumPy map
    return y


@cuda.jit(device=True, inline=True)
def row_norm(x, b, t, code):
    """The float64 L2 norm of row ``x[b, t]`` after SiLU (``silu_l2``) for the row maps; 1 for the others."""
    if code != KERNEL_CODE_L2 and code != KERNEL_CODE_SILU_L2:
        return 1.0
    acc = 0.0
    for i in range(x.shape[2]):
        y = pre_l2(x[b, t, i], code)
        acc += y * y
    return math.sqrt(acc)


@cuda.jit(device=True, inline=True)
def feature(x, b, t, i, code, nrm, zero, one):
    """Feature i of row ``x[b, t]``: the elementwise map, or for the row maps the element over
    ``nrm`` (:func:`row_norm`; a zero row maps to zero, exactly as the NumPy maps)."""
    if code == KERNEL_CODE_L2 or code == KERNEL_CODE_SILU_L2:
        if nrm > 0.0:
            return pre_l2(x[b, t, i], code) / nrm
        return 0.0
    return phi(x[b, t, i], code, zero, one)


@cuda.jit(device=True, inline=True)
def row_sum(feat, b, r, F):
    """The float64 sum of row ``r`` of ``feat[b]`` (the first ``F`` entries): every thread sums it itself."""
    acc = 0.0
    for i in range(F):
        acc += feat[b, r, i]
    return acc


@cuda.jit(device=True, inline=True)
def normaliser(feat, b, F, eps, norm):
    """``phi(q)^T z`` from its terms in row 2 of ``feat[b]``, floored at ``eps`` when ``norm`` is NORM_FLOOR."""
    den = row_sum(feat, b, 2, F)
    if norm == NORM_FLOOR and den < eps:
        den = eps
    return den


@cuda.jit(device=True, inline=True)
def put_out(out, b, t, m, acc, den, norm):
    """Write an output: the numerator ``acc`` (NORM_NONE) or ``acc / den``."""
    if norm == NORM_NONE:
        out[b, t, m] = acc
    else:
        out[b, t, m] = acc / den


@cuda.jit(device=True, inline=True)
def token_factor(lg, b, t, i, one):
    """The factor of feature i at token t: 1 (G = 0), ``exp(lg[b, t, 0])`` (G = 1) or ``exp(lg[b, t, i])``."""
    G = lg.shape[2]
    if G == 0:
        return one
    if G == 1:
        return math.exp(lg[b, t, 0])
    return math.exp(lg[b, t, i])


def state_step_py(q, k, v, S, z, out, feat, code, eps, zero, one):
    """One block per batch entry b; per token: features (strided over i), barrier, columns m."""
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    T = q.shape[1]
    F = S.shape[1]
    M = S.shape[2]
    for t in range(T):
        nk = row_norm(k, b, t, code)
        nq = row_norm(q, b, t, code)
        for i in range(tid, F, nt):
            feat[b, 0, i] = feature(k, b, t, i, code, nk, zero, one)
            feat[b, 1, i] = feature(q, b, t, i, code, nq, zero, one)
            zi = z[b, i] + feat[b, 0, i]
            z[b, i] = zi
            feat[b, 2, i] = feat[b, 1, i] * zi
        cuda.syncthreads()
        den = normaliser(feat, b, F, eps, NORM_FLOOR)  # eps = -inf: no floor
        for m in range(tid, M, nt):
            w = v[b, t, m]
            acc = zero
            for i in range(F):
                s = S[b, i, m] + feat[b, 0, i] * w
                S[b, i, m] = s
                acc += feat[b, 1, i] * s
            out[b, t, m] = acc / den
        cuda.syncthreads()


def state_query_py(q, S, z, out, feat, code, eps, norm, zero, one):
    """As the step without the update (every query reads the same state), with the output mode ``norm``."""
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    T = q.shape[1]
    F = S.shape[1]
    M = S.shape[2]
    for t in range(T):
        nq = row_norm(q, b, t, code)
        for i in range(tid, F, nt):
            feat[b, 1, i] = feature(q, b, t, i, code, nq, zero, one)
            feat[b, 2, i] = feat[b, 1, i] * z[b, i]
        cuda.syncthreads()
        den = normaliser(feat, b, F, eps, norm)
        for m in range(tid, M, nt):
            acc = zero
            for i in range(F):
                acc += feat[b, 1, i] * S[b, i, m]
            put_out(out, b, t, m, acc, den, norm)
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
            a = feature(k, b, t, i, code, row_norm(k, b, t, code), zero, one)
            acc += a * v[b, t, m]
        S[b, i, m] += acc
    if m == 0:
        zi = z[b, i]
        for t in range(T):
            a = feature(k, b, t, i, code, row_norm(k, b, t, code), zero, one)
            zi += a
        z[b, i] = zi


def rule_step_py(q, k, v, S, z, out, feat, lg, code, eps, norm, zero, one):
    """As :func:`state_step_py`, each token first scaling the state by its factors (row 3 of ``feat``)."""
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    T = q.shape[1]
    F = S.shape[1]
    M = S.shape[2]
    for t in range(T):
        nk = row_norm(k, b, t, code)
        nq = row_norm(q, b, t, code)
        for i in range(tid, F, nt):
            feat[b, 3, i] = token_factor(lg, b, t, i, one)
            feat[b, 0, i] = feature(k, b, t, i, code, nk, zero, one)
            feat[b, 1, i] = feature(q, b, t, i, code, nq, zero, one)
            zi = feat[b, 3, i] * z[b, i] + feat[b, 0, i]
            z[b, i] = zi
            feat[b, 2, i] = feat[b, 1, i] * zi
        cuda.syncthreads()
        den = normaliser(feat, b, F, eps, norm)
        for m in range(tid, M, nt):
            w = v[b, t, m]
            acc = zero
            for i in range(F):
                s = feat[b, 3, i] * S[b, i, m] + feat[b, 0, i] * w
                S[b, i, m] = s
                acc += feat[b, 1, i] * s
            put_out(out, b, t, m, acc, den, norm)
        cuda.syncthreads()


def rule_prefill_py(k, v, S, z, lg, code, zero, one):
    """Thread (b, i, m): s <- a_ti s + phi(k[b, t, i]) v[b, t, m] over the tokens; z by the m = 0 threads.

    The factor is float64, so the running element is too (one register; stored in the state dtype).
    """
    b = cuda.blockIdx.x
    i = cuda.blockIdx.y
    m = cuda.blockIdx.z * cuda.blockDim.x + cuda.threadIdx.x
    T = k.shape[1]
    M = S.shape[2]
    G = lg.shape[2]
    gi = i if G > 1 else 0
    if m < M:
        s = S[b, i, m]
        for t in range(T):
            a = feature(k, b, t, i, code, row_norm(k, b, t, code), zero, one)
            if G == 0:
                s = s + a * v[b, t, m]
            else:
                s = math.exp(lg[b, t, gi]) * s + a * v[b, t, m]
        S[b, i, m] = s
    if m == 0:
        zi = z[b, i]
        for t in range(T):
            a = feature(k, b, t, i, code, row_norm(k, b, t, code), zero, one)
            if G == 0:
                zi = zi + a
            else:
                zi = math.exp(lg[b, t, gi]) * zi + a
        z[b, i] = zi


def delta_step_py(q, k, v, S, z, out, feat, lg, beta, code, eps, norm, read, zero, one):
    """The delta rules, one block per batch entry: ``H <- a (I - beta k k^T) H + beta k [v 1]``.

    Per token: features strided over i (rows 0 and 1 of ``feat``) with the
    terms of ``k^T z`` (row 2), barrier, every thread sums them, barrier, the
    z update with the normaliser's terms (row 2 again), barrier; then one
    thread per column m: ``k^T S[:, m]``, the update
    ``S[:, m] <- a S[:, m] + beta k (v_m - a k^T S[:, m])`` and the read.
    ``lg`` (B, T, G): G = 0 the delta rule (a = 1), G = 1 the gated delta
    rule; ``beta`` (B, T) float64.  ``read`` False: no outputs (a prefill;
    ``q`` and ``out`` are not read or written).  The factor and the write
    strength are float64, so is the update arithmetic (stored in the state
    dtype).
    """
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    T = k.shape[1]
    F = S.shape[1]
    M = S.shape[2]
    G = lg.shape[2]
    for t in range(T):
        nk = row_norm(k, b, t, code)
        nq = row_norm(q, b, t, code) if read else 1.0
        a = math.exp(lg[b, t, 0]) if G > 0 else 1.0
        bt = beta[b, t]
        for i in range(tid, F, nt):
            feat[b, 0, i] = feature(k, b, t, i, code, nk, zero, one)
            if read:
                feat[b, 1, i] = feature(q, b, t, i, code, nq, zero, one)
            feat[b, 2, i] = feat[b, 0, i] * z[b, i]
        cuda.syncthreads()
        kz = row_sum(feat, b, 2, F)
        rz = bt * (1.0 - a * kz)
        cuda.syncthreads()  # row 2 is read by every thread before it is rewritten
        for i in range(tid, F, nt):
            zi = a * z[b, i] + rz * feat[b, 0, i]
            z[b, i] = zi
            feat[b, 2, i] = feat[b, 1, i] * zi
        cuda.syncthreads()
        den = normaliser(feat, b, F, eps, norm)
        for m in range(tid, M, nt):
            d = zero
            for i in range(F):
                d += feat[b, 0, i] * S[b, i, m]
            r = bt * (v[b, t, m] - a * d)
            acc = zero
            for i in range(F):
                s = a * S[b, i, m] + r * feat[b, 0, i]
                S[b, i, m] = s
                acc += feat[b, 1, i] * s
            if read:
                put_out(out, b, t, m, acc, den, norm)
        cuda.syncthreads()


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
                  "state_prefill": state_prefill_py, "first_nonfinite": first_nonfinite_py,
                  "rule_step": rule_step_py, "rule_prefill": rule_prefill_py,
                  "delta_step": delta_step_py}
_JIT = {}


def kernels():
    """``cuda.jit`` kernels (compiled lazily per signature on first launch)."""
    if not _JIT:
        for name, fn in PYTHON_KERNELS.items():
            _JIT[name] = cuda.jit(fn)
    return _JIT


def _eps(eps):
    return -math.inf if eps is None else float(eps)


def _consts(S):
    """The kernels' ``zero`` and ``one`` in the state dtype."""
    return S.dtype.type(0), S.dtype.type(1)


def _prefill_grid(B, F, M):
    """Launch configuration of the prefill kernels: one thread per (batch entry, feature, value column)."""
    nt = min(_threads(), max(32, M))
    return (B, F, (M + nt - 1) // nt), nt


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
    kernels()["state_step"][B, _threads()](q, k, v, S, z, out, feat, np.int64(code), _eps(eps), *_consts(S))
    return out


def state_query(q, S, z, out, feat, *, code, eps, normalize=True):
    """Launch the query kernel: one block per batch entry, the state unchanged (any rule's state;
    ``normalize=False``: numerators)."""
    B = q.shape[0]
    if B == 0 or q.shape[1] == 0:
        return out
    kernels()["state_query"][B, _threads()](q, S, z, out, feat, np.int64(code), _eps(eps),
                                             np.int64(norm_mode(eps, normalize)), *_consts(S))
    return out


def state_prefill(k, v, S, z, *, code):
    """Launch the prefill kernel: one thread per (batch entry, feature, value column)."""
    B, T, _ = k.shape
    if B == 0 or T == 0:
        return
    grid, nt = _prefill_grid(B, S.shape[1], S.shape[2])
    kernels()["state_prefill"][grid, nt](k, v, S, z, np.int64(code), *_consts(S))


def log_factors(inputs, B, T):
    """The kernels' ``lg`` (B, T, G) float64 on the device from a launcher's ``inputs`` (None: G = 0).

    Host arrays are copied to the device; device arrays are used as they are.
    """
    from .cpu import log_factors as host_log_factors

    if inputs:
        x = inputs.get("log_decay", inputs.get("log_gate"))
        if hasattr(x, "copy_to_host"):
            return x.reshape((B, T, 1) if "log_decay" in inputs else (B, T, x.shape[-1]))
    return cuda.to_device(host_log_factors(inputs, B, T))


def rule_step(q, k, v, S, z, out, feat, *, code, eps, inputs=None, normalize=True):
    """Launch the rule step kernel: one block per batch entry; ``feat`` is (B, 4, F)."""
    B, T = q.shape[0], q.shape[1]
    if B == 0 or T == 0:
        return out
    kernels()["rule_step"][B, _threads()](q, k, v, S, z, out, feat, log_factors(inputs, B, T), np.int64(code),
                                          _eps(eps), np.int64(norm_mode(eps, normalize)), *_consts(S))
    return out


def rule_prefill(k, v, S, z, *, code, inputs=None):
    """Launch the rule prefill kernel: one thread per (batch entry, feature, value column)."""
    B, T, _ = k.shape
    if B == 0 or T == 0:
        return
    grid, nt = _prefill_grid(B, S.shape[1], S.shape[2])
    kernels()["rule_prefill"][grid, nt](k, v, S, z, log_factors(inputs, B, T), np.int64(code), *_consts(S))


def delta_arrays(inputs, B, T):
    """The kernels' ``lg`` (B, T, G) (G = 1 with ``log_decay``: the gated delta rule, else 0) and
    ``beta`` (B, T), float64 device arrays, from a delta-rule launcher's ``inputs`` (host arrays are
    copied to the device, device arrays used as they are)."""
    def dev(x, shape):
        if hasattr(x, "copy_to_host"):
            return x.reshape(shape)
        return cuda.to_device(np.ascontiguousarray(x, dtype=np.float64).reshape(shape))

    beta = dev(inputs["beta"], (B, T))
    lg = dev(inputs["log_decay"], (B, T, 1)) if "log_decay" in inputs else cuda.to_device(np.zeros((B, T, 0)))
    return lg, beta


def delta_step(q, k, v, S, z, out, feat, *, code, eps, inputs, normalize=False):
    """Launch the delta-rule step kernel: one block per batch entry; ``feat`` is (B, >= 3, F).

    ``inputs``: ``{"beta": (B, T)}`` (delta) or ``{"beta", "log_decay"}`` (gated delta).
    """
    B, T = q.shape[0], q.shape[1]
    if B == 0 or T == 0:
        return out
    lg, beta = delta_arrays(inputs, B, T)
    kernels()["delta_step"][B, _threads()](q, k, v, S, z, out, feat, lg, beta, np.int64(code), _eps(eps),
                                           np.int64(norm_mode(eps, normalize)), True, *_consts(S))
    return out


def delta_prefill(k, v, S, z, feat, *, code, inputs):
    """Launch the delta-rule kernel without outputs: the state after T tokens."""
    B, T = k.shape[0], k.shape[1]
    if B == 0 or T == 0:
        return
    lg, beta = delta_arrays(inputs, B, T)
    out = cuda.device_array((1, 1, 1), dtype=S.dtype)  # not written (read=False)
    kernels()["delta_step"][B, _threads()](k, k, v, S, z, out, feat, lg, beta, np.int64(code), -math.inf,
                                           np.int64(NORM_NONE), False, *_consts(S))
