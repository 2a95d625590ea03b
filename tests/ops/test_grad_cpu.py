"""The CPU backward launchers (linattn_nb.ops.grad.cpu) against the float64 naive BPTT reference.

Every rule x {scan, chunked} x {float32, float64} on edge shapes (a chunk /
checkpoint interval of 4 tokens: N = 1, C - 1, C, C + 1, several chunks;
B = 1 and 3; F != M'; with and without an initial state and dHN; resets
inside a chunk and at chunk boundaries; beta at 0 and 2), with NaN-filled
output buffers, inputs checked unmodified; causality of the gradients bit for bit;
the public ``linear_attention_vjp`` through ``scan`` / ``chunked`` against
``quadratic``.  Small shapes: the serial kernels, one compilation per dtype.
"""
from __future__ import annotations

import numpy as np
import pytest

import linattn_nb
from linattn_nb import config
from linattn_nb import feature_maps as fm
from linattn_nb.ops._codes import RULES
from linattn_nb.ops.grad import cpu
from linattn_nb.ops.grad.naive import causal_backward_naive

CODES = {name: code for name, (code, _) in RULES.items()}
LAUNCHERS = {"scan": cpu.backward_scan, "chunked": cpu.backward_chunked}
C = 4  # chunk / checkpoint interval of the edge shapes
TOL = {np.float64: 1e-10, np.float32: 1e-4}

# (B, N, F, M', H0, dHN, reset tokens)
SHAPES = [
    (1, 1, 3, 2, False, False, ()),
    (3, C - 1, 5, 3, True, False, (1,)),
    (1, C, 5, 3, False, True, (0,)),
    (3, C + 1, 4, 6, True, True, (C,)),        # reset on a chunk's first token (a boundary)
    (2, 3 * C + 2, 5, 3, True, True, (2, C - 1, 2 * C)),  # inside, last of a chunk, first of one
]


def _inputs(rng, name, B, N, F, resets):
    out = {}
    for nm in RULES[name][1]:
        if nm == "beta":
            x = 2.0 * rng.random((B, N))
            x[:, 0] = 0.0
            x[:, -1] = 2.0
        else:
            x = -rng.random((B, N, F) if nm == "log_gate" else (B, N))
            for t in resets:
                if t < N:
                    x[:, t] = -np.inf
        out[nm] = x
    return out


def _problem(rng, name, dtype, B, N, F, M1, h0, dhn, resets):
    qf = rng.random((B, N, F)).astype(dtype)
    kf = rng.random((B, N, F)).astype(dtype)
    v1 = rng.standard_normal((B, N, M1)).astype(dtype)
    g1 = rng.standard_normal((B, N, M1)).astype(dtype)
    H0 = rng.standard_normal((B, F, M1)) if h0 else np.zeros((B, F, M1))
    dHN = rng.standard_normal((B, F, M1)) if dhn else None
    return qf, kf, v1, H0, g1, dHN, _inputs(rng, name, B, N, F, resets)


@pytest.fixture
def nan_outputs(monkeypatch):
    """Output buffers filled with NaN: every element must be written."""
    monkeypatch.setattr(cpu, "_alloc", lambda shape, dtype: np.full(shape, np.nan, dtype))


def _compare(got, ref, tol):
    for field, a, r in zip(got._fields, got, ref):
        if r is None:
            assert a is None, field
            continue
        a = np.asarray(a)
        assert a.shape == r.shape, field
        assert np.isfinite(a).all(), field
        scale = max(np.abs(r).max(), 1e-30)
        err = np.abs(a.astype(np.float64) - r).max() / scale
        assert err <= tol, f"{field}: relative error {err:.3g} > {tol:g}"


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("method", ["scan", "chunked"])
@pytest.mark.parametrize("name", list(RULES))
def test_matches_naive(name, method, dtype, nan_outputs):
    rng = np.random.default_rng(CODES[name])
    kw = {"checkpoint": C} if method == "scan" else {"chunk": C}
    for shape in SHAPES:
        args = _problem(rng, name, dtype, *shape)
        *arrays, inputs = args
        before = [None if x is None else x.copy() for x in arrays] + [{k: x.copy() for k, x in inputs.items()}]
        ref = causal_backward_naive(*arrays, inputs=inputs, rule=CODES[name])
        got = LAUNCHERS[method](*arrays, inputs=inputs, rule=CODES[name], **kw)
        assert got.dq.dtype == dtype and got.dk.dtype == dtype and got.dv.dtype == dtype
        assert got.dH0.dtype == np.float64
        _compare(got, ref, TOL[dtype])
        for x, y in zip(arrays, before):  # nothing passed in is modified
            assert (x is None) == (y is None) and (x is None or np.array_equal(x, y))
        assert all(np.array_equal(inputs[k], before[-1][k]) for k in inputs)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gate_chunks_by_gemms_and_by_loops(dtype, nan_outputs):
    """The gate rule's pass 1 runs a chunk as GEMMs on Q * b and K / b while the running gate products b
    stay in [e^-40, e^40] (float32; e^-300 in float64), and by its loops past that: mild chunks, chunks
    with strong gates on every feature or on some, both in one sequence, against the naive reference."""
    rng = np.random.default_rng(23)
    qf, kf, v1, H0, g1, dHN, inputs = _problem(rng, "gate", dtype, 2, 5 * C + 3, 5, 4, True, True, ())
    lg = inputs["log_gate"]
    cut = 40.0 if dtype == np.float32 else 300.0
    lg[:, C + 1:C + 3] = -0.6 * cut  # two tokens of a chunk: past the cut on every feature
    lg[:, 3 * C + 2, :2] = -1.5 * cut  # one token, two features
    lg[:, 4 * C + 1] = -0.4 * cut  # inside the cut: GEMMs on products down to e^-(0.4 cut)
    ref = causal_backward_naive(qf, kf, v1, H0, g1, dHN, inputs=inputs, rule=CODES["gate"])
    got = cpu.backward_chunked(qf, kf, v1, H0, g1, dHN, inputs=inputs, rule=CODES["gate"], chunk=C)
    _compare(got, ref, TOL[dtype])
    # the two forms of one chunk agree: a reset at its first token sends only that chunk to the loops
    mild = {"log_gate": -0.3 * rng.random(lg.shape)}
    reset = {"log_gate": mild["log_gate"].copy()}
    reset["log_gate"][:, 2 * C] = -np.inf
    a = cpu.backward_chunked(qf, kf, v1, H0, g1, dHN, inputs=mild, rule=CODES["gate"], chunk=C)
    r = causal_backward_naive(qf, kf, v1, H0, g1, dHN, inputs=mild, rule=CODES["gate"])
    _compare(a, r, TOL[dtype])
    r2 = causal_backward_naive(qf, kf, v1, H0, g1, dHN, inputs=reset, rule=CODES["gate"])
    _compare(cpu.backward_chunked(qf, kf, v1, H0, g1, dHN, inputs=reset, rule=CODES["gate"], chunk=C), r2,
             TOL[dtype])


@pytest.mark.parametrize("method", ["scan", "chunked"])
def test_default_sizes(method, nan_outputs):
    """Default chunk / checkpoint (one span covers a short sequence) and a sequence over several."""
    rng = np.random.default_rng(7)
    for name in ("additive", "gate", "gated_delta"):
        *arrays, inputs = _problem(rng, name, np.float64, 2, 150, 5, 4, True, True, (70,))
        ref = causal_backward_naive(*arrays, inputs=inputs, rule=CODES[name])
        _compare(LAUNCHERS[method](*arrays, inputs=inputs, rule=CODES[name]), ref, TOL[np.float64])


@pytest.mark.parametrize("method", ["scan", "chunked"])
def test_parallel_kernels(method, monkeypatch, nan_outputs):
    """The batch-parallel kernels (the serial ones serve the other tests' small calls)."""
    monkeypatch.setattr(config, "CPU_CHUNKED_SERIAL_MAX_WORK", 0)
    rng = np.random.default_rng(11)
    kw = {"checkpoint": C} if method == "scan" else {"chunk": C}
    for name in ("additive", "decay", "delta"):
        *arrays, inputs = _problem(rng, name, np.float64, 3, 3 * C + 1, 5, 3, True, True, (C,))
        ref = causal_backward_naive(*arrays, inputs=inputs, rule=CODES[name])
        _compare(LAUNCHERS[method](*arrays, inputs=inputs, rule=CODES[name], **kw), ref, TOL[np.float64])


@pytest.mark.parametrize("method", ["scan", "chunked"])
@pytest.mark.parametrize("name", list(RULES))
def test_causality(name, method):
    """dq[:t+1] never depends on g1 after t; dk, dv and the rule gradients from t on never on g1 before t."""
    rng = np.random.default_rng(3)
    kw = {"checkpoint": C} if method == "scan" else {"chunk": C}
    qf, kf, v1, H0, g1, dHN, inputs = _problem(rng, name, np.float64, 2, 3 * C + 1, 5, 3, True, True, (5,))
    base = LAUNCHERS[method](qf, kf, v1, H0, g1, dHN, inputs=inputs, rule=CODES[name], **kw)
    for t in (0, C - 1, C, 2 * C + 1):
        later = g1.copy()
        later[:, t + 1:] = rng.standard_normal(later[:, t + 1:].shape)
        got = LAUNCHERS[method](qf, kf, v1, H0, later, dHN, inputs=inputs, rule=CODES[name], **kw)
        assert np.array_equal(got.dq[:, :t + 1], base.dq[:, :t + 1])
        earlier = g1.copy()
        earlier[:, :t] = rng.standard_normal(earlier[:, :t].shape)
        got = LAUNCHERS[method](qf, kf, v1, H0, earlier, dHN, inputs=inputs, rule=CODES[name], **kw)
        for field in ("dk", "dv", "dfactor", "dbeta"):
            a, b = getattr(got, field), getattr(base, field)
            if b is not None:
                assert np.array_equal(a[:, t:], b[:, t:]), (field, t)


@pytest.mark.parametrize("method", ["scan", "chunked"])
def test_no_tokens(method):
    qf = np.zeros((2, 0, 3))
    v1 = np.zeros((2, 0, 4))
    dHN = np.arange(24.0).reshape(2, 3, 4)
    got = LAUNCHERS[method](qf, qf, v1, np.zeros((2, 3, 4)), v1, dHN, inputs={"log_decay": np.zeros((2, 0))},
                            rule=CODES["decay"])
    assert got.dq.shape == (2, 0, 3) and got.dv.shape == (2, 0, 4) and got.dfactor.shape == (2, 0)
    assert np.array_equal(got.dH0, dHN) and got.dH0 is not dHN


def test_errors():
    qf = np.zeros((1, 2, 3))
    v1 = np.zeros((1, 2, 4))
    H0 = np.zeros((1, 3, 4))
    with pytest.raises(ValueError, match="kf"):
        cpu.backward_scan(qf, qf.astype(np.float32), v1, H0, v1)
    with pytest.raises(ValueError, match="g1"):
        cpu.backward_chunked(qf, qf, v1, H0, v1[:, :1])
    with pytest.raises(ValueError, match="qf"):
        cpu.backward_chunked(qf.astype(np.float16), qf, v1, H0, v1)
    with pytest.raises(ValueError, match="H0"):
        cpu.backward_scan(qf, qf, v1, H0[:, :2], v1)
    with pytest.raises(ValueError, match="dHN"):
        cpu.backward_scan(qf, qf, v1, H0, v1, H0.astype(np.float32))
    with pytest.raises(ValueError, match="inputs"):
        cpu.backward_chunked(qf, qf, v1, H0, v1, rule=CODES["decay"])
    with pytest.raises(ValueError, match="chunk"):
        cpu.backward_chunked(qf, qf, v1, H0, v1, chunk=0)
    with pytest.raises(ValueError, match="checkpoint"):
        cpu.backward_scan(qf, qf, v1, H0, v1, checkpoint=0)


# ---------------------------------------------------------------------------
# through the public front end
# ---------------------------------------------------------------------------
@pytest.fixture
def identity_vjp(monkeypatch):
    """IdentityFeatureMap.vjp until the feature-map vjps land (only where it is not defined)."""
    if "vjp" not in fm.IdentityFeatureMap.__dict__ and not hasattr(fm.FeatureMap, "vjp"):
        monkeypatch.setattr(fm.IdentityFeatureMap, "vjp", lambda self, x, g, **kw: (g, None), raising=False)


def _rule_kwargs(rng, name, b, h, n, f):
    if name == "decay":
        return {"log_decay": -rng.random((b, h, n))}
    if name == "gate":
        return {"log_decay": -rng.random((b, h, n, f))}
    if name == "delta":
        return {"beta": 2.0 * rng.random((b, h, n))}
    if name == "gated_delta":
        ld = -rng.random((b, h, n))
        ld[..., 3] = -np.inf
        return {"beta": 2.0 * rng.random((b, h, n)), "log_decay": ld}
    return {}


@pytest.mark.parametrize("method", ["scan", "chunked"])
@pytest.mark.parametrize("name", list(RULES))
def test_vjp_front_end(name, method, identity_vjp):
    rng = np.random.default_rng(5)
    b, h, n, f, m = 1, 2, 9, 4, 3
    q = rng.random((b, h, n, f)) + 0.1
    k = rng.random((b, h, n, f)) + 0.1
    v = rng.standard_normal((b, h, n, m))
    g = rng.standard_normal((b, h, n, m))
    kw = dict(causal=True, feature_map=None, **_rule_kwargs(rng, name, b, h, n, f))
    ref = linattn_nb.linear_attention_vjp(q, k, v, g, method="quadratic", **kw)
    got = linattn_nb.linear_attention_vjp(q, k, v, g, method=method, **kw)
    for field in ("dq", "dk", "dv", "d_decay", "d_log_decay", "d_beta"):
        a, r = getattr(got, field), getattr(ref, field)
        assert (a is None) == (r is None), field
        if r is not None:
            np.testing.assert_allclose(a, r, rtol=1e-12, atol=1e-12 * np.abs(r).max(), err_msg=field)


def test_backward_chunk_defaults(monkeypatch):
    """32 tokens a chunk (the gate rule too, since its chunks run as GEMMs); the override wins; never more
    than the sequence."""
    from linattn_nb import config as cfg

    assert cfg.cpu_backward_chunk(4096, 64, 65, np.float32) == 32
    assert cfg.cpu_backward_chunk(4096, 128, 65, np.float64) == 32
    assert cfg.cpu_backward_chunk(5, 64, 65, np.float32) == 5
    monkeypatch.setattr(cfg, "BACKWARD_CHUNK", 24)
    assert cfg.cpu_backward_chunk(4096, 64, 65, np.float32) == 24
