"""Tests of the chunkwise-parallel causal CPU kernel (``method="chunked"``).

Reference: the quadratic NumPy form (float64).  The chunkwise form is that of
Yang et al. 2024 ("Gated Linear Attention Transformers with Hardware-Efficient
Training", Sec. 2.2, Alg. 1; origin Sun et al. 2023, RetNet): chunk size
C = N is the quadratic form and C = 1 the recurrence, and every C agrees with
both to round-off -- which is what these tests check, at the chunk boundaries.
"""
from __future__ import annotations

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

import linattn_nb.config as cfg
from linattn_nb import feature_maps as fm
from linattn_nb import linear_attention
from linattn_nb import _blas
from linattn_nb.ops._vec import elu1, f16_to_f32, f32_to_f16
from linattn_nb.ops.causal.chunked import causal_chunked, plan
from linattn_nb.ops.causal.naive import causal_linear_quadratic

DTYPES = (np.float16, np.float32, np.float64)
THREADS = numba.get_num_threads()


def _inputs(rng, B, N, D, M, dtype, scale=1.0):
    q = (rng.standard_normal((B, N, D)) * scale).astype(dtype)
    k = (rng.standard_normal((B, N, D)) * scale).astype(dtype)
    v = rng.standard_normal((B, N, M)).astype(dtype)
    return q, k, v


def _reference(q, k, v, fmap, S0=None, z0=None, eps=1e-8):
    """Quadratic float64 reference from the (already rounded) inputs."""
    f = fm.get(fmap)
    kw = dict(causal=True, offset=0, total_length=q.shape[1])
    if f.kernel_code is None:  # features made in NumPy and rounded to the input dtype, as the kernel sees them
        qf = np.asarray(f.apply(q, role="query", **kw), dtype=q.dtype).astype(np.float64)
        kf = np.asarray(f.apply(k, role="key", **kw), dtype=k.dtype).astype(np.float64)
    else:
        qf = f.apply(q.astype(np.float64), role="query", **kw)
        kf = f.apply(k.astype(np.float64), role="key", **kw)
    return causal_linear_quadratic(qf, kf, v.astype(np.float64), eps=eps, S0=S0, z0=z0)


def _run(q, k, v, fmap="elu", chunk=4, seq_parallel=None, S0=None, z0=None, eps=1e-8, block=None):
    """Launcher called directly, output pre-filled with NaN, state in/out."""
    B, N, D = q.shape
    M = v.shape[2]
    f = fm.get(fmap)
    code = f.kernel_code
    F = f.output_dim(D)
    if code is None:  # map applied in NumPy, kernel gets features
        kw = dict(causal=True, offset=0, total_length=N)
        q = np.ascontiguousarray(f.apply(q, role="query", **kw), dtype=q.dtype)
        k = np.ascontiguousarray(f.apply(k, role="key", **kw), dtype=k.dtype)
        code = 0
    H = np.zeros((B, F, M + 1))  # the state [S | z]
    if S0 is not None:
        H[..., :M] = S0
        H[..., M] = z0
    out = np.full((B, N, M), np.nan, dtype=q.dtype)
    causal_chunked(q, k, v, H, out, code=code, eps=eps, chunk=chunk, block=block, seq_parallel=seq_parallel)
    return out, H[..., :M], H[..., M]


def _assert_close(out, ref, dtype, what=""):
    assert out.dtype == np.dtype(dtype)
    assert not np.isnan(out).any(), f"unwritten (NaN) outputs {what}"
    if out.size == 0:
        return
    o = out.astype(np.float64)
    if dtype == np.float16:
        # float32 accumulation, one rounding to float16 at the end: within half
        # an ulp of float16 (plus float32 round-off); float16 accumulation
        # would be off by several ulp.
        bound = 2.0**-11 * np.abs(ref) * (1 + 1e-3) + 1e-5 * np.abs(ref).max() + 2.0**-25
        assert np.all(np.abs(o - ref) <= bound), f"{what}: max err {np.abs(o - ref).max()}"
    else:
        tol = 2e-6 if dtype == np.float32 else 1e-12
        scale = max(np.abs(ref).max(), 1e-30)
        err = np.abs(o - ref).max() / scale
        assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


# ---------------------------------------------------------------------------
# helpers: float16 bits and the vectorised ELU+1
# ---------------------------------------------------------------------------
# Not cached on disk: Numba keys a cached function on its own file only, so a
# helper of this file cached by Numba would keep running the old machine code
# of ops/_vec.py after an edit there (the package's kernels are keyed on all
# its sources, linattn_nb/_cache.py; these are not the package's).
@njit(cache=False)
def _up(a, o):
    for i in range(a.size):
        o[i] = f16_to_f32(a[i])


@njit(cache=False)
def _down(a, o):
    for i in range(a.size):
        o[i] = f32_to_f16(a[i])


@njit(cache=False)
def _elu_array(a, o):
    for i in range(a.size):
        o[i] = elu1(a[i])


def test_f16_to_f32_all_values():
    bits = np.arange(65536, dtype=np.uint16)
    out = np.empty(65536, np.float32)
    _up(bits, out)
    ref = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(out[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert np.isnan(out[nan]).all()


def test_f32_to_f16_rounds_like_numpy(rng):
    h = np.arange(65536, dtype=np.uint16).view(np.float16)
    finite = h[np.isfinite(h)].astype(np.float64)
    finite = np.unique(finite)
    mids = (finite[:-1] + finite[1:]) / 2  # ties: round to even
    special = np.array([65504, 65519.996, 65520, 1e6, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1e-9, 0.0, -0.0,
                        np.inf, -np.inf])
    rand = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([finite.astype(np.float32), mids.astype(np.float32), special.astype(np.float32), rand])
    out = np.empty(x.size, np.uint16)
    _down(x, out)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(out[~nan], ref[~nan])
    assert np.isnan(out[nan].view(np.float16)).all()


@pytest.mark.parametrize("dtype, ulps", [(np.float32, 1.5), (np.float64, 2.0)])
def test_elu1_accuracy_and_specials(dtype, ulps):
    lo = -87.0 if dtype == np.float32 else -700.0
    x = np.concatenate([np.linspace(lo, 0, 200_001), np.linspace(0, 50, 1001)]).astype(dtype)
    out = np.empty_like(x)
    _elu_array(x, out)
    x64 = x.astype(np.float64)
    if dtype == np.float32:
        ref = np.where(x64 >= 0, x64 + 1, np.exp(np.minimum(x64, 0)))
    else:
        ref = np.where(x64 >= 0, x64 + 1, np.exp(np.minimum(x64, 0).astype(np.longdouble)))
    rel = np.abs((out - ref) / ref).astype(np.float64)
    assert rel.max() <= ulps * np.finfo(dtype).eps
    sp = np.array([np.nan, np.inf, -np.inf, -1e4, -0.0, 0.0], dtype)
    o = np.empty_like(sp)
    _elu_array(sp, o)
    assert np.isnan(o[0]) and o[1] == np.inf
    assert 0 <= o[2] < 1e-37 and 0 <= o[3] < 1e-37
    assert o[4] == 1 and o[5] == 1


def test_elu1_float64_power_of_two_at_every_exponent():
    """float64 ELU+1 builds ``2**k`` from integer operations (no float64 -> int64 conversion, which AVX2 cannot
    vectorise): within 2 ulp of the exact ``exp`` on both sides of every switch of ``k`` in [-1022, 0] and up
    to the flush at -708.3, below which it gives 0."""
    mids = (np.arange(-1022, 1) + 0.5) * np.log(2.0)
    mids = mids[mids > -708.3]
    steps = np.arange(-8, 9, dtype=np.float64)
    x = np.concatenate([(mids[:, None] + steps * np.spacing(np.abs(mids))[:, None]).ravel(),
                        np.arange(-1022, 1) * np.log(2.0), np.linspace(-708.3, -708.0, 3001)])
    x = x[(x >= -708.3) & (x <= 0)]
    out = np.empty_like(x)
    _elu_array(x, out)
    ref = np.exp(x.astype(np.longdouble))
    ulps = np.abs((out - ref) / np.spacing(ref.astype(np.float64))).astype(np.float64)
    assert ulps.max() <= 2.0, f"{ulps.max():.3f} ulp at x = {x[ulps.argmax()]!r}"
    below = np.array([np.nextafter(-708.3, -np.inf), -708.4, -745.2, -1e300], np.float64)
    o = np.empty_like(below)
    _elu_array(below, o)
    assert np.array_equal(o, np.zeros(4))


_EXP_LIM_F32 = np.float32(-87.3)  # below it ELU+1's exp flushes to 0


def _exp_points_f32():
    """float32 points of [-87.3, 0]: a dense grid (4 points per 1e-4), every float32 near the ends, the
    ends of the reduced intervals (x = (j + 1/2) ln 2, where the range reduction switches j), and 0."""
    grid = np.linspace(_EXP_LIM_F32, 0, 2_000_001, dtype=np.float64).astype(np.float32)
    lo = _EXP_LIM_F32
    ends = [lo + np.arange(4096, dtype=np.float32) * np.spacing(lo),
            -np.arange(4096, dtype=np.float32)[::-1] * np.float32(2.0**-30),
            -np.float32([np.finfo(np.float32).tiny, 1e-45, 1e-38, 1e-7, 2.0**-24, 0.5, 1.0])]
    mids = (np.arange(-126, 0) + 0.5) * np.log(2.0)
    mids = mids[mids >= _EXP_LIM_F32].astype(np.float32)
    steps = np.arange(-64, 65, dtype=np.float32)
    around = (mids[:, None] + steps * np.spacing(np.abs(mids))[:, None]).ravel()
    x = np.concatenate([grid, *ends, around, [np.float32(0.0), np.float32(-0.0)]]).astype(np.float32)
    return x[(x >= _EXP_LIM_F32) & (x <= 0)]


def _assert_exp_f32_accurate(x, out, what):
    """Within 1.5 ulp (of the float32 result) of float64's exp, and unbiased (|mean error| <= 0.1 ulp)."""
    ref = np.exp(x.astype(np.float64))
    ulps = (out.astype(np.float64) - ref) / np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert np.abs(ulps).max() <= 1.5, f"{what}: {np.abs(ulps).max():.3f} ulp at x = {x[np.abs(ulps).argmax()]!r}"
    # a coefficient that is slightly off shifts the error one way over the whole range (measured: 0.014 ulp)
    assert abs(ulps.mean()) <= 0.1, f"{what}: mean error {ulps.mean():.3f} ulp"


def test_float32_exp_within_1_5_ulp_of_float64_and_flushed_below():
    """ELU+1's float32 branch-free exp (ops/_vec.py).

    Over [-87.3, 0] (a dense grid plus the edge points of
    :func:`_exp_points_f32`): within 1.5 ulp of float64's exp (measured 1.04)
    and unbiased.  Below -87.3, where it flushes to 0, within an absolute
    ``exp(-87.3) < 1.3e-38`` of the exact value (and 0 itself: never
    negative, never a garbage exponent).
    """
    x = _exp_points_f32()
    out = np.empty_like(x)
    _elu_array(x, out)
    _assert_exp_f32_accurate(x, out, "elu1(float32)")
    assert np.all(out[x == 0] == 1)
    below = np.concatenate([np.linspace(-300, _EXP_LIM_F32, 100_001, dtype=np.float64).astype(np.float32),
                            np.nextafter(_EXP_LIM_F32, np.float32(-np.inf)) - np.arange(64, dtype=np.float32)
                            * np.spacing(_EXP_LIM_F32), [np.float32(-1e30), np.float32(-np.inf)]]).astype(np.float32)
    below = below[below < _EXP_LIM_F32]
    ob = np.empty_like(below)
    _elu_array(below, ob)
    assert np.all(ob >= 0)
    assert np.abs(ob.astype(np.float64) - np.exp(below.astype(np.float64))).max() <= 1.3e-38
    assert np.all(ob == 0)


def test_chunked_kernel_applies_an_accurate_float32_exp():
    """The chunked kernel's own ELU+1 features, read back exactly.

    With one-hot values ``v_s = e_s`` and ``normalize=False`` the final state
    is ``S[d, s] = phi(k_s)[d]`` (one term per entry: no round-off), and with
    selector queries (``q_t[d] = 0`` for ``d = t``, -1000 elsewhere; D = N,
    so ``phi(q_t)`` is exactly one-hot: 1 and flushed zeros) the output is
    ``o_t[s] = phi(k_s)[t]`` for ``s <= t`` and 0 above: the features the
    kernel computed, across chunk boundaries, checked to 1.5 ulp as above.
    """
    n = 512
    code = fm.get("elu").kernel_code
    pts = _exp_points_f32()
    rng = np.random.default_rng(7)
    k = rng.permutation(pts)[: n * n].reshape(1, n, n)
    q = np.full((1, n, n), -1000.0, np.float32)
    q[0, np.arange(n), np.arange(n)] = 0.0
    v = np.eye(n, dtype=np.float32)[None]
    H = np.zeros((1, n, n + 1))
    out = np.full((1, n, n), np.nan, np.float32)
    causal_chunked(q, k, v, H, out, code=code, eps=None, normalize=False, chunk=64)
    feats = H[0, :, :n].T.astype(np.float32)  # (s, d): phi(k_s)[d], float32 values held exactly in float64
    np.testing.assert_array_equal(H[0, :, :n].T, feats)
    _assert_exp_f32_accurate(k[0].ravel(), feats.ravel(), "chunked state")
    o = out[0]
    tri = np.tril(np.ones((n, n), bool))
    np.testing.assert_array_equal(o[tri], feats.T[tri])
    assert np.all(o[~tri] == 0)


# ---------------------------------------------------------------------------
# the kernel against the quadratic reference
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk, block", [(1, 1), (4, 4), (7, 3), (8, 2), (6, 1), (5, 9)])
def test_chunk_boundaries(rng, dtype, chunk, block):
    """N = 0, 1, C-1, C, C+1, 3C, odd; D != M; B above the thread count; row
    blocks that divide the chunk, that do not, of one row, and wider than it."""
    B, D, M = THREADS + 1, 5, 3
    for N in sorted({0, 1, max(chunk - 1, 0), chunk, chunk + 1, 3 * chunk, 3 * chunk + 2, 13}):
        q, k, v = _inputs(rng, B, N, D, M, dtype)
        out, S, z = _run(q, k, v, chunk=chunk, block=block, seq_parallel=False)
        ref, S_ref, z_ref = _reference(q, k, v, "elu")
        _assert_close(out, ref, dtype, f"N={N} C={chunk} block={block}")
        np.testing.assert_allclose(S, S_ref, rtol=1e-5 if dtype != np.float64 else 1e-12,
                                   atol=1e-6 if dtype != np.float64 else 1e-13)
        np.testing.assert_allclose(z, z_ref, rtol=1e-6 if dtype != np.float64 else 1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmap", ["relu", "squared_relu", "identity", "dpfp"])
def test_feature_maps(rng, dtype, fmap):
    """Every inline code (and a map applied in NumPy, F != D) against the reference."""
    q, k, v = _inputs(rng, 2, 19, 4, 6, dtype)
    if fmap == "identity":  # keep the signed normaliser away from zero
        q, k = (np.abs(x) + np.asarray(0.5, dtype) for x in (q, k))
    out, _, _ = _run(q, k, v, fmap=fmap, chunk=5)
    ref, _, _ = _reference(q, k, v, fmap)
    _assert_close(out, ref, dtype, fmap)


@pytest.mark.parametrize("dtype", DTYPES)
def test_parallel_and_serial_kernels_agree(rng, dtype, monkeypatch):
    """The prange kernel (B above the thread count) gives the serial kernel's numbers, bit for bit."""
    q, k, v = _inputs(rng, THREADS + 1, 37, 5, 3, dtype)
    monkeypatch.setattr(cfg, "CPU_CHUNKED_SERIAL_MAX_WORK", 1 << 40)
    o_ser, S_ser, _ = _run(q, k, v, chunk=4, seq_parallel=False)
    monkeypatch.setattr(cfg, "CPU_CHUNKED_SERIAL_MAX_WORK", 0)
    o_par, S_par, _ = _run(q, k, v, chunk=4, seq_parallel=False)
    assert np.array_equal(o_ser, o_par) and np.array_equal(S_ser, S_par)
    ref, _, _ = _reference(q, k, v, "elu")
    _assert_close(o_par, ref, dtype, "parallel")


@pytest.mark.parametrize("dtype", DTYPES)
def test_sequence_parallel_equals_batch_parallel(rng, dtype, monkeypatch):
    """B below the thread count: segments from a prefix over state sums, initial state included."""
    monkeypatch.setattr(cfg, "CPU_CHUNKED_MIN_SEGMENT_CHUNKS", 1)
    B, N, D, M, C = 1, 61, 4, 3, 4
    q, k, v = _inputs(rng, B, N, D, M, dtype)
    S0 = rng.standard_normal((B, D, M))
    z0 = rng.uniform(1, 2, size=(B, D))
    assert plan(B, N, chunk=C, seq_parallel=True)[0] >= 2
    o_seq, S_seq, z_seq = _run(q, k, v, chunk=C, seq_parallel=True, S0=S0, z0=z0)
    o_bat, S_bat, z_bat = _run(q, k, v, chunk=C, seq_parallel=False, S0=S0, z0=z0)
    ref, S_ref, z_ref = _reference(q, k, v, "elu", S0=S0, z0=z0)
    _assert_close(o_seq, ref, dtype, "sequence-parallel")
    tol = {np.float16: 0, np.float32: 1e-6, np.float64: 1e-13}[dtype]
    if dtype == np.float16:  # equal up to one float16 ulp where float64 rounding flips a tie
        assert np.all(np.abs(o_seq.astype(np.float64) - o_bat) <= 2.0**-10 * np.abs(o_bat.astype(np.float64)))
    else:
        np.testing.assert_allclose(o_seq, o_bat, rtol=tol, atol=tol)
    np.testing.assert_allclose(S_seq, S_bat, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(z_seq, z_bat, rtol=1e-12)
    loose = dtype != np.float64  # float32/float16 inputs: the reference is float64 of the rounded inputs
    np.testing.assert_allclose(S_seq, S_ref, rtol=1e-5 if loose else 1e-12, atol=1e-5 if loose else 1e-13)
    np.testing.assert_allclose(z_seq, z_ref, rtol=1e-6 if loose else 1e-12)


def test_sequence_parallel_many_segments(rng, monkeypatch):
    """More segments than chunks per piece, B = 2 forced, P and sub > 1, empty pieces allowed."""
    monkeypatch.setattr(cfg, "CPU_CHUNKED_MIN_SEGMENT_CHUNKS", 1)
    q, k, v = _inputs(rng, 2, 23, 3, 2, np.float64)
    S0 = rng.standard_normal((2, 3, 2))
    z0 = rng.uniform(1, 2, size=(2, 3))
    import linattn_nb.ops.causal.chunked as ch

    orig = ch.plan
    monkeypatch.setattr(ch, "plan", lambda B, N, chunk, seq_parallel=None: (5, 3))
    out, S, z = _run(q, k, v, chunk=2, S0=S0, z0=z0)
    monkeypatch.setattr(ch, "plan", orig)
    ref, S_ref, z_ref = _reference(q, k, v, "elu", S0=S0, z0=z0)
    _assert_close(out, ref, np.float64)
    np.testing.assert_allclose(S, S_ref, rtol=1e-12)
    np.testing.assert_allclose(z, z_ref, rtol=1e-12)


def test_plan():
    assert plan(16, 4096, chunk=64, threads=2) == (1, 1)
    assert plan(1, 4096, chunk=64, threads=2) == (2, 2)
    assert plan(1, 4096, chunk=64, threads=4) == (4, 2)
    assert plan(3, 4096, chunk=64, threads=4) == (2, 2)
    assert plan(1, 100, chunk=64, threads=2) == (1, 1)  # too short to split
    assert plan(8, 4096, chunk=64, threads=2, seq_parallel=True) == (2, 1)
    assert plan(1, 4096, chunk=64, threads=2, seq_parallel=False) == (1, 1)


def test_segments_and_part_ranges():
    from linattn_nb.ops._chunks import part_range, segments, token_range

    assert segments(16, 64, threads=2) == 1  # the batch fills the threads
    assert segments(1, 64, threads=4) == 4
    assert segments(1, 64, threads=4, min_units=32) == 2
    assert segments(1, 64, threads=4, min_units=33) == 1  # fewer than two segments: no split
    assert segments(8, 64, threads=2, split=True) == 2
    assert segments(1, 64, threads=4, split=False) == 1
    for parts, u0, u1 in ((3, 0, 10), (4, 5, 6), (5, 2, 2)):
        rng_ = [part_range(j, parts, u0, u1) for j in range(parts)]
        assert rng_[0][0] == u0 and rng_[-1][1] == u1
        assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(rng_, rng_[1:]))
    assert token_range(3, 5, 8, 37) == (24, 37)


def test_segment_prefix_and_absorb(rng):
    """The prefix over segments and the combine of pieces: sums of the pieces in order, from H."""
    from linattn_nb.ops._chunks import absorb_parts, segment_states
    from linattn_nb.ops._codes import RULE_ADDITIVE

    B, P, sub, F, M1 = 2, 4, 3, 3, 5
    H = rng.standard_normal((B, F, M1))
    parts = rng.standard_normal((B, (P - 1) * sub, F, M1))
    Hst = segment_states(RULE_ADDITIVE, H, parts, sub, P)
    seg = parts.reshape(B, P - 1, sub, F, M1).sum(axis=2)
    want = H[:, None] + np.concatenate([np.zeros((B, 1, F, M1)), np.cumsum(seg, axis=1)], axis=1)
    np.testing.assert_allclose(Hst, want, rtol=1e-14, atol=1e-14)
    H2 = H.copy()
    absorb_parts(RULE_ADDITIVE, H2, parts)
    np.testing.assert_allclose(H2, H + parts.sum(axis=1), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("launcher", ["chunked", "scan", "noncausal"])
def test_launchers_check_state_and_inputs(rng, launcher):
    """The contract's H and inputs= are checked, with errors that name them."""
    from linattn_nb.ops.causal.cpu import causal_scan
    from linattn_nb.ops.noncausal.cpu import noncausal_aggregate

    fn = {"chunked": causal_chunked, "scan": causal_scan, "noncausal": noncausal_aggregate}[launcher]
    q, k, v = _inputs(rng, 2, 5, 3, 2, np.float64)
    out = np.full((2, 5, 2), np.nan)
    frozen = np.zeros((2, 3, 3))
    frozen.setflags(write=False)
    for bad in (np.zeros((2, 3, 2)), np.zeros((2, 3, 3), np.float32), np.zeros((2, 3, 3), order="F"), frozen,
                [[[0.0] * 3] * 3] * 2):
        with pytest.raises(ValueError, match="H must be"):
            fn(q, k, v, bad, out, code=1, eps=1e-8)
    with pytest.raises(ValueError, match="inputs"):
        fn(q, k, v, np.zeros((2, 3, 3)), out, code=1, eps=1e-8, inputs={"g": np.zeros((2, 5))})
    with pytest.raises(ValueError, match="rule"):
        fn(q, k, v, np.zeros((2, 3, 3)), out, code=1, eps=1e-8, rule=7)
    H = np.zeros((2, 3, 3))
    fn(q, k, v, H, out, code=1, eps=1e-8, inputs={})  # an empty mapping is no inputs
    assert not np.isnan(out).any() and H[..., 2].min() > 0


def test_public_api_dtypes_and_state(rng):
    """float16 in, float16 out (no float32 round trip), leading batch dims, state chaining."""
    q, k = rng.standard_normal((2, 2, 3, 40, 8))
    v = rng.standard_normal((2, 3, 40, 5))
    full = linear_attention(q, k, v, causal=True, method="quadratic")
    for dtype in DTYPES:
        qd, kd, vd = (x.astype(dtype) for x in (q, k, v))
        o = linear_attention(qd, kd, vd, causal=True, method="chunked")
        assert o.dtype == np.dtype(dtype) and o.shape == (2, 3, 40, 5)
        ref = linear_attention(qd.astype(np.float64), kd.astype(np.float64), vd.astype(np.float64),
                               causal=True, method="quadratic")
        _assert_close(o.reshape(6, 40, 5), ref.reshape(6, 40, 5), dtype, "public")
    # two segments with the state in between equal one call
    o1, st = linear_attention(q[..., :17, :], k[..., :17, :], v[..., :17, :], causal=True, method="chunked",
                              return_state=True)
    o2 = linear_attention(q[..., 17:, :], k[..., 17:, :], v[..., 17:, :], causal=True, method="chunked",
                          initial_state=st)
    np.testing.assert_allclose(np.concatenate([o1, o2], axis=-2), full, rtol=1e-12, atol=1e-13)


def test_float16_with_numpy_side_map(rng):
    """float16 inputs with a map applied in NumPy (dpfp, F != D): features in float32, output float16."""
    q, k, v = _inputs(rng, 2, 29, 4, 3, np.float16)
    o = linear_attention(q, k, v, causal=True, method="chunked", feature_map="dpfp")
    assert o.dtype == np.float16
    ref = linear_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True,
                           method="quadratic", feature_map="dpfp")
    _assert_close(o, ref, np.float16, "dpfp float16")


def test_nan_propagates_causally(rng):
    """A NaN in q at token t poisons row t only; in k or v, rows >= t (check_finite=False)."""
    q, k, v = _inputs(rng, 1, 20, 4, 3, np.float32)
    t = 9
    for arr, rows in ((q, [t]), (k, list(range(t, 20))), (v, list(range(t, 20)))):
        a = arr.copy()
        a[0, t, 1] = np.nan
        args = [q, k, v]
        args[[id(q), id(k), id(v)].index(id(arr))] = a
        o = linear_attention(*args, causal=True, method="chunked", check_finite=False)
        bad = np.where(np.isnan(o[0]).any(axis=-1))[0].tolist()
        assert bad == rows


def test_raw_division_eps_none(rng):
    """eps=None: signed features divide by the raw normaliser, like the reference."""
    q, k, v = _inputs(rng, 2, 15, 3, 2, np.float64)
    out, _, _ = _run(q, k, v, fmap="identity", chunk=4, eps=None)
    ref, _, _ = _reference(q, k, v, "identity", eps=None)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("causal", [True, False])
def test_zero_normaliser_raw_division(rng, causal):
    """eps=None and a normaliser exactly 0 (zero queries, identity map): inf/NaN like the reference, no exception."""
    q, k, v = _inputs(rng, 2, 12, 3, 2, np.float32)
    q[:, 5] = 0.0
    o = linear_attention(q, k, v, causal=causal, method="chunked", feature_map="identity", eps=None)
    assert np.isnan(o[:, 5]).all()  # 0 / 0
    assert np.isfinite(np.delete(o, 5, axis=1)).all()


def test_auto_uses_chunked_and_blas_threads_restored(rng):
    from linattn_nb.ops.registry import select_auto

    assert select_auto(causal=True, device="cpu", n=4096, dtype=np.float32) == "chunked"
    # the measured rows of config.AUTO_METHODS: the scan up to their boundary, chunked above
    rows = cfg.AUTO_METHODS[("additive", True, "cpu")]
    assert rows[0][1] == "scan" and rows[-1] == (None, "chunked")
    edge = rows[0][0]
    assert select_auto(causal=True, device="cpu", n=edge, dtype=np.float32) == "scan"
    assert select_auto(causal=True, device="cpu", n=edge + 1, dtype=np.float32) == "chunked"
    before = _blas.blas_threads()
    # large enough for the parallel kernel, which pins the BLAS while it runs
    q, k, v = _inputs(rng, 4, 600, 32, 32, np.float32)
    assert 4 * 600 * 32 * 32 >= cfg.CPU_CHUNKED_SERIAL_MAX_WORK
    linear_attention(q, k, v, causal=True, method="chunked")
    assert _blas.blas_threads() == before
    q, k, v = _inputs(rng, 2, 30, 8, 8, np.float32)  # the serial kernel: no pinning
    linear_attention(q, k, v, causal=True, method="chunked")
    assert _blas.blas_threads() == before
    with _blas.single_threaded_blas():
        assert all(n == 1 for n in _blas.blas_threads())
    assert _blas.blas_threads() == before


@settings(max_examples=30)
@given(
    B=st.integers(1, 4),
    N=st.integers(0, 40),
    D=st.integers(1, 6),
    M=st.integers(1, 5),
    C=st.integers(1, 9),
    block=st.integers(1, 10),
    dtype=st.sampled_from(DTYPES),
    fmap=st.sampled_from(["elu", "relu", "squared_relu"]),
    seq=st.sampled_from([None, True, False]),
    init=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_against_reference(B, N, D, M, C, block, dtype, fmap, seq, init, seed):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, B, N, D, M, dtype)
    if fmap != "elu":  # keep normalisers away from the eps floor
        q, k = (np.abs(x) + np.asarray(0.25, dtype) for x in (q, k))
    S0 = rng.standard_normal((B, D, M)) if init else None
    z0 = rng.uniform(1, 2, size=(B, D)) if init else None
    old = cfg.CPU_CHUNKED_MIN_SEGMENT_CHUNKS
    cfg.CPU_CHUNKED_MIN_SEGMENT_CHUNKS = 1
    try:
        out, S, z = _run(q, k, v, fmap=fmap, chunk=C, block=block, seq_parallel=seq, S0=S0, z0=z0)
    finally:
        cfg.CPU_CHUNKED_MIN_SEGMENT_CHUNKS = old
    ref, S_ref, z_ref = _reference(q, k, v, fmap, S0=S0, z0=z0)
    _assert_close(out, ref, dtype, f"B={B} N={N} C={C}")
    loose = dtype != np.float64
    np.testing.assert_allclose(S, S_ref, rtol=1e-5 if loose else 1e-12, atol=1e-5 if loose else 1e-13)
    np.testing.assert_allclose(z, z_ref, rtol=1e-5 if loose else 1e-12, atol=1e-12 if loose else 1e-13)


# ---------------------------------------------------------------------------
# the other fast CPU paths touched here: non-causal kernel, float16 in the scan
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_noncausal_kernel_pieces_and_dtypes(rng, dtype, monkeypatch):
    """Aggregate-then-query kernel (blocks, pieces of one sequence, initial state) against the reference."""
    from linattn_nb.ops.noncausal.cpu import noncausal_aggregate
    from linattn_nb.ops.noncausal.naive import noncausal_linear_quadratic

    B, D, M = 2, 5, 3
    for N, pieces, serial in ((0, None, True), (1, None, True), (37, None, True), (41, 3, dtype == np.float64)):
        monkeypatch.setattr(cfg, "CPU_CHUNKED_SERIAL_MAX_WORK", 1 << 40 if serial else 0)
        q, k, v = _inputs(rng, B, N, D, M, dtype)
        S0 = rng.standard_normal((B, D, M))
        z0 = rng.uniform(1, 2, size=(B, D))
        H = np.concatenate([S0, z0[..., None]], axis=-1)
        out = np.full((B, N, M), np.nan, dtype)
        noncausal_aggregate(q, k, v, H, out, code=1, eps=1e-8, block=8, pieces=pieces)
        S, z = H[..., :M], H[..., M]
        f = fm.get("elu")
        ref, S_ref, z_ref = noncausal_linear_quadratic(
            f(q.astype(np.float64)), f(k.astype(np.float64)), v.astype(np.float64), eps=1e-8, S0=S0, z0=z0)
        _assert_close(out, ref, dtype, f"non-causal N={N} pieces={pieces}")
        loose = dtype != np.float64
        np.testing.assert_allclose(S, S_ref, rtol=1e-6 if loose else 1e-12, atol=1e-6 if loose else 1e-13)
        np.testing.assert_allclose(z, z_ref, rtol=1e-6 if loose else 1e-12)


def test_scan_takes_float16(rng):
    """The per-token scan reads float16 bits directly (no float32 copy) and returns float16."""
    q, k, v = _inputs(rng, 2, 23, 4, 3, np.float16)
    o = linear_attention(q, k, v, causal=True, method="scan")
    assert o.dtype == np.float16
    ref, _, _ = _reference(q, k, v, "elu")
    _assert_close(o, ref, np.float16, "scan float16")


@pytest.mark.parametrize("rule_name", ["additive", "decay", "gate"])
def test_state_without_outputs(rule_name):
    """``out=None`` with ``save=``: the final state and the saved chunk-start states of the call with outputs
    (bit for bit where the key decay is the same product; the gate rule's keys are decayed in another order
    without the intra weights: to rounding), for sequence-parallel pieces as well."""
    from linattn_nb.ops._codes import RULES as CODES
    from linattn_nb.ops.causal.chunked import causal_chunked

    code, _ = CODES[rule_name]
    rng = np.random.default_rng(21)
    B, N, F, M = 1, 77, 5, 3
    q, k = rng.random((B, N, F)), rng.random((B, N, F))
    v = rng.standard_normal((B, N, M))
    inputs = {"additive": None, "decay": {"log_decay": -0.2 * rng.random((B, N))},
              "gate": {"log_gate": -0.2 * rng.random((B, N, F))}}[rule_name]
    res = []
    for want in (True, False):
        P = -(-N // 8)  # the chunk-start states alone (no residuals: not a delta rule)
        ck, Ys, KKs = np.empty((B, P, F, M + 1)), np.empty((B, P, 0, M + 1)), np.empty((B, P, 0, 0))
        H = np.zeros((B, F, M + 1))
        out = np.empty((B, N, M)) if want else None
        causal_chunked(q, k, v, H, out, code=0, eps=None, inputs=inputs, chunk=8, seq_parallel=True,
                       save=(ck, Ys, KKs), rule=code)
        res.append((H, ck))
    (Ha, cka), (Hb, ckb) = res
    if rule_name == "gate":
        np.testing.assert_allclose(Hb, Ha, rtol=1e-13)
        np.testing.assert_allclose(ckb, cka, rtol=1e-13)
    else:
        np.testing.assert_array_equal(Hb, Ha)
        np.testing.assert_array_equal(ckb, cka)
