"""CUDA kernels shared by the causal and non-causal launchers (Numba, ``numba-cuda``).

One sequence kernel does all the work of linear attention on the GPU; the
launchers in :mod:`linattn_nb.ops.causal.cuda` and
:mod:`linattn_nb.ops.noncausal.cuda` run it in different modes, through the
launch plans of :mod:`linattn_nb.ops._cuda_launch`:

* **scan** (causal): one block per (batch entry, block of value columns)
  walks the whole sequence token by token, updating the state and reading it
  (``update`` and ``write_out``), Katharopoulos et al. 2020, Eqs. 18-19.
* **chunk sums**: one block per (batch entry, chunk, column block) sums
  ``phi(k_j) v_j^T`` over its chunk only (``update``, no output).
* **chunk scan** (causal chunked, phase 3): like *scan*, but every chunk
  starts from its own state, the exclusive prefix over earlier chunks.  The
  inter-chunk state passing is that of the chunkwise-parallel form (Yang et
  al. 2024, GLA, Sec. 2.2); inside a chunk the kernel keeps the recurrence
  rather than the masked ``(Q K^T) V`` product, because without tensor-core
  matrix instructions (Numba exposes none) the recurrence is the cheaper of
  the two: ``4 F M`` FLOPs per token against ``2 L (F + M) + 4 F M`` for
  chunks of ``L`` tokens.
* **query** (non-causal, phase 3): the state is fixed; every token reads it
  (``write_out`` only).

Thread layouts of the sequence kernel (three).  Tokens are staged through shared
memory in tiles of ``T`` tokens: ``phi(q)`` and ``phi(k)`` (feature map
applied while staging, in the accumulation dtype), ``v`` and, for a rule with
per-token factors (decay, gate), the factors ``exp(log-factor)`` of the
tile's tokens (one per token, or one per feature row).  The state stays in
registers (local arrays of compile-time size, fully unrolled; no local-memory
traffic, checked in the PTX tests).  Per token every state element costs two
fused multiply-adds (the update, and its term of ``phi(q)^T S``), so what
decides the speed is how many shared-memory loads, address computations and
cross-thread sums a thread issues per FFMA.  Three layouts (:func:`seq_config`):

* **owner** (``G == 1``; ``D_phi`` padded to whole 16-byte vectors, at most
  :data:`OWNER_MAX_ROWS` = 64; every rule but the delta rules): a block owns
  ``MB`` value columns ``m0 .. m0 + MB - 1`` and each thread all ``F`` rows
  of its ``C = 1`` column, so ``phi(q)^T S`` is summed in registers and no
  value column needs another thread.  A token's ``phi(k)`` and ``phi(q)``
  rows start at a multiple of 16 bytes and every thread reads the same
  address, so they load as ``LDS.128`` broadcasts: at D = M = 64, float32,
  the causal token loop is 32 ``LDS.128`` + 2 scalar loads + 2 stores for
  128 FFMA out of 199 SASS instructions (64%; the rest is loop control and
  shared-window addressing), against 64 FFMA of 120 instructions plus a
  G-way shared-memory sum per output in the row-group layout it replaces
  there.  The normaliser ``z`` (the state of a value column of ones) is split
  by rows instead of taking one more thread: thread ``u`` owns rows ``u, u +
  MB, ...`` of ``z``, updates them per token (one add each) and writes them
  to shared memory (``sz``, the running ``z_t`` of every token of the tile);
  after the tile thread ``t`` forms token ``t``'s ``phi(q_t)^T z_t`` as one
  dot product of its own over the staged rows, as the tile layout reads its
  start state: no partial sums of several threads are added anywhere.  The
  rows of ``sq`` and ``sz`` are 16 bytes longer than ``D_phi`` so that the
  threads of that pass, each reading its own token's row, fall on different
  banks.  127 registers x 64 threads: 8 blocks, 16 warps per multiprocessor
  (registers), and ``T`` is chosen so shared memory allows
  :data:`TARGET_WARPS`; three ``syncthreads`` per tile.
* **row groups** (larger ``D_phi``, the delta rules where the tile layout
  does not fit, and any ``D_phi`` when a GPU has too few sequences for the owner
  layout's 2-warp blocks to fill it: :func:`linattn_nb.ops._cuda_launch.seq_layout`): the block's ``MB``
  value columns plus the normaliser column, ``MB + 1`` padded to ``MBP``
  (a multiple of ``C``), are split into groups of ``C`` columns and the
  ``F`` rows into ``G`` groups of ``R``; each thread keeps an ``R x C``
  tile.  Per token a thread reads ``R`` values of ``phi(k)`` and of
  ``phi(q)`` (``LDS.128``: ``R`` and its first row are multiples of 4) and
  ``C`` of ``v`` for ``2 R C`` FFMA (128 of 160 instructions at R = 16,
  C = 4, D_phi = 128; 64 of 92 at R = 8, C = 4, D_phi = 64, where a
  sequence takes 136 threads, 5 warps, against the owner layout's 2), and
  writes its partial ``phi(q)^T S`` for its ``C``
  columns to shared memory; after the tile the normaliser of every token is
  summed once and the ``G`` partials of every value column are summed and
  divided by it.

* **tiles** (``G == 0``; every rule, :data:`TILES_RULES`;
  ``D_phi`` padded to a multiple of 4 at most :data:`TILES_MAX_ROWS` = 64, within
  ``config.CUDA_TILES_SHARED_BYTES``: float32 up to D_phi = M = 64, float64 up to D_phi = 32; what the launchers
  take instead of row groups when the owner layout's blocks are too few,
  :func:`linattn_nb.ops._cuda_launch.seq_layout`): the chunkwise form inside
  a tile of ``T = FP / 4`` tokens, ``O = mask(phi(Q) phi(K)^T) [V | 1] +
  phi(Q) [S | z]`` and ``[S | z] += phi(K)^T [V | 1]`` (Yang et al. 2024,
  GLA, Sec. 2.2), as products that every thread sums on its own: the block's
  ``MB + 1`` columns (values, then the normaliser's column of ones) are
  padded to ``MP``, a multiple of 4, and thread ``(rg, cg)`` of ``FP / 4 x
  MP / 4`` owns the 4 x 4 state tile of rows ``4 rg ..`` and columns ``4 cg
  ..`` in registers, and the outputs of token ``rg`` of the tile at columns
  ``4 cg ..``.  Per tile: stage ``phi(q)``, ``phi(k)``, ``[v | 1]``; the
  causal scores ``phi(q_t)^T phi(k_s)``, ``s <= t``, one per thread of the
  first ``T (T + 1) / 2`` (no lane idles on the masked half); the outputs
  from the scores and the start state ``[S | z]`` (in shared memory; the
  normaliser is column ``MB``, written by its owner for the others: a
  broadcast, not a sum); the state tile's update from ``phi(K)^T [V | 1]``;
  three barriers.  No cross-thread reduction at all, and at D_phi = M = 64
  a sequence takes 272 threads (16 x 17; 9 warps, against the owner
  layout's 2 and the row groups' 5) for tiles of 16 tokens: ``2 x 64 x 68``
  products per token for the state and its read-out, plus ``8.5 x 64`` for
  the scores and ``16 x 68`` for their product (1.27 x 4 D_phi M FLOPs;
  ``gpu_static.py`` prints its static SASS mix).  More than
  :data:`MAX_SEQ_THREADS` threads: a register cap (``max_registers``) keeps
  registers x threads within a block's 65,536.
  The decay rule (``S_t = a_t S_{t-1} + k_t v_t^T``) in the same products:
  the tile's log-factors are staged (one per token, 0 past the sequence),
  each score (t, s) is weighted by ``a_{s+1} ... a_t``, token t reads the
  start state scaled by ``a_0 ... a_t`` and key s enters the end state with
  the share ``a_{s+1} ... a_{T-1}``, the state tile being scaled by the
  tile's ``a_0 ... a_{T-1}`` first: each factor the ``exp`` of a sum of
  log-factors taken forwards (never a difference or a ratio), so a reset
  (``-inf``) gives exact zeros and strong decay needs no fallback (the
  other layouts' rescaled tiles divide by running factors and fall back to
  the direct form below a floor).  One more barrier per tile only in the
  chunk-sum mode (no scores); 4 multiplies per key and thread, 16 per tile.
  The gate rule (``S_t = diag(a_t) S_{t-1} + k_t v_t^T``, a factor per
  feature row, so each score's weight differs per feature inside its dot
  product): one pass more per tile (a thread per feature row, one barrier)
  forms products of the factors over blocks of 4 tokens, taken forwards
  (a reset gives exact zeros), and stages ``phi(q_t)`` times its block's
  factors up to ``t`` and ``phi(k_s)`` times those after ``s`` next to the
  plain rows; every score is then a sum of three-way products of staged
  rows (an FMUL and an FFMA per feature); after the scores one more pass
  and barrier scale those rows in place to ``phi(q_t) a_0 ... a_t`` and
  ``phi(k_s) a_{s+1} ... a_{T-1}``, so the start state's read and the state
  update are the additive rule's loops (:func:`_tiles_kernel`).  46,524
  bytes of shared memory at D_phi = M = 64 in float32
  (``config.CUDA_TILES_SHARED_BYTES``).
  The delta rules (``H_t = a_t (I - beta_t k_t k_t^T) H_{t-1} + beta_t k_t
  [v_t | 1]^T``, ``a = 1`` for the delta rule) in the WY/UT form per tile
  (Yang et al. 2024, DeltaNet; the CPU chunked kernel's form,
  :mod:`linattn_nb.ops._rules`): with ``L = I + tril(diag(beta) (Gamma *
  phi(K) phi(K)^T), -1)`` (``Gamma_ts = a_{s+1} ... a_t``) and ``Y = [V |
  1] - (a_0 ... a_t phi(k_t))^T [S | z]`` row by row, the tile's values are
  replaced by ``U' = L^-1 diag(beta) Y`` and the outputs and the state are
  then the additive rule's (the decay rule's for the gated delta rule).
  Per tile: the entries of ``L`` next to the scores, one per thread of the
  next ``T (T - 1) / 2`` (64 products each at D_phi = 64); ``W = L^-1
  diag(beta)`` a column per thread of the first ``T``, solved forwards in
  shared memory (a thread reads only what it wrote; ``L`` is read as
  broadcasts), while every thread forms its token's and columns' ``Y`` (the
  start state's read loop, at the key); ``U' = W Y``; two more barriers.
  No per-token cross-thread sum (row groups: ``k^T H`` summed across
  groups by warp shuffles, a dependent chain every token); about 1.6 x
  the FLOPs of the additive tile.  38,032 bytes at D_phi = M = 64 in
  float32 (38,212 gated).

The owner and row-group layouts have at most :data:`MAX_SEQ_THREADS` = 256 threads, so
registers x threads stays within the 65,536 registers of a block however
many registers (at most 255) ptxas gives a thread, and the row-group tile is
kept to :data:`MAX_TILE_WORDS` registers (``C`` halved for float64), so no
configuration up to ``config.CUDA_MAX_FEATURES`` fails to launch.  Static
shared memory stays within ``config.CUDA_SHARED_BYTES`` (48 KiB is the
static limit).  Indices into shared memory and the staging loops are
unsigned (``uint32``): Numba wraps negative signed indices (a compare and a
select per access) and divides signed 64-bit integers slowly; a token index
is assumed below 2^32.

Global addressing.  The kernel receives q, k, v and out as 1-d views from
their first elements (:func:`flat_view`, no copy) with their strides in
elements; a block finds its batch entry's first element once, in 64 bits,
and addresses within the sequence by ``token * token stride + column *
column stride`` in ``uint32`` when every sequence spans fewer than
:data:`OFF32_LIMIT` = 2^31 elements (the launchers check,
:func:`linattn_nb.ops._cuda_launch.plan`), in ``uint64`` otherwise (a
kernel of its own, ``off32=False``).  Vector loads (``vec``, bits
:data:`VEC_QK` and :data:`VEC_V`): where q and k have unit feature stride,
``F`` and every other stride a multiple of 4 and an aligned first element
(:func:`vector_bits`), a thread stages four features of one token from one
16-byte load (``LDG.E.128`` for float32,
:func:`linattn_nb.ops._cuda_common.load4`), and likewise four values of v
when ``M`` and the block's ``MB`` are multiples of 4; otherwise one element
per load, consecutive threads on consecutive elements (coalesced either
way).  Staging an element is :func:`linattn_nb.ops._cuda_common.stage`:
the conversion to the working type, the finiteness count, the map.

Finiteness check: the kernels take ``flags``, an int32 device array.  Of
shape (3,) (``check_finite=True``), the staging counts every NaN or inf of
q, k, v into words 0, 1, 2 (an atomic add, on non-finite values only; q and
k by the first column block only, so each value counts once); of shape (1,)
nothing is counted.  The launcher reads the three words once after its
launches (:func:`linattn_nb.ops._cuda_launch.raise_nonfinite`).

Rescaled tiles (decay and gate rules, both layouts): ``S_t = a_t S_{t-1} +
k_t v_t^T`` costs a multiply and an FFMA per state element, and the
read-out one more FFMA.  Within a tile, with the running factors ``P_t =
a_0 ... a_t`` (per feature row for the gate), ``S_t = P_t S~_t`` where
``S~_t = S~_{t-1} + (k_t / P_t) v_t^T`` starts from the tile's start state,
and ``phi(q_t)^T S_t = (phi(q_t) P_t)^T S~_t``.  So the staging pass scales
the tile's ``phi(q)`` rows by ``P_t`` and its ``phi(k)`` rows by ``1 /
P_t`` (once per staged element), the token loop is the additive rule's
(two FFMA per element), and the state is multiplied by the tile's ``P``
once at its end.  Every term keeps its rounding relative to its own size (no
difference of large numbers), and the products are taken forwards in
factors <= 1, never as ratios of cumulative products.  ``k / P`` must stay
finite: a tile whose ``P`` falls below :data:`RESCALE_MIN_F32` (float64:
:data:`RESCALE_MIN_F64`) in any row -- a reset inside the tile, or strong
decay -- takes the direct form instead, one token at a time (the state
scaled by the token's factors, then the same additive loop), decided for
the whole block by one ``syncthreads_or``.

Row feature maps (``code`` 4, L2, and 5, SiLU then L2): the staged ``phi(q)``
and ``phi(k)`` rows hold the elementwise half of the map; one more pass over
the tile divides each row by its norm
(:func:`linattn_nb.ops._cuda_common.l2_normalize_row`, one thread per row,
float64 norm, a zero row stays zero), and one more ``syncthreads``.

Delta rules (delta, gated delta) in the row-group layout: before a token changes column ``m`` of
the state, the column must be read at the token's key, ``u_m = k^T H[:, m]``,
a sum over all ``F`` rows, which the ``G`` row groups hold between them.
When ``G`` is a power of two up to 32 (``D_phi = 64``: 8 groups of 8 rows)
the threads are numbered row group first, so the ``G`` threads holding one
column are adjacent lanes of one warp, and each sums its ``R``-row partials
with ``log2 G`` xor-shuffles (``shfl_xor_sync``): every lane of the group
gets the whole sum, with no shared memory and no barrier per token.
Otherwise each thread writes its partial sums to shared memory, the block
synchronises, and each thread sums the ``G`` partials of its columns (a
double buffer indexed by the token's parity, so one ``syncthreads`` per
token).  Either way each thread then forms its columns' corrections
``beta (w - k^T H[:, m])`` and updates its
tile; the staged per-token values are the factor (gated delta) and ``beta``.

Accumulation dtype: float32 for float16 and float32 inputs, float64 when any
input is float64; the state lives in registers in that dtype (float64 would
double the registers of the tile and run at half the fp32 rate on H100/H200,
1/64 on consumer GPUs).  The caller's state ``H`` = ``[S | z]`` is float64 (the
launcher contract); the per-chunk sums of ``chunked``/``aggregate`` are
stored in the accumulation dtype and combined across chunks in float64 by
:func:`chunk_scan_states_kernel`, whose per-rule step is
:func:`linattn_nb.ops._cuda_common.carry` with every chunk's total factor
(:func:`chunk_factors_kernel`: ``exp`` of the float64 sum of the chunk's
log-factors, a sum and never a difference, so a reset (``-inf``) gives the
factor 0 and no NaN).

Kernels are specialised on ``(R, C, G, MB, T, accumulation dtype, rule)``, compile-time
constants for the register and shared-memory arrays, and compiled lazily on
first use (nothing compiles at import).  All are cached on disk
(``config.CACHE``; numba-cuda keys a closure's cache entry on its cell
contents as well); the simulator caches nothing.
"""
from __future__ import annotations

import math

import numpy as np
from numba import config as _nbconfig
from numba import cuda, float32, float64, uint32, uint64

from .. import config
from ._codes import NORM_FLOOR, NORM_NONE, RULE_ADDITIVE, RULE_DECAY, RULE_DELTA, RULE_GATE, RULE_GATED_DELTA
from ._cuda_common import (carry, fill4, is_delta_rule, is_row_map, l2_normalize_row, rule_factor_rows, stage,
                           stage4, unravel4)

# Simulator: kernels are Python; no on-disk cache (and no PTX) there.
_SIM = bool(getattr(_nbconfig, "ENABLE_CUDASIM", 0))
_CACHE = bool(config.CACHE) and not _SIM

_ACC_TYPES = {"float32": float32, "float64": float64}


# ---------------------------------------------------------------------------
# The sequence kernel
# ---------------------------------------------------------------------------
_SEQ_KERNELS: dict = {}


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _entry_views(q, k, v, out, qs, ks, vs, os_, b1, b2):
    """The 1-d views of q, k, v, out from batch entry (b1, b2)'s first element (element strides
    ``qs`` ...: the entry's first element is ``b1 * s[0] + b2 * s[1]``, in 64 bits)."""
    return (q[b1 * qs[0] + b2 * qs[1]:], k[b1 * ks[0] + b2 * ks[1]:], v[b1 * vs[0] + b2 * vs[1]:],
            out[b1 * os_[0] + b2 * os_[1]:])


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _block_segment(q, k, v, out, qs, ks, vs, os_, nseg_per_b, b2n, state_div, MB, flags):
    """What a sequence-kernel block works on: segment ``blockIdx.x`` is chunk ``c`` of batch entry
    ``b = b1 * B2 + b2`` (``nseg_per_b`` chunks per entry), reads and writes state ``sidx``, and its
    value columns start at ``m0 = blockIdx.y * MB``; the entry's 1-d views (:func:`_entry_views`);
    ``check``: count non-finite q, k, v (``flags`` of shape (3,)), ``cqk``: q and k here (the first
    column block only, so each value counts once).  Returns ``(b, c, sidx, m0, qb, kb, vb, ob, check,
    cqk)``."""
    seg = cuda.blockIdx.x
    b = seg // nseg_per_b
    c = seg - b * nseg_per_b
    b1 = b // b2n
    b2 = b - b1 * b2n
    qb, kb, vb, ob = _entry_views(q, k, v, out, qs, ks, vs, os_, b1, b2)
    check = flags.shape[0] > 1
    return (b, c, seg // state_div, cuda.blockIdx.y * MB, qb, kb, vb, ob, check,
            check and cuda.blockIdx.y == 0)


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _normalize_staged_rows(sq, sk, nt, tid, nth, F, update, write_out):
    """The L2 half of the row maps (codes 4 and 5) on a staged tile: one thread per row of
    ``phi(k)`` (``update``) and ``phi(q)`` (``write_out``) of the ``nt`` tokens; the caller
    synchronises after it."""
    for idx in range(tid, 2 * nt, nth):
        t = idx >> 1
        if idx & 1:
            if update:
                l2_normalize_row(sk, t, F)
        elif write_out:
            l2_normalize_row(sq, t, F)


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _update_read(st, w, ac, sk, sq, t, row0, R, C):
    """One token on a row-group thread's R x C register tile ``st``: ``S += phi(k_t) w^T`` over its
    rows, and ``ac[j] += phi(q_t)^T S[:, j]`` with the updated elements (``w``: the staged values of
    its C columns, or the delta rules' corrections).  Inlined with compile-time R, C: the loops unroll
    and the tile stays in registers."""
    for r in range(R):
        kr = sk[t, row0 + r]
        qr = sq[t, row0 + r]
        for j in range(C):
            s = st[r * C + j] + kr * w[j]
            st[r * C + j] = s
            ac[j] += qr * s


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _rescale_tile(sq, sk, sv, sa, sp, nt, tid, nth, fp, mbp, per_row, keys, values, tau, one):
    """The staging side of a rescaled tile (module docstring, "Rescaled tiles"), for the whole block.

    ``sa`` (T, W): the tile's factors (per row when ``per_row``, else column
    0).  Decides with one ``syncthreads_or`` whether every running factor
    ``P_t = a_0 ... a_t`` of the ``nt`` tokens stays >= ``tau``; if so scales
    the staged ``phi(q_t)`` rows by ``P_t`` and, with ``keys``, the
    ``phi(k_t)`` rows by ``1 / P_t`` (decay, gate) or, with ``values``, the
    ``mbp`` value columns by ``1 / P_t`` (gated delta), stores each row's
    ``P`` in ``sp`` (``per_row``) and synchronises.  Returns ``(whole,
    ptile)``: whether the tile is rescaled, and its factor (one factor for
    every row; 1 when ``per_row``).  The products run forwards in factors <=
    1, never as ratios of cumulative products.
    """
    low = 0
    for i in range(tid, fp, nth):
        p = one
        for t in range(nt):
            p *= sa[uint32(t), uint32(i) if per_row else 0]
        if not p >= tau:
            low = 1
    whole = cuda.syncthreads_or(low) == 0
    ptile = one
    if whole:
        for i in range(tid, fp, nth):
            iu = uint32(i)
            p = one
            for t in range(nt):
                tu = uint32(t)
                p *= sa[tu, iu if per_row else 0]
                sq[tu, iu] *= p
                if keys:
                    sk[tu, iu] /= p
            if per_row:
                sp[iu] = p
        if values:
            for jj in range(tid, mbp, nth):
                ju = uint32(jj)
                p = one
                for t in range(nt):
                    tu = uint32(t)
                    p *= sa[tu, 0]
                    sv[tu, ju] /= p
        if not per_row:
            for t in range(nt):
                ptile *= sa[uint32(t), 0]
        cuda.syncthreads()
    return whole, ptile


def _owner_kernel(R, C, MB, T, acc, rule, code, off32, vec):
    """The owner layout (``G == 1``): see the module docstring."""
    acc_t = _ACC_TYPES[acc]
    IDX = uint32 if off32 else uint64  # element offsets within a sequence (module docstring)
    VQK = bool(vec & VEC_QK)  # q, k: four features per vector load (module docstring)
    VV = bool(vec & VEC_V)  # v: four columns per vector load
    MAP = -1 if code is None else int(code)  # the feature map, when specialised (seq_kernel)
    FP = R  # padded feature rows, all owned by every thread
    FPS = FP + owner_row_pad(8 if acc == "float64" else 4)  # rows of sq and sz: 16 bytes past FP
    MBP = -(-MB // C) * C  # value columns, padded (the normaliser's rows are split over the threads)
    NTH = MBP // C  # threads per block
    ZR = -(-FP // NTH)  # normaliser rows per thread: rows tid, tid + NTH, ...
    RC = R * C
    zero = acc_t(0.0)
    one = acc_t(1.0)
    FACTORS = rule_factor_rows(rule, FP) > 0
    PER_ROW = rule == RULE_GATE
    SAT = T if FACTORS else 1
    SAW = FP if PER_ROW else 1
    SPW = FP if PER_ROW else 1
    TAU = acc_t(RESCALE_MIN_F32 if acc == "float32" else RESCALE_MIN_F64)
    FPV = -(-FP // 4)  # groups of four feature rows
    MBV = -(-MBP // 4)  # groups of four value columns

    @cuda.jit(cache=_CACHE)
    def kernel(q, k, v, out, qs, ks, vs, os_, nf, nm, H, Hout, lf, n, seg_len, nseg_per_b, state_div, b2n,
               code, eps, norm, read_state, update, write_out, write_state, flags):
        sq = cuda.shared.array((T, FPS), acc_t)
        sk = cuda.shared.array((T, FP), acc_t)
        sv = cuda.shared.array((T, MBP), acc_t)
        sa = cuda.shared.array((SAT, SAW), acc_t)
        sp = cuda.shared.array(SPW, acc_t)  # a rescaled tile's factor of each state row (the gate)
        num = cuda.shared.array((T, MBP), acc_t)  # phi(q)^T S per token and column
        sz = cuda.shared.array((T, FPS), acc_t)  # z after each token (its owners' rows), for the normaliser
        den = cuda.shared.array(T, acc_t)
        st = cuda.local.array(RC, acc_t)  # st[r * C + j]: row r, column c0 + j
        zt = cuda.local.array(ZR, acc_t)  # z[tid + u * NTH]
        vt = cuda.local.array(C, acc_t)
        ac = cuda.local.array(C, acc_t)

        cd = code if MAP < 0 else MAP  # a specialised kernel's map is a constant: its branches fold
        F = nf
        M = nm
        Fu = uint32(F)
        Mu = uint32(M)
        tid = cuda.threadIdx.x
        c0 = tid * C
        epsa = acc_t(eps)
        # the batch entry's sequences from their first element (64-bit, once per block), then
        # element offsets of IDX within them: token x token stride + column x column stride
        b, c, sidx, m0, qb, kb, vb, ob, check, cqk = _block_segment(q, k, v, out, qs, ks, vs, os_, nseg_per_b, b2n,
                                                                    state_div, MB, flags)
        qn, qf, kn, kf = IDX(qs[2]), IDX(qs[3]), IDX(ks[2]), IDX(ks[3])
        vn, vf, on, of = IDX(vs[2]), IDX(vs[3]), IDX(os_[2]), IDX(os_[3])

        for j in range(C):
            ok = read_state and c0 + j < MB and m0 + c0 + j < M
            for r in range(R):
                x = zero
                if ok and r < F:
                    x = acc_t(H[sidx, r, m0 + c0 + j])
                st[r * C + j] = x
        for u in range(ZR):
            i = tid + u * NTH
            x = zero
            if read_state and i < F:
                x = acc_t(H[sidx, i, M])
            zt[u] = x

        t_begin = c * seg_len
        t_end = min(n, t_begin + seg_len)
        for t0 in range(t_begin, t_end, T):
            nt = min(T, t_end - t0)
            # ---- stage phi(q), phi(k) (zero-padded rows), v, the factors: a
            # thread stages one feature row (value column) of every token of
            # the tile, so a warp reads consecutive addresses; unsigned
            # indices (no negative-index wraparound, a token index < 2^32)
            if VQK:  # four feature rows of one token per thread, one vector load each
                for idx in range(tid, nt * FPV, NTH):
                    iu = uint32(idx)
                    tu = iu // uint32(FPV)
                    i4 = (iu - tu * uint32(FPV)) * uint32(4)
                    tok = uint32(t0) + tu
                    if write_out and i4 < Fu:
                        stage4(sq, tu, i4, qb, IDX(tok * qn + i4), flags, 0, cqk, True, cd, zero, one)
                    else:
                        fill4(sq, tu, i4, FP, zero, FP, zero)
                    if update and i4 < Fu:
                        stage4(sk, tu, i4, kb, IDX(tok * kn + i4), flags, 1, cqk, True, cd, zero, one)
                    else:
                        fill4(sk, tu, i4, FP, zero, FP, zero)
            for i in range(tid, FP, NTH):
                iu = uint32(i)
                live = i < F
                if not VQK:
                    for t in range(nt):
                        tu = uint32(t)
                        tok = uint32(t0 + t)
                        if live and write_out:
                            stage(sq, tu, iu, qb[IDX(tok * qn + iu * qf)], flags, 0, cqk, True, cd, zero, one)
                        else:
                            sq[tu, iu] = zero
                        if live and update:
                            stage(sk, tu, iu, kb[IDX(tok * kn + iu * kf)], flags, 1, cqk, True, cd, zero, one)
                        else:
                            sk[tu, iu] = zero
                if PER_ROW and update:
                    for t in range(nt):
                        sa[uint32(t), iu] = math.exp(acc_t(lf[b, uint32(t0 + t), iu])) if live else one
            if FACTORS and not PER_ROW and update:
                for t in range(tid, nt, NTH):
                    sa[uint32(t), 0] = math.exp(acc_t(lf[b, uint32(t0 + t), 0]))
            if update and VV:  # four value columns of one token per thread, one vector load each
                for idx in range(tid, nt * MBV, NTH):
                    iu = uint32(idx)
                    tu = iu // uint32(MBV)
                    j4 = (iu - tu * uint32(MBV)) * uint32(4)
                    if j4 < uint32(MB) and uint32(m0) + j4 < Mu:
                        stage4(sv, tu, j4, vb, IDX((uint32(t0) + tu) * vn + uint32(m0) + j4), flags, 2, check, False,
                               cd, zero, one)
                    else:
                        fill4(sv, tu, j4, MBP, zero, MBP, zero)
            elif update:
                for jj in range(tid, MBP, NTH):
                    ju = uint32(m0 + jj)
                    live = jj < MB and m0 + jj < M
                    for t in range(nt):
                        if live:
                            stage(sv, uint32(t), uint32(jj), vb[IDX(uint32(t0 + t) * vn + ju * vf)], flags, 2, check,
                                  False, cd, zero, one)
                        else:
                            sv[uint32(t), uint32(jj)] = zero
            cuda.syncthreads()
            if is_row_map(cd):
                _normalize_staged_rows(sq, sk, nt, tid, NTH, F, update, write_out)
                cuda.syncthreads()
            # ---- decay and gate (module docstring, "Rescaled tiles"): a tile whose
            # running factors P_t = a_0 ... a_t stay >= TAU runs the additive update
            # on q_t P_t and k_t / P_t and scales the state by its P once at its end;
            # otherwise (a reset, strong decay) each token is a segment of its own,
            # the state scaled by its factor first.  The token loop is the additive one.
            whole = not FACTORS
            ptile = one
            if FACTORS and update:
                whole, ptile = _rescale_tile(sq, sk, sv, sa, sp, nt, tid, NTH, FP, MBP, PER_ROW, True, False,
                                             TAU, one)
            # ---- per token: the thread's C columns over all rows, in registers
            if update:
                for seg_t in range(1 if whole else nt):  # one segment (additive: always), or one per token
                    ta = 0 if whole else seg_t
                    te = nt if whole else seg_t + 1
                    if not whole:  # the direct form: this token's factors on the state first
                        ua = uint32(ta)
                        for r in range(R):
                            fr = sa[ua, r] if PER_ROW else sa[ua, 0]
                            for j in range(C):
                                st[r * C + j] *= fr
                        for u in range(ZR):
                            i = tid + u * NTH
                            if i < FP:
                                zt[u] *= sa[ua, i] if PER_ROW else sa[ua, 0]
                    if write_out:
                        for tt in range(ta, te):
                            t = uint32(tt)  # unsigned: no negative-index wraparound in the addressing
                            for j in range(C):
                                vt[j] = sv[t, c0 + j]
                                ac[j] = zero
                            for r in range(R):
                                kr = sk[t, r]
                                qr = sq[t, r]
                                for j in range(C):
                                    s = st[r * C + j] + kr * vt[j]
                                    st[r * C + j] = s
                                    ac[j] += qr * s
                            for j in range(C):
                                num[t, c0 + j] = ac[j]
                            for u in range(ZR):
                                i = uint32(tid + u * NTH)
                                if i < FP:
                                    s = zt[u] + sk[t, i]
                                    zt[u] = s
                                    sz[t, i] = s
                    else:
                        for tt in range(ta, te):
                            t = uint32(tt)
                            for j in range(C):
                                vt[j] = sv[t, c0 + j]
                            for r in range(R):
                                kr = sk[t, r]
                                for j in range(C):
                                    st[r * C + j] += kr * vt[j]
                            for u in range(ZR):
                                i = tid + u * NTH
                                if i < FP:
                                    zt[u] += sk[t, i]
                if FACTORS and whole:
                    for r in range(R):
                        fr = sp[r] if PER_ROW else ptile
                        for j in range(C):
                            st[r * C + j] *= fr
                    for u in range(ZR):
                        i = tid + u * NTH
                        if i < FP:
                            zt[u] *= sp[i] if PER_ROW else ptile
            elif write_out:
                for t in range(nt):
                    for j in range(C):
                        ac[j] = zero
                    for r in range(R):
                        qr = sq[t, r]
                        for j in range(C):
                            ac[j] += qr * st[r * C + j]
                    for j in range(C):
                        num[t, c0 + j] = ac[j]
                    for u in range(ZR):
                        i = uint32(tid + u * NTH)
                        if i < FP:
                            sz[uint32(t), i] = zt[u]
            if write_out:
                cuda.syncthreads()
                # ---- the normaliser of every token, phi(q_t)^T z_t, a thread's own dot product over the
                # rows of z_t its owners wrote (as it reads phi(q_t) other threads staged): no partial
                # sums of several threads are added; rows FPS apart keep a warp's reads off one bank
                for t in range(tid, nt, NTH):
                    tu = uint32(t)
                    x = zero
                    for i in range(FP):
                        x += sq[tu, uint32(i)] * sz[tu, uint32(i)]
                    if norm == NORM_FLOOR and x < epsa:
                        x = epsa
                    den[t] = x
                cuda.syncthreads()
                for j in range(C):
                    jj = c0 + j
                    if jj < MB and m0 + jj < M:
                        ju = uint32(m0 + jj)
                        for t in range(nt):
                            x = num[uint32(t), jj]
                            if norm != NORM_NONE:
                                x = x / den[uint32(t)]
                            ob[IDX(uint32(t0 + t) * on + ju * of)] = x
            else:
                cuda.syncthreads()

        if write_state:
            for j in range(C):
                jj = c0 + j
                if jj < MB and m0 + jj < M:
                    for r in range(R):
                        if r < F:
                            Hout[sidx, r, m0 + jj] = st[r * C + j]
            if cuda.blockIdx.y == 0:  # the normaliser column: the first column block only
                for u in range(ZR):
                    i = tid + u * NTH
                    if i < F:
                        Hout[sidx, i, M] = zt[u]

    return kernel


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _triangle_entry(iu):
    """Entry ``iu`` (uint32) of a lower triangle stored row by row -> ``(t, s)``, ``s <= t``: the
    float32 root rounded down, then corrected by one where the rounding missed."""
    t = uint32((math.sqrt(float32(uint32(8) * iu + uint32(1))) - float32(1.0)) * float32(0.5))
    if (t + uint32(1)) * (t + uint32(2)) // uint32(2) <= iu:
        t = uint32(t + uint32(1))
    elif t * (t + uint32(1)) // uint32(2) > iu:
        t = uint32(t - uint32(1))
    return t, uint32(iu - t * (t + uint32(1)) // uint32(2))


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _tile_state_read(ac, sq, sst, tt, j0, FP):
    """``ac[j] += phi(q_tt)^T [S | z][:, j0 + j]``, j < 4: token ``tt``'s read of the tile's start state."""
    iu = uint32(0)
    while iu < uint32(FP):
        for a in range(4):
            x = sq[tt, iu + uint32(a)]
            for j in range(4):
                ac[j] += x * sst[iu + uint32(a), j0 + uint32(j)]
        iu += uint32(4)


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _row_dot(x, y, t, s, FP, zero):
    """``x[t, :FP] . y[s, :FP]`` (uint32 rows), four features a step."""
    d = zero
    iu = uint32(0)
    while iu < uint32(FP):
        for a in range(4):
            d += x[t, iu + uint32(a)] * y[s, iu + uint32(a)]
        iu = uint32(iu + uint32(4))
    return d


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _interval_row(lo, hi, NB):
    """The gate's row of ``sz`` holding ``beta_lo ... beta_{hi-1}``, the product of the factors of the
    tile's 4-token blocks ``lo .. hi - 1`` (uint32; row 0, all ones, when ``lo >= hi``)."""
    if lo >= hi:
        return uint32(0)
    return uint32(uint32(1 + 3 * NB) + lo * (uint32(2 * NB + 1) - lo) // uint32(2) + (hi - lo - uint32(1)))


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _gate_score_rows(t, s, T, NB):
    """The rows ``(of sq, of sk, of sz)`` whose product, summed over the features, is the gate's score
    ``sum_f phi(q_t)_f phi(k_s)_f a_{s+1,f} ... a_{t,f}``, ``s <= t`` (uint32; see :func:`_tiles_kernel`):
    another 4-token block's key: ``(q_t pi_t) (k_s sigma_s)`` and the blocks between; in the block,
    ``t`` its last token: ``q_t (k_s sigma_s)``; else ``q_t k_s`` and the pair's own product (1 on
    the diagonal)."""
    bt = t // uint32(4)
    bs = s // uint32(4)
    if bs < bt:
        return uint32(T) + t, uint32(T) + s, _interval_row(bs + uint32(1), bt, NB)
    if s == t:
        return t, s, uint32(0)
    if t == min(bt * uint32(4) + uint32(3), uint32(T - 1)):
        return t, uint32(T) + s, uint32(0)
    return t, s, uint32(1) + bt * uint32(3) + s + t - bt * uint32(8) - uint32(1)


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _log_sum(sl, lo, hi, zero):
    """``sl[lo] + ... + sl[hi - 1]`` (uint32 bounds; 0 when ``lo >= hi``): a sum of log-factors, never a
    difference, so a reset (``-inf``) gives ``-inf`` and its ``exp`` 0, not NaN."""
    g = zero
    u = lo
    while u < hi:
        g += sl[u]
        u = uint32(u + uint32(1))
    return g


def _tiles_kernel(FP, MB, acc, code, off32, vec, rule=RULE_ADDITIVE):
    """The tile layout (``G == 0``; every rule of :data:`TILES_RULES`): see the module docstring.

    The gate rule (``H_t = diag(a_t) H_{t-1} + k_t [v_t | 1]^T``, a factor per feature row): the
    tile's ``T`` tokens are cut into blocks of 4, and one pass (a thread per feature row) forms from
    the factors ``a_{r,f}`` of the tile's tokens, as products taken forwards (never a ratio, so a
    reset, ``a = 0``, gives exact zeros): ``pi_t`` = the factors of ``t``'s block up to ``t``
    (inclusive), ``sigma_s`` = those after ``s`` in its block, each block's product ``beta_b`` and
    the products of every run of whole blocks (rows of ``sz``), and the products of 1 and 2 factors
    inside a block.  With ``q_t pi_t`` and ``k_s sigma_s`` staged in the second halves of ``sq`` and
    ``sk``, every weight ``a_{s+1} ... a_t`` of a score is one row of ``sz`` (:func:`_gate_score_rows`),
    the start state's factor of token ``t`` is ``pi_t`` times the blocks before ``t``'s, and key
    ``s``'s share of the end state ``sigma_s`` times the blocks after ``s``'s: a pass after the scores
    multiplies the staged rows by those runs in place, and the loops that read the start state and
    update the state are the additive rule's.

    The delta rules: the tile's ``beta`` staged next to its log-decays (the gated rule's: as the
    decay rule's); the pass of the scores also forms ``sL[t, s] = beta_t a_{s+1} ... a_t
    phi(k_t)^T phi(k_s)``, ``s < t`` (thread ``NTRI + e`` takes entry ``e`` first); then threads
    ``j < T`` solve ``L x = beta_j e_j`` forwards into column ``j`` of ``sw`` (``W = L^-1
    diag(beta)``, 0 above the diagonal: ``beta = 0`` writes exact zeros) while every thread turns
    its own entries of ``sv`` into ``Y = [v_t | 1] - a_0 ... a_t phi(k_t)^T [S | z]``; after a
    barrier each thread forms its token's row of ``U' = W Y`` (``sU``) and after another the
    outputs and the state read ``sU`` where the other rules read ``sv``.
    """
    acc_t = _ACC_TYPES[acc]
    # one log-factor per token (the decay rule; the gated delta rule's column 0): the tile's weights,
    # start-state reads, key shares
    DECAY = rule == RULE_DECAY or rule == RULE_GATED_DELTA
    GATE = rule == RULE_GATE  # one log-factor per token and feature row: the products of the docstring
    DL = is_delta_rule(rule)  # the delta rules: the tile's values replaced by U' (the docstring's WY form)
    TD = FP // 4 if DECAY else 1  # per-token factor arrays (a one-element stand-in without factors)
    IDX = uint32 if off32 else uint64  # element offsets within a sequence (module docstring)
    VQK = bool(vec & VEC_QK)  # q, k: four features per vector load (module docstring)
    VV = bool(vec & VEC_V)  # v: four columns per vector load
    MAP = -1 if code is None else int(code)  # the feature map, when specialised (seq_kernel)
    MP = -(-(MB + 1) // 4) * 4  # value columns + the normaliser column, padded to 4
    NCG = MP // 4  # column groups of four
    RG = FP // 4  # row groups of four
    T = RG  # tokens per tile: one (token, column group) of the tile's outputs per thread
    NTH = RG * NCG  # threads per block
    FPK = FP + 4  # row stride of the staged phi(q), phi(k): 16-byte rows of one token in distinct banks
    NTRI = T * (T + 1) // 2  # entries of the tile's lower triangle (token s <= token t)
    SVW = 4 if T % 4 == 0 else 1  # scores per step of the tile tokens' product with [v | 1]
    FPV = FP // 4  # groups of four feature rows
    MBV = MP // 4  # groups of four columns
    NB = -(-FP // 16)  # the gate's blocks of 4 tokens in a tile
    TQ = 2 * T if GATE else T  # rows of the staged phi(q), phi(k): the gate's scaled copies after them
    NZ = _gate_rows(FP) if GATE else 1  # the gate's product rows (module docstring; a stand-in otherwise)
    ZW = FPK if GATE else 1
    KR = T if GATE else 0  # first row of sk the state update reads (the gate: the keys' staged shares)
    NL = T * (T - 1) // 2  # the delta rules: entries of the strict lower triangle L of the tile
    zero = acc_t(0.0)
    one = acc_t(1.0)
    # more than MAX_SEQ_THREADS threads (272 at D_phi = M = 64): a register cap keeps registers x
    # threads within a block's 65,536 (a launch bound, .maxntid 272, made ptxas 12.9 take 96
    # registers and spill; uncapped it takes 133, and 178 for strided inputs, spilling nothing)
    nwarps = -(-NTH // 32)
    cap = {} if _SIM or NTH <= MAX_SEQ_THREADS else {"max_registers": (65536 // (32 * nwarps)) // 8 * 8}

    @cuda.jit(cache=_CACHE, **cap)
    def kernel(q, k, v, out, qs, ks, vs, os_, nf, nm, H, Hout, lf, n, seg_len, nseg_per_b, state_div, b2n,
               code, eps, norm, read_state, update, write_out, write_state, flags):
        sq = cuda.shared.array((TQ, FPK), acc_t)
        sk = cuda.shared.array((TQ, FPK), acc_t)
        sz = cuda.shared.array((NZ, ZW), acc_t)  # gate: ones, the in-block products, the blocks' runs
        sv = cuda.shared.array((T, MP), acc_t)
        sa = cuda.shared.array((T, T), acc_t)  # phi(q_t)^T phi(k_s) for s <= t, 0 above the diagonal
        sst = cuda.shared.array((FP, MP), acc_t)  # the state at the tile's start, [S | z | 0]
        sden = cuda.shared.array(T, acc_t)  # the normaliser of every token of the tile
        sl = cuda.shared.array(TD, acc_t)  # decay: log a_t of the tile's tokens (0 past the sequence)
        sfp = cuda.shared.array(TD, acc_t)  # decay: a_0 ... a_t, token t's factor of the start state
        ssh = cuda.shared.array(TD, acc_t)  # decay: a_{s+1} ... a_{T-1}, key s's share of the end state
        # the delta rules' arrays (the other rules never touch them: names for arrays they have)
        sb = cuda.shared.array(T, acc_t) if DL else sl  # beta of the tile's tokens (0 past the sequence)
        sL = cuda.shared.array((T, T), acc_t) if DL else sa  # beta_t a_{s+1} ... a_t phi(k_t)^T phi(k_s), s < t
        sw = cuda.shared.array((T, T), acc_t) if DL else sa  # W = L^-1 diag(beta) (L with its unit diagonal)
        sU = cuda.shared.array((T, MP), acc_t) if DL else sv  # U' = W Y, the values the tile's products read
        st = cuda.local.array(16, acc_t)  # st[a * 4 + j]: state row r0 + a, column j0 + j
        ga = cuda.local.array(4, acc_t)  # gate: the factors of one block's tokens, one feature row
        ac = cuda.local.array(4, acc_t)
        kk = cuda.local.array(4, acc_t)
        vv = cuda.local.array(4, acc_t)

        cd = code if MAP < 0 else MAP  # a specialised kernel's map is a constant: its branches fold
        F = nf
        M = nm
        Fu = uint32(F)
        Mu = uint32(M)
        tid = cuda.threadIdx.x
        rg = uint32(tid) // uint32(NCG)
        cg = uint32(tid) - rg * uint32(NCG)
        r0 = rg * uint32(4)  # this thread's state rows r0 .. r0 + 3
        j0 = cg * uint32(4)  # and block columns j0 .. j0 + 3 (j < MB: value column m0 + j, MB: z)
        tt = rg  # the token of the tile whose outputs j0 .. j0 + 3 this thread sums
        b, c, sidx, m0, qb, kb, vb, ob, check, cqk = _block_segment(q, k, v, out, qs, ks, vs, os_, nseg_per_b, b2n,
                                                                    state_div, MB, flags)
        m0u = uint32(m0)
        epsa = acc_t(eps)
        qn, qf, kn, kf = IDX(qs[2]), IDX(qs[3]), IDX(ks[2]), IDX(ks[3])
        vn, vf, on, of = IDX(vs[2]), IDX(vs[3]), IDX(os_[2]), IDX(os_[3])

        for a in range(4):
            r = r0 + uint32(a)
            for j in range(4):
                jj = j0 + uint32(j)
                x = zero
                if read_state and r < Fu:
                    if jj < uint32(MB) and m0u + jj < Mu:
                        x = acc_t(H[sidx, r, m0u + jj])
                    elif jj == uint32(MB):
                        x = acc_t(H[sidx, r, M])
                st[a * 4 + j] = x
                sst[r, jj] = x
        for idx in range(tid, T * T, NTH):  # above the diagonal: 0 for good
            sa[uint32(idx) // uint32(T), uint32(idx) % uint32(T)] = zero
        my_t, my_s = _triangle_entry(uint32(tid) if tid < NTRI else uint32(0))
        # the delta rules' entries of L: thread NTRI + e takes entry e first (the threads of the scores last)
        lrot = (tid + NTH - NTRI % NTH) % NTH if DL else 0
        my_lt, my_ls = _triangle_entry(uint32(lrot) if DL and lrot < NL else uint32(0))
        my_lt = uint32(my_lt + uint32(1))
        my_x, my_y, my_z = _gate_score_rows(my_t, my_s, T, NB)
        if GATE:
            for f in range(tid, FP, NTH):
                sz[0, uint32(f)] = one

        t_begin = c * seg_len
        t_end = min(n, t_begin + seg_len)
        for t0 in range(t_begin, t_end, T):
            ntu = uint32(min(T, t_end - t0))
            t0u = uint32(t0)
            # ---- stage the tile's T tokens (past the sequence: zero): phi(q), phi(k), [v | 1 | 0]
            if VQK:
                for idx in range(tid, T * FPV, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(FPV)
                    i4 = (iu - t * uint32(FPV)) * uint32(4)
                    if write_out and t < ntu and i4 < Fu:
                        stage4(sq, t, i4, qb, IDX((t0u + t) * qn + i4), flags, 0, cqk, True, cd, zero, one)
                    else:
                        fill4(sq, t, i4, FP, zero, FP, zero)
                    if update and t < ntu and i4 < Fu:
                        stage4(sk, t, i4, kb, IDX((t0u + t) * kn + i4), flags, 1, cqk, True, cd, zero, one)
                    else:
                        fill4(sk, t, i4, FP, zero, FP, zero)
            else:
                for idx in range(tid, T * FP, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(FP)
                    i = iu - t * uint32(FP)
                    if write_out and t < ntu and i < Fu:
                        stage(sq, t, i, qb[IDX((t0u + t) * qn + i * qf)], flags, 0, cqk, True, cd, zero, one)
                    else:
                        sq[t, i] = zero
                    if update and t < ntu and i < Fu:
                        stage(sk, t, i, kb[IDX((t0u + t) * kn + i * kf)], flags, 1, cqk, True, cd, zero, one)
                    else:
                        sk[t, i] = zero
            if update and VV:
                for idx in range(tid, T * MBV, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(MBV)
                    j4 = (iu - t * uint32(MBV)) * uint32(4)
                    if t < ntu and j4 < uint32(MB) and m0u + j4 < Mu:
                        stage4(sv, t, j4, vb, IDX(m0u + j4 + (t0u + t) * vn), flags, 2, check, False, cd, zero, one)
                    else:  # past the values: the normaliser's column of ones (live tokens), then padding
                        fill4(sv, t, j4, MP, zero, MB, one if t < ntu else zero)
            elif update:
                for idx in range(tid, T * MP, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(MP)
                    jj = iu - t * uint32(MP)
                    col = m0u + jj
                    if t < ntu and jj < uint32(MB) and col < Mu:
                        stage(sv, t, jj, vb[IDX((t0u + t) * vn + col * vf)], flags, 2, check, False, cd, zero, one)
                    else:
                        sv[t, jj] = one if jj == uint32(MB) and t < ntu else zero
            if DECAY and update:
                for t in range(tid, T, NTH):
                    tu = uint32(t)
                    sl[tu] = acc_t(lf[b, t0u + tu, 0]) if tu < ntu else zero
            if DL and update:  # beta (column 1 of the delta rules' inputs; column 0 the log-decay)
                for t in range(tid, T, NTH):
                    tu = uint32(t)
                    sb[tu] = acc_t(lf[b, t0u + tu, 1]) if tu < ntu else zero
            cuda.syncthreads()
            if is_row_map(cd):  # L2, SiLU then L2: one thread per staged row
                _normalize_staged_rows(sq, sk, T, tid, NTH, F, update, write_out)
                cuda.syncthreads()
            if GATE and update:  # the products of the factors, a thread per feature row (docstring)
                for f in range(tid, FP, NTH):
                    fu = uint32(f)
                    for bb in range(NB):
                        for l in range(4):
                            r = uint32(4 * bb + l)
                            ga[l] = one
                            if 4 * bb + l < T and r < ntu and fu < Fu:
                                ga[l] = math.exp(acc_t(lf[b, t0u + r, fu]))
                        x = one
                        for l in range(4):  # pi: the block's factors up to each token, inclusive
                            if 4 * bb + l < T:
                                x *= ga[l]
                                sq[T + 4 * bb + l, fu] = sq[4 * bb + l, fu] * x
                        # the runs of whole blocks ending with this one, each the previous run times it
                        sz[1 + 3 * NB + bb * (2 * NB + 1 - bb) // 2, fu] = x
                        for lo in range(bb):
                            sz[1 + 3 * NB + lo * (2 * NB + 1 - lo) // 2 + bb - lo, fu] = (
                                sz[1 + 3 * NB + lo * (2 * NB + 1 - lo) // 2 + bb - lo - 1, fu] * x)
                        x = one
                        for l in range(3, -1, -1):  # sigma: the block's factors after each token
                            if 4 * bb + l < T:
                                sk[T + 4 * bb + l, fu] = sk[4 * bb + l, fu] * x
                                x *= ga[l]
                        sz[1 + 3 * bb, fu] = ga[1]  # the in-block pairs (0, 1), (0, 2), (1, 2)
                        sz[2 + 3 * bb, fu] = ga[1] * ga[2]
                        sz[3 + 3 * bb, fu] = ga[2]
                cuda.syncthreads()
            # ---- the tile's causal scores phi(q_t)^T phi(k_s), s <= t: one per thread of the first
            # NTRI (no lane idles on the masked half); a thread sums its own dot product
            if update and write_out:
                for idx in range(tid, NTRI, NTH):
                    if NTRI <= NTH:  # one score per thread: its (t, s), found once before the tiles
                        t, s = my_t, my_s
                        xr, yr, zr = my_x, my_y, my_z
                    else:
                        t, s = _triangle_entry(uint32(idx))
                        xr, yr, zr = _gate_score_rows(t, s, T, NB)
                    x = zero
                    iu = uint32(0)
                    while iu < uint32(FP):  # 32-bit counter, four rows a step (the loops below likewise)
                        for a in range(4):
                            if GATE:  # the weight of every feature row: one product row of sz
                                x += sq[xr, iu + uint32(a)] * sk[yr, iu + uint32(a)] * sz[zr, iu + uint32(a)]
                            else:
                                x += sq[t, iu + uint32(a)] * sk[s, iu + uint32(a)]
                        iu = uint32(iu + uint32(4))
                    if DECAY:  # weight a_{s+1} ... a_t: exp of a sum of the tile's log-factors (1 on the diagonal)
                        x *= math.exp(_log_sum(sl, uint32(s + uint32(1)), uint32(t + uint32(1)), zero))
                    sa[t, s] = x
            if DL and update:  # the entries of L, from thread NTRI on (the scores' threads come last)
                for idx in range(lrot, NL, NTH):
                    if NTRI + NL <= NTH:  # at most one entry per thread, found once before the tiles
                        t, s = my_lt, my_ls
                    else:
                        t, s = _triangle_entry(uint32(idx))
                        t = uint32(t + uint32(1))
                    w = sb[t]  # beta_t, times a_{s+1} ... a_t
                    if DECAY:
                        s1 = uint32(s + uint32(1))
                        w *= math.exp(_log_sum(sl, s1, uint32(t + uint32(1)), zero))
                    sL[t, s] = w * _row_dot(sk, sk, t, s, FP, zero)
            if DECAY and update:  # each token's factor of the start state and each key's share of the end state
                for t in range(tid, T, NTH):
                    tu = uint32(t)
                    sfp[tu] = math.exp(_log_sum(sl, uint32(0), uint32(tu + uint32(1)), zero))
                    ssh[tu] = math.exp(_log_sum(sl, uint32(tu + uint32(1)), uint32(T), zero))
            if update and (write_out or DECAY or DL):
                cuda.syncthreads()
            if DL and update:
                # W = L^-1 diag(beta): column j solved forwards by thread j alone (it reads only the
                # rows of its own column it wrote; L's entries are broadcasts), x_j = beta_j and
                # x_t = -sum_{s<t} L_ts x_s (0 above the diagonal)
                if tid < T:
                    ju = uint32(tid)
                    for t in range(T):
                        tu = uint32(t)
                        x = sb[ju] if tu == ju else zero
                        for s in range(t):
                            x -= sL[tu, uint32(s)] * sw[uint32(s), ju]
                        sw[tu, ju] = x
                # Y = [V | 1] - (a_0 ... a_t phi(k_t))^T [S | z], in place: this thread's token and columns
                for j in range(4):
                    ac[j] = zero
                _tile_state_read(ac, sk, sst, tt, j0, FP)
                bt = sfp[tt] if DECAY else one  # a_0 ... a_tt (the delta rule: 1)
                for j in range(4):
                    sv[tt, j0 + uint32(j)] -= bt * ac[j]
                cuda.syncthreads()
                # U' = W Y: the tile's values for the products below (the additive and decay rules' loops)
                for j in range(4):
                    ac[j] = zero
                uu = uint32(0)
                while uu < uint32(T):
                    for a in range(SVW):
                        x = sw[tt, uu + uint32(a)]
                        for j in range(4):
                            ac[j] += x * sv[uu + uint32(a), j0 + uint32(j)]
                    uu = uint32(uu + uint32(SVW))
                for j in range(4):
                    sU[tt, j0 + uint32(j)] = ac[j]
                cuda.syncthreads()
            if GATE and update:  # the scores read, the scaled rows become q_t a_0 ... a_t and k_s a_{s+1} ... a_{T-1}
                for idx in range(tid, 2 * T * FPV, NTH):  # four rows of one token at a time
                    iu = uint32(idx)
                    keys = iu >= uint32(T * FPV)
                    if keys:
                        iu = uint32(iu - uint32(T * FPV))
                    t = iu // uint32(FPV)
                    i4 = (iu - t * uint32(FPV)) * uint32(4)
                    if keys:  # sigma_t and the blocks after t's
                        zr = _interval_row(t // uint32(4) + uint32(1), uint32(NB), NB)
                        for a in range(4):
                            sk[uint32(T) + t, i4 + uint32(a)] *= sz[zr, i4 + uint32(a)]
                    else:  # pi_t and the blocks before t's
                        zr = _interval_row(uint32(0), t // uint32(4), NB)
                        for a in range(4):
                            sq[uint32(T) + t, i4 + uint32(a)] *= sz[zr, i4 + uint32(a)]
                cuda.syncthreads()
            # ---- outputs of token tt, columns j0 .. j0 + 3: the tile's own tokens, then the start
            # state ((Q K^T masked) [V | 1] + Q [S | z]; column MB is the normaliser)
            if write_out:
                for j in range(4):
                    ac[j] = zero
                if DECAY and update:  # the start state's term first, scaled by a_0 ... a_tt
                    _tile_state_read(ac, sq, sst, tt, j0, FP)
                    x = sfp[tt]
                    for j in range(4):
                        ac[j] *= x
                if update:
                    su = uint32(0)
                    while su < uint32(T):
                        for a in range(SVW):  # four scores a step (one 16-byte load) where T allows
                            x = sa[tt, su + uint32(a)]
                            for j in range(4):  # sU: U' for the delta rules, [v | 1] (sv itself) otherwise
                                ac[j] += x * sU[su + uint32(a), j0 + uint32(j)]
                        su = uint32(su + uint32(SVW))
                if GATE and update:  # phi(q_tt) a_0 ... a_tt, staged
                    _tile_state_read(ac, sq, sst, uint32(T) + tt, j0, FP)
                elif not (DECAY and update):
                    _tile_state_read(ac, sq, sst, tt, j0, FP)
                for j in range(4):
                    if j0 + uint32(j) == uint32(MB):
                        x = ac[j]
                        if norm == NORM_FLOOR and x < epsa:
                            x = epsa
                        sden[tt] = x
            # ---- the state: S += phi(K)^T [V | 1 | 0] over the tile, this thread's 4 x 4 tile
            if update:
                if DECAY:  # S <- a_0 ... a_{T-1} S + sum_s (a_{s+1} ... a_{T-1} k_s) [v_s | 1]^T
                    x = sfp[T - 1]
                    for i in range(16):
                        st[i] *= x
                if GATE:  # every row by its a_0 ... a_{T-1}: the run of all the tile's blocks
                    zr = _interval_row(uint32(0), uint32(NB), NB)
                    for a in range(4):
                        x = sz[zr, r0 + uint32(a)]
                        for j in range(4):
                            st[a * 4 + j] *= x
                sb0 = uint32(0)
                while sb0 < uint32(T):
                    for e in range(SVW):  # SVW keys a step where T allows
                        su = uint32(sb0 + uint32(e))
                        for a in range(4):  # the gate: key su times a_{su+1} ... a_{T-1}, staged
                            kk[a] = sk[uint32(KR) + su, r0 + uint32(a)]
                        if DECAY:
                            x = ssh[su]
                            for a in range(4):
                                kk[a] *= x
                        for j in range(4):
                            vv[j] = sU[su, j0 + uint32(j)]
                        for a in range(4):
                            for j in range(4):
                                st[a * 4 + j] += kk[a] * vv[j]
                    sb0 = uint32(sb0 + uint32(SVW))
            cuda.syncthreads()
            if update:
                for a in range(4):
                    for j in range(4):
                        sst[r0 + uint32(a), j0 + uint32(j)] = st[a * 4 + j]
            if write_out and tt < ntu:
                den = sden[tt]
                for j in range(4):
                    jj = j0 + uint32(j)
                    col = m0u + jj
                    if jj < uint32(MB) and col < Mu:
                        x = ac[j]
                        if norm != NORM_NONE:
                            x = x / den
                        ob[IDX((t0u + tt) * on + col * of)] = x
            # the next tile's staging rewrites sq, sk, sv only after every thread has read them
            # (the barrier above); its first barrier orders these state writes before their reads

        if write_state:
            for a in range(4):
                r = r0 + uint32(a)
                if r < Fu:
                    for j in range(4):
                        jj = j0 + uint32(j)
                        if jj < uint32(MB) and m0u + jj < Mu:
                            Hout[sidx, r, m0u + jj] = st[a * 4 + j]
                        elif jj == uint32(MB) and cuda.blockIdx.y == 0:
                            Hout[sidx, r, M] = st[a * 4 + j]

    return kernel


def seq_kernel(R: int, C: int, G: int, MB: int, T: int, acc: str, rule: int = RULE_ADDITIVE, code=None,
               off32: bool = True, vec: int = 0):
    """The sequence kernel specialised on its compile-time constants.

    ``R`` x ``C``: state rows x state columns per thread (a register tile);
    ``G``: row groups (``G R >= F``; ``G == 1`` is the owner layout of the
    module docstring for every rule but the delta rules); ``MB``: value columns per block; ``T``:
    tokens per shared-memory tile; ``acc``: accumulation dtype name;
    ``rule``: update-rule code (a constant here, so every rule test is
    resolved at compile time, and the staging and rescaling of per-token
    factors is compiled into the kernels of rules that have them only).  The
    block's ``MB + 1`` columns (values, then the normaliser) are padded to
    ``MBP``, a multiple of ``C`` (row groups; the owner layout splits the
    normaliser by rows).  Launch with ``grid=(n_segments, n_column_blocks)``,
    ``block=`` :func:`threads_per_block` threads (:func:`seq_config`)::

        kernel(q, k, v, out, qs, ks, vs, os, F, M, H, Hout, lf, n, seg_len, nseg_per_b, state_div, b2n,
               code, eps, norm, read_state, update, write_out, write_state, flags)

    q, k : (B1, B2, N, F); v, out : (B1, B2, N, M), any non-negative strides,
    passed as 1-d views from their first elements (:func:`flat_view`) and
    their strides in elements ``qs, ks, vs, os`` (4-tuples of int64; the
    signature is :func:`seq_signature`); batch entry
    ``b = b1 * B2 + b2`` (``b2n`` = B2).  Segment ``s = blockIdx.x`` is chunk
    ``s % nseg_per_b`` of batch entry ``s // nseg_per_b``: tokens
    ``[c * seg_len, min(N, (c + 1) * seg_len))``.  H, Hout : (n_states, F,
    M + 1) states in the accumulation dtype, column M holds z; the block
    starts from ``H[s // state_div]`` (``read_state``, else zero) and writes
    its final state to ``Hout[s // state_div]`` (``write_state``).  H and Hout
    may be one array only when the launch has one column block: the blocks
    over value columns all read the normaliser column, and only the first one
    writes it.  lf : (B, N, W) float64 (or float32: each value is converted to
    the accumulation dtype as it is staged) log-factors of the rule
    (:func:`linattn_nb.ops._cuda_common.rule_factor_rows`: W = 1 for the
    decay rule, F for the gate rule, 2 for the delta rules: the log-decay,
    then ``beta``); the additive kernel never reads it (pass any (1, 1, 1)
    float64 array).  ``code``: the feature map (:mod:`linattn_nb.ops._codes`;
    codes 4 and 5 normalise the staged rows); a kernel made with ``code=c``
    (the factory's last argument) applies map ``c`` whatever the argument
    says: its map is a compile-time constant, so the staging loop holds that
    map's instructions only, with no branch over the maps (``None``: one
    kernel for every map, branching per staged element).  ``norm``: ``NORM_RAW``, ``NORM_FLOOR``
    (the normaliser floored at ``eps``) or ``NORM_NONE`` (no division) of
    :mod:`linattn_nb.ops._codes`.  ``flags``: int32, shape (3,) to count the
    non-finite q, k, v values the launch stages (module docstring), (1,) for
    no check.  ``off32``: element offsets within a sequence in ``uint32``
    (every sequence spans fewer than :data:`OFF32_LIMIT` elements), else
    ``uint64``; ``vec``: the vector-load bits (:func:`vector_bits`; the
    caller guarantees the alignment they assume).
    """
    key = (int(R), int(C), int(G), int(MB), int(T), str(acc), int(rule), None if code is None else int(code),
           bool(off32), int(vec))
    kern = _SEQ_KERNELS.get(key)
    if kern is not None:
        return kern
    R, C, G, MB, T = key[:5]
    rule = key[6]
    if G == 0:
        if rule not in TILES_RULES or C != 4 or R % 4 or T != R // 4:
            raise ValueError(f"the tile layout (G = 0) is that of the rules of TILES_RULES, with C = 4, T = R / 4; "
                             f"got {key}")
        kern = _SEQ_KERNELS[key] = _tiles_kernel(R, MB, acc, key[7], key[8], key[9], rule)
        return kern
    if G == 1 and not is_delta_rule(rule):
        kern = _SEQ_KERNELS[key] = _owner_kernel(R, C, MB, T, acc, rule, key[7], key[8], key[9])
        return kern
    acc_t = _ACC_TYPES[acc]
    IDX = uint32 if key[8] else uint64  # element offsets within a sequence (module docstring)
    VQK = bool(key[9] & VEC_QK)  # q, k: four features per vector load (module docstring)
    VV = bool(key[9] & VEC_V)  # v: four columns per vector load
    MAP = -1 if key[7] is None else key[7]  # the feature map, when specialised
    FP = G * R  # padded feature rows
    MBP = -(-(MB + 1) // C) * C  # value columns + normaliser column, padded
    NCG = MBP // C  # column groups
    NTH = G * NCG  # threads per block
    RC = R * C
    zero = acc_t(0.0)
    one = acc_t(1.0)
    # per-token factors (compile-time): none (additive: sa is one unused
    # element), one per token (decay) or one per feature row (gate)
    FACTORS = rule_factor_rows(rule, FP) > 0
    PER_ROW = rule == RULE_GATE
    # delta rules: per token the factor (gated delta; 1 for the delta rule)
    # and the write strength beta, and a double buffer of the partial sums
    # k^T H[:, m] of the G row groups (the reduction before the update)
    DELTA = is_delta_rule(rule)
    GATED = rule == RULE_GATED_DELTA
    SAT = T if FACTORS else 1
    SAW = FP if PER_ROW else (2 if DELTA else 1)
    SPW = FP if PER_ROW else 1
    # delta rules with G a power of two up to 32: the G row groups of a column are G adjacent lanes
    # of one warp, and k^T H[:, m] is summed by log2(G) xor-shuffles, with no barrier per token
    WARP_SUM = DELTA and G <= 32 and (G & (G - 1)) == 0
    LOG2G = G.bit_length() - 1
    PU = (2, G, MBP) if DELTA and not WARP_SUM else (1, 1, 1)
    # decay and gate: rescaled tiles as in the owner layout (module docstring); the gated delta
    # rule rescales its tiles too (q_t P_t and v_t / P_t: the delta rule's step on them)
    RESCALE = FACTORS and not DELTA
    TAU = acc_t(RESCALE_MIN_F32 if acc == "float32" else RESCALE_MIN_F64)
    FPV = -(-FP // 4)  # groups of four feature rows
    MBV = -(-MBP // 4)  # groups of four columns

    @cuda.jit(cache=_CACHE)
    def kernel(q, k, v, out, qs, ks, vs, os_, nf, nm, H, Hout, lf, n, seg_len, nseg_per_b, state_div, b2n,
               code, eps, norm, read_state, update, write_out, write_state, flags):
        sq = cuda.shared.array((T, FP), acc_t)
        sk = cuda.shared.array((T, FP), acc_t)
        sv = cuda.shared.array((T, MBP), acc_t)
        sa = cuda.shared.array((SAT, SAW), acc_t)  # the tokens' factors exp(log-factor)
        part = cuda.shared.array((T, G, MBP), acc_t)
        sden = cuda.shared.array(T, acc_t)  # the normaliser of every token of the tile
        pu = cuda.shared.array(PU, acc_t)  # delta rules: partial k^T H per (token parity, row group, column)
        sp = cuda.shared.array(SPW, acc_t)  # a rescaled tile's factor of each state row (the gate)
        st = cuda.local.array(RC, acc_t)  # st[r * C + j]: row row0 + r, column c0 + j
        vt = cuda.local.array(C, acc_t)
        ac = cuda.local.array(C, acc_t)
        ut = cuda.local.array(C, acc_t)  # delta rules: k^T H, then the correction, per column

        cd = code if MAP < 0 else MAP  # a specialised kernel's map is a constant: its branches fold
        F = nf
        M = nm
        tid = cuda.threadIdx.x
        if WARP_SUM:  # row group fastest: a column's G groups share a warp
            tg = tid % G
            c0 = (tid // G) * C
        else:
            tg = tid // NCG
            c0 = (tid - tg * NCG) * C
        # the lanes of this thread's warp that exist (the last warp of the block may be partial)
        nlanes = min(32, NTH - (tid // 32) * 32)
        lanes = uint32(0xFFFFFFFF) if nlanes == 32 else uint32((1 << nlanes) - 1)
        # the batch entry's sequences from their first element (64-bit, once per block), then
        # element offsets of IDX within them: token x token stride + column x column stride
        b, c, sidx, m0, qb, kb, vb, ob, check, cqk = _block_segment(q, k, v, out, qs, ks, vs, os_, nseg_per_b, b2n,
                                                                    state_div, MB, flags)
        qn, qf, kn, kf = IDX(qs[2]), IDX(qs[3]), IDX(ks[2]), IDX(ks[3])
        vn, vf, on, of = IDX(vs[2]), IDX(vs[3]), IDX(os_[2]), IDX(os_[3])
        row0 = uint32(tg * R)  # unsigned: no wraparound, and the compiler sees its alignment
        Fu = uint32(F)
        Mu = uint32(M)
        m0u = uint32(m0)
        epsa = acc_t(eps)

        # block column j < MB is value column m0 + j, j == MB the normaliser
        # (state column M), j > MB padding
        for j in range(C):
            jj = c0 + j
            col = M if jj == MB else m0 + jj
            ok = read_state and (jj == MB or (jj < MB and m0 + jj < M))
            for r in range(R):
                x = zero
                if ok and row0 + r < F:
                    x = acc_t(H[sidx, row0 + r, col])
                st[r * C + j] = x

        t_begin = c * seg_len
        t_end = min(n, t_begin + seg_len)
        for t0 in range(t_begin, t_end, T):
            nt = min(T, t_end - t0)
            # ---- stage the tile: phi(q), phi(k) (zero-padded rows), v and 1;
            # unsigned indices (no negative-index wraparound; divisions by
            # compile-time constants; every operand unsigned, as a signed one
            # would make the sum a float)
            t0u = uint32(t0)
            if VQK:  # four feature rows of one token per thread, one vector load each
                for idx in range(tid, nt * FPV, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(FPV)
                    i4 = (iu - t * uint32(FPV)) * uint32(4)
                    if write_out and i4 < Fu:
                        stage4(sq, t, i4, qb, IDX((t0u + t) * qn + i4), flags, 0, cqk, True, cd, zero, one)
                    else:
                        fill4(sq, t, i4, FP, zero, FP, zero)
                    if update and i4 < Fu:
                        stage4(sk, t, i4, kb, IDX((t0u + t) * kn + i4), flags, 1, cqk, True, cd, zero, one)
                    else:
                        fill4(sk, t, i4, FP, zero, FP, zero)
            for idx in range(tid, nt * FP if (PER_ROW and update) or not VQK else 0, NTH):
                iu = uint32(idx)
                t = iu // uint32(FP)
                i = iu - t * uint32(FP)
                if not VQK:  # the feature map (ops._cuda_common.phi, inlined)
                    if write_out and i < Fu:
                        stage(sq, t, i, qb[IDX((t0u + t) * qn + i * qf)], flags, 0, cqk, True, cd, zero, one)
                    else:
                        sq[t, i] = zero
                    if update and i < Fu:
                        stage(sk, t, i, kb[IDX((t0u + t) * kn + i * kf)], flags, 1, cqk, True, cd, zero, one)
                    else:
                        sk[t, i] = zero
                if PER_ROW and update:  # gate: the factor of row i (1 on padding rows, whose state is 0)
                    sa[t, i] = math.exp(acc_t(lf[b, t0u + t, i])) if i < Fu else one
            if FACTORS and not PER_ROW and not DELTA and update:  # decay: one factor per token
                for t in range(tid, nt, NTH):
                    sa[t, 0] = math.exp(acc_t(lf[b, t0 + t, 0]))
            if DELTA and update:  # delta rules: the factor (1 without a gate), then beta
                for t in range(tid, nt, NTH):
                    sa[t, 0] = math.exp(acc_t(lf[b, t0 + t, 0])) if GATED else one
                    sa[t, 1] = acc_t(lf[b, t0 + t, 1])
            if update and VV:  # four columns of one token per thread, one vector load each
                for idx in range(tid, nt * MBV, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(MBV)
                    j4 = (iu - t * uint32(MBV)) * uint32(4)
                    if j4 < uint32(MB) and m0u + j4 < Mu:
                        stage4(sv, t, j4, vb, IDX((t0u + t) * vn + m0u + j4), flags, 2, check, False, cd, zero, one)
                    else:  # past the values: the normaliser's column of ones, then padding
                        fill4(sv, t, j4, MBP, zero, MB, one)
            elif update:
                for idx in range(tid, nt * MBP, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(MBP)
                    jj = iu - t * uint32(MBP)
                    col = m0u + jj
                    if jj < uint32(MB) and col < Mu:
                        stage(sv, t, jj, vb[IDX((t0u + t) * vn + col * vf)], flags, 2, check, False, cd, zero, one)
                    else:
                        sv[t, jj] = one if jj == uint32(MB) else zero
            cuda.syncthreads()
            # ---- row maps (L2, SiLU then L2): normalise every staged row,
            # one thread per row (code is uniform over the block)
            if is_row_map(cd):
                _normalize_staged_rows(sq, sk, nt, tid, NTH, F, update, write_out)
                cuda.syncthreads()
            # ---- decay, gate, gated delta (module docstring, "Rescaled tiles"): as in the
            # owner layout, a tile whose running factors stay >= TAU runs the token loop on
            # q_t P_t and k_t / P_t (gated delta: v_t / P_t) and scales the state by its P
            # at its end; otherwise one token at a time, the state scaled by the token's
            # factors first
            whole = not (RESCALE or GATED)
            ptile = one
            if (RESCALE or GATED) and update:
                whole, ptile = _rescale_tile(sq, sk, sv, sa, sp, nt, tid, NTH, FP, MBP, PER_ROW, RESCALE, GATED,
                                             TAU, one)
            # ---- per token: update the R x C state tile, partial phi(q)^T S
            if DELTA and update:
                # delta rules: k^T H[:, m] over all F rows, the partials of the G
                # row groups summed by xor-shuffles within the warp (WARP_SUM: every
                # lane of the group gets the whole sum, no barrier) or through shared
                # memory (one syncthreads per token: buffer t & 1 is rewritten two
                # tokens later, after the next token's barrier); then the column's
                # correction and the update.  The gated rule runs the delta rule's
                # step on a rescaled tile (v_t / P_t staged, the state scaled by P at
                # the tile's end), or in the direct form on the state scaled by the
                # token's factor first.
                for seg_t in range(1 if whole else nt):  # the whole tile, or one token at a time
                    ta = 0 if whole else seg_t
                    if not whole:  # the direct form: the token's factor on the state first
                        ft = sa[ta, 0]
                        for r in range(R):
                            for j in range(C):
                                st[r * C + j] *= ft
                    for t in range(ta, nt if whole else seg_t + 1):
                        bt = sa[t, 1]
                        for j in range(C):
                            ut[j] = zero
                        for r in range(R):
                            kr = sk[t, row0 + r]
                            for j in range(C):
                                ut[j] += kr * st[r * C + j]
                        if WARP_SUM:
                            for j in range(C):
                                x = ut[j]
                                for lvl in range(LOG2G):
                                    x += cuda.shfl_xor_sync(lanes, x, G >> (lvl + 1))
                                ut[j] = bt * (sv[t, c0 + j] - x)  # beta (w - k^T H): the column's correction
                                ac[j] = zero
                        else:
                            buf = t & 1
                            for j in range(C):
                                pu[buf, tg, c0 + j] = ut[j]
                            cuda.syncthreads()
                            for j in range(C):
                                x = zero
                                for g in range(G):
                                    x += pu[buf, g, c0 + j]
                                ut[j] = bt * (sv[t, c0 + j] - x)  # beta (w - k^T H): the column's correction
                                ac[j] = zero
                        _update_read(st, ut, ac, sk, sq, t, row0, R, C)
                        if write_out:
                            for j in range(C):
                                part[t, tg, c0 + j] = ac[j]
                if GATED and whole:
                    for r in range(R):
                        for j in range(C):
                            st[r * C + j] *= ptile
            elif update:
                # additive, decay, gate: the additive token loop over one segment
                # (the whole tile: the additive rule, a rescaled tile), or over one
                # token at a time with the token's factors on the state first
                for seg_t in range(1 if whole else nt):
                    ta = 0 if whole else seg_t
                    te = nt if whole else seg_t + 1
                    if not whole:
                        ua = uint32(ta)
                        for r in range(R):
                            fr = sa[ua, row0 + r] if PER_ROW else sa[ua, 0]
                            for j in range(C):
                                st[r * C + j] *= fr
                    if write_out:
                        for tt in range(ta, te):
                            t = uint32(tt)
                            for j in range(C):
                                vt[j] = sv[t, c0 + j]
                                ac[j] = zero
                            _update_read(st, vt, ac, sk, sq, t, row0, R, C)
                            for j in range(C):
                                part[t, tg, c0 + j] = ac[j]
                    else:
                        for tt in range(ta, te):
                            t = uint32(tt)
                            for j in range(C):
                                vt[j] = sv[t, c0 + j]
                            for r in range(R):
                                kr = sk[t, row0 + r]
                                for j in range(C):
                                    st[r * C + j] += kr * vt[j]
                if RESCALE and whole:
                    for r in range(R):
                        fr = sp[row0 + r] if PER_ROW else ptile
                        for j in range(C):
                            st[r * C + j] *= fr
            else:
                for t in range(nt):
                    for j in range(C):
                        ac[j] = zero
                    for r in range(R):
                        qr = sq[t, row0 + r]
                        for j in range(C):
                            ac[j] += qr * st[r * C + j]
                    for j in range(C):
                        part[t, tg, c0 + j] = ac[j]
            cuda.syncthreads()
            # ---- the normaliser of every token (its G partials, once per
            # token), then the G partials per value column divided by it
            # (part is rewritten only after the next tile's first sync);
            # unsigned indices: no wraparound, division by a constant
            if write_out:
                for t in range(tid, nt, NTH):
                    den = zero
                    for g in range(G):
                        den += part[t, g, MB]
                    if norm == NORM_FLOOR and den < epsa:
                        den = epsa
                    sden[t] = den
                cuda.syncthreads()
                for idx in range(tid, nt * MB, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(MB)
                    jj = iu - t * uint32(MB)
                    col = uint32(m0) + jj  # all unsigned: a signed operand would make it a float
                    if col < uint32(M):
                        num = zero
                        for g in range(G):
                            num += part[t, g, jj]
                        if norm != NORM_NONE:  # normalize=False writes the numerator
                            num = num / sden[t]
                        ob[IDX((uint32(t0) + t) * on + col * of)] = num

        if write_state:
            for j in range(C):
                jj = c0 + j
                col = M if jj == MB else m0 + jj
                # the normaliser column is written by the first column block only
                ok = (jj == MB and cuda.blockIdx.y == 0) or (jj < MB and m0 + jj < M)
                if ok:
                    for r in range(R):
                        if row0 + r < F:
                            Hout[sidx, row0 + r, col] = st[r * C + j]

    _SEQ_KERNELS[key] = kernel
    return kernel


# ---------------------------------------------------------------------------
# Helper kernels (plain arrays: cached on disk)
# ---------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _state_index(idx, F, M1):
    """C-order index -> (b, i, col) of a (B, F, M + 1) packed state."""
    b = idx // (F * M1)
    rem = idx - b * (F * M1)
    i = rem // M1
    return b, i, rem - i * M1


@cuda.jit(cache=_CACHE)
def state_copy_kernel(S, z, H, pack):
    """``pack``: H[b, :, :M] = S[b], H[b, :, M] = z[b] (cast to H's dtype);
    else the inverse, into S, z (cast to their dtype)."""
    B, F, M = S.shape
    M1 = M + 1
    total = B * F * M1
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for idx in range(start, total, stride):
        b, i, col = _state_index(idx, F, M1)
        if pack:
            if col < M:
                H[b, i, col] = S[b, i, col]
            else:
                H[b, i, col] = z[b, i]
        elif col < M:
            S[b, i, col] = H[b, i, col]
        else:
            z[b, i] = H[b, i, col]


@cuda.jit(cache=_CACHE)
def cast_copy_kernel(src, dst):
    """dst[...] = src[...] (cast to dst's dtype) for (n, F, M + 1) states of equal shape:
    the caller's float64 state to and from a float32 accumulation state."""
    n, F, M1 = src.shape
    total = n * F * M1
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for idx in range(start, total, stride):
        b, i, col = _state_index(idx, F, M1)
        dst[b, i, col] = src[b, i, col]


@cuda.jit(cache=_CACHE)
def chunk_factors_kernel(lf, L, nchunks, Af):
    """Every chunk's total factor: ``Af[b * nchunks + c, w] = exp(sum of lf[b, t, w])``.

    lf : (B, N, W) float64 or float32 log-factors of the rule (W = 1: decay, W = F:
    gate); chunk ``c`` is tokens ``[c L, min(N, (c + 1) L))``.  The sum runs
    in float64 (each log-factor converted to float64 first, whatever the
    dtype of ``lf``) and is never differenced: a reset (``-inf``) in the chunk
    makes the sum ``-inf`` and the factor exactly 0, with no NaN.  Af :
    (B * nchunks, W) float64.
    """
    B, N, W = lf.shape
    total = B * nchunks * W
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for idx in range(start, total, stride):
        w = idx % W
        bc = idx // W
        b = bc // nchunks
        c = bc - b * nchunks
        acc = 0.0
        for t in range(c * L, min(N, (c + 1) * L)):
            acc += float(lf[b, t, w])  # float64 (the simulator would keep a float32 lf in float32)
        Af[bc, w] = math.exp(acc)


@cuda.jit(cache=_CACHE)
def chunk_scan_states_kernel(Hc, H, Htot, Af, nchunks, exclusive, write_tot, rule):
    """Combine per-chunk contributions with the initial state, in float64.

    Hc : (B * nchunks, F, M + 1) per-chunk contributions (each chunk's state
    from zero), accumulation dtype.  H : (B, F, M + 1) float64, the initial
    state, replaced by the final state.  Af : (B * nchunks, W) float64, every
    chunk's total factor (:func:`chunk_factors_kernel`; W = 1: one per chunk,
    W = F: one per state row), not read for the additive rule (pass any
    (1, 1) float64 array).  Per state element, the running state goes through
    the chunks with :func:`linattn_nb.ops._cuda_common.carry` of ``rule``.
    With ``exclusive`` Hc is replaced by the state before each chunk (causal
    chunked); with ``write_tot`` Htot (B, F, M + 1) receives the final state
    too, in Htot's dtype (non-causal query phase).
    """
    B, F, M1 = H.shape
    W = Af.shape[1]
    total = B * F * M1
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for idx in range(start, total, stride):
        b, i, col = _state_index(idx, F, M1)
        w = i if W > 1 else 0
        run = float64(H[b, i, col])
        for c in range(nchunks):
            h = float64(Hc[b * nchunks + c, i, col])
            if exclusive:
                Hc[b * nchunks + c, i, col] = run
            f = 1.0
            if rule != RULE_ADDITIVE:
                f = Af[b * nchunks + c, w]
            run = carry(rule, run, h, f)
        H[b, i, col] = run
        if write_tot:
            Htot[b, i, col] = run


@cuda.jit(cache=_CACHE)
def pack_column_kernel(src, dst, w):
    """``dst[b, t, w] = src[b, t]``: one per-token input (B, N), any strides, into column ``w``
    of the (B, N, W) float64 array the sequence kernel reads (the delta rules' log-decay and beta)."""
    B, N = src.shape
    total = B * N
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for idx in range(start, total, stride):
        b = idx // N
        t = idx - b * N
        dst[b, t, w] = src[b, t]


@cuda.jit(cache=_CACHE)
def copy4d_kernel(src, dst):
    """dst[...] = src[...] for 4-d arrays of equal shape, any strides and dtypes."""
    A, Bn, N, F = src.shape
    total = A * Bn * N * F
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for idx in range(start, total, stride):
        b1, b2, t, i = unravel4(idx, Bn, N, F)
        dst[b1, b2, t, i] = src[b1, b2, t, i]


# ---------------------------------------------------------------------------
# Launch configuration
# ---------------------------------------------------------------------------
def helper_grid(total: int) -> tuple[int, int]:
    """(blocks, threads) for the grid-stride helper kernels over ``total`` elements."""
    tpb = max(1, int(config.CUDA_THREADS_PER_BLOCK))
    blocks = max(1, min(int(config.CUDA_MAX_HELPER_BLOCKS), -(-int(total) // tpb)))
    return blocks, tpb


#: Rescaled tiles of the decay and gate rules in the owner layout (module
#: docstring): the smallest running factor ``P_t`` of a tile for which the
#: kernel reads ``q_t P_t`` and ``k_t / P_t``; a tile whose factors fall
#: below it (a reset, strong decay) takes the direct form.  2^-32 in float32
#: keeps ``k / P`` finite for features up to 7.9e28 (beyond about 1e19 their
#: float32 products overflow either way); 2^-256 in float64.
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
#: Rules the tile layout takes: the additive rule, the decay rule (a scalar factor per token:
#: the tile's weights a_{s+1} ... a_t, the start state's a_0 ... a_t and the keys' shares of the
#: end state, each the exp of a sum of the tile's log-factors), the gate rule (a factor per
#: token and feature row: products over blocks of 4 tokens) and the delta rules (the WY/UT form
#: per tile: the values replaced by U' = L^-1 diag(beta) Y, :func:`_tiles_kernel`): every rule.
TILES_RULES = (RULE_ADDITIVE, RULE_DECAY, RULE_GATE, RULE_DELTA, RULE_GATED_DELTA)
#: Threads per block of the sequence kernel at most: 256 threads x 255
#: registers (the most ptxas gives a thread) fit the 65,536 registers of a
#: block, so every configuration launches whatever ptxas allocates.
MAX_SEQ_THREADS = 256
#: State words (32-bit registers) per thread at most in the row-group layout:
#: the register tile plus loads and addresses stay under 255 registers
#: without spilling (float64 takes two words per element).
MAX_TILE_WORDS = 128
#: Rows per thread at most for the delta rules in float64, whose tiles are
#: also kept to MAX_TILE_WORDS / 2 words: at D_phi = 256 a 64 x 1 float64
#: tile (128 words) spilled ~1 KB in the delta rules' step (ptxas 12.9, 255
#: registers), a 32 x 2 one ~100 B, a 32 x 1 one nothing (211-219
#: registers); the rows stop growing there and a block takes fewer value
#: columns instead (D_phi = 128 and more: 32 x 1 tiles).
MAX_DELTA_ROWS_F64 = 32
#: Static shared memory of a block at most (``cuda.shared.array``; more needs dynamic shared memory
#: and an opt-in the kernels do not use): sm_90's.  This module and ``SM90`` of
#: ``tools/cuda_resources.py`` (the measuring tool of the static checks, outside the package) each
#: keep sm_90's figures and the package never imports the tool; ``tests/ops/test_cuda_launchable.py``
#: checks that they agree.
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
    """Choose ``(R, C, G, MB, T)`` for feature dimension ``F``, value dimension ``M``.

    Three layouts (module docstring); ``layout="rows"`` asks for row groups
    where the owner layout would apply (more threads per sequence: the
    launchers' choice when the owner layout's blocks would leave the GPU
    short of warps, :func:`linattn_nb.ops._cuda_launch.seq_layout`), and
    ``layout="tiles"`` for the tile layout, ``(FP, 4, 0, MB, FP / 4)`` with
    ``FP`` = ``F`` padded to 4 and ``MB`` = min(M, ``config.CUDA_VALUE_COLS``,
    :data:`TILES_MAX_COLS`), where :func:`tiles_fits` (else the owner
    layout's rules):

    * **owner** (``G = 1``; rules other than the delta rules, ``F`` padded
      to whole 16-byte vectors at most :data:`OWNER_MAX_ROWS`, ``layout``
      "owner"): ``R`` = the padded ``F``, ``C = 1``, ``MB`` = min(M, ``config.CUDA_VALUE_COLS``,
      :data:`MAX_SEQ_THREADS`) value columns, one thread per column.  Only
      while a thread's registers of state, its column's ``R`` rows and its
      ``ceil(R / MB)`` rows of the normaliser, stay within
      :data:`MAX_TILE_WORDS` + 32 words (float64 counts two): a float64
      ``D_phi = 64`` with one value column would spill.
    * **row groups**: ``C`` = ``config.CUDA_COLS_PER_THREAD`` and ``R`` =
      ``config.CUDA_ROWS_PER_THREAD`` the register tile of a thread (the delta
      rules: ``CUDA_DELTA_COLS_PER_THREAD``, ``CUDA_DELTA_ROWS_PER_THREAD``); ``R`` doubled
      (up to ``config.CUDA_MAX_ROWS_PER_THREAD``; the delta rules in float64:
      :data:`MAX_DELTA_ROWS_F64`) while the block would
      exceed min(``config.CUDA_MAX_THREADS``, :data:`MAX_SEQ_THREADS`)
      threads, ``C`` halved while the tile exceeds :data:`MAX_TILE_WORDS`
      registers (the delta rules in float64: half that), then ``MB`` halved
      until the block fits.

    ``T`` tokens per shared-memory tile: at most ``config.CUDA_TILE_TOKENS``,
    within ``config.CUDA_SHARED_BYTES`` (static shared memory, at most 48 KiB)
    and, down to 8 tokens, small enough for :data:`TARGET_WARPS` resident warps
    per multiprocessor.  A rule with per-token factors (``rule``) stages them
    too: one more value per token, or one per padded feature row; the delta
    rules stage two values per token and keep a reduction buffer of
    ``2 G MBP`` values.  Every configuration has at most
    :data:`MAX_SEQ_THREADS` threads, so registers x threads <= 65,536.

    Raises
    ------
    ValueError
        When ``F`` exceeds ``config.CUDA_MAX_FEATURES`` or no configuration fits.
    """
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


def _gate_rows(FP: int) -> int:
    """Rows of the gate's product array in the tile layout (:func:`_tiles_kernel`): one of ones, three
    in-block products per block of 4 tokens, a row per run of whole blocks."""
    NB = -(-int(FP) // 16)
    return 1 + 3 * NB + NB * (NB + 1) // 2


def _tiles_sizes(F: int, M: int, acc_itemsize: int, rule: int = RULE_ADDITIVE):
    """``(FP, MB, T, threads, shared bytes)`` of the tile layout (module docstring)."""
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
             + 3 * (T if rule in (RULE_DECAY, RULE_GATED_DELTA) else 1) + (_gate_rows(FP) * (FP + 4) if gate else 1)
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


def is_sim_array(x) -> bool:
    """True for the simulator's device arrays (``FakeCUDAArray``)."""
    return type(x).__name__ == "FakeCUDAArray" and type(x).__module__.startswith("numba.cuda.simulator")


def strided_view(x, shape, strides):
    """A view of device array ``x`` (element 0 kept) with new shape and byte strides."""
    shape = tuple(int(s) for s in shape)
    strides = tuple(int(s) for s in strides)
    if is_sim_array(x):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        base = x._ary
        return FakeCUDAArray(np.lib.stride_tricks.as_strided(base, shape, strides))
    cai = x.__cuda_array_interface__
    desc = {
        "shape": shape,
        "strides": strides,
        "data": (cai["data"][0], False),
        "typestr": np.dtype(x.dtype).str,
        "version": 2,
    }
    return cuda.from_cuda_array_interface(desc, owner=x, sync=False)


def as_4d(x):
    """View a device array of shape (..., N, F) as (B1, B2, N, F) without copying.

    The last leading dimension becomes B2 and the ones before it are merged
    into B1, which needs their strides to be nested (true for any contiguous
    array and for the usual transposes such as (B, N, H, D) -> (B, H, N, D)).
    Returns None when they cannot be merged.

    Raises
    ------
    ValueError
        For negative strides.
    """
    shape = tuple(int(s) for s in x.shape)
    strides = tuple(int(s) for s in x.strides)
    if any(s < 0 for s in strides):
        raise ValueError(
            "device arrays with negative strides are not supported; make a contiguous copy first"
        )
    if len(shape) < 2:
        raise ValueError(f"expected at least 2 dimensions, got shape {shape}")
    n, f = shape[-2:]
    sn, sf = strides[-2:]
    # dimensions of size 1 take no part in addressing: drop them
    lead = [(d, s) for d, s in zip(shape[:-2], strides[:-2]) if d != 1]
    if len(shape) == 4 and len(lead) == 2:
        return x
    b2, s2 = lead[-1] if lead else (1, n * sn)
    rest = lead[:-1]
    for (d0, s0), (d1, s1) in zip(rest[:-1], rest[1:]):
        if s0 != s1 * d1:
            return None
    if rest:
        b1 = int(np.prod([d for d, _ in rest]))
        s1 = rest[-1][1]
    else:
        b1, s1 = 1, b2 * s2
    return strided_view(x, (b1, b2, n, f), (s1, s2, sn, sf))


def flat_view(x):
    """``(view, strides)`` of device array ``x`` for the sequence kernel.

    ``view``: a 1-d C-contiguous view from ``x``'s first element over every
    element ``x`` addresses (no copy); ``strides``: ``x``'s strides in
    elements (0 for a dimension of size 1, which takes no part in
    addressing).

    Raises
    ------
    ValueError
        For a negative stride or one that is not a multiple of the item size.
    """
    item = np.dtype(x.dtype).itemsize
    shape = tuple(int(d) for d in x.shape)
    strides = tuple(int(s) if d > 1 else 0 for d, s in zip(shape, x.strides))
    if any(s < 0 or s % item for s in strides):
        raise ValueError(f"device arrays need non-negative strides that are whole multiples of the item size "
                         f"({item} bytes); got strides {tuple(int(s) for s in x.strides)} for shape {shape}: "
                         "make a contiguous copy first")
    es = tuple(s // item for s in strides)
    span = 0 if 0 in shape else 1 + sum((d - 1) * s for d, s in zip(shape, es))
    return strided_view(x, (span,), (item,)), es


#: ``vec`` bits of :func:`seq_kernel`: q and k (``VEC_QK``), v (``VEC_V``)
#: staged four elements of a token per vector load (module docstring).
VEC_QK = 1
VEC_V = 2

#: Sequences that span fewer elements than this get the kernel with 32-bit
#: element offsets (:func:`linattn_nb.ops._cuda_launch.plan`): an offset
#: below 2^31 can be neither wrapped nor taken for a negative one.
OFF32_LIMIT = 2 ** 31


def data_pointer(x) -> int:
    """Address of device array ``x``'s first element (the simulator: of its host memory)."""
    if is_sim_array(x):
        return int(x._ary.__array_interface__["data"][0])
    return int(x.__cuda_array_interface__["data"][0])


def vector_bits(q, k, v, strides, F: int, M: int, MB: int) -> int:
    """The ``vec`` bits of :func:`seq_kernel` the 4-d views ``q, k, v`` allow (``strides``: theirs in
    elements, :func:`flat_view`): ``VEC_QK`` when q and k have unit feature stride, ``F`` a multiple
    of 4, every other stride a multiple of 4 elements and a first element aligned as
    :func:`linattn_nb.ops._cuda_common.load4` declares, so that every group of four features the
    kernel loads is aligned; ``VEC_V`` when v does with ``M`` and ``MB`` (a block's first column)
    multiples of 4."""
    from ._cuda_common import VEC_ALIGN

    def ok(x, es, width):
        align = VEC_ALIGN.get(np.dtype(x.dtype).itemsize * 8)
        return (align is not None and width % 4 == 0 and es[3] in (0, 1) and all(s % 4 == 0 for s in es[:3])
                and data_pointer(x) % align == 0)

    bits = VEC_QK if ok(q, strides[0], F) and ok(k, strides[1], F) else 0
    if ok(v, strides[2], M) and MB % 4 == 0:
        bits |= VEC_V
    return bits


def sequence_span(shape, strides) -> int:
    """Elements one (N, F) sequence of a 4-d array spans: the largest offset + 1 (0 if empty)."""
    n, f = (int(d) for d in shape[-2:])
    sn, sf = (int(s) for s in strides[-2:])
    return 0 if n == 0 or f == 0 else 1 + (n - 1) * sn + (f - 1) * sf


def seq_signature(in_dtype: str, acc: str, lf_dtype: str = "float64") -> tuple:
    """The Numba signature the launchers give the sequence kernel (:func:`seq_kernel`): 1-d views
    of ``in_dtype``, element strides, int64 sizes and flags, (n, F, M + 1) states of ``acc``, (B, N, W)
    log-factors of ``lf_dtype`` (float64; float32 for a device ``log_decay`` given in float32, read in
    place) and the int32 finiteness counters."""
    from numba import types

    a1 = types.Array(getattr(types, in_dtype), 1, "C")
    st = types.UniTuple(types.int64, 4)
    H = types.Array(getattr(types, acc), 3, "C")
    lf = types.Array(getattr(types, lf_dtype), 3, "C")
    i, b = types.int64, types.boolean
    return ((a1,) * 4 + (st,) * 4 + (i, i, H, H, lf) + (i,) * 6 + (types.float64, i) + (b,) * 4
            + (types.Array(types.int32, 1, "C"),))


def acc_name(*dtypes) -> str:
    """Accumulation dtype: float64 if any input is float64, else float32."""
    return "float64" if any(np.dtype(d) == np.float64 for d in dtypes) else "float32"
