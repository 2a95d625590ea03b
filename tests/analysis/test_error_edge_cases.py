"""approximation_error / attention_weights at the edges: overflowing products of features, scores whose
``q . k`` overflows but ``scale q . k`` does not, non-positive scales, rows floored at eps, NaN inputs."""
import dataclasses
import warnings

import numpy as np
import pytest

from linattn_nb.analysis import approximation_error, approximation_error_naive, attention_weights


def _same(a, b):
    for f in dataclasses.fields(a):
        np.testing.assert_allclose(getattr(a, f.name), getattr(b, f.name), rtol=1e-9, atol=1e-12,
                                   equal_nan=True, err_msg=f.name)


def _qkv(seed, shape=(3, 6, 2)):
    return np.random.default_rng(seed).standard_normal(shape)


def test_products_of_features_that_overflow_are_refused_naming_the_map():
    """q, k near 1e80: squared_relu's features (1e160) are finite, their products (1e320) are not.
    linear_attention raises for these inputs; the analysis returned NaN weights and statistics of NaN rows
    (entropy_linear 0, js_mean ln2 / 2)."""
    q, k, v = _qkv(0)
    q, k = q * 1e80, k * 1e80
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for call in (lambda: approximation_error(q, k, v, "squared_relu"),
                     lambda: approximation_error_naive(q, k, v, "squared_relu"),
                     lambda: attention_weights(q, k, "squared_relu")):
            with pytest.raises(ValueError, match=r"'squared_relu'.*overflow float64"):
                call()
        with pytest.raises(ValueError, match=r"query \d+ of batch entry 1\)? overflow"):
            attention_weights(np.stack([q / 1e80, q]), np.stack([k / 1e80, k]), "squared_relu")
        # check_finite=False lets it through: NaN statistics for those rows, not numbers made of NaN weights
        e = approximation_error(q, k, v, "squared_relu", check_finite=False)
        w = attention_weights(q, k, "squared_relu", check_finite=False)
    assert np.isnan(w).any()
    assert np.isnan(e.entropy_linear) and np.isnan(e.js_mean) and np.isnan(e.tv_mean)


def test_softmax_scores_are_formed_with_q_scaled_first():
    """scale = 1e-300 and inputs near 1e160: the scores (near 3e20) are finite, q . k (1e320) is not; the
    analysis formed scale * (q @ k.T) and refused them as an overflow."""
    q, k, v = _qkv(0)
    big_q, big_k, scale = q * 1e160, k * 1e160, 1e-300
    s = (scale * big_q) @ big_k.T
    want = np.exp(s - s.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    np.testing.assert_allclose(attention_weights(big_q, big_k, "softmax", scale=scale), want, rtol=1e-12)
    assert approximation_error(big_q, big_k, v, "softmax", scale=scale).kl_max == 0.0
    # a negative scale is checked too (the Cauchy-Schwarz bound took it as < 1e300)
    with pytest.raises(ValueError, match="overflow float64"):
        approximation_error(q * 1e160, k * 1e160, v, "softmax", scale=-1.0)


@pytest.mark.parametrize("scale", [-1.0, 0.0, -1e-3])
def test_monotonicity_ranks_q_dot_k_whatever_the_sign_of_scale(scale):
    """monotonicity is the Spearman correlation of q . k with the weights: a scale <= 0 flipped its sign (0:
    NaN), and softmax scored +1 where its weights fall as q . k grows."""
    q, k, v = _qkv(0, (3, 6, 3))
    for fn in (approximation_error, approximation_error_naive):
        want = fn(q, k, v, "elu", scale=1.0).monotonicity
        assert fn(q, k, v, "elu", scale=scale).monotonicity == pytest.approx(want, abs=1e-12), fn.__name__
        sm = fn(q, k, v, "softmax", scale=scale).monotonicity
        if scale == 0.0:
            assert np.isnan(sm), fn.__name__
        else:
            assert sm == pytest.approx(-1.0, abs=1e-12), fn.__name__
    for causal in (False, True):
        for name in ("elu", "softmax", "relu"):
            _same(approximation_error(q, k, v, name, scale=scale, causal=causal),
                  approximation_error_naive(q, k, v, name, scale=scale, causal=causal))


def test_rows_floored_at_eps_are_not_distributions():
    """Rows whose normaliser is below eps have weights summing to d_i / eps < 1: entropy_linear and js_mean
    (over the rows that form a distribution) counted them."""
    q, k, v = _qkv(0, (3, 8, 4))
    tiny = (q * 1e-6, k * 1e-6, v)
    assert (attention_weights(*tiny[:2], "relu").sum(-1) < 0.01).all()  # every row floored
    for fn in (approximation_error, approximation_error_naive):
        e = fn(*tiny, "relu")
        assert np.isnan(e.entropy_linear) and np.isnan(e.js_mean), fn.__name__
    # some rows floored, some not: the kernel and the reference agree, and the KL of the floored rows stays
    eps = 1.0
    for causal in (False, True):
        a = approximation_error(q, k, v, "relu", eps=eps, causal=causal)
        _same(a, approximation_error_naive(q, k, v, "relu", eps=eps, causal=causal))
        assert np.isfinite(a.entropy_linear)


def test_nan_scores_are_named_as_nan_inputs_not_as_an_overflow():
    """check_finite=False and a NaN in q: the message blamed an overflow and advised a smaller scale; and a
    2-D input was told of "batch entry 0"."""
    q, k, v = _qkv(0, (3, 5, 2))
    q[2, 0] = np.nan
    for call in (lambda: approximation_error(q, k, v, "elu", check_finite=False),
                 lambda: attention_weights(q, k, "softmax", check_finite=False)):
        with pytest.raises(ValueError, match=r"hold NaN \(query 2, key 0\): q holds inf or NaN") as info:
            call()
        assert "overflow" not in str(info.value) and "batch entry" not in str(info.value)
    with pytest.raises(ValueError, match=r"query 0, key 0\): the softmax") as info:
        attention_weights(np.nan_to_num(q) * 1e200, k * 1e200, "softmax", scale=1e308)
    assert "batch entry" not in str(info.value)
    qb = np.stack([q, q])[None]  # batch shape (1, 2)
    qb[0, 0, 2, 0] = 0.0
    kb, vb = (np.broadcast_to(x, qb.shape).copy() for x in (k, v))
    with pytest.raises(ValueError, match=r"query 2, key 0 of batch entry \(0, 1\)\): q holds"):
        attention_weights(qb, kb, "softmax", check_finite=False)
    with pytest.raises(ValueError, match=r"query 2, key 0 of batch entry \(0, 1\)\): q holds"):
        approximation_error(qb, kb, vb, "elu", check_finite=False)
