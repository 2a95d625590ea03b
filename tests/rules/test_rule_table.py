"""The one rule table (ops/_codes.RULES) drives the registry and the launchers' checks."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb.ops import _codes, methods  # noqa: F401  (registers the built-in rules)
from linattn_nb.ops import registry

CPU_CAUSAL = {"quadratic", "scan", "chunked"}
CUDA_CAUSAL = {"scan", "chunked"}


def test_table_entries_are_well_formed():
    codes = [code for code, _ in _codes.RULES.values()]
    assert len(set(codes)) == len(codes), "rule codes must be distinct"
    assert _codes.RULES["additive"] == (_codes.RULE_ADDITIVE, ())
    for name, (code, inputs) in _codes.RULES.items():
        assert isinstance(code, int) and code >= 0
        assert all(isinstance(x, str) and x for x in inputs) and len(set(inputs)) == len(inputs)
        assert _codes.rule_name(code) == name
        assert _codes.check_rule_inputs(code, {x: None for x in inputs}) == code


@pytest.mark.parametrize("name", sorted(_codes.RULES))
def test_every_rule_of_the_table_is_registered(name):
    code, inputs = _codes.RULES[name]
    rule = registry.get_rule(name)
    assert rule.code == code and rule.inputs == tuple(inputs)
    assert CPU_CAUSAL <= set(registry.available_methods(causal=True, device="cpu", rule=name))
    assert CUDA_CAUSAL <= set(registry.available_methods(causal=True, device="cuda", rule=name))
    for dev, names in (("cpu", CPU_CAUSAL), ("cuda", CUDA_CAUSAL)):
        for m in names:
            meth = registry.get_method(m, causal=True, device=dev, rule=name)
            assert meth.rule == name and meth.key == (name, True, m, dev)
            assert meth.inline_features == (m != "quadratic")
    for m in ("scan", "chunked"):  # the CPU launchers are bound to the rule's code
        fwd = registry.get_method(m, causal=True, device="cpu", rule=name).forward
        assert fwd.keywords == {"rule": code}
    assert set(registry.available_rules()) >= set(_codes.RULES)


def test_non_causal_methods_are_the_additive_rules():
    assert registry.available_methods(causal=False, device="cpu") == ["aggregate", "chunked", "quadratic", "scan"]
    assert registry.available_methods(causal=False, device="cuda") == ["aggregate", "chunked", "scan"]


def test_launchers_check_rule_and_inputs_against_the_table():
    rng = np.random.default_rng(0)
    B, N, F, M = 2, 5, 3, 4
    q, k = rng.random((B, N, F)), rng.random((B, N, F))
    v = rng.random((B, N, M))
    for m in sorted(CPU_CAUSAL):
        fwd = registry.get_method(m, causal=True, device="cpu").forward
        H = np.zeros((B, F, M + 1))
        with pytest.raises(ValueError, match=r"inputs: the additive rule takes no extra inputs, got \['decay'\]"):
            fwd(q, k, v, H, np.empty((B, N, M)), code=1, eps=1e-6, inputs={"decay": q})
        out = fwd(q, k, v, H, np.empty((B, N, M)), code=1, eps=1e-6, inputs={})
        assert np.isfinite(out).all()
    with pytest.raises(ValueError, match="rule must be one of the rule codes 0 \\(additive\\)"):
        _codes.check_rule_inputs(max(c for c, _ in _codes.RULES.values()) + 1, None)
    with pytest.raises(ValueError, match="rule must be one of"):
        _codes.check_rule_inputs(True, None)


_NEW_RULE = textwrap.dedent(
    """
    import importlib.util, sys
    import numpy as np
    # ops/_codes.py with one more rule in the table, loaded before the package registers its rules
    spec = importlib.util.spec_from_file_location("linattn_nb.ops._codes", sys.argv[1])
    _codes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(_codes)
    _codes.RULES["toy"] = (7, ("decay",))
    sys.modules["linattn_nb.ops._codes"] = _codes
    from linattn_nb.ops import methods, registry
    assert methods.RULES is _codes.RULES
    r = registry.get_rule("toy")
    assert (r.code, r.inputs) == (7, ("decay",)), r
    for dev, names in (("cpu", ["chunked", "quadratic", "scan"]), ("cuda", ["chunked", "scan"])):
        assert registry.available_methods(causal=True, device=dev, rule="toy") == names, dev
        assert registry.available_methods(causal=False, device=dev, rule="toy") == [], dev
        for name in names:
            fwd = registry.get_method(name, causal=True, device=dev, rule="toy").forward
            try:
                x = np.zeros((1, 2, 2))
                fwd(x, x, x, np.zeros((1, 2, 3)), x.copy(), code=0, eps=None, inputs=None)
            except ValueError as exc:
                assert "inputs: the toy rule takes the inputs ['decay'], got []" in str(exc), (dev, name, exc)
            else:
                raise AssertionError((dev, name, "no error"))
    print("ok")
    """
)


def test_a_rule_added_to_the_table_is_registered_everywhere():
    """Adding an entry to ops/_codes.RULES registers it with every rule-generic causal launcher
    (CPU and CUDA), each bound to the new code: no edit of ops/methods.py."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(la.__file__)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=os.pathsep.join([root] + sys.path))
    proc = subprocess.run([sys.executable, "-c", _NEW_RULE, _codes.__file__], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
