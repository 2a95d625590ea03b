"""NumPy references for recurrent decoding: the tests' ground truth for the step kernels.

Everything in float64, token by token (Katharopoulos et al. 2020, Eqs. 18-19):
``H_t = a_t (.) H_{t-1} + phi(k_t) [v_t 1]^T`` for the additive (``a_t = 1``),
decay and gate rules, ``H_t = a_t (I - beta_t k k^T) H_{t-1} + beta_t k [v_t 1]^T``
for the delta rules, ``o_t = phi(q_t)^T S_t / phi(q_t)^T z_t`` (token t included);
``exp(-inf) = 0`` wipes the state exactly.  The softmax reference attends, for
new token ``t``, to every cached key and to the new keys up to ``t``.
"""
from __future__ import annotations

import numpy as np


DELTA_RULES = ("delta", "gated_delta")


def token_factors(rule, inputs, B, T, F):
    """The per-token, per-row factors ``a`` (B, T, F) float64 of ``rule`` with ``inputs``.

    ``inputs`` as the launchers take them: None for the additive rule,
    ``{"log_decay": (B, T)}`` or ``{"log_gate": (B, T, F)}``; the delta rule
    (factor 1) takes ``{"beta": (B, T)}``, the gated delta rule
    ``{"beta": (B, T), "log_decay": (B, T)}``.
    """
    if rule == "delta":
        return np.ones((B, T, F))
    if rule == "additive":
        if inputs:
            raise ValueError(f"the additive rule takes no inputs, got {sorted(inputs)}")
        return np.ones((B, T, F))
    if rule == "decay":
        lg = np.asarray(inputs["log_decay"], dtype=np.float64).reshape(B, T, 1)
    elif rule == "gated_delta":
        lg = np.asarray(inputs["log_decay"], dtype=np.float64).reshape(B, T, 1)
    elif rule == "gate":
        lg = np.asarray(inputs["log_gate"], dtype=np.float64).reshape(B, T, F)
    else:
        raise ValueError(f"unknown rule {rule!r}")
    return np.broadcast_to(np.exp(lg), (B, T, F))


def _token_update(rule, inputs, a, kf, v, S, z, t):
    """The state after token t (float64 arrays, every batch entry): the rule's recurrence."""
    if rule in DELTA_RULES:
        beta = np.asarray(inputs["beta"], dtype=np.float64).reshape(kf.shape[0], -1)[:, t]
        k = kf[:, t]
        at = a[:, t, :1]  # one factor per token: (B, 1)
        # H <- a H + beta k ([v 1] - a k^T H)
        rS = v[:, t] - at * np.einsum("bf,bfm->bm", k, S)
        rz = 1.0 - at[:, 0] * np.einsum("bf,bf->b", k, z)
        S = at[:, :, None] * S + beta[:, None, None] * k[:, :, None] * rS[:, None, :]
        z = at * z + (beta * rz)[:, None] * k
        return S, z
    S = a[:, t, :, None] * S + kf[:, t, :, None] * v[:, t, None, :]
    z = a[:, t] * z + kf[:, t]
    return S, z


def state_step_reference(qf, kf, v, S, z, *, eps, rule="additive", inputs=None, normalize=True):
    """Recurrent step over T tokens from ``S`` (B, F, M), ``z`` (B, F) (not modified).

    ``qf, kf`` (B, T, F) features, ``v`` (B, T, M); ``eps`` the normaliser floor (None:
    raw); ``rule`` a rule name; ``inputs`` its log-factors and write strengths
    (:func:`token_factors`); ``normalize`` False returns the numerators.  Returns
    ``(out, S, z)`` float64: the outputs (B, T, M) and the state after the last token.
    """
    qf = np.asarray(qf, dtype=np.float64)
    kf = np.asarray(kf, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    S = np.array(S, dtype=np.float64)
    z = np.array(z, dtype=np.float64)
    B, T, F = qf.shape
    a = token_factors(rule, inputs, B, T, F)
    out = np.empty((B, T, v.shape[-1]))
    for t in range(T):
        S, z = _token_update(rule, inputs, a, kf, v, S, z, t)
        num = np.einsum("bf,bfm->bm", qf[:, t], S)
        if not normalize:
            out[:, t] = num
            continue
        den = np.einsum("bf,bf->b", qf[:, t], z)
        if eps is not None:
            den = np.maximum(den, eps)
        with np.errstate(divide="ignore", invalid="ignore"):
            out[:, t] = num / den[:, None]
    return out, S, z


def state_query_reference(qf, S, z, *, eps, normalize=True):
    """Read the state for every query without changing it: (B, T, M) float64.

    ``normalize=False`` returns the numerators ``phi(q)^T S``.
    """
    qf = np.asarray(qf, dtype=np.float64)
    S = np.asarray(S, dtype=np.float64)
    z = np.asarray(z, dtype=np.float64)
    num = np.einsum("btf,bfm->btm", qf, S)
    if not normalize:
        return num
    den = np.einsum("btf,bf->bt", qf, z)
    if eps is not None:
        den = np.maximum(den, eps)
    with np.errstate(divide="ignore", invalid="ignore"):
        return num / den[..., None]


def state_prefill_reference(kf, v, S, z, *, rule="additive", inputs=None):
    """State after absorbing the tokens (float64).

    Additive: ``S + phi(K)^T V``, ``z + sum phi(K)``; the other rules run the
    recurrence token by token.
    """
    kf = np.asarray(kf, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    if rule != "additive":
        B, T, F = kf.shape
        a = token_factors(rule, inputs, B, T, F)
        S = np.array(S, dtype=np.float64)
        z = np.array(z, dtype=np.float64)
        for t in range(T):
            S, z = _token_update(rule, inputs, a, kf, v, S, z, t)
        return S, z
    S = np.array(S, dtype=np.float64) + np.einsum("btf,btm->bfm", kf, v)
    z = np.array(z, dtype=np.float64) + kf.sum(axis=1)
    return S, z


def kv_step_reference(q, K, V, *, scale):
    """Softmax decoding against a cache.

    ``q`` (B, T, D) are the new queries; ``K`` (B, L, D) and ``V`` (B, L, M)
    hold every token, the T new ones last.  Query ``t`` attends to keys
    ``0 .. L - T + t``.  Returns (B, T, M) float64.
    """
    q = np.asarray(q, dtype=np.float64)
    K = np.asarray(K, dtype=np.float64)
    V = np.asarray(V, dtype=np.float64)
    B, T, _ = q.shape
    L = K.shape[1]
    out = np.empty((B, T, V.shape[-1]))
    for t in range(T):
        n = L - T + t + 1
        s = scale * np.einsum("bd,bld->bl", q[:, t], K[:, :n])
        s -= s.max(axis=-1, keepdims=True)
        w = np.exp(s)
        w /= w.sum(axis=-1, keepdims=True)
        out[:, t] = np.einsum("bl,blm->bm", w, V[:, :n])
    return out
