"""Helpers shared by the decoding tests of the rules with per-token inputs (test_state_decay.py, test_state_delta.py).

Ground truth is ``linear_attention(..., causal=True, method="quadratic")``: the explicit float64 form.
"""
from __future__ import annotations

import numpy as np

import linattn_nb as la

TOL = {np.float64: 1e-11, np.float32: 3e-5}


def assert_close(actual, expected, dtype=np.float64):
    """Finite, same shape, and within ``TOL[dtype]`` of ``expected`` relative to its largest magnitude (>= 1)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.isfinite(actual).all(), "NaN or inf in the result"
    if not expected.size:
        return
    scale = max(float(np.max(np.abs(expected))), 1.0)
    err = float(np.max(np.abs(actual - expected)))
    assert err <= TOL[np.dtype(dtype).type] * scale, f"max abs error {err:.3e} (scale {scale:.3e})"


def qkv(rng, batch, n, d, m, dtype=np.float64):
    """Standard normal q, k (batch + (n, d)) and v (batch + (n, m)) of ``dtype``."""
    return (rng.standard_normal(batch + (n, d)).astype(dtype), rng.standard_normal(batch + (n, d)).astype(dtype),
            rng.standard_normal(batch + (n, m)).astype(dtype))


def ref(q, k, v, **kw):
    """float64 outputs and final state of the quadratic reference."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    return la.linear_attention(q, k, v, causal=True, method="quadratic", return_state=True, **kw)
