"""The update-rule registry: each rule's record, and its reference recurrence against every causal method."""
import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import rules
from linattn_nb.ops._codes import RULES as KERNEL_RULES
from linattn_nb.ops.registry import get_rule as kernel_rule

NAMES = rules.rule_names()


def test_every_kernel_rule_has_one_rule_module():
    assert set(NAMES) == set(KERNEL_RULES)
    for name in NAMES:
        r = rules.get_rule(name)
        assert r.name == name
        assert r.code == KERNEL_RULES[name][0]
        assert kernel_rule(name).code == r.code


def test_arguments_select_exactly_one_rule():
    for r in rules.RULES.values():
        assert rules.rule_for(factor=r.factor, beta=r.beta) is r


def test_unknown_rule_and_bad_combinations_raise_naming_them():
    with pytest.raises(ValueError, match="unknown rule 'nope'.*'additive'"):
        rules.get_rule("nope")
    with pytest.raises(TypeError, match="rule must be a string"):
        rules.get_rule(3)
    with pytest.raises(ValueError, match="per-feature gate.*with beta"):
        rules.rule_for(factor="feature", beta=True)
    with pytest.raises(ValueError, match="already registered"):
        rules.register(rules.get_rule("delta"))
    with pytest.raises(TypeError, match="UpdateRule"):
        rules.register("delta")


def test_a_rule_outside_the_kernel_table_is_refused():
    import dataclasses
    r = dataclasses.replace(rules.get_rule("decay"), name="my_decay")
    with pytest.raises(ValueError, match="not in the kernels' rule table"):
        rules.register(r)


CASES = [(m, n, "cpu") for m in ("quadratic", "scan", "chunked") for n in (1, 7, 70)]
CASES += [(m, 7, "cuda") for m in ("scan", "chunked")]  # the CUDA kernels (the simulator without a GPU), tiny


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("method,n,device", CASES)
def test_reference_recurrence_equals_every_causal_method(name, method, n, device):
    """Each rule's own float64 recurrence is the definition the kernels compute, resets included."""
    rule = rules.get_rule(name)
    rng = np.random.default_rng(n)
    b, d, m = 2, 5, 3
    q, k, v = (rng.standard_normal((b, n, x)) for x in (d, d, m))
    kw = rule.sample(rng, b, n, d)
    fmap = la.feature_maps.get(rule.study_map)
    out, st = la.linear_attention(q, k, v, feature_map=fmap, causal=True, method=method, return_state=True,
                                  eps=None, device=device, **kw)
    assert st.rule == name
    fq, fk = fmap(q), fmap(k)
    inputs = {}
    if "decay" in kw:
        with np.errstate(divide="ignore"):
            lg = np.log(kw["decay"])
        inputs[next(x for x in rule.kernel_inputs if x != "beta")] = lg
    if "beta" in kw:
        inputs["beta"] = kw["beta"]
    ref, H = rules.reference(rule, fq, fk, v, inputs=inputs or None)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st.S, H[:, :, :m], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st.z, H[:, :, m], rtol=1e-12, atol=1e-12)


def test_reference_normalize_flag_and_initial_state():
    rule = rules.get_rule("decay")
    rng = np.random.default_rng(0)
    fq, fk = (np.abs(rng.standard_normal((1, 4, 3))) for _ in range(2))
    v = rng.standard_normal((1, 4, 2))
    H0 = np.abs(rng.standard_normal((1, 3, 3)))
    inputs = {"log_decay": np.log(np.full((1, 4), 0.5))}
    num, H = rules.reference(rule, fq, fk, v, inputs=inputs, H0=H0, normalize=False)
    out, H2 = rules.reference(rule, fq, fk, v, inputs=inputs, H0=H0)
    np.testing.assert_array_equal(H, H2)
    assert not np.allclose(num, out)  # the flag matters
    got = la.linear_attention(fq, fk, v, feature_map=None, causal=True,
                              method="scan", decay=np.full((1, 4), 0.5), initial_state=(H0[:, :, :2], H0[:, :, 2]),
                              normalize=False)
    np.testing.assert_allclose(got, num, rtol=1e-12, atol=1e-12)


def test_reference_takes_a_rule_name_as_get_rule_does():
    """rules.reference('delta', ...) failed with "'str' object has no attribute 'normalize'"."""
    fq = fk = np.ones((1, 2, 3))
    v = np.ones((1, 2, 2))
    by_name = rules.reference("delta", fq, fk, v, inputs={"beta": np.ones((1, 2))})
    by_rule = rules.reference(rules.get_rule("delta"), fq, fk, v, inputs={"beta": np.ones((1, 2))})
    for a, b in zip(by_name, by_rule):
        np.testing.assert_array_equal(a, b)


def test_dplr_range_errors_print_plain_numbers():
    q = np.random.default_rng(0).normal(size=(2, 4, 3))
    with pytest.raises(ValueError, match=r"got 2\.5 \(8 value"):
        la.dplr_attention(q, q, q, rule="kda", log_decay=np.zeros((2, 4, 3)), beta=np.full((2, 4), 2.5),
                          feature_map="l2")
