"""LinearAttentionState where finite inputs overflow a dtype: no NaN or inf is returned in silence.

* a NumPy-side map whose float32 features of finite inputs overflow (taylor2, dpfp: inf features; rff
  raises FeatureOverflow) runs in float64 before the state sees anything, as ``linear_attention`` does:
  outputs and state as the float64 computation's; a float32 state, which could not sum such features,
  refuses the call and is left as it was;
* outputs that overflow their dtype, and a float32 state that overflows, raise NonFiniteResult on every
  CPU path (the additive fast path, the rule fast path, the generic kernel, prefill, query); the message
  says that the tokens were absorbed and whether the state overflowed;
* ``check_finite=False`` keeps the unchecked behaviour (the values as computed).
"""
from __future__ import annotations

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import feature_maps as fm
from linattn_nb.feature_maps._base import FeatureOverflow
from linattn_nb.ops._finite import NonFiniteResult

D = 4


def _inputs(scale, n=3, seed=0):
    rng = np.random.default_rng(seed)
    q, v = (rng.standard_normal((1, n, D)) for _ in range(2))
    q = (q * scale).astype(np.float32)
    return q, q[:, ::-1].copy(), v.astype(np.float32)  # the keys: the queries in reverse order


def _maps():
    return [fm.get("taylor2"), fm.get("dpfp"), fm.get("rff", dim=D, seed=0)]


def _overflows_float32(fmap, x):
    """Whether the map's float32 features of the finite x are not finite (or the map says so)."""
    try:
        return not np.isfinite(fmap(x)).all()
    except FeatureOverflow:
        return True


# taylor2 and dpfp: inf features in float32; rff (its exp(|x|^2 / 2) factor) raises FeatureOverflow, finite in
# float64 at this scale
SCALES = {"taylor2": 1e20, "dpfp": 1e20, "rff": 15.0}


@pytest.mark.parametrize("fmap", _maps()[:2], ids=lambda m: m.name)
def test_numpy_map_overflow_runs_in_float64_like_linear_attention(fmap):
    q, k, v = _inputs(SCALES[fmap.name])
    assert _overflows_float32(fmap, q)  # the case under test
    ref, ref_state = la.linear_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                         feature_map=fmap, causal=True, return_state=True)
    st = la.LinearAttentionState(D, D, feature_map=fmap, batch_shape=(1,))
    outs = [st.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]) for t in range(q.shape[1])]
    out = np.concatenate(outs, axis=1)
    assert out.dtype == np.float32 and np.isfinite(out).all()
    np.testing.assert_allclose(out, ref.astype(np.float32), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(st.S, ref_state.S, rtol=1e-12)
    np.testing.assert_allclose(st.z, ref_state.z, rtol=1e-12)
    # the same through prefill and query
    st2 = la.LinearAttentionState(D, D, feature_map=fmap, batch_shape=(1,))
    st2.prefill(k, v)
    np.testing.assert_allclose(st2.S, ref_state.S, rtol=1e-12)
    got = st2.query(q[:, -1:])
    assert got.dtype == np.float32 and np.isfinite(got).all()
    np.testing.assert_allclose(got, ref[:, -1:].astype(np.float32), rtol=1e-6, atol=1e-6)
    # linear_attention of the float32 inputs agrees (it recomputes in float64 too)
    np.testing.assert_allclose(out, la.linear_attention(q, k, v, feature_map=fmap, causal=True), rtol=1e-6,
                               atol=1e-6)


def test_outputs_of_float64_features_that_overflow_float32_raise_after_the_tokens_were_absorbed():
    # rff's features are not positive: its normalised outputs of these inputs exceed float32 in float64
    fmap = fm.get("rff", dim=D, seed=0)
    q, k, v = _inputs(SCALES["rff"])
    st = la.LinearAttentionState(D, D, feature_map=fmap, batch_shape=(1,))
    with pytest.raises(NonFiniteResult, match=r"overflow float32 \(they are finite in float64\).*position 3"):
        st.step(q, k, v)
    ref = la.LinearAttentionState(D, D, feature_map=fmap, batch_shape=(1,))
    out64 = ref.step(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    assert np.isfinite(out64).all() and np.abs(out64).max() > np.finfo(np.float32).max
    np.testing.assert_array_equal(st.S, ref.S)
    assert st.position == 3


# rff: only its keys overflow (its query features carry no exp(|x|^2 / 2) factor)
REFUSED = [(m, call) for m in _maps() for call in ("step", "prefill", "query") if (m.name, call) != ("rff", "query")]


@pytest.mark.parametrize("fmap, call", REFUSED, ids=lambda x: getattr(x, "name", x))
def test_a_float32_state_refuses_overflowing_features_and_is_left_as_it_was(fmap, call):
    q, k, v = _inputs(SCALES[fmap.name])
    st = la.LinearAttentionState(D, D, feature_map=fmap, batch_shape=(1,), dtype=np.float32)
    st.step(*_inputs(1.0, n=1, seed=1))
    S0, z0, pos = st.S.copy(), st.z.copy(), st.position
    with pytest.raises(ValueError, match=r"overflows float32.*float64 state"):
        if call == "step":
            st.step(q, k, v)
        elif call == "prefill":
            st.prefill(k, v)
        else:
            st.query(q)
    assert st.position == pos
    np.testing.assert_array_equal(st.S, S0)
    np.testing.assert_array_equal(st.z, z0)


def test_numpy_map_overflow_with_check_finite_false_still_runs_in_float64():
    fmap = fm.get("taylor2")
    q, k, v = _inputs(1e20)
    st = la.LinearAttentionState(D, D, feature_map=fmap, batch_shape=(1,))
    out = st.step(q, k, v, check_finite=False)  # the map's inf features are not scanned: the kernel sees them
    assert out.dtype == np.float32
    # rff raises FeatureOverflow itself: caught with or without the check
    fmap = fm.get("rff", dim=D, seed=0)
    q, k, v = _inputs(SCALES["rff"])
    st = la.LinearAttentionState(D, D, feature_map=fmap, batch_shape=(1,))
    st.step(q, k, v, check_finite=False)
    ref = la.LinearAttentionState(D, D, feature_map=fmap, batch_shape=(1,))
    ref.step(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    np.testing.assert_array_equal(st.S, ref.S)  # the float64 features' state


# outputs and states that overflow: q, k of 1e5 and v of 3e37 (phi(q) . phi(k) v ~ 1e47)
BIG_Q = np.full((1, 1, D), 1e5, np.float32)
BIG_V = np.full((1, 1, D), 3e37, np.float32)

# (arguments of step, the path it takes)
PATHS = {
    "additive fast path": {},
    "rule fast path": {"decay": 0.9},
    "generic kernel": {"log_decay": np.zeros((1, 1, 1))},
}


@pytest.mark.parametrize("path", list(PATHS))
def test_unnormalised_outputs_that_overflow_float32_raise_and_the_float64_state_absorbed_them(path):
    st = la.LinearAttentionState(D, D, batch_shape=(1,), normalize=False)
    with pytest.raises(NonFiniteResult, match=r"not finite in float32.*absorbed the 1 token\(s\) \(position 1\)"):
        st.step(BIG_Q, BIG_Q, BIG_V, **PATHS[path])
    assert st.position == 1
    assert np.isfinite(st.S).all() and np.isfinite(st.z).all()
    ref = la.LinearAttentionState(D, D, batch_shape=(1,), normalize=False)
    out64 = ref.step(BIG_Q.astype(np.float64), BIG_Q.astype(np.float64), BIG_V.astype(np.float64), **PATHS[path])
    np.testing.assert_array_equal(st.S, ref.S)  # what the error says: the tokens were absorbed
    assert np.isfinite(out64).all() and np.abs(out64).max() > np.finfo(np.float32).max


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("normalize", [True, False])
def test_a_float32_state_that_overflows_raises(path, normalize):
    st = la.LinearAttentionState(D, D, batch_shape=(1,), dtype=np.float32, normalize=normalize)
    with pytest.raises(NonFiniteResult, match=r"float32 state overflowed.*position 1.*reset\(\)"):
        st.step(BIG_Q, BIG_Q, BIG_V, **PATHS[path])
    assert st.position == 1


def test_several_tokens_and_prefill_raise_when_the_float32_state_overflows():
    q3, v3 = np.repeat(BIG_Q, 3, axis=1), np.repeat(BIG_V, 3, axis=1)
    st = la.LinearAttentionState(D, D, batch_shape=(1,), dtype=np.float32)
    with pytest.raises(NonFiniteResult, match=r"float32 state overflowed.*3 token\(s\) \(position 3\)"):
        st.step(q3, q3, v3)
    st = la.LinearAttentionState(D, D, batch_shape=(1,), dtype=np.float32)
    with pytest.raises(NonFiniteResult, match=r"float32 state overflowed.*3 token\(s\) \(position 3\)"):
        st.prefill(q3, v3)
    st = la.LinearAttentionState(D, D, batch_shape=(1,))  # float64: sums them
    st.prefill(q3, v3)
    assert st.position == 3 and np.isfinite(st.S).all()


def test_a_query_that_overflows_raises_and_leaves_the_state():
    st = la.LinearAttentionState(D, D, batch_shape=(1,), normalize=False)
    st.prefill(BIG_Q, BIG_V)
    S0 = st.S.copy()
    with pytest.raises(NonFiniteResult, match="state is unchanged"):
        st.query(BIG_Q)
    np.testing.assert_array_equal(st.S, S0)
    assert np.isfinite(st.query(BIG_Q.astype(np.float64))).all()  # float64 queries read it


def test_check_finite_false_returns_the_values_as_computed():
    st = la.LinearAttentionState(D, D, batch_shape=(1,), normalize=False)
    out = st.step(BIG_Q, BIG_Q, BIG_V, check_finite=False)
    assert np.isinf(out).all() and st.position == 1


def test_large_finite_outputs_are_not_flagged():
    # outputs near float32's largest value, finite: no error (the check is per element, not a sum)
    st = la.LinearAttentionState(64, 64, batch_shape=(1,))
    v = np.full((1, 1, 64), 3e38, np.float32)
    x = np.full((1, 1, 64), 0.1, np.float32)
    out = st.step(x, x, v)
    assert np.isfinite(out).all() and out.max() == np.float32(3e38)


# KVCache: scores q . k beyond float32's range (|q|, |k| ~ 1e20) gave NaN outputs in a float32 cache
@pytest.mark.parametrize("block", [2, 256])  # plain loops, and BLAS from 128 keys a block
def test_kv_cache_scores_beyond_float32_are_recomputed_in_float64(block, monkeypatch):
    from linattn_nb import config

    monkeypatch.setattr(config, "KV_BLOCK", block)
    rng = np.random.default_rng(3)
    n = 200
    q, k = ((rng.standard_normal((2, n, D)) * 1e20).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((2, n, D)).astype(np.float32)
    ref = la.softmax_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True)
    assert np.isfinite(ref).all()
    cache = la.KVCache(D, D, batch_shape=(2,), dtype=np.float32)
    cache.prefill(k[:, :150], v[:, :150])
    outs = [cache.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]) for t in range(150, 190)]  # fast path
    outs.append(cache.step(q[:, 190:], k[:, 190:], v[:, 190:]))  # several tokens
    got = np.concatenate(outs, axis=1)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    np.testing.assert_allclose(got, ref[:, 150:].astype(np.float32), rtol=1e-5, atol=1e-6)
    assert cache.length == n
    # a query reads the whole cache
    got = cache.query(q[:, -3:])
    s = np.einsum("btd,bnd->btn", q[:, -3:].astype(np.float64), k.astype(np.float64)) / np.sqrt(D)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    full = (p / p.sum(axis=-1, keepdims=True)) @ v.astype(np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, full.astype(np.float32), rtol=1e-5, atol=1e-6)


def test_float16_outputs_that_overflow_in_the_cast_raise_and_the_state_absorbed_them():
    # float16 inputs run in float32; outputs of 30 * 30 * 8 * 1000 = 7.2e6 exceed float16's 65504
    q = np.full((1, 3, 8), 30, np.float16)
    v = np.full((1, 3, 8), 1000, np.float16)
    st = la.LinearAttentionState(8, 8, normalize=False)
    with pytest.raises(NonFiniteResult, match=r"overflow float16 \(they are finite in float32\).*position 3"):
        st.step(q[0], q[0], v[0])
    assert st.position == 3 and np.isfinite(st.S).all()
    st = la.LinearAttentionState(8, 8)  # normalised: the values' average fits
    out = st.step(q[0], q[0], v[0])
    assert out.dtype == np.float16 and np.isfinite(out).all()


def test_features_not_finite_even_in_float64_are_refused_by_name():
    q = np.full((1, 1, D), 1e200)  # taylor2's squares: 1e400, beyond float64
    st = la.LinearAttentionState(D, D, feature_map="taylor2", batch_shape=(1,))
    with pytest.raises(ValueError, match=r"'taylor2' returns non-finite features for the finite q, even in float64"):
        st.step(q, np.ones_like(q), np.ones((1, 1, D)))
    assert st.position == 0 and not st.S.any()
    F = fm.get("taylor2").output_dim(D)
    with pytest.raises(ValueError, match="even in float64"):
        la.dplr_attention(q, np.ones_like(q), np.ones((1, 1, D)), a=np.zeros((1, 1, F)), b=np.zeros((1, 1, F)),
                          feature_map="taylor2", method="scan")


# A GPU state (the CUDA simulator where there is no GPU) with a NumPy-side map: the features come from the
# host, finite, and the step and prefill kernels check the outputs and the new state as for the inline maps,
# so a result that overflows leaves the state as it was (its buffers are not swapped) and raises.
_HAVE_CUDA = __import__("linattn_nb.device", fromlist=["cuda_status"]).cuda_status() != "none"


def _host(x):
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


@pytest.mark.slow
@pytest.mark.skipif(not _HAVE_CUDA, reason="no CUDA and no simulator")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator's NumPy scalars warn on the overflow
@pytest.mark.parametrize("call", ["step", "prefill"])
def test_a_gpu_state_with_a_numpy_side_map_keeps_its_state_when_it_would_overflow(call):
    fmap = fm.get("taylor2")  # features 1, x, x x^T / sqrt(2): finite in float32 for |x| = 3e4
    big = np.full((1, 1, D), 3e4, np.float32)
    assert np.isfinite(fmap(big)).all()  # no float64 recomputation: the features reach the kernel
    st = la.LinearAttentionState(D, D, feature_map=fmap, batch_shape=(1,), dtype=np.float32, device="cuda")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, D)).astype(np.float32)
    st.prefill(x, x)
    S0, z0 = _host(st.S).copy(), _host(st.z).copy()
    with pytest.raises(NonFiniteResult, match="state is unchanged"):
        if call == "step":
            st.step(big, big, BIG_V)
        else:
            st.prefill(big, BIG_V)
    np.testing.assert_array_equal(_host(st.S), S0)
    np.testing.assert_array_equal(_host(st.z), z0)
    assert st.position == 2
    out = st.step(x[:, :1], x[:, :1], x[:, :1])  # the state still works
    assert np.isfinite(out).all() and st.position == 3


@pytest.mark.parametrize("kw", [{}, {"dtype": np.float32}, {"batch_shape": (1,)}, {"decay": 0.9}, {"beta": 0.5}])
def test_a_zero_normaliser_without_floor_raises_nonfiniteresult_not_zerodivisionerror(kw):
    """relu features of -q are all 0: with eps=None the step's normaliser is 0, which the docs answer with
    NonFiniteResult; the decode kernels divided with Python's error model and raised ZeroDivisionError."""
    rule = {k: kw.pop(k) for k in ("decay", "beta") if k in kw}
    st = la.LinearAttentionState(4, 4, feature_map="relu", eps=None, normalize=True, **kw)
    k = np.array([[1.0, 2, 3, 4]]).reshape(kw.get("batch_shape", ()) + (1, 4))
    with pytest.raises(NonFiniteResult, match="normaliser is 0 with eps=None"):
        st.step(-k, k, np.ones_like(k), **rule)


@pytest.mark.parametrize("path", list(PATHS))
def test_a_float32_states_normaliser_that_overflows_is_reported_not_read_as_a_zero_output(path):
    """float64 inputs of 2e19 through a float32 state: phi(q) . z (about 1.6e39) overflows the state's float32 sums
    while the numerators, summed from the float64 values, do not; ``num / inf`` was a silent 0 (the right answer
    is ``v`` itself).  It raises NonFiniteResult and names the float64 state; the query does too."""
    x = np.full((1, 1, D), 2e19)
    v = np.arange(1.0, D + 1.0).reshape(1, 1, D)
    st = la.LinearAttentionState(D, D, batch_shape=(1,), dtype=np.float32)
    with pytest.raises(NonFiniteResult, match=r"float32 state's sums \(use a float64 state"):
        st.step(x, x, v, **PATHS[path])
    with pytest.raises(NonFiniteResult, match=r"float32 state's sums \(use a float64 state"):
        st.query(x)
    wide = la.LinearAttentionState(D, D, batch_shape=(1,), dtype=np.float64)
    np.testing.assert_allclose(wide.step(x, x, v, **PATHS[path]), v, rtol=1e-12)


@pytest.mark.parametrize("call", ["prefill", "step"])
def test_a_float32_kv_cache_refuses_finite_tokens_beyond_float32_and_appends_nothing(call):
    """float64 keys or values of 1e39 were cast to inf in a float32 cache (a NumPy warning only), appended,
    and every later query failed, blaming float64 scores; now a ValueError names the input, nothing appended."""
    c = la.KVCache(D, D, dtype=np.float32)
    big, one = np.full((1, D), 1e39), np.ones((1, D))
    with pytest.raises(ValueError, match=r"^k has 4 finite value\(s\) beyond the range of the float32 cache"):
        c.prefill(big, one) if call == "prefill" else c.step(one, big, one)
    with pytest.raises(ValueError, match=r"^v has 4 finite value\(s\) beyond the range of the float32 cache"):
        c.prefill(one, big) if call == "prefill" else c.step(one, one, big)
    assert c.length == 0
    c.prefill(one, one)
    np.testing.assert_allclose(c.query(one), one)


def test_a_float32_state_says_it_is_the_queries_features_that_overflow():
    """The refusal said "and so would the float32 state that sums them" of query features, which the state
    does not sum; the message now names the queries (the keys' features keep the old reason)."""
    one, big = np.ones((1, D), np.float32), np.full((1, D), 1e20, np.float32)
    st = la.LinearAttentionState(D, D, feature_map="taylor2", dtype=np.float32)
    st.prefill(one, one)
    with pytest.raises(ValueError, match=r"overflows float32 on the finite queries q \(their features: the state "
                                         r"sums only the keys'.*float64 state"):
        st.query(big)
    with pytest.raises(ValueError, match=r"overflows float32 on these finite inputs \(the keys k\), and so would "
                                         r"the float32 state that sums the keys' features"):
        st.prefill(big, one)
    assert st.position == 1


def test_a_kv_cache_holding_nan_says_so_not_that_scores_overflow():
    """NaN keys appended with check_finite=False made later calls blame scores q . k beyond float64's range."""
    c = la.KVCache(D, D)
    nan = np.full((1, D), np.nan)
    c.prefill(nan, np.ones((1, D)), check_finite=False)
    for call in (lambda: c.query(np.ones((1, D))), lambda: c.step(*(np.ones((1, D)),) * 3)):
        with pytest.raises(NonFiniteResult, match=r"^KVCache: the outputs are not finite because the cached keys "
                                                  r"hold NaN or inf \(appended with check_finite=False\)"):
            call()
