"""Kernels compiled twice (serial and parallel, linattn_nb.ops._twins): both
variants give the same numbers, bit for bit, and match the references.

The launchers pick the serial kernel below a work threshold; the thresholds
are forced here so that each variant runs on the same small inputs.
"""
from __future__ import annotations

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import config as cfg
from linattn_nb.ops.causal.naive import causal_linear_quadratic

from test_softmax import direct_softmax

THRESHOLDS = ("CPU_CHUNKED_SERIAL_MAX_WORK", "SOFTMAX_SERIAL_MAX_WORK")


def _both(monkeypatch, fn):
    """fn() under serial-only and parallel-only thresholds."""
    res = []
    for value in (1 << 60, 0):
        for name in THRESHOLDS:
            monkeypatch.setattr(cfg, name, value)
        res.append(fn())
    return res


def _elu1(x):
    x = np.asarray(x, np.float64)
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 5, 33])
def test_scan_serial_equals_parallel(monkeypatch, rng, dtype, n):
    q, k = (rng.standard_normal((3, 2, n, 4)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((3, 2, n, 3)).astype(dtype)
    ser, par = _both(monkeypatch, lambda: la.linear_attention(q, k, v, causal=True, method="scan",
                                                              return_state=True))
    assert np.array_equal(ser[0], par[0], equal_nan=True)
    assert np.array_equal(ser[1].S, par[1].S) and np.array_equal(ser[1].z, par[1].z)
    ref, _, _ = causal_linear_quadratic(_elu1(q).reshape(6, n, 4), _elu1(k).reshape(6, n, 4),
                                        v.astype(np.float64).reshape(6, n, 3), eps=1e-6)
    tol = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(par[0].astype(np.float64).reshape(6, n, 3), ref, rtol=tol * 10, atol=tol)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_serial_equals_parallel(monkeypatch, rng, causal, dtype):
    q, k = (rng.standard_normal((3, 37, 5)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((3, 37, 4)).astype(dtype)
    monkeypatch.setattr(cfg, "SOFTMAX_BLOCK_Q", 8)  # several tasks per sequence
    ser, par = _both(monkeypatch, lambda: la.softmax_attention(q, k, v, causal=causal))
    # Bit for bit in every run here; once (float64, non-causal, an xdist worker on a loaded host, a cold
    # cache) the twins differed: Numba can optimise a twin loaded from its disk cache differently from
    # one compiled fresh (numba/numba#10617, see ops/softmax/cpu.py).  A few ulp, not more, is allowed.
    eps = np.finfo(dtype).eps
    np.testing.assert_allclose(par, ser, rtol=4 * eps, atol=4 * eps)
    tol = 2e-6 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(par, direct_softmax(q, k, v, causal), rtol=tol * 10, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_noncausal_serial_equals_parallel(monkeypatch, rng, dtype):
    q, k = (rng.standard_normal((3, 29, 4)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((3, 29, 3)).astype(dtype)
    ser, par = _both(monkeypatch, lambda: la.linear_attention(q, k, v, causal=False))
    assert np.array_equal(ser, par)
    fq, fk = _elu1(q), _elu1(k)
    a = fq @ np.swapaxes(fk, -1, -2)
    ref = (a @ v.astype(np.float64)) / a.sum(-1, keepdims=True)
    np.testing.assert_allclose(par, ref, rtol=2e-5 if dtype == np.float32 else 1e-12)
