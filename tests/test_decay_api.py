"""The public decay/gating arguments of linear_attention: forms, errors, states, normalize.

The formulas (one recurrence, several papers) are in ``docs/theory.md``, "Decay and gating":
S_t = a_t S_{t-1} + phi(k_t) v_t^T with a constant a_t = gamma per head (RetNet, Sun et al. 2023),
a scalar per token (Mamba-2/SSD, Dao & Gu 2024) or a vector per feature (GLA, Yang et al. 2024); the
normaliser z follows the same recurrence.  Kernel-level tests are in tests/ops/test_decay.py; here the
reference method ("quadratic") is checked against a plain loop and the front end's parsing is checked.
"""
import numpy as np
import pytest

from linattn_nb import LinearState, feature_maps, linear_attention
from linattn_nb._validate import decay_inputs

RNG = np.random.default_rng(14)


def _qkv(batch=(2, 3), n=11, d=4, m=3, dtype=np.float64):
    q = RNG.normal(size=batch + (n, d)).astype(dtype)
    k = RNG.normal(size=batch + (n, d)).astype(dtype)
    v = RNG.normal(size=batch + (n, m)).astype(dtype)
    return q, k, v


def _loop(q, k, v, a, *, normalize=True, eps=1e-8, S0=None, z0=None):
    """The recurrence token by token, float64, ELU+1 features; ``a`` (..., N, F) the factors."""
    fq = np.where(q > 0, q + 1.0, np.exp(np.minimum(q, 0.0)))
    fk = np.where(k > 0, k + 1.0, np.exp(np.minimum(k, 0.0)))
    batch, (n, f), m = q.shape[:-2], q.shape[-2:], v.shape[-1]
    S = np.zeros(batch + (f, m)) if S0 is None else np.array(S0, dtype=np.float64)
    z = np.zeros(batch + (f,)) if z0 is None else np.array(z0, dtype=np.float64)
    out = np.empty(batch + (n, m))
    for t in range(n):
        at = a[..., t, :]
        S = at[..., None] * S + fk[..., t, :, None] * v[..., t, None, :]
        z = at * z + fk[..., t, :]
        num = np.einsum("...f,...fm->...m", fq[..., t, :], S)
        if normalize:
            den = np.maximum(np.einsum("...f,...f->...", fq[..., t, :], z), eps)
            num = num / den[..., None]
        out[..., t, :] = num
    return out, S, z


@pytest.mark.parametrize("form", ["scalar", "per_head", "per_head_broadcast", "per_token", "per_feature"])
def test_every_form_is_the_recurrence(form):
    q, k, v = _qkv()
    batch, n, f = q.shape[:-2], q.shape[-2], q.shape[-1]
    if form == "scalar":
        decay = 0.8
        a = np.full(batch + (n, f), 0.8)
    elif form == "per_head":
        decay = RNG.uniform(0.5, 1.0, size=batch)
        a = np.broadcast_to(decay[..., None, None], batch + (n, f))
    elif form == "per_head_broadcast":
        decay = np.array([[0.9, 0.99, 0.5]])  # (1, H): one gamma per head
        a = np.broadcast_to(decay[..., None, None], batch + (n, f))
    elif form == "per_token":
        decay = RNG.uniform(0.3, 1.0, size=batch + (n,))
        a = np.broadcast_to(decay[..., None], batch + (n, f))
    else:
        decay = RNG.uniform(0.3, 1.0, size=batch + (n, f))
        a = decay
    out, st = linear_attention(q, k, v, causal=True, decay=decay, method="quadratic", return_state=True)
    ref, S, z = _loop(q, k, v, a)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(st.S, S, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(st.z, z, rtol=1e-12, atol=1e-13)
    assert st.rule == ("gate" if form == "per_feature" else "decay")
    # log_decay is the same factors as logs
    lg = np.log(decay)
    out2 = linear_attention(q, k, v, causal=True, log_decay=lg, method="quadratic")
    np.testing.assert_allclose(out2, out, rtol=1e-13, atol=1e-14)


def test_no_batch_dimensions():
    q, k, v = _qkv(batch=())
    for decay, a in [(0.7, np.full((11, 4), 0.7)), (np.full(11, 0.6), np.full((11, 4), 0.6)),
                     (np.full((11, 4), 0.5), np.full((11, 4), 0.5))]:
        out = linear_attention(q, k, v, causal=True, decay=decay, method="quadratic")
        np.testing.assert_allclose(out, _loop(q, k, v, a)[0], rtol=1e-12, atol=1e-13)


def test_decay_one_is_additive_and_zero_resets_exactly():
    q, k, v = _qkv()
    add = linear_attention(q, k, v, causal=True, method="quadratic")
    one = linear_attention(q, k, v, causal=True, decay=1.0, method="quadratic")
    np.testing.assert_allclose(one, add, rtol=1e-13, atol=1e-14)
    a = np.ones(q.shape[:-1])
    a[..., 5] = 0.0  # a document boundary at token 5
    out = linear_attention(q, k, v, causal=True, decay=a, method="quadratic")
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[..., 5:, :], linear_attention(q[..., 5:, :], k[..., 5:, :], v[..., 5:, :],
                                                                 causal=True, method="quadratic"),
                               rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(out[..., :5, :], add[..., :5, :], rtol=1e-13, atol=1e-14)
    lg = np.zeros(q.shape[:-1] + (q.shape[-1],))
    lg[..., 5, :] = -np.inf  # the same as a per-feature gate, -inf as the log
    out2 = linear_attention(q, k, v, causal=True, log_decay=lg, method="quadratic")
    np.testing.assert_allclose(out2, out, rtol=1e-13, atol=1e-14)


def test_huge_finite_log_decay_is_a_reset():
    """log-factors below exp's float64 range are the reset they round to (no cancellation, no NaN)."""
    q, k, v = _qkv(batch=(2,))
    lg = np.full(q.shape[:-1], -1e-3)
    lg[:, 4] = -1e300
    _, ins = decay_inputs(None, lg, (2,), 11, 4, causal=True)
    assert np.isneginf(ins["log_decay"][:, 4]).all() and (ins["log_decay"][:, 5:] == -1e-3).all()
    out = linear_attention(q, k, v, causal=True, log_decay=lg, method="quadratic")
    assert np.isfinite(out).all()


def test_log_factors_are_checked_in_one_pass_and_copied_only_when_needed():
    """decay_inputs: the caller's float64 gate itself with copy=False when nothing needs converting.

    Every other case gets an array of its own, and the caller's array is never written.
    """
    B, N, F = 2, 11, 4
    lg = -RNG.uniform(0.0, 1.0, size=(B, N, F))
    keep = lg.copy()
    _, ins = decay_inputs(None, lg, (B,), N, F, causal=True, copy=False)
    assert ins["log_gate"] is lg or ins["log_gate"].base is lg
    _, ins = decay_inputs(None, lg, (B,), N, F, causal=True)  # copy=True (the default)
    assert not np.shares_memory(ins["log_gate"], lg)
    np.testing.assert_array_equal(ins["log_gate"], lg)
    # resets to rewrite, linear factors, float32, a strided or read-only array: new arrays, the input untouched
    lg[0, 3, 1] = -1e300
    ro = lg.copy()
    ro.flags.writeable = False
    with np.errstate(over="ignore"):
        f32 = lg.astype(np.float32)  # -1e300 -> -inf
    cases = [("log_decay", lg), ("decay", np.exp(lg)), ("log_decay", f32),
             ("log_decay", np.repeat(lg, 2, axis=-1)[..., ::2]), ("log_decay", ro)]
    for name, x in cases:
        before = x.copy()
        _, ins = decay_inputs(x if name == "decay" else None, x if name == "log_decay" else None, (B,), N, F,
                              causal=True, copy=False)
        g = ins["log_gate"]
        assert g.flags.c_contiguous and g.flags.writeable and g.dtype == np.float64
        assert not np.shares_memory(g, x)
        np.testing.assert_array_equal(x, before)
        assert np.isneginf(g[0, 3, 1]) and np.isfinite(np.delete(g.ravel(), 3 * F + 1)).all()
    # the one-pass counts find a single bad element anywhere, with its value in the error
    big = np.full((B, N, F), -0.5)
    for bad, match in ((np.nan, "log_decay contains NaN"), (0.25, r"log_decay must be <= 0 .*got 0\.25"),
                       (np.inf, r"log_decay must be <= 0 .*got inf")):
        x = big.copy()
        x[1, N - 1, F - 1] = bad
        with pytest.raises(ValueError, match=match):
            decay_inputs(None, x, (B,), N, F, causal=True, copy=False)
    for bad, match in ((1.0 + 1e-12, "must lie in"), (-1e-300, "must lie in"), (np.inf, "must lie in")):
        x = np.full((B, N), 0.5)
        x[0, 7] = bad
        with pytest.raises(ValueError, match=match):
            decay_inputs(x, None, (B,), N, F, causal=True)


def test_the_callers_gate_is_read_not_written():
    q, k, v = _qkv(batch=(2,))
    lg = -RNG.uniform(0.0, 0.5, size=q.shape[:-1] + (q.shape[-1],))
    keep = lg.copy()
    for method in ("chunked", "scan", "quadratic"):
        out = linear_attention(q, k, v, causal=True, log_decay=lg, method=method)
        np.testing.assert_array_equal(lg, keep)
        np.testing.assert_allclose(out, linear_attention(q, k, v, causal=True, log_decay=keep.copy(),
                                                         method="quadratic"), rtol=1e-12, atol=1e-13)


def test_normalize_false_is_the_unnormalised_read():
    q, k, v = _qkv()
    decay = RNG.uniform(0.5, 1.0, size=q.shape[:-1])
    out = linear_attention(q, k, v, causal=True, decay=decay, normalize=False, method="quadratic")
    ref = _loop(q, k, v, np.broadcast_to(decay[..., None], q.shape), normalize=False)[0]
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    # the additive rule too, causal and not
    add = linear_attention(q, k, v, causal=True, normalize=False, method="quadratic")
    np.testing.assert_allclose(add, _loop(q, k, v, np.ones(q.shape), normalize=False)[0], rtol=1e-12, atol=1e-12)
    for method in ("quadratic", "aggregate"):
        nc = linear_attention(q, k, v, causal=False, normalize=False, method=method)
        fq, fk = (np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0))) for x in (q, k))
        np.testing.assert_allclose(nc, fq @ np.swapaxes(fk, -1, -2) @ v, rtol=1e-12)
    with pytest.raises(TypeError, match="normalize"):
        linear_attention(q, k, v, causal=True, normalize="no")


@pytest.mark.parametrize("name", ["favor+", "hedgehog"])
def test_maps_with_row_shifts_refuse_normalize_false(name):
    q, k, v = _qkv()
    fmap = feature_maps.get(name, dim=4, num_features=8, seed=0) if name == "favor+" else name
    with pytest.raises(ValueError, match="normalize=False"):
        linear_attention(q, k, v, causal=True, feature_map=fmap, normalize=False)
    # normalize=True (the default) is fine
    linear_attention(q, k, v, causal=True, feature_map=fmap, decay=0.9, method="quadratic")


@pytest.mark.parametrize("kw, match", [
    (dict(decay=1.5), r"decay factors must lie in \[0, 1\]"),
    (dict(decay=-0.1), r"decay factors must lie in \[0, 1\]"),
    (dict(decay=np.nan), "decay contains NaN"),
    (dict(log_decay=0.5), "log_decay must be <= 0"),
    (dict(log_decay=np.nan), "log_decay contains NaN"),
    (dict(decay=0.9, log_decay=-0.1), "at most one of decay and log_decay"),
    (dict(decay=np.ones((2, 3, 11, 5))), r"last axes must be \(N, D_phi\)=\(11, 4\)"),
    (dict(decay=np.ones((2, 3, 10))), "last axis must be N=11"),
    (dict(decay=np.ones((4, 3))), "does not broadcast"),
    (dict(decay=np.ones((1, 2, 3, 11, 4))), "has 5 dimensions"),
    (dict(log_decay=np.zeros((2, 3, 11, 4, 1))), "log_decay of shape"),
])
def test_bad_decay_raises_naming_the_argument(kw, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        linear_attention(q, k, v, causal=True, **kw)


def test_decay_needs_causal_and_real_values():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="decay applies to causal attention"):
        linear_attention(q, k, v, causal=False, decay=0.9)
    with pytest.raises(ValueError, match="log_decay applies to causal attention"):
        linear_attention(q, k, v, log_decay=-0.1)
    with pytest.raises(TypeError, match="decay must hold real numbers"):
        linear_attention(q, k, v, causal=True, decay=np.ones(q.shape[:-2], dtype=complex))
    with pytest.raises(TypeError, match="decay must hold real numbers"):
        linear_attention(q, k, v, causal=True, decay=True)


def test_a_state_of_another_family_or_an_unknown_rule_reads_cleanly():
    """The hint after "a state continues only the rule that made it" was "()" for a state of a rule without a
    linear form (a DPLR rule's, e.g. 'kda'): now it names dplr_attention, and an unknown rule gets none."""
    q, k, v = _qkv()
    S, z = np.zeros(q.shape[:-2] + (4, 3)), np.zeros(q.shape[:-2] + (4,))
    with pytest.raises(ValueError, match=r"state of the 'kda' update rule.*'additive' rule; a state continues only the "
                                         r"rule that made it \(a diagonal-plus-low-rank rule: "
                                         r"dplr_attention\(rule='kda'\) continues it\)$"):
        linear_attention(q, k, v, causal=True, initial_state=LinearState(S, z, 0, "kda"))
    with pytest.raises(ValueError, match="the rule that made it$"):
        linear_attention(q, k, v, causal=True, initial_state=LinearState(S, z, 0, "no_such_rule"))

def test_segments_carry_the_rule_and_refuse_another():
    q, k, v = _qkv()
    decay = RNG.uniform(0.5, 1.0, size=q.shape[:-1])
    whole, st = linear_attention(q, k, v, causal=True, decay=decay, method="quadratic", return_state=True)
    o1, s1 = linear_attention(q[..., :6, :], k[..., :6, :], v[..., :6, :], causal=True, decay=decay[..., :6],
                              method="quadratic", return_state=True)
    o2, s2 = linear_attention(q[..., 6:, :], k[..., 6:, :], v[..., 6:, :], causal=True, decay=decay[..., 6:],
                              method="quadratic", return_state=True, initial_state=s1)
    np.testing.assert_allclose(np.concatenate([o1, o2], axis=-2), whole, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(s2.S, st.S, rtol=1e-12, atol=1e-13)
    assert (s1.rule, s2.rule, s2.position) == ("decay", "decay", 11)
    with pytest.raises(ValueError, match="state of the 'decay' update rule.*'additive' rule"):
        linear_attention(q, k, v, causal=True, initial_state=s1)
    with pytest.raises(ValueError, match="state of the 'decay' update rule.*'gate' rule"):
        linear_attention(q, k, v, causal=True, initial_state=s1, decay=np.ones(q.shape))
    # a plain tuple carries no rule: the caller vouches for it
    linear_attention(q, k, v, causal=True, initial_state=(s1.S, s1.z, 6), decay=0.9, method="quadratic")
    add = linear_attention(q, k, v, causal=True, method="quadratic", return_state=True)[1]
    assert isinstance(add, LinearState) and add.rule == "additive"
    with pytest.raises(ValueError, match="state of the 'additive' update rule"):
        linear_attention(q, k, v, causal=True, initial_state=add, decay=0.5)
