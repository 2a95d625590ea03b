"""Launch planning of the sequence kernel: its limits, the choice of ``(R, C, G, MB, T)``, and threads.

The constants bound registers, threads and shared memory; the design is in
``docs/cuda_kernels.md``, "Choosing the configuration".
"""
from __future__ import annotations

import numpy as np
from numba import config as _nbconfig
from numba import float32, float64

from ... import config
from .._codes import RULE_ADDITIVE, RULE_DECAY, RULE_DELTA, RULE_GATE, RULE_GATED_DELTA
from .._cuda_common import is_delta_rule, rule_factor_rows

#: The CUDA simulator is on: kernels are Python; no on-disk cache (and no PTX) there.
SIM = bool(getattr(_nbconfig, "ENABLE_CUDASIM", 0))
#: Whether the kernels are cached on disk (``config.CACHE``, never on the simulator).
CACHE = bool(config.CACHE) and not SIM
#: Numba types of the accumulation dtypes, by name.
ACC_TYPES = {"float32": float32, "float64": float64}


def helper_grid(total: int) -> tuple[int, int]:
    """(blocks, threads) for the grid-stride helper kernels over ``total`` elements."""
    tpb = max(1, int(config.CUDA_THREADS_PER_BLOCK))
    blocks = max(1, min(int(config.CUDA_MAX_HELPER_BLOCKS), -(-int(total) // tpb)))
    return blocks, tpb


#: The smallest running factor ``P_t`` of a rescaled tile (decay, gate); a tile whose factors
#: fall below it takes the direct form (docs/cuda_kernels.md, "Rescaled tiles").
RESCALE_MIN_F32 = 2.0 ** -32
RESCALE_MIN_F64 = 2.0 ** -256
#: Largest padded feature dimension of the owner layout (``G = 1``, every
#: thread holds all feature rows of its value columns); larger ``D_phi``, and
#: the delta rules, use row groups.
OWNER_MAX_ROWS = 64
#: Largest padded feature dimension (tokens per tile x 4) and value columns
#: per block of the tile layout: 16 x 17 = 272 threads at D_phi = M = 64.
TILES_MAX_ROWS = 64
TILES_MAX_COLS = 64
#: Rules the tile layout takes: every rule (docs/cuda_kernels.md, "Tiles").
TILES_RULES = (RULE_ADDITIVE, RULE_DECAY, RULE_GATE, RULE_DELTA, RULE_GATED_DELTA)
#: Threads per block of the sequence kernel at most: 256 threads x 255
#: registers (the most ptxas gives a thread) fit the 65,536 registers of a
#: block, so every configuration launches whatever ptxas allocates.
MAX_SEQ_THREADS = 256
#: State words (32-bit registers) per thread at most in the row-group layout:
#: the register tile plus loads and addresses stay under 255 registers
#: without spilling (float64 takes two words per element).
MAX_TILE_WORDS = 128
#: Rows per thread at most for the delta rules in float64 (beyond it their tiles spilled;
#: docs/cuda_kernels.md, "Limits").
MAX_DELTA_ROWS_F64 = 32
#: Static shared memory of a block at most: sm_90's (``tools/cuda_resources.py`` keeps the same
#: figures; docs/cuda_kernels.md, "Limits").
STATIC_SHARED_BYTES = 49152
#: Shared memory per multiprocessor on sm_90 (228 KiB; :data:`SM_RESERVED_BYTES` of it is reserved
#: per resident block), for the occupancy target of the tile size.
SM_SHARED_BYTES = 233472
SM_RESERVED_BYTES = 1024
#: Resident warps per multiprocessor the tile size aims at (shared memory
#: permitting): enough to hide the shared-memory and FFMA latencies.
TARGET_WARPS = 16


def owner_row_pad(acc_itemsize: int) -> int:
    """Elements the owner layout adds to the rows of its staged ``phi(q)`` and of ``z`` per token
    (16 bytes): its normaliser's pass reads one token's row per thread, and rows of a multiple of 128
    bytes would put a warp's threads on one bank."""
    return max(1, 16 // int(acc_itemsize))


def _pad_rows(F: int, acc_itemsize: int) -> int:
    """Feature rows padded so that one token's row is whole 16-byte vectors (LDS.128 broadcasts)."""
    per = max(1, 16 // int(acc_itemsize))
    return -(-int(F) // per) * per


def seq_config(F: int, M: int, acc_itemsize: int, rule: int = RULE_ADDITIVE, layout: str = "owner"
               ) -> tuple[int, int, int, int, int]:
    """Choose ``(R, C, G, MB, T)`` for feature dimension ``F``, value dimension ``M`` in ``layout``: "owner"
    (row groups where it does not apply), "rows" or "tiles" (where :func:`tiles_fits`, else as "owner");
    at most :data:`MAX_SEQ_THREADS` threads (``docs/cuda_kernels.md``, "Choosing the configuration").
    ValueError when ``F`` exceeds ``config.CUDA_MAX_FEATURES`` or no configuration fits."""
    F = int(F)
    M = int(M)
    item = int(acc_itemsize)
    if layout not in ("owner", "rows", "tiles"):
        raise ValueError(f"layout must be 'owner', 'rows' or 'tiles', got {layout!r}")
    if F > int(config.CUDA_MAX_FEATURES):
        raise ValueError(
            f"the CUDA kernels support a feature dimension D_phi up to config.CUDA_MAX_FEATURES="
            f"{config.CUDA_MAX_FEATURES}, got {F}; use device='cpu' for larger feature maps"
        )
    if layout == "tiles":
        if tiles_fits(F, M, acc_itemsize, rule):
            FP, MB, T, _, _ = _tiles_sizes(F, M, acc_itemsize, rule)
            return FP, 4, 0, MB, T
        layout = "owner"
    max_threads = max(2, min(int(config.CUDA_MAX_THREADS), MAX_SEQ_THREADS))
    MB = max(1, min(M, int(config.CUDA_VALUE_COLS)))
    words = max(1, item // 4)
    FPo = _pad_rows(F, item)
    if layout == "owner" and owner_fits(F, M, item, rule):
        R, C, G = FPo, 1, 1
        MB = min(MB, max_threads)
        MBP = MB
        nthreads = MB
        factors = rule_factor_rows(rule, FPo)
        per_token = item * (3 * FPo + 2 * owner_row_pad(item) + 2 * MBP + 1 + factors)  # sq, sz padded; sk
        fixed = 0 if factors else item  # a rule without factors still declares a (1, 1) factor array
        fixed += item * (FPo if rule == RULE_GATE else 1)  # the rescaled tile's row factors (one stand-in)
    else:
        delta = is_delta_rule(rule)
        C = max(1, int(config.CUDA_DELTA_COLS_PER_THREAD if delta else config.CUDA_COLS_PER_THREAD))
        R = max(1, int(config.CUDA_DELTA_ROWS_PER_THREAD if delta else config.CUDA_ROWS_PER_THREAD))
        r_max = max(R, int(config.CUDA_MAX_ROWS_PER_THREAD))
        if delta and words == 2:
            r_max = min(r_max, max(R, MAX_DELTA_ROWS_F64))

        def threads(R, C, MB):
            return -(-F // R) * (-(-(MB + 1) // C))

        while threads(R, C, MB) > max_threads and R < r_max:
            R = min(2 * R, r_max)
        tile_words = MAX_TILE_WORDS // 2 if delta and words == 2 else MAX_TILE_WORDS
        while R * C * words > tile_words and C > 1:
            C //= 2
        while threads(R, C, MB) > max_threads and MB > 1:
            MB = max(1, MB // 2)
        G = -(-F // R)
        if threads(R, C, MB) > max_threads:
            raise ValueError(
                f"no CUDA launch configuration for D_phi={F}: {G} row groups of {R} rows exceed "
                f"{max_threads} threads per block; raise config.CUDA_MAX_ROWS_PER_THREAD or use device='cpu'"
            )
        MBP = -(-(MB + 1) // C) * C
        nthreads = threads(R, C, MB)
        factors = rule_factor_rows(rule, G * R)
        per_token = item * (2 * G * R + MBP + G * MBP + 1 + factors)
        # the delta rules' reduction buffer (none when G is a power of two up to 32: warp shuffles), else
        # its (1, 1, 1) stand-in; a (1, 1) factor array without factors
        shuffles = G <= 32 and (G & (G - 1)) == 0
        fixed = item * 2 * G * MBP if is_delta_rule(rule) and not shuffles else item
        fixed += 0 if factors else item
        fixed += item * (G * R if rule == RULE_GATE else 1)  # the rescaled tile's row factors (one stand-in)
    T = min(int(config.CUDA_TILE_TOKENS), (int(config.CUDA_SHARED_BYTES) - fixed) // per_token)
    if T < 1:
        raise ValueError(
            f"D_phi={F}, M={M}: one token needs {per_token} bytes of shared memory, more than "
            f"config.CUDA_SHARED_BYTES={config.CUDA_SHARED_BYTES}; use device='cpu'"
        )
    warps = -(-nthreads // 32)
    blocks = -(-TARGET_WARPS // warps)
    t_occ = (SM_SHARED_BYTES // blocks - SM_RESERVED_BYTES - fixed) // per_token
    T = max(min(T, 8), min(T, t_occ))
    return R, C, G, MB, T


def gate_rows(FP: int) -> int:
    """Rows of the gate's product array in the tile layout (:func:`tiles_kernel`): one of ones, three
    in-block products per block of 4 tokens, a row per run of whole blocks."""
    NB = -(-int(FP) // 16)
    return 1 + 3 * NB + NB * (NB + 1) // 2


def _tiles_sizes(F: int, M: int, acc_itemsize: int, rule: int = RULE_ADDITIVE):
    """``(FP, MB, T, threads, shared bytes)`` of the tile layout (docs/cuda_kernels.md)."""
    FP = -(-int(F) // 4) * 4
    MB = max(1, min(int(M), int(config.CUDA_VALUE_COLS), TILES_MAX_COLS))
    MP = -(-(MB + 1) // 4) * 4
    T = FP // 4
    # phi(q), phi(k) (the gate: and their scaled copies), [v | 1], scores, start state, normalisers;
    # the decay rule's (and the gated delta rule's) three per-token factor arrays and the gate's
    # product rows (one-element stand-ins for the rules without them); the delta rules' beta, L, W
    # and U' (the other rules: names for arrays they have)
    gate = rule == RULE_GATE
    delta = is_delta_rule(rule)
    words = (2 * (2 * T if gate else T) * (FP + 4) + T * MP + T * T + FP * MP + T
             + 3 * (T if rule in (RULE_DECAY, RULE_GATED_DELTA) else 1) + (gate_rows(FP) * (FP + 4) if gate else 1)
             + (T + 2 * T * T + T * MP if delta else 0))
    return FP, MB, T, T * (MP // 4), words * int(acc_itemsize)


def tiles_fits(F: int, M: int, acc_itemsize: int, rule: int = RULE_ADDITIVE) -> bool:
    """Whether the tile layout applies (:func:`seq_config`): a rule of :data:`TILES_RULES` (every
    rule), ``D_phi`` padded to a multiple of 4 at most :data:`TILES_MAX_ROWS`, and its shared
    memory within ``config.CUDA_TILES_SHARED_BYTES`` (and the 48 KiB static limit)."""
    FP, _, _, _, nbytes = _tiles_sizes(F, M, acc_itemsize, rule)
    budget = min(int(config.CUDA_TILES_SHARED_BYTES), STATIC_SHARED_BYTES)
    return rule in TILES_RULES and FP <= TILES_MAX_ROWS and nbytes <= budget


def owner_fits(F: int, M: int, acc_itemsize: int, rule: int = RULE_ADDITIVE) -> bool:
    """Whether the owner layout applies to ``F`` features, ``M`` values, ``rule`` (:func:`seq_config`):
    not a delta rule, ``F`` padded at most :data:`OWNER_MAX_ROWS` and a thread's registers of state
    within :data:`MAX_TILE_WORDS` + 32 words."""
    item = int(acc_itemsize)
    max_threads = max(2, min(int(config.CUDA_MAX_THREADS), MAX_SEQ_THREADS))
    MBo = min(max(1, min(int(M), int(config.CUDA_VALUE_COLS))), max_threads)
    FPo = _pad_rows(F, item)
    owner_words = (FPo + -(-FPo // MBo)) * max(1, item // 4)  # the column's rows and the thread's rows of z
    return not is_delta_rule(rule) and FPo <= OWNER_MAX_ROWS and owner_words <= MAX_TILE_WORDS + 32


def threads_per_block(R: int, C: int, G: int, MB: int, rule: int = RULE_ADDITIVE) -> int:
    """Threads per block of :func:`seq_kernel` for a configuration (``rule``: the owner layout
    is ``G == 1`` for rules other than the delta rules; ``G == 0`` the tile layout)."""
    if G == 0:
        return (R // 4) * -(-(MB + 1) // 4)
    if G == 1 and not is_delta_rule(rule):
        return -(-MB // C)
    return G * (-(-(MB + 1) // C))


#: ``vec`` bits of :func:`seq_kernel`: q and k (``VEC_QK``), v (``VEC_V``)
#: staged four elements of a token per vector load (docs/cuda_kernels.md).
VEC_QK = 1
VEC_V = 2

#: Sequences that span fewer elements than this get the kernel with 32-bit
#: element offsets (:func:`linattn_nb.ops._cuda_launch.plan`): an offset
#: below 2^31 can be neither wrapped nor taken for a negative one.
OFF32_LIMIT = 2 ** 31


def acc_name(*dtypes) -> str:
    """Accumulation dtype: float64 if any input is float64, else float32."""
    return "float64" if any(np.dtype(d) == np.float64 for d in dtypes) else "float32"
