"""The delta rules on the decoding side: LinearAttentionState.step/prefill with beta=,
the delta step kernels, the rule record of states and state files, and the l2/silu_l2 row maps in
the step kernels.

Ground truth is linear_attention(..., causal=True, beta=..., method="quadratic") (the explicit
float64 form, exact resets) and the naive step reference of tests/ops/_step_naive.py.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")

import linattn_nb as la
from linattn_nb import feature_maps as fm
from linattn_nb.ops.registry import get_method, get_rule
from linattn_nb.ops.step import cpu as step_cpu
import _step_naive as step_naive
from linattn_nb.state import LinearAttentionState, StateFileError
from linattn_nb.ops.step import launchers

from _rule_state import assert_close, qkv, ref  # noqa: E402


def rule_kwargs(rng, rule, batch, n, resets=()):
    """beta in [0, 2] per token; for the gated rule decay factors in (0.3, 1] with zeros at ``resets``."""
    kw = {"beta": rng.uniform(0.0, 2.0, size=batch + (n,))}
    if rule == "gated_delta":
        a = rng.uniform(0.3, 1.0, size=batch + (n,))
        for t in resets:
            a[..., t] = 0.0
        kw["decay"] = a
    return kw


def take(kw, sl, form="seq"):
    """The per-token arguments of tokens ``sl``: "seq" (*batch, T), "step" (*batch, T, 1), "one" (*batch);
    "mixed": beta (*batch, T) (a step takes it too), the decay (*batch, T, 1) (in a step, (*batch, T)
    would be a per-feature gate)."""
    out = {}
    for n, x in kw.items():
        y = x[..., sl]
        out[n] = y[..., None] if form == "step" or (form == "mixed" and n != "beta") else y
    return out


# ---------------------------------------------------------------------------
# 1. The naive step reference and the CPU kernels
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["delta", "gated_delta"])
@pytest.mark.parametrize("normalize", [False, True])
def test_naive_step_reference_equals_quadratic(rule, normalize):
    rng = np.random.default_rng(0)
    B, N, D, M = 3, 11, 4, 5
    q, k, v = qkv(rng, (B,), N, D, M)
    kw = rule_kwargs(rng, rule, (B,), N, resets=(5,))
    out, st = ref(q, k, v, feature_map="l2", normalize=normalize, **kw)
    l2 = fm.get("l2")
    inputs = {"beta": kw["beta"]}
    if rule == "gated_delta":
        with np.errstate(divide="ignore"):
            inputs["log_decay"] = np.log(kw["decay"])
    o, S, z = step_naive.state_step_reference(l2.transform(q), l2.transform(k), v, np.zeros((B, D, M)),
                                              np.zeros((B, D)), eps=1e-8, rule=rule, inputs=inputs,
                                              normalize=normalize)
    assert_close(o, out)
    assert_close(S, st.S)
    assert_close(z, st.z)
    S2, z2 = step_naive.state_prefill_reference(l2.transform(k), v, np.zeros((B, D, M)), np.zeros((B, D)),
                                                rule=rule, inputs=inputs)
    assert_close(S2, st.S)
    assert_close(z2, st.z)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("code,name", [(0, None), (4, "l2"), (5, "silu_l2")])
@pytest.mark.parametrize("twin", ["serial", "parallel"])
def test_cpu_delta_kernels_match_naive(dtype, code, name, twin, monkeypatch):
    """Both compiled twins, features given (code 0, unit rows) or the row maps inline; a reset;
    a non-zero initial state; every output mode; the prefill."""
    from linattn_nb import config

    monkeypatch.setattr(config, "STEP_PARALLEL_MIN_WORK", 0 if twin == "parallel" else 10**12)
    rng = np.random.default_rng(1)
    B, T, F, M = 3, 7, 5, 4
    q, k, v = qkv(rng, (B,), T, F, M, dtype)
    mp = fm.get(name) if name else fm.get("l2")
    if code == 0:  # features given: unit rows
        q, k = mp.transform(q), mp.transform(k)
    qf, kf = mp.transform(q.astype(np.float64)), mp.transform(k.astype(np.float64))
    beta = rng.uniform(0.0, 2.0, size=(B, T))
    lg = np.log(rng.uniform(0.3, 1.0, size=(B, T)))
    lg[1, 3] = -np.inf
    S0 = rng.standard_normal((B, F, M)) * 0.3
    z0 = rng.uniform(0.0, 0.5, size=(B, F))
    for rule, inputs in (("delta", {"beta": beta}), ("gated_delta", {"beta": beta, "log_decay": lg})):
        for eps, normalize in ((None, False), (1e-8, False), (1e-8, True)):
            St = np.ascontiguousarray(S0.transpose(0, 2, 1)).astype(dtype)
            z = z0.astype(dtype)
            out = np.empty((B, T, M), dtype)
            feat = np.zeros((3, B, F), dtype)
            bad = step_cpu.step(q, k, v, St, z, out, feat, code=code, eps=eps, check=True, rule=get_rule(rule).code,
                                inputs=inputs, normalize=normalize)
            assert bad == 0
            o, S, zz = step_naive.state_step_reference(qf, kf, v, S0, z0, eps=eps, rule=rule, inputs=inputs,
                                                       normalize=normalize)
            assert_close(out, o, dtype)
            assert_close(St.transpose(0, 2, 1), S, dtype)
            assert_close(z, zz, dtype)
        St = np.ascontiguousarray(S0.transpose(0, 2, 1)).astype(dtype)
        z = z0.astype(dtype)
        step_cpu.prefill(k, v, St, z, np.zeros((3, B, F), dtype), code=code, rule=get_rule(rule).code,
                         inputs=inputs)
        S, zz = step_naive.state_prefill_reference(kf, v, S0, z0, rule=rule, inputs=inputs)
        assert_close(St.transpose(0, 2, 1), S, dtype)
        assert_close(z, zz, dtype)


def test_cpu_delta_kernel_nonfinite_modifies_nothing():
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, (2,), 3, 4, 2)
    St = np.ones((2, 2, 4))
    z = np.ones((2, 4))
    out = np.zeros((2, 3, 2))
    v[1, 2, 0] = np.nan
    bad = step_cpu.step(q, k, v, St, z, out, np.zeros((3, 2, 4)), code=4, eps=None, check=True,
                        rule=get_rule("delta").code, inputs={"beta": np.ones((2, 3))})
    assert bad == 3 and (St == 1).all() and (z == 1).all()


def test_step_launchers_are_registered():
    for rule in ("delta", "gated_delta"):
        code = get_rule(rule).code
        assert get_method("step", causal=True, device="cpu", rule=rule).forward is launchers.cpu_launcher(code)
        assert get_method("step", causal=True, device="cuda", rule=rule).forward is launchers.cuda_launcher(code)
    arrays = [np.zeros((1, 1, 1))] * 6 + [(np.zeros((3, 1, 1)),)]
    with pytest.raises(ValueError, match="beta"):
        launchers.cpu_launcher(get_rule("delta").code)(*arrays, code=0, eps=None, check=False,
                                                       inputs={"log_decay": np.zeros((1, 1))})
    with pytest.raises(ValueError, match="inputs"):
        launchers.cpu_launcher(get_rule("gated_delta").code)(*arrays, code=0, eps=None, check=False,
                                                             inputs={"beta": np.zeros((1, 1)),
                                                                     "log_gate": np.zeros((1, 1, 1))})


# ---------------------------------------------------------------------------
# 2. LinearAttentionState: token by token equals the whole sequence
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["delta", "gated_delta"])
@pytest.mark.parametrize("feature_map", ["l2", "silu_l2"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_token_by_token_equals_whole_sequence(rule, feature_map, dtype):
    """One token per step (beta of the token: one per sequence), outputs and final state; the
    gated rule with a reset in the middle; batch (2, 3)."""
    rng = np.random.default_rng(3)
    bs, N, D, M = (2, 3), 9, 4, 5
    q, k, v = qkv(rng, bs, N, D, M, dtype)
    kw = rule_kwargs(rng, rule, bs, N, resets=(4,))
    out, st = ref(q, k, v, feature_map=feature_map, **kw)
    s = LinearAttentionState(D, M, batch_shape=bs, feature_map=feature_map, dtype=dtype)
    outs = [s.step(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :], **take(kw, t, "one"))
            for t in range(N)]
    o = np.concatenate(outs, axis=-2)
    assert o.dtype == dtype and s.rule == rule and s.normalize is False and s.position == N
    assert_close(o, out, dtype)
    assert_close(s.S, st.S, dtype)
    assert_close(s.z, st.z, dtype)
    # The whole sequence in one step (beta per token), and prefill + blocks in every form.
    s2 = LinearAttentionState(D, M, batch_shape=bs, feature_map=feature_map, dtype=dtype)
    assert_close(s2.step(q, k, v, **take(kw, slice(0, N), "mixed")), out, dtype)
    assert_close(s2.S, st.S, dtype)
    s3 = LinearAttentionState(D, M, batch_shape=bs, feature_map=feature_map, dtype=dtype)
    s3.prefill(k[..., :3, :], v[..., :3, :], **take(kw, slice(0, 3)))
    o1 = s3.step(q[..., 3:6, :], k[..., 3:6, :], v[..., 3:6, :], **take(kw, slice(3, 6), "step"))
    o2 = s3.step(q[..., 6:, :], k[..., 6:, :], v[..., 6:, :], **take(kw, slice(6, N), "mixed"))
    assert_close(np.concatenate([o1, o2], axis=-2), out[..., 3:, :], dtype)
    assert_close(s3.S, st.S, dtype)
    assert_close(s3.z, st.z, dtype)
    assert_close(s3.query(q[..., :2, :]), np.einsum("...tf,...fm->...tm", fm.get(feature_map).transform(
        q[..., :2, :].astype(np.float64)), st.S), dtype)


@pytest.mark.parametrize("rule", ["delta", "gated_delta"])
def test_per_sequence_beta_and_decay_over_several_tokens(rule):
    """A scalar beta, a (batch,) beta and a per-head decay apply to every token of a call."""
    rng = np.random.default_rng(4)
    bs, N, D, M = (3,), 6, 4, 2
    q, k, v = qkv(rng, bs, N, D, M)
    beta = np.array([0.2, 1.0, 1.7])
    kw = {"beta": beta} if rule == "delta" else {"beta": beta, "log_decay": np.log([0.9, 0.5, 1.0])}
    out, st = ref(q, k, v, feature_map="l2", **kw)
    s = LinearAttentionState(D, M, batch_shape=bs, feature_map="l2")
    s.prefill(k[:, :2], v[:, :2], **kw)
    assert_close(s.step(q[:, 2:], k[:, 2:], v[:, 2:], **kw), out[:, 2:])
    assert_close(s.S, st.S)
    out, st = ref(q, k, v, feature_map="l2", beta=0.5)
    s = LinearAttentionState(D, M, batch_shape=bs, feature_map="l2")
    assert_close(s.step(q, k, v, beta=0.5), out)


@pytest.mark.parametrize("rule", ["delta", "gated_delta"])
def test_normalize_true_and_other_maps(rule):
    """normalize=True divides by the floored normaliser; the additive-style maps (elu, features
    given) run the same recurrence."""
    rng = np.random.default_rng(5)
    bs, N, D, M = (2,), 7, 3, 4
    q, k, v = qkv(rng, bs, N, D, M)
    kw = rule_kwargs(rng, rule, bs, N, resets=(3,))
    kw["beta"] = kw["beta"] * 0.1  # elu features are not unit rows: keep the recurrence tame
    for fmap in ("silu_l2", "elu", None):
        qq, kk = (q, k) if fmap is not None else (np.abs(q), np.abs(k))
        for normalize in (True, False):
            out, st = ref(qq, kk, v, feature_map=fmap, normalize=normalize, **kw)
            s = LinearAttentionState(D, M, batch_shape=bs, feature_map=fmap, normalize=normalize)
            o = np.concatenate([s.step(qq[:, t:t + 1], kk[:, t:t + 1], v[:, t:t + 1], **take(kw, t, "one"))
                                for t in range(N)], axis=1)
            assert s.normalize is normalize
            assert_close(o, out)
            assert_close(s.S, st.S)
            assert_close(s.z, st.z)


def test_positional_feature_map_host_path():
    """A map without an inline form (features computed in NumPy, code 0) also runs the delta rule."""
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, (2,), 5, 3, 2)
    kw = {"beta": rng.uniform(0.0, 0.2, size=(2, 5))}
    out, st = ref(q, k, v, feature_map="dpfp", **kw)
    s = LinearAttentionState(3, 2, batch_shape=(2,), feature_map="dpfp")
    s.prefill(k[:, :2], v[:, :2], beta=kw["beta"][:, :2])
    assert_close(s.step(q[:, 2:], k[:, 2:], v[:, 2:], beta=kw["beta"][:, 2:]), out[:, 2:])
    assert_close(s.S, st.S)


# ---------------------------------------------------------------------------
# 3. The rule is fixed; errors name beta
# ---------------------------------------------------------------------------
def test_rule_is_fixed_and_mismatches_name_beta():
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, (2,), 4, 3, 2)
    st = LinearAttentionState(3, 2, batch_shape=(2,), feature_map="l2")
    st.step(q[:, :0], k[:, :0], v[:, :0], beta=0.5)  # no token: nothing fixed
    assert st.rule is None and st.normalize is True  # the additive convention while open
    st.step(q[:, :1], k[:, :1], v[:, :1], beta=0.5)
    assert st.rule == "delta" and st.normalize is False and st._launch is launchers.cpu_launcher(get_rule("delta").code)
    S = st.S.copy()
    for call, name in ((lambda: st.step(q[:, 1:2], k[:, 1:2], v[:, 1:2]), "beta"),
                       (lambda: st.step(q[:, 1:2], k[:, 1:2], v[:, 1:2], decay=0.5), "beta"),
                       (lambda: st.step(q[:, 1:2], k[:, 1:2], v[:, 1:2], beta=0.5, decay=0.5), "beta"),
                       (lambda: st.prefill(k[:, 1:], v[:, 1:], log_decay=-0.1, beta=0.5), "beta")):
        with pytest.raises(ValueError, match=name) as err:
            call()
        assert "'delta' update rule" in str(err.value)
    assert np.array_equal(st.S, S) and st.position == 1
    # A gated delta state refuses calls without a decay, or without beta; decay and gate states refuse beta.
    gd = LinearAttentionState(3, 2, batch_shape=(2,), feature_map="l2", rule="gated_delta")
    assert gd.normalize is False
    with pytest.raises(ValueError, match="pass beta with decay or log_decay"):
        gd.step(q[:, :1], k[:, :1], v[:, :1], beta=0.5)
    with pytest.raises(ValueError, match="beta"):
        gd.step(q[:, :1], k[:, :1], v[:, :1], decay=0.5)
    for rule, kw in (("decay", {"decay": 0.5}), ("gate", {"decay": np.full((2, 3), 0.5)}), ("additive", {})):
        other = LinearAttentionState(3, 2, batch_shape=(2,), feature_map="l2", rule=rule)
        with pytest.raises(ValueError, match="beta") as err:
            other.step(q[:, :1], k[:, :1], v[:, :1], beta=0.5, **({} if rule == "gate" else kw))
        assert f"'{rule}' update rule" in str(err.value)
    # The rule survives copy and reset.
    twin = st.copy()
    assert twin.rule == "delta" and twin.normalize is False
    st.reset()
    assert st.rule == "delta" and st.position == 0


def test_beta_argument_errors():
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, (2,), 3, 3, 2)
    st = LinearAttentionState(3, 2, batch_shape=(2,), feature_map="l2")
    for bad, exc, msg in ((2.5, ValueError, r"beta .*\[0, 2\]"), (-0.1, ValueError, r"\[0, 2\]"),
                          (np.nan, ValueError, "beta contains NaN"), (np.ones((2, 4)), ValueError, "beta"),
                          (np.ones((2, 3, 2)), ValueError, "beta"), (np.ones((2, 3, 1, 1)), ValueError, "beta"),
                          (np.ones(3), ValueError, "beta"), ("x", TypeError, "beta"),
                          (np.array([1 + 1j, 0]), TypeError, "beta")):
        with pytest.raises(exc, match=msg):
            st.step(q, k, v, beta=bad)
        if not (isinstance(bad, np.ndarray) and bad.shape == (2, 3, 1)):  # (B, T, 1) is a step form only
            with pytest.raises(exc, match="beta"):
                st.prefill(k, v, beta=bad)
    assert st.rule is None and st.position == 0
    # A per-feature gate with beta: the gated delta rule takes a scalar decay.
    with pytest.raises(ValueError, match="per-feature gate"):
        st.step(q, k, v, beta=0.5, decay=np.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="per-feature gate"):
        st.prefill(k, v, beta=0.5, decay=np.full((2, 3, 3), 0.5))
    # Non-finite inputs: nothing changes.
    k2 = k.copy()
    k2[0, 1, 0] = np.inf
    with pytest.raises(ValueError, match="k contains non-finite"):
        st.step(q, k2, v, beta=0.5)
    with pytest.raises(ValueError, match="k contains non-finite"):
        st.prefill(k2, v, beta=0.5)
    with pytest.raises(ValueError, match="k contains non-finite"):
        st.step(q, k2, v, decay=0.5)  # the decay rule's kernels alike: the rule is not fixed by a refused call
    assert st.rule is None and st.position == 0 and not st.S.any()


def test_maps_that_need_the_normaliser_refuse_the_delta_default():
    with pytest.raises(ValueError, match="normalize=False"):
        LinearAttentionState(4, 2, feature_map=fm.get("favor+", dim=4, num_features=8, seed=0), rule="delta")
    st = LinearAttentionState(4, 2, feature_map=fm.get("favor+", dim=4, num_features=8, seed=0))
    x = np.ones((1, 4))
    with pytest.raises(ValueError, match="normalize=False"):
        st.step(x, x, np.ones((1, 2)), beta=0.5)
    assert st.rule is None
    ok = LinearAttentionState(4, 2, feature_map=fm.get("favor+", dim=4, num_features=8, seed=0), rule="delta",
                              normalize=True)
    assert ok.normalize is True
    ok.step(x, x, np.ones((1, 2)), beta=0.5)


# ---------------------------------------------------------------------------
# 4. Conversions and state files
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["delta", "gated_delta"])
def test_conversions_keep_the_rule(rule, tmp_path):
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, (2,), 8, 3, 2)
    kw = rule_kwargs(rng, rule, (2,), 8, resets=(5,))
    out, st_ref = ref(q, k, v, feature_map="l2", **kw)
    s = LinearAttentionState(3, 2, batch_shape=(2,), feature_map="l2")
    s.prefill(k[:, :4], v[:, :4], **take(kw, slice(0, 4)))
    ls = s.to_linear_state()
    assert ls.rule == rule
    # linear_attention continues the state ...
    o, st2 = la.linear_attention(q[:, 4:], k[:, 4:], v[:, 4:], causal=True, feature_map="l2", method="quadratic",
                                 initial_state=ls, return_state=True, **take(kw, slice(4, 8)))
    assert_close(o, out[:, 4:])
    assert_close(st2.S, st_ref.S)
    # ... and so does a state built from it, or loaded from a file.
    back = LinearAttentionState.from_linear_state(ls, 3, feature_map="l2")
    assert back.rule == rule and back.normalize is False and back.position == 4
    assert_close(back.step(q[:, 4:], k[:, 4:], v[:, 4:], **take(kw, slice(4, 8), "mixed")), out[:, 4:])
    with pytest.raises(ValueError, match=f"records the '{rule}' update rule"):
        LinearAttentionState.from_linear_state(ls, 3, feature_map="l2", rule="decay")
    path = tmp_path / "delta.npz"
    s.save(path)
    loaded = LinearAttentionState.load(path)
    assert loaded.rule == rule and loaded.normalize is False and loaded.position == 4
    assert np.array_equal(loaded.S, s.S) and np.array_equal(loaded.z, s.z)
    assert_close(loaded.step(q[:, 4:], k[:, 4:], v[:, 4:], **take(kw, slice(4, 8), "mixed")), out[:, 4:])
    assert LinearAttentionState.load(path, rule=rule).rule == rule
    with pytest.raises(StateFileError, match=f"runs the '{rule}' update rule, expected 'additive'"):
        LinearAttentionState.load(path, rule="additive")
    # normalize=True is recorded too.
    sn = LinearAttentionState(3, 2, batch_shape=(2,), feature_map="l2", rule=rule, normalize=True)
    sn.save(tmp_path / "n.npz")
    assert LinearAttentionState.load(tmp_path / "n.npz").normalize is True


# ---------------------------------------------------------------------------
# 5. The row maps in the other step kernels (l2, silu_l2 were the identity there)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("feature_map", ["l2", "silu_l2"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_row_maps_in_the_additive_and_decay_step_kernels(feature_map, dtype):
    rng = np.random.default_rng(10)
    bs, N, D, M = (3,), 6, 4, 2
    q, k, v = qkv(rng, bs, N, D, M, dtype)
    out, st = ref(q, k, v, feature_map=feature_map, eps=None)
    s = LinearAttentionState(D, M, batch_shape=bs, feature_map=feature_map, dtype=dtype, eps=None)
    s.prefill(k[:, :2], v[:, :2])
    o1 = s.step(q[:, 2:3], k[:, 2:3], v[:, 2:3])  # the single-token fast path
    o2 = s.step(q[:, 3:], k[:, 3:], v[:, 3:])  # several tokens: features of every batch entry at once
    assert_close(np.concatenate([o1, o2], axis=1), out[:, 2:], dtype)
    assert_close(s.S, st.S, dtype)
    assert_close(s.query(q[:, :2]), np.einsum("btf,bfm->btm", fm.get(feature_map).transform(
        q[:, :2].astype(np.float64)), st.S) / np.einsum("btf,bf->bt", fm.get(feature_map).transform(
            q[:, :2].astype(np.float64)), st.z)[..., None], dtype)
    a = rng.uniform(0.5, 1.0, size=bs + (N,))
    out, st = ref(q, k, v, feature_map=feature_map, eps=None, decay=a, normalize=False)
    s = LinearAttentionState(D, M, batch_shape=bs, feature_map=feature_map, dtype=dtype, eps=None,
                             normalize=False)
    s.prefill(k[:, :2], v[:, :2], decay=a[:, :2])
    assert_close(s.step(q[:, 2:], k[:, 2:], v[:, 2:], decay=a[:, 2:, None]), out[:, 2:], dtype)
    assert_close(s.S, st.S, dtype)


def test_row_map_zero_row_maps_to_zero():
    """A zero key row has zero features (no NaN): the delta rule leaves the state unchanged."""
    st = LinearAttentionState(3, 2, feature_map="l2")
    k = np.array([[1.0, 2.0, 2.0], [0.0, 0.0, 0.0]])
    v = np.array([[1.0, -1.0], [5.0, 5.0]])
    st.prefill(k[:1], v[:1], beta=1.0)
    S = st.S.copy()
    out = st.step(k[1:], k[1:], v[1:], beta=1.0)
    assert np.array_equal(st.S, S) and np.array_equal(out, np.zeros((1, 2)))
    # beta = 1 with a unit key stores the value exactly: reading it back returns it.
    assert np.allclose(st.query(k[:1]), v[:1])


# ---------------------------------------------------------------------------
# 6. The single-token fast path of a fixed decay/delta rule (one factor per sequence)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("bs", [(3,), (2, 2)])
def test_rule_fast_path_equals_the_validating_path(dtype, bs):
    """Python numbers, NumPy scalars, 0-d and batch-shaped arrays (float32 too) on the fast path give
    the validating path's outputs and state (the same kernels), step after step, with a reset."""
    rng = np.random.default_rng(11)
    N, D, M = 6, 4, 3
    q, k, v = qkv(rng, bs, N, D, M, dtype)
    gam = rng.uniform(0.5, 1.0, size=bs)
    bet = rng.uniform(0.0, 2.0, size=bs)
    per_token = [
        ({"decay": 0.9}, {"decay": np.full(bs + (1, 1), 0.9)}),
        ({"decay": gam}, {"decay": gam[..., None, None]}),
        ({"log_decay": np.log(gam).astype(np.float32)}, {"log_decay": np.log(gam).astype(np.float32)[..., None, None]}),
        ({"decay": np.float64(0.0)}, {"decay": np.zeros(bs + (1, 1))}),  # a reset
        ({"log_decay": -1}, {"log_decay": np.full(bs + (1, 1), -1.0)}),
        ({"decay": np.array(0.7)}, {"decay": np.full(bs + (1, 1), 0.7)}),
    ]
    cases = {"decay": ("elu", per_token)}
    cases["delta"] = ("l2", [({"beta": b}, {"beta": np.broadcast_to(b, bs)[..., None, None]})
                             for b in (0.5, bet, bet.astype(np.float32), 2, np.array(1.5), 0.0)])
    cases["gated_delta"] = ("silu_l2", [({"beta": bet, **fast}, {"beta": bet[..., None, None], **slow})
                                        for fast, slow in per_token])
    for rule, (fmap, calls) in cases.items():
        fast = LinearAttentionState(D, M, batch_shape=bs, feature_map=fmap, dtype=dtype, rule=rule)
        slow = LinearAttentionState(D, M, batch_shape=bs, feature_map=fmap, dtype=dtype, rule=rule)
        assert fast._rfast
        for t, (kf, ks) in enumerate(calls):
            sl = (Ellipsis, slice(t, t + 1), slice(None))
            a = fast.step(q[sl], k[sl], v[sl], **kf)
            b = slow.step(q[sl], k[sl], v[sl], **ks)  # (*batch, T, 1): the validating path
            assert a.dtype == dtype and a.shape == bs + (1, M)
            np.testing.assert_allclose(a, b, rtol=1e-6 if dtype == np.float32 else 1e-14, atol=1e-7 if dtype == np.float32 else 1e-14)
            np.testing.assert_allclose(fast.S, slow.S, rtol=1e-6 if dtype == np.float32 else 1e-14, atol=1e-7 if dtype == np.float32 else 1e-14)
        assert fast.position == slow.position == len(calls)


def test_rule_fast_path_falls_back_and_refuses_like_the_validating_path():
    rng = np.random.default_rng(12)
    q, k, v = qkv(rng, (2,), 3, 3, 2)
    one = (q[:, :1], k[:, :1], v[:, :1])
    st = LinearAttentionState(3, 2, batch_shape=(2,), rule="decay")
    st.step(*one, decay=0.5)
    S = st.S.copy()
    for kw, exc, msg in (({"decay": 1.5}, ValueError, r"decay factors must lie in \[0, 1\]"),
                         ({"decay": np.array([0.5, np.nan])}, ValueError, "decay contains NaN"),
                         ({"log_decay": 0.1}, ValueError, "log_decay must be <= 0"),
                         ({"decay": np.array([0.5, -0.5])}, ValueError, r"\[0, 1\]"),
                         ({"decay": True}, TypeError, "decay"),
                         ({"decay": 0.5, "log_decay": -0.1}, ValueError, "at most one"),
                         ({"decay": 0.5, "beta": 0.5}, ValueError, "beta"),
                         ({}, ValueError, "'decay' update rule")):
        with pytest.raises(exc, match=msg):
            st.step(*one, **kw)
    bad_q = q[:, :1].copy()
    bad_q[1, 0, 2] = np.nan
    with pytest.raises(ValueError, match="q contains non-finite"):
        st.step(bad_q, k[:, :1], v[:, :1], decay=0.5)
    assert np.array_equal(st.S, S) and st.position == 1
    # Shapes and dtypes the fast path does not take still work (float16, lists, a broadcast (1,)).
    ref_st = st.copy()
    o = st.step(*(x.astype(np.float16) for x in one), decay=[0.5, 0.5])
    o2 = ref_st.step(*one, decay=np.array([0.5]))
    assert o.dtype == np.float16 and np.allclose(o, o2, atol=1e-2)
    dl = LinearAttentionState(3, 2, batch_shape=(2,), feature_map="l2", rule="delta")
    for kw, msg in (({"beta": 2.5}, r"\[0, 2\]"), ({"beta": np.array([0.5, np.nan])}, "beta contains NaN"),
                    ({"beta": 0.5, "decay": 0.5}, "'delta' update rule"), ({}, "beta")):
        with pytest.raises(ValueError, match=msg):
            dl.step(*one, **kw)
    assert dl.position == 0 and not dl.S.any()
