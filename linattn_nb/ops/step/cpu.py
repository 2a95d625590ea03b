"""Numba CPU kernels of recurrent decoding: state step, query, prefill; KV-cache step.

The state is ``St`` (B, M, F) = ``S^T`` per batch entry and ``z`` (B, F), in the
state dtype.  Design: ``docs/design-cpu.md``, "Decode-step kernels".
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ... import config
from .._codes import (KERNEL_CODE_ELU, KERNEL_CODE_L2, KERNEL_CODE_SILU_L2, NORM_FLOOR, NORM_NONE, RULE_ADDITIVE,
                      RULE_DECAY, RULE_GATED_DELTA, norm_mode)
from .._common import phi, rescale_needed, scale_exponent
from .._rules import is_delta, log_factors, step_inputs, step_normaliser, step_row
from .._twins import pick, serial_and_parallel
from .._vec import is_finite
from ..._blas import parallel_entry


# ---------------------------------------------------------------------------
# Feature rows
# ---------------------------------------------------------------------------
@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _pre_l2(x, code):
    """The element before the row's L2 normalisation, in float64: SiLU for ``silu_l2``, else itself."""
    y = np.float64(x)
    if code == KERNEL_CODE_SILU_L2:
        y = y / (1.0 + math.exp(-y))  # exp overflow: y / inf = -0, as the NumPy map
    return y


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _l2_row(x, out, code):
    """out[:] = s / ||s|| with s = x (``l2``) or SiLU(x) (``silu_l2``); the norm in float64 (the row scaled
    by a power of two where its squares overflow or underflow), no epsilon, a zero row maps to zero
    (:class:`linattn_nb.feature_maps.L2FeatureMap`)."""
    nrm = 0.0
    for i in range(x.shape[0]):
        y = _pre_l2(x[i], code)
        nrm += y * y
    e = 0
    if rescale_needed(nrm):  # squares that overflowed or underflowed: the row scaled by a power of two
        mx = 0.0
        for i in range(x.shape[0]):
            mx = max(mx, abs(_pre_l2(x[i], code)))
        e = scale_exponent(mx)
        if e != 0:
            nrm = 0.0
            for i in range(x.shape[0]):
                y = math.ldexp(_pre_l2(x[i], code), -e)
                nrm += y * y
    nrm = math.sqrt(nrm)
    if e != 0:
        for i in range(x.shape[0]):
            out[i] = math.ldexp(_pre_l2(x[i], code), -e) / nrm
        return
    for i in range(x.shape[0]):
        out[i] = _pre_l2(x[i], code) / nrm if nrm > 0.0 else 0.0


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def phi_row(x, out, code):
    """out[:] = phi(x[:]) for the map ``code`` on one row (:func:`linattn_nb.ops._common.phi`), vectorised.
    The row maps normalise the whole ``x``: pass one token's row (several: :func:`phi_rows`).
    """
    if code == KERNEL_CODE_L2 or code == KERNEL_CODE_SILU_L2:
        _l2_row(x, out, code)
        return
    for i in range(x.shape[0]):
        out[i] = phi(x[i], code)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def phi_rows(x, out, code, F):
    """:func:`phi_row` of consecutive rows of ``F`` elements of the flat ``x`` (one pass for an
    elementwise map; the row maps normalise each row of F on its own)."""
    if code == KERNEL_CODE_L2 or code == KERNEL_CODE_SILU_L2:
        for r in range(x.shape[0] // F):
            _l2_row(x[r * F:(r + 1) * F], out[r * F:(r + 1) * F], code)
        return
    for i in range(x.shape[0]):
        out[i] = phi(x[i], code)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _finite3(x):
    """True when the 3-D array holds no NaN or inf (``x * 0`` is NaN exactly for those; the sum vectorises)."""
    acc = 0.0
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for i in range(x.shape[2]):
                acc += x[b, t, i] * 0.0
    return acc == 0.0


#: A step kernel's return value when its finite inputs gave a non-finite output (the outputs' dtype or the
#: state's overflowed, or a normaliser of 0 with no floor); the tokens were absorbed.
RESULT_NOT_FINITE = 4


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def outputs_finite(out):
    """Whether the 3-D ``out`` holds no NaN or inf, as stored (a flag per element: a sum of ``x * 0`` may be
    reassociated into ``(sum x) * 0``, which overflows for large finite outputs), or-ed as an integer so that
    the loop keeps its vector form (as :func:`linattn_nb.ops._finite._all_finite_rows`)."""
    bad = np.uint8(0)
    for b in range(out.shape[0]):
        for t in range(out.shape[1]):
            row = out[b, t]
            for m in range(row.shape[0]):
                bad |= np.uint8(not is_finite(row[m]))
    return bad == 0


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def first_nonfinite(q, k, v):
    """0 when q, k, v (3-D) are all finite, else 1, 2 or 3 for the first bad one."""
    if not _finite3(q):
        return 1
    if not _finite3(k):
        return 2
    if not _finite3(v):
        return 3
    return 0


@njit(fastmath=config.FASTMATH, cache=config.CACHE, error_model="numpy")  # 1/0 -> inf: RESULT_NOT_FINITE
def _advance(v, St, z, out, fa, fc, b, t, eps):
    """Token t of batch entry b of the additive rule, features fa = phi(k_t), fc = phi(q_t) given: update,
    then read (divided by the normaliser); two rows of ``St[b]`` per pass.
    """
    F = St.shape[2]
    M = St.shape[1]
    zero = St.dtype.type(0)
    Sb = St[b]
    zb = z[b]
    den = 0.0
    for i in range(F):
        zi = zb[i] + fa[i]
        zb[i] = zi
        den += fc[i] * zi
    if not is_finite(den):  # overflowed the state's dtype: NaN outputs, which the check reports (floored)
        den = math.nan
    elif den < eps:  # eps < 0 when there is no floor
        den = eps
    M2 = M - M % 2
    for m in range(0, M2, 2):
        w0 = v[b, t, m]
        w1 = v[b, t, m + 1]
        r0 = Sb[m]
        r1 = Sb[m + 1]
        acc0 = zero
        acc1 = zero
        for i in range(F):
            a = fa[i]
            c = fc[i]
            s0 = r0[i] + a * w0
            s1 = r1[i] + a * w1
            r0[i] = s0
            r1[i] = s1
            acc0 += c * s0
            acc1 += c * s1
        out[b, t, m] = acc0 / den
        out[b, t, m + 1] = acc1 / den
    for m in range(M2, M):
        w = v[b, t, m]
        row = Sb[m]
        acc = zero
        for i in range(F):
            s = row[i] + fa[i] * w
            row[i] = s
            acc += fc[i] * s
        out[b, t, m] = acc / den


@njit(fastmath=config.FASTMATH, cache=config.CACHE, inline="always")
def _tokens(q, k, v, St, z, out, feat, code, eps, rule, lg, norm, read, b):
    """The T tokens of batch entry b: features (for T > 1; the caller computed them for T = 1), then
    the rule's step hooks (:mod:`linattn_nb.ops._rules`): its inputs, the normaliser, each row of the
    state updated and read in one pass."""
    T = k.shape[1]
    Sb = St[b]
    zb = z[b]
    fa = feat[0, b]
    fc = feat[1, b]
    g = feat[feat.shape[0] - 1, b]  # the factors: row 2 (decay, gate); unused by the other rules
    for t in range(T):
        if T > 1:
            phi_row(k[b, t], fa, code)
            if read:
                phi_row(q[b, t], fc, code)
        a, beta = step_inputs(rule, lg, b, t, g)
        den = floored(step_normaliser(rule, zb, fa, fc, g, a, beta), eps, norm)
        for m in range(St.shape[1]):
            acc = step_row(rule, Sb[m], fa, fc, g, v[b, t, m], a, beta)
            if read:
                out[b, t, m] = output(acc, den, norm)


@njit(fastmath=config.FASTMATH, cache=config.CACHE, inline="always")
def _step_all(q, k, v, St, z, out, feat, code, eps, check, rule, lg, norm, read):
    """The body of every step entry point (inlined into each, so that ``prange`` is theirs)."""
    if check:
        bad = first_nonfinite(q, k, v)
        if bad:
            return bad
    B, T, _ = k.shape
    n = B * St.shape[2]
    if T == 1:  # x[:, 0, :] is contiguous: the features of every batch entry in one vectorised pass
        phi_rows(k.reshape(n), feat[0].reshape(n), code, St.shape[2])
        if read:
            phi_rows(q.reshape(n), feat[1].reshape(n), code, St.shape[2])
    for b in prange(B):
        # np.int64(b): prange's index is unsigned in the parallel twin; without the cast the helper
        # compiles a second time, for uint64, besides the serial twin's int64
        _tokens(q, k, v, St, z, out, feat, code, eps, rule, lg, norm, read, np.int64(b))
    if check and read and not outputs_finite(out):
        return RESULT_NOT_FINITE
    return 0


def _step(q, k, v, St, z, out, feat, code, eps, check, rule, lg, norm, read):
    """T tokens of rule ``rule`` through the state of every batch entry: token t updates, then reads.
    ``feat`` (2 or, with factors, 3, B, F) scratch in the state dtype; ``lg`` (B, T, G) float64 from
    :func:`linattn_nb.ops._rules.log_factors`; ``read`` False absorbs the tokens without outputs.  Returns
    0, or 1/2/3 (nothing modified) when ``check`` finds q/k/v non-finite, or :data:`RESULT_NOT_FINITE` when
    ``check`` finds an output that is not (the tokens absorbed).
    """
    return _step_all(q, k, v, St, z, out, feat, code, eps, check, rule, lg, norm, read)


def _additive_step(q, k, v, St, z, out, feat, code, eps, check):
    """The additive rule's decode step (``normalize=True``), kept apart from :func:`_step` for speed
    (``docs/design-cpu.md``): the features of all batch entries in two vectorised passes, then the row
    pass of each entry.  Returns as :func:`_step`.
    """
    if check:
        bad = first_nonfinite(q, k, v)
        if bad:
            return bad
    B, T, _ = q.shape
    F = St.shape[2]
    n = B * F
    xs = np.empty(n if T > 1 else 0, dtype=q.dtype)
    fa = feat[0].reshape(n)
    fc = feat[1].reshape(n)
    for t in range(T):
        if T == 1:  # x[:, 0, :] is contiguous: no copy
            phi_rows(k.reshape(n), fa, code, F)
            phi_rows(q.reshape(n), fc, code, F)
        else:
            for b in range(B):
                for i in range(F):
                    xs[b * F + i] = k[b, t, i]
            phi_rows(xs, fa, code, F)
            for b in range(B):
                for i in range(F):
                    xs[b * F + i] = q[b, t, i]
            phi_rows(xs, fc, code, F)
        for b in prange(B):
            _advance(v, St, z, out, feat[0, b], feat[1, b], np.int64(b), t, eps)  # one helper type (_step_all)
    if check and not outputs_finite(out):
        return RESULT_NOT_FINITE
    return 0


step_serial, step_parallel = serial_and_parallel(_step, fastmath=config.FASTMATH, cache=config.CACHE)
additive_step_serial, additive_step_parallel = serial_and_parallel(_additive_step, fastmath=config.FASTMATH,
                                                                   cache=config.CACHE)


def _pick_twin(serial, parallel, b, t, m, f):
    """``serial`` below ``config.STEP_PARALLEL_MIN_WORK`` multiply-adds (b t m f), else ``parallel``."""
    return pick(serial, parallel, items=b, work=b * t * m * f, limit="STEP_PARALLEL_MIN_WORK")


def pick_kernel(b, t, m, f):
    """The serial step kernel below ``config.STEP_PARALLEL_MIN_WORK`` multiply-adds, else the parallel one.

    Call it as ``kern(q, k, v, St, z, out, feat, code, eps, check, rule, lg, norm, read)`` (see
    :func:`_step`; ``code``, ``rule``, ``norm`` int64, ``eps`` from :func:`eps_arg`).
    """
    return _pick_twin(step_serial, step_parallel, b, t, m, f)


def pick_step_kernel(b, t, m, f):
    """As :func:`pick_kernel`, the additive rule's decode step: ``kern(q, k, v, St, z, out, feat, code,
    eps, check)``."""
    return _pick_twin(additive_step_serial, additive_step_parallel, b, t, m, f)


def _rule_entry(q, k, v, St, z, out, feat, code, eps, check, lg, norm):
    """:func:`_step` of the decay (``lg`` (B, T, 1)) or gate rule (``lg`` (B, T, F)), the rule a constant so
    that the hooks' branches compile away.
    """
    return _step_all(q, k, v, St, z, out, feat, code, eps, check, RULE_DECAY, lg, norm, True)


def _delta_entry(q, k, v, St, z, out, feat, code, eps, check, lg, beta, norm, read):
    """:func:`_step` of the delta rule (``lg`` (B, T, 0)) or the gated delta rule (``lg`` (B, T, 1)), the
    write strengths ``beta`` (B, T) apart."""
    B, T = beta.shape
    packed = np.zeros((B, T, 2))
    for b in range(B):
        for t in range(T):
            if lg.shape[2]:
                packed[b, t, 0] = lg[b, t, 0]
            packed[b, t, 1] = beta[b, t]
    return _step_all(q, k, v, St, z, out, feat, code, eps, check, RULE_GATED_DELTA, packed, norm, read)


_RULE_ENTRY = serial_and_parallel(_rule_entry, fastmath=config.FASTMATH, cache=config.CACHE)
_DELTA_ENTRY = serial_and_parallel(_delta_entry, fastmath=config.FASTMATH, cache=config.CACHE)


def pick_rule_kernel(b, t, m, f):
    """The step kernel of the decay and gate rules with the arguments ``(q, k, v, St, z, out, feat, code,
    eps, check, lg, norm)`` (serial or parallel as :func:`pick_kernel`)."""
    return _pick_twin(*_RULE_ENTRY, b, t, m, f)


def pick_delta_kernel(b, t, m, f):
    """The step kernel of the delta rules with the arguments ``(q, k, v, St, z, out, feat, code, eps,
    check, lg, beta, norm, read)`` (serial or parallel as :func:`pick_kernel`)."""
    return _pick_twin(*_DELTA_ENTRY, b, t, m, f)


def flat_inputs(inputs, B, T, F):
    """A launcher's ``inputs`` with the batch dimensions flattened: (B, T), ``log_gate`` (B, T, F) (host or
    device arrays)."""
    return {name: x.reshape((B, T, F) if name == "log_gate" else (B, T)) for name, x in (inputs or {}).items()}


@parallel_entry
def step(q, k, v, St, z, out, feat, *, code, eps, check, rule=RULE_ADDITIVE, inputs=None, normalize=True):
    """Launcher of the step kernels (serial below ``config.STEP_PARALLEL_MIN_WORK``).

    q, k (B, T, D); v, out (B, T, M) of one float32/float64 dtype; St (B, M, F),
    z (B, F), feat (2 or 3, B, F) scratch in the state dtype.  Returns 0, or 1/2/3
    when q/k/v is not finite (nothing modified), or :data:`RESULT_NOT_FINITE` when an output of finite inputs
    is not (the tokens absorbed).
    """
    B, T, M, F = q.shape[0], q.shape[1], St.shape[1], St.shape[2]
    args = (q, k, v, St, z, out, feat, np.int64(code), eps_arg(eps), bool(check))
    if rule == RULE_ADDITIVE and normalize:
        return int(pick_step_kernel(B, T, M, F)(*args))
    lg = log_factors(rule, flat_inputs(inputs, B, T, F), B, T, F)
    return int(pick_kernel(B, T, M, F)(*args, np.int64(rule), lg, np.int64(norm_mode(eps, normalize)), True))


def eps_arg(eps):
    """The kernels' ``eps`` argument: the floor, or -inf for none (``den < -inf`` never holds)."""
    return -math.inf if eps is None else float(eps)


def block_arg(block):
    """The prefill kernels' ``block`` (tokens per GEMM): ``config.PREFILL_BLOCK`` for None, checked."""
    block = int(config.PREFILL_BLOCK if block is None else block)
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    return np.int64(block)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def floored(den, eps, norm):
    """The normaliser ``den``, floored at ``eps`` when ``norm`` is NORM_FLOOR; NaN where it is not finite (a sum
    that overflowed the state's dtype), so that the outputs divided by it are not finite either and the
    check reports them (``acc / inf`` would be a silent 0 where ``acc`` was summed wider, from float64
    values)."""
    if not is_finite(den):
        return math.nan
    if norm == NORM_FLOOR and den < eps:
        return eps
    return den


@njit(fastmath=config.FASTMATH, cache=config.CACHE, error_model="numpy")  # 1/0 -> inf, not an exception
def output(acc, den, norm):
    """An output of mode ``norm``: the numerator ``acc`` (NORM_NONE) or ``acc / den``."""
    return acc if norm == NORM_NONE else acc / den


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def state_query_kernel(q, St, z, out, code, eps, norm):
    """out[b, t] = phi(q_t)^T S_b / max(phi(q_t)^T z_b, eps) (``NORM_NONE``: the numerators); the state is
    read only (any rule's), and nothing of it is written: the feature row is the call's own, so that
    threads may query one state at the same time.
    """
    B, T, _ = q.shape
    M = St.shape[1]
    F = St.shape[2]
    for b in prange(B):
        Sb = St[b]
        zb = z[b]
        fc = np.empty(F, St.dtype)
        for t in range(T):
            phi_row(q[b, t], fc, code)
            den = 0.0
            for i in range(F):
                den += fc[i] * zb[i]
            den = floored(den, eps, norm)
            for m in range(M):
                row = Sb[m]
                acc = St.dtype.type(0)
                for i in range(F):
                    acc += fc[i] * row[i]
                out[b, t, m] = output(acc, den, norm)


@parallel_entry
def state_query(q, St, z, out, *, code, eps, normalize=True):
    state_query_kernel(q, St, z, out, np.int64(code), eps_arg(eps), np.int64(norm_mode(eps, normalize)))
    return out


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def prefill_kernel(k, v, St, z, code, rule, lg, block):
    """The state after T tokens of the additive, decay or gate rule, in blocks of ``block`` tokens, one
    GEMM each, with the factors as running products from the end of the block.
    """
    B, T, _ = k.shape
    M = St.shape[1]
    F = St.shape[2]
    scaled = rule != RULE_ADDITIVE
    for b in prange(B):
        Sb = St[b]
        zb = z[b]
        fk = np.empty((block, F), dtype=St.dtype)
        vb = np.empty((block, M), dtype=St.dtype)
        w = np.empty((block, F))
        g = np.ones(F)
        for s0 in range(0, T, block):
            n = min(block, T - s0)
            if scaled:
                for i in range(F):
                    w[n - 1, i] = 1.0
                for s in range(n - 2, -1, -1):
                    step_inputs(rule, lg, b, s0 + s + 1, g)
                    for i in range(F):
                        w[s, i] = w[s + 1, i] * g[i]
                step_inputs(rule, lg, b, s0, g)
                for i in range(F):
                    g[i] *= w[0, i]  # the factor of the state before the block
            for t in range(n):
                phi_row(k[b, s0 + t], fk[t], code)
                for i in range(F):
                    if scaled:
                        fk[t, i] = fk[t, i] * w[t, i]
                    else:
                        zb[i] += fk[t, i]
                for m in range(M):
                    vb[t, m] = v[b, s0 + t, m]
            if scaled:
                for i in range(F):
                    acc = 0.0
                    for t in range(n):
                        acc += fk[t, i]
                    zb[i] = g[i] * zb[i] + acc
            part = np.dot(vb[:n].T, fk[:n])
            for m in range(M):
                row = Sb[m]
                for i in range(F):
                    row[i] = g[i] * row[i] + part[m, i] if scaled else row[i] + part[m, i]


@parallel_entry
def prefill(k, v, St, z, feat, *, code, rule=RULE_ADDITIVE, inputs=None, block=None):
    """The state after T tokens (no outputs): :func:`prefill_kernel`, or for the delta rules the step
    kernel without reads (token by token; ``feat`` (2, B, F) scratch in the state dtype)."""
    B, T, F = k.shape[0], k.shape[1], St.shape[2]
    lg = log_factors(rule, flat_inputs(inputs, B, T, F), B, T, F)
    if is_delta(rule):
        out = np.empty((0, 0, 0), dtype=St.dtype)
        pick_kernel(B, T, St.shape[1], F)(k, k, v, St, z, out, feat, np.int64(code), -math.inf, False,
                                           np.int64(rule), lg, np.int64(NORM_NONE), False)
    else:
        prefill_kernel(k, v, St, z, np.int64(code), np.int64(rule), lg, block_arg(block))


#: ``kind`` of :func:`fill_token_inputs`: factors in [0, 1], log-factors <= 0, write strengths in [0, 2].
FILL_DECAY = 0
FILL_LOG_DECAY = 1
FILL_BETA = 2


@njit(cache=config.CACHE)
def fill_token_inputs(x, out, kind, log_reset):
    """Check one token's per-sequence inputs ``x`` (1-D, one per batch entry, or one for all) and write
    the kernels' form into ``out`` (float64): the log-factor (``-inf`` at or below ``log_reset``) for
    ``FILL_DECAY``/``FILL_LOG_DECAY``, the value for ``FILL_BETA``.

    Returns False, ``out`` partly written, when a value is NaN or out of range (the caller then takes
    the validating path).  No fast-math, so NaN compares as NaN.
    """
    n = out.shape[0]
    one = x.shape[0] == 1
    for i in range(n):
        a = np.float64(x[0] if one else x[i])
        if kind == FILL_BETA:
            if not (a >= 0.0 and a <= 2.0):
                return False
            out[i] = a
            continue
        if kind == FILL_DECAY:
            if not (a >= 0.0 and a <= 1.0):
                return False
            a = np.log(a) if a > 0.0 else -np.inf
        elif not (a <= 0.0):
            return False
        out[i] = -np.inf if a <= log_reset else a
    return True


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _kv_one(q, K, V, length, causal_new, out, scale, block, b):
    """Every query of batch entry b against its cached keys: online softmax over key blocks (GEMVs through
    BLAS from 128 keys a block, plain loops below).
    """
    T, D = q.shape[1], q.shape[2]
    M = V.shape[2]
    zero = K.dtype.type(0)
    qs = np.empty(D, dtype=K.dtype)
    acc = np.empty(M)
    accb = np.empty(M, dtype=K.dtype)
    sbuf = np.empty(block, dtype=K.dtype)
    Kb = K[b]
    Vb = V[b]
    for t in range(T):
        n = length - T + t + 1 if causal_new else length
        for d in range(D):
            qs[d] = q[b, t, d] * scale
        mx = -np.inf
        tot = 0.0
        acc[:] = 0.0
        for k0 in range(0, n, block):
            k1 = min(n, k0 + block)
            nk = k1 - k0
            small = nk < 128
            if small:
                s = sbuf[:nk]
                for j in range(nk):
                    row = Kb[k0 + j]
                    a = zero
                    for d in range(D):
                        a += row[d] * qs[d]
                    s[j] = a
            else:
                s = np.dot(Kb[k0:k1], qs)
            bm = mx
            for j in range(nk):
                if s[j] > bm:
                    bm = s[j]
            alpha = np.exp(mx - bm) if mx > -np.inf else 0.0
            for j in range(nk):
                s[j] -= bm
            # exp of the (non-positive) shifted scores: ELU+1 is exp there (exp(0) = 0 + 1),
            # through the vectorised exp of the feature maps.
            phi_row(s, s, KERNEL_CODE_ELU)
            part = 0.0
            for j in range(nk):
                part += s[j]
            tot = tot * alpha + part
            mx = bm
            if small:
                accb[:] = zero
                for j in range(nk):
                    pj = s[j]
                    row = Vb[k0 + j]
                    for m in range(M):
                        accb[m] += pj * row[m]
                pv = accb
            else:
                pv = np.dot(s, Vb[k0:k1])
            for m in range(M):
                acc[m] = acc[m] * alpha + pv[m]
        for m in range(M):
            out[b, t, m] = acc[m] / tot


def _kv_attend(q, K, V, length, causal_new, out, scale, block):
    """Softmax of each query against the cached keys, blocked with a running max; serial and parallel twins.

    q (B, T, D), the cache K (B, cap, D), V (B, cap, M) of one dtype, its first
    ``length`` rows valid.  ``causal_new``: the T queries are the last T cached tokens
    and query t sees keys ``< length - T + t + 1``; else every query sees all.
    """
    for b in prange(q.shape[0]):
        _kv_one(q, K, V, length, causal_new, out, scale, block, np.int64(b))  # one helper type (see _step_all)


kv_attend_serial, kv_attend_parallel = serial_and_parallel(_kv_attend, fastmath=config.FASTMATH,
                                                           cache=config.CACHE)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _kv_append(k, v, K, V, length):
    B, T, D = k.shape
    M = v.shape[2]
    for b in range(B):
        for t in range(T):
            for d in range(D):
                K[b, length + t, d] = k[b, t, d]
            for m in range(M):
                V[b, length + t, m] = v[b, t, m]


def _kv_step(q, k, v, K, V, length, out, scale, block, check, check_out):
    """Check, append the T new tokens at ``length``, attend (the cache has room).  Returns 0, or 1/2/3
    (nothing appended) when ``check`` finds q/k/v non-finite, or :data:`RESULT_NOT_FINITE` (the tokens
    appended) when ``check_out`` finds an output that is not finite (scores beyond the cache's dtype).
    """
    if check:
        bad = first_nonfinite(q, k, v)
        if bad:
            return bad
    _kv_append(k, v, K, V, length)
    n = length + q.shape[1]
    for b in prange(q.shape[0]):
        _kv_one(q, K, V, n, True, out, scale, block, np.int64(b))  # one helper type (see _step_all)
    if check_out and not outputs_finite(out):
        return RESULT_NOT_FINITE
    return 0


kv_step_serial, kv_step_parallel = serial_and_parallel(_kv_step, fastmath=config.FASTMATH, cache=config.CACHE)


def pick_kv_kernel(b, t, length, d, m):
    """Serial below ``config.KV_PARALLEL_MIN_WORK`` multiply-adds, else parallel."""
    return pick(kv_step_serial, kv_step_parallel, items=b, work=b * t * length * (d + m),
                limit="KV_PARALLEL_MIN_WORK")


@parallel_entry
def kv_attend(q, K, V, length, out, *, scale, causal_new, block=None):
    """Launcher: the parallel kernel from ``config.KV_PARALLEL_MIN_WORK`` multiply-adds on."""
    block = config.knob_int("KV_BLOCK") if block is None else int(block)
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    B, T, D = q.shape
    kern = pick(kv_attend_serial, kv_attend_parallel, items=B, work=B * T * int(length) * (D + V.shape[2]),
                limit="KV_PARALLEL_MIN_WORK")
    kern(q, K, V, np.int64(length), bool(causal_new), out, float(scale), np.int64(block))
    return out
