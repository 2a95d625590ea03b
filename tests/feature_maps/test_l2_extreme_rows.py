"""The L2 row maps at the ends of float64's range: every finite non-zero row maps to its unit direction.

Rows whose float64 squares overflow (entries above about 1e154) or underflow (below about 1e-154, and
subnormal rows) gave a zero row in the NumPy map and in the gradient front end's row maps, and a
subnormal row gave NaN in the forward kernels, while moderate rows normalised.  Scaling a row by a power
of two changes neither ``s / |s|`` nor its rounding, so the checks below are exact: the features of
``2^k r`` are those of ``r``, and the VJP of ``l2`` scales by ``2^-k``.  The rows hold small integers,
so ``2^k r`` is exact even among the subnormals.
"""
import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import feature_maps as fm
from linattn_nb.ops.grad import _rowmaps
from linattn_nb.ops.step.cpu import phi_row

_ROWS = np.array([[3.0, -1.0, 2.0, 5.0], [0.0, 0.0, -7.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
#: powers of two: subnormal entries, squares that underflow, squares that overflow
_POWERS = [-1068, -600, -520, 520, 600, 1000]


def _scaled(k):
    x = np.ldexp(_ROWS, k)
    assert np.array_equal(np.ldexp(x, -k), _ROWS)  # exact
    return x


@pytest.mark.parametrize("k", _POWERS)
def test_numpy_map_features_do_not_depend_on_the_scale(k):
    fmap = fm.get("l2")
    want = fmap.transform(_ROWS)
    got = fmap.transform(_scaled(k))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, rtol=4e-16)


@pytest.mark.parametrize("k", [-600, -520, 520, 600, 1000])
def test_numpy_map_vjp_scales_by_the_inverse_power(k):
    fmap = fm.get("l2")
    g = np.array([[0.5, -1.0, 2.0, 0.25], [1.0, 3.0, -2.0, 0.5], [-1.0, 0.0, 2.0, 1.0]])
    want, _ = fmap.vjp(_ROWS, g, role="key")
    got, _ = fmap.vjp(_scaled(k), g, role="key")
    assert np.isfinite(got).all() and np.abs(got).max() > 0
    np.testing.assert_array_equal(got, np.ldexp(want, -k))


@pytest.mark.parametrize("k", _POWERS)
def test_row_kernels_match_the_numpy_map(k):
    """The gradient front end's compiled rows: features, and for ``l2`` the VJP, as the NumPy map's."""
    code = fm.get("l2").kernel_code
    x = _scaled(k)
    feats, finite = _rowmaps.features(x, code, np.float64)
    assert finite
    np.testing.assert_array_equal(feats, fm.get("l2").transform(_ROWS))
    if k > -1000:  # a subnormal row's gradient (about 2^1068) overflows float64
        g = np.array([[0.5, -1.0, 2.0, 0.25], [1.0, 3.0, -2.0, 0.5], [-1.0, 0.0, 2.0, 1.0]])
        want, _ = fm.get("l2").vjp(x, g, role="key")
        got = _rowmaps.vjp(x, g, code, np.float64)
        assert np.abs(got).max() > 0
        np.testing.assert_allclose(got, want, rtol=8e-16, atol=0)


@pytest.mark.parametrize("name", ["l2", "silu_l2"])
@pytest.mark.parametrize("k", [-1068, -600])
def test_silu_rows_of_tiny_values_normalise(name, k):
    """``silu_l2`` of tiny rows: SiLU(y) = y / 2 to float64's precision there, so the features are the
    row's direction; the compiled rows and the decode step's row agree with the NumPy map."""
    fmap = fm.get(name)
    x = _scaled(k)
    want = fmap.transform(x)
    np.testing.assert_allclose(want, fm.get("l2").transform(_ROWS), rtol=0, atol=4e-16)
    feats, _ = _rowmaps.features(x, fmap.kernel_code, np.float64)
    np.testing.assert_allclose(feats, want, rtol=0, atol=4e-16)
    for r in range(x.shape[0]):
        out = np.empty(x.shape[1])
        phi_row(x[r], out, fmap.kernel_code)
        np.testing.assert_allclose(out, want[r], rtol=0, atol=4e-16)


@pytest.mark.parametrize("k", _POWERS)
def test_decode_step_row_does_not_depend_on_the_scale(k):
    """The decode step's row (its division may be taken as a product by the reciprocal: within an ulp)."""
    code = fm.get("l2").kernel_code
    x = _scaled(k)
    want = fm.get("l2").transform(_ROWS)
    for r in range(x.shape[0]):
        out = np.empty(x.shape[1])
        phi_row(x[r], out, code)
        np.testing.assert_allclose(out, want[r], rtol=0, atol=2.3e-16)


@pytest.mark.parametrize("method", ["scan", "chunked"])
@pytest.mark.parametrize("k", [-1068, -600, 600])
def test_attention_and_gradients_do_not_depend_on_a_row_scale(method, k):
    """Forward kernels and ``linear_attention_vjp`` with one key and one query scaled by ``2^k``: the
    output and ``dv`` are those of the unscaled inputs (``l2`` sees only the directions); ``dk`` of the
    scaled row is ``2^-k`` times the unscaled one's."""
    rng = np.random.default_rng(0)
    q = rng.integers(-4, 5, (1, 6, 4)).astype(np.float64)
    k_ = rng.integers(-4, 5, (1, 6, 4)).astype(np.float64)
    q[0, 0] = k_[0, 0] = 1.0  # no zero rows
    v = rng.standard_normal((1, 6, 4))
    q2, k2 = q.copy(), k_.copy()
    k2[0, 2] = np.ldexp(k_[0, 2], k)
    q2[0, 3] = np.ldexp(q[0, 3], k)
    kw = dict(feature_map="l2", causal=True, beta=np.full((1, 6), 0.5), method=method)
    np.testing.assert_array_equal(la.linear_attention(q2, k2, v, **kw), la.linear_attention(q, k_, v, **kw))
    if k < -1000:
        return  # the gradient of a subnormal row overflows float64
    g = rng.standard_normal(v.shape)
    got = la.linear_attention_vjp(q2, k2, v, g, **kw)
    want = la.linear_attention_vjp(q, k_, v, g, **kw)
    np.testing.assert_allclose(got.dv, want.dv, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(np.ldexp(got.dk[0, 2], k), want.dk[0, 2], rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(np.ldexp(got.dq[0, 3], k), want.dq[0, 3], rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("method", ["scan", "chunked"])
@pytest.mark.parametrize("k", [-1068, -600, 600])
def test_dplr_attention_and_gradients_do_not_depend_on_a_row_scale(method, k):
    """As above for a diagonal-plus-low-rank rule (KDA) on its own kernels and row maps."""
    from linattn_nb.dplr import dplr_attention, dplr_attention_vjp

    rng = np.random.default_rng(1)
    q = rng.integers(-4, 5, (6, 4)).astype(np.float64)
    k_ = rng.integers(-4, 5, (6, 4)).astype(np.float64)
    q[0] = k_[0] = 1.0
    v = rng.standard_normal((6, 4))
    q2, k2 = q.copy(), k_.copy()
    k2[2] = np.ldexp(k_[2], k)
    q2[3] = np.ldexp(q[3], k)
    kw = dict(rule="kda", decay=np.full((6, 4), 0.9), beta=np.full(6, 0.5), feature_map="l2", method=method)
    np.testing.assert_allclose(dplr_attention(q2, k2, v, **kw), dplr_attention(q, k_, v, **kw), rtol=0, atol=1e-15)
    if k < -1000:
        return
    g = rng.standard_normal(v.shape)
    got, want = dplr_attention_vjp(q2, k2, v, g, **kw), dplr_attention_vjp(q, k_, v, g, **kw)
    np.testing.assert_allclose(got.dv, want.dv, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(np.ldexp(got.dk[2], k), want.dk[2], rtol=1e-13, atol=1e-14)


def test_silu_l2_numpy_map_at_minus_infinity():
    """SiLU(-inf) is -0 (its limit), as in the kernels: a row with one -inf entry keeps the direction of
    the others, with no NaN (the map gave NaN there)."""
    x = np.array([[-np.inf, 3.0, -1.0, 2.0]])
    fmap = fm.get("silu_l2")
    got = fmap.transform(x)
    rest = fmap.transform(np.array([[-800.0, 3.0, -1.0, 2.0]]))  # SiLU(-800) = -0 as well
    np.testing.assert_array_equal(got, rest)
    feats, finite = _rowmaps.features(x, fmap.kernel_code, np.float64)
    assert not finite
    np.testing.assert_allclose(feats, got, rtol=0, atol=4e-16)


@pytest.mark.parametrize("name", ["l2", "silu_l2"])
def test_a_nan_row_gives_nan_features_and_gradient_as_the_kernels_do(name):
    """A NaN norm is not a zero norm: the row's features and gradient stay NaN (they were 0), as the
    compiled kernels' outputs are; a zero row still has zero features and a zero gradient."""
    fmap = fm.get(name)
    x = np.array([[np.nan, 1.0, 2.0], [0.1, 0.2, 0.3], [0.0, 0.0, 0.0]])
    f = fmap(x)
    assert np.isnan(f[0]).all() and np.isfinite(f[1]).all() and np.array_equal(f[2], np.zeros(3))
    dx = fmap.vjp(x, np.ones((3, 3)), role="key")[0]
    assert np.isnan(dx[0]).all() and np.isfinite(dx[1]).all() and np.array_equal(dx[2], np.zeros(3))
    out = la.linear_attention(x[None], x[None], np.ones((1, 3, 2)), feature_map=name, causal=True, check_finite=False,
                           method="scan")
    assert np.isnan(out[0, 0]).all()
