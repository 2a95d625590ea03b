"""Device functions shared by the CUDA kernels (imported with the CUDA path only).

:func:`phi` is the elementwise feature map of :func:`linattn_nb.ops._common.phi`
on the GPU: codes 0 identity, 1 ELU+1 (``exp`` only sees negative arguments),
2 ReLU, 3 squared ReLU; NaN propagates through every branch.  ``zero`` and
``one`` carry the working type, so a float32 kernel does no float64
arithmetic (an integer literal would promote it).  It is the only definition
of the maps on the CUDA target: the sequence kernels
(:mod:`linattn_nb.ops._cuda_kernels`) and the decode-step kernels
(:mod:`linattn_nb.ops.step.cuda`) both call it.

:func:`carry` is the per-rule hook of the chunk machinery: the state after a
chunk from the state before it and the chunk's own contribution, one state
element at a time.  The rule codes are the ``RULE_*`` constants below.

Both are compiled with ``inline=True``: numba-cuda inlines such a function at
the Numba IR level, so kernels that call it still compile to PTX without a GPU
(``numba.cuda.compile_ptx`` in the tests); a non-inlined device function asks
the driver for the current device's compute capability and fails there.
"""
from __future__ import annotations

import math

from numba import cuda

#: Rule code of the additive update ``S_t = S_{t-1} + phi(k_t) v_t^T`` (and
#: ``z_t = z_{t-1} + phi(k_t)``, the same update of a value column of ones).
RULE_ADDITIVE = 0

#: Rule codes the CUDA chunk machinery implements (checked on the host before a launch).
RULES = frozenset({RULE_ADDITIVE})


@cuda.jit(device=True, inline=True)
def phi(x, code, zero, one):
    if code == 1:
        return x + one if x >= zero else math.exp(x)
    if code == 2:
        return x if (x > zero or x != x) else zero
    if code == 3:
        return x * x if (x > zero or x != x) else zero
    return x


@cuda.jit(device=True, inline=True)
def carry(rule, before, inc):
    """State element after a chunk.

    ``before``: the element of the state before the chunk; ``inc``: the same
    element of the chunk's own contribution (the chunk's state when started
    from zero).  The additive rule adds them.  A rule whose state is
    transformed across a chunk (a decay multiplies ``before`` by the chunk's
    product of per-token factors) adds its branch here, with the factor as one
    more argument; an unknown code gives NaN rather than a plausible state.
    """
    if rule == RULE_ADDITIVE:
        return before + inc
    return math.nan
