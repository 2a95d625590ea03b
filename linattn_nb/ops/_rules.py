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
  ``z_i += phi(k_t)_i``);
* :func:`intra_weights` -- the intra-chunk weights of a block of rows
  (additive: ``tril(phi(Q_c) phi(K_c)^T)``, diagonal included), in the
  chunked kernel (:mod:`linattn_nb.ops.causal.chunked`);
* :func:`chunk_transition` -- the state across one chunk (additive:
  ``H += phi(K_c)^T [V_c 1]``), in the chunked kernel;
* :func:`carry` -- the state across a span whose own contribution is known
  (additive: ``H += part``), used by the prefix over segments and the
  combine of pieces (:mod:`linattn_nb.ops._chunks`).

A new rule adds its entry to :data:`linattn_nb.ops._codes.RULES` and a branch
to each hook here (its per-token inputs become hook arguments), and nothing
to the kernels' loops.  The rule is a plain integer argument (no
function-typed arguments, no closures), so the kernels stay cacheable on
disk.  As for the other helper modules, kernels cached on disk do not see
edits made here: clear the ``__pycache__`` folders after changing this file.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .. import config
from ._codes import RULE_ADDITIVE, check_rule_inputs
from ._gemm import gemm


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


@njit(fastmath=config.FASTMATH, cache=config.CACHE, inline="always")
def token_step(rule, S, z, i, a, c, v, num):
    """Row ``i`` of the state after one token, read by the token's query; returns the new ``z[i]``.

    ``S`` (F, M) and ``z`` (F,): the state of the scan (the normaliser kept
    apart), updated in place; ``a = phi(k_t)[i]``, ``c = phi(q_t)[i]``; ``v``
    (M,): the token's values; ``num`` (M,) += ``c * S[i]`` (the new row).
    The caller sums ``c * z[i]`` (the returned value) into the normaliser.
    Additive: ``z[i] += a``, ``S[i] += a v``.
    """
    if rule == RULE_ADDITIVE:
        zi = z[i] + a  # the normaliser: value column M, whose value is 1
        z[i] = zi
        for m in range(v.shape[0]):
            s = S[i, m] + a * v[m]
            S[i, m] = s
            num[m] += c * s
        return zi
    return np.nan  # unreachable: launchers check the rule code


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def intra_weights(rule, X, fk, r0, ce, F):
    """Weights of rows [r0, ce) of a chunk on its tokens [0, ce), into ``X[r0:ce, F:F + ce]``.

    ``X`` (C, F + C) holds ``phi(Q_c)`` in its first F columns; ``fk`` (C, F)
    is ``phi(K_c)``.  Additive: ``phi(Q_c) phi(K_c)^T`` with the causal mask
    (token t sees tokens j <= t), one BLAS product.
    """
    if rule == RULE_ADDITIVE:
        LX = X.shape[1]
        gemm(0, 1, ce - r0, ce, F, 1.0, X, r0 * LX, LX, fk, 0, F, 0.0, X, r0 * LX + F, LX)
        zero = X.dtype.type(0.0)
        for t in range(r0, ce):
            for j in range(t + 1, ce):
                X[t, F + j] = zero


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def chunk_transition(rule, H, R, fk, part, n):
    """H (F, M + 1) float64 <- the state after the chunk's n tokens; R's state rows follow it.

    ``R`` ((F + C) x (M + 1), working dtype) is ``[H ; V_c 1]``; ``fk``
    ``phi(K_c)``; ``part`` (F, M + 1) scratch of the working dtype.
    Additive: ``part = phi(K_c)^T [V_c 1]`` (one BLAS product in the working
    dtype), summed into ``H`` in float64.
    """
    if rule == RULE_ADDITIVE:
        F = fk.shape[1]
        M1 = R.shape[1]
        gemm(1, 0, F, M1, n, 1.0, fk, 0, F, R, F * M1, M1, 0.0, part, 0, M1)
        absorb(H, part, R)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def absorb(H, part, R):
    """H (F, M + 1) += part in float64, and R's first F rows (the working-dtype copy) follow, in one pass."""
    for i in range(H.shape[0]):
        for m in range(H.shape[1]):
            s = H[i, m] + part[i, m]
            H[i, m] = s
            R[i, m] = s


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def carry(rule, acc, part):
    """acc (F, M + 1) <- the state after a span whose own contribution (from a zero state) is ``part``.

    Additive: ``acc += part``.
    """
    if rule == RULE_ADDITIVE:
        for i in range(acc.shape[0]):
            for m in range(acc.shape[1]):
                acc[i, m] += part[i, m]
