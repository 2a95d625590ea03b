"""CUDA kernels of the decay and gate rules, and normalize=False on every CUDA launcher.

Runs on the Numba CUDA simulator without a GPU (tests/conftest.py) with the tiny
launch configuration of test_cuda.py (2 tokens per shared-memory tile, 2 x 3 state
tiles, 3 value columns per block, so M = 4 takes two column blocks), and chunks of
3 tokens, so that N = 8 gives three chunks and the combine over chunks runs.
Shapes are tiny: the simulator is slow.  The sequence kernels of both rules are
also compiled to sm_90 PTX at the default launch configuration (type-checking
what the simulator does not).

Ground truth: the float64 explicit form of ops/causal/naive.py
(``causal_linear_quadratic``), exact at resets.
"""
from __future__ import annotations


import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import config
from linattn_nb.device import cuda_status
from linattn_nb.ops._codes import RULE_ADDITIVE, RULE_DECAY, RULE_GATE
from linattn_nb.ops.causal.naive import causal_linear_quadratic
from linattn_nb.ops.noncausal.naive import noncausal_linear_quadratic
from _ptx import run_ptx_script, seq_kernel_ptx_script
from test_cuda import SMALL_LAUNCH, phi_ref

cuda = pytest.importorskip("numba.cuda")

pytestmark = pytest.mark.skipif(cuda_status() == "none", reason="neither a CUDA GPU nor the simulator is available")

#: max abs error / max(1, max |reference|), per input dtype (float32 accumulates in float32)
TOL = {np.float32: 3e-5, np.float64: 1e-12}
#: rule name -> (code, input name)
RULES = {"decay": (RULE_DECAY, "log_decay"), "gate": (RULE_GATE, "log_gate")}
B, N, F, M, CHUNK = 3, 8, 3, 4, 3


@pytest.fixture(autouse=True)
def small_launch(monkeypatch):
    for name, value in SMALL_LAUNCH.items():
        monkeypatch.setattr(config, name, value)


def assert_close(actual, expected, dtype):
    actual = np.asarray(actual, dtype=np.float64)
    assert np.isfinite(actual).all(), "NaN or inf in the result"
    scale = max(float(np.max(np.abs(expected))), 1.0)
    err = float(np.max(np.abs(actual - expected)))
    assert err <= TOL[np.dtype(dtype).type] * scale, f"max abs error {err:.3e}"


def log_factors(rng, rule, b=B, n=N, f=F):
    """Log-factors of factors in [0.3, 1) with resets (-inf): mid-chunk (entry 0, token 4),
    at a chunk boundary (entry 1, token 3), at token 0 (entry 2: the initial state is wiped);
    for the gate also one feature row alone (entry 0, token 6, row 1)."""
    lg = np.log(rng.uniform(0.3, 1.0, size=(b, n) if rule == "decay" else (b, n, f)))
    lg[0, 4] = lg[1, 3] = lg[2, 0] = -np.inf
    if rule == "gate":
        lg[0, 6, 1] = -np.inf
    return lg


def data(rng, dtype):
    q, k = (rng.normal(size=(B, N, F)).astype(dtype) for _ in range(2))
    v = rng.normal(size=(B, N, M)).astype(dtype)
    S0 = rng.normal(size=(B, F, M))
    z0 = rng.uniform(0.5, 1.5, size=(B, F))
    return q, k, v, S0, z0


def launcher(method):
    from linattn_nb.ops.causal.cuda import causal_chunked_cuda, causal_scan_cuda

    if method == "chunked":
        return lambda *a, **kw: causal_chunked_cuda(*a, chunk_size=CHUNK, **kw)
    return causal_scan_cuda


def run(method, q, k, v, S0, z0, *, rule, inputs, normalize=True, eps=1e-8):
    """The CUDA launcher on device copies; returns (out, S, z) on the host."""
    H = cuda.to_device(np.concatenate([S0, z0[..., None]], axis=-1))
    out = cuda.to_device(np.full(q.shape[:2] + v.shape[-1:], np.nan, dtype=np.result_type(q, k, v)))
    got = launcher(method)(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), H, out, code=1, eps=eps,
                           inputs=inputs, normalize=normalize, rule=rule)
    assert got is out
    h = H.copy_to_host()
    return out.copy_to_host(), h[..., :-1], h[..., -1]


@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "raw"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("method", ["scan", "chunked"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_launchers_match_reference(rule, method, dtype, normalize):
    """Initial state in, final state out, resets mid-chunk, at a chunk boundary and at token 0:
    outputs and final state equal the explicit form, with no NaN."""
    rng = np.random.default_rng(14)
    q, k, v, S0, z0 = data(rng, dtype)
    code, name = RULES[rule]
    inputs = {name: log_factors(rng, rule)}
    out, S, z = run(method, q, k, v, S0, z0, rule=code, inputs=inputs, normalize=normalize)
    ref, S_ref, z_ref = causal_linear_quadratic(phi_ref(q, 1), phi_ref(k, 1), v.astype(np.float64), eps=1e-8,
                                                S0=S0, z0=z0, rule=code, inputs=inputs, normalize=normalize)
    assert_close(out, ref, dtype)
    assert_close(S, S_ref, dtype)
    assert_close(z, z_ref, dtype)


# float64 (its own rescaling floor, 2^-256) with the scan only: the chunked method's own passes are the
# same code in either dtype, and each of its runs costs ~8 s on the simulator (the suite's time)
@pytest.mark.parametrize("method,dtype,layout", [
    ("scan", np.float32, "owner"), ("scan", np.float64, "owner"), ("scan", np.float32, "rows"),
    ("scan", np.float64, "rows"), ("chunked", np.float32, "owner"), ("chunked", np.float32, "rows")],
    ids=["scan-f32-owner", "scan-f64-owner", "scan-f32-rows", "scan-f64-rows", "chunked-f32-owner", "chunked-f32-rows"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_rescaled_and_direct_tiles(monkeypatch, rule, method, dtype, layout):
    """Tiles of 8 tokens: mild factors (rescaled tiles), a tile whose running factor ends just
    above the rescaling floor (k / P up to ~5e8 in float32), one that falls below it (the direct
    form; for the gate in one feature row only, which decides for the block), a reset, and a
    part tile at the end: all against the explicit form, in both thread layouts of the
    sequence kernel (the owner layout; row groups: 2 groups of 2 rows here, as a GPU with
    few sequences per multiprocessor gets at D_phi = 64)."""
    from linattn_nb.ops.cuda.plan import RESCALE_MIN_F32, RESCALE_MIN_F64

    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", layout)
    monkeypatch.setattr(config, "CUDA_TILE_TOKENS", 8)
    monkeypatch.setattr(config, "CUDA_CHUNK_SIZE", 16)
    rng = np.random.default_rng(20)
    b, n = 2, 45
    q, k = (rng.normal(size=(b, n, F)).astype(dtype) for _ in range(2))
    v = rng.normal(size=(b, n, M)).astype(dtype)
    S0, z0 = rng.normal(size=(b, F, M)), rng.uniform(0.5, 1.5, size=(b, F))
    floor = np.log(RESCALE_MIN_F32 if dtype == np.float32 else RESCALE_MIN_F64)
    lg = -rng.uniform(0.0, 0.2, size=(b, n, F))
    lg[0, 8:16] = 0.9 * floor / 8  # ends at ~floor^0.9: rescaled
    lg[1, 8:16, 2] = 1.3 * floor / 8  # below the floor in row 2: the direct form
    lg[1, 30] = -np.inf  # a reset mid-tile
    if rule == "decay":
        lg = lg.mean(axis=-1)
        lg[1, 8:16] = 1.3 * floor / 8
    code, name = RULES[rule]
    inputs = {name: lg}
    out, S, z = run(method, q, k, v, S0, z0, rule=code, inputs=inputs)
    ref, S_ref, z_ref = causal_linear_quadratic(phi_ref(q, 1), phi_ref(k, 1), v.astype(np.float64), eps=1e-8,
                                                S0=S0, z0=z0, rule=code, inputs=inputs)
    assert_close(out, ref, dtype)
    assert_close(S, S_ref, dtype)
    assert_close(z, z_ref, dtype)
    # the outputs right after the strongly decayed tiles, on their own scale
    for row in (16, 17, 31):
        np.testing.assert_allclose(out[:, row], ref[:, row], rtol=TOL[dtype] * 10, atol=TOL[dtype])


@pytest.mark.parametrize("f, dtype", [(12, np.float32), (12, np.float64), (16, np.float32)])
@pytest.mark.parametrize("method", ["scan", "chunked"])
def test_decay_tile_layout(monkeypatch, method, dtype, f):
    """The decay rule in the tile layout (what a GPU with few sequences gets at D_phi <= 64):
    D_phi = 12 (tiles of 3 tokens) and 16 (tiles of 4: the loops over the tile's tokens take four
    a step), N = 11 (a part tile at the end), chunks of two tiles,
    column blocks 3 + 2; mild factors, a tile of factors e^-25 (products down to e^-75, far below
    the other layouts' rescaling floor in float32), resets mid-tile, at a tile's first token and
    at token 0; outputs and final state against the explicit form, from a random state."""
    from linattn_nb.ops.cuda import plan as KP

    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", "tiles")
    b, n, m = 2, 11, 5
    assert KP.seq_config(f, m, np.dtype(dtype).itemsize, RULE_DECAY, "tiles") == (f, 4, 0, 3, f // 4)
    rng = np.random.default_rng(31)
    q, k = (rng.normal(size=(b, n, f)).astype(dtype) for _ in range(2))
    v = rng.normal(size=(b, n, m)).astype(dtype)
    S0, z0 = rng.normal(size=(b, f, m)), rng.uniform(0.5, 1.5, size=(b, f))
    lg = np.log(rng.uniform(0.3, 1.0, size=(b, n)))
    lg[0, 3:6] = -25.0
    lg[0, 7] = -np.inf
    lg[1, 0] = lg[1, f // 4 * 2] = -np.inf
    check_tile_layout(method, RULE_DECAY, {"log_decay": lg}, q, k, v, S0, z0, chunk=2 * (f // 4))


def check_tile_layout(method, rule, inputs, q, k, v, S0, z0, chunk):
    """Run ``method`` of ``rule`` in the tile layout (asserted) from the state ``[S0 | z0]`` and compare
    the outputs and the final state with the float64 explicit form."""
    from linattn_nb.ops import _cuda_launch as CL
    from linattn_nb.ops.causal.cuda import causal_chunked_cuda, causal_scan_cuda

    dtype = q.dtype.type
    H = cuda.to_device(np.concatenate([S0, z0[..., None]], axis=-1))
    out = cuda.to_device(np.full(v.shape, np.nan, dtype))
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    p = CL.plan(dq, dk, dv, H, out, rule=rule, inputs=inputs)
    assert p.cfg[2] == 0, p.cfg
    if method == "chunked":
        causal_chunked_cuda(dq, dk, dv, H, out, code=1, eps=1e-8, inputs=inputs, rule=rule, chunk_size=chunk)
    else:
        causal_scan_cuda(dq, dk, dv, H, out, code=1, eps=1e-8, inputs=inputs, rule=rule)
    h = H.copy_to_host()
    ref, S_ref, z_ref = causal_linear_quadratic(phi_ref(q, 1), phi_ref(k, 1), v.astype(np.float64), eps=1e-8,
                                                S0=S0, z0=z0, rule=rule, inputs=inputs)
    assert_close(out.copy_to_host(), ref, dtype)
    assert_close(h[..., :-1], S_ref, dtype)
    assert_close(h[..., -1], z_ref, dtype)


@pytest.mark.parametrize("method", ["scan", "chunked"])
@pytest.mark.parametrize("f, dtype", [(12, np.float32), (16, np.float32), (24, np.float32), (36, np.float32),
                                      (36, np.float64)])
def test_gate_tile_layout(monkeypatch, method, dtype, f):
    """The gate rule in the tile layout: D_phi = 12 (tiles of 3 tokens: one part block of 4), 16 (tiles
    of 4, one whole block: the loops over the tile's tokens take four a step), 24
    (tiles of 6: a whole block and a part one, so scores across blocks, in a block up to its last
    token and at it) and 36 (tiles of 9: blocks 0 and 2 have block 1 between them), N = 13 (a part
    tile at the end), chunks of two tiles, column blocks 3 + 2; mild
    factors, a run of factors e^-25 in some feature rows (products down to e^-150), resets of one
    row and of every row, at token 0, mid-tile and at a tile's first token; outputs and final state
    against the explicit form, from a random state.  float64 at D_phi = 36 only (the suite's time: the
    dtype changes no index)."""
    from linattn_nb.ops.cuda import plan as KP

    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", "tiles")
    b, n, m = 2, 13, 5
    assert KP.seq_config(f, m, np.dtype(dtype).itemsize, RULE_GATE, "tiles") == (f, 4, 0, 3, f // 4)
    rng = np.random.default_rng(37)
    q, k = (rng.normal(size=(b, n, f)).astype(dtype) for _ in range(2))
    v = rng.normal(size=(b, n, m)).astype(dtype)
    S0, z0 = rng.normal(size=(b, f, m)), rng.uniform(0.5, 1.5, size=(b, f))
    lg = np.log(rng.uniform(0.3, 1.0, size=(b, n, f)))
    lg[0, 2:8, ::3] = -25.0
    lg[0, 9, 1] = -np.inf
    lg[0, 6, 4] = -np.inf
    lg[1, 0] = lg[1, 6] = -np.inf
    lg[1, 10, 2] = -np.inf
    check_tile_layout(method, RULE_GATE, {"log_gate": lg}, q, k, v, S0, z0, chunk=2 * (f // 4))


@pytest.mark.parametrize("method", ["scan", "chunked"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_reset_at_token_zero_forgets_the_initial_state_exactly(rule, method):
    """A reset at token 0 of every entry: the outputs and the final state are those of a zero
    initial state, bit for bit, however large the initial state (0 * s is 0 exactly)."""
    rng = np.random.default_rng(3)
    q, k, v, S0, z0 = data(rng, np.float64)
    code, name = RULES[rule]
    lg = log_factors(rng, rule)
    lg[:, 0] = -np.inf
    inputs = {name: lg}
    got = run(method, q, k, v, 1e30 * S0, 1e30 * z0, rule=code, inputs=inputs)
    zero = run(method, q, k, v, 0.0 * S0, 0.0 * z0, rule=code, inputs=inputs)
    for a, b in zip(got, zero):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("method", ["scan", "chunked", "aggregate"])
def test_additive_normalize_false(method, dtype):
    """normalize=False on the additive launchers (causal scan and chunked, non-causal aggregate):
    phi(q)^T S without the division."""
    from linattn_nb.ops.noncausal.cuda import noncausal_aggregate_cuda

    rng = np.random.default_rng(5)
    q, k, v, S0, z0 = data(rng, dtype)
    qf, kf, v64 = phi_ref(q, 1), phi_ref(k, 1), v.astype(np.float64)
    if method == "aggregate":
        H = cuda.to_device(np.concatenate([S0, z0[..., None]], axis=-1))
        dout = cuda.to_device(np.full((B, N, M), np.nan, dtype=dtype))
        noncausal_aggregate_cuda(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), H, dout, code=1,
                                 eps=1e-8, normalize=False, chunk_size=CHUNK)
        h = H.copy_to_host()
        out, S, z = dout.copy_to_host(), h[..., :-1], h[..., -1]
        ref, S_ref, z_ref = noncausal_linear_quadratic(qf, kf, v64, eps=1e-8, S0=S0, z0=z0, normalize=False)
    else:
        out, S, z = run(method, q, k, v, S0, z0, rule=RULE_ADDITIVE, inputs=None, normalize=False)
        ref, S_ref, z_ref = causal_linear_quadratic(qf, kf, v64, eps=1e-8, S0=S0, z0=z0, normalize=False)
    assert_close(out, ref, dtype)
    assert_close(S, S_ref, dtype)
    assert_close(z, z_ref, dtype)


@pytest.mark.parametrize("method", ["scan", "chunked"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_public_api_with_host_inputs(rule, method):
    """linear_attention(..., causal=True, decay=/log_decay=, device="cuda") with NumPy inputs
    (batch (2, 1), chunks of 3 tokens) equals method="quadratic" on the CPU: outputs and the final state, from an
    initial state; decay factors with zeros (resets), a per-feature log-gate with -inf."""
    rng = np.random.default_rng(7)
    q, k = (rng.normal(size=(2, 1, N, F)) for _ in range(2))
    v = rng.normal(size=(2, 1, N, M))
    state = (rng.normal(size=(2, 1, F, M)), rng.uniform(0.5, 1.5, size=(2, 1, F)))
    if rule == "decay":
        kw = {"decay": rng.uniform(0.3, 1.0, size=(2, 1, N))}
        kw["decay"][0, 0, 4] = kw["decay"][1, 0, 3] = 0.0
    else:
        kw = {"log_decay": np.log(rng.uniform(0.3, 1.0, size=(2, 1, N, F)))}
        kw["log_decay"][0, 0, 4] = -np.inf
        kw["log_decay"][1, 0, 3, 2] = -np.inf
    normalize = method == "scan"  # one of each
    o, st = la.linear_attention(q, k, v, causal=True, device="cuda", method=method, initial_state=state,
                                return_state=True, normalize=normalize, **kw)
    r, rst = la.linear_attention(q, k, v, causal=True, device="cpu", method="quadratic", initial_state=state,
                                 return_state=True, normalize=normalize, **kw)
    assert isinstance(o, np.ndarray) and o.shape == (2, 1, N, M)
    assert_close(o, r, np.float64)
    assert_close(st.S, rst.S, np.float64)
    assert_close(st.z, rst.z, np.float64)
    assert st.rule == rule


def test_rule_inputs_checked_and_device_inputs_read_in_place():
    """Log-factors of the wrong shape or (on the device) dtype raise ValueError naming them; a
    device array gives the result of the host array, a float32 device array (read in place) that
    of the float64 array of its values."""
    rng = np.random.default_rng(9)
    q, k, v, S0, z0 = data(rng, np.float64)
    lg = log_factors(rng, "decay")
    host = run("scan", q, k, v, S0, z0, rule=RULE_DECAY, inputs={"log_decay": lg})
    dev = run("scan", q, k, v, S0, z0, rule=RULE_DECAY, inputs={"log_decay": cuda.to_device(lg)})
    for a, b in zip(host, dev):
        np.testing.assert_array_equal(a, b)
    lg32 = lg.astype(np.float32)
    for method in ("scan", "chunked"):
        dev32 = run(method, q, k, v, S0, z0, rule=RULE_DECAY, inputs={"log_decay": cuda.to_device(lg32)})
        host32 = run(method, q, k, v, S0, z0, rule=RULE_DECAY, inputs={"log_decay": lg32.astype(np.float64)})
        for a, b in zip(host32, dev32):
            np.testing.assert_array_equal(a, b)
    for rule, inputs, msg in [
        (RULE_DECAY, {"log_decay": lg[:, :-1]},
         r"inputs\['log_decay'\] must have shape \(B, N\) = \(3, 8\), got \(3, 7\)"),
        (RULE_GATE, {"log_gate": lg}, r"inputs\['log_gate'\] must have shape \(B, N, F\) = \(3, 8, 3\), got \(3, 8\)"),
        (RULE_DECAY, {"log_decay": cuda.to_device(lg.astype(np.float16))},
         r"inputs\['log_decay'\] must be float32 or float64, got float16"),
        (RULE_DECAY, None, r"inputs: the decay rule takes the inputs \['log_decay'\], got \[\]"),
    ]:
        for method in ("scan", "chunked"):
            with pytest.raises(ValueError, match=msg):
                run(method, q, k, v, S0, z0, rule=rule, inputs=inputs)



def test_gate_of_one_feature_on_device_arrays_is_the_gate_rule():
    """A per-feature log-gate of shape (B, N, 1) (one feature: D = 1, ELU+1) held on the device is the gate
    rule, as the same NumPy array is: the state records "gate" and continues on the host, with the host's
    results (it was taken for the decay rule, whose state the host call then refused)."""
    rng = np.random.default_rng(11)
    q, k = rng.normal(size=(2, 1, 5, 1))
    v = rng.normal(size=(1, 5, 2))
    g = -rng.uniform(0.1, 0.5, size=(1, 5, 1))
    d = cuda.to_device
    o, st = la.linear_attention(d(q), d(k), d(v), causal=True, log_decay=d(g), device="cuda", return_state=True)
    r, rst = la.linear_attention(q, k, v, causal=True, log_decay=g, device="cpu", method="quadratic",
                                 return_state=True)
    assert st.rule == rst.rule == "gate"
    assert_close(o.copy_to_host() if hasattr(o, "copy_to_host") else o, r, np.float64)
    o2 = la.linear_attention(q, k, v, causal=True, log_decay=g, device="cpu", initial_state=st)
    r2 = la.linear_attention(q, k, v, causal=True, log_decay=g, device="cpu", initial_state=rst)
    assert_close(o2, r2, np.float64)

# the decay rule's default kernel (the owner layout) in float32, the gate rule's in float64, and the
# gate rule's tile kernel (the decay rule's tile code: the gated delta rule's, test_delta_cuda.py)
_PTX_SCRIPT = seq_kernel_ptx_script((("float32", RULE_DECAY, "default"), ("float64", RULE_GATE, "default"),
                                     ("float32", RULE_GATE, "tiles")), "chunk_factors_kernel",
                                    '(types.Array(f64, 3, "C"), i, i, types.Array(f64, 2, "C"))')


def test_decay_and_gate_kernels_compile_to_ptx():
    """The decay and gate sequence kernels type-check and compile for sm_90 at D_phi = M = 64 (the
    default configuration, float32 and float64 accumulation, and the tile layout a GPU with few
    sequences takes) with the state in registers (no local memory); the chunk-factor kernel
    compiles too.  Every kernel at every configuration: the opt-in launch check."""
    res = run_ptx_script(_PTX_SCRIPT)
    assert len(res) == 4
    for key, val in res.items():
        assert val == {"target": True, "entry": True, "local": False}, (key, val)
