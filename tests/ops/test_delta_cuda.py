"""CUDA kernels of the delta and gated delta rules and the inline 'l2' / 'silu_l2' feature maps.

Runs on the Numba CUDA simulator without a GPU (tests/conftest.py) with the tiny
launch configuration of test_cuda.py (2 tokens per shared-memory tile, 2 x 3 state
tiles, so F = 3 takes two row groups and the delta rules' per-token reduction
crosses threads; 3 value columns per block, so M = 4 takes two column blocks),
and chunks of 3 tokens.  For the delta rules ``chunked`` runs the scan (their
chunk transition is an (F, F) matrix; ops/causal/cuda.py), so both methods are
checked alike.  The sequence kernels of both rules are also compiled to sm_90
PTX at the default launch configuration.  The simulator's time grows with the
blocks (batch entries x column blocks) and the tokens: the tests whose subject is
not the column-block split take M = 3 (one block), and each test as few batch
entries as its cases need.

Ground truth: the float64 explicit form of ops/causal/naive.py
(``causal_linear_quadratic``, the closed form of the delta rules) on features
from the NumPy maps of linattn_nb.feature_maps.
"""
from __future__ import annotations


import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import config
from linattn_nb.device import cuda_status
from linattn_nb.feature_maps import get as get_map
from linattn_nb.ops._codes import KERNEL_CODE_L2, KERNEL_CODE_SILU_L2, RULE_ADDITIVE, RULE_DELTA, RULE_GATED_DELTA
from linattn_nb.ops.causal.naive import causal_linear_quadratic
from linattn_nb.ops.noncausal.naive import noncausal_linear_quadratic
from _ptx import run_ptx_script, seq_kernel_ptx_script
from test_cuda import SMALL_LAUNCH

cuda = pytest.importorskip("numba.cuda")

pytestmark = pytest.mark.skipif(cuda_status() == "none", reason="neither a CUDA GPU nor the simulator is available")

#: max abs error / max(1, max |reference|), per input dtype (float32 accumulates in float32)
TOL = {np.float32: 3e-5, np.float64: 1e-12}
#: rule name -> (code, the map its tests use)
RULES = {"delta": (RULE_DELTA, KERNEL_CODE_L2), "gated_delta": (RULE_GATED_DELTA, KERNEL_CODE_SILU_L2)}
MAPS = {KERNEL_CODE_L2: "l2", KERNEL_CODE_SILU_L2: "silu_l2"}
B, N, F, M, CHUNK = 2, 8, 3, 4, 3


@pytest.fixture(autouse=True)
def small_launch(monkeypatch):
    for name, value in SMALL_LAUNCH.items():
        monkeypatch.setattr(config, name, value)
    # the grid-stride helper kernels (state casts, the rules' inputs packed) on at most 2 blocks of 8
    # threads: each thread loops over several elements, and the simulator starts 16 threads a launch
    # rather than one per element
    monkeypatch.setattr(config, "CUDA_THREADS_PER_BLOCK", 8)
    monkeypatch.setattr(config, "CUDA_MAX_HELPER_BLOCKS", 2)


def assert_close(actual, expected, dtype):
    actual = np.asarray(actual, dtype=np.float64)
    assert np.isfinite(actual).all(), "NaN or inf in the result"
    scale = max(float(np.max(np.abs(expected))), 1.0)
    err = float(np.max(np.abs(actual - expected)))
    assert err <= TOL[np.dtype(dtype).type] * scale, f"max abs error {err:.3e}"


def features(x, code):
    """The NumPy map of kernel code ``code`` on ``x`` (its dtype), in float64."""
    return get_map(MAPS[code]).transform(x).astype(np.float64)


def data(rng, dtype, b=B, m=M):
    """Positive q, k (so that with normalize=True the normaliser stays away from 0), a zero key row
    (entry 1, token 2; entry 0 when b = 1) and a zero query row (entry 0, token 5); a random initial
    state, z0 > 0."""
    q, k = (np.abs(rng.normal(size=(b, N, F))) + 0.1 for _ in range(2))
    k[min(1, b - 1), 2] = 0.0
    q[0, 5] = 0.0
    v = rng.normal(size=(b, N, m))
    S0 = rng.normal(size=(b, F, m))
    z0 = rng.uniform(0.5, 1.5, size=(b, F))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), S0, z0


def rule_inputs(rng, rule, b=B, n=N):
    """beta in [0, 2] (with a 0 and a 2); the gated rule's log-decays with resets (-inf) at token 0
    and mid-chunk (entry 0, tokens 0 and 4) and at a chunk boundary (entry 1, token 3), so that
    entry 1 carries its initial state in (b = 1: all of them in entry 0)."""
    e1 = min(1, b - 1)
    beta = rng.uniform(0.0, 2.0, size=(b, n))
    beta[0, 1] = 0.0
    beta[e1, 5] = 2.0
    if rule == "delta":
        return {"beta": beta}
    lg = np.log(rng.uniform(0.3, 1.0, size=(b, n)))
    lg[0, 4] = lg[e1, 3] = lg[0, 0] = -np.inf
    return {"beta": beta, "log_decay": lg}


def launcher(method):
    from linattn_nb.ops.causal.cuda import causal_chunked_cuda, causal_scan_cuda

    if method == "chunked":
        return lambda *a, **kw: causal_chunked_cuda(*a, chunk_size=CHUNK, **kw)
    return causal_scan_cuda


def run(method, q, k, v, S0, z0, *, rule, inputs, code, normalize=False, eps=1e-8):
    """A CUDA launcher on device copies; returns (out, S, z) on the host."""
    H = cuda.to_device(np.concatenate([S0, z0[..., None]], axis=-1))
    out = cuda.to_device(np.full(q.shape[:2] + v.shape[-1:], np.nan, dtype=np.result_type(q, k, v)))
    if method == "aggregate":
        from linattn_nb.ops.noncausal.cuda import noncausal_aggregate_cuda

        got = noncausal_aggregate_cuda(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), H, out, code=code,
                                       eps=eps, inputs=inputs, normalize=normalize, chunk_size=CHUNK)
    else:
        got = launcher(method)(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), H, out, code=code, eps=eps,
                               inputs=inputs, normalize=normalize, rule=rule)
    assert got is out
    h = H.copy_to_host()
    return out.copy_to_host(), h[..., :-1], h[..., -1]


# chunked runs the scan (causal_chunked_cuda calls the same C.scan with the same normalize flag for the
# delta rules, checked on both settings by the scan cases): one dtype and one setting check that it does
@pytest.mark.parametrize("method, dtype, normalize",
                         [("scan", np.float32, False), ("scan", np.float32, True), ("scan", np.float64, False),
                          ("scan", np.float64, True), ("chunked", np.float32, True)],
                         ids=["scan-f32-raw", "scan-f32-normalize", "scan-f64-raw", "scan-f64-normalize",
                              "chunked-f32-normalize"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_launchers_match_reference(rule, method, dtype, normalize):
    """Initial state in, final state out, beta 0 and 2, a zero key and a zero query row, resets of
    the gated rule mid-chunk, at a chunk boundary and at token 0, M = 4 in two column blocks: outputs
    and the final state equal the explicit form (delta: 'l2' features, gated delta: 'silu_l2',
    applied in the kernel)."""
    rng = np.random.default_rng(15)
    q, k, v, S0, z0 = data(rng, dtype)
    code, map_code = RULES[rule]
    inputs = rule_inputs(rng, rule)
    out, S, z = run(method, q, k, v, S0, z0, rule=code, inputs=inputs, code=map_code, normalize=normalize)
    ref, S_ref, z_ref = causal_linear_quadratic(features(q, map_code), features(k, map_code), v.astype(np.float64),
                                                eps=1e-8, S0=S0, z0=z0, rule=code, inputs=inputs, normalize=normalize)
    if normalize:  # the data keep the normaliser phi(q)^T z away from 0 (the division amplifies rounding)
        den, _, _ = causal_linear_quadratic(features(q, map_code), features(k, map_code), np.ones((B, N, 1)),
                                            eps=1e-8, S0=z0[..., None], z0=z0, rule=code, inputs=inputs,
                                            normalize=False)
        den[0, 5] = 1.0  # the zero query row: 0 / eps = 0 exactly
        assert np.abs(den).min() > 0.05
    assert_close(out, ref, dtype)
    assert_close(S, S_ref, dtype)
    assert_close(z, z_ref, dtype)


def scan_against_reference(rng, rule, dtype, b, n, f, m, inputs):
    """The CUDA scan (no normalisation) on positive q, k drawn from ``rng`` and a random initial
    state, against the explicit form: outputs, S and z within TOL.  Returns (out, reference)."""
    q, k = (np.abs(rng.normal(size=(b, n, f))) + 0.1 for _ in range(2))
    v = rng.normal(size=(b, n, m))
    S0, z0 = rng.normal(size=(b, f, m)), rng.uniform(0.5, 1.5, size=(b, f))
    code, map_code = RULES[rule]
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    out, S, z = run("scan", q, k, v, S0, z0, rule=code, inputs=inputs, code=map_code)
    ref, S_ref, z_ref = causal_linear_quadratic(features(q, map_code), features(k, map_code), v.astype(np.float64),
                                                eps=1e-8, S0=S0, z0=z0, rule=code, inputs=inputs, normalize=False)
    assert_close(out, ref, dtype)
    assert_close(S, S_ref, dtype)
    assert_close(z, z_ref, dtype)
    return out, ref


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("f,dtype", [(3, np.float32), (3, np.float64), (5, np.float32), (5, np.float64), (8, np.float32)],
                         ids=["G2-shuffles-float32", "G2-shuffles-float64", "G3-shared-float32", "G3-shared-float64",
                              "G4-shuffles-float32"])  # float64 shuffles at G = 2 only (the suite's time)
def test_row_group_reductions(rule, dtype, f):
    """k^T H[:, m] summed across the row groups both ways: xor-shuffles within a warp when the
    number of groups G is a power of two (F = 3 and 8: G = 2 and 4 groups of 2 rows), through
    shared memory with a barrier per token otherwise (F = 5: G = 3); the blocks here have 2 G
    threads, one partial warp (the shuffles' lane mask); one batch entry (the sums are within a
    block), M = 4 in two column blocks.  Against the explicit form."""
    from linattn_nb.ops.cuda import plan as KP

    rng = np.random.default_rng(16 + f)
    b, n, m = 1, 7, 4
    cfg = KP.seq_config(f, m, np.dtype(dtype).itemsize, RULES[rule][0])
    assert cfg[2] == -(-f // 2), cfg
    scan_against_reference(rng, rule, dtype, b, n, f, m, rule_inputs(rng, rule, b=b, n=n))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("f", [3, 5], ids=["shuffles", "shared"])
def test_gated_rescaled_and_direct_tiles(monkeypatch, dtype, f):
    """The gated delta rule on tiles of 8 tokens: mild factors (rescaled tiles: q_t P_t and
    v_t / P_t staged), a tile whose running factor ends just above the rescaling floor (v / P up
    to ~5e8 in float32), one below it (the direct form: the state scaled token by token) and a
    rescaled tile after it, a reset mid-tile in the part tile at the end, with both row-group sums:
    against the explicit form (one column block: M = 3)."""
    from linattn_nb.ops.cuda.plan import RESCALE_MIN_F32, RESCALE_MIN_F64

    monkeypatch.setattr(config, "CUDA_TILE_TOKENS", 8)
    rng = np.random.default_rng(21)
    b, n, m = 2, 29, 3  # tiles 0-7, 8-15, 16-23 and the part tile 24-28
    tau = RESCALE_MIN_F32 if dtype == np.float32 else RESCALE_MIN_F64
    floor = np.log(tau)
    lg = -rng.uniform(0.0, 0.2, size=(b, n))
    lg[0, 8:16] = 0.9 * floor / 8  # ends at ~floor^0.9: rescaled
    lg[1, 8:16] = 1.3 * floor / 8  # below the floor: the direct form
    lg[1, 26] = -np.inf  # a reset mid-tile
    rescaled = [[bool(np.exp(lg[e, t0:t0 + 8].sum()) >= tau) for t0 in range(0, n, 8)] for e in range(b)]
    assert rescaled == [[True] * 4, [True, False, True, False]], rescaled  # the tiles' forms (blocks.rescale_tile)
    inputs = {"beta": rng.uniform(0.0, 2.0, size=(b, n)), "log_decay": lg}
    out, ref = scan_against_reference(rng, "gated_delta", dtype, b, n, f, m, inputs)
    for row in (16, 17, 27):  # right after the strongly decayed tiles and the reset, on their own scale
        np.testing.assert_allclose(out[:, row], ref[:, row], rtol=TOL[dtype] * 10, atol=TOL[dtype])


@pytest.mark.parametrize("method", ["scan", "chunked"])
def test_gated_reset_at_token_zero_forgets_the_initial_state_exactly(method):
    """A reset at token 0 of every entry: outputs and final state are those of a zero initial
    state, bit for bit, however large the initial state (0 * s and 0 * k^T s are 0 exactly); one
    column block (M = 3)."""
    rng = np.random.default_rng(3)
    q, k, v, S0, z0 = data(rng, np.float64, m=3)
    inputs = rule_inputs(rng, "gated_delta")
    inputs["log_decay"][:, 0] = -np.inf
    kw = dict(rule=RULE_GATED_DELTA, inputs=inputs, code=KERNEL_CODE_L2)
    got = run(method, q, k, v, 1e30 * S0, 1e30 * z0, **kw)
    zero = run(method, q, k, v, 0.0 * S0, 0.0 * z0, **kw)
    for a, b in zip(got, zero):
        np.testing.assert_array_equal(a, b)


def test_delta_rule_beta_zero_keeps_the_state_and_unit_keys_stay_bounded():
    """beta = 0: the state is never written (outputs read the initial state); beta in [0, 2]
    with unit keys ('l2'): I - beta k k^T is a contraction, so ||S|| stays within
    ||S0|| + sum_t beta_t ||v_t|| whatever the keys; one column block (M = 3)."""
    rng = np.random.default_rng(8)
    q, k, v, S0, z0 = data(rng, np.float64, m=3)
    k = rng.normal(size=k.shape)  # signed unit keys
    out, S, z = run("scan", q, k, v, S0, z0, rule=RULE_DELTA, inputs={"beta": np.zeros((B, N))}, code=KERNEL_CODE_L2)
    np.testing.assert_array_equal(S, S0)
    np.testing.assert_array_equal(z, z0)
    np.testing.assert_allclose(out, np.einsum("bnf,bfm->bnm", features(q, KERNEL_CODE_L2), S0), rtol=0, atol=1e-14)
    beta = rng.uniform(0.0, 2.0, size=(B, N))
    _, S, _ = run("scan", q, k, v, S0, z0, rule=RULE_DELTA, inputs={"beta": beta}, code=KERNEL_CODE_L2)
    bound = np.linalg.norm(S0, 2, axis=(1, 2)) + np.sum(beta * np.linalg.norm(v, axis=-1), axis=1)
    assert (np.linalg.norm(S, 2, axis=(1, 2)) <= bound * (1 + 1e-12)).all()


# column blocks of 3 + 2 at D_phi = 12; one block of 3 (M = 3) at the larger tiles, with the same threads
@pytest.mark.parametrize("f, m, cols, dtype", [(8, 5, 64, np.float32), (12, 5, 3, np.float32),
                                             (12, 11, 64, np.float32), (16, 3, 3, np.float32),
                                             (24, 3, 3, np.float32), (36, 3, 3, np.float32),
                                             (36, 3, 3, np.float64)],
                         ids=["T2-one-entry-each", "T3-cols3+2", "T3-one-entry-each", "T4-four-a-step", "T6", "T9",
                              "T9-float64"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_delta_tile_layout(monkeypatch, rule, f, m, cols, dtype):
    """The delta rules in the tile layout (the WY/UT form per tile of T = D_phi / 4 tokens: L of
    the tile's keys, W = L^-1 diag(beta) solved a column per thread, Y = [V | 1] minus the keys'
    read of the start state, U' = W Y): N = 13 (a part tile at the end), beta 0 and 2, the gated
    rule's resets at token 0, mid-tile and at a tile's first token and a run of e^-25 factors,
    a random start state; with one entry of the scores and of L per thread (D_phi = 8, M = 5 and
    D_phi = 12, M = 11: NTRI + NL = threads) and with threads looping over them, column blocks
    of 3 + 2 (D_phi = 12) or one of 3; D_phi = 16 (tiles of 4 tokens: the products over the
    tile's tokens take four a step); outputs and final state against the explicit form (float64:
    normalised outputs)."""
    from linattn_nb.ops.cuda import plan as KP

    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", "tiles")
    monkeypatch.setattr(config, "CUDA_VALUE_COLS", cols)
    code, map_code = RULES[rule]
    b, n, T = 2, 13, f // 4
    cfg = KP.seq_config(f, m, np.dtype(dtype).itemsize, code, "tiles")
    assert cfg == (f, 4, 0, min(m, cols), T), cfg
    nth = KP.threads_per_block(*cfg[:4], code)
    assert (T * (T + 1) // 2 + T * (T - 1) // 2 <= nth) == (cols == 64), nth
    rng = np.random.default_rng(41 + f)
    normalize = dtype == np.float64
    q, k = (rng.normal(size=(b, n, f)) for _ in range(2))
    if normalize:  # positive features: the normaliser phi(q)^T z stays away from 0
        q, k = np.abs(q) + 0.1, np.abs(k) + 0.1
    v = rng.normal(size=(b, n, m))
    S0, z0 = rng.normal(size=(b, f, m)), rng.uniform(0.5, 1.5, size=(b, f))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    beta = rng.uniform(0.0, 2.0, size=(b, n))
    beta[0, 1], beta[1, T] = 0.0, 2.0
    inputs = {"beta": beta}
    if rule == "gated_delta":
        lg = np.log(rng.uniform(0.3, 1.0, size=(b, n)))
        lg[0, 2:6] = -25.0
        lg[0, T + 1] = lg[1, 0] = lg[1, T] = -np.inf
        inputs["log_decay"] = lg
    out, S, z = run("scan", q, k, v, S0, z0, rule=code, inputs=inputs, code=map_code, normalize=normalize)
    ref, S_ref, z_ref = causal_linear_quadratic(features(q, map_code), features(k, map_code), v.astype(np.float64),
                                                eps=1e-8, S0=S0, z0=z0, rule=code, inputs=inputs, normalize=normalize)
    assert_close(out, ref, dtype)
    assert_close(S, S_ref, dtype)
    assert_close(z, z_ref, dtype)


@pytest.mark.parametrize("layout", ["auto", "tiles"])
@pytest.mark.parametrize("method", ["scan", "chunked", "aggregate"])
@pytest.mark.parametrize("code", [KERNEL_CODE_L2, KERNEL_CODE_SILU_L2])
def test_row_maps_inline(monkeypatch, code, method, layout):
    """'l2' and 'silu_l2' applied in the kernel equal the NumPy maps (additive rule, causal scan
    and chunked, non-causal aggregate; float32): signed inputs, a zero key row and a zero query
    row (which stay zero), a row of very negative values (SiLU gives -0s: a zero row) and a query
    row whose squares overflow float32 (the norm is taken in float64); the simulator's layout
    (owner) and the tile layout (unnormalised outputs); one column block (M = 3: the maps are
    applied to the staged rows, whatever the block's columns)."""
    from linattn_nb import config

    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", layout)
    rng = np.random.default_rng(code)
    m = 3
    q, k = (rng.normal(size=(B, N, F)) for _ in range(2))
    v = rng.normal(size=(B, N, m))
    k[1, 2] = 0.0
    q[0, 5] = 0.0
    k[0, 6] = -1e4
    q[1, 3] = [1e20, 2e20, 2e20]
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    S0 = rng.normal(size=(B, F, m))
    z0 = rng.normal(size=(B, F))
    qf, kf = features(q, code), features(k, code)
    assert np.array_equal(kf[1, 2], np.zeros(F)) and np.abs(qf[1, 3]).max() == pytest.approx(2 / 3)
    if code == KERNEL_CODE_SILU_L2:
        assert not kf[0, 6].any()
    out, S, z = run(method, q, k, v, S0, z0, rule=RULE_ADDITIVE, inputs=None, code=code, normalize=False)
    ref_fn = noncausal_linear_quadratic if method == "aggregate" else causal_linear_quadratic
    ref, S_ref, z_ref = ref_fn(qf, kf, v.astype(np.float64), eps=1e-8, S0=S0, z0=z0, normalize=False)
    assert_close(out, ref, np.float32)
    assert_close(S, S_ref, np.float32)
    assert_close(z, z_ref, np.float32)
    assert not out[0, 5].any()  # a zero query row reads nothing


@pytest.mark.parametrize("method", ["scan", "chunked"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_public_api_with_host_inputs(rule, method):
    """linear_attention(..., beta=, [log_decay=,] device="cuda") with NumPy inputs (batch (2, 1))
    equals method="quadratic" on the CPU: outputs and the final state, from an initial state;
    the state is tagged with the rule (one column block: M = 3)."""
    rng = np.random.default_rng(7)
    m = 3
    q, k = (rng.normal(size=(2, 1, N, F)) for _ in range(2))
    v = rng.normal(size=(2, 1, N, m))
    state = (rng.normal(size=(2, 1, F, m)), rng.uniform(0.5, 1.5, size=(2, 1, F)))
    kw = {"beta": rng.uniform(0.0, 2.0, size=(2, 1, N))}
    if rule == "gated_delta":
        kw["decay"] = rng.uniform(0.3, 1.0, size=(2, 1, N))
        kw["decay"][0, 0, 4] = 0.0
    fmap = MAPS[RULES[rule][1]]
    o, st = la.linear_attention(q, k, v, causal=True, device="cuda", method=method, initial_state=state,
                                return_state=True, feature_map=fmap, **kw)
    r, rst = la.linear_attention(q, k, v, causal=True, device="cpu", method="quadratic", initial_state=state,
                                 return_state=True, feature_map=fmap, **kw)
    assert isinstance(o, np.ndarray) and o.shape == (2, 1, N, m)
    assert_close(o, r, np.float64)
    assert_close(st.S, rst.S, np.float64)
    assert_close(st.z, rst.z, np.float64)
    assert st.rule == rule


def test_rule_inputs_checked_and_device_inputs_read():
    """beta / log_decay of the wrong shape or (on the device) dtype raise ValueError naming them;
    device arrays (alone or mixed with host arrays) give the result of the host arrays, float32 ones
    that of the float64 arrays of their values (one batch entry, one column block: M = 3)."""
    rng = np.random.default_rng(9)
    q, k, v, S0, z0 = data(rng, np.float64, b=1, m=3)
    inputs = rule_inputs(rng, "gated_delta", b=1)
    kw = dict(rule=RULE_GATED_DELTA, code=KERNEL_CODE_L2)
    host = run("scan", q, k, v, S0, z0, inputs=inputs, **kw)
    for dev in ({"beta": cuda.to_device(inputs["beta"]), "log_decay": cuda.to_device(inputs["log_decay"])},
                {"beta": cuda.to_device(inputs["beta"]), "log_decay": inputs["log_decay"]}):
        got = run("scan", q, k, v, S0, z0, inputs=dev, **kw)
        for a, b in zip(host, got):
            np.testing.assert_array_equal(a, b)
    in32 = {name: x.astype(np.float32) for name, x in inputs.items()}
    got32 = run("scan", q, k, v, S0, z0, inputs={name: cuda.to_device(x) for name, x in in32.items()}, **kw)
    host32 = run("scan", q, k, v, S0, z0, inputs={name: x.astype(np.float64) for name, x in in32.items()}, **kw)
    for a, b in zip(host32, got32):
        np.testing.assert_array_equal(a, b)
    beta = inputs["beta"]
    for rule, bad, msg in [
        (RULE_DELTA, {"beta": beta[:, :-1]}, r"inputs\['beta'\] must have shape \(B, N\) = \(1, 8\), got \(1, 7\)"),
        (RULE_GATED_DELTA, {"beta": beta, "log_decay": inputs["log_decay"][:, None]},
         r"inputs\['log_decay'\] must have shape \(B, N\) = \(1, 8\), got \(1, 1, 8\)"),
        (RULE_DELTA, {"beta": cuda.to_device(beta.astype(np.float16))},
         r"inputs\['beta'\] must be float32 or float64, got float16"),
        (RULE_GATED_DELTA, {"beta": beta}, r"inputs: the gated_delta rule takes the inputs \['beta', 'log_decay'\]"),
    ]:
        for method in ("scan", "chunked"):
            with pytest.raises(ValueError, match=msg):
                run(method, q, k, v, S0, z0, rule=rule, inputs=bad, code=KERNEL_CODE_L2)


# the delta rule's default kernel (row groups) in float32, the gated rule's (a superset of its code)
# in float64, and the gated rule's tile kernel (the delta rules' and the decay rule's tile code)
_PTX_SCRIPT = seq_kernel_ptx_script((("float32", RULE_DELTA, "default"), ("float64", RULE_GATED_DELTA, "default"),
                                     ("float32", RULE_GATED_DELTA, "tiles")), "pack_column_kernel",
                                    '(types.Array(f64, 2, "A"), types.Array(f64, 3, "C"), i)')


def test_delta_kernels_compile_to_ptx():
    """The delta and gated delta sequence kernels (with the inline row maps) type-check and compile
    for sm_90 at D_phi = M = 64 (the row groups the launchers take with many sequences, float32 and
    float64 accumulation, and the tile layout they take with few) with the state in registers (no
    local memory); the packing kernel of the rules' inputs compiles too.  Every kernel at every
    configuration: the opt-in launch check (tests/ops/test_cuda_launchable.py)."""
    res = run_ptx_script(_PTX_SCRIPT)
    assert len(res) == 4
    for key, val in res.items():
        assert val == {"target": True, "entry": True, "local": False}, (key, val)


@pytest.mark.parametrize("k_pow", [-1068, -600, 600])
def test_row_maps_float64_rows_at_the_ends_of_the_range(k_pow):
    """A float64 key and query row scaled by 2^k_pow (squares that overflow or underflow, subnormals):
    'l2' in the kernel still gives the row's direction, so the output is the unscaled inputs' (the CPU
    kernels do the same: tests/feature_maps/test_l2_extreme_rows.py)."""
    rng = np.random.default_rng(2)
    q = rng.integers(-4, 5, (1, 4, F)).astype(np.float64)
    k = rng.integers(-4, 5, (1, 4, F)).astype(np.float64)
    q[0, 0] = k[0, 0] = 1.0
    v = rng.normal(size=(1, 4, M))
    q2, k2 = q.copy(), k.copy()
    k2[0, 1] = np.ldexp(k[0, 1], k_pow)
    q2[0, 2] = np.ldexp(q[0, 2], k_pow)
    kw = dict(causal=True, device="cuda", method="scan", feature_map="l2", beta=np.full((1, 4), 0.5))
    np.testing.assert_allclose(la.linear_attention(q2, k2, v, **kw), la.linear_attention(q, k, v, **kw),
                               rtol=0, atol=1e-15)
