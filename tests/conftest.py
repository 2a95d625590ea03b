"""Test-suite set-up.

The CUDA kernels are tested everywhere: when no CUDA driver is present, the
Numba CUDA simulator is switched on here, before numba is first imported
(NUMBA_ENABLE_CUDASIM is read at numba's import).  On a machine with a driver
the real GPU is used and the simulator stays off.
"""
from __future__ import annotations

import ctypes
import os


def _cuda_driver_present() -> bool:
    for lib in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            ctypes.CDLL(lib)
            return True
        except OSError:
            continue
    return False


if "NUMBA_ENABLE_CUDASIM" not in os.environ and not _cuda_driver_present():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Hypothesis: deterministic in CI, no deadline (first calls compile kernels).
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def rng():
    return np.random.default_rng(12345)
