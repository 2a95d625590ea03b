"""The sequence kernel: one kernel per configuration of its thread layouts, and its launch signature.

:func:`seq_kernel` returns the kernel of the owner (:mod:`.owner`), row-group
(:mod:`.rows`) or tile (:mod:`.tiles`) layout specialised on its
compile-time constants, made once per configuration; :func:`seq_signature`
is the Numba signature the launchers give it.  See ``docs/cuda_kernels.md``.
"""
from __future__ import annotations

from .._codes import RULE_ADDITIVE
from .._cuda_common import is_delta_rule
from .owner import owner_kernel
from .plan import TILES_RULES
from .rows import rows_kernel
from .tiles import tiles_kernel

_SEQ_KERNELS: dict = {}


def seq_kernel(R: int, C: int, G: int, MB: int, T: int, acc: str, rule: int = RULE_ADDITIVE, code=None,
               off32: bool = True, vec: int = 0):
    """The sequence kernel specialised on its compile-time constants.

    ``R`` x ``C``: state rows x state columns per thread (a register tile);
    ``G``: row groups (``G R >= F``; ``G == 1`` is the owner layout
    for every rule but the delta rules, ``G == 0`` the tile layout); ``MB``: value columns per block; ``T``:
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
    non-finite q, k, v values the launch stages (docs/cuda_kernels.md), (1,) for
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
        kern = _SEQ_KERNELS[key] = tiles_kernel(R, MB, acc, key[7], key[8], key[9], rule)
        return kern
    if G == 1 and not is_delta_rule(rule):
        kern = _SEQ_KERNELS[key] = owner_kernel(R, C, MB, T, acc, rule, key[7], key[8], key[9])
        return kern
    kern = _SEQ_KERNELS[key] = rows_kernel(R, C, G, MB, T, acc, rule, key[7], key[8], key[9])
    return kern


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
