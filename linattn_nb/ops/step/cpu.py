"""Numba CPU kernels of recurrent decoding: state step, query, prefill; KV-cache step.

State layout (see the package docstring): ``St`` of shape (B, M, F) holds
``S^T`` per batch entry, ``z`` (B, F); both in the state dtype.  Inputs q, k
(B, T, D) are raw (``code`` > 0, the elementwise map is applied inline by
:func:`linattn_nb.ops._common.phi`, through :func:`phi_row`) or already
features (code 0); v is (B, T, M).  Every kernel takes all batch*heads in one
call.

Step semantics are those of the causal scan (:mod:`linattn_nb.ops.causal.cpu`):
token t first updates the state, then reads it; the normaliser is
accumulated in float64 and floored at ``eps`` (``-inf``: no floor, raw division).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ... import config
from .._codes import KERNEL_CODE_ELU, KERNEL_CODE_L2, KERNEL_CODE_SILU_L2, NORM_FLOOR, NORM_NONE, norm_mode
from .._common import phi
from .._twins import pick, serial_and_parallel


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
    """out[:] = s / ||s|| with s = x (``l2``) or SiLU(x) (``silu_l2``); the norm in float64, no epsilon,
    a zero row maps to zero (:class:`linattn_nb.feature_maps.L2FeatureMap`)."""
    nrm = 0.0
    for i in range(x.shape[0]):
        y = _pre_l2(x[i], code)
        nrm += y * y
    nrm = math.sqrt(nrm)
    for i in range(x.shape[0]):
        out[i] = _pre_l2(x[i], code) / nrm if nrm > 0.0 else 0.0


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def phi_row(x, out, code):
    """out[:] = phi(x[:]) for the map ``code`` on one row (:func:`linattn_nb.ops._common.phi`).

    The map's ELU+1 is a branch-free ``exp`` (:func:`linattn_nb.ops._vec.elu1`),
    so the loop vectorises: libm's scalar ``exp`` would cost a large share of
    a decode step, which evaluates 2 * H * D_phi of them.  The row maps
    (``KERNEL_CODE_L2``, ``KERNEL_CODE_SILU_L2``) normalise the whole row
    ``x``: pass one token's row (several rows: :func:`phi_rows`).
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


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _advance(v, St, z, out, fa, fc, b, t, eps):
    """Token t of batch entry b, features fa = phi(k_t), fc = phi(q_t) given: update, then read.

    The row loop is the whole cost of a decode step: each row ``St[b, m]``
    (D_phi contiguous values) is updated and dotted with phi(q) in one pass.
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
    if den < eps:  # eps < 0 when there is no floor
        den = eps
    M2 = M - M % 2
    for m in range(0, M2, 2):
        # Two rows per pass share the loads of phi(k) and phi(q).
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


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _features_all(x, t, xs, dst, code):
    """dst (B*F,) = phi(x[:, t, :]) for every batch entry in one vectorised pass."""
    B = x.shape[0]
    F = x.shape[2]
    for b in range(B):
        for i in range(F):
            xs[b * F + i] = x[b, t, i]
    phi_rows(xs, dst, code, F)


def _state_step(q, k, v, St, z, out, feat, code, eps, check):
    """T tokens through the state of every batch entry.

    Per token: the features of all batch entries in two vectorised passes,
    then the row pass of each entry.  ``feat`` (2, B, F) is scratch in the
    state dtype (preallocated by the caller: no allocation in a decode step).
    Returns 0, or 1/2/3 (nothing modified) when ``check`` finds q/k/v
    non-finite.

    Compiled twice (:mod:`linattn_nb.ops._twins`): :data:`state_step_serial`
    (a decode step is a few microseconds of work) and
    :data:`state_step_parallel`, the row passes of the batch entries in
    parallel, one parallel region per token.
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
            _features_all(k, t, xs, fa, code)
            _features_all(q, t, xs, fc, code)
        for b in prange(B):
            # np.int64(b): prange's index is unsigned in the parallel twin; without the cast the helper
            # compiles a second time, for uint64, besides the serial twin's int64
            _advance(v, St, z, out, feat[0, b], feat[1, b], np.int64(b), t, eps)
    return 0


state_step_serial, state_step_parallel = serial_and_parallel(_state_step, fastmath=config.FASTMATH,
                                                             cache=config.CACHE)


def _pick_twin(serial, parallel, b, t, m, f):
    """``serial`` below ``config.STEP_PARALLEL_MIN_WORK`` multiply-adds (b t m f), else ``parallel``."""
    return pick(serial, parallel, items=b, work=b * t * m * f, limit=config.STEP_PARALLEL_MIN_WORK)


def pick_step_kernel(b, t, m, f):
    """The serial kernel below ``config.STEP_PARALLEL_MIN_WORK`` multiply-adds, else the parallel one.

    Call it as ``kern(q, k, v, St, z, out, feat, code, eps, check)`` (see
    :func:`state_step`; ``code`` int64, ``eps`` from :func:`eps_arg`).
    """
    return _pick_twin(state_step_serial, state_step_parallel, b, t, m, f)


def state_step(q, k, v, St, z, out, feat, *, code, eps, check):
    """Launcher of the step kernels; returns 0, or 1/2/3 when q/k/v is not finite.

    Nothing is modified when it returns non-zero.  q, k (B, T, D); v, out
    (B, T, M); St (B, M, F), z (B, F), feat (2, B, F) scratch, in the state
    dtype; q, k, v, out of one float32/float64 dtype.
    """
    kern = pick_step_kernel(q.shape[0], q.shape[1], St.shape[1], St.shape[2])
    return int(kern(q, k, v, St, z, out, feat, np.int64(code), eps_arg(eps), bool(check)))


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
    """The normaliser ``den``, floored at ``eps`` when ``norm`` is NORM_FLOOR."""
    if norm == NORM_FLOOR and den < eps:
        return eps
    return den


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def output(acc, den, norm):
    """An output of mode ``norm``: the numerator ``acc`` (NORM_NONE) or ``acc / den``."""
    return acc if norm == NORM_NONE else acc / den


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def state_query_kernel(q, St, z, out, feat, code, eps, norm):
    """out[b, t] = phi(q_t)^T S_b / max(phi(q_t)^T z_b, eps); the state is read only (any rule's).

    ``norm`` the output mode (:func:`linattn_nb.ops._codes.norm_mode`; ``NORM_NONE`` writes the
    numerators ``phi(q_t)^T S_b``).
    """
    B, T, _ = q.shape
    M = St.shape[1]
    F = St.shape[2]
    for b in prange(B):
        Sb = St[b]
        zb = z[b]
        fc = feat[1, b]
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


def state_query(q, St, z, out, feat, *, code, eps, normalize=True):
    state_query_kernel(q, St, z, out, feat, np.int64(code), eps_arg(eps), np.int64(norm_mode(eps, normalize)))
    return out


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def state_prefill_kernel(k, v, St, z, code, block):
    """St[b] += V_b^T phi(K_b), z[b] += sum_t phi(k_t): blocks of ``block`` tokens through BLAS.

    z is accumulated token by token (the scan's order); S per block as a GEMM
    in the state dtype.
    """
    B, T, _ = k.shape
    M = St.shape[1]
    F = St.shape[2]
    for b in prange(B):
        Sb = St[b]
        zb = z[b]
        fk = np.empty((block, F), dtype=St.dtype)
        vb = np.empty((block, M), dtype=St.dtype)
        for s0 in range(0, T, block):
            n = min(block, T - s0)
            for t in range(n):
                phi_row(k[b, s0 + t], fk[t], code)
                for i in range(F):
                    zb[i] += fk[t, i]
                for m in range(M):
                    vb[t, m] = v[b, s0 + t, m]
            part = np.dot(vb[:n].T, fk[:n])
            for m in range(M):
                for i in range(F):
                    Sb[m, i] += part[m, i]


def state_prefill(k, v, St, z, *, code, block=None):
    state_prefill_kernel(k, v, St, z, code, block_arg(block))


# ---------------------------------------------------------------------------
# Rules with a factor per token: decay (one per sequence and token) and gate
# (one per feature as well).  ``lg`` (B, T, G) float64 holds the log-factors:
# G = 0 none (the additive rule, factor 1), G = 1 one per token (decay), G = F
# one per feature (gate).  -inf is a reset: exp(-inf) = 0 multiplies the
# state away exactly.  The additive rule with normalize=True keeps the kernels
# above; these run the other rules and normalize=False.
# ---------------------------------------------------------------------------
@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def factor_row(lg, b, t, g):
    """g[:] = the factors of token t of batch entry b (1, exp(lg[b, t, 0]) or exp(lg[b, t, :]))."""
    G = lg.shape[2]
    F = g.shape[0]
    if G == 0:
        for i in range(F):
            g[i] = 1.0
    elif G == 1:
        a = math.exp(lg[b, t, 0])
        for i in range(F):
            g[i] = a
    else:
        for i in range(F):
            g[i] = math.exp(lg[b, t, i])


def _rule_step(q, k, v, St, z, out, feat, code, eps, check, lg, norm):
    """T tokens through the state, each first scaling it by its factors: H <- a_t (.) H + phi(k_t)^T [v_t 1].

    Layout and arguments as :func:`_state_step`, with ``feat`` (3, B, F)
    (phi(k), phi(q), the factors), ``lg`` (B, T, G) the log-factors (see
    above) and ``norm`` the output mode (:func:`linattn_nb.ops._codes.norm_mode`:
    ``NORM_NONE`` writes ``phi(q)^T S`` undivided).  Each batch entry walks
    its tokens alone (``prange`` over the batch in the parallel twin).
    Returns 0, or 1/2/3 (nothing modified) when ``check`` finds q/k/v
    non-finite.
    """
    if check:
        bad = first_nonfinite(q, k, v)
        if bad:
            return bad
    B, T, _ = q.shape
    M = St.shape[1]
    F = St.shape[2]
    zero = St.dtype.type(0)
    for b in prange(B):
        Sb = St[b]
        zb = z[b]
        fa = feat[0, b]
        fc = feat[1, b]
        g = feat[2, b]
        for t in range(T):
            phi_row(k[b, t], fa, code)
            phi_row(q[b, t], fc, code)
            factor_row(lg, b, t, g)
            den = 0.0
            for i in range(F):
                zi = g[i] * zb[i] + fa[i]
                zb[i] = zi
                den += fc[i] * zi
            den = floored(den, eps, norm)
            for m in range(M):
                w = v[b, t, m]
                row = Sb[m]
                acc = zero
                for i in range(F):
                    s = g[i] * row[i] + fa[i] * w
                    row[i] = s
                    acc += fc[i] * s
                out[b, t, m] = output(acc, den, norm)
    return 0


rule_step_serial, rule_step_parallel = serial_and_parallel(_rule_step, fastmath=config.FASTMATH,
                                                           cache=config.CACHE)


def log_decay_arg(inputs, B, T):
    """``inputs["log_decay"]`` as the kernels' ``lg`` (B, T, 1) float64."""
    return np.ascontiguousarray(inputs["log_decay"], dtype=np.float64).reshape(B, T, 1)


def log_factors(inputs, B, T):
    """The kernels' ``lg`` (B, T, G) float64 from a launcher's ``inputs`` (None: G = 0)."""
    if not inputs:
        return np.zeros((B, T, 0))
    if "log_decay" in inputs:
        return log_decay_arg(inputs, B, T)
    lg = np.ascontiguousarray(inputs["log_gate"], dtype=np.float64)
    return lg.reshape(B, T, lg.shape[-1])


def pick_rule_kernel(b, t, m, f):
    """The serial rule step kernel below ``config.STEP_PARALLEL_MIN_WORK`` multiply-adds, else the
    parallel one (arguments: :func:`_rule_step`)."""
    return _pick_twin(rule_step_serial, rule_step_parallel, b, t, m, f)


def rule_step(q, k, v, St, z, out, feat, *, code, eps, check, inputs=None, normalize=True):
    """Launcher of the rule step kernels (serial below ``config.STEP_PARALLEL_MIN_WORK``).

    ``inputs``: None (additive), ``{"log_decay": (B, T)}`` or
    ``{"log_gate": (B, T, F)}``; ``feat`` (3, B, F) scratch in the state dtype.
    Returns 0, or 1/2/3 when q/k/v is not finite (nothing modified).
    """
    B, T = q.shape[0], q.shape[1]
    M, F = St.shape[1], St.shape[2]
    kern = pick_rule_kernel(B, T, M, F)
    return int(kern(q, k, v, St, z, out, feat, np.int64(code), eps_arg(eps), bool(check),
                    log_factors(inputs, B, T), np.int64(norm_mode(eps, normalize))))


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def rule_prefill_kernel(k, v, St, z, code, lg, block):
    """The state after T tokens of a rule with factors, in blocks of ``block`` tokens through BLAS.

    Within a block of n tokens, token s enters the block's end state scaled
    by ``w_s = a_{s+1} ... a_{n-1}`` (per row), built as a running product
    from the end of the block (never a difference of log-factors, so a reset
    gives exact zeros and no NaN); the state before the block is scaled by
    ``w_0 a_0``.  Then ``S <- (w_0 a_0) (.) S + V^T (w (.) phi(K))`` is one GEMM.
    """
    B, T, _ = k.shape
    M = St.shape[1]
    F = St.shape[2]
    for b in prange(B):
        Sb = St[b]
        zb = z[b]
        fk = np.empty((block, F), dtype=St.dtype)
        vb = np.empty((block, M), dtype=St.dtype)
        w = np.empty((block, F))
        g = np.empty(F)
        for s0 in range(0, T, block):
            n = min(block, T - s0)
            for i in range(F):
                w[n - 1, i] = 1.0
            for s in range(n - 2, -1, -1):
                factor_row(lg, b, s0 + s + 1, g)
                for i in range(F):
                    w[s, i] = w[s + 1, i] * g[i]
            factor_row(lg, b, s0, g)
            for i in range(F):
                g[i] *= w[0, i]  # the factor of the state before the block
            for t in range(n):
                phi_row(k[b, s0 + t], fk[t], code)
                for i in range(F):
                    fk[t, i] = fk[t, i] * w[t, i]
                for m in range(M):
                    vb[t, m] = v[b, s0 + t, m]
            for i in range(F):
                acc = 0.0
                for t in range(n):
                    acc += fk[t, i]
                zb[i] = g[i] * zb[i] + acc
            part = np.dot(vb[:n].T, fk[:n])
            for m in range(M):
                row = Sb[m]
                for i in range(F):
                    row[i] = g[i] * row[i] + part[m, i]


def rule_prefill(k, v, St, z, *, code, inputs=None, block=None):
    """Launcher of :func:`rule_prefill_kernel` (``inputs`` as :func:`rule_step`)."""
    B, T = k.shape[0], k.shape[1]
    rule_prefill_kernel(k, v, St, z, np.int64(code), log_factors(inputs, B, T), block_arg(block))


# ---------------------------------------------------------------------------
# The delta rules: each token corrects the state instead of adding to it.
# On H = [S | z] (every column alike), with k = phi(k_t):
#     H <- a_t (I - beta_t k k^T) H + beta_t k [v_t 1]
#        = a_t H + beta_t k ([v_t 1] - a_t k^T H)
# a_t = 1 (delta) or exp(lg[b, t, 0]) (gated delta, -inf a reset); beta (B, T)
# float64 write strengths.  Per row m of S^T: one pass for k^T H[:, m], one for
# the update and the read.
# ---------------------------------------------------------------------------
def _delta_step(q, k, v, St, z, out, feat, code, eps, check, lg, beta, norm, read):
    """T tokens of the delta rule (``lg`` (B, T, 0)) or the gated delta rule (``lg`` (B, T, 1)).

    Layout and arguments as :func:`_rule_step`, with ``beta`` (B, T) float64.
    ``read`` False absorbs the tokens without outputs (a prefill: ``q`` and
    ``out`` are not touched).  Each batch entry walks its tokens alone
    (``prange`` over the batch in the parallel twin).  Returns 0, or 1/2/3
    (nothing modified) when ``check`` finds q/k/v non-finite.
    """
    if check:
        bad = first_nonfinite(q, k, v)
        if bad:
            return bad
    B, T, _ = k.shape
    M = St.shape[1]
    F = St.shape[2]
    G = lg.shape[2]
    zero = St.dtype.type(0)
    for b in prange(B):
        Sb = St[b]
        zb = z[b]
        fa = feat[0, b]
        fc = feat[1, b]
        for t in range(T):
            phi_row(k[b, t], fa, code)
            if read:
                phi_row(q[b, t], fc, code)
            a = math.exp(lg[b, t, 0]) if G > 0 else 1.0
            bt = beta[b, t]
            kz = 0.0
            for i in range(F):
                kz += fa[i] * zb[i]
            rz = bt * (1.0 - a * kz)
            den = 0.0
            for i in range(F):
                zi = a * zb[i] + rz * fa[i]
                zb[i] = zi
                den += fc[i] * zi
            den = floored(den, eps, norm)
            af = St.dtype.type(a)
            for m in range(M):
                row = Sb[m]
                d = zero
                for i in range(F):
                    d += fa[i] * row[i]
                r = St.dtype.type(bt * (v[b, t, m] - a * d))
                acc = zero
                for i in range(F):
                    s = af * row[i] + r * fa[i]
                    row[i] = s
                    acc += fc[i] * s
                if read:
                    out[b, t, m] = output(acc, den, norm)
    return 0


delta_step_serial, delta_step_parallel = serial_and_parallel(_delta_step, fastmath=config.FASTMATH,
                                                             cache=config.CACHE)


def delta_arrays(inputs, B, T):
    """The kernels' ``lg`` (B, T, G) (G = 1 with ``log_decay``, the gated delta rule, else 0) and
    ``beta`` (B, T), float64, from a delta-rule launcher's ``inputs``."""
    beta = np.ascontiguousarray(inputs["beta"], dtype=np.float64).reshape(B, T)
    lg = log_decay_arg(inputs, B, T) if "log_decay" in inputs else np.zeros((B, T, 0))
    return lg, beta


def pick_delta_kernel(B, T, M, F):
    """The serial delta step kernel below ``config.STEP_PARALLEL_MIN_WORK`` multiply-adds, else the
    parallel one (arguments: :func:`_delta_step`)."""
    return _pick_twin(delta_step_serial, delta_step_parallel, B, T, M, F)


def delta_step(q, k, v, St, z, out, feat, *, code, eps, check, inputs, normalize=False):
    """Launcher of the delta-rule step kernels (serial below ``config.STEP_PARALLEL_MIN_WORK``).

    ``inputs``: ``{"beta": (B, T)}`` (delta) or ``{"beta": (B, T), "log_decay": (B, T)}``
    (gated delta); ``feat`` (>= 2, B, F) scratch in the state dtype.  Returns 0, or
    1/2/3 when q/k/v is not finite (nothing modified).
    """
    B, T = q.shape[0], q.shape[1]
    lg, beta = delta_arrays(inputs, B, T)
    kern = pick_delta_kernel(B, T, St.shape[1], St.shape[2])
    return int(kern(q, k, v, St, z, out, feat, np.int64(code), eps_arg(eps), bool(check), lg, beta,
                    np.int64(norm_mode(eps, normalize)), True))


def delta_prefill(k, v, St, z, feat, *, code, inputs):
    """The state after T tokens of a delta rule (token by token; no outputs)."""
    B, T = k.shape[0], k.shape[1]
    lg, beta = delta_arrays(inputs, B, T)
    kern = pick_delta_kernel(B, T, St.shape[1], St.shape[2])
    out = np.empty((0, 0, 0), dtype=St.dtype)
    kern(k, k, v, St, z, out, feat, np.int64(code), -math.inf, False, lg, beta, np.int64(NORM_NONE), False)


#: ``kind`` of :func:`fill_token_inputs`: factors in [0, 1], log-factors <= 0, write strengths in [0, 2].
FILL_DECAY = 0
FILL_LOG_DECAY = 1
FILL_BETA = 2


@njit(cache=config.CACHE)
def fill_token_inputs(x, out, kind, log_reset):
    """Check one token's per-sequence inputs ``x`` (1-D, one value per batch entry, or a single value
    for all) and write the kernels' form into ``out`` (1-D, float64): the log-factor (``-inf`` at or
    below ``log_reset``) for ``FILL_DECAY``/``FILL_LOG_DECAY``, the value for ``FILL_BETA``.

    Returns False, with ``out`` partly written, when a value is NaN or out of its range: the caller
    then takes the validating path, whose error names the argument.  (The single-token fast path of
    :class:`linattn_nb.LinearAttentionState`; no fast-math, so NaN compares as NaN.)
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
    """Every query of batch entry b against its cached keys: online softmax over key blocks.

    Scores ``K_blk q`` and the weighted sum ``p^T V_blk`` are GEMVs: through BLAS
    for blocks of at least 128 keys, as plain loops below (a BLAS call costs
    more than a short block; docs/measurements-cpu.md).
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
    """Softmax of each query against the cached keys, blocked with a running max.

    q (B, T, D) and the cache K (B, cap, D), V (B, cap, M) share one dtype; the
    first ``length`` cache rows are valid.  With ``causal_new`` the T queries
    are the last T cached tokens and query t sees keys ``< length - T + t + 1``;
    else every query sees all ``length`` keys.  Scores and probabilities are
    in the cache dtype (GEMV through BLAS per key block), the running
    normaliser and accumulator in float64.  Compiled serial and parallel over
    the batch (:data:`kv_attend_serial`, :data:`kv_attend_parallel`).
    """
    for b in prange(q.shape[0]):
        _kv_one(q, K, V, length, causal_new, out, scale, block, np.int64(b))  # one helper type (see _state_step)


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


def _kv_step(q, k, v, K, V, length, out, scale, block, check):
    """Check, append the T new tokens at ``length``, attend (the cache has room).

    Returns 0, or 1/2/3 (nothing appended) when ``check`` finds q/k/v
    non-finite.  Compiled serial and parallel over the batch
    (:data:`kv_step_serial`, :data:`kv_step_parallel`).
    """
    if check:
        bad = first_nonfinite(q, k, v)
        if bad:
            return bad
    _kv_append(k, v, K, V, length)
    n = length + q.shape[1]
    for b in prange(q.shape[0]):
        _kv_one(q, K, V, n, True, out, scale, block, np.int64(b))  # one helper type (see _state_step)
    return 0


kv_step_serial, kv_step_parallel = serial_and_parallel(_kv_step, fastmath=config.FASTMATH, cache=config.CACHE)


def pick_kv_kernel(b, t, length, d, m):
    """Serial below ``config.KV_PARALLEL_MIN_WORK`` multiply-adds, else parallel."""
    return pick(kv_step_serial, kv_step_parallel, items=b, work=b * t * length * (d + m),
                limit=config.KV_PARALLEL_MIN_WORK)


def kv_attend(q, K, V, length, out, *, scale, causal_new, block=None):
    """Launcher: the parallel kernel from ``config.KV_PARALLEL_MIN_WORK`` multiply-adds on.

    (A parallel region waits for every thread: on a busy machine that can cost a
    scheduler time slice, milliseconds, which would swamp short contexts.)
    """
    block = int(config.KV_BLOCK if block is None else block)
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    B, T, D = q.shape
    kern = pick(kv_attend_serial, kv_attend_parallel, items=B, work=B * T * int(length) * (D + V.shape[2]),
                limit=config.KV_PARALLEL_MIN_WORK)
    kern(q, K, V, np.int64(length), bool(causal_new), out, float(scale), np.int64(block))
    return out
