"""approximation_error / attention_weights: Numba row-block kernel against the naive reference, and claims."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn_nb import config, linear_attention, softmax_attention
from linattn_nb import feature_maps as fm
from linattn_nb.analysis import ApproximationError, approximation_error, approximation_error_naive, attention_weights
from _bad_maps import BadShapeMap

FIELDS = ("output_rel_error", "kl_mean", "kl_max", "tv_mean", "tv_max", "entropy_softmax", "entropy_linear",
          "monotonicity", "nonpositive_normalizer_rate", "kl_infinite_rate", "js_mean")


def _assert_same(got: ApproximationError, want: ApproximationError, rtol=1e-12):
    assert got.n_rows == want.n_rows
    for f in FIELDS:
        a, b = getattr(got, f), getattr(want, f)
        if math.isnan(b) or math.isinf(b):
            assert (math.isnan(a) and math.isnan(b)) or a == b, (f, a, b)
        else:
            assert math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12), (f, a, b)


def _map(name):
    if name == "favor+":
        return fm.get("favor+", num_features=16, seed=0)
    if name == "rff":
        return fm.get("rff", num_features=6, seed=0)
    if name == "t2r":  # d = 5 -> d_out = 7, with a bias: zero features on some rows, not all
        r = np.random.default_rng(0)
        return fm.get("t2r", W=r.normal(size=(7, 5)), b=0.3 * r.normal(size=7))
    return name


# ---------------------------------------------------------------------------
# kernel against the naive reference, on edge shapes
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["softmax", "elu", "relu", "favor+", "rff", "identity", "cosformer", "taylor2",
                                  "hedgehog", "t2r", "dpfp"])
@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 37])
def test_kernel_matches_naive(name, causal, n, rng):
    """Block 8: N = 7, 8, 9 are block - 1, block, block + 1; relu gives tied and zero weights."""
    q, k = rng.normal(size=(2, 3, n, 5))
    v = rng.normal(size=(3, n, 4))                  # D != M, 3 batch entries (above 2 threads)
    got = approximation_error(q, k, v, _map(name), causal=causal, block=8)
    want = approximation_error_naive(q, k, v, _map(name), causal=causal)
    _assert_same(got, want)


@pytest.mark.parametrize("eps", [None, 1e-8, 0.5])
def test_eps_conventions_match_naive(eps, rng):
    """Signed maps: raw division (eps=None, zero normalisers give inf) and floors, as linear_attention."""
    q, k = rng.normal(size=(2, 2, 16, 3))
    v = rng.normal(size=(2, 16, 2))
    for name in ("rff", "identity", "relu"):
        got = approximation_error(q, k, v, _map(name), causal=True, eps=eps, block=5)
        want = approximation_error_naive(q, k, v, _map(name), causal=True, eps=eps)
        _assert_same(got, want)
    # an exactly zero normaliser with eps=None: relu features with disjoint supports
    q = np.array([[1.0, -1.0], [1.0, 1.0]])
    k = np.array([[-1.0, 1.0], [1.0, 1.0]])
    v = np.ones((2, 1))
    got = approximation_error(q, k, v, "relu", causal=True, eps=None)
    want = approximation_error_naive(q, k, v, "relu", causal=True, eps=None)
    assert got.nonpositive_normalizer_rate == 0.5 and got.tv_max == math.inf
    _assert_same(got, want)


@settings(max_examples=12)
@given(n=st.integers(1, 20), d=st.integers(1, 4), batch=st.sampled_from([(), (1,), (2, 3)]),
       causal=st.booleans(), block=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_kernel_matches_naive_property(n, d, batch, causal, block, seed):
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(2,) + batch + (n, d))
    v = rng.normal(size=batch + (n, 2))
    for name in ("elu", "favor+"):
        got = approximation_error(q, k, v, _map(name), causal=causal, block=block)
        want = approximation_error_naive(q, k, v, _map(name), causal=causal)
        _assert_same(got, want)


def test_long_rows_use_the_radix_ranks(rng):
    """Rows of >= 24 keys are ranked by the radix sort: ties (ReLU zeros) and signs against scipy's rankdata."""
    n = 300
    q, k = rng.normal(size=(2, n, 4))
    v = rng.normal(size=(n, 2))
    for name, causal in (("relu", False), ("identity", True), ("softmax", False)):
        got = approximation_error(q, k, v, name, causal=causal)
        want = approximation_error_naive(q, k, v, name, causal=causal)
        _assert_same(got, want)
    # negative zeros tie with positive zeros
    k2 = k.copy()
    k2[: n // 2] = -0.0
    got = approximation_error(q, k2, v, "identity", eps=None)
    want = approximation_error_naive(q, k2, v, "identity", eps=None)
    _assert_same(got, want)


def test_radix_ranks_against_rankdata():
    """The radix ranking on its own: ties, signed zeros, clustered, tiny and huge values, as rankdata - 1."""
    from scipy.stats import rankdata

    from linattn_nb.analysis._kernels import _RADIX_PASSES, _RADIX_SIZE, _average_ranks

    rng = np.random.default_rng(3)
    n = 3000
    cases = [rng.normal(size=n), np.round(rng.normal(size=n), 1), 1 + 1e-12 * rng.random(n),
             np.exp(rng.uniform(-700, 700, n)) * rng.choice([-1.0, 1.0], n),
             np.where(rng.random(n) < 0.5, -0.0, 0.0), np.full(n, 2.5), rng.normal(size=30)]
    for x in cases:
        m = x.size
        bufs = (np.empty(m), np.empty(m, np.uint64), np.empty(m, np.uint64), np.empty(m, np.int64),
                np.empty(m, np.int64), np.empty((_RADIX_PASSES, _RADIX_SIZE), np.int64))
        ranks = np.full(m, np.nan)
        _average_ranks(x, m, *bufs, ranks)
        np.testing.assert_array_equal(ranks, rankdata(x) - 1)


def test_empty_and_batch_shapes(rng):
    q = np.zeros((2, 0, 3))
    r = approximation_error(q, q, np.zeros((2, 0, 1)), "elu")
    assert r.n_rows == 0 and all(math.isnan(getattr(r, f)) for f in FIELDS)
    q = np.zeros((0, 4, 3))
    assert approximation_error(q, q, np.zeros((0, 4, 1)), "elu").n_rows == 0
    q, k = rng.normal(size=(2, 2, 3, 10, 4))
    v = rng.normal(size=(2, 3, 10, 2))
    r = approximation_error(q, k, v, "elu", causal=True)
    assert r.n_rows == 60
    _assert_same(approximation_error(q.reshape(6, 10, 4), k.reshape(6, 10, 4), v.reshape(6, 10, 2), "elu",
                                     causal=True), r)


def test_dtypes_and_layouts(rng):
    q, k = rng.normal(size=(2, 12, 3))
    v = rng.normal(size=(12, 2))
    want = approximation_error(q, k, v, "elu")
    _assert_same(approximation_error(q.astype(np.float32), k.astype(np.float16), v, "elu"),
                 approximation_error_naive(q.astype(np.float32), k.astype(np.float16), v, "elu"))
    qf = np.asfortranarray(q)
    _assert_same(approximation_error(qf, k[::1], v, "elu"), want)


def test_bad_inputs(rng):
    q = rng.normal(size=(5, 3))
    v = rng.normal(size=(5, 2))
    with pytest.raises(ValueError, match="same sequence length"):
        approximation_error(q, q[:4], v, "elu")
    with pytest.raises(TypeError, match="float"):
        approximation_error(q.astype(int), q, v, "elu")
    bad = q.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        approximation_error(bad, q, v, "elu")
    with pytest.raises(ValueError, match="unknown feature map"):
        approximation_error(q, q, v, "nope")
    with pytest.raises(ValueError, match="eps"):
        approximation_error(q, q, v, "elu", eps=-1.0)
    with pytest.raises(ValueError, match="block"):
        approximation_error(q, q, v, "elu", block=0)
    with pytest.warns(UserWarning, match="scale"):
        approximation_error(q, q, v, fm.get("favor+", num_features=4, seed=0), scale=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        approximation_error(q, q, v, fm.get("favor+", num_features=4, seed=0, scale=1.0), scale=1.0)


# ---------------------------------------------------------------------------
# attention_weights
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_attention_weights_reproduce_the_outputs(causal, rng):
    q, k = rng.normal(size=(2, 2, 11, 4))
    v = rng.normal(size=(2, 11, 3))
    w = attention_weights(q, k, "softmax", causal=causal)
    np.testing.assert_allclose(w @ v, softmax_attention(q, k, v, causal=causal), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-12)
    for name in ("elu", "favor+", "dpfp", "taylor2"):
        w = attention_weights(q, k, _map(name), causal=causal)
        np.testing.assert_allclose(w @ v, linear_attention(q, k, v, feature_map=_map(name), causal=causal),
                                   rtol=1e-12, atol=1e-13)
        sums = w.sum(-1)   # 1, or 0 where every feature product vanishes (DPFP's sparse features)
        assert (np.isclose(sums, 1.0, rtol=1e-12) | (sums == 0)).all()
        assert np.isclose(sums, 1.0).mean() > 0.5
        if causal:
            assert (np.triu(w, 1) == 0).all()


def test_attention_weights_refuses_huge_n(monkeypatch):
    monkeypatch.setattr(config, "QUADRATIC_MAX_ELEMENTS", 100)
    x = np.zeros((11, 2))
    with pytest.raises(ValueError, match="QUADRATIC_MAX_ELEMENTS"):
        attention_weights(x, x, "elu")


# ---------------------------------------------------------------------------
# published claims
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_against_itself_is_zero(causal, rng):
    """Self-check of the metric definitions: softmax against itself differs by exactly 0.

    KL(p || p) = 0, TV(p, p) = 0, equal outputs and entropies, no sign failure;
    the weights are monotone in q.k, so the Spearman correlation is 1.
    """
    q, k = rng.normal(size=(2, 2, 3, 70, 8))
    v = rng.normal(size=(2, 3, 70, 5))
    r = approximation_error(q, k, v, "softmax", causal=causal)
    for f in ("output_rel_error", "kl_mean", "kl_max", "tv_mean", "tv_max", "nonpositive_normalizer_rate",
              "kl_infinite_rate", "js_mean"):
        assert getattr(r, f) == 0.0, f
    assert r.entropy_softmax == r.entropy_linear > 0
    assert r.monotonicity == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_monotonicity_is_one_where_its_weights_underflow(causal, rng):
    """Scores of magnitude ~1e3: most float64 softmax weights of a row underflow to 0.  The weights still
    order the keys as the scores do (exp is increasing), so Spearman's correlation is exactly 1, in the
    kernel and in the naive reference; ranking the underflowed zeros as ties gave 0.23."""
    q, k = 100 * rng.normal(size=(2, 64, 8))
    v = rng.normal(size=(64, 3))
    for fn in (approximation_error, approximation_error_naive):
        r = fn(q, k, v, "softmax", causal=causal)
        assert r.monotonicity == pytest.approx(1.0, abs=1e-12), fn.__name__
        assert r.kl_max == r.tv_max == 0.0


def test_trig_features_give_nonpositive_normalisers_positive_never(rng):
    """Signed trigonometric features give normalisers <= 0 at a measurable rate; positive ones never.

    Choromanski et al. (ICLR 2021) §2.3 / Fig. 1: the trigonometric estimator
    takes negative values and its normaliser can vanish, the reason for
    positive random features; Peng et al. (RFA, ICLR 2021) §2 note the same.
    """
    q, k = rng.normal(size=(2, 4, 128, 16))
    v = rng.normal(size=(4, 128, 8))
    for causal in (False, True):
        trig = approximation_error(q, k, v, fm.get("rff", num_features=16, seed=0), causal=causal)
        assert trig.nonpositive_normalizer_rate > 0.02, trig
        assert trig.kl_infinite_rate > 0
        for pos in (fm.get("favor+", num_features=16, seed=0), fm.get("favor+", num_features=4, seed=1,
                                                                      kind="hyperbolic"), "elu"):
            r = approximation_error(q, k, v, pos, causal=causal)
            assert r.nonpositive_normalizer_rate == 0.0
            assert r.kl_infinite_rate == 0.0 and math.isfinite(r.kl_max)


def test_js_is_finite_where_kl_is_not_and_defined_only_for_distributions(rng):
    """Jensen-Shannon: 0 <= JS <= ln 2 and JS <= TV's bound, finite for a positive map with zero weights
    (relu: KL infinite), NaN for a map whose weights are never a distribution (identity, signed rows).

    Lin (1991), Theorem: JS(p, w) <= ln 2 * TV(p, w) for the total variation 1/2 sum |p - w|.
    """
    q, k = rng.normal(size=(2, 3, 64, 8))
    v = rng.normal(size=(3, 64, 4))
    for causal in (False, True):
        r = approximation_error(q, k, v, "relu", causal=causal)
        assert r.kl_infinite_rate > 0 and math.isinf(r.kl_mean)
        assert 0 < r.js_mean <= math.log(2) * r.tv_mean + 1e-12
        e = approximation_error(q, k, v, "elu", causal=causal)
        assert e.kl_infinite_rate == 0 and 0 < e.js_mean <= min(e.kl_mean, math.log(2) * e.tv_mean) + 1e-12
    # disjoint supports: relu puts all the weight on key 1, softmax (to round-off) all on key 0:
    # JS is then exactly ln 2, its largest value, and KL infinite
    q = np.array([[1.0, -1.0], [1.0, -1.0]])  # two identical queries (N must match the keys')
    k = np.array([[-1000.0, -3000.0], [1.0, 1000.0]])
    assert np.array_equal(attention_weights(q, k, "relu"), [[0.0, 1.0]] * 2)
    assert np.array_equal(attention_weights(q, k, "softmax"), [[1.0, 0.0]] * 2)
    for fn in (approximation_error, approximation_error_naive):
        r = fn(q, k, np.ones((2, 1)), "relu")
        assert r.js_mean == pytest.approx(math.log(2), rel=1e-12) and math.isinf(r.kl_mean), fn
    # a map whose weights are never a distribution: JS not applicable (NaN), TV finite
    ident = approximation_error(q, np.array([[1.0, 0.5], [-2.0, 1.0]]), np.ones((2, 1)), "identity", eps=None)
    assert math.isnan(ident.js_mean) and math.isfinite(ident.tv_mean)


def test_favor_output_error_falls_like_inverse_sqrt_m(rng):
    """FAVOR+ attention error falls like 1/sqrt(m).

    Performer (Choromanski et al., ICLR 2021): the positive estimator's MSE is
    O(1/m) (Lemma 2), so the kernel's and, to first order, the attention
    output's RMS error scale like m^(-1/2) (Fig. 4: error against m).  Fit of
    log(error) against log(m) over m = 16..1024, RMS over 6 draws; inputs of
    moderate norm keep the estimator in its asymptotic regime (measured
    slope -0.47).
    """
    q, k = rng.normal(size=(2, 2, 64, 16)) * 0.3
    v = rng.normal(size=(2, 64, 8))
    ms = np.array([16, 64, 256, 1024])
    errs = []
    for m in ms:
        e = [approximation_error(q, k, v, fm.get("favor+", num_features=int(m), seed=s, orthogonal=False))
             .output_rel_error for s in range(6)]
        errs.append(np.sqrt(np.mean(np.square(e))))
    slope = np.polyfit(np.log(ms), np.log(errs), 1)[0]
    assert -0.6 < slope < -0.4, (slope, errs)


def test_elu_weights_are_flatter_than_softmax(rng):
    """Hedgehog (Zhang et al., ICLR 2024, §3.2, Fig. 2): earlier maps lack low-entropy "spiky" weights
    and monotonicity in q.k; softmax weights are spiky and monotone.
    """
    q, k = rng.normal(size=(2, 2, 96, 16)) * 2.0
    v = rng.normal(size=(2, 96, 4))
    r = approximation_error(q, k, v, "elu")
    assert r.entropy_linear > r.entropy_softmax + 0.5
    assert r.monotonicity < 0.9
    assert approximation_error(q, k, v, "softmax").monotonicity == pytest.approx(1.0)


# ---------------------------------------------------------------------------
# feature maps of the wrong shape, causal, KL round-off
# ---------------------------------------------------------------------------


class _BadDimMap(fm.FeatureMap):
    name = "bad-output-dim"

    def __init__(self, dim):
        self.dim = dim

    def output_dim(self, d):
        return self.dim

    def transform(self, x):
        return x


BAD_SHAPES = ["drop_row", "extra_row", "drop_batch", "features"]


@pytest.mark.parametrize("how", BAD_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_a_map_of_the_wrong_shape_raises_naming_it(how, causal, rng):
    """Every shape a map returns is checked; the error names the map and both shapes."""
    q, k, v = rng.normal(size=(3, 2, 6, 4))
    bad = BadShapeMap(how)
    match = rf"feature map 'bad-{how}' returned features of shape \(.*\) for [qk] of shape \(2, 6, 4\); expected \(2, 6, 4\)"
    for call in (lambda: attention_weights(q, k, bad, causal=causal),
                 lambda: approximation_error(q, k, v, bad, causal=causal),
                 lambda: approximation_error_naive(q, k, v, bad, causal=causal)):
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("dim", [0, -1, 2.5])
def test_a_map_with_a_bad_output_dim_raises_naming_it(dim, rng):
    q, k, v = rng.normal(size=(3, 5, 4))
    for call in (lambda: attention_weights(q, k, _BadDimMap(dim)),
                 lambda: approximation_error(q, k, v, _BadDimMap(dim))):
        with pytest.raises(ValueError, match=r"feature map 'bad-output-dim' has output_dim\(4\)"):
            call()


@pytest.mark.parametrize("causal", ["False", "True", 2.5, 0, 1, [1], None, np.array(True), np.array([False])])
def test_causal_must_be_a_bool(causal, rng):
    """causal="False" must not run causal attention; non-bools raise TypeError naming causal."""
    q, k, v = rng.normal(size=(3, 5, 4))
    for call in (lambda: attention_weights(q, k, "elu", causal=causal),
                 lambda: attention_weights(q, k, "softmax", causal=causal),
                 lambda: approximation_error(q, k, v, "elu", causal=causal),
                 lambda: approximation_error_naive(q, k, v, "elu", causal=causal)):
        with pytest.raises(TypeError, match="causal must be a bool"):
            call()
    # NumPy bools are bools
    np.testing.assert_array_equal(attention_weights(q, k, "elu", causal=np.bool_(True)),
                                  attention_weights(q, k, "elu", causal=True))


@pytest.mark.parametrize("n", [3, 10, 11, 33, 100])
@pytest.mark.parametrize("causal", [False, True])
def test_kl_is_never_negative(n, causal):
    """KL >= 0; linear weights equal to the softmax weights up to round-off give 0, not -4e-16.

    q = k = 1 (D = 1) with the identity map: every score is equal, so both
    weight rows are uniform, and ``log(1/L)`` against ``-log(L)`` differs in
    the last bit for some L (e.g. L = 10).
    """
    q = np.ones((2, n, 1))
    for fn in (approximation_error, approximation_error_naive):
        res = fn(q, q, q, None, causal=causal)
        assert res.kl_mean >= 0.0 and res.kl_max >= 0.0, (fn.__name__, res.kl_mean, res.kl_max)
        assert res.kl_max < 1e-14 and res.tv_max < 1e-14


# ---------------------------------------------------------------------------
# summary statistics against an independent NumPy reference
# ---------------------------------------------------------------------------
def _independent_statistics(q, k, v, phi, *, causal, eps):
    """Every field of ApproximationError from explicit weights, in NumPy only.

    Nothing of linattn_nb is used: the features are ``phi`` (written out in
    the test), the softmax weights are formed here, and each statistic is
    written out as the ApproximationError docstring defines it, so that a
    slip shared by ``approximation_error`` and ``approximation_error_naive``
    (both reduce their rows through ``_summarise``) is caught.
    """
    from scipy.stats import spearmanr

    b, n, d = q.shape
    scale = 1.0 / math.sqrt(d)
    mask = np.tril(np.ones((n, n), bool)) if causal else np.ones((n, n), bool)
    s = scale * np.einsum("bid,bjd->bij", q, k)
    e = np.where(mask, np.exp(s - np.where(mask, s, -np.inf).max(-1, keepdims=True)), 0.0)
    p = e / e.sum(-1, keepdims=True)
    a = np.where(mask, np.einsum("bif,bjf->bij", phi(q), phi(k)), 0.0)
    den = a.sum(-1)
    w = a / np.maximum(den, eps)[..., None]
    o_sm, o_lin = p @ v, w @ v
    kl, tv, hp, hw, rho, js = ([] for _ in range(6))
    for bb in range(b):
        for i in range(n):
            m = mask[i]
            pi, wi, ai, si = p[bb, i, m], w[bb, i, m], a[bb, i, m], s[bb, i, m]
            tv.append(0.5 * np.abs(pi - wi).sum())
            hp.append(-np.sum(pi * np.log(pi)))
            if den[bb, i] > 0 and np.all(ai >= 0):
                kl.append(np.inf if np.any(wi <= 0) else max(0.0, np.sum(pi * np.log(pi / wi))))
                if den[bb, i] >= eps:  # else floored: the weights sum to den / eps < 1, no distribution
                    pos = wi > 0
                    hw.append(-np.sum(wi[pos] * np.log(wi[pos])))
                    mix = 0.5 * (pi + wi)
                    js.append(0.5 * np.sum(pi * np.log(pi / mix))
                              + 0.5 * np.sum(wi[pos] * np.log(wi[pos] / mix[pos])))
            else:
                kl.append(np.inf)
            if m.sum() >= 2 and np.ptp(si) > 0 and np.ptp(wi) > 0:
                rho.append(spearmanr(si, wi)[0])
    kl = np.array(kl)

    def mean(x):
        return float(np.mean(x)) if len(x) else float("nan")

    return dict(
        output_rel_error=float(np.sqrt(np.sum((o_lin - o_sm) ** 2)) / np.sqrt(np.sum(o_sm ** 2))),
        kl_mean=float(kl.mean()), kl_max=float(kl.max()), tv_mean=mean(tv), tv_max=float(np.max(tv)),
        entropy_softmax=mean(hp), entropy_linear=mean(hw), monotonicity=mean(rho),
        nonpositive_normalizer_rate=float(np.mean(den <= 0)), kl_infinite_rate=float(np.mean(np.isinf(kl))),
        js_mean=mean(js), n_rows=b * n,
    )


def _elu1(x):
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name, phi", [("elu", _elu1), ("relu", lambda x: np.maximum(x, 0.0)),
                                       ("identity", lambda x: x)])
def test_summary_statistics_against_an_independent_numpy_reference(name, phi, causal, rng):
    """Each summary statistic recomputed from explicit weights in the test.

    ELU+1 (a distribution on every row: every statistic finite), ReLU (zero
    weights: some KL infinite, entropy and JS over the rows that are
    distributions) and the identity map (signed: normalisers <= 0, few rows
    distributions).  The weights are those the module
    docstring defines; ``phi`` is checked to be the package's map first.
    float64 throughout; 1e-12 relative (the kernel sums in another order,
    the Spearman ranks come from another sort).
    """
    q, k = rng.normal(size=(2, 3, 9, 4))
    v = rng.normal(size=(3, 9, 2))
    np.testing.assert_array_equal(fm.get(name)(q), phi(q))
    want = _independent_statistics(q, k, v, phi, causal=causal, eps=config.DEFAULT_EPS)
    if name == "elu":  # the reference exercises the fields it claims to
        assert want["kl_infinite_rate"] == 0 and want["tv_max"] > 1.5 * want["tv_mean"] > 0
    elif name == "relu":  # zero weights where softmax has mass: some KL infinite, entropy and JS still defined
        assert 0 < want["kl_infinite_rate"] < 1 and not math.isnan(want["js_mean"])
    else:  # signed weights: (nearly) no row is a distribution
        assert 0 < want["nonpositive_normalizer_rate"] < 1 and want["kl_infinite_rate"] > 0.9
    for got in (approximation_error(q, k, v, name, causal=causal, block=4),
                approximation_error_naive(q, k, v, name, causal=causal)):
        assert got.n_rows == want["n_rows"]
        for f in FIELDS:
            a, b = getattr(got, f), want[f]
            if math.isinf(b) or math.isnan(b):
                assert a == b or (math.isnan(a) and math.isnan(b)), (f, a, b)
            else:
                assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15), (f, a, b)


@pytest.mark.parametrize("case", [
    dict(k_cols=2),                           # q and k of other feature dimensions
    dict(decay=np.full((2, 5, 7), 0.9)),      # a per-feature gate of the wrong width
    dict(log_decay=np.array([0.5, -1.0])),    # a log-factor > 0
    dict(beta=3.0),                           # a write strength out of range
    dict(decay=0.9, beta=np.full((2, 5), np.nan)),
])
def test_the_analyses_refuse_a_request_with_linear_attentions_own_messages(case, rng):
    """The analyses prepare their request as linear_attention does (the front end's host_call): the same
    argument raises the same error, word for word."""
    case = dict(case)
    q = rng.normal(size=(2, 5, 3))
    k = q[..., : case.pop("k_cols", 3)]
    with pytest.raises(ValueError) as want:
        linear_attention(q, k, q, causal=True, **case)
    for call in (lambda: attention_weights(q, k, "elu", causal=True, **case),
                 lambda: approximation_error(q, k, q, "elu", causal=True, **case)):
        with pytest.raises(ValueError) as got:
            call()
        assert str(got.value) == str(want.value)


def test_softmax_scores_that_overflow_are_refused_by_name():
    """scale * q . k beyond float64 made the softmax weights NaN (inf - inf): attention_weights gave NaN rows,
    approximation_error a KL of 0 and NaN totals, the rank functions LAPACK's "SVD did not converge".  A score
    no row reads (causal, a later key) is not refused, and the kernel still agrees with the reference."""
    from linattn_nb.analysis import attention_rank, semiseparable_rank

    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 12, 4)) * 10
    calls = [lambda: attention_weights(q, k, "softmax", scale=1e308),
             lambda: approximation_error(q, k, v, "softmax", scale=1e308),
             lambda: approximation_error(q, k, v, "elu", scale=1e308, causal=True),
             lambda: approximation_error_naive(q, k, v, "elu", scale=1e308),
             lambda: attention_rank(q, k, "softmax", scale=1e308),
             lambda: semiseparable_rank(q, k, "softmax", scale=1e308)]
    for call in calls:
        with pytest.raises(ValueError, match=r"softmax scores scale \* q \. k overflow float64 \(query \d+, key \d+"):
            call()
    with pytest.raises(ValueError, match=r"query 2, key 2 of batch entry 1\)"):
        big = np.ones((2, 3, 1))
        big[1, 2] = 1e300
        approximation_error(big, big, big, "elu", scale=1.0)
    q2 = np.array([[[1.0], [1.0], [0.0]]])
    k2 = np.array([[[1.0], [1.0], [1e300]]])
    a = approximation_error(q2, k2, np.ones((1, 3, 1)), "elu", scale=1e10, causal=True)
    b = approximation_error_naive(q2, k2, np.ones((1, 3, 1)), "elu", scale=1e10, causal=True)
    assert np.isfinite(a.kl_mean) and np.isclose(a.kl_mean, b.kl_mean) and np.isclose(a.tv_mean, b.tv_mean)


def test_a_missing_array_is_named():
    """None for q, k or v failed inside the code (IndexError, AttributeError, "'NoneType' object is not
    subscriptable")."""
    from linattn_nb.analysis import attention_rank, semiseparable_rank, state_rank_profile

    x = np.ones((4, 2))
    calls = {"q": [lambda: approximation_error(None, x, x, "elu"), lambda: attention_weights(None, x, "elu"),
                   lambda: attention_rank(None, x), lambda: semiseparable_rank(None, x)],
             "k": [lambda: attention_rank(x, None), lambda: approximation_error_naive(x, None, x, "elu"),
                   lambda: state_rank_profile(None, x)],
             "v": [lambda: approximation_error(x, x, None, "elu"), lambda: approximation_error_naive(x, x, None, "elu"),
                   lambda: state_rank_profile(x, None)]}
    for name, group in calls.items():
        for call in group:
            with pytest.raises(TypeError, match=rf"^{name} must be an array of shape \(\.\.\., N, [DM]\), got None"):
                call()
