"""Keep BLAS single-threaded while a Numba-parallel kernel calls it.

``np.dot`` inside ``@njit`` calls the BLAS that SciPy links (with the PyPI
wheels a pthreads OpenBLAS).  OpenBLAS multithreads a GEMM once it is large
enough, and when every Numba thread does that at once the cores are
oversubscribed and OpenBLAS's idle threads spin: the kernels that call BLAS
from parallel loops ran several times slower (docs/measurements-cpu.md) until
BLAS was pinned to one thread for the duration of the call.

:func:`single_threaded_blas` does that pinning through ``threadpoolctl`` (the
maintained library for exactly this) and restores the previous limits on
exit.  Nested and concurrent uses (several Python threads calling kernels)
share one reference count, so the limit is lifted only when the last user
leaves.  ``config.CPU_BLAS_SINGLE_THREAD = False`` disables the pinning.
"""
from __future__ import annotations

import contextlib
import threading

from . import config

_lock = threading.Lock()
_controller = None
_limiter = None
_depth = 0


def _blas_controller():
    """threadpoolctl's view of the BLAS libraries loaded (SciPy's included)."""
    global _controller
    if _controller is None:
        import scipy.linalg.cython_blas  # noqa: F401  (load the BLAS Numba's np.dot calls)
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController().select(user_api="blas")
    return _controller


@contextlib.contextmanager
def single_threaded_blas(when: bool = True):
    """Context manager: the process's BLAS libraries run one thread inside it.

    This changes a process-wide setting: NumPy matrix products run at the same
    time in other Python threads are single-threaded while a kernel runs.
    ``when=False`` makes it do nothing (a launcher that runs its serial
    kernel on the calling thread, where BLAS's own threads may help, passes
    ``kernel is parallel_kernel``).
    """
    global _depth, _limiter
    if not when or not config.CPU_BLAS_SINGLE_THREAD:
        yield
        return
    with _lock:
        if _depth == 0:
            _limiter = _blas_controller().limit(limits=1)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _limiter is not None:
                _limiter.restore_original_limits()
                _limiter = None


def blas_threads() -> list:
    """Current thread counts of the BLAS libraries found (for tests and reports)."""
    return [int(info["num_threads"]) for info in _blas_controller().info()]
