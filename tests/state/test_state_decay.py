"""Decay and gating on the decoding side: LinearAttentionState.step/prefill with
decay=/log_decay=, the rule step kernels, the rule record of states and state files.

Ground truth is linear_attention(..., causal=True, decay=..., method="quadratic") (the explicit
float64 form with exact resets) and the naive step reference of tests/ops/_step_naive.py.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")

import linattn_nb as la
from linattn_nb import config
from linattn_nb.ops.registry import get_method, get_rule
from linattn_nb.ops.step import cpu as step_cpu
import _step_naive as step_naive
from linattn_nb.state import LinearAttentionState, StateFileError
from linattn_nb.state import fileformat
from linattn_nb.ops.step import launchers

from _rule_state import assert_close, qkv, ref  # noqa: E402
from _state_files import rewrite_state_file  # noqa: E402


def token_factors(rng, batch, n, f=None, resets=()):
    """Factors in (0.3, 1] per token (and feature when f is given), with exact zeros at ``resets``."""
    shape = batch + (n,) + (() if f is None else (f,))
    a = rng.uniform(0.3, 1.0, size=shape)
    for t in resets:
        if f is None:
            a[..., t] = 0.0
        else:
            a[..., t, :] = 0.0
    return a


# ---------------------------------------------------------------------------
# 1. The naive step reference against the quadratic form
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["head", "token", "gate"])
@pytest.mark.parametrize("normalize", [True, False])
def test_naive_step_reference_equals_quadratic(form, normalize):
    rng = np.random.default_rng(0)
    B, N, F, M = 3, 11, 4, 5
    qf, kf = rng.uniform(0.1, 2.0, size=(2, B, N, F))
    v = rng.standard_normal((B, N, M))
    S0, z0 = rng.standard_normal((B, F, M)), rng.uniform(0.5, 1.0, size=(B, F))
    if form == "head":
        lg = np.broadcast_to(np.log(rng.uniform(0.5, 1.0, size=(B, 1))), (B, N)).copy()
        rule, inputs = "decay", {"log_decay": lg}
    elif form == "token":
        lg = np.log(rng.uniform(0.3, 1.0, size=(B, N)))
        lg[:, 5] = -np.inf
        rule, inputs = "decay", {"log_decay": lg}
    else:
        lg = np.log(rng.uniform(0.3, 1.0, size=(B, N, F)))
        lg[1, 4, :] = -np.inf
        lg[0, 7, 2] = -np.inf
        rule, inputs = "gate", {"log_gate": lg}
    from linattn_nb.ops._codes import RULES
    from linattn_nb.ops.causal.naive import causal_linear_quadratic

    out, S, z = step_naive.state_step_reference(qf, kf, v, S0, z0, eps=1e-8, rule=rule, inputs=inputs,
                                                normalize=normalize)
    o2, S2, z2 = causal_linear_quadratic(qf, kf, v, eps=1e-8, S0=S0, z0=z0, rule=RULES[rule][0], inputs=inputs,
                                         normalize=normalize)
    assert_close(out, o2)
    assert_close(S, S2)
    assert_close(z, z2)
    Sp, zp = step_naive.state_prefill_reference(kf, v, S0, z0, rule=rule, inputs=inputs)
    assert_close(Sp, S2)
    assert_close(zp, z2)


# ---------------------------------------------------------------------------
# 2. The CPU rule kernels against the naive step
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["additive", "decay", "gate"])
@pytest.mark.parametrize("state_dtype", [np.float64, np.float32])
@pytest.mark.parametrize("parallel", [False, True])
def test_cpu_rule_kernels_against_naive(rule, state_dtype, parallel, monkeypatch):
    monkeypatch.setattr(config, "STEP_PARALLEL_MIN_WORK", 0 if parallel else 1 << 62)
    code = get_rule(rule).code
    rng = np.random.default_rng(1)
    B, T, F, M = 5, 9, 6, 3
    q, k = rng.standard_normal((2, B, T, F)).astype(state_dtype)
    v = rng.standard_normal((B, T, M)).astype(state_dtype)
    if rule == "decay":
        lg = np.log(rng.uniform(0.2, 1.0, size=(B, T)))
        lg[2, 4] = -np.inf
        inputs = {"log_decay": lg}
    elif rule == "gate":
        lg = np.log(rng.uniform(0.2, 1.0, size=(B, T, F)))
        lg[3, 6, :] = -np.inf
        inputs = {"log_gate": lg}
    else:
        inputs = None
    qf = np.where(q >= 0, q + 1.0, np.exp(np.minimum(q, 0)))
    kf = np.where(k >= 0, k + 1.0, np.exp(np.minimum(k, 0)))
    S0 = rng.standard_normal((B, F, M))
    z0 = rng.uniform(0.5, 1.0, size=(B, F))
    for normalize in (True, False):
        St = np.ascontiguousarray(S0.transpose(0, 2, 1), dtype=state_dtype)
        z = z0.astype(state_dtype)
        out = np.empty((B, T, M), dtype=state_dtype)
        feat = np.zeros((3, B, F), dtype=state_dtype)
        assert step_cpu.step(q, k, v, St, z, out, feat, code=1, eps=1e-8, check=True, rule=code, inputs=inputs,
                             normalize=normalize) == 0
        o_ref, S_ref, z_ref = step_naive.state_step_reference(qf, kf, v, S0, z0, eps=1e-8, rule=rule,
                                                              inputs=inputs, normalize=normalize)
        assert_close(out, o_ref, state_dtype)
        assert_close(St.transpose(0, 2, 1), S_ref, state_dtype)
        assert_close(z, z_ref, state_dtype)
    # Prefill, in blocks that split the sequence (and its reset) unevenly.
    for block in (1, 4, 64):
        St = np.ascontiguousarray(S0.transpose(0, 2, 1), dtype=state_dtype)
        z = z0.astype(state_dtype)
        step_cpu.prefill(k, v, St, z, feat, code=1, rule=code, inputs=inputs, block=block)
        S_ref, z_ref = step_naive.state_prefill_reference(kf, v, S0, z0, rule=rule, inputs=inputs)
        assert_close(St.transpose(0, 2, 1), S_ref, state_dtype)
        assert_close(z, z_ref, state_dtype)
    # A non-finite input: nothing modified.
    St = np.ascontiguousarray(S0.transpose(0, 2, 1), dtype=state_dtype)
    before = St.copy()
    bad = v.copy()
    bad[1, 2, 0] = np.nan
    assert step_cpu.step(q, k, bad, St, z, out, feat, code=1, eps=1e-8, check=True, rule=code, inputs=inputs) == 3
    assert np.array_equal(St, before)


# ---------------------------------------------------------------------------
# 3. LinearAttentionState: token by token == one whole-sequence call
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("feature_map", ["elu", "dpfp"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_per_head_decay_steps_equal_linear_attention(feature_map, dtype):
    """RetNet's gamma per head: prefill a prompt, decode token by token and in a multi-token step."""
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, (2, 3), 13, 4, 3, dtype)
    gamma = np.array([[0.9, 0.99, 1.0], [0.5, 0.0, 0.8]])  # a 0 resets at every token
    out_ref, st_ref = ref(q, k, v, decay=gamma, feature_map=feature_map)
    st = LinearAttentionState(4, 3, batch_shape=(2, 3), feature_map=feature_map, dtype=dtype)
    assert st.rule is None
    st.prefill(k[..., :5, :], v[..., :5, :], decay=gamma)
    assert st.rule == "decay" and st.position == 5
    outs = [st.step(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :], decay=gamma) for t in range(5, 9)]
    outs.append(st.step(q[..., 9:, :], k[..., 9:, :], v[..., 9:, :], log_decay=np.log(gamma)))
    dec = np.concatenate(outs, axis=-2)
    assert dec.dtype == dtype
    assert_close(dec, out_ref[..., 5:, :], dtype)
    assert_close(st.S, st_ref.S, dtype)
    assert_close(st.z, st_ref.z, dtype)
    assert st.position == 13


@pytest.mark.parametrize("gate", [False, True])
def test_per_token_factors_with_a_reset_mid_sequence(gate):
    """Mamba-2/SSD (per token) and GLA (per feature): stepping token by token equals one call, a reset
    (decay 0) mid-sequence wipes the past with no NaN; also through multi-token steps and prefill."""
    rng = np.random.default_rng(3)
    batch, N, D, M = (2, 2), 12, 3, 4
    q, k, v = qkv(rng, batch, N, D, M)
    F = D  # elu
    a = token_factors(rng, batch, N, F if gate else None, resets=(6,))
    out_ref, st_ref = ref(q, k, v, decay=a)
    assert np.isfinite(out_ref).all()
    st = LinearAttentionState(D, M, batch_shape=batch)
    outs = []
    for t in range(N):
        at = a[..., t, :] if gate else a[..., t]  # the token's own factor
        outs.append(st.step(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :], decay=at))
    assert st.rule == ("gate" if gate else "decay")
    assert_close(np.concatenate(outs, axis=-2), out_ref)
    assert_close(st.S, st_ref.S)
    assert_close(st.z, st_ref.z)
    # After the reset, the outputs are those of the sequence started at the reset.
    tail, _ = ref(q[..., 6:, :], k[..., 6:, :], v[..., 6:, :], decay=a[..., 6:, :] if gate else a[..., 6:])
    assert_close(np.concatenate(outs, axis=-2)[..., 6:, :], tail)
    # Prefill (per token forms of linear_attention), then multi-token steps with a token axis.
    st2 = LinearAttentionState(D, M, batch_shape=batch)
    st2.prefill(k[..., :4, :], v[..., :4, :], decay=a[..., :4, :] if gate else a[..., :4])
    a_mid = a[..., 4:9, :] if gate else a[..., 4:9, None]
    o_mid = st2.step(q[..., 4:9, :], k[..., 4:9, :], v[..., 4:9, :], log_decay=np.log(a_mid))
    a_end = a[..., 9:, :] if gate else a[..., 9:, None]
    o_end = st2.step(q[..., 9:, :], k[..., 9:, :], v[..., 9:, :], decay=a_end)
    assert_close(np.concatenate([o_mid, o_end], axis=-2), out_ref[..., 4:, :])
    assert_close(st2.S, st_ref.S)


def test_prefill_blocks_and_resets_at_block_edges(monkeypatch):
    """The blocked prefill (running products from each block's end) across block edges and resets on them."""
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, (3,), 23, 4, 2)
    lg = np.log(rng.uniform(0.6, 1.0, size=(3, 23)))
    lg[0, 8] = -np.inf   # first token of a block of 4
    lg[1, 11] = -np.inf  # last token of a block
    lg[2, 0] = -np.inf   # wipes the initial state
    g = np.log(rng.uniform(0.6, 1.0, size=(3, 23, 4)))
    g[:, 12, 1] = -np.inf
    for block in (1, 4, 5, 64):
        monkeypatch.setattr(config, "PREFILL_BLOCK", block)
        for kw in (dict(log_decay=lg), dict(log_decay=g)):
            _, st_ref = ref(q, k, v, **kw)
            st = LinearAttentionState(4, 2, batch_shape=(3,))
            st.prefill(k, v, **kw)
            assert_close(st.S, st_ref.S)
            assert_close(st.z, st_ref.z)


def test_strong_decay_float32_no_overflow_or_nan():
    """log_decay = -20 per token (and -inf): the float32 state stays finite and matches."""
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, (2,), 40, 4, 3, np.float32)
    lg = np.full((2, 40), -20.0)
    lg[1, ::7] = -np.inf
    out_ref, st_ref = ref(q, k, v, log_decay=lg)
    st = LinearAttentionState(4, 3, batch_shape=(2,), dtype=np.float32)
    st.prefill(k[:, :20], v[:, :20], log_decay=lg[:, :20])
    out = np.concatenate([st.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], log_decay=lg[:, t])
                          for t in range(20, 40)], axis=1)
    assert_close(out, out_ref[:, 20:], np.float32)
    assert_close(st.S, st_ref.S, np.float32)


def test_decay_one_is_the_additive_rule_and_gate_of_equal_rows_is_decay():
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, (2,), 8, 3, 2)
    add = LinearAttentionState(3, 2, batch_shape=(2,))
    dec = LinearAttentionState(3, 2, batch_shape=(2,), rule="decay")
    gat = LinearAttentionState(3, 2, batch_shape=(2,))
    a = add.step(q, k, v)
    b = dec.step(q, k, v, decay=1.0)
    c = gat.step(q, k, v, decay=np.ones((2, 3)))
    assert_close(b, a)
    assert_close(c, a)
    assert (add.rule, dec.rule, gat.rule) == ("additive", "decay", "gate")


# ---------------------------------------------------------------------------
# 4. normalize=False
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["additive", "decay", "gate"])
def test_normalize_false_steps_and_queries(kind):
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, (2,), 9, 3, 4)
    kw = {"additive": {}, "decay": {"decay": np.array([0.9, 0.7])},
          "gate": {"decay": rng.uniform(0.5, 1.0, size=(2, 9, 3))}}[kind]
    out_ref, st_ref = ref(q, k, v, normalize=False, **kw)
    st = LinearAttentionState(3, 4, batch_shape=(2,), normalize=False)
    assert st.normalize is False and not st._fast
    pre = {} if kind == "additive" else {"decay": kw["decay"][..., :4, :] if kind == "gate" else kw["decay"]}
    st.prefill(k[:, :4], v[:, :4], **pre)
    outs = []
    for t in range(4, 9):
        tk = {} if kind == "additive" else {"decay": kw["decay"][:, t] if kind == "gate" else kw["decay"]}
        outs.append(st.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], **tk))
    assert_close(np.concatenate(outs, axis=1), out_ref[:, 4:])
    # query: the numerators phi(q)^T S of the current state
    qf = np.where(q >= 0, q + 1.0, np.exp(np.minimum(q, 0)))
    assert_close(st.query(q[:, :3]), np.einsum("btf,bfm->btm", qf[:, :3], st_ref.S))
    assert_close(st.S, st_ref.S)


def test_normalize_false_refused_for_maps_that_need_the_normaliser():
    with pytest.raises(ValueError, match="normalize=False"):
        LinearAttentionState(4, 2, feature_map=la.feature_maps.get("favor+", seed=0), normalize=False)
    with pytest.raises(TypeError, match="normalize"):
        LinearAttentionState(4, 2, normalize="yes")


# ---------------------------------------------------------------------------
# 5. When the rule is fixed, and calls of another rule
# ---------------------------------------------------------------------------
def test_the_first_tokens_fix_the_rule_and_other_rules_raise():
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, (2,), 4, 3, 2)
    st = LinearAttentionState(3, 2, batch_shape=(2,))
    assert st.rule is None and st._fast  # additive decoding keeps its fast path
    st.step(q[:, :0], k[:, :0], v[:, :0], decay=0.5)  # no token: nothing fixed
    st.prefill(k[:, :0], v[:, :0], decay=np.ones((2, 0, 3)))
    assert st.rule is None
    st.step(q[:, :1], k[:, :1], v[:, :1], decay=0.5)
    assert st.rule == "decay" and not st._fast
    assert st._launch is launchers.cpu_launcher(get_rule("decay").code)
    S = st.S.copy()
    with pytest.raises(ValueError, match="decay") as err:
        st.step(q[:, 1:2], k[:, 1:2], v[:, 1:2])
    assert "'decay' update rule" in str(err.value)
    with pytest.raises(ValueError, match="decay"):
        st.step(q[:, 1:2], k[:, 1:2], v[:, 1:2], decay=np.full((2, 3), 0.5))  # a gate
    with pytest.raises(ValueError, match="log_decay"):
        st.prefill(k[:, 1:], v[:, 1:], log_decay=np.zeros((2, 3, 3)))
    with pytest.raises(ValueError, match="decay"):
        st.step(q[:, :0], k[:, :0], v[:, :0])  # no token, but another rule
    assert np.array_equal(st.S, S) and st.position == 1
    # The rule survives copy and reset.
    twin = st.copy()
    assert twin.rule == "decay"
    st.reset()
    assert st.rule == "decay" and st.position == 0
    # Fixed at construction.
    add = LinearAttentionState(3, 2, batch_shape=(2,), rule="additive")
    assert add._fast
    with pytest.raises(ValueError, match="decay"):
        add.step(q, k, v, decay=0.9)
    gate = LinearAttentionState(3, 2, batch_shape=(2,), rule="gate")
    with pytest.raises(ValueError, match="pass decay or log_decay"):
        gate.prefill(k, v)
    # An additive first token fixes additive, on the fast path too.
    st3 = LinearAttentionState(3, 2, batch_shape=(2,))
    st3.step(*(np.ascontiguousarray(x[:, :1]) for x in (q, k, v)))
    assert st3.rule == "additive"
    with pytest.raises(ValueError, match="log_decay"):
        st3.step(q[:, 1:2], k[:, 1:2], v[:, 1:2], log_decay=-0.1)
    with pytest.raises(ValueError, match="rule must be None or one of"):
        LinearAttentionState(3, 2, rule="deltanet")  # not a rule name (the rule is "delta")
    with pytest.raises(TypeError, match="rule"):
        LinearAttentionState(3, 2, rule=1)


def test_decay_argument_errors_name_the_argument():
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, (2,), 3, 3, 2)
    st = LinearAttentionState(3, 2, batch_shape=(2,))
    cases = [
        (dict(decay=1.5), ValueError, "decay factors must lie in"),
        (dict(log_decay=0.1), ValueError, "log_decay must be <= 0"),
        (dict(decay=np.nan), ValueError, "decay contains NaN"),
        (dict(decay=0.5, log_decay=-1.0), ValueError, "at most one of decay and log_decay"),
        (dict(decay=np.ones((2, 4))), ValueError, "decay of shape \\(2, 4\\).*D_phi=3"),
        (dict(decay=np.ones((2, 3, 2))), ValueError, "decay of shape \\(2, 3, 2\\).*\\(T, 1\\)"),
        (dict(log_decay=np.zeros((2, 1, 1, 1))), ValueError, "log_decay of shape .* 4 dimensions"),
        (dict(decay=np.ones(5)), ValueError, "decay"),
        (dict(decay=np.array([True, False])), TypeError, "decay must hold real numbers"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            st.step(q, k, v, **kw)
    with pytest.raises(ValueError, match="log_decay"):
        st.prefill(k, v, log_decay=np.zeros((2, 4)))
    with pytest.raises(ValueError, match="decay"):
        st.prefill(k, v, decay=np.ones((2, 3, 5)))
    assert st.rule is None and st.position == 0 and st.device == "auto"


# ---------------------------------------------------------------------------
# 6. Conversions and segment-wise processing keep the rule
# ---------------------------------------------------------------------------
def test_conversions_keep_the_rule():
    rng = np.random.default_rng(10)
    q, k, v = qkv(rng, (2,), 10, 3, 2)
    a = rng.uniform(0.5, 1.0, size=(2, 10))
    full, _ = ref(q, k, v, decay=a)
    st = LinearAttentionState(3, 2, batch_shape=(2,))
    st.prefill(k[:, :6], v[:, :6], decay=a[:, :6])
    ls = st.to_linear_state()
    assert ls.rule == "decay" and ls.position == 6
    with pytest.raises(ValueError, match="'decay' update rule"):
        la.linear_attention(q[:, 6:], k[:, 6:], v[:, 6:], causal=True, initial_state=ls)
    with pytest.raises(ValueError, match="'decay' update rule"):
        la.linear_attention(q[:, 6:], k[:, 6:], v[:, 6:], causal=True, initial_state=st)
    rest = la.linear_attention(q[:, 6:], k[:, 6:], v[:, 6:], causal=True, decay=a[:, 6:], initial_state=st,
                               method="quadratic")
    assert_close(rest, full[:, 6:])
    # And back: linear_attention's state continues in a LinearAttentionState.
    _, ls2 = ref(q[:, :6], k[:, :6], v[:, :6], decay=a[:, :6])
    back = LinearAttentionState.from_linear_state(ls2, 3)
    assert back.rule == "decay" and back.position == 6
    out = np.concatenate([back.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], decay=a[:, t])
                          for t in range(6, 10)], axis=1)
    assert_close(out, full[:, 6:])
    with pytest.raises(ValueError, match="records the 'decay' update rule"):
        LinearAttentionState.from_linear_state(ls2, 3, rule="additive")
    # A plain tuple records no rule: rule= or the first tokens decide.
    t_state = LinearAttentionState.from_linear_state((ls2.S, ls2.z, 6), 3, rule="decay")
    assert t_state.rule == "decay"
    assert LinearAttentionState.from_linear_state((ls2.S, ls2.z, 6), 3).rule is None
    # An unfixed state is zero and continues any rule.
    fresh = LinearAttentionState(3, 2, batch_shape=(2,))
    assert fresh.to_linear_state().rule == "additive"
    la.linear_attention(q, k, v, causal=True, decay=a, initial_state=fresh, method="quadratic")
    # Additive states stay additive.
    add = LinearAttentionState(3, 2, batch_shape=(2,))
    add.prefill(k, v)
    assert add.to_linear_state().rule == "additive"
    with pytest.raises(ValueError, match="'additive' update rule"):
        la.linear_attention(q, k, v, causal=True, decay=a, initial_state=add, method="quadratic")


def test_segmentwise_linear_attention_with_decay_equals_one_call():
    """return_state/initial_state across segments (empty ones included) carry the decayed state."""
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, (2, 2), 17, 3, 2)
    lg = np.log(rng.uniform(0.4, 1.0, size=(2, 2, 17, 3)))
    lg[..., 9, :] = -np.inf
    full, st_full = ref(q, k, v, log_decay=lg)
    state, outs = None, []
    for a, b in ((0, 0), (0, 5), (5, 9), (9, 9), (9, 17)):
        o, state = la.linear_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], causal=True,
                                       method="quadratic", log_decay=lg[..., a:b, :], initial_state=state,
                                       return_state=True)
        assert state.rule == "gate"
        outs.append(o)
    assert_close(np.concatenate(outs, axis=-2), full)
    assert_close(state.S, st_full.S)
    # ... and a decoding state picks up where the segments left off.
    st = LinearAttentionState.from_linear_state(state, 3)
    assert st.rule == "gate" and st.position == 17


# ---------------------------------------------------------------------------
# 7. State files carry the rule
# ---------------------------------------------------------------------------
def test_state_files_store_the_rule(tmp_path):
    rng = np.random.default_rng(12)
    q, k, v = qkv(rng, (2,), 8, 3, 2)
    g = rng.uniform(0.5, 1.0, size=(2, 8, 3))
    st = LinearAttentionState(3, 2, batch_shape=(2,), normalize=False)
    st.prefill(k[:, :5], v[:, :5], decay=g[:, :5])
    path = tmp_path / "gate.npz"
    st.save(path)
    back = LinearAttentionState.load(path)
    assert back.rule == "gate" and back.normalize is False and back.position == 5
    assert np.array_equal(back.S, st.S) and np.array_equal(back.z, st.z)
    assert np.array_equal(back.step(q[:, 5:], k[:, 5:], v[:, 5:], decay=g[:, 5:]),
                          st.step(q[:, 5:], k[:, 5:], v[:, 5:], decay=g[:, 5:]))
    with pytest.raises(ValueError, match="decay"):
        back.step(q[:, :1], k[:, :1], v[:, :1])  # continuing with another rule
    LinearAttentionState.load(path, rule="gate")
    with pytest.raises(StateFileError, match="runs the 'gate' update rule, expected 'additive'"):
        LinearAttentionState.load(path, rule="additive")
    # An unfixed state saves as such and takes the rule of its first tokens (or of load's rule=).
    fresh = LinearAttentionState(3, 2, batch_shape=(2,))
    p2 = tmp_path / "fresh.npz"
    fresh.save(p2)
    assert LinearAttentionState.load(p2).rule is None
    assert LinearAttentionState.load(p2, rule="decay").rule == "decay"
    # Bad entries.
    for change, msg in ((dict(rule=np.array("deltanet")), "entry 'rule' must be a registered rule, one of"),
                        (dict(normalize=np.array(7)), "entry 'normalize'"),
                        (dict(rule=None), "missing entries \\['rule'\\]")):
        p = tmp_path / "bad.npz"
        rewrite_state_file(path, p, **change)
        with pytest.raises(StateFileError, match=msg):
            LinearAttentionState.load(p)


def test_version_1_files_load_as_additive(tmp_path):
    """Files written before states recorded a rule (no rule/normalize entries, version 1) stay readable."""
    rng = np.random.default_rng(13)
    q, k, v = qkv(rng, (2,), 6, 3, 2)
    st = LinearAttentionState(3, 2, batch_shape=(2,))
    st.prefill(k[:, :4], v[:, :4])
    path = tmp_path / "new.npz"
    st.save(path)
    old = tmp_path / "old.npz"
    rewrite_state_file(path, old, version=np.array(1, dtype=np.int64), rule=None, normalize=None)
    back = LinearAttentionState.load(old)
    assert back.rule == "additive" and back.normalize is True and back.position == 4
    assert np.array_equal(back.step(q[:, 4:], k[:, 4:], v[:, 4:]), st.step(q[:, 4:], k[:, 4:], v[:, 4:]))
    with pytest.raises(ValueError, match="decay"):
        back.step(q[:, :1], k[:, :1], v[:, :1], decay=0.5)
    with pytest.raises(StateFileError, match="runs the 'additive' update rule"):
        LinearAttentionState.load(old, rule="decay")
    assert fileformat.FORMAT_VERSION == 2


# ---------------------------------------------------------------------------
# 8. The step launchers of the rules in the method table
# ---------------------------------------------------------------------------
def test_rule_step_launchers_are_registered():
    for rule in ("decay", "gate"):
        code = get_rule(rule).code
        for dev, launcher in (("cpu", launchers.cpu_launcher(code)), ("cuda", launchers.cuda_launcher(code))):
            m = get_method("step", causal=True, device=dev, rule=rule)
            assert m.kind == "step" and m.forward is launcher and m.rule == rule
    st = LinearAttentionState(3, 2, rule="gate", device="cpu")
    assert st._launch is launchers.cpu_launcher(get_rule("gate").code) and st._launch.kernel is None
    with pytest.raises(ValueError, match="inputs"):
        st._launch.prefill(np.zeros((1, 1, 3)), np.zeros((1, 1, 2)), *st._launch.zeros(1, 3, 2,
                                        np.float64)[:2], code=1, check=False, inputs=None)
    with pytest.raises(ValueError, match="inputs"):
        S, z, scratch = launchers.CPU_STEP.zeros(1, 3, 2, np.float64)
        launchers.CPU_STEP(np.zeros((1, 1, 3)), np.zeros((1, 1, 3)), np.zeros((1, 1, 2)), S, z,
                           np.zeros((1, 1, 2)), scratch, code=1, eps=1e-8, check=False,
                           inputs={"log_decay": np.zeros((1, 1))})


@pytest.mark.parametrize("arg", ["decay", "log_decay"])
def test_a_step_decay_of_shape_batch_by_t_is_refused_when_t_equals_d_phi(arg):
    """(*batch_shape, T) is one factor per token for linear_attention and prefill, but (*batch_shape, D_phi) a
    gate for every token in a step: with T = D_phi a step read per-token factors as a gate, silently."""
    rng = np.random.default_rng(0)
    D = T = 4
    q, k, v = (rng.standard_normal((2, T, D)) for _ in range(3))
    fac = rng.uniform(0.5, 1.0, (2, T))
    x = fac if arg == "decay" else np.log(fac)
    st = LinearAttentionState(D, D, batch_shape=(2,))
    with pytest.raises(ValueError, match=rf"{arg} of shape \(2, 4\) is ambiguous in a step of T = D_phi = 4"):
        st.step(q, k, v, **{arg: x})
    assert st.position == 0 and st.rule is None
    # the unambiguous forms: one factor per token, as linear_attention reads (..., N)
    out = st.step(q, k, v, **{arg: x[..., None]})
    np.testing.assert_allclose(out, la.linear_attention(q, k, v, causal=True, **{arg: x}), rtol=1e-12, atol=1e-12)
    # a gate for every token (T = 1 steps, or the same row repeated per token)
    st2 = LinearAttentionState(D, D, batch_shape=(2,))
    gate = np.broadcast_to(x[:, None, :], (2, T, D))
    out2 = st2.step(q, k, v, **{arg: gate})
    np.testing.assert_allclose(out2, la.linear_attention(q, k, v, causal=True, **{arg: gate}), rtol=1e-12,
                               atol=1e-12)
    one = LinearAttentionState(D, D, batch_shape=(2,))
    assert one.step(q[:, :1], k[:, :1], v[:, :1], **{arg: x}).shape == (2, 1, D)  # T = 1: a gate, no ambiguity
