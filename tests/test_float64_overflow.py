"""Finite float64 inputs whose results overflow float64 itself: with ``check_finite`` (the default) an error
that says so, not NaN or 0 rows returned as results (the inline maps' kernels, the VJP, the torch adapter)."""
import numpy as np
import pytest

import linattn_nb as la
from linattn_nb.ops._finite import NonFiniteResult

_MSG = "not finite even in float64"


def _big(seed=8):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((2, 6, 3)) * 1e200 for _ in range(2))  # finite; q . k and the sums overflow
    return q, k, rng.standard_normal((2, 6, 2))


@pytest.mark.parametrize("fmap", ["elu", "squared_relu", "identity"])
@pytest.mark.parametrize("causal, method", [(True, "scan"), (True, "chunked"), (False, "auto")])
def test_forward_refuses_outputs_that_overflow_float64(fmap, causal, method):
    q, k, v = _big()
    with pytest.raises(NonFiniteResult, match=_MSG + r".*'" + fmap + r"'.*q 2\.\d+e\+200"):
        la.linear_attention(q, k, v, feature_map=fmap, causal=causal, method=method)
    # asked for: the values as float64 gives them
    out = la.linear_attention(q, k, v, feature_map=fmap, causal=causal, method=method, check_finite=False)
    assert not np.isfinite(out).all()


def test_float64_results_still_returned_where_eps_none_allows_nan():
    # eps=None: a normaliser of exactly 0 gives the documented NaN, which is not told apart from an overflow
    q, k, v = _big()
    out = la.linear_attention(q, k, v, feature_map="elu", causal=True, eps=None)
    assert np.isnan(out).any()
    relu = la.linear_attention(-np.abs(q[:, :, :] / 1e200), -np.abs(k / 1e200), v, feature_map="relu", causal=True,
                               eps=None)
    assert np.isnan(relu).all()  # every normaliser 0: NaN rows, no error (documented)


@pytest.mark.parametrize("kw", [{}, {"normalize": False}, {"log_decay": -0.1}, {"method": "scan"}])
def test_vjp_refuses_gradients_that_overflow_float64(kw):
    q, k, v = _big()
    g = np.ones((2, 6, 2))
    with pytest.raises(NonFiniteResult, match="a gradient that is " + _MSG):
        la.linear_attention_vjp(q, k, v, g, feature_map="elu", causal=True, **kw)
    # a gradient of the outputs large enough to overflow the gradients, on ordinary inputs
    qs, ks = q / 1e200, k / 1e200
    with pytest.raises(NonFiniteResult, match="a gradient that is " + _MSG):
        la.linear_attention_vjp(qs, ks, v, g * 1e308, feature_map="elu", causal=True, **kw)
    res = la.linear_attention_vjp(q, k, v, g, feature_map="elu", causal=True, check_finite=False, **kw)
    assert not all(np.isfinite(x).all() for x in (res.dq, res.dk, res.dv))
    ok = la.linear_attention_vjp(qs, ks, v, g, feature_map="elu", causal=True, **kw)
    assert np.isfinite(ok.dq).all()


def test_torch_adapter_refuses_float64_overflow():
    torch = pytest.importorskip("torch")
    import linattn_nb.torch as lt

    q, k, v = (torch.from_numpy(x) for x in _big())
    with pytest.raises(NonFiniteResult, match="an output or the state that is " + _MSG):
        lt.linear_attention(q.requires_grad_(), k, v, causal=True)
    qs = (q.detach() / 1e200).requires_grad_()
    out = lt.linear_attention(qs, k / 1e200, v, causal=True)
    with pytest.raises(NonFiniteResult, match="a gradient that is " + _MSG):
        out.backward(torch.full_like(out, 1e308))
    out = lt.linear_attention(qs, k / 1e200, v, causal=True, method="scan")  # the unfused backward too
    with pytest.raises(NonFiniteResult, match="a gradient that is " + _MSG):
        out.backward(torch.full_like(out, 1e308))


@pytest.mark.parametrize("method", ["blocked", "quadratic"])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_refuses_scores_that_overflow_float64(method, causal):
    q, k, v = _big()
    with pytest.raises(NonFiniteResult, match="an output that is " + _MSG + r".* in the scores"):
        la.softmax_attention(q, k, v, causal=causal, method=method)
    out = la.softmax_attention(q, k, v, causal=causal, method=method, check_finite=False)
    assert np.isnan(out).any()
    ok = la.softmax_attention(q / 1e200, k / 1e200, v, causal=causal, method=method)
    assert np.isfinite(ok).all()


@pytest.mark.parametrize("fmap, scale", [("hedgehog", 400.0), ("rff", 60.0)])
def test_features_beyond_float64_raise_the_documented_nonfiniteresult(fmap, scale):
    """A map computed in NumPy whose features of finite float64 inputs overflow float64 (hedgehog's exp, rff's
    exp(|x|^2 / 2) factor): the NonFiniteResult that linear_attention documents, with the inputs' largest
    magnitudes, which is also the map's own FeatureOverflow (a ValueError) as before."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 6, 4))
    m = la.feature_maps.get(fmap, dim=4, num_features=8, seed=0) if fmap == "rff" else fmap
    for call in (lambda: la.linear_attention(q * scale, k * scale, v, causal=True, feature_map=m, method="scan"),
                 lambda: la.linear_attention_vjp(q * scale, k * scale, v, v, causal=True, feature_map=m)):
        with pytest.raises(NonFiniteResult, match=r"overflow float64.*largest magnitudes: q \d") as err:
            call()
        assert isinstance(err.value, la.feature_maps.FeatureOverflow)
