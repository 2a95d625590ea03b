"""Feature-map base class and registry; the elementwise maps and DPFP."""
from __future__ import annotations

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import feature_maps as fm


def test_builtin_names_registered():
    names = fm.available()
    for name in ("elu", "relu", "identity", "squared_relu", "dpfp"):
        assert name in names
    assert names == sorted(names)


def test_get_unknown_lists_available():
    with pytest.raises(KeyError, match="unknown feature map 'nope'; available: .*elu"):
        fm.get("nope")


def test_register_user_map_and_overwrite():
    class Cube(fm.FeatureMap):
        """phi(x) = x**3 (odd, signed)."""

        name = "cube_test"

        def transform(self, x):
            return x ** 3

    fm.register("cube_test", Cube, overwrite=True)
    try:
        assert "cube_test" in fm.available()
        with pytest.raises(ValueError, match="already registered"):
            fm.register("cube_test", Cube)
        x = np.array([[1.0, 2.0]])
        np.testing.assert_array_equal(fm.get("cube_test")(x), x ** 3)
        out = la.linear_attention(x + 1, x + 1, x, feature_map="cube_test")
        np.testing.assert_allclose(out, x)
    finally:
        fm._REGISTRY.pop("cube_test", None)
    with pytest.raises(ValueError, match="non-empty"):
        fm.register("", Cube)
    with pytest.raises(TypeError, match="name must be a non-empty string, got int 3"):
        fm.register(3, Cube)
    with pytest.raises(TypeError, match="callable"):
        fm.register("x_test", 3)
    fm.register("bad_factory_test", lambda: 3)
    try:
        with pytest.raises(TypeError, match="not a FeatureMap"):
            fm.get("bad_factory_test")
    finally:
        fm._REGISTRY.pop("bad_factory_test", None)


def test_resolve():
    assert isinstance(fm.resolve(None), fm.IdentityFeatureMap)
    m = fm.get("relu")
    assert fm.resolve(m) is m
    assert fm.resolve("elu").name == "elu"


def test_feature_map_input_checks():
    with pytest.raises(TypeError, match="floating point"):
        fm.get("elu")(np.arange(3))
    with pytest.raises(ValueError, match="at least 1 dimension"):
        fm.get("elu")(np.float64(1.0))


@pytest.mark.parametrize("name", ["elu", "relu", "squared_relu", "identity"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_elementwise_maps_keep_dtype_and_match_kernels(name, dtype, rng):
    """The NumPy transform and the kernels' inline code give the same attention."""
    x = rng.standard_normal((3, 17, 5)).astype(dtype)
    f = fm.get(name)
    assert f(x).dtype == dtype and f(x).shape == x.shape and f.output_dim(5) == 5
    v = rng.standard_normal((3, 17, 2)).astype(dtype)
    q = k = np.abs(x) + 0.1 if name == "identity" else x
    inline = la.linear_attention(q, k, v, feature_map=name, causal=True, method="scan")
    numpy_side = la.linear_attention(f(q), f(k), v, feature_map=None, causal=True, method="scan")
    np.testing.assert_allclose(inline, numpy_side, rtol=1e-5 if dtype == np.float32 else 1e-13, atol=1e-6)


def test_elementwise_values():
    x = np.array([-2.0, -0.0, 0.0, 0.5, np.nan])
    np.testing.assert_allclose(fm.get("elu")(x)[:4], [np.exp(-2.0), 1.0, 1.0, 1.5])
    np.testing.assert_allclose(fm.get("relu")(x)[:4], [0.0, 0.0, 0.0, 0.5])
    np.testing.assert_allclose(fm.get("squared_relu")(x)[:4], [0.0, 0.0, 0.0, 0.25])
    for name in ("elu", "relu", "squared_relu", "identity"):
        assert np.isnan(fm.get(name)(x)[4]), f"{name} must propagate NaN"


def test_nan_propagates_through_inline_kernel_maps():
    q = np.array([[np.nan, 1.0], [0.5, 0.5]])
    v = np.ones((2, 1))
    for name in ("elu", "relu", "squared_relu"):
        out = la.linear_attention(q, np.ones((2, 2)), v, feature_map=name, causal=True, check_finite=False)
        assert np.isnan(out[0]).all() and np.isfinite(out[1]).all(), name


def test_elu_no_overflow_warning():
    with np.errstate(over="raise"):
        assert np.isfinite(fm.get("elu")(np.array([1e308, -1e308, 800.0]))).all()


@pytest.mark.parametrize("nu", [1, 2, 3])
def test_dpfp_against_definition(nu, rng):
    """DPFP (Schlag et al. 2021, §5.4): r = relu([x, -x]); phi_{i,j} = r_i r_{(i+j) mod 2d}, j = 1..nu."""
    d = 4
    x = rng.standard_normal((6, d))
    f = fm.get("dpfp", nu=nu)
    assert f.output_dim(d) == 2 * d * nu
    out = f(x)
    assert out.shape == (6, 2 * d * nu)
    for t in range(6):
        r = np.maximum(np.concatenate([x[t], -x[t]]), 0)
        expected = [r[i] * r[(i + j) % (2 * d)] for j in range(1, nu + 1) for i in range(2 * d)]
        np.testing.assert_allclose(out[t], expected)
    assert (out >= 0).all()


def test_dpfp_parameter_errors():
    with pytest.raises(ValueError, match="nu must be an integer >= 1"):
        fm.get("dpfp", nu=0)
    with pytest.raises(ValueError, match="nu=8 must be smaller than 2\\*D=8"):
        fm.get("dpfp", nu=8)(np.ones((2, 4)))


def test_a_parameter_the_map_does_not_take_is_named_with_those_it_does():
    """Not a private class's constructor error: the map's name, the bad parameter, the parameters it takes."""
    with pytest.raises(TypeError, match=r"'hedgehog' takes no parameter\(s\) \['dim'\]; its parameters: W, b"):
        fm.get("hedgehog", dim=4)
    with pytest.raises(TypeError, match=r"map 'elu' takes no parameter\(s\) \['bogus'\]; its parameters: none"):
        fm.get("elu", bogus=1)
    with pytest.raises(TypeError, match=r"'favor\+' takes no parameter\(s\) \['nu'\]; its parameters: dim, "):
        fm.get("favor+", dim=4, nu=2)
    assert fm.get("dpfp", nu=2).nu == 2  # the parameters a map takes still pass


@pytest.mark.parametrize("name", ["favor+", "rff"])
@pytest.mark.parametrize("seed, err", [(-1, ValueError), (1.5, TypeError), ("a", TypeError)])
def test_a_bad_seed_is_named(name, seed, err):
    with pytest.raises(err, match=r"seed must be None, a non-negative integer.*got"):
        fm.get(name, dim=4, num_features=4, seed=seed)
    fmap = fm.get(name, dim=4, num_features=4, seed=3)
    with pytest.raises(err, match=r"seed must be None"):
        fmap.redraw(seed=seed)
    assert fmap.seed == 3  # a refused redraw leaves the map as it was


def test_apply_takes_the_same_keywords_for_every_map():
    """``apply(x, role=...)`` works for every registered map (``causal`` defaults to False everywhere, as the
    maps that override ``apply`` already had it); the base class required it."""
    import inspect

    x = np.random.default_rng(0).standard_normal((2, 5, 4))
    for name in fm.available():
        m = fm.get(name, dim=4, seed=0) if "dim" in inspect.signature(type(fm.get(name)).__init__).parameters \
            else fm.get(name)
        sig = inspect.signature(m.apply)
        assert sig.parameters["causal"].default is False, name
        np.testing.assert_array_equal(m.apply(x, role="query"), m.apply(x, role="query", causal=False),
                                      err_msg=name)
