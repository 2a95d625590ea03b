"""The analysis functions under the delta rule and the gated delta rule, and the capacity facts.

The delta rule (Schlag, Irie & Schmidhuber 2021, §4.2) writes ``S_t = S_{t-1} + beta_t phi(k_t) (v_t - S_{t-1}^T phi(k_t))^T``;
the gated delta rule (Yang, Kautz & Hatamizadeh 2025) multiplies the state by
``a_t (I - beta_t phi(k_t) phi(k_t)^T)`` before the write.  Ground truth here
is that recurrence, run token by token in NumPy, and
``linear_attention(..., method="quadratic")``.  Sizes are small: these check
definitions, not speed.
"""
from __future__ import annotations

import numpy as np
import pytest

from linattn_nb import feature_maps as fm
from linattn_nb import linear_attention
from linattn_nb.analysis import (approximation_error, attention_rank, attention_weights, recall_capacity,
                                 semiseparable_rank, state_rank_profile)
from linattn_nb.analysis.error import approximation_error_naive

B, N, D = 2, 19, 4


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(15)
    q, k, v = rng.normal(size=(3, B, N, D))
    return q, k, v


def _rules(seed=5):
    """Every form of the arguments: name -> kwargs (delta per sequence / per token, gated per head / per token)."""
    rng = np.random.default_rng(seed)
    per_token = rng.uniform(0.0, 2.0, size=(B, N))
    decay = rng.uniform(0.6, 1.0, size=(B, N))
    decay[1, 7] = 0.0  # a reset
    return {
        "delta_scalar": dict(beta=1.0),
        "delta_per_sequence": dict(beta=np.array([0.3, 1.7])),
        "delta_per_token": dict(beta=per_token),
        "gated_scalar": dict(beta=0.8, decay=0.9),
        "gated_per_token": dict(beta=per_token, decay=decay),
    }


RULES = _rules()


def _recurrence(q, k, v, beta, decay=None, normalize=False, eps=1e-8):
    """The (gated) delta rule token by token on H = [S | z] (one sequence; features given)."""
    n, f = k.shape
    H = np.zeros((f, v.shape[1] + 1))
    out = np.zeros((n, v.shape[1]))
    for t in range(n):
        a = 1.0 if decay is None else decay[t]
        kt = k[t]
        H = a * (H - beta[t] * np.outer(kt, kt @ H)) + beta[t] * np.outer(kt, np.append(v[t], 1.0))
        o = q[t] @ H
        out[t] = o[:-1] / max(o[-1], eps) if normalize else o[:-1]
    return out


def _per_token(x, b):
    """Entry ``b`` of a scalar, per-sequence (B,) or per-token (B, N) argument, as (N,)."""
    if x is None:
        return None
    x = np.asarray(x, dtype=float)
    x = x.reshape(B, 1) if x.ndim == 1 else x
    return np.broadcast_to(x, (B, N))[b]


def _l2(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("normalize", [False, True])
def test_weights_are_the_rule_equivalent_causal_matrix(qkv, name, normalize):
    """attention_weights(beta=) @ v is the delta rule's output: the recurrence and linear_attention."""
    q, k, v = qkv
    kw = RULES[name]
    w = attention_weights(q, k, "l2", causal=True, normalize=normalize, **kw)
    assert w.shape == (B, N, N)
    assert np.all(np.triu(w, 1) == 0.0)
    o = linear_attention(q, k, v, feature_map="l2", causal=True, method="quadratic", normalize=normalize, **kw)
    np.testing.assert_allclose(w @ v, o, rtol=1e-12, atol=1e-12)
    for b in range(B):
        ref = _recurrence(_l2(q[b]), _l2(k[b]), v[b], _per_token(kw["beta"], b), _per_token(kw.get("decay"), b),
                          normalize=normalize)
        np.testing.assert_allclose((w @ v)[b], ref, rtol=1e-12, atol=1e-12)


def test_delta_defaults_to_unnormalised_and_replaces_a_rewritten_key():
    """normalize defaults to False with beta; a key written twice (beta = 1) keeps only its last value."""
    kk = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    w = attention_weights(kk, kk, "l2", causal=True, beta=1.0)
    np.testing.assert_array_equal(w, attention_weights(kk, kk, "l2", causal=True, beta=1.0, normalize=False))
    np.testing.assert_allclose(w[2], [0.0, 0.0, 1.0], atol=1e-15)
    add = attention_weights(kk, kk, "l2", causal=True, normalize=False)
    np.testing.assert_allclose(add[2], [1.0, 0.0, 1.0])  # the additive rule returns the sum of both writes
    # beta = 0 writes nothing: every weight is 0
    assert not attention_weights(kk, kk, "l2", causal=True, beta=0.0).any()
    # a gated delta rule with decay 1 is the delta rule
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 9, 3))
    np.testing.assert_allclose(attention_weights(q, k, "l2", causal=True, beta=0.7, decay=1.0),
                               attention_weights(q, k, "l2", causal=True, beta=0.7), rtol=1e-13, atol=1e-14)


def test_beta_errors_name_the_argument(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="beta"):
        attention_weights(q, k, "softmax", causal=True, beta=1.0)
    with pytest.raises(ValueError, match="beta"):
        attention_weights(q, k, "l2", causal=False, beta=1.0)
    with pytest.raises(ValueError, match="beta"):
        attention_weights(q, k, "l2", causal=True, beta=2.5)
    with pytest.raises(ValueError, match="beta"):
        attention_weights(q, k, "l2", causal=True, beta=np.full((B, N + 1), 0.5))
    with pytest.raises(ValueError, match="beta"):  # a per-feature gate does not combine with beta
        attention_weights(q, k, "l2", causal=True, beta=0.5, decay=np.full((B, N, D), 0.9))
    with pytest.raises(ValueError, match="beta"):
        approximation_error(q, k, v, "l2", causal=True, beta=-0.1)
    with pytest.raises(ValueError, match="beta"):
        attention_rank(q, k, "l2", causal=True, beta=float("nan"))
    with pytest.raises(ValueError, match="beta"):
        semiseparable_rank(q, k, "softmax", beta=1.0)
    with pytest.raises(ValueError, match="beta"):
        state_rank_profile(k, v, "l2", beta=3.0)
    with pytest.raises(ValueError, match="method='explicit'"):
        semiseparable_rank(q, k, "l2", beta=1.0, method="factor")


@pytest.mark.parametrize("name", ["delta_per_token", "gated_per_token", "gated_scalar"])
def test_approximation_error_matches_the_explicit_reference(qkv, name):
    """The kernel (explicit delta weights per entry, row blocks) equals the naive reference, field by field."""
    q, k, v = qkv
    kw = RULES[name]
    fast = approximation_error(q * 0.5, k * 0.5, v, "silu_l2", causal=True, block=6, **kw)
    ref = approximation_error_naive(q * 0.5, k * 0.5, v, "silu_l2", causal=True, **kw)
    for field in ("output_rel_error", "kl_mean", "kl_max", "tv_mean", "tv_max", "entropy_softmax",
                  "entropy_linear", "monotonicity", "nonpositive_normalizer_rate", "kl_infinite_rate"):
        a, b = getattr(fast, field), getattr(ref, field)
        if np.isnan(b):
            assert np.isnan(a), field
        else:
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=field)
    assert fast.n_rows == B * N


def test_approximation_error_refuses_weights_too_large_to_form(monkeypatch, qkv):
    from linattn_nb import config

    q, k, v = qkv
    monkeypatch.setattr(config, "QUADRATIC_MAX_ELEMENTS", N * N - 1)
    with pytest.raises(ValueError, match="QUADRATIC_MAX_ELEMENTS"):
        approximation_error(q, k, v, "l2", causal=True, beta=1.0)


@pytest.mark.parametrize("name", sorted(RULES))
def test_ranks_of_the_delta_weights(qkv, name):
    """attention_rank is the rank of the weights; every strictly-lower block has rank <= D_phi (semiseparable).

    With beta = 1 and unit keys ``I - k k^T`` is a projection, so blocks are
    often exactly rank deficient and their smallest singular value is
    round-off: a tolerance well above it (1e-8) makes the ranks well defined.
    """
    q, k, _ = qkv
    kw = RULES[name]
    rtol = 1e-8

    def rank(a):
        s = np.linalg.svd(a, compute_uv=False)
        return int(np.count_nonzero(s > rtol * s.max())) if s.size else 0

    w = attention_weights(q, k, "l2", causal=True, **kw)
    ranks = attention_rank(q, k, "l2", causal=True, rtol=rtol, **kw)
    assert ranks.tolist() == [rank(w[b]) for b in range(B)]
    semi, split = semiseparable_rank(q, k, "l2", return_split=True, rtol=rtol, **kw)
    for b in range(B):
        blocks = [rank(w[b, i:, :i]) for i in range(1, N)]
        assert semi[b] == max(blocks) <= D
        assert blocks[split[b] - 1] == semi[b]
    # more keys than D_phi, and still a rank-D_phi bound on the blocks (a long sequence, D_phi = 3)
    rng = np.random.default_rng(1)
    qq, kk = rng.normal(size=(2, 60, 3))
    assert semiseparable_rank(qq, kk, "l2", beta=rng.uniform(0, 2, 60)) <= 3


@pytest.mark.parametrize("name", sorted(RULES))
def test_state_rank_profile_follows_the_delta_state(qkv, name):
    q, k, v = qkv
    kw = RULES[name]
    prof = state_rank_profile(k, v, "l2", positions=[0, 1, 2, N], **kw)
    _, st = linear_attention(q, k, v, feature_map="l2", causal=True, method="quadratic", return_state=True, **kw)
    for b in range(B):
        assert prof.rank[b, 0] == 0
        assert prof.rank[b, -1] == np.linalg.matrix_rank(st.S[b])
    # beta = 1 on one unit key written again and again: the value is replaced, the rank stays 1
    kk = np.tile([[2.0, 0.0, 0.0]], (5, 1))
    vv = np.random.default_rng(2).normal(size=(5, 3))
    assert state_rank_profile(kk, vv, "l2", beta=1.0).rank.tolist() == [1, 1, 1, 1, 1]
    assert state_rank_profile(kk, vv, "l2", beta=1.0, decay=np.where(np.arange(5) == 3, 0.0, 1.0),
                              positions=[3, 4]).rank.tolist() == [1, 1]


# ---------------------------------------------------------------------------
# Capacity facts (Schlag, Irie & Schmidhuber 2021, §4.1-4.2)
# ---------------------------------------------------------------------------
def test_delta_rule_stores_orthonormal_keys_exactly_where_the_additive_rule_needs_orthogonality():
    """Orthonormal unit keys, beta = 1: the delta rule retrieves n <= D_phi pairs exactly (<= 1e-12, float64).

    Each write ``S + k (v - S^T k)^T`` stores its pair and leaves every
    orthogonal key's read-out alone (Schlag et al. 2021, §4.2).  The additive
    rule is exact only while the keys are orthogonal: with keys in general
    position (Gaussian, ``n <= D_phi``) its read-out carries the cross-talk
    ``sum_j (k_i . k_j) v_j`` and its error is far from 0.
    """
    d = 16
    ns = [1, 4, 8, 16]
    delta = recall_capacity("l2", d, ns, trials=3, beta=1.0, orthogonal_keys=True)
    assert delta.mse.max() <= 1e-12
    assert delta.accuracy.tolist() == [1.0] * len(ns)
    assert delta.beta == 1.0 and delta.normalize is False and delta.orthogonal_keys is True
    gated = recall_capacity("l2", d, ns, trials=2, beta=1.0, decay=1.0, orthogonal_keys=True)
    assert gated.mse.max() <= 1e-12
    additive = recall_capacity("l2", d, ns[1:], trials=3, normalize=False)  # Gaussian keys, not orthogonal
    assert additive.optimal_mse.max() <= 1e-12  # a state of this size could store them all
    assert additive.mse.min() > 0.05
    # a key written twice: the delta rule keeps the last value, the additive rule returns the sum
    k = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    v = np.eye(3)
    _, st = linear_attention(k, k, v, feature_map="l2", causal=True, beta=1.0, method="quadratic",
                             return_state=True)
    np.testing.assert_allclose(k[2] @ st.S, v[2], atol=1e-15)
    _, st = linear_attention(k, k, v, feature_map="l2", causal=True, normalize=False, return_state=True)
    np.testing.assert_allclose(k[2] @ st.S, v[0] + v[2])


# l2, normalised: its normaliser falls to the floor for some key, refused with or without beta (test_capacity)
@pytest.mark.parametrize("kw", [dict(normalize=False), dict(beta=1.0), dict(beta=0.5), dict(beta=2.0),
                                dict(beta=1.0, decay=0.9), dict(decay=0.95, normalize=False)])
def test_no_rule_beats_the_floor_past_d_phi(kw):
    """Past D_phi no update rule's read-out beats 1 - D_phi/n (one-hot values; Eckart-Young on a rank-D_phi read-out)."""
    d = 6
    ns = np.array([7, 9, 12, 24])
    res = recall_capacity("l2", d, ns, trials=3, seed=4, **kw)
    floor = 1.0 - d / ns
    np.testing.assert_allclose(res.optimal_mse, floor, atol=1e-12)
    assert np.all(res.mse >= floor - 1e-12), (res.mse, floor)
    np.testing.assert_allclose(res.error_by_distance.shape, (len(ns), len(res.distance_edges) - 1))


def test_recall_capacity_delta_matches_the_recurrence():
    """recall_capacity(beta=) reads the state the recurrence leaves (same draws as the function makes)."""
    d, n = 5, 9
    res = recall_capacity("l2", d, [n], trials=1, seed=3, beta=0.6, decay=0.8, distance_bins=[0, n])
    rng = np.random.default_rng([3, n, 0])
    keys = _l2(rng.standard_normal((n, d)))
    S = np.zeros((d, n))
    for j in range(n):
        S = 0.8 * (S - 0.6 * np.outer(keys[j], keys[j] @ S)) + 0.6 * np.outer(keys[j], np.eye(n)[j])
    err = np.sum((keys @ S - np.eye(n)) ** 2) / n
    np.testing.assert_allclose(res.mse[0], err, rtol=1e-12)
    np.testing.assert_allclose(res.error_by_distance[0, 0], err, rtol=1e-12)
    assert "beta=0.6" in res.table() and "unnormalised" in res.table()


def test_recall_capacity_argument_errors():
    with pytest.raises(ValueError, match="beta"):
        recall_capacity("l2", 4, [2], beta=2.1)
    with pytest.raises(TypeError, match="beta"):
        recall_capacity("l2", 4, [2], beta=True)
    with pytest.raises(TypeError, match="beta"):
        recall_capacity("l2", 4, [2], beta=np.ones(2))
    with pytest.raises(ValueError, match="orthogonal_keys"):
        recall_capacity("l2", 4, [2, 5], orthogonal_keys=True)
    with pytest.raises(TypeError, match="orthogonal_keys"):
        recall_capacity("l2", 4, [2], orthogonal_keys=1)
    with pytest.raises(TypeError, match="normalize"):
        recall_capacity("l2", 4, [2], normalize="no")
    with pytest.raises(ValueError, match="normalize=False"):
        recall_capacity(fm.get("favor+", num_features=8, seed=0), 4, [2], normalize=False)
    with pytest.raises(ValueError, match="method"):
        recall_capacity("l2", 4, [2], beta=1.0, method="bogus")


# ---------------------------------------------------------------------------
# The study
# ---------------------------------------------------------------------------
def test_rules_study_grid_and_floor_check(tmp_path):
    """Every rule of the study with >= 5 seeds; a rule below the floor is reported as a problem."""
    from linattn_nb.studies import Context, rules

    ctx = Context(out=tmp_path, profile="tiny", plots=False)
    pts = rules.points(ctx)
    gauss = [p for p in pts if p["kind"] == "gaussian"]
    labels = {p["rule"] for p in gauss}
    assert labels == {label for label, _, _ in rules.RULES} | {label for label, _, _ in rules.DPLR_ROWS}
    assert any(p["beta"] is None and p.get("dplr") is None for p in gauss)  # the additive rule
    assert any(p["beta"] == 1.0 and p["decay"] is None for p in gauss)  # the delta rule, beta = 1
    assert any(p["beta"] is not None and p["decay"] is not None for p in gauss)  # the gated delta rule
    for label in labels:
        assert len({p["seed"] for p in gauss if p["rule"] == label}) >= 5
    records = [dict(params=p, status="ok", result=rules.run(**p)) for p in pts]
    out = rules.render(records, ctx)
    assert out.problems == []
    for words in ("Regime:", "one-hot values", "5 seeds", "optimal floor (least squares)", "1 − D_φ/n",
                  "What it shows", " ± ", "gated delta", "KDA", "DeltaProduct", "Orthonormal keys"):
        assert words in out.markdown, words
    # a forged result below the floor is caught
    bad = [dict(r, result=dict(r["result"], mse=[x - 0.01 for x in r["result"]["optimal_mse"]])) if i == 0 else r
           for i, r in enumerate(records)]
    assert any("beats the least-squares floor" in p for p in rules.render(bad, ctx).problems)


def test_row_normalising_maps_are_not_applied_elementwise_by_the_rank_functions():
    """'l2' and 'silu_l2' carry kernel codes but need each row's norm: the rank functions use the map's own features.

    (Regression: the elementwise Numba path read codes 4 and 5 as the identity.)
    """
    rng = np.random.default_rng(7)
    q, k = rng.normal(size=(2, 40, 6)) * 3.0
    for name in ("l2", "silu_l2"):
        _, s_factor = attention_rank(q, k, name, method="factor", return_spectrum=True, normalize=False)
        w = attention_weights(q, k, name, normalize=False)
        s_explicit = np.linalg.svd(w, compute_uv=False)[:6]
        np.testing.assert_allclose(s_factor, s_explicit, rtol=1e-12, atol=1e-12)
        kf = fm.resolve(name).apply(k, role="key", causal=True)
        np.testing.assert_allclose(np.linalg.norm(kf, axis=-1), 1.0, rtol=1e-12)
        v = rng.normal(size=(40, 2))
        prof = state_rank_profile(np.tile(k[:1], (40, 1)), v, name, beta=1.0, rtol=1e-10)
        assert prof.rank.tolist() == [1] * 40  # one unit key rewritten 40 times: each write replaces the value
