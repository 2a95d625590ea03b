"""CUDA backward launchers: linattn_nb/ops/grad/cuda.py.

Runs on the Numba CUDA simulator without a GPU (tests/conftest.py).  The
launch configuration is shrunk so that tiny shapes exercise every path of the
kernels: 2 state columns per block (M' = 3 takes two column blocks, the second
with one column, so the partial sums over column blocks are added up), 2
threads per block (F = 2 rows, 2 columns: every loop over rows and columns
crosses threads), checkpoints every 2 tokens (N = 5 spans three chunks, the
last one short), and N = 1.  One test runs with more threads than rows and
columns, and one with a single thread.  The kernels are also compiled to sm_90
PTX in a subprocess, for float32 and float64, at the default configuration;
when ptxas (the ``nvidia-cuda-nvcc-cu12`` wheel) is installed, the PTX is
assembled too and the register counts and spills are checked.

Ground truth: the float64 per-token BPTT of linattn_nb/ops/grad/naive.py
(checked against finite differences in its own tests) on the same inputs
(float32 inputs are widened exactly), and end to end through
``linear_attention_vjp`` the CPU ``quadratic`` method.
"""
from __future__ import annotations

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import config
from linattn_nb import feature_maps as fm
from linattn_nb.device import cuda_status
from linattn_nb.ops._codes import RULE_DECAY, RULE_DELTA, RULE_GATE, RULE_GATED_DELTA, RULES
from linattn_nb.ops.grad.naive import causal_backward_naive, noncausal_backward_naive
from linattn_nb.ops.registry import get_method
from _ptx import run_ptx_script

cuda = pytest.importorskip("numba.cuda")

pytestmark = pytest.mark.skipif(cuda_status() == "none", reason="neither a CUDA GPU nor the simulator is available")

CODES = {name: code for name, (code, _) in RULES.items()}
#: max abs error / max(1, max |reference|): float32 results are float64 sums rounded once
TOL = {np.float32: 2e-7, np.float64: 1e-13}
B, F, M1, CHUNK = 2, 2, 3, 2
SMALL = {"CUDA_VALUE_COLS": 2, "CUDA_CHUNK_SIZE": CHUNK, "CUDA_MAX_THREADS": 2, "CUDA_THREADS_PER_BLOCK": 8}


@pytest.fixture(autouse=True)
def small_launch(monkeypatch):
    for name, value in SMALL.items():
        monkeypatch.setattr(config, name, value)


@pytest.fixture(autouse=True)
def nan_filled(monkeypatch):
    """Every new device array starts NaN-filled (results, scratch, partial sums): an entry the kernels
    read before writing it, or never write, shows as NaN in the results."""
    empty = cuda.device_array

    def device_array(shape, dtype=np.float64, *args, **kwargs):
        out = empty(shape, dtype, *args, **kwargs)
        if np.dtype(dtype).kind == "f" and out.size:
            out.copy_to_device(np.full(out.shape, np.nan, dtype=dtype))
        return out

    monkeypatch.setattr(cuda, "device_array", device_array)


def rule_inputs(rng, rule, b, n, f):
    """The rule's inputs (host float64): log-decays in [-1, 0] with a reset (entry 0, token 2: the
    first token of the second chunk), log-gates with a reset of one row (entry 1, token 3),
    write strengths in [0, 2] with a 0 and a 2; None for the additive rule."""
    names = RULES[rule][1]
    inputs = {}
    if "log_decay" in names:
        ld = -rng.uniform(0.0, 1.0, (b, n))
        if n > 2:
            ld[0, 2] = -np.inf
        inputs["log_decay"] = ld
    if "log_gate" in names:
        lg = -rng.uniform(0.0, 1.0, (b, n, f))
        if n > 3:
            lg[1, 3, 1] = -np.inf
        inputs["log_gate"] = lg
    if "beta" in names:
        beta = rng.uniform(0.0, 2.0, (b, n))
        beta[0, 0] = 0.0
        beta[1, -1] = 2.0
        inputs["beta"] = beta
    return inputs or None


def problem(rng, n, dtype, *, b=B, f=F, m1=M1, state_grad=True):
    """qf, kf, v1 (last column ones), H0, g1, dHN: host arrays (float64 states)."""
    qf = rng.normal(size=(b, n, f)).astype(dtype)
    kf = (rng.normal(size=(b, n, f)) / np.sqrt(f)).astype(dtype)
    v1 = rng.normal(size=(b, n, m1)).astype(dtype)
    v1[:, :, -1] = 1.0
    H0 = rng.normal(size=(b, f, m1))
    g1 = rng.normal(size=(b, n, m1)).astype(dtype)
    dHN = rng.normal(size=(b, f, m1)) if state_grad else None
    return qf, kf, v1, H0, g1, dHN


def on_device(arrays):
    return [None if x is None else cuda.to_device(x) for x in arrays]


def assert_grads(got, ref, dtype):
    """Every field of ``got`` (device arrays) against the float64 reference ``ref``."""
    for name, g, r in zip(ref._fields, got, ref):
        if r is None:
            assert g is None, name
            continue
        g = g.copy_to_host()
        assert g.shape == r.shape, (name, g.shape, r.shape)
        want = dtype if name in ("dq", "dk", "dv") else np.float64
        assert g.dtype == want, (name, g.dtype)
        assert np.isfinite(g).all(), name
        scale = max(1.0, float(np.max(np.abs(r)))) if r.size else 1.0
        err = float(np.max(np.abs(g - r))) if r.size else 0.0
        assert err <= TOL[np.dtype(dtype).type] * scale, f"{name}: max abs error {err:.3e}"


def cuda_backward(method, rule):
    """The backward launcher the method table registers for (method, rule) with CUDA."""
    return get_method(method, causal=True, device="cuda", rule=rule).backward


# (method, dtype, N) of every rule.  The CUDA chunked backward is the scan's checkpointed recurrence:
# backward_chunked_cuda calls backward_scan_cuda with the same arguments (chunk_size None: both take
# config.CUDA_CHUNK_SIZE), so a chunked case runs the scan's launch again and only checks that the method
# table registers it for the rule: N = 1 does that.  The kernel's control flow does not depend on the dtype
# (it computes in float64; the dtype changes only the loads of the inputs and the stores of dq, dk, dv):
# float32 at N = 1 (one chunk) runs every float32 load and store, float64 at N = 5 (three chunks, the
# checkpoints) every path in float64 round-off; the other two pairs ran the same code again.
CAUSAL_CASES = [pytest.param(method, dtype, n, id=f"{method}-{dtype.__name__}-{n}")
                for method, dtype, n in (("scan", np.float32, 1), ("scan", np.float64, 5), ("chunked", np.float32, 1))]


@pytest.mark.parametrize("method, dtype, n", CAUSAL_CASES)
@pytest.mark.parametrize("rule", list(RULES))
def test_causal_backward_matches_naive(rng, rule, method, dtype, n):
    """Every rule x method x dtype (CAUSAL_CASES) against the naive BPTT: H0 and dH_N given, resets and
    beta 0 and 2 (N = 5: three chunks of the checkpointed recurrence, two column blocks)."""
    args = problem(rng, n, dtype)
    inputs = rule_inputs(rng, rule, B, n, F)
    ref = causal_backward_naive(*args, inputs=inputs, rule=CODES[rule])
    got = cuda_backward(method, rule)(*on_device(args), inputs=inputs)
    assert_grads(got, ref, dtype)


def test_causal_gradients_ignore_earlier_grad_out(rng):
    """Gradients at token t never depend on grad_out rows before t: changing the rows of g1 before
    token 3 leaves every gradient at tokens 3.. unchanged, bit for bit."""
    args = list(problem(rng, 5, np.float32))
    inputs = rule_inputs(rng, "gated_delta", B, 5, F)
    launcher = cuda_backward("scan", "gated_delta")
    first = launcher(*on_device(args), inputs=inputs)
    args[4] = args[4].copy()
    args[4][:, :3] = rng.normal(size=(B, 3, M1))
    second = launcher(*on_device(args), inputs=inputs)
    for name, a, b in zip(first._fields, first, second):
        if name != "dH0":
            np.testing.assert_array_equal(a.copy_to_host()[:, 3:], b.copy_to_host()[:, 3:], err_msg=name)


@pytest.mark.parametrize("rule", ["additive", "gated_delta"])
def test_causal_backward_without_state_grad(rng, rule):
    """dH_N = None: the adjoint starts from zero."""
    args = problem(rng, 5, np.float64, state_grad=False)
    inputs = rule_inputs(rng, rule, B, 5, F)
    ref = causal_backward_naive(*args, inputs=inputs, rule=CODES[rule])
    got = cuda_backward("scan", rule)(*on_device(args), inputs=inputs)
    assert_grads(got, ref, np.float64)


@pytest.mark.parametrize("threads, rule", [(32, "gate"), (32, "gated_delta"), (1, "decay"), (1, "delta")])
def test_causal_backward_thread_counts(rng, monkeypatch, threads, rule):
    """More threads than rows and columns (idle threads in both phases), and a single thread (it owns
    every row and column); F = 3, M' = 4, one column block of 4 or two of 2, chunks of 3 tokens."""
    monkeypatch.setattr(config, "CUDA_MAX_THREADS", threads)
    monkeypatch.setattr(config, "CUDA_VALUE_COLS", 4 if threads > 1 else 2)
    args = problem(rng, 7, np.float64, f=3, m1=4)
    inputs = rule_inputs(rng, rule, B, 7, 3)
    ref = causal_backward_naive(*args, inputs=inputs, rule=CODES[rule])
    from linattn_nb.ops.grad.cuda import backward_chunked_cuda

    got = backward_chunked_cuda(*on_device(args), inputs=inputs, rule=CODES[rule], chunk_size=3)
    assert_grads(got, ref, np.float64)


def test_causal_backward_device_inputs_and_strided_views(rng):
    """The rule's inputs may be device arrays (read in place, as by the forward launchers), and the
    features non-contiguous device views."""
    from linattn_nb.ops.grad.cuda import backward_scan_cuda

    args = problem(rng, 5, np.float32)
    inputs = rule_inputs(rng, "gated_delta", B, 5, F)
    ref = causal_backward_naive(*args, inputs=inputs, rule=RULE_GATED_DELTA)
    dev_inputs = {name: cuda.to_device(x) for name, x in inputs.items()}
    dev = on_device(args)
    wide = np.zeros((B, 5, 2 * F), dtype=np.float32)
    wide[:, :, ::2] = args[0]
    dev[0] = cuda.to_device(wide)[:, :, ::2]
    assert not dev[0].is_c_contiguous()
    got = backward_scan_cuda(*dev, inputs=dev_inputs, rule=RULE_GATED_DELTA)
    assert_grads(got, ref, np.float32)


@pytest.mark.parametrize("b, n", [(2, 0), (0, 3)])
def test_causal_backward_empty(rng, b, n):
    """No tokens: dH0 = dH_N and zero gradients of the right shapes; no batch entries: empty results."""
    from linattn_nb.ops.grad.cuda import backward_scan_cuda

    args = problem(rng, n, np.float32, b=b)
    inputs = rule_inputs(rng, "gate", b, n, F)
    got = backward_scan_cuda(*on_device(args), inputs=inputs, rule=RULE_GATE)
    assert got.dq.shape == got.dk.shape == (b, n, F) and got.dv.shape == (b, n, M1)
    np.testing.assert_array_equal(got.dH0.copy_to_host(), args[5])
    assert got.dfactor.shape == (b, n, F) and not got.dfactor.copy_to_host().any()
    assert got.dbeta is None


def test_causal_backward_errors(rng):
    from linattn_nb.ops.grad.cuda import backward_chunked_cuda, backward_scan_cuda

    qf, kf, v1, H0, g1, dHN = problem(rng, 3, np.float64)
    d = on_device((qf, kf, v1, H0, g1, dHN))
    with pytest.raises(TypeError, match="qf must be a CUDA device array"):
        backward_scan_cuda(qf, *d[1:])
    with pytest.raises(ValueError, match=r"g1 must have shape \(2, 3, 3\)"):
        backward_scan_cuda(d[0], d[1], d[2], d[3], cuda.to_device(np.ascontiguousarray(g1[:, :, :2])), d[5])
    with pytest.raises(TypeError, match="H0 must be float64"):
        backward_scan_cuda(d[0], d[1], d[2], cuda.to_device(H0.astype(np.float32)), d[4], d[5])
    with pytest.raises(TypeError, match="kf must have the working dtype of qf"):
        backward_scan_cuda(d[0], cuda.to_device(kf.astype(np.float32)), *d[2:])
    with pytest.raises(ValueError, match=r"inputs: the decay rule takes the inputs \['log_decay'\]"):
        backward_scan_cuda(*d, rule=RULE_DECAY)
    with pytest.raises(ValueError, match=r"inputs\['beta'\] must have shape \(B, N\) = \(2, 3\)"):
        backward_scan_cuda(*d, inputs={"beta": np.zeros((2, 4))}, rule=RULE_DELTA)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        backward_chunked_cuda(*d, chunk_size=0)


@pytest.mark.parametrize("state_grad", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_aggregate_backward_matches_naive(rng, dtype, state_grad):
    from linattn_nb.ops.grad.cuda import backward_aggregate_cuda

    args = problem(rng, 5, dtype, state_grad=state_grad)
    ref = noncausal_backward_naive(*args)
    got = backward_aggregate_cuda(*on_device(args))
    assert_grads(got, ref, dtype)
    with pytest.raises(ValueError, match="additive rule only"):
        backward_aggregate_cuda(*on_device(args), inputs={"log_decay": np.zeros((B, 5))})


def test_aggregate_backward_registered():
    for name in ("aggregate", "scan", "chunked"):
        assert get_method(name, causal=False, device="cuda").backward.__name__ == "backward_aggregate_cuda"


# ---------------------------------------------------------------------------
# End to end through linear_attention_vjp
# ---------------------------------------------------------------------------
@pytest.fixture
def identity_vjp(monkeypatch):
    """The identity map's vjp (features are the inputs), patched in only where the map has none yet."""
    x = np.zeros((1, 2, 2))
    try:
        fm.IdentityFeatureMap().vjp(x, x, role="query", causal=True, offset=0, total_length=2)
    except (AttributeError, NotImplementedError):
        monkeypatch.setattr(fm.IdentityFeatureMap, "vjp", lambda self, x, g, **kw: (g, None), raising=False)


def assert_vjp_close(got, ref, rtol):
    for name in ("dq", "dk", "dv", "d_decay", "d_log_decay", "d_beta"):
        a, r = getattr(got, name), getattr(ref, name)
        assert (a is None) == (r is None), name
        if r is not None:
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(r, np.float64), rtol=rtol,
                                       atol=rtol * max(1.0, float(np.max(np.abs(r)))), err_msg=name)
    if ref.d_initial_state is not None:
        for part in ("S", "z"):
            np.testing.assert_allclose(getattr(got.d_initial_state, part), getattr(ref.d_initial_state, part),
                                       rtol=rtol, atol=rtol, err_msg=part)


@pytest.mark.parametrize("method, rule", [("scan", "additive"), ("chunked", "gated_delta"), ("scan", "decay")])
def test_vjp_end_to_end(rng, identity_vjp, method, rule):
    """``linear_attention_vjp(device="cuda")`` (the CUDA forward, then this backward) against the CPU
    ``quadratic`` method: float64, positive features (a normaliser away from 0), an initial state and
    a final-state gradient."""
    n, d, m = 5, 2, 2
    q, k = (np.abs(rng.normal(size=(B, n, d))) + 0.2 for _ in range(2))
    v = rng.normal(size=(B, n, m))
    g = rng.normal(size=(B, n, m))
    kw = dict(causal=True, feature_map=None)
    if rule == "gated_delta":
        kw.update(beta=rng.uniform(0.0, 2.0, (B, n)), log_decay=-rng.uniform(0.0, 1.0, (B, n)))
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    elif rule == "decay":
        kw.update(decay=rng.uniform(0.5, 1.0, (B,)))
    state = la.LinearState(S=rng.normal(size=(B, d, m)), z=rng.uniform(1.0, 2.0, (B, d)), rule=rule)
    grad_state = la.LinearState(S=rng.normal(size=(B, d, m)), z=rng.normal(size=(B, d)))
    ref = la.linear_attention_vjp(q, k, v, g, method="quadratic", device="cpu", initial_state=state,
                                  grad_state=grad_state, **kw)
    got = la.linear_attention_vjp(q, k, v, g, method=method, device="cuda", initial_state=state,
                                  grad_state=grad_state, **kw)
    assert_vjp_close(got, ref, 1e-10)


def test_vjp_end_to_end_noncausal(rng, identity_vjp):
    n, d, m = 5, 2, 2
    q, k = (np.abs(rng.normal(size=(B, n, d))) + 0.2 for _ in range(2))
    v, g = (rng.normal(size=(B, n, m)).astype(np.float32) for _ in range(2))
    q, k = q.astype(np.float32), k.astype(np.float32)
    kw = dict(causal=False, feature_map=None)
    ref = la.linear_attention_vjp(q, k, v, g, method="quadratic", device="cpu", **kw)
    got = la.linear_attention_vjp(q, k, v, g, method="aggregate", device="cuda", **kw)
    assert got.dq.dtype == np.float32
    assert_vjp_close(got, ref, 2e-5)


# ---------------------------------------------------------------------------
# sm_90 PTX (and, with ptxas, registers and spills)
# ---------------------------------------------------------------------------
_PTX_SCRIPT = """
import json, os, subprocess, tempfile
from numba import cuda, types
from linattn_nb.ops.grad import _cuda_kernels as GK
from linattn_nb.ops.grad.cuda import column_blocks
try:
    import nvidia.cuda_nvcc as nv
    ptxas = os.path.join(list(nv.__path__)[0], "bin", "ptxas")
    ptxas = ptxas if os.path.exists(ptxas) else None
except Exception:
    ptxas = None
i, b, f64 = types.int64, types.boolean, types.float64
C3, C4 = types.Array(f64, 3, "C"), types.Array(f64, 4, "C")
res = {}
def check(key, fn, sig, assemble):
    text, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
    r = {"target": ".target sm_90" in text, "entry": ".entry" in text,
         "local": ("ld.local" in text) or ("st.local" in text)}
    if ptxas and assemble:
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "k.ptx")
            with open(p, "w") as fh:
                fh.write(text)
            out = subprocess.run([ptxas, "-arch=sm_90", "-v", p, "-o", os.path.join(d, "k.cubin")],
                                 capture_output=True, text=True)
            info = out.stdout + out.stderr
            r["registers"] = int(info.split("Used ")[1].split(" registers")[0])
            r["spills"] = int(info.split(" bytes spill stores")[0].rsplit(" ", 1)[1])
    res[key] = r
MB, _ = column_blocks(65)  # D_phi = M = 64: M' = 65 columns, two blocks
for dt in (types.float32, types.float64):
    w3 = types.Array(dt, 3, "C")
    sig = (w3, w3, w3, w3, C3, C3, b, C3, C4, C4, C3, w3, C4, C4, C4, C4, i, i, i)
    check("backward/%s" % dt, GK.causal_backward_kernel(MB).py_func, sig, dt == types.float64)
    check("sum_blocks/%s" % dt, GK.sum_blocks_kernel.py_func, (C4, w3), False)
    check("aggregate_sums/%s" % dt, GK.aggregate_sums_kernel.py_func, (w3, w3, w3, w3, C3, C3, b, C3, C3), False)
    check("aggregate_grads/%s" % dt, GK.aggregate_grads_kernel.py_func, (w3, w3, w3, C3, C3, w3, w3, w3), False)
print(json.dumps(res))
"""


def test_backward_kernels_compile_to_ptx():
    """Every backward kernel (the causal kernel, which takes the rule as an argument, the block sum,
    the two non-causal kernels) compiles for sm_90 in float32 and float64 at the default configuration (D_phi = M =
    64), with no local memory; the float64 causal kernel assembled by ptxas when installed
    (seconds per kernel; the float32 one has the same register count): no spills, and a block of
    ``MAX_BACKWARD_THREADS`` threads fits in the registers of a multiprocessor."""
    from linattn_nb.ops.grad._cuda_kernels import MAX_BACKWARD_THREADS

    res = run_ptx_script(_PTX_SCRIPT)
    assert len(res) == 8
    for key, val in res.items():
        assert (val["target"], val["entry"], val["local"]) == (True, True, False), (key, val)
        if "spills" in val:  # and a block of the most threads fits in a multiprocessor's 64k registers
            assert val["spills"] == 0 and val["registers"] * MAX_BACKWARD_THREADS <= 65536, (key, val)
