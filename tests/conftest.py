"""Test-suite set-up.

Both settings below must be in the environment before numba is first
imported, so they are made here, at the top of the first module pytest loads.

The CUDA kernels are tested everywhere: when no CUDA driver is present, the
Numba CUDA simulator is switched on here, before numba is first imported
(NUMBA_ENABLE_CUDASIM is read at numba's import).  On a machine with a driver
the real GPU is used and the simulator stays off.
"""
from __future__ import annotations

import ctypes
import hashlib
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


def _source_keyed_cache_dir() -> str:
    """A Numba cache directory keyed by a hash of the package's sources.

    Numba keys a cached kernel on its own source file only, so a kernel that
    inlines a helper from another module (ops/_vec.py, ops/_common.py, ...)
    is not recompiled when that helper changes, and the tests would run stale
    machine code.  Keying the directory on every source file makes each test
    run compile against the sources it sees; directories of older sources are
    removed.
    """
    root = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha1()
    for path in sorted((root / "linattn_nb").rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    base = root / ".numba_cache"
    target = base / digest.hexdigest()[:16]
    if base.is_dir():
        for old in base.iterdir():
            if old != target and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
    target.mkdir(parents=True, exist_ok=True)
    return str(target)


if "NUMBA_CACHE_DIR" not in os.environ:
    os.environ["NUMBA_CACHE_DIR"] = _source_keyed_cache_dir()

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
