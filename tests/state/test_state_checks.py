"""LinearAttentionState through the shared front end and the method table.

* every shape a feature map returns is checked (step, query, prefill; CPU and
  CUDA with host inputs) before a kernel sees it;
* positions are validated and named;
* a state file's feature-map probe is always checked;
* the decode-step launchers are method-table entries, looked up once;
* the NumPy-side maps (favor+, rff, cosformer, hedgehog, t2r, taylor2) decode as
  ``linear_attention(causal=True)`` computes with the same map instance.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import config
from linattn_nb import feature_maps as fm
from linattn_nb.device import cuda_status
from linattn_nb.ops import registry
from linattn_nb.ops.step import launchers
from linattn_nb.state import LinearAttentionState, StateFileError
from linattn_nb.state import linear as state_linear
from _state_files import rewrite_state_file

HAVE_CUDA = cuda_status() != "none"
# the CUDA cases run on the simulator without a GPU (seconds each): the full suite's, not the fast tier's
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA and no simulator"),
                                              pytest.mark.slow])]
TOL = {np.float64: 1e-11, np.float32: 3e-5}


@pytest.fixture(autouse=True)
def few_simulator_threads(monkeypatch):
    """On the simulator (each CUDA thread a Python thread), launch the decode-step kernels with 3 threads
    per block instead of 128 and the helper kernels (the zero fills) with 2 blocks of 8: the results do not
    depend on it (every kernel loops over its rows and columns by the block or grid size: with 3 threads the
    step and query kernels' loops over features and the M = 4 value columns take several turns, and the
    prefill grid has two blocks of columns, the second partial), and the CUDA cases cost a fifth.  A GPU
    keeps the default launch configuration."""
    if cuda_status() == "simulator":
        monkeypatch.setattr(config, "CUDA_STEP_THREADS", 3)
        monkeypatch.setattr(config, "CUDA_THREADS_PER_BLOCK", 8)
        monkeypatch.setattr(config, "CUDA_MAX_HELPER_BLOCKS", 2)


def assert_close(actual, expected, dtype=np.float64):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.max(np.abs(expected))), 1.0) if expected.size else 1.0
    err = float(np.max(np.abs(actual - expected))) if expected.size else 0.0
    assert err <= TOL[np.dtype(dtype).type] * scale, f"max abs error {err:.3e} (scale {scale:.3e})"


def host(x):
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


def qkv(rng, batch, n, d, m, dtype=np.float64):
    return (rng.standard_normal(batch + (n, d)).astype(dtype), rng.standard_normal(batch + (n, d)).astype(dtype),
            rng.standard_normal(batch + (n, m)).astype(dtype))


rewrite = rewrite_state_file  # copy a state file, replacing (or with None: dropping) entries


# ---------------------------------------------------------------------------
# Feature maps that return the wrong shape
# ---------------------------------------------------------------------------
class BadShape(fm.FeatureMap):
    """ELU-like features, then the shape damaged as ``how`` says."""

    name = "bad_shape_test"
    is_positive = True

    def __init__(self, how="ok"):
        self.how = how

    def transform(self, x):
        return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0))).astype(x.dtype)

    def apply(self, x, *, role, causal, offset=0, total_length=None):
        f = self(x)
        if self.how == "row+":
            return np.concatenate([f, f[..., :1, :]], axis=-2)
        if self.how == "row-":
            return f[..., 1:, :]
        if self.how == "batch-":
            return f[1:]
        if self.how == "batch+":
            return np.concatenate([f, f[:1]], axis=0)
        if self.how == "feat":
            return f[..., :-1]
        return f


def _damaged(shape, how):
    b, n, d = shape
    return {"row+": (b, n + 1, d), "row-": (b, n - 1, d), "batch-": (b - 1, n, d), "batch+": (b + 1, n, d),
            "feat": (b, n, d - 1)}[how]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["row+", "row-", "batch-", "batch+", "feat"])
def test_wrong_feature_shapes_raise_before_any_kernel(how, device):
    """step (1 and 3 tokens), query and prefill refuse a map's wrong shape, naming the map and
    both shapes; the state is untouched."""
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, (2,), 3, 4, 2)
    st = LinearAttentionState(4, 2, batch_shape=(2,), feature_map=BadShape(how), device=device)

    def expect(name, x):
        msg = (rf"feature map 'bad_shape_test' returned features of shape {re.escape(str(_damaged(x.shape, how)))}"
               rf" for {name} of shape {re.escape(str(x.shape))}")
        return pytest.raises(ValueError, match=msg)

    with expect("q", q):
        st.step(q, k, v)
    with expect("q", q[:, :1]):
        st.step(q[:, :1], k[:, :1], v[:, :1])
    with expect("q", q):
        st.query(q)
    with expect("k", k):
        st.prefill(k, v)
    assert st.position == 0 and not host(st.S).any() and not host(st.z).any()
    good = LinearAttentionState(4, 2, batch_shape=(2,), feature_map=BadShape("ok"), device=device)
    assert_close(good.step(q, k, v), la.linear_attention(q, k, v, causal=True, feature_map=BadShape("ok")))


@pytest.mark.parametrize("dim", [0, -3, 2.5, None])
def test_feature_maps_with_a_bad_output_dim_are_refused(dim):
    class BadDim(BadShape):
        def output_dim(self, d):
            return dim

    with pytest.raises(ValueError, match=r"feature map 'bad_shape_test' has output_dim\(4\)"):
        LinearAttentionState(4, 2, feature_map=BadDim())


# ---------------------------------------------------------------------------
# Positions
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad,exc", [(None, TypeError), ("3", TypeError), (True, TypeError), ([3], TypeError),
                                     (np.nan, ValueError), (2.5, ValueError), (-1, ValueError),
                                     (np.inf, ValueError)])
def test_from_linear_state_validates_the_position(bad, exc):
    S, z = np.ones((2, 4, 3)), np.ones((2, 4))
    with pytest.raises(exc, match=r"state\.position"):
        LinearAttentionState.from_linear_state((S, z, bad), 4)
    with pytest.raises(exc, match=r"state\.position"):
        LinearAttentionState.from_linear_state(la.LinearState(S, z, bad), 4)


def test_from_linear_state_accepts_integral_positions_and_checks_its_arguments():
    S, z = np.ones((2, 4, 3)), np.ones((2, 4))
    assert LinearAttentionState.from_linear_state((S, z, 3.0), 4).position == 3
    assert LinearAttentionState.from_linear_state((S, z, np.int32(5)), 4).position == 5
    assert LinearAttentionState.from_linear_state((S, z), 4).position == 0
    with pytest.raises(TypeError, match="state must be a LinearState"):
        LinearAttentionState.from_linear_state(S, 4)
    with pytest.raises(ValueError, match="device must be one of"):
        LinearAttentionState.from_linear_state((S, z), 4, device="tpu")


def test_from_linear_state_refuses_a_state_that_is_not_finite_without_a_switch_it_lacks():
    """The message suggested check_finite=False, which from_linear_state does not take (TypeError)."""
    S, z = np.ones((2, 4, 3)), np.ones((2, 4))
    S[1, 2, 0] = np.nan
    with pytest.raises(ValueError, match=r"^state\.S contains 1 non-finite value\(s\) \(NaN or inf\); a state is "
                                         r"loaded only when every value is finite$"):
        LinearAttentionState.from_linear_state((S, z), 4)
    z[0, 1] = z[1, 3] = np.inf
    with pytest.raises(ValueError, match=r"^state\.z contains 2 non-finite"):
        LinearAttentionState.from_linear_state((np.ones((2, 4, 3)), z), 4)


def test_from_linear_state_refuses_values_beyond_a_float32_state():
    """A finite float64 state of 1e300 was cast to inf in a float32 state (the finiteness check ran before the
    cast); the next step then raised NonFiniteResult and absorbed its token.  Now the load is refused."""
    S, z = np.full((4, 3), 1e300), np.ones(4)
    with pytest.raises(ValueError, match=r"^state\.S has 12 finite value\(s\) beyond the range of the float32 "
                                         r"state .*does not fit the chosen dtype"):
        LinearAttentionState.from_linear_state((S, z, 5), 4, dtype=np.float32)
    with pytest.raises(ValueError, match=r"^state\.z has 1 finite value"):
        LinearAttentionState.from_linear_state((np.ones((4, 3)), np.array([1.0, 1.0, 1e300, 1.0])), 4,
                                               dtype=np.float32)
    assert LinearAttentionState.from_linear_state((S, z, 5), 4).position == 5  # float64 holds them


@pytest.mark.parametrize("bad", ["False", None, 0])
def test_check_finite_must_be_true_or_false(bad):
    """step, prefill and query (of LinearAttentionState, KVCache, and DPLRState.query) read check_finite by its
    truthiness: "False" kept the check, None or 0 switched it off; linear_attention's TypeError now."""
    from linattn_nb.state.dplr import DPLRState

    x = np.ones((1, 4))
    st, cache = LinearAttentionState(4, 4), la.KVCache(4, 4)
    calls = [lambda: st.step(x, x, x, check_finite=bad), lambda: st.prefill(x, x, check_finite=bad),
             lambda: st.query(x, check_finite=bad), lambda: cache.step(x, x, x, check_finite=bad),
             lambda: cache.prefill(x, x, check_finite=bad), lambda: cache.query(x, check_finite=bad),
             lambda: DPLRState(4, 4, rule="kda", feature_map="l2").query(x[0], check_finite=bad)]
    for call in calls:
        with pytest.raises(TypeError, match=f"^check_finite must be True or False, got {re.escape(repr(bad))}$"):
            call()
    assert st.position == 0 and cache.length == 0
    assert st.step(x, x, x, check_finite=np.bool_(False)).shape == (1, 4)  # a NumPy bool is a bool


def test_load_refuses_positions_that_are_not_integers(tmp_path):
    st = LinearAttentionState(3, 2)
    st.prefill(np.ones((4, 3)), np.ones((4, 2)))
    good = tmp_path / "good.npz"
    st.save(good)
    for i, val in enumerate([np.array(2.5), np.array("3"), np.array(np.nan), np.array([3]), np.array(True)]):
        p = tmp_path / f"pos{i}.npz"
        rewrite(good, p, position=val)
        with pytest.raises(StateFileError, match="entry 'position'"):
            LinearAttentionState.load(p)
    p = tmp_path / "none.npz"
    with np.load(good, allow_pickle=False) as npz:
        data = {k: npz[k] for k in npz.files}
    data["position"] = np.array(None)  # an object array: written as a pickle, never unpickled
    np.savez(p, **data)
    with pytest.raises(StateFileError, match="corrupted or truncated.*entry 'position'"):
        LinearAttentionState.load(p)


# ---------------------------------------------------------------------------
# The feature-map probe of a state file
# ---------------------------------------------------------------------------
def test_state_files_without_a_usable_probe_are_refused(tmp_path):
    """A file whose probe is missing, empty or reshaped cannot vouch for its feature map: refused,
    whether the map is rebuilt from the file (also a hand-edited name) or passed to load()."""
    st = LinearAttentionState(3, 2, batch_shape=(2,))
    st.prefill(np.ones((2, 4, 3)), np.ones((2, 4, 2)))
    good = tmp_path / "good.npz"
    st.save(good)
    with np.load(good) as npz:
        probe = npz["feature_map_probe"]
    assert probe.shape == (3, 3)
    edits = {
        "relu_empty": dict(feature_map=np.array("relu"), feature_map_probe=np.zeros((0, 3))),
        "empty": dict(feature_map_probe=np.zeros((0, 3))),
        "flat_empty": dict(feature_map_probe=np.zeros(0)),
        "scalar": dict(feature_map_probe=np.array(1.0)),
        "rows": dict(feature_map_probe=probe[:2]),
        "ints": dict(feature_map_probe=probe.astype(np.int64)),
        "missing": dict(feature_map_probe=None),
    }
    for name, change in edits.items():
        p = tmp_path / f"{name}.npz"
        rewrite(good, p, **change)
        with pytest.raises(StateFileError, match="probe"):
            LinearAttentionState.load(p)
        with pytest.raises(StateFileError, match="probe"):
            LinearAttentionState.load(p, feature_map="elu")
    assert np.array_equal(LinearAttentionState.load(good).S, st.S)


def test_a_map_that_fails_on_the_probe_cannot_be_saved(tmp_path):
    """cosFormer with max_length 2 cannot featurise the 3-token probe: save() says so instead of
    writing a file that load() would refuse."""
    st = LinearAttentionState(3, 2, feature_map=fm.get("cosformer", max_length=2))
    st.prefill(np.ones((2, 3)), np.ones((2, 2)))
    with pytest.raises(ValueError, match="cannot save the state.*probe"):
        st.save(tmp_path / "c.npz")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------
# The step launchers in the method table
# ---------------------------------------------------------------------------
def test_step_launchers_are_method_table_entries():
    for dev, launcher in (("cpu", launchers.CPU_STEP), ("cuda", launchers.CUDA_STEP)):
        m = registry.get_method("step", causal=True, device=dev, rule="additive")
        assert m.kind == "step" and m.forward is launcher and m.rule == "additive" and m.causal is True
        assert launcher.device == dev
    assert "step" not in registry.available_methods(causal=True, device="cpu")
    assert registry.available_methods(causal=True, device="cpu", kind="step") == ["step"]
    assert registry.available_methods(causal=True, device="cuda", kind="step") == ["step"]
    assert LinearAttentionState(4, 3)._launch is launchers.CPU_STEP


def test_the_state_looks_its_launcher_up_once_and_runs_what_is_registered(monkeypatch):
    """A launcher registered under ("additive", True, "step", "cpu") is what the state runs (a new
    rule's kernels plug in the same way); the table is read at construction, not per token."""
    calls = []

    def counting(name):
        fn = getattr(launchers.CPU_STEP, name)

        def wrapped(*a, **kw):
            calls.append(name)
            return fn(*a, **kw)

        return wrapped

    custom = dataclasses.replace(launchers.CPU_STEP, step=counting("step"), query=counting("query"),
                                 prefill=counting("prefill"), kernel=None)
    original = registry.get_method("step", causal=True, device="cpu", rule="additive")
    registry.register_method(dataclasses.replace(original, forward=custom), overwrite=True)
    lookups = []
    real_get = state_linear.get_method

    def counting_get(*a, **kw):
        lookups.append((a, kw))
        return real_get(*a, **kw)

    monkeypatch.setattr(state_linear, "get_method", counting_get)
    try:
        rng = np.random.default_rng(4)
        q, k, v = qkv(rng, (2,), 9, 4, 3, np.float32)
        st = LinearAttentionState(4, 3, batch_shape=(2,), dtype=np.float32, device="cpu")
        assert lookups == [(("step",), dict(causal=True, device="cpu", rule="additive"))]
        assert st._launch is custom and not st._fast
        st.prefill(k[:, :3], v[:, :3])
        outs = [st.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]) for t in range(3, 6)]
        outs.append(st.step(q[:, 6:], k[:, 6:], v[:, 6:]))
        st.query(q[:, :2])
        twin = st.copy()
        assert twin._launch is custom
    finally:
        registry.register_method(original, overwrite=True)
    assert calls == ["prefill", "step", "step", "step", "step", "query"]
    assert len(lookups) == 2  # the constructor's and the copy's
    assert_close(np.concatenate(outs, axis=1), la.linear_attention(q, k, v, causal=True)[:, 3:], np.float32)
    assert LinearAttentionState(4, 3)._launch is launchers.CPU_STEP


def test_an_auto_state_looks_the_gpu_launcher_up_when_gpu_inputs_decide():
    if not HAVE_CUDA:
        pytest.skip("no CUDA and no simulator")
    from numba import cuda

    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, (2,), 3, 4, 2)
    _, ls = la.linear_attention(q, k, v, causal=True, return_state=True)
    st = LinearAttentionState.from_linear_state(ls, 4)  # host data, device still "auto"
    assert st.device == "auto" and st._launch is launchers.CPU_STEP
    out = st.step(*(cuda.to_device(np.ascontiguousarray(x[:, :1])) for x in (q, k, v)))
    assert st.device == "cuda" and st._launch is launchers.CUDA_STEP
    full = la.linear_attention(np.concatenate([q, q[:, :1]], 1), np.concatenate([k, k[:, :1]], 1),
                               np.concatenate([v, v[:, :1]], 1), causal=True)
    assert_close(host(out), full[:, 3:])


# ---------------------------------------------------------------------------
# The NumPy-side feature maps
# ---------------------------------------------------------------------------
def _maps(n, d):
    rng = np.random.default_rng(30)
    return {
        "favor+": fm.get("favor+", seed=0),
        "rff": fm.get("rff", seed=1),
        "cosformer": fm.get("cosformer", max_length=n),
        "hedgehog": fm.get("hedgehog", W=0.3 * rng.standard_normal((3, d)), b=0.1 * rng.standard_normal(3)),
        "t2r": fm.get("t2r", W=0.5 * rng.standard_normal((7, d)), b=0.5 + 0.2 * rng.standard_normal(7)),
        "taylor2": fm.get("taylor2"),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["favor+", "rff", "cosformer", "hedgehog", "t2r", "taylor2"])
def test_numpy_side_maps_decode_like_the_causal_kernel(name, device):
    """prefill, single-token and multi-token steps give linear_attention(causal=True)'s rows and
    final state with the same map instance; query reads phi(q)^T S / phi(q)^T z at the current
    position (positions matter for cosFormer)."""
    n, d, m = 11, 5, 4
    fmap = _maps(n, d)[name]
    rng = np.random.default_rng(31)
    q, k, v = qkv(rng, (2, 3), n, d, m)
    ref, ref_state = la.linear_attention(q, k, v, causal=True, feature_map=fmap, return_state=True)
    _, st5 = la.linear_attention(q[..., :5, :], k[..., :5, :], v[..., :5, :], causal=True, feature_map=fmap,
                                 return_state=True)
    st = LinearAttentionState(d, m, batch_shape=(2, 3), feature_map=fmap, device=device)
    assert st.feature_dim == fmap.output_dim(d)
    st.prefill(k[..., :5, :], v[..., :5, :])
    qf = fmap.apply(q[..., 5:7, :], role="query", causal=True, offset=5, total_length=7)
    den = np.maximum(np.einsum("...tf,...f->...t", qf, st5.z), 1e-8)
    assert_close(st.query(q[..., 5:7, :]), np.einsum("...tf,...fm->...tm", qf, st5.S) / den[..., None])
    assert st.position == 5
    outs = [st.step(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :]) for t in range(5, 8)]
    outs.append(st.step(q[..., 8:, :], k[..., 8:, :], v[..., 8:, :]))
    dec = np.concatenate(outs, axis=-2)
    assert isinstance(dec, np.ndarray) and dec.shape == (2, 3, n - 5, m)
    assert_close(dec, ref[..., 5:, :])
    assert st.position == n
    np.testing.assert_allclose(host(st.S), ref_state.S, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(host(st.z), ref_state.z, rtol=1e-12, atol=1e-12)


def test_a_read_only_out_is_refused_before_the_state_moves():
    """``step(out=<read-only array>)`` raised NumPy's "assignment destination is read-only" after the kernel
    had absorbed the tokens: a retry with a writable out absorbed them twice.  Now it is refused first, and
    ``dplr_attention(out=...)`` refuses it before its work too."""
    import linattn_nb as la

    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 2, 5, 4))
    st = la.LinearAttentionState(4, 4, batch_shape=(2,))
    S0 = st.S.copy()
    ro = np.zeros((2, 5, 4))
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="out is read-only"):
        st.step(q, k, v, out=ro)
    assert st.position == 0 and np.array_equal(st.S, S0)
    good = np.zeros((2, 5, 4))
    assert st.step(q, k, v, out=good) is good
    np.testing.assert_array_equal(good, la.LinearAttentionState(4, 4, batch_shape=(2,)).step(q, k, v))
    with pytest.raises(ValueError, match="out is read-only"):
        la.dplr_attention(q, k, v, a=np.zeros((2, 5, 4)), b=np.zeros((2, 5, 4)), feature_map="l2", out=ro)
