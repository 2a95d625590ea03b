"""One convention across the public API.

* every result class converts with ``to_dict()`` to JSON-ready plain values;
  ``ApproximationError.as_dict()`` is kept as a deprecated alias;
* the package namespaces list no ``annotations`` (the ``__future__`` import);
* no public signature shows ``<object object at 0x...>``;
* a random map given by name warns once per process; ``num_features`` is the
  effective ``m``.
"""
import inspect
import json
import warnings

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import analysis, feature_maps as fm, studies


def _qkv(n=8, d=4):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((1, n, d)) for _ in range(3))


def _results():
    q, k, v = _qkv()
    x = np.array([0.3, -0.2, 0.1])
    return {
        "ApproximationError": analysis.approximation_error(q, k, v, "elu"),
        "RecallCapacity": analysis.recall_capacity("elu", 4, [2, 4], trials=1, seed=0),
        "KernelEstimate": analysis.kernel_estimate_mse(fm.get("favor+", num_features=4, seed=0), x, x, draws=3),
        "StateRankProfile": analysis.state_rank_profile(k[0], v[0], "elu"),
        "MQAR": analysis.mqar(2, 16, 2, vocab_size=64, seed=0),
    }


def _plain(x) -> bool:
    if isinstance(x, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in x.items())
    if isinstance(x, list):
        return all(_plain(v) for v in x)
    return x is None or type(x) in (bool, int, float, str)


def test_every_result_class_has_to_dict_with_plain_values():
    for name, res in _results().items():
        d = res.to_dict()
        assert isinstance(d, dict) and d, name
        assert _plain(d), name   # no arrays, no NumPy scalars
        json.dumps(d)            # goes to JSON as it is


def test_as_dict_is_a_deprecated_alias():
    q, k, v = _qkv()
    res = analysis.approximation_error(q, k, v, "elu")
    with pytest.warns(DeprecationWarning, match=r"as_dict\(\) is deprecated; use to_dict\(\)"):
        old = res.as_dict()
    assert old == res.to_dict()
    assert not hasattr(analysis.RecallCapacity, "as_dict")  # one name, no new aliases


@pytest.mark.parametrize("module", [la, la.feature_maps, la.config, la.state, analysis, studies],
                         ids=lambda m: m.__name__)
def test_no_annotations_in_public_namespaces(module):
    assert "annotations" not in dir(module)


def test_public_signatures_are_readable():
    objs = [getattr(la, n) for n in la.__all__] + [v for n, v in vars(analysis).items() if not n.startswith("_")]
    objs += [getattr(fm, n) for n in fm.__all__]
    seen = 0
    for obj in objs:
        if not callable(obj):
            continue
        try:
            sig = str(inspect.signature(obj))
        except (TypeError, ValueError):
            continue
        seen += 1
        assert " at 0x" not in sig, (obj, sig)
    assert seen > 20
    assert "eps=config.DEFAULT_EPS" in str(inspect.signature(analysis.attention_weights))


def test_eps_default_marker_survives_copy_and_pickle():
    import copy
    import pickle

    from linattn_nb.analysis import _common as C

    assert copy.deepcopy(C.DEFAULT) is C.DEFAULT
    assert pickle.loads(pickle.dumps(C.DEFAULT)) is C.DEFAULT


def test_random_map_by_name_warns_once_per_process(monkeypatch):
    monkeypatch.setattr(fm, "_WARNED_BY_NAME", set())
    q, k, v = _qkv()
    with pytest.warns(UserWarning, match=r"feature_map='favor\+' given by name .* unseeded") as rec:
        la.linear_attention(q, k, v, feature_map="favor+")
    # the warning points at this file, not inside the package
    assert any(w.filename == __file__ for w in rec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        la.linear_attention(q, k, v, feature_map="favor+")             # once per process
        la.linear_attention(q, k, v, feature_map=fm.get("favor+", seed=0))  # an object never warns
        la.linear_attention(q, k, v, feature_map="elu")                # deterministic maps never warn
    with pytest.warns(UserWarning, match="feature_map='rff'"):  # once per map name
        la.linear_attention(q, k, v, feature_map="rff")


def test_num_features_is_the_effective_m():
    assert fm.get("favor+", num_features=8).num_features == 8
    d = 64
    assert fm.get("favor+", dim=d).num_features == int(d * np.log(d))
    phi = fm.get("rff", seed=0)
    assert phi.num_features is None  # d not known yet: documented
    phi(np.zeros((3, 5)))
    assert phi.num_features == phi.W.shape[0] == int(5 * np.log(5))
    assert phi.output_dim(5) == 2 * phi.num_features


def test_assigning_config_default_eps_changes_the_calls_that_follow(monkeypatch):
    """The eps defaults were bound at import, so config.DEFAULT_EPS = ... changed nothing although the
    configuration guide says every knob is read at call time; a decode state reads it when built."""
    from linattn_nb import config

    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(3, 6, 4))
    before = la.linear_attention(q, k, v, causal=True)
    st_before = la.LinearAttentionState(4, 4)
    monkeypatch.setattr(config, "DEFAULT_EPS", 1e6)
    np.testing.assert_allclose(la.linear_attention(q, k, v, causal=True),
                               la.linear_attention(q, k, v, causal=True, eps=1e6), rtol=0, atol=0)
    assert not np.allclose(la.linear_attention(q, k, v, causal=True), before)
    assert la.LinearAttentionState(4, 4).eps == 1e6 and st_before.eps == 1e-8
    monkeypatch.setattr(config, "DEFAULT_EPS", float("nan"))
    with pytest.raises(ValueError, match="config.DEFAULT_EPS"):
        la.linear_attention(q, k, v)


@pytest.mark.parametrize("env, expr, want", [
    ({"LINATTN_NO_CACHE": "TRUE"}, "config.CACHE", "False"),
    ({"LINATTN_BLAS_SINGLE_THREAD": "Off"}, "config.CPU_BLAS_SINGLE_THREAD", "False"),
    ({"LINATTN_EPS": "nan"}, "config.DEFAULT_EPS", "LINATTN_EPS='nan' must be a number >= 0"),
    ({"LINATTN_FAVOR_KEY_HEADROOM": "-1"}, "config.FAVOR_KEY_HEADROOM", "must be a number >= 0"),
    ({"LINATTN_REPORT_BACKGROUND": "maybe"}, "config.REPORT_BACKGROUND", "must be one of"),
    ({"LINATTN_CUDA_OFFSETS_32": "7"}, "config.CUDA_OFFSETS_32", "LINATTN_CUDA_OFFSETS_32='7' must be 0 or 1"),
    ({"LINATTN_CUDA_VECTOR_LOADS": "0"}, "config.CUDA_VECTOR_LOADS", "0"),
    ({"LINATTN_CPU_CHUNK_SIZE": "-1"}, "config.CPU_CHUNK_SIZE", "LINATTN_CPU_CHUNK_SIZE='-1' must be an integer >= 0"),
])
def test_environment_variables_are_read_in_any_case_or_refused_by_name(env, expr, want):
    """'TRUE' or 'Off' were silently ignored (exact lower-case matches), a NaN or negative eps or FAVOR+
    headroom was taken as given (a negative headroom zeroed every FAVOR+ output)."""
    import os
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", f"from linattn_nb import config; print({expr})"],
                         capture_output=True, text=True, env=dict(os.environ, **env), timeout=120)
    assert want in res.stdout + res.stderr


@pytest.mark.parametrize("name, value", [("CPU_CHUNK_SIZE", 2.5), ("CPU_CHUNK_SIZE", "32"),
                                         ("CPU_NONCAUSAL_BLOCK", None), ("SOFTMAX_BLOCK_Q", 3.0)])
def test_a_size_knob_assigned_a_non_integer_is_refused_by_name(monkeypatch, name, value):
    """config.CPU_CHUNK_SIZE = 2.5 ran chunks of 2 (int() truncated it), "32" failed in a comparison and
    None in int(); each now raises TypeError naming the knob.  NumPy integers are integers."""
    from linattn_nb import config

    x = np.random.default_rng(0).normal(size=(1, 12, 4))
    monkeypatch.setattr(config, name, value)
    with pytest.raises(TypeError, match=f"config.{name} must be an integer"):
        if name.startswith("SOFTMAX"):
            la.softmax_attention(x, x, x)
        else:
            la.linear_attention(x, x, x, causal=name == "CPU_CHUNK_SIZE",
                                method="chunked" if name == "CPU_CHUNK_SIZE" else "auto")
    monkeypatch.setattr(config, name, np.int64(5))
    assert la.linear_attention(x, x, x, causal=True, method="chunked").shape == (1, 12, 4)


def _knob_call(name):
    x = np.random.default_rng(0).normal(size=(1, 12, 4))
    return {
        "BACKWARD_CHECKPOINT": lambda: la.linear_attention_vjp(x, x, x, x, causal=True, method="scan"),
        "BACKWARD_DELTA_CHUNK": lambda: la.linear_attention_vjp(x, x, x, x, causal=True, method="chunked",
                                                                feature_map="l2", beta=np.full((1, 12), 0.5)),
        "CPU_CHUNKED_SERIAL_MAX_WORK": lambda: la.linear_attention(x, x, x, causal=True, method="chunked"),
        "QUADRATIC_MAX_ELEMENTS": lambda: la.linear_attention(x, x, x, causal=True, method="quadratic"),
        "CPU_CHUNK_SIZE": lambda: la.linear_attention(x, x, x, causal=True, method="chunked"),
        "SOFTMAX_SERIAL_MAX_WORK": lambda: la.softmax_attention(x, x, x),
    }[name]


@pytest.mark.parametrize("value", [2.5, "16", -1])
def test_a_parallel_threshold_is_checked_where_the_kernels_are_picked(monkeypatch, value):
    """Every twin pair's threshold is read by ``pick`` through knob_int (SOFTMAX_SERIAL_MAX_WORK was compared
    raw: "16" failed with Python's comparison error)."""
    from linattn_nb import config

    monkeypatch.setattr(config, "SOFTMAX_SERIAL_MAX_WORK", value)
    with pytest.raises(TypeError if value != -1 else ValueError, match="config.SOFTMAX_SERIAL_MAX_WORK must be"):
        _knob_call("SOFTMAX_SERIAL_MAX_WORK")()


@pytest.mark.parametrize("name", ["BACKWARD_CHECKPOINT", "BACKWARD_DELTA_CHUNK", "CPU_CHUNKED_SERIAL_MAX_WORK",
                                  "QUADRATIC_MAX_ELEMENTS"])
@pytest.mark.parametrize("value", [2.5, "16"])
def test_every_size_knob_read_by_a_call_refuses_a_non_integer_by_name(monkeypatch, name, value):
    """These four knobs were read raw: 2.5 was truncated (or compared as a float) and "16" failed in a comparison
    with Python's message, naming nothing, where the configuration guide promises a TypeError naming the knob."""
    from linattn_nb import config

    monkeypatch.setattr(config, name, value)
    with pytest.raises(TypeError, match=f"config.{name} must be an integer"):
        _knob_call(name)()


@pytest.mark.parametrize("name", ["CPU_CHUNK_SIZE", "BACKWARD_CHECKPOINT"])
def test_a_size_knob_assigned_a_negative_value_is_refused(monkeypatch, name):
    """config.CPU_CHUNK_SIZE = -5 ran the table's chunk size, as if unset, silently; its environment variable
    refuses negatives."""
    from linattn_nb import config

    monkeypatch.setattr(config, name, -5)
    with pytest.raises(ValueError, match=f"config.{name} must be >= 0, got -5"):
        _knob_call(name)()


def test_the_attention_functions_refuse_a_flag_that_is_not_a_bool():
    """``return_state='False'`` returned a state and ``check_finite='False'`` still checked: a truthy string read
    as True.  TypeError naming the flag, as ``causal`` had; NumPy bools are bools."""
    x = np.ones((3, 2))
    for fn, flag in ((la.linear_attention, "return_state"), (la.linear_attention, "check_finite"),
                     (la.softmax_attention, "check_finite")):
        with pytest.raises(TypeError, match=rf"^{flag} must be True or False, got 'False'$"):
            fn(x, x, x, **{flag: "False"})
        fn(x, x, x, **{flag: np.bool_(False)})
    with pytest.raises(TypeError, match=r"^check_finite must be True or False, got 1$"):
        la.linear_attention_vjp(x, x, x, x, causal=True, check_finite=1)


@pytest.mark.parametrize("kw", [dict(decay=10 ** 400), dict(decay=2 ** 64), dict(beta=2 ** 64),
                                dict(log_decay=-(2 ** 64))])
def test_an_integer_beyond_64_bits_is_a_value_error_naming_the_argument(kw):
    """decay=2**64 (NumPy makes an object array of it) was a TypeError "got an object array (ragged or
    non-numeric input?)", while 2**62 is the range's ValueError: a number out of range, not a bad type."""
    x = np.ones((1, 4, 2))
    (name,) = kw
    with pytest.raises(ValueError, match=f"^{name} holds an integer of [0-9]+ bits"):
        la.linear_attention(x, x, x, causal=True, **kw)
    with pytest.raises(TypeError, match="object"):  # non-numeric input stays a TypeError
        la.linear_attention(x, x, x, causal=True, **{name: np.array([0.5, "a"], dtype=object)})
