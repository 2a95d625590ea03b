"""A researcher's own DPLR rule (docs/dplr.md, "A rule of your own"): what its check and build return is checked
before a kernel reads it, on every method, and a rule without a pullback is refused where gradients are asked."""
import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import rules
from linattn_nb.rules import _dplr as D

F = 8  # l2 features of keys of dimension 8


def _check(inputs, lead, N, F, r):
    return {"beta": D.per_feature("beta", inputs["beta"], lead, N, F)}


def _good(fk, v, i):
    return D.GeneralForm(np.zeros(fk.shape[:2] + (0,)), (i["beta"] * fk)[:, :, None], -fk[:, :, None],
                         (i["beta"] * fk)[:, :, None], v[:, :, None])


@pytest.fixture
def register():
    """Registers rules for one test and removes them after."""
    added = []

    def reg(name, build=_good, check=_check, pullback=None):
        rule = D.DPLRRule(name=name, arguments=("beta",), substeps=False, formula="", check=check, build=build,
                          step=lambda H, k, v1, inp: H, sample=None, pullback=pullback)
        rules.register_dplr(rule)
        added.append(name)
        return name

    yield reg
    for name in added:
        rules.DPLR_RULES.pop(name, None)


def _inputs():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 2, 16, F))
    return q, k, v, rng.uniform(0, 1, (2, 16, F))


def _with(form, **fields):
    return lambda fk, v, i: form(fk, v, i)._replace(**{n: f(fk, v, i) for n, f in fields.items()})


BAD = {
    "ld of width 3": (_with(_good, ld=lambda fk, v, i: np.zeros(fk.shape[:2] + (3,))),
                      ValueError, r"ld must have shape \(B, N, W\) = \(2, 16, W\) with W = 0, 1 or D_phi = 8, "
                                  r"got \(2, 16, 3\)"),
    "ld above 0": (_with(_good, ld=lambda fk, v, i: np.full(fk.shape[:2] + (1,), 0.5)),
                   ValueError, r"ld, the log-diagonal, must be <= 0 .*above 0"),
    "ld NaN": (_with(_good, ld=lambda fk, v, i: np.full(fk.shape[:2] + (1,), np.nan)),
               ValueError, r"ld, the log-diagonal, must be <= 0 .*NaN"),
    "vectors without r": (lambda fk, v, i: D.GeneralForm(np.zeros(fk.shape[:2] + (0,)), i["beta"] * fk, -fk,
                                                         i["beta"] * fk, v),
                          ValueError, r"a must have shape \(B, N, r, D_phi\).*got \(2, 16, 8\)"),
    "b of other r": (_with(_good, b=lambda fk, v, i: np.stack([fk, fk], axis=2)),
                     ValueError, r"b must have shape \(2, 16, 1, 8\)"),
    "vw of other width": (_with(_good, vw=lambda fk, v, i: v[:, :, None, :3]),
                          ValueError, r"vw must have shape \(2, 16, 1, 8\).*got \(2, 16, 1, 3\)"),
    "a NaN": (_with(_good, a=lambda fk, v, i: np.full(fk.shape[:2] + (1, F), np.nan)),
              ValueError, r"a holds non-finite values"),
    "not a form": (lambda fk, v, i: (fk, v), TypeError, r"must return a GeneralForm \(ld, a, b, kw, vw\), got tuple"),
    "integer kw": (_with(_good, kw=lambda fk, v, i: np.ones(fk.shape[:2] + (1, F), dtype=np.int64)),
                   TypeError, r"kw must be a floating-point array"),
}


@pytest.mark.parametrize("method", ["quadratic", "scan", "chunked"])
@pytest.mark.parametrize("case", list(BAD))
def test_a_rules_bad_build_is_refused_naming_the_rule_and_the_field(register, case, method):
    build, err, msg = BAD[case]
    name = register("user_" + case.replace(" ", "_"), build=build)
    q, k, v, beta = _inputs()
    with pytest.raises(err, match=rf"rule {name!r}: build.*{msg}"):
        la.dplr_attention(q, k, v, rule=name, beta=beta, feature_map="l2", method=method)


def test_a_good_rule_of_ones_own_runs_on_every_method(register):
    """The control: the same rule well built gives one result on every method (the checks refuse only the bad)."""
    name = register("user_good")
    q, k, v, beta = _inputs()
    outs = [la.dplr_attention(q, k, v, rule=name, beta=beta, feature_map="l2", method=m)
            for m in ("quadratic", "scan", "chunked")]
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(outs[2], outs[0], rtol=1e-10, atol=1e-12)


def test_a_check_that_returns_no_dict_is_refused(register):
    name = register("user_nocheck", check=lambda inputs, lead, N, F, r: None)
    q, k, v, beta = _inputs()
    with pytest.raises(TypeError, match=r"rule 'user_nocheck': check must return a dict .*got NoneType"):
        la.dplr_attention(q, k, v, rule=name, beta=beta, feature_map="l2")


def test_a_rule_without_pullback_runs_forward_and_refuses_gradients(register):
    name = register("user_nopullback")
    q, k, v, beta = _inputs()
    la.dplr_attention(q, k, v, rule=name, beta=beta, feature_map="l2")
    with pytest.raises(ValueError, match=r"rule 'user_nopullback' has no pullback"):
        la.dplr_attention_vjp(q, k, v, np.ones_like(v), rule=name, beta=beta, feature_map="l2")
    torch = pytest.importorskip("torch")
    import linattn_nb.torch as lt

    qt = torch.tensor(q, requires_grad=True)
    kt, vt = torch.tensor(k), torch.tensor(v)
    with pytest.raises(ValueError, match=r"rule 'user_nopullback' has no pullback"):
        lt.dplr_attention(qt, kt, vt, rule=name, beta=beta, feature_map="l2")  # at the forward, not the backward
    with torch.no_grad():
        lt.dplr_attention(qt, kt, vt, rule=name, beta=beta, feature_map="l2")  # no gradient asked: runs


def test_a_pullback_gradient_of_an_optional_argument_not_passed_is_dropped(register):
    """A rule whose beta is optional (ones when omitted) and whose pullback always returns its gradient: a KeyError
    where the call did not pass beta; now no d_inputs entry for it, and the other gradients as with beta = 1."""
    from linattn_nb.dplr import dplr_attention_vjp

    def check(inputs, lead, N, F, r):
        b = inputs.get("beta")
        return {"beta": np.ones((int(np.prod(lead)), N, F)) if b is None else D.per_feature("beta", b, lead, N, F)}

    def pullback(fk, v, inp, g):
        dA, dB, dK = g["a"][:, :, 0], g["b"][:, :, 0], g["kw"][:, :, 0]
        return dA * inp["beta"] + dK * inp["beta"] - dB, g["vw"][:, :, 0], {"beta": (dA + dK) * fk}

    name = register("optional_beta_test", check=check, pullback=pullback)
    q, k, v, _ = _inputs()
    without = dplr_attention_vjp(q, k, v, v, rule=name, feature_map="l2")
    ones = dplr_attention_vjp(q, k, v, v, rule=name, feature_map="l2", beta=np.ones((2, 16, F)))
    assert "beta" not in without.d_inputs and ones.d_inputs["beta"].shape == (2, 16, F)
    for a, b in ((without.dq, ones.dq), (without.dk, ones.dk), (without.dv, ones.dv)):
        np.testing.assert_array_equal(a, b)


def _pullback(fk, v, inp, g):
    dA, dB, dK = g["a"][:, :, 0], g["b"][:, :, 0], g["kw"][:, :, 0]
    return dA * inp["beta"] + dK * inp["beta"] - dB, g["vw"][:, :, 0], {"beta": (dA + dK) * fk}


@pytest.mark.parametrize("bad, match", [
    (lambda out: out[:2], r"must return \(dfk, dv, dinputs\), got tuple of length 2"),
    (lambda out: (out[0][..., 0], out[1], out[2]), r"dfk has shape \(2, 16\), expected \(2, 16, 8\)"),
    (lambda out: (out[0], out[1][:, :1], out[2]), r"dv has shape \(2, 1, 8\), expected \(2, 16, 8\)"),
    (lambda out: (out[0], out[1], []), r"dinputs must be a dict by argument name, got list"),
    (lambda out: (out[0], out[1], {"gamma": out[2]["beta"]}), r"dinputs names \['gamma'\]"),
    (lambda out: (out[0], out[1], {}), r"dinputs has no gradient for 'beta', which the call passed"),
    (lambda out: (out[0], out[1], {"beta": out[2]["beta"][:, :3]}),
     r"dinputs\['beta'\] has shape \(2, 3, 8\), expected \(2, 16, 8\)"),
])
def test_a_pullback_that_returns_the_wrong_thing_is_named(register, bad, match):
    """A researcher's pullback is checked as their check and build are: what is wrong, naming the rule (it
    gave NumPy's unpacking or reshape errors, and an empty dinputs returned no gradient for beta)."""
    name = register("user_badpullback", pullback=lambda fk, v, inp, g: bad(_pullback(fk, v, inp, g)))
    q, k, v, beta = _inputs()
    with pytest.raises(ValueError, match=r"rule 'user_badpullback': pullback\(fk, v, inputs, g\).*" + match):
        la.dplr_attention_vjp(q, k, v, np.ones_like(v), rule=name, beta=beta, feature_map="l2")
    rules.DPLR_RULES[name] = rules.DPLR_RULES[name].__class__(
        **{**{f: getattr(rules.DPLR_RULES[name], f) for f in rules.DPLR_RULES[name].__dataclass_fields__},
           "pullback": _pullback})
    assert la.dplr_attention_vjp(q, k, v, np.ones_like(v), rule=name, beta=beta, feature_map="l2").dq.shape == q.shape


def test_registration_refuses_bad_names_and_arguments_and_the_linear_rules_names(register):
    """A name that is not a non-empty string, arguments that are not a tuple of names or that take one of
    dplr_attention's own keywords, and a linear rule's name even with overwrite=True (it took over the torch
    layer's rule='delta'): refused, naming what is wrong.  Overwriting a DPLR rule stays allowed."""
    import dataclasses

    base = D.DPLRRule(name="x", arguments=("beta",), substeps=False, formula="", check=_check, build=_good,
                      step=lambda H, k, v1, inp: H, sample=None, pullback=None)
    for kw, err, match in (({"name": None}, TypeError, "rule.name must be a string, got NoneType"),
                           ({"name": 3}, TypeError, "rule.name must be a string, got int"),
                           ({"name": ""}, ValueError, "rule.name must not be empty"),
                           ({"arguments": "beta"}, TypeError, "arguments must be a tuple of non-empty strings"),
                           ({"arguments": ("beta", "eps")}, ValueError, r"argument\(s\) \['eps'\] are keywords"),
                           ({"name": "delta"}, ValueError, "'delta' is a name of the built-in rules"),
                           ({"name": "dplr"}, ValueError, "'dplr' is a name of the built-in rules")):
        with pytest.raises(err, match=match):
            rules.register_dplr(dataclasses.replace(base, **kw), overwrite=True)
    assert "delta" not in rules.DPLR_RULES and "x" not in rules.DPLR_RULES
    name = register("user_twice")
    with pytest.raises(ValueError, match="already registered"):
        rules.register_dplr(dataclasses.replace(base, name=name))
    rules.register_dplr(dataclasses.replace(base, name=name), overwrite=True)  # a DPLR rule: replaced
    from linattn_nb import dplr

    import inspect
    taken = {p for f in (dplr.dplr_attention, dplr.dplr_attention_vjp) for p in inspect.signature(f).parameters}
    assert taken - {"beta", "rule_arguments"} <= rules.RESERVED_ARGUMENTS


@pytest.mark.parametrize("field", ["check", "build", "step", "sample", "pullback", "keyed"])
def test_registration_refuses_fields_that_are_not_callables(field):
    """A rule with build=None (or check=None) registered, and its first call failed with "'NoneType' object is
    not callable": now a TypeError at registration naming the rule and the field.  step, sample, pullback and
    keyed may be None (docs/dplr.md); check and build run at every call."""
    import dataclasses

    base = D.DPLRRule(name="user_fields", arguments=("beta",), substeps=False, formula="", check=_check,
                      build=_good, step=lambda H, k, v1, inp: H, sample=None, pullback=None)
    with pytest.raises(TypeError, match=rf"rule 'user_fields': {field} must be a callable.*, got int"):
        rules.register_dplr(dataclasses.replace(base, **{field: 3}))
    optional = field in ("step", "sample", "pullback", "keyed")
    try:
        if optional:
            rules.register_dplr(dataclasses.replace(base, **{field: None}))
        else:
            with pytest.raises(TypeError, match=rf"rule 'user_fields': {field} must be a callable, got NoneType"):
                rules.register_dplr(dataclasses.replace(base, **{field: None}))
        assert ("user_fields" in rules.DPLR_RULES) == optional
    finally:
        rules.DPLR_RULES.pop("user_fields", None)


def test_a_saved_state_of_ones_own_rule_loads(register, tmp_path):
    """DPLRState.save of a rule registered after import wrote a file that load refused (the file format's list
    of rules was made at import); it now loads with the same state, and an unregistered rule is named."""
    from linattn_nb.state.dplr import DPLRState

    name = register("user_saved")
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 4, F))
    st = DPLRState(F, F, rule=name, feature_map="l2")
    st.prefill(k, v, beta=rng.uniform(0, 1, (4, F)))
    st.save(tmp_path / "s.npz")
    back = DPLRState.load(tmp_path / "s.npz")
    assert back.rule == name and np.array_equal(back.S, st.S) and np.array_equal(back.z, st.z)
    rules.DPLR_RULES.pop(name)
    with pytest.raises(ValueError, match=r"must be a registered rule, .* got 'user_saved' \(a rule of your own"):
        DPLRState.load(tmp_path / "s.npz")


def _check_token(inputs, lead, N, F, r):
    return {"beta": D.per_token("beta", inputs["beta"], lead, N)}


def _delta_build(fk, v, i):
    bk = i["beta"][..., None] * fk
    return D.GeneralForm(np.zeros(fk.shape[:2] + (0,)), fk[:, :, None], -bk[:, :, None], bk[:, :, None],
                         v[:, :, None])


def _delta_keyed(steps):
    def keyed(fk, v, i):
        bt = np.repeat(i["beta"][:, :, None], steps, axis=2)
        return D.KeyedForm(np.zeros(fk.shape[:2] + (0,)), -bt, bt, np.repeat(v[:, :, None], steps, axis=2))
    return keyed


@pytest.mark.parametrize("steps", [1, 2])
def test_a_keyed_form_has_one_step_per_key(steps):
    """The chunked kernel reads one ``cb``, ``cw``, ``vw`` per key (one without sub-steps): a keyed form with
    another count is refused naming ``cb`` (it ran, with a step ignored or read past the form); one of the
    keys' count agrees with the scan, which runs the build."""
    name = f"user_keyed_{steps}"
    rules.register_dplr(D.DPLRRule(name=name, arguments=("beta",), substeps=False, formula="", check=_check_token,
                                   build=_delta_build, step=None, sample=None, pullback=None,
                                   keyed=_delta_keyed(steps)))
    try:
        q, k, v, _ = _inputs()
        beta = np.random.default_rng(1).uniform(0, 1, (2, 16))
        kw = dict(rule=name, beta=beta, feature_map="l2")
        if steps == 1:
            np.testing.assert_allclose(la.dplr_attention(q, k, v, method="chunked", **kw),
                                       la.dplr_attention(q, k, v, method="scan", **kw), rtol=1e-10, atol=1e-12)
        else:
            with pytest.raises(ValueError, match=rf"rule {name!r}: keyed: cb must have shape \(2, 16, 1\)"):
                la.dplr_attention(q, k, v, method="chunked", **kw)
    finally:
        rules.DPLR_RULES.pop(name, None)
