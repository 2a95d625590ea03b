"""Device functions shared by the CUDA kernels (imported with the CUDA path only).

:func:`phi` is the elementwise feature map of :func:`linattn_nb.ops._common.phi`
on the GPU: codes 0 identity, 1 ELU+1, 2 ReLU, 3 squared ReLU, and the
elementwise halves of the row maps: 4 (L2) the identity, 5 (SiLU then L2)
the SiLU (``exp`` only sees arguments <= 0 in ELU+1 and SiLU, so nothing
overflows); NaN propagates through every branch.  The L2 normalisation of
codes 4 and 5 needs the whole row: a kernel that stages a row calls
:func:`l2_normalize_row` on it after :func:`phi` (:func:`is_row_map` says
when).  ``zero`` and ``one`` carry the working type, so :func:`phi` does no
float64 arithmetic in a float32 kernel (an integer literal would promote it);
only the row norm is taken in float64, once per row.  It is the only definition
of the maps on the CUDA target: the sequence kernels
(:mod:`linattn_nb.ops._cuda_kernels`) and the decode-step kernels
(:mod:`linattn_nb.ops.step.cuda`) both call it.

The per-rule hooks of the CUDA kernels, one state element at a time, each
taking the rule code (``RULE_*`` of :mod:`linattn_nb.ops._codes`, where
:data:`linattn_nb.ops._codes.RULES` lists every rule) as its first argument:

* :func:`token_update` -- the element after one token, in the token loop of
  the sequence kernel (:func:`linattn_nb.ops._cuda_kernels.seq_kernel`, which
  is specialised on the rule, so the branch is a compile-time constant there
  and the kernel of a rule holds that rule's code only);
* :func:`carry` -- the element after a chunk from the element before it and
  the chunk's own contribution, in the combine over chunks
  (:func:`linattn_nb.ops._cuda_kernels.chunk_scan_states_kernel`).

The delta rules (``RULE_DELTA``, ``RULE_GATED_DELTA``) write a rank-1
correction, ``H <- f H + beta k (w - f k^T H)^T`` (``f = 1`` for the delta
rule), which needs the column's ``k^T H[:, m]``, a reduction over all
feature rows, before any element of the column changes.  The sequence kernel
computes it (a reduction across the threads that hold the column) and turns
it into the column's correction with :func:`delta_correction`; the element
update is then :func:`token_update` with the correction in place of the
value.  Their chunk transition is an (F, F) matrix, not a factor per row:
:func:`carry` has no form for them (:func:`is_delta_rule`).

Both take the factor ``f`` the rule applies to the element's row: the
token's factor ``exp(log_decay[b, t])`` (decay) or ``exp(log_gate[b, t, i])``
(gate, row ``i``) in :func:`token_update`, the product of a chunk's factors
(``exp`` of the sum of their logs, 0 across a reset) in :func:`carry`.  The
kernels stage the factors (:func:`rule_factor_rows` says how many per token)
and pass them; the additive rule ignores them, and in its kernel the loads
are dead code.  A new rule adds a branch to each hook and nothing to the
kernels' loops.

All are compiled with ``inline=True``: numba-cuda inlines such a function at
the Numba IR level, so kernels that call it still compile to PTX without a GPU
(``numba.cuda.compile_ptx`` in the tests); a non-inlined device function asks
the driver for the current device's compute capability and fails there.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float64

from ._codes import (KERNEL_CODE_ELU, KERNEL_CODE_L2, KERNEL_CODE_RELU, KERNEL_CODE_SILU_L2,
                     KERNEL_CODE_SQUARED_RELU, RULE_ADDITIVE, RULE_DECAY, RULE_DELTA, RULE_GATE,
                     RULE_GATED_DELTA)

# NaN of the narrowest accumulation type: it unifies with float32 and float64
# alike, so a hook's fallback does not widen a float32 kernel to float64.
_NAN32 = np.float32(np.nan)


@cuda.jit(device=True, inline=True)
def phi(x, code, zero, one):
    """The elementwise feature map ``code`` (:mod:`linattn_nb.ops._codes`) on the GPU; NaN propagates."""
    if code == KERNEL_CODE_ELU:
        return x + one if x >= zero else math.exp(x)
    if code == KERNEL_CODE_RELU:
        return x if (x > zero or x != x) else zero
    if code == KERNEL_CODE_SQUARED_RELU:
        return x * x if (x > zero or x != x) else zero
    if code == KERNEL_CODE_SILU_L2:  # SiLU x sigmoid(x); exp only sees arguments <= 0 (no overflow)
        if x >= zero:
            return x / (one + math.exp(-x))
        e = math.exp(x)
        return x * e / (one + e)
    return x


@cuda.jit(device=True, inline=True)
def is_row_map(code):
    """True for the feature maps that normalise a whole row after :func:`phi` (codes 4 and 5)."""
    return code == KERNEL_CODE_L2 or code == KERNEL_CODE_SILU_L2


@cuda.jit(device=True, inline=True)
def l2_normalize_row(a, t, n):
    """Divide ``a[t, :n]`` by its Euclidean norm in place (the L2 half of codes 4 and 5).

    Exact, with no epsilon: the sum of squares, the square root and the
    division run in float64 whatever ``a``'s dtype (so a float32 row whose
    squares overflow float32 is still normalised, as in the NumPy maps of
    :mod:`linattn_nb.feature_maps`), and the quotient is rounded once to
    ``a``'s dtype.  A zero row stays zero; a row holding NaN becomes NaN (the
    kernels propagate NaN, where the NumPy map gives 0).  ``a`` is any 2-d
    array: the kernels pass a row of their shared-memory tile.
    """
    ss = 0.0
    for i in range(n):
        x = float64(a[t, i])
        ss += x * x
    if ss != 0.0:
        nrm = math.sqrt(ss)
        for i in range(n):
            a[t, i] = float64(a[t, i]) / nrm


def rule_factor_rows(rule: int, f: int) -> int:
    """Log-factors per token the kernels read for rule code ``rule`` and ``f`` features.

    0 for a rule without factors (additive), 1 for a scalar factor per token
    (decay), ``f`` for one per feature row (gate), 2 for the delta rules (the
    log-factor, 0 for the delta rule, then the write strength ``beta``).  The
    launchers view the rule's input as (B, N, rows)
    (:func:`linattn_nb.ops._cuda_launch.rule_factors`).
    """
    if rule == RULE_DECAY:
        return 1
    if rule == RULE_GATE:
        return int(f)
    if rule == RULE_DELTA or rule == RULE_GATED_DELTA:
        return 2
    return 0


def is_delta_rule(rule: int) -> bool:
    """True for the rules with a rank-1 correction (delta, gated delta): see the module docstring."""
    return rule == RULE_DELTA or rule == RULE_GATED_DELTA


@cuda.jit(device=True, inline=True)
def token_update(rule, s, a, w, f):
    """State element after one token.

    ``s``: the element ``S[i, m]`` before the token (the normaliser column
    ``z[i]`` alike); ``a``: the token's feature ``phi(k_t)[i]``; ``w``: its
    value ``v_t[m]`` (1 in the normaliser column); ``f``: the token's factor
    of row ``i`` (unused by the additive rule).  All of the accumulation
    type.  Additive: ``s + a w``; decay and gate: ``f s + a w`` (``f = 0``, a
    reset, gives ``a w`` exactly for a finite ``s``); the delta rules take
    their column's correction (:func:`delta_correction`) as ``w``: ``s + a w``
    (delta), ``f s + a w`` (gated delta).  The launchers check the
    rule code on the host; an unknown code gives NaN rather than a plausible
    state.
    """
    if rule == RULE_ADDITIVE:
        return s + a * w
    if rule == RULE_DECAY or rule == RULE_GATE or rule == RULE_GATED_DELTA:
        return f * s + a * w
    if rule == RULE_DELTA:
        return s + a * w
    return _NAN32


@cuda.jit(device=True, inline=True)
def delta_correction(rule, w, u, f, beta):
    """The delta rules' correction of a state column for one token.

    ``w``: the token's value ``v_t[m]`` (1 in the normaliser column); ``u``:
    ``k_t^T H_{t-1}[:, m]``, the column read at the token's key; ``f``: the
    token's factor ``exp(log_decay[b, t])`` (unused by the delta rule);
    ``beta``: its write strength.  Delta: ``beta (w - u)``; gated delta:
    ``beta (w - f u)`` (``f = 0``, a reset, gives ``beta w``).  The element
    update is then :func:`token_update` with this in place of ``w``:
    ``f s + k_i beta (w - f u)`` = ``(f (I - beta k k^T) H + beta k w^T)[i, m]``.
    Other rules: NaN.
    """
    if rule == RULE_DELTA:
        return beta * (w - u)
    if rule == RULE_GATED_DELTA:
        return beta * (w - f * u)
    return _NAN32


@cuda.jit(device=True, inline=True)
def carry(rule, before, inc, f):
    """State element after a chunk.

    ``before``: the element of the state before the chunk; ``inc``: the same
    element of the chunk's own contribution (the chunk's state when started
    from zero); ``f``: the chunk's total factor of the element's row (the
    product of its tokens' factors, 0 when the chunk holds a reset; unused by
    the additive rule).  Additive: ``before + inc``; decay and gate:
    ``f before + inc``.  An unknown code gives NaN rather than a plausible
    state.
    """
    if rule == RULE_ADDITIVE:
        return before + inc
    if rule == RULE_DECAY or rule == RULE_GATE:
        return f * before + inc
    return math.nan
