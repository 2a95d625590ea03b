"""Keep BLAS single-threaded while a Numba-parallel kernel calls it.

``np.dot`` inside ``@njit`` calls the BLAS that SciPy links (``scipy.linalg.
cython_blas``; with the PyPI wheels a pthreads OpenBLAS).  OpenBLAS
multithreads a GEMM once ``m * n * k`` reaches about 64**3, and when every
Numba thread does that at once its pool is oversubscribed: measured here
(2 cores) with the chunked causal kernel at B*H = 16, N = 4096, D = M = 64,
chunk 96 ran 12x slower than chunk 64 until the BLAS was pinned to one thread
for the duration of the call.  :func:`single_threaded_blas` does that pinning
and restores the previous setting on exit; nested and concurrent uses share
one reference count.

Libraries are found among those loaded in the process (Linux:
``/proc/self/maps``; elsewhere through ``threadpoolctl`` when it is installed);
unknown BLAS libraries are left alone.  ``config.CPU_BLAS_SINGLE_THREAD = False``
disables the pinning.
"""
from __future__ import annotations

import contextlib
import ctypes
import re
import sys
import threading

from .. import config

_SYMBOLS = (
    ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
    ("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
    ("openblas_get_num_threads", "openblas_set_num_threads"),
    ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
    ("MKL_Get_Max_Threads", "MKL_Set_Num_Threads"),
)

_lock = threading.Lock()
_controls = None  # list of (get, set) callables
_depth = 0
_saved: list = []


def _linux_libraries():
    try:
        with open("/proc/self/maps") as fh:
            maps = fh.read()
    except OSError:
        return []
    return sorted(set(re.findall(r"(/\S*(?:blas|mkl_rt)\S*\.so[\w.]*)", maps)))


def _find_controls():
    global _controls
    if _controls is not None:
        return _controls
    controls = []
    try:  # load the library Numba's np.dot will call
        import scipy.linalg.cython_blas  # noqa: F401
    except Exception:  # pragma: no cover - SciPy missing: np.dot in njit is unavailable anyway
        pass
    if sys.platform.startswith("linux"):
        for path in _linux_libraries():
            try:
                lib = ctypes.CDLL(path)
            except OSError:  # pragma: no cover
                continue
            for get_name, set_name in _SYMBOLS:
                if hasattr(lib, get_name) and hasattr(lib, set_name):
                    getter = getattr(lib, get_name)
                    setter = getattr(lib, set_name)
                    getter.restype = ctypes.c_int
                    setter.argtypes = [ctypes.c_int]
                    setter.restype = None
                    controls.append((getter, setter))
                    break
    else:  # pragma: no cover - exercised on macOS / Windows only
        try:
            from threadpoolctl import ThreadpoolController

            ctl = ThreadpoolController().select(user_api="blas")
            for lib in ctl.lib_controllers:
                controls.append((lib.get_num_threads, lib.set_num_threads))
        except Exception:
            pass
    _controls = controls
    return controls


@contextlib.contextmanager
def single_threaded_blas():
    """Context manager: the process's BLAS libraries run one thread inside it."""
    global _depth, _saved
    if not config.CPU_BLAS_SINGLE_THREAD:
        yield
        return
    controls = _find_controls()
    with _lock:
        if _depth == 0:
            _saved = []
            for getter, setter in controls:
                n = int(getter())
                _saved.append(n)
                if n != 1:
                    setter(1)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for (getter, setter), n in zip(controls, _saved):
                    if n != 1:
                        setter(n)


def blas_threads() -> list:
    """Current thread counts of the BLAS libraries found (for tests and reports)."""
    return [int(getter()) for getter, _ in _find_controls()]
