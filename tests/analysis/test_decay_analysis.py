"""The analysis functions with a decay or gate: weights, error, ranks, state ranks, recall by distance.

Ground truth is the naive explicit form (``linattn_nb.ops.causal.naive``) and
``linear_attention(..., method="quadratic")``, both float64 and exact at
resets.  Sizes are small: these check definitions, not speed.
"""
from __future__ import annotations

import numpy as np
import pytest

from linattn_nb import LinearState, linear_attention
from linattn_nb.analysis import (approximation_error, attention_rank, attention_weights, recall_capacity,
                                 semiseparable_rank, state_rank_profile)
from linattn_nb.analysis.error import approximation_error_naive

B, N, D = 2, 23, 4


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(14)
    q, k, v = rng.normal(size=(3, B, N, D)) * 0.7
    return q, k, v


def _decays(rng_seed=3):
    """Every form of the argument: name -> kwargs (per head, per token, per feature, with resets)."""
    rng = np.random.default_rng(rng_seed)
    per_token = rng.uniform(0.6, 1.0, size=(B, N))
    reset = per_token.copy()
    reset[:, 9] = 0.0
    reset[1, 17] = 0.0
    gate = rng.uniform(0.5, 1.0, size=(B, N, D))  # ELU+1: D_phi = D
    gate_reset = gate.copy()
    gate_reset[0, 5, :] = 0.0
    return {
        "per_head_scalar": dict(decay=0.9),
        "per_head_array": dict(decay=np.array([0.8, 0.95])),
        "per_token": dict(decay=per_token),
        "per_token_log": dict(log_decay=np.log(per_token)),
        "per_token_reset": dict(decay=reset),
        "log_reset": dict(log_decay=np.where(reset == 0, -np.inf, np.log(np.where(reset == 0, 1, reset)))),
        "gate": dict(decay=gate),
        "gate_reset": dict(decay=gate_reset),
    }


DECAYS = _decays()


# ---------------------------------------------------------------------------
# constant gamma: W_ts = gamma^(t-s) W_additive; semiseparable rank <= D_phi
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [0.999, 0.9, 0.5])
def test_constant_decay_weights_are_gamma_powers_times_additive_and_semiseparable_rank_stays_low(qkv, gamma):
    """RetNet (Sun et al. 2023, §2.1-2.2): the decay mask is gamma^(t-s)."""
    q, k, _ = qkv
    raw = attention_weights(q, k, "elu", causal=True, normalize=False)
    dec = attention_weights(q, k, "elu", causal=True, decay=gamma, normalize=False)
    t, s = np.indices((N, N))
    mask = np.where(t >= s, gamma ** np.maximum(t - s, 0).astype(float), 0.0)
    np.testing.assert_allclose(dec, mask * raw, rtol=1e-13, atol=0)
    # log_decay is the same factor
    np.testing.assert_allclose(attention_weights(q, k, "elu", causal=True, log_decay=np.log(gamma),
                                                 normalize=False), dec, rtol=1e-13)
    # normalised: each row divided by its own sum (the decayed normaliser)
    w = attention_weights(q, k, "elu", causal=True, decay=gamma)
    np.testing.assert_allclose(w, dec / dec.sum(-1, keepdims=True), rtol=1e-13)
    # semiseparable: every strictly-lower block has rank <= D_phi = D, normalised or not
    qq, kk = np.random.default_rng(1).normal(size=(2, 60, D))
    for normalize in (False, True):
        r = semiseparable_rank(qq, kk, "elu", decay=gamma, normalize=normalize)
        assert 1 <= r <= D
        w = attention_weights(qq, kk, "elu", causal=True, decay=gamma, normalize=normalize)
        assert max(np.linalg.matrix_rank(w[i:, :i]) for i in range(1, 60)) <= D
    assert semiseparable_rank(qq, kk, "elu", decay=gamma, normalize=False) == D  # generic keys: the bound is reached
    assert semiseparable_rank(qq, kk, "softmax", scale=3.0) > D  # softmax has no such bound


def test_per_feature_gate_keeps_the_semiseparable_bound():
    rng = np.random.default_rng(2)
    q, k = rng.normal(size=(2, 50, D))
    gate = rng.uniform(0.7, 1.0, size=(50, D))
    for normalize in (False, True):
        assert semiseparable_rank(q, k, "elu", decay=gate, normalize=normalize) <= D


# ---------------------------------------------------------------------------
# attention_weights against linear_attention
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(DECAYS))
@pytest.mark.parametrize("normalize", [True, False])
def test_weights_reproduce_linear_attention(qkv, name, normalize):
    q, k, v = qkv
    kw = DECAYS[name]
    w = attention_weights(q, k, "elu", causal=True, normalize=normalize, **kw)
    assert w.shape == (B, N, N) and np.isfinite(w).all()
    assert np.all(np.triu(w, 1) == 0)
    out = linear_attention(q, k, v, feature_map="elu", causal=True, method="quadratic", normalize=normalize, **kw)
    np.testing.assert_allclose(w @ v, out, rtol=1e-12, atol=1e-13)
    if normalize:
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-12)


def test_a_reset_cuts_every_weight_across_it_exactly(qkv):
    q, k, _ = qkv
    w = attention_weights(q, k, "elu", causal=True, normalize=False, **DECAYS["per_token_reset"])
    assert np.all(w[0, 9:, :9] == 0.0) and np.all(w[1, 17:, :17] == 0.0)
    assert np.all(w[0, 9:, 9:][np.tril_indices(N - 9)] > 0)  # ELU+1 features are positive
    g = attention_weights(q, k, "elu", causal=True, normalize=False, **DECAYS["gate_reset"])
    assert np.all(g[0, 5:, :5] == 0.0) and np.all(g[1][np.tril_indices(N)] > 0)


def test_decay_one_is_the_additive_rule(qkv):
    q, k, v = qkv
    for normalize in (True, False):
        np.testing.assert_allclose(attention_weights(q, k, "elu", causal=True, decay=1.0, normalize=normalize),
                                   attention_weights(q, k, "elu", causal=True, normalize=normalize), rtol=1e-13)
    a = approximation_error(q, k, v, "elu", causal=True, decay=1.0).to_dict()
    b = approximation_error(q, k, v, "elu", causal=True).to_dict()
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-10, abs=1e-13), key


def test_additive_unnormalised_weights(qkv):
    q, k, _ = qkv
    from linattn_nb import feature_maps as fm

    phi = fm.get("elu")
    a = np.einsum("bif,bjf->bij", phi(q), phi(k))
    np.testing.assert_allclose(attention_weights(q, k, "elu", normalize=False), a, rtol=1e-13)
    np.testing.assert_allclose(attention_weights(q, k, "elu", causal=True, normalize=False), np.tril(a), rtol=1e-13)


# ---------------------------------------------------------------------------
# approximation_error: the Numba kernel against the explicit reference
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["per_head_scalar", "per_token_log", "per_token_reset", "gate", "gate_reset"])
def test_approximation_error_with_decay_matches_the_naive_reference(qkv, name):
    q, k, v = qkv
    kw = DECAYS[name]
    fast = approximation_error(q, k, v, "elu", causal=True, block=5, **kw).to_dict()
    ref = approximation_error_naive(q, k, v, "elu", causal=True, **kw).to_dict()
    for key in fast:
        assert fast[key] == pytest.approx(ref[key], rel=1e-9, abs=1e-12), key
    # softmax is the same with or without the decay; the linear weights concentrate on recent tokens
    plain = approximation_error(q, k, v, "elu", causal=True).to_dict()
    assert fast["entropy_softmax"] == pytest.approx(plain["entropy_softmax"], rel=1e-12)
    assert fast["entropy_linear"] < plain["entropy_linear"]


# ---------------------------------------------------------------------------
# attention_rank, semiseparable_rank
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["per_head_array", "per_token_reset", "gate"])
@pytest.mark.parametrize("normalize", [True, False])
def test_attention_rank_with_decay_is_the_rank_of_the_weights(qkv, name, normalize):
    q, k, _ = qkv
    kw = DECAYS[name]
    w = attention_weights(q, k, "elu", causal=True, normalize=normalize, **kw)
    ranks, spectra = attention_rank(q, k, "elu", causal=True, normalize=normalize, return_spectrum=True, **kw)
    assert ranks.tolist() == [int(np.linalg.matrix_rank(x)) for x in w]
    np.testing.assert_allclose(spectra, np.linalg.svd(w, compute_uv=False), rtol=1e-12, atol=1e-13)


def test_unnormalised_ranks_from_factors_match_explicit():
    rng = np.random.default_rng(5)
    q, k = rng.normal(size=(2, 3, 300, 6))
    r_factor = attention_rank(q, k, "elu", normalize=False, method="factor")
    r_explicit = attention_rank(q, k, "elu", normalize=False, method="explicit")
    assert r_factor.tolist() == r_explicit.tolist() == [6, 6, 6]
    s_factor = semiseparable_rank(q[:, :120], k[:, :120], "elu", normalize=False, method="factor")
    s_explicit = semiseparable_rank(q[:, :120], k[:, :120], "elu", normalize=False, method="explicit")
    assert s_factor.tolist() == s_explicit.tolist()


def test_semiseparable_rank_of_decayed_weights_is_explicit(qkv):
    q, k, _ = qkv
    kw = DECAYS["per_token_reset"]
    w = attention_weights(q, k, "elu", causal=True, **kw)
    want = [max(int(np.linalg.matrix_rank(x[i:, :i])) for i in range(1, N)) for x in w]
    assert semiseparable_rank(q, k, "elu", **kw).tolist() == want
    assert semiseparable_rank(q, k, "elu", method="explicit", **kw).tolist() == want
    with pytest.raises(ValueError, match="method='factor'.*'decay' rule"):
        semiseparable_rank(q, k, "elu", method="factor", **kw)


# ---------------------------------------------------------------------------
# state_rank_profile
# ---------------------------------------------------------------------------
def _states(k, v, kw, positions, initial_state=None):
    """S after each of ``positions`` tokens, from linear_attention (quadratic, float64) on the prefixes."""
    out = []
    for t in positions:
        sub = {}
        for name, x in kw.items():
            x = np.asarray(x)
            sub[name] = x[..., :t, :] if x.ndim == 3 else (x[..., :t] if x.ndim == 2 else x)
        _, st = linear_attention(k[..., :t, :], k[..., :t, :], v[..., :t, :], causal=True, method="quadratic",
                                 return_state=True, initial_state=initial_state, **sub)
        out.append(st.S)
    return out


@pytest.mark.parametrize("name", ["per_head_scalar", "per_token_reset", "gate_reset"])
def test_state_rank_profile_with_decay_ranks_linear_attentions_states(qkv, name):
    _, k, v = qkv
    kw = DECAYS[name]
    positions = [1, 3, 5, 6, 9, 10, 12, 17, 18, 23]
    prof = state_rank_profile(k, v, "elu", positions=positions, **kw)
    states = _states(k, v, kw, positions)
    want = np.array([[np.linalg.matrix_rank(S[b]) for S in states] for b in range(B)])
    assert prof.rank.tolist() == want.tolist()
    if name == "per_token_reset":  # the reset before token 9 wipes the state: one token after it, rank 1
        assert prof.rank[0, positions.index(10)] == 1 and prof.rank[1, positions.index(18)] == 1


def test_state_rank_profile_continues_a_state_of_its_rule_and_refuses_another(qkv):
    _, k, v = qkv
    gamma = np.full((B, N), 0.9)
    gamma[:, 15] = 0.0
    # a state of the decay rule after 12 tokens, continued for the last 11
    _, st = linear_attention(k[:, :12], k[:, :12], v[:, :12], causal=True, method="quadratic",
                             decay=gamma[:, :12], return_state=True)
    assert st.rule == "decay"
    cont = state_rank_profile(k[:, 12:], v[:, 12:], "elu", decay=gamma[:, 12:], initial_state=st,
                              positions=[0, 1, 3, 4, 11])
    whole = state_rank_profile(k, v, "elu", decay=gamma, positions=[12, 13, 15, 16, 23])
    assert cont.rank.tolist() == whole.rank.tolist()
    with pytest.raises(ValueError, match="'decay' update rule.*'additive' rule"):
        state_rank_profile(k[:, 12:], v[:, 12:], "elu", initial_state=st)
    with pytest.raises(ValueError, match="'decay' update rule.*'gate' rule"):
        state_rank_profile(k[:, 12:], v[:, 12:], "elu", decay=np.full((B, 11, D), 0.9), initial_state=st)
    additive = LinearState(st.S, st.z, 12)  # rule "additive"
    with pytest.raises(ValueError, match="'additive' update rule.*'decay' rule"):
        state_rank_profile(k[:, 12:], v[:, 12:], "elu", decay=0.9, initial_state=additive)
    # a plain tuple carries no record: taken as it is
    state_rank_profile(k[:, 12:], v[:, 12:], "elu", decay=0.9, initial_state=(st.S, st.z, 12))


# ---------------------------------------------------------------------------
# errors: the same forms and messages as linear_attention
# ---------------------------------------------------------------------------
def _calls(q, k, v):
    """Each function called with the keywords it takes (the causal-only ones drop ``causal``)."""
    def causal_only(kw):
        return {key: val for key, val in kw.items() if key != "causal"}

    return {
        "attention_weights": lambda **kw: attention_weights(q, k, "elu", **kw),
        "approximation_error": lambda **kw: approximation_error(q, k, v, "elu", **kw),
        "attention_rank": lambda **kw: attention_rank(q, k, "elu", **kw),
        "semiseparable_rank": lambda **kw: semiseparable_rank(q, k, "elu", **causal_only(kw)),
        "state_rank_profile": lambda **kw: state_rank_profile(k, v, "elu", **causal_only(kw)),
    }


@pytest.mark.parametrize("func", ["attention_weights", "approximation_error", "attention_rank", "semiseparable_rank",
                                  "state_rank_profile"])
def test_bad_decays_raise_like_linear_attention(qkv, func):
    q, k, v = qkv
    call = _calls(q, k, v)[func]
    bad = [
        (dict(decay=1.5), "decay factors must lie in \\[0, 1\\]"),
        (dict(decay=-0.1), "decay factors must lie in \\[0, 1\\]"),
        (dict(log_decay=0.5), "log_decay must be <= 0"),
        (dict(decay=np.nan), "decay contains NaN"),
        (dict(decay=0.9, log_decay=-0.1), "at most one of decay and log_decay"),
        (dict(decay=np.full((B, N + 1), 0.9)), "decay of shape .* last axis must be N=23"),
        (dict(log_decay=np.full((B, N, D + 1), -0.1)), "log_decay of shape .* \\(N, D_phi\\)=\\(23, 4\\)"),
        (dict(decay=np.full((B, N, D, 1), 0.9)), "decay of shape .* has 4 dimensions"),
    ]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            call(causal=True, **kw)
        # linear_attention raises the same
        with pytest.raises(ValueError, match=match):
            linear_attention(q, k, v, causal=True, method="quadratic", **kw)
    with pytest.raises(TypeError, match="decay must hold real numbers"):
        call(causal=True, decay=np.array([1 + 1j]))
    if func in ("attention_weights", "approximation_error", "attention_rank"):
        for name in ("decay", "log_decay"):
            with pytest.raises(ValueError, match=f"{name} applies to causal attention"):
                call(causal=False, **{name: 0.9 if name == "decay" else -0.1})


@pytest.mark.parametrize("func", ["attention_weights", "attention_rank", "semiseparable_rank"])
def test_softmax_and_normalize_errors(qkv, func):
    q, k, v = qkv
    f = {"attention_weights": attention_weights, "attention_rank": attention_rank,
         "semiseparable_rank": semiseparable_rank}[func]
    extra = {} if func == "semiseparable_rank" else {"causal": True}
    with pytest.raises(ValueError, match="decay applies to linear attention's recurrence"):
        f(q, k, "softmax", decay=0.9, **extra)
    with pytest.raises(ValueError, match="log_decay applies to linear attention's recurrence"):
        f(q, k, "softmax", log_decay=-0.1, **extra)
    with pytest.raises(ValueError, match="normalize=False does not apply to feature_map='softmax'"):
        f(q, k, "softmax", normalize=False, **extra)
    with pytest.raises(TypeError, match="normalize must be None, True or False"):
        f(q, k, "elu", normalize="yes", **extra)
    from linattn_nb import feature_maps as fm

    favor = fm.get("favor+", num_features=8, seed=0)
    with pytest.raises(ValueError, match="normalize=False"):
        f(q, k, favor, normalize=False, **extra)
    with pytest.raises(ValueError, match="decay applies to linear attention's recurrence"):
        approximation_error(q, k, v, "softmax", causal=True, decay=0.9)


# ---------------------------------------------------------------------------
# recall_capacity(..., decay=): error against the write-read distance
# ---------------------------------------------------------------------------
def test_recall_decay_one_is_the_additive_rule_and_one_bin_is_the_total():
    kw = dict(value_dim=8, trials=2, seed=3)
    a = recall_capacity("elu", 8, [6, 40], **kw)
    b = recall_capacity("elu", 8, [6, 40], decay=1.0, **kw)
    for field in ("accuracy", "mse", "optimal_mse", "softmax_mse", "error_by_distance", "optimal_error_by_distance"):
        np.testing.assert_allclose(getattr(b, field), getattr(a, field), rtol=1e-12, atol=1e-14, err_msg=field)
    assert a.decay is None and b.decay == 1.0
    assert a.distance_edges.tolist() == [0, 1, 2, 4, 8, 16, 32, 64]
    # n = 6 reaches distances 0..5: the bins from 8 on are empty
    assert np.isnan(a.error_by_distance[0, 4:]).all() and np.isfinite(a.error_by_distance[0, :4]).all()
    assert np.isfinite(a.error_by_distance[1]).all()
    one = recall_capacity("elu", 8, [6, 40], decay=0.9, distance_bins=[0, 64], **kw)
    np.testing.assert_allclose(one.error_by_distance[:, 0], one.mse, rtol=1e-12)
    np.testing.assert_allclose(one.optimal_error_by_distance[:, 0], one.optimal_mse, rtol=1e-12, atol=1e-14)
    assert one.distance_edges.tolist() == [0, 64]


def test_recall_decay_reads_linear_attentions_decayed_state():
    """The read-out is causal linear_attention(decay=gamma) after the last write, queried by each key."""
    n, d, m, gamma, seed = 12, 4, 3, 0.8, 5
    res = recall_capacity("elu", d, n, value_dim=m, trials=1, seed=seed, decay=gamma, distance_bins=[0, 1, 4, 16])
    rng = np.random.default_rng([seed, n, 0])  # the documented stream of (seed, n, trial)
    keys = rng.standard_normal((n, d))
    vals = rng.standard_normal((n, m))
    # batch entry j: the n writes, with the last token's query replaced by key j
    q = np.repeat(keys[None], n, axis=0)
    q[:, -1] = keys
    out = linear_attention(q, np.repeat(keys[None], n, axis=0), np.repeat(vals[None], n, axis=0), causal=True,
                           decay=gamma, method="quadratic")[:, -1]
    err = np.sum((out - vals) ** 2, axis=1)
    norm = np.sum(vals ** 2, axis=1)
    assert res.mse[0] == pytest.approx(err.sum() / norm.sum(), rel=1e-10)
    dist = n - 1 - np.arange(n)
    for b, (lo, hi) in enumerate([(0, 1), (1, 4), (4, 16)]):
        sel = (dist >= lo) & (dist < hi)
        assert res.error_by_distance[0, b] == pytest.approx(err[sel].sum() / norm[sel].sum(), rel=1e-10)


def test_recall_decay_trades_old_pairs_for_recent_ones():
    kw = dict(value_dim=16, trials=3, seed=0, distance_bins=[0, 4, 32, 256])
    add = recall_capacity("dpfp", 16, 256, **kw)
    dec = recall_capacity("dpfp", 16, 256, decay=0.9, **kw)
    assert dec.error_by_distance[0, 0] < 0.7 * add.error_by_distance[0, 0]  # recent: less interference
    assert dec.error_by_distance[0, 2] > add.error_by_distance[0, 2]        # old: forgotten
    assert dec.error_by_distance[0, 2] > 1.0  # the read-out of a forgotten pair mixes other values
    # the floor does not depend on the rule
    np.testing.assert_allclose(dec.optimal_error_by_distance, add.optimal_error_by_distance, rtol=1e-12)


def test_recall_decay_errors():
    for bad, exc, match in [(1.5, ValueError, "decay must lie in \\[0, 1\\]"), (-0.5, ValueError, "decay must lie"),
                            (float("nan"), ValueError, "decay must lie"), (True, TypeError, "decay must be a real"),
                            ("0.9", TypeError, "decay must be a real"), ([0.9], TypeError, "decay must be a real")]:
        with pytest.raises(exc, match=match):
            recall_capacity("elu", 4, 8, decay=bad, trials=1)
    for bins, exc in [([0], ValueError), ([3, 2], ValueError), ([-1, 4], ValueError), ([0.0, 4.0], TypeError),
                      ([[0, 4]], TypeError)]:
        with pytest.raises(exc, match="distance_bins"):
            recall_capacity("elu", 4, 8, distance_bins=bins, trials=1)
    res = recall_capacity("elu", 4, 8, decay=0.0, trials=1, value_dim=2, distance_bins=[0, 1, 8])
    assert np.isfinite(res.error_by_distance).all()  # gamma = 0 keeps only the last pair: no NaN
