"""The normalised additive rule's fused CPU backward (``backward_chunked_normalized``): no forward before it,
the normalisers and ``g . num`` from its own products.  Checked against a float64 reference built from the
naive forward, the normalised output's gradient written out in NumPy and the naive backward."""
import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import _gradfront as GF
from linattn_nb.ops.grad import cpu
from linattn_nb.ops._codes import RULE_ADDITIVE, RULE_DECAY, RULE_DELTA, RULE_GATE
from linattn_nb.ops.grad.naive import causal_backward_naive


@pytest.fixture
def nan_outputs(monkeypatch):
    """Output buffers filled with NaN: every element must be written."""
    monkeypatch.setattr(cpu, "_alloc", lambda shape, dtype: np.full(shape, np.nan, dtype))


def _inputs(B, N, F, M, dtype, seed=0, scale=1.0, state=False, grad_state=False):
    rng = np.random.default_rng(seed)
    qf, kf = (scale * rng.uniform(0.05, 1.5, (B, N, F)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((B, N, M)).astype(dtype)
    g = rng.standard_normal((B, N, M)).astype(dtype)
    v1 = np.concatenate([v, np.ones((B, N, 1), dtype)], axis=2)
    H0 = np.zeros((B, F, M + 1))
    if state:
        H0[:, :, :M] = rng.standard_normal((B, F, M))
        H0[:, :, M] = rng.uniform(0.1, 1.0, (B, F))
    dHN = rng.standard_normal((B, F, M + 1)) if grad_state else None
    return qf, kf, v1, H0, g, dHN


def _reference(qf, kf, v1, H0, g, dHN, eps, inputs=None):
    """float64: o = num / den' (den' = den, or eps where den <= eps with no gradient to den); ``inputs`` the
    decay rule's (``log_decay`` (B, N)), None for the additive rule."""
    qf, kf, v1, g = (x.astype(np.float64) for x in (qf, kf, v1, g))
    B, N, F = qf.shape
    M = g.shape[2]
    if inputs is None:
        a = np.ones((B, N, 1))
    elif "log_gate" in inputs:
        a = np.exp(inputs["log_gate"])
    else:
        a = np.exp(inputs["log_decay"])[:, :, None]
    nd = np.empty((B, N, M + 1))
    H = H0.copy()
    for t in range(N):
        H = a[:, t, :, None] * H + np.einsum("bf,bm->bfm", kf[:, t], v1[:, t])
        nd[:, t] = np.einsum("bf,bfm->bm", qf[:, t], H)
    num, den = nd[..., :M], nd[..., M]
    active = np.ones(den.shape, bool) if eps is None else den > eps
    d = np.where(active, den, eps if eps is not None else 0.0)
    g1 = np.empty((B, N, M + 1))
    g1[..., :M] = g / d[..., None]
    g1[..., M] = np.where(active, -(g * num).sum(-1) / d ** 2, 0.0)
    if inputs is None:
        return causal_backward_naive(qf, kf, v1, H0, g1, dHN), g1
    rule = RULE_GATE if "log_gate" in inputs else RULE_DECAY
    return causal_backward_naive(qf, kf, v1, H0, g1, dHN, inputs=inputs, rule=rule), g1


def _decay(B, N, seed):
    rng = np.random.default_rng(seed + 100)
    lg = rng.uniform(-0.3, -0.001, (B, N))
    lg[0, N // 2] = -np.inf  # a reset
    return {"log_decay": lg}


def _gate(B, N, F, seed):
    """Per-feature log-gates; sequence 0 has a reset (its chunk takes the loops, not the GEMMs on Q * b and
    K / b), sequence 1 none."""
    rng = np.random.default_rng(seed + 200)
    lg = rng.uniform(-0.5, -0.001, (B, N, F))
    lg[0, N // 2, 1] = -np.inf
    return {"log_gate": lg}


def _rule_inputs(rule, B, N, F, seed):
    if rule == RULE_DECAY:
        return _decay(B, N, seed)
    if rule == RULE_GATE:
        return _gate(B, N, F, seed)
    return None


RULES = [RULE_ADDITIVE, RULE_DECAY, RULE_GATE]


def _close(got, want, dtype, what):
    tol = 2e-5 if dtype == np.float32 else 1e-11
    got = np.asarray(got, np.float64)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * (1 + np.abs(want).max()), err_msg=what)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,chunk,block", [(1, None, None), (2, 1, 1), (7, 3, 2), (49, None, None), (49, 48, 8),
                                           (50, 16, 16), (97, 5, 3), (130, 64, 7)])
@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("rule", RULES)
def test_matches_reference(dtype, N, chunk, block, state, rule, nan_outputs):
    qf, kf, v1, H0, g, dHN = _inputs(2, N, 5, 3, dtype, seed=N, state=state, grad_state=state)
    inputs = _rule_inputs(rule, 2, N, 5, N)
    ref, g1_ref = _reference(qf, kf, v1, H0, g, dHN, None, inputs)
    g1 = np.full((2, N, 4), np.nan, dtype)
    grads, g_ok, res_ok = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, dHN, chunk=chunk, block=block, g1=g1,
                                                          rule=rule, inputs=inputs)
    assert g_ok and res_ok
    _close(g1, g1_ref, dtype, "g1")
    for name in ("dq", "dk", "dv", "dH0"):  # dv with the ones column's, as backward_chunked's
        _close(getattr(grads, name), getattr(ref, name), dtype, name)
    if rule == RULE_ADDITIVE:
        assert grads.dfactor is None
    else:
        _close(grads.dfactor, ref.dfactor, dtype, "dfactor")
    assert grads.dbeta is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rule", RULES)
def test_floor_of_the_normaliser(dtype, rule, nan_outputs):
    """Rows whose normaliser is at or below eps divide by eps and pass no gradient to it."""
    qf, kf, v1, H0, g, dHN = _inputs(1, 40, 4, 3, dtype, seed=3)
    qf[:, ::3] *= 1e-6  # a third of the rows below the floor
    eps = 1e-3
    inputs = _rule_inputs(rule, 1, 40, 4, 3)
    ref, g1_ref = _reference(qf, kf, v1, H0, g, dHN, eps, inputs)
    assert (g1_ref[0, :, 3] == 0).sum() >= 10  # the floor is active somewhere
    g1 = np.full((1, 40, 4), np.nan, dtype)
    grads, _, _ = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, eps=eps, chunk=16, block=4, g1=g1, rule=rule,
                                                  inputs=inputs)
    _close(g1, g1_ref, dtype, "g1")
    for name in ("dq", "dk", "dH0"):
        _close(getattr(grads, name), getattr(ref, name), dtype, name)


@pytest.mark.parametrize("rule", RULES)
def test_flags_a_gradient_not_finite_and_an_overflow(rule):
    qf, kf, v1, H0, g, _ = _inputs(2, 20, 4, 3, np.float32)
    inputs = {RULE_ADDITIVE: None, RULE_DECAY: {"log_decay": np.full((2, 20), -1e-3)},
              RULE_GATE: {"log_gate": np.full((2, 20, 4), -1e-3)}}[rule]
    kw = dict(chunk=8, rule=rule, inputs=inputs)
    g[1, 5, 2] = np.nan
    _, g_ok, _ = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, **kw)
    assert not g_ok  # (its NaN reaches g . num: the results' flag may be down too)
    g[1, 5, 2] = 0.0
    _, g_ok, res_ok = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, **kw)
    assert g_ok and res_ok
    kf[0, :, 0] = 3e37  # finite features whose float32 normaliser overflows
    _, g_ok, res_ok = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, **kw)
    assert g_ok and not res_ok


# (rule, log-factor, config.BACKWARD_DECAY_ANCHOR, the array the kernel keeps, its shape): the decay rule keeps
# every fourth chunk's state, and that of every chunk that decays by more than 2^-10 (-0.9 * 8 tokens; not the
# last chunk's 5 tokens); with anchors 0, the kernel that keeps every chunk's state
@pytest.mark.parametrize("rule, lf, anchor, kept, shape", [(RULE_DECAY, -0.05, 4, "anchors", (2, 2, 5, 4)),
                                                           (RULE_DECAY, -0.9, 4, "anchors", (2, 5, 5, 4)),
                                                           (RULE_DECAY, -0.05, 0, "ck", (2, 6, 5, 4)),
                                                           (RULE_GATE, -0.05, 4, "ck", (2, 6, 5, 4))])
def test_chunk_states_from_the_callers_empty(rule, lf, anchor, kept, shape, monkeypatch):
    """``empty``: the decay and gate rules' chunk-start states come from the caller's maker (a work array it
    keeps, NaN-filled here: every element the kernel reads it writes first), the same gradients bit for bit
    as with a fresh array, called again on the same array."""
    monkeypatch.setattr(la.config, "BACKWARD_DECAY_ANCHOR", anchor)
    qf, kf, v1, H0, g, dHN = _inputs(2, 45, 5, 3, np.float32, seed=4, state=True, grad_state=True)
    inputs = {RULE_DECAY: {"log_decay": np.full((2, 45), lf)},
              RULE_GATE: {"log_gate": np.full((2, 45, 5), lf)}}[rule]
    kw = dict(chunk=8, rule=rule, inputs=inputs, eps=1e-6)
    want, _, _ = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, dHN, **kw)
    made = {}

    def empty(name, shape, dtype):
        if name not in made:
            made[name] = np.full(shape, np.nan, dtype)
        return made[name]

    for _ in range(2):
        got, g_ok, res_ok = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, dHN, empty=empty, **kw)
        assert g_ok and res_ok
        for name in ("dq", "dk", "dv", "dH0", "dfactor"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert made[kept].shape == shape and made[kept].dtype == np.float32
    assert ("ck" in made) == (kept == "ck")  # no state of every chunk where the anchors do


def test_bad_arguments_name_themselves():
    qf, kf, v1, H0, g, _ = _inputs(1, 8, 4, 3, np.float32)
    with pytest.raises(ValueError, match="g must have shape"):
        cpu.backward_chunked_normalized(qf, kf, v1, H0, g[:, :, :2])
    with pytest.raises(ValueError, match="g must have the working dtype"):
        cpu.backward_chunked_normalized(qf, kf, v1, H0, g.astype(np.float64))
    with pytest.raises(ValueError, match="g1 must be"):
        cpu.backward_chunked_normalized(qf, kf, v1, H0, g, g1=np.empty((1, 8, 3), np.float32))
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        cpu.backward_chunked_normalized(qf, kf, v1, H0, g, chunk=0)
    with pytest.raises(ValueError, match="block must be >= 1"):
        cpu.backward_chunked_normalized(qf, kf, v1, H0, g, block=0)
    with pytest.raises(ValueError, match="rule: the fused normalised backward takes"):
        cpu.backward_chunked_normalized(qf, kf, v1, H0, g, rule=RULE_DELTA, inputs={"beta": np.ones((1, 8))})


@pytest.mark.parametrize("decay", [None, "token", "feature"])
def test_vjp_takes_it_and_agrees_with_the_forward_path(decay, monkeypatch):
    """``linear_attention_vjp`` of the additive, decay and gate rules' normalised outputs (chunked, CPU) runs
    this kernel and no forward; its gradients are those of the path through the forward (float32, within
    rounding), the decay's or gate's included."""
    rng = np.random.default_rng(5)
    q, k, v, g = (rng.standard_normal((2, 3, 70, 8)).astype(np.float32) for _ in range(4))
    kw = {}
    if decay:
        kw["log_decay"] = rng.uniform(-0.2, -0.01, (2, 3, 70) if decay == "token" else (2, 3, 70, 8))
    calls = []
    real = GF.backward_chunked_normalized
    monkeypatch.setattr(GF, "backward_chunked_normalized", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(GF, "forward", lambda *a, **k: pytest.fail("the forward ran"))
    got = la.linear_attention_vjp(q, k, v, g, causal=True, method="chunked", **kw)
    assert calls
    monkeypatch.undo()
    req = GF.prepare(q, k, v, feature_map="elu", causal=True, method="chunked", device="cpu", eps=None,
                     check_finite=True, initial_state=None, **kw)
    _, nd, _ = GF.forward(req, want_out=False)
    want = GF.backward(req, nd, g)
    names = ("dq", "dk", "dv") + (("d_log_decay",) if decay else ())
    for name in names:
        a, b = getattr(got, name), getattr(want, name)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(), err_msg=name)
    assert got.dq.dtype == np.float32


def test_vjp_of_a_wider_gradient_takes_the_forward_path(monkeypatch):
    """A float64 ``grad_out`` of float32 inputs is not cast to float32 first: the path through the forward."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 30, 4)).astype(np.float32) for _ in range(3))
    g = rng.standard_normal((1, 30, 4))
    monkeypatch.setattr(GF, "backward_chunked_normalized", lambda *a, **kw: pytest.fail("fused path taken"))
    got = la.linear_attention_vjp(q, k, v, g, causal=True, method="chunked")
    monkeypatch.undo()
    want = la.linear_attention_vjp(*(x.astype(np.float64) for x in (q, k, v)), g, causal=True, method="chunked")
    np.testing.assert_allclose(got.dq, want.dq, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------
# the map's VJP inside the kernels (maps=(xq, xk, code))
# --------------------------------------------------------------------------
from linattn_nb.ops._codes import (KERNEL_CODE_ELU, KERNEL_CODE_NONE, KERNEL_CODE_RELU,  # noqa: E402
                                    KERNEL_CODE_SQUARED_RELU)
from linattn_nb.ops.grad import _maps  # noqa: E402

MAP_CODES = [KERNEL_CODE_ELU, KERNEL_CODE_RELU, KERNEL_CODE_SQUARED_RELU]


def _map_inputs(B, N, F, dtype, seed):
    """Raw inputs with the values where a map's derivative turns: 0, -0, tiny negatives whose exp rounds
    to 1, and large ones."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, B, N, F)).astype(dtype)
    special = np.array([0.0, -0.0, -1e-9, -3e-8, 1e-9, -20.0, 4.0, -1e-30], dtype)
    x.reshape(-1)[: special.size] = special
    x.reshape(-1)[-special.size:] = special
    return x[0], x[1]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("code", MAP_CODES)
@pytest.mark.parametrize("rule", RULES)
def test_maps_in_the_kernel_are_the_maps_vjp_bit_for_bit(dtype, code, rule, nan_outputs):
    """With ``maps``, dq and dk are those of the map's own pass over the kernel's feature gradients, bit
    for bit, and dv, dH0, g1 are unchanged."""
    B, N, F, M = 2, 61, 5, 3
    xq, xk = _map_inputs(B, N, F, dtype, seed=code)
    qf, kf = (_maps.features(x, code, dtype)[0] for x in (xq, xk))
    _, _, v1, H0, g, _ = _inputs(B, N, F, M, dtype, seed=7)
    inputs = _rule_inputs(rule, B, N, F, 3)
    kw = dict(chunk=16, block=4, rule=rule, inputs=inputs, eps=1e-6)  # the floor: a ReLU's zero rows
    g1a, g1b = (np.full((B, N, M + 1), np.nan, dtype) for _ in range(2))
    plain, g_ok, res_ok = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, g1=g1a, **kw)
    fused, g_ok2, res_ok2 = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, g1=g1b, maps=(xq, xk, code), **kw)
    assert g_ok and res_ok and g_ok2 and res_ok2
    np.testing.assert_array_equal(fused.dq, _maps.vjp(xq, plain.dq, code, dtype))
    np.testing.assert_array_equal(fused.dk, _maps.vjp(xk, plain.dk, code, dtype))
    for name in ("dv", "dH0"):
        np.testing.assert_array_equal(getattr(fused, name), getattr(plain, name))
    np.testing.assert_array_equal(g1b, g1a)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("code", [KERNEL_CODE_ELU, KERNEL_CODE_RELU])
def test_derivative_from_the_features_is_the_maps_own(dtype, code):
    """ELU+1's and ReLU's derivative taken from the feature (map_span) is the map's own (dphi) at every value, over a
    dense sweep around 0 and out to where exp underflows."""
    from linattn_nb.ops.grad._cpu_chunked import map_span

    x = np.concatenate([np.linspace(-1e-6, 1e-6, 20001), np.linspace(-120, 5, 20001), [0.0, -0.0]])
    x = x.astype(dtype)
    f = _maps.features(x.reshape(1, -1), code, dtype)[0].reshape(-1)
    d = np.ones_like(x)
    assert map_span(np.empty(0, dtype), f, d, code)  # x unread for these maps
    np.testing.assert_array_equal(d, _maps.vjp(x.reshape(1, -1), np.ones((1, x.size), dtype), code,
                                               dtype).reshape(-1))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("code", [KERNEL_CODE_ELU, KERNEL_CODE_NONE])
def test_maps_flag_a_gradient_that_overflows(rule, code):
    """With ``maps``, a stored gradient element beyond float32 reads in the results' flag (the front end then
    recomputes in float64), where without them the front end looked at the arrays itself.  Here the
    gradients overflow and the normalisers do not: v = 0 makes ``g . num`` 0, and tiny features a tiny
    normaliser, so ``g / den`` is beyond float32 while ``den`` and ``g . num`` fit."""
    B, N, F, M = 1, 20, 4, 3
    xq = np.full((B, N, F), -12.0, np.float32)
    xk = xq.copy()
    qf, kf = (_maps.features(x, KERNEL_CODE_ELU, np.float32)[0] for x in (xq, xk))
    v1 = np.zeros((B, N, M + 1), np.float32)
    v1[..., M] = 1.0
    H0 = np.zeros((B, F, M + 1))
    g = np.full((B, N, M), 1e30, np.float32)
    inputs = _rule_inputs(rule, B, N, F, 3)
    kw = dict(chunk=8, rule=rule, inputs=inputs)
    plain, g_ok, res_ok = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, **kw)
    assert g_ok and res_ok  # the normalisers and g . num fit
    assert not np.isfinite(plain.dv[..., :M]).all()
    maps = (xq, xk, code) if code != KERNEL_CODE_NONE else (qf, kf, code)  # given features: x is unread
    _, g_ok, res_ok = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, maps=maps, **kw)
    assert g_ok and not res_ok


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rule", RULES)
def test_given_features_pass_their_gradients_through(dtype, rule, nan_outputs):
    """``maps`` with ``KERNEL_CODE_NONE`` (features given as they are, whose gradients pass through): every result
    bit for bit that of the call without maps, and the results found finite."""
    B, N, F, M = 2, 37, 4, 3
    qf, kf, v1, H0, g, _ = _inputs(B, N, F, M, dtype, seed=9)
    kw = dict(chunk=16, block=4, rule=rule, inputs=_rule_inputs(rule, B, N, F, 5), eps=1e-6)
    plain, g_ok, res_ok = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, **kw)
    given, g_ok2, res_ok2 = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, maps=(qf, kf, KERNEL_CODE_NONE),
                                                            **kw)
    assert g_ok and res_ok and g_ok2 and res_ok2
    for name in ("dq", "dk", "dv", "dH0", "dfactor"):
        a, b = getattr(plain, name), getattr(given, name)
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(b, a, err_msg=name)
    from linattn_nb.ops.grad._cpu_chunked import map_span

    d = np.array([1.5, -2.0, np.inf], dtype)
    assert not map_span(np.empty(0, dtype), d.copy(), d, KERNEL_CODE_NONE)
    np.testing.assert_array_equal(d, np.array([1.5, -2.0, np.inf], dtype))  # unchanged
    assert map_span(np.empty(0, dtype), d[:2].copy(), d[:2], KERNEL_CODE_NONE)


def test_maps_argument_errors():
    qf, kf, v1, H0, g, _ = _inputs(1, 8, 4, 3, np.float32)
    with pytest.raises(ValueError, match="maps must be a tuple"):
        cpu.backward_chunked_normalized(qf, kf, v1, H0, g, maps=[qf, kf, KERNEL_CODE_ELU])
    with pytest.raises(ValueError, match="maps: code must be one of"):
        cpu.backward_chunked_normalized(qf, kf, v1, H0, g, maps=(qf, kf, 99))
    with pytest.raises(ValueError, match="maps: xk must be a float32 array of shape"):
        cpu.backward_chunked_normalized(qf, kf, v1, H0, g, maps=(qf, kf[:, :4], KERNEL_CODE_ELU))
    with pytest.raises(ValueError, match="maps: xq must be a float32 array"):
        cpu.backward_chunked_normalized(qf, kf, v1, H0, g, maps=(qf.astype(np.float64), kf, KERNEL_CODE_ELU))


@pytest.mark.parametrize("name", ["elu", "relu", "squared_relu"])
@pytest.mark.parametrize("rule_kw", [{}, {"log_decay": -0.05}, {"log_decay": "gate"}])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_front_end_maps_in_the_kernel_match_the_quadratic_form(name, rule_kw, dtype):
    """``linear_attention_vjp`` of the fused path, the map's VJP in the kernel (float16 inputs: converted for
    the squared ReLU, which reads them), against the quadratic form's gradients in float64."""
    rng = np.random.default_rng(11)
    q, k, v, g = (rng.standard_normal((2, 3, 37, 4)) for _ in range(4))
    q += 0.3  # fewer all-zero ReLU rows
    k += 0.3
    if rule_kw.get("log_decay") == "gate":
        rule_kw = {"log_decay": -rng.uniform(0.01, 0.3, (2, 3, 37, 4))}
    kw = dict(feature_map=name, causal=True, eps=1e-3, **rule_kw)
    got = la.linear_attention_vjp(*(x.astype(dtype) for x in (q, k, v, g)), method="chunked", **kw)
    ref = la.linear_attention_vjp(*(x.astype(dtype).astype(np.float64) for x in (q, k, v, g)),
                                  method="quadratic", **kw)
    tol = {np.float16: 2e-2, np.float32: 2e-5, np.float64: 1e-10}[dtype]
    for field in ("dq", "dk", "dv", "d_log_decay"):
        a, r = getattr(got, field), getattr(ref, field)
        assert (a is None) == (r is None), field
        if r is not None:
            a = np.asarray(a, np.float64)
            np.testing.assert_allclose(a, r, rtol=tol, atol=tol * np.max(np.abs(r)), err_msg=field)


from linattn_nb.ops.grad._outgrad import times_factor  # noqa: E402


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,chunk", [(1, None), (7, 3), (50, 16), (97, None)])
@pytest.mark.parametrize("rule", [RULE_DECAY, RULE_GATE])
def test_log_grad_is_the_factor_gradient_times_the_factors(dtype, N, chunk, rule):
    # log_grad: the kernel (gate) or the launcher (decay) multiplies by the factors; the same values as the
    # front end's pass over the factor gradient, bit for bit, and 0 at the reset of sequence 0
    B, F, M = 2, 5, 3
    qf, kf, v1, H0, g, dHN = _inputs(B, N, F, M, dtype, seed=11, state=True, grad_state=True)
    inputs = _rule_inputs(rule, B, N, F, seed=11)
    kw = dict(eps=1e-6, chunk=chunk, rule=rule, inputs=inputs)
    plain, _, _ = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, dHN, **kw)
    logd, _, _ = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, dHN, log_grad=True, **kw)
    lg = np.ascontiguousarray(inputs["log_gate" if rule == RULE_GATE else "log_decay"], np.float64)
    want = times_factor(np.array(plain.dfactor, np.float64, order="C"), lg)
    np.testing.assert_array_equal(logd.dfactor, want)
    for name in ("dq", "dk", "dv", "dH0"):  # nothing else changes
        np.testing.assert_array_equal(getattr(logd, name), getattr(plain, name))
    if N > 1:
        reset = (0, N // 2, 1) if rule == RULE_GATE else (0, N // 2)
        assert logd.dfactor[reset] == 0.0
        assert np.abs(want).max() > 0


def test_vjp_log_decay_gradient_unchanged_by_the_fused_product():
    # the front end asks the launcher for log_grad and skips its own pass: the gradients a caller gets are
    # those of d/dlog a = a dL/da, against the quadratic reference (decay= keeps dL/da)
    rng = np.random.default_rng(5)
    q, k, v, g = (rng.standard_normal((2, 3, 40, 4)) for _ in range(4))
    lg = rng.uniform(-0.4, -0.01, (2, 3, 40, 4))
    kw = dict(causal=True, method="chunked", feature_map="elu")
    got = la.linear_attention_vjp(q, k, v, g, log_decay=lg, **kw)
    ref = la.linear_attention_vjp(q, k, v, g, decay=np.exp(lg), **kw)
    np.testing.assert_allclose(got.d_log_decay, ref.d_decay * np.exp(lg), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# the decay rule's kernel that keeps the states of a few chunks only (ops/grad/_cpu_chunked_decay.py): every
# BACKWARD_DECAY_ANCHOR-th chunk's and those of the chunks that decay by more than BACKWARD_DECAY_CARRY_MIN; it
# carries the chunk-spanning term of the factor gradient as sums of pairs between them
# ---------------------------------------------------------------------------------------------------------------
def _decays(kind, B, N, seed):
    """Log-decays: "mild" (every chunk of up to 64 tokens decays by at least 2^-10: anchors by spacing only),
    "mixed" (strong stretches and a reset in sequence 0: anchors by strength too)."""
    rng = np.random.default_rng(seed + 300)
    lg = rng.uniform(-0.03, -0.0005, (B, N))
    if kind == "mixed":
        lg[0, N // 3:N // 2] = rng.uniform(-2.0, -0.5, N // 2 - N // 3)
        lg[0, (2 * N) // 3] = -np.inf
        lg[-1, -5:] = -3.0
    return {"log_decay": lg}


def _kept(qf, kf, v1, H0, g, dHN, **kw):
    """The launcher's result and the names of the arrays it asked ``empty`` for."""
    made = {}

    def empty(name, shape, dtype):
        made[name] = np.full(shape, np.nan, dtype)
        return made[name]

    out = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, dHN, empty=empty, **kw)
    return out, set(made)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,chunk", [(1, None), (2, 1), (7, 3), (32, None), (33, None), (45, 8), (97, 5),
                                     (130, 64)])
@pytest.mark.parametrize("anchor", [1, 2, 4, 1000])
@pytest.mark.parametrize("kind", ["mild", "mixed"])
@pytest.mark.parametrize("state", [False, True])
def test_decay_with_anchors_matches_reference(dtype, N, chunk, anchor, kind, state, nan_outputs, monkeypatch):
    """Every output against the float64 reference, at edge lengths (one token, one chunk, one more, chunks
    that are not a multiple of the anchors' spacing), with strong decays and a reset or not, with and without
    an initial state and ``dH_N``, with the normaliser's floor active on some rows."""
    monkeypatch.setattr(la.config, "BACKWARD_DECAY_ANCHOR", anchor)
    qf, kf, v1, H0, g, dHN = _inputs(2, N, 5, 3, dtype, seed=N + anchor, state=state, grad_state=state)
    qf[:, ::4] *= 1e-6  # rows below the floor
    inputs = _decays(kind, 2, N, N)
    ref, g1_ref = _reference(qf, kf, v1, H0, g, dHN, 1e-3, inputs)
    g1 = np.full((2, N, 4), np.nan, dtype)
    (grads, g_ok, res_ok), made = _kept(qf, kf, v1, H0, g, dHN, chunk=chunk, g1=g1, rule=RULE_DECAY, inputs=inputs,
                                        eps=1e-3)
    assert made == {"anchors"}  # this kernel ran
    assert g_ok and res_ok
    _close(g1, g1_ref, dtype, "g1")
    for name in ("dq", "dk", "dv", "dH0", "dfactor"):
        _close(getattr(grads, name), getattr(ref, name), dtype, name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("code", MAP_CODES)
@pytest.mark.parametrize("kind", ["mild", "mixed"])
def test_decay_with_anchors_agrees_with_the_kernel_that_keeps_every_state(dtype, code, kind, monkeypatch):
    """The two decay kernels on the same call, with the map's VJP in the kernel, ``log_grad`` and ``dH_N``:
    the same gradients (to rounding: float64 1e-12, float32 at its own precision), 0 at the reset."""
    B, N, F, M = 3, 150, 6, 4
    xq, xk = _map_inputs(B, N, F, dtype, seed=code + 20)
    qf, kf = (_maps.features(x, code, dtype)[0] for x in (xq, xk))
    _, _, v1, H0, g, dHN = _inputs(B, N, F, M, dtype, seed=21, state=True, grad_state=True)
    inputs = _decays(kind, B, N, 22)
    kw = dict(chunk=16, rule=RULE_DECAY, inputs=inputs, eps=1e-6, maps=(xq, xk, code), log_grad=True)
    runs = []
    for anchor, kept in ((4, {"anchors"}), (0, {"ck", "Ys", "KKs"})):
        monkeypatch.setattr(la.config, "BACKWARD_DECAY_ANCHOR", anchor)
        g1 = np.full((B, N, M + 1), np.nan, dtype)
        (grads, g_ok, res_ok), made = _kept(qf, kf, v1, H0, g, dHN, g1=g1, **kw)
        assert made == kept and g_ok and res_ok
        runs.append((grads, g1))
    (new, g1n), (old, g1o) = runs
    tol = 1e-12 if dtype == np.float64 else 2e-6
    for name, a, b in [("g1", g1n, g1o)] + [(n, getattr(new, n), getattr(old, n))
                                            for n in ("dq", "dk", "dv", "dH0", "dfactor")]:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max(), err_msg=name)
    if kind == "mixed":
        assert new.dfactor[0, (2 * N) // 3] == 0.0  # d/dlog a at a reset


def test_decay_anchor_choice(monkeypatch):
    """decay_anchors: every BACKWARD_DECAY_ANCHOR-th chunk from the first, and every chunk that decays by more
    than BACKWARD_DECAY_CARRY_MIN (2^-10: -log 6.93), a reset included, numbered in order; None for a NaN or
    with anchors 0."""
    lg = np.full((2, 100, 1), -0.05)  # chunks of 10: 0.5
    lg[1, 40:50] = -0.8  # chunk 4 of sequence 1: 8.0
    lg[1, 95] = -np.inf  # chunk 9 of sequence 1: a reset
    slot, count = cpu.decay_anchors(lg, 10)
    np.testing.assert_array_equal(slot, [[0, -1, -1, -1, 1, -1, -1, -1, 2, -1],
                                         [0, -1, -1, -1, 1, -1, -1, -1, 2, 3]])
    assert count == 4 and slot.dtype == np.int64
    lg[1, 40:50] = -0.9
    lg[1, 95] = -0.05
    slot, count = cpu.decay_anchors(lg, 8)  # chunks of 8, the last of 4 tokens; chunk 5 (40-47): 7.2
    np.testing.assert_array_equal(slot[1], [0, -1, -1, -1, 1, 2, -1, -1, 3, -1, -1, -1, 4])
    assert count == 5 and slot[0].max() == 3
    monkeypatch.setattr(la.config, "BACKWARD_DECAY_CARRY_MIN", 2.0)  # above 1: every chunk
    assert (cpu.decay_anchors(lg, 8)[0] == np.arange(13)).all()
    monkeypatch.setattr(la.config, "BACKWARD_DECAY_CARRY_MIN", 0.0)  # no floor; a reset is still kept
    lg[0, 3] = -np.inf
    np.testing.assert_array_equal(cpu.decay_anchors(lg, 8)[0][0], [0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3])
    monkeypatch.setattr(la.config, "BACKWARD_DECAY_CARRY_MIN", 2.0 ** -10)
    slot, count = cpu.decay_anchors(np.empty((2, 0, 1)), 8)
    assert slot.shape == (2, 0) and count == 0
    nan = lg.copy()
    nan[0, 7] = np.nan
    assert cpu.decay_anchors(nan, 8) is None
    monkeypatch.setattr(la.config, "BACKWARD_DECAY_ANCHOR", 0)
    assert cpu.decay_anchors(lg, 8) is None


def test_decay_factor_gradient_in_float32_as_close_as_with_every_state(monkeypatch):
    """The carried sums' rounding, a random walk over the chunks between anchors, keeps the float32 factor
    gradient of a long sequence within 1.5x the per-element error of the kernel that keeps every state
    (measured 1.36x at anchors of 4 over 192 chunks of 32; with no anchors it grows as the square root of
    the chunk count: 4.2x here).  One sequence, so that the serial kernels run: the parallel twins compile
    in the full suite's tests."""
    B, N, F, M = 1, 6144, 16, 16
    rng = np.random.default_rng(3)
    q, k = (np.exp(rng.standard_normal((B, N, F)) * 0.3) for _ in range(2))
    v1 = np.ones((B, N, M + 1))
    v1[:, :, :M] = rng.standard_normal((B, N, M))
    g = rng.standard_normal((B, N, M))
    H0 = np.abs(rng.standard_normal((B, F, M + 1)))
    inputs = {"log_decay": np.log(rng.uniform(0.9, 1.0, (B, N)))}
    ref = cpu.backward_chunked_normalized(q, k, v1, H0, g, rule=RULE_DECAY, inputs=inputs, eps=1e-8,
                                          chunk=32)[0].dfactor
    f32 = [x.astype(np.float32) for x in (q, k, v1)] + [H0, g.astype(np.float32)]
    err = {}
    for anchor in (4, 0):
        monkeypatch.setattr(la.config, "BACKWARD_DECAY_ANCHOR", anchor)
        got = cpu.backward_chunked_normalized(*f32, rule=RULE_DECAY, inputs=inputs, eps=1e-8, chunk=32)[0].dfactor
        err[anchor] = np.median(np.abs(got - ref) / np.abs(ref))
    assert err[4] <= 1.5 * err[0], err


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,chunk", [(1, None), (7, 3), (33, None), (97, 5), (130, 64)])
@pytest.mark.parametrize("kind", ["mild", "mixed"])
@pytest.mark.parametrize("state", [False, True])
def test_decay_with_anchors_takes_a_given_g1(dtype, N, chunk, kind, state, nan_outputs, monkeypatch):
    """backward_chunked (a given ``g1 = dL/d[num | den]``: unnormalised outputs) runs the kernel with anchors
    too: against the naive float64 backward, and the same as the kernel that keeps every state."""
    qf, kf, v1, H0, g, dHN = _inputs(2, N, 5, 3, dtype, seed=N + 7, state=state, grad_state=state)
    g1 = np.concatenate([g, np.random.default_rng(N).standard_normal((2, N, 1)).astype(dtype)], axis=2)
    inputs = _decays(kind, 2, N, N + 1)
    ref = causal_backward_naive(*(x.astype(np.float64) for x in (qf, kf, v1)), H0, g1.astype(np.float64), dHN,
                                inputs=inputs, rule=RULE_DECAY)
    ran = []
    for kernel in ("_run_decay_carry", "_run_chunked_delta"):
        monkeypatch.setattr(cpu, kernel, lambda *a, _f=getattr(cpu, kernel), _k=kernel, **kw: (ran.append(_k),
                                                                                             _f(*a, **kw))[1])
    got = {}
    for anchor in (4, 0):
        monkeypatch.setattr(la.config, "BACKWARD_DECAY_ANCHOR", anchor)
        g1_before = g1.copy()
        got[anchor] = cpu.backward_chunked(qf, kf, v1, H0, g1, dHN, chunk=chunk, rule=RULE_DECAY, inputs=inputs)
        np.testing.assert_array_equal(g1, g1_before)  # read only
    assert ran == ["_run_decay_carry", "_run_chunked_delta"]
    for name in ("dq", "dk", "dv", "dH0", "dfactor"):
        _close(getattr(got[4], name), getattr(ref, name), dtype, name)
        a, b = (np.asarray(getattr(got[k], name), np.float64) for k in (4, 0))
        tol = 1e-12 if dtype == np.float64 else 2e-6
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max(), err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,chunk,block", [(50, 16, 1), (50, 16, 3), (50, 16, 16), (97, 48, 7), (97, 48, 48),
                                           (40, 5, 64)])
@pytest.mark.parametrize("given_g1", [False, True])
def test_decay_with_anchors_in_row_blocks(dtype, N, chunk, block, given_g1, nan_outputs, monkeypatch):
    """The decay kernel's intra-chunk products in row blocks (the upper triangle of the diagonal blocks only):
    blocks of one row, blocks that do not divide the chunk, one block a chunk, a block wider than the chunk;
    the normalised launcher (``block=``) and ``backward_chunked`` with a given ``g1`` (the config's block)."""
    qf, kf, v1, H0, g, dHN = _inputs(2, N, 5, 3, dtype, seed=N + block, state=True, grad_state=True)
    inputs = _decays("mixed", 2, N, N + block)
    ran = []
    monkeypatch.setattr(cpu, "_run_decay_carry", lambda *a, _f=cpu._run_decay_carry, **kw: (ran.append(1),
                                                                                            _f(*a, **kw))[1])
    if given_g1:
        monkeypatch.setattr(la.config, "BACKWARD_NORM_BLOCK", block)
        g1 = np.concatenate([g, np.random.default_rng(N).standard_normal((2, N, 1)).astype(dtype)], axis=2)
        ref = causal_backward_naive(*(x.astype(np.float64) for x in (qf, kf, v1)), H0, g1.astype(np.float64),
                                    dHN, inputs=inputs, rule=RULE_DECAY)
        grads = cpu.backward_chunked(qf, kf, v1, H0, g1, dHN, chunk=chunk, rule=RULE_DECAY, inputs=inputs)
    else:
        ref, g1_ref = _reference(qf, kf, v1, H0, g, dHN, 1e-3, inputs)
        g1 = np.full((2, N, 4), np.nan, dtype)
        grads, g_ok, res_ok = cpu.backward_chunked_normalized(qf, kf, v1, H0, g, dHN, chunk=chunk, block=block,
                                                              g1=g1, rule=RULE_DECAY, inputs=inputs, eps=1e-3)
        assert g_ok and res_ok
        _close(g1, g1_ref, dtype, "g1")
    assert ran == [1]  # the kernel with anchors ran
    for name in ("dq", "dk", "dv", "dH0", "dfactor"):
        _close(getattr(grads, name), getattr(ref, name), dtype, name)
