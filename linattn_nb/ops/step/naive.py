"""NumPy references for recurrent decoding (ground truth for the step kernels).

Everything in float64, token by token, written the way "Transformers are RNNs"
(Katharopoulos et al. 2020, Eqs. 18-19) states the recurrence:
``S_t = S_{t-1} + phi(k_t) v_t^T``, ``z_t = z_{t-1} + phi(k_t)``,
``o_t = phi(q_t)^T S_t / phi(q_t)^T z_t`` (token t included).  The softmax
reference attends, for new token ``t``, to every cached key and to the new
keys up to and including ``t``.
"""
from __future__ import annotations

import numpy as np


def state_step_reference(qf, kf, v, S, z, *, eps):
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
    B, T, _ = qf.shape
    out = np.empty((B, T, v.shape[-1]))
    for t in range(T):
        S += kf[:, t, :, None] * v[:, t, None, :]
        z += kf[:, t]
        num = np.einsum("bf,bfm->bm", qf[:, t], S)
        den = np.einsum("bf,bf->b", qf[:, t], z)
        if eps is not None:
            den = np.maximum(den, eps)
        with np.errstate(divide="ignore", invalid="ignore"):
            out[:, t] = num / den[:, None]
    return out, S, z


def state_query_reference(qf, S, z, *, eps):
    """Read the state for every query without changing it: (B, T, M) float64."""
    qf = np.asarray(qf, dtype=np.float64)
    S = np.asarray(S, dtype=np.float64)
    z = np.asarray(z, dtype=np.float64)
    num = np.einsum("btf,bfm->btm", qf, S)
    den = np.einsum("btf,bf->bt", qf, z)
    if eps is not None:
        den = np.maximum(den, eps)
    with np.errstate(divide="ignore", invalid="ignore"):
        return num / den[..., None]


def state_prefill_reference(kf, v, S, z):
    """State after absorbing the tokens: ``S + phi(K)^T V``, ``z + sum phi(K)`` (float64)."""
    kf = np.asarray(kf, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
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
