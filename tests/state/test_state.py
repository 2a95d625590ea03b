"""Recurrent state, segment-wise processing and decoding against a KV cache (CPU).

The recurrence is "Transformers are RNNs" (Katharopoulos et al. 2020, Eqs. 18-19):
token t updates S and z, then reads them; a long sequence processed in segments, or
token by token from a state, must give the outputs of one causal call.
"""
from __future__ import annotations

import glob
import io
import os
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import linattn_nb as la
from linattn_nb import config
from linattn_nb import feature_maps as fm
from linattn_nb.state import fileformat as state_mod
from linattn_nb.ops.causal.naive import causal_linear_quadratic
from linattn_nb.ops.registry import available_methods
from linattn_nb.ops.step import cpu as step_cpu
import _step_naive as step_naive
from linattn_nb.state import KVCache, LinearAttentionState, StateFileError

from _state_files import rewrite_state_file

# Relative tolerances (max-abs error over max(max-abs reference, 1)) per computing dtype.
TOL = {np.float64: 1e-11, np.float32: 3e-5, np.float16: 5e-3}


def assert_close(actual, expected, dtype):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if not expected.size:
        return
    scale = max(float(np.max(np.abs(expected))), 1.0)
    err = float(np.max(np.abs(actual - expected)))
    assert err <= TOL[np.dtype(dtype).type] * scale, f"max abs error {err:.3e} (scale {scale:.3e})"


class Ramp(fm.FeatureMap):
    """A position-dependent test map: ELU+1 scaled by (1 + position / 64) for keys only.

    It ignores ``total_length``, so segment-wise processing must reproduce one call
    exactly when (and only when) the offsets are passed on correctly.
    """

    name = "ramp_test"
    position_dependent = True
    is_positive = True

    def transform(self, x):
        return np.where(x >= 0, x + 1, np.exp(np.minimum(x, 0))).astype(x.dtype)

    def apply(self, x, *, role, causal, offset=0, total_length=None):
        f = self(x)
        if role == "key":
            pos = offset + np.arange(x.shape[-2])
            f = f * (1.0 + pos / 64.0)[:, None].astype(x.dtype)
        return f


def reference(q, k, v, *, feature_map="elu", eps=1e-8):
    """float64 causal outputs and final state through the naive quadratic form."""
    fmap = fm.resolve(feature_map)
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    batch = q64.shape[:-2]
    n = q64.shape[-2]
    b = int(np.prod(batch, dtype=int))
    f = fmap.output_dim(q64.shape[-1])
    qf = np.asarray(fmap.apply(q64, role="query", causal=True, offset=0, total_length=n)).reshape((b, n, f))
    kf = np.asarray(fmap.apply(k64, role="key", causal=True, offset=0, total_length=n)).reshape((b, n, f))
    m = v64.shape[-1]
    out, S, z = causal_linear_quadratic(qf, kf, v64.reshape((b, n, m)), eps=eps)
    return out.reshape(batch + (n, m)), S.reshape(batch + (f, m)), z.reshape(batch + (f,))


def qkv(rng, batch, n, d, m, dtype=np.float64, scale=1.0):
    q = (scale * rng.standard_normal(batch + (n, d))).astype(dtype)
    k = (scale * rng.standard_normal(batch + (n, d))).astype(dtype)
    v = rng.standard_normal(batch + (n, m)).astype(dtype)
    return q, k, v


def cuts_from(rng, n, pieces):
    """Sorted split points in [0, n], with repeats (empty segments) and both ends."""
    inner = sorted(rng.integers(0, n + 1, size=pieces).tolist())
    return [0, 0] + inner + [n, n]


# ---------------------------------------------------------------------------
# 1. linear_attention(initial_state=, return_state=): segment-wise == one call
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("method", available_methods(causal=True, device="cpu"))
@pytest.mark.parametrize("dtype,feature_map", [(np.float64, "elu"), (np.float32, "elu"),
                                               (np.float64, "dpfp"), (np.float64, Ramp()),
                                               (np.float16, "relu")])
def test_segmentwise_equals_one_shot(method, dtype, feature_map):
    """Random split points (empty segments included) give the outputs and the final state of one call."""
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, (2, 3), 41, 5, 4, dtype)
    full, st_full = la.linear_attention(q, k, v, causal=True, method=method, feature_map=feature_map,
                                        return_state=True)
    out_ref, S_ref, z_ref = reference(q, k, v, feature_map=feature_map)
    assert_close(full, out_ref, dtype)
    for trial in range(3):
        cuts = cuts_from(rng, 41, 3 + trial)
        state, outs = None, []
        for a, b in zip(cuts[:-1], cuts[1:]):
            o, state = la.linear_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], causal=True,
                                           method=method, feature_map=feature_map, initial_state=state,
                                           return_state=True)
            assert o.shape == (2, 3, b - a, 4) and o.dtype == dtype
            assert state.position == b
            outs.append(o)
        seg = np.concatenate(outs, axis=-2)
        assert_close(seg, full, dtype)
        # "chunked" sums float32 GEMM parts per chunk (in float64): other split
        # points give other chunks, so float32/float16 states agree to float32
        # round-off; the per-token scan multiplies in float64 and agrees to 1e-12.
        st_tol = 1e-12 if (dtype == np.float64 or method != "chunked") else 2e-6
        np.testing.assert_allclose(state.S, st_full.S, rtol=st_tol, atol=st_tol)
        np.testing.assert_allclose(state.z, st_full.z, rtol=st_tol, atol=st_tol)
        np.testing.assert_allclose(state.S, S_ref, rtol=1e-5 if dtype != np.float64 else 1e-12,
                                   atol=1e-6 if dtype != np.float64 else 1e-13)


@given(st.lists(st.integers(0, 23), min_size=0, max_size=6), st.sampled_from([1, 3]))
@settings(max_examples=15)
def test_segmentwise_property(points, batch):
    """Any split of a causal sequence (hypothesis over split points) equals one scan call."""
    rng = np.random.default_rng(len(points) * 31 + batch)
    q, k, v = qkv(rng, (batch,), 23, 3, 2)
    full = la.linear_attention(q, k, v, causal=True, method="scan")
    cuts = [0] + sorted(points) + [23]
    state, outs = None, []
    for a, b in zip(cuts[:-1], cuts[1:]):
        o, state = la.linear_attention(q[:, a:b], k[:, a:b], v[:, a:b], causal=True, method="scan",
                                       initial_state=state, return_state=True)
        outs.append(o)
    assert_close(np.concatenate(outs, axis=-2), full, np.float64)
    assert state.position == 23


def test_noncausal_segments_accumulate_the_same_state(rng):
    """Non-causal attention has no per-token recurrence, but its final state still adds up over segments."""
    q, k, v = qkv(rng, (2,), 30, 4, 3)
    _, st_full = la.linear_attention(q, k, v, return_state=True)
    state = None
    for a, b in ((0, 0), (0, 11), (11, 30), (30, 30)):
        _, state = la.linear_attention(q[:, a:b], k[:, a:b], v[:, a:b], initial_state=state, return_state=True)
    np.testing.assert_allclose(state.S, st_full.S, rtol=1e-12)
    np.testing.assert_allclose(state.z, st_full.z, rtol=1e-12)
    assert state.position == 30


# ---------------------------------------------------------------------------
# 2. LinearAttentionState against the causal kernels
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("feature_map", ["elu", "relu", "squared_relu", "identity", "dpfp", Ramp()])
def test_step_by_step_equals_causal_kernel(feature_map):
    """Prefill a prompt, then decode token by token and in multi-token steps: the outputs
    are the causal kernel's rows and the state is its final state (float64 state)."""
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, (2, 3), 19, 5, 3)
    out_ref, S_ref, z_ref = reference(q, k, v, feature_map=feature_map)
    kernel = la.linear_attention(q, k, v, causal=True, feature_map=feature_map)
    st_ = LinearAttentionState(5, 3, batch_shape=(2, 3), feature_map=feature_map)
    st_.prefill(k[..., :6, :], v[..., :6, :])
    outs = []
    for t in range(6, 11):
        outs.append(st_.step(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :]))
    outs.append(st_.step(q[..., 11:19, :], k[..., 11:19, :], v[..., 11:19, :]))
    dec = np.concatenate(outs, axis=-2)
    assert dec.shape == (2, 3, 13, 3) and dec.dtype == np.float64
    assert_close(dec, out_ref[..., 6:, :], np.float64)
    assert_close(dec, kernel[..., 6:, :], np.float64)
    assert st_.position == 19
    np.testing.assert_allclose(st_.S, S_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st_.z, z_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batch_shape,dtype,state_dtype", [((4,), np.float32, np.float32),
                                                           ((2, 3), np.float64, np.float64),
                                                           ((), np.float32, np.float64)])
def test_fast_decode_path(batch_shape, dtype, state_dtype, monkeypatch):
    """Contiguous tokens of one native dtype take the lean path (compiled entry point, no
    validation helper), for T = 1 and T > 1: same outputs as the causal kernel, NaN refused
    with the state untouched, the float16 and mixed-dtype cases left to the general path."""
    rng = np.random.default_rng(12)
    q, k, v = qkv(rng, batch_shape, 10, 5, 3, dtype)
    ref = la.linear_attention(q, k, v, causal=True)
    st_ = LinearAttentionState(5, 3, batch_shape=batch_shape, dtype=state_dtype)
    real_prepare = LinearAttentionState._prepare

    def boom(*a, **kw):
        raise AssertionError("the decode step left the fast path")

    monkeypatch.setattr(LinearAttentionState, "_prepare", boom)
    toks = [tuple(np.ascontiguousarray(x[..., t:t + 1, :]) for x in (q, k, v)) for t in range(7)]
    outs = [st_.step(*tk) for tk in toks]
    assert all(o.dtype == dtype and o.shape == batch_shape + (1, 3) for o in outs)
    outs.append(st_.step(*(np.ascontiguousarray(x[..., 7:, :]) for x in (q, k, v))))
    tol = np.float32 if np.float32 in (dtype, state_dtype) else np.float64
    assert_close(np.concatenate(outs, axis=-2), ref, tol)
    assert st_.device == "cpu" and st_.position == 10 and np.dtype(dtype) in st_._entry
    S0 = st_.S.copy()
    bad = toks[0][1].copy()
    bad.flat[-1] = np.inf
    with pytest.raises(ValueError, match="k contains"):
        st_.step(toks[0][0], bad, toks[0][2])
    assert np.array_equal(st_.S, S0) and st_.position == 10
    monkeypatch.setattr(LinearAttentionState, "_prepare", real_prepare)
    half = st_.copy().step(*(x.astype(np.float16) for x in toks[0]))
    assert half.dtype == np.float16


@pytest.mark.parametrize("dtype,state_dtype", [(np.float32, np.float32), (np.float32, np.float64),
                                               (np.float16, np.float32)])
def test_step_dtypes(dtype, state_dtype):
    """Outputs come back in the input dtype; the state dtype sets the accumulation precision."""
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, (4,), 12, 6, 5, dtype)
    out_ref = reference(q, k, v)[0]
    st_ = LinearAttentionState(6, 5, batch_shape=(4,), dtype=state_dtype)
    st_.prefill(k[:, :4], v[:, :4])
    outs = [st_.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]) for t in range(4, 12)]
    dec = np.concatenate(outs, axis=1)
    assert dec.dtype == dtype and st_.S.dtype == state_dtype
    worst = np.float16 if dtype == np.float16 else np.float32
    assert_close(dec, out_ref[:, 4:], worst)


def test_mixed_input_dtypes_promote(rng):
    q, k, v = qkv(rng, (), 5, 3, 2)
    st_ = LinearAttentionState(3, 2)
    out = st_.step(q.astype(np.float32), k, v.astype(np.float16))
    assert out.dtype == np.float64
    assert_close(out, reference(q.astype(np.float32), k, v.astype(np.float16))[0], np.float32)


@pytest.mark.parametrize("batch_shape", [(), (1,), (7,), (2, 5), (0, 3)])
@pytest.mark.parametrize("parallel", [False, True])
def test_batch_shapes_and_both_step_kernels(batch_shape, parallel, monkeypatch):
    """Batch*heads below and above the thread count, empty batches; serial and parallel kernels agree."""
    monkeypatch.setattr(config, "STEP_PARALLEL_MIN_WORK", 0 if parallel else 1 << 62)
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, batch_shape, 9, 4, 6)
    st_ = LinearAttentionState(4, 6, batch_shape=batch_shape)
    assert st_._kern1 is (step_cpu.additive_step_parallel if parallel and int(np.prod(batch_shape)) > 1
                          else step_cpu.additive_step_serial)
    o1 = st_.step(q[..., :1, :], k[..., :1, :], v[..., :1, :])
    o2 = st_.step(q[..., 1:, :], k[..., 1:, :], v[..., 1:, :])
    out = np.concatenate([o1, o2], axis=-2)
    assert out.shape == batch_shape + (9, 6)
    assert_close(out, reference(q, k, v)[0], np.float64)


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_token_counts_and_empty_steps(n, rng):
    q, k, v = qkv(rng, (3,), n, 4, 2)
    st_ = LinearAttentionState(4, 2, batch_shape=(3,))
    st_.prefill(k[:, :0], v[:, :0])
    out = st_.step(q, k, v)
    assert out.shape == (3, n, 2) and st_.position == n
    assert_close(out, reference(q, k, v)[0], np.float64)
    empty = st_.step(q[:, :0], k[:, :0], v[:, :0])
    assert empty.shape == (3, 0, 2) and st_.position == n
    assert st_.query(q[:, :0]).shape == (3, 0, 2)


def test_prefill_equals_causal_final_state():
    """prefill(k, v) leaves the causal kernel's final state (S, z, position), also in blocks
    of prefill_block - 1, block, block + 1 tokens, and for float32 states."""
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, (2, 2), 33, 4, 5)
    _, ref = la.linear_attention(q, k, v, causal=True, return_state=True)
    for block in (1, 8, 32, 33, 34, 1000):
        st_ = LinearAttentionState(4, 5, batch_shape=(2, 2))
        old = config.PREFILL_BLOCK
        config.PREFILL_BLOCK = block
        try:
            st_.prefill(k, v)
        finally:
            config.PREFILL_BLOCK = old
        np.testing.assert_allclose(st_.S, ref.S, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(st_.z, ref.z, rtol=1e-13, atol=0)
        assert st_.position == 33
    st32 = LinearAttentionState(4, 5, batch_shape=(2, 2), dtype=np.float32)
    st32.prefill(k.astype(np.float32), v.astype(np.float32))
    np.testing.assert_allclose(st32.S, ref.S, rtol=2e-5, atol=2e-5)
    # From a non-zero state, against the NumPy reference S0 + phi(K)^T V.
    kf = fm.get("elu")(k).reshape(4, 33, 4)
    S_ref, z_ref = step_naive.state_prefill_reference(kf, v.reshape(4, 33, 5), ref.S.reshape(4, 4, 5),
                                                      ref.z.reshape(4, 4))
    st_.prefill(k, v)
    np.testing.assert_allclose(st_.S, S_ref.reshape(2, 2, 4, 5), rtol=1e-12)
    np.testing.assert_allclose(st_.z, z_ref.reshape(2, 2, 4), rtol=1e-12)


def test_query_reads_without_updating(rng):
    """query() returns phi(q)^T S / phi(q)^T z for every query and leaves S, z, position bit-identical."""
    q, k, v = qkv(rng, (3,), 10, 4, 3)
    st_ = LinearAttentionState(4, 3, batch_shape=(3,))
    st_.prefill(k, v)
    S0, z0 = st_.S.copy(), st_.z.copy()
    res = st_.query(q[:, :4])
    assert np.array_equal(st_.S, S0) and np.array_equal(st_.z, z0) and st_.position == 10
    qf = fm.get("elu")(q[:, :4])
    assert_close(res, step_naive.state_query_reference(qf, S0, z0, eps=1e-8), np.float64)
    # A query equals the output of a step whose token adds nothing (k -> phi(k) = 0 with relu, v = 0).
    st2 = LinearAttentionState(4, 3, batch_shape=(3,), feature_map="relu")
    st2.prefill(k, v)
    a = st2.query(q[:, :1])
    b = st2.step(q[:, :1], -np.abs(k[:, :1]) - 1, np.zeros((3, 1, 3)))
    assert_close(a, b, np.float64)


def test_step_kernel_against_naive_recurrence(rng):
    """The Numba step kernel (transposed rows) against the token-by-token NumPy recurrence,
    on D_phi != M, odd sizes, an initial state, and raw division (eps=None) with signed features."""
    B, T, F, M = 5, 7, 9, 4
    qf = rng.standard_normal((B, T, F))
    kf = rng.standard_normal((B, T, F))
    v = rng.standard_normal((B, T, M))
    S0 = rng.standard_normal((B, F, M))
    z0 = rng.standard_normal((B, F)) + 3
    for eps in (1e-8, None):
        St = np.ascontiguousarray(S0.transpose(0, 2, 1))
        z = z0.copy()
        out = np.full((B, T, M), np.nan)
        rc = step_cpu.step(qf, kf, v, St, z, out, np.empty((2, B, F)), code=0, eps=eps, check=True)
        ref, S_ref, z_ref = step_naive.state_step_reference(qf, kf, v, S0, z0, eps=eps)
        assert rc == 0
        np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(St.transpose(0, 2, 1), S_ref, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(z, z_ref, rtol=1e-13, atol=1e-13)


def test_vectorised_elu_matches_libm():
    """The step kernels' branch-free exp: <= 2 ulp from NumPy's exp (float32 and float64),
    subnormal results flushed to 0, NaN and +-inf handled like ELU+1."""
    for dtype, ulps, lim in ((np.float32, 2, -87.3), (np.float64, 1, -708.3)):
        x = np.concatenate([np.linspace(-300, 5, 20001), [-np.inf, np.inf, np.nan, -0.0, 0.0, 1e-30, -1e-30,
                                                          lim + 0.01, lim - 0.01, -1000.0]]).astype(dtype)
        out = np.full(x.shape, np.nan, dtype=dtype)
        step_cpu.phi_row(x, out, np.int64(1))
        with np.errstate(over="ignore", invalid="ignore"):
            want = np.where(x >= 0, x + 1, np.exp(np.minimum(x, 0)).astype(dtype))
        flushed = (x < lim) & (x > -np.inf)
        assert np.all(out[flushed] == 0)
        keep = ~flushed & np.isfinite(want) & (want > 0)
        err = np.abs(out[keep].astype(np.float64) - want[keep]) / np.spacing(want[keep]).astype(np.float64)
        assert err.max() <= ulps, (dtype, err.max())
        assert np.isnan(out[np.isnan(x)]).all()
        assert out[x == -np.inf][0] == 0 and out[x == np.inf][0] == np.inf


def test_non_finite_inputs_leave_state_untouched(rng):
    q, k, v = qkv(rng, (2,), 3, 4, 2)
    for fmap in ("elu", "dpfp"):
        st_ = LinearAttentionState(4, 2, batch_shape=(2,), feature_map=fmap)
        st_.prefill(k, v)
        S0, z0 = st_.S.copy(), st_.z.copy()
        for name in ("q", "k", "v"):
            bad = {"q": q.copy(), "k": k.copy(), "v": v.copy()}
            bad[name][1, 2, 1] = np.nan if name != "k" else np.inf
            with pytest.raises(ValueError, match=f"{name} contains"):
                st_.step(bad["q"], bad["k"], bad["v"])
            assert np.array_equal(st_.S, S0) and np.array_equal(st_.z, z0) and st_.position == 3
        with pytest.raises(ValueError, match="k contains"):
            st_.prefill(np.full((2, 1, 4), np.nan), v[:, :1])
        with pytest.raises(ValueError, match="q contains"):
            st_.query(np.full((2, 1, 4), np.inf))
        assert np.array_equal(st_.S, S0) and st_.position == 3
    # check_finite=False: NaN propagates to the affected batch entry only.
    st_ = LinearAttentionState(4, 2, batch_shape=(2,))
    qb = q.copy()
    qb[0, 0, 0] = np.nan
    out = st_.step(qb, k, v, check_finite=False)
    assert np.isnan(out[0, 0]).all() and np.isfinite(out[1]).all()


def test_eps_none_and_signed_features(rng):
    """identity features with eps=None divide raw, as linear_attention(eps=None) does."""
    q, k, v = qkv(rng, (2,), 6, 3, 2)
    ref = la.linear_attention(q, k, v, causal=True, feature_map="identity", eps=None)
    st_ = LinearAttentionState(3, 2, batch_shape=(2,), feature_map="identity", eps=None)
    out = np.concatenate([st_.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]) for t in range(6)], axis=1)
    assert_close(out, ref, np.float64)
    floored = LinearAttentionState(3, 2, batch_shape=(2,), feature_map="identity", eps=1e-3)
    assert_close(floored.step(q, k, v), la.linear_attention(q, k, v, causal=True, feature_map="identity",
                                                            eps=1e-3), np.float64)


def test_layouts_and_general_path(rng):
    """Fortran-ordered, strided, read-only and list inputs take the general path and agree."""
    q, k, v = qkv(rng, (3,), 8, 4, 5)
    want = reference(q, k, v)[0]
    st_ = LinearAttentionState(4, 5, batch_shape=(3,))
    qF = np.asfortranarray(q)
    k2 = np.repeat(k, 2, axis=1)[:, ::2]
    vr = v.copy()
    vr.flags.writeable = False
    assert_close(st_.step(qF, k2, vr), want, np.float64)
    st2 = LinearAttentionState(4, 5, batch_shape=(3,))
    assert_close(st2.step(q.tolist(), k.tolist(), v.tolist()), want, np.float64)


def test_shape_and_type_errors():
    st_ = LinearAttentionState(4, 3, batch_shape=(2,))
    x = np.zeros((2, 1, 4))
    y = np.zeros((2, 1, 3))
    with pytest.raises(ValueError, match=r"q must have shape \(2, T, 4\).*got \(3, 1, 4\)"):
        st_.step(np.zeros((3, 1, 4)), x, y)
    with pytest.raises(ValueError, match=r"v must have shape \(2, T, 3\).*value_dim 3.*got \(2, 1, 4\)"):
        st_.step(x, x, x)
    with pytest.raises(ValueError, match="same number of tokens"):
        st_.step(x, np.zeros((2, 2, 4)), y)
    with pytest.raises(ValueError, match="k must have shape"):
        st_.prefill(np.zeros((2, 1, 5)), y)
    with pytest.raises(TypeError, match="q must have dtype float16, float32 or float64"):
        st_.step(x.astype(np.int64), x, y)
    with pytest.raises(ValueError, match="key_dim must be >= 1"):
        LinearAttentionState(0, 3)
    with pytest.raises(TypeError, match="value_dim must be an integer"):
        LinearAttentionState(3, 2.0)
    with pytest.raises(TypeError, match="dtype must be float32 or float64"):
        LinearAttentionState(3, 2, dtype=np.float16)
    with pytest.raises(ValueError, match="batch_shape"):
        LinearAttentionState(3, 2, batch_shape=(2, -1))
    with pytest.raises(ValueError, match="device must be one of"):
        LinearAttentionState(3, 2, device="tpu")
    with pytest.raises(ValueError, match="eps"):
        LinearAttentionState(3, 2, eps=-1.0)
    with pytest.raises(ValueError, match="feature_map"):
        LinearAttentionState(3, 2, feature_map="nope")
    assert st_.position == 0 and st_.device == "auto"
    st_.step(x, x, y)
    assert st_.device == "cpu"


def test_nbytes_copy_reset_and_interop(rng):
    """nbytes stays constant while decoding; copies are independent; the state continues
    linear_attention (and the other way round)."""
    q, k, v = qkv(rng, (2, 2), 12, 4, 3)
    st_ = LinearAttentionState(4, 3, batch_shape=(2, 2), dtype=np.float32)
    assert st_.nbytes == 2 * 2 * 4 * (3 + 1) * 4
    sizes = set()
    for t in range(5):
        st_.step(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :])
        sizes.add(st_.nbytes)
    assert sizes == {64 * 4} and st_.position == 5
    twin = st_.copy()
    a = st_.step(q[..., 5:, :], k[..., 5:, :], v[..., 5:, :])
    assert twin.position == 5
    b = twin.step(q[..., 5:, :], k[..., 5:, :], v[..., 5:, :])
    assert np.array_equal(a, b) and np.array_equal(st_.S, twin.S)
    # Hand the state to linear_attention, and take one back.
    full = la.linear_attention(q, k, v, causal=True)
    st64 = LinearAttentionState(4, 3, batch_shape=(2, 2))
    st64.prefill(k[..., :7, :], v[..., :7, :])
    rest = la.linear_attention(q[..., 7:, :], k[..., 7:, :], v[..., 7:, :], causal=True,
                               initial_state=st64.to_linear_state())
    assert_close(rest, full[..., 7:, :], np.float64)
    rest2 = la.linear_attention(q[..., 7:, :], k[..., 7:, :], v[..., 7:, :], causal=True, initial_state=st64)
    assert_close(rest2, full[..., 7:, :], np.float64)
    _, ls = la.linear_attention(q[..., :7, :], k[..., :7, :], v[..., :7, :], causal=True, return_state=True)
    back = LinearAttentionState.from_linear_state(ls, 4)
    assert back.position == 7 and back.batch_shape == (2, 2)
    assert_close(back.step(q[..., 7:, :], k[..., 7:, :], v[..., 7:, :]), full[..., 7:, :], np.float64)
    with pytest.raises(ValueError, match="D_phi"):
        LinearAttentionState.from_linear_state(ls, 4, feature_map="dpfp")
    st64.reset()
    assert st64.position == 0 and not st64.S.any() and not st64.z.any()
    with pytest.raises(ValueError, match="read-only"):
        st64.S[...] = 1.0


def test_state_refuses_gpu_inputs_once_on_the_host():
    class FakeGpu:
        __cuda_array_interface__ = {"shape": (1, 2), "typestr": "<f8", "data": (0, False), "version": 3}
        shape = (1, 2)

    st_ = LinearAttentionState(2, 2, device="cpu")
    with pytest.raises(ValueError, match="lives on the host"):
        st_.step(FakeGpu(), np.zeros((1, 2)), np.zeros((1, 2)))
    st2 = LinearAttentionState(2, 2)
    with pytest.raises(ValueError, match="different devices"):
        st2.step(FakeGpu(), np.zeros((1, 2)), np.zeros((1, 2)))
    assert st2.device == "auto"


# ---------------------------------------------------------------------------
# save / load
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,feature_map,eps", [(np.float32, "elu", 1e-8), (np.float64, fm.DpfpFeatureMap(nu=2), None)])
def test_save_load_round_trip_bit_exact(tmp_path, dtype, feature_map, eps):
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, (2, 3), 9, 4, 5, dtype)
    st_ = LinearAttentionState(4, 5, batch_shape=(2, 3), feature_map=feature_map, dtype=dtype, eps=eps)
    st_.prefill(k[..., :6, :], v[..., :6, :])
    path = tmp_path / "state.npz"
    st_.save(path)
    back = LinearAttentionState.load(path)
    assert back.S.dtype == dtype and back.position == 6 and back.eps == eps
    assert back.batch_shape == (2, 3) and back.key_dim == 4 and back.value_dim == 5
    assert type(back.feature_map) is type(fm.resolve(feature_map))
    assert getattr(back.feature_map, "nu", None) == getattr(fm.resolve(feature_map), "nu", None)
    assert np.array_equal(back.S, st_.S) and np.array_equal(back.z, st_.z)
    a = st_.step(q[..., 6:, :], k[..., 6:, :], v[..., 6:, :])
    b = back.step(q[..., 6:, :], k[..., 6:, :], v[..., 6:, :])
    assert np.array_equal(a, b)
    assert glob.glob(str(tmp_path / ".*")) == []  # no temporary left behind
    # Expectations checked on load.
    LinearAttentionState.load(path, key_dim=4, value_dim=5, batch_shape=(2, 3), dtype=dtype)
    with pytest.raises(StateFileError, match="value_dim is 5, expected 6"):
        LinearAttentionState.load(path, value_dim=6)
    with pytest.raises(StateFileError, match=r"batch_shape is \(2, 3\), expected \(6,\)"):
        LinearAttentionState.load(path, batch_shape=(6,))


def test_save_is_atomic(tmp_path, monkeypatch):
    """A save that fails half-way leaves the previous file intact and no temporary behind."""
    st_ = LinearAttentionState(3, 2)
    st_.prefill(np.ones((4, 3)), np.ones((4, 2)))
    path = tmp_path / "s.npz"
    st_.save(path)
    good = path.read_bytes()

    def broken_savez(f, **arrays):
        f.write(b"PK\x03\x04 half a zip file")
        raise OSError("disk full")

    monkeypatch.setattr(state_mod.np, "savez", broken_savez)
    st_.step(np.ones((1, 3)), np.ones((1, 3)), np.ones((1, 2)))
    with pytest.raises(OSError, match="disk full"):
        st_.save(path)
    assert path.read_bytes() == good
    assert sorted(os.listdir(tmp_path)) == ["s.npz"]
    monkeypatch.undo()
    assert LinearAttentionState.load(path).position == 4


def test_save_keeps_the_umask_and_follows_a_link(tmp_path):
    """A new file had mode 0o644 whatever the umask (readable by everyone under 077); saving to a symbolic link
    replaced the link with a file and left its target stale."""
    st_ = LinearAttentionState(3, 2)
    st_.prefill(np.ones((4, 3)), np.ones((4, 2)))
    old = os.umask(0o077)
    try:
        st_.save(tmp_path / "private.npz")
    finally:
        os.umask(old)
    assert (tmp_path / "private.npz").stat().st_mode & 0o777 == 0o600
    real, link = tmp_path / "real.npz", tmp_path / "latest.npz"
    LinearAttentionState(3, 2).save(real)
    os.chmod(real, 0o640)
    link.symlink_to(real.name)
    st_.save(link)
    assert link.is_symlink() and LinearAttentionState.load(real).position == 4
    assert real.stat().st_mode & 0o777 == 0o640  # the replaced file's mode kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.npz", "private.npz", "real.npz"]


def test_positions_past_int64_and_files_that_are_not_archives(tmp_path):
    """from_linear_state took a position of 2**70, a file's uint64 2**64 - 1 loaded, and save failed with a bare
    OverflowError; a folder read as "corrupted or truncated (IsADirectoryError ...)" and a .npy file as a
    TypeError about the context manager protocol."""
    S, z = np.zeros((4, 3)), np.zeros(4)
    with pytest.raises(ValueError, match=r"state\.position must be at most 2\*\*63 - 1"):
        LinearAttentionState.from_linear_state((S, z, 2 ** 70), 4)
    st_ = LinearAttentionState.from_linear_state((S, z, 2 ** 63 - 1), 4)
    st_.step(np.ones((1, 4)), np.ones((1, 4)), np.ones((1, 3)))
    with pytest.raises(ValueError, match="does not fit the file's int64"):
        st_.save(tmp_path / "past.npz")
    assert not (tmp_path / "past.npz").exists()
    good = tmp_path / "good.npz"
    LinearAttentionState(4, 3).save(good)
    with np.load(good) as npz:
        data = dict(npz)
    data["position"] = np.array(2 ** 64 - 1, dtype=np.uint64)
    np.savez(tmp_path / "huge.npz", **data)
    with pytest.raises(StateFileError, match="position=18446744073709551615"):
        LinearAttentionState.load(tmp_path / "huge.npz")
    with pytest.raises(StateFileError, match="is a folder, not a state file"):
        LinearAttentionState.load(tmp_path)
    np.save(tmp_path / "a.npy", np.ones(3))
    with pytest.raises(StateFileError, match=r"one NumPy array, \.npy"):
        LinearAttentionState.load(tmp_path / "a.npy")


def test_bad_files_rejected_with_clear_errors(tmp_path):
    st_ = LinearAttentionState(3, 2, batch_shape=(2,))
    st_.prefill(np.ones((2, 4, 3)), np.ones((2, 4, 2)))
    good = tmp_path / "good.npz"
    st_.save(good)
    raw = good.read_bytes()
    cases = {
        "truncated": (raw[: len(raw) // 2], "corrupted or truncated"),
        "empty": (b"", "corrupted or truncated"),
        "garbage": (b"not a zip file at all" * 10, "corrupted or truncated"),
    }
    # Flip bytes inside the stored S array: the zip CRC no longer matches.
    pos = raw.find(b"S.npy")
    pos = raw.find(b"\x93NUMPY", pos) + 200
    flipped = bytearray(raw)
    flipped[pos:pos + 4] = bytes(b ^ 0xFF for b in flipped[pos:pos + 4])
    cases["flipped"] = (bytes(flipped), "corrupted or truncated")
    for name, (blob, msg) in cases.items():
        p = tmp_path / f"{name}.npz"
        p.write_bytes(blob)
        with pytest.raises(StateFileError, match=msg):
            LinearAttentionState.load(p)
    edits = {
        "version": (dict(version=np.array(99)), "format version 99 was written by a newer"),
        "format": (dict(format=np.array("something.else")), "not a LinearAttentionState file"),
        "missing": (dict(z=None), "missing entries \\['z'\\]"),
        "shape": (dict(S=np.zeros((2, 3, 3))), r"S has shape \(2, 3, 3\).*expected \(2, 3, 2\)"),
        "dtype": (dict(z=np.zeros((2, 3), dtype=np.float32)), "S and z must both be float32 or float64"),
        "int": (dict(S=np.zeros((2, 3, 2), dtype=np.int64), z=np.zeros((2, 3), dtype=np.int64)),
                "float32 or float64"),
        "nan": (dict(S=np.full((2, 3, 2), np.nan)), "non-finite"),
        "position": (dict(position=np.array(-3)), "invalid dimensions"),
        "fmap": (dict(feature_map=np.array("no_such_map")), "cannot rebuild feature map 'no_such_map'"),
        "probe": (dict(feature_map=np.array("relu")), "other features"),
        "key_dim": (dict(key_dim=np.array(5)), r"S has shape .* expected \(2, 5, 2\)"),
    }
    for name, (change, msg) in edits.items():
        p = tmp_path / f"{name}.npz"
        rewrite_state_file(good, p, **change)
        with pytest.raises(StateFileError, match=msg):
            LinearAttentionState.load(p)
    # A pickled object array is never unpickled.
    p = tmp_path / "pickle.npz"
    with np.load(good, allow_pickle=False) as npz:
        data = {k: npz[k] for k in npz.files}
    data["S"] = np.array([{"evil": 1}], dtype=object)
    np.savez(p, **data)
    with pytest.raises(StateFileError, match="corrupted or truncated|cannot read"):
        LinearAttentionState.load(p)
    with pytest.raises(FileNotFoundError):
        LinearAttentionState.load(tmp_path / "absent.npz")
    assert isinstance(StateFileError("x"), ValueError)
    assert zipfile.is_zipfile(io.BytesIO(raw))


def test_unregistered_feature_map_needs_feature_map_on_load(tmp_path):
    class Square(fm.ElementwiseFeatureMap):
        name = "square_unregistered"

        def _f(self, x):
            return x * x

    st_ = LinearAttentionState(3, 2, feature_map=Square())
    st_.prefill(np.ones((2, 3)), np.ones((2, 2)))
    p = tmp_path / "sq.npz"
    st_.save(p)
    with pytest.raises(StateFileError, match="cannot be rebuilt.*pass feature_map="):
        LinearAttentionState.load(p)
    back = LinearAttentionState.load(p, feature_map=Square())
    assert np.array_equal(back.S, st_.S)
    with pytest.raises(StateFileError, match="other features"):
        LinearAttentionState.load(p, feature_map="elu")


# ---------------------------------------------------------------------------
# KVCache: the softmax baseline
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,block,n", [(np.float64, 5, 29), (np.float32, 5, 29), (np.float32, 130, 300)])
def test_kv_cache_steps_equal_softmax_causal_rows(dtype, block, n, monkeypatch):
    """Prefill, then steps of 1 and several tokens (from an empty cache too), with key blocks
    smaller than the cache (short blocks as loops, >= 128 keys through BLAS, mixed in one
    online softmax): the outputs are the causal softmax rows."""
    monkeypatch.setattr(config, "KV_BLOCK", block)
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, (2, 3), n, 6, 4, dtype, scale=2.0)
    ref = la.softmax_attention(q, k, v, causal=True, method="quadratic")
    cache = KVCache(6, 4, batch_shape=(2, 3), dtype=dtype, capacity=2)
    outs = [cache.step(q[..., :1, :], k[..., :1, :], v[..., :1, :])]
    cache.prefill(k[..., 1:9, :], v[..., 1:9, :])
    a = 9
    for b in (10, 11, 20, 20, n - 1, n):
        outs.append(cache.step(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :]))
        a = b
    got = np.concatenate(outs, axis=-2)
    want = np.concatenate([ref[..., :1, :], ref[..., 9:, :]], axis=-2)
    assert got.dtype == dtype
    assert_close(got, want, dtype)
    last = step_naive.kv_step_reference(q[..., n - 1:, :].reshape(6, 1, 6), k.reshape(6, n, 6),
                                        v.reshape(6, n, 4), scale=1 / np.sqrt(6))
    assert_close(got[..., -1:, :], last.reshape(2, 3, 1, 4), dtype)
    assert cache.length == n and cache.position == n
    assert np.array_equal(cache.keys, k.astype(dtype)) and np.array_equal(cache.values, v.astype(dtype))
    # query attends to all cached tokens without appending.
    res = cache.query(q[..., :3, :])
    s = np.einsum("...td,...ld->...tl", q[..., :3, :].astype(np.float64), k.astype(np.float64)) / np.sqrt(6)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    assert_close(res, w @ v.astype(np.float64), dtype)
    assert cache.length == n


@pytest.mark.parametrize("batch_shape", [(), (3,), (2, 2)])
def test_kv_fast_decode_path(batch_shape, monkeypatch):
    """Contiguous single tokens of the cache dtype take the lean path (no validation helper)
    and give the same rows; NaN is still refused there, nothing appended."""
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, batch_shape, 12, 4, 3, np.float32)
    ref = la.softmax_attention(q, k, v, causal=True, method="quadratic")
    cache = KVCache(4, 3, batch_shape=batch_shape, dtype=np.float32, capacity=1)
    cache.prefill(k[..., :5, :], v[..., :5, :])

    def boom(*a, **kw):
        raise AssertionError("the decode step left the fast path")

    monkeypatch.setattr(KVCache, "_prepare", boom)
    toks = [tuple(np.ascontiguousarray(x[..., t:t + 1, :]) for x in (q, k, v)) for t in range(5, 12)]
    got = np.concatenate([cache.step(*tk) for tk in toks], axis=-2)
    assert_close(got, ref[..., 5:, :], np.float32)
    bad = toks[0][2].copy()
    bad.flat[0] = np.nan
    with pytest.raises(ValueError, match="v contains"):
        cache.step(toks[0][0], toks[0][1], bad)
    assert cache.length == 12


def test_kv_cache_grows_geometrically_and_reports_memory():
    cache = KVCache(2, 3, batch_shape=(4,), dtype=np.float32, capacity=1)
    caps = []
    for _ in range(40):
        cache.step(np.zeros((4, 1, 2)), np.zeros((4, 1, 2)), np.ones((4, 1, 3)))
        caps.append(cache.capacity)
    assert sorted(set(caps)) == [1, 2, 4, 8, 16, 32, 64]  # doubling: O(log n) copies
    assert cache.nbytes == 4 * 64 * (2 + 3) * 4
    cache.reserve(1000)
    assert cache.capacity == 1000 and cache.length == 40
    for bad, exc in (("x", TypeError), (None, TypeError), (2000.7, TypeError), (True, TypeError), (-1, ValueError)):
        with pytest.raises(exc, match=r"^tokens must be"):  # named, nothing grown (2000.7 was cut to 2000)
            cache.reserve(bad)
    cache.reserve(np.int64(10))  # fits already
    assert cache.capacity == 1000
    assert np.array_equal(cache.values[:, :, 0], np.ones((4, 40)))
    twin = cache.copy()
    twin.step(np.zeros((4, 1, 2)), np.zeros((4, 1, 2)), np.ones((4, 1, 3)))
    assert cache.length == 40 and twin.length == 41
    twin.truncate(10)
    assert twin.length == 10 and twin.keys.shape == (4, 10, 2)
    with pytest.raises(ValueError, match=r"length must be in \[0, 10\]"):
        twin.truncate(11)
    cache.reset()
    assert cache.length == 0


def test_kv_cache_errors():
    cache = KVCache(3, 2)
    with pytest.raises(ValueError, match="empty"):
        cache.query(np.zeros((1, 3)))
    with pytest.raises(ValueError, match="q must have shape"):
        cache.step(np.zeros((2, 1, 3)), np.zeros((1, 3)), np.zeros((1, 2)))
    with pytest.raises(ValueError, match="CPU kernel only"):
        KVCache(3, 2, device="cuda")
    with pytest.raises(ValueError, match="k contains"):
        cache.prefill(np.full((1, 3), np.inf), np.zeros((1, 2)))
    with pytest.raises(ValueError, match="scale must be finite"):
        KVCache(3, 2, scale=np.inf)
    with pytest.raises(ValueError, match="capacity"):
        KVCache(3, 2, capacity=-1)
    for wrong in (2.0, "8", True):  # not an integer: a TypeError, as reserve() and truncate() raise
        with pytest.raises(TypeError, match="capacity"):
            KVCache(3, 2, capacity=wrong)
    assert cache.length == 0
    custom = KVCache(3, 2, scale=0.5)
    x = np.arange(6.0).reshape(2, 3)
    out = custom.step(x, x, np.eye(2))
    assert_close(out, la.softmax_attention(x, x, np.eye(2), causal=True, scale=0.5, method="quadratic"), np.float64)


def test_step_out_argument_on_the_host():
    """step(out=...) with host inputs fills and returns the caller's array (fast path or not), equal to
    the result without it; a wrong out is refused before the state changes."""
    rng = np.random.default_rng(11)
    q, k, v = rng.normal(size=(3, 2, 4, 3))
    a = LinearAttentionState(3, 3, batch_shape=(2,))
    b = LinearAttentionState(3, 3, batch_shape=(2,))
    for t in range(4):
        sl = slice(t, t + 1)
        out = np.full((2, 1, 3), np.nan)
        res = a.step(q[:, sl], k[:, sl], v[:, sl], out=out)
        assert res is out
        np.testing.assert_array_equal(out, b.step(q[:, sl], k[:, sl], v[:, sl]))
    with pytest.raises(TypeError, match="out must have dtype float64"):  # as linear_attention's out
        a.step(q[:, :1], k[:, :1], v[:, :1], out=np.empty((2, 1, 3), np.float32))
    with pytest.raises(ValueError, match=r"out must have shape \(2, 1, 3\)"):
        a.step(q[:, :1], k[:, :1], v[:, :1], out=np.empty((2, 2, 3)))
    with pytest.raises(TypeError, match="out must be a numpy.ndarray"):
        a.step(q[:, :1], k[:, :1], v[:, :1], out=[[0.0] * 3] * 2)
    # a new state's first call refused for its out: nothing fixed, its device included (it became "cpu")
    fresh = LinearAttentionState(3, 3, batch_shape=(2,))
    with pytest.raises(TypeError, match="out must have dtype"):
        fresh.step(q[:, :2], k[:, :2], v[:, :2], out=np.empty((2, 2, 3), np.float32))
    assert fresh.device == "auto" and fresh.position == 0
    assert a.position == 4
    c = LinearAttentionState(3, 3, batch_shape=(2,))
    d = LinearAttentionState(3, 3, batch_shape=(2,))
    out = np.empty((2, 2, 3))
    assert c.step(q[:, :2], k[:, :2], v[:, :2], decay=0.5, out=out) is out  # the rule path
    np.testing.assert_array_equal(out, d.step(q[:, :2], k[:, :2], v[:, :2], decay=0.5))


# ---------------------------------------------------------------------------
# the state with the random, positional, learned and polynomial maps
# ---------------------------------------------------------------------------
def _other_map(name, n):
    if name == "favor+":
        return fm.get("favor+", num_features=12, seed=3)
    if name == "rff":
        return fm.get("rff", num_features=6, seed=3)
    if name == "cosformer":  # segment-wise decoding needs one M for every segment
        return fm.get("cosformer", max_length=n)
    if name == "hedgehog":  # a learned map: weights away from its identity start
        r = np.random.default_rng(3)
        return fm.get("hedgehog", W=np.eye(4) + 0.3 * r.normal(size=(4, 4)), b=0.1 * r.normal(size=4))
    return fm.get(name)


@pytest.mark.parametrize("name", ["favor+", "rff", "cosformer", "hedgehog", "taylor2"])
def test_state_with_random_positional_learned_and_polynomial_maps(name, tmp_path):
    """LinearAttentionState with FAVOR+, RFF (signed), cosFormer (position-dependent), Hedgehog and
    Taylor-2 (CPU): prefill then decode one token and several at a time gives the causal kernel's
    rows and final state (float64: 1e-12 on the state), and a saved state decodes identically."""
    n, d, m = 19, 4, 3
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, (2,), n, d, m, scale=0.5)
    fmap = _other_map(name, n)
    out_ref, S_ref, z_ref = reference(q, k, v, feature_map=fmap)
    kernel, st_kernel = la.linear_attention(q, k, v, causal=True, feature_map=fmap, return_state=True)
    assert_close(kernel, out_ref, np.float64)
    st_ = LinearAttentionState(d, m, batch_shape=(2,), feature_map=fmap)
    assert st_.S.shape == (2, fmap.output_dim(d), m)
    st_.prefill(k[..., :6, :], v[..., :6, :])
    outs = [st_.step(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :]) for t in range(6, 10)]
    path = tmp_path / "state.npz"
    st_.save(path)
    back = LinearAttentionState.load(path, feature_map=fmap)
    assert back.position == 10
    rest = st_.step(q[..., 10:, :], k[..., 10:, :], v[..., 10:, :])
    assert np.array_equal(back.step(q[..., 10:, :], k[..., 10:, :], v[..., 10:, :]), rest)
    dec = np.concatenate(outs + [rest], axis=-2)
    assert dec.shape == (2, n - 6, m)
    assert_close(dec, out_ref[..., 6:, :], np.float64)
    assert_close(dec, kernel[..., 6:, :], np.float64)
    assert st_.position == n
    np.testing.assert_allclose(st_.S, S_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st_.z, z_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st_.S, st_kernel.S, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st_.z, st_kernel.z, rtol=1e-12, atol=1e-12)


def test_kv_cache_dtype_error_speaks_of_the_cache():
    with pytest.raises(TypeError, match=r"float32 or float64 \(the cache's keys and values\), got float16"):
        la.KVCache(4, 4, dtype=np.float16)


@pytest.mark.parametrize("kw", [{}, {"rule": "delta", "feature_map": "l2"}, {"dtype": np.float32}])
def test_copy_copy_and_pickle_give_independent_states(kw):
    """copy.copy shared the buffers the step kernels write in place (the original then held the copy's
    tokens at its own position), and pickle failed on the launcher closure; both now give an independent
    state with the same S, z, position, rule, dtype and map, which continues as the original does."""
    import copy
    import pickle

    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(3, 2, 8, 4))
    beta = (lambda n: {"beta": np.full((2, n), 0.5)}) if "rule" in kw else (lambda n: {})
    st = LinearAttentionState(4, 4, batch_shape=(2,), **kw)
    st.prefill(k[:, :5], v[:, :5], **beta(5))
    S0 = st.S.copy()
    shallow = copy.copy(st)
    shallow.step(q[:, 5:7], k[:, 5:7], v[:, 5:7], **beta(2))
    assert st.position == 5 and np.array_equal(st.S, S0)
    back = pickle.loads(pickle.dumps(st))
    assert (back.position, back.rule, back.dtype, back.feature_map.name) == (5, st.rule, st.dtype,
                                                                            st.feature_map.name)
    assert np.array_equal(back.S, st.S) and np.array_equal(back.z, st.z)
    np.testing.assert_array_equal(back.step(q[:, 7:], k[:, 7:], v[:, 7:], **beta(1)),
                                  st.step(q[:, 7:], k[:, 7:], v[:, 7:], **beta(1)))


def test_copy_copy_of_a_kv_cache_keeps_its_own_tokens():
    import copy

    from linattn_nb import KVCache

    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(3, 2, 8, 4))
    cache = KVCache(4, 4, batch_shape=(2,))
    cache.prefill(k[:, :5], v[:, :5])
    other = copy.copy(cache)
    other.step(q[:, 5:6], k[:, 5:6], v[:, 5:6])
    cache.step(q[:, 6:7], k[:, 6:7] + 3.0, v[:, 6:7])
    np.testing.assert_array_equal(other.keys[:, 5], k[:, 5])


@pytest.mark.parametrize("rule", [{}, {"decay": 0.9}, {"beta": 0.5}, "prefill"])
def test_a_refused_first_call_leaves_the_device_open(rule):
    """A new state's first step (or prefill) refused for a NaN input fixed its device to "cpu" (every path but
    the additive single-token one), so it then refused GPU inputs, though its message says nothing changed."""
    q = np.ones((2, 4))
    v = np.ones((2, 3))
    bad = q.copy()
    bad[1, 0] = np.nan
    st = LinearAttentionState(4, 3)
    with pytest.raises(ValueError, match="contains non-finite values"):
        if rule == "prefill":
            st.prefill(bad, v)
        else:
            st.step(bad, q, v, **rule)
    assert st.device == "auto" and st.position == 0 and st.rule is None
    assert not np.any(st.S) and not np.any(st.z)


def test_save_paths_that_name_a_folder_or_a_missing_one_and_bytes_paths(tmp_path):
    """``save("x.npz/")`` wrote ``x.npz`` (realpath drops the slash) and ``load`` of the same path failed; a missing
    folder's error named the temporary file; a bytes path could not be saved though load reads it."""
    st = la.LinearAttentionState(4, 3)
    st.prefill(np.ones((2, 4)), np.ones((2, 3)))
    for bad in (str(tmp_path / "s.npz") + "/", str(tmp_path), ""):
        with pytest.raises(IsADirectoryError, match="names a folder"):
            st.save(bad)
    assert list(tmp_path.iterdir()) == []
    missing = tmp_path / "nofolder" / "s.npz"
    with pytest.raises(FileNotFoundError, match=r"cannot write '.*nofolder/s\.npz': the folder .* does not exist"):
        st.save(missing)
    st.save(os.fsencode(tmp_path / "b.npz"))
    assert la.LinearAttentionState.load(os.fsencode(tmp_path / "b.npz")).position == 2


@pytest.mark.parametrize("value, error", [(4.9, TypeError), ("four", TypeError), ([3], TypeError), (True, TypeError),
                                          (0, ValueError)])
def test_load_checks_the_expected_dimensions_as_the_constructor_does(tmp_path, value, error):
    """``load(key_dim=4.9)`` loaded a key_dim-4 state (int() truncated it); "four" and [3] gave int()'s message,
    naming nothing."""
    la.LinearAttentionState(4, 3).save(tmp_path / "s.npz")
    with pytest.raises(error, match="key_dim must be"):
        la.LinearAttentionState.load(tmp_path / "s.npz", key_dim=value)


def test_entries_valid_alone_but_not_together_are_a_state_file_error(tmp_path):
    """A favor+ state saved with normalize off (a hand-edited file) raised the constructor's plain ValueError,
    naming no file, where load documents StateFileError for inconsistent entries."""
    st = la.LinearAttentionState(4, 3, feature_map=fm.get("favor+", num_features=5, seed=1))
    st.save(tmp_path / "f.npz")
    entries = dict(np.load(tmp_path / "f.npz"))
    entries["normalize"] = np.array(0)
    np.savez(tmp_path / "e.npz", **entries)
    with pytest.raises(state_mod.StateFileError, match=r"e\.npz: inconsistent entries: .*normalize"):
        la.LinearAttentionState.load(tmp_path / "e.npz")
