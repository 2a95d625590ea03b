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
import sys


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

# The simulator runs each CUDA thread of a block as a Python thread, and its block loop polls them for
# syncthreads() without blocking: at the interpreter's default switch interval (5 ms) every barrier waits
# for the polling thread to give the GIL up.  A 10 us interval made one simulated scan call (B = 3, N = 8,
# F = 3, M = 4) 12x faster (1.55 -> 0.13 s).  Scheduling only: every kernel runs the same threads and
# barriers and computes the same results.  Not on a real GPU.
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    sys.setswitchinterval(1e-5)


ROOT = pathlib.Path(__file__).resolve().parents[1]

# The tests mirror the package (tests/state/, tests/analysis/, ...).  pytest puts a test file's own
# folder on sys.path, so a helper module next to its tests (``from _ptx import ...``) imports by name;
# a helper used from other folders as well (tests/state/_state_files.py by test_mutation_catches.py,
# tests/feature_maps/_bad_maps.py by the analysis tests) needs its folder on sys.path from the start:
# every folder of tests/ that holds a helper module is put there here.
for _helpers in sorted({p.parent for p in (ROOT / "tests").glob("*/_*.py")}):
    if str(_helpers) not in sys.path:
        sys.path.append(str(_helpers))

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

# method="auto" follows config.AUTO_METHODS only: a calibration of this machine stored by
# ``linattn tune`` (docs/tuning.md) would make the methods the tests run depend on timings.
os.environ["LINATTN_AUTO_TUNE"] = "off"

from linattn_nb import _cache  # noqa: E402  (installs the cache locator: after the settings above)


def _lock_simulator_shared_arrays() -> None:
    """Make the simulator's ``cuda.shared.array`` safe for its threads.

    numba-cuda's simulator (``FakeCUDAShared.array``) finds a block's shared array by the calling line
    and creates it on first use with no lock: two simulated threads of a block's first call can each
    create their own, and the kernel then reads a copy that the other threads never wrote (seen once in
    about ten runs of tests/ops/test_cuda_transfers.py at the default switch interval; every time with a
    1 ms sleep planted in the gap, and more often with the short interval set above).  The same lookup,
    keyed as there (the caller's file and line), under a lock."""
    import threading

    import numpy
    from numba.cuda.simulator import kernelapi

    original = kernelapi.FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = numpy.empty(shape, dtype)
        return res

    kernelapi.FakeCUDAShared.array = array


if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    _lock_simulator_shared_arrays()

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


# ---------------------------------------------------------------------------
# The fast tier: ``python -m pytest -m "not slow"``
# ---------------------------------------------------------------------------
#: Files whose tests are marked ``slow`` as a whole: the CUDA kernels on the simulator and their
#: PTX, every array layout of every entry point, the notebooks, the README and docs builds, the
#: report and sweep end to end, installs, fitting runs, the mutation checks and the serial/parallel
#: kernel twins.  The fast tier leaves them out (and the tests of ``SLOW_TESTS`` and the
#: parametrisations of ``_slow_parametrisation`` below) and still runs every rule on every method
#: forward and backward on small shapes in float64 (``tests/rules/test_rules.py``, the CUDA methods
#: included, ``tests/ops/test_grad_cpu.py``, ``tests/rules/test_dplr.py``), the CPU kernels against
#: their references, the front ends, states, analyses, feature maps and the torch adapter.
SLOW_FILES = frozenset({
    "ops/test_cuda.py", "ops/test_cuda_launchable.py", "ops/test_cuda_transfers.py", "ops/test_decay_cuda.py",
    "ops/test_delta_cuda.py", "ops/test_grad_cuda.py", "ops/test_step_cuda.py",
    "studies/test_report.py", "studies/test_report_background.py",
    "studies/test_sweep.py", "studies/test_learned_study.py", "studies/test_mqar.py",
    "fitting/test_fitted_maps_paths.py", "fitting/test_fitting.py",
    "test_layouts.py", "test_notebooks.py", "test_readme.py", "test_docs.py", "test_doctests.py", "test_install.py",
    "test_cli.py", "test_mutation_catches.py", "test_numerics.py", "test_device.py", "rules/test_dplr_cuda.py",
    "ops/test_serial_parallel.py",
    # the chunked DPLR backward against the scan backward on edge shapes; the fast tier checks it by
    # central differences (tests/rules/test_dplr.py, method="chunked"), which compiles it once
    "ops/test_dplr_chunked_grad.py",
})


#: Tests (``file::function``, every parametrisation) marked ``slow`` on their own.  Numba compiles each
#: kernel once per signature, and a first compilation costs seconds: each of these is the only fast test
#: that needs a specialisation (a batch- or sequence-parallel twin, a non-contiguous or read-only layout,
#: a long sequence), compiles the same kernels a second time in a subprocess, or compiles kernels the
#: other worker compiles at the same moment.  The full suite runs them.
SLOW_TESTS = frozenset({
    # the parallel twins of the kernels (the small calls of the fast tier take the serial ones)
    "ops/test_grad_cpu.py::test_parallel_kernels",
    "ops/test_causal_chunked.py::test_parallel_and_serial_kernels_agree",
    "ops/test_causal_chunked.py::test_sequence_parallel_equals_batch_parallel",
    "ops/test_causal_chunked.py::test_sequence_parallel_many_segments",
    "ops/test_causal_chunked.py::test_noncausal_kernel_pieces_and_dtypes",
    "ops/test_grad_delta_chunked.py::test_default_chunk_and_parallel",
    "ops/test_causal_chunked.py::test_auto_uses_chunked_and_blas_threads_restored",
    "ops/test_delta.py::test_batch_below_and_above_threads",
    "ops/test_decay.py::test_chunked_sequence_splitting",
    "ops/test_decay.py::test_chunked_many_segments_and_pieces",
    "analysis/test_decay_analysis.py::test_recall_decay_trades_old_pairs_for_recent_ones",
    "test_linear_attention.py::test_done_when_long_float32_causal",
    # non-contiguous, Fortran-ordered and read-only arrays: a second signature of each kernel
    "test_linear_attention.py::test_layouts_noncontiguous_fortran_readonly",
    "state/test_state.py::test_layouts_and_general_path",
    # a subprocess that compiles its kernels from cold (the parallel float32 forward and backward; the
    # calibration's kernels)
    "test_threads.py::test_workqueue_calls_from_threads_are_serialised",
    "test_tune.py::test_tune_command",
    # a study run end to end (grid, every rule and DPLR row, render), as tests/studies/ does
    "analysis/test_delta_analysis.py::test_rules_study_grid_and_floor_check",
    # float32 and float16 (which runs on the float32 kernels) beyond the public entry points' checks kept
    # fast below: each compiles float32 kernels in whichever worker runs its file
    "ops/test_delta.py::test_l2_maps_inline_float16",
    "ops/test_causal_chunked.py::test_float16_with_numpy_side_map",
    "ops/test_softmax.py::test_quadratic_method_and_float16",
    "state/test_state_decay.py::test_strong_decay_float32_no_overflow_or_nan",
    "feature_maps/test_feature_maps.py::test_favor_causal_output_ignores_future_tokens_bitwise",
    "feature_maps/test_feature_maps.py::test_favor_float32_large_inputs_do_not_overflow",
    # the DPLR kernels through the torch adapter: tests/rules/test_dplr.py compiles them in the other
    # worker, and both would compile the same backward at once
    "test_torch.py::test_dplr_gradcheck_general_form",
    "test_torch.py::test_dplr_gradcheck_general_form_substeps",
    "test_torch.py::test_dplr_gradcheck_named_rules",
    "test_torch.py::test_dplr_forward_equals_numpy_api",
    "test_torch.py::test_dplr_gradients_equal_the_vjp_and_constants_get_none",
    "test_torch.py::test_dplr_only_state_used_and_segments_chain",
    "test_torch.py::test_dplr_gradcheck_hedgehog_parameters",
    # the DPLR forward and both backward kernels at float64 in a second worker
    "feature_maps/test_l2_extreme_rows.py::test_dplr_attention_and_gradients_do_not_depend_on_a_row_scale",
})

#: Parameter values whose parametrisations are ``slow``: the parallel twins (``twin="parallel"``,
#: ``parallel=True``) and the float32 / float16 dtypes (float16 runs on the float32 kernels), a second
#: compilation of every kernel a test reaches.  The fast tier checks every kernel in float64 and keeps
#: float32 / float16 through the public entry points (``ops/test_causal_chunked.py::
#: test_public_api_dtypes_and_state``, ``test_linear_attention.py::test_float16_inputs_return_float16``).
_LOW_PRECISION = frozenset({"float16", "float32", "torch.float16", "torch.float32"})
#: Files that compile no kernel: their float32 cases stay fast.
_NUMPY_ONLY = frozenset({"feature_maps/test_feature_map_vjp.py", "analysis/test_spectral.py"})


def _slow_parametrisation(item, rel) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name, value in params.items():
        if name in ("twin", "parallel") and value in ("parallel", True):
            return True
        if "dtype" in name and rel not in _NUMPY_ONLY:
            label = str(value)
            try:
                label = np.dtype(value).name
            except TypeError:
                pass
            if label in _LOW_PRECISION:
                return True
    return False


def pytest_collection_modifyitems(config, items):
    tests = ROOT / "tests"
    for item in items:
        try:
            rel = pathlib.Path(str(item.fspath)).resolve().relative_to(tests).as_posix()
        except ValueError:
            continue
        name = getattr(item, "originalname", None) or item.name
        if rel in SLOW_FILES or f"{rel}::{name}" in SLOW_TESTS or _slow_parametrisation(item, rel):
            item.add_marker(pytest.mark.slow)
