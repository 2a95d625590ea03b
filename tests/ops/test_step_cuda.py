"""CUDA side of recurrent decoding: the step/query/prefill kernels against the CPU state.

Without a GPU these run on the Numba CUDA simulator (tests/conftest.py), with a tiny
launch configuration so that the thread loops stride (fewer threads than features
and values) and idle threads exist (more threads than either).  The kernels are
also compiled to PTX for sm_90 in a subprocess (type-checking what the simulator
does not).  The segment-wise ``linear_attention(device="cuda")`` tests run every
registered causal CUDA method.
"""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import config
from linattn_nb.device import cuda_status
from linattn_nb.state import LinearAttentionState
from _ptx import run_ptx_script

pytestmark = pytest.mark.skipif(cuda_status() == "none", reason="no CUDA GPU and the simulator is off")


@pytest.fixture(autouse=True)
def small_helper_blocks(monkeypatch):
    """32 threads per block and at most 2 blocks for the grid-stride helper kernels (filling the flags
    and states, cast and 4-d copies; as tests/ops/test_cuda.py): the default 256 simulated threads a
    launch were most of this file's simulator time.  The step kernels' own threads are
    config.CUDA_STEP_THREADS (``threads``)."""
    monkeypatch.setattr(config, "CUDA_THREADS_PER_BLOCK", 32)
    monkeypatch.setattr(config, "CUDA_MAX_HELPER_BLOCKS", 2)


TOL = {np.float64: 1e-11, np.float32: 3e-5}


def assert_close(actual, expected, dtype):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape
    scale = max(float(np.max(np.abs(expected))), 1.0) if expected.size else 1.0
    err = float(np.max(np.abs(actual - expected))) if expected.size else 0.0
    assert err <= TOL[np.dtype(dtype).type] * scale, f"max abs error {err:.3e}"


def host(x):
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


@pytest.fixture(params=[3, 16], ids=["threads3", "threads16"])
def threads(request, monkeypatch):
    monkeypatch.setattr(config, "CUDA_STEP_THREADS", request.param)
    return request.param


def qkv(rng, batch, n, d, m, dtype):
    return (rng.standard_normal(batch + (n, d)).astype(dtype), rng.standard_normal(batch + (n, d)).astype(dtype),
            rng.standard_normal(batch + (n, m)).astype(dtype))


@pytest.mark.parametrize("dtype,feature_map", [(np.float64, "elu"), (np.float32, "relu"),
                                               (np.float64, "dpfp"), (np.float32, "identity")])
def test_cuda_state_matches_cpu_state(dtype, feature_map, threads):
    """prefill, 1-token and multi-token steps, query: the GPU state equals the CPU state
    (host inputs in, NumPy out); D_phi != M, batch (2, 1)."""
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, (2, 1), 7, 5, 4, dtype)
    eps = None if feature_map == "identity" else 1e-8
    g = LinearAttentionState(5, 4, batch_shape=(2, 1), feature_map=feature_map, dtype=dtype, device="cuda",
                             eps=eps)
    c = LinearAttentionState(5, 4, batch_shape=(2, 1), feature_map=feature_map, dtype=dtype, eps=eps)
    assert g.device == "cuda"
    for st in (g, c):
        st.prefill(k[..., :2, :], v[..., :2, :])
    outs = []
    for a, b in ((2, 3), (3, 7)):
        og = g.step(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :])
        oc = c.step(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :])
        assert isinstance(og, np.ndarray) and og.dtype == dtype and og.shape == (2, 1, b - a, 4)
        assert_close(og, oc, dtype)
        outs.append(og)
    assert_close(g.query(q[..., :3, :]), c.query(q[..., :3, :]), dtype)
    assert_close(host(g.S), c.S, dtype)
    assert_close(host(g.z), c.z, dtype)
    assert g.position == c.position == 7 and g.nbytes == c.nbytes
    ref = la.linear_attention(q, k, v, causal=True, feature_map=feature_map, eps=eps)
    if dtype == np.float64:  # g is already a float64 GPU state prefilled with 2 tokens: its steps' outputs
        assert_close(np.concatenate(outs, axis=-2), ref[..., 2:, :], dtype)
    else:  # a float64 GPU state with these float32 inputs
        c2 = LinearAttentionState(5, 4, batch_shape=(2, 1), feature_map=feature_map, dtype=np.float64,
                                  device="cuda", eps=eps)
        c2.prefill(k[..., :2, :], v[..., :2, :])
        assert_close(c2.step(q[..., 2:, :], k[..., 2:, :], v[..., 2:, :]), ref[..., 2:, :], dtype)


def test_cuda_device_inputs_stay_on_the_device(threads):
    """GPU inputs give GPU outputs (zero-copy); auto follows the data; NaN is refused
    before the state changes; a host copy of a GPU state saves and loads back."""
    from numba import cuda

    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, (3,), 4, 2, 3, np.float32)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    g = LinearAttentionState(2, 3, batch_shape=(3,), dtype=np.float32, device="cuda")
    c = LinearAttentionState(2, 3, batch_shape=(3,), dtype=np.float32)
    out = g.step(dq, dk, dv)
    assert hasattr(out, "copy_to_host") and out.shape == (3, 4, 3)
    assert_close(out.copy_to_host(), c.step(q, k, v), np.float32)
    S0 = host(g.S).copy()
    bad = v.copy()
    bad[1, 2, 0] = np.nan
    with pytest.raises(ValueError, match="v contains"):
        g.step(dq, dk, cuda.to_device(bad))
    assert np.array_equal(host(g.S), S0) and g.position == 4
    with pytest.raises(TypeError, match="one dtype"):
        g.step(cuda.to_device(q.astype(np.float64)), dk, dv)
    # GPU inputs with a host out: the devices named (it was a false "out lives in GPU memory" error)
    with pytest.raises(ValueError, match=r"q, k, v on the GPU, out on the host"):
        g.step(dq, dk, dv, out=np.empty((3, 4, 3), np.float32))
    # ... and a list: the same (it was the simulator's "out lives in GPU memory", on a GPU "cannot read this GPU
    # array (builtins.list)")
    with pytest.raises(ValueError, match=r"q, k, v on the GPU, out on the host \(a list\)"):
        g.step(dq, dk, dv, out=np.empty((3, 4, 3), np.float32).tolist())
    # host inputs with a GPU out: the devices named, as linear_attention(..., device="cuda") does (it was "out
    # must be a numpy.ndarray for CPU inputs")
    with pytest.raises(ValueError, match=r"out on the GPU, q, k, v on the host"):
        g.step(q, k, v, out=cuda.device_array((3, 4, 3), np.float32))
    with pytest.raises(ValueError, match=r"out on the GPU, q, k, v on the host"):
        la.linear_attention(q, k, v, causal=True, device="cuda", out=cuda.device_array((3, 4, 3), np.float32))
    assert np.array_equal(host(g.S), S0) and g.position == 4
    twin = g.copy()
    twin.step(dq, dk, dv)
    assert np.array_equal(host(g.S), S0) and twin.position == 8
    again = twin.step(q, k, v)  # host inputs to a copied GPU state: host outputs
    assert isinstance(again, np.ndarray) and twin.position == 12 and twin.device == "cuda"


def test_cuda_results_that_overflow_raise_and_leave_the_state(threads):
    """Finite inputs whose outputs or new state elements are not finite in their dtype: the GPU kernels set the
    flag's result bit, the state buffers are not swapped, NonFiniteResult says the state is unchanged (the CPU
    kernels, in place, absorb the tokens first: tests/state/test_state_overflow.py)."""
    small = np.full((1, 1, 2), 0.5, np.float32)
    big_q = np.full((1, 1, 2), 1e5, np.float32)
    big_v = np.full((1, 1, 3), 3e37, np.float32)
    # a float32 state that would overflow: step, prefill
    g = LinearAttentionState(2, 3, batch_shape=(1,), dtype=np.float32, device="cuda")
    g.step(small, small, np.ones((1, 1, 3), np.float32))
    S0 = host(g.S).copy()
    with pytest.raises(la.NonFiniteResult, match="state is unchanged"):
        g.step(big_q, big_q, big_v)
    with pytest.raises(la.NonFiniteResult, match="state is unchanged"):
        g.prefill(big_q, big_v)
    assert np.array_equal(host(g.S), S0) and g.position == 1
    # float32 outputs of a float64 state that overflow: step, then query of a state that holds them
    g = LinearAttentionState(2, 3, batch_shape=(1,), device="cuda", normalize=False)
    with pytest.raises(la.NonFiniteResult, match="state is unchanged"):
        g.step(big_q, big_q, big_v)
    assert g.position == 0 and not host(g.S).any()
    g.prefill(big_q, big_v)  # the float64 state holds it
    with pytest.raises(la.NonFiniteResult):
        g.query(big_q)
    assert np.isfinite(g.query(big_q.astype(np.float64))).all()
    # check_finite=False: the kernels' values as computed
    out = g.step(big_q, big_q, big_v, check_finite=False)
    assert not np.isfinite(out).all() and g.position == 2


def test_cuda_state_save_load_and_reset(tmp_path, threads):
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, (2,), 3, 4, 2, np.float64)
    g = LinearAttentionState(4, 2, batch_shape=(2,), device="cuda")
    g.prefill(k, v)
    path = tmp_path / "g.npz"
    g.save(path)
    back = LinearAttentionState.load(path, device="cuda")
    assert back.device == "cuda" and back.position == 3
    assert np.array_equal(host(back.S), host(g.S))
    assert np.array_equal(back.step(q, k, v), g.step(q, k, v))
    cpu = LinearAttentionState.load(path)
    assert np.array_equal(cpu.S, LinearAttentionState.load(path, device="cuda").to_linear_state().S)
    g.reset()
    assert g.position == 0 and not host(g.S).any()


# ---------------------------------------------------------------------------
# linear_attention(device="cuda"): segment-wise == one call
# ---------------------------------------------------------------------------
def _cuda_methods():
    from linattn_nb.ops.registry import available_methods

    return available_methods(causal=True, device="cuda")


@pytest.mark.parametrize("method", _cuda_methods())
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cuda_segmentwise_equals_one_shot(method, dtype):
    """Random split points (empty segments included) on the GPU: the outputs and the final
    state of one call; the state also continues on the CPU."""
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, (2, 2), 37, 4, 3, dtype)
    full, st_full = la.linear_attention(q, k, v, causal=True, method=method, device="cuda", return_state=True)
    cpu_full = la.linear_attention(q, k, v, causal=True)
    assert_close(host(full), cpu_full, dtype)
    for trial in range(2):
        cuts = [0, 0] + sorted(rng.integers(0, 38, size=3 + trial).tolist()) + [37, 37]
        state, outs = None, []
        for a, b in zip(cuts[:-1], cuts[1:]):
            o, state = la.linear_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], causal=True,
                                           method=method, device="cuda", initial_state=state,
                                           return_state=True)
            outs.append(host(o))
        assert_close(np.concatenate(outs, axis=-2), cpu_full, dtype)
        np.testing.assert_allclose(host(state.S), host(st_full.S), rtol=1e-12, atol=1e-12)
        assert state.position == 37


# ---------------------------------------------------------------------------
# PTX for sm_90: type-checks the real kernels (the simulator checks no types)
# ---------------------------------------------------------------------------
_PTX_SCRIPT = textwrap.dedent(
    """
    import json
    from numba import cuda, types
    from linattn_nb.ops.step import cuda as C
    res = {}
    lg = types.Array(types.float64, 3, "C")
    fl = types.Array(types.int32, 1, "C")
    bo, i8 = types.boolean, types.int64
    for sdt, idt in (("float32", "float16"), ("float32", "float32"), ("float64", "float32"), ("float64", "float64")):
        st = getattr(types, sdt)
        S3 = types.Array(st, 3, "C")
        z2 = types.Array(st, 2, "C")
        a3 = types.Array(getattr(types, idt), 3, "C")
        sigs = {
            "step": (a3, a3, a3, S3, z2, S3, z2, a3, S3, lg, fl, bo, i8, st, i8, i8, bo, st, st),
            "state_query": (a3, S3, z2, a3, S3, fl, bo, i8, st, i8, st, st),
            "prefill": (a3, a3, S3, z2, S3, z2, lg, fl, bo, i8, i8, st, st),
        }
        for name, sig in sigs.items():
            ptx, _ = cuda.compile_ptx(C.PYTHON_KERNELS[name], sig, cc=(9, 0))
            res[f"{name}/{sdt}/{idt}"] = {"entry": ".entry" in ptx, "target": ".target sm_90" in ptx,
                                          "local": ("ld.local" in ptx) or ("st.local" in ptx)}
        # the delta rules' prefill: the step kernel without outputs (``out`` the float64 placeholder)
        sig = (a3, a3, a3, S3, z2, S3, z2, lg, S3, lg, fl, bo, i8, st, i8, i8, bo, st, st)
        ptx, _ = cuda.compile_ptx(C.PYTHON_KERNELS["step"], sig, cc=(9, 0))
        res[f"step-noread/{sdt}/{idt}"] = {"entry": ".entry" in ptx, "target": ".target sm_90" in ptx,
                                           "local": ("ld.local" in ptx) or ("st.local" in ptx)}
    print(json.dumps(res))
    """
)


def test_step_kernels_compile_to_ptx():
    """Every step kernel compiles for sm_90 (float32 and float64 states, float16 (float32 states),
    float32 and float64 inputs) without spilling to local memory: the step kernel (every rule's
    branches: the rule is a launch argument), the query, the prefill, and the step kernel as the
    delta rules' prefill runs it."""
    res = run_ptx_script(_PTX_SCRIPT)
    assert len(res) == 16
    for key, val in res.items():
        assert val == {"entry": True, "target": True, "local": False}, (key, val)


# ---------------------------------------------------------------------------
# Decay and gating: the rule kernels, TINY (the simulator is slow)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["decay", "gate"])
def test_cuda_rule_state_matches_cpu_and_linear_attention(form, threads):
    """prefill + 1-token + multi-token steps with a reset (decay 0) in the middle, and a
    normalize=False query: the GPU state equals the CPU state and linear_attention; no NaN."""
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, (2,), 5, 3, 2, np.float64)
    if form == "decay":
        a = rng.uniform(0.5, 1.0, size=(2, 5))
        a[1, 2] = 0.0
        steps = [a[:, 2], a[:, 3:, None]]  # the token's own factor, then (B, T, 1)
        pre = a[:, :2]
    else:
        a = rng.uniform(0.5, 1.0, size=(2, 5, 3))
        a[0, 2, :] = 0.0
        steps = [a[:, 2], a[:, 3:]]  # (B, D_phi), then (B, T, D_phi)
        pre = a[:, :2]
    full = la.linear_attention(q, k, v, causal=True, decay=a, method="quadratic")
    g = LinearAttentionState(3, 2, batch_shape=(2,), device="cuda")
    c = LinearAttentionState(3, 2, batch_shape=(2,))
    outs = []
    for st in (g, c):
        st.prefill(k[:, :2], v[:, :2], decay=pre)
        o1 = st.step(q[:, 2:3], k[:, 2:3], v[:, 2:3], decay=steps[0])
        o2 = st.step(q[:, 3:], k[:, 3:], v[:, 3:], decay=steps[1])
        outs.append(np.concatenate([o1, o2], axis=1))
    assert g.rule == c.rule == form and g._launch is not c._launch
    assert np.isfinite(outs[0]).all()
    assert_close(outs[0], outs[1], np.float64)
    assert_close(outs[0], full[:, 2:], np.float64)
    assert_close(host(g.S), c.S, np.float64)
    assert_close(host(g.z), c.z, np.float64)


def test_cuda_normalize_false_and_float32_gate(threads):
    """normalize=False through the additive launcher (its rule kernels) and a float32 gate state."""
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, (2,), 3, 2, 3, np.float32)
    ref = la.linear_attention(q, k, v, causal=True, normalize=False)
    g = LinearAttentionState(2, 3, batch_shape=(2,), dtype=np.float32, device="cuda", normalize=False)
    assert_close(g.step(q, k, v), ref, np.float32)
    c = LinearAttentionState(2, 3, batch_shape=(2,), dtype=np.float32, normalize=False)
    c.step(q, k, v)
    assert_close(g.query(q[:, :2]), c.query(q[:, :2]), np.float32)
    lg = np.log(rng.uniform(0.5, 1.0, size=(2, 3, 2)))
    gg = LinearAttentionState(2, 3, batch_shape=(2,), dtype=np.float32, device="cuda")
    assert_close(gg.step(q, k, v, log_decay=lg), la.linear_attention(q, k, v, causal=True, log_decay=lg,
                                                                     method="quadratic"), np.float32)


# ---------------------------------------------------------------------------
# The delta rules: the delta kernel, TINY (the simulator is slow)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["delta", "gated_delta"])
def test_cuda_delta_state_matches_cpu_and_linear_attention(rule, threads):
    """prefill + 1-token + multi-token steps of the delta rules (unit keys: the l2 map; the gated
    rule with a reset in the middle), and a query: the GPU state equals the CPU state and
    linear_attention's quadratic form; no NaN."""
    rng = np.random.default_rng(17)
    q, k, v = qkv(rng, (2,), 5, 3, 2, np.float64)
    beta = rng.uniform(0.0, 2.0, size=(2, 5))
    kw = {"beta": beta}
    if rule == "gated_delta":
        a = rng.uniform(0.5, 1.0, size=(2, 5))
        a[1, 2] = 0.0
        kw["decay"] = a
    full, ref_state = la.linear_attention(q, k, v, causal=True, feature_map="l2", method="quadratic",
                                          return_state=True, **kw)
    g = LinearAttentionState(3, 2, batch_shape=(2,), feature_map="l2", device="cuda")
    c = LinearAttentionState(3, 2, batch_shape=(2,), feature_map="l2")
    outs = []
    for st in (g, c):
        st.prefill(k[:, :2], v[:, :2], **{n: x[:, :2] for n, x in kw.items()})
        o1 = st.step(q[:, 2:3], k[:, 2:3], v[:, 2:3], **{n: x[:, 2] for n, x in kw.items()})  # the token's own
        o2 = st.step(q[:, 3:], k[:, 3:], v[:, 3:], **{n: x[:, 3:, None] for n, x in kw.items()})  # (B, T, 1)
        outs.append(np.concatenate([o1, o2], axis=1))
    assert g.rule == c.rule == rule and not g.normalize and g._launch is not c._launch
    assert np.isfinite(outs[0]).all()
    assert_close(outs[0], outs[1], np.float64)
    assert_close(outs[0], full[:, 2:], np.float64)
    assert_close(host(g.S), ref_state.S, np.float64)
    assert_close(host(g.z), ref_state.z, np.float64)
    assert_close(g.query(q[:, :2]), c.query(q[:, :2]), np.float64)


def test_cuda_delta_float32_silu_l2_normalize_and_row_maps(threads):
    """A float32 gated delta state with silu_l2 and normalize=True; the additive step and prefill
    with the l2 row map (each token's row divided by its norm)."""
    rng = np.random.default_rng(18)
    q, k, v = qkv(rng, (2,), 3, 2, 3, np.float32)
    beta = rng.uniform(0.0, 1.0, size=(2,))
    lg = np.log(rng.uniform(0.5, 1.0, size=(2, 3)))
    ref = la.linear_attention(q, k, v, causal=True, feature_map="silu_l2", beta=beta, log_decay=lg,
                              normalize=True, method="quadratic")
    g = LinearAttentionState(2, 3, batch_shape=(2,), feature_map="silu_l2", dtype=np.float32, device="cuda",
                             normalize=True)
    assert_close(g.step(q, k, v, beta=beta, log_decay=lg[..., None]), ref, np.float32)
    add = la.linear_attention(q, k, v, causal=True, feature_map="l2", eps=None, method="quadratic")
    ga = LinearAttentionState(2, 3, batch_shape=(2,), feature_map="l2", device="cuda", eps=None)
    ga.prefill(k[:, :1], v[:, :1])
    assert_close(ga.step(q[:, 1:], k[:, 1:], v[:, 1:]), add[:, 1:], np.float32)


@pytest.mark.parametrize("scale_pow", [-120, 70])
def test_cuda_step_row_maps_at_the_ends_of_float32(scale_pow, threads):
    """float32 rows whose squares underflow (2^-120) or overflow (2^70, about 1.2e21) float32: the step,
    the prefill and the query take them as the row's direction, as the CPU state does (the step's norm
    was taken in the state dtype and gave zero features)."""
    rng = np.random.default_rng(4)
    q = rng.integers(-4, 5, (2, 3, 3)).astype(np.float32)
    k = rng.integers(-4, 5, (2, 3, 3)).astype(np.float32)
    q[:, :, 0] = k[:, :, 0] = 1.0  # no zero rows
    v = rng.standard_normal((2, 3, 2)).astype(np.float32)
    q2, k2 = q.copy(), k.copy()
    q2[0, 2] = np.ldexp(q[0, 2], scale_pow)
    k2[1, 1] = np.ldexp(k[1, 1], scale_pow)
    k2[0, 0] = np.ldexp(k[0, 0], scale_pow)
    outs = []
    for qq, kk in ((q2, k2), (q, k)):
        g = LinearAttentionState(3, 2, batch_shape=(2,), feature_map="l2", dtype=np.float32, device="cuda", eps=None)
        g.prefill(kk[:, :1], v[:, :1])
        outs.append((g.step(qq[:, 1:], kk[:, 1:], v[:, 1:]), g.query(qq)))
    assert np.isfinite(outs[0][0]).all()
    assert_close(outs[0][0], outs[1][0], np.float32)
    assert_close(outs[0][1], outs[1][1], np.float32)
