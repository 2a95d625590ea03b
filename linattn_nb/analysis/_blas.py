"""Keep OpenBLAS single-threaded while a Numba ``prange`` kernel calls ``np.dot``.

``np.dot`` inside ``@njit`` calls SciPy's BLAS.  When every ``prange``
thread calls a GEMM and OpenBLAS runs each GEMM on its own thread pool as
well, the threads oversubscribe the cores and OpenBLAS's idle threads spin:
measured on the 2-core development machine, the approximation-error kernel
at N = 4096 used 2.96 s of CPU with OpenBLAS's default threads and 1.03 s
with one thread per GEMM (same result).  :func:`single_threaded_blas` sets
the thread count of every OpenBLAS already loaded in the process to 1 for
the duration of a ``with`` block and restores it afterwards.  Where no
OpenBLAS is found (another BLAS, no ``/proc``) it does nothing.

It changes a process-wide setting: NumPy matrix products run concurrently
in other Python threads are single-threaded while the block runs.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading

# (setter, getter) symbol names of the OpenBLAS builds NumPy and SciPy ship.
_SYMBOLS = (
    ("openblas_set_num_threads", "openblas_get_num_threads"),
    ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
    ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
    ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
)

_lock = threading.Lock()
_cache: dict = {}


def _loaded_openblas_paths():
    try:
        with open("/proc/self/maps") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    paths = set()
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and "openblas" in os.path.basename(parts[-1]).lower():
            paths.add(parts[-1])
    return sorted(paths)


def _controls():
    """(set, get) function pairs of the loaded OpenBLAS libraries."""
    try:  # the BLAS Numba's np.dot calls; load it before looking
        import scipy.linalg.cython_blas  # noqa: F401
    except ImportError:  # pragma: no cover - SciPy is a dependency
        pass
    paths = tuple(_loaded_openblas_paths())
    if paths in _cache:
        return _cache[paths]
    found = []
    noload = getattr(os, "RTLD_NOLOAD", 0)
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=noload)
        except OSError:
            continue
        for set_name, get_name in _SYMBOLS:
            setter = getattr(lib, set_name, None)
            getter = getattr(lib, get_name, None)
            if setter is not None and getter is not None:
                setter.argtypes = [ctypes.c_int]
                setter.restype = None
                getter.argtypes = []
                getter.restype = ctypes.c_int
                found.append((setter, getter))
                break
    _cache[paths] = found
    return found


@contextlib.contextmanager
def single_threaded_blas():
    """Context manager: OpenBLAS uses one thread per call inside the block."""
    with _lock:
        controls = _controls()
        saved = [(setter, getter()) for setter, getter in controls]
        for setter, _ in saved:
            setter(1)
    try:
        yield
    finally:
        with _lock:
            for setter, n in saved:
                setter(n)
