"""Keep BLAS single-threaded while a Numba-parallel kernel calls it (through ``threadpoolctl``).

:func:`single_threaded_blas` pins BLAS to one thread (reference-counted across nested and concurrent
uses); :func:`parallel_calls` serialises parallel kernels under the ``workqueue`` threading layer.
Why: docs/frontend.md, "BLAS inside parallel kernels", and docs/threads.md.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading

from . import config

_lock = threading.Lock()
_controller = None
_limiter = None
_depth = 0
_layer_lock = threading.RLock()
_layer = None


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
    """Context manager: the process's BLAS libraries run one thread inside it (a process-wide setting;
    ``when=False``: nothing, for a serial kernel where BLAS's own threads may help).  It also enters
    :func:`parallel_calls`."""
    if not when:
        yield
        return
    with parallel_calls(), (_pinned() if config.CPU_BLAS_SINGLE_THREAD else contextlib.nullcontext()):
        yield


@contextlib.contextmanager
def _pinned():
    global _depth, _limiter
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


def threading_layer() -> str:
    """Numba's threading layer: ``"omp"``, ``"tbb"`` or ``"workqueue"``; before the first parallel kernel,
    the one Numba will choose, without starting the thread pool (a pool started for nothing would
    make GNU OpenMP refuse parallel kernels in forked children)."""
    global _layer
    if _layer is None:
        import numba

        try:
            _layer = numba.threading_layer()
        except ValueError:  # no parallel kernel has run yet
            return _predicted_layer(numba.config)
    return _layer


def layer_problem(layer: str) -> str | None:
    """Why Numba cannot load the threading ``layer`` (``"tbb"``, ``"omp"``, ``"workqueue"``), or None.

    Imports the layer's module as Numba does at the first parallel kernel (for TBB, with Numba's check of
    the TBB version), without starting a thread pool.
    """
    import importlib

    try:
        if layer == "tbb":
            from numba.np.ufunc import parallel

            check = getattr(parallel, "_check_tbb_version_compatible", None)
            if check is not None:
                check()
        importlib.import_module("numba.np.ufunc." + ("workqueue" if layer == "workqueue" else layer + "pool"))
    except Exception as exc:  # ImportError, OSError: the library is missing or too old
        return f"{type(exc).__name__}: {exc}"
    return None


def _gnu_openmp() -> bool:
    """Whether Numba's ``omp`` layer is GNU OpenMP on Linux (not fork-safe: Numba's ``forksafe`` leaves it out)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        from numba.np.ufunc import omppool

        return str(getattr(omppool, "openmp_vendor", "GNU")) == "GNU"
    except Exception:  # noqa: BLE001 - no omp layer: it is not chosen anyway
        return True


def _predicted_layer(cfg) -> str:
    """The layer Numba's own choice gives for ``cfg.THREADING_LAYER``: a named one as it is; ``safe`` is TBB
    only (named in effect: Numba fails without it); ``threadsafe`` TBB or OpenMP; ``forksafe`` TBB,
    OpenMP unless it is GNU OpenMP on Linux, or workqueue; ``default`` any, in the priority order."""
    name = str(cfg.THREADING_LAYER).lower()
    if name in ("tbb", "omp", "workqueue"):
        return name  # named: Numba loads it or fails (layer_problem says which)
    if name == "safe":
        return "tbb"  # the only layer both thread- and fork-safe: loaded or Numba fails
    forksafe = ("tbb",) + (() if _gnu_openmp() else ("omp",)) + ("workqueue",)
    allowed = {"threadsafe": ("tbb", "omp"), "forksafe": forksafe}.get(name, ("tbb", "omp", "workqueue"))
    for layer in cfg.THREADING_LAYER_PRIORITY:
        if layer in allowed and layer_problem(layer) is None:
            return layer
    return "workqueue"


@contextlib.contextmanager
def parallel_calls(when: bool = True):
    """Context manager: one Python thread at a time inside it (a re-entrant process-wide lock) when Numba's
    layer is ``workqueue``, which aborts the process when two threads enter parallel regions at once
    (docs/threads.md); nothing under ``omp`` and ``tbb``.  Also :func:`keep_torch_threads` until Numba's
    pool has started."""
    with keep_torch_threads():
        if not when or threading_layer() != "workqueue":
            yield
            return
        with _layer_lock:
            yield


@contextlib.contextmanager
def keep_torch_threads():
    """Context manager: torch's thread count (where torch is imported) as it was before, if the first parallel
    kernel started Numba's pool inside.  Numba's ``omp`` layer sets the OpenMP thread count of the thread that
    starts it to its own (``omp_set_num_threads``), which is also the count torch reads and runs its ops
    with: a script's ``torch.set_num_threads(1)`` was undone by its first call.  Nothing once the pool runs."""
    torch = sys.modules.get("torch")
    if torch is None or _layer is not None or not hasattr(torch, "get_num_threads"):
        yield
        return
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if threading_layer() and _layer is not None and torch.get_num_threads() != before:
            torch.set_num_threads(before)


def parallel_entry(fn):
    """Decorator: ``fn`` runs inside :func:`parallel_calls` (for the front ends that reach parallel kernels)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with parallel_calls():
            return fn(*args, **kwargs)

    return wrapper


def blas_threads() -> list:
    """Current thread counts of the BLAS libraries found (for tests and reports)."""
    return [int(info["num_threads"]) for info in _blas_controller().info()]
