"""Fitted feature maps on every path.

A fitted map is a parametric map whose parameters are not the defaults:
Hedgehog and T2R with a non-square ``W`` (``d_out != d``) and a bias, and
FAVOR+ with ``learn_projection=True`` whose projection was changed after the
draw (as training changes it).  Each runs on every path and agrees with the
package's naive references (``linattn_nb.ops.*.naive``, float64, explicit
``N x N`` weights) fed with features computed here from the formulas and the
map's parameters, independently of the map's own ``apply``:

* ``linear_attention`` on the CPU: causal ``"scan"``, ``"chunked"`` (a chunk
  size that does not divide ``N``) and ``"quadratic"``, non-causal
  ``"aggregate"``; final states; a sequence processed in two segments;
* ``device="cuda"`` with host (NumPy) inputs (the CUDA simulator here, with
  tiny sizes);
* :class:`~linattn_nb.LinearAttentionState`: prefill and step-by-step
  decoding equal the full causal call; after save then load (the map rebuilt
  from the file, its parameters included) decoding continues with the same
  outputs as the original state.

Shapes: ``N = 1``, ``N`` not a multiple of the chunk, batch dimensions
``(2, 3)``.  Tolerances are float64 round-off (1e-10 relative to the largest
entry), which a wrong parameter, a dropped bias or a lost projection exceeds
by orders of magnitude.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import config
from linattn_nb import feature_maps as fm
from linattn_nb.device import cuda_status
from linattn_nb.ops.causal.naive import causal_linear_quadratic
from linattn_nb.ops.noncausal.naive import noncausal_linear_quadratic
from linattn_nb.state import LinearAttentionState, StateFileError

D, M = 4, 3
BATCH = (2, 3)
EPS = 1e-8
TOL = 1e-10
MAPS = ["hedgehog", "t2r", "favor+"]
HAVE_CUDA = cuda_status() != "none"
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA and no simulator")


def fitted_map(name):
    """A map with non-default parameters, the same for every call (fixed seeds)."""
    r = np.random.default_rng(18)
    if name == "hedgehog":  # d_out = 6 != d = 4: 12 features
        return fm.get("hedgehog", W=0.5 * r.standard_normal((6, D)), b=0.3 * r.standard_normal(6))
    if name == "t2r":  # d_out = 7; a mostly positive bias: some projections below the kink, few zero rows
        return fm.get("t2r", W=0.6 * r.standard_normal((7, D)), b=0.4 + 0.3 * r.standard_normal(7))
    phi = fm.get("favor+", dim=D, num_features=5, seed=3, learn_projection=True)
    phi.parameters()["projection"][...] += 0.1 + 0.2 * r.standard_normal((5, D))  # "trained" in place
    return phi


def formula_features(name, fmap, x):
    """phi(x) from the map's formula and parameters (no stabilising shift): float64, ``(..., F)``."""
    x = np.asarray(x, dtype=np.float64)
    if name in ("hedgehog", "t2r"):
        u = x @ fmap.W.T + fmap.b
        return np.exp(np.concatenate([u, -u], axis=-1)) if name == "hedgehog" else np.maximum(u, 0.0)
    xs = x * math.sqrt(1.0 / math.sqrt(x.shape[-1]))  # the default scale 1/sqrt(d)
    w = fmap.W
    return np.exp(xs @ w.T - 0.5 * np.sum(xs * xs, axis=-1, keepdims=True)) / math.sqrt(w.shape[0])


def reference(name, fmap, q, k, v, *, causal, S0=None, z0=None):
    """Outputs and final state ``(out, S, z)`` of the naive float64 reference, batch dimensions kept."""
    bs, n = q.shape[:-2], q.shape[-2]
    qf, kf = formula_features(name, fmap, q), formula_features(name, fmap, k)
    f = qf.shape[-1]
    flat = (-1, n)
    if S0 is not None:
        S0, z0 = np.reshape(S0, (-1, f, M)), np.reshape(z0, (-1, f))
    fn = causal_linear_quadratic if causal else noncausal_linear_quadratic
    out, S, z = fn(qf.reshape(flat + (f,)), kf.reshape(flat + (f,)), v.reshape(flat + (M,)), eps=EPS, S0=S0, z0=z0)
    # the comparison means something only when no normaliser sits at the eps floor
    z_run = np.cumsum(kf, axis=-2) if causal else kf.sum(axis=-2, keepdims=True)
    if z0 is not None:
        z_run = z_run + z0.reshape(bs + (1, f))
    assert np.einsum("...tf,...tf->...t", qf, z_run).min() > 1e-3
    return out.reshape(bs + (n, M)), S.reshape(bs + (f, M)), z.reshape(bs + (f,))


def assert_close(got, want, what=""):
    got = np.asarray(got.copy_to_host() if hasattr(got, "copy_to_host") else got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1.0)
    err = float(np.max(np.abs(got - want), initial=0.0)) / scale
    assert err <= TOL, f"{what}: relative error {err:.3g} > {TOL}"


def inputs(n, seed=0):
    r = np.random.default_rng(100 + n + seed)
    q, k = 0.7 * r.standard_normal((2,) + BATCH + (n, D))
    return q, k, r.standard_normal(BATCH + (n, M))


@pytest.fixture(autouse=True)
def few_simulator_threads(monkeypatch):
    """On the simulator (each CUDA thread a Python thread), launch the decode-step kernels with 2 threads
    per block instead of 128 and the helper kernels (zero fills, the chunk-state scan) with 2 blocks of 8:
    the results do not depend on it (the kernels loop over their rows and columns by the block or grid size:
    with 2 threads the step kernel's loops over features and the M = 3 value columns take several turns,
    and the prefill grid has two blocks of columns, the second partial), and the state cases cost a fifth.
    A GPU keeps the default launch configuration."""
    if cuda_status() == "simulator":
        monkeypatch.setattr(config, "CUDA_STEP_THREADS", 2)
        monkeypatch.setattr(config, "CUDA_THREADS_PER_BLOCK", 8)
        monkeypatch.setattr(config, "CUDA_MAX_HELPER_BLOCKS", 2)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 tokens on the CPU and 2 on CUDA, so that N = 11 on the CPU and N = 5 on CUDA end in a
    partial chunk, after two whole ones."""
    monkeypatch.setattr(config, "CPU_CHUNK_SIZE", 4)
    monkeypatch.setattr(config, "CUDA_CHUNK_SIZE", 2)


def test_maps_are_fitted_and_references_independent():
    """The maps really carry non-default parameters, and the formulas here agree with the maps' own features."""
    x = inputs(5)[0]
    for name in MAPS:
        fmap = fitted_map(name)
        if name == "favor+":
            redrawn = fm.get("favor+", dim=D, num_features=5, seed=3)
            assert fmap.projection is fmap.W and not np.allclose(fmap.W, redrawn.W)
            assert fmap.key_shift == 0.0  # key features are the formula's exactly
        else:
            assert fmap.W.shape[0] != D and fmap.b is not None
        np.testing.assert_allclose(fmap.apply(x, role="key", causal=True), formula_features(name, fmap, x),
                                   rtol=1e-13)
    t2r = formula_features("t2r", fitted_map("t2r"), x)
    assert (t2r == 0).any() and (t2r > 0).any()  # the relu kink is exercised


# ---------------------------------------------------------------------------
# linear_attention on the CPU
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 4, 11])
@pytest.mark.parametrize("causal, method", [(True, "scan"), (True, "chunked"), (True, "quadratic"),
                                            (False, "aggregate"), (False, "auto")])
@pytest.mark.parametrize("name", MAPS)
def test_cpu_methods_match_naive(name, causal, method, n, small_chunks):
    fmap = fitted_map(name)
    q, k, v = inputs(n)
    want, S, z = reference(name, fmap, q, k, v, causal=causal)
    out, st = la.linear_attention(q, k, v, feature_map=fmap, causal=causal, method=method, eps=EPS,
                                  return_state=True)
    assert_close(out, want, f"{name} {method} out")
    assert_close(st.S, S, f"{name} {method} S")
    assert_close(st.z, z, f"{name} {method} z")


@pytest.mark.parametrize("method", ["scan", "chunked"])
@pytest.mark.parametrize("name", MAPS)
def test_cpu_segments_match_naive(name, method, small_chunks):
    """Two segments linked by initial_state (a split inside a chunk) give the one-pass reference."""
    fmap = fitted_map(name)
    q, k, v = inputs(11)
    want, _, _ = reference(name, fmap, q, k, v, causal=True)
    a, st = la.linear_attention(q[..., :6, :], k[..., :6, :], v[..., :6, :], feature_map=fmap, causal=True,
                                method=method, return_state=True)
    b = la.linear_attention(q[..., 6:, :], k[..., 6:, :], v[..., 6:, :], feature_map=fmap, causal=True,
                            method=method, initial_state=st)
    assert_close(np.concatenate([a, b], axis=-2), want, f"{name} {method} segments")


# ---------------------------------------------------------------------------
# CUDA with host inputs (the simulator without a GPU)
# ---------------------------------------------------------------------------
@needs_cuda
# N = 5 in chunks of 2 (small_chunks): three chunks, the last partial, as N = 11 in chunks of 4 on the CPU;
# the simulator runs a block per batch entry and chunk, its time grows with N
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("causal, method", [(True, "scan"), (True, "chunked"), (False, "aggregate")])
@pytest.mark.parametrize("name", MAPS)
def test_cuda_host_inputs_match_naive(name, causal, method, n, small_chunks):
    if n > 1:  # three chunks of the CUDA chunk size, the last partial
        assert -(-n // config.CUDA_CHUNK_SIZE) == 3 and n % config.CUDA_CHUNK_SIZE
    fmap = fitted_map(name)
    q, k, v = inputs(n, seed=1)
    want, S, z = reference(name, fmap, q, k, v, causal=causal)
    out, st = la.linear_attention(q, k, v, feature_map=fmap, causal=causal, method=method, device="cuda", eps=EPS,
                                  return_state=True)
    assert isinstance(out, np.ndarray)  # host inputs: a host result
    assert_close(out, want, f"{name} cuda {method} out")
    assert_close(st.S, S, f"{name} cuda {method} S")
    assert_close(st.z, z, f"{name} cuda {method} z")


# ---------------------------------------------------------------------------
# LinearAttentionState: decoding, save, load, continue
# ---------------------------------------------------------------------------
def _decode(st, q, k, v, start, stop):
    """Single-token steps over positions [start, stop)."""
    outs = [st.step(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :]) for t in range(start, stop)]
    return np.concatenate([np.asarray(o.copy_to_host() if hasattr(o, "copy_to_host") else o) for o in outs], axis=-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("name", MAPS)
def test_state_decoding_matches_the_causal_call(name, device):
    n = 11 if device == "cpu" else 3  # the simulator: each step a kernel launch run in Python (3 tokens: the suite's time)
    fmap = fitted_map(name)
    q, k, v = inputs(n, seed=2)
    want, S, z = reference(name, fmap, q, k, v, causal=True)
    full = la.linear_attention(q, k, v, feature_map=fmap, causal=True, eps=EPS)
    assert_close(full, want, f"{name} full call")
    # step by step from the first token
    st = LinearAttentionState(D, M, batch_shape=BATCH, feature_map=fmap, device=device, eps=EPS)
    assert st.feature_dim == fmap.output_dim(D)
    assert_close(_decode(st, q, k, v, 0, n), want, f"{name} {device} steps")
    assert_close(st.S, S, f"{name} {device} S")
    assert_close(st.z, z, f"{name} {device} z")
    # a prompt of 1 token, then steps
    st = LinearAttentionState(D, M, batch_shape=BATCH, feature_map=fmap, device=device, eps=EPS)
    st.prefill(k[..., :1, :], v[..., :1, :])
    assert_close(_decode(st, q, k, v, 1, n), want[..., 1:, :], f"{name} {device} prefill + steps")


def _saved_params(path):
    with np.load(path, allow_pickle=False) as npz:
        assert str(npz["feature_map_rebuild_error"]) == ""
        return {key[len("feature_map_param__"):]: npz[key] for key in npz.files
                if key.startswith("feature_map_param__")}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("name", MAPS)
def test_save_load_continue(name, device, tmp_path):
    """A fitted map saves with its parameters: load() rebuilds it from the file alone (no feature_map=),
    with equal parameters and identical features, and decoding continues with the original's outputs."""
    n, cut = (11, 4) if device == "cpu" else (5, 2)
    fmap = fitted_map(name)
    q, k, v = inputs(n, seed=3)
    want, S, z = reference(name, fmap, q, k, v, causal=True)
    st = LinearAttentionState(D, M, batch_shape=BATCH, feature_map=fmap, device=device, eps=EPS)
    st.prefill(k[..., :cut, :], v[..., :cut, :])
    path = tmp_path / f"{name}.npz"
    st.save(path)
    # the file holds the fitted parameters themselves
    saved = _saved_params(path)
    stored = fmap.parameters() if name != "favor+" else {"projection": fmap.W}
    assert set(saved) == set(stored)
    for key, val in stored.items():
        assert np.array_equal(saved[key], val), key
    back = LinearAttentionState.load(path, device=device)
    rebuilt = back.feature_map
    assert type(rebuilt) is type(fmap) and rebuilt is not fmap
    assert rebuilt.output_dim(D) == fmap.output_dim(D)
    for key, val in stored.items():
        assert np.array_equal(getattr(rebuilt, "projection" if key == "projection" else key), val), key
    if name == "favor+":
        assert rebuilt.learn_projection and np.array_equal(rebuilt.parameters()["projection"], fmap.W)
    x = inputs(7, seed=4)[0]
    for role in ("query", "key"):
        assert np.array_equal(rebuilt.apply(x, role=role, causal=True), fmap.apply(x, role=role, causal=True))
    assert back.position == cut
    assert np.array_equal(np.asarray(back.S if device == "cpu" else back.S.copy_to_host()),
                          np.asarray(st.S if device == "cpu" else st.S.copy_to_host()))
    # both continue identically, and as the one-pass reference
    cont = _decode(st, q, k, v, cut, n)
    cont_back = _decode(back, q, k, v, cut, n)
    assert np.array_equal(cont_back, cont)
    assert_close(cont_back, want[..., cut:, :], f"{name} {device} continued after load")
    assert_close(back.S, S, f"{name} {device} S after load")
    assert_close(back.z, z, f"{name} {device} z after load")


def test_favor_projection_round_trips_only_when_learned_or_given(tmp_path):
    """Without learn_projection the file keeps its old form (the seed, no array): a projection changed by
    hand is then not rebuildable and load() asks for feature_map=; with it, or with projection=, it is saved."""
    q, k, v = inputs(3, seed=5)
    plain = fm.get("favor+", dim=D, num_features=5, seed=3)
    st = LinearAttentionState(D, M, batch_shape=BATCH, feature_map=plain)
    st.prefill(k, v)
    st.save(tmp_path / "plain.npz")
    assert _saved_params(tmp_path / "plain.npz") == {}
    np.testing.assert_array_equal(LinearAttentionState.load(tmp_path / "plain.npz").feature_map.W, plain.W)
    plain.W[...] += 0.1  # changed, but not declared trainable: the seed no longer reproduces it
    st = LinearAttentionState(D, M, batch_shape=BATCH, feature_map=plain)
    st.save(tmp_path / "changed.npz")
    with pytest.raises(StateFileError, match="pass feature_map="):
        LinearAttentionState.load(tmp_path / "changed.npz")
    assert LinearAttentionState.load(tmp_path / "changed.npz", feature_map=plain).feature_map is plain
    given = fm.get("favor+", projection=plain.W, kind="hyperbolic")  # given, not learned, no seed
    st = LinearAttentionState(D, M, batch_shape=BATCH, feature_map=given)
    st.prefill(k, v)
    st.save(tmp_path / "given.npz")
    back = LinearAttentionState.load(tmp_path / "given.npz")
    assert np.array_equal(back.feature_map.W, plain.W) and back.feature_map.kind == "hyperbolic"
    assert not back.feature_map.learn_projection
    assert np.array_equal(back.query(q), st.query(q))
