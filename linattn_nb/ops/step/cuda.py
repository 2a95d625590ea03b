"""CUDA kernels of recurrent decoding: state step, query and prefill.

State layout on the GPU: ``S`` (B, F, M) (canonical), ``z`` (B, F), in the
state dtype, double-buffered (:class:`DoubleBuffer`); ``feat`` (B, 4,
max(F, 2)) is scratch in the state dtype and ``flag`` (1,) int32 the
finiteness flag.  Inputs q, k (B, T, D) are raw (``code`` > 0: the
elementwise map is applied inline) or features (code 0); v (B, T, M); out
(B, T, M); float16, float32 or float64, each value converted to the state
dtype as it is loaded.

No host round-trips: a step, query or prefill is **one kernel
launch**, with no host-to-device copy, no allocation and no separate check
kernel; the only device-to-host copy is the read of ``flag`` when the caller
asks for the finiteness check (``check=True``).  The kernels test every q,
k, v value they load and OR a bit (1 q, 2 k, 4 v) into ``flag``; ``flag`` is
zero between calls (the host sets it back after a read that found a bit).
So that a refused call leaves the state untouched, a checked step or
prefill reads the state from one buffer of :class:`DoubleBuffer` and writes
the other (the same traffic as in place: every element is read once and
written once), and the host swaps the two only when the flag is clear;
unchecked calls update the current buffer in place (``Sout is S``).

Arithmetic is in the state dtype (float32 states: float32 features, row
norms of the row maps, normaliser, division and state updates).  float64
remains only where the inputs are float64: the rules' per-token
log-factors and write strengths (float64 arrays) are exponentiated in
float64 and rounded once to the state dtype (in the step kernels through
the ``feat`` scratch, so the per-element updates stay in the state dtype);
the rule prefill's running element, which multiplies by such a factor per
token, is float64 (one register, rounded once at the end).

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
  The step keeps each token's factors in a fourth scratch row of ``feat``;
  the prefill thread runs the recurrence of its element
  ``s <- a_t s + phi(k_t) v_t`` in a register.  ``norm`` is the output mode
  of :func:`linattn_nb.ops._codes.norm_mode`.

The kernels are plain Python functions (``*_py``, :data:`PYTHON_KERNELS`)
wrapped with ``cuda.jit`` on first use, so that importing this module touches
no GPU and the tests can compile them to PTX (``numba.cuda.compile_ptx``).
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

#: Bits of the finiteness flag: the input that held NaN or inf.
BAD_Q, BAD_K, BAD_V = 1, 2, 4


@cuda.jit(device=True, inline=True)
def bad_bit(x, bit):
    """``bit`` when ``x`` is NaN or inf, else 0 (comparisons only: no floating-point exception)."""
    if x == x and abs(x) < math.inf:
        return 0
    return bit


@cuda.jit(device=True, inline=True)
def pre_l2(x, code, one):
    """An element before the row's L2 normalisation, in the state dtype: SiLU for ``silu_l2``, else itself."""
    y = one * x
    if code == KERNEL_CODE_SILU_L2:
        y = y / (one + math.exp(-y))  # exp overflow: y / inf = -0, as the NumPy map
    return y


@cuda.jit(device=True, inline=True)
def row_norm(x, b, t, code, zero, one):
    """The L2 norm of row ``x[b, t]`` (after SiLU for ``silu_l2``) for the row maps, in the state dtype;
    1 for the others."""
    if code != KERNEL_CODE_L2 and code != KERNEL_CODE_SILU_L2:
        return one
    acc = zero
    for i in range(x.shape[2]):
        y = pre_l2(x[b, t, i], code, one)
        acc += y * y
    return math.sqrt(acc)


@cuda.jit(device=True, inline=True)
def feature(x, b, t, i, code, nrm, zero, one):
    """Feature i of row ``x[b, t]`` in the state dtype: the elementwise map, or for the row maps the
    element over ``nrm`` (:func:`row_norm`; a zero row maps to zero, exactly as the NumPy maps)."""
    if code == KERNEL_CODE_L2 or code == KERNEL_CODE_SILU_L2:
        if nrm > zero:
            return pre_l2(x[b, t, i], code, one) / nrm
        return zero
    return phi(zero + x[b, t, i], code, zero, one)


@cuda.jit(device=True, inline=True)
def row_sum(feat, b, r, F, zero):
    """The sum of row ``r`` of ``feat[b]`` (the first ``F`` entries) in the state dtype: every thread sums it."""
    acc = zero
    for i in range(F):
        acc += feat[b, r, i]
    return acc


@cuda.jit(device=True, inline=True)
def normaliser(feat, b, F, eps, norm, zero):
    """``phi(q)^T z`` from its terms in row 2 of ``feat[b]``, floored at ``eps`` (state dtype) when ``norm``
    is NORM_FLOOR."""
    den = row_sum(feat, b, 2, F, zero)
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
    """The factor of feature i at token t: 1 (G = 0), ``exp(lg[b, t, 0])`` (G = 1) or ``exp(lg[b, t, i])``
    (float64; the caller stores it in the state dtype)."""
    G = lg.shape[2]
    if G == 0:
        return 1.0
    if G == 1:
        return math.exp(lg[b, t, 0])
    return math.exp(lg[b, t, i])


@cuda.jit(device=True, inline=True)
def raise_flag(flag, bad):
    """OR this thread's bits into the finiteness flag (one atomic per thread that found one)."""
    if bad != 0:
        cuda.atomic.or_(flag, 0, bad)


def state_step_py(q, k, v, S, z, S2, z2, out, feat, flag, check, code, eps, zero, one):
    """One block per batch entry b; per token: features (strided over i), barrier, columns m.

    Reads the state from ``S, z`` at the first token and from ``S2, z2`` after
    it, writes ``S2, z2`` (which may be ``S, z``).  ``check``: OR the bits of
    the inputs holding NaN or inf into ``flag[0]``.
    """
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    T = q.shape[1]
    F = S.shape[1]
    M = S.shape[2]
    bad = 0
    for t in range(T):
        Sr = S2
        zr = z2
        if t == 0:
            Sr = S
            zr = z
        nk = row_norm(k, b, t, code, zero, one)
        nq = row_norm(q, b, t, code, zero, one)
        for i in range(tid, F, nt):
            if check:
                bad |= bad_bit(zero + q[b, t, i], BAD_Q) | bad_bit(zero + k[b, t, i], BAD_K)
            fk = feature(k, b, t, i, code, nk, zero, one)
            fq = feature(q, b, t, i, code, nq, zero, one)
            feat[b, 0, i] = fk
            feat[b, 1, i] = fq
            zi = zr[b, i] + fk
            z2[b, i] = zi
            feat[b, 2, i] = fq * zi
        cuda.syncthreads()
        den = normaliser(feat, b, F, eps, NORM_FLOOR, zero)  # eps = -inf: no floor
        for m in range(tid, M, nt):
            w = zero + v[b, t, m]
            if check:
                bad |= bad_bit(w, BAD_V)
            acc = zero
            for i in range(F):
                s = Sr[b, i, m] + feat[b, 0, i] * w
                S2[b, i, m] = s
                acc += feat[b, 1, i] * s
            out[b, t, m] = acc / den
        cuda.syncthreads()
    raise_flag(flag, bad)


def state_query_py(q, S, z, out, feat, flag, check, code, eps, norm, zero, one):
    """As the step without the update (every query reads the same state), with the output mode ``norm``."""
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    T = q.shape[1]
    F = S.shape[1]
    M = S.shape[2]
    bad = 0
    for t in range(T):
        nq = row_norm(q, b, t, code, zero, one)
        for i in range(tid, F, nt):
            if check:
                bad |= bad_bit(zero + q[b, t, i], BAD_Q)
            fq = feature(q, b, t, i, code, nq, zero, one)
            feat[b, 1, i] = fq
            feat[b, 2, i] = fq * z[b, i]
        cuda.syncthreads()
        den = normaliser(feat, b, F, eps, norm, zero)
        for m in range(tid, M, nt):
            acc = zero
            for i in range(F):
                acc += feat[b, 1, i] * S[b, i, m]
            put_out(out, b, t, m, acc, den, norm)
        cuda.syncthreads()
    raise_flag(flag, bad)


def state_prefill_py(k, v, S, z, S2, z2, flag, check, code, zero, one):
    """Thread (b, i, m): S2[b, i, m] = S[b, i, m] + sum_t phi(k[b, t, i]) v[b, t, m]; z by the m = 0
    threads.  ``check``: the m = 0 threads test k, the i = 0 threads v."""
    b = cuda.blockIdx.x
    i = cuda.blockIdx.y
    m = cuda.blockIdx.z * cuda.blockDim.x + cuda.threadIdx.x
    T = k.shape[1]
    M = S.shape[2]
    bad = 0
    if m < M:
        acc = zero
        for t in range(T):
            w = zero + v[b, t, m]
            if check and i == 0:
                bad |= bad_bit(w, BAD_V)
            a = feature(k, b, t, i, code, row_norm(k, b, t, code, zero, one), zero, one)
            acc += a * w
        S2[b, i, m] = S[b, i, m] + acc
    if m == 0:
        zi = z[b, i]
        for t in range(T):
            if check:
                bad |= bad_bit(zero + k[b, t, i], BAD_K)
            zi += feature(k, b, t, i, code, row_norm(k, b, t, code, zero, one), zero, one)
        z2[b, i] = zi
    raise_flag(flag, bad)


def rule_step_py(q, k, v, S, z, S2, z2, out, feat, lg, flag, check, code, eps, norm, zero, one):
    """As :func:`state_step_py`, each token first scaling the state by its factors (row 3 of ``feat``)."""
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    T = q.shape[1]
    F = S.shape[1]
    M = S.shape[2]
    bad = 0
    for t in range(T):
        Sr = S2
        zr = z2
        if t == 0:
            Sr = S
            zr = z
        nk = row_norm(k, b, t, code, zero, one)
        nq = row_norm(q, b, t, code, zero, one)
        for i in range(tid, F, nt):
            if check:
                bad |= bad_bit(zero + q[b, t, i], BAD_Q) | bad_bit(zero + k[b, t, i], BAD_K)
            feat[b, 3, i] = token_factor(lg, b, t, i, one)  # rounded to the state dtype once
            fk = feature(k, b, t, i, code, nk, zero, one)
            fq = feature(q, b, t, i, code, nq, zero, one)
            feat[b, 0, i] = fk
            feat[b, 1, i] = fq
            zi = feat[b, 3, i] * zr[b, i] + fk
            z2[b, i] = zi
            feat[b, 2, i] = fq * zi
        cuda.syncthreads()
        den = normaliser(feat, b, F, eps, norm, zero)
        for m in range(tid, M, nt):
            w = zero + v[b, t, m]
            if check:
                bad |= bad_bit(w, BAD_V)
            acc = zero
            for i in range(F):
                s = feat[b, 3, i] * Sr[b, i, m] + feat[b, 0, i] * w
                S2[b, i, m] = s
                acc += feat[b, 1, i] * s
            put_out(out, b, t, m, acc, den, norm)
        cuda.syncthreads()
    raise_flag(flag, bad)


def rule_prefill_py(k, v, S, z, S2, z2, lg, flag, check, code, zero, one):
    """Thread (b, i, m): s <- a_ti s + phi(k[b, t, i]) v[b, t, m] over the tokens from ``S``, stored in
    ``S2``; z by the m = 0 threads.

    The factor is float64, so the running element is too (one register; stored in the state dtype).
    """
    b = cuda.blockIdx.x
    i = cuda.blockIdx.y
    m = cuda.blockIdx.z * cuda.blockDim.x + cuda.threadIdx.x
    T = k.shape[1]
    M = S.shape[2]
    G = lg.shape[2]
    gi = i if G > 1 else 0
    bad = 0
    if m < M:
        s = 1.0 * S[b, i, m]
        for t in range(T):
            w = zero + v[b, t, m]
            if check and i == 0:
                bad |= bad_bit(w, BAD_V)
            a = feature(k, b, t, i, code, row_norm(k, b, t, code, zero, one), zero, one)
            if G == 0:
                s = s + a * w
            else:
                s = math.exp(lg[b, t, gi]) * s + a * w
        S2[b, i, m] = s
    if m == 0:
        zi = 1.0 * z[b, i]
        for t in range(T):
            if check:
                bad |= bad_bit(zero + k[b, t, i], BAD_K)
            a = feature(k, b, t, i, code, row_norm(k, b, t, code, zero, one), zero, one)
            if G == 0:
                zi = zi + a
            else:
                zi = math.exp(lg[b, t, gi]) * zi + a
        z2[b, i] = zi
    raise_flag(flag, bad)


def delta_step_py(q, k, v, S, z, S2, z2, out, feat, lg, beta, flag, check, code, eps, norm, read, zero, one):
    """The delta rules, one block per batch entry: ``H <- a (I - beta k k^T) H + beta k [v 1]``.

    Per token: thread 0 stores the token's factor ``a`` and write strength
    ``beta`` in row 3 of ``feat`` (rounded once to the state dtype), features
    strided over i (rows 0 and 1 of ``feat``) with the terms of ``k^T z``
    (row 2), barrier, every thread sums them, barrier, the z update with the
    normaliser's terms (row 2 again), barrier; then one thread per column m:
    ``k^T S[:, m]``, the update ``S[:, m] <- a S[:, m] + beta k (v_m - a k^T
    S[:, m])`` and the read, all in the state dtype.  ``lg`` (B, T, G): G =
    0 the delta rule (a = 1), G = 1 the gated delta rule; ``beta`` (B, T)
    float64.  ``read`` False: no outputs (a prefill; ``q`` and ``out`` are not
    read or written).  State buffers as :func:`state_step_py`.
    """
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    T = k.shape[1]
    F = S.shape[1]
    M = S.shape[2]
    G = lg.shape[2]
    bad = 0
    for t in range(T):
        Sr = S2
        zr = z2
        if t == 0:
            Sr = S
            zr = z
        nk = row_norm(k, b, t, code, zero, one)
        nq = row_norm(q, b, t, code, zero, one) if read else one
        if tid == 0:
            feat[b, 3, 0] = math.exp(lg[b, t, 0]) if G > 0 else 1.0
            feat[b, 3, 1] = beta[b, t]
        for i in range(tid, F, nt):
            if check:
                bad |= bad_bit(zero + k[b, t, i], BAD_K)
                if read:
                    bad |= bad_bit(zero + q[b, t, i], BAD_Q)
            fk = feature(k, b, t, i, code, nk, zero, one)
            feat[b, 0, i] = fk
            if read:
                feat[b, 1, i] = feature(q, b, t, i, code, nq, zero, one)
            feat[b, 2, i] = fk * zr[b, i]
        cuda.syncthreads()
        a = feat[b, 3, 0]
        bt = feat[b, 3, 1]
        kz = row_sum(feat, b, 2, F, zero)
        rz = bt * (one - a * kz)
        cuda.syncthreads()  # row 2 is read by every thread before it is rewritten
        for i in range(tid, F, nt):
            zi = a * zr[b, i] + rz * feat[b, 0, i]
            z2[b, i] = zi
            feat[b, 2, i] = feat[b, 1, i] * zi
        cuda.syncthreads()
        den = normaliser(feat, b, F, eps, norm, zero)
        for m in range(tid, M, nt):
            w = zero + v[b, t, m]
            if check:
                bad |= bad_bit(w, BAD_V)
            d = zero
            for i in range(F):
                d += feat[b, 0, i] * Sr[b, i, m]
            r = bt * (w - a * d)
            acc = zero
            for i in range(F):
                s = a * Sr[b, i, m] + r * feat[b, 0, i]
                S2[b, i, m] = s
                acc += feat[b, 1, i] * s
            if read:
                put_out(out, b, t, m, acc, den, norm)
        cuda.syncthreads()
    raise_flag(flag, bad)


PYTHON_KERNELS = {"state_step": state_step_py, "state_query": state_query_py,
                  "state_prefill": state_prefill_py, "rule_step": rule_step_py, "rule_prefill": rule_prefill_py,
                  "delta_step": delta_step_py}
_JIT = {}


def kernels():
    """``cuda.jit`` kernels (compiled lazily per signature on first launch)."""
    if not _JIT:
        for name, fn in PYTHON_KERNELS.items():
            _JIT[name] = cuda.jit(fn)
    return _JIT


# ---------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------
class DoubleBuffer:
    """Two device arrays of one shape: the current one (``cur``) and the one a checked call writes (``alt``).

    A checked step or prefill reads ``cur`` and writes ``alt``; :meth:`swap`
    makes ``alt`` current once the finiteness flag is clear, so a call refused
    for NaN or inf leaves ``cur`` untouched.  Unchecked calls update ``cur`` in
    place.  Both are allocated (and zeroed on the device) once, with the state.
    """

    __slots__ = ("cur", "alt")

    def __init__(self, shape, dtype):
        from .. import _cuda_pool as P

        self.cur = P.zeros(shape, dtype)
        self.alt = P.zeros(shape, dtype)

    def swap(self):
        self.cur, self.alt = self.alt, self.cur

    @property
    def shape(self):
        return self.cur.shape

    @property
    def dtype(self):
        return self.cur.dtype


class StepScratch:
    """What the kernels of one GPU state need besides its state: ``feat`` (B, 4, max(F, 2)) in the state
    dtype, the finiteness ``flag`` (1,) int32 on the device (zero between calls), a host array to read
    it into, and the (1, 1, 0) float64 ``lg`` of a call without factors."""

    __slots__ = ("feat", "flag", "host_flag", "no_factors")

    def __init__(self, B, F, dtype):
        from .. import _cuda_pool as P

        self.feat = P.zeros((B, 4, max(F, 2)), dtype)
        self.flag = P.zeros((1,), np.int32)
        self.host_flag = cuda.pinned_array((1,), dtype=np.int32)
        self.no_factors = cuda.device_array((1, 1, 0), dtype=np.float64)

    def read_flag(self) -> int:
        """The flag's bits (one device-to-host copy, a sync); set back to zero on the device when not zero."""
        self.flag.copy_to_host(self.host_flag)
        bits = int(self.host_flag[0])
        if bits:
            from .. import _cuda_pool as P

            P.fill(self.flag, 0)
        return bits


def _eps(eps, dtype):
    """``eps`` in the state dtype (-inf: no floor)."""
    return np.dtype(dtype).type(-math.inf if eps is None else float(eps))


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


def _first_bad(bits, order):
    """The 1-based position in ``order`` (flag bits) of the first input whose bit is set, else 0."""
    for j, bit in enumerate(order):
        if bits & bit:
            return j + 1
    return 0


def _buffers(S, z, check):
    """(S in, z in, S out, z out) of the double-buffered state: ``alt`` when checked, else in place."""
    if check:
        return S.cur, z.cur, S.alt, z.alt
    return S.cur, z.cur, S.cur, z.cur


def _finish(S, z, scratch, check, order):
    """After an updating launch: read the flag when ``check``; swap the buffers when clean.  Returns the
    1-based index in ``order`` of the first bad input, or 0."""
    if not check:
        return 0
    bad = _first_bad(scratch.read_flag(), order)
    if not bad:
        S.swap()
        z.swap()
    return bad


def state_step(q, k, v, S, z, out, scratch, *, code, eps, check=False) -> int:
    """Launch the step kernel (one block per batch entry): one launch, no copy; ``S``, ``z``
    :class:`DoubleBuffer`.

    Returns 0, or with ``check`` 1, 2 or 3 when q, k or v holds NaN or inf (the first; the state is
    then unchanged and ``out`` undefined).
    """
    B = q.shape[0]
    if B == 0 or q.shape[1] == 0:
        return 0
    Si, zi, So, zo = _buffers(S, z, check)
    kernels()["state_step"][B, _threads()](q, k, v, Si, zi, So, zo, out, scratch.feat, scratch.flag, bool(check),
                                           np.int64(code), _eps(eps, Si.dtype), *_consts(Si))
    return _finish(S, z, scratch, check, (BAD_Q, BAD_K, BAD_V))


def state_query(q, S, z, out, scratch, *, code, eps, normalize=True, check=False) -> int:
    """Launch the query kernel: one block per batch entry, the state unchanged (any rule's state;
    ``normalize=False``: numerators).  Returns 1 when ``check`` finds q not finite, else 0."""
    B = q.shape[0]
    if B == 0 or q.shape[1] == 0:
        return 0
    Sc, zc = S.cur, z.cur
    kernels()["state_query"][B, _threads()](q, Sc, zc, out, scratch.feat, scratch.flag, bool(check),
                                             np.int64(code), _eps(eps, Sc.dtype),
                                             np.int64(norm_mode(eps, normalize)), *_consts(Sc))
    return _first_bad(scratch.read_flag(), (BAD_Q,)) if check else 0


def state_prefill(k, v, S, z, scratch, *, code, check=False) -> int:
    """Launch the prefill kernel (one thread per batch entry, feature and value column).  Returns 0, or
    with ``check`` 1 or 2 when k or v holds NaN or inf (the state unchanged)."""
    B, T, _ = k.shape
    if B == 0 or T == 0:
        return 0
    Si, zi, So, zo = _buffers(S, z, check)
    grid, nt = _prefill_grid(B, Si.shape[1], Si.shape[2])
    kernels()["state_prefill"][grid, nt](k, v, Si, zi, So, zo, scratch.flag, bool(check), np.int64(code),
                                         *_consts(Si))
    return _finish(S, z, scratch, check, (BAD_K, BAD_V))


def log_factors(inputs, B, T, scratch):
    """The kernels' ``lg`` (B, T, G) float64 on the device from a launcher's ``inputs`` (None: G = 0,
    the scratch's placeholder).  Host arrays are copied to the device; device arrays are used as they are."""
    from .cpu import log_factors as host_log_factors

    if not inputs:
        return scratch.no_factors
    x = inputs.get("log_decay", inputs.get("log_gate"))
    if hasattr(x, "copy_to_host"):
        return x.reshape((B, T, 1) if "log_decay" in inputs else (B, T, x.shape[-1]))
    return cuda.to_device(host_log_factors(inputs, B, T))


def rule_step(q, k, v, S, z, out, scratch, *, code, eps, inputs=None, normalize=True, check=False) -> int:
    """Launch the rule step kernel (one block per batch entry); returns as :func:`state_step`."""
    B, T = q.shape[0], q.shape[1]
    if B == 0 or T == 0:
        return 0
    Si, zi, So, zo = _buffers(S, z, check)
    kernels()["rule_step"][B, _threads()](q, k, v, Si, zi, So, zo, out, scratch.feat,
                                          log_factors(inputs, B, T, scratch), scratch.flag, bool(check),
                                          np.int64(code), _eps(eps, Si.dtype), np.int64(norm_mode(eps, normalize)),
                                          *_consts(Si))
    return _finish(S, z, scratch, check, (BAD_Q, BAD_K, BAD_V))


def rule_prefill(k, v, S, z, scratch, *, code, inputs=None, check=False) -> int:
    """Launch the rule prefill kernel (one thread per batch entry, feature and value column); returns as
    :func:`state_prefill`."""
    B, T, _ = k.shape
    if B == 0 or T == 0:
        return 0
    Si, zi, So, zo = _buffers(S, z, check)
    grid, nt = _prefill_grid(B, Si.shape[1], Si.shape[2])
    kernels()["rule_prefill"][grid, nt](k, v, Si, zi, So, zo, log_factors(inputs, B, T, scratch), scratch.flag,
                                        bool(check), np.int64(code), *_consts(Si))
    return _finish(S, z, scratch, check, (BAD_K, BAD_V))


def delta_arrays(inputs, B, T, scratch):
    """The kernels' ``lg`` (B, T, G) (G = 1 with ``log_decay``: the gated delta rule, else 0) and
    ``beta`` (B, T), float64 device arrays, from a delta-rule launcher's ``inputs`` (host arrays are
    copied to the device, device arrays used as they are)."""
    def dev(x, shape):
        if hasattr(x, "copy_to_host"):
            return x.reshape(shape)
        return cuda.to_device(np.ascontiguousarray(x, dtype=np.float64).reshape(shape))

    beta = dev(inputs["beta"], (B, T))
    lg = dev(inputs["log_decay"], (B, T, 1)) if "log_decay" in inputs else scratch.no_factors
    return lg, beta


def delta_step(q, k, v, S, z, out, scratch, *, code, eps, inputs, normalize=False, check=False) -> int:
    """Launch the delta-rule step kernel (one block per batch entry); returns as :func:`state_step`.

    ``inputs``: ``{"beta": (B, T)}`` (delta) or ``{"beta", "log_decay"}`` (gated delta).
    """
    B, T = q.shape[0], q.shape[1]
    if B == 0 or T == 0:
        return 0
    lg, beta = delta_arrays(inputs, B, T, scratch)
    Si, zi, So, zo = _buffers(S, z, check)
    kernels()["delta_step"][B, _threads()](q, k, v, Si, zi, So, zo, out, scratch.feat, lg, beta, scratch.flag,
                                           bool(check), np.int64(code), _eps(eps, Si.dtype),
                                           np.int64(norm_mode(eps, normalize)), True, *_consts(Si))
    return _finish(S, z, scratch, check, (BAD_Q, BAD_K, BAD_V))


def delta_prefill(k, v, S, z, scratch, *, code, inputs, check=False) -> int:
    """Launch the delta-rule kernel without outputs: the state after T tokens; returns as
    :func:`state_prefill`."""
    B, T = k.shape[0], k.shape[1]
    if B == 0 or T == 0:
        return 0
    lg, beta = delta_arrays(inputs, B, T, scratch)
    Si, zi, So, zo = _buffers(S, z, check)
    out = scratch.no_factors  # not written (read=False)
    kernels()["delta_step"][B, _threads()](k, k, v, Si, zi, So, zo, out, scratch.feat, lg, beta, scratch.flag,
                                           bool(check), np.int64(code), _eps(None, Si.dtype), np.int64(NORM_NONE),
                                           False, *_consts(Si))
    return _finish(S, z, scratch, check, (BAD_K, BAD_V))
