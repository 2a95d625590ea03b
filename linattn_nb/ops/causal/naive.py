"""Naive NumPy reference of causal linear attention (ground truth for tests).

The explicit lower-triangular ``N x N`` weights per batch entry, in float64
(Katharopoulos et al. 2020, Eqs. 10-12), for every update rule; the method
table's ``quadratic`` method runs it.  The state ``(S, z)`` is ``H = [S | z]`` split in two.
"""
from __future__ import annotations

import numpy as np

from .._codes import RULE_ADDITIVE, RULE_DECAY, RULE_DELTA, RULE_GATE, RULE_GATED_DELTA, check_rule_inputs


def _log_factors(rule, inputs, b, n, f):
    """Per-token log-factors of batch entry ``b`` as an (N, F) float64 array (0 for the additive rule)."""
    if rule == RULE_DECAY:
        lg = np.asarray(inputs["log_decay"][b], dtype=np.float64).reshape(n, 1)
        return np.broadcast_to(lg, (n, f))
    if rule == RULE_GATE:
        return np.asarray(inputs["log_gate"][b], dtype=np.float64).reshape(n, f)
    return np.zeros((n, f))


def _decayed_weights(qf, kf, lg):
    """The decay and gate rules' explicit form from per-token log-factors ``lg`` (N, F).

    Output ``t`` weighs token ``s <= t`` by ``sum_i q_ti k_si exp(sum_{s<u<=t} lg_ui)``,
    with running sums started at each ``s``, so a ``-inf`` (a reset) gives exact
    zeros and never a NaN.  O(N^2 F) time, O(N F) memory.
    """
    N, F = qf.shape
    A = np.zeros((N, N))
    with np.errstate(under="ignore"):
        for s in range(N):
            A[s, s] = qf[s] @ kf[s]
            if s + 1 < N:
                dec = np.exp(np.cumsum(lg[s + 1:], axis=0))  # (N - s - 1, F): exp(sum_{s<u<=t} lg_u)
                A[s + 1:, s] = (qf[s + 1:] * dec) @ kf[s]
        head = np.exp(np.cumsum(lg, axis=0))  # exp(sum_{u<=t} lg_u): how output t reads the initial state
        tail = np.exp(np.cumsum(lg[::-1], axis=0)[::-1])  # exp(sum_{u>=s} lg_u)
        tail = np.vstack([tail[1:], np.ones((1, F))]) if N else tail  # exp(sum_{u>s} lg_u)
        keep = head[-1] if N else np.ones(F)
    return A, qf * head, kf * tail, keep


def explicit_weights(rule, qf, kf, inputs, b):
    """The explicit form of rule ``rule`` on batch entry ``b`` from its float64 features ``qf, kf`` (N, F).

    Returns ``(A, Qs, Ks, keep)``: ``A`` (N, N) the weight of token ``s``'s value in
    output ``t`` (0 for ``s > t``); output ``t`` reads the initial state as
    ``Qs[t] @ [S0 | z0]``; the final state is ``keep * [S0 | z0] + Ks.T @ [V | 1]``
    with ``keep`` None (1), a per-row factor (F,) or, for the delta rules, a matrix (F, F).
    """
    if rule == RULE_ADDITIVE:
        return np.tril(qf @ kf.T), qf, kf, None
    if rule in (RULE_DECAY, RULE_GATE):
        N, F = qf.shape
        return _decayed_weights(qf, kf, _log_factors(rule, inputs, b, N, F))
    if rule == RULE_DELTA:
        return delta_weights(qf, kf, inputs["beta"][b])
    if rule == RULE_GATED_DELTA:
        return delta_weights(qf, kf, inputs["beta"][b], inputs["log_decay"][b])
    raise ValueError(f"the naive reference has no branch for rule {rule}")  # pragma: no cover


def delta_weights(qf, kf, beta, lg=None):
    """The (gated) delta rule's explicit form on one sequence, float64.

    ``H_t = a_t (I - beta_t k_t k_t^T) H_{t-1} + beta_t k_t [v_t 1]^T`` is linear in
    ``H_0`` and the values: ``O = A [V 1] + Qs H_0``, ``H_N = keep H_0 + Ks^T [V 1]``
    (the WY/UT transform over the whole sequence), with ``G_ts = exp(sum_{s<u<=t} lg_u)``,
    ``L = I + tril(diag(beta) (G * K K^T), -1)``, ``T = L^{-1} diag(beta)``,
    ``A = tril(G * Q K^T) T``, ``Qs = e^b * Q - A (e^b * K)``, ``Ks = T^T (e^{b_N - b} * K)``,
    ``keep = e^{b_N} I - (e^{b_N - b} * K)^T T (e^b * K)``.  ``beta`` (N,) write
    strengths; ``lg`` (N,) the gated rule's log-decays (None: the delta rule).
    Returns ``(A, Qs, Ks, keep)`` as :func:`explicit_weights`.
    """
    from scipy.linalg import solve_triangular

    N, F = qf.shape
    beta = np.asarray(beta, dtype=np.float64)
    if lg is None:
        G = np.tril(np.ones((N, N)))
        head = np.ones(N)
        tail = np.ones(N)
        total = 1.0
    else:
        G = _decayed_weights(np.ones((N, 1)), np.ones((N, 1)), np.asarray(lg, np.float64).reshape(N, 1))[0]
        with np.errstate(under="ignore"):
            head = np.exp(np.cumsum(lg)) if N else np.ones(0)  # e^{b_t}
            tail = np.exp(np.concatenate([np.cumsum(lg[::-1])[::-1][1:], [0.0]])) if N else np.ones(0)  # e^{b_N - b_s}
        total = float(head[-1]) if N else 1.0
    L = np.eye(N) + np.tril(beta[:, None] * (G * (kf @ kf.T)), -1)
    T = solve_triangular(L, np.diag(beta), lower=True, unit_diagonal=True) if N else np.zeros((0, 0))
    A = np.tril(G * (qf @ kf.T)) @ T
    kb = head[:, None] * kf
    kt = tail[:, None] * kf
    Qs = head[:, None] * qf - A @ kb
    Ks = T.T @ kt
    keep = total * np.eye(F) - kt.T @ (T @ kb)
    return A, Qs, Ks, keep


def float64_problem(qf, kf, v, S0, z0):
    """``qf, kf, v`` in float64, float64 copies of the initial state (zeros for None), an empty output."""
    qf, kf, v = (np.asarray(x, dtype=np.float64) for x in (qf, kf, v))
    (B, N, F), M = qf.shape, v.shape[-1]
    S = np.zeros((B, F, M)) if S0 is None else np.array(S0, dtype=np.float64)
    z = np.zeros((B, F)) if z0 is None else np.array(z0, dtype=np.float64)
    return qf, kf, v, S, z, np.empty((B, N, M))


def causal_linear_quadratic(qf, kf, v, *, eps, S0=None, z0=None, rule=RULE_ADDITIVE, inputs=None,
                            normalize=True):
    """Causal linear attention from explicit weights, in float64.

    ``qf, kf`` (B, N, F) features, ``v`` (B, N, M); ``eps`` the normaliser floor (None:
    raw division); ``S0, z0`` (B, F, M), (B, F) the initial state (zeros for None);
    ``rule`` a code of :data:`linattn_nb.ops._codes.RULES` with its per-token
    ``inputs`` flattened to the batch; ``normalize`` False returns ``phi(q)^T S_t``.
    Returns ``(out, S, z)``: the outputs (B, N, M) and the final state, float64.
    """
    rule = check_rule_inputs(rule, inputs)
    qf, kf, v, S, z, out = float64_problem(qf, kf, v, S0, z0)
    (B, N, _), M = qf.shape, v.shape[-1]
    for b in range(B):
        A, Qs, Ks, keep = explicit_weights(rule, qf[b], kf[b], inputs, b)
        if np.isfinite(v[b]).all():
            num = A @ v[b]
        else:  # row by row: in A @ v a NaN/inf of a later token leaks into earlier rows as 0 * NaN
            num = np.array([A[t, : t + 1] @ v[b, : t + 1] for t in range(N)]).reshape(N, M)
        num = num + Qs @ S[b]
        if not normalize:
            out[b] = num
        else:
            den = A.sum(axis=-1) + Qs @ z[b]
            if eps is not None:
                den = np.maximum(den, eps)
            with np.errstate(divide="ignore", invalid="ignore"):
                out[b] = num / den[:, None]
        if keep is not None and keep.ndim == 2:  # a matrix: the delta rule
            S[b] = keep @ S[b]
            z[b] = keep @ z[b]
        elif keep is not None:
            S[b] *= keep[:, None]
            z[b] *= keep
        S[b] += Ks.T @ v[b]
        z[b] += Ks.sum(axis=0)
    return out, S, z
