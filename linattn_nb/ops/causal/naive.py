"""Naive NumPy reference of causal linear attention (ground truth for tests).

Builds the explicit lower-triangular ``N x N`` weight matrix per batch entry,
in float64, exactly as "Transformers are RNNs" (Katharopoulos et al. 2020,
Eqs. 10-12) writes it: token ``t`` attends to tokens ``0..t`` (itself
included).  The state ``(S, z)`` taken and returned here is the ``H = [S | z]``
of the kernels' contract split in two.

Every update rule of :data:`linattn_nb.ops._codes.RULES` has its branch in
:func:`explicit_weights`: the weights, how the queries read the initial state
and how the keys and the initial state make the final state.  The method
table's ``quadratic`` method runs this reference for every rule.
"""
from __future__ import annotations

import numpy as np

from .._codes import RULE_ADDITIVE, check_rule_inputs


def explicit_weights(rule, qf, kf, inputs, b):
    """The explicit form of update rule ``rule`` on batch entry ``b``.

    Parameters
    ----------
    rule : int
        Update-rule code.
    qf, kf : ndarray, shape (N, F), float64
        The entry's features phi(q), phi(k).
    inputs : mapping or None
        The rule's per-token inputs, flattened to the batch (entry ``b`` of each).
    b : int
        The batch entry.

    Returns
    -------
    A : ndarray (N, N)
        ``A[t, s]``: weight of token ``s``'s value in output ``t`` (zero for
        ``s > t``).
    Qs : ndarray (N, F)
        Output ``t`` reads the initial state as ``Qs[t] @ [S0 | z0]``.
    Ks : ndarray (N, F)
        The final state is ``keep * [S0 | z0] + Ks.T @ [V | 1]``.
    keep : None or ndarray (F,)
        Per-row factor of the initial state in the final state (None: 1).
    """
    if rule == RULE_ADDITIVE:
        return np.tril(qf @ kf.T), qf, kf, None
    raise ValueError(f"the naive reference has no branch for rule {rule}")  # pragma: no cover


def causal_linear_quadratic(qf, kf, v, *, eps, S0=None, z0=None, rule=RULE_ADDITIVE, inputs=None):
    """Causal linear attention from explicit weights.

    Parameters
    ----------
    qf, kf : ndarray, shape (B, N, F)
        Features phi(q), phi(k).
    v : ndarray, shape (B, N, M)
    eps : float or None
        Floor of the normaliser (``den = max(den, eps)``); None divides raw.
    S0, z0 : ndarray, shape (B, F, M) and (B, F), optional
        Initial state (context absorbed before token 0).
    rule : int, optional
        Update-rule code (:data:`linattn_nb.ops._codes.RULES`), default additive.
    inputs : mapping, optional
        The rule's per-token inputs, flattened to the batch (none for the
        additive rule).

    Returns
    -------
    out : ndarray (B, N, M) float64
    S, z : final state, float64
    """
    rule = check_rule_inputs(rule, inputs)
    qf = np.asarray(qf, dtype=np.float64)
    kf = np.asarray(kf, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    B, N, F = qf.shape
    M = v.shape[-1]
    S = np.zeros((B, F, M)) if S0 is None else np.array(S0, dtype=np.float64)
    z = np.zeros((B, F)) if z0 is None else np.array(z0, dtype=np.float64)
    out = np.empty((B, N, M))
    for b in range(B):
        A, Qs, Ks, keep = explicit_weights(rule, qf[b], kf[b], inputs, b)
        if np.isfinite(v[b]).all():
            num = A @ v[b]
        else:  # row by row: in A @ v a NaN/inf of a later token leaks into earlier rows as 0 * NaN
            num = np.array([A[t, : t + 1] @ v[b, : t + 1] for t in range(N)]).reshape(N, M)
        num = num + Qs @ S[b]
        den = A.sum(axis=-1) + Qs @ z[b]
        if eps is not None:
            den = np.maximum(den, eps)
        with np.errstate(divide="ignore", invalid="ignore"):
            out[b] = num / den[:, None]
        if keep is not None:
            S[b] *= keep[:, None]
            z[b] *= keep
        S[b] += Ks.T @ v[b]
        z[b] += Ks.sum(axis=0)
    return out, S, z
