"""The gradient front end's parallel row maps (``l2``, ``silu_l2``) against the NumPy maps."""
import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import feature_maps as fm
from linattn_nb.ops.grad import _rowmaps


@pytest.mark.parametrize("name", ["l2", "silu_l2"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_features_and_vjp_match_the_numpy_map(name, dtype):
    rng = np.random.default_rng(3)
    fmap = fm.get(name)
    x = (rng.standard_normal((2, 3, 9, 6)) * 3).astype(dtype)
    x[0, 0, 0] = 0  # a zero row: zero features, zero gradient
    x[1, 2, 3] = -60  # SiLU of it underflows to -0 in every entry: a zero row after the map
    work = np.float64 if dtype == np.float64 else np.float32
    xw = x.astype(work)
    feats, finite = _rowmaps.features(x, fmap.kernel_code, work)
    assert finite and feats.dtype == work and feats.shape == x.shape
    np.testing.assert_allclose(feats, fmap.apply(xw, role="key", causal=True), rtol=0, atol=4 * np.finfo(work).eps)
    g = rng.standard_normal(x.shape).astype(work)
    dx = _rowmaps.vjp(xw, g, fmap.kernel_code, work)
    ref, _ = fmap.vjp(xw, g, role="key", causal=True)
    assert dx.dtype == work
    np.testing.assert_allclose(dx, ref, rtol=0, atol=8 * np.finfo(work).eps * np.abs(ref).max())
    assert not dx[0, 0, 0].any()


def test_non_finite_rows_are_reported():
    x = np.ones((2, 4))
    x[1, 2] = np.nan
    _, finite = _rowmaps.features(x, fm.get("l2").kernel_code, np.float64)
    assert not finite


def test_vjp_names_a_non_finite_key():
    rng = np.random.default_rng(0)
    q, k, v, g = rng.standard_normal((4, 1, 8, 4))
    k[0, 5, 1] = np.inf
    with pytest.raises(ValueError, match="k"):
        la.linear_attention_vjp(q, k, v, g, causal=True, beta=0.5, feature_map="l2")
