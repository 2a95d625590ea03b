"""Per-rule hooks of the CPU kernels: the parts of a kernel that depend on the update rule.

The state of every rule is ``H = [S | z]`` of shape (F, M + 1), float64: the
normaliser ``z`` is the state of one more value column of ones, so a rule
that updates ``S`` gets the normaliser for free.  The CPU kernels are written
once; what a rule changes in them are the small ``@njit`` functions below,
each taking the rule code (``RULE_*`` of :mod:`linattn_nb.ops._codes`) as its
first argument:

* :func:`token_step` -- one token's update of one state row, read by the
  token's query: the per-token recurrence of the scan
  (:mod:`linattn_nb.ops.causal.cpu`; additive: ``S_i += phi(k_t)_i v_t``,
  ``z_i += phi(k_t)_i``; decay and gate: the row scaled by the token's
  factor first);
* :func:`chunk_factors` -- the running products of a chunk's per-token
  factors that the next two hooks use (nothing for the additive rule);
* :func:`intra_weights` -- the intra-chunk weights of a block of rows
  (additive: ``tril(phi(Q_c) phi(K_c)^T)``, diagonal included), in the
  chunked kernel (:mod:`linattn_nb.ops.causal.chunked`);
* :func:`chunk_transition` -- the state across one chunk (additive:
  ``H += phi(K_c)^T [V_c 1]``), in the chunked kernel;
* :func:`chunk_values` -- the delta rules' value rows of a chunk (the
  WY/UT transform below; nothing for the other rules);
* :func:`carry` -- the state across a span whose own contribution is known
  (additive: ``H += part``), used by the prefix over segments and the
  combine of pieces (:mod:`linattn_nb.ops._chunks`).
* :func:`step_inputs`, :func:`step_normaliser`, :func:`step_row` -- the
  decode step (:mod:`linattn_nb.ops.step.cpu`),
  whose state is stored transposed (a row ``S^T[m]`` per value column): a
  token's factors, its update of ``z``, and its update of one row read by
  its query, every rule's (the delta rules' included).

The delta rules (``delta``, ``gated_delta``) read the state before they
write it, so their token update is not a row-by-row one: the scan calls
:func:`delta_token` for the whole token instead of :func:`token_step`.  In
the chunked kernel they are the WY/UT transform (Yang et al. 2024,
"Parallelizing Linear Transformers with the Delta Rule over Sequence
Length"; ``docs/theory.md``): per chunk, with ``e^b`` the
running products of the chunk's decays (1 for ``delta``) and ``G_ts`` their
ratios,

    Y  = [V 1] - (e^b * K) H                        (one GEMM)
    U' = L^{-1} diag(beta) Y,   L = I + tril(diag(beta) (G * K K^T), -1)
                                                    (one GEMM for K K^T, a unit
                                                     lower-triangular solve)
    O  = [e^b * Q | tril(G * Q K^T)] [H ; U']       (the additive/decay form)
    H <- e^{b_n} H + (e^{b_n - b} * K)^T U'         (the additive/decay form)

so :func:`chunk_values` replaces the value rows ``[V 1]`` of ``R = [H ;
V 1]`` by ``U'`` (``W = T (e^b * K)`` is never formed: ``U - W H = T Y``),
and the intra-chunk weights and the transition are those of the additive
rule (``delta``) and the decay rule (``gated_delta``) unchanged.  Their
per-token inputs reach the kernels as ``lg`` (B, N, 2): column 0 the
log-decay (0 for ``delta``), column 1 the write strength ``beta`` (not a
logarithm).  Their transition across a span is an (F, F) matrix, which
:func:`carry` does not take: the chunked kernel runs these rules
batch-parallel only (:mod:`linattn_nb.ops.causal.chunked`).

A new rule adds its entry to :data:`linattn_nb.ops._codes.RULES` and a branch
to each hook here, and nothing to the kernels' loops.  Per-token inputs reach
the kernels as one float64 array of log-factors ``lg`` (B, N, G)
(:func:`log_factors`: G = 0 additive, 1 decay, F gate), so every rule
compiles to the same Numba types; the hooks get the factors they need as
arguments (``g`` of :func:`token_step`, the products of
:func:`chunk_factors`, the span factor of :func:`carry`).  The rule is a plain integer argument (no
function-typed arguments, no closures), so the kernels stay cacheable on
disk.  As for the other helper modules, kernels cached on disk do not see
edits made here: clear the ``__pycache__`` folders after changing this file.
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
    """The kernels' ``rule`` argument, after checking ``rule`` and the launcher's ``inputs=``.

    Raises ValueError when ``rule`` is not a code of
    :data:`linattn_nb.ops._codes.RULES` or ``inputs`` does not hold exactly
    the per-token inputs the rule takes.
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
    """The kernels' ``lg`` argument: the rule's per-token log-factors as one (batch, n, G) float64 array.

    ``G`` is 0 for the additive rule (no factors), 1 for the decay rule (one
    scalar per token, ``inputs["log_decay"]`` of shape (batch, n)) and ``f``
    for the gate rule (one factor per feature, ``inputs["log_gate"]`` of
    shape (batch, n, f)).  Every rule's kernels thus get the same Numba
    types (one compilation); the array is writeable, as Numba types a
    read-only array apart.  Call after :func:`check_rule`.

    The delta rules get ``G = 2``: column 0 the log-decay
    (``inputs["log_decay"]`` of the gated delta rule, 0 for the delta rule),
    column 1 the write strength ``inputs["beta"]`` (both (batch, n)).

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
    """Row ``i`` of the state after one token, read by the token's query; returns the new ``z[i]``.

    ``S`` (F, M) and ``z`` (F,): the state of the scan (the normaliser kept
    apart), updated in place; ``a = phi(k_t)[i]``, ``c = phi(q_t)[i]``; ``v``
    (M,): the token's values; ``num`` (M,) += ``c * S[i]`` (the new row);
    ``g``: the token's factor of row ``i`` (``exp`` of its log-factor; unused
    by the additive rule).  The caller sums ``c * z[i]`` (the returned value)
    into the normaliser.  Additive: ``z[i] += a``, ``S[i] += a v``; decay and
    gate: ``z[i] = g z[i] + a``, ``S[i] = g S[i] + a v`` (``g = 0``, a reset,
    wipes the row exactly).
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

    ``S`` (F, M) and ``z`` (F,) float64: the state of the scan, updated in
    place to ``H <- a (I - beta k k^T) H + beta k [v 1]``, computed as
    ``u = beta ([v 1] - a k^T H)``, ``H <- a H + k u^T`` (``k = fk``,
    ``a = 1`` for the delta rule, ``a = 0`` a reset); ``num`` (M,) <-
    ``phi(q)^T S`` of the new state (``fq = phi(q)``), ``u`` (M,) scratch.
    Two passes over the state (the read ``k^T H``, then the write and the
    query's read), each vectorised over a row.
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
# Decode-step hooks (:mod:`linattn_nb.ops.step.cpu`).  The step kernel keeps the
# state transposed, one contiguous row ``S^T[m]`` of F values per value column
# m, so that a token's update and its query's read fuse into one pass over each
# row; these hooks are the per-rule parts of that pass.
# ---------------------------------------------------------------------------
@njit(fastmath=config.FASTMATH, cache=config.CACHE, inline="always")
def step_inputs(rule, lg, b, t, g):
    """Token t of sequence b for the other step hooks: ``g`` (F,) <- its factor per feature (decay,
    gate); returns ``(a, beta)``, its scalar factor and write strength (the delta rules; else (1, 0)).

    ``lg`` (B, T, G) float64 as :func:`log_factors` (decay G = 1, gate G = F,
    the delta rules G = 2); ``exp(-inf) = 0`` is a reset.  ``g`` is in the
    state dtype (each factor rounded once).
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
    """z (F,) <- the normaliser after the token; returns ``phi(q)^T z`` (float64, not floored).

    ``fa = phi(k)``, ``fc = phi(q)``, ``g``, ``a``, ``beta``: :func:`step_inputs`.
    Additive: ``z + fa``; decay and gate: ``g z + fa``; the delta rules:
    ``a z + beta (1 - a fa^T z) fa`` (in float64, rounded once to the state dtype).
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
    read ``fc^T row`` (the state dtype).

    Additive: ``row + w fa``; decay and gate: ``g row + w fa``; the delta
    rules: ``a row + r fa`` with ``r = beta (w - a fa^T row)`` (a first pass
    for ``fa^T row``).  ``g = 0`` or ``a = 0`` (a reset) wipes the row exactly.
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
def chunk_values(rule, X, R, fk, o, n, F, fs, fw, w):
    """The delta rules: ``R``'s value rows ``[V_c 1]`` <- ``U'`` of the WY/UT transform; other rules: nothing.

    ``R`` ((F + C) x (M + 1), working dtype) = ``[H ; V_c 1]``, its first F
    rows the chunk-start state; ``fk`` (C, F) = ``phi(K_c)``; ``X`` (C, F + C):
    its weight block ``X[:n, F:F + n]`` is scratch here (``K K^T``), before
    :func:`intra_weights` fills it; ``o`` (C, M + 1) scratch; ``fs``, ``fw``:
    the chunk's factors (:func:`chunk_factors`: decays, ``beta``); ``w`` (C,)
    float64 scratch.  Computes ``Y = [V 1] - (e^b * K) H`` (one GEMM), ``K
    K^T`` (one GEMM) and solves ``L U' = diag(beta) Y``, ``L = I +
    tril(diag(beta) (G * K K^T), -1)``, by forward substitution in place
    (row t: ``U'_t = beta_t (Y_t - sum_{j<t} G_tj (k_t . k_j) U'_j)``,
    vectorised over the M + 1 columns; the ``G_tj = a_{j+1} ... a_t`` are
    running products, exactly 0 across a reset).  The solve only mixes
    earlier rows into later ones, so a NaN or inf stays in its own and the
    later rows.
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
        bt = fw[t, 1]
        for m in range(M1):
            R[F + t, m] *= bt


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def chunk_factors(rule, lg, b, s0, n, fs, fw, tot):
    """The factors of tokens [s0, s0 + n) of sequence ``b``, for the other chunk hooks.

    ``lg`` (B, N, G) float64: the per-token log-factors (:func:`log_factors`;
    G = 0 for the additive rule, which needs nothing here).  Writes, for
    ``t, s < n`` and each of the G columns:

    * ``fs[0, t] = a_t = exp(lg[b, s0 + t])``, and ``fw[t]`` the same in the
      working dtype;
    * ``fs[1, t] = a_0 a_1 ... a_t``: how token t's query reads the state at
      the chunk's start;
    * ``fs[2, s] = a_{s+1} ... a_{n-1}``: token s's share of the state at the
      chunk's end;
    * ``tot = a_0 ... a_{n-1}``: the chunk's factor of its start state.

    The delta rules (G = 2): the above for column 0 (the gated delta rule's
    decays; nothing for the delta rule, whose hooks take the additive
    branches), and ``fs[0, t, 1] = fw[t, 1] = beta_t``.

    Running products of factors in [0, 1] rather than exponentials of
    differences of cumulative log-sums: they neither overflow nor meet
    ``-inf - -inf``; a reset (``a = 0``) makes every product across it
    exactly 0, and strong decay underflows gracefully to 0.  float64; the
    exponentials through :func:`linattn_nb.ops._vec.elu1` (exp of a
    non-positive argument, vectorised; within 2.5e-308 of 0 below -708.3).
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

    ``X`` (C, F + C) holds ``phi(Q_c)`` in its first F columns; ``fk`` (C, F)
    is ``phi(K_c)``; ``fs``, ``fw``: the chunk's factors
    (:func:`chunk_factors`); ``w`` (C,) float64 scratch.  Additive:
    ``phi(Q_c) phi(K_c)^T`` with the causal mask (token t sees tokens j <=
    t), one BLAS product.  The rows of a chunk must come in order, from
    ``r0 = 0`` (the decay and gate rules carry running products from one
    row to the next).

    Decay: the additive weights times ``w_j = a_{j+1} ... a_t`` (a running
    product updated row by row: ``w <- a_t w``, ``w_t = 1``), and the query
    rows scaled by ``fs[1, t]`` for their read of the chunk-start state.

    Gate: ``A[t, j] = sum_i phi(q_t)_i phi(k_j)_i prod_{j<u<=t} alpha_{u,i}``
    directly, with the keys decayed in place row by row (``fk[j] <- alpha_t
    * fk[j]`` for ``j < t``): every factor is a product of gates in [0, 1],
    so there is no overflow and no ``-inf - -inf`` however strong the gates
    (the exact form that GLA's secondary chunking approximates with log-space
    sub-chunks; Yang et al. 2024, Sec. 4.2).  After the chunk's last row,
    ``fk[j]`` is key j's share of the chunk-end state (see
    :func:`chunk_transition`).  Then the query rows are scaled per feature
    by ``fs[1, t]``.

    The delta rules: as the additive (``delta``) and decay (``gated_delta``)
    rules; the chunk's ``U'`` (:func:`chunk_values`) makes the difference.
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

    ``R`` ((F + C) x (M + 1), working dtype) is ``[H ; V_c 1]``; ``fk``
    ``phi(K_c)`` (scratch: overwritten); ``part`` (F, M + 1) scratch of the
    working dtype; ``fs``, ``tot``: the chunk's factors
    (:func:`chunk_factors`); ``after_intra``: :func:`intra_weights` ran on
    every row of this chunk (the gate rule's keys are then decayed already).
    Additive: ``part = phi(K_c)^T [V_c 1]`` (one BLAS product in the working
    dtype), summed into ``H`` in float64.  Decay and gate: the keys are
    scaled by their share ``fs[2]`` first, and ``H <- tot * H + part``
    (``tot`` per row for the gate).  The delta rules: as the additive
    (``delta``) and decay (``gated_delta``) rules, with ``R``'s value rows
    already ``U'`` (:func:`chunk_values`).
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
    """H (F, M + 1) <- g H + part in float64, and R's first F rows (the working-dtype copy) follow, in one pass.

    ``g``: the chunk's factor of the state before it (the decay and gated
    delta rules; 1 for the additive and delta rules, where ``1 * h + p`` is
    ``h + p`` exactly, fused or not).  All three arrays C-contiguous (the
    kernels' scratch and ``Hst[b, p]``): the F x (M + 1) elements as one
    flat loop (R's first F rows are its first F (M + 1) elements).  Rows of
    M + 1 = 65 each set up a vector loop with its alias checks and a scalar
    remainder: the flat loop takes 0.7-0.9x their time
    (``benchmarks/chunked_breakdown.py --against``, "state update",
    2026-12-01); the same sums.
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
    """acc (F, M + 1) <- the state after a span whose own contribution (from a zero state) is ``part``.

    ``fac`` (G,) float64: the span's factor of the state before it (the
    product of its tokens' factors; unused by the additive rule).  Additive:
    ``acc += part``; decay: ``acc <- fac[0] acc + part``; gate: row ``i``
    scaled by ``fac[i]``.  Not for the delta rules: their span moves the
    state through an (F, F) matrix, so their kernels never split a sequence
    into pieces (:mod:`linattn_nb.ops.causal.chunked`).
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
