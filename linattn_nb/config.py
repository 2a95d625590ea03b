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
# Feature maps and analysis
# --------------------------------------------------------------------------
#: FAVOR+ key features are shifted by ``max(0, max_i |w_i|^2/2 - headroom)``,
#: a constant computed from the random matrix only (never from the data, so
#: it is causal-safe and identical across segments).  Because
#: ``w.x - |x|^2/2 <= |w|^2/2``, key features are then at most
#: ``exp(headroom)``: 40 keeps them and their products with values far below
#: the float32 maximum (exp(88.7)) while wasting as little of the float32
#: range below as possible.  Read when a map is built (stored on the map, so
#: that a carried state stays consistent).
FAVOR_KEY_HEADROOM = _env_float("LINATTN_FAVOR_KEY_HEADROOM", 40.0)

#: Query rows per task in the approximation-error kernels
#: (:mod:`linattn_nb.analysis.error`).  Memory per task is about
#: ``block * N`` float64 numbers times four; the N x N matrix is never formed.
ANALYSIS_BLOCK_Q = _env_int("LINATTN_ANALYSIS_BLOCK_Q", 64)

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
