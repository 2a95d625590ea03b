"""The diagonal-plus-low-rank recurrence (``linattn_nb.dplr_attention``) and its named rules.

* Every rule of ``linattn_nb.rules`` equals its parameterisation through the general form, to 1e-12
  in float64, on every method, outputs and final state.
* Every named DPLR rule's general form equals its own step as its paper writes it (``DPLRRule.step``).
* Segments chained through ``initial_state`` equal one call; a reset wipes the state; bad input names
  the argument and the shapes; nothing the caller passed is modified; growth that overflows is an
  error, never a silent inf.
"""
from __future__ import annotations

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import rules
from linattn_nb.feature_maps import get as get_map
from linattn_nb.feature_maps._base import FeatureOverflow
from linattn_nb.ops._finite import NonFiniteResult

METHODS = ("quadratic", "scan", "chunked")
B, N, D, M = 2, 9, 5, 4


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    """Chunks of 4 steps: the short sequences here span several (the chunked form's cuts)."""
    monkeypatch.setattr(la.config, "DPLR_CHUNK", 4)


def _qkv(rng, r=0):
    q = rng.standard_normal((B, N, D))
    shape = (B, N, r) if r else (B, N)
    return q, rng.standard_normal(shape + (D,)), rng.standard_normal(shape + (M,))


def _log(x):
    with np.errstate(divide="ignore"):
        return np.log(x)


def general_form(name, fk, inputs):
    """The general entry's arguments that make rule ``name`` (fk: the keys' features)."""
    zeros = np.zeros_like(fk)
    decay = inputs.get("decay")
    ld = None if decay is None else _log(decay)
    beta = inputs.get("beta")
    if name in ("additive", "decay", "gate"):
        return {"a": zeros, "b": zeros, "log_diag": ld}
    if name == "delta":
        return {"a": fk, "b": -beta[..., None] * fk, "beta": beta}
    if name == "gated_delta":
        return {"a": np.exp(ld)[..., None] * fk, "b": -beta[..., None] * fk, "beta": beta, "log_diag": ld}
    raise AssertionError(f"no parameterisation for {name}")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", rules.rule_names())
def test_every_rule_is_a_parameterisation(rng, name, method):
    rule = rules.get_rule(name)
    fmap = rule.study_map
    q, k, v = _qkv(rng)
    inputs = rule.sample(rng, B, N, D)
    S0, z0 = rng.random((B, D, M)), rng.random((B, D)) + 0.5
    init = la.LinearState(S0, z0, 0, name)
    ref, st = la.linear_attention(q, k, v, causal=True, method="quadratic", feature_map=fmap, initial_state=init,
                                  return_state=True, **inputs)
    fk = get_map(fmap)(k)
    o, st2 = la.dplr_attention(q, k, v, feature_map=fmap, method=method, normalize=rule.normalize,
                               initial_state=la.LinearState(S0, z0, 0, "dplr"), return_state=True,
                               **general_form(name, fk, inputs))
    np.testing.assert_allclose(o, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st2.S, st.S, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st2.z, st.z, rtol=1e-12, atol=1e-12)
    assert st2.position == N and st2.rule == "dplr"


def _paper(rule, fq, fk, v, inputs, H0, normalize, eps):
    """The named rule's own step, token by token (float64)."""
    Bn, n = fq.shape[:2]
    Mv = v.shape[-1]
    out = np.empty((Bn, n, Mv))
    H = H0.copy()
    for b in range(Bn):
        for t in range(n):
            inp = {key: x[b, t] for key, x in inputs.items()}
            v1 = np.concatenate([v[b, t], np.ones(v[b, t].shape[:-1] + (1,))], axis=-1)
            H[b] = rule.step(H[b], fk[b, t], v1, inp)
            red = fq[b, t] @ H[b]
            out[b, t] = red[:Mv] / max(red[Mv], eps) if normalize else red[:Mv]
    return out, H


def _checked(name, inputs):
    """The sample's arguments as the rule's step reads them (log-factors, beta)."""
    out = {}
    for key, x in inputs.items():
        if key == "decay":
            out["log_gate" if name in ("kda", "gated_delta_product") else "log_w"] = _log(x)
        else:
            out[key] = x
    return out


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", rules.dplr_rule_names())
def test_named_rules_match_their_papers(rng, name, method, normalize):
    rule = rules.get_dplr_rule(name)
    r = 3 if rule.substeps else 0
    q, k, v = _qkv(rng, r)
    inputs = rule.sample(rng, B, N, D, r)
    H0 = rng.random((B, D, M + 1)) + 0.5
    init = la.LinearState(H0[..., :M], H0[..., M], 0, name)
    o, st = la.dplr_attention(q, k, v, rule=name, feature_map="l2", method=method, normalize=normalize, eps=1e-6,
                              initial_state=init, return_state=True, **inputs)
    fq, fk = get_map("l2")(q), get_map("l2")(k)
    ref, H = _paper(rule, fq, fk, v, _checked(name, inputs), H0, normalize, 1e-6)
    np.testing.assert_allclose(o, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st.S, H[..., :M], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st.z, H[..., M], rtol=1e-12, atol=1e-12)
    assert st.rule == name


def test_one_step_products_are_the_delta_rules(rng):
    """n_h = 1: DeltaProduct is the delta rule and gated DeltaProduct the gated delta rule; KDA with
    one gate for every feature is the gated delta rule."""
    q, k, v = _qkv(rng)
    beta = rng.uniform(0, 2, size=(B, N))
    decay = rng.uniform(0.5, 1, size=(B, N))
    delta = la.linear_attention(q, k, v, causal=True, feature_map="l2", beta=beta)
    gated = la.linear_attention(q, k, v, causal=True, feature_map="l2", beta=beta, decay=decay)
    for method in METHODS:
        o = la.dplr_attention(q, k[:, :, None], v[:, :, None], rule="delta_product", beta=beta[..., None],
                              feature_map="l2", method=method)
        np.testing.assert_allclose(o, delta, rtol=1e-12, atol=1e-12)
        o = la.dplr_attention(q, k[:, :, None], v[:, :, None], rule="gated_delta_product", beta=beta[..., None],
                              decay=decay, feature_map="l2", method=method)
        np.testing.assert_allclose(o, gated, rtol=1e-12, atol=1e-12)
        o = la.dplr_attention(q, k, v, rule="kda", beta=beta, decay=np.repeat(decay[..., None], D, -1),
                              feature_map="l2", method=method)
        np.testing.assert_allclose(o, gated, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", rules.dplr_rule_names())
def test_segments_chain_through_the_state(rng, name):
    rule = rules.get_dplr_rule(name)
    r = 2 if rule.substeps else 0
    q, k, v = _qkv(rng, r)
    inputs = rule.sample(rng, B, N, D, r)
    whole, st = la.dplr_attention(q, k, v, rule=name, feature_map="l2", return_state=True, **inputs)
    cut = 4
    first, st1 = la.dplr_attention(q[:, :cut], k[:, :cut], v[:, :cut], rule=name, feature_map="l2",
                                   return_state=True, **{key: x[:, :cut] for key, x in inputs.items()})
    second, st2 = la.dplr_attention(q[:, cut:], k[:, cut:], v[:, cut:], rule=name, feature_map="l2",
                                    initial_state=st1, return_state=True,
                                    **{key: x[:, cut:] for key, x in inputs.items()})
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), whole, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st2.S, st.S, rtol=1e-12, atol=1e-12)
    assert st2.position == N


def test_reset_wipes_the_state(rng):
    """log_diag = -inf at token t (and a = b = 0 there): the outputs from t on are those of a fresh start."""
    q, k, v = _qkv(rng)
    a = rng.standard_normal((B, N, D)) * 0.2
    b = rng.standard_normal((B, N, D)) * 0.2
    ld = _log(rng.uniform(0.5, 1, size=(B, N, D)))
    t = 5
    ld[:, t] = -np.inf
    a[:, t] = 0.0
    for method in METHODS:
        o = la.dplr_attention(q, k, v, a=a, b=b, log_diag=ld, method=method)
        ld2 = ld[:, t:].copy()
        ld2[:, 0] = 0.0
        fresh = la.dplr_attention(q[:, t:], k[:, t:], v[:, t:], a=a[:, t:], b=b[:, t:], log_diag=ld2, method=method)
        np.testing.assert_allclose(o[:, t:], fresh, rtol=1e-12, atol=1e-12)


def test_scan_matches_quadratic_in_every_dtype_and_batch_shape(rng):
    q = rng.standard_normal((2, 3, N, D))
    k = rng.standard_normal((2, 3, N, 2, D))
    v = rng.standard_normal((2, 3, N, 2, M))
    a = rng.standard_normal((2, 3, N, 2, D)) * 0.3
    b = rng.standard_normal((2, 3, N, 2, D)) * 0.3
    ld = _log(rng.uniform(0.5, 1, size=(2, 3, N)))
    beta = rng.uniform(0, 1, size=(2, 3, N, 2))
    ref = la.dplr_attention(q, k, v, a=a, b=b, log_diag=ld, beta=beta, method="quadratic", normalize=True)
    assert ref.shape == (2, 3, N, M)
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5), (np.float16, 1e-2)):
        ref_d = la.dplr_attention(*(x.astype(dtype) for x in (q, k, v)), a=a, b=b, log_diag=ld, beta=beta,
                                  method="quadratic", normalize=True)
        for method in ("scan", "chunked"):
            o = la.dplr_attention(*(x.astype(dtype) for x in (q, k, v)), a=a, b=b, log_diag=ld, beta=beta,
                                  method=method, normalize=True)
            assert o.dtype == dtype
            np.testing.assert_allclose(o.astype(np.float64), ref_d.astype(np.float64), rtol=tol, atol=tol)
    out = np.empty((2, 3, N, M))
    res = la.dplr_attention(q, k, v, a=a, b=b, log_diag=ld, beta=beta, normalize=True, out=out)
    assert res is out
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


def _general_case(rng, n, r, w, ld, scale=0.3):
    """The general form's arguments for n tokens, r sub-steps (0: none) and writes after each sub-step
    (w = r) or after the last (w = 1)."""
    q = rng.standard_normal((B, n, D))
    kshape = (B, n, r) if (r and w == r) else (B, n)
    k, v = rng.standard_normal(kshape + (D,)), rng.standard_normal(kshape + (M,))
    ab = (B, n, r, D) if r else (B, n, D)
    return q, k, v, {"a": rng.standard_normal(ab) * scale, "b": rng.standard_normal(ab) * scale, "log_diag": ld,
                     "beta": rng.uniform(0.2, 1, size=kshape)}


def _chunked_equals_quadratic(q, k, v, args, normalize):
    S0, z0 = np.full((B, D, M), 0.3), np.full((B, D), 1.5)
    res = []
    for method in ("quadratic", "chunked"):
        res.append(la.dplr_attention(q, k, v, method=method, normalize=normalize, eps=1e-6, return_state=True,
                                     initial_state=la.LinearState(S0, z0, 0, "dplr"), **args))
    (ref, st), (o, st2) = res
    np.testing.assert_allclose(o, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st2.S, st.S, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st2.z, st.z, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("chunk", [4, 64])
@pytest.mark.parametrize("case", ["ragged", "reset_inside", "reset_first", "reset_rank", "reset_finite",
                                  "decay_cuts", "substeps", "substeps_one_write"])
def test_chunked_cuts(rng, monkeypatch, case, chunk, normalize):
    """Chunk boundaries: N not a multiple of the chunk, a reset inside a chunk and at its first step
    (with a low-rank part that still reads the state, and a finite log-diagonal of -700), decays of
    -50 a step that force a chunk to end before exp(-600), r = 3 sub-steps with a write after each
    (and one write after the last)."""
    monkeypatch.setattr(la.config, "DPLR_CHUNK", chunk)
    n, r, w = 11, 0, 1
    ld = _log(rng.uniform(0.5, 1, size=(B, n, D)))
    if case == "reset_inside":
        ld[:, 5] = -np.inf
    elif case == "reset_first":
        ld[:, 4] = -np.inf
        ld[0, 8, 2] = -np.inf  # one feature only
    elif case == "reset_rank":
        ld[:, [0, 4, 6]] = -np.inf
        ld[:, 7] = -np.inf  # two resets in a row
    elif case == "reset_finite":
        ld[:, 5, 1] = -700.0
        ld[:, 9, 3] = -650.0
    elif case == "decay_cuts":
        n = 40
        ld = np.full((B, n, D), -50.0)
        ld[:, :, 1] = -3.0
        ld[1, 17] = -5.0
    elif case.startswith("substeps"):
        r = 3
        w = r if case == "substeps" else 1
        ld = _log(rng.uniform(0.5, 1, size=(B, n)))
        ld[:, 6] = -np.inf
    q, k, v, args = _general_case(rng, n, r, w, ld)
    _chunked_equals_quadratic(q, k, v, args, normalize)


def test_chunked_with_no_diagonal_and_one_per_token(rng, monkeypatch):
    monkeypatch.setattr(la.config, "DPLR_CHUNK", 4)
    n = 10
    q, k, v, args = _general_case(rng, n, 2, 2, None)
    _chunked_equals_quadratic(q, k, v, args, True)
    ld = _log(rng.uniform(0.2, 1, size=(B, n)))
    ld[:, 3] = -np.inf
    q, k, v, args = _general_case(rng, n, 0, 1, ld)
    _chunked_equals_quadratic(q, k, v, args, False)


def test_auto_picks_chunked_from_the_crossover(rng, monkeypatch):
    q, k, v, args = _general_case(rng, N, 0, 1, _log(rng.uniform(0.5, 1, size=(B, N, D))))
    calls = []
    import linattn_nb.ops.dplr.chunked as CH

    real = CH.dplr_chunked
    monkeypatch.setattr(CH, "dplr_chunked", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(la.config, "DPLR_AUTO_CHUNKED_MIN", N + 1)
    scan = la.dplr_attention(q, k, v, **args)
    assert not calls
    monkeypatch.setattr(la.config, "DPLR_AUTO_CHUNKED_MIN", N)
    chunked = la.dplr_attention(q, k, v, **args)
    assert calls
    np.testing.assert_allclose(chunked, scan, rtol=1e-12, atol=1e-12)


def test_empty_sequence(rng):
    q, k, v = (np.zeros((B, 0, n)) for n in (D, D, M))
    o, st = la.dplr_attention(q, k, v, a=np.zeros((B, 0, D)), b=np.zeros((B, 0, D)), return_state=True)
    assert o.shape == (B, 0, M) and st.S.shape == (B, D, M) and not st.S.any()


@pytest.mark.parametrize("fmap", ["l2", "silu_l2"])
def test_empty_float32_calls_with_a_row_map_on_the_default_method(fmap):
    """N = 0 or an empty batch in float32 with a row map: the float32 features' reshape (-1 over 0 rows) raised
    "cannot reshape array of size 0"; now an empty output, as float64 and the scan gave."""
    for shape in ((0, D), (0, 3, D)):
        z = np.zeros(shape, np.float32)
        out = la.dplr_attention(z, z, z, a=z, b=z, feature_map=fmap)
        assert out.shape == shape and out.dtype == np.float32
        kda = la.dplr_attention(z, z, z, rule="kda", decay=z, beta=z[..., 0], feature_map=fmap)
        assert kda.shape == shape


@pytest.mark.parametrize("method", METHODS)
def test_a_factor_axis_of_zero_is_refused(rng, method):
    """a, b of shape (..., N, 0, D_phi): the scan gave zeros (every write dropped), the chunked form a
    ZeroDivisionError; now a ValueError naming a."""
    q, k, v = _qkv(rng)
    z = np.zeros((B, N, 0, D))
    with pytest.raises(ValueError, match=r"^a's factor axis \(r, the second to last\) must be >= 1"):
        la.dplr_attention(q, k, v, a=z, b=z, method=method)


def test_inputs_are_not_modified(rng):
    q, k, v = _qkv(rng)
    args = {"a": rng.standard_normal((B, N, D)), "b": rng.standard_normal((B, N, D)) * 0.1,
            "log_diag": _log(rng.uniform(0.5, 1, size=(B, N))), "beta": rng.uniform(0, 1, size=(B, N))}
    before = [x.copy() for x in (q, k, v, *args.values())]
    for method in METHODS:
        la.dplr_attention(q, k, v, method=method, normalize=True, **args)
    for x, y in zip((q, k, v, *args.values()), before):
        np.testing.assert_array_equal(x, y)
    kd = {"decay": rng.uniform(0.5, 1, size=(B, N, D)), "beta": rng.uniform(0, 1, size=(B, N))}
    saved = {key: x.copy() for key, x in kd.items()}
    la.dplr_attention(q, k, v, rule="kda", **kd)
    for key in kd:
        np.testing.assert_array_equal(kd[key], saved[key])


def test_growth_is_an_error_not_a_silent_inf(rng):
    """a = b = ones: ||I + b a^T|| = 1 + D per token, the state overflows float64 within ~300 tokens."""
    n = 400
    q, k, v = (np.abs(rng.standard_normal((1, n, d))) for d in (D, D, M))
    ones = np.ones((1, n, D))
    for method in METHODS:
        with pytest.raises(NonFiniteResult, match="grew"):
            la.dplr_attention(q, k, v, a=ones, b=ones, method=method)
    # float32 outputs past float32's range (6^60 ~ 5e46), finite in float64
    n = 60
    q, k, v = (np.abs(rng.standard_normal((1, n, d))).astype(np.float32) for d in (D, D, M))
    ones = np.ones((1, n, D))
    with pytest.raises(NonFiniteResult, match="float32"):
        la.dplr_attention(q, k, v, a=ones, b=ones)
    o = la.dplr_attention(q.astype(np.float64), k, v, a=ones, b=ones)
    assert np.isfinite(o).all() and np.abs(o).max() > np.finfo(np.float32).max


# maps whose float32 features of finite inputs overflow: taylor2 and dpfp (computed in float32: inf), squared
# ReLU (the chunked path's compiled float32 map, and NumPy's), rff (raises FeatureOverflow: its keys'
# exp(|x|^2 / 2) factor at |x| ~ 20); normalised, so that the float64 outputs of the positive maps fit in
# float32 (rff's features take both signs: its outputs need not)
OVERFLOWING = [("taylor2", {}, 1e20), ("dpfp", {}, 1e20), ("squared_relu", {}, 1e20),
               ("rff", {"dim": D, "seed": 0}, 12.0)]


@pytest.mark.parametrize("name, params, scale", OVERFLOWING, ids=[c[0] for c in OVERFLOWING])
@pytest.mark.parametrize("method", METHODS)
def test_features_that_overflow_float32_run_the_call_in_float64(name, params, scale, method, rng):
    fmap = get_map(name, **params)
    F = fmap.output_dim(D)
    q = (rng.standard_normal((1, N, D)) * scale).astype(np.float32)
    k, v = q[:, ::-1].copy(), rng.standard_normal((1, N, M)).astype(np.float32)
    try:
        with np.errstate(over="ignore"):
            assert not np.isfinite(fmap.apply(k, role="key", causal=True)).all()  # the case under test
    except FeatureOverflow:
        pass
    a, b = np.zeros((1, N, F), np.float32), np.full((1, N, F), -0.01, np.float32)
    kw = dict(a=a, b=b, feature_map=fmap, normalize=True, return_state=True)
    ref, st64 = la.dplr_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), method="scan",
                                  **kw)
    assert np.isfinite(ref).all()
    if np.abs(ref).max() > np.finfo(np.float32).max:  # rff: features of both signs, so normalised outputs too
        with pytest.raises(NonFiniteResult, match="float32"):
            la.dplr_attention(q, k, v, method=method, **kw)
        return
    out, st = la.dplr_attention(q, k, v, method=method, **kw)
    assert out.dtype == np.float32 and np.isfinite(out).all()
    np.testing.assert_allclose(out, ref.astype(np.float32), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(st.S, st64.S, rtol=1e-9)
    np.testing.assert_allclose(st.z, st64.z, rtol=1e-9)
    # the state object runs dplr_attention
    dst = la.DPLRState(D, M, feature_map=fmap, normalize=True)
    np.testing.assert_allclose(dst.step(q[0], k[0], v[0], a=a[0], b=b[0]), ref[0].astype(np.float32), rtol=1e-5,
                               atol=1e-6)


def test_unnormalised_outputs_of_overflowing_features_still_raise(rng):
    # taylor2's features of 1e20 are ~1e40: in float64 the unnormalised outputs exceed float32's range
    q = (rng.standard_normal((1, N, D)) * 1e20).astype(np.float32)
    F = get_map("taylor2").output_dim(D)
    zeros = np.zeros((1, N, F), np.float32)
    with pytest.raises(NonFiniteResult, match="float32"):
        la.dplr_attention(q, q, q, a=zeros, b=zeros, feature_map="taylor2")


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"a": np.zeros((B, N, D + 1)), "b": np.zeros((B, N, D + 1))}, ValueError, r"a must have shape .*\(2, 9, 5\)"),
    ({"a": np.zeros((B, N, D))}, TypeError, "missing argument: b"),
    ({"a": np.zeros((B, N, D)), "b": np.zeros((B, N, 2, D))}, ValueError, "same shape"),
    ({"a": np.zeros((B, N, D)), "b": np.zeros((B, N, D)), "log_diag": np.ones((B, N))}, ValueError, "<= 0"),
    ({"a": np.zeros((B, N, D)), "b": np.zeros((B, N, D)), "log_diag": np.zeros((B, N + 1))}, ValueError,
     r"log_diag must have shape"),
    ({"a": np.zeros((B, N, D)), "b": np.zeros((B, N, D)), "beta": np.zeros((B, 1))}, ValueError,
     r"beta must have shape \(\.\.\., N\)"),
    ({"a": np.zeros((B, N, D)), "b": np.zeros((B, N, D)), "method": "blocked"}, ValueError, "method must be one of"),
    ({"a": np.zeros((B, N, D)), "b": np.zeros((B, N, D)), "decay": np.ones((B, N))}, TypeError, "unexpected"),
    ({"rule": "kda", "beta": np.ones((B, N))}, TypeError, "decay or log_decay"),
    ({"rule": "kda", "beta": np.ones((B, N)), "decay": np.ones((B, N))}, ValueError, r"decay must have shape"),
    ({"rule": "kda", "beta": np.full((B, N), 3.0), "decay": np.ones((B, N, D))}, ValueError, r"beta must lie in"),
    ({"rule": "kda", "beta": np.ones((B, N)), "decay": np.ones((B, N, D)), "a": np.ones((B, N, D))}, TypeError,
     "builds its own a"),
    ({"rule": "kda", "beta": np.ones((B, N)), "log_decay": np.zeros((B, N, D)), "kappa": 1}, TypeError,
     "unexpected"),
    ({"rule": "rwkv7", "decay": np.ones((B, N, D)), "kappa": np.ones((B, N, D)), "iclr": np.full((B, N, D), 2.0)},
     ValueError, "iclr must lie in"),
    ({"rule": "nope"}, ValueError, "unknown DPLR rule 'nope'"),
    ({"rule": "delta_product", "beta": np.ones((B, N))}, ValueError, r"k must have shape \(\.\.\., N, r, D\)"),
])
def test_bad_input_names_the_argument(rng, kwargs, exc, match):
    q, k, v = _qkv(rng)
    with pytest.raises(exc, match=match):
        la.dplr_attention(q, k, v, **kwargs)


def test_bad_arrays_name_the_argument(rng):
    q, k, v = _qkv(rng)
    ab = {"a": np.zeros((B, N, D)), "b": np.zeros((B, N, D))}
    with pytest.raises(TypeError, match="q must have dtype float16, float32 or float64, got int64"):
        la.dplr_attention(q.astype(int), k, v, **ab)
    # read as linear_attention reads them: long double (it came back as float128), masked (the mask was dropped),
    # ragged (NumPy's error, no name)
    with pytest.raises(TypeError, match="q must have dtype float16, float32 or float64, got float128"):
        la.dplr_attention(q.astype(np.longdouble), k, v, **ab)
    with pytest.raises(TypeError, match="q is a masked array"):
        la.dplr_attention(np.ma.masked_array(q), k, v, **ab)
    with pytest.raises(TypeError, match="a is a masked array"):
        la.dplr_attention(q, k, v, a=np.ma.masked_array(ab["a"]), b=ab["b"])
    with pytest.raises(TypeError, match="a must be a real floating-point array, got dtype float128"):
        la.dplr_attention(q, k, v, a=ab["a"].astype(np.longdouble), b=ab["b"])
    with pytest.raises(TypeError, match="q could not be converted to an array"):
        la.dplr_attention([[0.0, 1.0], [1.0]], k, v, **ab)
    with pytest.raises(ValueError, match="v must have shape"):
        la.dplr_attention(q, k, v[:, :-1], **ab)
    with pytest.raises(ValueError, match="k must have shape"):
        la.dplr_attention(q, k[..., :-1], v, **ab)
    bad = k.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="k contains 1 non-finite"):
        la.dplr_attention(q, bad, v, **ab)
    with pytest.raises(ValueError, match="initial_state was made by rule 'delta'"):
        la.dplr_attention(q, k, v, initial_state=la.LinearState(np.zeros((B, D, M)), np.zeros((B, D)), 0, "delta"),
                          **ab)
    with pytest.raises(ValueError, match=r"initial_state.S must have shape"):
        la.dplr_attention(q, k, v, initial_state=la.LinearState(np.zeros((B, D, M + 1)), np.zeros((B, D)), 0, "dplr"),
                          **ab)
    # a state that records no rule (made by hand) is taken as this call's own, as linear_attention and the torch
    # adapter take it
    S0, z0 = rng.standard_normal((B, D, M)), rng.random((B, D))
    np.testing.assert_array_equal(la.dplr_attention(q, k, v, initial_state=la.LinearState(S0, z0, 0, None), **ab),
                                  la.dplr_attention(q, k, v, initial_state=la.LinearState(S0, z0, 0, "dplr"), **ab))
    # as linear_attention's out: a wrong dtype a TypeError, a wrong shape a ValueError
    with pytest.raises(TypeError, match="out must have dtype float64"):
        la.dplr_attention(q, k, v, out=np.empty((B, N, M), np.float32), **ab)
    with pytest.raises(ValueError, match="out must have shape"):
        la.dplr_attention(q, k, v, out=np.empty((B, N + 1, M)), **ab)


def _kda_args(rng):
    return {"rule": "kda", "decay": rng.uniform(0.5, 1, (B, N, D)), "beta": rng.uniform(0, 1, (B, N)),
            "feature_map": "l2"}


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"return_state": "no"}, TypeError, "return_state must be True or False, got 'no'"),
    ({"return_state": 1}, TypeError, "return_state must be True or False, got 1"),
    ({"check_finite": "no"}, TypeError, "check_finite must be True or False, got 'no'"),
    ({"normalize": True, "eps": "x"}, TypeError, "eps must be a non-negative float or None, got str"),
    ({"normalize": True, "eps": True}, TypeError, "eps must be a non-negative float or None, got bool"),
    ({"normalize": False, "eps": "x"}, TypeError, "eps must be a non-negative float or None, got str"),
    ({"normalize": True, "eps": -1.0}, ValueError, "eps must be a finite non-negative float or None"),
])
def test_flags_and_eps_are_checked_as_linear_attention_checks_them(rng, kwargs, exc, match):
    """return_state and check_finite were truth-tested (return_state="no" returned a tuple) and eps read by
    float() (eps="x" a bare ValueError, eps=True a floor of 1): now linear_attention's checks and messages."""
    q, k, v = _qkv(rng)
    with pytest.raises(exc, match=match):
        la.linear_attention(q, k, v, causal=True, **kwargs)
    with pytest.raises(exc, match=match):
        la.dplr_attention(q, k, v, **_kda_args(rng), **kwargs)
    if "return_state" not in kwargs:
        with pytest.raises(exc, match=match):
            la.dplr_attention_vjp(q, k, v, np.ones((B, N, M)), **_kda_args(rng), **kwargs)


@pytest.mark.parametrize("position,exc,match", [
    (-5, ValueError, "initial_state.position must be >= 0, got -5"),
    (2.7, ValueError, "initial_state.position must be a non-negative integer, got 2.7"),
    (True, TypeError, "initial_state.position must be a non-negative integer, got True"),
    ("3", TypeError, "initial_state.position must be a non-negative integer"),
    (1 << 63, ValueError, "initial_state.position must be at most 2"),
])
def test_initial_state_position_is_checked_as_linear_attention_checks_it(rng, position, exc, match):
    """initial_state.position was read by int(): -5 accepted (the state returned at position 4), 2.7 cut to 2."""
    q, k, v = _qkv(rng)
    args = _kda_args(rng)
    _, st = la.dplr_attention(q, k, v, return_state=True, **args)
    bad = la.LinearState(S=st.S, z=st.z, position=position, rule="kda")
    with pytest.raises(exc, match=match):
        la.dplr_attention(q, k, v, initial_state=bad, **args)
    with pytest.raises(exc, match=match):
        la.dplr_attention_vjp(q, k, v, np.ones((B, N, M)), initial_state=bad, **args)
    ok = la.LinearState(S=st.S, z=st.z, position=np.int64(N), rule="kda")
    assert la.dplr_attention(q, k, v, initial_state=ok, return_state=True, **args)[1].position == 2 * N


@pytest.mark.parametrize("field", ["S", "z"])
def test_a_non_finite_grad_state_is_refused(rng, field):
    """dplr_attention_vjp checked grad_state's shape only: a NaN in it gave NaN gradients; now the ValueError
    naming grad_state.S or .z that linear_attention_vjp raises, and check_finite=False lets it through."""
    q, k, v = _qkv(rng)
    args = _kda_args(rng)
    _, st = la.dplr_attention(q, k, v, return_state=True, **args)
    bad = st._replace(**{field: np.full_like(getattr(st, field), np.nan)})
    g = np.ones((B, N, M))
    with pytest.raises(ValueError, match=rf"grad_state.{field} contains \d+ non-finite value\(s\)"):
        la.dplr_attention_vjp(q, k, v, g, grad_state=bad, **args)
    res = la.dplr_attention_vjp(q, k, v, g, grad_state=bad, check_finite=False, **args)
    assert not np.isfinite(res.d_inputs["decay"]).all()


def test_a_non_finite_grad_out_is_counted_as_linear_attention_vjp_counts_it(rng):
    """dplr_attention_vjp said "grad_out contains non-finite values (NaN or inf)" with no count; now the message
    of linear_attention_vjp (the same helper), and check_finite=False lets the values through."""
    q, k, v = _qkv(rng)
    args = _kda_args(rng)
    g = np.ones((B, N, M))
    g[0, 1, 2], g[1, 3, 0] = np.nan, np.inf
    with pytest.raises(ValueError) as dplr:
        la.dplr_attention_vjp(q, k, v, g, **args)
    assert str(dplr.value) == ("grad_out contains 2 non-finite value(s) (NaN or inf); pass check_finite=False to "
                               "skip this check")
    with pytest.raises(ValueError) as linear:
        la.linear_attention_vjp(q, k, v, g, causal=True, method="quadratic")
    assert str(linear.value) == str(dplr.value)
    with np.errstate(invalid="ignore"):  # inf times 0 in the gradients
        res = la.dplr_attention_vjp(q, k, v, g, check_finite=False, **args)
    assert not np.isfinite(res.dv).all()


@pytest.mark.parametrize("change,exc,match", [
    ({"z": None}, TypeError, r"^grad_state\.z must be an array, got None$"),
    ({"position": -1}, ValueError, r"^grad_state\.position must be >= 0, got -1$"),
    ({"position": 2.7}, ValueError, r"^grad_state\.position must be a non-negative integer, got 2\.7$"),
    ({"position": True}, TypeError, r"^grad_state\.position must be a non-negative integer, got True$"),
    ({"S": np.ones((B, D, M), dtype=np.int64)}, TypeError,
     r"^grad_state\.S must have dtype float16, float32 or float64, got int64"),
    ({"z": np.ones((B, D), dtype=np.int32)}, TypeError,
     r"^grad_state\.z must have dtype float16, float32 or float64, got int32"),
])
def test_grad_state_is_read_as_linear_attention_vjp_reads_it(rng, change, exc, match):
    """dplr_attention_vjp took a grad_state whose z was None as zeros and never looked at its position; now both
    as linear_attention_vjp (parse_state): z is required (the state's z is part of it with normalize=False too),
    the position a non-negative integer, not compared with the call's; a tuple (S, z) is a grad_state too; an
    integer S or z a TypeError (it was taken as float64)."""
    q, k, v = _qkv(rng)
    args = _kda_args(rng)
    g = np.ones((B, N, M))
    _, st = la.dplr_attention(q, k, v, return_state=True, **args)
    with pytest.raises(exc, match=match):
        la.dplr_attention_vjp(q, k, v, g, grad_state=st._replace(**change), **args)
    ref = la.dplr_attention_vjp(q, k, v, g, grad_state=st, **args)
    for other in ((st.S, st.z), st._replace(position=0), st._replace(position=np.int64(3 * N))):
        got = la.dplr_attention_vjp(q, k, v, g, grad_state=other, **args)
        np.testing.assert_array_equal(got.dq, ref.dq)
        np.testing.assert_array_equal(got.d_inputs["decay"], ref.d_inputs["decay"])


@pytest.mark.parametrize("method", METHODS)
def test_a_non_finite_initial_state_is_taken_with_check_finite_off(rng, method):
    """dplr_attention refused a non-finite initial_state with check_finite=False too, where linear_attention takes
    it; now as there: refused with check_finite (the message names initial_state.S or .z and counts the values),
    taken as it is without (NaN in the outputs of the sequence that holds it, the other one unchanged)."""
    q, k, v = _qkv(rng)
    args = {"a": np.zeros((B, N, D)), "b": np.zeros((B, N, D)), "method": method}
    _, st = la.dplr_attention(q, k, v, return_state=True, **args)
    S0 = st.S.copy()
    S0[0, 1, 2] = np.nan
    bad = st._replace(S=S0)
    want = r"^initial_state\.S contains 1 non-finite value\(s\) \(NaN or inf\); pass check_finite=False"
    with pytest.raises(ValueError, match=want):
        la.dplr_attention(q, k, v, initial_state=bad, **args)
    with pytest.raises(ValueError, match=want):
        la.dplr_attention_vjp(q, k, v, np.ones((B, N, M)), initial_state=bad, **args)
    z0 = st.z.copy()
    z0[1, 0] = np.inf
    with pytest.raises(ValueError, match=r"^initial_state\.z contains 1 non-finite"):
        la.dplr_attention(q, k, v, initial_state=st._replace(z=z0), **args)
    lin = la.linear_attention(q, k, v, causal=True, method="quadratic", normalize=False, check_finite=False,
                              initial_state=la.LinearState(S0, st.z, st.position, "additive"))
    out = la.dplr_attention(q, k, v, initial_state=bad, check_finite=False, **args)
    good = la.dplr_attention(q, k, v, initial_state=st, **args)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(lin))
    assert np.isnan(out[0]).any() and np.array_equal(out[1], good[1])
    res = la.dplr_attention_vjp(q, k, v, np.ones((B, N, M)), initial_state=bad, check_finite=False, **args)
    assert np.isfinite(res.dq[1]).all() and res.d_initial_state is not None


def test_registry():
    assert rules.dplr_rule_names() == ("kda", "rwkv7", "delta_product", "gated_delta_product")
    assert rules.get_dplr_rule("kda") is rules.DPLR_RULES["kda"]
    with pytest.raises(ValueError, match="already registered"):
        rules.register_dplr(rules.DPLR_RULES["kda"])
    with pytest.raises(TypeError, match="DPLRRule"):
        rules.register_dplr(rules.get_rule("delta"))


# ---------------------------------------------------------------------------
# Gradients: directional central differences in float64 (relative 1e-6)
# ---------------------------------------------------------------------------
def _loss_and_grads(rng, call, vjp, arrays, fixed):
    """Check every array in ``arrays`` (name -> float64 array) against central differences of
    L = <out, G> + <S_N, GS> + <z_N, Gz> along a random direction."""
    out, st = call(**arrays, **fixed)
    G, GS, Gz = rng.standard_normal(out.shape), rng.standard_normal(st.S.shape), rng.standard_normal(st.z.shape)

    def loss(**arrs):
        o, s = call(**arrs, **fixed)
        return float((o * G).sum() + (s.S * GS).sum() + (s.z * Gz).sum())

    grads = vjp(G, la.LinearState(GS, Gz, 0, st.rule), **arrays, **fixed)
    checked = []
    for name, x in arrays.items():
        grad = grads[name]
        if grad is None:
            continue
        direction = rng.standard_normal(x.shape)
        if name in ("decay", "log_decay", "log_diag"):
            finite = np.isfinite(x) & (x != 0.0) if name != "decay" else (x > 0) & (x < 1)
            direction = np.where(finite, direction, 0.0)
        h = 1e-6
        plus = loss(**{**arrays, name: x + h * direction})
        minus = loss(**{**arrays, name: x - h * direction})
        numeric = (plus - minus) / (2 * h)
        analytic = float((grad * direction).sum())
        assert abs(analytic - numeric) <= 1e-6 * max(1.0, abs(numeric)), (name, analytic, numeric)
        checked.append(name)
    return checked


def _vjp_grads(g):
    return {"q": g.dq, "k": g.dk, "v": g.dv, **g.d_inputs,
            "S0": None if g.d_initial_state is None else g.d_initial_state.S}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("sub", [0, 2])
def test_general_form_gradients(rng, method, normalize, sub):
    n = 7
    q = rng.standard_normal((B, n, D))
    shape = (B, n, sub) if sub else (B, n)
    arrays = {"q": q, "k": rng.standard_normal(shape + (D,)), "v": rng.standard_normal(shape + (M,)),
              "a": rng.standard_normal((B, n, 2, D)) * 0.3, "b": rng.standard_normal((B, n, 2, D)) * 0.3,
              "log_diag": _log(rng.uniform(0.5, 1, size=(B, n, D))), "beta": rng.uniform(0.2, 1, size=shape)}
    arrays["log_diag"][:, 3, 1] = -np.inf  # a reset of one feature
    if sub:
        arrays["a"], arrays["b"] = arrays["a"][:, :, :sub], arrays["b"][:, :, :sub]
    S0 = rng.random((B, D, M))
    z0 = rng.random((B, D)) + 1.0
    fixed = {"feature_map": "elu", "normalize": normalize, "method": method}

    def call(q, k, v, **kw):
        return la.dplr_attention(q, k, v, initial_state=la.LinearState(S0, z0, 0, "dplr"), return_state=True, **kw)

    def vjp(G, GS, q, k, v, **kw):
        g = la.dplr_attention_vjp(q, k, v, G, initial_state=la.LinearState(S0, z0, 0, "dplr"), grad_state=GS, **kw)
        return _vjp_grads(g)

    assert set(_loss_and_grads(rng, call, vjp, arrays, fixed)) == set(arrays)


@pytest.mark.parametrize("log_form", [False, True])
@pytest.mark.parametrize("name", rules.dplr_rule_names())
def test_named_rule_gradients(rng, name, log_form):
    rule = rules.get_dplr_rule(name)
    n, r = 6, (2 if rule.substeps else 0)
    q, k, v = (x[:, :n] for x in _qkv(rng, r))
    inputs = rule.sample(rng, B, n, D, r)
    if "decay" in inputs:
        inputs["decay"] = np.clip(inputs["decay"], 0.3, 0.99)  # away from the reset: the differences stay smooth
        if log_form:
            inputs["log_decay"] = np.log(inputs.pop("decay"))
    arrays = {"q": q, "k": k, "v": v, **inputs}
    fixed = {"feature_map": "l2", "rule": name}

    def call(q, k, v, **kw):
        return la.dplr_attention(q, k, v, return_state=True, **kw)

    def vjp(G, GS, q, k, v, **kw):
        return _vjp_grads(la.dplr_attention_vjp(q, k, v, G, grad_state=GS, **kw))

    assert set(_loss_and_grads(rng, call, vjp, arrays, fixed)) == set(arrays)


def test_gradient_of_a_reset_decay_is_finite(rng):
    """With respect to ``decay`` the gradient is finite at decay = 0 (a reset)."""
    q, k, v = _qkv(rng)
    decay = rng.uniform(0.5, 1, size=(B, N, D))
    decay[:, 4] = 0.0
    g = la.dplr_attention_vjp(q, k, v, np.ones((B, N, M)), rule="kda", decay=decay, beta=np.full((B, N), 0.5),
                              feature_map="l2")
    assert np.isfinite(g.d_inputs["decay"]).all() and np.abs(g.d_inputs["decay"][:, 4]).sum() > 0
