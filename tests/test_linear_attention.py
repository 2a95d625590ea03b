"""linear_attention: every CPU kernel against the quadratic reference, a minimal NumPy version, errors."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import linattn_nb as la
from linattn_nb import feature_maps as fm
from linattn_nb.ops.causal.naive import causal_linear_quadratic
from linattn_nb.ops.noncausal.naive import noncausal_linear_quadratic
from linattn_nb.ops.registry import available_methods

# Relative tolerances (max-abs error over max-abs reference) per dtype.
TOL = {np.float64: 1e-11, np.float32: 2e-5, np.float16: 5e-3}


def reference(q, k, v, *, causal, feature_map="elu", eps=1e-8, initial_state=None):
    """float64 ground truth through the naive NumPy forms."""
    fmap = fm.resolve(feature_map)
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    batch = q64.shape[:-2]
    b, n, f = int(np.prod(batch, dtype=int)), q64.shape[-2], fmap.output_dim(q64.shape[-1])
    qf = fmap(q64).reshape((b, n, f))
    kf = fmap(k64).reshape((b, n, f))
    vv = v64.reshape((b, n, v64.shape[-1]))
    S0 = z0 = None
    if initial_state is not None:
        S0 = np.asarray(initial_state[0], dtype=np.float64).reshape((b, f, v64.shape[-1]))
        z0 = np.asarray(initial_state[1], dtype=np.float64).reshape((b, f))
    fn = causal_linear_quadratic if causal else noncausal_linear_quadratic
    out, S, z = fn(qf, kf, vv, eps=eps, S0=S0, z0=z0)
    return (out.reshape(batch + out.shape[-2:]), S.reshape(batch + (f, v64.shape[-1])),
            z.reshape(batch + (f,)))


def assert_close(actual, expected, dtype):
    scale = max(np.max(np.abs(expected)), 1.0) if expected.size else 1.0
    err = np.max(np.abs(actual.astype(np.float64) - expected)) if expected.size else 0.0
    assert err <= TOL[np.dtype(dtype).type] * scale, f"max abs error {err:.3e} (scale {scale:.3e})"


def cpu_methods(causal):
    return [m for m in available_methods(causal=causal, device="cpu")]


# ---------------------------------------------------------------------------
# A minimal NumPy linear attention, literally
# ---------------------------------------------------------------------------
def test_minimal_numpy_example_literally():
    """Against a minimal NumPy version (ELU+1, Katharopoulos et al. 2020): N=12, D=8, M=6, default_rng(7), atol 1e-10."""

    def phi(x):
        return np.where(x >= 0, x + 1, np.exp(np.minimum(x, 0)))

    def minimal_linear_attention(q, k, v):
        qf, kf = phi(q), phi(k)
        state = kf.T @ v
        normalizer = kf.sum(axis=0)
        denominator = qf @ normalizer
        return (qf @ state) / denominator[:, None].clip(1e-8)

    rng = np.random.default_rng(7)
    q, k = rng.normal(size=(2, 12, 8))
    v = rng.normal(size=(12, 6))
    pairwise = phi(q) @ phi(k).T
    reference_ = (pairwise @ v) / pairwise.sum(-1, keepdims=True)
    for method in ["auto"] + cpu_methods(False):
        output = la.linear_attention(q, k, v, method=method)
        assert output.shape == (12, 6)
        np.testing.assert_allclose(output, reference_, atol=1e-10)
        np.testing.assert_allclose(output, minimal_linear_attention(q, k, v), atol=1e-10)
    # causal: prefix states that include token t
    causal_ref = (np.tril(pairwise) @ v) / np.tril(pairwise).sum(-1, keepdims=True)
    for method in ["auto"] + cpu_methods(True):
        np.testing.assert_allclose(la.linear_attention(q, k, v, causal=True, method=method), causal_ref, atol=1e-10)


# ---------------------------------------------------------------------------
# Property-based: every kernel against the reference
# ---------------------------------------------------------------------------
@st.composite
def problems(draw):
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    n = draw(st.one_of(st.integers(0, 40), st.integers(41, 300)))
    d = draw(st.integers(1, 130))
    m = draw(st.integers(1, 130))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    causal = draw(st.booleans())
    fmap = draw(st.sampled_from(["elu", "relu", "squared_relu", "identity"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return batch, n, d, m, dtype, causal, fmap, seed


@settings(max_examples=60)
@given(problems())
def test_kernels_match_quadratic_reference(problem):
    batch, n, d, m, dtype, causal, fmap, seed = problem
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(batch + (n, d)).astype(dtype)
    k = rng.standard_normal(batch + (n, d)).astype(dtype)
    v = rng.standard_normal(batch + (n, m)).astype(dtype)
    if fmap == "identity":
        # signed features: keep the normaliser away from zero so the comparison is meaningful
        q, k = np.abs(q) + 0.5, np.abs(k) + 0.5
    ref, S_ref, z_ref = reference(q, k, v, causal=causal, feature_map=fmap)
    for method in cpu_methods(causal):
        out = np.full(batch + (n, m), np.nan, dtype=dtype)
        res, state = la.linear_attention(q, k, v, causal=causal, feature_map=fmap, method=method,
                                         out=out, return_state=True)
        assert res is out and res.dtype == dtype and res.shape == batch + (n, m)
        assert not np.isnan(res).any(), f"{method}: unwritten output elements"
        assert_close(res, ref, dtype)
        assert state.position == n
        tol = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(state.S, S_ref, rtol=tol, atol=tol * max(1.0, np.abs(S_ref).max()))
        np.testing.assert_allclose(state.z, z_ref, rtol=tol, atol=tol * max(1.0, np.abs(z_ref).max()))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bh", [1, 2, 3, 17])  # below, at and above the thread count
def test_batch_sizes_around_thread_count(causal, bh, rng):
    q, k = rng.standard_normal((2, bh, 37, 5))
    v = rng.standard_normal((bh, 37, 7))
    ref = reference(q, k, v, causal=causal)[0]
    for method in cpu_methods(causal):
        assert_close(la.linear_attention(q, k, v, causal=causal, method=method), ref, np.float64)


def test_done_when_long_float32_causal():
    """Long float32 sequences: (2, 8, 4096, 64) float32 causal vs float64 quadratic, rel. error < 1e-5."""
    rng = np.random.default_rng(0)
    shape = (2, 8, 4096, 64)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    ref = la.linear_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                              causal=True, method="quadratic")
    out = la.linear_attention(q, k, v, causal=True)
    assert out.dtype == np.float32
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel < 1e-5, rel


# ---------------------------------------------------------------------------
# Causality
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_causal_prefix_property(dtype, rng):
    """Output at t is unchanged (bit for bit) when tokens after t change."""
    n, t = 70, 33
    q, k, v = (rng.standard_normal((3, n, 6)).astype(dtype) for _ in range(3))
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    for x in (q2, k2, v2):
        x[:, t + 1:] = rng.standard_normal(x[:, t + 1:].shape) * 5
    for method in ["auto"] + cpu_methods(True):
        a = la.linear_attention(q, k, v, causal=True, method=method)
        b = la.linear_attention(q2, k2, v2, causal=True, method=method)
        np.testing.assert_array_equal(a[:, : t + 1], b[:, : t + 1], err_msg=method)
        assert not np.array_equal(a[:, t + 1:], b[:, t + 1:])


def test_causal_row_equals_normalised_prefix_sum(rng):
    """Row t of causal attention is the normalised sum over tokens 0..t (token t included)."""
    q, k, v = (rng.standard_normal((20, 4)) for _ in range(3))
    phi = fm.get("elu")
    for method in cpu_methods(True):
        out = la.linear_attention(q, k, v, causal=True, method=method)
        for t in (0, 7, 19):
            w = phi(k[: t + 1]) @ phi(q[t])
            np.testing.assert_allclose(out[t], (w @ v[: t + 1]) / w.sum(), rtol=1e-12)


# ---------------------------------------------------------------------------
# Shapes, layouts, dtypes
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_empty_sequence(causal):
    q = np.zeros((2, 3, 0, 4))
    v = np.zeros((2, 3, 0, 5))
    for method in ["auto"] + cpu_methods(causal):
        out, state = la.linear_attention(q, q, v, causal=causal, method=method, return_state=True)
        assert out.shape == (2, 3, 0, 5) and out.dtype == np.float64
        assert state.S.shape == (2, 3, 4, 5) and not state.S.any() and state.position == 0


def test_zero_batch():
    q = np.zeros((0, 5, 4))
    out = la.linear_attention(q, q, np.zeros((0, 5, 2)), causal=True)
    assert out.shape == (0, 5, 2)


@pytest.mark.parametrize("causal", [False, True])
def test_layouts_noncontiguous_fortran_readonly(causal, rng):
    base = rng.standard_normal((4, 30, 12))
    q = base[:, :, ::2]                      # non-contiguous view
    k = np.asfortranarray(base[:, :, 1::2])  # Fortran-ordered
    v = base[:, ::-1, :5].copy()
    v.setflags(write=False)                  # read-only
    ref = reference(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), causal=causal)[0]
    for method in cpu_methods(causal):
        assert_close(la.linear_attention(q, k, v, causal=causal, method=method), ref, np.float64)
    assert not v.flags.writeable  # inputs untouched


def test_lists_and_2d_inputs():
    q = [[0.1, 0.2], [0.3, -0.4], [1.0, 0.0]]
    out = la.linear_attention(q, q, q)
    assert out.shape == (3, 2) and out.dtype == np.float64


def test_mixed_dtypes_promote_to_widest(rng):
    q = rng.standard_normal((10, 4)).astype(np.float32)
    k = rng.standard_normal((10, 4))
    v = rng.standard_normal((10, 3)).astype(np.float32)
    out = la.linear_attention(q, k, v, causal=True)
    assert out.dtype == np.float64
    expected = la.linear_attention(q.astype(np.float64), k, v.astype(np.float64), causal=True)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("causal", [False, True])
def test_float16_inputs_return_float16(causal, rng):
    q, k, v = (rng.standard_normal((2, 40, 8)).astype(np.float16) for _ in range(3))
    ref = reference(q, k, v, causal=causal)[0]
    for method in ["auto"] + cpu_methods(causal):
        out = la.linear_attention(q, k, v, causal=causal, method=method)
        assert out.dtype == np.float16
        assert_close(out, ref, np.float16)


@pytest.mark.parametrize("bad", [np.int64, np.int32, np.bool_, np.complex128])
def test_non_float_dtypes_rejected(bad):
    x = np.ones((4, 3))
    for name, args in (("q", (x.astype(bad), x, x)), ("k", (x, x.astype(bad), x)), ("v", (x, x, x.astype(bad)))):
        with pytest.raises(TypeError, match=f"^{name} must have dtype"):
            la.linear_attention(*args)


def test_longdouble_rejected():
    x = np.ones((4, 3))
    with pytest.raises(TypeError, match="q must have dtype"):
        la.linear_attention(x.astype(np.longdouble), x, x)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------
def test_shape_errors_name_arguments_and_shapes():
    q = np.ones((2, 5, 4))
    with pytest.raises(ValueError, match=r"same sequence length N.*\(2, 5, 4\).*\(2, 6, 4\)"):
        la.linear_attention(q, np.ones((2, 6, 4)), np.ones((2, 6, 3)))
    with pytest.raises(ValueError, match=r"q and k must have the same feature dimension D.*\(2, 5, 4\).*\(2, 5, 3\)"):
        la.linear_attention(q, np.ones((2, 5, 3)), np.ones((2, 5, 3)))
    with pytest.raises(ValueError, match="equal leading batch dimensions"):
        la.linear_attention(q, np.ones((3, 5, 4)), np.ones((3, 5, 3)))
    with pytest.raises(ValueError, match="same number of dimensions"):
        la.linear_attention(q, np.ones((1, 2, 5, 4)), np.ones((1, 2, 5, 3)))
    with pytest.raises(ValueError, match=r"q must have at least 2 dimensions.*\(5,\)"):
        la.linear_attention(np.ones(5), np.ones(5), np.ones(5))
    with pytest.raises(ValueError, match="at least 1"):
        la.linear_attention(np.ones((5, 0)), np.ones((5, 0)), np.ones((5, 2)))


@pytest.mark.parametrize("bad_value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_non_finite_inputs(bad_value, which):
    args = [np.ones((6, 3)) for _ in range(3)]
    args[which][2, 1] = bad_value
    name = "qkv"[which]
    with pytest.raises(ValueError, match=f"{name} contains 1 non-finite"):
        la.linear_attention(*args)
    if np.isnan(bad_value):
        out = la.linear_attention(*args, check_finite=False, causal=True)
        assert np.isnan(out).any()


def test_method_device_feature_map_eps_errors():
    x = np.ones((4, 3))
    with pytest.raises(ValueError, match="unknown method 'fast'"):
        la.linear_attention(x, x, x, method="fast")
    with pytest.raises(TypeError, match="method must be a string"):
        la.linear_attention(x, x, x, method=3)
    with pytest.raises(ValueError, match="device must be one of"):
        la.linear_attention(x, x, x, device="tpu")
    with pytest.raises(ValueError, match="feature_map: unknown feature map 'nope'"):
        la.linear_attention(x, x, x, feature_map="nope")
    with pytest.raises(TypeError, match="feature_map must be"):
        la.linear_attention(x, x, x, feature_map=42)
    with pytest.raises(ValueError, match="eps must be"):
        la.linear_attention(x, x, x, eps=-1.0)
    with pytest.raises(TypeError, match="eps must be"):
        la.linear_attention(x, x, x, eps="small")


def test_eps_too_large_for_a_float():
    """eps=10**400 raised a bare OverflowError from float(); now the ValueError naming eps."""
    x = np.ones((4, 3))
    with pytest.raises(ValueError, match="eps must be a finite non-negative float or None, got .*too large"):
        la.linear_attention(x, x, x, eps=10**400)


def test_out_buffer_errors_and_use():
    x = np.ones((2, 4, 3))
    with pytest.raises(ValueError, match=r"out must have shape \(2, 4, 3\)"):
        la.linear_attention(x, x, x, out=np.empty((2, 4, 2)))
    with pytest.raises(TypeError, match="out must have dtype float64"):
        la.linear_attention(x, x, x, out=np.empty((2, 4, 3), dtype=np.float32))
    ro = np.empty((2, 4, 3))
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="out is read-only"):
        la.linear_attention(x, x, x, out=ro)
    # a non-contiguous out buffer is filled correctly
    big = np.full((2, 4, 6), np.nan)
    view = big[:, :, ::2]
    res = la.linear_attention(x, x, x, causal=True, out=view)
    assert res is view and not np.isnan(view).any()
    np.testing.assert_allclose(view, 1.0)


def test_quadratic_refuses_huge_n(monkeypatch):
    import linattn_nb.config as cfg

    monkeypatch.setattr(cfg, "QUADRATIC_MAX_ELEMENTS", 100)
    x = np.ones((11, 2))
    with pytest.raises(ValueError, match="QUADRATIC_MAX_ELEMENTS"):
        la.linear_attention(x, x, x, method="quadratic")


# ---------------------------------------------------------------------------
# Normaliser: eps floor and non-positive denominators
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_nonpositive_denominators_documented_behaviour(causal):
    """With signed features ('identity') phi(q).z can be <= 0.

    Default eps: the normaliser is floored at eps (max(den, eps)), so the output
    is num / eps, finite.  eps=None: raw signed division (num / den).
    """
    q = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]])
    k = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    v = np.array([[2.0], [4.0], [6.0]])
    for method in cpu_methods(causal):
        floored = la.linear_attention(q, k, v, feature_map="identity", causal=causal, method=method)
        raw = la.linear_attention(q, k, v, feature_map="identity", causal=causal, method=method, eps=None)
        fq, fk = q, k
        A = fq @ fk.T
        if causal:
            A = np.tril(A)
        num, den = A @ v, A.sum(-1)
        # row 0: positive normaliser: identical in both modes
        np.testing.assert_allclose(floored[0], num[0] / den[0])
        np.testing.assert_allclose(raw[0], num[0] / den[0])
        # row 1: negative normaliser: floored -> num / 1e-8, raw -> signed division
        np.testing.assert_allclose(floored[1], num[1] / 1e-8)
        np.testing.assert_allclose(raw[1], num[1] / den[1])
        assert den[1] < 0  # the case under test really has a negative normaliser
        # row 2: zero normaliser and zero numerator: floored -> 0, raw -> NaN (0/0)
        assert floored[2, 0] == 0.0
        assert np.isnan(raw[2, 0])


def test_custom_eps_floor():
    q = np.array([[1e-6, 1e-6]])
    out = la.linear_attention(q, q, np.array([[3.0]]), feature_map="identity", eps=1.0)
    np.testing.assert_allclose(out, [[2e-12 * 3.0]])


# ---------------------------------------------------------------------------
# Feature maps through the dispatcher
# ---------------------------------------------------------------------------
def test_user_feature_map_applied_in_numpy(rng):
    class Square(fm.FeatureMap):
        """phi(x) = [x**2, 1]: output dimension d + 1."""

        name = "square_plus_one"

        def output_dim(self, d):
            return d + 1

        def transform(self, x):
            return np.concatenate([x * x, np.ones(x.shape[:-1] + (1,), x.dtype)], axis=-1)

    q, k, v = (rng.standard_normal((2, 25, 3)) for _ in range(3))
    for causal in (False, True):
        ref = reference(q, k, v, causal=causal, feature_map=Square())[0]
        for method in cpu_methods(causal):
            out, state = la.linear_attention(q, k, v, feature_map=Square(), causal=causal, method=method,
                                             return_state=True)
            assert_close(out, ref, np.float64)
            assert state.S.shape == (2, 4, 3)


def test_feature_map_none_means_features_given(rng):
    q, k = (np.abs(rng.standard_normal((15, 4))) for _ in range(2))
    v = rng.standard_normal((15, 2))
    np.testing.assert_array_equal(
        la.linear_attention(q, k, v, feature_map=None, causal=True),
        la.linear_attention(q, k, v, feature_map="identity", causal=True),
    )


def test_wrong_output_dim_is_reported():
    class Liar(fm.FeatureMap):
        name = "liar"

        def output_dim(self, d):
            return d + 3

        def transform(self, x):
            return x

    x = np.ones((4, 2))
    with pytest.raises(ValueError, match="output_dim"):
        la.linear_attention(x, x, x, feature_map=Liar())


def test_elu_overflow_safe_in_kernels():
    """exp only ever sees min(x, 0): large inputs give no overflow (underflow to 0 is fine)."""
    x = np.array([[800.0, -800.0], [-1e30, 700.0]])
    v = np.array([[1.0], [2.0]])
    with np.errstate(over="raise", invalid="raise"):
        ref = reference(x, x, v, causal=True)[0]
    for method in cpu_methods(True):
        out = la.linear_attention(x, x, v, causal=True, method=method)
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, rtol=1e-12)


# ---------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------
def test_initial_state_continues_the_sequence(rng):
    """Two causal segments, the second started from the first's state, equal one call."""
    q, k, v = (rng.standard_normal((2, 50, 4)) for _ in range(3))
    for method in cpu_methods(True):
        full, st_full = la.linear_attention(q, k, v, causal=True, method=method, return_state=True)
        a, st_a = la.linear_attention(q[:, :19], k[:, :19], v[:, :19], causal=True, method=method,
                                      return_state=True)
        b, st_b = la.linear_attention(q[:, 19:], k[:, 19:], v[:, 19:], causal=True, method=method,
                                      initial_state=st_a, return_state=True)
        np.testing.assert_allclose(np.concatenate([a, b], axis=1), full, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(st_b.S, st_full.S, rtol=1e-12)
        np.testing.assert_allclose(st_b.z, st_full.z, rtol=1e-12)
        assert st_a.position == 19 and st_b.position == 50


@pytest.mark.parametrize("causal", [False, True])
def test_initial_state_against_reference(causal, rng):
    """The initial state is context absorbed before token 0 (seen by every query)."""
    q, k, v = (rng.standard_normal((2, 50, 4)) for _ in range(3))
    S0 = np.abs(rng.standard_normal((2, 4, 4)))
    z0 = np.abs(rng.standard_normal((2, 4)))
    ref = reference(q, k, v, causal=causal, initial_state=(S0, z0))[0]
    for method in cpu_methods(causal):
        assert_close(la.linear_attention(q, k, v, causal=causal, method=method, initial_state=(S0, z0)),
                     ref, np.float64)


def test_initial_state_errors_and_not_mutated(rng):
    q = rng.standard_normal((2, 5, 3))
    S0 = np.ones((2, 3, 3))
    z0 = np.ones((2, 3))
    keep = S0.copy()
    la.linear_attention(q, q, q, causal=True, initial_state=(S0, z0))
    np.testing.assert_array_equal(S0, keep)
    with pytest.raises(ValueError, match=r"initial_state must have S of shape \(2, 3, 3\)"):
        la.linear_attention(q, q, q, causal=True, initial_state=(np.ones((3, 3)), np.ones(3)))
    with pytest.raises(TypeError, match="initial_state must be"):
        la.linear_attention(q, q, q, causal=True, initial_state="state")
    with pytest.raises(TypeError, match="initial_state.S must have dtype"):
        la.linear_attention(q, q, q, causal=True, initial_state=(S0.astype(int), z0))
    bad = S0.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="initial_state.S contains"):
        la.linear_attention(q, q, q, causal=True, initial_state=(bad, z0))


def test_nan_in_a_value_stays_in_its_own_and_later_rows():
    """check_finite=False: a NaN in v[t] reaches rows >= t only (causality holds for NaN too)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 12, 3)) for _ in range(3))
    v[0, 7, 1] = np.nan
    for method in cpu_methods(True):
        out = la.linear_attention(q, k, v, causal=True, method=method, check_finite=False)
        assert np.isfinite(out[0, :7]).all(), method
        assert np.isnan(out[0, 7:, 1]).all(), method
