"""NumPy references for recurrent decoding (ground truth for the step kernels).

Everything in float64, token by token, written the way "Transformers are RNNs"
(Katharopoulos et al. 2020, Eqs. 18-19) states the recurrence, with the
update rules of :mod:`linattn_nb.ops._codes`:
``S_t = a_t (.) S_{t-1} + phi(k_t) v_t^T``, ``z_t = a_t (.) z_{t-1} + phi(k_t)``,
``o_t = phi(q_t)^T S_t / phi(q_t)^T z_t`` (token t included; ``normalize=False``
returns ``phi(q_t)^T S_t``).  ``a_t`` is 1 for the additive rule,
``exp(log_decay[b, t])`` for the decay rule (one factor for every row) and
``exp(log_gate[b, t, i])`` for row i under the gate rule; ``exp(-inf) = 0``
wipes the state exactly.  The delta rules correct the state instead of adding
to it (on ``H = [S | z]``, every column alike, with ``k = phi(k_t)``):
``H_t = a_t (I - beta_t k k^T) H_{t-1} + beta_t k [v_t 1]``, ``a_t = 1`` for
the delta rule and ``exp(log_decay[b, t])`` for the gated delta rule.  The softmax reference attends, for new token ``t``,
to every cached key and to the new keys up to and including ``t``.
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
    """Recurrent step over T tokens.

    Parameters
    ----------
    qf, kf : ndarray, shape (B, T, F)
        Features phi(q), phi(k).
    v : ndarray, shape (B, T, M)
    S, z : ndarray, shape (B, F, M) and (B, F)
        State before the first token (not modified).
    eps : float or None
        Floor of the normaliser; None divides raw.
    rule : {"additive", "decay", "gate", "delta", "gated_delta"}
    inputs : dict or None
        The rule's log-factors and write strengths (:func:`token_factors`).
    normalize : bool
        False returns the numerators ``phi(q_t)^T S_t``.

    Returns
    -------
    out : ndarray (B, T, M) float64
    S, z : the state after the last token, float64
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
