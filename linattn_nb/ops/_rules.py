"""Per-rule hooks of the CPU kernels: the parts of a kernel that depend on the update rule.

Every hook is a small ``@njit`` function taking the rule code (``RULE_*`` of
:mod:`linattn_nb.ops._codes`) first, so the kernels are written once; the state is
``H = [S | z]`` (F, M + 1) float64.  The hooks, the delta rules' WY/UT chunk form and
how to add a rule: ``docs/adding_an_update_rule.md``, "CPU kernels".
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .. import config
from ._codes import (RULE_ADDITIVE, RULE_DECAY, RULE_DELTA, RULE_GATE, RULE_GATED_DELTA, check_rule_inputs,
                     rule_name)
from ._gemm import gemm
from ._vec import elu1


def check_rule(rule, inputs) -> np.int64:
    """The kernels' ``rule`` argument (int64), after checking ``rule`` and the launcher's ``inputs=``.

    Raises ValueError for an unknown code or ``inputs`` other than the rule's.
    """
    return np.int64(check_rule_inputs(rule, inputs))


def check_state(H, batch: int, f: int, m: int) -> None:
    """Raise ValueError unless ``H`` is the (batch, f, m + 1) C-contiguous float64 state of the contract."""
    if not isinstance(H, np.ndarray) or H.dtype != np.float64 or H.shape != (batch, f, m + 1) \
            or not H.flags.c_contiguous or not H.flags.writeable:
        desc = (f"{type(H).__name__} {getattr(H, 'dtype', '')} {getattr(H, 'shape', '')}").strip()
        raise ValueError(f"H must be a writeable C-contiguous float64 array of shape ({batch}, {f}, {m + 1}) "
                         f"(the state [S | z]), got {desc}")


def log_factors(rule, inputs, batch: int, n: int, f: int) -> np.ndarray:
    """The kernels' ``lg`` argument: the rule's per-token log-factors, writeable (batch, n, G) float64.

    ``G``: 0 additive, 1 decay, ``f`` gate, 2 the delta rules (column 0 the
    log-decay, 0 for ``delta``; column 1 ``beta``), so every rule's kernels get
    the same Numba types.  Call after :func:`check_rule`.

    Raises ValueError naming the input when its shape is not the rule's.
    """
    if rule == RULE_DELTA or rule == RULE_GATED_DELTA:
        out = np.zeros((batch, n, 2))
        names = ("beta", "log_decay") if rule == RULE_GATED_DELTA else ("beta",)
        for name in names:
            x = np.asarray(inputs[name])
            if x.shape != (batch, n):
                raise ValueError(f"inputs: {name} of the {rule_name(rule)} rule must have shape {(batch, n)}, "
                                 f"got {x.shape}")
            out[:, :, 1 if name == "beta" else 0] = x
        return out
    if rule == RULE_DECAY:
        name, shape = "log_decay", (batch, n)
    elif rule == RULE_GATE:
        name, shape = "log_gate", (batch, n, f)
    else:
        return np.empty((batch, n, 0))
    x = np.asarray(inputs[name])
    if x.shape != shape:
        raise ValueError(f"inputs: {name} of the {rule_name(rule)} rule must have shape {shape}, got {x.shape}")
    # writeable (a read-only array is another Numba type: every kernel would compile once more)
    return np.require(x, np.float64, ("C", "W")).reshape(batch, n, 1 if rule == RULE_DECAY else f)


@njit(fastmath=config.FASTMATH, cache=config.CACHE, inline="always")
def token_step(rule, S, z, i, a, c, v, num, g):
    """Row ``i`` of the scan's state ``S`` (F, M), ``z`` (F,) after one token, in place; returns new ``z[i]``.

    ``a = phi(k_t)[i]``, ``c = phi(q_t)[i]``, ``v`` (M,) the token's values,
    ``num`` (M,) += ``c * S[i]`` (the new row), ``g`` the row's factor (decay,
    gate; ``g = 0`` wipes the row exactly).
    """
    if rule == RULE_ADDITIVE:
        zi = z[i] + a  # the normaliser: value column M, whose value is 1
        z[i] = zi
        for m in range(v.shape[0]):
            s = S[i, m] + a * v[m]
            S[i, m] = s
            num[m] += c * s
        return zi
    if rule == RULE_DECAY or rule == RULE_GATE:
        zi = g * z[i] + a
        z[i] = zi
        for m in range(v.shape[0]):
            s = g * S[i, m] + a * v[m]
            S[i, m] = s
            num[m] += c * s
        return zi
    return np.nan  # unreachable: launchers check the rule code


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def is_delta(rule):
    """Whether ``rule`` is one of the delta rules (their state update reads the state: :func:`delta_token`)."""
    return rule == RULE_DELTA or rule == RULE_GATED_DELTA


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def delta_token(S, z, fk, fq, v, a, beta, num, u):
    """One token of the (gated) delta rule on the whole state, read by the token's query; returns its normaliser.

    ``H <- a (I - beta k k^T) H + beta k [v 1]`` in place on ``S`` (F, M), ``z``
    (F,), as ``u = beta ([v 1] - a k^T H)``, ``H <- a H + k u^T`` (``k = fk``;
    ``a = 1`` for ``delta``, 0 a reset); ``num`` (M,) <- ``fq^T S`` of the new
    state; ``u`` (M,) scratch.
    """
    F = fk.shape[0]
    M = v.shape[0]
    for m in range(M):
        u[m] = 0.0
    uz = 0.0
    for i in range(F):
        ki = fk[i]
        for m in range(M):
            u[m] += ki * S[i, m]
        uz += ki * z[i]
    for m in range(M):
        u[m] = beta * (v[m] - a * u[m])
        num[m] = 0.0
    uz = beta * (1.0 - a * uz)
    den = 0.0
    for i in range(F):
        ki = fk[i]
        c = fq[i]
        for m in range(M):
            s = a * S[i, m] + ki * u[m]
            S[i, m] = s
            num[m] += c * s
        zi = a * z[i] + ki * uz
        z[i] = zi
        den += c * zi
    return den


# ---------------------------------------------------------------------------
# Decode-step hooks (:mod:`linattn_nb.ops.step.cpu`): the state is kept transposed, a row
# ``S^T[m]`` per value column, so a token's update and its query's read fuse into one pass.
# ---------------------------------------------------------------------------
@njit(fastmath=config.FASTMATH, cache=config.CACHE, inline="always")
def step_inputs(rule, lg, b, t, g):
    """Token t of sequence b for the other step hooks: ``g`` (F,) <- its factor per feature (decay,
    gate); returns ``(a, beta)``, its scalar factor and write strength (the delta rules; else (1, 0)).
    ``lg`` as :func:`log_factors`; ``exp(-inf) = 0`` is a reset.
    """
    if rule == RULE_DECAY or rule == RULE_GATE:
        if lg.shape[2] == 1:
            a = math.exp(lg[b, t, 0])
            for i in range(g.shape[0]):
                g[i] = a
        else:
            for i in range(g.shape[0]):
                g[i] = math.exp(lg[b, t, i])
    elif rule == RULE_DELTA or rule == RULE_GATED_DELTA:
        return math.exp(lg[b, t, 0]), lg[b, t, 1]  # exp(0) = 1 exactly for the delta rule
    return 1.0, 0.0


@njit(fastmath=config.FASTMATH, cache=config.CACHE, inline="always")
def step_normaliser(rule, z, fa, fc, g, a, beta):
    """z (F,) <- the normaliser after the token (:func:`step_inputs` gives ``g``, ``a``, ``beta``); returns
    ``phi(q)^T z`` (float64, not floored).  Delta rules: ``a z + beta (1 - a fa^T z) fa`` in float64.
    """
    den = 0.0
    if rule == RULE_DELTA or rule == RULE_GATED_DELTA:
        kz = 0.0
        for i in range(z.shape[0]):
            kz += fa[i] * z[i]
        rz = beta * (1.0 - a * kz)
        for i in range(z.shape[0]):
            zi = a * z[i] + rz * fa[i]
            z[i] = zi
            den += fc[i] * zi
    elif rule == RULE_DECAY or rule == RULE_GATE:
        for i in range(z.shape[0]):
            zi = g[i] * z[i] + fa[i]
            z[i] = zi
            den += fc[i] * zi
    else:
        for i in range(z.shape[0]):
            zi = z[i] + fa[i]
            z[i] = zi
            den += fc[i] * zi
    return den


@njit(fastmath=config.FASTMATH, cache=config.CACHE, inline="always")
def step_row(rule, row, fa, fc, g, w, a, beta):
    """One row ``S^T[m]`` (F,) of the state after the token, whose value is ``w = v_t[m]``; returns its
    read ``fc^T row`` (the state dtype).  The delta rules take a first pass for ``fa^T row``; a reset
    (``g = 0`` or ``a = 0``) wipes the row exactly.
    """
    acc = row.dtype.type(0)
    if rule == RULE_DELTA or rule == RULE_GATED_DELTA:
        d = row.dtype.type(0)
        for i in range(row.shape[0]):
            d += fa[i] * row[i]
        r = row.dtype.type(beta * (w - a * d))
        af = row.dtype.type(a)
        for i in range(row.shape[0]):
            s = af * row[i] + r * fa[i]
            row[i] = s
            acc += fc[i] * s
    elif rule == RULE_DECAY or rule == RULE_GATE:
        for i in range(row.shape[0]):
            s = g[i] * row[i] + fa[i] * w
            row[i] = s
            acc += fc[i] * s
    else:
        for i in range(row.shape[0]):
            s = row[i] + fa[i] * w
            row[i] = s
            acc += fc[i] * s
    return acc


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def chunk_values(rule, X, R, fk, o, n, F, fs, fw, w, sY, sKK):
    """The delta rules: ``R``'s value rows ``[V_c 1]`` <- ``U'`` of the WY/UT transform; other rules: nothing.

    ``R`` ((F + C) x (M + 1)) = ``[H ; V_c 1]``; ``fk`` (C, F) = ``phi(K_c)``;
    ``X[:n, F:F + n]`` is scratch (``K K^T``) before :func:`intra_weights` fills it;
    ``o`` (C, M + 1) and ``w`` (C,) scratch; ``fs``, ``fw`` from :func:`chunk_factors`.
    The forward substitution only mixes earlier rows into later ones, so a NaN or
    inf stays in its own and the later rows.  When ``sY`` (C, M') has rows, the
    chunk's residuals ``Y`` (``U' = diag(beta) Y``, first M' columns) go there and
    ``K K^T`` (strict lower triangle, zeros elsewhere) into ``sKK`` (C, C): what the
    chunked backward's reverse pass reads (:mod:`linattn_nb.ops.grad._cpu_chunked_delta`).
    """
    if not (rule == RULE_DELTA or rule == RULE_GATED_DELTA) or n == 0:
        return
    LX = X.shape[1]
    M1 = R.shape[1]
    wd = R.dtype.type
    for t in range(n):
        R[F + t, M1 - 1] = wd(1.0)  # the normaliser's value column (U' of the previous chunk overwrote it)
    if rule == RULE_DELTA:
        gemm(0, 0, n, M1, F, -1.0, fk, 0, F, R, 0, M1, 1.0, R, F * M1, M1)
    else:
        gemm(0, 0, n, M1, F, 1.0, fk, 0, F, R, 0, M1, 0.0, o, 0, M1)
        for t in range(n):
            h = wd(fs[1, t, 0])
            for m in range(M1):
                R[F + t, m] -= h * o[t, m]
    gemm(0, 1, n, n, F, 1.0, fk, 0, F, fk, 0, F, 0.0, X, F, LX)
    save = sY.shape[0] > 0
    Ms = sY.shape[1]
    if save:
        zero = sKK.dtype.type(0.0)
        for t in range(n):
            for j in range(t):
                sKK[t, j] = X[t, F + j]
            for j in range(t, sKK.shape[1]):
                sKK[t, j] = zero
    for t in range(n):
        if rule == RULE_GATED_DELTA:
            a = fs[0, t, 0]
            for j in range(t):
                w[j] *= a
            w[t] = 1.0
            for j in range(t):
                X[t, F + j] = X[t, F + j] * wd(w[j])
        for j in range(t):
            c = X[t, F + j]
            for m in range(M1):
                R[F + t, m] -= c * R[F + j, m]
        if save:
            for m in range(Ms):
                sY[t, m] = R[F + t, m]
        bt = fw[t, 1]
        for m in range(M1):
            R[F + t, m] *= bt


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def chunk_factors(rule, lg, b, s0, n, fs, fw, tot):
    """The factors of tokens [s0, s0 + n) of sequence ``b``, for the other chunk hooks.

    Per column of ``lg`` (B, N, G): ``fs[0, t] = fw[t] = a_t``, ``fs[1, t] = a_0 ... a_t``,
    ``fs[2, s] = a_{s+1} ... a_{n-1}``, ``tot = a_0 ... a_{n-1}``; the delta rules: the
    decays in column 0 (gated delta only) and ``fs[0, t, 1] = fw[t, 1] = beta_t``.
    Running products of factors in [0, 1]: no overflow, no ``-inf - -inf``, exactly 0
    across a reset.
    """
    G = lg.shape[2]
    if G == 0 or n == 0:
        return
    if rule == RULE_DELTA or rule == RULE_GATED_DELTA:
        # column 1: beta as it is (fs[0, t, 1], fw[t, 1]); column 0: the decays as above
        for t in range(n):
            beta = lg[b, s0 + t, 1]
            fs[0, t, 1] = beta
            fw[t, 1] = beta
        if rule == RULE_DELTA:
            return
        for t in range(n):
            a = elu1(lg[b, s0 + t, 0])
            fs[0, t, 0] = a
            fw[t, 0] = a
        fs[1, 0, 0] = fs[0, 0, 0]
        for t in range(1, n):
            fs[1, t, 0] = fs[1, t - 1, 0] * fs[0, t, 0]
        fs[2, n - 1, 0] = 1.0
        tot[0] = fs[1, n - 1, 0]
        for s in range(n - 2, -1, -1):
            fs[2, s, 0] = fs[2, s + 1, 0] * fs[0, s + 1, 0]
        return
    for t in range(n):
        for g in range(G):
            a = elu1(lg[b, s0 + t, g])  # exp of a log-factor <= 0, vectorised; -inf -> 0
            fs[0, t, g] = a
            fw[t, g] = a
    for g in range(G):
        fs[1, 0, g] = fs[0, 0, g]
    for t in range(1, n):
        for g in range(G):
            fs[1, t, g] = fs[1, t - 1, g] * fs[0, t, g]
    for g in range(G):
        fs[2, n - 1, g] = 1.0
        tot[g] = fs[1, n - 1, g]
    for s in range(n - 2, -1, -1):
        for g in range(G):
            fs[2, s, g] = fs[2, s + 1, g] * fs[0, s + 1, g]


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def intra_weights(rule, X, fk, r0, ce, F, fs, fw, w):
    """Weights of rows [r0, ce) of a chunk on its tokens [0, ce), into ``X[r0:ce, F:F + ce]``.

    ``X`` (C, F + C) holds ``phi(Q_c)`` in its first F columns; ``fk`` (C, F) is
    ``phi(K_c)``; ``fs``, ``fw`` from :func:`chunk_factors`; ``w`` (C,) scratch.
    Rows must come in order from ``r0 = 0`` (running products carry from row to
    row).  The query rows are scaled by ``fs[1, t]`` for their read of the
    chunk-start state; the gate rule decays ``fk`` in place, so after the last row
    ``fk[j]`` is key j's share of the chunk-end state.
    """
    LX = X.shape[1]
    zero = X.dtype.type(0.0)
    if rule == RULE_ADDITIVE or rule == RULE_DELTA:
        gemm(0, 1, ce - r0, ce, F, 1.0, X, r0 * LX, LX, fk, 0, F, 0.0, X, r0 * LX + F, LX)
        for t in range(r0, ce):
            for j in range(t + 1, ce):
                X[t, F + j] = zero
    elif rule == RULE_DECAY or rule == RULE_GATED_DELTA:
        gemm(0, 1, ce - r0, ce, F, 1.0, X, r0 * LX, LX, fk, 0, F, 0.0, X, r0 * LX + F, LX)
        for t in range(r0, ce):
            a = fs[0, t, 0]
            for j in range(t):
                w[j] *= a
            w[t] = 1.0
            for j in range(t + 1):
                X[t, F + j] = X[t, F + j] * w[j]
            for j in range(t + 1, ce):
                X[t, F + j] = zero
            qs = X.dtype.type(fs[1, t, 0])
            for i in range(F):
                X[t, i] *= qs
    elif rule == RULE_GATE:
        for t in range(r0, ce):
            for j in range(t):
                acc = zero
                for i in range(F):
                    x = fk[j, i] * fw[t, i]
                    fk[j, i] = x
                    acc += X[t, i] * x
                X[t, F + j] = acc
            acc = zero
            for i in range(F):
                acc += X[t, i] * fk[t, i]
            X[t, F + t] = acc
            for j in range(t + 1, ce):
                X[t, F + j] = zero
            for i in range(F):
                X[t, i] *= fw.dtype.type(fs[1, t, i])


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def chunk_transition(rule, H, R, fk, part, n, fs, tot, after_intra):
    """H (F, M + 1) float64 <- the state after the chunk's n tokens; R's state rows follow it.

    ``R`` = ``[H ; V_c 1]`` (value rows already ``U'`` for the delta rules);
    ``fk`` ``phi(K_c)`` is overwritten; ``part`` (F, M + 1) scratch; ``after_intra``:
    :func:`intra_weights` ran on every row (the gate rule's keys are decayed already).
    """
    F = fk.shape[1]
    M1 = R.shape[1]
    if rule == RULE_ADDITIVE or rule == RULE_DELTA:
        gemm(1, 0, F, M1, n, 1.0, fk, 0, F, R, F * M1, M1, 0.0, part, 0, M1)
        absorb(H, part, R)
    elif rule == RULE_DECAY or rule == RULE_GATED_DELTA:
        for s in range(n):
            ks = fk.dtype.type(fs[2, s, 0])
            for i in range(F):
                fk[s, i] *= ks
        gemm(1, 0, F, M1, n, 1.0, fk, 0, F, R, F * M1, M1, 0.0, part, 0, M1)
        absorb(H, part, R, tot[0])
    elif rule == RULE_GATE:
        if not after_intra:
            for s in range(n):
                for i in range(F):
                    fk[s, i] *= fk.dtype.type(fs[2, s, i])
        gemm(1, 0, F, M1, n, 1.0, fk, 0, F, R, F * M1, M1, 0.0, part, 0, M1)
        for i in range(F):
            g = tot[i]
            for m in range(M1):
                h = g * H[i, m] + part[i, m]
                H[i, m] = h
                R[i, m] = h


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def absorb(H, part, R, g=1.0):
    """H (F, M + 1) <- g H + part in float64, and R's first F rows follow, in one flat pass.

    All three arrays C-contiguous; ``g = 1`` gives ``h + p`` exactly.  The flat loop
    beats a loop over rows (``docs/design-cpu.md``).
    """
    h = H.reshape(-1)
    p = part.reshape(-1)
    r = R.reshape(-1)
    for j in range(h.shape[0]):
        s = g * h[j] + p[j]
        h[j] = s
        r[j] = s


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def carry(rule, acc, part, fac):
    """acc (F, M + 1) <- the state after a span whose own contribution from a zero state is ``part``.

    ``fac`` (G,) float64: the span's factor of the state before it (unused by the
    additive rule).  Not for the delta rules (their span is an (F, F) matrix).
    """
    if rule == RULE_ADDITIVE:
        for i in range(acc.shape[0]):
            for m in range(acc.shape[1]):
                acc[i, m] += part[i, m]
    elif rule == RULE_DECAY or rule == RULE_GATE:
        G = fac.shape[0]
        for i in range(acc.shape[0]):
            g = fac[0] if G == 1 else fac[i]
            for m in range(acc.shape[1]):
                acc[i, m] = g * acc[i, m] + part[i, m]
