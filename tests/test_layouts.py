"""Every public function reads every array argument by its layout, and ``out=`` never corrupts an input.

Layouts: each array argument of each public function is passed in turn as a
strided view, a reversed view (negative strides), a Fortran-ordered copy, a
read-only array and a zero-stride broadcast view; the result must equal, bit
for bit, the result of the same call on C-contiguous copies of the same
values.  No compiled code may read an array against its layout (a kernel
compiled for C-contiguous arrays and handed a view reads the wrong elements,
or past the end of the buffer).  A read-only argument reaches the kernels as
a writeable view of its memory (``_arrays.kernel_view``): it must keep its
values, compile no kernel again, and no result may be a writeable view of it.

Overlap: ``out=`` laid over each input in turn (offsets 0, +1, -1 and half an
array, in the units of the output's elements) gives what a fresh call gives.

Hypothesis draws the shapes, values and (where a function has several) the
method; the cases below list what is covered, argument by argument.
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import types as nbtypes
from numba.core.dispatcher import Dispatcher

import linattn_nb as la
from linattn_nb import analysis as A

KINDS = ("strided", "reversed", "fortran", "readonly", "broadcast")


# ---------------------------------------------------------------------------
# views of the same values
# ---------------------------------------------------------------------------
def as_view(a: np.ndarray, kind: str):
    """``(view, values)``: a ``kind`` view and a C-contiguous array of the values it holds."""
    a = np.asarray(a)
    if kind == "strided":
        if a.ndim == 0:
            return a.copy(), a.copy()
        big = np.full(tuple(2 * s + 1 for s in a.shape), np.nan, dtype=a.dtype)
        sl = tuple(slice(1, None, 2) for _ in a.shape)
        big[sl] = a
        return big[sl], a.copy()
    if kind == "reversed":
        flipped = np.flip(a).copy()
        return np.flip(flipped), a.copy()
    if kind == "fortran":
        return np.asfortranarray(a), a.copy()
    if kind == "readonly":
        c = a.copy()
        c.flags.writeable = False
        return c, a.copy()
    if kind == "broadcast":
        axes = [i for i, s in enumerate(a.shape) if s > 1]
        if not axes:
            return np.broadcast_to(a, a.shape), a.copy()
        ax = axes[0]
        one = np.take(a, [0], axis=ax)
        view = np.broadcast_to(one, a.shape)
        return view, np.ascontiguousarray(view)
    raise ValueError(kind)


def flat_result(res) -> list:
    """The numbers of a result (arrays, tuples, named tuples, dataclasses, dicts, scalars) as a list of arrays."""
    if res is None:
        return []
    if isinstance(res, (str, bytes)):
        return []
    if dataclasses.is_dataclass(res):
        return [x for f in dataclasses.fields(res) for x in flat_result(getattr(res, f.name))]
    if isinstance(res, dict):
        return [x for key in sorted(res) for x in flat_result(res[key])]
    if isinstance(res, (tuple, list)):
        return [x for item in res for x in flat_result(item)]
    if hasattr(res, "detach"):
        res = res.detach().numpy()
    return [np.asarray(res)]


def assert_same(got, want, what, rtol=0.0):
    """Bit for bit; ``rtol`` > 0 allows that relative difference (float results only)."""
    g, w = flat_result(got), flat_result(want)
    assert len(g) == len(w), what
    for i, (x, y) in enumerate(zip(g, w)):
        assert x.shape == y.shape, f"{what}: part {i} shape {x.shape} != {y.shape}"
        if rtol and x.dtype.kind == "f":
            np.testing.assert_allclose(x, y, rtol=rtol, atol=0.0, err_msg=f"{what}: part {i}")
        else:
            np.testing.assert_array_equal(x, y, err_msg=f"{what}: part {i}")


#: The analysis statistics of approximation_error (KL, TV, entropies) vary by a few units in the last place
#: from run to run on a 2-thread machine, whatever the layout (seen: tv_mean 0.13970256343164705 against ...708,
#: kl_mean 4 ulps apart, for the same contiguous inputs): those cases allow a relative 1e-13; a layout that
#: read the wrong elements would change them far more.
RTOL = {"analysis (attention)": 1e-13}


# ---------------------------------------------------------------------------
# the cases: (name, arrays builder, call) -- call(**arrays) runs the public function
# ---------------------------------------------------------------------------
def _qkv(rng, bs, n, d, m):
    return (rng.standard_normal(bs + (n, d)), rng.standard_normal(bs + (n, d)) * 0.5,
            rng.standard_normal(bs + (n, m)))


def _state(rng, bs, f, m):
    return rng.standard_normal(bs + (f, m)) * 0.1, np.abs(rng.standard_normal(bs + (f,))) + 1.0


RULES = {
    # rule: (extra arrays builder, keyword names)
    "additive": lambda rng, bs, n, f: {},
    "decay": lambda rng, bs, n, f: {"log_decay": -rng.uniform(0.01, 0.5, bs + (n,))},
    "decay_per_seq": lambda rng, bs, n, f: {"decay": rng.uniform(0.5, 1.0, bs)},
    "gate": lambda rng, bs, n, f: {"log_decay": -rng.uniform(0.01, 0.5, bs + (n, f))},
    "delta": lambda rng, bs, n, f: {"beta": rng.uniform(0.1, 1.0, bs + (n,))},
    "gated_delta": lambda rng, bs, n, f: {"beta": rng.uniform(0.1, 1.0, bs + (n,)),
                                          "log_decay": -rng.uniform(0.01, 0.5, bs + (n,))},
}


def _map_for(rule):
    return "l2" if rule in ("delta", "gated_delta") else "elu"


def _draw_rule_method(data):
    """A rule, a sequence method and causality (the rules other than additive are causal; scan is causal only)."""
    rule = data.draw(st.sampled_from(sorted(RULES)), label="rule")
    method = data.draw(st.sampled_from(["scan", "chunked", "quadratic"]), label="method")
    causal = rule != "additive" or data.draw(st.booleans(), label="causal")
    if not causal and method == "scan":
        method = "chunked"
    return rule, method, causal


def case_linear_attention(data, rng):
    rule, method, causal = _draw_rule_method(data)
    bs, n, d, m = (data.draw(st.integers(1, 3), label="B"),), data.draw(st.integers(1, 9), label="N"), 3, 2
    q, k, v = _qkv(rng, bs, n, d, m)
    arrays = dict(q=q, k=k, v=v, **RULES[rule](rng, bs, n, d))
    with_state = causal and data.draw(st.booleans(), label="initial_state")
    if with_state:
        arrays["S0"], arrays["z0"] = _state(rng, bs, d, m)
    fmap = _map_for(rule)

    def call(q, k, v, S0=None, z0=None, **rule_args):
        init = None if S0 is None else la.LinearState(S0, z0, 2, rule.replace("_per_seq", ""))
        return la.linear_attention(q, k, v, causal=causal, method=method, feature_map=fmap, initial_state=init,
                                   return_state=causal, **rule_args)
    return arrays, call


def case_linear_attention_vjp(data, rng):
    rule, method, causal = _draw_rule_method(data)
    bs, n, d, m = (data.draw(st.integers(1, 3), label="B"),), data.draw(st.integers(1, 7), label="N"), 3, 2
    q, k, v = _qkv(rng, bs, n, d, m)
    arrays = dict(q=q, k=k, v=v, grad_out=rng.standard_normal(bs + (n, m)), **RULES[rule](rng, bs, n, d))
    if causal:
        arrays["S0"], arrays["z0"] = _state(rng, bs, d, m)
        arrays["gS"], arrays["gz"] = rng.standard_normal(bs + (d, m)), rng.standard_normal(bs + (d,))
    fmap = _map_for(rule)

    def call(q, k, v, grad_out, S0=None, z0=None, gS=None, gz=None, **rule_args):
        init = None if S0 is None else la.LinearState(S0, z0, 0, rule.replace("_per_seq", ""))
        grad_state = None if gS is None else (gS, gz)
        return la.linear_attention_vjp(q, k, v, grad_out, causal=causal, method=method, feature_map=fmap,
                                       initial_state=init, grad_state=grad_state, **rule_args)
    return arrays, call


def case_softmax_attention(data, rng):
    method = data.draw(st.sampled_from(["blocked", "quadratic"]), label="method")
    causal = data.draw(st.booleans(), label="causal")
    bs, n = (data.draw(st.integers(1, 3), label="B"),), data.draw(st.integers(1, 9), label="N")
    q, k, v = _qkv(rng, bs, n, 3, 2)
    return dict(q=q, k=k, v=v), lambda q, k, v: la.softmax_attention(q, k, v, causal=causal, method=method)


STEP_RULES = ("additive", "decay_per_seq", "decay", "gate", "delta", "gated_delta")


def _state_for(rule, bs, dtype=np.float64):
    name = rule.replace("_per_seq", "")
    return la.LinearAttentionState(3, 2, batch_shape=bs, feature_map=_map_for(rule), dtype=dtype,
                                   rule=None if name == "additive" else name)


def _step_rule_args(rng, rule, bs, t, f, one_token, prefill=False):
    """Rule arguments of a step of T tokens: per sequence (the fast path) where ``one_token``."""
    if rule == "additive":
        return {}
    if rule in ("decay_per_seq",):
        return {"decay": rng.uniform(0.5, 1.0, bs)}
    if one_token:
        if rule == "decay":
            return {"log_decay": -rng.uniform(0.01, 0.5, bs)}
        if rule == "gate":
            return {"log_decay": -rng.uniform(0.01, 0.5, bs + (f,))}
        if rule == "delta":
            return {"beta": rng.uniform(0.1, 1.9, bs)}
        return {"beta": rng.uniform(0.1, 1.9, bs), "decay": rng.uniform(0.5, 1.0, bs)}
    if rule == "decay":  # per token: (*batch, T) for prefill, (*batch, T, 1) for step
        return {"log_decay": -rng.uniform(0.01, 0.5, bs + ((t,) if prefill else (t, 1)))}
    if rule == "gate":
        return {"log_decay": -rng.uniform(0.01, 0.5, bs + (t, f))}
    if rule == "delta":
        return {"beta": rng.uniform(0.1, 1.9, bs + (t,))}
    return {"beta": rng.uniform(0.1, 1.9, bs + (t,)),
            "log_decay": -rng.uniform(0.01, 0.5, bs + ((t,) if prefill else (t, 1)))}


def _prefilled(rule, bs, rng, dtype):
    """A state of ``rule`` after a contiguous prefill of 3 tokens (so the rule is fixed: the fast paths)."""
    stt = _state_for(rule, bs, dtype)
    k, v = rng.standard_normal(bs + (3, 3)), rng.standard_normal(bs + (3, 2))
    stt.prefill(k, v, **_step_rule_args(rng, rule, bs, 3, 3, one_token=False, prefill=True))
    return stt


def case_state_step(data, rng):
    rule = data.draw(st.sampled_from(STEP_RULES), label="rule")
    dtype = data.draw(st.sampled_from([np.float64, np.float32]), label="dtype")
    one = data.draw(st.booleans(), label="one token")
    bs = (data.draw(st.integers(2, 3), label="B"),)
    t = 1 if one else data.draw(st.integers(2, 5), label="T")
    q, k, v = (x.astype(dtype) for x in _qkv(rng, bs, t, 3, 2))
    if one:
        q, k, v = q[..., 0, :], k[..., 0, :], v[..., 0, :]  # (B, D): the decode step's own shape
        q, k, v = q[:, None], k[:, None], v[:, None]
    arrays = dict(q=q, k=k, v=v, **_step_rule_args(rng, rule, bs, t, 3, one))
    seed = int(rng.integers(1 << 30))

    def call(q, k, v, **rule_args):
        stt = _prefilled(rule, bs, np.random.default_rng(seed), dtype)
        out = stt.step(q, k, v, **rule_args)
        return out, stt.to_linear_state()
    return arrays, call


def case_state_prefill(data, rng):
    rule = data.draw(st.sampled_from(STEP_RULES), label="rule")
    bs, t = (data.draw(st.integers(2, 3), label="B"),), data.draw(st.integers(1, 6), label="T")
    k, v = rng.standard_normal(bs + (t, 3)), rng.standard_normal(bs + (t, 2))
    arrays = dict(k=k, v=v, **_step_rule_args(rng, rule, bs, t, 3, one_token=False, prefill=True))

    def call(k, v, **rule_args):
        stt = _state_for(rule, bs)
        stt.prefill(k, v, **rule_args)
        return stt.to_linear_state()
    return arrays, call


def case_state_query(data, rng):
    bs, t = (data.draw(st.integers(2, 3), label="B"),), data.draw(st.integers(1, 6), label="T")
    q = rng.standard_normal(bs + (t, 3))
    seed = int(rng.integers(1 << 30))

    def call(q):
        return _prefilled("additive", bs, np.random.default_rng(seed), np.float64).query(q)
    return dict(q=q), call


def case_kv_cache(data, rng):
    bs, t = (data.draw(st.integers(2, 3), label="B"),), data.draw(st.integers(1, 5), label="T")
    q, k, v = _qkv(rng, bs, t, 3, 2)
    k0, v0 = rng.standard_normal(bs + (2, 3)), rng.standard_normal(bs + (2, 2))

    def call(q, k, v):
        c = la.KVCache(3, 2, batch_shape=bs)
        c.prefill(k0, v0)
        return c.step(q, k, v), c.query(q)
    return dict(q=q, k=k, v=v), call


def case_analysis_attention(data, rng):
    fn = data.draw(st.sampled_from(["approximation_error", "attention_weights", "attention_rank",
                                    "semiseparable_rank"]), label="function")
    rule = data.draw(st.sampled_from(["additive", "decay", "gate", "delta"]), label="rule")
    causal = rule != "additive" or fn == "semiseparable_rank" or data.draw(st.booleans(), label="causal")
    bs, n = (data.draw(st.integers(1, 2), label="B"),), data.draw(st.integers(2, 8), label="N")
    q, k, v = _qkv(rng, bs, n, 3, 2)
    extra = RULES[rule](rng, bs, n, 3)
    fmap = _map_for(rule)
    if fn == "approximation_error":
        return dict(q=q, k=k, v=v, **extra), lambda q, k, v, **r: A.approximation_error(q, k, v, fmap, causal=causal,
                                                                                          **r)
    if fn == "attention_weights":
        return dict(q=q, k=k, **extra), lambda q, k, **r: A.attention_weights(q, k, fmap, causal=causal, **r)
    if fn == "attention_rank":
        return dict(q=q, k=k, **extra), lambda q, k, **r: A.attention_rank(q, k, fmap, causal=causal,
                                                                           return_spectrum=True, **r)
    return dict(q=q, k=k, **extra), lambda q, k, **r: A.semiseparable_rank(q, k, fmap, return_split=True, **r)


def case_analysis_state_rank(data, rng):
    rule = data.draw(st.sampled_from(["additive", "decay", "gate", "delta"]), label="rule")
    bs, n = (data.draw(st.integers(1, 2), label="B"),), data.draw(st.integers(2, 8), label="N")
    k, v = rng.standard_normal(bs + (n, 3)), rng.standard_normal(bs + (n, 2))
    arrays = dict(k=k, v=v, **RULES[rule](rng, bs, n, 3))
    arrays["S0"], arrays["z0"] = _state(rng, bs, 3, 2)
    fmap = _map_for(rule)

    def call(k, v, S0, z0, **r):
        return A.state_rank_profile(k, v, fmap, initial_state=(S0, z0), **r)
    return arrays, call


def case_analysis_spectrum(data, rng):
    fn = data.draw(st.sampled_from(["singular_values", "numerical_rank", "effective_rank", "stable_rank",
                                    "cumulative_spectrum"]), label="function")
    shape = (data.draw(st.integers(1, 2), label="B"), data.draw(st.integers(2, 6), label="rows"),
             data.draw(st.integers(2, 6), label="cols"))
    return dict(A=rng.standard_normal(shape)), lambda A_: getattr(A, fn)(A_)


def case_analysis_kernel(data, rng):
    fn = data.draw(st.sampled_from(["kernel_estimate_mse", "favor_mse", "orthogonal_mse_bound"]), label="function")
    p = data.draw(st.integers(2, 5), label="pairs")
    x, y = rng.standard_normal((p, 3)) * 0.3, rng.standard_normal((p, 3)) * 0.3
    if fn == "kernel_estimate_mse":
        def call(x, y):
            phi = la.feature_maps.get("favor+", num_features=4, seed=3, scale=1.0)
            return A.kernel_estimate_mse(phi, x, y, 3)
        return dict(x=x, y=y), call
    return dict(x=x, y=y), lambda x, y: getattr(A, fn)(x, y, 2)  # num_features <= d for the bound


def case_feature_map(data, rng):
    name = data.draw(st.sampled_from(["elu", "l2", "favor+", "taylor2", "dpfp", "hedgehog", "rff"]), label="map")
    bs, n = (data.draw(st.integers(1, 2), label="B"),), data.draw(st.integers(1, 5), label="N")
    x = rng.standard_normal(bs + (n, 4))

    def call(x):
        kw = {"seed": 1} if name in ("favor+", "rff") else {}
        phi = la.feature_maps.get(name, **kw)
        return phi.apply(x, role="key", causal=True)
    return dict(x=x), call


CASES = {
    "linear_attention": (case_linear_attention, ("q", "k", "v", "decay", "log_decay", "beta", "S0", "z0")),
    "linear_attention_vjp": (case_linear_attention_vjp,
                             ("q", "k", "v", "grad_out", "decay", "log_decay", "beta", "S0", "z0", "gS", "gz")),
    "softmax_attention": (case_softmax_attention, ("q", "k", "v")),
    "LinearAttentionState.step": (case_state_step, ("q", "k", "v", "decay", "log_decay", "beta")),
    "LinearAttentionState.prefill": (case_state_prefill, ("k", "v", "decay", "log_decay", "beta")),
    "LinearAttentionState.query": (case_state_query, ("q",)),
    "KVCache.step/query": (case_kv_cache, ("q", "k", "v")),
    "analysis (attention)": (case_analysis_attention, ("q", "k", "v", "decay", "log_decay", "beta")),
    "analysis.state_rank_profile": (case_analysis_state_rank, ("k", "v", "decay", "log_decay", "beta", "S0", "z0")),
    "analysis (spectra)": (case_analysis_spectrum, ("A",)),
    "analysis (kernel estimates)": (case_analysis_kernel, ("x", "y")),
    "FeatureMap.apply": (case_feature_map, ("x",)),
}


def readonly_specialisations() -> set:
    """``(kernel, signature)`` of every compiled specialisation of the package's module-level Numba kernels
    that takes a read-only array (Numba types it apart from a writeable one: a compilation of its own)."""
    found = set()
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "linattn_nb" or mod_name.startswith("linattn_nb.")):
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, Dispatcher):
                for sig in obj.signatures:
                    if any(isinstance(t, nbtypes.Array) and not t.mutable for t in sig):
                        found.add((f"{mod_name}.{obj.py_func.__name__}", sig))
    return found


def _call(call, arrays):
    if "A" in arrays:
        return call(arrays["A"])
    return call(**arrays)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=4, deadline=None, derandomize=True)
@given(data=st.data())
def test_every_array_argument_read_by_its_layout(case, kind, data):
    """Each array argument in turn as a ``kind`` view: the result of contiguous copies of its values, bit for bit."""
    build, names = CASES[case]
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    arrays, call = build(data, np.random.default_rng(seed))
    present = [nm for nm in names if nm in arrays]
    assert present, case
    name = data.draw(st.sampled_from(present), label="argument")
    view, values = as_view(arrays[name], kind)
    want = _call(call, {**{nm: np.ascontiguousarray(a) for nm, a in arrays.items()}, name: values})
    before = readonly_specialisations() if kind == "readonly" else set()
    got = _call(call, {**{nm: np.ascontiguousarray(a) for nm, a in arrays.items()}, name: view})
    if kind == "readonly":
        # no kernel compiles again for a read-only argument (it would take one more compilation of each)
        assert readonly_specialisations() <= before, f"{case}: {name} read-only compiled " \
            f"{sorted(k for k, _ in readonly_specialisations() - before)} again"
    assert_same(got, want, f"{case}: {name} as a {kind} view", RTOL.get(case, 0.0))
    if kind in ("strided", "reversed", "fortran", "readonly"):
        # nothing the caller passed is modified (a read-only input reaches the kernels as a writeable view of
        # its memory, _arrays.kernel_view: no kernel may write it)
        np.testing.assert_array_equal(view, values)
    if kind == "readonly":
        for i, part in enumerate(flat_result(got)):
            assert not (part.flags.writeable and np.shares_memory(part, view)), \
                f"{case}: part {i} of the result is a writeable view of the read-only {name}"


@pytest.mark.parametrize("kind", ("strided", "reversed", "fortran"))
@pytest.mark.parametrize("method", ("scan", "chunked", "quadratic"))
def test_out_of_any_layout(kind, method):
    """``out=`` as a strided, reversed or Fortran view receives the result; a read-only ``out`` is refused."""
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, (2,), 6, 3, 2)
    want = la.linear_attention(q, k, v, causal=True, method=method)
    out, _ = as_view(np.zeros_like(want), kind)
    res = la.linear_attention(q, k, v, causal=True, method=method, out=out)
    assert res is out
    np.testing.assert_array_equal(out, want)
    ro = np.zeros_like(want)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out"):
        la.linear_attention(q, k, v, causal=True, method=method, out=ro)
    with pytest.raises(ValueError, match="out"):
        la.linear_attention(q, k, v, causal=True, method=method, out=np.broadcast_to(want[:1], want.shape))


# ---------------------------------------------------------------------------
# out= over the inputs
# ---------------------------------------------------------------------------
OVERLAP_INPUTS = ("q", "k", "v", "log_decay", "gate", "beta", "S0", "z0", "W")


@pytest.mark.parametrize("method", ("scan", "chunked", "quadratic"))
@pytest.mark.parametrize("target", OVERLAP_INPUTS)
def test_out_over_each_input(target, method):
    """``out`` laid over each input in turn (offsets 0, +1, -1, half an array) gives a fresh call's result."""
    b, n, d, m = 2, 16, 1, 1  # out (B, N, M) has as many elements as q, k, v (B, N, D)
    rng = np.random.default_rng(7)
    rule_of = {"log_decay": "decay", "gate": "gate", "beta": "delta"}
    rule = rule_of.get(target, "decay")
    fmap = "l2" if rule == "delta" else "elu"
    if target == "W":
        fmap = la.feature_maps.get("favor+", num_features=4, seed=0)
        d = 2
    size = b * n * m
    for offset in (0, 1, -1, size // 2):
        base = {"q": rng.standard_normal((b, n, d)), "k": rng.standard_normal((b, n, d)),
                "v": rng.standard_normal((b, n, m))}
        if rule == "decay":
            base["log_decay"] = -rng.uniform(0.01, 0.3, (b, n))
        elif rule == "gate":
            base["gate"] = -rng.uniform(0.01, 0.3, (b, n, 1))
        else:
            base["beta"] = rng.uniform(0.1, 1.0, (b, n))
        base["S0"], base["z0"] = rng.standard_normal((b, 1, m)), np.abs(rng.standard_normal((b, 1))) + 1
        if target == "W":
            fmap.apply(base["k"], role="key")  # draws the map's projection
            base["S0"] = rng.standard_normal((b, fmap.output_dim(d), m))
            base["z0"] = np.abs(rng.standard_normal((b, fmap.output_dim(d)))) + 1

        def run(arrs, out=None):
            init = la.LinearState(arrs["S0"], arrs["z0"], 0, rule)
            rule_args = {"log_decay": arrs["log_decay"]} if "log_decay" in arrs else (
                {"log_decay": arrs["gate"]} if "gate" in arrs else {"beta": arrs["beta"]})
            return la.linear_attention(arrs["q"], arrs["k"], arrs["v"], causal=True, method=method,
                                       feature_map=fmap, initial_state=init, out=out, return_state=True,
                                       **rule_args)

        want_out, want_state = run({nm: a.copy() for nm, a in base.items()})
        arrs = dict(base)
        src = fmap.W if target == "W" else base[target]
        room = max(src.size, size)
        buf = np.zeros(3 * room)
        lo = room  # the input in the middle; out starts ``offset`` elements from it
        buf[lo: lo + src.size] = src.reshape(-1)
        placed = buf[lo: lo + src.size].reshape(src.shape)
        if target == "W":
            fmap.W = placed
        else:
            arrs[target] = placed
        out = buf[lo + offset: lo + offset + size].reshape(b, n, m)
        got_out, got_state = run(arrs, out=out)
        assert got_out is out
        what = f"out over {target} at offset {offset} ({method})"
        np.testing.assert_allclose(got_out, want_out, rtol=1e-12, atol=1e-12, err_msg=what)
        np.testing.assert_allclose(got_state.S, want_state.S, rtol=1e-12, atol=1e-12, err_msg=what)
        if target == "W":
            fmap.W = src


def test_state_step_out_over_inputs_and_strided_factors():
    """The decode loop (prefill, then ``step(..., beta=b[:, t])`` per token) equals linear_attention."""
    rng = np.random.default_rng(0)
    B, N = 3, 8
    q, k, v = rng.standard_normal((3, B, N, 4))
    for rule, key in (("delta", "beta"), ("gated_delta", "beta"), ("decay", "log_decay"), ("decay", "decay")):
        for dtype in (np.float64, np.float32):
            b = rng.uniform(0.1, 1.5, (B, N)) if key == "beta" else (
                -rng.uniform(0.01, 0.5, (B, N)) if key == "log_decay" else rng.uniform(0.5, 1.0, (B, N)))
            extra = {"log_decay": -0.1 * np.ones((B, N))} if rule == "gated_delta" else {}
            fmap = "l2" if rule != "decay" else "elu"
            want = la.linear_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), causal=True,
                                       feature_map=fmap, method="quadratic", **{key: b}, **extra)
            stt = la.LinearAttentionState(4, 4, batch_shape=(B,), feature_map=fmap, rule=rule, dtype=dtype)
            stt.prefill(k[:, :2].astype(dtype), v[:, :2].astype(dtype), **{key: b[:, :2]},
                        **{nm: x[:, :2] for nm, x in extra.items()})
            outs = [stt.step(q[:, t:t + 1].astype(dtype), k[:, t:t + 1].astype(dtype),
                             v[:, t:t + 1].astype(dtype), **{key: b[:, t]},  # a strided column
                             **{nm: x[:, t] for nm, x in extra.items()}) for t in range(2, N)]
            got = np.concatenate(outs, axis=1)
            tol = 1e-12 if dtype == np.float64 else 2e-5
            np.testing.assert_allclose(got, want[:, 2:], rtol=tol, atol=tol, err_msg=f"{rule} {key} {dtype}")
            # reversed views of the factors: the same as their copies
            s1 = stt.copy()
            s2 = stt.copy()
            col = b[::-1, 0]
            o1 = s1.step(q[:, :1].astype(dtype), k[:, :1].astype(dtype), v[:, :1].astype(dtype),
                         **{key: col}, **{nm: x[::-1, 0] for nm, x in extra.items()})
            o2 = s2.step(q[:, :1].astype(dtype), k[:, :1].astype(dtype), v[:, :1].astype(dtype),
                         **{key: col.copy()}, **{nm: x[::-1, 0].copy() for nm, x in extra.items()})
            np.testing.assert_array_equal(o1, o2)


def test_vjp_leaves_its_inputs_and_returns_fresh_arrays():
    """linear_attention_vjp has no ``out=``: it modifies nothing passed and returns no view of an input."""
    rng = np.random.default_rng(3)
    q, k, v, g = rng.standard_normal((4, 2, 6, 3))
    lg = -rng.uniform(0.01, 0.3, (2, 6))
    S0, z0 = rng.standard_normal((2, 3, 3)), np.abs(rng.standard_normal((2, 3))) + 1
    gS, gz = rng.standard_normal((2, 3, 3)), rng.standard_normal((2, 3))
    inputs = [q, k, v, g, lg, S0, z0, gS, gz]
    copies = [x.copy() for x in inputs]
    res = la.linear_attention_vjp(q, k, v, g, causal=True, log_decay=lg, initial_state=la.LinearState(S0, z0, 0,
                                                                                                        "decay"),
                                  grad_state=(gS, gz))
    for x, c in zip(inputs, copies):
        np.testing.assert_array_equal(x, c)
    for r in flat_result(res):
        assert not any(np.may_share_memory(r, x) for x in inputs)


def test_overlap_helper():
    from linattn_nb._overlap import call_reads, may_overlap, out_overlaps

    buf = np.zeros(20)
    assert may_overlap(buf[:10], buf[9:])
    assert not may_overlap(buf[:10], buf[10:])
    assert may_overlap(buf[::2], buf[1::2])  # conservative, as numpy.may_share_memory
    assert not may_overlap(buf, 3.0) and not may_overlap(None, buf)
    assert out_overlaps(buf[:4], call_reads(np.ones(3), buf[3:6]))
    S, z = np.zeros((2, 2)), np.zeros(2)
    assert out_overlaps(z, call_reads(initial_state=la.LinearState(S, z)))
    assert not out_overlaps(None, call_reads(buf))


# ---------------------------------------------------------------------------
# the torch adapter: non-contiguous tensors
# ---------------------------------------------------------------------------
TORCH_KINDS = ("strided", "transposed", "expanded")


def _torch_view(t, kind):
    """``(view, values)`` of a torch tensor: a strided, transposed-storage or expanded (zero-stride) view."""
    import torch

    if kind == "strided":
        big = torch.zeros(tuple(2 * s for s in t.shape), dtype=t.dtype)
        sl = tuple(slice(None, None, 2) for _ in t.shape)
        big[sl] = t
        return big[sl], t.clone()
    if kind == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2), t.clone()
    view = t[:1].expand(t.shape)
    return view, view.contiguous()


@pytest.mark.parametrize("kind", TORCH_KINDS)
@pytest.mark.parametrize("rule", ("additive", "decay", "gate", "delta"))
@settings(max_examples=4, deadline=None, derandomize=True)
@given(data=st.data())
def test_torch_adapter_non_contiguous(rule, kind, data):
    """Each tensor argument as a non-contiguous view: forward and gradients equal those of contiguous copies."""
    torch = pytest.importorskip("torch")
    from linattn_nb import torch as lt

    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    rng = np.random.default_rng(seed)
    b, n = data.draw(st.integers(2, 3), label="B"), data.draw(st.integers(1, 6), label="N")
    method = data.draw(st.sampled_from(["scan", "chunked", "quadratic"]), label="method")
    q, k, v = _qkv(rng, (b,), n, 3, 2)
    arrays = {"q": q, "k": k, "v": v, **RULES[rule](rng, (b,), n, 3)}
    name = data.draw(st.sampled_from(sorted(arrays)), label="argument")

    def run(tensors):
        ts = {nm: t.detach().requires_grad_(True) if nm == name else t for nm, t in tensors.items()}
        leaves = {nm: t for nm, t in ts.items() if t.requires_grad}
        extra = {nm: ts[nm] for nm in ("log_decay", "beta", "decay") if nm in ts}
        out = lt.linear_attention(ts["q"], ts["k"], ts["v"], causal=True, method=method,
                                  feature_map=_map_for(rule), **extra)
        out.square().sum().backward()
        return out.detach().numpy(), {nm: t.grad.numpy() for nm, t in leaves.items()}

    base = {nm: torch.from_numpy(a.copy()) for nm, a in arrays.items()}
    view, values = _torch_view(base[name], kind)
    want = run({**base, name: values})
    # the view's own gradient: a leaf made from the view keeps its strides
    got = run({**base, name: view})
    assert_same(got, want, f"torch adapter ({rule}, {method}): {name} as a {kind} tensor")


# ---------------------------------------------------------------------------
# GPU arrays (the CUDA simulator): out= over a device input
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("target", ("q", "log_decay"))
def test_device_out_over_a_device_input(target):
    from linattn_nb.device import cuda_status

    if cuda_status() != "simulator":
        pytest.skip("runs device arrays of the CUDA simulator")
    from numba import cuda

    b, n = 1, 48  # longer than a tile of tokens: out written while later tokens are still to be read
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((3, b, n, 1))
    lg = -rng.uniform(0.01, 0.3, (b, n))
    want = la.linear_attention(q, k, v, causal=True, log_decay=lg, method="scan")
    for offset in (0, 1, -1, 24):
        src = q if target == "q" else lg
        buf = np.zeros(3 * src.size)
        lo = src.size
        buf[lo: lo + src.size] = src.reshape(-1)
        dbuf = cuda.to_device(buf)
        placed = dbuf[lo: lo + src.size].reshape(src.shape)
        out = dbuf[lo + offset: lo + offset + b * n].reshape(b, n, 1)
        args = {"q": cuda.to_device(q), "k": cuda.to_device(k), "v": cuda.to_device(v),
                "log_decay": cuda.to_device(lg)}
        args[target] = placed
        res = la.linear_attention(args["q"], args["k"], args["v"], causal=True, log_decay=args["log_decay"],
                                  method="scan", device="cuda", out=out)
        np.testing.assert_allclose(res.copy_to_host(), want, rtol=1e-12, atol=1e-12,
                                   err_msg=f"device out over {target} at {offset}")
