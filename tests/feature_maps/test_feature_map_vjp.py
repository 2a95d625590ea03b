"""FeatureMap.vjp and FeatureMap.parameters: gradients through every built-in feature map.

Every vjp is checked against central finite differences in float64 of ``sum(apply(x) * G)``, with respect
to ``x`` and to the map's trainable parameters (hedgehog's and t2r's ``W`` and ``b``, favor+'s projection
with ``learn_projection=True``).  Inputs stay away from the kinks (ReLU at 0) and from ties of the per-row max
of favor+ and hedgehog queries; t2r's kink is at ``W x + b = 0``, which the fixed draws below do not come
near (within a finite-difference step).
"""
from __future__ import annotations

import doctest

import numpy as np
import pytest

from linattn_nb import feature_maps as fm

#: The maps this module registers itself (tests elsewhere may register more while they run).
BUILTIN = [n for n in fm.available() if getattr(fm.factory(n), "__module__", "").startswith(fm.__name__ + ".")]

#: Small constructions, seeds fixed; maps not listed build without parameters.
BUILD = {
    "favor+": dict(dim=4, num_features=6, seed=1),
    "rff": dict(dim=4, num_features=5, seed=2),
    "dpfp": dict(nu=3),
    "hedgehog": dict(W=np.random.default_rng(3).standard_normal((3, 4)),
                     b=np.random.default_rng(4).standard_normal(3)),
    "t2r": dict(W=np.random.default_rng(5).standard_normal((5, 4)),
                b=np.random.default_rng(6).standard_normal(5)),
    "cosformer": dict(max_length=16),
}

#: Every built-in map, plus the other kinds of the maps that have them.
VARIANTS = [(n, {}) for n in BUILTIN] + [
    ("favor+", dict(kind="hyperbolic")),
    ("rff", dict(target="gaussian")),
    ("hedgehog", dict(W=None, b=None)),
    ("t2r", dict(W=None, b=None)),
]
VARIANT_IDS = list(BUILTIN) + ["favor+-hyperbolic", "rff-gaussian", "hedgehog-defaults", "t2r-defaults"]

#: The maps with trainable affine parameters W and b (whose vjp always returns their gradients).
AFFINE = ("hedgehog", "t2r")


def build(name, **over):
    params = dict(BUILD.get(name, {}))
    params.update(over)
    params = {k: v for k, v in params.items() if v is not None}
    return fm.get(name, **params)


def inputs(rng, shape):
    """Values of magnitude in [0.2, 1.2], random signs: no input within 0.2 of a kink."""
    return rng.uniform(0.2, 1.2, size=shape) * rng.choice([-1.0, 1.0], size=shape)


def central_difference(f, a, rel_step=1e-6):
    """Gradient of the scalar ``f()`` w.r.t. the array ``a``, perturbed in place (and restored)."""
    grad = np.zeros(a.shape)
    for i in np.ndindex(a.shape):
        keep = a[i]
        h = rel_step * max(1.0, abs(keep))
        a[i] = keep + h
        up = f()
        a[i] = keep - h
        down = f()
        a[i] = keep
        grad[i] = (up - down) / (2 * h)
    return grad


def assert_close(got, want, rtol=1e-6):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-300)
    err = float(np.max(np.abs(got - want), initial=0.0)) / scale
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def kwargs(name, role, causal):
    # cosFormer: a segment at offset 3 of a length-16 sequence, so that positions matter
    return dict(role=role, causal=causal, offset=3 if name == "cosformer" else 0,
                total_length=16 if name == "cosformer" else None)


# ---------------------------------------------------------------------------
# dx against finite differences
# ---------------------------------------------------------------------------
def test_every_builtin_map_is_checked():
    assert set(BUILTIN) >= {"elu", "relu", "squared_relu", "identity", "l2", "silu_l2", "dpfp", "favor+", "rff",
                            "taylor2", "cosformer", "hedgehog", "t2r"}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("role", ["query", "key"])
@pytest.mark.parametrize("name, over", VARIANTS, ids=VARIANT_IDS)
def test_vjp_matches_finite_differences(name, over, role, causal):
    rng = np.random.default_rng(10)
    phi = build(name, **over)
    x = inputs(rng, (2, 5, 4))
    kw = kwargs(name, role, causal)
    g = rng.standard_normal(phi.apply(x, **kw).shape)
    dx, dparams = phi.vjp(x, g, **kw)
    assert dx.shape == x.shape and dx.dtype == np.float64
    want = central_difference(lambda: float(np.sum(phi.apply(x, **kw) * g)), x)
    assert_close(dx, want)
    assert (dparams is None) == (name not in AFFINE)


@pytest.mark.parametrize("name", ["favor+", "hedgehog"])
def test_max_shift_gradient_goes_to_the_argmax(name):
    """The queries' per-row max is differentiated as written (its gradient goes to one entry)."""
    rng = np.random.default_rng(11)
    phi = build(name)
    x = inputs(rng, (6, 4))
    g = rng.standard_normal(phi.apply(x, role="query", causal=False).shape)
    dx, _ = phi.vjp(x, g, role="query")
    # without the max term (g * f through exp only) the gradient would differ
    assert_close(dx, central_difference(lambda: float(np.sum(phi.apply(x, role="query", causal=False) * g)), x))


def test_cosformer_gradient_depends_on_positions():
    rng = np.random.default_rng(12)
    phi = build("cosformer")
    x = inputs(rng, (3, 2))
    g = rng.standard_normal((3, 4))
    a, _ = phi.vjp(x, g, role="key", offset=0, total_length=16)
    b, _ = phi.vjp(x, g, role="key", offset=5, total_length=16)
    assert not np.allclose(a, b)
    with pytest.raises(ValueError, match="max_length"):
        fm.get("cosformer").vjp(x, g, role="key", offset=2)


@pytest.mark.parametrize("name, slope", [("relu", 0.0), ("squared_relu", 0.0), ("elu", 1.0), ("cosformer", 0.0),
                                         ("dpfp", 0.0)])
def test_kink_convention(name, slope):
    """At x = 0 the derivative is that of the side where the map is 0 (ELU+1 has slope 1 on both sides)."""
    phi = build(name)
    x = np.zeros((1, 3))
    g = np.ones(phi.apply(x, role="key", causal=False).shape)
    dx, _ = phi.vjp(x, g, role="key")
    assert np.array_equal(dx, np.full((1, 3), slope))


@pytest.mark.parametrize("name", ["l2", "silu_l2"])
def test_l2_zero_row_has_zero_gradient(name):
    phi = fm.get(name)
    x = np.array([[0.0, 0.0, 0.0], [0.5, -1.0, 2.0]])
    g = np.ones((2, 3))
    with np.errstate(all="raise"):
        dx, _ = phi.vjp(x, g, role="key")
    assert np.array_equal(dx[0], np.zeros(3))
    assert np.isfinite(dx).all()


def test_silu_l2_large_inputs_stay_finite():
    phi = fm.get("silu_l2")
    x = np.array([[800.0, -800.0, 1.0]])
    dx, _ = phi.vjp(x, np.ones((1, 3)), role="query")
    assert np.isfinite(dx).all()


# ---------------------------------------------------------------------------
# Parameter gradients
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["query", "key"])
@pytest.mark.parametrize("given", ["W,b", "W", "b", "defaults"])
@pytest.mark.parametrize("name", AFFINE)
def test_affine_parameter_gradients(name, given, role):
    rng = np.random.default_rng(13)
    W = rng.standard_normal((3, 4)) if "W" in given else None
    b = rng.standard_normal(3 if W is not None else 4) if "b" in given else None
    phi = fm.get(name, W=W, b=b)
    x = inputs(rng, (2, 3, 4))
    g = rng.standard_normal(phi.apply(x, role=role, causal=True).shape)
    dx, dparams = phi.vjp(x, g, role=role, causal=True)
    assert set(dparams) == {"W", "b"}
    assert set(phi.parameters()) == {k for k in ("W", "b") if k in given}
    # the defaults' gradients are those of the explicit W = I, b = 0 that materialize() stores
    phi.materialize(4)
    assert set(phi.parameters()) == {"W", "b"}
    dx2, dparams2 = phi.vjp(x, g, role=role, causal=True)
    assert np.array_equal(dx, dx2)
    params = phi.parameters()
    for key in ("W", "b"):
        assert dparams[key].shape == params[key].shape and dparams[key].dtype == np.float64
        assert np.array_equal(dparams[key], dparams2[key])
        want = central_difference(lambda: float(np.sum(phi.apply(x, role=role, causal=True) * g)), params[key])
        assert_close(dparams[key], want)


@pytest.mark.parametrize("name", AFFINE)
def test_affine_materialize(name):
    x = inputs(np.random.default_rng(14), (3, 4))
    phi = fm.get(name)
    before = phi.apply(x, role="key", causal=False)
    assert phi.parameters() == {}
    assert phi.materialize(4) is phi
    assert np.array_equal(phi.W, np.eye(4)) and np.array_equal(phi.b, np.zeros(4))
    assert np.array_equal(phi.apply(x, role="key", causal=False), before)
    assert phi.parameters()["W"] is phi.W  # the map's own arrays: updating them updates the map
    with pytest.raises(ValueError, match="d"):
        fm.get(name).materialize()
    only_b = fm.get(name, b=np.zeros(4)).materialize()
    assert only_b.W.shape == (4, 4)
    with pytest.raises(ValueError, match="b has shape"):
        fm.get(name, b=np.zeros(4)).materialize(3)
    # a given W keeps its shape (d_out != d); a d that disagrees with it is refused, naming both
    only_w = fm.get(name, W=np.ones((5, 4))).materialize(4)
    assert only_w.W.shape == (5, 4) and np.array_equal(only_w.b, np.zeros(5))
    with pytest.raises(ValueError, match=rf"{name}: d=3 but W has shape \(5, 4\)"):
        fm.get(name, W=np.ones((5, 4))).materialize(3)
    # d is checked whether or not it is needed: with W or b set, 2.7 or "4" passed int(d)
    for d, given in ((2.7, dict(W=np.ones((5, 4)))), ("4", dict(W=np.ones((5, 4)))), (3.9, dict(b=np.zeros(3)))):
        with pytest.raises(ValueError, match="d must be an integer >= 1"):
            fm.get(name, **given).materialize(d)


@pytest.mark.parametrize("headroom", [None, 0.0], ids=["shift-off", "shift-on"])
@pytest.mark.parametrize("role", ["query", "key"])
@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
def test_favor_projection_gradient(kind, role, headroom):
    rng = np.random.default_rng(15)
    phi = build("favor+", kind=kind, learn_projection=True)
    if headroom is not None:
        phi.key_headroom = headroom  # makes the W-dependent key shift active at this small d
        assert phi.key_shift > 0
    x = inputs(rng, (2, 3, 4))
    g = rng.standard_normal(phi.apply(x, role=role, causal=False).shape)
    dx, dparams = phi.vjp(x, g, role=role)
    params = phi.parameters()
    assert set(params) == set(dparams) == {"projection"}
    assert params["projection"] is phi.W and dparams["projection"].shape == phi.W.shape
    want = central_difference(lambda: float(np.sum(phi.apply(x, role=role, causal=False) * g)), phi.W)
    assert_close(dparams["projection"], want)
    if headroom is None:  # the same map without learn_projection: the same dx, no dparams
        same, none = build("favor+", kind=kind).vjp(x, g, role=role)
        assert none is None and np.array_equal(same, dx)


def test_favor_learn_projection_keyword():
    assert fm.get("favor+", dim=4, seed=0).parameters() == {}
    lazy = fm.get("favor+", num_features=3, seed=0, learn_projection=True)
    assert lazy.parameters() == {}  # nothing drawn yet
    lazy.vjp(np.ones((2, 4)), np.ones((2, 3)), role="key")
    assert lazy.parameters()["projection"] is lazy.W
    assert "learn_projection=True" in repr(lazy)
    assert "learn_projection" not in repr(fm.get("favor+", dim=4, seed=0))
    with pytest.raises(TypeError, match="learn_projection"):
        fm.get("favor+", learn_projection=1)


@pytest.mark.parametrize("name", BUILTIN)
def test_parameters_default_empty(name):
    if name not in AFFINE:
        assert build(name).parameters() == {}


# ---------------------------------------------------------------------------
# Shapes, dtypes, errors
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 3])
@pytest.mark.parametrize("name", BUILTIN)
def test_batch_and_edge_shapes(name, n):
    rng = np.random.default_rng(16)
    phi = build(name)
    x = inputs(rng, (2, 3, n, 4))
    kw = kwargs(name, "key", True)
    g = rng.standard_normal(phi.apply(x, **kw).shape)
    dx, dparams = phi.vjp(x, g, **kw)
    assert dx.shape == x.shape
    # each batch slice on its own gives the same rows
    for i in np.ndindex(2, 3):
        dxi, dpi = phi.vjp(x[i], g[i], **kw)
        np.testing.assert_allclose(dx[i], dxi, rtol=1e-12, atol=1e-300)
    if dparams is not None:
        for key, val in dparams.items():
            assert np.isfinite(val).all()
            if n == 0:
                assert not val.any()


@pytest.mark.parametrize("name", BUILTIN)
def test_rows_are_independent(name):
    """dx of a token depends on that token's x and grad_features only (what causal gradients rely on)."""
    rng = np.random.default_rng(17)
    phi = build(name)
    x = inputs(rng, (5, 4))
    kw = kwargs(name, "query", True)
    g = rng.standard_normal(phi.apply(x, **kw).shape)
    dx, _ = phi.vjp(x, g, **kw)
    x2, g2 = x.copy(), g.copy()
    x2[3] = np.nan
    g2[3] = 7.0
    dx2, _ = phi.vjp(x2, g2, **kw)
    keep = [0, 1, 2, 4]
    assert np.array_equal(dx[keep], dx2[keep])


@pytest.mark.parametrize("name", BUILTIN)
def test_dtypes(name):
    rng = np.random.default_rng(18)
    phi = build(name)
    x = inputs(rng, (3, 4))
    kw = kwargs(name, "key", False)
    g = rng.standard_normal(phi.apply(x, **kw).shape)
    ref, _ = phi.vjp(x, g, **kw)
    cases = [(np.float32, np.float32, np.float32), (np.float32, np.float64, np.float64),
             (np.float64, np.float32, np.float64), (np.float16, np.float16, np.float32)]
    for xt, gt, want in cases:
        dx, _ = phi.vjp(x.astype(xt), g.astype(gt), **kw)
        assert dx.dtype == want, (xt, gt, dx.dtype)
        np.testing.assert_allclose(dx, ref, rtol=2e-2, atol=2e-2 * np.max(np.abs(ref)))


@pytest.mark.parametrize("name", BUILTIN)
def test_wrong_grad_features_shape(name):
    phi = build(name)
    x = inputs(np.random.default_rng(19), (2, 3, 4))
    kw = kwargs(name, "key", False)
    shape = phi.apply(x, **kw).shape
    for bad in [shape[:-1] + (shape[-1] + 1,), shape[1:], (2, 4, shape[-1])]:
        with pytest.raises(ValueError, match="grad_features") as info:
            phi.vjp(x, np.zeros(bad), **kw)
        assert str(bad) in str(info.value) and str(shape) in str(info.value)


@pytest.mark.parametrize("name", BUILTIN)
def test_bad_role_and_grad_dtype(name):
    phi = build(name)
    x = inputs(np.random.default_rng(20), (3, 4))
    kw = kwargs(name, "key", False)
    g = np.zeros(phi.apply(x, **kw).shape)
    with pytest.raises(ValueError, match="role"):
        phi.vjp(x, g, **{**kw, "role": "value"})
    with pytest.raises(TypeError, match="grad_features"):
        phi.vjp(x, g.astype(complex), **kw)
    with pytest.raises(TypeError, match="floating"):
        phi.vjp(x.astype(int), g, **kw)


def test_custom_map_without_vjp():
    class Softplus(fm.FeatureMap):
        name = "softplus-test"

        def transform(self, x):
            return np.logaddexp(0.0, x)

    class Cube(fm.ElementwiseFeatureMap):
        name = "cube-test"

        def _f(self, x):
            return x ** 3

    x, g = np.ones((2, 3)), np.ones((2, 3))
    for phi in (Softplus(), Cube()):
        assert phi.parameters() == {}
        with pytest.raises(NotImplementedError, match=f"{phi.name}.*define .*to take gradients through this map"):
            phi.vjp(x, g, role="key")

    class CubeWithDerivative(Cube):
        def _df(self, x):
            return 3 * x ** 2

    dx, dparams = CubeWithDerivative().vjp(2 * x, g, role="query")
    assert np.array_equal(dx, np.full((2, 3), 12.0)) and dparams is None


def test_overflowing_keys_raise_like_apply():
    phi = build("hedgehog", W=None, b=None)
    x = np.full((1, 4), 200.0, dtype=np.float32)  # exp(200) overflows float32
    with pytest.raises(ValueError, match="overflow"):
        phi.apply(x, role="key", causal=False)
    with pytest.raises(ValueError, match="overflow"):
        phi.vjp(x, np.ones((1, 8), dtype=np.float32), role="key")
    # t2r: W x (in float64) beyond the float32 range
    phi = build("t2r", W=np.full((2, 4), 1e10), b=None)
    x = np.full((1, 4), 1e30, dtype=np.float32)
    for role in ("query", "key"):
        with pytest.raises(ValueError, match="overflow"):
            phi.apply(x, role=role, causal=False)
        with pytest.raises(ValueError, match="overflow"):
            phi.vjp(x, np.ones((1, 2), dtype=np.float32), role=role)


def test_t2r_kink_convention():
    """Where ``W x + b`` is exactly 0 the derivative is that of the zero side: no gradient to x, W or b."""
    rng = np.random.default_rng(21)
    # dyadic numbers: W x is exact in any summation order, so row 0 sits exactly on every kink
    x = np.array([[0.5, -0.25, 1.0, 0.75], [0.25, 1.0, -0.5, 0.5]])
    W = rng.integers(-3, 4, size=(3, 4)).astype(np.float64)
    b = -(x[0] @ W.T)
    phi = fm.get("t2r", W=W, b=b)
    assert not phi.apply(x[:1], role="key", causal=False).any()
    g = np.ones((2, 3))
    dx, dparams = phi.vjp(x, g, role="key")
    assert not dx[0].any()
    one, p1 = phi.vjp(x[1:], g[1:], role="key")  # the kink row adds nothing to the parameter gradients
    assert np.array_equal(dx[1:], one)
    np.testing.assert_allclose(dparams["W"], p1["W"], rtol=1e-15)
    np.testing.assert_allclose(dparams["b"], p1["b"], rtol=1e-15)


@pytest.mark.parametrize("obj", [fm.FeatureMap.vjp, fm.HedgehogFeatureMap.materialize, fm.T2RFeatureMap])
def test_docstring_examples(obj):
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    tests = finder.find(obj, globs={})
    assert tests and any(t.examples for t in tests)
    for t in tests:
        runner.run(t)
    assert runner.summarize(verbose=False).failed == 0


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("role", ["query", "key"])
@pytest.mark.parametrize("name, over", VARIANTS, ids=VARIANT_IDS)
def test_apply_with_vjp_is_apply_then_vjp(name, over, role, dtype):
    """The fused forward and pullback give apply's features and vjp's gradients, bit for bit (they do the
    same arithmetic; the affine maps keep the forward's intermediates instead of recomputing them)."""
    rng = np.random.default_rng(17)
    fmap = build(name, **over)
    x = inputs(rng, (2, 5, 4)).astype(dtype)
    kw = dict(role=role, causal=True, offset=3, total_length=16)
    feats, pullback = fmap.apply_with_vjp(x, **kw)
    want = fmap.apply(x, **kw)
    assert feats.dtype == want.dtype and np.array_equal(feats, want)
    g = rng.standard_normal(want.shape)
    dx, dparams = pullback(g)
    dx_want, dparams_want = fmap.vjp(x, g, **kw)
    assert dx.dtype == dx_want.dtype and np.array_equal(dx, dx_want)
    assert (dparams is None) == (dparams_want is None)
    for key in dparams_want or {}:
        assert np.array_equal(dparams[key], dparams_want[key]), key
    with pytest.raises(ValueError, match="grad_features"):
        pullback(g[..., :-1])


def test_apply_with_vjp_default_calls_apply_and_vjp():
    """A user map without an override gets apply now and vjp in the pullback (vjp errors surface there)."""
    class Plain(fm.FeatureMap):
        name = "plain-test"

        def transform(self, x):
            return np.asarray(x, dtype=np.float64) ** 2

    x = np.arange(6.0).reshape(3, 2)
    feats, pullback = Plain().apply_with_vjp(x, role="key")
    assert np.array_equal(feats, x ** 2)
    with pytest.raises(NotImplementedError, match="vjp"):
        pullback(np.ones_like(feats))


@pytest.mark.parametrize("name", AFFINE)
def test_apply_with_vjp_honours_a_subclass_override(name):
    """A subclass of hedgehog/t2r that overrides apply and vjp gets its own functions, not the fused path."""
    calls = []

    class Scaled(type(fm.get(name))):
        def apply(self, x, *, role, causal=False, offset=0, total_length=None):
            calls.append("apply")
            return 2.0 * super().apply(x, role=role, causal=causal, offset=offset, total_length=total_length)

        def vjp(self, x, g, **kw):
            calls.append("vjp")
            dx, dp = super().vjp(x, g, **kw)
            return 2.0 * dx, {key: 2.0 * val for key, val in dp.items()}

    phi = Scaled()
    x = inputs(np.random.default_rng(2), (3, 4))
    feats, pullback = phi.apply_with_vjp(x, role="key")
    assert np.array_equal(feats, 2.0 * fm.get(name).apply(x, role="key", causal=False))
    pullback(np.ones_like(feats))
    assert calls == ["apply", "vjp"]
