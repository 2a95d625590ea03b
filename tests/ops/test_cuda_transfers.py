"""No host round-trips on the GPU path, counted on the CUDA simulator.

The simulator's entry points are wrapped to count what a call does: host-to-device copies
(``cuda.to_device``, ``copy_to_device``), device allocations (``cuda.device_array`` and
friends: the pool allocates through them), device-to-host copies (``copy_to_host``) and kernel
launches.  After a first call has filled the workspace pool, a call of
``linear_attention`` on device arrays with the caller's ``out`` makes no copy to the device, no
allocation and at most one read back (the finiteness counters, with ``check_finite=True``); a
decode step of a GPU ``LinearAttentionState`` is one kernel launch, with no copy to the device,
no allocation but its result, and one read back only with ``check_finite=True``.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import config
from linattn_nb.device import cuda_status
from linattn_nb.ops import _cuda_pool as P
from linattn_nb.state import LinearAttentionState

pytestmark = pytest.mark.skipif(cuda_status() != "simulator", reason="counts the CUDA simulator's entry points")

_ALLOC = ("device_array", "device_array_like", "pinned_array", "mapped_array", "managed_array")


@pytest.fixture(autouse=True)
def _small_helper_blocks(monkeypatch):
    """The simulator runs a Python thread per simulated thread: the grid-stride helper kernels (fills,
    casts, packs, the checks' counts) in blocks of 8 threads, not 256 (the counts of transfers,
    allocations and launches do not depend on it; the strides then cover several elements a thread)."""
    monkeypatch.setattr(config, "CUDA_THREADS_PER_BLOCK", 8)


@pytest.fixture
def counts(monkeypatch):
    """A Counter of transfers, allocations and launches, switched on by ``counts["on"] = 1``."""
    from numba import cuda
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    c = Counter()

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if c["on"]:
                c[name] += 1
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(cuda, "to_device", wrap("h2d", cuda.to_device))
    for name in _ALLOC:
        if hasattr(cuda, name):
            monkeypatch.setattr(cuda, name, wrap("alloc", getattr(cuda, name)))
    monkeypatch.setattr(FakeCUDAArray, "copy_to_host", wrap("d2h", FakeCUDAArray.copy_to_host))
    monkeypatch.setattr(FakeCUDAArray, "copy_to_device", wrap("h2d", FakeCUDAArray.copy_to_device))
    call = sim_kernel.FakeCUDAKernel.__call__

    def launch(self, *args):
        if c["on"] and not self._device and sim_kernel._kernel_context is None:
            c["launch"] += 1
        return call(self, *args)

    monkeypatch.setattr(sim_kernel.FakeCUDAKernel, "__call__", launch)
    return c


def _measure(counts, fn):
    counts.clear()
    counts["on"] = 1
    try:
        res = fn()
    finally:
        counts["on"] = 0
    return res, {k: counts[k] for k in ("h2d", "alloc", "d2h", "launch")}


@pytest.mark.parametrize("causal,method", [(True, "scan"), (True, "chunked"), (False, "aggregate")])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_linear_attention_second_call_copies_and_allocates_nothing(counts, monkeypatch, causal, method, dtype):
    from numba import cuda

    # 2 chunks of 4 (one whole, one part): the chunk passes and their workspaces; one sequence (the
    # simulator's time goes with the blocks: sequences x chunks)
    monkeypatch.setattr(config, "CUDA_CHUNK_SIZE", 4)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 5, d)).astype(dtype) for d in (3, 3, 2))
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    out = cuda.device_array((1, 5, 2), dtype=dtype)
    ref = la.linear_attention(q, k, v, causal=causal)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for check in (False, True):
        def call():
            return la.linear_attention(dq, dk, dv, causal=causal, method=method, device="cuda", out=out,
                                       check_finite=check)
        call()  # the first call with these shapes fills the pool
        res, n = _measure(counts, call)
        assert res is out
        np.testing.assert_allclose(out.copy_to_host(), ref, rtol=tol, atol=tol)
        assert n["h2d"] == 0 and n["alloc"] == 0, n
        assert n["d2h"] == (1 if check else 0), n
    # a device initial state (the LinearState of a previous call): packed on the device, checked in the
    # same single read; the final state is the only new memory (S and z)
    _, st = la.linear_attention(dq, dk, dv, causal=causal, method=method, device="cuda", return_state=True)

    def resume():
        return la.linear_attention(dq, dk, dv, causal=causal, method=method, device="cuda", out=out,
                                   initial_state=st, return_state=True)
    resume()
    (_, st2), n = _measure(counts, resume)
    assert n["h2d"] == 0 and n["d2h"] == 1 and n["alloc"] == 2, n
    assert st2.position == 10


def test_linear_attention_check_reads_once_and_names_the_input(counts):
    """NaN in v and inf in the initial state: one read of the counters names the first (v); the
    counters are zero again afterwards (the next clean call passes)."""
    from numba import cuda

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 6, 2)) for _ in range(3))
    v[0, 3, 1] = np.nan
    S0, z0 = cuda.to_device(np.zeros((1, 2, 2))), cuda.to_device(np.ones((1, 2)))
    S0[0, 1, 1] = np.inf
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    with pytest.raises(ValueError, match="^v contains 1 non-finite"):
        _measure(counts, lambda: la.linear_attention(dq, dk, dv, device="cuda", initial_state=(S0, z0)))
    assert counts["d2h"] == 1
    with pytest.raises(ValueError, match="^initial_state.S contains 1 non-finite"):
        la.linear_attention(dq, dk, cuda.to_device(np.ones_like(v)), device="cuda", initial_state=(S0, z0))
    o = la.linear_attention(dq, dk, cuda.to_device(np.ones_like(v)), device="cuda")
    assert np.isfinite(o.copy_to_host()).all()


@pytest.mark.parametrize("form,method", [("per_token", "scan"), ("per_feature", "chunked")])  # each form, each method once
def test_device_log_decay_is_read_in_place(counts, monkeypatch, form, method):
    """A float64 or float32 GPU log_decay (per token or per feature, batch dims included) read in
    place, in its own dtype (no converted copy: GLA's (B, N, D_phi) gates read once by the kernels):
    no copy, no allocation on a repeated call, the values checked on the device in the call's single
    read (with or without check_finite); the float32 array gives bit for bit the result of the
    float64 array of the same values (float32 and float64 q, k, v); a NaN or a positive log-factor
    raises naming log_decay, and the next call is clean."""
    from numba import cuda

    monkeypatch.setattr(config, "CUDA_CHUNK_SIZE", 2)
    rng = np.random.default_rng(6)
    # two batch dims; chunks of 2: one whole, one part (the simulator's time goes with the blocks:
    # sequences x chunks)
    batch, N, D, M = (1, 2), 3, 3, 2
    q, k, v = (rng.standard_normal(batch + (N, d)).astype(np.float32) for d in (D, D, M))
    lg = -rng.uniform(0.0, 0.5, size=batch + ((N,) if form == "per_token" else (N, D)))
    lg[0, 1, 2] = -np.inf  # a reset (in the part chunk)
    dq, dk, dv, dlg = (cuda.to_device(x) for x in (q, k, v, lg))
    out = cuda.device_array(batch + (N, M), dtype=np.float32)
    ref = la.linear_attention(q, k, v, causal=True, log_decay=lg, method="quadratic")
    # float64 and float32 read in place: never converted into a pooled copy
    converted = []
    monkeypatch.setattr(P, "rule_input", lambda *a, **kw: converted.append(a[0]))
    dlg32 = cuda.to_device(lg.astype(np.float32))
    ref32 = la.linear_attention(q, k, v, causal=True, log_decay=lg.astype(np.float32), method="quadratic")
    # a call with and one without the check fill the pool; then no call copies or allocates, the
    # float32 gates' first calls included
    for check in (False, True):
        la.linear_attention(dq, dk, dv, causal=True, log_decay=dlg, method=method, device="cuda", out=out,
                            check_finite=check)
    for arr, want in ((dlg, ref), (dlg32, ref32)):
        for check in (False, True):
            def call():
                return la.linear_attention(dq, dk, dv, causal=True, log_decay=arr, method=method, device="cuda",
                                           out=out, check_finite=check)
            res, n = _measure(counts, call)
            assert res is out
            np.testing.assert_allclose(out.copy_to_host(), want, rtol=2e-5, atol=2e-6)
            assert n["h2d"] == 0 and n["alloc"] == 0 and n["d2h"] == 1, n
    np.testing.assert_array_equal(dlg.copy_to_host(), lg)  # read, never written
    assert not converted, converted
    # the float32 gates give the float64 array's result of their values, bit for bit
    same = cuda.to_device(lg.astype(np.float32).astype(np.float64))
    for x in (q, q.astype(np.float64)):
        dx = (cuda.to_device(x), cuda.to_device(k.astype(x.dtype)), cuda.to_device(v.astype(x.dtype)))
        a, b = (la.linear_attention(*dx, causal=True, log_decay=g, method=method, device="cuda").copy_to_host()
                for g in (dlg32, same))
        np.testing.assert_array_equal(a, b)
    for bad, where in ((0.25, (0, 1, 1)), (np.nan, (0, 0, N - 1))):
        x = lg.copy()
        x[where + (1,) * (x.ndim - 3)] = bad  # one entry
        with pytest.raises(ValueError, match=r"log_decay must be <= 0 .*1 value\(s\)"):
            la.linear_attention(dq, dk, dv, causal=True, log_decay=cuda.to_device(x), method=method, device="cuda")
        res = la.linear_attention(dq, dk, dv, causal=True, log_decay=dlg, method=method, device="cuda", out=out)
        np.testing.assert_allclose(res.copy_to_host(), ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("form", ["per_sequence", "per_head", "per_token_strided", "per_feature"])
def test_device_decay_factors_are_converted_on_the_device(counts, monkeypatch, form):
    """decay= (linear factors) on the GPU, float32, per sequence (RetNet's gamma per batch entry and
    head), per head broadcast over the batch, per token through a strided view, per token and
    feature: converted to log-factors on the device (0 a reset) -- no copy to the device, one read
    of the check counters, no allocation on a repeated call -- with the host path's result; a
    factor outside [0, 1] or NaN raises naming decay, and the next call is clean."""
    from numba import cuda

    monkeypatch.setattr(config, "CUDA_CHUNK_SIZE", 2)
    rng = np.random.default_rng(8)
    # chunks of 2: one whole, one part; a batch dim and a head dim, the batch of 2 where a per-head
    # factor is broadcast over it (the simulator's time goes with the blocks: sequences x chunks)
    batch, N, D, M = (2 if form == "per_head" else 1, 2), 3, 3, 2
    q, k, v = (rng.standard_normal(batch + (N, d)).astype(np.float32) for d in (D, D, M))
    if form == "per_sequence":
        a = rng.uniform(0.5, 1.0, size=batch).astype(np.float32)
        da = cuda.to_device(a)
    elif form == "per_head":
        a = rng.uniform(0.5, 1.0, size=(1, batch[1])).astype(np.float32)
        da = cuda.to_device(a)
    elif form == "per_token_strided":
        full = rng.uniform(0.5, 1.0, size=batch + (2 * N,)).astype(np.float32)
        full[0, 1, 4] = 0.0  # a reset (token 2 of the view, in the part chunk)
        a = full[..., ::2]
        da = cuda.to_device(full)[..., ::2]
    else:
        a = rng.uniform(0.5, 1.0, size=batch + (N, D)).astype(np.float32)
        a[0, 1, 2] = 0.0  # a reset of every feature row (in the part chunk)
        da = cuda.to_device(a)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    out = cuda.device_array(batch + (N, M), dtype=np.float32)
    ref = la.linear_attention(q, k, v, causal=True, decay=np.ascontiguousarray(a), method="quadratic")

    def call(x=da, check=False):
        return la.linear_attention(dq, dk, dv, causal=True, decay=x, method="chunked", device="cuda", out=out,
                                   check_finite=check)
    call()
    for check in (False, True):
        res, n = _measure(counts, lambda: call(check=check))
        assert res is out
        np.testing.assert_allclose(out.copy_to_host(), ref, rtol=2e-5, atol=2e-6)
        assert n["h2d"] == 0 and n["alloc"] == 0 and n["d2h"] == 1, n
    host = np.ascontiguousarray(a).copy()
    for bad in (1.5, -0.25, np.nan):
        x = host.copy()
        x.reshape(-1)[x.size // 2] = bad
        with pytest.raises(ValueError, match=r"decay factors must lie in \[0, 1\].*1 value\(s\)"):
            call(cuda.to_device(x))
        np.testing.assert_allclose(call().copy_to_host(), ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("rule", ["delta", "gated_delta"])
def test_device_beta_is_read_in_place(counts, rule):
    """A float64 GPU beta (and per-token log_decay for the gated delta rule): no copy to the
    device, one read (float32 ones: the same result); beta outside [0, 2] or NaN raises naming
    beta; a host beta beside a device log_decay takes the host path with the same result."""
    from numba import cuda

    rng = np.random.default_rng(7)
    batch, N, D, M = (2,), 4, 3, 2  # a scan: one block a sequence (the simulator's time)
    q, k, v = (rng.standard_normal(batch + (N, d)).astype(np.float32) for d in (D, D, M))
    beta = rng.uniform(0.0, 2.0, size=batch + (N,))
    kw = {"beta": beta}
    if rule == "gated_delta":
        kw["log_decay"] = -rng.uniform(0.0, 0.3, size=batch + (N,))
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    dkw = {name: cuda.to_device(x) for name, x in kw.items()}
    out = cuda.device_array(batch + (N, M), dtype=np.float32)
    ref = la.linear_attention(q, k, v, causal=True, feature_map="l2", method="quadratic", **kw)

    def call(**over):
        return la.linear_attention(dq, dk, dv, causal=True, feature_map="l2", method="scan", device="cuda",
                                   out=out, **{**dkw, **over})
    call()
    res, n = _measure(counts, call)
    np.testing.assert_allclose(res.copy_to_host(), ref, rtol=2e-5, atol=2e-6)
    assert n["h2d"] == 0 and n["alloc"] == 0 and n["d2h"] == 1, n
    for bad in (2.5, -0.1, np.nan):
        x = beta.copy()
        x[1, 2] = bad
        with pytest.raises(ValueError, match=r"beta \(the write strength\) must lie in \[0, 2\].*1 value"):
            call(beta=cuda.to_device(x))
    np.testing.assert_allclose(call().copy_to_host(), ref, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(call(beta=beta).copy_to_host(), ref, rtol=2e-5, atol=2e-6)  # host beta
    # one float32 beta per sequence, converted and broadcast over the tokens on the device
    b1 = rng.uniform(0.0, 2.0, size=batch).astype(np.float32)
    ref1 = la.linear_attention(q, k, v, causal=True, feature_map="l2", method="quadratic", **{**kw, "beta": b1})
    db1 = cuda.to_device(b1)
    call(beta=db1)
    res, n = _measure(counts, lambda: call(beta=db1))
    np.testing.assert_allclose(res.copy_to_host(), ref1, rtol=2e-5, atol=2e-6)
    assert n["h2d"] == 0 and n["alloc"] == 0 and n["d2h"] == 1, n
    b1[1] = 3.0
    with pytest.raises(ValueError, match=r"beta \(the write strength\) must lie in \[0, 2\].* 1 value"):
        call(beta=cuda.to_device(b1))
    # a float32 beta per token (and log_decay) read in place: the float64 arrays' result of its values
    kw32 = {name: x.astype(np.float32) for name, x in kw.items()}
    a = call(**{name: cuda.to_device(x) for name, x in kw32.items()}).copy_to_host()
    b = call(**{name: cuda.to_device(x.astype(np.float64)) for name, x in kw32.items()}).copy_to_host()
    np.testing.assert_array_equal(a, b)


def test_pool_is_bounded_and_keyed(monkeypatch):
    P.clear()
    a = P.workspace("t", (4, 4), np.float32)
    assert P.workspace("t", (4, 4), np.float32) is a
    assert P.workspace("t", (4, 4), np.float64) is not a
    assert P.workspace("u", (4, 4), np.float32) is not a
    monkeypatch.setattr(config, "CUDA_WORKSPACE_BYTES", 100)
    big = P.workspace("big", (200,), np.float32)  # above the bound: allocated, not kept
    assert P.workspace("big", (200,), np.float32) is not big
    P.workspace("t", (4, 4), np.float32)  # 64 bytes: evicts the others down to the bound
    assert P.stats()["bytes"] <= 100
    monkeypatch.setattr(config, "CUDA_WORKSPACE_BYTES", 0)
    assert P.workspace("t", (4, 4), np.float32) is not P.workspace("t", (4, 4), np.float32)
    P.clear()
    assert P.stats()["buffers"] == 0


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
def test_decode_step_is_one_launch(counts, monkeypatch, check, normalize):
    """A float32 GPU state fed device tokens: each step is one kernel launch, no copy to the device,
    no allocation but its output, one read back only with check_finite=True; float32 all through."""
    from numba import cuda

    monkeypatch.setattr(config, "CUDA_STEP_THREADS", 4)
    rng = np.random.default_rng(2)
    B, T, D, M = 3, 4, 3, 2
    q, k, v = (rng.standard_normal((B, T, d)).astype(np.float32) for d in (D, D, M))
    g = LinearAttentionState(D, M, batch_shape=(B,), dtype=np.float32, device="cuda", normalize=normalize)
    c = LinearAttentionState(D, M, batch_shape=(B,), dtype=np.float32, normalize=normalize)
    dev = [tuple(cuda.to_device(np.ascontiguousarray(x[:, t:t + 1])) for x in (q, k, v)) for t in range(T)]
    g.step(*dev[0], check_finite=check)
    c.step(q[:, :1], k[:, :1], v[:, :1])
    given = cuda.device_array((B, 1, M), dtype=np.float32)
    for t in range(1, T):
        if t % 2:  # no out: the result is the only allocation
            out, n = _measure(counts, lambda: g.step(*dev[t], check_finite=check))
            assert n == {"h2d": 0, "alloc": 1, "d2h": 1 if check else 0, "launch": 1}, n
        else:  # the caller's out: nothing allocated
            out, n = _measure(counts, lambda: g.step(*dev[t], check_finite=check, out=given))
            assert n == {"h2d": 0, "alloc": 0, "d2h": 1 if check else 0, "launch": 1}, n
            assert out is given
        assert out.dtype == np.float32
        np.testing.assert_allclose(out.copy_to_host(), c.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]),
                                   rtol=3e-5, atol=3e-6)
    _, n = _measure(counts, lambda: g.query(dev[0][0], check_finite=check))
    assert n == {"h2d": 0, "alloc": 1, "d2h": 1 if check else 0, "launch": 1}, n
    _, n = _measure(counts, lambda: g.prefill(dev[0][1], dev[0][2], check_finite=check))
    assert n == {"h2d": 0, "alloc": 0, "d2h": 1 if check else 0, "launch": 1}, n
    c.prefill(k[:, :1], v[:, :1])
    np.testing.assert_allclose(g.S.copy_to_host(), c.S, rtol=3e-5, atol=3e-6)
    np.testing.assert_allclose(g.z.copy_to_host(), c.z, rtol=3e-5, atol=3e-6)
    assert g.S.dtype == np.float32 and g.position == c.position == T + 1


@pytest.mark.parametrize("method", ["scan", "aggregate"])
def test_backward_temporaries_come_from_the_pool(counts, method):
    """A second backward call on device arrays: no copy to the device, no read back, and no
    allocation but its gradients (checkpoints, token states and per-block partial sums are pooled);
    the same gradients as the first call."""
    from numba import cuda

    from linattn_nb.ops.grad.cuda import backward_aggregate_cuda, backward_scan_cuda

    rng = np.random.default_rng(5)
    B, N, F, M1 = 2, 7, 3, 4
    qf, kf = (cuda.to_device(rng.uniform(0.1, 1.0, (B, N, F))) for _ in range(2))
    v1, g1 = (cuda.to_device(rng.standard_normal((B, N, M1))) for _ in range(2))
    H0 = cuda.to_device(rng.standard_normal((B, F, M1)))
    if method == "scan":
        run = lambda: backward_scan_cuda(qf, kf, v1, H0, g1, chunk_size=3)  # noqa: E731
    else:
        run = lambda: backward_aggregate_cuda(qf, kf, v1, H0, g1)  # noqa: E731
    first = [None if x is None else x.copy_to_host() for x in run()]
    got, n = _measure(counts, run)
    results = sum(1 for x in got if x is not None)
    assert n["h2d"] == 0 and n["d2h"] == 0 and n["alloc"] == results, (n, results)
    for a, b in zip(first, got):
        if a is not None:
            np.testing.assert_array_equal(a, b.copy_to_host())


@pytest.mark.parametrize("rule", ["additive", "decay", "delta"])
def test_reset_zeroes_the_state_on_the_device(counts, monkeypatch, rule):
    """reset() of a GPU state: one kernel per array, no host copy, no allocation; then it decodes
    as a fresh state does."""
    monkeypatch.setattr(config, "CUDA_STEP_THREADS", 4)  # not 128 simulated threads a block
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 3, d)).astype(np.float32) for d in (2, 2, 3))
    kw = {"decay": dict(decay=0.9), "delta": dict(beta=0.5)}.get(rule, {})
    fmap = "l2" if rule == "delta" else "elu"
    g = LinearAttentionState(2, 3, batch_shape=(2,), dtype=np.float32, device="cuda", feature_map=fmap)
    g.step(q, k, v, **kw)
    _, n = _measure(counts, g.reset)
    assert n == {"h2d": 0, "alloc": 0, "d2h": 0, "launch": 2}, n
    assert g.position == 0
    assert not g.S.copy_to_host().any() and not g.z.copy_to_host().any()
    fresh = LinearAttentionState(2, 3, batch_shape=(2,), dtype=np.float32, device="cuda", feature_map=fmap)
    np.testing.assert_array_equal(g.step(q, k, v, **kw), fresh.step(q, k, v, **kw))  # host tokens: host results


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the simulator computes inf / inf
def test_refused_step_leaves_the_state_and_next_step_clean(counts):
    """A step refused for NaN (one launch, one read) leaves S and z bit for bit; the flag is clear
    again, so the next finite step passes."""
    from numba import cuda

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 1, d)).astype(np.float32) for d in (2, 2, 3))
    g = LinearAttentionState(2, 3, batch_shape=(2,), dtype=np.float32, device="cuda")
    g.step(*(cuda.to_device(x) for x in (q, k, v)))
    S0, z0 = g.S.copy_to_host(), g.z.copy_to_host()
    bad = k.copy()
    bad[1, 0, 1] = np.inf
    with pytest.raises(ValueError, match="k contains"):
        _measure(counts, lambda: g.step(*(cuda.to_device(x) for x in (q, bad, v))))
    assert counts["launch"] >= 1 and counts["d2h"] == 1
    assert np.array_equal(g.S.copy_to_host(), S0) and np.array_equal(g.z.copy_to_host(), z0)
    assert g.position == 1
    g.step(*(cuda.to_device(x) for x in (q, k, v)))
    assert g.position == 2


@pytest.mark.parametrize("rule", ["additive", "decay", "delta"])
def test_float16_inputs_to_the_cuda_state(rule, monkeypatch):
    """float16 inputs, host or device, to a float32 GPU state: the CPU state's outputs (float16 out)."""
    from numba import cuda

    monkeypatch.setattr(config, "CUDA_STEP_THREADS", 3)
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 3, d)).astype(np.float16) for d in (3, 3, 2))
    kw = {"decay": {"decay": 0.9}, "delta": {"beta": 0.5}}.get(rule, {})
    fmap = "l2" if rule == "delta" else "elu"
    c = LinearAttentionState(3, 2, batch_shape=(2,), dtype=np.float32, feature_map=fmap)
    ref = c.step(q, k, v, **kw)
    assert ref.dtype == np.float16
    for host in (True, False):
        g = LinearAttentionState(3, 2, batch_shape=(2,), dtype=np.float32, device="cuda", feature_map=fmap)
        args = (q, k, v) if host else tuple(cuda.to_device(x) for x in (q, k, v))
        out = g.step(*args, **kw)
        out = out if host else out.copy_to_host()
        assert out.dtype == np.float16 and out.shape == (2, 3, 2)
        np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(g.S.copy_to_host(), c.S, rtol=1e-5, atol=1e-6)


_POOL_PTX_SCRIPT = """
import json
from numba import cuda, types
from linattn_nb.ops import _cuda_pool as P
res = {}
c = types.Array(types.int32, 1, "C")
for dt in ("float16", "float32", "float64"):
    sig = (types.Array(getattr(types, dt), 4, "A"), c, types.int64)
    ptx, _ = cuda.compile_ptx(P._count4_py, sig, cc=(9, 0))
    res["count4/" + dt] = {"entry": ".entry" in ptx, "local": ("ld.local" in ptx) or ("st.local" in ptx)}
for dt in ("int32", "float32", "float64"):
    t = getattr(types, dt)
    ptx, _ = cuda.compile_ptx(P._fill_py, (types.Array(t, 1, "C"), t), cc=(9, 0))
    res["fill/" + dt] = {"entry": ".entry" in ptx, "local": ("ld.local" in ptx) or ("st.local" in ptx)}
sig = (types.Array(types.float64, 1, "C"), types.float64, types.float64, c, types.int64)
ptx, _ = cuda.compile_ptx(P._count_range_py, sig, cc=(9, 0))
res["count_range/float64"] = {"entry": ".entry" in ptx, "local": ("ld.local" in ptx) or ("st.local" in ptx)}
for dt in ("float16", "float32", "float64"):
    sig = (types.Array(getattr(types, dt), 4, "A"), types.Array(types.float64, 1, "C"), types.int64, types.float64,
           types.float64, types.float64, c, types.int64)
    ptx, _ = cuda.compile_ptx(P._rule_input_py, sig, cc=(9, 0))
    res["rule_input/" + dt] = {"entry": ".entry" in ptx, "local": ("ld.local" in ptx) or ("st.local" in ptx)}
print(json.dumps(res))
"""


@pytest.mark.skipif(cuda_status() == "none", reason="needs numba-cuda")
def test_pool_kernels_compile_to_ptx():
    """The pool's fill and counting kernels compile for sm_90 without local memory (float16 inputs too),
    the log-factor check of a device log_decay and the conversion of device rule inputs."""
    from _ptx import run_ptx_script

    res = run_ptx_script(_POOL_PTX_SCRIPT)
    assert len(res) == 10
    for key, val in res.items():
        assert val == {"entry": True, "local": False}, (key, val)
