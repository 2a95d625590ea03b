"""CUDA kernels and the device path of linear_attention.

Runs everywhere: without a CUDA driver, tests/conftest.py switches the Numba
CUDA simulator on, and ``device="cuda"`` runs the kernels there (slowly: the
shapes are tiny, and the launch configuration is shrunk so that several
blocks and partial blocks run: 3 value columns per block (+ the normaliser
column, padded to 6 = 2 column groups of 3, in the row-group layout), 2 x 3
state tiles per thread there, 2 tokens per shared-memory tile, chunks of 3
tokens, 32 threads per helper block and at most 2 helper blocks: their grid-stride loops stride, and
the simulator starts no more than 64 threads for a helper kernel).  D_phi <= 64 takes the owner layout (one
thread per value column, all rows) for every rule but the delta rules;
``test_row_group_layout`` forces the row-group layout on the additive rule.  The simulator checks no types, so ``test_kernels_compile_to_ptx``
compiles every kernel for sm_90 in a subprocess with the simulator off.
Tests marked ``gpu`` need a real GPU and skip without one.

Ground truth: the float64 quadratic references of ops/causal/naive.py and
ops/noncausal/naive.py (Katharopoulos et al. 2020, Eqs. 7 and 10-12).
"""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import config
from linattn_nb.device import cuda_status
from linattn_nb.ops.causal.naive import causal_linear_quadratic
from linattn_nb.ops.noncausal.naive import noncausal_linear_quadratic
from _ptx import run_ptx_script

cuda = pytest.importorskip("numba.cuda")

STATUS = cuda_status()
ON_GPU = STATUS == "gpu"
pytestmark = pytest.mark.skipif(STATUS == "none", reason="neither a CUDA GPU nor the simulator is available")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a real CUDA GPU")

# out: rtol/atol per input dtype (float16 output is rounded to 11 bits)
TOL = {np.float16: (4e-3, 4e-3), np.float32: (2e-5, 2e-6), np.float64: (1e-11, 1e-12)}
# state: always float64, accumulated in float32 for float16/32 inputs
STATE_TOL = {np.float16: (1e-5, 1e-5), np.float32: (1e-5, 1e-6), np.float64: (1e-11, 1e-12)}


SMALL_LAUNCH = {"CUDA_VALUE_COLS": 3, "CUDA_ROWS_PER_THREAD": 2, "CUDA_COLS_PER_THREAD": 3, "CUDA_MAX_ROWS_PER_THREAD": 4,
                "CUDA_DELTA_ROWS_PER_THREAD": 2, "CUDA_DELTA_COLS_PER_THREAD": 3,
                "CUDA_TILE_TOKENS": 2, "CUDA_CHUNK_SIZE": 3, "CUDA_THREADS_PER_BLOCK": 32,
                "CUDA_MAX_HELPER_BLOCKS": 2}
DEFAULT_LAUNCH = {name: getattr(config, name) for name in SMALL_LAUNCH}


@pytest.fixture(autouse=True)
def small_launch(monkeypatch):
    """Shrink the launch configuration so tiny shapes still span several blocks."""
    for name, value in SMALL_LAUNCH.items():
        monkeypatch.setattr(config, name, value)


def phi_ref(x, code):
    x = np.asarray(x, dtype=np.float64)
    if code == 1:
        return np.where(x >= 0, x + 1, np.exp(np.minimum(x, 0)))
    if code == 2:
        return np.maximum(x, 0)
    if code == 3:
        return np.maximum(x, 0) ** 2
    return x


def reference(q, k, v, *, causal, code=1, eps=1e-8, S0=None, z0=None):
    """float64 quadratic reference on (B, N, F) arrays."""
    ref = causal_linear_quadratic if causal else noncausal_linear_quadratic
    return ref(phi_ref(q, code), phi_ref(k, code), np.asarray(v, np.float64), eps=eps, S0=S0, z0=z0)


def launcher(method, causal):
    """The CUDA launcher of the additive rule (contract: q, k, v, H, out, *, code, eps, inputs)."""
    from linattn_nb.ops.causal.cuda import causal_chunked_cuda, causal_scan_cuda
    from linattn_nb.ops.noncausal.cuda import noncausal_aggregate_cuda

    return {("scan", True): causal_scan_cuda, ("chunked", True): causal_chunked_cuda,
            ("aggregate", False): noncausal_aggregate_cuda}[(method, causal)]


def nan_device(shape, dtype):
    return cuda.to_device(np.full(shape, np.nan, dtype=dtype))


def state_h(S0, z0):
    """The launcher state H = [S | z] (float64, C-contiguous) on the device."""
    return cuda.to_device(np.concatenate([S0, z0[..., None]], axis=-1).astype(np.float64))


def split_h(H):
    h = H.copy_to_host()
    return h[..., :-1], h[..., -1]


def run_launcher(method, causal, q, k, v, S0, z0, *, code=1, eps=1e-8):
    H = state_h(S0, z0)
    out = nan_device(q.shape[:2] + v.shape[-1:], np.result_type(q, k, v))
    got = launcher(method, causal)(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), H, out,
                                   code=code, eps=eps)
    assert got is out
    return (out.copy_to_host(),) + split_h(H)


def data(rng, B, N, F, M, dtype=np.float32):
    q = rng.normal(size=(B, N, F)).astype(dtype)
    k = rng.normal(size=(B, N, F)).astype(dtype)
    v = rng.normal(size=(B, N, M)).astype(dtype)
    return q, k, v


# ---------------------------------------------------------------------------
# Kernels against the reference
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("method,causal", [("scan", True), ("chunked", True), ("aggregate", False)])
def test_launcher_matches_reference(rng, method, causal, dtype):
    """B=2, N=7 (tiles 2+2+2+1, chunks 3+3+1), F=5 (3 row groups, 1 padded row),
    M=4 (column blocks 3+1), random initial state, NaN-filled output."""
    q, k, v = data(rng, 2, 7, 5, 4, dtype)
    S0 = rng.random((2, 5, 4))
    z0 = rng.random((2, 5))
    out, S, z = run_launcher(method, causal, q, k, v, S0, z0)
    ref, S_ref, z_ref = reference(q, k, v, causal=causal, S0=S0, z0=z0)
    assert out.dtype == dtype
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=rtol, atol=atol)
    rtol, atol = STATE_TOL[dtype]
    np.testing.assert_allclose(S, S_ref, rtol=rtol, atol=atol)
    np.testing.assert_allclose(z, z_ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("method,causal", [("scan", True), ("chunked", True), ("aggregate", False)])
def test_one_column_per_thread(rng, monkeypatch, method, causal):
    """Register tile of 1 column (CUDA_COLS_PER_THREAD=1): no padded columns, 4 column groups."""
    monkeypatch.setattr(config, "CUDA_COLS_PER_THREAD", 1)
    _check_against_reference(rng, method, causal)


def _check_against_reference(rng, method, causal, N=7, F=5, M=4):
    """B = 2, N = 7, D_phi = 5, M = 4 (by default) float32 from an initial state, against the float64
    reference."""
    q, k, v = data(rng, 2, N, F, M)
    S0, z0 = rng.random((2, F, M)), rng.random((2, F))
    out, S, z = run_launcher(method, causal, q, k, v, S0, z0)
    ref, S_ref, z_ref = reference(q, k, v, causal=causal, S0=S0, z0=z0)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(S, S_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(z, z_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method,causal", [("scan", True), ("chunked", True), ("aggregate", False)])
def test_row_group_layout(rng, monkeypatch, method, causal):
    """The row-group layout (larger D_phi and the delta rules) for the additive rule too: with
    OWNER_MAX_ROWS = 0 every D_phi takes it (3 row groups of 2 rows, column blocks 3 + 1)."""
    from linattn_nb.ops.cuda import plan as KP

    monkeypatch.setattr(KP, "OWNER_MAX_ROWS", 0)
    assert KP.seq_config(5, 4, 4)[2] == 3
    _check_against_reference(rng, method, causal)


@pytest.mark.parametrize("method,causal", [("scan", True), ("chunked", True), ("aggregate", False)])
def test_tile_layout(rng, monkeypatch, method, causal):
    """The tile layout (CUDA_SEQ_LAYOUT="tiles", what a GPU with few sequences gets for the additive
    rule): D_phi = 5 padded to 8, tiles of 2 tokens (N = 7: a partial last tile, chunks 3 + 3 + 1),
    column blocks 3 + 1 (the normaliser at block column 3, one group of four), from a random state."""
    from linattn_nb.ops.cuda import plan as KP

    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", "tiles")
    assert KP.seq_config(5, 4, 4, layout="tiles") == (8, 4, 0, 3, 2)
    assert KP.threads_per_block(8, 4, 0, 3) == 2
    _check_against_reference(rng, method, causal)


@pytest.mark.parametrize("method,causal", [("scan", True), ("chunked", True), ("aggregate", False)])
def test_tile_layout_four_tokens(rng, monkeypatch, method, causal):
    """The tile layout at D_phi = 16: tiles of 4 tokens, where the products over the tile's tokens
    (the scores with [v | 1], the state update) take four tokens a step as at D_phi = 64; N = 9 (two
    tiles and a part one of 1 token), M = 5 (column blocks 3 + 2), from a random state."""
    from linattn_nb.ops.cuda import plan as KP

    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", "tiles")
    assert KP.seq_config(16, 5, 4, layout="tiles") == (16, 4, 0, 3, 4)
    _check_against_reference(rng, method, causal, N=9, F=16, M=5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("method,causal", [("scan", True), ("chunked", True), ("aggregate", False)])
def test_tile_layout_wide(rng, monkeypatch, method, causal, dtype, strided):
    """The tile layout at D_phi = 12 (tiles of 3 tokens, 3 row groups), N = 7 (tiles 3 + 3 + 1; chunks of 4:
    4 = 3 + 1 and 3), float32 and float64:
    contiguous inputs with M = 8 in one block (four elements per vector load of q, k and v; the
    normaliser at column 8 opens a third column group: 9 threads), or strided inputs (one element
    per load) with M = 7 (the normaliser at column 7: 2 column groups, 6 threads)."""
    from linattn_nb.ops.cuda import plan as KP, views as KV
    from linattn_nb.ops import _cuda_launch as CL

    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", "tiles")
    monkeypatch.setattr(config, "CUDA_VALUE_COLS", 8)
    monkeypatch.setattr(config, "CUDA_CHUNK_SIZE", 4)
    B, N, F, M = 2, 7, 12, 7 if strided else 8
    assert KP.seq_config(F, M, np.dtype(dtype).itemsize, layout="tiles") == (12, 4, 0, M, 3)
    assert KP.threads_per_block(12, 4, 0, M) == 3 * (2 if strided else 3)
    q, k, v = data(rng, B, N, F, M, dtype)
    if not strided:
        H = state_h(np.zeros((B, F, M)), np.zeros((B, F)))
        p = CL.plan(*(cuda.to_device(x) for x in (q, k, v)), H, nan_device((B, N, M), dtype))
        assert p.cfg[2] == 0 and p.vec == KP.VEC_QK | KP.VEC_V, (p.cfg, p.vec)
    S0, z0 = rng.random((B, F, M)), rng.random((B, F))
    if strided:  # q, k transposed in memory (feature stride N), v with a column stride of 2
        def dev(x):
            d = cuda.to_device(np.ascontiguousarray(x.transpose(0, 2, 1)))
            return KV.strided_view(d, x.shape, (d.strides[0], d.strides[2], d.strides[1]))
        vw = np.zeros((B, N, 2 * M), dtype)
        vw[..., ::2] = v
        vd = cuda.to_device(vw)
        vd = KV.strided_view(vd, (B, N, M), (vd.strides[0], vd.strides[1], 2 * vd.strides[2]))
        H = state_h(S0, z0)
        outd = nan_device((B, N, M), dtype)
        launcher(method, causal)(dev(q), dev(k), vd, H, outd, code=1, eps=1e-8)
        out, (S, z) = outd.copy_to_host(), split_h(H)
    else:
        out, S, z = run_launcher(method, causal, q, k, v, S0, z0)
    ref, S_ref, z_ref = reference(q, k, v, causal=causal, S0=S0, z0=z0)
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=rtol, atol=atol)
    rtol, atol = STATE_TOL[dtype]
    np.testing.assert_allclose(S, S_ref, rtol=rtol, atol=atol)
    np.testing.assert_allclose(z, z_ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("method", ["scan", "chunked"])
def test_refused_tile_launch_runs_in_row_groups(rng, monkeypatch, method):
    """A device that refuses the tile-layout kernel (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: a compiler
    that gives it more registers than its threads per block allow, as an H200 with CUDA 13 did for the
    decay rule at D_phi = M = 64) gets the row-group kernel instead: the right outputs and state, one
    RuntimeWarning, and later plans in row groups from the start."""
    from linattn_nb.ops import _cuda_launch as CL

    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", "tiles")
    monkeypatch.setattr(config, "CUDA_VALUE_COLS", 8)
    monkeypatch.setattr(CL, "_REFUSED_TILES", set())
    real = CL._launch
    refused = []

    def launch(p, code, segments, args):
        if p.cfg[2] == 0:
            refused.append(p.cfg)
            raise RuntimeError("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: too many resources requested for launch")
        real(p, code, segments, args)

    monkeypatch.setattr(CL, "_launch", launch)
    B, N, F, M = 2, 7, 12, 8
    q, k, v = data(rng, B, N, F, M, np.float64)
    S0, z0 = rng.random((B, F, M)), rng.random((B, F))
    with pytest.warns(RuntimeWarning, match="tile-layout kernel"):
        out, S, z = run_launcher(method, True, q, k, v, S0, z0)
    assert refused, "the tile layout was not tried"
    ref, S_ref, z_ref = reference(q, k, v, causal=True, S0=S0, z0=z0)
    rtol, atol = TOL[np.float64]
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol)
    np.testing.assert_allclose(S, S_ref, rtol=rtol, atol=atol)
    np.testing.assert_allclose(z, z_ref, rtol=rtol, atol=atol)
    H = state_h(np.zeros((B, F, M)), np.zeros((B, F)))
    p = CL.plan(*(cuda.to_device(x) for x in (q, k, v)), H, nan_device((B, N, M), np.float64))
    assert p.cfg[2] != 0, p.cfg  # remembered: row groups from the start


def test_other_launch_errors_are_raised(rng, monkeypatch):
    """Only a refused tile-layout kernel is relaunched: any other launch error reaches the caller."""
    from linattn_nb.ops import _cuda_launch as CL

    monkeypatch.setattr(CL, "_REFUSED_TILES", set())

    def launch(p, code, segments, args):
        raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")

    monkeypatch.setattr(CL, "_launch", launch)
    q, k, v = data(rng, 1, 3, 4, 3, np.float64)
    with pytest.raises(RuntimeError, match="ILLEGAL_ADDRESS"):
        run_launcher("scan", True, q, k, v, np.zeros((1, 4, 3)), np.zeros((1, 4)))


@pytest.mark.parametrize("F,M,dtype", [(3, 7, np.float32), (12, 3, np.float32), (9, 2, np.float64)],
                         ids=["threads-without-z-rows", "four-z-rows-each", "float64-five-z-rows-each"])
@pytest.mark.parametrize("method,causal", [("scan", True), ("aggregate", False)])
def test_owner_layout_normaliser(rng, monkeypatch, method, causal, F, M, dtype):
    """The owner layout's normaliser: thread u keeps rows u, u + MB, ... of z and writes them per
    token, and each token's phi(q_t)^T z_t is one thread's dot product after the tile (the causal
    token loop, and the query-only pass of the non-causal form).  M = 7 threads with D_phi = 3 padded
    to 4 (three threads own no row of z); D_phi = 12 on 3 threads (4 rows each, the last row live);
    float64 D_phi = 9 padded to 10 on 2 threads (5 rows each).  N = 7 in tiles of 2, from a random
    state, against the float64 reference."""
    from linattn_nb.ops.cuda import plan as KP

    monkeypatch.setattr(config, "CUDA_VALUE_COLS", 8)
    item = np.dtype(dtype).itemsize
    R, C, G, MB, T = KP.seq_config(F, M, item)
    assert (G, C, MB, T) == (1, 1, M, 2) and R == KP._pad_rows(F, item), (R, C, G, MB, T)
    q, k, v = data(rng, 2, 7, F, M, dtype)
    S0, z0 = rng.random((2, F, M)), rng.random((2, F))
    out, S, z = run_launcher(method, causal, q, k, v, S0, z0)
    ref, S_ref, z_ref = reference(q, k, v, causal=causal, S0=S0, z0=z0)
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol)
    rtol, atol = STATE_TOL[dtype]
    np.testing.assert_allclose(S, S_ref, rtol=rtol, atol=atol)
    np.testing.assert_allclose(z, z_ref, rtol=rtol, atol=atol)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the simulator computes inf - inf
@pytest.mark.parametrize("layout", ["owner", "rows", "tiles"])
@pytest.mark.parametrize("method,causal", [("scan", True), ("chunked", True), ("aggregate", False)])
def test_launcher_counts_nonfinite_in_the_kernel(rng, monkeypatch, method, causal, layout):
    """check_finite=True: the sequence kernels count non-finite q, k, v while staging them (one
    flag array, read once); every value counted once (2 column blocks, 3 chunks; the tile layout
    too, with tiles of one token at D_phi = 3); the error names the first argument holding one;
    check_finite=False raises nothing."""
    from linattn_nb.ops.cuda import plan as KP

    if layout == "rows":
        monkeypatch.setattr(KP, "OWNER_MAX_ROWS", 0)
    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", "tiles" if layout == "tiles" else "auto")
    q, k, v = data(rng, 1, 7, 3, 4)
    q[0, 1, 2] = np.nan
    k[0, 4, 0] = np.inf
    k[0, 6, 1] = -np.inf
    v[0, 5, 3] = np.nan
    run = launcher(method, causal)
    for arrays, msg in (((q, k, v), "q contains 1 non-finite"), ((np.ones_like(q), k, v), "k contains 2 non-finite"),
                        ((np.ones_like(q), np.ones_like(k), v), "v contains 1 non-finite")):
        H = state_h(np.zeros((1, 3, 4)), np.zeros((1, 3)))
        out = nan_device((1, 7, 4), np.float32)
        dq, dk, dv = (cuda.to_device(np.ascontiguousarray(x)) for x in arrays)
        with pytest.raises(ValueError, match=msg):
            run(dq, dk, dv, H, out, code=1, eps=1e-8, check_finite=True)
        if arrays[0] is q:  # once, on the inputs holding every non-finite value (the later ones hold a subset;
            # between the counted launches, as before, so the next count also starts from cleared counters)
            with np.errstate(invalid="ignore"):
                run(dq, dk, dv, H, out, code=1, eps=1e-8, check_finite=False)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("method,causal", [("scan", True), ("chunked", True), ("aggregate", False)])
@pytest.mark.parametrize("layout", ["auto", "tiles"])
def test_edge_lengths(rng, monkeypatch, method, causal, n, layout):
    """N = 0, 1, tile size, chunk - 1, chunk, chunk + 1 (tile 2, chunk 3); D != M; one batch
    entry and one value-column block below the block width (M=2 < 3); the owner layout (the
    simulator's "auto") and the tile layout (D_phi = 3 padded to 4: tiles of one token)."""
    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", layout)
    q, k, v = data(rng, 1, n, 3, 2)
    S0 = rng.random((1, 3, 2))
    z0 = rng.random((1, 3))
    out, S, z = run_launcher(method, causal, q, k, v, S0, z0)
    ref, S_ref, z_ref = reference(q, k, v, causal=causal, S0=S0, z0=z0)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(S, S_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(z, z_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("code", [0, 1, 2, 3])
def test_inline_feature_maps(rng, code):
    """Every inline map code; identity (code 0) with signed features and eps=None (raw division)."""
    q, k, v = data(rng, 2, 5, 4, 3, np.float64)
    eps = None if code == 0 else 1e-8
    if code == 0:  # keep the signed normaliser away from zero
        q, k = q + 3.0, k + 3.0
    zeros = np.zeros((2, 4, 3)), np.zeros((2, 4))
    out, _, _ = run_launcher("scan", True, q, k, v, *zeros, code=code, eps=eps)
    ref, _, _ = reference(q, k, v, causal=True, code=code, eps=eps)
    np.testing.assert_allclose(out, ref, rtol=1e-11, atol=1e-12)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the simulator divides 0/0
def test_eps_floor_and_raw_division():
    """ReLU features of negative inputs give a zero normaliser: eps floors it (output 0),
    eps=None divides raw (0/0 = NaN), as on the CPU path."""
    q = -np.ones((1, 3, 2))
    k = np.ones((1, 3, 2))
    v = np.ones((1, 3, 2))
    zeros = np.zeros((1, 2, 2)), np.zeros((1, 2))
    out, _, _ = run_launcher("scan", True, q, k, v, *zeros, code=2, eps=1e-8)
    np.testing.assert_array_equal(out, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        out, _, _ = run_launcher("scan", True, q, k, v, *zeros, code=2, eps=None)
    assert np.isnan(out).all()


def test_chunked_matches_scan_across_chunk_sizes(rng):
    """Chunkwise form = recurrence for every chunk size (Yang et al. 2024, GLA Sec. 2.2:
    chunk size N is the quadratic form, 1 the recurrence)."""
    from linattn_nb.ops.causal.cuda import causal_chunked_cuda

    q, k, v = data(rng, 1, 6, 3, 2, np.float64)
    ref, S_ref, _ = reference(q, k, v, causal=True)
    for L in (1, 2, 4, 6):
        H = cuda.to_device(np.zeros((1, 3, 3)))
        out = nan_device((1, 6, 2), np.float64)
        causal_chunked_cuda(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), H, out,
                            code=1, eps=1e-8, chunk_size=L)
        np.testing.assert_allclose(out.copy_to_host(), ref, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(split_h(H)[0], S_ref, rtol=1e-12, atol=1e-13)


def test_state_pack_unpack_and_launcher_errors(rng):
    """pack_state/unpack_state convert (S, z) <-> H (any float dtype and strides in); the
    launchers name a wrong H and refuse extra inputs for the additive rule."""
    from linattn_nb.ops.cuda.views import strided_view
    from linattn_nb.ops._cuda_launch import pack_state, unpack_state
    from linattn_nb.ops.causal.cuda import causal_scan_cuda

    S0 = rng.random((2, 3, 4))
    z0 = rng.random((2, 3))
    H = pack_state(cuda.to_device(S0.astype(np.float32)), cuda.to_device(z0))
    assert H.dtype == np.float64 and tuple(H.shape) == (2, 3, 5) and H.is_c_contiguous()
    S, z = split_h(H)
    np.testing.assert_allclose(S, S0, rtol=1e-7)
    np.testing.assert_array_equal(z, z0)
    S, z = unpack_state(H)
    assert S.is_c_contiguous() and z.is_c_contiguous() and S.dtype == z.dtype == np.float64
    np.testing.assert_array_equal(S.copy_to_host(), split_h(H)[0])
    dS, dz = cuda.to_device(np.zeros((2, 3, 4))), cuda.to_device(np.zeros((2, 3)))
    S2, z2 = unpack_state(H, dS, dz)
    assert S2 is dS and z2 is dz
    np.testing.assert_array_equal(dz.copy_to_host(), z0)
    with pytest.raises(ValueError, match="does not split"):
        unpack_state(H, dS, cuda.to_device(np.zeros((2, 4))))
    with pytest.raises(ValueError, match=r"S must be \(B, F, M\)"):
        pack_state(dS, cuda.to_device(np.zeros((2, 4))))

    q, k, v = (cuda.to_device(x) for x in data(rng, 2, 3, 3, 4))
    out = nan_device((2, 3, 4), np.float32)
    with pytest.raises(ValueError, match=r"H must have shape \(B, F, M \+ 1\)"):
        causal_scan_cuda(q, k, v, cuda.to_device(np.zeros((2, 3, 4))), out, code=1, eps=1e-8)
    with pytest.raises(TypeError, match="H must be float64"):
        causal_scan_cuda(q, k, v, cuda.to_device(np.zeros((2, 3, 5), np.float32)), out, code=1, eps=1e-8)
    with pytest.raises(ValueError, match="H must be C-contiguous"):
        wide = cuda.to_device(np.zeros((2, 3, 10)))
        causal_scan_cuda(q, k, v, strided_view(wide, (2, 3, 5), (240, 80, 8)), out, code=1, eps=1e-8)
    with pytest.raises(ValueError, match="inputs: the additive rule takes no extra inputs"):
        causal_scan_cuda(q, k, v, H, out, code=1, eps=1e-8, inputs={"decay": q})
    causal_scan_cuda(q, k, v, H, out, code=1, eps=1e-8, inputs={})  # empty inputs are fine
    assert np.isfinite(out.copy_to_host()).all()


# ---------------------------------------------------------------------------
# The public function on the CUDA path
# ---------------------------------------------------------------------------
def test_host_inputs_copy_over_and_back(rng):
    """device='cuda' with NumPy inputs: NumPy out, mixed dtypes promoted, batch dims kept,
    state and position as on the CPU path; a map without an inline form (DPFP) is applied
    on the host."""
    q = rng.normal(size=(2, 1, 5, 3)).astype(np.float16)
    k = rng.normal(size=(2, 1, 5, 3)).astype(np.float32)
    v = rng.normal(size=(2, 1, 5, 4)).astype(np.float32)
    o, st = la.linear_attention(q, k, v, causal=True, device="cuda", return_state=True)
    r, rs = la.linear_attention(q, k, v, causal=True, device="cpu", method="quadratic", return_state=True)
    assert isinstance(o, np.ndarray) and o.dtype == np.float32 and o.shape == (2, 1, 5, 4)
    np.testing.assert_allclose(o, r, rtol=2e-5, atol=2e-6)
    assert isinstance(st.S, np.ndarray) and st.S.shape == (2, 1, 3, 4) and st.position == 5
    np.testing.assert_allclose(st.S, rs.S, rtol=1e-5, atol=1e-6)
    out = np.full((2, 1, 5, 4), np.nan, np.float32)
    got = la.linear_attention(q, k, v, feature_map="dpfp", device="cuda", method="aggregate", out=out)
    assert got is out
    np.testing.assert_allclose(out, la.linear_attention(q, k, v, feature_map="dpfp", method="quadratic"),
                               rtol=2e-5, atol=2e-6)


def test_device_inputs_zero_copy_and_out(rng):
    """Device inputs give a device result of the batch shape; out= is written and returned."""
    q, k, v = data(rng, 3, 5, 4, 3)
    dq, dk, dv = (cuda.to_device(x.reshape(3, 1, *x.shape[1:])) for x in (q, k, v))
    o = la.linear_attention(dq, dk, dv, causal=True, device="cuda")
    assert not isinstance(o, np.ndarray) and tuple(o.shape) == (3, 1, 5, 3)
    ref, _, _ = reference(q, k, v, causal=True)
    np.testing.assert_allclose(o.copy_to_host().reshape(3, 5, 3), ref, rtol=2e-5, atol=2e-6)
    out = nan_device((3, 1, 5, 3), np.float32)
    got = la.linear_attention(dq, dk, dv, causal=False, device="cuda", out=out)
    assert got is out
    ref, _, _ = reference(q, k, v, causal=False)
    np.testing.assert_allclose(out.copy_to_host().reshape(3, 5, 3), ref, rtol=2e-5, atol=2e-6)


def test_strided_device_inputs(rng):
    """(B, N, H, D) memory read as (B, H, N, D) without a copy; a 5-d layout whose batch dims
    cannot be merged (copied on the device); a strided out."""
    from linattn_nb.ops.cuda.views import strided_view

    B, N, H, D, M = 2, 4, 2, 3, 2

    def bhnd(x):  # device view (B, H, N, F) of (B, N, H, F) memory
        d = cuda.to_device(x.transpose(0, 2, 1, 3).copy())
        s = d.strides
        return strided_view(d, (B, H, N, x.shape[-1]), (s[0], s[2], s[1], s[3]))

    q, k = (rng.normal(size=(B, H, N, D)) for _ in range(2))
    v = rng.normal(size=(B, H, N, M))
    o = la.linear_attention(bhnd(q), bhnd(k), bhnd(v), causal=True, device="cuda")
    ref, _, _ = reference(q.reshape(-1, N, D), k.reshape(-1, N, D), v.reshape(-1, N, M), causal=True)
    np.testing.assert_allclose(o.copy_to_host().reshape(-1, N, M), ref, rtol=1e-11, atol=1e-12)

    # 5-d (A, B, H, N, F) stored as (B, A, H, N, F): A and B cannot be merged
    def swapped(x):
        d = cuda.to_device(np.ascontiguousarray(x.swapaxes(0, 1)))
        s = d.strides
        return strided_view(d, x.shape, (s[1], s[0]) + tuple(s[2:]))

    q5, k5 = (rng.normal(size=(2, 2, 1, N, D)) for _ in range(2))
    v5 = rng.normal(size=(2, 2, 1, N, M))
    outd = cuda.to_device(np.full((2, 2, 1, N, M), np.nan).swapaxes(0, 1).copy())
    s = outd.strides
    out5 = strided_view(outd, (2, 2, 1, N, M), (s[1], s[0]) + tuple(s[2:]))
    got = la.linear_attention(swapped(q5), swapped(k5), swapped(v5), causal=False, device="cuda", out=out5)
    assert got is out5
    ref, _, _ = reference(q5.reshape(-1, N, D), k5.reshape(-1, N, D), v5.reshape(-1, N, M), causal=False)
    res = outd.copy_to_host().swapaxes(0, 1).reshape(-1, N, M)
    np.testing.assert_allclose(res, ref, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("method", ["scan", "chunked"])
def test_state_carries_across_segments(rng, method):
    """Two segments chained through the device state equal one pass (what segment-wise
    processing builds on); the state stays on the device."""
    q, k, v = data(rng, 2, 7, 3, 2, np.float64)
    dev = [cuda.to_device(x) for x in (q, k, v)]
    full, st_full = la.linear_attention(*dev, causal=True, method=method, device="cuda", return_state=True)
    a, st = la.linear_attention(*(x[:, :4] for x in dev), causal=True, method=method, device="cuda",
                                return_state=True)
    assert not isinstance(st.S, np.ndarray) and st.S.dtype == np.float64 and st.position == 4
    b, st2 = la.linear_attention(*(x[:, 4:] for x in dev), causal=True, method=method, device="cuda",
                                 initial_state=st, return_state=True)
    assert st2.position == 7
    np.testing.assert_allclose(np.concatenate([a.copy_to_host(), b.copy_to_host()], axis=1),
                               full.copy_to_host(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(st2.S.copy_to_host(), st_full.S.copy_to_host(), rtol=1e-12)
    # a host float32 state works too, and the caller's state is never modified
    S0 = np.asarray(st.S.copy_to_host(), np.float32)
    z0 = np.asarray(st.z.copy_to_host(), np.float32)
    keep = S0.copy()
    b2 = la.linear_attention(*(x[:, 4:] for x in dev), causal=True, method=method, device="cuda",
                             initial_state=(S0, z0, 4))
    np.testing.assert_array_equal(S0, keep)
    np.testing.assert_allclose(b2.copy_to_host(), b.copy_to_host(), rtol=1e-6)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the simulator computes inf - inf
def test_check_finite_on_device(rng):
    """check_finite counts non-finite device values; with check_finite=False NaN in token t
    reaches the causal outputs from t on only."""
    q, k, v = data(rng, 1, 5, 3, 2)
    v[0, 2, 1] = np.nan
    k[0, 3, 0] = np.inf
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    with pytest.raises(ValueError, match=r"v contains 1 non-finite"):
        la.linear_attention(dq, cuda.to_device(data(rng, 1, 5, 3, 2)[1]), dv, device="cuda")
    with pytest.raises(ValueError, match=r"k contains 1 non-finite"):
        la.linear_attention(dq, dk, dv, device="cuda")
    with np.errstate(invalid="ignore"):
        o = la.linear_attention(dq, cuda.to_device(data(rng, 1, 5, 3, 2)[1]), dv, causal=True,
                                device="cuda", check_finite=False).copy_to_host()
    assert np.isfinite(o[0, :2]).all() and np.isnan(o[0, 2:]).any()


def test_errors(rng, monkeypatch):
    q, k, v = data(rng, 1, 4, 3, 2)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    with pytest.raises(ValueError, match="different devices"):
        la.linear_attention(dq, k, dv, device="cuda")
    with pytest.raises(ValueError, match="no inline CUDA form"):
        la.linear_attention(dq, dk, dv, feature_map="dpfp", device="cuda")
    with pytest.raises(ValueError, match="not available for causal=True on device 'cuda'"):
        la.linear_attention(dq, dk, dv, causal=True, method="quadratic", device="cuda")
    with pytest.raises(ValueError, match="out must have shape"):
        la.linear_attention(dq, dk, dv, device="cuda", out=nan_device((1, 4, 3), np.float32))
    with pytest.raises(TypeError, match="out must have dtype"):
        la.linear_attention(dq, dk, dv, device="cuda", out=nan_device((1, 4, 2), np.float64))
    with pytest.raises(ValueError, match="initial_state must have S of shape"):
        la.linear_attention(dq, dk, dv, causal=True, device="cuda",
                            initial_state=(cuda.to_device(np.zeros((1, 2, 2))), cuda.to_device(np.zeros((1, 3)))))
    monkeypatch.setattr(config, "CUDA_MAX_FEATURES", 2)
    with pytest.raises(ValueError, match="CUDA_MAX_FEATURES"):
        la.linear_attention(dq, dk, dv, device="cuda")
    with pytest.raises(ValueError, match="CUDA_MAX_FEATURES"):
        la.linear_attention(q, k, v, device="cuda")


def test_no_gpu_is_a_clear_error(rng, monkeypatch):
    import linattn_nb.device as device

    monkeypatch.setattr(device, "cuda_status", lambda: "none")
    x = rng.normal(size=(3, 2))
    with pytest.raises(RuntimeError, match="need a usable CUDA GPU"):
        la.linear_attention(x, x, x, device="cuda")
    assert device.resolve_device("auto", x, x, x) == "cpu"


@pytest.mark.skipif(ON_GPU, reason="simulator semantics")
def test_simulator_never_counts_as_gpu_for_auto(rng):
    """Simulator device arrays run on the CPU path with device='auto' (NumPy result)."""
    q, k, v = data(rng, 1, 4, 3, 2)
    o = la.linear_attention(*(cuda.to_device(x) for x in (q, k, v)), causal=True)
    assert isinstance(o, np.ndarray)
    np.testing.assert_allclose(o, reference(q, k, v, causal=True)[0], rtol=2e-5, atol=2e-6)


def test_auto_method_selection(monkeypatch):
    from linattn_nb import _cuda_dispatch as D

    monkeypatch.setattr(config, "CUDA_VALUE_COLS", 64)
    monkeypatch.setattr(config, "CUDA_ROWS_PER_THREAD", 16)
    monkeypatch.setattr(config, "CUDA_MAX_ROWS_PER_THREAD", 64)
    monkeypatch.setattr(config, "CUDA_DELTA_ROWS_PER_THREAD", 16)  # the defaults: 4 row groups x 33 column pairs, 5 warps
    monkeypatch.setattr(config, "CUDA_DELTA_COLS_PER_THREAD", 2)
    monkeypatch.setattr(D, "multiprocessor_count", lambda: 132)
    kw = dict(causal=True, f=64, m=64, dtype=np.float32, rule="additive")
    assert D.select_auto_cuda(batch=128, n=4096, **kw) == "scan"  # tiles: 128 x 9 warps >= 4 * 132
    # ... but from CUDA_AUTO_TILES_CHUNKED_MIN_N tokens on, chunked (faster there on an H200)
    assert D.select_auto_cuda(batch=128, n=8191, **kw) == "scan"
    assert D.select_auto_cuda(batch=128, n=8192, **kw) == "chunked"
    assert D.select_auto_cuda(batch=128, n=65536, **kw) == "chunked"
    assert D.select_auto_cuda(batch=58, n=65536, **kw) == "chunked"  # 58 x 9 warps < 4 * 132
    assert D.select_auto_cuda(batch=128, n=4096, **dict(kw, rule="gate")) == "scan"  # tiles too: 128 x 9
    assert D.select_auto_cuda(batch=128, n=65536, **dict(kw, rule="gate")) == "chunked"
    monkeypatch.setattr(config, "CUDA_AUTO_TILES_CHUNKED_MIN_N", 10**9)
    assert D.select_auto_cuda(batch=128, n=65536, **kw) == "scan"
    monkeypatch.setattr(config, "CUDA_AUTO_TILES_CHUNKED_MIN_N", 8192)
    assert D.select_auto_cuda(batch=100, n=65536, **dict(kw, rule="delta")) == "scan"  # tiles: 100 x 9
    assert D.select_auto_cuda(batch=58, n=65536, **dict(kw, rule="delta")) == "chunked"  # 58 x 9 < 4 x 132
    assert D.select_auto_cuda(batch=1024, n=65536, **kw) == "scan"
    assert D.select_auto_cuda(batch=8, n=100, **kw) == "scan"  # short: AUTO_METHODS row
    assert D.select_auto_cuda(batch=8, n=100, **dict(kw, causal=False)) == "aggregate"


def test_traffic_model_headline(monkeypatch):
    """traffic_model at the headline shape (B*H = 128, N = 16384, D = M = 64, float32), default
    launch configuration: the scan reads q, k, v and writes the output once (<= 2.5 GB, FLOPs
    within 1.5 x 4 B N D M); the three-pass chunked plan reads k and v twice."""
    import pathlib
    import sys

    tools = str(pathlib.Path(__file__).resolve().parents[2] / "tools")  # the model lives outside the package
    if tools not in sys.path:
        sys.path.insert(0, tools)
    from cuda_traffic import traffic_model

    for name, value in DEFAULT_LAUNCH.items():
        monkeypatch.setattr(config, name, value)
    shape = (128, 16384, 64, 64)
    io = 4 * 128 * 16384 * 64 * 4
    scan = traffic_model(shape, method="scan")
    assert scan["config"][2] == 1 and scan["launches"] == 3  # owner layout; cast-copies around it
    assert io <= scan["bytes"] <= 2.5e9
    assert 1.0 <= scan["flops_ratio"] <= 1.5
    chunked = traffic_model(shape, method="chunked")
    assert chunked["parts"]["k"] == 2 * scan["parts"]["k"] and chunked["bytes"] > scan["bytes"]
    assert chunked["flops"] > scan["flops"]
    delta = traffic_model(shape, method="chunked", rule=3)  # the delta rules run the scan
    assert delta["method"] == "scan"
    # on an H200 (132 SMs) the headline's 128 sequences take the tile layout: one pass still, 9 warps
    # a sequence, and its FLOPs: per token 2 x 64 x 68 products twice, 8.5 scores of 64 and 16 x 68
    h200 = traffic_model(shape, method="scan", sms=132)
    assert h200["layout"] == "tiles" and h200["warps"] == 128 * 9
    assert io <= h200["bytes"] <= 2.5e9 and 1.0 <= h200["flops_ratio"] <= 1.5
    per_token = 2 * (2 * 64 * 68 + 8.5 * 64 + 16 * 68) + 64
    assert h200["flops"] == 128 * 16384 * per_token
    # the gate rule's (B, N, D_phi) log-gates: as the kernels read them (float64, or float32 read in
    # place), once per column block; the front end's range check reads them once more
    g64 = traffic_model(shape, method="scan", sms=132, rule=2)
    g32 = traffic_model(shape, method="scan", sms=132, rule=2, factor_dtype="float32", range_check=True)
    assert g64["parts"]["factors"] == 128 * 16384 * 64 * 8 and g64["parts"]["checks"] == 0
    assert g32["parts"]["factors"] == g32["parts"]["checks"] == 128 * 16384 * 64 * 4
    assert g32["bytes"] == g64["bytes"] and g32["flops"] == g64["flops"]
    with pytest.raises(ValueError, match="factor_dtype must be float32 or float64"):
        traffic_model(shape, rule=2, factor_dtype="float16")
    # row groups there (CUDA_SEQ_LAYOUT="rows"): 5 warps a sequence
    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", "rows")
    rows = traffic_model(shape, method="scan", sms=132)
    assert rows["layout"] == "rows" and rows["warps"] == 128 * 5 and rows["bytes"] == h200["bytes"]


def test_sequence_layout_choice(monkeypatch):
    """seq_layout: the owner layout while its blocks give CUDA_AUTO_SCAN_BLOCKS_PER_SM per SM, the
    tile layout below (every rule where it fits; 9 warps per sequence at D_phi = M = 64) or row
    groups, the owner layout on a one-SM device (the simulator) and where it does not apply (the delta
    rules, which have none: the tile layout wherever it fits, however many sequences, else row groups);
    config.CUDA_SEQ_LAYOUT overrides; method="auto" then picks the scan at the headline on an H200
    (one pass) and the chunked method with too few sequences."""
    from linattn_nb import _cuda_dispatch as D
    from linattn_nb.ops.cuda import plan as KP
    from linattn_nb.ops._codes import RULE_DECAY, RULE_DELTA, RULE_GATE, RULE_GATED_DELTA
    from linattn_nb.ops._cuda_launch import seq_layout

    for name, value in DEFAULT_LAUNCH.items():
        monkeypatch.setattr(config, name, value)
    assert seq_layout(128, 64, 64, 4, sms=132) == "tiles"  # 128 blocks of 2 warps < 4 x 132
    assert seq_layout(528, 64, 64, 4, sms=132) == "owner"
    assert seq_layout(527, 64, 64, 4, RULE_GATE, sms=132) == "tiles"  # the gate rule too (TILES_RULES)
    assert seq_layout(128, 64, 64, 4, RULE_DECAY, sms=132) == "tiles"  # the decay rule too (TILES_RULES)
    assert seq_layout(128, 64, 64, 4, sms=1) == "owner"  # one multiprocessor: the simulator
    assert seq_layout(1, 64, 128, 4, sms=132) == "tiles"  # two column blocks, still too few
    assert seq_layout(1, 64, 128, 4, RULE_GATE, sms=132) == "tiles"
    assert seq_layout(1, 64, 64, 8, RULE_GATE, sms=132) == "rows"
    assert seq_layout(1, 64, 64, 4, RULE_DELTA, sms=132) == "tiles"  # the delta rules too (TILES_RULES)
    assert seq_layout(527, 64, 64, 4, RULE_GATED_DELTA, sms=132) == "tiles"
    assert seq_layout(528, 64, 64, 4, RULE_GATED_DELTA, sms=132) == "tiles"  # however many sequences
    assert seq_layout(1, 64, 64, 4, RULE_DELTA, sms=1) == "rows"  # the simulator
    assert seq_layout(1, 64, 64, 8, RULE_DELTA, sms=132) == "rows"  # float64 at D_phi = 64: no tiles
    assert seq_layout(1, 32, 64, 8, RULE_GATED_DELTA, sms=132) == "tiles"
    assert seq_layout(1, 64, 64, 8, sms=132) == "rows"  # float64 at D_phi = 64: no tiles (shared memory)
    assert seq_layout(1, 32, 64, 8, sms=132) == "tiles"
    assert seq_layout(10**6, 64, 64, 4, RULE_DELTA, sms=132) == "tiles"  # no per-token k^T H sum across threads
    assert seq_layout(10**6, 128, 64, 4, RULE_DELTA, sms=132) == "rows"  # D_phi > 64: row groups anyway
    assert seq_layout(1024, 256, 64, 4, sms=132) == "rows"  # D_phi > 64: row groups anyway
    assert KP.seq_config(64, 64, 4, 0, seq_layout(128, 64, 64, 4, sms=132)) == (64, 4, 0, 64, 16)
    assert KP.seq_config(64, 64, 4, 0, "rows") == (8, 4, 8, 64, 13)
    assert KP.seq_config(64, 64, 4, RULE_GATE, "tiles") == (64, 4, 0, 64, 16)  # 46,524 bytes: within 48 KiB
    assert KP.seq_config(64, 64, 4, RULE_GATED_DELTA, "tiles") == (64, 4, 0, 64, 16)  # 38,212 bytes
    assert KP.seq_config(64, 64, 4, RULE_DELTA, "tiles") == (64, 4, 0, 64, 16)
    assert KP.seq_config(64, 64, 4, RULE_DELTA, "rows") == KP.seq_config(64, 64, 4, RULE_DELTA) == (16, 2, 4, 64, 22)
    monkeypatch.setattr(config, "CUDA_TILES_SHARED_BYTES", 46523)  # one byte short: the owner layout's rule
    assert KP.seq_config(64, 64, 4, RULE_GATE, "tiles") == KP.seq_config(64, 64, 4, RULE_GATE, "owner")
    assert seq_layout(527, 64, 64, 4, RULE_GATE, sms=132) == "rows"
    assert KP.seq_config(64, 64, 4, 0, "tiles")[2] == 0  # the additive rule's 31,568 bytes still fit
    monkeypatch.setattr(config, "CUDA_TILES_SHARED_BYTES", 49152)
    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", "owner")
    assert seq_layout(1, 64, 64, 4, sms=132) == "owner"
    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", "rows")
    assert seq_layout(10**6, 64, 64, 4, sms=132) == "rows"
    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", "tiles")
    assert seq_layout(10**6, 64, 64, 4, sms=132) == "tiles"
    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", "wide")
    with pytest.raises(ValueError, match="CUDA_SEQ_LAYOUT"):
        seq_layout(1, 64, 64, 4, sms=132)
    with pytest.raises(ValueError, match="layout"):
        KP.seq_config(64, 64, 4, 0, "wide")
    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", "auto")
    kw = dict(rule="additive", causal=True, n=4096, f=64, m=64, dtype=np.float32, sms=132)
    assert D.select_auto_cuda(batch=128, **kw) == "scan"  # 128 x 9 warps >= 4 per SM
    assert D.select_auto_cuda(batch=58, **kw) == "chunked"  # 58 x 9 = 522 warps < 4 x 132
    assert D.select_auto_cuda(batch=59, **kw) == "scan"
    assert D.select_auto_cuda(batch=58, **dict(kw, rule="gate")) == "chunked"  # the gate in tiles too: 522 warps
    assert D.select_auto_cuda(batch=59, **dict(kw, rule="gate")) == "scan"
    assert D.select_auto_cuda(batch=58, **dict(kw, rule="delta")) == "chunked"  # the delta rules in tiles: 522
    assert D.select_auto_cuda(batch=59, **dict(kw, rule="gated_delta")) == "scan"  # (was row groups: from 106)
    assert D.select_auto_cuda(batch=600, **kw) == "scan"  # owner blocks fill the GPU
    assert D.select_auto_cuda(batch=128, **dict(kw, rule="gate")) == "scan"
    # long sequences: the owner layout keeps the scan; the delta rules (no AUTO_METHODS rows on CUDA,
    # their chunked kernel not timed on a GPU) keep it in tiles too
    assert D.select_auto_cuda(batch=600, **dict(kw, n=65536)) == "scan"
    assert D.select_auto_cuda(batch=128, **dict(kw, n=65536, rule="delta")) == "scan"


@pytest.mark.parametrize("code", [0, 1, 2, 3, 4, 5])
def test_map_specialised_kernel_equals_the_generic_one(monkeypatch, code):
    """config.CUDA_SPECIALIZE_MAPS: the launch takes the kernel compiled for its feature map (a
    compile-time constant), whose outputs and state equal those of the kernel for every map, bit
    for bit, for each map code; 0 launches the kernel for every map."""
    from linattn_nb.ops.cuda import seq as KS
    from linattn_nb.ops.causal.cuda import causal_scan_cuda

    rng = np.random.default_rng(40 + code)
    q, k, v = data(rng, 2, 5, 4, 3)
    if code == 0:  # the inputs are the features
        q, k = np.abs(q) + 0.1, np.abs(k) + 0.1
    res = {}
    for spec in (1, 0):
        monkeypatch.setattr(config, "CUDA_SPECIALIZE_MAPS", spec)
        KS._SEQ_KERNELS.clear()
        H = cuda.to_device(np.zeros((2, 4, 4)))
        out = cuda.to_device(np.zeros((2, 5, 3), np.float32))
        causal_scan_cuda(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), H, out, code=code, eps=1e-8)
        made = {key[7] for key in KS._SEQ_KERNELS}  # the plan makes the kernel for every map (None) too
        assert (code in made) if spec else made == {None}, made
        res[spec] = (out.copy_to_host(), H.copy_to_host())
    np.testing.assert_array_equal(res[1][0], res[0][0])
    np.testing.assert_array_equal(res[1][1], res[0][1])
    assert np.isfinite(res[1][0]).all()


def test_row_layout_plan_on_the_simulator(monkeypatch):
    """A plan made under CUDA_SEQ_LAYOUT="rows" launches the row-group kernel at D_phi <= 64 (the
    layout the GPU gets with few sequences), and its outputs and state equal the owner layout's."""
    from linattn_nb.ops import _cuda_launch as CL
    from linattn_nb.ops.causal.cuda import causal_scan_cuda

    rng = np.random.default_rng(31)
    q, k, v = data(rng, 2, 7, 4, 5)
    res = {}
    for layout in ("owner", "rows"):
        monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", layout)
        H = cuda.to_device(np.zeros((2, 4, 6)))
        out = cuda.to_device(np.zeros((2, 7, 5), np.float32))
        p = CL.plan(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), H, out)
        assert (p.cfg[2] == 1) == (layout == "owner"), p.cfg
        causal_scan_cuda(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), H, out, code=1, eps=1e-8)
        res[layout] = (out.copy_to_host(), H.copy_to_host())
    np.testing.assert_allclose(res["rows"][0], res["owner"][0], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(res["rows"][1], res["owner"][1], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(res["owner"][0], reference(q, k, v, causal=True)[0], rtol=2e-5, atol=2e-6)


def test_registered_cuda_methods():
    from linattn_nb.ops.registry import available_methods

    assert available_methods(causal=True, device="cuda") == ["chunked", "scan"]
    assert available_methods(causal=False, device="cuda") == ["aggregate", "chunked", "scan"]


# ---------------------------------------------------------------------------
# Type-checking: compile every kernel to PTX for sm_90
# ---------------------------------------------------------------------------
_PTX_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from numba import cuda, types
    from linattn_nb.ops.cuda import helpers as KH, seq as KS
    res = {}
    cc = (9, 0)
    def ptx(fn, sig):
        text, _ = cuda.compile_ptx(fn.py_func, sig, cc=cc)
        return text
    for acc, dts in (("float32", ("float16", "float32")), ("float64", ("float64",))):
        for dt in dts:
            # 32-bit offsets and vector loads (float16, float64), 64-bit offsets and scalar loads (float32)
            kern = KS.seq_kernel(8, 4, 8, 64, 16, acc, off32=dt != "float32", vec=0 if dt == "float32" else 3)
            text = ptx(kern, KS.seq_signature(dt, acc))
            res[dt] = {"target": ".target sm_90" in text, "local": ("ld.local" in text) or ("st.local" in text),
                       "entry": ".entry" in text}
    f64 = types.float64
    S = types.Array(f64, 3, "C")
    z = types.Array(f64, 2, "C")
    H64 = types.Array(f64, 3, "C")
    b = types.boolean
    res["state_copy_kernel"] = {"entry": ".entry" in ptx(KH.state_copy_kernel, (S, z, H64, b))}
    for acc in ("float32", "float64"):
        H = types.Array(getattr(types, acc), 3, "C")
        sig = (H, H64, H, types.Array(f64, 2, "C"), types.int64, b, b, types.int64)
        res["chunk_scan_states_kernel/" + acc] = {"entry": ".entry" in ptx(KH.chunk_scan_states_kernel, sig)}
        for src, dst in ((H64, H), (H, H64)):
            key = "cast_copy_kernel/%s->%s" % (src.dtype, dst.dtype)
            res[key] = {"entry": ".entry" in ptx(KH.cast_copy_kernel, (src, dst))}
    for dt in ("float16", "float32", "float64"):
        a4 = types.Array(getattr(types, dt), 4, "A")
        res["copy4d/" + dt] = {"entry": ".entry" in ptx(KH.copy4d_kernel, (a4, types.Array(f64, 4, "C")))}
    print(json.dumps(res))
    """
)


def test_kernels_compile_to_ptx():
    """Every CUDA kernel type-checks and compiles for sm_90 (float16, float32, float64 inputs);
    the register-resident state of the sequence kernel does not spill to local memory."""
    res = run_ptx_script(_PTX_SCRIPT)
    for dt in ("float16", "float32", "float64"):
        assert res[dt] == {"target": True, "local": False, "entry": True}, (dt, res[dt])
    assert all(v["entry"] for v in res.values())
    # sequence kernel x 3 input dtypes; state pack; chunk scan x 2 accumulators; cast copies
    # float64 <-> float32 and float64 -> float64; 4-d copy x 3 dtypes
    assert len(res) == 3 + 1 + 2 + 3 + 3


# ---------------------------------------------------------------------------
# Real GPU only
# ---------------------------------------------------------------------------
@gpu_only
@pytest.mark.parametrize("causal,method", [(True, "scan"), (True, "chunked"), (False, "aggregate")])
def test_gpu_default_launch_config(causal, method, monkeypatch):
    """Default launch configuration (undo the tiny one) on a realistic shape (D=64, M=80: two
    column blocks) vs the float64 reference."""
    for name, value in DEFAULT_LAUNCH.items():
        monkeypatch.setattr(config, name, value)
    rng = np.random.default_rng(1)
    q, k = (rng.normal(size=(2, 3, 1000, 64)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(2, 3, 1000, 80)).astype(np.float32)
    o = la.linear_attention(*(cuda.to_device(x) for x in (q, k, v)), causal=causal, method=method)
    r = la.linear_attention(q, k, v, causal=causal, device="cpu", method="quadratic")  # NumPy, no compile
    np.testing.assert_allclose(o.copy_to_host(), r, rtol=1e-4, atol=1e-5)


@gpu_only
def test_gpu_torch_and_cupy_interop(rng):
    """PyTorch CUDA tensors and CuPy arrays run zero-copy with device='auto'; out= is the
    caller's tensor; (B, N, H, D) -> (B, H, N, D) transposes are read in place."""
    q, k, v = data(rng, 2, 9, 4, 3)
    ref, _, _ = reference(q, k, v, causal=True)
    ran = 0
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
        o = la.linear_attention(tq, tk, tv, causal=True)
        np.testing.assert_allclose(o.copy_to_host(), ref, rtol=1e-4, atol=1e-5)
        tout = torch.full((2, 9, 3), float("nan"), device="cuda")
        assert la.linear_attention(tq, tk, tv, causal=True, out=tout) is tout
        np.testing.assert_allclose(tout.cpu().numpy(), ref, rtol=1e-4, atol=1e-5)
        t4 = [torch.from_numpy(x.reshape(1, 2, 9, -1)).cuda().permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
              for x in (q, k, v)]
        o = la.linear_attention(*t4, causal=True)
        np.testing.assert_allclose(o.copy_to_host().reshape(2, 9, 3), ref, rtol=1e-4, atol=1e-5)
        with pytest.raises(TypeError, match="detach"):
            la.linear_attention(tq.clone().requires_grad_(True), tk, tv, device="cuda")
        ran += 1
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        o = la.linear_attention(*(cupy.asarray(x) for x in (q, k, v)), causal=True)
        np.testing.assert_allclose(o.copy_to_host(), ref, rtol=1e-4, atol=1e-5)
        ran += 1
    if not ran:
        pytest.skip("neither PyTorch with CUDA nor CuPy is installed")


@pytest.mark.parametrize("layout", ["owner", "rows"])
def test_32_and_64_bit_offsets_agree(monkeypatch, layout):
    """The kernel with 32-bit element offsets within a sequence (config.CUDA_OFFSETS_32, the
    default) and the 64-bit one give the same outputs and state bit for bit on strided inputs
    (a feature stride of 2, a transposed v, a strided out); a sequence spanning
    ``OFF32_LIMIT`` elements or more takes the 64-bit kernel."""
    from linattn_nb.ops.cuda import views as KV
    from linattn_nb.ops import _cuda_launch as CL
    from linattn_nb.ops.causal.cuda import causal_scan_cuda

    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", layout)
    rng = np.random.default_rng(33)
    B, N, D, M = 2, 7, 4, 5
    q, k, v = data(rng, B, N, D, M)
    qw = np.zeros((B, N, 2 * D), np.float32)
    qw[..., ::2] = q
    vt = np.ascontiguousarray(v.transpose(0, 2, 1))

    def run(launch=True):
        qd = cuda.to_device(qw)
        qd = KV.strided_view(qd, (B, N, D), (qd.strides[0], qd.strides[1], 2 * qd.strides[2]))
        vd = cuda.to_device(vt)
        vd = KV.strided_view(vd, (B, N, M), (vd.strides[0], vd.strides[2], vd.strides[1]))
        od = cuda.to_device(np.full((B, N, 2 * M), np.nan, np.float32))
        out = KV.strided_view(od, (B, N, M), (od.strides[0], od.strides[1], 2 * od.strides[2]))
        H = cuda.to_device(np.zeros((B, D, M + 1)))
        p = CL.plan(qd, cuda.to_device(k), vd, H, out)
        if launch:
            causal_scan_cuda(qd, cuda.to_device(k), vd, H, out, code=1, eps=1e-8)
        return p, od.copy_to_host()[..., ::2], H.copy_to_host()

    res = {}
    for off32 in (1, 0):
        monkeypatch.setattr(config, "CUDA_OFFSETS_32", off32)
        p, o, H = run()
        assert p.off32 == bool(off32) and p.strides[0] == (0, N * 2 * D, 2 * D, 2) and p.strides[2][2:] == (1, N)
        res[off32] = (o, H)
    np.testing.assert_array_equal(res[1][0], res[0][0])
    np.testing.assert_array_equal(res[1][1], res[0][1])
    np.testing.assert_allclose(res[1][0], reference(q, k, v, causal=True)[0], rtol=2e-5, atol=2e-6)
    # the guard: out's sequences span the most, 1 + 6 * 10 + 4 * 2 = 69 elements (q: 55, v: 35)
    monkeypatch.setattr(config, "CUDA_OFFSETS_32", 1)
    monkeypatch.setattr(CL, "OFF32_LIMIT", 69)  # the limit the launcher compares with
    p, o, H = run()
    assert not p.off32
    np.testing.assert_array_equal(o, res[1][0])
    monkeypatch.setattr(CL, "OFF32_LIMIT", 70)
    assert run(launch=False)[0].off32  # the plan the launcher makes (its launch is the one checked above)


def test_sequence_span_and_flat_view_errors():
    from linattn_nb.ops.cuda import views as KV
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    assert KV.sequence_span((2, 3, 5, 4), (0, 20, 4, 1)) == 20
    assert KV.sequence_span((2, 3, 5, 4), (0, 1, 12, 3)) == 1 + 4 * 12 + 3 * 3
    assert KV.sequence_span((2, 3, 0, 4), (0, 0, 4, 1)) == 0
    if not KV.is_sim_array(cuda.to_device(np.zeros(1))):
        pytest.skip("odd strides are built on the simulator's arrays")
    base = np.zeros(64, np.float32)
    odd = FakeCUDAArray(np.lib.stride_tricks.as_strided(base, (2, 3, 4), (40, 12, 2)))
    with pytest.raises(ValueError, match="multiples of the item size"):
        KV.flat_view(odd)
    view, es = KV.flat_view(FakeCUDAArray(base.reshape(2, 4, 8)[:, :1, ::2]))
    assert es == (32, 0, 2) and view.shape == (1 + 32 + 6,)


@pytest.mark.parametrize("layout", ["owner", "rows"])
def test_vector_loads_agree_with_scalar_loads(monkeypatch, layout):
    """config.CUDA_VECTOR_LOADS: q, k (four features) and v (four values) read by vector loads give
    the outputs, state and non-finite counts of one element per load, bit for bit: 8 values in
    blocks of 4 (two column blocks, the second starting at column 4), D_phi = 8 (D_phi = 6: q and k
    one at a time), padding rows and the normaliser column of the row-group layout."""
    from linattn_nb.ops.cuda import plan as KP
    from linattn_nb.ops import _cuda_launch as CL
    from linattn_nb.ops.causal.cuda import causal_scan_cuda

    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", layout)
    monkeypatch.setattr(config, "CUDA_VALUE_COLS", 4)
    monkeypatch.setattr(config, "CUDA_ROWS_PER_THREAD", 4)
    monkeypatch.setattr(config, "CUDA_MAX_ROWS_PER_THREAD", 4)
    rng = np.random.default_rng(35)
    for D, want in ((8, KP.VEC_QK | KP.VEC_V), (6, KP.VEC_V)):
        q, k, v = data(rng, 2, 5, D, 8)
        q[1, 3, 2] = np.nan  # one non-finite q: counted once either way
        res = {}
        for vec in (1, 0):
            monkeypatch.setattr(config, "CUDA_VECTOR_LOADS", vec)
            H = cuda.to_device(np.zeros((2, D, 9)))
            out = cuda.to_device(np.zeros((2, 5, 8), np.float32))
            args = [cuda.to_device(x) for x in (q, k, v)]
            p = CL.plan(*args, H, out, check_finite=True)
            assert p.vec == (want if vec else 0), (p.vec, p.cfg)
            with pytest.raises(ValueError, match="q"):
                causal_scan_cuda(*args, H, out, code=1, eps=1e-8, check_finite=True)
            res[vec] = (out.copy_to_host(), H.copy_to_host())
        np.testing.assert_array_equal(res[1][0], res[0][0])
        np.testing.assert_array_equal(res[1][1], res[0][1])
        ok = np.ones(2, bool)
        ok[1] = False  # the NaN sequence
        np.testing.assert_allclose(res[1][0][ok], reference(q[ok], k[ok], v[ok], causal=True)[0],
                                   rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("which", ["q", "v", "out"])
def test_reversed_device_arrays_are_refused_by_name(rng, which):
    """A reversed GPU view (negative strides: ``x[:, ::-1]``, ``cupy.flip``) was refused with "device arrays with
    negative strides are not supported", naming no argument; the kernels read and write in place, so the message
    now names it and says how to pass it."""
    q, k, v = (cuda.to_device(rng.normal(size=(1, 6, 3))) for _ in range(3))
    args = dict(q=q, k=k, v=v, out=cuda.device_array((1, 6, 3)))
    args[which] = args[which][:, ::-1]
    with pytest.raises(ValueError, match=rf"^{which} is a GPU array with negative strides .*a contiguous copy"):
        la.linear_attention(args["q"], k, args["v"], causal=True, device="cuda", out=args["out"])


def test_vector_bits_need_aligned_unit_stride_inputs():
    """Vector loads only where every group of four is aligned: unit feature stride, sizes and
    strides in multiples of 4, an aligned first element; else one element per load."""
    from linattn_nb.ops.cuda import plan as KP, views as KV

    def bits(q, v, MB=4):
        views = [KV.as_4d(x) for x in (q, q, v)]
        strides = [KV.flat_view(x)[1] for x in views]
        return KV.vector_bits(*views, strides, int(q.shape[2]), int(v.shape[2]), MB)

    both = KP.VEC_QK | KP.VEC_V
    base = cuda.to_device(np.zeros((2, 6, 16), np.float32))
    if KV.data_pointer(base) % 16:
        pytest.skip("the device allocation is not 16-byte aligned here")
    assert bits(base, base) == both
    assert bits(base, base, MB=6) == KP.VEC_QK  # a column block starting at column 6
    assert bits(KV.strided_view(base, (2, 6, 8), (384, 64, 8)), base) == KP.VEC_V  # feature stride 2
    assert bits(KV.strided_view(base, (2, 6, 12), (384, 64, 4)), base) == both
    assert bits(KV.strided_view(base, (2, 3, 12), (384, 72, 4)), base) == KP.VEC_V  # token stride 18
    shifted = base[:, :, 1:13]  # first element 4 bytes past an aligned address
    assert bits(shifted, base) == KP.VEC_V
    assert bits(base[:, :, :6], base[:, :, :6]) == 0  # 6 features / values
