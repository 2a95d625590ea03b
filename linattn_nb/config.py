"""Every tunable knob of linattn_nb in one place.

Values can be overridden by environment variables (read once, at import of this
module) or by assigning to the module attributes at run time, e.g.::

    import linattn_nb.config as cfg
    cfg.CPU_CHUNK_SIZE = 128

Launchers read these attributes at call time, never at import, so run-time
assignments take effect on the next call.  Nothing in this module compiles
anything.
"""
from __future__ import annotations

import os


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:  # pragma: no cover - misconfiguration
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from exc


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:  # pragma: no cover - misconfiguration
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from exc


# --------------------------------------------------------------------------
# Numba compilation flags
# --------------------------------------------------------------------------
#: The single fastmath flag set used by every CPU kernel.  It deliberately
#: omits ``nnan`` and ``ninf`` so that NaN/Inf checks and propagation keep
#: working (a NaN in the input must never silently become a finite output).
#: ``reassoc`` and ``contract`` let LLVM vectorise reductions and fuse
#: multiply-adds; ``nsz`` and ``arcp`` are harmless for this arithmetic.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

#: ``cache=True`` for kernels that take plain arrays (on-disk cache, keyed on
#: the source file).  Set ``LINATTN_NO_CACHE=1`` to disable, e.g. on a
#: read-only installation without NUMBA_CACHE_DIR.
CACHE = os.environ.get("LINATTN_NO_CACHE", "") not in ("1", "true", "yes")

# --------------------------------------------------------------------------
# Numerics
# --------------------------------------------------------------------------
#: Default floor of the normaliser phi(q)^T z (the seed's ``clip(1e-8)``).
#: ``linear_attention(eps=None)`` disables the floor (raw signed division).
DEFAULT_EPS = _env_float("LINATTN_EPS", 1e-8)

# --------------------------------------------------------------------------
# CPU kernels
# --------------------------------------------------------------------------
#: Tokens per block in the non-causal CPU kernel (aggregate phase and query
#: phase both work on blocks of this many rows, GEMM-shaped through BLAS).
CPU_NONCAUSAL_BLOCK = _env_int("LINATTN_CPU_NONCAUSAL_BLOCK", 256)

#: Query rows and key columns per block in the CPU softmax kernel.  Memory is
#: O(block_q * block_k) per thread; the N x N matrix is never formed.
SOFTMAX_BLOCK_Q = _env_int("LINATTN_SOFTMAX_BLOCK_Q", 128)
SOFTMAX_BLOCK_K = _env_int("LINATTN_SOFTMAX_BLOCK_K", 256)

#: Above this many elements (N*N per batch*head) ``method="quadratic"`` refuses
#: to build the explicit N x N matrix and says so; it is a test reference.
QUADRATIC_MAX_ELEMENTS = _env_int("LINATTN_QUADRATIC_MAX_ELEMENTS", 1 << 26)

# --------------------------------------------------------------------------
# method="auto"
# --------------------------------------------------------------------------
#: ``(causal, device) -> [(max_n, method), ...]``: the first row whose
#: ``max_n`` (inclusive; None = unbounded) admits the sequence length wins.
#: The rows must come from measurements (benchmarks/), not guesses.
AUTO_METHODS = {
    (True, "cpu"): [(None, "scan")],
    (False, "cpu"): [(None, "aggregate")],
}

# --------------------------------------------------------------------------
# Recurrent state and KV cache (linattn_nb.state, linattn_nb.ops.step)
# --------------------------------------------------------------------------
#: ``LinearAttentionState.step`` runs its Numba kernel in parallel over the
#: batch*heads only when ``batch * tokens * D_phi * M`` reaches this many
#: multiply-adds; below it the serial kernel wins (a parallel region costs
#: microseconds to open, a whole decode step of H=16, D=M=64 is ~5 us).
STEP_PARALLEL_MIN_WORK = _env_int("LINATTN_STEP_PARALLEL_MIN_WORK", 1 << 20)

#: Tokens per block in ``LinearAttentionState.prefill`` (GEMM-shaped blocks
#: through BLAS; scratch O(block * (D_phi + M)) per thread).
PREFILL_BLOCK = _env_int("LINATTN_PREFILL_BLOCK", 256)

#: Keys per block in the KV-cache step (online softmax over key blocks;
#: scratch O(block) per thread).
KV_BLOCK = _env_int("LINATTN_KV_BLOCK", 2048)

#: The KV-cache step runs in parallel over the batch*heads from this many
#: multiply-adds (``batch * tokens * context * (D + M)``) on; 2**24 is ~4 ms
#: of serial work.  (A parallel region waits for all its threads: on a busy
#: machine a late thread costs a scheduler time slice, measured ~20 ms on the
#: shared 2-core development VM, so small steps stay serial.)
KV_PARALLEL_MIN_WORK = _env_int("LINATTN_KV_PARALLEL_MIN_WORK", 1 << 24)

#: Initial capacity (tokens) of a ``KVCache`` and its growth factor: when an
#: append does not fit, the buffers grow to ``max(needed, GROWTH * capacity)``
#: (amortised O(1) append).
KV_INITIAL_CAPACITY = _env_int("LINATTN_KV_INITIAL_CAPACITY", 256)
KV_GROWTH = _env_float("LINATTN_KV_GROWTH", 2.0)

#: Threads per block of the CUDA step, query and prefill kernels.
CUDA_STEP_THREADS = _env_int("LINATTN_CUDA_STEP_THREADS", 128)
