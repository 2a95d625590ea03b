"""Naive float64 reference of the backward pass (ground truth for the gradient tests).

Backpropagation through time of the per-token recurrence, one token at a time
with every state kept (O(N F M) memory), each line the adjoint of one line of the
recurrence (``docs/theory.md``, "Gradients"); the tests check it against finite
differences of :func:`linattn_nb.ops.causal.naive.causal_linear_quadratic`.
"""
from __future__ import annotations

import numpy as np

from .._codes import RULE_ADDITIVE, RULE_DECAY, RULE_DELTA, RULE_GATE, RULE_GATED_DELTA, check_rule_inputs
from . import Grads


def factors(rule, inputs, b, n, f):
    """Per-token factors ``a_t`` of batch entry ``b``: (N, F) float64 (1 for rules without a decay)."""
    with np.errstate(under="ignore"):
        if rule in (RULE_DECAY, RULE_GATED_DELTA):
            return np.broadcast_to(np.exp(np.asarray(inputs["log_decay"][b], np.float64)).reshape(n, 1), (n, f))
        if rule == RULE_GATE:
            return np.exp(np.asarray(inputs["log_gate"][b], np.float64)).reshape(n, f)
    return np.ones((n, f))


def causal_backward_naive(qf, kf, v1, H0, g1, dHN=None, *, inputs=None, rule=RULE_ADDITIVE):
    """Gradients of causal linear attention by a reverse-time scan in float64.

    Parameters and results: the backward launcher contract of
    :mod:`linattn_nb.ops.grad` (``rule`` the update-rule code).  Results are
    float64.
    """
    rule = check_rule_inputs(rule, inputs)
    qf, kf, v1, g1 = (np.asarray(x, dtype=np.float64) for x in (qf, kf, v1, g1))
    B, N, F = qf.shape
    M = v1.shape[2]
    delta = rule in (RULE_DELTA, RULE_GATED_DELTA)
    dq = np.zeros((B, N, F))
    dk = np.zeros((B, N, F))
    dv = np.zeros((B, N, M))
    dH0 = np.zeros((B, F, M))
    has_factor = rule in (RULE_DECAY, RULE_GATE, RULE_GATED_DELTA)
    dfac = np.zeros((B, N, F)) if has_factor else None
    dbeta = np.zeros((B, N)) if delta else None
    for b in range(B):
        a = factors(rule, inputs, b, N, F)
        beta = np.asarray(inputs["beta"][b], np.float64) if delta else np.zeros(N)
        Hs = np.empty((N + 1, F, M))
        Hs[0] = H0[b]
        for t in range(N):  # forward, every state kept
            P, k = Hs[t], kf[b, t]
            if delta:
                u = k @ P
                Hs[t + 1] = a[t, 0] * (P - beta[t] * np.outer(k, u)) + beta[t] * np.outer(k, v1[b, t])
            else:
                Hs[t + 1] = a[t][:, None] * P + np.outer(k, v1[b, t])
        D = np.zeros((F, M)) if dHN is None else np.array(dHN[b], dtype=np.float64)
        for t in range(N - 1, -1, -1):
            P, k, v = Hs[t], kf[b, t], v1[b, t]
            D += np.outer(qf[b, t], g1[b, t])  # D is now dL/dH_t
            dq[b, t] = Hs[t + 1] @ g1[b, t]
            if delta:
                at, bt = a[t, 0], beta[t]
                u = k @ P  # k^T H_{t-1}
                w = k @ D  # D^T k
                dk[b, t] = -at * bt * (D @ u + P @ w) + bt * (D @ v)
                dv[b, t] = bt * w
                dbeta[b, t] = w @ (v - at * u)
                if has_factor:
                    dfac[b, t, 0] = np.sum(D * P) - bt * (w @ u)
                D = at * (D - bt * np.outer(k, w))
            else:
                dk[b, t] = D @ v
                dv[b, t] = D.T @ k
                if has_factor:
                    dfac[b, t] = np.sum(D * P, axis=1)
                D = a[t][:, None] * D
        dH0[b] = D
    if has_factor and rule != RULE_GATE:  # one factor per token: its rows summed (decay) or taken once
        dfac = dfac.sum(axis=2) if rule == RULE_DECAY else dfac[:, :, 0]
    return Grads(dq, dk, dv, dH0, dfac, dbeta)


def noncausal_backward_naive(qf, kf, v1, H0, g1, dHN=None, *, inputs=None):
    """Gradients of non-causal linear attention, ``o_t = phi(q_t)^T (H0 + sum_s phi(k_s) v1_s^T)``, float64.

    Parameters and results: the backward launcher contract of
    :mod:`linattn_nb.ops.grad` (the additive rule only; ``inputs`` must be None).
    """
    if inputs:
        raise ValueError("non-causal attention has the additive rule only: inputs must be None")
    qf, kf, v1, g1 = (np.asarray(x, dtype=np.float64) for x in (qf, kf, v1, g1))
    H = np.asarray(H0, np.float64) + np.einsum("bnf,bnm->bfm", kf, v1)
    R = np.einsum("bnf,bnm->bfm", qf, g1)  # dL/dH through the outputs
    if dHN is not None:
        R = R + np.asarray(dHN, np.float64)  # the final state is H as well
    dq = np.einsum("bfm,bnm->bnf", H, g1)
    dk = np.einsum("bfm,bnm->bnf", R, v1)
    dv = np.einsum("bfm,bnf->bnm", R, kf)
    return Grads(dq, dk, dv, R.copy())
