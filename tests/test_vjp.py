"""linear_attention_vjp: the gradient front end against finite differences of linear_attention.

The naive backward (method="quadratic") is checked against central
differences of the public forward (relative 1e-6 in float64), for every
rule, with the normaliser, its eps floor, initial and final states and
broadcast inputs; the fast methods are checked against it in
tests/ops/test_grad_*.py and at the end of this file.
"""
import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import feature_maps as fm
from linattn_nb.ops.registry import available_methods

RNG = np.random.default_rng(7)
H_FD = 1e-6


def _fd(f, x, h=H_FD):
    """Central differences of the scalar f at x (float64 copy)."""
    x = np.array(x, dtype=np.float64)
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        g[idx] = (f(xp) - f(xm)) / (2 * h)
    return g


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _inputs(shape=(2, 5, 3), m=4, positive=True):
    q = RNG.uniform(0.2, 1.0, shape) if positive else RNG.normal(size=shape)
    k = RNG.uniform(0.2, 1.0, shape) if positive else RNG.normal(size=shape)
    v = RNG.normal(size=shape[:-1] + (m,))
    g = RNG.normal(size=shape[:-1] + (m,))
    return q, k, v, g


RULE_CASES = {
    "additive": {},
    "decay-scalar": {"decay": 0.8},
    "decay-per-seq": {"decay": np.array([0.9, 0.6])},
    "decay-per-token": {"decay": RNG.uniform(0.3, 0.95, (2, 5))},
    "log-decay-per-token": {"log_decay": RNG.uniform(-1.0, -0.05, (2, 5))},
    "gate": {"log_decay": RNG.uniform(-1.0, -0.05, (2, 5, 3))},
    "delta": {"beta": RNG.uniform(0.2, 1.5, (2, 5))},
    "delta-scalar": {"beta": 0.7},
    "gated-delta": {"beta": RNG.uniform(0.2, 1.5, (2, 5)), "decay": RNG.uniform(0.5, 0.95, (2, 5))},
}


def _check_against_fd(q, k, v, g, *, tol=1e-6, **kw):
    res = la.linear_attention_vjp(q, k, v, g, **kw)
    fwd = {a: b for a, b in kw.items() if a not in ("grad_state",)}

    def loss(**over):
        args = dict(fwd)
        args.update({a: b for a, b in over.items() if a not in ("q", "k", "v")})
        out = la.linear_attention(over.get("q", q), over.get("k", k), over.get("v", v),
                                  **{**args, "method": "quadratic"}, return_state=kw.get("grad_state") is not None)
        if kw.get("grad_state") is None:
            return float(np.sum(out * g))
        o, st = out
        gs = kw["grad_state"]
        return float(np.sum(o * g) + np.sum(st.S * gs[0]) + np.sum(st.z * gs[1]))

    for name, x, grad in (("q", q, res.dq), ("k", k, res.dk), ("v", v, res.dv)):
        assert grad.shape == np.shape(x)
        assert _rel(grad, _fd(lambda y: loss(**{name: y}), x)) < tol, name
    for name in ("decay", "log_decay", "beta"):
        if kw.get(name) is not None:
            grad = getattr(res, "d_" + name)
            assert np.shape(grad) == np.shape(kw[name]), name
            assert _rel(grad, _fd(lambda y: loss(**{name: y if np.ndim(y) else float(y)}), kw[name])) < tol, name
        else:
            assert getattr(res, "d_" + name) is None
    return res


@pytest.mark.parametrize("case", sorted(RULE_CASES))
@pytest.mark.parametrize("normalize", [True, False])
def test_naive_gradients_match_finite_differences(case, normalize):
    q, k, v, g = _inputs()
    _check_against_fd(q, k, v, g, feature_map=None, causal=True, method="quadratic", normalize=normalize,
                      **RULE_CASES[case])


@pytest.mark.parametrize("method", ["quadratic", "aggregate"])
def test_noncausal_gradients_match_finite_differences(method):
    q, k, v, g = _inputs()
    _check_against_fd(q, k, v, g, feature_map=None, causal=False, method=method)


@pytest.mark.parametrize("case", ["additive", "gate", "gated-delta"])
def test_state_gradients(case):
    """d_initial_state against differences in S0 and z0; grad_state flows into every gradient."""
    q, k, v, g = _inputs()
    S0 = RNG.uniform(0.0, 1.0, (2, 3, 4))
    z0 = RNG.uniform(0.5, 1.0, (2, 3))
    rule = {"additive": "additive", "gate": "gate", "gated-delta": "gated_delta"}[case]
    st = la.LinearState(S0, z0, 4, rule)
    gs = (RNG.normal(size=(2, 3, 4)), RNG.normal(size=(2, 3)))
    kw = dict(feature_map=None, causal=True, method="quadratic", **RULE_CASES[case])
    res = _check_against_fd(q, k, v, g, initial_state=st, grad_state=gs, **kw)

    def loss(S, z):
        o, fin = la.linear_attention(q, k, v, initial_state=la.LinearState(S, z, 4, rule), return_state=True, **kw)
        return float(np.sum(o * g) + np.sum(fin.S * gs[0]) + np.sum(fin.z * gs[1]))

    assert res.d_initial_state.position == 4 and res.d_initial_state.rule == rule
    assert _rel(res.d_initial_state.S, _fd(lambda S: loss(S, z0), S0)) < 1e-6
    assert _rel(res.d_initial_state.z, _fd(lambda z: loss(S0, z), z0)) < 1e-6


def test_eps_floor_gives_the_gradient_of_the_floored_expression():
    """Rows whose normaliser is <= eps are num / eps: no gradient through the normaliser."""
    q, k, v, g = _inputs(positive=False)
    eps = 1e-3
    kw = dict(feature_map=None, causal=True, method="quadratic", eps=eps)
    den = np.einsum("bnf,bnf->bn", q, np.cumsum(k, axis=1))
    assert (den <= eps).any() and (den > eps).any()  # both kinds of rows
    res = _check_against_fd(q, k, v, g, **kw)
    # the floored rows of dq: (S_t g_t) / eps exactly, the normaliser's column contributing nothing
    S = np.cumsum(np.einsum("bnf,bnm->bnfm", k, v), axis=1)
    floored = den <= eps
    want = np.einsum("bnfm,bnm->bnf", S, g) / eps
    np.testing.assert_allclose(res.dq[floored], want[floored], rtol=1e-12)


def test_reset_gradient_is_finite_and_matches_one_sided_difference():
    q, k, v, g = _inputs()
    a = RNG.uniform(0.3, 0.9, (2, 5))
    a[0, 2] = 0.0
    a[1, 0] = 0.0
    kw = dict(feature_map=None, causal=True, method="quadratic")
    res = la.linear_attention_vjp(q, k, v, g, decay=a, **kw)
    assert np.isfinite(res.d_decay).all()
    h = 1e-7
    for idx in ((0, 2), (1, 0)):
        ap = a.copy()
        ap[idx] = h
        fd = (np.sum(la.linear_attention(q, k, v, decay=ap, **kw) * g)
              - np.sum(la.linear_attention(q, k, v, decay=a, **kw) * g)) / h
        assert abs(fd - res.d_decay[idx]) <= 1e-5 * max(1.0, abs(fd))
    lres = la.linear_attention_vjp(q, k, v, g, log_decay=np.log(np.where(a > 0, a, 1.0)) + np.where(a > 0, 0, -np.inf),
                                   **kw)
    assert lres.d_log_decay[0, 2] == 0.0 and np.isfinite(lres.d_log_decay).all()
    np.testing.assert_allclose(lres.d_log_decay, a * res.d_decay, rtol=1e-12, atol=1e-300)


def test_broadcast_inputs_are_summed_back():
    q, k, v, g = _inputs(shape=(2, 3, 5, 3))
    gamma = np.array([[0.9, 0.8, 0.95]])  # (1, H)
    res = la.linear_attention_vjp(q, k, v, g, feature_map=None, causal=True, method="quadratic", decay=gamma)
    assert res.d_decay.shape == (1, 3)
    full = la.linear_attention_vjp(q, k, v, g, feature_map=None, causal=True, method="quadratic",
                                   decay=np.broadcast_to(gamma[..., None], (2, 3, 5)).copy())
    np.testing.assert_allclose(res.d_decay, full.d_decay.sum(axis=(0, 2))[None], rtol=1e-12)
    res = la.linear_attention_vjp(q, k, v, g, feature_map=None, causal=True, method="quadratic", beta=0.5)
    assert isinstance(res.d_beta, float)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_low_precision_dtypes(dtype):
    q, k, v, g = _inputs()
    res = la.linear_attention_vjp(*(x.astype(dtype) for x in (q, k, v, g)), feature_map=None, causal=True,
                                  method="quadratic")
    ref = la.linear_attention_vjp(*(x.astype(dtype).astype(np.float64) for x in (q, k, v, g)), feature_map=None,
                                  causal=True, method="quadratic")
    tol = 2e-3 if dtype == np.float16 else 1e-5
    for a, b in zip(res[:3], ref[:3]):
        assert a.dtype == dtype
        assert _rel(a, b) < tol


def test_empty_sequence_and_batch():
    q, k, v, g = (np.zeros((2, 0, 3)),) * 2 + (np.zeros((2, 0, 4)),) * 2
    res = la.linear_attention_vjp(q, k, v, g, feature_map=None, causal=True, decay=0.5)
    assert res.dq.shape == (2, 0, 3) and res.dv.shape == (2, 0, 4) and res.d_decay == 0.0
    gs = (np.ones((2, 3, 4)), np.ones((2, 3)))
    res = la.linear_attention_vjp(q, k, v, g, feature_map=None, causal=True,
                                  initial_state=(np.zeros((2, 3, 4)), np.zeros((2, 3))), grad_state=gs)
    np.testing.assert_array_equal(res.d_initial_state.S, gs[0])


def test_errors_name_the_argument():
    q, k, v, g = _inputs()
    with pytest.raises(ValueError, match="grad_out"):
        la.linear_attention_vjp(q, k, v, g[:, :4], feature_map=None, causal=True)
    with pytest.raises(TypeError, match="grad_out"):
        la.linear_attention_vjp(q, k, v, g.astype(np.int64), feature_map=None, causal=True)
    bad = g.copy()
    bad[0, 1, 2] = np.nan
    with pytest.raises(ValueError, match="grad_out"):
        la.linear_attention_vjp(q, k, v, bad, feature_map=None, causal=True)
    with pytest.raises(ValueError, match="grad_state.S"):
        la.linear_attention_vjp(q, k, v, g, feature_map=None, causal=True, grad_state=(np.zeros((2, 3, 3)),
                                                                                        np.zeros((2, 3))))
    with pytest.raises(ValueError, match="decay"):
        la.linear_attention_vjp(q, k, v, g, feature_map=None, causal=False, decay=0.5)
    with pytest.raises(ValueError, match="q"):
        la.linear_attention_vjp(q[:, :4], k, v, g, feature_map=None, causal=True)


def _fast_methods(rule="additive"):
    return [m for m in available_methods(causal=True, device="cpu", rule=rule) if m != "quadratic"]


def _have(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


@pytest.mark.skipif(not _have("linattn_nb.ops.grad.cpu"), reason="CPU backward launchers not built")
@pytest.mark.parametrize("case", sorted(RULE_CASES))
@pytest.mark.parametrize("method", ["scan", "chunked"])
def test_causal_gradients_never_read_earlier_grad_out_rows(case, method):
    """dq_t, dk_t, dv_t depend on grad_out rows >= t only: bit-for-bit unchanged when earlier rows change."""
    q, k, v, g = _inputs(shape=(2, 9, 3))
    kw = dict(RULE_CASES[case])
    for key, val in list(kw.items()):  # the per-token cases were drawn for N = 5
        if np.ndim(val) >= 2:
            kw[key] = RNG.uniform(0.3, 0.95, val.shape[:1] + (9,) + val.shape[2:])
            if key == "log_decay":
                kw[key] = np.log(kw[key])
    base = la.linear_attention_vjp(q, k, v, g, feature_map=None, causal=True, method=method, **kw)
    for t in (1, 4, 8):
        g2 = g.copy()
        g2[:, :t] = RNG.normal(size=g2[:, :t].shape)
        res = la.linear_attention_vjp(q, k, v, g2, feature_map=None, causal=True, method=method, **kw)
        for a, b in zip(res[:3], base[:3]):
            np.testing.assert_array_equal(a[:, t:], b[:, t:])


@pytest.mark.skipif(not _have("linattn_nb.ops.grad.cpu"), reason="CPU backward launchers not built")
@pytest.mark.parametrize("case", sorted(RULE_CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fast_cpu_methods_match_the_reference(case, dtype):
    q, k, v, g = _inputs(shape=(2, 5, 3))
    kw = dict(feature_map=None, causal=True, **RULE_CASES[case])
    S0, z0 = RNG.uniform(0, 1, (2, 3, 4)), RNG.uniform(0.5, 1, (2, 3))
    rule = la.linear_attention(q, k, v, return_state=True, **kw)[1].rule
    st, gs = la.LinearState(S0, z0, 0, rule), (RNG.normal(size=(2, 3, 4)), RNG.normal(size=(2, 3)))
    ref = la.linear_attention_vjp(q, k, v, g, method="quadratic", initial_state=st, grad_state=gs, **kw)
    tol = 1e-10 if dtype == np.float64 else 2e-5
    for method in _fast_methods(rule):
        res = la.linear_attention_vjp(*(x.astype(dtype) for x in (q, k, v, g)), method=method, initial_state=st,
                                      grad_state=gs, **kw)
        for name in ("dq", "dk", "dv", "d_decay", "d_log_decay", "d_beta"):
            a, b = getattr(res, name), getattr(ref, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert _rel(a, b) < tol, (method, name)
        assert _rel(res.d_initial_state.S, ref.d_initial_state.S) < tol
        assert _rel(res.d_initial_state.z, ref.d_initial_state.z) < tol


def _map(name):
    if name == "favor+":
        return fm.get("favor+", dim=3, num_features=6, seed=1)
    if name == "hedgehog":
        return fm.HedgehogFeatureMap(W=RNG.normal(size=(2, 3)) * 0.5, b=RNG.normal(size=2) * 0.1)
    if name == "t2r":  # d_out = 4 != d = 3; a positive bias keeps W x + b off the kink
        return fm.T2RFeatureMap(W=RNG.normal(size=(4, 3)) * 0.5, b=0.5 + RNG.uniform(0.0, 0.2, size=4))
    if name == "cosformer":
        return fm.get("cosformer", max_length=16)
    return fm.get(name)


@pytest.mark.parametrize("name", ["elu", "relu", "squared_relu", "l2", "silu_l2", "taylor2", "favor+", "hedgehog",
                                  "t2r", "cosformer", "dpfp"])
def test_gradients_through_feature_maps(name):
    """The chain through phi: FD of linear_attention with the map, causal, with a decay; segment offset 3."""
    q, k, v, g = _inputs(positive=False)
    fmap = _map(name)
    f = fmap.output_dim(3)
    st = la.LinearState(RNG.uniform(0, 1, (2, f, 4)), RNG.uniform(0.5, 1, (2, f)), 3, "decay")
    res = _check_against_fd(q, k, v, g, feature_map=fmap, causal=True, method="quadratic", decay=0.9,
                            initial_state=st)
    if name not in ("hedgehog", "t2r"):
        assert res.d_params is None
        return
    assert set(res.d_params) == {"W", "b"}

    def loss(W, b):
        out = la.linear_attention(q, k, v, feature_map=type(fmap)(W, b), causal=True, method="quadratic",
                                  decay=0.9, initial_state=st)
        return float(np.sum(out * g))

    assert _rel(res.d_params["W"], _fd(lambda W: loss(W, fmap.b), fmap.W)) < 1e-6
    assert _rel(res.d_params["b"], _fd(lambda b: loss(fmap.W, b), fmap.b)) < 1e-6


def test_favor_projection_gradient_when_asked():
    q, k, v, g = _inputs(positive=False)
    fmap = fm.get("favor+", dim=3, num_features=5, seed=2, learn_projection=True)
    res = la.linear_attention_vjp(q, k, v, g, feature_map=fmap, causal=False, method="quadratic")
    W0 = fmap.parameters()["projection"].copy()

    def loss(W):
        fmap.W[...] = W
        try:
            return float(np.sum(la.linear_attention(q, k, v, feature_map=fmap, method="quadratic") * g))
        finally:
            fmap.W[...] = W0

    assert _rel(res.d_params["projection"], _fd(loss, W0)) < 1e-6


@pytest.mark.parametrize("name", ["elu", "relu", "squared_relu"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_inline_map_kernels_match_the_numpy_maps(name, dtype):
    """The gradient front end's one-pass features and vjp (ops/grad/_maps.py) against FeatureMap.apply / vjp."""
    from linattn_nb.ops.grad import _maps

    x = RNG.normal(size=(2, 3, 7, 5)).astype(dtype)
    x[0, 0, 0, :3] = [0.0, -0.0, 1e-30]
    g = RNG.normal(size=x.shape).astype(dtype)
    fmap = fm.get(name)
    work = np.float32 if dtype == np.float16 else dtype
    feats, finite = _maps.features(x, fmap.kernel_code, work)
    assert finite and feats.dtype == work
    tol = 1e-6 if work == np.float32 else 1e-15
    np.testing.assert_allclose(feats, fmap.apply(x.astype(work), role="key", causal=True), rtol=tol)
    dx = _maps.vjp(x, g, fmap.kernel_code, work)
    np.testing.assert_allclose(dx, fmap.vjp(x.astype(work), g.astype(work), role="key")[0],
                               rtol=tol)
    clean = x.copy()
    x[1, 2, 3, 4] = np.inf
    assert not _maps.features(x, fmap.kernel_code, work)[1]
    with pytest.raises(ValueError, match="k contains"):
        la.linear_attention_vjp(clean, x, g, g, feature_map=name, causal=True)


@pytest.mark.parametrize("method", ["chunked", "scan"])
def test_caller_log_gate_is_read_not_copied_nor_written(method):
    """A one-shot VJP reads the caller's float64 log-gate in place (no copy of an array as large as q): it
    leaves it bit-for-bit as given, and its gradient is that of a copy."""
    rng = np.random.default_rng(5)
    q, k, v, g = (rng.standard_normal((2, 37, 4)) for _ in range(4))
    lg = -rng.uniform(0.001, 0.5, (2, 37, 4))
    lg[0, 5, 1] = -np.inf  # a reset
    keep = lg.copy()
    kw = dict(feature_map="elu", causal=True, method=method)
    got = la.linear_attention_vjp(q, k, v, g, log_decay=lg, **kw)
    assert np.array_equal(lg, keep)
    want = la.linear_attention_vjp(q, k, v, g, log_decay=keep.copy(), **kw)
    np.testing.assert_array_equal(got.d_log_decay, want.d_log_decay)
    assert np.isfinite(got.d_log_decay).all() and got.d_log_decay[0, 5, 1] == 0.0


def test_grad_out_and_grad_state_are_read_as_q_k_v_are():
    """A long-double grad_out or grad_state is refused as a long-double q is (it was taken as float64), and a
    torch CPU tensor as grad_out is read as q, k and v are (NumPy could not read its dtype: a TypeError that
    named nothing)."""
    torch = pytest.importorskip("torch")
    q, k, v, g = _inputs()
    kw = dict(causal=True, method="chunked")  # the fused normalised path reads grad_out's dtype first
    want = la.linear_attention_vjp(q, k, v, g, **kw)
    got = la.linear_attention_vjp(q, k, v, torch.from_numpy(g), **kw)  # the forward-then-backward path
    for x, y in zip(got[:3], want[:3]):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14)
    with pytest.raises(TypeError, match="grad_out must have dtype float16, float32 or float64, got float128"):
        la.linear_attention_vjp(q, k, v, g.astype(np.longdouble), **kw)
    f = fm.get("elu").output_dim(q.shape[-1])
    S, z = np.zeros(q.shape[:-2] + (f, v.shape[-1]), np.longdouble), np.zeros(q.shape[:-2] + (f,))
    with pytest.raises(TypeError, match="grad_state.S must have dtype float16, float32 or float64, got float128"):
        la.linear_attention_vjp(q, k, v, g, grad_state=(S, z), **kw)
