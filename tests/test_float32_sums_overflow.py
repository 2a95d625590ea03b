"""Finite float32 inputs whose float32 sums overflow (keys of large features): the differentiable paths agree
with the float64 result, as :func:`linattn_nb.linear_attention` does, instead of returning 0 or NaN rows.

The torch adapter's forward and :func:`linattn_nb.linear_attention_vjp` ran their forward with the
kernels' checks off and divided in float32: where a normaliser overflowed, rows came out as 0 or NaN
(48 of 64 rows off by up to 0.3 with Hedgehog keys of 86, a training run of the MQAR study diverged on
it).  Now they run such a request again in float64; a gradient that is finite in float64 but overflows
float32 raises ValueError naming it.
"""
import numpy as np
import pytest

import linattn_nb as la

N = 64


def _inputs(fmap):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, N, 4)).astype(np.float32) for _ in range(3))
    # each key's features about 2e37 (Hedgehog: exp(86); ELU+1: 6e36 + 1): their sum over the tokens
    # overflows float32, the attention weights do not
    k[..., 0] = 86.0 if fmap == "hedgehog" else 6e36
    return q, k, v


def _f64(*xs):
    return tuple(x.astype(np.float64) for x in xs)


@pytest.mark.parametrize("fmap", ["hedgehog", "elu"])
def test_vjp_is_the_float64_one(fmap):
    q, k, v = _inputs(fmap)
    g = np.random.default_rng(1).standard_normal(v.shape).astype(np.float32)
    # one method for both: dk of the ELU+1 keys of 6e36 is a difference of far larger terms, whose rounding
    # differs between methods
    got = la.linear_attention_vjp(q, k, v, g, feature_map=fmap, causal=True, method="chunked")
    want = la.linear_attention_vjp(*_f64(q, k, v, g), feature_map=fmap, causal=True, method="chunked")
    for name in ("dq", "dk", "dv"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == np.float32 and np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6 * np.abs(b).max(), err_msg=name)


@pytest.mark.parametrize("fmap", ["hedgehog", "elu"])
def test_torch_adapter_forward_and_backward_are_the_float64_ones(fmap):
    torch = pytest.importorskip("torch")
    from linattn_nb import torch as lt

    q, k, v = _inputs(fmap)
    want = la.linear_attention(*_f64(q, k, v), feature_map=fmap, causal=True)
    assert np.isfinite(la.linear_attention(q, k, v, feature_map=fmap, causal=True)).all()
    qt, kt, vt = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    out = lt.linear_attention(qt, kt, vt, feature_map=fmap, causal=True, method="chunked")
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=0, atol=1e-6)
    g = np.random.default_rng(1).standard_normal(v.shape).astype(np.float32)
    out.backward(torch.from_numpy(g))
    ref = la.linear_attention_vjp(*_f64(q, k, v, g), feature_map=fmap, causal=True, method="chunked")
    for t, b in ((qt, ref.dq), (kt, ref.dk), (vt, ref.dv)):
        # atol: the terms are O(1) (q, k's other features, v, g); dq's first feature is a cancellation
        # to about 1e-16 of them, whose rounding differs between two float64 runs
        np.testing.assert_allclose(t.grad.numpy(), b, rtol=2e-5, atol=1e-6)


def test_a_gradient_finite_in_float64_that_overflows_float32_is_named():
    """Output gradients of 3e38 (finite float32): the gradients sum several of them, finite in float64
    only; the first one cast is named."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 8, 4)).astype(np.float32) for _ in range(3))
    g = np.full(v.shape, 3e38, np.float32)
    with pytest.raises(ValueError, match="the gradient d[qkv] overflows float32"):
        la.linear_attention_vjp(q, k, v, g, feature_map="elu", causal=True)
    dv64 = la.linear_attention_vjp(*_f64(q, k, v, g), feature_map="elu", causal=True).dv
    assert np.isfinite(dv64).all() and np.abs(dv64).max() > np.finfo(np.float32).max


# ---------------------------------------------------------------------------
# Features that overflow float32 themselves (Hedgehog's exp(W x + b) beyond exp(88.7)): the map called
# directly raises FeatureOverflow (a ValueError); the attention front ends run the call in float64, whose
# normalised outputs are representable in float32.  The MQAR study's Hedgehog runs at kv = 16, d = 64
# stopped on this error after 17 and 31 minutes of training, while the public forward of the same
# inputs would have given the answer.
# ---------------------------------------------------------------------------
def _overflowing(seed=3):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 2, 16, 4)).astype(np.float32) for _ in range(3))
    k[0, 1, 5, 2] = 95.0  # Hedgehog (W = I, b = 0): exp(95) = 1.8e41, beyond float32's 3.4e38
    q[0, 0, 7, 1] = -93.0  # and a query's mirrored half, exp(93)
    return q, k, v


def test_the_map_called_directly_still_raises_naming_it():
    from linattn_nb.feature_maps._base import FeatureOverflow

    q, k, _ = _overflowing()
    with pytest.raises(ValueError, match="feature map 'hedgehog': features of finite inputs overflow float32") as e:
        la.feature_maps.get("hedgehog")(k)
    assert isinstance(e.value, FeatureOverflow) and e.value.dtype == np.float32


@pytest.mark.parametrize("causal", [True, False])
def test_forward_whose_features_overflow_float32_is_the_float64_one(causal):
    q, k, v = _overflowing()
    want = la.linear_attention(*_f64(q, k, v), feature_map="hedgehog", causal=causal)
    for check in (True, False):
        got = la.linear_attention(q, k, v, feature_map="hedgehog", causal=causal, check_finite=check)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_float64_inputs_whose_features_overflow_float64_still_raise():
    q, k, v = _f64(*_overflowing())
    k[0, 1, 5, 2] = 800.0  # exp(800): beyond float64
    with pytest.raises(ValueError, match="'hedgehog'.*overflow float64"):
        la.linear_attention(q, k, v, feature_map="hedgehog", causal=True)
    with pytest.raises(ValueError, match="'hedgehog'.*overflow float64"):
        la.linear_attention_vjp(q, k, v, np.ones_like(v), feature_map="hedgehog", causal=True)


def test_vjp_whose_features_overflow_float32_is_the_float64_one():
    q, k, v = _overflowing()
    g = np.random.default_rng(4).standard_normal(v.shape).astype(np.float32)
    got = la.linear_attention_vjp(q, k, v, g, feature_map="hedgehog", causal=True, method="chunked")
    want = la.linear_attention_vjp(*_f64(q, k, v, g), feature_map="hedgehog", causal=True, method="chunked")
    for name in ("dq", "dk", "dv"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == np.float32 and np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6 * np.abs(b).max(), err_msg=name)


def test_torch_adapter_with_learned_parameters_whose_features_overflow_float32():
    """The study's case: Hedgehog's W and b passed as tensors, its features beyond float32."""
    torch = pytest.importorskip("torch")
    from linattn_nb import feature_maps as fm
    from linattn_nb import torch as lt

    q, k, v = _overflowing()
    g = np.random.default_rng(5).standard_normal(v.shape).astype(np.float32)
    W0 = np.eye(4) + 0.05 * np.random.default_rng(6).standard_normal((4, 4))
    b0 = np.full(4, 0.1)

    def run(dtype):
        fmap = fm.get("hedgehog")
        fmap.materialize(4)
        ts = [torch.from_numpy(x.astype(dtype)).requires_grad_() for x in (q, k, v, W0, b0)]
        out = lt.linear_attention(*ts[:3], feature_map=fmap, causal=True, method="chunked",
                                  feature_map_params={"W": ts[3], "b": ts[4]})
        out.backward(torch.from_numpy(g.astype(dtype)))
        return out.detach().numpy(), [t.grad.numpy() for t in ts]

    out32, grads32 = run(np.float32)
    out64, grads64 = run(np.float64)
    assert out32.dtype == np.float32 and np.isfinite(out32).all()
    np.testing.assert_allclose(out32, out64, rtol=1e-6, atol=1e-6)
    for name, a, b in zip(("dq", "dk", "dv", "dW", "db"), grads32, grads64):
        assert a.dtype == np.float32 and np.isfinite(a).all(), name
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6 * np.abs(b).max(), err_msg=name)
