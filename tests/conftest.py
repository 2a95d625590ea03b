"""Test-suite set-up.

Both settings below (the CUDA simulator and the kernel cache folder) must be
made before numba and linattn_nb are first imported, so they are made here,
at the top of the first module pytest loads.

The CUDA kernels are tested everywhere: when no CUDA driver is present, the
Numba CUDA simulator is switched on here, before numba is first imported
(NUMBA_ENABLE_CUDASIM is read at numba's import).  On a machine with a driver
the real GPU is used and the simulator stays off.
"""
from __future__ import annotations

import ctypes
import os
import pathlib
import shutil


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


ROOT = pathlib.Path(__file__).resolve().parents[1]

# The package keys its kernel cache on a hash of its sources (linattn_nb/_cache.py):
# Numba keys a cached kernel on its own source file only, so a kernel that inlines
# a helper from another module (ops/_vec.py, ops/_common.py, ...) would run stale
# machine code after an edit of that helper.  The tests use the same mechanism with
# the root in the checkout (.numba_cache/<version>-<hash>, subprocesses included),
# and remove the folders of other sources at once.  A NUMBA_CACHE_DIR or
# LINATTN_CACHE_DIR set by the caller is left alone.
_OWN_CACHE = "NUMBA_CACHE_DIR" not in os.environ and "LINATTN_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["LINATTN_CACHE_DIR"] = str(ROOT / ".numba_cache")

from linattn_nb import _cache  # noqa: E402  (installs the cache locator: after the settings above)

if _OWN_CACHE and _cache.cache_folder()[0] is not None:
    _keep = pathlib.Path(_cache.cache_folder()[0])
    for _old in _keep.parent.iterdir():
        if _old != _keep and _old.is_dir():
            shutil.rmtree(_old, ignore_errors=True)

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


@pytest.fixture
def python_sigint_handler():
    """Python's own SIGINT handler for the test (a runner may have installed another)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
