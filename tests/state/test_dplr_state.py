"""DPLRState: decoding a diagonal-plus-low-rank rule token by token, and its state files."""
from __future__ import annotations

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import rules
from linattn_nb.state import StateFileError
from linattn_nb.state.dplr import DPLRState

BS, N, D, M = (2,), 7, 4, 3


def _data(rng, name):
    spec = rules.get_dplr_rule(name)
    r = 2 if spec.substeps else 0
    shape = BS + ((N, r) if r else (N,))
    q = rng.standard_normal(BS + (N, D))
    k, v = rng.standard_normal(shape + (D,)), rng.standard_normal(shape + (M,))
    return q, k, v, spec.sample(rng, BS[0], N, D, r)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("name", rules.dplr_rule_names())
def test_token_by_token_equals_one_call(rng, name, normalize):
    q, k, v, args = _data(rng, name)
    whole, st_whole = la.dplr_attention(q, k, v, rule=name, feature_map="l2", normalize=normalize, return_state=True,
                                        **args)
    st = DPLRState(D, M, rule=name, batch_shape=BS, feature_map="l2", normalize=normalize)
    st.prefill(k[:, :2], v[:, :2], **{n: x[:, :2] for n, x in args.items()})
    outs = [st.step(q[:, t], k[:, t], v[:, t], **{n: x[:, t] for n, x in args.items()}) for t in range(2, 5)]
    outs.append(st.step(q[:, 5:], k[:, 5:], v[:, 5:], **{n: x[:, 5:] for n, x in args.items()}))
    got = np.concatenate([np.stack(outs[:3], axis=1), outs[3]], axis=1)
    np.testing.assert_allclose(got, whole[:, 2:], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st.S, st_whole.S, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st.z, st_whole.z, rtol=1e-12, atol=1e-12)
    assert st.position == N and st.rule == name


def test_general_form_and_query(rng):
    q, k, v = rng.standard_normal((3,) + BS + (N, D))[:, :, :, :]
    v = v[..., :M]
    a, b = rng.standard_normal((2,) + BS + (N, D)) * 0.3
    ld = np.log(rng.uniform(0.5, 1, size=BS + (N,)))
    st = DPLRState(D, M, batch_shape=BS, normalize=True)
    out = st.step(q, k, v, a=a, b=b, log_diag=ld)
    np.testing.assert_allclose(out, la.dplr_attention(q, k, v, a=a, b=b, log_diag=ld, normalize=True),
                               rtol=1e-12, atol=1e-12)
    S, z, pos = st.S, st.z, st.position
    fq = la.feature_maps.get("elu")(q[:, :2])
    want = np.einsum("btf,bfm->btm", fq, S) / np.maximum(np.einsum("btf,bf->bt", fq, z), la.config.DEFAULT_EPS)[..., None]
    np.testing.assert_allclose(st.query(q[:, :2]), want, rtol=1e-12)
    np.testing.assert_allclose(st.query(q[:, 0]), want[:, 0], rtol=1e-12)
    assert np.array_equal(st.S, S) and st.position == pos  # query leaves the state
    st.reset()
    assert st.position == 0 and not st.S.any()


def test_save_and_load(rng, tmp_path):
    q, k, v, args = _data(rng, "kda")
    st = DPLRState(D, M, rule="kda", batch_shape=BS, feature_map="l2")
    st.prefill(k, v, **args)
    path = tmp_path / "kda.npz"
    st.save(path)
    back = DPLRState.load(path)
    assert back.rule == "kda" and back.position == N and back.batch_shape == BS
    assert np.array_equal(back.S, st.S) and np.array_equal(back.z, st.z)
    qt, kt, vt = q[:, 0], k[:, 0], v[:, 0]
    one = {n: x[:, 0] for n, x in args.items()}
    np.testing.assert_array_equal(back.step(qt, kt, vt, **one), st.copy().step(qt, kt, vt, **one))
    with pytest.raises(StateFileError, match="expected 'rwkv7'"):
        DPLRState.load(path, rule="rwkv7")
    with pytest.raises(StateFileError, match="load it with DPLRState.load"):
        la.LinearAttentionState.load(path)
    lin = la.LinearAttentionState(D, M, batch_shape=BS)
    lin.save(tmp_path / "add.npz")
    with pytest.raises(StateFileError, match="not a DPLR rule"):
        DPLRState.load(tmp_path / "add.npz")


def test_bad_arguments(rng):
    with pytest.raises(ValueError, match="key_dim must be a positive integer"):
        DPLRState(0, 3)
    with pytest.raises(ValueError, match="unknown DPLR rule"):
        DPLRState(4, 3, rule="nope")
    st = DPLRState(D, M, rule="kda", batch_shape=BS)
    with pytest.raises(ValueError, match="q must have shape"):
        st.query(np.ones((3, 1, D)))
    with pytest.raises(TypeError, match="missing argument: beta"):
        st.step(np.ones(BS + (D,)), np.ones(BS + (D,)), np.ones(BS + (M,)), decay=np.ones(BS + (D,)))
    assert st.position == 0  # a refused call leaves the state


@pytest.mark.parametrize("call, match", [
    ("step1 q", r"q must have shape \(2, 4\) \(batch_shape \(2,\), one token, key_dim 4\), got \(2, 3\)"),
    ("step1 v", r"v must have shape \(2, 3\) \(batch_shape \(2,\), one token, value_dim 3\), got \(2, 4\)"),
    ("step1 batch", r"q must have shape \(2, 4\) .*got \(3, 4\)"),
    ("stepT k", r"k must have shape \(2, T, 4\) \(batch_shape \(2,\), T tokens, key_dim 4\), got \(2, 5, 3\)"),
    ("stepT lengths", r"q, k, v must have the same number of tokens T \(axis 1\)"),
    ("prefill k", r"k must have shape \(2, T, 4\) .*got \(2, 5, 3\)"),
    ("prefill v", r"v must have shape \(2, T, 3\) .*got \(2, 5, 2\)"),
])
def test_tokens_of_the_wrong_shape_are_named(call, match):
    """q, k or v of another key_dim, value_dim or batch shape than the state's were reported as a wrong
    ``initial_state.S`` (the held state, which the caller never passed), e.g. ``initial_state.S must have shape
    (..., D_phi, M) = (3, 3), got (4, 3)`` for one query of D = 3; LinearAttentionState names the argument."""
    st = DPLRState(D, M, rule="kda", batch_shape=BS, feature_map="l2")
    one = dict(decay=np.full(BS + (D,), 0.5), beta=np.full(BS, 0.5))
    many = dict(decay=np.full(BS + (5, D), 0.5), beta=np.full(BS + (5,), 0.5))
    x, y = np.ones(BS + (D,)), np.ones(BS + (M,))
    calls = {
        "step1 q": lambda: st.step(np.ones(BS + (3,)), x, y, **one),
        "step1 v": lambda: st.step(x, x, np.ones(BS + (M + 1,)), **one),
        "step1 batch": lambda: st.step(np.ones((3, D)), np.ones((3, D)), np.ones((3, M)), **one),
        "stepT k": lambda: st.step(np.ones(BS + (5, D)), np.ones(BS + (5, 3)), np.ones(BS + (5, M)), **many),
        "stepT lengths": lambda: st.step(np.ones(BS + (5, D)), np.ones(BS + (4, D)), np.ones(BS + (5, M)), **many),
        "prefill k": lambda: st.prefill(np.ones(BS + (5, 3)), np.ones(BS + (5, M)), **many),
        "prefill v": lambda: st.prefill(np.ones(BS + (5, D)), np.ones(BS + (5, 2)), **many),
    }
    with pytest.raises(ValueError, match=match):
        calls[call]()
    assert st.position == 0


def test_delta_product_keys_keep_their_writes_axis(rng):
    """DeltaProduct's keys and values, batch + (T, n_h, D) (batch + (n_h, D) for one token), pass the shape
    check."""
    q, k, v, args = _data(rng, "delta_product")
    st = DPLRState(D, M, rule="delta_product", batch_shape=BS, feature_map="l2")
    st.prefill(k[:, :3], v[:, :3], **{n: a[:, :3] for n, a in args.items()})
    st.step(q[:, 3], k[:, 3], v[:, 3], **{n: a[:, 3] for n, a in args.items()})
    assert st.position == 4
    with pytest.raises(ValueError, match=r"k must have shape \(2, T, n_h, 4\)"):
        st.prefill(k[:, :3, :, :3], v[:, :3], **{n: a[:, :3] for n, a in args.items()})


@pytest.mark.parametrize("eps, error", [(-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                                        ("abc", TypeError)])
def test_bad_eps_is_refused_at_construction(eps, error):
    """DPLRState checked only the default eps: -1, NaN or "abc" were kept and failed at the first step (the string
    with NumPy's message, not naming eps), where LinearAttentionState refuses them when built."""
    with pytest.raises(error, match="eps must be"):
        DPLRState(D, M, rule="kda", eps=eps)
    assert DPLRState(D, M, rule="kda", eps=0).eps == 0.0 and DPLRState(D, M, rule="kda", eps=None).eps is None


def test_a_one_token_step_refuses_an_argument_without_the_batch_axes_by_name():
    """A 0-d beta or decay of a batched state's one-token step crashed in np.expand_dims with NumPy's AxisError;
    now dplr_attention's ValueError names it."""
    q = np.ones(BS + (D,))
    st = DPLRState(D, M, rule="kda", feature_map="l2", batch_shape=BS)
    for kw in ({"decay": np.full(BS + (D,), 0.9), "beta": 0.5}, {"decay": np.array(0.9), "beta": np.full(BS, 0.5)}):
        name = "beta" if np.ndim(kw["beta"]) == 0 else "decay"
        with pytest.raises(ValueError, match=f"^{name} must have shape"):
            st.step(q, q, q[..., :M], **kw)
    assert st.position == 0


def test_query_returns_the_queries_dtype_and_an_int_batch_shape_is_accepted():
    """query returned float32 for float16 queries (step returns float16); batch_shape=2 was a bare TypeError."""
    st = DPLRState(D, M, rule="kda", feature_map="l2", batch_shape=2)
    assert st.batch_shape == (2,)
    q = np.ones((2, 1, D), np.float16)
    assert st.query(q).dtype == np.float16 and st.query(q[:, 0]).dtype == np.float16
    assert st.query(q.astype(np.float32)).dtype == np.float32
