"""Rank of attention weights (factor-based vs explicit), semiseparable rank, state rank."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import linattn_nb.config as cfg
from linattn_nb import feature_maps, linear_attention
from linattn_nb.analysis import attention_rank, semiseparable_rank, state_rank_profile
from linattn_nb.analysis import rank as rank_mod
from _bad_maps import BadShapeMap

KERNEL_MAPS = ["elu", "relu", "squared_relu", "identity", "dpfp"]


# ---------------------------------------------------------------------------
# Independent references (built here from the feature maps, not from rank.py)
# ---------------------------------------------------------------------------
def _weights(q, k, fmap, causal, eps=1e-8, scale=None):
    """Explicit N x N attention weights, float64."""
    if fmap == "softmax":
        s = (1 / np.sqrt(q.shape[-1]) if scale is None else scale) * q @ k.T
        if causal:
            s = np.where(np.tril(np.ones(s.shape, dtype=bool)), s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        return w / w.sum(-1, keepdims=True)
    phi = feature_maps.resolve(fmap)
    a = phi(q) @ phi(k).T
    if causal:
        a = np.tril(a)
    return a / np.maximum(a.sum(-1), eps)[:, None]


def _semisep_reference(w):
    """max over every split i of matrix_rank(w[i:, :i]) (no pruning), and the first split reaching it."""
    n = w.shape[0]
    ranks = [np.linalg.matrix_rank(w[i:, :i]) for i in range(1, n)]
    if not ranks:
        return 0, 0
    best = max(ranks)
    return best, 1 + ranks.index(best)


def _structured(rng, n, d):
    """Rows drawn segment-wise from random subspaces of random dimension (0..d), sometimes rescaled."""
    x = np.zeros((n, d))
    cuts = np.sort(rng.integers(0, n + 1, size=int(rng.integers(0, 3))))
    for seg in np.split(np.arange(n), cuts):
        r = int(rng.integers(0, d + 1))
        if r and len(seg):
            x[seg] = rng.normal(size=(len(seg), r)) @ rng.normal(size=(r, d))
    if rng.random() < 0.3:
        x *= 10.0 ** rng.integers(-2, 3, size=(n, 1))
    return x


# ---------------------------------------------------------------------------
# Streamed Householder QR
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n,f", [(0, 3), (1, 1), (1, 5), (4, 9), (127, 6), (128, 6), (129, 6), (700, 12),
                                 (2 * 2048 + 3, 7)])  # the last: three LAPACK blocks, the third partial
def test_r_factor_reproduces_gram(rng, n, f):
    x = rng.normal(size=(n, f))
    if n > 3:
        x[:, 0] = x[:, 1] - x[:, 2]  # exact rank deficiency
    r_par = rank_mod._r_factor(x)
    r_ser = np.zeros((f, f))
    for s0 in range(0, n, 37):  # uneven segments, like the semiseparable sweeps
        rank_mod._append_rows(r_ser, x[s0:s0 + 37])
    for r in (r_par, r_ser):
        assert r.shape == (f, f)
        np.testing.assert_array_equal(np.tril(r, -1), 0.0)
        np.testing.assert_allclose(r.T @ r, x.T @ x, atol=1e-10 * max(1.0, np.abs(x.T @ x).max()))
        if n:
            np.testing.assert_allclose(
                np.linalg.svd(r, compute_uv=False)[: min(n, f)], np.linalg.svd(x, compute_uv=False), atol=1e-10
            )


def test_r_factor_extreme_scales(rng):
    """Reflectors are computed on scaled values: no overflow or underflow to 0/inf/NaN."""
    for scale in (1e-200, 1e200):
        x = scale * rng.normal(size=(50, 4))
        r = rank_mod._r_factor(x)
        assert np.isfinite(r).all()
        np.testing.assert_allclose(np.linalg.svd(r / scale, compute_uv=False), np.linalg.svd(x / scale, compute_uv=False))
    # one row into an empty factor: the rest of R stays exactly zero
    r = np.zeros((4, 4))
    rank_mod._append_rows(r, rng.normal(size=(1, 4)))
    np.testing.assert_array_equal(r[1:], 0.0)


# ---------------------------------------------------------------------------
# attention_rank
# ---------------------------------------------------------------------------
@settings(max_examples=40)
@given(nq=st.integers(1, 40), nk=st.integers(1, 40), d=st.integers(1, 6),
       fmap=st.sampled_from(KERNEL_MAPS), seed=st.integers(0, 2**31))
def test_attention_rank_factor_equals_explicit(nq, nk, d, fmap, seed):
    """The rank from the R factors equals matrix_rank of the explicit weights (generic and degenerate inputs)."""
    rng = np.random.default_rng(seed)
    q, k = _structured(rng, nq, d), _structured(rng, nk, d)
    r, s = attention_rank(q, k, fmap, return_spectrum=True)
    w = _weights(q, k, fmap, causal=False)
    assert r == np.linalg.matrix_rank(w)
    sw = np.linalg.svd(w, compute_uv=False)
    np.testing.assert_allclose(s, sw[: s.size], rtol=1e-12, atol=1e-12 * max(sw.max(), 1e-300))
    assert r == attention_rank(q, k, fmap, method="explicit")


@pytest.mark.parametrize("fmap", sorted(feature_maps.available()))
def test_linear_attention_rank_at_most_d_phi(rng, fmap):
    """Linear attention weights D^-1 phi(Q) phi(K)^T have rank <= D_phi at N >> D_phi, for every
    registered map, while sharp softmax weights on the same q, k exceed D_phi
    (Katharopoulos et al. 2020, "Transformers are RNNs", Eq. 7 factorisation)."""
    d = 4
    f = feature_maps.get(fmap).output_dim(d)
    n = max(16 * f, 256)
    q, k = rng.normal(size=(2, n, d))
    r = attention_rank(q, k, fmap)
    assert 1 <= r <= f < n
    if f < 256:
        assert attention_rank(q[:256], k[:256], "softmax", scale=2.0) > f


def test_attention_rank_generic_equals_d_phi_and_softmax_sharpness(rng):
    q, k = rng.normal(size=(2, 256, 8))
    assert attention_rank(q, k, "elu") == 8
    assert attention_rank(q, k, "dpfp") == 16
    # softmax: scale 0 gives uniform weights (rank 1); a small scale s leaves, above the tolerance
    # N eps, the Taylor terms exp(s q.k) ~ 1 + s q.k + (s q.k)^2 / 2 of rank 1, D, D(D+1)/2
    # (the Taylor feature map of Based, Arora et al. 2024, Eq. 4); sharp weights are full rank
    ranks = [attention_rank(q, k, "softmax", scale=s) for s in (0.0, 1e-9, 1e-6, 3.0)]
    assert ranks[:3] == [1, 1 + 8, 1 + 8 + 36] and ranks[3] > 200
    w = _weights(q, k, "softmax", causal=False, scale=3.0)
    assert ranks[3] == np.linalg.matrix_rank(w)


def test_attention_rank_causal_is_explicit_and_full_rank(rng):
    """tril of a rank-D_phi matrix is itself (usually) full rank: causal ELU+1 weights have a positive
    diagonal, so rank N; semiseparable_rank is the structured measure."""
    q, k = rng.normal(size=(2, 60, 3))
    r = attention_rank(q, k, "elu", causal=True)
    assert r == 60 == np.linalg.matrix_rank(_weights(q, k, "elu", causal=True))
    assert attention_rank(q, k, "softmax", causal=True) == np.linalg.matrix_rank(_weights(q, k, "softmax", True))
    with pytest.raises(ValueError, match="causal weights are not low rank"):
        attention_rank(q, k, "elu", causal=True, method="factor")
    with pytest.raises(ValueError, match="softmax weights have no low-rank factors"):
        attention_rank(q, k, "softmax", method="factor")


def test_attention_rank_batch_dtypes_and_edges(rng):
    q = rng.normal(size=(2, 3, 50, 4)).astype(np.float32)
    k = rng.normal(size=(2, 3, 30, 4))
    r, s = attention_rank(q, k, "elu", return_spectrum=True)
    assert r.shape == (2, 3) and r.dtype == np.int64 and s.shape == (2, 3, 4)
    for i in range(2):
        for j in range(3):
            w = _weights(q[i, j].astype(np.float64), k[i, j], "elu", causal=False)
            assert r[i, j] == np.linalg.matrix_rank(w)
    # explicit spectrum has min(Nq, Nk) values
    _, se = attention_rank(q, k, "elu", method="explicit", return_spectrum=True)
    assert se.shape == (2, 3, 30)
    np.testing.assert_allclose(se[..., :4], s, rtol=1e-12, atol=1e-12)
    # empty and one-token sequences
    assert attention_rank(np.zeros((0, 3)), np.zeros((0, 3)), "elu") == 0
    assert attention_rank(rng.normal(size=(1, 3)), rng.normal(size=(5, 3)), "elu") == 1
    # rtol per batch entry; float16 input
    q2, k2 = rng.normal(size=(2, 2, 40, 3))
    np.testing.assert_array_equal(attention_rank(q2, k2, "elu", rtol=[0.0, 0.9]), [3, 1])
    assert attention_rank(q2[0].astype(np.float16), k2[0].astype(np.float16), "elu") == 3
    # a FeatureMap instance, None (q, k already features)
    assert attention_rank(q2[0], k2[0], feature_maps.DpfpFeatureMap(2)) == np.linalg.matrix_rank(
        _weights(q2[0], k2[0], feature_maps.DpfpFeatureMap(2), causal=False))
    qp, kp = np.abs(q2[0]), np.abs(k2[0])
    assert attention_rank(qp, kp, None) == 3


def test_attention_rank_errors(rng, monkeypatch):
    q, k = rng.normal(size=(2, 10, 3))
    with pytest.raises(ValueError, match="same feature dimension"):
        attention_rank(q, k[:, :2])
    with pytest.raises(ValueError, match="same sequence length"):
        attention_rank(q, k[:5], causal=True)
    with pytest.raises(ValueError, match="batch dimensions"):
        attention_rank(q[None], k)
    with pytest.raises(TypeError, match="q must have dtype"):
        attention_rank(q.astype(int), k)
    with pytest.raises(ValueError, match="non-finite"):
        attention_rank(np.full((3, 3), np.nan), np.ones((3, 3)))
    with pytest.raises(ValueError, match="feature_map"):
        attention_rank(q, k, "no-such-map")
    with pytest.raises(ValueError, match="method"):
        attention_rank(q, k, method="svd")
    # a zero normaliser with eps=None is refused, not turned into inf
    z = np.zeros((4, 3))
    with pytest.raises(ValueError, match="normaliser"):
        attention_rank(z, z, "relu", eps=None)
    assert attention_rank(z, z, "relu") == 0  # eps floor: all-zero weights
    monkeypatch.setattr(cfg, "ANALYSIS_EXPLICIT_MAX_N", 8)
    with pytest.raises(ValueError, match="ANALYSIS_EXPLICIT_MAX_N"):
        attention_rank(q, k, "softmax")
    assert attention_rank(q, k, "elu") == 3  # the factor path has no such limit


# ---------------------------------------------------------------------------
# semiseparable_rank
# ---------------------------------------------------------------------------
@settings(max_examples=40)
@given(n=st.integers(0, 30), d=st.integers(1, 5), fmap=st.sampled_from(KERNEL_MAPS), seed=st.integers(0, 2**31))
def test_semiseparable_factor_equals_explicit(n, d, fmap, seed):
    """The factor-based semiseparable rank (candidate splits only) equals the explicit maximum of
    matrix_rank(A[i:, :i]) over every split, and so does the first split reaching it."""
    rng = np.random.default_rng(seed)
    q, k = _structured(rng, n, d), _structured(rng, n, d)
    got = semiseparable_rank(q, k, fmap, return_split=True)
    ref = _semisep_reference(_weights(q, k, fmap, causal=True))
    assert got == ref
    assert semiseparable_rank(q, k, fmap, method="explicit", return_split=True) == ref


def test_semiseparable_memory_groups(rng, monkeypatch):
    """A tiny memory budget (one candidate per group, one pair of sweeps each) gives the same answer."""
    for seed in range(6):
        r = np.random.default_rng(seed)
        q, k = _structured(r, 40, 4), _structured(r, 40, 4)
        want = semiseparable_rank(q, k, "elu", return_split=True)
        monkeypatch.setattr(cfg, "ANALYSIS_MEMORY_BUDGET", 1)
        assert semiseparable_rank(q, k, "elu", return_split=True) == want
        monkeypatch.undo()


def test_semiseparable_rank_bounded_by_d_phi(rng):
    """Causal linear attention is semiseparable: every strictly-lower block has rank <= D_phi, at any N
    (Dao & Gu 2024, "Transformers are SSMs", §3), although the whole matrix is full rank."""
    q, k = rng.normal(size=(2, 3000, 4))
    for fmap, f in (("elu", 4), ("dpfp", 8), ("relu", 4)):
        r, split = semiseparable_rank(q, k, fmap, return_split=True)
        assert r == f  # generic inputs reach the bound
        assert 1 <= split < 3000
    qs, ks = q[:48], k[:48]
    assert semiseparable_rank(qs, ks, "elu") == _semisep_reference(_weights(qs, ks, "elu", True))[0] == 4
    assert attention_rank(qs, ks, "elu", causal=True) == 48


def test_semiseparable_softmax_grows_with_n(rng):
    """Causal softmax weights have no semiseparable bound: the rank grows with N and passes D_phi."""
    q, k = rng.normal(size=(2, 64, 4))
    ranks = [semiseparable_rank(q[:n], k[:n], "softmax", scale=2.0) for n in (8, 16, 32, 64)]
    assert all(a < b for a, b in zip(ranks, ranks[1:]))
    assert ranks[-1] > semiseparable_rank(q, k, "elu") == 4
    assert ranks[1] == _semisep_reference(_weights(q[:16], k[:16], "softmax", True, scale=2.0))[0]


def test_semiseparable_batch_edges_errors(rng, monkeypatch):
    q, k = rng.normal(size=(2, 2, 3, 20, 3))
    r, s = semiseparable_rank(q, k, "elu", return_split=True)
    assert r.shape == s.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            assert (r[i, j], s[i, j]) == _semisep_reference(_weights(q[i, j], k[i, j], "elu", True))
    assert semiseparable_rank(q[0, 0, :1], k[0, 0, :1]) == 0
    assert semiseparable_rank(q[0, 0, :0], k[0, 0, :0], return_split=True) == (0, 0)
    # rtol applies to every block
    assert semiseparable_rank(q[0, 0], k[0, 0], "elu", rtol=0.99) == 1
    with pytest.raises(ValueError, match="same sequence length"):
        semiseparable_rank(q[0, 0], k[0, 0, :5])
    with pytest.raises(ValueError, match="softmax"):
        semiseparable_rank(q, k, "softmax", method="factor")
    with pytest.raises(ValueError, match="scalar"):
        semiseparable_rank(q, k, rtol=[0.1, 0.2])
    monkeypatch.setattr(cfg, "ANALYSIS_SEMISEPARABLE_EXPLICIT_MAX_N", 10)
    with pytest.raises(ValueError, match="ANALYSIS_SEMISEPARABLE_EXPLICIT_MAX_N"):
        semiseparable_rank(q, k, "elu", method="explicit")


# ---------------------------------------------------------------------------
# state_rank_profile
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmap,d,m", [("elu", 6, 10), ("elu", 10, 6), ("dpfp", 3, 9), ("relu", 5, 5)])
def test_state_rank_saturates(rng, fmap, d, m):
    """rank(S_t) grows by at most one per token and saturates at min(D_phi, M): the fixed-size state
    (Katharopoulos et al. 2020, Eqs. 10-12; Schlag et al. 2021, §4.1)."""
    n = 40
    k, v = rng.normal(size=(n, d)), rng.normal(size=(n, m))
    f = feature_maps.get(fmap).output_dim(d)
    prof = state_rank_profile(k, v, fmap)
    assert prof.max_rank == min(f, m)
    np.testing.assert_array_equal(prof.positions, np.arange(1, n + 1))
    assert np.all(np.diff(prof.rank) >= 0) and np.all(np.diff(prof.rank) <= 1)
    assert prof.rank[-1] == min(f, m)
    if fmap == "elu":  # dense positive features: every token adds a direction until saturation
        np.testing.assert_array_equal(prof.rank, np.minimum(np.arange(1, n + 1), min(f, m)))
    # the final state is the one linear_attention returns
    _, state = linear_attention(k, k, v, feature_map=fmap, causal=True, return_state=True)
    assert prof.rank[-1] == np.linalg.matrix_rank(state.S)


def test_state_rank_profile_positions_batch_errors(rng):
    k, v = rng.normal(size=(2, 3, 30, 4)), rng.normal(size=(2, 3, 30, 2))
    prof = state_rank_profile(k, v, "elu", positions=[30, 0, 1, 1, 2])
    np.testing.assert_array_equal(prof.positions, [0, 1, 2, 30])
    assert prof.rank.shape == (2, 3, 4)
    np.testing.assert_array_equal(prof.rank, np.broadcast_to([0, 1, 2, 2], (2, 3, 4)))
    # low-rank values cap the state rank below min(D_phi, M)
    v1 = np.outer(rng.normal(size=30), rng.normal(size=5))
    assert state_rank_profile(k[0, 0], v1, "elu").rank.max() == 1
    with pytest.raises(ValueError, match="softmax"):
        state_rank_profile(k, v, "softmax")
    with pytest.raises(ValueError, match=r"\[0, N\]"):
        state_rank_profile(k, v, positions=[31])
    with pytest.raises(TypeError, match="integers"):
        state_rank_profile(k, v, positions=[1.5])
    with pytest.raises(ValueError, match="same sequence length"):
        state_rank_profile(k, v[..., :5, :])


# ---------------------------------------------------------------------------
# Feature maps of the wrong shape, causal
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["drop_row", "extra_row", "drop_batch", "features"])
def test_a_map_of_the_wrong_shape_raises_naming_it(how, rng):
    """Every shape a map returns is checked; the error names the map and both shapes."""
    q, k = rng.normal(size=(2, 2, 12, 4))
    v = rng.normal(size=(2, 12, 3))
    bad = BadShapeMap(how)
    match = rf"feature map 'bad-{how}' returned features of shape \(.*\) for [qk] of shape \(2, 12, 4\); expected \(2, 12, 4\)"
    for call in (lambda: attention_rank(q, k, bad),
                 lambda: attention_rank(q, k, bad, method="explicit"),
                 lambda: attention_rank(q, k, bad, causal=True),
                 lambda: semiseparable_rank(q, k, bad),
                 lambda: semiseparable_rank(q, k, bad, method="explicit"),
                 lambda: state_rank_profile(k, v, bad)):
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("dim", [0, -3])
def test_a_map_with_a_bad_output_dim_raises_naming_it(dim, rng):
    class BadDim(feature_maps.FeatureMap):
        name = "bad-output-dim"

        def output_dim(self, d):
            return dim

        def transform(self, x):
            return x

    q, k = rng.normal(size=(2, 10, 4))
    for call in (lambda: attention_rank(q, k, BadDim()), lambda: semiseparable_rank(q, k, BadDim()),
                 lambda: state_rank_profile(k, q, BadDim())):
        with pytest.raises(ValueError, match=r"feature map 'bad-output-dim' has output_dim\(4\)"):
            call()


@pytest.mark.parametrize("causal", ["False", "True", 2.5, 1, [1], None, np.array(True)])
def test_causal_must_be_a_bool(causal, rng):
    """attention_rank(causal="False") must not rank causal weights."""
    q, k = rng.normal(size=(2, 10, 4))
    for fmap in ("elu", "softmax"):
        with pytest.raises(TypeError, match="causal must be a bool"):
            attention_rank(q, k, fmap, causal=causal)
    assert attention_rank(q, k, "elu", causal=np.bool_(True)) == attention_rank(q, k, "elu", causal=True)


def test_state_rank_profile_of_dplr_rules():
    """A named DPLR rule's profile: the ranks of the states dplr_attention returns at each position;
    DeltaProduct writes n_h directions a token; a KDA reset wipes the state."""
    import linattn_nb as la
    from linattn_nb.analysis import state_rank_profile

    rng = np.random.default_rng(3)
    k, v = rng.normal(size=(2, 2, 30, 6))
    decay = rng.uniform(0.5, 1.0, size=(2, 30, 6))
    decay[:, 12] = 0.0
    args = {"decay": decay, "beta": rng.uniform(0.2, 1.0, size=(2, 30))}
    pos = [0, 1, 3, 6, 12, 13, 15, 30]
    prof = state_rank_profile(k, v, "l2", positions=pos, rule="kda", rule_arguments=args)
    want = []
    for t in pos:
        _, st = la.dplr_attention(k[:, :t], k[:, :t], v[:, :t], rule="kda", feature_map="l2", return_state=True,
                                  **{n: x[:, :t] for n, x in args.items()})
        want.append([np.linalg.matrix_rank(s) for s in st.S])
    assert prof.rank.tolist() == np.array(want).T.tolist()
    assert prof.rank[:, pos.index(13)].tolist() == [1, 1]  # the reset at token 12
    kk, vv = rng.normal(size=(2, 10, 3, 8))
    dp = state_rank_profile(kk, vv, "l2", positions=[1, 2], rule="delta_product",
                            rule_arguments={"beta": np.ones((10, 3))})
    assert dp.rank.tolist() == [3, 6]
    with pytest.raises(TypeError, match="rule_arguments"):
        state_rank_profile(k, v, "l2", rule="kda", beta=1.0)
    with pytest.raises(TypeError, match="needs rule="):
        state_rank_profile(k, v, "l2", rule_arguments={})
    with pytest.raises(ValueError, match="unknown DPLR rule"):
        state_rank_profile(k, v, "l2", rule="nope")


def test_state_rank_profile_of_a_dplr_rule_takes_a_tuple_initial_state():
    """The documented tuple (S, z[, position]) form of initial_state with rule=: as the LinearState that
    dplr_attention returns (it raised AttributeError at t = 0, TypeError past it); checked up front."""
    import linattn_nb as la

    rng = np.random.default_rng(5)
    k, v = rng.normal(size=(10, 4)), rng.normal(size=(10, 3))
    args = {"decay": rng.uniform(0.5, 1.0, size=(10, 4)), "beta": rng.uniform(0.2, 1.0, size=10)}
    _, st4 = la.dplr_attention(k[:4], k[:4], v[:4], rule="kda", feature_map="l2", return_state=True,
                               **{n: x[:4] for n, x in args.items()})
    rest = {n: x[4:] for n, x in args.items()}
    pos = [0, 1, 3, 6]
    want = state_rank_profile(k[4:], v[4:], "l2", positions=pos, rule="kda", rule_arguments=rest,
                              initial_state=st4).rank.tolist()
    assert want[0] == np.linalg.matrix_rank(st4.S)
    for init in ((st4.S, st4.z, st4.position), (st4.S, st4.z)):
        got = state_rank_profile(k[4:], v[4:], "l2", positions=pos, rule="kda", rule_arguments=rest,
                                 initial_state=init)
        assert got.rank.tolist() == want
    s0 = rng.normal(size=(4, 3))
    assert state_rank_profile(k, v, "l2", positions=[0], rule="kda", rule_arguments=args,
                              initial_state=(s0, np.zeros(4))).rank.tolist() == [3]
    with pytest.raises(ValueError, match=r"initial_state must have S of shape \(4, 3\)"):
        state_rank_profile(k, v, "l2", positions=[0], rule="kda", rule_arguments=args,
                           initial_state=(s0[:2], np.zeros(4)))
    _, other = linear_attention(k, k, v, feature_map="l2", causal=True, return_state=True)
    with pytest.raises(ValueError, match="initial_state is a state of the 'additive' update rule"):
        state_rank_profile(k, v, "l2", positions=[0], rule="kda", rule_arguments=args, initial_state=other)


def test_state_rank_profile_of_a_dplr_rule_names_k_and_v_up_front():
    """With rule=, NaN keys were reported as "q contains ..." and k shorter than v as a v shape error after the
    first tokens were written: both are checked before any token and named as on the additive path."""
    rng = np.random.default_rng(6)
    k, v = rng.normal(size=(6, 3)), rng.normal(size=(6, 2))
    vbad = v.copy()
    vbad[0, 0] = np.inf
    args = {"beta": np.full(6, 0.5), "decay": np.full((6, 3), 0.9)}
    for rule, kw in ((None, {}), ("kda", {"rule_arguments": args})):
        with pytest.raises(ValueError, match=r"^k contains 18 non-finite"):
            state_rank_profile(np.full_like(k, np.nan), v, "l2", rule=rule, **kw)
        with pytest.raises(ValueError, match=r"^v contains 1 non-finite"):
            state_rank_profile(k, vbad, "l2", rule=rule, **kw)
        with pytest.raises(ValueError, match=r"k and v must have the same sequence length N .* \(3, 3\), \(6, 2\)"):
            state_rank_profile(k[:3], v, "l2", rule=rule, positions=[2, 3], **kw)
        with pytest.raises(TypeError, match="k must have dtype float16, float32 or float64"):
            state_rank_profile(k.astype(np.int64), v, "l2", rule=rule, **kw)
    kk, vv = rng.normal(size=(2, 5, 2, 3))
    kbad = kk.copy()
    kbad[1, 0, 2] = np.nan
    with pytest.raises(ValueError, match=r"same \(\.\.\., N, r\) for rule 'delta_product'"):
        state_rank_profile(kk, vv[:3], "l2", rule="delta_product", rule_arguments={"beta": np.ones((5, 2))})
    with pytest.raises(ValueError, match=r"^k contains 1 non-finite"):
        state_rank_profile(kbad, vv, "l2", rule="delta_product", rule_arguments={"beta": np.ones((5, 2))})


def test_attention_rank_refuses_an_rtol_that_does_not_broadcast_to_the_batch_shape():
    """rtol=[1e-12] for unbatched q, k passed the check, then np.broadcast_to failed with NumPy's message;
    an rtol must broadcast to the batch shape (one per entry), else ValueError naming rtol."""
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 6, 3))
    with pytest.raises(ValueError, match=r"rtol of shape \(1,\) does not broadcast to the batch shape \(\)"):
        attention_rank(q, k, "elu", rtol=[1e-12])
    qb, kb = rng.normal(size=(2, 3, 6, 3))
    with pytest.raises(ValueError, match=r"rtol of shape \(2, 3\) does not broadcast to the batch shape \(3,\)"):
        attention_rank(qb, kb, "elu", rtol=np.full((2, 3), 1e-12))
    assert attention_rank(q, k, "elu", rtol=np.array(1e-12)) == attention_rank(q, k, "elu", rtol=1e-12) == 3
    np.testing.assert_array_equal(attention_rank(qb, kb, "elu", rtol=[1e-12]), [3, 3, 3])


def test_rank_flags_take_bools_and_an_empty_profile_is_empty():
    k = np.random.default_rng(0).normal(size=(8, 4))
    with pytest.raises(TypeError, match="check_finite must be True or False"):
        attention_rank(k, k, check_finite="no")
    with pytest.raises(TypeError, match="return_spectrum must be True or False"):
        attention_rank(k, k, return_spectrum="no")
    prof = state_rank_profile(k, k, positions=[])
    assert prof.positions.shape == (0,) and prof.rank.shape == (0,)
