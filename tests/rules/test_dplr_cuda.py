"""The CUDA scan of the DPLR recurrence (``dplr_attention(device="cuda")``) against the float64 reference.

Without a GPU these run on the Numba CUDA simulator (tests/conftest.py) on tiny shapes; the column
blocks (more value columns than a block's threads) are reached by lowering the block size.  The
simulator checks no types, so the kernel is also compiled to PTX for sm_90 in a subprocess.

Ground truth: ``method="quadratic"`` (``linattn_nb.ops.dplr.naive``), 1e-12 in float64.
"""
from __future__ import annotations

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import rules
from linattn_nb.device import cuda_status
from linattn_nb.ops._finite import NonFiniteResult
from linattn_nb.ops.dplr import cuda as K
from _ptx import run_ptx_script

pytestmark = pytest.mark.skipif(cuda_status() == "none", reason="no CUDA GPU and the simulator is off")

B, N, D, M = 2, 5, 4, 3


def _log(x):
    with np.errstate(divide="ignore"):
        return np.log(x)


def _host(x):
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


def _close(actual, expected):
    np.testing.assert_allclose(_host(actual), expected, rtol=1e-12, atol=1e-12)


@pytest.fixture(params=[256, 3], ids=["one_block", "column_blocks"])
def threads(request, monkeypatch):
    """Blocks of 256 threads (one per sequence), or of 3 (two value columns and the normaliser's: the
    value columns split over column blocks)."""
    monkeypatch.setattr(K, "MAX_THREADS", request.param)
    return request.param


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("sub", [0, 2])
def test_general_form_matches_the_reference(rng, threads, sub, normalize):
    """Per-feature diagonal with a reset, r = 2 factors, one write per token or one per sub-step,
    beta, an initial state: outputs and final state."""
    shape = (B, N, sub) if sub else (B, N)
    q = rng.standard_normal((B, N, D))
    k, v = rng.standard_normal(shape + (D,)), rng.standard_normal(shape + (M,))
    args = {"a": rng.standard_normal((B, N, 2, D)) * 0.3, "b": rng.standard_normal((B, N, 2, D)) * 0.3,
            "log_diag": _log(rng.uniform(0.5, 1, size=(B, N, D))), "beta": rng.uniform(0.2, 1, size=shape)}
    args["log_diag"][1, 2, 1] = -np.inf
    S0, z0 = rng.random((B, D, M)), rng.random((B, D)) + 1.0
    init = la.LinearState(S0, z0, 0, "dplr")
    ref, st = la.dplr_attention(q, k, v, method="quadratic", normalize=normalize, initial_state=init,
                                return_state=True, **args)
    o, st2 = la.dplr_attention(q, k, v, method="scan", device="cuda", normalize=normalize, initial_state=init,
                               return_state=True, **args)
    assert isinstance(o, np.ndarray) and o.shape == (B, N, M)
    _close(o, ref)
    _close(st2.S, st.S)
    _close(st2.z, st.z)
    assert st2.position == N and st2.rule == "dplr"
    np.testing.assert_array_equal(init.S, S0)  # the caller's state is not modified


@pytest.mark.parametrize("name", rules.dplr_rule_names())
def test_named_rules_match_the_reference(rng, name):
    rule = rules.get_dplr_rule(name)
    r = 2 if rule.substeps else 0
    shape = (B, N, r) if r else (B, N)
    q, k, v = rng.standard_normal((B, N, D)), rng.standard_normal(shape + (D,)), rng.standard_normal(shape + (M,))
    inputs = rule.sample(rng, B, N, D, r)
    H0 = rng.random((B, D, M + 1)) + 0.5
    init = la.LinearState(H0[..., :M], H0[..., M], 0, name)
    normalize = name in ("rwkv7", "gated_delta_product")
    kw = dict(rule=name, feature_map="l2", normalize=normalize, eps=1e-6, initial_state=init, return_state=True,
              **inputs)
    ref, st = la.dplr_attention(q, k, v, method="quadratic", **kw)
    o, st2 = la.dplr_attention(q, k, v, method="auto", device="cuda", **kw)
    _close(o, ref)
    _close(st2.S, st.S)
    _close(st2.z, st.z)
    assert st2.rule == name


def _general(rng, n=N):
    q, k, v = rng.standard_normal((B, n, D)), rng.standard_normal((B, n, D)), rng.standard_normal((B, n, M))
    return (q, k, v), {"a": rng.standard_normal((B, n, D)) * 0.3, "b": rng.standard_normal((B, n, D)) * 0.3,
                       "log_diag": _log(rng.uniform(0.5, 1, size=(B, n)))}


def test_device_inputs_give_a_device_result(rng):
    """Device arrays with device="cuda": a device result (also written into a device ``out``); the
    simulator's arrays with device="auto" run on the CPU (the simulator is never a GPU for "auto")."""
    from numba import cuda

    (q, k, v), args = _general(rng)
    ref = la.dplr_attention(q, k, v, method="quadratic", normalize=True, **args)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    dargs = {key: cuda.to_device(x) for key, x in args.items()}
    o = la.dplr_attention(dq, dk, dv, device="cuda", normalize=True, **dargs)
    assert hasattr(o, "copy_to_host")
    _close(o, ref)
    out = cuda.device_array((B, N, M))
    res = la.dplr_attention(dq, dk, dv, device="cuda", normalize=True, out=out, **dargs)
    assert res is out
    _close(out, ref)
    # a strided device view as out (a raw Numba error after the whole computation before)
    wide = cuda.device_array((B, N, 2 * M))
    view = wide[:, :, ::2]
    assert la.dplr_attention(dq, dk, dv, device="cuda", normalize=True, out=view, **dargs) is view
    _close(view, ref)
    if cuda_status() == "simulator":
        _close(la.dplr_attention(dq, dk, dv, normalize=True, **dargs), ref)
    with pytest.raises(ValueError, match="different devices"):
        la.dplr_attention(dq, k, v, device="cuda", **args)
    # a device out as a host one: a wrong shape a ValueError, a wrong dtype a TypeError
    with pytest.raises(ValueError, match="out must have shape"):
        la.dplr_attention(dq, dk, dv, device="cuda", out=cuda.device_array((B, N + 1, M)), **dargs)
    with pytest.raises(TypeError, match="out must have dtype"):
        la.dplr_attention(dq, dk, dv, device="cuda", out=cuda.device_array((B, N, M), np.float32), **dargs)


def test_launcher_updates_a_device_state(rng, threads):
    """The launcher on device arrays: the state updated in place, the outputs written (float64),
    as the CPU scan."""
    from numba import cuda

    from linattn_nb.ops.dplr.cpu import dplr_scan

    fq = rng.random((B, N, D))
    form = (np.zeros((B, N, 0)), rng.standard_normal((B, N, 2, D)) * 0.3, rng.standard_normal((B, N, 2, D)) * 0.3,
            rng.standard_normal((B, N, 2, D)), rng.standard_normal((B, N, 2, M)))
    H = rng.random((B, D, M + 1))
    Hc, oc = H.copy(), np.empty((B, N, M))
    dplr_scan(fq, *form, Hc, oc, 0, 0.0)
    dH, dout = cuda.to_device(H), cuda.device_array((B, N, M))
    bad = K.dplr_scan_cuda(fq, *form, dH, dout, 0, 0.0)
    assert bad.dtype == np.uint8 and not bad.any()
    np.testing.assert_allclose(dH.copy_to_host(), Hc, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(dout.copy_to_host(), oc, rtol=1e-13, atol=1e-13)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the simulator's NumPy scalars
def test_growth_is_an_error_not_a_silent_inf(rng):
    """a = b = ones multiply the state by 1 + D per token: from 1e305 it overflows in a few tokens."""
    n = 4
    q, k, v = (np.abs(rng.standard_normal((B, n, d))) for d in (D, D, M))
    ones = np.ones((B, n, D))
    init = la.LinearState(np.full((B, D, M), 1e305), np.full((B, D), 1e305), 0, "dplr")
    with pytest.raises(NonFiniteResult, match="grew"):
        la.dplr_attention(q, k, v, a=ones, b=ones, device="cuda", initial_state=init)
    H = np.full((B, D, M + 1), 1e305)
    H[0] = 0.0
    form = (np.zeros((B, n, 0)), ones[:, :, None], ones[:, :, None], np.zeros((B, n, 1, D)), np.zeros((B, n, 1, M)))
    bad = K.dplr_scan_cuda(q, *form, H, np.empty((B, n, M)), 2, 0.0)
    assert bad.tolist() == [0, 1]


def test_limits_and_errors(rng, monkeypatch):
    assert [K.feature_capacity(f) for f in (1, 8, 9, 256)] == [8, 8, 16, 256]
    with pytest.raises(ValueError, match="at most 256 features"):
        K.feature_capacity(257)
    (q, k, v), args = _general(rng, 2)
    with pytest.raises(ValueError, match="device must be one of"):
        la.dplr_attention(q, k, v, device="gpu", **args)
    import linattn_nb.device as dev

    monkeypatch.setattr(dev, "cuda_status", lambda: "none")
    with pytest.raises(RuntimeError, match="need a usable CUDA GPU"):
        la.dplr_attention(q, k, v, device="cuda", **args)
    # the host methods stay where they are
    o = la.dplr_attention(q, k, v, **args)
    _close(o, la.dplr_attention(q, k, v, method="quadratic", **args))


_PTX_SCRIPT = """
import json
from numba import cuda, types
from linattn_nb.ops.dplr import cuda as K
f64, i64 = types.float64, types.int64
a3, a4 = types.Array(f64, 3, "C"), types.Array(f64, 4, "C")
sig = (a3, a3, a4, a4, a4, a4, a3, a3, a3, types.Array(types.int32, 1, "C"), i64, f64)
res = {}
for fmax in (8, 256):
    text, _ = cuda.compile_ptx(K.dplr_kernel(fmax).py_func, sig, cc=(9, 0))
    res[str(fmax)] = {"target": ".target sm_90" in text, "entry": ".entry" in text,
                      "barriers": text.count("bar.sync")}
print(json.dumps(res))
"""


def test_kernel_compiles_to_ptx():
    """The kernel type-checks and compiles for sm_90 at the smallest and largest feature capacity."""
    res = run_ptx_script(_PTX_SCRIPT)
    for fmax in ("8", "256"):
        assert res[fmax]["target"] and res[fmax]["entry"], res
        assert res[fmax]["barriers"] >= 2, res
