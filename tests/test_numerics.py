"""Finiteness: the check fused into the CPU kernels, and no silent overflow.

* ``check_finite=True`` (the default) is checked by the CPU kernels while
  they read q, k and v (no separate NumPy scan on the default path): a NaN or
  inf in any input, at any token, in any batch entry, raises ValueError
  naming the input (the same message as the NumPy scan had), on every CPU
  method and dtype, and across chunks, blocks, segments and pieces.
* finite inputs give bit-identical outputs (and states) with
  ``check_finite=True`` and ``False``.
* finite float32 inputs whose float32 computation overflows (magnitudes
  1e19, 1e30, 3e38) give a finite result close to the float64 reference: the
  kernels flag a non-finite output, normaliser or state, and the front end
  recomputes the call in float64.  Where even float64 cannot be cast back,
  ValueError says the inputs are too large for the dtype.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb.feature_maps._base import FeatureOverflow
from linattn_nb import config
from linattn_nb.ops._finite import NonFiniteResult
from linattn_nb.ops.causal.chunked import causal_chunked
from linattn_nb.ops.causal.cpu import causal_scan
from linattn_nb.ops.noncausal.cpu import noncausal_aggregate
from linattn_nb.ops.softmax.cpu import softmax_blocked

DTYPES = (np.float16, np.float32, np.float64)
# (causal, method): every CPU method of linear attention, and softmax_attention's blocked kernel
LINEAR = [(True, "chunked"), (True, "scan"), (False, "aggregate"), (True, "quadratic"), (False, "quadratic")]


@pytest.fixture
def small_blocks(monkeypatch):
    """Chunks of 8, non-causal blocks of 16, softmax blocks of 16 x 8: N = 53 spans several of each."""
    monkeypatch.setattr(config, "CPU_CHUNK_SIZE", 8)
    monkeypatch.setattr(config, "CPU_CHUNK_BLOCK", 4)
    monkeypatch.setattr(config, "CPU_NONCAUSAL_BLOCK", 16)
    monkeypatch.setattr(config, "SOFTMAX_BLOCK_Q", 16)
    monkeypatch.setattr(config, "SOFTMAX_BLOCK_K", 8)


def _inputs(rng, batch, n, d, m, dtype):
    return tuple(rng.standard_normal(batch + (n, x)).astype(dtype) for x in (d, d, m))


def _call(kind, args, **kw):
    causal, method = kind
    if method == "softmax":
        return la.softmax_attention(*args, causal=causal, **kw)
    return la.linear_attention(*args, causal=causal, method=method, **kw)


# ---------------------------------------------------------------------------
# The fused check
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", LINEAR + [(True, "softmax"), (False, "softmax")])
@pytest.mark.parametrize("batch", [(2, 3), (1,)])  # (1,): a sequence split over threads (segments, pieces)
def test_fused_check_names_the_input(small_blocks, kind, dtype, batch):
    """NaN, +inf and -inf in q, k or v at the first, a middle and the last token: ValueError naming it."""
    rng = np.random.default_rng(0)
    n = 53
    clean = _inputs(rng, batch, n, 5, 4, dtype)
    where = tuple(s - 1 for s in batch)  # the last batch entry: not the first work item
    for bad in (np.nan, np.inf, -np.inf):
        for which, name in enumerate("qkv"):
            for t in (0, n // 2, n - 1):
                args = [x.copy() for x in clean]
                args[which][where + (t, 1)] = bad
                with pytest.raises(ValueError, match=f"^{name} contains 1 non-finite value"):
                    _call(kind, args)
    # two bad inputs: the first of q, k, v is named
    args = [x.copy() for x in clean]
    args[1][where + (n - 1, 0)] = np.nan
    args[2][where + (0, 0)] = np.inf
    args[2][where + (3, 0)] = np.inf
    with pytest.raises(ValueError, match="^k contains 1 non-finite"):
        _call(kind, args)
    args[1][where + (n - 1, 0)] = 0.0
    with pytest.raises(ValueError, match="^v contains 2 non-finite"):
        _call(kind, args)
    # check_finite=False: no error, the NaN propagates
    args = [x.copy() for x in clean]
    args[2][where + (n // 2, 1)] = np.nan
    assert np.isnan(_call(kind, args, check_finite=False)).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("launcher", ["chunked", "scan", "aggregate"])
def test_launchers_check_every_work_item(launcher, dtype):
    """The launchers themselves, on every split: sequence-parallel chunked (segments and pass-1 pieces),
    non-causal pieces; a bad value in any one position of any one input is found."""
    rng = np.random.default_rng(1)
    B, N, F, M = 2, 45, 3, 2
    q, k, v = (rng.standard_normal((B, N, x)).astype(dtype) for x in (F, F, M))
    calls = {
        "chunked": [dict(chunk=4, block=2, seq_parallel=True), dict(chunk=4, seq_parallel=False),
                    dict(chunk=64)],
        "scan": [{}],
        "aggregate": [dict(block=4, pieces=3), dict(block=8, pieces=1)],
    }[launcher]
    fn = {"chunked": causal_chunked, "scan": causal_scan, "aggregate": noncausal_aggregate}[launcher]
    for kw in calls:
        for which, name in enumerate("qkv"):
            for b, t in ((0, 0), (1, 17), (1, N - 1), (0, N // 2)):
                args = [x.copy() for x in (q, k, v)]
                args[which][b, t, -1] = np.inf if t % 2 else -np.inf
                H = np.zeros((B, F, M + 1))
                with pytest.raises(ValueError, match=f"^{name} contains 1 non-finite"):
                    fn(*args, H, np.empty((B, N, M), dtype), code=1, eps=1e-8, check_finite=True, **kw)
                # without check_finite the launcher raises nothing
                fn(*args, np.zeros((B, F, M + 1)), np.empty((B, N, M), dtype), code=1, eps=1e-8, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_launcher_checks_every_task(dtype):
    rng = np.random.default_rng(2)
    B, N, D, M = 2, 37, 3, 2
    q, k, v = (rng.standard_normal((B, N, x)).astype(np.float32 if dtype == np.float16 else dtype)
               for x in (D, D, M))
    for causal in (True, False):
        for which, name in enumerate("qkv"):
            for b, t in ((0, 0), (1, 20), (1, N - 1)):
                args = [x.copy() for x in (q, k, v)]
                args[which][b, t, 0] = np.nan
                with pytest.raises(ValueError, match=f"^{name} contains 1 non-finite"):
                    softmax_blocked(*args, np.empty((B, N, M), args[0].dtype), causal=causal, scale=0.5,
                                    block_q=8, block_k=4, check_finite=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmap", ["elu", "relu", "squared_relu", "identity", "favor+"])
@pytest.mark.parametrize("batch", [(2, 3), (1,)])
def test_finite_inputs_bit_identical(small_blocks, fmap, dtype, batch):
    """check_finite=True and False give the same bits (outputs and state) for finite inputs."""
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, batch, 53, 5, 4, dtype)
    if fmap == "identity":  # positive features: no normaliser floored at eps (num / 1e-8 overflows float16)
        q, k = np.abs(q), np.abs(k)
    kw = dict(feature_map=fmap if fmap != "favor+" else la.feature_maps.get("favor+", seed=0, num_features=6))
    for causal, method in LINEAR:
        a, sa = la.linear_attention(q, k, v, causal=causal, method=method, return_state=True, **kw)
        b, sb = la.linear_attention(q, k, v, causal=causal, method=method, return_state=True, check_finite=False,
                                    **kw)
        assert a.dtype == b.dtype == np.dtype(dtype)
        assert np.isfinite(a).all()
        assert a.tobytes() == b.tobytes(), (causal, method)
        assert sa.S.tobytes() == sb.S.tobytes() and sa.z.tobytes() == sb.z.tobytes(), (causal, method)
    for causal in (True, False):
        a = la.softmax_attention(q, k, v, causal=causal)
        b = la.softmax_attention(q, k, v, causal=causal, check_finite=False)
        assert a.tobytes() == b.tobytes()


def test_initial_state_still_checked():
    x = np.ones((2, 6, 3))
    S0, z0 = np.zeros((2, 3, 3)), np.ones((2, 3))
    S0[1, 2, 0] = np.nan
    for method in ("chunked", "scan"):
        with pytest.raises(ValueError, match="initial_state.S contains 1 non-finite"):
            la.linear_attention(x, x, x, causal=True, method=method, initial_state=(S0, z0))


def test_numpy_side_map_still_scans_raw_inputs():
    """A map applied in NumPy: the raw q, k are scanned before it (the kernel sees features)."""
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, (2,), 20, 4, 3, np.float32)
    fmap = la.feature_maps.get("favor+", seed=0, num_features=6)
    for which, name in enumerate("qkv"):
        args = [x.copy() for x in (q, k, v)]
        args[which][1, 7, 2] = -np.inf
        for causal, method in ((True, "chunked"), (True, "scan"), (False, "aggregate")):
            with pytest.raises(ValueError, match=f"^{name} contains 1 non-finite"):
                la.linear_attention(*args, causal=causal, method=method, feature_map=fmap)


def test_map_overflow_then_bad_value_still_named():
    """A NumPy-side map that overflows float32 on finite inputs: recomputed in float64, and a NaN in v
    (which the front end leaves to the kernel) is still reported."""
    rng = np.random.default_rng(10)
    fmap = "taylor2"  # [1, x, x x^T / sqrt 2]: positive weights, applied in NumPy
    q, k, v = _inputs(rng, (2,), 20, 4, 3, np.float32)
    q *= np.float32(1e20)  # q q^T beyond float32, not float64
    with np.errstate(over="ignore"):  # the map's own float32 cast overflows (then recomputed in float64)
        out = la.linear_attention(q, k, v, causal=True, method="chunked", feature_map=fmap)
    ref = la.linear_attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True, method="quadratic",
                              feature_map=fmap)
    assert np.isfinite(ref).all() and np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(v))))
    v[1, 4, 0] = np.nan
    with pytest.raises(ValueError, match="^v contains 1 non-finite"), np.errstate(over="ignore"):
        la.linear_attention(q, k, v, causal=True, method="chunked", feature_map=fmap)


def test_launchers_accept_the_contract_keyword():
    """Every registered sequence launcher (CPU and CUDA) takes check_finite=."""
    import inspect

    from linattn_nb.ops import registry

    for m in registry._METHODS.values():
        if m.kind == "sequence":
            params = inspect.signature(m.forward).parameters
            assert "check_finite" in params and params["check_finite"].default is False, m.key


def test_cuda_launchers_honour_check_finite():
    """The CUDA launchers take the keyword and, with True, refuse non-finite inputs (simulator or GPU)."""
    cuda = pytest.importorskip("numba.cuda")
    from linattn_nb.device import cuda_status
    from linattn_nb.ops.registry import get_method

    if cuda_status() == "none":
        pytest.skip("neither a CUDA GPU nor the simulator is available")
    rng = np.random.default_rng(5)
    B, N, F, M = 1, 5, 2, 2
    q, k, v = (rng.standard_normal((B, N, x)).astype(np.float32) for x in (F, F, M))
    v[0, 3, 1] = np.nan
    for causal, name in ((True, "scan"), (True, "chunked"), (False, "aggregate")):
        impl = get_method(name, causal=causal, device="cuda")
        dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
        dH, dout = cuda.to_device(np.zeros((B, F, M + 1))), cuda.device_array((B, N, M), np.float32)
        with pytest.raises(ValueError, match="^v contains 1 non-finite"):
            impl.forward(dq, dk, dv, dH, dout, code=1, eps=1e-8, check_finite=True)
        impl.forward(dq, dk, dv, dH, dout, code=1, eps=1e-8, check_finite=False)  # runs, NaN propagates
        assert np.isnan(dout.copy_to_host()[0, 3:]).any()


# ---------------------------------------------------------------------------
# No silent overflow
# ---------------------------------------------------------------------------
MAGNITUDES = {np.float32: (1e19, 1e30, 3e38), np.float16: (1e4, 6e4)}
# |result - float64 reference| <= RTOL * |reference| + ATOL * (largest |v|), per dtype
TOL = {np.float32: (1e-4, 1e-5), np.float16: (4e-3, 2e-3)}


def _large(rng, batch, n, d, m, dtype, mag, which):
    """q, k, v uniform in [-1, 1) (standard normal for the inputs not made large), times ``mag`` for
    those named in ``which``; computed in float64, each value representable in ``dtype``."""
    out = []
    for name, width in zip("qkv", (d, d, m)):
        if name in which:
            x = mag * rng.uniform(-1.0, 1.0, batch + (n, width))
        else:
            x = rng.standard_normal(batch + (n, width))
        out.append(x.astype(dtype))
    return out


def _reference(args, causal, fmap):
    """The float64 reference: the quadratic method on float64 inputs (features in float64)."""
    a64 = [x.astype(np.float64) for x in args]
    return la.linear_attention(*a64, causal=causal, method="quadratic", feature_map=fmap, return_state=True)


def _assert_close(res, ref, dtype, vmax):
    rtol, atol = TOL[dtype]
    fin = np.isfinite(ref)
    assert np.isfinite(res[fin]).all(), "non-finite result where the float64 reference is finite"
    err = np.abs(res[fin].astype(np.float64) - ref[fin])
    assert (err <= rtol * np.abs(ref[fin]) + atol * vmax).all(), float(np.max(err / (np.abs(ref[fin]) + vmax)))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("which", ["q", "k", "v", "qkv"])
@pytest.mark.parametrize("kind", [(True, "chunked"), (True, "scan"), (False, "aggregate")])
@pytest.mark.parametrize("fmap", ["elu", "squared_relu"])
def test_large_inputs_linear(small_blocks, kind, which, dtype, fmap):
    causal, method = kind
    rng = np.random.default_rng(6)
    for mag in MAGNITUDES[dtype]:
        args = _large(rng, (2, 2), 40, 6, 5, dtype, mag, which)
        out, state = la.linear_attention(*args, causal=causal, method=method, feature_map=fmap, return_state=True)
        ref, ref_state = _reference(args, causal, fmap)
        assert np.isfinite(ref).all() and np.isfinite(ref_state.S).all()  # the case under test
        vmax = float(np.max(np.abs(args[2].astype(np.float64))))
        _assert_close(out, ref, dtype, vmax)
        # the state is float64: finite, and close to the reference's
        for got, want in ((state.S, ref_state.S), (state.z, ref_state.z)):
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(want))))


def _need_cuda():
    from linattn_nb.device import cuda_status

    if cuda_status() == "none":
        pytest.skip("neither a CUDA GPU nor the simulator is available")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator's NumPy scalars warn on the overflow
@pytest.mark.parametrize("kind", [(True, "chunked"), (True, "scan"), (False, "aggregate")])
def test_large_host_inputs_on_the_gpu_are_the_float64_result(kind):
    """Host arrays run on the GPU (``device="cuda"``): finite float32 inputs whose float32 result or state
    overflows give the float64 result, as on the CPU (they came back inf or NaN in silence), a result beyond
    float32 raises ValueError, and ``check_finite=False`` returns the values as computed."""
    _need_cuda()
    causal, method = kind
    rng = np.random.default_rng(6)
    args = _large(rng, (1, 2), 12, 4, 3, np.float32, 1e19, "qk")
    ref, ref_state = _reference(args, causal, "elu")
    out, state = la.linear_attention(*args, causal=causal, method=method, device="cuda", return_state=True)
    assert np.isfinite(ref).all()  # the case under test
    _assert_close(out, ref, np.float32, float(np.max(np.abs(args[2]))))
    np.testing.assert_allclose(state.S, ref_state.S, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(ref_state.S))))
    unchecked = la.linear_attention(*args, causal=causal, method=method, device="cuda", check_finite=False)
    assert not np.isfinite(unchecked).all()
    q = np.array([[1e10, 0.0]], np.float32)  # signed features, a floored normaliser: beyond float32
    with pytest.raises(ValueError, match="too large for float32"):
        la.linear_attention(q, -q, np.array([[1e20]], np.float32), causal=causal, method=method,
                            feature_map="identity", device="cuda")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fmap", ["taylor2", "rff"])
def test_numpy_side_map_overflow_on_the_gpu_is_the_float64_result(fmap):
    """A NumPy-side map whose float32 features of finite inputs overflow (taylor2: inf features; rff: it
    raises FeatureOverflow): the GPU call runs in float64, as the CPU call does (it returned NaN, or raised
    FeatureOverflow)."""
    _need_cuda()
    rng = np.random.default_rng(10)
    q, k, v = _inputs(rng, (2,), 10, 4, 3, np.float32)
    if fmap == "taylor2":
        q *= np.float32(1e20)
    else:
        q[...] = k[...] = 15.0  # rff's exp(|x|^2 / 2) factor: beyond float32, not float64
    m = la.feature_maps.get(fmap, dim=4, seed=0) if fmap == "rff" else la.feature_maps.get(fmap)
    with np.errstate(over="ignore"):
        try:
            assert not np.isfinite(m(q if fmap == "taylor2" else k)).all()  # the case under test
        except FeatureOverflow:
            pass
        want = la.linear_attention(q, k, v, causal=True, feature_map=m)
        got = la.linear_attention(q, k, v, causal=True, feature_map=m, device="cuda")
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("which", ["q", "k", "v", "qkv"])
@pytest.mark.parametrize("causal", [True, False])
def test_large_inputs_softmax(small_blocks, causal, which, dtype):
    rng = np.random.default_rng(7)
    for mag in MAGNITUDES[dtype]:
        args = _large(rng, (2, 2), 40, 6, 5, dtype, mag, which)
        # a scale that keeps scores comparable in float64 (the reference's own exp must not underflow
        # every weight but one; the result is finite either way)
        out = la.softmax_attention(*args, causal=causal)
        ref = la.softmax_attention(*(x.astype(np.float64) for x in args), causal=causal, method="quadratic")
        assert np.isfinite(ref).all()
        vmax = float(np.max(np.abs(args[2].astype(np.float64))))
        _assert_close(out, ref, dtype, vmax)


def test_overflow_check_follows_check_finite():
    """check_finite=False skips the overflow guard too (documented): the float32 result may be non-finite."""
    rng = np.random.default_rng(8)
    args = _large(rng, (2,), 30, 6, 5, np.float32, 1e19, "qk")
    assert np.isfinite(la.linear_attention(*args, causal=True, method="chunked")).all()
    assert not np.isfinite(la.linear_attention(*args, causal=True, method="chunked", check_finite=False)).all()


def test_result_too_large_for_the_dtype():
    """Signed features and a floored normaliser: finite in float64, beyond float32: ValueError."""
    q = np.array([[1e10, 0.0]], np.float32)
    k = np.array([[-1e10, 0.0]], np.float32)
    v = np.array([[1e20]], np.float32)
    ref = la.linear_attention(*(x.astype(np.float64) for x in (q, k, v)), feature_map="identity")
    assert np.isfinite(ref).all() and np.abs(ref).max() > np.finfo(np.float32).max
    for causal, method in LINEAR:
        with pytest.raises(ValueError, match="too large for float32"):
            la.linear_attention(q, k, v, causal=causal, method=method, feature_map="identity")


def test_launcher_flags_overflow():
    """The launcher contract: finite inputs, non-finite result -> NonFiniteResult after out and H are written."""
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 30, 4)).astype(np.float32) * np.float32(1e19) for _ in range(3))
    for fn in (causal_chunked, causal_scan, noncausal_aggregate):
        with pytest.raises(NonFiniteResult):
            fn(q, k, v, np.zeros((2, 4, 5)), np.empty_like(v), code=3, eps=1e-8, check_finite=True)
    with pytest.raises(NonFiniteResult):
        softmax_blocked(q, k, v, np.empty_like(v), causal=True, scale=1.0, check_finite=True)


# ---------------------------------------------------------------------------
# ops/_vec.py follows LINATTN_NO_CACHE
# ---------------------------------------------------------------------------
def test_vec_kernels_follow_no_cache():
    code = ("from linattn_nb.ops import _vec; "
            "print(type(_vec._elu1_f32._cache).__name__, type(_vec._elu1_f64._cache).__name__)")
    env = dict(os.environ, LINATTN_NO_CACHE="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.stdout.split() == ["NullCache", "NullCache"], proc.stdout


@pytest.mark.parametrize("method", ["scan", "quadratic"])
def test_a_zero_floor_over_a_zero_normaliser_is_not_called_an_overflow(method):
    """eps=0 is a floor of 0: a normaliser of 0 (a 'relu' query with no positive entry) divides by 0.  The error
    says so, and does not tell the caller to scale inputs of size 2 down as a float64 overflow would."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 8, 4))
    q[3] = -np.abs(q[3])  # relu(q_3) = 0: the normaliser of token 3 is 0
    kw = dict(causal=True, feature_map="relu", method=method)
    for call in (lambda: la.linear_attention(q, k, v, eps=0.0, **kw),
                 lambda: la.linear_attention_vjp(q, k, v, np.ones((8, 4)), eps=0.0, **kw)):
        with pytest.raises(NonFiniteResult, match="with eps=0 a normaliser of 0") as err:
            call()
        assert "scale the inputs down" not in str(err.value)
    assert np.isnan(la.linear_attention(q, k, v, eps=None, **kw)[3]).all()  # eps=None: the documented NaN row


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_a_zero_floor_over_a_zero_normaliser_raises_in_every_dtype(dtype, causal):
    """float32 and float16 inputs returned NaN rows (and filled a caller's out= with them) where float64 inputs
    raise NonFiniteResult: the float64 recomputation's own error was dropped.  Same for linear_attention_vjp."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 8, 4))
    q[3] = -np.abs(q[3])  # relu(q_3) = 0: the normaliser of token 3 is 0
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    kw = dict(causal=causal, feature_map="relu", eps=0.0)
    out = np.full((8, 4), 5.0, dtype)
    with pytest.raises(NonFiniteResult, match="with eps=0 a normaliser of 0"):
        la.linear_attention(q, k, v, out=out, **kw)
    with pytest.raises(NonFiniteResult, match="with eps=0 a normaliser of 0"):
        la.linear_attention_vjp(q, k, v, np.ones((8, 4), dtype), **kw)
    assert np.isnan(la.linear_attention(q, k, v, causal=causal, feature_map="relu", eps=None)[3]).all()


def test_a_float16_overflow_from_the_floor_names_the_floor():
    """float16 outputs beyond its range because a signed map's normaliser at or below eps divides a numerator by
    eps: the ValueError names the floor, which rescaling q and k cannot help, beside the inputs' sizes."""
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 20, 3)).astype(np.float16)
    with pytest.raises(ValueError, match="overflows float16.*at or below the floor eps = 1e-08"):
        la.linear_attention(q, k, v, causal=True, feature_map="identity", method="scan")
