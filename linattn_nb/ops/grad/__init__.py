"""Backward launchers: the vector-Jacobian products of the sequence methods.

Every causal sequence method (``quadratic``, ``scan``, ``chunked`` on the
CPU; ``scan``, ``chunked`` with CUDA) and the non-causal ``aggregate`` method
register a ``backward`` launcher next to their ``forward`` one
(:class:`linattn_nb.ops.registry.Method`).  The front end
(:mod:`linattn_nb._gradfront`) reduces every gradient request to one
**unnormalised** problem, so that the launchers know nothing of the
normaliser, of ``eps`` or of feature maps:

* the normaliser is one more value column of ones (as in the forward
  contract), so the launcher sees values ``v1 = [v | 1]`` with ``M' = M + 1``
  columns and the state ``H = [S | z]`` with ``M'`` columns;
* outputs are ``o_t = phi(q_t)^T H_t`` (the numerators and, in column M, the
  normaliser); the front end turns ``dL/d(out)`` into ``g1 = dL/d[num | den]``
  (``g / den`` and ``-(g . out) / den``, zero where the ``eps`` floor is
  active) and chains the feature gradients through the map
  (:meth:`linattn_nb.feature_maps.FeatureMap.vjp`).

The backward launcher contract, for every rule and device::

    backward(qf, kf, v1, H0, g1, dHN, *, inputs=None) -> Grads

``qf, kf`` (B, N, F): features (never raw inputs: ``code`` is always 0 here),
float32 or float64 (the working dtype).  ``v1`` (B, N, M'): values with the
ones column appended, the working dtype.  ``H0`` (B, F, M') float64: the
initial state (no implicit column: ``H0[..., M]`` is ``z0``).  ``g1`` (B, N,
M'): the gradient of ``o_t``, the working dtype.  ``dHN`` (B, F, M') float64
or None: the gradient of the final state ``H_N`` (segment-wise training).
``inputs``: the rule's per-token inputs exactly as the forward launcher takes
them (``log_decay`` (B, N), ``log_gate`` (B, N, F), ``beta`` (B, N); float64;
``-inf`` is a reset).  The rule is bound to the launcher (``rule=`` code, as
for the forward launchers).  Nothing passed in is modified.  On CUDA the
arrays are device arrays and so are the results.

The recurrence differentiated (``a_t = exp(log-factor)``, a scalar or, for
the gate rule, a vector over the F rows; ``a_t = 1`` and ``beta_t = 0``
where a rule has none)::

    additive, decay, gate:   H_t = diag(a_t) H_{t-1} + phi(k_t) v1_t^T
    delta, gated delta:      H_t = a_t (I - beta_t k_t k_t^T) H_{t-1} + beta_t k_t v1_t^T
    o_t = phi(q_t)^T H_t

Results (:class:`Grads`): ``dq, dk`` (B, N, F) and ``dv`` (B, N, M') in the
working dtype; ``dH0`` (B, F, M') float64; ``dfactor``: the gradient with
respect to the factors ``a_t`` themselves (not their logs, so that it is
finite and defined at a reset ``a_t = 0``), float64 (B, N) for the decay and
gated delta rules, (B, N, F) for the gate rule, None otherwise; ``dbeta``
float64 (B, N) for the delta rules, None otherwise.  Launchers accumulate in
float64 (states, adjoint states, the sums behind ``dfactor`` and ``dbeta``).

Memory: a backward keeps at most one state per chunk (or recomputes), never
one per token; the naive reference (:mod:`.naive`) is exempt.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np


class Grads(NamedTuple):
    """What a backward launcher returns (module docstring)."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dH0: np.ndarray
    dfactor: Optional[np.ndarray] = None
    dbeta: Optional[np.ndarray] = None
