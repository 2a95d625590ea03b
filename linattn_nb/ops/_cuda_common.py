"""Device functions shared by the CUDA kernels (imported with the CUDA path only).

:func:`phi` is the elementwise feature map of :func:`linattn_nb.ops._common.phi`
on the GPU: codes 0 identity, 1 ELU+1 (``exp`` only sees negative arguments),
2 ReLU, 3 squared ReLU; NaN propagates through every branch.  ``zero`` and
``one`` carry the working type, so a float32 kernel does no float64
arithmetic (an integer literal would promote it).  It is the only definition
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
from numba import cuda

from ._codes import (KERNEL_CODE_ELU, KERNEL_CODE_RELU, KERNEL_CODE_SQUARED_RELU, RULE_ADDITIVE, RULE_DECAY,
                     RULE_GATE)

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
    return x


def rule_factor_rows(rule: int, f: int) -> int:
    """Log-factors per token the kernels read for rule code ``rule`` and ``f`` features.

    0 for a rule without factors (additive), 1 for a scalar factor per token
    (decay), ``f`` for one per feature row (gate).  The launchers view the
    rule's input as (B, N, rows) (:func:`linattn_nb.ops._cuda_launch.rule_factors`).
    """
    if rule == RULE_DECAY:
        return 1
    if rule == RULE_GATE:
        return int(f)
    return 0


@cuda.jit(device=True, inline=True)
def token_update(rule, s, a, w, f):
    """State element after one token.

    ``s``: the element ``S[i, m]`` before the token (the normaliser column
    ``z[i]`` alike); ``a``: the token's feature ``phi(k_t)[i]``; ``w``: its
    value ``v_t[m]`` (1 in the normaliser column); ``f``: the token's factor
    of row ``i`` (unused by the additive rule).  All of the accumulation
    type.  Additive: ``s + a w``; decay and gate: ``f s + a w`` (``f = 0``, a
    reset, gives ``a w`` exactly for a finite ``s``).  The launchers check the
    rule code on the host; an unknown code gives NaN rather than a plausible
    state.
    """
    if rule == RULE_ADDITIVE:
        return s + a * w
    if rule == RULE_DECAY or rule == RULE_GATE:
        return f * s + a * w
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
