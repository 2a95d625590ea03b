"""The result check shared by the CPU kernel tests of the rules with per-token inputs (test_decay.py, test_delta.py)."""
from __future__ import annotations

import numpy as np


def check_result(out, H, ref, dtype, tol, what=""):
    """No NaN/inf anywhere; outputs and final state within ``tol`` of ``ref`` (relative to the largest).

    ``ref``: ``(out, S, z)`` of the float64 reference; ``H``: the kernel's final state ``[S | z]``;
    the state is held to ``max(tol, 1e-12)`` (it is float64 in every kernel).
    """
    o_ref, S, z = ref
    M = S.shape[2]
    assert out.dtype == np.dtype(dtype)
    assert np.isfinite(out).all(), f"{what}: NaN/inf (or unwritten) outputs"
    assert np.isfinite(H).all(), f"{what}: NaN/inf in the state"
    if out.size:
        err = np.abs(out.astype(np.float64) - o_ref).max() / max(np.abs(o_ref).max(), 1e-30)
        assert err <= tol, f"{what}: output relative error {err:.3g} > {tol}"
    for got, want, name in ((H[..., :M], S, "S"), (H[..., M], z, "z")):
        err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30) if want.size else 0.0
        assert err <= max(tol, 1e-12), f"{what}: final state {name} relative error {err:.3g}"
