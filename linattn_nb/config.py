"""Every tunable knob of linattn_nb in one place.

Values can be overridden by environment variables (``LINATTN_*``, read at import of this module) or
by assigning to the module attributes at run time (``config.CPU_CHUNK_SIZE = 128``): launchers read
them at call time.  Guide: docs/guide/configuration.md.
"""
from __future__ import annotations

import os


def _env_int(name: str, default, kind=int):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError as exc:  # pragma: no cover - misconfiguration
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"environment variable {name}={raw!r} is not {what}") from exc
    if kind is int and value < 0:  # every integer knob is a size, a count or a switch
        raise ValueError(f"environment variable {name}={raw!r} must be an integer >= 0")
    return value


def _env_float(name: str, default: float, low: float | None = None) -> float:
    value = _env_int(name, default, float)
    if value != value or (low is not None and value < low):  # NaN, or below the range
        raise ValueError(f"environment variable {name}={os.environ.get(name)!r} must be a number"
                         + (f" >= {low:g}" if low is not None else ""))
    return value


def _env_bit(name: str, default: int) -> int:
    """A switch documented as the integers 0 or 1 (any other integer, e.g. 7, is refused, not taken as on)."""
    value = _env_int(name, default)
    if value not in (0, 1):
        raise ValueError(f"environment variable {name}={os.environ.get(name)!r} must be 0 or 1")
    return value


_YES = ("1", "true", "yes", "on")
_NO = ("0", "false", "no", "off")


def _env_flag(name: str, default: bool) -> bool:
    """An on/off variable: 1/true/yes/on or 0/false/no/off in any case; unset or empty: ``default``."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _YES or raw in _NO:
        return raw in _YES
    raise ValueError(f"environment variable {name}={os.environ[name]!r} must be one of "
                     f"{'/'.join(_YES)} or {'/'.join(_NO)}")


# --------------------------------------------------------------------------
# Threads between kernels
# --------------------------------------------------------------------------
#: How idle OpenMP threads wait (``OMP_WAIT_POLICY``), set to passive here before Numba starts its
#: thread pool unless the environment names one (why: docs/guide/configuration.md, docs/threads.md).
OMP_WAIT_POLICY = os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# --------------------------------------------------------------------------
# Numba compilation flags
# --------------------------------------------------------------------------
#: The single fastmath flag set used by every CPU kernel: without ``nnan`` and ``ninf``, so that NaN/Inf
#: checks and propagation keep working (docs/guide/configuration.md).
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

#: ``cache=True`` for kernels that take plain arrays: Numba's on-disk cache, outside the package
#: (:mod:`linattn_nb._cache`, docs/guide/configuration.md).  ``LINATTN_NO_CACHE=1`` disables it.
CACHE = not _env_flag("LINATTN_NO_CACHE", False)

#: The folder linattn_nb's kernels are cached in, set at import by :func:`linattn_nb._cache.install`
#: (None when caching is off).  Read-only: assigning it moves nothing.
CACHE_DIR = None

#: Cache folders of other versions or sources (``<version>-<hash>`` beside the
#: one in use) unused for this many days are removed at import; negative keeps
#: them all.
CACHE_PRUNE_DAYS = _env_float("LINATTN_CACHE_PRUNE_DAYS", 14.0)

# --------------------------------------------------------------------------
# Numerics
# --------------------------------------------------------------------------
#: Default floor of the normaliser phi(q)^T z (``clip(1e-8)`` of the NumPy
#: reference the package started from).
#: ``linear_attention(eps=None)`` disables the floor (raw signed division).
DEFAULT_EPS = _env_float("LINATTN_EPS", 1e-8, low=0.0)

# --------------------------------------------------------------------------
# CPU kernels
# --------------------------------------------------------------------------
#: Tokens per block in the non-causal CPU kernel (aggregate phase and query
#: phase both work on blocks of this many rows, GEMM-shaped through BLAS).
#: Chosen by measurement (figures: docs/measurements.md, "CPU_NONCAUSAL_BLOCK").
CPU_NONCAUSAL_BLOCK = _env_int("LINATTN_CPU_NONCAUSAL_BLOCK", 128)

#: Pin the BLAS that ``np.dot`` calls inside Numba kernels to one thread while a parallel CPU kernel
#: runs (why: docs/frontend.md, "BLAS inside parallel kernels").
CPU_BLAS_SINGLE_THREAD = _env_flag("LINATTN_BLAS_SINGLE_THREAD", True)

#: Chunk size C of ``method="chunked"`` (causal, CPU).  0 (default) picks it
#: from :data:`CPU_CHUNK_TABLE` through :func:`cpu_chunk_size`.
CPU_CHUNK_SIZE = _env_int("LINATTN_CPU_CHUNK_SIZE", 0)

#: Measured best (chunk size, row block) per working dtype: ``dtype name -> [(max F*M, C, block), ...]``,
#: the first row whose bound admits F*M (None = any) wins (docs/measurements.md, "CPU_CHUNK_TABLE").
#: ``method="auto"`` runs this machine's calibrated pair instead where ``linattn tune`` stored one
#: (docs/tuning.md, "The chunk size").
CPU_CHUNK_TABLE = {
    "float32": [(256, 16, 16), (1024, 24, 8), (None, 32, 8)],
    "float64": [(256, 16, 16), (None, 32, 8)],
}

#: Row block of the intra-chunk products of ``method="chunked"`` (docs/design-cpu.md).  0 (default)
#: takes the third entry of the :data:`CPU_CHUNK_TABLE` row; values are clipped to [1, C].
CPU_CHUNK_BLOCK = _env_int("LINATTN_CPU_CHUNK_BLOCK", 0)

#: Sequence parallelism of ``method="chunked"`` (batch*heads below the thread
#: count) splits a sequence into segments of at least this many chunks.
CPU_CHUNKED_MIN_SEGMENT_CHUNKS = _env_int("LINATTN_CPU_CHUNKED_MIN_SEGMENT_CHUNKS", 8)

#: Below this much work (B * N * D_phi * M) ``method="chunked"``, the scan and
#: the non-causal kernel run on the calling thread: entering a parallel region
#: costs more than the work there under load (docs/measurements.md,
#: "Serial or parallel").
CPU_CHUNKED_SERIAL_MAX_WORK = _env_int("LINATTN_CPU_CHUNKED_SERIAL_MAX_WORK", 1 << 21)


def knob_int(name: str) -> int:
    """``config.<name>`` as an int, for the size knobs assigned at run time: a float, string, bool or None
    raises TypeError naming the knob (``int()`` would truncate 2.5 to 2, and a string fail in a comparison), a
    negative value ValueError (the environment variable refuses it too; -5 read as "unset" would be silent)."""
    import numbers

    x = globals()[name]
    if type(x) is int and x >= 0:  # the usual case, first: pick() reads a threshold on every decode step
        return x
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"config.{name} must be an integer, got {x!r}")
    if x < 0:  # as its environment variable: 0 is "the default" where a knob has one
        raise ValueError(f"config.{name} must be >= 0, got {x}")
    return int(x)


def cpu_chunk_size(n: int, f: int, m: int, dtype) -> int:
    """Chunk size for ``method="chunked"`` on the CPU (``CPU_CHUNK_SIZE`` if set, else the table)."""
    size = knob_int("CPU_CHUNK_SIZE")
    if size > 0:
        return size
    return int(chunk_table_row(f, m, dtype)[1])


def cpu_chunk_block(c: int, f: int, m: int, dtype) -> int:
    """Row block for a chunk of ``c`` tokens (``CPU_CHUNK_BLOCK`` if set, else the table), in [1, c]."""
    blk = knob_int("CPU_CHUNK_BLOCK")
    blk = blk if blk > 0 else chunk_table_row(f, m, dtype)[2]
    return max(1, min(int(c), int(blk)))


def chunk_table_row(f: int, m: int, dtype) -> tuple:
    """The row ``(max F*M, C, block)`` of :data:`CPU_CHUNK_TABLE` for ``f`` features by ``m`` value columns of
    the working ``dtype`` (float32 for any dtype but float64)."""
    import numpy as np

    name = "float64" if np.dtype(dtype) == np.float64 else "float32"
    for row in CPU_CHUNK_TABLE.get(name, ()):
        if row[0] is None or f * m <= row[0]:
            return row
    return (None, 32, 16)


#: Chunk size C of the CPU chunked backward of the additive, decay and gate rules
#: (``linattn_nb.ops.grad.cpu.backward_chunked``; docs/design-cpu.md).  0 (default) picks
#: :func:`cpu_backward_chunk`.  The delta rules use :data:`BACKWARD_DELTA_CHUNK`.
BACKWARD_CHUNK = _env_int("LINATTN_BACKWARD_CHUNK", 0)

#: Checkpoint interval (tokens) of the CPU scan backward (``linattn_nb.ops.grad.cpu.backward_scan``;
#: docs/design-cpu.md).  0 (default) picks :func:`cpu_backward_checkpoint`.
BACKWARD_CHECKPOINT = _env_int("LINATTN_BACKWARD_CHECKPOINT", 0)


def cpu_backward_chunk(n: int, f: int, m: int, dtype) -> int:
    """Chunk size of the CPU chunked backward of the additive and gate rules (``BACKWARD_CHUNK`` if set,
    else 32), at most ``max(n, 1)``.

    32 against 64 (measured: docs/design-cpu.md, "Chunked backward"): 12-14 % less launcher time for the
    additive rule.  The gate rule, whose chunks run as GEMMs on ``Q * b`` and ``K / b``: 32 and 64 within
    3 % of each other, 16 slower (1.03-1.2x at f = 64 to 128)."""
    c = knob_int("BACKWARD_CHUNK")
    c = c if c > 0 else 32
    return max(1, min(int(c), int(n)))


#: The decay rule's normalised CPU backward keeps the state before every this-many-th chunk only (an
#: anchor; ``linattn_nb.ops.grad._cpu_chunked_decay``, docs/design-cpu.md) and carries the gradient that
#: crosses the other chunks as sums of pairs; at an anchor that gradient comes from the state itself, and
#: the carried sums' rounding (a random walk over the chunks since the last anchor) starts again.  1 keeps
#: every chunk's state in that kernel; 0 runs the kernel before it, which keeps every chunk's state and does
#: all but the states in its reverse pass.
BACKWARD_DECAY_ANCHOR = _env_int("LINATTN_BACKWARD_DECAY_ANCHOR", 4)

#: A chunk whose product of decays is below this is an anchor too: between anchors that gradient is
#: divided by a factor of the chunk, and this floor bounds how much the division can magnify the carried
#: rounding.  A value above 1 makes every chunk an anchor.
BACKWARD_DECAY_CARRY_MIN = _env_float("LINATTN_BACKWARD_DECAY_CARRY_MIN", 2.0 ** -10, low=0.0)


#: Chunk size and row block of the fused CPU backward of the normalised additive and decay rules
#: (``linattn_nb.ops.grad.cpu.backward_chunked_normalized``; docs/design-cpu.md).  0 (default) picks
#: :func:`cpu_backward_norm_chunk` and :func:`cpu_backward_norm_block`, or for a gradient of
#: ``method="auto"`` the pair this machine's calibration stored (``linattn tune``; docs/tuning.md, "The
#: backward's chunk size"); either knob set fixes the pair and the calibration does not time it.
BACKWARD_NORM_CHUNK = _env_int("LINATTN_BACKWARD_NORM_CHUNK", 0)
BACKWARD_NORM_BLOCK = _env_int("LINATTN_BACKWARD_NORM_BLOCK", 0)


def cpu_backward_norm_chunk(n: int, f: int, m1: int, dtype) -> int:
    """Chunk size of the fused CPU backward of the normalised additive and decay rules (``BACKWARD_NORM_CHUNK``
    if set, else 48), at most ``max(n, 1)``.

    48 with row blocks of 8 (docs/design-cpu.md, "Chunked backward of normalised outputs"): at f = m = 64,
    float32, one core, 2.68x the forward's CPU time against 2.81x at 32, 2.75x at 64 and 2.95x for whole
    (unblocked) chunks of 32 or 48."""
    c = knob_int("BACKWARD_NORM_CHUNK")
    c = c if c > 0 else 48
    return max(1, min(int(c), int(n)))


def cpu_backward_norm_block(c: int, f: int, m1: int, dtype) -> int:
    """Row block of that backward's intra-chunk products (``BACKWARD_NORM_BLOCK`` if set, else 8), in [1, c]."""
    blk = knob_int("BACKWARD_NORM_BLOCK")
    blk = blk if blk > 0 else 8
    return max(1, min(int(c), int(blk)))


def cpu_backward_checkpoint(n: int, f: int, m1: int, itemsize: int) -> int:
    """Checkpoint interval of the CPU scan backward (``BACKWARD_CHECKPOINT`` if set): by default the
    ``L = 8 f / itemsize`` at which a float64 state costs about the bytes of ``L`` value rows,
    clipped to [16, 256] and to ``max(n, 1)``."""
    c = knob_int("BACKWARD_CHECKPOINT")
    if c <= 0:
        c = min(256, max(16, (8 * int(f)) // max(1, int(itemsize))))
    return max(1, min(c, int(n)))


#: Chunk size (steps: tokens times sub-steps) of ``dplr_attention(method="chunked")`` on the CPU
#: (:mod:`linattn_nb.ops.dplr.chunked`); a chunk holds ``max(1, DPLR_CHUNK // r)`` tokens.  Measured:
#: docs/guide/configuration.md.
DPLR_CHUNK = _env_int("LINATTN_DPLR_CHUNK", 16)

#: Chunk size (steps) of the chunked DPLR backward on the CPU (:mod:`linattn_nb.ops.dplr.chunked_grad`),
#: float64 GEMMs per chunk.  Measured: docs/guide/configuration.md.
DPLR_BACKWARD_CHUNK = _env_int("LINATTN_DPLR_BACKWARD_CHUNK", 16)

#: ``dplr_attention_vjp(method="auto")`` runs the chunked backward where the forward would run
#: ``chunked`` (from :data:`DPLR_AUTO_CHUNKED_MIN` steps) and the state has at least this many features
#: (``D_phi``); the scan backward below, where a chunk's small GEMMs cost more than the scan's loops
#: (measured: docs/guide/configuration.md).
DPLR_BACKWARD_CHUNKED_MIN_FEATURES = _env_int("LINATTN_DPLR_BACKWARD_CHUNKED_MIN_FEATURES", 16)

#: ``dplr_attention(method="auto")`` runs ``chunked`` (on the CPU) from this many steps
#: (``N * r``) on, the scan below (measured: docs/guide/configuration.md).
DPLR_AUTO_CHUNKED_MIN = _env_int("LINATTN_DPLR_AUTO_CHUNKED_MIN", 32)

#: The DPLR kernels run on the calling thread below :data:`CPU_CHUNKED_SERIAL_MAX_WORK` multiply-adds
#: (``B N r D_phi (M + 1)``), the scan's counted this many times and its backward's
#: :data:`DPLR_SCAN_BACKWARD_WORK_WEIGHT` times: their per-token loops cost more per multiply-add than
#: the chunks' GEMMs, so their parallel kernels pay for themselves at a fraction of the chunked form's
#: work (measured: docs/guide/configuration.md).
DPLR_SCAN_WORK_WEIGHT = _env_int("LINATTN_DPLR_SCAN_WORK_WEIGHT", 4)
DPLR_SCAN_BACKWARD_WORK_WEIGHT = _env_int("LINATTN_DPLR_SCAN_BACKWARD_WORK_WEIGHT", 6)

#: The chunked DPLR path keeps the float32 features of q and k in work arrays of the calling thread,
#: reused by its next call of the same shape, each up to this many bytes (larger ones are fresh per
#: call; 0 turns reuse off).  Fresh pages per call cost a KDA call at the benchmark shape about 15%
#: and most of its spread (docs/dplr.md, "Measured").
DPLR_WORK_BYTES = _env_int("LINATTN_DPLR_WORK_BYTES", 64 << 20)

#: ``linear_attention_vjp`` keeps its own arrays (the features of q and k, ``[v | 1]``, the forward's
#: ``[num | den]``, what the delta rules' forward saves for the backward and the chunk-start states of the
#: decay and gate rules' fused backward) in work arrays of the calling
#: thread, reused by its next call of the same shape, each up to this many bytes (larger ones are fresh
#: per call; 0 turns reuse off).  The gradients it returns are always fresh arrays.  Fresh pages cost a
#: delta-rule VJP at the benchmark shape about a sixth of its time (docs/performance.md).
GRAD_WORK_BYTES = _env_int("LINATTN_GRAD_WORK_BYTES", 64 << 20)

#: ``linear_attention`` on the CPU converts float32 ``log_decay`` to the float64 its kernels read in a work
#: array of the calling thread, reused by its next call of the same shape, up to this many bytes (larger
#: ones are fresh per call; 0 turns reuse off).  A per-feature gate is as large as q and k: with fresh
#: pages the conversion took 3.4-3.7 ms against 1.2 ms at B*H = 16, N = 4096, F = 64 (docs/performance.md,
#: "The gate's log-factors").
FACTOR_WORK_BYTES = _env_int("LINATTN_FACTOR_WORK_BYTES", 64 << 20)

#: Below this much work (B * N * N * (D + M), halved when causal) the CPU
#: softmax kernel runs on the calling thread (see CPU_CHUNKED_SERIAL_MAX_WORK).
SOFTMAX_SERIAL_MAX_WORK = _env_int("LINATTN_SOFTMAX_SERIAL_MAX_WORK", 1 << 21)

#: Query rows and key columns per block in the CPU softmax kernel.  Memory is
#: O(block_q * block_k) per thread; the N x N matrix is never formed.
SOFTMAX_BLOCK_Q = _env_int("LINATTN_SOFTMAX_BLOCK_Q", 128)
SOFTMAX_BLOCK_K = _env_int("LINATTN_SOFTMAX_BLOCK_K", 256)

#: Above this many elements (N*N per batch*head) ``method="quadratic"`` refuses
#: to build the explicit N x N matrix and says so; it is a test reference.
QUADRATIC_MAX_ELEMENTS = _env_int("LINATTN_QUADRATIC_MAX_ELEMENTS", 1 << 26)

# --------------------------------------------------------------------------
# Feature maps and analysis
# --------------------------------------------------------------------------
#: FAVOR+ key features are shifted by ``max(0, max_i |w_i|^2/2 - headroom)`` (from the random matrix
#: only), so they are at most ``exp(headroom)``, far below the float32 maximum (derivation:
#: docs/guide/configuration.md).  Read when a map is built.
FAVOR_KEY_HEADROOM = _env_float("LINATTN_FAVOR_KEY_HEADROOM", 40.0, low=0.0)

#: Query rows per task in the approximation-error kernels
#: (:mod:`linattn_nb.analysis.error`).  Memory per task is about
#: ``block * N`` float64 numbers times four; the N x N matrix is never formed.
ANALYSIS_BLOCK_Q = _env_int("LINATTN_ANALYSIS_BLOCK_Q", 64)

# --------------------------------------------------------------------------
# method="auto"
# --------------------------------------------------------------------------
#: ``(rule, causal, device) -> [(max_n, method), ...]``, one table per
#: update rule (:mod:`linattn_nb.ops.registry`): the first row whose
#: ``max_n`` (inclusive; None = unbounded) admits the sequence length wins.
#: The rows must come from measurements (benchmarks/), not guesses.
AUTO_METHODS = {
    # causal CPU: the scan wins up to N = 2 (docs/measurements.md, "AUTO_METHODS")
    ("additive", True, "cpu"): [(2, "scan"), (None, "chunked")],
    ("additive", False, "cpu"): [(None, "aggregate")],
    # decay and gate rules: the scan up to N = 4 (docs/measurements.md, "AUTO_METHODS of the decay and
    # gate rules")
    ("decay", True, "cpu"): [(4, "scan"), (None, "chunked")],
    ("gate", True, "cpu"): [(4, "scan"), (None, "chunked")],
}

# --------------------------------------------------------------------------
# CUDA kernels (linattn_nb/ops/cuda/).  Read at every launch.
# --------------------------------------------------------------------------
#: Value columns per block of the sequence kernel (docs/cuda_kernels.md, "Thread layouts"); blocks
#: over the value dimension M run side by side (grid axis y).
CUDA_VALUE_COLS = _env_int("LINATTN_CUDA_VALUE_COLS", 64)
#: Register tile of a thread in the row-group layout: CUDA_ROWS_PER_THREAD state rows x
#: CUDA_COLS_PER_THREAD state columns; rows are doubled up to CUDA_MAX_ROWS_PER_THREAD when a block
#: would exceed CUDA_MAX_THREADS threads.  PROVISIONAL (docs/guide/configuration.md).
CUDA_ROWS_PER_THREAD = _env_int("LINATTN_CUDA_ROWS_PER_THREAD", 8)
CUDA_COLS_PER_THREAD = _env_int("LINATTN_CUDA_COLS_PER_THREAD", 4)
CUDA_MAX_ROWS_PER_THREAD = _env_int("LINATTN_CUDA_MAX_ROWS_PER_THREAD", 64)
#: The register tile of the delta rules (row groups always): 16 rows x 2 columns.  PROVISIONAL
#: (static counts: docs/guide/configuration.md).
CUDA_DELTA_ROWS_PER_THREAD = _env_int("LINATTN_CUDA_DELTA_ROWS_PER_THREAD", 16)
CUDA_DELTA_COLS_PER_THREAD = _env_int("LINATTN_CUDA_DELTA_COLS_PER_THREAD", 2)
#: Upper bound on threads per block of the sequence kernel (the kernels cap
#: it at 256 as well: 256 threads x 255 registers fit a block's registers).
CUDA_MAX_THREADS = _env_int("LINATTN_CUDA_MAX_THREADS", 1024)
#: Tokens staged through shared memory per tile (fewer when the tile would
#: exceed CUDA_SHARED_BYTES; static shared memory is limited to 48 KiB).
CUDA_TILE_TOKENS = _env_int("LINATTN_CUDA_TILE_TOKENS", 32)
CUDA_SHARED_BYTES = _env_int("LINATTN_CUDA_SHARED_BYTES", 40960)
#: Static shared memory per block the tile layout of the sequence kernel may take
#: (linattn_nb.ops.cuda.plan.tiles_fits): it decides only where the layout applies; the default is
#: the whole static limit, 48 KiB (docs/cuda_kernels.md).
CUDA_TILES_SHARED_BYTES = _env_int("LINATTN_CUDA_TILES_SHARED_BYTES", 49152)
#: Tokens per chunk of method="chunked" (causal) and of the non-causal
#: aggregate phase: chunks are processed in parallel.
CUDA_CHUNK_SIZE = _env_int("LINATTN_CUDA_CHUNK_SIZE", 256)
#: Threads per block and a cap on blocks of the grid-stride helper kernels
#: (state packing, prefix over chunks, finiteness check, copies).
CUDA_THREADS_PER_BLOCK = _env_int("LINATTN_CUDA_THREADS_PER_BLOCK", 256)
CUDA_MAX_HELPER_BLOCKS = _env_int("LINATTN_CUDA_MAX_HELPER_BLOCKS", 4096)
#: Bytes of device memory the workspace pool (linattn_nb/ops/_cuda_pool.py) keeps between calls, per
#: process (least recently used buffers freed first; a larger buffer is not kept; 0 turns the pool
#: off).  docs/cuda_kernels.md, "Workspaces and finiteness counters".
CUDA_WORKSPACE_BYTES = _env_int("LINATTN_CUDA_WORKSPACE_BYTES", 1 << 30)
#: Largest feature dimension D_phi the CUDA kernels accept (the value
#: dimension M is not limited: blocks over M).  Beyond it, a ValueError
#: suggests device="cpu".
CUDA_MAX_FEATURES = _env_int("LINATTN_CUDA_MAX_FEATURES", 1024)
#: method="auto" on CUDA, causal: "scan" when its owner-layout blocks reach
#: CUDA_AUTO_SCAN_BLOCKS_PER_SM per multiprocessor, or its row-group warps
#: CUDA_AUTO_SCAN_MIN_WARPS_PER_SM; otherwise the AUTO_METHODS rows below by sequence length.  The
#: same block count decides the layout of every sequence-kernel launch.  PROVISIONAL
#: (docs/guide/configuration.md).
CUDA_AUTO_SCAN_BLOCKS_PER_SM = _env_int("LINATTN_CUDA_AUTO_SCAN_BLOCKS_PER_SM", 4)
CUDA_AUTO_SCAN_MIN_WARPS_PER_SM = _env_int("LINATTN_CUDA_AUTO_SCAN_MIN_WARPS_PER_SM", 4)
#: ... except that a scan filling the GPU only through its tile or row-group warps gives way to the
#: AUTO_METHODS rows (the chunked method) from this many tokens on, for the rules that have such rows
#: (additive, decay, gate).  Measured on an NVIDIA H200 (132 SMs), B*H = 128, D = M = 64, float32:
#: chunked / scan 1.02 at N = 4096, 0.88 at 8192, 0.94 at 16384, 0.88 at 32768, 0.87 at 65536.
CUDA_AUTO_TILES_CHUNKED_MIN_N = _env_int("LINATTN_CUDA_AUTO_TILES_CHUNKED_MIN_N", 8192)
#: Compile the sequence kernel once per feature map (1, default: the map a compile-time constant),
#: or once for every map (0: a branch over the maps per staged element; fewer compilations).
#: PROVISIONAL (static counts: docs/guide/configuration.md).
CUDA_SPECIALIZE_MAPS = _env_bit("LINATTN_CUDA_SPECIALIZE_MAPS", 1)
#: Thread layout of the sequence kernel: "auto" (linattn_nb.ops._cuda_launch.seq_layout,
#: docs/cuda_kernels.md, "Choosing the layout"), "owner" (where it applies), "rows" (always row
#: groups) or "tiles" (where it applies, else the owner layout's rule).  PROVISIONAL: argued from
#: static SASS counts, not timed.
CUDA_SEQ_LAYOUT = os.environ.get("LINATTN_CUDA_SEQ_LAYOUT", "auto") or "auto"
#: Element offsets within a sequence in the sequence kernel: 1 (default) takes the kernel with
#: 32-bit offsets whenever every sequence spans fewer than 2^31 elements, the 64-bit kernel
#: otherwise; 0 always takes the 64-bit kernel (docs/cuda_kernels.md, "Global addressing").
CUDA_OFFSETS_32 = _env_bit("LINATTN_CUDA_OFFSETS_32", 1)
#: Vector loads in the sequence kernel's staging: 1 (default) reads four consecutive elements per
#: load wherever the layout allows it (linattn_nb.ops.cuda.views.vector_bits); 0: one at a time.
CUDA_VECTOR_LOADS = _env_bit("LINATTN_CUDA_VECTOR_LOADS", 1)
AUTO_METHODS[("additive", True, "cuda")] = [(2 * 256, "scan"), (None, "chunked")]
AUTO_METHODS[("additive", False, "cuda")] = [(None, "aggregate")]
# PROVISIONAL for the forgetting rules on CUDA: the additive rows (their kernels
# are the additive ones with one factor per token or row), unmeasured on a GPU.
AUTO_METHODS[("decay", True, "cuda")] = AUTO_METHODS[("additive", True, "cuda")]
AUTO_METHODS[("gate", True, "cuda")] = AUTO_METHODS[("additive", True, "cuda")]

# --------------------------------------------------------------------------
# linattn_nb.analysis (rank and capacity tools)
# --------------------------------------------------------------------------
#: Largest N for which the analysis tools form an explicit N x N attention
#: matrix (softmax weights, causal kernel weights, method="explicit").  At
#: 8192 the matrix takes 512 MiB in float64 and its SVD minutes.
ANALYSIS_EXPLICIT_MAX_N = _env_int("LINATTN_ANALYSIS_EXPLICIT_MAX_N", 8192)

#: Largest N for the explicit semiseparable rank (one SVD per split; the
#: splits are visited in decreasing order of min(i, N - i) and the scan stops
#: once no remaining split can beat the best rank found).
ANALYSIS_SEMISEPARABLE_EXPLICIT_MAX_N = _env_int("LINATTN_ANALYSIS_SEMISEPARABLE_EXPLICIT_MAX_N", 2048)

#: Rows per block of the streamed Householder QR (R factors of the N x D_phi
#: feature matrices): each block is transposed into a D_phi x block scratch
#: that should stay in cache.
ANALYSIS_QR_BLOCK = _env_int("LINATTN_ANALYSIS_QR_BLOCK", 128)

#: Bytes the factor-based semiseparable rank may spend on stored D_phi x D_phi
#: R factors (one per candidate split); above it the candidates are processed
#: in several groups, one extra pair of sweeps over the sequence per group.
ANALYSIS_MEMORY_BUDGET = _env_int("LINATTN_ANALYSIS_MEMORY_BUDGET", 256 << 20)

# Recurrent state and KV cache (linattn_nb.state, linattn_nb.ops.step)
# --------------------------------------------------------------------------
#: ``LinearAttentionState.step`` runs its kernel in parallel over the batch*heads from this many
#: multiply-adds (``batch * tokens * D_phi * M``) on; below it the serial kernel wins.
STEP_PARALLEL_MIN_WORK = _env_int("LINATTN_STEP_PARALLEL_MIN_WORK", 1 << 20)

#: Tokens per block in ``LinearAttentionState.prefill`` (GEMM-shaped blocks
#: through BLAS; scratch O(block * (D_phi + M)) per thread).
PREFILL_BLOCK = _env_int("LINATTN_PREFILL_BLOCK", 256)

#: Keys per block in the KV-cache step (online softmax over key blocks;
#: scratch O(block) per thread).
KV_BLOCK = _env_int("LINATTN_KV_BLOCK", 2048)

#: The KV-cache step runs in parallel over the batch*heads from this many multiply-adds
#: (``batch * tokens * context * (D + M)``; 2**24 is ~4 ms of serial work) on
#: (docs/measurements.md, "Serial or parallel").
KV_PARALLEL_MIN_WORK = _env_int("LINATTN_KV_PARALLEL_MIN_WORK", 1 << 24)

#: Initial capacity (tokens) of a ``KVCache`` and its growth factor: when an
#: append does not fit, the buffers grow to ``max(needed, GROWTH * capacity)``
#: (amortised O(1) append).
KV_INITIAL_CAPACITY = _env_int("LINATTN_KV_INITIAL_CAPACITY", 256)
KV_GROWTH = _env_float("LINATTN_KV_GROWTH", 2.0)

#: Threads per block of the CUDA step, query and prefill kernels.
CUDA_STEP_THREADS = _env_int("LINATTN_CUDA_STEP_THREADS", 128)

# Fitting feature maps to softmax attention (linattn_nb.fitting)
# --------------------------------------------------------------------------
#: Bytes of the two ``rows x keys`` float64 scratch blocks (softmax weights
#: and linear weights / their gradient) one pass of the fitting loss streams
#: through: the row block is ``FIT_BLOCK_BYTES // (16 * N)`` queries (at least
#: one).  64 MiB gives 256 rows at N = 16,384.
FIT_BLOCK_BYTES = _env_int("LINATTN_FIT_BLOCK_BYTES", 64 << 20)

#: The softmax weights of the training (and validation) queries do not depend
#: on the map's parameters: ``fit`` keeps them between evaluations while they
#: take at most this many bytes (float64; 128 MiB per 4,096 x 4,096 matrix),
#: else recomputes them in every evaluation (one GEMM and one exp per entry).
FIT_CACHE_BYTES = _env_int("LINATTN_FIT_CACHE_BYTES", 512 << 20)

#: ``fit`` runs BLAS on one thread while one evaluation's products are smaller than this many
#: multiply-adds (``B * N * N * D_phi``): small block GEMMs are too short to share between threads
#: (docs/guide/configuration.md).
FIT_SERIAL_BLAS_MAX_WORK = _env_int("LINATTN_FIT_SERIAL_BLAS_MAX_WORK", 1 << 27)

#: Floor of the fitted linear weights in the cross-entropy and KL losses for maps whose weights can be
#: exactly 0 (relu, T2R): the loss uses ``(1 - floor) * max(L_ij, 0) + floor / n_i``.
FIT_FLOOR = _env_float("LINATTN_FIT_FLOOR", 1e-6)

# Reports (linattn_nb.studies.run_report)
# --------------------------------------------------------------------------
#: ``run_report`` runs the studies marked ``background`` (mostly compiling) in a spawned process beside
#: the untimed studies; ``LINATTN_REPORT_BACKGROUND=0`` runs every study in the reporting process.
REPORT_BACKGROUND = _env_flag("LINATTN_REPORT_BACKGROUND", True)

# method="auto" calibrated on this machine (linattn_nb._tune, docs/tuning.md)
# --------------------------------------------------------------------------
#: Whether ``method="auto"`` on the CPU (causal) uses a calibration of this machine instead of the
#: rows of :data:`AUTO_METHODS`: ``"off"``, ``"load"`` (default: one stored by ``linattn tune``,
#: never measures) or ``"first-use"`` (also times a missing entry once).  docs/tuning.md.
AUTO_TUNE = os.environ.get("LINATTN_AUTO_TUNE", "load") or "load"

# Chunked backward of the delta rules (linattn_nb.ops.grad.cpu.backward_chunked)
# --------------------------------------------------------------------------
#: Chunk size C of the CPU chunked backward of the delta and gated delta rules
#: (:mod:`linattn_nb.ops.grad._cpu_chunked_delta`).  0 (default) picks
#: :func:`cpu_backward_delta_chunk`: 32 (measured: docs/design-cpu.md).
BACKWARD_DELTA_CHUNK = _env_int("LINATTN_BACKWARD_DELTA_CHUNK", 0)


def cpu_backward_delta_chunk(n: int, f: int, m: int, dtype) -> int:
    """Chunk size of the delta rules' chunked backward (``BACKWARD_DELTA_CHUNK`` if set, else 32), at most n."""
    c = knob_int("BACKWARD_DELTA_CHUNK")
    c = c if c > 0 else 32
    return max(1, min(int(c), int(n)))


# the name bound by ``from __future__ import annotations`` is not part of the API
del annotations
