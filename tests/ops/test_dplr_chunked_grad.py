"""The chunked DPLR backward against the checkpointed scan backward (its naive counterpart, itself checked
against central differences in tests/rules/test_dplr.py): ragged lengths, sub-steps and both write
layouts, no / one / a per-feature diagonal, every normaliser mode, resets and strong decays (the scan
runs), chunks cut by the cumulative decay, several stored-state groups, and a state that overflows."""
from __future__ import annotations

import numpy as np
import pytest

from linattn_nb import config
from linattn_nb.dplr import dplr_attention_vjp
from linattn_nb.ops._codes import NORM_FLOOR, NORM_NONE, NORM_RAW
from linattn_nb.ops.dplr.chunked_grad import LOG_STRONG, dplr_chunked_backward
from linattn_nb.ops.dplr.cpu import dplr_scan_backward

NAMES = ("dfq", "ddiag", "dA", "dBv", "dKW", "dVW", "dH0")


def _arrays(rng, B, N, F, M, r, w, W, lo=-0.7):
    fq = rng.random((B, N, F))
    ld = rng.uniform(lo, 0.0, (B, N, W))
    A, Bv = (rng.standard_normal((B, N, r, F)) * 0.3 for _ in range(2))
    KW = rng.standard_normal((B, N, w, F)) * 0.3 + 0.4
    VW = rng.standard_normal((B, N, w, M))
    H0 = rng.random((B, F, M + 1)) + 0.5
    dout = rng.standard_normal((B, N, M))
    dH = rng.standard_normal((B, F, M + 1))
    return [fq, ld, A, Bv, KW, VW, H0, dout, dH]


def _compare(args, norm, eps, C, K=None, tol=5e-14):
    ref = dplr_scan_backward(*[np.array(x) for x in args], norm, eps, 8)
    kept = [np.array(x) for x in args]
    got = dplr_chunked_backward(*kept, norm, eps, C, K)
    for name, x, y, a in zip(NAMES, ref, got, args):
        assert y.shape == x.shape and y.dtype == np.float64, name
        scale = max(np.abs(x).max(initial=0.0), 1e-300)
        err = np.abs(x - y).max(initial=0.0) / scale
        assert err <= tol, (name, err)
    for x, y in zip(args, kept):  # inputs untouched
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("norm", [NORM_NONE, NORM_RAW, NORM_FLOOR])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 26])
@pytest.mark.parametrize("r, w, W", [(1, 1, 4), (2, 2, 1), (3, 1, 4), (2, 1, 0)])
def test_equals_the_scan_backward(rng, norm, n, r, w, W):
    """Chunks of 8 steps over N tokens: 1, one short of, exactly, one past a chunk, and several."""
    args = _arrays(rng, 2, n, 4, 3, r, w, W)
    _compare(args, norm, 0.5 if norm == NORM_FLOOR else 0.0, C=8)


def test_floored_normaliser(rng):
    """eps above some normalisers: their d normaliser is zero in both."""
    args = _arrays(rng, 2, 20, 4, 3, 1, 1, 4)
    args[0][:, ::3] *= 1e-3  # small queries: normalisers below eps
    _compare(args, NORM_FLOOR, 1.0, C=8)


@pytest.mark.parametrize("where", ["first", "inside", "last", "every_other", "strong"])
def test_resets_and_strong_decays_run_by_the_scan(rng, where):
    """Resets (-inf) and decays below LOG_STRONG at a chunk's first token, inside one, at the end, every
    other token (runs of scan tokens between one-token chunks), and log-decays of -30 (where the chunk
    form would lose digits of d/d exp(ld))."""
    n = 30
    args = _arrays(rng, 2, n, 5, 3, 2, 2, 5)
    ld = args[1]
    with np.errstate(divide="ignore"):
        if where == "first":
            ld[:, 8, 1] = -np.inf
        elif where == "inside":
            ld[:, 11, :] = -np.inf
            ld[:, 12, 2] = LOG_STRONG - 0.5
        elif where == "last":
            ld[:, n - 1, 0] = -np.inf
        elif where == "every_other":
            ld[:, ::2, 3] = -np.inf
        else:
            ld[:, ::3] = -30.0
    _compare(args, NORM_NONE, 0.0, C=8)
    _compare(args, NORM_RAW, 0.0, C=8)


def test_decays_just_above_the_scan_threshold_keep_their_digits(rng):
    """Every log-decay in [LOG_STRONG, 0): all in chunks, d/d exp(ld) still within 1e-13 of the scan's."""
    args = _arrays(rng, 2, 40, 5, 3, 1, 1, 5, lo=LOG_STRONG + 1e-9)
    _compare(args, NORM_NONE, 0.0, C=8, tol=1e-13)


def test_cumulative_cut_ends_chunks(rng):
    """Log-decays of about -3.8 a token in chunks of 256 steps: the cumulative passes -600 inside a chunk."""
    args = _arrays(rng, 1, 300, 3, 2, 1, 1, 3)
    args[1][:] = rng.uniform(-3.9, -3.7, args[1].shape)
    _compare(args, NORM_NONE, 0.0, C=256)


@pytest.mark.parametrize("K", [1, 2, 3])
def test_stored_state_groups(rng, K):
    """K segments per stored state: the states of all groups but the last are computed again."""
    args = _arrays(rng, 2, 37, 4, 3, 1, 1, 4)
    with np.errstate(divide="ignore"):
        args[1][:, 20, 0] = -np.inf
    _compare(args, NORM_RAW, 0.0, C=4, K=K)


def test_overflowing_state_runs_by_the_scan(rng):
    """A sequence whose state overflows is handed to the scan backward: the same values, NaN and inf
    included, as the scan backward with the checkpoint the wrapper uses."""
    N, F, M1 = 150, 4, 4
    args = _arrays(rng, 2, N, F, M1 - 1, 1, 1, 0)
    args[2][1], args[3][1] = 1.0, 40.0  # a = 1, b = 40: the second sequence's state grows 161-fold a token
    C = config.cpu_backward_checkpoint(N, F, M1, 8)
    with np.errstate(all="ignore"):
        ref = dplr_scan_backward(*[np.array(x) for x in args], NORM_NONE, 0.0, C)
        got = dplr_chunked_backward(*[np.array(x) for x in args], NORM_NONE, 0.0, 8)
    assert not np.isfinite(ref[0][1]).all()
    for name, x, y in zip(NAMES, ref, got):
        np.testing.assert_array_equal(x[1], y[1], err_msg=name)
        np.testing.assert_allclose(y[0], x[0], rtol=0, atol=5e-14 * np.abs(x[0]).max(initial=1.0), err_msg=name)


def test_empty_sequence(rng):
    args = _arrays(rng, 2, 0, 4, 3, 1, 1, 4)
    got = dplr_chunked_backward(*args, NORM_NONE, 0.0)
    np.testing.assert_array_equal(got[-1], args[-1])  # dH0 = dH
    assert got[0].shape == (2, 0, 4)


def test_vjp_methods_agree_and_auto_follows_the_features(rng, monkeypatch):
    """dplr_attention_vjp with method="chunked" equals method="scan" (a named rule, float32 inputs);
    "auto" takes the chunked backward from config.DPLR_BACKWARD_CHUNKED_MIN_FEATURES features on."""
    import linattn_nb.ops.dplr.chunked_grad as cg

    B, N, D = 2, 40, 6
    q, k, v = (rng.standard_normal((B, N, D)).astype(np.float32) for _ in range(3))
    g = rng.standard_normal((B, N, D)).astype(np.float32)
    kw = dict(rule="kda", decay=rng.uniform(0.5, 1.0, (B, N, D)), beta=rng.uniform(0, 1, (B, N)), feature_map="l2")
    a = dplr_attention_vjp(q, k, v, g, method="scan", **kw)
    b = dplr_attention_vjp(q, k, v, g, method="chunked", **kw)
    for x, y in [(a.dq, b.dq), (a.dk, b.dk), (a.dv, b.dv)] + [(a.d_inputs[n], b.d_inputs[n]) for n in a.d_inputs]:
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6 * np.abs(x).max())
    calls = []
    real = cg.dplr_chunked_backward
    monkeypatch.setattr(cg, "dplr_chunked_backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(config, "DPLR_BACKWARD_CHUNKED_MIN_FEATURES", D + 1)
    dplr_attention_vjp(q, k, v, g, **kw)
    assert calls == []
    monkeypatch.setattr(config, "DPLR_BACKWARD_CHUNKED_MIN_FEATURES", D)
    dplr_attention_vjp(q, k, v, g, **kw)
    assert calls == [1]
