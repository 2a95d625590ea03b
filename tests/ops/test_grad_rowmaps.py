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


def _reference(x, g, silu):
    """Float64 NumPy features and VJP of ``l2``/``silu_l2``, SiLU from ``exp(-|y|)`` with its limits at +-inf."""
    y = x.astype(np.float64)
    with np.errstate(all="ignore"):
        if silu:
            e = np.exp(-np.abs(y))
            sig = np.where(y >= 0, 1 / (1 + e), e / (1 + e))
            sig_neg = np.where(y >= 0, e / (1 + e), 1 / (1 + e))
            s = np.where(np.isinf(y), np.where(y > 0, y, -0.0), y * sig)
            ds = np.where(np.isinf(y), (y > 0).astype(np.float64), sig * (1 + y * sig_neg))
            ds_terms = np.where(np.isinf(y), 1.0, sig * (1 + np.abs(y) * sig_neg))
        else:
            s, ds = y, np.ones_like(y)
            ds_terms = ds
        # each finite row scaled by a power of two (exact) so that no square overflows or underflows: a row
        # of 1e-300 or of SiLU(-710) (subnormal) still has its unit direction; |s| is |s'| 2^e
        mx = np.max(np.abs(s), axis=-1, keepdims=True)
        e = np.where(np.isfinite(mx), np.frexp(mx)[1], 0)
        s = np.ldexp(s, -e)
        nrm = np.sqrt(np.sum(s * s, axis=-1, keepdims=True))
        live = nrm > 0  # NaN rows and zero rows: zero features, zero gradient
        f = np.where(live, s / np.where(live, nrm, 1), 0.0)
        fg = np.sum(f * g, axis=-1, keepdims=True)
        dx = np.where(live, np.ldexp((g - f * fg) / np.where(live, nrm, 1), -e) * ds, 0.0)
        scale = np.where(live, np.ldexp((np.abs(g) + np.abs(f * fg)) / np.where(live, nrm, 1), -e) * ds_terms, 0.0)
    return f, dx, scale  # scale: the size of the terms of dx, for its rounding error


def _assert_close(got, want, scale, rtol):
    atol = np.finfo(got.dtype).tiny  # below it a float32 result underflows
    with np.errstate(over="ignore"):
        rounded = want.astype(got.dtype)  # above its range a float32 result is +-inf
    got = got.astype(np.float64)
    with np.errstate(invalid="ignore"):
        ok = (got == want) | (np.isnan(got) & np.isnan(want)) | (np.abs(got - want) <= rtol * scale + atol)
        ok |= np.isinf(rounded) & (got == rounded)
    bad = np.argwhere(~ok)
    assert not bad.size, [(tuple(i), got[tuple(i)], want[tuple(i)]) for i in bad[:5]]


@pytest.mark.parametrize("name", ["l2", "silu_l2"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_edge_values_match_a_float64_reference(name, dtype):
    # SiLU rows with an |x| above 700 take the scalar exp: -inf gives -0 (not -inf * 0), +inf the slope 1, and
    # exp(-710) is subnormal, not flushed (here it decides the features and gradient next to -300)
    rng = np.random.default_rng(5)
    D = 19  # a vector's remainder too
    rows = [np.zeros(D), np.full(D, 1e-300), np.full(D, -750.0), np.full(D, -710.0)]
    for v in (0.0, np.inf, -np.inf, np.nan, -710.0, -750.0, 1e-300, 1e30, -1e30, -699.0):
        for at in (0, D - 1):
            row = rng.standard_normal(D) * 3
            row[at] = v
            rows.append(row)
            tiny = np.full(D, -300.0)
            tiny[at] = v
            rows.append(tiny)
    x = np.array(rows).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    code = fm.get(name).kernel_code
    want_f, want_dx, scale = _reference(x, g.astype(np.float64), name == "silu_l2")
    feats, finite = _rowmaps.features(x, code, dtype)
    dx = _rowmaps.vjp(x, g, code, dtype)
    tol = 8 * np.finfo(dtype).eps
    _assert_close(feats, want_f, np.abs(want_f), tol)
    _assert_close(dx, want_dx, scale, tol)
    assert not finite
    for i, row in enumerate(x):
        assert _rowmaps.features(row[None], code, dtype)[1] == bool(np.isfinite(row).all()), i


@pytest.mark.parametrize("d", [4, 6, 13, 64])
def test_vjp_is_the_same_from_call_to_call(d):
    """Identical calls give identical bits (float64 SiLU+L2 rows of 4 to 13 features once came out
    different in the last bit on alternate calls, with the scratch rows' placement)."""
    code = fm.get("silu_l2").kernel_code
    rng = np.random.default_rng(d)
    x = rng.standard_normal((2, 300, d))
    g = rng.standard_normal(x.shape)
    first = _rowmaps.vjp(x, g, code, np.float64)
    for _ in range(5):
        np.testing.assert_array_equal(_rowmaps.vjp(x, g, code, np.float64), first)
