"""The (gated) delta rule's explicit form against a plain loop of its recurrence.

Schlag, Irie & Schmidhuber 2021, Sec. 4.2; Yang et al. 2024 (WY/UT chunk form); gated: Yang, Kautz &
Hatamizadeh 2025 (formulas: ``docs/theory.md``, "Delta rule and gated delta rule").  The closed forms
agree with the recurrence to 2e-15 in float64; checked here with an initial state, a reset and the normaliser
column of ones.
"""
import numpy as np
import pytest

from linattn_nb.ops.causal.naive import delta_weights


def _loop(q, k, v, beta, lg, H0):
    H = H0.copy()
    out = []
    for t in range(q.shape[0]):
        a = 1.0 if lg is None else np.exp(lg[t])
        H = a * (H - beta[t] * np.outer(k[t], k[t] @ H)) + beta[t] * np.outer(k[t], np.append(v[t], 1.0))
        out.append(q[t] @ H)
    return np.array(out).reshape(q.shape[0], H.shape[1]), H


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("n", [0, 1, 2, 17])
def test_delta_closed_form_is_the_recurrence(gated, n):
    rng = np.random.default_rng(n)
    F, M = 5, 3
    q = rng.normal(size=(n, F))
    k = rng.normal(size=(n, F))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    v = rng.normal(size=(n, M))
    beta = rng.uniform(0.0, 2.0, n)
    lg = np.log(rng.uniform(0.3, 1.0, n)) if gated else None
    if gated and n > 2:
        lg[n // 2] = -np.inf  # a reset: exact, no NaN
    H0 = rng.normal(size=(F, M + 1))
    ref, H = _loop(q, k, v, beta, lg, H0)
    A, Qs, Ks, keep = delta_weights(q, k, beta, lg)
    V1 = np.hstack([v, np.ones((n, 1))])
    assert np.isfinite(A).all() and np.isfinite(Qs).all() and np.isfinite(keep).all()
    np.testing.assert_allclose(A @ V1 + Qs @ H0, ref, rtol=0, atol=1e-13)
    np.testing.assert_allclose(keep @ H0 + Ks.T @ V1, H, rtol=0, atol=1e-13)
