"""The chunked CPU backward of the delta and gated delta rules (the WY/UT form differentiated chunk by chunk),
whose kernel serves the decay rule as well.

Against the float64 naive BPTT reference on edge shapes for a chunk of 8
tokens (N = 1, below a chunk, one chunk, one more, not a multiple, several
chunks; B = 1 and 3; F != M'; with and without an initial state and dHN;
beta 0 on some tokens; the gated rule's log-decay 0, negative and -inf), in
float64 (to 1e-12 relative) and float32 (loosely); both kernel twins; the
public ``linear_attention_vjp(method="chunked")`` against ``method="scan"``.
"""
from __future__ import annotations

import numpy as np
import pytest

import linattn_nb
from linattn_nb import config
from linattn_nb.ops._codes import RULE_ADDITIVE, RULE_DECAY, RULE_DELTA, RULE_GATE, RULE_GATED_DELTA
from linattn_nb.ops.grad import cpu
from linattn_nb.ops.grad.naive import causal_backward_naive

C = 8
RULES = {"delta": RULE_DELTA, "gated_delta": RULE_GATED_DELTA}
#: the rules whose forward saves its chunk values for the backward (the decay rule: the chunk-start states)
SAVING = {**RULES, "decay": RULE_DECAY}
# (B, N, F, M', H0, dHN)
SHAPES = [
    (1, 1, 3, 4, False, False),
    (3, C - 3, 5, 3, True, False),
    (1, C, 4, 6, False, True),
    (3, C + 1, 5, 3, True, True),
    (2, 3 * C + 5, 6, 4, True, True),
    (1, 4 * C, 3, 5, False, False),
]


def _problem(rng, gated, dtype, B, N, F, M1, h0, dhn):
    scale = 1.0 / np.sqrt(F)  # |k|^2 <= 1: beta k k^T a contraction, as the feature maps of the rule give
    qf = (scale * rng.random((B, N, F))).astype(dtype)
    kf = (scale * rng.random((B, N, F))).astype(dtype)
    v1 = rng.standard_normal((B, N, M1)).astype(dtype)
    v1[:, :, -1] = 1.0  # the normaliser's column of ones
    g1 = rng.standard_normal((B, N, M1)).astype(dtype)
    H0 = rng.standard_normal((B, F, M1)) if h0 else np.zeros((B, F, M1))
    dHN = rng.standard_normal((B, F, M1)) if dhn else None
    beta = rng.uniform(0.0, 1.0, (B, N))
    beta[:, ::3] = 0.0
    beta[:, 1::5] = 1.0
    inputs = {"beta": beta}
    if gated:
        ld = -rng.random((B, N))
        ld[:, ::4] = 0.0
        for t in (2, C, 2 * C + 3):  # inside a chunk, on a chunk's first token
            if t < N:
                ld[:, t] = -np.inf
        inputs["log_decay"] = ld
    return qf, kf, v1, H0, g1, dHN, inputs


@pytest.fixture
def nan_outputs(monkeypatch):
    """Output buffers filled with NaN (every element must be written); the token recurrence not reachable."""
    monkeypatch.setattr(cpu, "_alloc", lambda shape, dtype: np.full(shape, np.nan, dtype))

    def no_scan(*args, **kwargs):
        raise AssertionError("backward_chunked ran the token recurrence")

    monkeypatch.setattr(cpu, "_run_scan", no_scan)


def _compare(got, ref, tol):
    for field, a, r in zip(got._fields, got, ref):
        if r is None:
            assert a is None, field
            continue
        a = np.asarray(a, np.float64)
        assert a.shape == r.shape, field
        assert np.isfinite(a).all(), field
        err = np.abs(a - r).max() / max(np.abs(r).max(), 1e-30)
        assert err <= tol, f"{field}: relative error {err:.3g} > {tol:g}"


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("name", list(RULES))
def test_matches_naive(name, dtype, tol, nan_outputs):
    rng = np.random.default_rng(RULES[name])
    for shape in SHAPES:
        *arrays, inputs = _problem(rng, name == "gated_delta", dtype, *shape)
        ref = causal_backward_naive(*arrays, inputs=inputs, rule=RULES[name])
        got = cpu.backward_chunked(*arrays, inputs=inputs, rule=RULES[name], chunk=C)
        assert got.dq.dtype == dtype and got.dv.dtype == dtype and got.dH0.dtype == np.float64
        _compare(got, ref, tol)


def test_default_chunk_and_parallel(monkeypatch, nan_outputs):
    """The default chunk and one of 37 tokens (row blocks of the solves: 16, 16, 5) over several chunks,
    through the batch-parallel twin as well."""
    rng = np.random.default_rng(4)
    for name in RULES:
        *arrays, inputs = _problem(rng, name == "gated_delta", np.float64, 3, 150, 5, 4, True, True)
        ref = causal_backward_naive(*arrays, inputs=inputs, rule=RULES[name])
        _compare(cpu.backward_chunked(*arrays, inputs=inputs, rule=RULES[name]), ref, 1e-12)
        _compare(cpu.backward_chunked(*arrays, inputs=inputs, rule=RULES[name], chunk=37), ref, 1e-12)
        with monkeypatch.context() as mp:
            mp.setattr(config, "CPU_CHUNKED_SERIAL_MAX_WORK", 0)
            _compare(cpu.backward_chunked(*arrays, inputs=inputs, rule=RULES[name], chunk=C), ref, 1e-12)


def test_decay_rule(nan_outputs):
    """The decay rule runs the same kernel without the transform (a reset inside a chunk and on a first token)."""
    rng = np.random.default_rng(6)
    for B, N, F, M1, chunk in ((1, 1, 3, 4, 8), (3, 150, 5, 4, 37), (2, 70, 4, 6, None)):
        *arrays, inputs = _problem(rng, True, np.float64, B, N, F, M1, True, True)
        inputs = {"log_decay": inputs["log_decay"]}
        ref = causal_backward_naive(*arrays, inputs=inputs, rule=RULE_DECAY)
        _compare(cpu.backward_chunked(*arrays, inputs=inputs, rule=RULE_DECAY, chunk=chunk), ref, 1e-12)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("name", list(RULES))
def test_vjp_chunked_matches_scan(name, normalize):
    rng = np.random.default_rng(9)
    b, h, n, f, m = 2, 2, 70, 5, 3
    q = rng.random((b, h, n, f)) + 0.1
    k = rng.random((b, h, n, f)) + 0.1
    v = rng.standard_normal((b, h, n, m))
    g = rng.standard_normal((b, h, n, m))
    kw = dict(causal=True, feature_map="l2", normalize=normalize, beta=rng.random((b, h, n)))
    if name == "gated_delta":
        ld = -0.3 * rng.random((b, h, n))
        ld[..., 40] = -np.inf
        kw["log_decay"] = ld
    ref = linattn_nb.linear_attention_vjp(q, k, v, g, method="scan", **kw)
    got = linattn_nb.linear_attention_vjp(q, k, v, g, method="chunked", **kw)
    for field in ("dq", "dk", "dv", "d_log_decay", "d_beta"):
        a, r = getattr(got, field), getattr(ref, field)
        assert (a is None) == (r is None), field
        if r is not None:
            np.testing.assert_allclose(a, r, rtol=1e-10, atol=1e-11 * np.abs(r).max(), err_msg=field)


def _saving_forward(arrays, inputs, code, chunk, nan_fill=True):
    """The chunked forward on the backward's arrays (values with their ones column, as the gradient front
    end runs it), saving its chunk values; ``(out, (C, ck, Ys, KKs))`` with NaN where nothing was saved."""
    from linattn_nb.ops.causal.chunked import causal_chunked

    qf, kf, v1, H0, g1, dHN = arrays
    B, N, F = qf.shape
    M1 = v1.shape[2]
    saved = cpu.save_arrays(code, B, N, F, M1, qf.dtype, chunk=chunk)
    if nan_fill:
        for x in saved[1:]:
            x.fill(np.nan)
    Hx = np.zeros((B, F, M1 + 1))
    Hx[:, :, :M1] = H0
    out = np.empty((B, N, M1), qf.dtype)
    causal_chunked(qf, kf, v1, Hx, out, code=0, eps=None, inputs=inputs, normalize=False, chunk=saved[0],
                   save=saved[1:], rule=code)
    return out, saved, Hx


def _saving_problem(rng, name, dtype, shape):
    """:func:`_problem` for a saving rule: the decay rule takes the gated delta rule's log-decay (resets
    included) and no beta."""
    *arrays, inputs = _problem(rng, name != "delta", dtype, *shape)
    if name == "decay":
        inputs = {"log_decay": inputs["log_decay"]}
    return arrays, inputs


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("name", list(SAVING))
def test_backward_from_saved_forward(name, dtype, tol, nan_outputs):
    """The backward's reverse pass alone, on what the forward saved (arrays NaN-filled first: every value
    it reads was written), against the naive reference; the saving forward's outputs and final state are
    those of the plain forward, bit for bit."""
    from linattn_nb.ops.causal.chunked import causal_chunked

    rng = np.random.default_rng(11 + SAVING[name])
    for shape in SHAPES:
        arrays, inputs = _saving_problem(rng, name, dtype, shape)
        ref = causal_backward_naive(*arrays, inputs=inputs, rule=SAVING[name])
        out, saved, Hx = _saving_forward(arrays, inputs, SAVING[name], C)
        qf, kf, v1, H0 = arrays[:4]
        plain_H = np.zeros_like(Hx)
        plain_H[:, :, : v1.shape[2]] = H0
        plain = np.empty_like(out)
        causal_chunked(qf, kf, v1, plain_H, plain, code=0, eps=None, inputs=inputs, normalize=False, chunk=C,
                       rule=SAVING[name])
        np.testing.assert_array_equal(out, plain)
        np.testing.assert_array_equal(Hx, plain_H)
        got = cpu.backward_chunked(*arrays, inputs=inputs, rule=SAVING[name], saved=saved)
        _compare(got, ref, tol)
        # no outputs asked for (out=None): the same state and saved values, nothing else computed
        C_, ck, Ys, KKs = cpu.save_arrays(SAVING[name], *qf.shape, v1.shape[2], qf.dtype, chunk=C)
        H2 = np.zeros_like(Hx)
        H2[:, :, : v1.shape[2]] = H0
        assert causal_chunked(qf, kf, v1, H2, None, code=0, eps=None, inputs=inputs, normalize=False, chunk=C,
                              save=(ck, Ys, KKs), rule=SAVING[name]).shape == (qf.shape[0], 0, v1.shape[2])
        np.testing.assert_array_equal(H2, Hx)
        n = qf.shape[1]
        for x, y in ((ck, saved[1]), (Ys, saved[2]), (KKs, saved[3])):
            for c in range(x.shape[1]):  # the last chunk's rows past the sequence are never written
                rows = min(C, n - c * C) if x.ndim == 4 and x is not ck else None
                np.testing.assert_array_equal(x[:, c, :rows], y[:, c, :rows])


def test_saved_checks(nan_outputs):
    """Saved arrays of the wrong shape, dtype or chunk are refused with their name; a rule without a saving
    forward refuses them."""
    from linattn_nb.ops.causal.chunked import causal_chunked

    rng = np.random.default_rng(5)
    *arrays, inputs = _problem(rng, False, np.float64, 2, 20, 4, 3, True, False)
    qf, kf, v1, H0, g1, dHN = arrays
    C_, ck, Ys, KKs = cpu.save_arrays(RULE_DELTA, 2, 20, 4, 3, np.float64, chunk=8)
    with pytest.raises(ValueError, match="saved: Ys"):
        cpu.backward_chunked(*arrays, inputs=inputs, rule=RULE_DELTA, saved=(C_, ck, Ys[:, :, :4], KKs))
    with pytest.raises(ValueError, match="saved: ck"):
        cpu.backward_chunked(*arrays, inputs=inputs, rule=RULE_DELTA, saved=(C_, np.zeros(ck.shape, np.float32), Ys, KKs))
    with pytest.raises(ValueError, match="only the decay and delta rules"):
        cpu.backward_chunked(*arrays, rule=RULE_ADDITIVE, saved=(C_, ck, Ys, KKs))
    with pytest.raises(ValueError, match="saved: Ys"):  # the decay rule saves no residuals
        cpu.backward_chunked(*arrays, inputs={"log_decay": np.zeros((2, 20))}, rule=RULE_DECAY,
                             saved=(C_, ck, Ys, KKs))
    with pytest.raises(ValueError, match="save: Ys"):
        causal_chunked(qf, kf, v1, np.zeros((2, 4, 4)), np.empty((2, 20, 3)), code=0, eps=None,
                       inputs={"log_decay": np.zeros((2, 20))}, normalize=False, chunk=8, save=(ck, Ys, KKs),
                       rule=RULE_DECAY)
    with pytest.raises(ValueError, match="rule: code .* no saved chunk values"):
        cpu.save_arrays(RULE_GATE, 2, 20, 4, 3, np.float64)
    Hx = np.zeros((2, 4, 4))
    out = np.empty((2, 20, 3))
    with pytest.raises(ValueError, match="save: ck .* shape \\(2, 5, 4, 3\\) \\(chunk 4\\)"):
        causal_chunked(qf, kf, v1, Hx, out, code=0, eps=None, inputs=inputs, normalize=False, chunk=4,
                       save=(ck, Ys, KKs), rule=RULE_DELTA)
    with pytest.raises(ValueError, match="save: KKs"):
        causal_chunked(qf, kf, v1, Hx, out, code=0, eps=None, inputs=inputs, normalize=False, chunk=8,
                       save=(ck, Ys, np.ascontiguousarray(KKs[:, :, :, :7])), rule=RULE_DELTA)
    with pytest.raises(ValueError, match="out: None"):
        causal_chunked(qf, kf, v1, Hx, None, code=0, eps=None, inputs=inputs, normalize=False, chunk=8,
                       rule=RULE_DELTA)
    assert [cpu.takes_saved(r) for r in (RULE_ADDITIVE, RULE_DECAY, RULE_GATE, RULE_DELTA, RULE_GATED_DELTA)] == [
        False, True, False, True, True]
    _, ck, Ys, KKs = cpu.save_arrays(RULE_DECAY, 2, 20, 4, 3, np.float32)  # the backward's chunk, no residuals
    C = config.cpu_backward_chunk(20, 4, 3, np.float32)
    assert ck.shape == (2, -(-20 // C), 4, 3) and Ys.shape[2] == 0 and KKs.shape[2:] == (0, 0)


def _spy_saved(monkeypatch):
    """A list that receives, per call of the chunked delta/decay kernels' launchers, whether it was given the
    forward's saved chunk values (the decay rule's kernel with anchors never is: it keeps its own)."""
    seen = []
    real = cpu._run_chunked_delta
    real_anchors = cpu._run_decay_carry

    def spy(*args, **kwargs):
        seen.append(kwargs.get("have", args[9] if len(args) > 9 else None) is not None)
        return real(*args, **kwargs)

    def spy_anchors(*args, **kwargs):
        seen.append(False)
        return real_anchors(*args, **kwargs)

    monkeypatch.setattr(cpu, "_run_chunked_delta", spy)
    monkeypatch.setattr(cpu, "_run_decay_carry", spy_anchors)
    return seen


@pytest.mark.parametrize("name", list(RULES))
def test_vjp_uses_saved_forward(name, monkeypatch):
    """``linear_attention_vjp(method="chunked")`` of a delta rule skips the backward's first pass (the
    forward saved its values), with the gradients of the backward that runs both passes."""
    from linattn_nb import _gradfront as GF

    rng = np.random.default_rng(13)
    b, n, f, m = 3, 45, 4, 3
    q, k = rng.random((b, n, f)) + 0.1, rng.random((b, n, f)) + 0.1
    v, g = rng.standard_normal((b, n, m)), rng.standard_normal((b, n, m))
    kw = dict(causal=True, feature_map="l2", method="chunked", beta=rng.random((b, n)))
    if name == "gated_delta":
        kw["log_decay"] = -0.3 * rng.random((b, n))
    seen = _spy_saved(monkeypatch)
    got = linattn_nb.linear_attention_vjp(q, k, v, g, **kw)
    monkeypatch.setattr(GF, "_saves", lambda req, unread=False: False)
    ref = linattn_nb.linear_attention_vjp(q, k, v, g, **kw)
    assert seen == [True, False]
    for field in ("dq", "dk", "dv", "d_log_decay", "d_beta"):
        a, r = getattr(got, field), getattr(ref, field)
        assert (a is None) == (r is None), field
        if r is not None:
            np.testing.assert_allclose(a, r, rtol=1e-12, atol=1e-13 * np.abs(r).max(), err_msg=field)


@pytest.mark.parametrize("normalize", [False, True])
def test_decay_forward_saves_for_its_backward_where_it_runs(normalize, monkeypatch):
    """The decay rule's front-end forward with outputs (the PyTorch adapter's) saves its chunk-start states for
    unnormalised outputs only, and the backward then skips its first pass with the same gradients; the
    normalised outputs go to the fused backward and save nothing."""
    from linattn_nb import _gradfront as GF

    rng = np.random.default_rng(17)
    b, n, f, m = 3, 45, 4, 3
    q, k = rng.random((b, n, f)) + 0.1, rng.random((b, n, f)) + 0.1
    v, g = rng.standard_normal((b, n, m)), rng.standard_normal((b, n, m))
    ld = -0.3 * rng.random((b, n))
    ld[:, 9] = -np.inf  # a reset
    kw = dict(feature_map="elu", causal=True, method="chunked", device="cpu", eps=1e-8, check_finite=True,
              initial_state=None, log_decay=ld, normalize=normalize)
    seen = _spy_saved(monkeypatch)
    req = GF.prepare(q, k, v, **kw)
    out, nd, _ = GF.forward(req)
    assert (req.saved is not None) == (not normalize)
    got = GF.backward(req, nd, g)
    monkeypatch.setattr(GF, "_saves", lambda req, unread=False: False)
    req = GF.prepare(q, k, v, **kw)
    out2, nd2, _ = GF.forward(req)
    ref = GF.backward(req, nd2, g)
    assert seen == [not normalize, False]
    np.testing.assert_allclose(out, out2, rtol=1e-13)
    for field in ("dq", "dk", "dv", "d_log_decay"):
        a, r = getattr(got, field), getattr(ref, field)
        np.testing.assert_allclose(a, r, rtol=1e-12, atol=1e-13 * np.abs(r).max(), err_msg=field)
