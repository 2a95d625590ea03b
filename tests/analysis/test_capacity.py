"""Recall capacity of the fixed-size state, MQAR sequences, state size."""
from __future__ import annotations

import json

import numpy as np
import pytest

from linattn_nb import feature_maps
from linattn_nb.analysis import mqar, recall_capacity, state_size
from linattn_nb.feature_maps import DpfpFeatureMap


# ---------------------------------------------------------------------------
# recall_capacity
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmap,d", [("elu", 16), (DpfpFeatureMap(1), 32), (DpfpFeatureMap(2), 16),
                                    (DpfpFeatureMap(3), 16)])
def test_optimal_mse_is_the_eckart_young_floor(fmap, d):
    """Schlag, Irie & Schmidhuber 2021, §4.1: a D_phi x M state holds at most D_phi orthogonal keys, so
    beyond n = D_phi pairs retrieval must err.  With one-hot values the least-squares state attains the
    Eckart-Young floor: relative error 0 for n <= D_phi (keys in general position) and 1 - D_phi/n beyond.
    ELU+1: D_phi = d; DPFP(nu): D_phi = 2 d nu (§5.4).  DPFP features are sparse products, so at small d
    n = D_phi random keys are often *not* in general position (rank-deficient in ~25% of draws at d = 8,
    nu = 1; 0.5% at d = 16; none seen at d = 32 in 200 draws): d is chosen where they are."""
    f = feature_maps.resolve(fmap).output_dim(d)
    assert f == (d if fmap == "elu" else 2 * d * fmap.nu)
    ns = [4, f // 2, f, 2 * f, 3 * f]
    res = recall_capacity(fmap, d, ns, trials=2, seed=3)
    assert res.d_phi == f
    want = [max(0.0, 1 - f / n) for n in ns]
    np.testing.assert_allclose(res.optimal_mse, want, atol=1e-9)
    # the sum rule never beats the floor (its read-out D^-1 phi phi^T has rank <= D_phi)
    assert np.all(res.mse >= res.optimal_mse - 1e-12)


@pytest.mark.parametrize("fmap", sorted(feature_maps.available()))
def test_sum_rule_never_below_floor_and_softmax_wins(fmap):
    """With one-hot values the sum rule's error is never below optimal_mse (Eckart-Young: its read-out
    has rank <= D_phi), and at n >> D_phi softmax over the same pairs (a KV cache, which grows with n)
    errs less than every linear feature map (Eckart-Young; Schlag et al. 2021, §4.1)."""
    d = 8
    m = feature_maps.get(fmap)
    f = m.output_dim(d)
    n_big = 8 * f
    # signed features: the unnormalised read-out (a normaliser at the floor is refused, tested below)
    res = recall_capacity(fmap, d, [f // 2, f, n_big], trials=2, seed=1, normalize=None if m.is_positive else False)
    assert np.all(res.mse >= res.optimal_mse - 1e-12)
    assert res.optimal_mse[-1] == pytest.approx(1 - f / n_big, abs=1e-9)
    assert res.softmax_mse[-1] < res.mse[-1]
    assert 0.0 <= res.accuracy.min() and res.accuracy.max() <= 1.0


def test_argmax_hides_the_capacity_limit():
    """With unit-norm keys ELU+1's argmax recall already fails at
    n = 8 (its features share a large positive mean), while with N(0, 1) keys it stays above 80% far past
    D_phi -- yet the error is close to 1 and the optimal floor says most of the information is gone."""
    d = 64
    unit = recall_capacity("elu", d, [8], key_scale=1 / np.sqrt(d), trials=4, seed=0)
    assert unit.accuracy[0] < 0.6
    gauss = recall_capacity("elu", d, [8, 512], trials=2, seed=0)
    assert gauss.accuracy[0] == 1.0
    assert gauss.accuracy[1] > 0.8
    assert gauss.mse[1] > 0.95 and gauss.optimal_mse[1] == pytest.approx(1 - 64 / 512, abs=1e-9)
    assert gauss.softmax_accuracy[1] == 1.0


def test_gaussian_values_and_result_object():
    res = recall_capacity("elu", 8, [4, 8, 64], value_dim=5, trials=3, seed=2)
    assert res.value_dim == 5 and res.d_phi == 8
    np.testing.assert_allclose(res.optimal_mse[:2], 0.0, atol=1e-12)  # n <= D_phi: exact storage possible
    assert 0.5 < res.optimal_mse[2] < 1.0
    assert np.all(res.mse >= res.optimal_mse - 1e-12)  # least squares is the floor of any linear read-out
    d = json.loads(json.dumps(res.to_dict()))
    assert d["n_pairs"] == [4, 8, 64] and len(d["mse"]) == 3
    table = res.table()
    assert "D_phi=8" in table and len(table.splitlines()) == 2 + 3


def test_recall_capacity_reproducible_and_independent_of_other_n():
    a = recall_capacity("relu", 6, [10, 20], trials=2, seed=5)
    b = recall_capacity("relu", 6, [20], trials=2, seed=5)
    c = recall_capacity("relu", 6, [20], trials=2, seed=6)
    assert a.mse[1] == b.mse[0] and a.softmax_mse[1] == b.softmax_mse[0]
    assert c.mse[0] != b.mse[0]


def test_recall_capacity_errors():
    with pytest.raises(ValueError, match="softmax"):
        recall_capacity("softmax", 8, [4])
    with pytest.raises(ValueError, match="n_pairs"):
        recall_capacity("elu", 8, [0, 4])
    with pytest.raises(TypeError, match="n_pairs"):
        recall_capacity("elu", 8, [1.5])
    with pytest.raises(TypeError, match="d must be an integer"):
        recall_capacity("elu", 8.0, [4])
    with pytest.raises(ValueError, match="key_scale"):
        recall_capacity("elu", 8, [4], key_scale=0)
    with pytest.raises(ValueError, match="trials"):
        recall_capacity("elu", 8, [4], trials=0)
    with pytest.raises(ValueError, match="feature_map"):
        recall_capacity("nope", 8, [4])


# ---------------------------------------------------------------------------
# mqar
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("seq_len,n_kv", [(64, 4), (128, 8), (256, 16), (16, 4)])
def test_mqar_satisfies_zoology_constraints(seq_len, n_kv):
    """Arora et al. 2023 (Zoology), MQAR: keys distinct from [1, V/2), values distinct from [V/2, V), the
    context k1 v1 ... kn vn first, every key queried exactly once later, label = its value at the query
    position and -100 elsewhere.  Sweeps (seq, kv) in {(64, 4), (128, 8), (256, 16)} and the tightest 4 kv = seq."""
    vocab = 8192 if seq_len > 16 else 20
    b = mqar(50, seq_len, n_kv, vocab_size=vocab, seed=0)
    assert b.inputs.shape == b.labels.shape == (50, seq_len)
    assert b.inputs.dtype == b.labels.dtype == np.int64
    half = vocab // 2
    for e in range(50):
        x, y, ks, vs, qp = b.inputs[e], b.labels[e], b.keys[e], b.values[e], b.query_positions[e]
        assert len(set(ks)) == n_kv and len(set(vs)) == n_kv
        assert ks.min() >= 1 and ks.max() < half
        assert vs.min() >= half and vs.max() < vocab
        np.testing.assert_array_equal(x[0:2 * n_kv:2], ks)
        np.testing.assert_array_equal(x[1:2 * n_kv:2], vs)
        assert np.all(qp >= 2 * n_kv) and np.all((qp - 2 * n_kv) % 2 == 0) and len(set(qp)) == n_kv
        np.testing.assert_array_equal(x[qp], ks)
        np.testing.assert_array_equal(y[qp], vs)
        assert np.count_nonzero(y != -100) == n_kv
        for kk in ks:  # each key occurs exactly twice: in its pair and at its query
            assert np.count_nonzero(x == kk) == 2
        assert x.min() >= 0 and x.max() < vocab


def test_mqar_power_law_query_slots():
    """Query slots follow p(i) ∝ a i^(a-1) (Zoology, power_a = 0.01): with one pair per example the
    empirical slot frequencies match p (binomial 5-sigma band)."""
    seq_len, n_ex, a = 32, 4000, 0.01
    b = mqar(n_ex, seq_len, 1, vocab_size=64, power_a=a, seed=1)
    slots = (b.query_positions[:, 0] - 2) // 2
    idx = np.arange(1, (seq_len - 2) // 2 + 1)
    p = a * idx ** (a - 1.0)
    p /= p.sum()
    freq = np.bincount(slots, minlength=p.size) / n_ex
    band = 5 * np.sqrt(p * (1 - p) / n_ex)
    assert np.all(np.abs(freq - p) <= band)
    assert freq[0] > 5 * freq[-1]  # ~ i^-0.99: queries crowd towards the context
    flat = mqar(n_ex, seq_len, 1, vocab_size=64, power_a=1.0, seed=1)  # a = 1: uniform slots
    assert np.bincount((flat.query_positions[:, 0] - 2) // 2).max() / n_ex < 0.1


def test_mqar_options_and_errors():
    b = mqar(3, 16, 2, vocab_size=32, random_non_queries=False, seed=4)
    filler = np.ones(16, dtype=bool)
    filler[:4] = False
    for e in range(3):
        f = filler.copy()
        f[b.query_positions[e]] = False
        assert np.all(b.inputs[e, f] == 0)
    g = mqar(3, 16, 2, vocab_size=32, seed=np.random.default_rng(4))
    np.testing.assert_array_equal(g.keys, mqar(3, 16, 2, vocab_size=32, seed=4).keys)
    assert mqar(0, 16, 2, vocab_size=32).inputs.shape == (0, 16)
    with pytest.raises(ValueError, match="even"):
        mqar(1, 15, 2, vocab_size=32)
    with pytest.raises(ValueError, match="vocab_size must be larger"):
        mqar(1, 16, 2, vocab_size=16)
    with pytest.raises(ValueError, match="4 \\* n_kv"):
        mqar(1, 16, 5, vocab_size=64)
    with pytest.raises(ValueError, match="power_a"):
        mqar(1, 16, 2, vocab_size=64, power_a=0.0)


# ---------------------------------------------------------------------------
# state_size
# ---------------------------------------------------------------------------
def test_state_size_counts_like_zoology():
    """Zoology / Based: heads * head_dim * D_phi + heads * D_phi numbers (S and z)."""
    assert state_size("elu", 64, 64, heads=8) == 8 * (64 * 64 + 64) * 8
    assert state_size("elu", 16, 64, heads=2, dtype=np.float32) == 2 * (64 * 16 + 16) * 4
    assert state_size(DpfpFeatureMap(3), 16, 32) == (32 * 96 + 96) * 8
    assert state_size("softmax", 64, 32, heads=4, seq_len=100, dtype="float16") == 4 * 100 * 96 * 2
    with pytest.raises(ValueError, match="seq_len"):
        state_size("softmax", 64, 64)
    with pytest.raises(ValueError, match="heads"):
        state_size("elu", 64, 64, heads=0)


class _DropRow(feature_maps.FeatureMap):
    name = "drop-row"
    is_positive = True

    def transform(self, x):
        return np.maximum(x, 0.0)[..., :-1, :]


class _NoFeatures(feature_maps.FeatureMap):
    name = "no-features"

    def output_dim(self, d):
        return 0

    def transform(self, x):
        return x[..., :0]


def test_maps_of_the_wrong_shape_raise_naming_them():
    """The features recall_capacity reads are shape-checked like linear_attention's."""
    with pytest.raises(ValueError, match=r"feature map 'drop-row' returned features of shape \(7, 4\) for keys "
                                         r"of shape \(8, 4\); expected \(8, 4\)"):
        recall_capacity(_DropRow(), 4, [8], trials=1)
    with pytest.raises(ValueError, match=r"feature map 'no-features' has output_dim\(4\) = 0"):
        recall_capacity(_NoFeatures(), 4, [8], trials=1)
    with pytest.raises(ValueError, match=r"feature map 'no-features' has output_dim\(4\) = 0"):
        state_size(_NoFeatures(), 4, 4)


@pytest.mark.parametrize("softmax_scale, eps", [(None, 1e-8), (0.2, 1e-8), (3.0, 20.0)])
def test_recall_capacity_softmax_scale_and_eps_against_numpy(softmax_scale, eps):
    """``softmax_scale=`` sets the softmax baseline's temperature, ``eps=`` the linear read-out's floor
   : every reported mean recomputed here from the keys the documented streams draw
    (``default_rng([seed, n, trial])``, N(0, 1) keys, one-hot values), ReLU features written out."""
    d, ns, trials, seed = 6, [5, 12], 2, 4
    res = recall_capacity("relu", d, ns, trials=trials, seed=seed, softmax_scale=softmax_scale, eps=eps)
    scale = 1 / np.sqrt(d) if softmax_scale is None else softmax_scale
    assert res.softmax_scale == scale
    want = {key: np.zeros(len(ns)) for key in ("accuracy", "mse", "softmax_accuracy", "softmax_mse")}
    floored = 0
    for a, n in enumerate(ns):
        for t in range(trials):
            keys = np.random.default_rng([seed, n, t]).standard_normal((n, d))
            eye = np.eye(n)
            s = scale * keys @ keys.T
            p = np.exp(s - s.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            f = np.maximum(keys, 0.0)
            A = f @ f.T
            den = A.sum(1)
            floored += int(np.sum(den < eps))
            vhat = A / np.maximum(den, eps)[:, None]
            for name, out in (("", vhat), ("softmax_", p)):
                # nearest one-hot value: argmax of 2 out_i . e_j - 1
                want[name + "accuracy"][a] += np.mean(np.argmax(out, 1) == np.arange(n)) / trials
                want[name + "mse"][a] += np.sum((out - eye) ** 2) / n / trials
    for key, val in want.items():
        np.testing.assert_allclose(getattr(res, key), val, rtol=1e-12, err_msg=key)
    if eps == 20.0:  # the floor is reached on some rows, and it changes the read-out
        assert floored > 0
        plain = recall_capacity("relu", d, ns, trials=trials, seed=seed, softmax_scale=softmax_scale)
        assert not np.allclose(plain.mse, res.mse)
        np.testing.assert_array_equal(plain.softmax_mse, res.softmax_mse)


def test_recall_capacity_of_dplr_rules():
    """Named DPLR rules through recall_capacity: KDA with gates of 1 and RWKV-7 with its removal key the
    written key (iclr = 1, w = 1) are the delta rule at beta = 1; DeltaProduct writing each pair twice
    at beta = 0.5 stores 1 - 0.5^2 of it, the delta rule at beta = 0.75 on orthonormal keys."""
    from linattn_nb.analysis import recall_capacity

    ones = np.ones(16)
    ref = recall_capacity("l2", 16, [8, 32], trials=2, beta=1.0)
    kda = recall_capacity("l2", 16, [8, 32], trials=2, rule="kda", rule_arguments={"decay": ones, "beta": 1.0})
    rwkv = recall_capacity("l2", 16, [8, 32], trials=2, rule="rwkv7",
                           rule_arguments={"decay": ones, "kappa": "keys", "iclr": ones})
    np.testing.assert_allclose(kda.mse, ref.mse, rtol=1e-10)
    np.testing.assert_allclose(rwkv.mse, ref.mse, rtol=1e-10)
    assert kda.rule == "kda" and "rule=kda" in kda.table()
    dp = recall_capacity("l2", 16, [4, 8], trials=2, rule="delta_product", rule_arguments={"beta": [0.5, 0.5]},
                         orthogonal_keys=True)
    d75 = recall_capacity("l2", 16, [4, 8], trials=2, beta=0.75, orthogonal_keys=True)
    np.testing.assert_allclose(dp.mse, d75.mse, rtol=1e-10)
    with pytest.raises(TypeError, match="rule_arguments"):
        recall_capacity("l2", 16, 4, rule="kda", beta=1.0)
    with pytest.raises(TypeError, match="needs rule="):
        recall_capacity("l2", 16, 4, rule_arguments={})
    with pytest.raises(ValueError, match="shape \\(n_h,\\)"):
        recall_capacity("l2", 16, 4, rule="delta_product", rule_arguments={"beta": 1.0})


@pytest.mark.parametrize("decay", [None, 0.9])
def test_a_signed_map_whose_normaliser_falls_to_the_floor_is_refused_not_read(decay):
    """l2 features of random keys give some key phi(k) . z <= eps: the normalised read-out would divide by the
    floor (errors of 1e15).  Refused, naming normalize; with normalize=False the read-out is the plain one."""
    with pytest.raises(ValueError, match=r"'l2' has signed features.*<= 1e-08.*pass normalize=False"):
        recall_capacity("l2", 4, [2, 4, 8], trials=4, decay=decay)
    res = recall_capacity("l2", 4, [2, 4, 8], trials=4, decay=decay, normalize=False)
    assert np.all(np.isfinite(res.mse)) and res.mse.max() < 10
    # maps whose kernel keeps the normaliser positive still read normalised: taylor2 (signed features), relu
    for name in ("taylor2", "relu"):
        assert np.all(recall_capacity(name, 4, [2, 4, 8], trials=4, decay=decay).mse < 2)


@pytest.mark.parametrize("kw", [{"beta": 1.0}, {"beta": 0.5, "decay": 0.9},
                                {"rule": "kda", "rule_arguments": {"decay": np.ones(2), "beta": 1.0}}])
def test_the_signed_normaliser_check_holds_for_the_delta_and_dplr_rules(kw):
    """The delta rule (beta=) and a named DPLR rule (rule=) with normalize=True and l2 features: a key whose
    normaliser phi(k) . z is <= eps is refused as on the additive path, not read as an error of 1e15."""
    with pytest.raises(ValueError, match=r"'l2' has signed features.*<= 1e-08.*pass normalize=False"):
        recall_capacity("l2", 2, 4, trials=1, seed=1, normalize=True, **kw)
    res = recall_capacity("l2", 2, 4, trials=1, seed=1, normalize=False, **kw)
    assert np.all(np.isfinite(res.mse)) and res.mse.max() < 10


def test_distances_below_the_first_edge_are_left_out_as_those_past_the_last():
    """distance_bins = [1, 2, 4]: the last pair (distance 0) falls in no bin, as distances >= 4 do; the bins
    are those of [0, 1, 2, 4] without the first."""
    part = recall_capacity("elu", 3, 8, trials=2, distance_bins=[1, 2, 4])
    full = recall_capacity("elu", 3, 8, trials=2, distance_bins=[0, 1, 2, 4])
    assert part.error_by_distance.shape == (1, 2)
    np.testing.assert_allclose(part.error_by_distance, full.error_by_distance[:, 1:], rtol=1e-12)
    np.testing.assert_allclose(part.optimal_error_by_distance, full.optimal_error_by_distance[:, 1:], rtol=1e-12)
    # no distance in any bin: NaN, not an error
    assert np.isnan(recall_capacity("elu", 3, 2, trials=1, distance_bins=[5, 6]).error_by_distance).all()


def test_a_zero_normaliser_with_eps_none_is_refused_as_attention_rank_refuses_it():
    """ReLU features of a negative key are all 0: with eps=None its read-out is 0/0.  Refused (ValueError
    naming eps) on every path instead of a NaN mse next to a finite accuracy; with the floor it reads 0."""
    for kw in ({}, {"decay": 0.9}, {"beta": 1.0, "normalize": True}):
        with pytest.raises(ValueError, match=r"zero normaliser.*'relu' with eps=None.*pass eps > 0"):
            recall_capacity("relu", 1, 4, trials=2, eps=None, **kw)
        assert np.all(np.isfinite(recall_capacity("relu", 1, 4, trials=2, **kw).mse))
    # without the normaliser there is nothing to divide by
    assert np.all(np.isfinite(recall_capacity("relu", 1, 4, trials=2, eps=None, normalize=False).mse))


def test_a_tied_read_out_is_a_miss_as_in_read_back():
    """ReLU features of a negative key are all 0: the read-out is 0, equally far from every one-hot value.
    argmax gave such rows to the first pair; a tie is not 'nearest', and read_back counts it a miss."""
    from linattn_nb.analysis.capacity import _nearest_accuracy

    v = np.eye(4)
    vhat = v.copy()
    vhat[2] = 0.0  # tied with every value
    vhat[0] = 0.0  # tied too, and argmax would give it to row 0
    assert _nearest_accuracy(vhat, v) == 0.5
    assert _nearest_accuracy(v[:1] * 0.5, v[:1]) == 1.0  # no other value to be nearer


def test_mqar_steep_power_law_and_odd_arguments():
    """power_a = 140 overflowed idx ** (a - 1) and failed in NumPy ("Probabilities contain NaN"); a seed of True
    was taken as 1; state_size gave 0 bytes for dtype=str and took seq_len=-5; recall_capacity of n = 10**7
    failed in np.eye with NumPy's MemoryError for 728 TiB."""
    from linattn_nb.analysis import mqar, recall_capacity, state_size

    steep = mqar(3, 400, 4, vocab_size=512, power_a=140.0, seed=0)
    # the law favours the last slots that overwhelmingly: every query sits in the last 20 of 196
    assert (steep.query_positions >= 400 - 40).all()
    assert mqar(3, 400, 4, vocab_size=512, power_a=100.0, seed=0).query_positions.shape == (3, 4)
    with pytest.raises(TypeError, match="seed must be None, a non-negative integer"):
        mqar(1, 16, 2, vocab_size=32, seed=True)
    for bad in (str, object, "int32", "not a dtype"):
        with pytest.raises(TypeError, match="dtype must be a floating dtype"):
            state_size("elu", 4, 4, dtype=bad)
    with pytest.raises(ValueError, match="seq_len"):
        state_size("elu", 4, 4, seq_len=-5)
    assert state_size("elu", 4, 4, dtype="float16", seq_len=7) == (4 * 4 + 4) * 2
    with pytest.raises(ValueError, match=r"n_pairs: n = 10000000 .* config\.QUADRATIC_MAX_ELEMENTS"):
        recall_capacity("elu", 4, [8, 10 ** 7])


def test_mqar_power_law_that_underflows_still_draws_the_law():
    """power_a = 1e4 underflowed the log-space law to fewer non-zero slots than n_kv and failed in NumPy
    ("Fewer non-zero entries in p than size"): the same law drawn from its logs puts every query in the
    n_kv last slots, as it does (to float precision) for any a that large."""
    n_kv, seq_len = 8, 64
    for a in (1e4, 1e300, 1.7e308):
        b = mqar(20, seq_len, n_kv, vocab_size=128, power_a=a, seed=0)
        last = set(range(seq_len - 2 * n_kv, seq_len, 2))
        for e in range(20):
            assert set(b.query_positions[e].tolist()) == last
            np.testing.assert_array_equal(b.inputs[e, b.query_positions[e]], b.keys[e])
            np.testing.assert_array_equal(b.labels[e, b.query_positions[e]], b.values[e])
            assert np.count_nonzero(b.labels[e] != -100) == n_kv


def test_recall_capacity_refuses_an_empty_n_pairs_and_sizes_too_large_before_making_them(monkeypatch):
    """n_pairs=[] was a TypeError (np.asarray([]) is float) though the docstring says ValueError; a d (or
    value_dim) whose arrays exceed config.QUADRATIC_MAX_ELEMENTS ran out of memory in the trial."""
    from linattn_nb import config

    with pytest.raises(ValueError, match="n_pairs must be non-empty"):
        recall_capacity("elu", 4, [])
    with pytest.raises(ValueError, match="n_pairs must be non-empty"):
        recall_capacity("elu", 4, np.array([], dtype=np.int64))
    monkeypatch.setattr(config, "QUADRATIC_MAX_ELEMENTS", 1000)
    with pytest.raises(ValueError, match=r"d = 600: .* n x d keys = 2 x 600 .*QUADRATIC_MAX_ELEMENTS = 1000"):
        recall_capacity("elu", 600, 2, trials=1)
    with pytest.raises(ValueError, match=r"d = 31: .* n x D_phi features = 2 x 528 "):
        recall_capacity("taylor2", 31, 2, trials=1)  # D_phi = 1 + d + d(d+1)/2
    with pytest.raises(ValueError, match=r"d = 40: .* d x d orthogonal block = 40 x 40 "):
        recall_capacity(feature_maps.get("favor+", num_features=4, seed=0), 40, 2, trials=1)
    with pytest.raises(ValueError, match=r"value_dim = 600: .* n x M values = 2 x 600 "):
        recall_capacity("elu", 4, 2, trials=1, value_dim=600)
    assert recall_capacity("elu", 4, 2, trials=1).n_pairs.tolist() == [2]
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"d = 1000000000: .*QUADRATIC_MAX_ELEMENTS"):
        recall_capacity("elu", 10 ** 9, 2)


def test_keys_that_overflow_the_state_raise_the_documented_error_without_a_numpy_warning():
    """key_scale=1e200: the read-out's normaliser check printed NumPy's overflow warning (an error under
    ``-W error``) before linear_attention's NonFiniteResult, which the docstring did not list."""
    import warnings

    from linattn_nb import NonFiniteResult

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(NonFiniteResult):
            recall_capacity("elu", 4, [3], key_scale=1e200, trials=1)
