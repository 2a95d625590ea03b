"""Spectral tools: singular values, numerical / effective / stable rank, cumulative spectrum."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn_nb.analysis import (
    cumulative_spectrum,
    effective_rank,
    numerical_rank,
    singular_values,
    stable_rank,
)


def _low_rank(rng, batch, m, n, r, dtype=np.float64):
    a = rng.normal(size=batch + (m, r)) @ rng.normal(size=batch + (r, n))
    return a.astype(dtype)


# ---------------------------------------------------------------------------
# singular_values
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (1, 1), (2, 4, 6, 6), (3, 1, 7)])
def test_singular_values_match_numpy(rng, shape):
    a = rng.normal(size=shape)
    s = singular_values(a)
    assert s.shape == shape[:-2] + (min(shape[-2:]),)
    np.testing.assert_allclose(s, np.linalg.svd(a, compute_uv=False), rtol=1e-12, atol=1e-12)
    assert np.all(np.diff(s, axis=-1) <= 0)  # descending


def test_singular_values_empty_and_dtypes(rng):
    assert singular_values(np.zeros((3, 0, 4))).shape == (3, 0)
    assert singular_values(np.zeros((0, 2, 2))).shape == (0, 2)
    a = rng.normal(size=(6, 4))
    assert singular_values(a.astype(np.float32)).dtype == np.float32
    s16 = singular_values(a.astype(np.float16))  # LAPACK has no half: computed in float32
    assert s16.dtype == np.float32
    np.testing.assert_allclose(s16, np.linalg.svd(a, compute_uv=False), rtol=2e-3, atol=2e-3)
    # read-only, non-contiguous input
    b = np.asfortranarray(rng.normal(size=(5, 7)))[:, ::2]
    b.flags.writeable = False
    np.testing.assert_allclose(singular_values(b), np.linalg.svd(b, compute_uv=False))


def test_singular_values_errors():
    with pytest.raises(TypeError, match="A must have dtype"):
        singular_values(np.eye(3, dtype=np.int64))
    with pytest.raises(TypeError, match="A must have dtype"):
        singular_values(np.eye(3, dtype=np.complex128))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        singular_values(np.ones(3))
    a = np.eye(3)
    a[1, 2] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        singular_values(a)


# ---------------------------------------------------------------------------
# numerical_rank
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numerical_rank_matches_matrix_rank(rng, dtype):
    """NumPy/LAPACK convention: sigma > max(m, n) * eps * sigma_max, eps of the working dtype."""
    mats = [_low_rank(rng, (), 20, 12, r, dtype) for r in (0, 1, 5, 12)]
    mats.append((np.eye(7) * np.array([1, 1, 1, 1e-30, 1, 1, 0])).astype(dtype))
    for a in mats:
        assert numerical_rank(a) == np.linalg.matrix_rank(a)
    batch = _low_rank(rng, (2, 3), 9, 9, 4, dtype)
    got = numerical_rank(batch)
    assert got.shape == (2, 3) and got.dtype == np.int64
    np.testing.assert_array_equal(got, np.linalg.matrix_rank(batch))
    assert set(np.unique(got)) == {4}


def test_numerical_rank_rtol(rng):
    a = np.diag([1.0, 1e-3, 1e-6, 0.0])
    assert numerical_rank(a) == 3
    assert numerical_rank(a, 1e-4) == 2
    assert numerical_rank(a, 1e-2) == 1
    np.testing.assert_array_equal(numerical_rank(np.stack([a, a, a]), np.array([1e-2, 1e-4, 1e-9])), [1, 2, 3])
    assert numerical_rank(a, 0.0) == 3  # strict inequality: the zero never counts
    with pytest.raises(ValueError, match="rtol"):
        numerical_rank(a, -1.0)
    with pytest.raises(ValueError, match="broadcast"):
        numerical_rank(np.stack([a, a]), np.ones(3))
    with pytest.raises(TypeError, match="rtol"):
        numerical_rank(a, True)


def test_numerical_rank_rtol_must_broadcast_to_the_batch_shape():
    """A single matrix with rtol=[1e-12] returned array([3]) where a Python int is documented: an rtol that
    would grow the batch shape raises ValueError naming rtol; a 0-d one gives the int."""
    a = np.eye(3)
    with pytest.raises(ValueError, match=r"rtol of shape \(1,\) does not broadcast to the batch shape \(\)"):
        numerical_rank(a, rtol=[1e-12])
    with pytest.raises(ValueError, match=r"rtol of shape \(2, 2\) does not broadcast to the batch shape \(2,\)"):
        numerical_rank(np.stack([a, a]), np.ones((2, 2)))
    r = numerical_rank(a, rtol=np.array(1e-12))
    assert r == 3 and type(r) is int
    np.testing.assert_array_equal(numerical_rank(np.stack([a, a]), [1e-12]), [3, 3])


def test_numerical_rank_edges():
    assert numerical_rank(np.zeros((4, 4))) == 0
    assert numerical_rank(np.zeros((0, 3))) == 0
    assert numerical_rank(np.ones((1, 1))) == 1
    assert numerical_rank(np.ones((5, 3))) == 1


# ---------------------------------------------------------------------------
# effective, stable rank, cumulative spectrum
# ---------------------------------------------------------------------------
def test_effective_rank_definition(rng):
    """Roy & Vetterli 2007, Def. 1: erank = exp(-sum p_i log p_i), p_i = sigma_i / ||sigma||_1."""
    assert effective_rank(np.eye(6)) == pytest.approx(6.0)
    assert effective_rank(np.outer(np.arange(1.0, 5), np.ones(3))) == pytest.approx(1.0)
    assert effective_rank(np.diag([1.0, 1.0, 0.0])) == pytest.approx(2.0)
    assert effective_rank(np.zeros((3, 3))) == 0.0
    a = rng.normal(size=(4, 10, 7))
    s = np.linalg.svd(a, compute_uv=False)
    p = s / s.sum(-1, keepdims=True)
    want = np.exp(-(p * np.log(p)).sum(-1))
    np.testing.assert_allclose(effective_rank(a), want, rtol=1e-12)
    # spectrum=True: any order, same result
    np.testing.assert_allclose(effective_rank(s[..., ::-1], spectrum=True), want, rtol=1e-12)
    with pytest.raises(ValueError, match=">= 0"):
        effective_rank(np.array([1.0, -1.0]), spectrum=True)
    with pytest.raises(ValueError, match="at least 1 dimension"):
        effective_rank(np.float64(1.0), spectrum=True)


@settings(max_examples=25)
@given(m=st.integers(1, 8), n=st.integers(1, 8), r=st.integers(0, 8), seed=st.integers(0, 2**31))
def test_rank_measures_are_ordered(m, n, r, seed):
    """Effective and stable rank lie in [1, rank] (Roy & Vetterli 2007, §2: 1 <= erank <= rank); 0 for A = 0."""
    rng = np.random.default_rng(seed)
    a = _low_rank(rng, (), m, n, min(r, m, n))
    rk = numerical_rank(a)
    er, sr = effective_rank(a), stable_rank(a)
    if rk == 0:
        assert er == 0.0 and sr == 0.0
    else:
        assert 1.0 - 1e-9 <= er <= rk + 1e-9
        assert 1.0 - 1e-9 <= sr <= rk + 1e-9


def test_stable_rank(rng):
    a = rng.normal(size=(3, 8, 5))
    want = np.linalg.norm(a, axis=(-2, -1)) ** 2 / np.linalg.norm(a, ord=2, axis=(-2, -1)) ** 2
    np.testing.assert_allclose(stable_rank(a), want, rtol=1e-12)
    assert stable_rank(np.zeros((2, 2))) == 0.0
    assert stable_rank(np.array([2.0, 2.0, 0.0]), spectrum=True) == pytest.approx(2.0)


def test_cumulative_spectrum(rng):
    """Linformer (Wang et al. 2020), Fig. 1: normalised cumulative singular values, rising to 1."""
    a = rng.normal(size=(2, 12, 9))
    c = cumulative_spectrum(a)
    assert c.shape == (2, 9)
    assert np.all(np.diff(c, axis=-1) >= 0)
    np.testing.assert_allclose(c[..., -1], 1.0)
    s = np.linalg.svd(a, compute_uv=False)
    np.testing.assert_allclose(c, np.cumsum(s, -1) / s.sum(-1, keepdims=True), rtol=1e-12)
    # squared=True: fraction of ||A||_F^2 kept by the best rank-k approximation (Eckart-Young)
    u, s0, vt = np.linalg.svd(a[0])
    cs = cumulative_spectrum(a[0], squared=True)
    for k in (1, 4, 9):
        ak = (u[:, :k] * s0[:k]) @ vt[:k]
        kept = 1 - np.linalg.norm(a[0] - ak) ** 2 / np.linalg.norm(a[0]) ** 2
        assert cs[k - 1] == pytest.approx(kept, rel=1e-10)
    # a rank-2 matrix reaches 1 after two values
    c2 = cumulative_spectrum(_low_rank(rng, (), 10, 10, 2))
    np.testing.assert_allclose(c2[1:], 1.0, rtol=1e-12)
    assert c2[0] < 1.0
    np.testing.assert_array_equal(cumulative_spectrum(np.zeros((3, 3))), 0.0)
    assert cumulative_spectrum(np.zeros((2, 0, 3))).shape == (2, 0)


# ---------------------------------------------------------------------------
# Scale invariance
# ---------------------------------------------------------------------------
SCALES = [1e-300, 1e-170, 1e-30, 1.0, 1e30, 1e200, 1e300]


@pytest.mark.parametrize("c", SCALES)
def test_scale_invariant_measures_are_finite_at_any_scale(c):
    """stable_rank(1e-170 * I3) == stable_rank(1e200 * I3) == 3: no NaN from squares that under- or overflow."""
    eye = c * np.eye(3)
    assert stable_rank(eye) == 3.0
    assert effective_rank(eye) == pytest.approx(3.0, rel=1e-12)
    assert numerical_rank(eye) == 3
    np.testing.assert_allclose(cumulative_spectrum(eye), [1 / 3, 2 / 3, 1.0], rtol=1e-12)
    np.testing.assert_allclose(cumulative_spectrum(eye, squared=True), [1 / 3, 2 / 3, 1.0], rtol=1e-12)
    # the same as spectra
    s = np.full(3, c)
    assert stable_rank(s, spectrum=True) == 3.0
    assert effective_rank(s, spectrum=True) == pytest.approx(3.0, rel=1e-12)
    np.testing.assert_allclose(cumulative_spectrum(s, spectrum=True, squared=True), [1 / 3, 2 / 3, 1.0], rtol=1e-12)


def test_scale_invariance_on_general_matrices(rng):
    """Entries near the float limits, where the singular values themselves would overflow."""
    a = rng.normal(size=(4, 6, 5))
    want = (stable_rank(a), effective_rank(a), numerical_rank(a), cumulative_spectrum(a),
            cumulative_spectrum(a, squared=True))
    for c in (2.0 ** -1000, 2.0 ** -560, 2.0 ** 600, 2.0 ** 1018):
        got = (stable_rank(c * a), effective_rank(c * a), numerical_rank(c * a), cumulative_spectrum(c * a),
               cumulative_spectrum(c * a, squared=True))
        for g, w in zip(got, want):
            assert np.all(np.isfinite(g))
            np.testing.assert_allclose(g, w, rtol=1e-12)
    # all-ones at 1e308: sigma_max = 6e308 overflows, the rank-1 structure does not
    big = np.full((6, 5), 1e308)
    assert stable_rank(big) == pytest.approx(1.0) and numerical_rank(big) == 1
    assert effective_rank(big) == pytest.approx(1.0)
    np.testing.assert_allclose(cumulative_spectrum(big), 1.0)
    # float32 near its limits
    a32 = a.astype(np.float32)
    for c in (np.float32(1e-30), np.float32(1e30)):
        np.testing.assert_allclose(stable_rank(a32 * c), stable_rank(a32), rtol=1e-5)
        np.testing.assert_allclose(cumulative_spectrum(a32 * c, squared=True),
                                   cumulative_spectrum(a32, squared=True), rtol=1e-5)
    # huge spectra given directly
    s = np.array([1e308, 1e308, 1e300])
    assert stable_rank(s, spectrum=True) == pytest.approx(2.0)
    np.testing.assert_allclose(cumulative_spectrum(s, spectrum=True), [0.5, 1.0, 1.0], rtol=1e-7)


@pytest.mark.parametrize("call", [
    lambda: effective_rank(np.eye(3), spectrum="yes"),
    lambda: stable_rank(np.eye(3), check_finite="no"),
    lambda: cumulative_spectrum(np.eye(3), squared=1),
])
def test_flags_take_bools_only(call):
    """A truthy string was read as True ('yes' made a matrix three spectra); now a TypeError naming it."""
    with pytest.raises(TypeError, match="must be True or False"):
        call()
