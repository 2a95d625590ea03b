"""The compiled Taylor-2 and DPFP rows against the NumPy forms (their reference): features bit for bit, the VJP
to float64 round-off, on edge shapes (d = 1, 2, rows across task boundaries, batch dimensions, a
non-contiguous input) and dtypes, and float16 on the NumPy path."""
from __future__ import annotations

import numpy as np
import pytest

from linattn_nb import feature_maps


@pytest.mark.parametrize("shape", [(1, 1), (3, 2), (33, 5), (2, 7, 8), (65, 16)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_features_equal_the_numpy_form(rng, shape, dtype):
    phi = feature_maps.get("taylor2")
    x = (rng.standard_normal(shape) * 2).astype(dtype)
    got = phi(x)
    ref = phi._transform_numpy(x)
    assert got.dtype == dtype and got.shape == shape[:-1] + (phi.output_dim(shape[-1]),)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("shape", [(1, 1), (3, 2), (33, 5), (2, 7, 8)])
@pytest.mark.parametrize("xdt, gdt", [(np.float64, np.float64), (np.float32, np.float64), (np.float32, np.float32)])
def test_vjp_equals_the_numpy_form(rng, shape, xdt, gdt):
    phi = feature_maps.get("taylor2", scale=0.7)
    x = rng.standard_normal(shape).astype(xdt)
    g = rng.standard_normal(shape[:-1] + (phi.output_dim(shape[-1]),)).astype(gdt)
    dx, dp = phi.vjp(x, g, role="key")
    out = np.result_type(xdt, gdt, np.float32)
    ref, _ = phi._vjp_numpy(x, g.astype(np.float64), out, np.sqrt(0.7))
    assert dp is None and dx.dtype == out and dx.shape == shape
    np.testing.assert_allclose(dx, ref, rtol=1e-6 if out == np.float32 else 1e-13,
                               atol=1e-13 * np.abs(ref).max())


def test_vjp_is_the_gradient(rng):
    """Against central differences of <phi(x), g> in float64."""
    phi = feature_maps.get("taylor2")
    x = rng.standard_normal((4, 6))
    g = rng.standard_normal((4, phi.output_dim(6)))
    dx, _ = phi.vjp(x, g, role="query")
    e = rng.standard_normal(x.shape)
    h = 1e-6
    num = ((phi(x + h * e) * g).sum() - (phi(x - h * e) * g).sum()) / (2 * h)
    assert abs((dx * e).sum() - num) <= 1e-7 * max(1.0, abs(num))


def test_non_contiguous_and_float16(rng):
    phi = feature_maps.get("taylor2")
    x = rng.standard_normal((6, 10))[:, ::2]
    np.testing.assert_array_equal(phi(x), phi._transform_numpy(x))
    h = x.astype(np.float16)
    f = phi(h)
    assert f.dtype == np.float16
    np.testing.assert_array_equal(f, phi._transform_numpy(h))
    dx, _ = phi.vjp(h, np.ones(f.shape, np.float16), role="key")
    assert dx.dtype == np.float32 and np.isfinite(dx).all()


@pytest.mark.parametrize("nu", [1, 2, 3])
@pytest.mark.parametrize("shape", [(1, 2), (33, 5), (2, 7, 8)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_dpfp_rows_equal_the_numpy_forms(rng, nu, shape, dtype):
    """DPFP's features and VJP bit for bit (the same operations in the same order), with zeros, a NaN
    and g in float32 and float64."""
    phi = feature_maps.get("dpfp", nu=nu)
    x = rng.standard_normal(shape).astype(dtype)
    x.reshape(-1)[:2] = 0.0
    np.testing.assert_array_equal(phi(x), phi._transform_numpy(x))
    for gdt in (np.float64, np.float32):
        g = rng.standard_normal(shape[:-1] + (phi.output_dim(shape[-1]),)).astype(gdt)
        dx, dp = phi.vjp(x, g, role="query")
        out = np.result_type(dtype, gdt, np.float32)
        ref, _ = phi._vjp_numpy(x, g.astype(np.float64), out)
        assert dp is None and dx.dtype == out
        np.testing.assert_array_equal(dx, ref)
    x.reshape(-1)[-1] = np.nan
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(phi(x), phi._transform_numpy(x))


def test_dpfp_float16_and_nu_check(rng):
    phi = feature_maps.get("dpfp", nu=2)
    h = rng.standard_normal((3, 4)).astype(np.float16)
    np.testing.assert_array_equal(phi(h), phi._transform_numpy(h))
    with pytest.raises(ValueError, match="nu"):
        feature_maps.get("dpfp", nu=4)(rng.standard_normal((3, 2)))
