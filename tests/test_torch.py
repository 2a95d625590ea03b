"""The PyTorch autograd adapter (linattn_nb.torch): gradcheck on every rule, forward values, zero-copy, training.

``torch.autograd.gradcheck`` compares the adapter's backward (the backward
launchers of linattn_nb.ops.grad through linattn_nb._gradfront) with central
finite differences of its forward, in float64, at interior values of the
decay and of beta (formulas: ``docs/theory.md``, "Gradients"; fla checks its
kernels' dq, dk, dv and initial-state gradients against autograd the same
way).  The fast CPU backward launchers (``scan``, ``chunked``) are tested
when ``linattn_nb.ops.grad.cpu`` is importable.
"""
from __future__ import annotations

import dataclasses
import doctest
import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import linattn_nb  # noqa: E402
from linattn_nb import _gradfront, config  # noqa: E402
from linattn_nb import feature_maps as fm  # noqa: E402
import linattn_nb.torch as lt  # noqa: E402

HAS_FM_VJP = hasattr(fm.FeatureMap, "vjp")
HAS_CPU_GRAD = importlib.util.find_spec("linattn_nb.ops.grad.cpu") is not None
needs_fm_vjp = pytest.mark.skipif(not HAS_FM_VJP, reason="FeatureMap.vjp not merged yet (branch h16-fmvjp)")

CAUSAL_METHODS = ["quadratic"] + [pytest.param(m, marks=pytest.mark.skipif(
    not HAS_CPU_GRAD, reason="CPU backward launchers not merged yet (branch h16-cpugrad)")) for m in ("scan", "chunked")]

B, H, N, D, M = 1, 2, 10, 3, 2


@pytest.fixture(autouse=True)
def _identity_vjp(monkeypatch):
    """Until FeatureMap.vjp lands, the identity map (feature_map=None) gets its exact vjp here only."""
    if not hasattr(fm.IdentityFeatureMap, "vjp"):
        monkeypatch.setattr(fm.IdentityFeatureMap, "vjp", lambda self, x, g, **kw: (np.asarray(g), None),
                            raising=False)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """torch's OpenMP threads spin against Numba's on a small shared machine (tiny ops take 10x longer)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 tokens, so that N = 10 spans three chunks (one partial)."""
    monkeypatch.setattr(config, "CPU_CHUNK_SIZE", 4)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _qkv(seed=0, dtype=torch.float64, positive=True, shape=(B, H, N)):
    """q, k positive (identity features keep the normaliser away from 0), v signed."""
    g = _gen(seed)
    lo = 0.5 if positive else -1.0
    q = lo + (1.5 - lo) * torch.rand(*shape, D, generator=g, dtype=dtype)
    k = lo + (1.5 - lo) * torch.rand(*shape, D, generator=g, dtype=dtype)
    v = torch.randn(*shape, M, generator=g, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)]


def _rule_inputs(rule, seed=1, dtype=torch.float64):
    """Interior decay / beta values for ``rule`` as tensors that require grad (keyword -> tensor)."""
    g = _gen(seed)
    u = lambda *s: torch.rand(*s, generator=g, dtype=dtype)  # noqa: E731
    if rule == "additive":
        return {}
    if rule == "decay_head":
        return {"decay": (0.5 + 0.4 * u(1, H)).requires_grad_()}
    if rule == "decay_token":
        return {"decay": (0.3 + 0.6 * u(B, H, N)).requires_grad_()}
    if rule == "log_decay_token":
        return {"log_decay": (-0.05 - 0.5 * u(B, H, N)).requires_grad_()}
    if rule == "gate":
        return {"decay": (0.3 + 0.6 * u(B, H, N, D)).requires_grad_()}
    if rule == "delta":
        return {"beta": (0.2 + 0.7 * u(B, H, N)).requires_grad_()}
    if rule == "delta_head":
        return {"beta": (0.2 + 0.7 * u(1, H)).requires_grad_()}
    if rule == "gated_delta":
        return {"beta": (0.2 + 0.7 * u(B, H, N)).requires_grad_(), "decay": (0.5 + 0.4 * u(B, H, N)).requires_grad_()}
    raise AssertionError(rule)


RULES = ["additive", "decay_head", "decay_token", "log_decay_token", "gate", "delta", "delta_head", "gated_delta"]


def _gradcheck(fn, inputs, fast=False):
    """gradcheck in float64; ``fast``: one random projection per input (fast_mode) instead of the full Jacobian."""
    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=fast)


# ---------------------------------------------------------------------------
# gradcheck
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("method", CAUSAL_METHODS)
@pytest.mark.parametrize("rule", RULES)
def test_gradcheck_causal_every_rule(rule, method, small_chunks):
    q, k, v = _qkv()
    extra = _rule_inputs(rule)
    names = list(extra)

    def fn(q, k, v, *rest):
        return lt.linear_attention(q, k, v, feature_map=None, causal=True, method=method,
                                   **dict(zip(names, rest)))

    # the delta rules' float64 reference forward solves a triangular system per call: the full Jacobian
    # there only with the fast methods
    _gradcheck(fn, [q, k, v, *extra.values()], fast="delta" in rule and method == "quadratic")


@pytest.mark.parametrize("method", ["quadratic", "aggregate"])
def test_gradcheck_noncausal(method):
    q, k, v = _qkv(seed=3)
    _gradcheck(lambda q, k, v: lt.linear_attention(q, k, v, feature_map=None, method=method), [q, k, v])


@pytest.mark.parametrize("method", CAUSAL_METHODS)
@pytest.mark.parametrize("rule", ["additive", "decay_token", "delta", "gated_delta"])
def test_gradcheck_initial_and_final_state(rule, method, small_chunks):
    """Segment-wise training: gradients reach the initial state, and the final state's gradient flows back."""
    q, k, v = _qkv(seed=4)
    extra = _rule_inputs(rule, seed=5)
    names = list(extra)
    g = _gen(6)
    S0 = (0.2 * torch.rand(B, H, D, M, generator=g, dtype=torch.float64)).requires_grad_()
    z0 = (0.5 + torch.rand(B, H, D, generator=g, dtype=torch.float64)).requires_grad_()

    def fn(q, k, v, S0, z0, *rest):
        out, st = lt.linear_attention(q, k, v, feature_map=None, causal=True, method=method,
                                      initial_state=(S0, z0), return_state=True, **dict(zip(names, rest)))
        return out, st.S, st.z

    _gradcheck(fn, [q, k, v, S0, z0, *extra.values()], fast=True)


def test_gradcheck_unnormalized_and_eps_none():
    q, k, v = _qkv(seed=7)
    for kw in (dict(normalize=False), dict(eps=None)):
        _gradcheck(lambda q, k, v: lt.linear_attention(q, k, v, feature_map=None, causal=True,
                                                       method="quadratic", **kw), [q, k, v])


@needs_fm_vjp
@pytest.mark.parametrize("method", CAUSAL_METHODS)
@pytest.mark.parametrize("feature_map,rule", [("elu", "additive"), ("elu", "decay_token"), ("silu_l2", "delta"),
                                              ("silu_l2", "gated_delta")])
def test_gradcheck_builtin_feature_maps(feature_map, rule, method, small_chunks):
    q, k, v = _qkv(seed=8, positive=False)
    extra = _rule_inputs(rule, seed=9)
    names = list(extra)
    _gradcheck(lambda q, k, v, *rest: lt.linear_attention(q, k, v, feature_map=feature_map, causal=True,
                                                          method=method, **dict(zip(names, rest))),
               [q, k, v, *extra.values()], fast="delta" in rule and method == "quadratic")


@needs_fm_vjp
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["hedgehog", "t2r"])
def test_gradcheck_hedgehog_parameters(name, causal):
    """d_params flows back to the map's parameters passed as tensors (hedgehog, and t2r's relu(W x + b))."""
    fmap = fm.get(name)
    if not hasattr(fmap, "materialize"):
        pytest.skip("HedgehogFeatureMap.materialize not merged yet")
    fmap.materialize(D)
    q, k, v = _qkv(seed=10, positive=False, shape=(1, 1, 6))
    g = _gen(11)
    W = (torch.eye(D, dtype=torch.float64) + 0.2 * torch.randn(D, D, generator=g, dtype=torch.float64))
    b = 0.1 * torch.randn(D, generator=g, dtype=torch.float64)
    W.requires_grad_(), b.requires_grad_()

    def fn(q, k, v, W, b):
        return lt.linear_attention(q, k, v, feature_map=fmap, causal=causal, method="quadratic",
                                   feature_map_params={"W": W, "b": b})

    _gradcheck(fn, [q, k, v, W, b])
    np.testing.assert_array_equal(fmap.parameters()["W"], W.detach().numpy())  # the map took the values


@needs_fm_vjp
@pytest.mark.parametrize("method", ["quadratic", "chunked"])
def test_a_shared_map_object_takes_each_calls_own_parameters_in_its_backward(method):
    """Two calls through one map object (two layers sharing it) with other parameters: the first call's
    backward uses its own parameters, not the ones the second forward wrote into the map."""
    fmap = fm.get("hedgehog")
    fmap.materialize(D)
    q, k, v = _qkv(seed=12, positive=False, shape=(1, 1, 6))
    P1 = {n: torch.tensor(a, dtype=torch.float64, requires_grad=True) for n, a in fmap.parameters().items()}
    P2 = {n: 1.5 * t.detach() + 0.1 for n, t in P1.items()}
    o1 = lt.linear_attention(q, k, v, causal=True, feature_map=fmap, method=method, feature_map_params=P1)
    ref = torch.autograd.grad(o1.square().sum(), [q, k, P1["W"], P1["b"]], retain_graph=True)
    lt.linear_attention(q, k, v, causal=True, feature_map=fmap, method=method, feature_map_params=P2)
    got = torch.autograd.grad(o1.square().sum(), [q, k, P1["W"], P1["b"]])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["elu", "relu", "squared_relu", "identity"])
def test_maps_applied_by_torch_equal_the_numpy_maps(name):
    """The built-in elementwise maps run as torch ops; a subclass takes the NumPy map and its vjp: same numbers."""
    cls = type(fm.get(name))
    numpy_path = type("NumpyPath", (cls,), {})()
    q, k, v = _qkv(seed=25, positive=False)
    extra = _rule_inputs("decay_token", seed=26)
    gout = torch.randn(B, H, N, M, generator=_gen(27), dtype=torch.float64)
    res = []
    for fmap in (name, numpy_path):
        out = lt.linear_attention(q, k, v, feature_map=fmap, causal=True, method="chunked", eps=None, **extra)
        res.append((out, *torch.autograd.grad(out, (q, k, v, extra["decay"]), gout)))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------
# forward values, agreement with the NumPy API
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rule", RULES)
def test_forward_equals_numpy_api(rule, dtype):
    q, k, v = _qkv(seed=12, dtype=dtype)
    extra = _rule_inputs(rule, seed=13, dtype=dtype)
    out, st = lt.linear_attention(q, k, v, feature_map=None, causal=True, method="chunked", return_state=True,
                                  **extra)
    npkw = {nm: t.detach().numpy() for nm, t in extra.items()}
    ref, ref_st = linattn_nb.linear_attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(),
                                              feature_map=None, causal=True, method="chunked", return_state=True,
                                              **npkw)
    assert out.dtype == dtype and out.shape == (B, H, N, M)
    np.testing.assert_allclose(out.detach().numpy(), ref, rtol=1e-5 if dtype == torch.float32 else 1e-12,
                               atol=1e-6 if dtype == torch.float32 else 1e-12)
    np.testing.assert_allclose(st.S.detach().numpy(), ref_st.S, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(st.z.detach().numpy(), ref_st.z, rtol=1e-5, atol=1e-6)
    assert st.position == ref_st.position == N and st.rule == ref_st.rule


def test_noncausal_forward_equals_numpy_api():
    q, k, v = _qkv(seed=14, positive=False)
    out = lt.linear_attention(q, k, v)
    ref = linattn_nb.linear_attention(*(x.detach().numpy() for x in (q, k, v)))
    np.testing.assert_allclose(out.detach().numpy(), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rule", ["additive", "decay_head", "gate", "gated_delta"])
def test_gradients_equal_linear_attention_vjp(rule):
    """Same numbers as linattn_nb.linear_attention_vjp, shapes of broadcast inputs kept, dtypes of the inputs."""
    q, k, v = _qkv(seed=15, dtype=torch.float32)
    extra = _rule_inputs(rule, seed=16, dtype=torch.float32)
    out = lt.linear_attention(q, k, v, feature_map=None, causal=True, method="quadratic", **extra)
    gout = torch.randn(out.shape, generator=_gen(17))
    out.backward(gout)
    ref = linattn_nb.linear_attention_vjp(*(x.detach().numpy() for x in (q, k, v)), gout.numpy(),
                                          feature_map=None, causal=True, method="quadratic",
                                          **{nm: t.detach().numpy() for nm, t in extra.items()})
    for t, r in ((q, ref.dq), (k, ref.dk), (v, ref.dv)):
        assert t.grad.dtype == torch.float32
        np.testing.assert_allclose(t.grad.numpy(), r, rtol=1e-6, atol=1e-6)
    for nm, t in extra.items():
        r = getattr(ref, "d_" + nm)
        assert t.grad.shape == t.shape and t.grad.dtype == torch.float32
        np.testing.assert_allclose(t.grad.numpy(), r, rtol=1e-5, atol=1e-6)


def test_segments_chain_like_one_call():
    """Two segments joined by the state give the output and the gradients of one call over both."""
    q, k, v = _qkv(seed=18)
    extra = _rule_inputs("decay_token", seed=19)
    a = extra["decay"]
    whole = lt.linear_attention(q, k, v, feature_map=None, causal=True, method="quadratic", decay=a)
    grads_whole = torch.autograd.grad(whole.square().sum(), (q, k, v, a))
    s = 4
    o1, st = lt.linear_attention(q[..., :s, :], k[..., :s, :], v[..., :s, :], feature_map=None, causal=True,
                                 method="quadratic", decay=a[..., :s], return_state=True)
    o2 = lt.linear_attention(q[..., s:, :], k[..., s:, :], v[..., s:, :], feature_map=None, causal=True,
                             method="quadratic", decay=a[..., s:], initial_state=st)
    both = torch.cat([o1, o2], dim=-2)
    torch.testing.assert_close(both, whole, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(both.square().sum(), (q, k, v, a))
    for g1, g2 in zip(grads, grads_whole):
        torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)


def test_only_state_used():
    """A loss of the final state alone (no gradient for the output) still backpropagates."""
    q, k, v = _qkv(seed=20)
    _, st = lt.linear_attention(q, k, v, feature_map=None, causal=True, method="quadratic", return_state=True)
    st.S.sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() == 0  # queries do not reach the state
    assert k.grad.abs().sum() > 0 and v.grad.abs().sum() > 0


def test_no_grad_and_inputs_without_grad():
    q, k, v = (x.detach() for x in _qkv(seed=21))
    with torch.no_grad():
        out = lt.linear_attention(q, k, v, causal=True, method="quadratic", feature_map=None)
    assert not out.requires_grad
    v.requires_grad_()
    lt.linear_attention(q, k, v, causal=True, method="quadratic", feature_map=None).sum().backward()
    assert q.grad is None and v.grad is not None


# ---------------------------------------------------------------------------
# zero-copy, errors
# ---------------------------------------------------------------------------
def test_cpu_tensors_reach_the_front_end_zero_copy(monkeypatch):
    seen = {}
    real = _gradfront.prepare

    def spy(q, k, v, **kw):
        seen.update(q=q, k=k, v=v, decay=kw.get("decay"))
        return real(q, k, v, **kw)

    monkeypatch.setattr(_gradfront, "prepare", spy)
    q, k, v = _qkv(seed=22)
    a = _rule_inputs("decay_token")["decay"]
    lt.linear_attention(q, k, v, feature_map=None, causal=True, method="quadratic", decay=a)
    for name, t in (("q", q), ("k", k), ("v", v), ("decay", a)):
        assert isinstance(seen[name], np.ndarray)
        assert np.shares_memory(seen[name], t.detach().numpy()), name


def test_errors():
    q, k, v = _qkv(seed=23)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        lt.linear_attention(q.detach().numpy(), k, v)
    with pytest.raises(TypeError, match="v must be float16, float32 or float64.*bfloat16"):
        lt.linear_attention(q, k, v.detach().to(torch.bfloat16))
    with pytest.raises(TypeError, match="k must be float16, float32 or float64"):
        lt.linear_attention(q, torch.ones(k.shape, dtype=torch.int64), v)
    with pytest.raises(TypeError, match="q must be a real floating tensor"):
        lt.linear_attention(q.detach().to(torch.complex128), k, v)
    with pytest.raises(ValueError, match="decay is on device meta"):
        lt.linear_attention(q, k, v, causal=True, decay=torch.ones(B, H, N, device="meta"))
    with pytest.raises(TypeError, match="initial_state.S must be a torch.Tensor"):
        lt.linear_attention(q, k, v, causal=True, initial_state=(np.zeros((B, H, D, M)), torch.zeros(B, H, D)))
    with pytest.raises(ValueError, match="decay.*causal=True"):  # the core's own validation
        lt.linear_attention(q, k, v, decay=torch.full((B, H, N), 0.5))
    with pytest.raises(ValueError, match="feature_map_params.*no parameter"):
        lt.linear_attention(q, k, v, feature_map_params={"W": torch.eye(D)})


def test_sparse_tensors_and_non_finite_map_parameters_are_refused_by_name():
    """A sparse tensor failed inside torch (``.contiguous()``, ``.numpy()``) without naming the argument; a
    NaN map parameter passed check_finite, was written into the caller's map and was blamed on the inputs'
    features.  Both are now refused naming the argument, and the map keeps its parameters."""
    q, k, v = _qkv(seed=25)
    with pytest.raises(TypeError, match=r"^q must be a dense \(strided\) tensor, got layout torch.sparse_coo"):
        lt.linear_attention(q.detach().to_sparse(), k, v)
    with pytest.raises(TypeError, match=r"^decay must be a dense"):
        lt.linear_attention(q, k, v, causal=True, decay=torch.full((B, H, N), 0.9, dtype=torch.float64).to_sparse())
    with pytest.raises(TypeError, match=r"^v must be a dense"):
        lt.dplr_attention(q, k, v.detach().to_sparse(), rule="kda", decay=0.9, beta=0.5)
    fmap = fm.get("hedgehog")
    fmap.materialize(D)
    W0 = np.array(fmap.parameters()["W"])
    W = torch.tensor(W0)
    W[0, 0] = float("nan")
    for call in (lambda: lt.linear_attention(q, k, v, causal=True, feature_map=fmap, feature_map_params={"W": W}),
                 lambda: lt.dplr_attention(q, k, v, rule="kda", decay=0.9, beta=0.5, feature_map=fmap,
                                           feature_map_params={"W": W})):
        with pytest.raises(ValueError, match=r"^feature_map_params\['W'\] contains 1 non-finite value\(s\)"):
            call()
        np.testing.assert_array_equal(fmap.parameters()["W"], W0)


def test_in_place_change_after_forward_is_refused():
    q, k, v = _qkv(seed=24)
    qq = q * 1.0
    out = lt.linear_attention(qq, k, v, feature_map=None, causal=True, method="quadratic")
    with torch.no_grad():
        qq.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# ---------------------------------------------------------------------------
# the module
# ---------------------------------------------------------------------------
MODULE_CASES = [dict(), dict(decay="head"), dict(decay="token"), dict(decay="gate"),
                dict(rule="delta"), dict(rule="delta", decay="token"), dict(causal=False), dict(conv_size=3),
                dict(rule="gated_delta", decay="head"), dict(rule="gate", decay="gate")]


@pytest.mark.parametrize("kw", MODULE_CASES, ids=lambda kw: "-".join(f"{a}={b}" for a, b in kw.items()) or "default")
def test_module_forward_backward(kw):
    torch.manual_seed(0)
    layer = lt.LinearAttention(8, 2, feature_map=None, method="quadratic", dtype=torch.float64, **kw)
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    y = layer(x)
    assert y.shape == x.shape
    y.square().mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("named, base", [(dict(rule="decay", decay="token"), dict(decay="token")),
                                         (dict(rule="gate", decay="gate"), dict(decay="gate")),
                                         (dict(rule="gated_delta", decay="head"), dict(rule="delta", decay="head"))])
def test_module_rule_named_directly_is_the_rule_its_options_select(named, base):
    """A forgetting rule named by ``rule`` is the layer that ``rule`` without forgetting and ``decay`` build."""
    layers = []
    for kw in (named, base):
        torch.manual_seed(3)
        layers.append(lt.LinearAttention(8, 2, feature_map=None, method="quadratic", dtype=torch.float64, **kw))
    assert layers[0].update_rule == layers[1].update_rule == named["rule"]
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    torch.testing.assert_close(layers[0](x), layers[1](x), rtol=0, atol=0)


def test_module_gradcheck_delta_rule():
    """End to end through projections, sigmoid beta and a per-token decay (gated delta rule)."""
    torch.manual_seed(1)
    layer = lt.LinearAttention(4, 2, feature_map=None, rule="delta", decay="token", method="quadratic",
                               dtype=torch.float64)
    x = torch.randn(1, 5, 4, dtype=torch.float64, requires_grad=True)
    _gradcheck(layer, [x])


def test_module_state_round_trip():
    torch.manual_seed(2)
    layer = lt.LinearAttention(8, 2, feature_map=None, method="quadratic", decay="token", dtype=torch.float64)
    x = torch.randn(1, 9, 8, dtype=torch.float64)
    y = layer(x)
    y1, st = layer(x[:, :5], return_state=True)
    y2 = layer(x[:, 5:], initial_state=st)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=1e-12, atol=1e-12)
    assert st.S.shape == (1, 2, 4, 4) and st.position == 5


def test_module_errors():
    with pytest.raises(ValueError, match="not divisible"):
        lt.LinearAttention(10, 3)
    with pytest.raises(ValueError, match="rule must be one of"):
        lt.LinearAttention(8, 2, rule="hebbian")
    with pytest.raises(ValueError, match="need causal=True"):
        lt.LinearAttention(8, 2, causal=False, rule="delta")
    with pytest.raises(ValueError, match="cannot be combined"):
        lt.LinearAttention(8, 2, rule="delta", decay="gate")
    # a rule that forgets needs a decay option of its own form
    with pytest.raises(ValueError, match="decay=None cannot be combined with rule='decay'; use decay= one of 'head', "
                                         "'token'"):
        lt.LinearAttention(8, 2, rule="decay")
    with pytest.raises(ValueError, match="decay='gate' cannot be combined with rule='gated_delta'"):
        lt.LinearAttention(8, 2, rule="gated_delta", decay="gate")
    with pytest.raises(ValueError, match="decay='token' cannot be combined with rule='gate'; use decay= one of 'gate'"):
        lt.LinearAttention(8, 2, rule="gate", decay="token")
    with pytest.raises(ValueError, match="no trainable parameters"):
        lt.LinearAttention(8, 2, learn_feature_map=True)
    layer = lt.LinearAttention(8, 2, conv_size=2)
    with pytest.raises(ValueError, match=r"x must have shape \(B, N, d_model=8\)"):
        layer(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="conv_size"):
        layer(torch.randn(1, 3, 8), initial_state=(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4)))


@pytest.mark.parametrize("name", ["favor+", "rff"])
def test_module_random_map_projection_is_a_buffer(name, monkeypatch):
    """A random map's W is the layer's persistent buffer, drawn at construction from torch's generator: a
    fresh layer given the state_dict computes the same outputs (it drew another W before the fix: |dy| 0.35
    for favor+), and no warning says that each call draws another W."""
    import copy
    import warnings

    monkeypatch.setattr(fm, "_WARNED_BY_NAME", set())  # the by-name warning shows once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        layer = lt.LinearAttention(4, 2, feature_map=name, method="quadratic", dtype=torch.float64)
    assert not [w for w in caught if "random projection W" in str(w.message)]
    W = layer.feature_map_projection
    assert W.dtype == torch.float64 and W.shape == (layer.feature_map.num_features, 2)
    assert "feature_map_projection" in layer.state_dict()
    torch.manual_seed(0)  # torch's seed fixes a map given by name
    assert torch.equal(lt.LinearAttention(4, 2, feature_map=name, dtype=torch.float64).feature_map_projection, W)
    x = torch.randn(1, 5, 4, dtype=torch.float64)
    y = layer(x)
    torch.manual_seed(1)
    fresh = lt.LinearAttention(4, 2, feature_map=name, method="quadratic", dtype=torch.float64)
    assert not torch.equal(fresh.feature_map_projection, W)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh(x), y) and torch.equal(copy.deepcopy(layer)(x), y)
    # a map instance keeps its own W; a layer whose buffer changes computes with a copy, the shared map unchanged
    shared = fm.get(name, seed=5)
    shared.materialize(2)
    W0 = shared.W.copy()
    a, b = (lt.LinearAttention(4, 2, feature_map=shared, method="quadratic", dtype=torch.float64) for _ in range(2))
    np.testing.assert_array_equal(a.feature_map_projection.numpy(), W0)
    with torch.no_grad():
        b.feature_map_projection.mul_(0.5)
    b(x)
    np.testing.assert_array_equal(shared.W, W0)
    np.testing.assert_array_equal(b.feature_map.W, 0.5 * W0)
    # maps without a random projection: no buffer, no new state_dict key
    plain = lt.LinearAttention(4, 2)
    assert plain.feature_map_projection is None and "feature_map_projection" not in plain.state_dict()


@pytest.mark.parametrize("flag", ["causal", "learn_feature_map", "bias", "check_finite"])
@pytest.mark.parametrize("value", ["False", None, 1])
def test_module_flags_must_be_bools(flag, value):
    """causal="False" built a causal layer (bool("False")) and causal=None a non-causal one: now a TypeError."""
    with pytest.raises(TypeError, match=f"{flag} must be True or False, got {value!r}"):
        lt.LinearAttention(8, 2, **{flag: value})


def test_module_state_of_a_dplr_rule_names_it():
    """A kda layer's state given to a delta layer: the message names the state's rule, with no empty "()"."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 4, dtype=torch.float64)
    _, st = lt.LinearAttention(4, 1, rule="kda", feature_map="l2", dtype=torch.float64)(x, return_state=True)
    delta = lt.LinearAttention(4, 1, rule="delta", feature_map="l2", dtype=torch.float64)
    with pytest.raises(ValueError, match="'kda' update rule") as err:
        delta(x, initial_state=st)
    assert "()" not in str(err.value) and "dplr_attention(rule='kda')" in str(err.value)


def test_module_with_a_dplr_rule_makes_its_arguments_from_the_input(monkeypatch):
    """rule="kda": the layer's gate and beta projections feed dplr_attention; gradients reach every parameter."""
    torch.manual_seed(0)
    layer = lt.LinearAttention(8, 2, head_dim=4, rule="kda", feature_map="l2", method="scan", dtype=torch.float64)
    assert layer.update_rule == "kda" and set(layer.dplr_proj) == {"log_decay", "beta"}
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    # the same call written out: projections, heads, the rule's arguments, the differentiable entry
    B, N, H, D = 2, 6, 2, 4
    q, k, v = (p(x).reshape(B, N, H, D).transpose(1, 2) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    log_decay = (torch.nn.functional.logsigmoid(layer.dplr_proj["log_decay"](x)) / 16).reshape(B, N, H, D)
    beta = torch.sigmoid(layer.dplr_proj["beta"](x)).transpose(1, 2)
    o = lt.dplr_attention(q, k, v, rule="kda", log_decay=log_decay.transpose(1, 2), beta=beta, feature_map="l2",
                          method="quadratic")
    torch.testing.assert_close(y, layer.out_proj(o.transpose(1, 2).reshape(B, N, H * D)), rtol=1e-12, atol=1e-12)
    y.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
    small = lt.LinearAttention(4, 1, rule="kda", feature_map="l2", method="scan", dtype=torch.float64)
    assert torch.autograd.gradcheck(small, (torch.randn(1, 4, 4, dtype=torch.float64, requires_grad=True),))
    bare = dataclasses.replace(linattn_nb.rules.get_dplr_rule("rwkv7"), name="rwkv7_bare", layer={})
    monkeypatch.setitem(linattn_nb.rules.DPLR_RULES, "rwkv7_bare", bare)
    with pytest.raises(ValueError, match="has no layer form"):
        lt.LinearAttention(8, 2, rule="rwkv7_bare")
    with pytest.raises(ValueError, match="pass decay=None"):
        lt.LinearAttention(8, 2, rule="kda", decay="token")
    with pytest.raises(ValueError, match="needs causal=True"):
        lt.LinearAttention(8, 2, rule="kda", causal=False)


def _toy_loss(model, head, x, y):
    return torch.nn.functional.mse_loss(head(model(x)), y)


@pytest.mark.parametrize("kw", [dict(feature_map=None), dict(feature_map=None, rule="delta", decay="head")],
                         ids=["additive", "gated_delta"])
def test_module_trains(kw):
    """A few Adam steps on a toy task (predict the running mean of the inputs) lower the loss."""
    torch.manual_seed(3)
    model = lt.LinearAttention(8, 2, method="quadratic", **kw)
    head = torch.nn.Linear(8, 8)
    x = torch.rand(4, 12, 8)
    y = torch.cumsum(x, 1) / torch.arange(1, 13)[None, :, None]
    opt = torch.optim.Adam(list(model.parameters()) + list(head.parameters()), lr=1e-2)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = _toy_loss(model, head, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@needs_fm_vjp
def test_module_learns_hedgehog_map():
    torch.manual_seed(4)
    layer = lt.LinearAttention(8, 2, feature_map="hedgehog", learn_feature_map=True, method="quadratic",
                               dtype=torch.float64)
    assert sorted(layer.feature_map_params) == ["W", "b"]
    W0 = layer.feature_map_params["W"].detach().clone()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    layer(x).square().mean().backward()
    assert layer.feature_map_params["W"].grad.abs().sum() > 0
    opt.step()
    assert not torch.equal(layer.feature_map_params["W"], W0)
    layer(x)  # the map computes with the updated values
    np.testing.assert_array_equal(layer.feature_map.parameters()["W"], layer.feature_map_params["W"].detach().numpy())


@pytest.mark.slow  # with the package's other docstring examples, in the full suite
@needs_fm_vjp
def test_docstring_examples():
    res = doctest.testmod(lt, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0


def test_core_never_imports_torch():
    import subprocess
    import sys

    code = "import sys, linattn_nb, linattn_nb.attention, linattn_nb._gradfront; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow  # two fresh processes that may compile
@pytest.mark.parametrize("entry", ["adapter", "numpy"])
def test_the_first_call_keeps_torchs_thread_count(entry):
    """The first parallel kernel starts Numba's omp pool, which set the starting thread's OpenMP count to
    Numba's: a script's torch.set_num_threads(1), the remedy docs/threads.md gives for torch's spinning pool,
    became 2 after the adapter's first call (a fresh process: the pool starts once per process).  A first
    NumPy call is checked too."""
    import os
    import subprocess
    import sys

    call = ("lt.linear_attention(q, q, q, causal=True)" if entry == "adapter" else
            "la.linear_attention(q.numpy(), q.numpy(), q.numpy(), causal=True, method='chunked')")
    code = ("import torch; torch.set_num_threads(1)\n"
            "import numba, linattn_nb as la, linattn_nb.torch as lt\n"
            "q = torch.randn(16, 512, 64)\n"
            f"{call}\n"
            "print(torch.get_num_threads(), numba.threading_layer(), numba.get_num_threads())")
    env = dict(os.environ, NUMBA_NUM_THREADS="2", LINATTN_CPU_CHUNKED_SERIAL_MAX_WORK="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    torch_threads, layer, numba_threads = out.stdout.split()
    assert torch_threads == "1" and numba_threads == "2", out.stdout


# ---------------------------------------------------------------------------
# dplr_attention
# ---------------------------------------------------------------------------
DPLR_B, DPLR_N, DPLR_D, DPLR_M = 2, 5, 3, 2


def _f64(x, grad=True):
    return torch.tensor(np.asarray(x), dtype=torch.float64).requires_grad_(grad)


def _dplr_general(seed=40, r=2, sub=0):
    """General-form arguments (float64 tensors that require grad): per-feature log_diag, r factors, beta;
    ``sub`` writes per token when > 0.  Small a, b: the transition stays near its diagonal, so the
    normaliser stays away from its floor."""
    rng = np.random.default_rng(seed)
    Bn, n, d, m = DPLR_B, DPLR_N, DPLR_D, DPLR_M
    w = (Bn, n, sub) if sub else (Bn, n)
    args = {"q": rng.standard_normal((Bn, n, d)), "k": rng.standard_normal(w + (d,)),
            "v": rng.standard_normal(w + (m,)),
            "a": 0.3 * rng.standard_normal((Bn, n, sub or r, d)), "b": 0.3 * rng.standard_normal((Bn, n, sub or r, d)),
            "log_diag": np.log(rng.uniform(0.5, 0.95, size=(Bn, n, d))), "beta": rng.uniform(0.2, 1.0, size=w),
            "S0": rng.standard_normal((Bn, d, m)), "z0": rng.uniform(1.0, 2.0, size=(Bn, d))}
    return {key: _f64(x) for key, x in args.items()}


def _dplr_named(name, seed=41, log_form=False):
    """A named rule's arguments at interior values (float64 tensors that require grad): q, k, v, then the rule's."""
    rule = linattn_nb.rules.get_dplr_rule(name)
    rng = np.random.default_rng(seed)
    r = 2 if rule.substeps else 0
    w = (DPLR_B, DPLR_N, r) if r else (DPLR_B, DPLR_N)
    args = {"q": rng.standard_normal((DPLR_B, DPLR_N, DPLR_D)), "k": rng.standard_normal(w + (DPLR_D,)),
            "v": rng.standard_normal(w + (DPLR_M,))}
    inputs = rule.sample(rng, DPLR_B, DPLR_N, DPLR_D, r)
    if "decay" in inputs:  # away from a reset (0) and from 1: the differences stay inside the domain
        inputs["decay"] = np.clip(inputs["decay"], 0.3, 0.95)
        if log_form:
            inputs["log_decay"] = np.log(inputs.pop("decay"))
    if "beta" in inputs:
        inputs["beta"] = np.clip(inputs["beta"], 0.1, 1.9)
    if "iclr" in inputs:
        inputs["iclr"] = np.clip(inputs["iclr"], 0.05, 0.95)
    args.update(inputs)
    return {key: _f64(x) for key, x in args.items()}


def _dplr_general_fn(normalize, method, names):
    def fn(q, k, v, *rest):
        kw = dict(zip(names, rest))
        S0, z0 = kw.pop("S0"), kw.pop("z0")
        out, st = lt.dplr_attention(q, k, v, feature_map="elu", method=method, normalize=normalize,
                                    initial_state=linattn_nb.LinearState(S0, z0, 0, "dplr"), return_state=True,
                                    **kw)
        return out, st.S, st.z

    return fn


@pytest.mark.parametrize("method", ["quadratic", "scan"])
@pytest.mark.parametrize("normalize", [False, True])
def test_dplr_gradcheck_general_form(normalize, method):
    args = _dplr_general()
    names = list(args)[3:]
    _gradcheck(_dplr_general_fn(normalize, method, names), list(args.values()))


@pytest.mark.parametrize("normalize", [False, True])
def test_dplr_gradcheck_general_form_substeps(normalize):
    args = _dplr_general(seed=42, sub=2)
    names = list(args)[3:]
    _gradcheck(_dplr_general_fn(normalize, "scan", names), list(args.values()))


@pytest.mark.parametrize("name,log_form", [("kda", False), ("kda", True), ("rwkv7", False), ("rwkv7", True),
                                           ("delta_product", False), ("gated_delta_product", False),
                                           ("gated_delta_product", True)])
def test_dplr_gradcheck_named_rules(name, log_form):
    args = _dplr_named(name, log_form=log_form)
    names = list(args)[3:]
    assert names and all(t.requires_grad for t in args.values())

    def fn(q, k, v, *rest):
        out, st = lt.dplr_attention(q, k, v, rule=name, feature_map="l2", return_state=True,
                                    **dict(zip(names, rest)))
        return out, st.S

    _gradcheck(fn, list(args.values()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", [None, "kda", "rwkv7", "delta_product", "gated_delta_product"])
def test_dplr_forward_equals_numpy_api(name, dtype):
    if name is None:
        args = _dplr_general(seed=43)
        S0, z0 = args.pop("S0"), args.pop("z0")
        extra = {"normalize": True, "feature_map": "elu"}
    else:
        args = _dplr_named(name, seed=44)
        S0 = z0 = None
        extra = {"rule": name, "feature_map": "l2"}
    q, k, v = (args.pop(key).detach().to(dtype) for key in ("q", "k", "v"))
    init = None if S0 is None else linattn_nb.LinearState(S0, z0, 3, "dplr")
    out, st = lt.dplr_attention(q, k, v, initial_state=init, return_state=True, **args, **extra)
    as_np = lambda t: t.detach().numpy()  # noqa: E731
    init_np = None if S0 is None else linattn_nb.LinearState(as_np(S0), as_np(z0), 3, "dplr")
    ref, st_ref = linattn_nb.dplr_attention(as_np(q), as_np(k), as_np(v), initial_state=init_np, return_state=True,
                                            **{key: as_np(t) for key, t in args.items()}, **extra)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out.detach().numpy(), ref)
    np.testing.assert_array_equal(st.S.detach().numpy(), st_ref.S)
    np.testing.assert_array_equal(st.z.detach().numpy(), st_ref.z)
    assert st.position == st_ref.position and st.rule == st_ref.rule


def test_dplr_gradients_equal_the_vjp_and_constants_get_none():
    """Tensors get dplr_attention_vjp's gradients in their dtype; NumPy arrays and floats are constants."""
    args = _dplr_named("kda", seed=45)
    q, k, v = (args[key].detach().to(torch.float32).requires_grad_() for key in ("q", "k", "v"))
    decay, beta = args["decay"], args["beta"].detach().numpy()  # beta: a constant
    out = lt.dplr_attention(q, k, v, rule="kda", decay=decay, beta=beta, feature_map="l2")
    G = torch.randn(out.shape, generator=_gen(5), dtype=torch.float32)
    (out * G).sum().backward()
    g = linattn_nb.dplr_attention_vjp(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), G.numpy(),
                                      rule="kda", decay=decay.detach().numpy(), beta=beta, feature_map="l2")
    for t, ref in ((q, g.dq), (k, g.dk), (v, g.dv), (decay, g.d_inputs["decay"])):
        assert t.grad.dtype == t.dtype
        np.testing.assert_allclose(t.grad.double().numpy(), ref, rtol=1e-6, atol=1e-6)
    # NumPy a, b, log_diag: only q, k, v are differentiated
    q2 = q.detach().double().requires_grad_()
    a = np.zeros((DPLR_B, DPLR_N, DPLR_D))
    out = lt.dplr_attention(q2, k.detach().double(), v.detach().double(), a=a, b=a,
                            log_diag=np.full((DPLR_B, DPLR_N), -0.1))
    out.sum().backward()
    assert q2.grad is not None and q2.grad.shape == q2.shape


def test_dplr_only_state_used_and_segments_chain():
    args = _dplr_named("gated_delta_product", seed=46)
    q, k, v, decay, beta = args.values()
    whole, st = lt.dplr_attention(q, k, v, rule="gated_delta_product", decay=decay, beta=beta, feature_map="l2",
                                  return_state=True)
    cut = 2
    first, st1 = lt.dplr_attention(q[:, :cut], k[:, :cut], v[:, :cut], rule="gated_delta_product",
                                   decay=decay[:, :cut], beta=beta[:, :cut], feature_map="l2", return_state=True)
    second, st2 = lt.dplr_attention(q[:, cut:], k[:, cut:], v[:, cut:], rule="gated_delta_product",
                                    decay=decay[:, cut:], beta=beta[:, cut:], feature_map="l2", initial_state=st1,
                                    return_state=True)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, rtol=1e-12, atol=1e-12)
    assert st2.position == DPLR_N and st2.rule == "gated_delta_product"
    st2.S.sum().backward()  # the outputs unused: the gradient flows through the states only
    assert q.grad is None or not q.grad.any()  # the state does not read the queries
    assert float(k.grad[:, :cut].abs().sum()) > 0 and float(decay.grad[:, :cut].abs().sum()) > 0


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"a": torch.zeros(DPLR_B, DPLR_N, DPLR_D + 1), "b": torch.zeros(DPLR_B, DPLR_N, DPLR_D + 1)}, ValueError,
     "a must have shape"),
    ({"a": torch.zeros(DPLR_B, DPLR_N, DPLR_D)}, TypeError, "missing argument: b"),
    ({"a": torch.zeros(DPLR_B, DPLR_N, DPLR_D), "b": torch.zeros(DPLR_B, DPLR_N, DPLR_D),
      "log_diag": torch.ones(DPLR_B, DPLR_N)}, ValueError, "<= 0"),
    ({"rule": "kda", "beta": torch.ones(DPLR_B, DPLR_N)}, TypeError, "decay or log_decay"),
    ({"rule": "kda", "beta": torch.full((DPLR_B, DPLR_N), 3.0), "decay": torch.ones(DPLR_B, DPLR_N, DPLR_D)},
     ValueError, "beta must lie in"),
    ({"rule": "rwkv7", "decay": torch.ones(DPLR_B, DPLR_N, DPLR_D), "kappa": torch.ones(DPLR_B, DPLR_N, DPLR_D),
      "iclr": torch.full((DPLR_B, DPLR_N, DPLR_D), 2.0)}, ValueError, "iclr must lie in"),
    ({"rule": "nope"}, ValueError, "unknown DPLR rule 'nope'"),
    ({"a": torch.zeros(DPLR_B, DPLR_N, DPLR_D), "b": torch.zeros(DPLR_B, DPLR_N, DPLR_D), "method": "blocked"},
     ValueError, "method must be one of"),
    ({"a": torch.zeros(DPLR_B, DPLR_N, DPLR_D), "b": torch.zeros(DPLR_B, DPLR_N, DPLR_D), "decay": 0.5},
     TypeError, "unexpected"),
])
def test_dplr_bad_arguments_raise_the_numpy_errors(kwargs, exc, match):
    q, k, v = (torch.randn(DPLR_B, DPLR_N, d, generator=_gen(47), dtype=torch.float64) for d in (DPLR_D, DPLR_D,
                                                                                                 DPLR_M))
    with pytest.raises(exc, match=match):
        lt.dplr_attention(q, k, v, **kwargs)
    np_kwargs = {key: x.numpy() if isinstance(x, torch.Tensor) else x for key, x in kwargs.items()}
    with pytest.raises(exc, match=match):
        linattn_nb.dplr_attention(q.numpy(), k.numpy(), v.numpy(), **np_kwargs)


def test_dplr_adapter_errors():
    args = _dplr_general(seed=48)
    q, k, v, a, b = (args[key] for key in ("q", "k", "v", "a", "b"))
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        lt.dplr_attention(q.detach().numpy(), k, v, a=a, b=b)
    with pytest.raises(TypeError, match="k must be float16, float32 or float64.*bfloat16"):
        lt.dplr_attention(q, k.detach().to(torch.bfloat16), v, a=a, b=b)
    with pytest.raises(TypeError, match="out= is not supported"):
        lt.dplr_attention(q, k, v, a=a, b=b, out=torch.empty(DPLR_B, DPLR_N, DPLR_M))
    with pytest.raises(ValueError, match="a is on device meta"):
        lt.dplr_attention(q, k, v, a=torch.zeros(a.shape, device="meta"), b=b)
    with pytest.raises(TypeError, match="initial_state.z must be a torch.Tensor"):
        lt.dplr_attention(q, k, v, a=a, b=b, initial_state=linattn_nb.LinearState(args["S0"], np.ones((2, 3)),
                                                                                     0, "dplr"))
    with pytest.raises(ValueError, match="feature_map_params.*no parameter"):
        lt.dplr_attention(q, k, v, a=a, b=b, feature_map_params={"W": torch.eye(DPLR_D)})
    qq = q * 1.0
    out = lt.dplr_attention(qq, k, v, a=a, b=b)
    with torch.no_grad():
        qq.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@needs_fm_vjp
def test_dplr_gradcheck_hedgehog_parameters():
    fmap = fm.get("hedgehog")
    fmap.materialize(DPLR_D)
    F = fmap.output_dim(DPLR_D)
    rng = np.random.default_rng(49)
    q, k, v = (_f64(rng.standard_normal((1, 4, d))) for d in (DPLR_D, DPLR_D, DPLR_M))
    a, b = (_f64(0.2 * rng.standard_normal((1, 4, F))) for _ in range(2))
    params = {n: _f64(p) for n, p in fmap.parameters().items()}
    names = list(params)

    def fn(q, k, v, a, b, *ps):
        return lt.dplr_attention(q, k, v, a=a, b=b, feature_map=fmap, normalize=True,
                                 feature_map_params=dict(zip(names, ps)))

    _gradcheck(fn, [q, k, v, a, b, *params.values()])


def test_linear_attention_refuses_a_second_derivative_inside_a_larger_graph():
    """The adapter's backward runs outside autograd: a second derivative through it raises even where other
    parts of the graph are twice differentiable (without the guard they would silently drop its part)."""
    q = torch.randn(1, 4, 3, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn(1, 4, 3, dtype=torch.float64), torch.randn(1, 4, 2, dtype=torch.float64)
    y = lt.linear_attention(q, k, v, causal=True, method="quadratic").square().sum() + q.pow(3).sum()
    (gq,) = torch.autograd.grad(y, q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|not differentiable|twice"):
        gq.sum().backward()


@pytest.mark.parametrize("fn", ["linear", "dplr", "conv"])
def test_a_gradient_penalty_on_a_loss_linear_in_the_outputs_raises(fn):
    """``grad((o * w).sum(), q, create_graph=True)`` sends the backward an incoming gradient that does not require
    grad; ``once_differentiable`` then returned gradients detached from q, and the penalty's second-order term was
    dropped from ``q.grad`` without an error.  Now differentiating those gradients raises; a ``create_graph=True``
    whose gradients are not differentiated again still works."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 3, dtype=torch.float64, requires_grad=True)
    k, v, w = (torch.randn(1, 4, 3, dtype=torch.float64) for _ in range(3))
    if fn == "linear":
        o = lt.linear_attention(q, k, v, causal=True)
    elif fn == "dplr":
        o = lt.dplr_attention(q, k, v, rule="kda", feature_map="l2", decay=torch.full((1, 4, 3), 0.5, dtype=q.dtype),
                              beta=torch.full((1, 4), 0.5, dtype=q.dtype))
    else:
        conv = torch.nn.Conv1d(3, 3, 2, groups=3, padding=1, dtype=torch.float64)
        o = lt._short_conv(q, conv)
    loss = (o * w).sum()
    (gq,) = torch.autograd.grad(loss, q, create_graph=True, retain_graph=True)
    np.testing.assert_array_equal(gq.detach().numpy(), torch.autograd.grad(loss, q, retain_graph=True)[0].numpy())
    with pytest.raises(RuntimeError, match="not differentiable"):
        (loss + gq.square().sum()).backward()


@pytest.mark.parametrize("rule", ["additive", "decay", "gate"])
def test_normalised_backward_is_the_vjps_fused_kernel(rule, monkeypatch):
    """The adapter's backward of the additive, decay and gate rules' normalised outputs (CPU, chunked) runs the
    fused kernel of ``linear_attention_vjp`` (no ``[num | den]`` kept from the forward) and gives its
    gradients; unnormalised outputs take the backward from the forward's values."""
    rng = np.random.default_rng(4)
    q, k, v, g = (rng.standard_normal((2, 3, 21, 4)).astype(np.float32) for _ in range(4))
    extra = {"additive": {}, "decay": {"decay": np.float32(0.9)},
             "gate": {"log_decay": (-0.2 * rng.random((2, 3, 21, 4))).astype(np.float32)}}[rule]
    seen = []
    real = _gradfront.backward_normalized

    def spy(*args, **kwargs):
        seen.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(_gradfront, "backward_normalized", spy)
    for normalize in (None, False):
        seen.clear()
        qt, kt, vt = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
        kw = dict(causal=True, method="chunked", normalize=normalize)
        out = lt.linear_attention(qt, kt, vt, **kw, **{n: torch.from_numpy(np.asarray(x)) for n, x in extra.items()})
        out.backward(torch.from_numpy(g))
        assert seen == ([True] if normalize is None else [])
        want = linattn_nb.linear_attention_vjp(q, k, v, g, **kw, **extra)
        for t, w in ((qt, want.dq), (kt, want.dk), (vt, want.dv)):
            # the map's VJP of the adapter's map object and the unnormalised VJP's sums (no forward run) round
            # in another order
            np.testing.assert_allclose(t.grad.numpy(), w, rtol=1e-5, atol=1e-6 * np.abs(w).max())


def test_fused_backward_that_overflows_float32_is_recomputed_and_named():
    """Output gradients of 3e38 (finite float32): the fused backward overflows float32 and is recomputed in
    float64, as ``linear_attention_vjp`` does, whose gradients overflow float32: ValueError naming one."""
    rng = np.random.default_rng(2)
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 8, 4)).astype(np.float32)).requires_grad_()
               for _ in range(3))
    out = lt.linear_attention(q, k, v, causal=True, method="chunked")
    with pytest.raises(ValueError, match="the gradient d[qkv] overflows float32"):
        out.backward(torch.full(out.shape, 3e38))


@pytest.mark.parametrize("name,code", [("elu", "KERNEL_CODE_ELU"), ("relu", "KERNEL_CODE_RELU")])
def test_cpu_adapter_keeps_the_librarys_map_and_matches_the_vjp_bit_for_bit(monkeypatch, name, code):
    """On CPU tensors the adapter hands the library's map to the front end (not torch-mapped features): the
    fused kernel runs the map's VJP on each chunk's rows, and the outputs and gradients are those of
    ``linear_attention`` and ``linear_attention_vjp``, bit for bit."""
    from linattn_nb.ops import _codes

    seen = []
    real = _gradfront.backward_chunked_normalized

    def spy(*args, **kwargs):
        seen.append(kwargs.get("maps"))
        return real(*args, **kwargs)

    monkeypatch.setattr(_gradfront, "backward_chunked_normalized", spy)
    rng = np.random.default_rng(6)
    q, k, v, g = (rng.standard_normal((2, 3, 53, 4)).astype(np.float32) for _ in range(4))
    qt, kt, vt = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
    kw = dict(causal=True, method="chunked", feature_map=name)
    out = lt.linear_attention(qt, kt, vt, **kw)
    out.backward(torch.from_numpy(g))
    assert len(seen) == 1 and seen[0][2] == getattr(_codes, code)
    assert np.array_equal(out.detach().numpy(), linattn_nb.linear_attention(q, k, v, **kw))
    want = linattn_nb.linear_attention_vjp(q, k, v, g, **kw)
    for t, w in ((qt, want.dq), (kt, want.dk), (vt, want.dv)):
        assert np.array_equal(t.grad.numpy(), w)


def test_torch_maps_are_for_cuda_tensors_only(monkeypatch):
    """The built-in maps applied with torch ops (then handed over as given features, whose gradients pass
    through) are those of CUDA tensors: a CPU call of every rule's form never calls them."""
    def refuse(x):
        raise AssertionError("torch map applied to a CPU tensor")

    monkeypatch.setattr(lt, "_TORCH_MAPS", {cls: refuse for cls in lt._TORCH_MAPS})
    rng = np.random.default_rng(1)
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 9, 4))).requires_grad_() for _ in range(3))
    cases = [dict(causal=True, feature_map=name) for name in ("elu", "relu", "squared_relu", "identity")]
    cases += [dict(causal=False), dict(causal=True, normalize=False), dict(causal=True, log_decay=-0.1),
              dict(causal=True, beta=0.5, feature_map="relu")]
    for kw in cases:
        lt.linear_attention(q, k, v, **kw).sum().backward()
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(lt._PRECOMPUTED.vjp(None, x, role="query")[0], x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_elu_map_adds_one_in_place_with_the_same_values_and_gradients(dtype):
    """The adapter's ELU+1 adds 1 in place on ELU's output (no second tensor): values and input gradients are
    those of ``elu(x) + 1.0`` bit for bit, through autograd (ELU's backward reads its input)."""
    x = torch.linspace(-30, 5, 1001, dtype=dtype).reshape(7, 143).requires_grad_()
    g = torch.from_numpy(np.random.default_rng(0).standard_normal((7, 143))).to(dtype)
    y = lt._TORCH_MAPS[fm.EluFeatureMap](x)
    y.backward(g)
    got = x.grad.clone()
    x.grad = None
    want = torch.nn.functional.elu(x) + 1.0
    want.backward(g)
    assert torch.equal(y, want) and torch.equal(got, x.grad)


def test_torchscript_trace_works_and_script_fails_as_documented():
    """docs/guide/gradients.md: ``torch.jit.trace`` of the layer gives its results on new inputs of the traced
    shape; ``torch.jit.script`` fails (keyword-only arguments with defaults)."""
    import warnings

    torch.manual_seed(0)
    layer = lt.LinearAttention(8, 2)
    x, x2 = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(layer, (x,), check_trace=False)
    torch.testing.assert_close(traced(x2), layer(x2), rtol=0, atol=0)
    with pytest.raises(Exception, match="keyword-only arguments"):
        torch.jit.script(layer)


@pytest.mark.parametrize("dplr", [False, True])
def test_threads_sharing_a_map_with_their_own_parameters(dplr):
    """Two threads, one Hedgehog map object, each call with its own ``feature_map_params``: the parameters
    are written into the map before it computes, so without the adapter's lock one thread computed with the
    other's (outputs off by up to 2.5, gradients by 1e3, silently).  Outputs and gradients equal the serial
    calls', bit for bit, over repeated races."""
    import threading

    fmap = fm.get("hedgehog")
    fmap.materialize(8)
    gen = torch.Generator().manual_seed(0)
    args = []
    for i in range(2):
        q, k, v = (torch.randn(2, 2, 256, 8, dtype=torch.float64, generator=gen) for _ in range(3))
        W = (torch.eye(8, dtype=torch.float64) * (1 + i)).requires_grad_()
        b = torch.full((8,), 0.1 * i, dtype=torch.float64).requires_grad_()
        args.append((q.requires_grad_(), k, v, W, b))

    def call(i, res):
        q, k, v, W, b = args[i]
        for x in (q, W, b):
            x.grad = None
        if dplr:
            F = fmap.output_dim(8)
            ab = torch.full((2, 2, 256, F), 0.01, dtype=torch.float64)
            out = lt.dplr_attention(q, k, v, a=ab, b=ab, feature_map=fmap, normalize=True,
                                    feature_map_params={"W": W, "b": b})
        else:
            out = lt.linear_attention(q, k, v, causal=True, feature_map=fmap, feature_map_params={"W": W, "b": b})
        out.square().sum().backward()
        res[i] = (out.detach(), q.grad.clone(), W.grad.clone(), b.grad.clone())

    serial = [None, None]
    for i in range(2):
        call(i, serial)
    for _ in range(8):
        par = [None, None]
        threads = [threading.Thread(target=call, args=(i, par)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(2):
            for got, want in zip(par[i], serial[i]):
                assert torch.equal(got, want)


def test_flags_must_be_bools():
    """``check_finite='False'`` was read as True (a truthy string) by the adapter, which does not go through
    linear_attention's front end; ``return_state='False'`` returned a state.  Both are refused, naming the flag,
    as linear_attention refuses them."""
    q = torch.randn(1, 4, 3)
    ab = torch.zeros(1, 4, 3)
    for flag in ("check_finite", "return_state"):
        with pytest.raises(TypeError, match=f"{flag} must be True or False, got 'False'"):
            lt.linear_attention(q, q, q, **{flag: "False"})
        with pytest.raises(TypeError, match=f"{flag} must be True or False, got 'False'"):
            lt.dplr_attention(q, q, q, a=ab, b=ab, **{flag: "False"})
    out, st = lt.linear_attention(q, q, q, causal=True, return_state=np.bool_(True))  # a NumPy bool is a bool
    assert st.S.dtype == torch.float64 and out.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_layer_leaves_the_callers_random_map_instance_as_it_was(dtype):
    """Building a layer wrote its dtype-rounded W into the caller's favor+ instance (max |dW| 7e-8 for float32,
    8e-4 for float16), so the same instance then gave other NumPy results; the layer now works on its own copy."""
    m = fm.get("favor+", seed=3)
    m.materialize(4)
    w0 = m.W.copy()
    x = np.random.default_rng(0).standard_normal((3, 2, 6, 4))
    before = linattn_nb.linear_attention(*x, feature_map=m)
    layer = lt.LinearAttention(8, 2, feature_map=m, dtype=dtype)
    np.testing.assert_array_equal(m.W, w0)
    np.testing.assert_array_equal(linattn_nb.linear_attention(*x, feature_map=m), before)
    np.testing.assert_array_equal(layer.feature_map.W, layer.feature_map_projection.double().numpy())


@pytest.mark.parametrize("kw, error, match", [
    (dict(method="nope"), ValueError, "method must be one of"),
    (dict(method=3), TypeError, "method must be a string"),
    (dict(rule="kda", feature_map="l2", method="aggregate"), ValueError, "method must be one of"),
    (dict(normalize="yes"), TypeError, "normalize must be True or False"),
    (dict(eps=-1.0), ValueError, "eps must be"),
    (dict(dtype=torch.bfloat16), TypeError, "dtype must be torch.float16, torch.float32 or torch.float64"),
])
def test_a_layer_with_a_bad_option_is_refused_when_built(kw, error, match):
    """method="nope", normalize="yes", eps=-1 and dtype=torch.bfloat16 built a layer that failed only at its first
    forward (bfloat16 with a message about the input x)."""
    with pytest.raises(error, match=match):
        lt.LinearAttention(8, 2, **kw)
    assert lt.LinearAttention(8, 2, normalize=None, eps=None, method="chunked").method == "chunked"
