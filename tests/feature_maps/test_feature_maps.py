"""Feature maps: registry, formulas against their sources, stabilisation, positions, randomness."""
from __future__ import annotations

import math

import numpy as np
import pytest

from linattn_nb import feature_maps as fm
from linattn_nb import linear_attention, softmax_attention
from linattn_nb.analysis import attention_weights

NEW_MAPS = ("favor+", "rff", "taylor2", "cosformer", "hedgehog", "t2r")
ALL_MAPS = ("elu", "relu", "squared_relu", "identity", "dpfp") + NEW_MAPS


def _build(name, d=None, **kw):
    if name in ("favor+", "rff"):
        kw.setdefault("seed", 0)
        kw.setdefault("num_features", 12)
    if name == "t2r" and d is not None:  # a non-square W (d_out = d + 2) and a bias, mostly positive projections
        r = np.random.default_rng(7)
        kw.setdefault("W", 0.5 * r.standard_normal((d + 2, d)))
        kw.setdefault("b", 0.5 + 0.3 * r.standard_normal(d + 2))
    return fm.get(name, **kw)


def _normalised(a, causal, eps=None):
    if causal:
        a = np.tril(a)
    den = a.sum(axis=-1, keepdims=True)
    return a / (den if eps is None else np.maximum(den, eps))


# ---------------------------------------------------------------------------
# registry and shapes
# ---------------------------------------------------------------------------
def test_registry_lists_every_map():
    assert set(ALL_MAPS) <= set(fm.available())
    for name in ALL_MAPS:
        assert fm.get(name).name == name


@pytest.mark.parametrize("name", ALL_MAPS)
@pytest.mark.parametrize("d", [1, 3, 8])
def test_output_dim_matches_features(name, d, rng):
    phi = _build(name)
    x = rng.normal(size=(2, 5, d)).astype(np.float32)
    if name == "dpfp" and d == 1:
        phi = fm.get("dpfp", nu=1)
    f = phi(x)
    assert f.shape == (2, 5, phi.output_dim(d))
    assert f.dtype == np.float32
    for role in ("query", "key"):
        g = phi.apply(x, role=role, causal=True, offset=0, total_length=5)
        assert g.shape == f.shape and g.dtype == np.float32
    if phi.is_positive:
        assert (f >= 0).all()


def test_documented_output_dims():
    """Output dimensions as the sources state them."""
    assert fm.get("taylor2").output_dim(16) == 153          # Based: 1 + d + d(d+1)/2
    assert fm.get("dpfp", nu=3).output_dim(64) == 384        # DPFP: 2 d nu
    assert fm.get("favor+", num_features=256).output_dim(64) == 256
    assert fm.get("favor+", num_features=256, kind="hyperbolic").output_dim(64) == 512
    assert fm.get("rff", num_features=100).output_dim(64) == 200
    assert fm.get("cosformer").output_dim(64) == 128
    assert fm.get("hedgehog").output_dim(64) == 128
    assert fm.get("hedgehog", W=np.ones((5, 3))).output_dim(3) == 10
    assert fm.get("t2r").output_dim(64) == 64
    assert fm.get("t2r", W=np.ones((5, 3))).output_dim(3) == 5
    assert fm.get("favor+").output_dim(64) == int(64 * math.log(64))  # Performer's default m


def test_bad_role_raises(rng):
    x = rng.normal(size=(3, 4))
    for m in NEW_MAPS:
        with pytest.raises(ValueError, match="role"):
            _build(m).apply(x, role="value", causal=False)


def test_input_checks():
    with pytest.raises(TypeError, match="floating"):
        fm.get("taylor2")(np.ones((2, 3), dtype=np.int64))
    with pytest.raises(TypeError, match="floating"):
        _build("favor+").apply(np.ones((2, 3), dtype=np.int64), role="key", causal=False)
    # long double (float128 features came back) and masked inputs (the mask was dropped), as linear_attention
    # refuses them; rff's key vjp read a list's dtype (AttributeError)
    x = np.ones((2, 3))
    for name in fm.available():
        m = _build(name)
        with pytest.raises(TypeError, match=r"floating point \(float16, float32 or float64\), got dtype float128"):
            m.apply(x.astype(np.longdouble), role="key", causal=False)
        with pytest.raises(TypeError, match="masked array"):
            m.apply(np.ma.masked_array(x), role="query", causal=False)
        with pytest.raises(TypeError, match="masked array"):
            m.vjp(np.ma.masked_array(x), np.ones_like(m.apply(x, role="key")), role="key")
    rff = _build("rff")
    np.testing.assert_array_equal(rff.vjp(x.tolist(), np.ones_like(rff.apply(x, role="key")), role="key")[0],
                                  rff.vjp(x, np.ones_like(rff.apply(x, role="key")), role="key")[0])
    for bad in (dict(num_features=0), dict(num_features=2.5), dict(dim=0), dict(scale=-1.0),
                dict(scale=float("inf")), dict(row_norm="unit"), dict(kind="relu")):
        with pytest.raises((ValueError, TypeError)):
            fm.get("favor+", **bad)
    with pytest.raises(ValueError, match="target"):
        fm.get("rff", target="laplace")
    with pytest.raises(TypeError, match="orthogonal"):
        fm.get("rff", orthogonal="yes")


@pytest.mark.parametrize("name", ALL_MAPS + ("l2", "silu_l2"))
def test_zero_feature_dimension_refused_by_every_map(name):
    # D = 0 is refused, by the call, apply and vjp of every map, as linear_attention refuses it (not a
    # ZeroDivisionError, a NumPy reduction error or a reshape error); N = 0 and B = 0 still work
    phi = _build(name)
    x0 = np.zeros((1, 3, 0))
    match = "feature dimensions must be at least 1, got D=0"
    with pytest.raises(ValueError, match=match):
        phi(x0)
    for role in ("query", "key"):
        with pytest.raises(ValueError, match=match):
            phi.apply(x0, role=role)
        with pytest.raises(ValueError, match=match):
            phi.vjp(x0, np.zeros((1, 3, 0)), role=role)
        with pytest.raises(ValueError, match=match):
            phi.apply_with_vjp(x0, role=role)
    for shape in ((2, 0, 3), (0, 4, 3)):
        phi = _build(name, d=3)
        x = np.zeros(shape)
        for role in ("query", "key"):
            f = phi.apply(x, role=role)
            assert f.shape == shape[:-1] + (phi.output_dim(3),)
            dx, _ = phi.vjp(x, np.zeros(f.shape), role=role)
            assert dx.shape == shape


# ---------------------------------------------------------------------------
# elementwise maps and DPFP
# ---------------------------------------------------------------------------
def test_elementwise_formulas(rng):
    x = rng.normal(size=(4, 7)) * 3
    np.testing.assert_array_equal(fm.get("elu")(x), np.where(x >= 0, x + 1, np.exp(np.minimum(x, 0))))
    np.testing.assert_array_equal(fm.get("relu")(x), np.maximum(x, 0))
    np.testing.assert_array_equal(fm.get("squared_relu")(x), np.maximum(x, 0) ** 2)
    np.testing.assert_array_equal(fm.get("identity")(x), x)
    big = np.array([1e30, -1e30, 800.0, -800.0])
    with np.errstate(over="raise"):
        assert np.isfinite(fm.get("elu")(big)).all()
    nan = np.array([np.nan, 1.0])
    for name in ("elu", "relu", "squared_relu", "identity", "dpfp", "cosformer", "taylor2"):
        assert np.isnan(fm.get(name)(nan[None, :])).any(), name


@pytest.mark.parametrize("nu", [1, 2, 3])
def test_dpfp_matches_schlag_et_al(nu, rng):
    """DPFP(nu) as defined by Schlag, Irie & Schmidhuber (2021), §5.4.

    r = ReLU([x, -x]) in R^(2d); phi_{i,nu'}(x) = r_i r_{(i + nu') mod 2d} for
    nu' = 1..nu, concatenated: output dimension 2 d nu.
    """
    d = 4
    x = rng.normal(size=(6, d))
    got = fm.get("dpfp", nu=nu)(x)
    for t in range(6):
        r = np.maximum(np.concatenate([x[t], -x[t]]), 0)
        want = [r[i] * r[(i + j) % (2 * d)] for j in range(1, nu + 1) for i in range(2 * d)]
        np.testing.assert_allclose(got[t], want, rtol=0, atol=0)
    assert got.shape[-1] == 2 * d * nu and (got >= 0).all()


def test_dpfp_parameter_checks():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="nu"):
            fm.get("dpfp", nu=bad)
    with pytest.raises(ValueError, match="nu"):
        fm.get("dpfp", nu=4)(np.ones((1, 2)))   # nu must be < 2d


# ---------------------------------------------------------------------------
# random maps: seeds, redraw, orthogonality
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["favor+", "rff"])
def test_seed_redraw_reproducible(name, rng):
    a = fm.get(name, dim=6, num_features=9, seed=3)
    b = fm.get(name, dim=6, num_features=9, seed=3)
    c = fm.get(name, dim=6, num_features=9, seed=4)
    np.testing.assert_array_equal(a.W, b.W)
    assert not np.array_equal(a.W, c.W)
    w0 = a.W.copy()
    a.redraw()
    b.redraw()
    assert not np.array_equal(a.W, w0)
    np.testing.assert_array_equal(a.W, b.W)       # the redraw sequence is seeded too
    a.redraw(seed=3)
    np.testing.assert_array_equal(a.W, w0)        # reseeding restarts it
    x = rng.normal(size=(5, 6))
    np.testing.assert_array_equal(a(x), fm.get(name, dim=6, num_features=9, seed=3)(x))


def test_lazy_draw_fixes_dim(rng):
    phi = fm.get("favor+", num_features=5, seed=0)
    assert phi.W is None
    phi(rng.normal(size=(3, 4)))
    assert phi.W.shape == (5, 4) and phi.dim == 4
    with pytest.raises(ValueError, match="dim=4"):
        phi(rng.normal(size=(3, 5)))
    lazy = fm.get("favor+", num_features=5, seed=0)
    lazy.redraw()                                 # before any draw: next call draws
    eager = fm.get("favor+", dim=4, num_features=5, seed=0)
    np.testing.assert_array_equal(lazy.weights(4), eager.W)


@pytest.mark.parametrize("m", [3, 8, 19])
def test_orthogonal_blocks(m):
    """Block-QR rows (Performer §3): orthogonal within each d-block, norms chi(d) or sqrt(d)."""
    d = 8
    rng = np.random.default_rng(0)
    w = fm.draw_projection(rng, m, d, orthogonal=True, row_norm="fixed")
    assert w.shape == (m, d)
    np.testing.assert_allclose(np.linalg.norm(w, axis=1), math.sqrt(d), rtol=1e-12)
    for s in range(0, m, d):
        blk = w[s:s + d]
        g = blk @ blk.T
        np.testing.assert_allclose(g, d * np.eye(len(blk)), atol=1e-12 * d)
    w = fm.draw_projection(rng, m, d, orthogonal=True, row_norm="chi")
    norms = np.linalg.norm(w, axis=1)
    assert np.ptp(norms) > 0
    u = w / norms[:, None]
    np.testing.assert_allclose(u[:min(m, d)] @ u[:min(m, d)].T, np.eye(min(m, d)), atol=1e-12)
    w = fm.draw_projection(rng, m, d, orthogonal=False, row_norm="fixed")
    np.testing.assert_allclose(np.linalg.norm(w, axis=1), math.sqrt(d), rtol=1e-12)


def test_orthogonal_rows_are_marginally_gaussian():
    """With chi norms every row is marginally N(0, I_d): second moment I, directions uniform."""
    rng = np.random.default_rng(1)
    d = 4
    rows = np.concatenate([fm.draw_projection(rng, d, d, orthogonal=True) for _ in range(3000)])
    cov = rows.T @ rows / len(rows)
    np.testing.assert_allclose(cov, np.eye(d), atol=0.06)
    np.testing.assert_allclose(rows.mean(axis=0), 0, atol=0.04)


# ---------------------------------------------------------------------------
# FAVOR+: stabilisation, causality, overflow, segments
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize("causal", [False, True])
def test_favor_shifts_cancel(kind, causal, rng):
    """The per-query and per-map shifts of apply() leave the attention weights unchanged."""
    phi = fm.get("favor+", dim=6, num_features=16, kind=kind, seed=1)
    q, k = rng.normal(size=(2, 9, 6))
    exact = _normalised(phi(q) @ phi(k).T, causal)
    got = attention_weights(q, k, phi, causal=causal, eps=None)
    np.testing.assert_allclose(got, exact, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
def test_favor_causal_output_ignores_future_tokens_bitwise(kind, rng):
    """Causal FAVOR+ at token t uses no token after t (performer-pytorch issue #82).

    A shift taken over the whole sequence would make earlier outputs change
    when later tokens change; the parameter-only key shift cannot.
    """
    n, t0 = 40, 17
    q, k = rng.normal(size=(2, 2, n, 8)).astype(np.float32)
    v = rng.normal(size=(2, n, 5)).astype(np.float32)
    phi = fm.get("favor+", dim=8, num_features=32, kind=kind, seed=0)
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    q2[:, t0 + 1:] *= 40.0
    k2[:, t0 + 1:] = rng.normal(size=k2[:, t0 + 1:].shape) * 40.0
    v2[:, t0 + 1:] = 1e6
    o1 = linear_attention(q, k, v, feature_map=phi, causal=True)
    o2 = linear_attention(q2, k2, v2, feature_map=phi, causal=True)
    np.testing.assert_array_equal(o1[:, :t0 + 1], o2[:, :t0 + 1])
    assert not np.array_equal(o1[:, t0 + 1:], o2[:, t0 + 1:])
    for role, x, x2 in (("query", q, q2), ("key", k, k2)):
        f1 = phi.apply(x, role=role, causal=True)
        f2 = phi.apply(x2, role=role, causal=True)
        np.testing.assert_array_equal(f1[:, :t0 + 1], f2[:, :t0 + 1])


def test_favor_key_shift_is_a_parameter_bound():
    """w.x - |x|^2/2 <= |w|^2/2: key features never exceed exp(headroom) / sqrt(m)."""
    d, m = 256, 64                      # |w|^2/2 ~ 128 > headroom: a positive shift
    phi = fm.get("favor+", dim=d, num_features=m, seed=0)
    assert phi.key_shift > 0
    np.testing.assert_allclose(phi.key_shift, 0.5 * np.max(np.sum(phi.W ** 2, axis=1)) - phi.key_headroom)
    # the worst key for feature i is x' = w_i: there the feature reaches the bound
    i = int(np.argmax(np.sum(phi.W ** 2, axis=1)))
    x = phi.W[i] / math.sqrt(phi.effective_scale(d))
    f = phi.apply(x[None, :], role="key", causal=True)
    np.testing.assert_allclose(f.max(), math.exp(phi.key_headroom) / math.sqrt(m), rtol=1e-12)
    small = fm.get("favor+", dim=8, num_features=8, seed=0)
    assert small.key_shift == 0.0


@pytest.mark.parametrize("causal", [False, True])
def test_favor_float32_large_inputs_do_not_overflow(causal, rng):
    """Keys and queries of any size stay finite in float32 (no overflow, no warning)."""
    d = 16
    phi = fm.get("favor+", dim=d, num_features=64, seed=0)
    for mag in (1.0, 30.0, 1e3, 1e15):
        q, k = (rng.normal(size=(2, 64, d)) * mag).astype(np.float32)
        v = rng.normal(size=(64, 4)).astype(np.float32)
        with np.errstate(over="raise", invalid="raise"):
            fq = phi.apply(q, role="query", causal=causal)
            fk = phi.apply(k, role="key", causal=causal)
        assert np.isfinite(fq).all() and np.isfinite(fk).all()
        assert fq.max() <= 1.0 / math.sqrt(64) * (1 + 1e-6)
        o = linear_attention(q, k, v, feature_map=phi, causal=causal)
        assert np.isfinite(o).all()
    # at ordinary magnitudes float32 agrees with float64
    q, k = rng.normal(size=(2, 64, d)) * 2
    v = rng.normal(size=(64, 4))
    o64 = linear_attention(q, k, v, feature_map=phi, causal=causal)
    o32 = linear_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                           feature_map=phi, causal=causal)
    np.testing.assert_allclose(o32, o64, rtol=2e-4, atol=2e-4 * np.abs(o64).max())


def test_favor_segments_match_one_pass(rng):
    """The key shift depends on W only, so a state carried across segments stays consistent."""
    phi = fm.get("favor+", dim=32, num_features=48, seed=0)   # no key shift
    big = fm.get("favor+", dim=200, num_features=16, seed=0)  # a positive key shift
    assert phi.key_shift == 0 and big.key_shift > 0
    for p, d in ((phi, 32), (big, 200)):
        q, k = rng.normal(size=(2, 2, 30, d)) * 0.3
        v = rng.normal(size=(2, 30, 3))
        full = linear_attention(q, k, v, feature_map=p, causal=True)
        a, st = linear_attention(q[:, :13], k[:, :13], v[:, :13], feature_map=p, causal=True, return_state=True)
        b = linear_attention(q[:, 13:], k[:, 13:], v[:, 13:], feature_map=p, causal=True, initial_state=st)
        np.testing.assert_allclose(np.concatenate([a, b], axis=1), full, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
def test_favor_given_projection(kind, rng):
    """projection= is used as W as given: it fixes dim and num_features, draws nothing, and is what
    a state file stores (with learn_projection=True, the current W; else only when given)."""
    d, m = 5, 7
    drawn = fm.get("favor+", dim=d, num_features=m, seed=4, kind=kind)
    W = drawn.W + 0.1 * rng.normal(size=(m, d))  # a "trained" projection
    phi = fm.get("favor+", projection=W, kind=kind, seed=4)
    assert phi.dim == d and phi.num_features == m and phi.output_dim(d) == drawn.output_dim(d)
    assert np.array_equal(phi.W, W) and phi.W is not W  # a float64 copy
    assert phi.projection is phi.W and phi.parameters() == {}
    x = rng.normal(size=(3, d))
    manual = fm.get("favor+", dim=d, num_features=m, seed=4, kind=kind)
    manual.W[...] = W
    for role in ("query", "key"):
        np.testing.assert_array_equal(phi.apply(x, role=role, causal=True), manual.apply(x, role=role, causal=True))
    # nothing was drawn at construction: the first redraw is the seed's first draw
    phi.redraw()
    np.testing.assert_array_equal(phi.W, drawn.W)
    learned = fm.get("favor+", projection=W, learn_projection=True)
    assert learned.parameters()["projection"] is learned.W is learned.projection
    # without projection= the attribute is None unless the projection is learned (once drawn)
    assert fm.get("favor+", dim=d, seed=0).projection is None
    assert fm.get("favor+", num_features=3, learn_projection=True).projection is None
    lazy = fm.get("favor+", dim=d, seed=0, learn_projection=True)
    assert lazy.projection is lazy.W
    # consistent dim and num_features are accepted, others refused naming both
    fm.get("favor+", projection=W, dim=d, num_features=m)
    with pytest.raises(ValueError, match=r"favor\+: dim=4 disagrees with projection of shape \(7, 5\)"):
        fm.get("favor+", projection=W, dim=4)
    with pytest.raises(ValueError, match=r"favor\+: num_features=8 disagrees with projection of shape \(7, 5\)"):
        fm.get("favor+", projection=W, num_features=8)
    with pytest.raises(ValueError, match=r"projection must be a non-empty 2-D array .*got shape \(5,\)"):
        fm.get("favor+", projection=np.ones(5))
    with pytest.raises(ValueError, match="projection must be finite"):
        fm.get("favor+", projection=np.full((2, 2), np.nan))
    with pytest.raises(TypeError, match="projection must be an array of real numbers"):
        fm.get("favor+", projection=np.ones((2, 2), dtype=complex))
    with pytest.raises(ValueError, match="dim must be an integer"):
        fm.get("favor+", projection=W, dim=0)


# ---------------------------------------------------------------------------
# RFF
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["softmax", "gaussian"])
@pytest.mark.parametrize("causal", [False, True])
def test_rff_query_factor_cancels(target, causal, rng):
    phi = fm.get("rff", dim=5, num_features=32, target=target, seed=2)
    q, k = rng.normal(size=(2, 7, 5))
    a = phi(q) @ phi(k).T
    if causal:
        a = np.tril(a)
    exact = a / a.sum(axis=-1, keepdims=True)
    got = attention_weights(q, k, phi, causal=causal, eps=None)
    np.testing.assert_allclose(got, exact, rtol=1e-12, atol=1e-13)


def test_rff_kernels_and_overflow(rng):
    x, y = rng.normal(size=(2, 3, 4))
    s = 0.7
    g = fm.get("rff", target="gaussian", scale=s)
    np.testing.assert_allclose(g.kernel(x, y), np.exp(-0.5 * s * np.sum((x - y) ** 2, -1)))
    assert not g.estimates_softmax and fm.get("rff").estimates_softmax
    # Monte-Carlo: the gaussian estimator is unbiased (Rahimi & Recht 2007)
    est = [(lambda p: np.sum(p(x) * p(y), -1))(fm.get("rff", target="gaussian", num_features=64, seed=i,
                                                         scale=s)) for i in range(400)]
    np.testing.assert_allclose(np.mean(est, axis=0), g.kernel(x, y), atol=0.03)
    phi = fm.get("rff", dim=4, num_features=8, seed=0)
    with pytest.raises(ValueError, match="overflow"):
        phi.apply(np.full((1, 4), 30.0, dtype=np.float32), role="key", causal=False)
    assert np.isfinite(phi.apply(np.full((1, 4), 30.0, dtype=np.float32), role="query", causal=False)).all()


# ---------------------------------------------------------------------------
# Taylor-2
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("d", [1, 2, 5, 16])
@pytest.mark.parametrize("scale", [None, 1.0, 0.3])
def test_taylor2_exact_on_its_polynomial(d, scale, rng):
    """phi(q).phi(k) = 1 + t + t^2/2 exactly, t = scale q.k (Based, Arora et al. 2024, Eq. 4)."""
    phi = fm.get("taylor2", scale=scale)
    x, y = rng.normal(size=(2, 50, d)) * 2
    s = 1 / math.sqrt(d) if scale is None else scale
    t = s * np.sum(x * y, axis=-1)
    got = np.sum(phi(x) * phi(y), axis=-1)
    np.testing.assert_allclose(got, 1 + t + t * t / 2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(phi.kernel(x, y), 1 + t + t * t / 2, rtol=1e-14)
    assert got.min() >= 0.5 - 1e-12                 # (1 + (1 + t)^2) / 2 >= 1/2
    q, k = rng.normal(size=(2, 9, d))
    w = attention_weights(q, k, phi, scale=s)
    kern = phi.kernel(q[:, None, :], k[None, :, :])
    np.testing.assert_allclose(w, kern / kern.sum(-1, keepdims=True), rtol=1e-12)


# ---------------------------------------------------------------------------
# cosFormer
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_cosformer_weights_match_definition(causal, rng):
    """relu(q_i).relu(k_j) cos(pi/2 (i - j)/M), M = N (Qin et al. 2022, Eq. 9-11), over j <= i if causal."""
    n, d = 11, 4
    q, k = rng.normal(size=(2, n, d))
    a = np.maximum(q, 0) @ np.maximum(k, 0).T
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    a = a * np.cos(0.5 * np.pi * (i - j) / n)
    got = attention_weights(q, k, "cosformer", causal=causal)
    np.testing.assert_allclose(got, _normalised(a, causal, eps=1e-8), rtol=1e-12, atol=1e-15)
    v = rng.normal(size=(n, 3))
    np.testing.assert_allclose(linear_attention(q, k, v, feature_map="cosformer", causal=causal), got @ v,
                               rtol=1e-12)
    phi = fm.get("cosformer")
    np.testing.assert_allclose(phi.kernel(q[2], k[5], pos_x=2, pos_y=5, max_length=n), a[2, 5])


@pytest.mark.parametrize("causal", [False, True])
def test_cosformer_segments_with_max_length(causal, rng):
    n, d = 20, 3
    q, k = rng.normal(size=(2, 2, n, d))
    v = rng.normal(size=(2, n, 2))
    phi = fm.get("cosformer", max_length=32)
    full = linear_attention(q, k, v, feature_map=phi, causal=causal)
    if causal:
        a, s1 = linear_attention(q[:, :8], k[:, :8], v[:, :8], feature_map=phi, causal=True, return_state=True)
        assert s1.position == 8
        b = linear_attention(q[:, 8:], k[:, 8:], v[:, 8:], feature_map=phi, causal=True, initial_state=s1)
        np.testing.assert_allclose(np.concatenate([a, b], axis=1), full, rtol=1e-12, atol=1e-13)
    # positions are absolute: features of a segment equal the slice of the full features
    f_full = phi.apply(q, role="query", causal=causal, offset=0)
    f_seg = phi.apply(q[:, 8:], role="query", causal=causal, offset=8)
    np.testing.assert_allclose(f_seg, f_full[:, 8:], rtol=1e-14)


def test_cosformer_position_errors(rng):
    x = rng.normal(size=(5, 2))
    with pytest.raises(ValueError, match="max_length"):
        fm.get("cosformer").apply(x, role="key", causal=True, offset=3)
    with pytest.raises(ValueError, match="exceed"):
        fm.get("cosformer", max_length=6).apply(x, role="key", causal=True, offset=3)
    with pytest.raises(ValueError, match="exceed"):
        fm.get("cosformer").apply(x, role="key", causal=False, total_length=4)
    with pytest.raises(ValueError, match="max_length"):
        fm.get("cosformer", max_length=0)
    # offset and total_length: integers (NumPy's too), never a bool, a float or a string cast by int()
    phi, g = fm.get("cosformer", max_length=8), np.ones((5, 4))
    for bad in (1.7, True, np.bool_(True), "2", np.float64(1.0), None):
        with pytest.raises(TypeError, match="offset must be an integer"):
            phi.apply(x, role="key", offset=bad)
        with pytest.raises(TypeError, match="offset must be an integer"):
            phi.vjp(x, g, role="key", offset=bad)
    for bad in (5.9, 7.0, True, "6"):
        for m in (fm.get("cosformer"), phi):
            with pytest.raises(TypeError, match="total_length must be an integer"):
                m.apply(x, role="key", total_length=bad)
            with pytest.raises(TypeError, match="total_length must be an integer"):
                m.vjp(x, g, role="key", total_length=bad)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        phi.apply(x, role="key", offset=-1)
    with pytest.raises(ValueError, match="total_length must be >= 0"):
        fm.get("cosformer").apply(x, role="key", total_length=-5)
    np.testing.assert_array_equal(phi.apply(x, role="key", offset=np.int64(2)), phi.apply(x, role="key", offset=2))
    np.testing.assert_array_equal(fm.get("cosformer").apply(x, role="key", total_length=np.int32(7)),
                                  fm.get("cosformer").apply(x, role="key", total_length=7))
    # a carried state without max_length is refused by the dispatcher too
    v = rng.normal(size=(5, 1))
    _, st = linear_attention(x, x, v, feature_map="cosformer", causal=True, return_state=True)
    with pytest.raises(ValueError, match="max_length"):
        linear_attention(x, x, v, feature_map="cosformer", causal=True, initial_state=st)


# ---------------------------------------------------------------------------
# Hedgehog
# ---------------------------------------------------------------------------
def test_hedgehog_default_and_custom(rng):
    """phi(x) = [exp(Wx + b), exp(-Wx - b)] (Zhang et al. 2024); identity W: sum_i 2 cosh(x_i + y_i)."""
    x, y = rng.normal(size=(2, 6, 3))
    phi = fm.get("hedgehog")
    np.testing.assert_allclose(np.sum(phi(x) * phi(y), -1), np.sum(2 * np.cosh(x + y), -1), rtol=1e-12)
    W = rng.normal(size=(5, 3))
    b = rng.normal(size=5)
    phi = fm.get("hedgehog", W=W, b=b)
    u = x @ W.T + b
    np.testing.assert_allclose(phi(x), np.exp(np.concatenate([u, -u], -1)), rtol=1e-12)
    for causal in (False, True):
        exact = _normalised(phi(x) @ phi(y).T, causal)
        np.testing.assert_allclose(attention_weights(x, y, phi, causal=causal, eps=None), exact, rtol=1e-12)
    with pytest.raises(ValueError, match="W"):
        fm.get("hedgehog", W=np.ones(3))
    with pytest.raises(ValueError, match="b"):
        fm.get("hedgehog", W=np.ones((2, 3)), b=np.ones(3))
    with pytest.raises(ValueError, match="dimension"):
        fm.get("hedgehog", W=np.ones((2, 3)))(np.ones((1, 4)))
    with pytest.raises(ValueError, match="overflow"):
        fm.get("hedgehog").apply(np.full((1, 2), 100.0, dtype=np.float32), role="key", causal=False)


# ---------------------------------------------------------------------------
# T2R
# ---------------------------------------------------------------------------
def test_t2r_default_and_custom(rng):
    """phi(x) = relu(W x + b) (Kasai et al. 2021); the defaults W = I, b = 0 give the relu map."""
    x, y = rng.normal(size=(2, 6, 3))
    phi = fm.get("t2r")
    assert isinstance(phi, fm.T2RFeatureMap) and phi.kernel_code is None
    assert phi.is_positive and not phi.strictly_positive and not phi.needs_normalizer
    np.testing.assert_array_equal(phi(x), fm.get("relu")(x))
    W = rng.normal(size=(5, 3))
    b = rng.normal(size=5)
    phi = fm.get("t2r", W=W, b=b)
    np.testing.assert_allclose(phi(x), np.maximum(x @ W.T + b, 0.0), rtol=1e-15)
    assert (phi(x) == 0).any() and (phi(x) > 0).any()  # both sides of the kink
    for role in ("query", "key"):  # no role-dependent shift
        np.testing.assert_array_equal(phi.apply(x, role=role, causal=True), phi(x))
    for causal in (False, True):
        exact = _normalised(phi(x) @ phi(y).T, causal, eps=1e-300)
        np.testing.assert_allclose(attention_weights(x, y, phi, causal=causal, eps=1e-300), exact, rtol=1e-12)
    assert np.isnan(phi(np.array([np.nan, 0.0, 0.0]))).all()  # NaN propagates through W x
    assert repr(phi) == "T2RFeatureMap(W shape=(5, 3), b=set)"
    assert repr(fm.get("t2r")) == "T2RFeatureMap(W shape=None, b=None)"


@pytest.mark.parametrize("name", ["hedgehog", "t2r"])
def test_affine_maps_check_w_and_b(name):
    """hedgehog and t2r share the checks of W and b; every message names the map, the argument and the shapes."""
    bad = [
        (dict(W=np.ones(3)), ValueError, r"W must be a non-empty 2-D array \(d_out, d\), got shape \(3,\)"),
        (dict(W=np.ones((0, 3))), ValueError, r"W must be a non-empty 2-D array .* got shape \(0, 3\)"),
        (dict(W=[[1.0, np.inf]]), ValueError, "W must be finite"),
        (dict(W=np.ones((2, 3)) * 1j), TypeError, "W must be an array of real numbers, got dtype complex128"),
        (dict(W=np.ones((2, 3)), b=np.ones(3)), ValueError, r"b must have shape \(2,\), got \(3,\)"),
        (dict(b=np.ones((2, 2))), ValueError, r"b must have shape \(d,\), got \(2, 2\)"),
        (dict(b=np.ones(0)), ValueError, r"b must have shape \(d,\), got \(0,\)"),
        (dict(b=[np.nan]), ValueError, "b must be finite"),
        (dict(b=["a"]), TypeError, "b must be an array of real numbers"),
    ]
    for kw, exc, match in bad:
        with pytest.raises(exc, match=f"{name}: {match}"):
            fm.get(name, **kw)
    with pytest.raises(ValueError, match=rf"{name}: W has shape \(2, 3\), inputs have dimension 4"):
        fm.get(name, W=np.ones((2, 3)))(np.ones((1, 4)))
    with pytest.raises(ValueError, match=rf"{name}: b has shape \(3,\), projections have dimension 4"):
        fm.get(name, b=np.ones(3))(np.ones((1, 4)))
    # the map keeps float64 copies: changing the caller's arrays later does not change it
    W, b = np.ones((2, 3), dtype=np.float32), np.zeros(2)
    phi = fm.get(name, W=W, b=b)
    W[0, 0], b[0] = 5.0, 5.0
    assert phi.W.dtype == np.float64 and phi.W[0, 0] == 1.0 and phi.b[0] == 0.0


# ---------------------------------------------------------------------------
# through the dispatcher
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NEW_MAPS + ("dpfp",))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 2, 9])
def test_linear_attention_equals_explicit_weights(name, causal, n, rng):
    """linear_attention with each map equals its explicit weights (attention_weights) times v."""
    d, m = 4, 3
    phi = _build(name, d)
    q, k = rng.normal(size=(2, 3, n, d)) * 0.7
    v = rng.normal(size=(3, n, m))
    eps = None if name == "rff" else 1e-8
    want = attention_weights(q, k, phi, causal=causal, eps=eps) @ v
    got = linear_attention(q, k, v, feature_map=phi, causal=causal, eps=eps)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13 * max(1.0, np.abs(want).max()))


def test_softmax_estimators_share_the_temperature(rng):
    """favor+, rff and taylor2 estimate exp(q.k / sqrt(D)), the kernel of softmax_attention."""
    d = 9
    x, y = rng.normal(size=(2, 4, d))
    want = np.exp(np.sum(x * y, -1) / 3.0)
    for name in ("favor+", "rff"):
        np.testing.assert_allclose(fm.get(name).kernel(x, y), want, rtol=1e-14)
    t = np.sum(x * y, -1) / 3.0
    np.testing.assert_allclose(fm.get("taylor2").kernel(x, y), 1 + t + t * t / 2, rtol=1e-14)
    # large m: FAVOR+ attention approaches softmax attention at the same default temperature
    q, k = rng.normal(size=(2, 32, d)) * 0.5
    v = rng.normal(size=(32, 2))
    o = linear_attention(q, k, v, feature_map=fm.get("favor+", num_features=20000, seed=0))
    ref = softmax_attention(q, k, v)
    assert np.linalg.norm(o - ref) / np.linalg.norm(ref) < 0.05


@pytest.mark.parametrize("make", [lambda d: fm.get("hedgehog").materialize(d), lambda d: fm.get("t2r").materialize(d),
                                  lambda d: fm.get("favor+", dim=d, num_features=4, seed=0, learn_projection=True)])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_parameter_is_named_not_reported_as_an_overflow(make, bad):
    """A parameter made NaN or inf through the documented in-place route (``parameters()``, a diverged update)
    was reported as features of finite inputs overflowing float64, "use smaller inputs"; the cause is named now,
    for a direct call and for linear_attention."""
    import warnings

    import linattn_nb as la

    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 5, 4))
    phi = make(4)
    params = phi.parameters()
    name = next(iter(params))
    params[name][0, 0] = bad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NumPy's, on the way to the non-finite features
        with pytest.raises(ValueError, match=f"its parameter {name} holds NaN or inf") as direct:
            phi.apply(q, role="key")
        with pytest.raises(ValueError, match=f"its parameter {name} holds NaN or inf") as call:
            la.linear_attention(q, k, rng.standard_normal((5, 2)), feature_map=phi)
    assert not isinstance(direct.value, fm.FeatureOverflow) and not isinstance(call.value, fm.FeatureOverflow)
