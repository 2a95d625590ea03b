"""softmax_attention: the blocked Numba kernel against a direct NumPy softmax."""
from __future__ import annotations

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb.ops._finite import NonFiniteResult
from linattn_nb.ops.softmax.cpu import softmax_blocked


def direct_softmax(q, k, v, causal, scale=None):
    """Softmax attention written out directly in float64 (no shared code with the package)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * np.einsum("...id,...jd->...ij", q, k)
    if causal:
        n = s.shape[-1]
        s = np.where(np.arange(n)[:, None] >= np.arange(n)[None, :], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-6)])
@pytest.mark.parametrize("n", [1, 2, 7, 64, 129])
def test_matches_direct_softmax(causal, dtype, tol, n, rng):
    q, k = (rng.standard_normal((2, 3, n, 5)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((2, 3, n, 4)).astype(dtype)
    out = la.softmax_attention(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == (2, 3, n, 4)
    np.testing.assert_allclose(out, direct_softmax(q, k, v, causal), rtol=tol * 10, atol=tol)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bq,bk", [(1, 1), (3, 5), (16, 7), (64, 64)])
def test_block_sizes_partial_blocks(causal, bq, bk, rng):
    """Several query and key blocks, partial last blocks, NaN-prefilled output."""
    q, k = (rng.standard_normal((3, 37, 6)) for _ in range(2))
    v = rng.standard_normal((3, 37, 9))
    out = np.full((3, 37, 9), np.nan)
    softmax_blocked(q, k, v, out, causal=causal, scale=0.4, block_q=bq, block_k=bk)
    np.testing.assert_allclose(out, direct_softmax(q, k, v, causal, scale=0.4), rtol=1e-12, atol=1e-12)


def test_large_logits_are_stable():
    """Scores of +-1e4: the running max keeps exp finite."""
    q = np.array([[100.0, 0.0], [0.0, -100.0], [50.0, 50.0]])
    k = q.copy()
    v = np.arange(6.0).reshape(3, 2)
    for causal in (False, True):
        out = la.softmax_attention(q, k, v, causal=causal, scale=1.0)
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, direct_softmax(q, k, v, causal, scale=1.0), atol=1e-12)


def test_scale_default_and_explicit(rng):
    q, k, v = (rng.standard_normal((10, 16)) for _ in range(3))
    np.testing.assert_allclose(la.softmax_attention(q, k, v), la.softmax_attention(q, k, v, scale=0.25))
    np.testing.assert_allclose(la.softmax_attention(q, k, v, scale=2.0), direct_softmax(q, k, v, False, 2.0))


def test_quadratic_method_and_float16(rng):
    q, k, v = (rng.standard_normal((20, 8)) for _ in range(3))
    ref = direct_softmax(q, k, v, True)
    np.testing.assert_allclose(la.softmax_attention(q, k, v, causal=True, method="quadratic"), ref, atol=1e-12)
    out16 = la.softmax_attention(*(x.astype(np.float16) for x in (q, k, v)), causal=True)
    assert out16.dtype == np.float16
    np.testing.assert_allclose(out16, ref, atol=5e-3)


def test_empty_and_errors():
    assert la.softmax_attention(np.zeros((2, 0, 3)), np.zeros((2, 0, 3)), np.zeros((2, 0, 4))).shape == (2, 0, 4)
    x = np.ones((4, 3))
    with pytest.raises(ValueError, match="same sequence length"):
        la.softmax_attention(x, np.ones((5, 3)), np.ones((5, 3)))
    with pytest.raises(TypeError, match="k must have dtype"):
        la.softmax_attention(x, x.astype(int), x)
    with pytest.raises(ValueError, match="scale must be finite"):
        la.softmax_attention(x, x, x, scale=np.inf)
    with pytest.raises(TypeError, match="scale must be a real number"):
        la.softmax_attention(x, x, x, scale="big")
    with pytest.raises(ValueError, match="unknown method"):
        la.softmax_attention(x, x, x, method="flash")
    bad = x.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="v contains 1 non-finite"):
        la.softmax_attention(x, x, bad)
    with pytest.raises(ValueError, match="block sizes"):
        softmax_blocked(x[None], x[None], x[None], np.empty((1, 4, 3)), causal=False, scale=1.0, block_q=0)


@pytest.mark.parametrize("method", ["blocked", "quadratic"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_scores_overflowing_float64_raise_for_every_dtype(method, dtype, rng):
    """Scores beyond float64 (scale=1e308, |q|, |k| ~ 10): float32/float16 inputs with the blocked kernel
    returned all NaN (the float64 retry was not checked); every dtype and method raises NonFiniteResult."""
    q, k, v = (rng.standard_normal((8, 4)) for _ in range(3))
    with pytest.raises(NonFiniteResult, match="not finite even in float64"):
        la.softmax_attention((10 * q).astype(dtype), (10 * k).astype(dtype), v.astype(dtype), scale=1e308,
                             method=method)
    out = la.softmax_attention((10 * q).astype(dtype), (10 * k).astype(dtype), v.astype(dtype), scale=1e308,
                               method=method, check_finite=False)
    assert out.dtype == dtype and out.shape == (8, 4)


@pytest.mark.parametrize("causal", [False, True])
def test_quadratic_scales_q_before_the_product(causal, rng):
    """q, k ~ 1e160 with scale=1e-300: the scores (~1e20) are representable but q . k is not; the quadratic
    reference formed q . k first and raised NonFiniteResult, while the blocked kernel scales q first."""
    q, k, v = (rng.standard_normal((6, 2)) for _ in range(3))
    Q, K, scale = q * 1e160, k * 1e160, 1e-300
    ref = direct_softmax(scale * Q, K, v, causal, scale=1.0)
    assert np.isfinite(ref).all()
    for method in ("blocked", "quadratic"):
        np.testing.assert_allclose(la.softmax_attention(Q, K, v, causal=causal, scale=scale, method=method), ref,
                                   rtol=1e-12, atol=1e-12)


def test_scale_too_large_for_a_float():
    """scale=10**400 raised a bare OverflowError from float(); now the ValueError naming scale."""
    x = np.ones((4, 3))
    with pytest.raises(ValueError, match="scale must be finite, got .*too large for a float"):
        la.softmax_attention(x, x, x, scale=10**400)
    with pytest.raises(ValueError, match="scale must be finite"):
        la.softmax_attention(x, x, x, scale=-10**400)


def test_method_type_error_as_linear_attention():
    """method=None raised ValueError in softmax_attention, TypeError in linear_attention: both TypeError."""
    x = np.ones((4, 3))
    for f in (la.softmax_attention, la.linear_attention):
        with pytest.raises(TypeError, match="method must be a string, got NoneType"):
            f(x, x, x, method=None)
