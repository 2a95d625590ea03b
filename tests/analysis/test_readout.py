"""linattn_nb.analysis.read_back: reading stored values back from a state, against plain NumPy."""
from __future__ import annotations

import numpy as np
import pytest

from linattn_nb import LinearAttentionState, LinearState, linear_attention
from linattn_nb.analysis import Readout, read_back


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _delta_numpy(keys, vals, beta, passes=1):
    S = np.zeros((keys.shape[1], vals.shape[1]))
    for _ in range(passes):
        for k, v in zip(keys, vals):
            S = S + beta * np.outer(k, v - S.T @ k)
    return S


@pytest.mark.parametrize("passes", [1, 3])
def test_read_back_of_a_delta_state_matches_numpy(passes):
    rng = np.random.default_rng(0)
    keys, vals = _unit(rng.standard_normal((12, 6))), np.eye(12)
    st = LinearAttentionState(6, 12, feature_map="l2", rule="delta", normalize=False)
    for _ in range(passes):
        st.prefill(keys, vals, beta=0.7)
    r = read_back(st, keys, vals)
    ref = keys @ _delta_numpy(keys, vals, 0.7, passes)
    np.testing.assert_allclose(r.values, ref, atol=1e-12)
    assert r.accuracy == pytest.approx(np.mean(ref.argmax(1) == np.arange(12)))
    assert r.error == pytest.approx(((ref - vals) ** 2).sum() / 12)


def test_read_back_of_a_linear_state_takes_the_feature_map():
    rng = np.random.default_rng(1)
    keys, vals = _unit(rng.standard_normal((8, 5))), np.eye(8)
    _, st = linear_attention(keys[None], keys[None], vals[None], causal=True, feature_map="l2", beta=1.0,
                             method="quadratic", return_state=True)
    state = LinearState(st.S[0], st.z[0], st.position, st.rule)
    r = read_back(state, keys, vals, feature_map="l2")
    np.testing.assert_allclose(r.values, keys @ _delta_numpy(keys, vals, 1.0), atol=1e-12)
    # the additive rule's convention: normalised by phi(k) . z
    _, st = linear_attention(keys[None], keys[None], vals[None], causal=True, feature_map="elu", return_state=True)
    state = LinearState(st.S[0], st.z[0], st.position, st.rule)
    out = read_back(state, keys, feature_map="elu").values
    phi = np.where(keys > 0, keys + 1.0, np.exp(keys))
    np.testing.assert_allclose(out, (phi @ st.S[0]) / (phi @ st.z[0])[:, None], rtol=1e-12)
    assert isinstance(read_back(state, keys, feature_map="elu"), Readout)
    assert read_back(state, keys, feature_map="elu").accuracy is None


def test_orthonormal_keys_are_read_back_exactly_and_a_tie_is_a_miss():
    keys = np.linalg.qr(np.random.default_rng(2).standard_normal((6, 6)))[0][:4]
    eye = np.eye(8)
    for rule, kw in (("delta", {"beta": 1.0}), ("additive", {})):
        st = LinearAttentionState(6, 8, feature_map="l2", rule=rule, normalize=False)
        st.prefill(keys, eye[:4], **kw)  # old values
        st.prefill(keys, eye[4:], **kw)  # the same keys with new values
        r = read_back(st, keys, eye[4:], candidates=eye)
        if rule == "delta":  # each write replaces the key's value
            assert r.accuracy == 1.0 and r.error < 1e-24
        else:  # old and new at equal weight: a tie, counted as a miss
            assert r.accuracy == 0.0 and r.error == pytest.approx(1.0)


def test_read_back_refuses_bad_input():
    st = LinearAttentionState(3, 2)
    with pytest.raises(ValueError, match="keys must have shape"):
        read_back(st, np.zeros(3))
    with pytest.raises(ValueError, match="key_dim"):
        read_back(st, np.zeros((2, 4)))
    with pytest.raises(TypeError, match="feature_map and normalize"):
        read_back(st, np.zeros((2, 3)), feature_map="elu")
    with pytest.raises(ValueError, match="values must have shape"):
        read_back(st, np.zeros((2, 3)), np.zeros((2, 3)))
    with pytest.raises(TypeError, match="needs feature_map"):
        read_back(LinearState(np.zeros((3, 2)), np.zeros(3)), np.zeros((2, 3)))
    with pytest.raises(TypeError, match="LinearAttentionState or a LinearState"):
        read_back(np.zeros((3, 2)), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="unbatched"):
        read_back(LinearAttentionState(3, 2, batch_shape=(2,)), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="one of the candidates"):
        read_back(st, np.zeros((2, 3)), np.eye(2), candidates=np.zeros((2, 2)))


def test_read_back_refuses_what_linear_attention_refuses():
    """Complex keys, values or S (their imaginary parts were dropped with a ComplexWarning), integer, long-double,
    masked and None keys, NaN values, an unknown map name (a KeyError) and a z of another shape than S's D_phi
    (a batched z gave values of another shape with no error) are refused, naming the argument."""
    st = LinearAttentionState(3, 2)
    lin = LinearState(np.eye(3, 2), np.ones(3))
    keys = np.eye(3)[:2]
    for bad in (keys + 1j, keys.astype(np.int64), keys.astype(np.longdouble), np.ma.masked_array(keys)):
        with pytest.raises(TypeError, match="keys"):
            read_back(st, bad)
    with pytest.raises(TypeError, match="keys must be an array, got None"):
        read_back(st, None)
    with pytest.raises(TypeError, match="values"):
        read_back(st, keys, np.zeros((2, 2)) + 1j)
    with pytest.raises(ValueError, match="values contain non-finite"):
        read_back(st, keys, np.full((2, 2), np.nan))
    with pytest.raises(TypeError, match="state.S"):
        read_back(LinearState(np.eye(3, 2) + 1j, np.ones(3)), keys, feature_map="elu")
    with pytest.raises(ValueError, match="unknown feature map 'bogus'"):
        read_back(lin, keys, feature_map="bogus")
    for z in (np.ones(4), np.ones((3, 3))):
        with pytest.raises(ValueError, match=r"state.z must have shape \(3,\)"):
            read_back(LinearState(np.eye(3, 2), z), keys, feature_map="elu")


def test_an_exact_read_out_with_no_other_candidate_is_a_hit():
    """One pair, or every candidate equal to the row's own value: no other value is nearer, so an exact
    read-out is strictly nearest (it was scored a miss through inf - TIE_RTOL * inf = NaN)."""
    keys, vals = np.eye(4)[:1], np.eye(3)[:1]
    st = LinearAttentionState(4, 3, feature_map="l2", rule="delta")
    st.prefill(keys, vals, beta=1.0)
    res = read_back(st, keys, vals)
    assert res.accuracy == 1.0 and res.error == 0.0
    keys2 = np.eye(4)[:2]
    st2 = LinearAttentionState(4, 3, feature_map="l2", rule="delta")
    st2.prefill(keys2, np.stack([vals[0], vals[0]]), beta=1.0)
    assert read_back(st2, keys2, np.stack([vals[0], vals[0]])).accuracy == 1.0


def test_read_back_names_keys_and_refuses_no_keys():
    """NaN keys were reported as "q contains non-finite values" (the state's query); no keys gave an
    accuracy of NaN with NumPy's "Mean of empty slice" warning, where the docstring promises a float."""
    keys, vals = np.eye(4)[:3], np.eye(3)
    st = LinearAttentionState(4, 3, feature_map="l2", rule="delta")
    st.prefill(keys, vals, beta=1.0)
    for bad in (np.nan, np.inf):
        k = keys.copy()
        k[1, 2] = bad
        with pytest.raises(ValueError, match="keys contain non-finite values"):
            read_back(st, k, vals)
        with pytest.raises(ValueError, match="keys contain non-finite values"):
            read_back(LinearState(np.zeros((4, 3)), np.zeros(4)), k, feature_map="l2")
    with pytest.raises(ValueError, match=r"keys must hold at least one key .* got shape \(0, 4\)"):
        read_back(st, keys[:0], vals[:0])
    with pytest.raises(ValueError, match="keys must hold at least one key"):
        read_back(st, keys[:0])


def test_read_back_checks_eps_and_normalize_as_linear_attention_does():
    """eps=nan read out NaN and eps=-1 was taken; normalize="no" (truthy) normalised.  Both are checked as
    linear_attention checks them, naming the argument; None, True, False and a NumPy bool still work."""
    rng = np.random.default_rng(0)
    keys, vals = rng.normal(size=(5, 3)), rng.normal(size=(5, 2))
    _, st = linear_attention(keys, keys, vals, feature_map="elu", causal=True, return_state=True)
    for eps in (np.nan, -1.0, np.inf):
        with pytest.raises(ValueError, match="eps must be a finite non-negative float or None"):
            read_back(st, keys, vals, feature_map="elu", eps=eps)
    for eps in ("1e-8", True):
        with pytest.raises(TypeError, match="eps must be"):
            read_back(st, keys, vals, feature_map="elu", eps=eps)
    for normalize in ("no", 1, 0.0):
        with pytest.raises(TypeError, match="normalize must be None, True or False"):
            read_back(st, keys, vals, feature_map="elu", normalize=normalize)
    phi = np.where(keys > 0, keys + 1.0, np.exp(keys))  # elu + 1
    np.testing.assert_allclose(read_back(st, keys, feature_map="elu", normalize=np.bool_(False)).values,
                               phi @ st.S, rtol=1e-12)
    np.testing.assert_allclose(read_back(st, keys, feature_map="elu", eps=None).values,
                               (phi @ st.S) / (phi @ st.z)[:, None], rtol=1e-12)
    # an eps for a LinearAttentionState (which reads with its own) is checked all the same
    with pytest.raises(ValueError, match="eps must be"):
        read_back(LinearAttentionState(3, 2), keys, eps=-1.0)
