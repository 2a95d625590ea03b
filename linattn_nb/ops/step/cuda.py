"""CUDA kernels of recurrent decoding: state step, query and prefill.

See ``docs/cuda_kernels.md``, "Decode-step kernels".
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, int32

from ... import config
from .._codes import (KERNEL_CODE_L2, KERNEL_CODE_SILU_L2, NORM_FLOOR, NORM_NONE, RULE_ADDITIVE, RULE_DELTA,
                      RULE_GATED_DELTA, norm_mode)
from .._cuda_common import is_delta_rule, phi, step_element, step_factor, step_scalars, step_z
from .._cuda_launch import rule_factors
from .cpu import RESULT_NOT_FINITE, flat_inputs


# The elementwise map: linattn_nb.ops._cuda_common.phi (inlined device
# function; ``zero``/``one`` of the state dtype keep float32 kernels in float32).
# The row maps (l2, silu_l2) divide each token's row by its norm: every thread
# that needs a feature of the row computes the norm itself (``row_norm``, a
# loop over the row, like the normaliser's sum every thread does), so the
# kernels need no extra barrier.

#: A row's sum of squares (state dtype) below this is summed again scaled (:func:`row_norm`).
_SS_TINY_STEP = 2.0 ** -90

#: Bits of the finiteness flag: the input that held NaN or inf; ``BAD_RESULT``: a new state element or an
#: output that is not (finite inputs whose results overflow the dtype; the state buffers are then not
#: swapped, so the state is unchanged).
BAD_Q, BAD_K, BAD_V, BAD_RESULT = 1, 2, 4, 8


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
    """``(nrm, e)`` for the row maps: the L2 norm of row ``x[b, t]`` (after SiLU for ``silu_l2``) in the
    state dtype, of the row scaled by ``2^-e``; ``(1, 0)`` for the others.

    ``e`` is 0 unless the squares overflow the state dtype or their sum falls below 2^-90 (squares that
    underflow float32 could matter there): then the row is scaled by the power of two that puts its
    largest entry in [0.5, 1) (exact, so ``x / |x|`` keeps its rounding), as the CPU kernels do, and a
    float32 row beyond 1.8e19 still normalises."""
    e = int32(0)
    if code != KERNEL_CODE_L2 and code != KERNEL_CODE_SILU_L2:
        return one, e
    acc = zero
    for i in range(x.shape[2]):
        y = pre_l2(x[b, t, i], code, one)
        acc += y * y
    if acc < _SS_TINY_STEP or acc * zero != zero:  # also NaN: the scaled sum is NaN again
        mx = zero
        for i in range(x.shape[2]):
            mx = max(mx, abs(pre_l2(x[b, t, i], code, one)))
        if mx > zero and mx * zero == zero:
            e = math.frexp(mx)[1]
            acc = zero
            for i in range(x.shape[2]):
                y = math.ldexp(pre_l2(x[b, t, i], code, one), -e)
                acc += y * y
    return math.sqrt(acc), e


@cuda.jit(device=True, inline=True)
def feature(x, b, t, i, code, nr, zero, one):
    """Feature i of row ``x[b, t]`` in the state dtype: the elementwise map, or for the row maps the
    element over the norm (``nr``, :func:`row_norm`'s pair; a zero row maps to zero, exactly as the
    NumPy maps)."""
    if code == KERNEL_CODE_L2 or code == KERNEL_CODE_SILU_L2:
        nrm, e = nr
        if nrm > zero:
            y = pre_l2(x[b, t, i], code, one)
            if e != 0:
                y = math.ldexp(y, -e)
            return y / nrm
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
    if math.isinf(den):  # overflowed the state dtype: NaN outputs, which the check reports (as the CPU's floored)
        den = den - den
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
def raise_flag(flag, bad):
    """OR this thread's bits into the finiteness flag (one atomic per thread that found one)."""
    if bad != 0:
        cuda.atomic.or_(flag, 0, bad)


def step_py(q, k, v, S, z, S2, z2, out, feat, lg, flag, check, code, eps, norm, rule, read, zero, one):
    """One block per batch entry b; per token: features (strided over i), barrier, columns m.

    Reads the state from ``S, z`` at the first token and from ``S2, z2`` after it,
    writes ``S2, z2`` (which may be ``S, z``).  ``check``: OR the bits of the inputs
    holding NaN or inf into ``flag[0]``.  ``lg`` (B, T, G) the rule's per-token
    inputs; ``read`` False: no outputs (``q``, ``out`` untouched).  The delta rules
    take two more barriers per token for ``k^T z`` (``feat`` rows: 0, 1 features,
    2 the z terms, 3 the factors; ``docs/cuda_kernels.md``).
    """
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    T = k.shape[1]
    F = S.shape[1]
    M = S.shape[2]
    delta = rule == RULE_DELTA or rule == RULE_GATED_DELTA  # a correction: k^T H first
    bad = 0
    for t in range(T):
        Sr = S2
        zr = z2
        if t == 0:
            Sr = S
            zr = z
        nk = row_norm(k, b, t, code, zero, one)
        nq = row_norm(q, b, t, code, zero, one) if read else (one, int32(0))
        if delta and tid == 0:
            feat[b, 3, 0], feat[b, 3, 1] = step_scalars(rule, lg, b, t)
        for i in range(tid, F, nt):
            if check:
                bad |= bad_bit(zero + k[b, t, i], BAD_K)
                if read:
                    bad |= bad_bit(zero + q[b, t, i], BAD_Q)
            fk = feature(k, b, t, i, code, nk, zero, one)
            feat[b, 0, i] = fk
            if read:
                feat[b, 1, i] = feature(q, b, t, i, code, nq, zero, one)
            if delta:
                feat[b, 2, i] = fk * zr[b, i]
            else:
                feat[b, 3, i] = step_factor(rule, lg, b, t, i)  # rounded to the state dtype once
                zi = step_z(rule, zr[b, i], fk, feat[b, 3, i])
                if check:
                    bad |= bad_bit(zi, BAD_RESULT)
                z2[b, i] = zi
                feat[b, 2, i] = feat[b, 1, i] * zi
        cuda.syncthreads()
        a = one
        bt = zero
        if delta:
            a = feat[b, 3, 0]
            bt = feat[b, 3, 1]
            rz = bt * (one - a * row_sum(feat, b, 2, F, zero))
            cuda.syncthreads()  # row 2 is read by every thread before it is rewritten
            for i in range(tid, F, nt):
                zi = step_element(rule, zr[b, i], feat[b, 0, i], one, one, a, rz)
                if check:
                    bad |= bad_bit(zi, BAD_RESULT)
                z2[b, i] = zi
                feat[b, 2, i] = feat[b, 1, i] * zi
            cuda.syncthreads()
        den = normaliser(feat, b, F, eps, norm, zero)
        for m in range(tid, M, nt):
            w = zero + v[b, t, m]
            if check:
                bad |= bad_bit(w, BAD_V)
            r = zero
            if delta:
                d = zero
                for i in range(F):
                    d += feat[b, 0, i] * Sr[b, i, m]
                r = bt * (w - a * d)
            acc = zero
            chk = zero  # sum of s * 0: NaN exactly when a new state element is NaN or inf (no fastmath here)
            for i in range(F):
                s = step_element(rule, Sr[b, i, m], feat[b, 0, i], feat[b, 3, i], w, a, r)
                S2[b, i, m] = s
                acc += feat[b, 1, i] * s
                chk += s * zero
            if check:
                bad |= bad_bit(chk, BAD_RESULT)
            if read:
                put_out(out, b, t, m, acc, den, norm)
                if check:
                    bad |= bad_bit(zero + out[b, t, m], BAD_RESULT)  # as stored: the output's dtype
        cuda.syncthreads()
    raise_flag(flag, bad)


def prefill_py(k, v, S, z, S2, z2, lg, flag, check, code, rule, zero, one):
    """Thread (b, i, m): the element ``S[b, i, m]`` after the T tokens, stored in ``S2``; z by the m = 0
    threads.  ``check``: the m = 0 threads test k, the i = 0 threads v.  Not for the delta rules; the
    decay and gate rules' running element is float64 (one register).
    """
    b = cuda.blockIdx.x
    i = cuda.blockIdx.y
    m = cuda.blockIdx.z * cuda.blockDim.x + cuda.threadIdx.x
    T = k.shape[1]
    M = S.shape[2]
    summed = rule == RULE_ADDITIVE
    bad = 0
    if m < M:
        acc = zero
        s = 1.0 * S[b, i, m]
        for t in range(T):
            w = zero + v[b, t, m]
            if check and i == 0:
                bad |= bad_bit(w, BAD_V)
            a = feature(k, b, t, i, code, row_norm(k, b, t, code, zero, one), zero, one)
            if summed:
                acc += a * w
            else:
                s = step_element(rule, s, a, step_factor(rule, lg, b, t, i), w, one, zero)
        S2[b, i, m] = S[b, i, m] + acc if summed else s
        if check:
            bad |= bad_bit(S2[b, i, m], BAD_RESULT)
    if m == 0:
        zs = z[b, i]
        zf = 1.0 * z[b, i]
        for t in range(T):
            if check:
                bad |= bad_bit(zero + k[b, t, i], BAD_K)
            a = feature(k, b, t, i, code, row_norm(k, b, t, code, zero, one), zero, one)
            if summed:
                zs += a
            else:
                zf = step_z(rule, zf, a, step_factor(rule, lg, b, t, i))
        z2[b, i] = zs if summed else zf
        if check:
            bad |= bad_bit(z2[b, i], BAD_RESULT)
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
            if check:
                bad |= bad_bit(zero + out[b, t, m], BAD_RESULT)  # as stored
        cuda.syncthreads()
    raise_flag(flag, bad)


PYTHON_KERNELS = {"step": step_py, "state_query": state_query_py, "prefill": prefill_py}
_JIT = {}


def kernels():
    """``cuda.jit`` kernels (compiled lazily per signature on first launch)."""
    if not _JIT:
        _JIT.update({name: cuda.jit(fn) for name, fn in PYTHON_KERNELS.items()})
    return _JIT


# ---------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------
class DoubleBuffer:
    """Two device arrays of one shape: the current one (``cur``) and the one a checked call writes (``alt``).

    :meth:`swap` makes ``alt`` current once the finiteness flag is clear, so a call
    refused for NaN or inf leaves ``cur`` untouched; unchecked calls update ``cur`` in place.
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
    it into, and a (1, 1, 0) float64 placeholder (the ``out`` of the delta rules' prefill, never
    written)."""

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


def _threads():
    nt = int(config.CUDA_STEP_THREADS)
    if nt < 1:
        raise ValueError(f"config.CUDA_STEP_THREADS must be >= 1, got {nt}")
    return nt


def _first_bad(bits, order):
    """The 1-based position in ``order`` (flag bits) of the first input whose bit is set, else
    :data:`~linattn_nb.ops.step.cpu.RESULT_NOT_FINITE` for :data:`BAD_RESULT` alone (finite inputs, a result
    that is not: the state unchanged, as for a bad input), else 0."""
    for j, bit in enumerate(order):
        if bits & bit:
            return j + 1
    return RESULT_NOT_FINITE if bits & BAD_RESULT else 0


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


def _launch_step(q, k, v, S, z, out, scratch, code, eps, rule, inputs, norm, read, check, order):
    """One launch of the step kernel (one block per batch entry) and its flag; returns as :func:`step`."""
    B, T, F = k.shape[0], k.shape[1], S.cur.shape[1]
    lg = rule_factors(rule, flat_inputs(inputs, B, T, F), B, T, F)
    Si, zi, So, zo = _buffers(S, z, check)
    kernels()["step"][B, _threads()](q, k, v, Si, zi, So, zo, out, scratch.feat, lg, scratch.flag, bool(check),
                                     np.int64(code), _eps(eps, Si.dtype), np.int64(norm), np.int64(rule),
                                     bool(read), *_consts(Si))
    return _finish(S, z, scratch, check, order)


def step(q, k, v, S, z, out, scratch, *, code, eps, rule=RULE_ADDITIVE, inputs=None, normalize=True,
         check=False) -> int:
    """Launch the step kernel: one launch, no copy; ``S``, ``z`` :class:`DoubleBuffer`; ``inputs`` the
    rule's per-token inputs (host or device arrays, :data:`linattn_nb.ops._codes.RULES`).

    Returns 0, or with ``check`` 1, 2 or 3 when q, k or v holds NaN or inf (the first; the state is
    then unchanged and ``out`` undefined), or :data:`~linattn_nb.ops.step.cpu.RESULT_NOT_FINITE` when finite
    inputs gave a non-finite output or state element (the state unchanged too: its buffers not swapped).
    """
    if q.shape[0] == 0 or q.shape[1] == 0:
        return 0
    return _launch_step(q, k, v, S, z, out, scratch, code, eps, rule, inputs, norm_mode(eps, normalize), True,
                        check, (BAD_Q, BAD_K, BAD_V))


def state_query(q, S, z, out, scratch, *, code, eps, normalize=True, check=False) -> int:
    """Launch the query kernel: one block per batch entry, the state unchanged (any rule's state;
    ``normalize=False``: numerators).  Returns 1 when ``check`` finds q not finite,
    :data:`~linattn_nb.ops.step.cpu.RESULT_NOT_FINITE` when it finds an output of a finite q that is not,
    else 0."""
    B = q.shape[0]
    if B == 0 or q.shape[1] == 0:
        return 0
    Sc, zc = S.cur, z.cur
    kernels()["state_query"][B, _threads()](q, Sc, zc, out, scratch.feat, scratch.flag, bool(check),
                                             np.int64(code), _eps(eps, Sc.dtype),
                                             np.int64(norm_mode(eps, normalize)), *_consts(Sc))
    return _first_bad(scratch.read_flag(), (BAD_Q,)) if check else 0


def prefill(k, v, S, z, scratch, *, code, rule=RULE_ADDITIVE, inputs=None, check=False) -> int:
    """Launch the prefill kernel (one thread per batch entry, feature and value column), or for the delta
    rules the step kernel without outputs.  Returns 0, or with ``check`` 1 or 2 when k or v holds NaN or
    inf, or :data:`~linattn_nb.ops.step.cpu.RESULT_NOT_FINITE` when a new state element of finite inputs is
    not finite (the state unchanged either way)."""
    B, T, _ = k.shape
    if B == 0 or T == 0:
        return 0
    if is_delta_rule(rule):  # ``out`` is not written (read=False)
        return _launch_step(k, k, v, S, z, scratch.no_factors, scratch, code, None, rule, inputs, NORM_NONE,
                            False, check, (BAD_K, BAD_V))
    F = S.cur.shape[1]
    lg = rule_factors(rule, flat_inputs(inputs, B, T, F), B, T, F)
    Si, zi, So, zo = _buffers(S, z, check)
    M = Si.shape[2]
    nt = min(_threads(), max(32, M))  # one thread per (batch entry, feature, value column)
    kernels()["prefill"][(B, F, (M + nt - 1) // nt), nt](k, v, Si, zi, So, zo, lg, scratch.flag, bool(check),
                                                         np.int64(code), np.int64(rule), *_consts(Si))
    return _finish(S, z, scratch, check, (BAD_K, BAD_V))
