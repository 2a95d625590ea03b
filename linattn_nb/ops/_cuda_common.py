"""Device functions shared by the CUDA kernels (imported with the CUDA path only).

See ``docs/cuda_kernels.md``, "Device functions and rule hooks".
"""
from __future__ import annotations

import math
import threading

from numba import config as _nbconfig
from numba import cuda, float64, uint32

from ._codes import (KERNEL_CODE_ELU, KERNEL_CODE_L2, KERNEL_CODE_RELU, KERNEL_CODE_SILU_L2,
                     KERNEL_CODE_SQUARED_RELU, RULE_ADDITIVE, RULE_DECAY, RULE_DELTA, RULE_GATE,
                     RULE_GATED_DELTA, SS_TINY)

_DBL_MAX = 1.7976931348623157e308


def _simulated_shfl_xor_sync(self, mask, value, lane_mask):
    """``cuda.shfl_xor_sync`` for the simulator: ``value`` of lane ``lane ^ lane_mask`` of the warp.

    Exchanged through a per-block table and two barriers, so exact only when every
    thread of the block calls it together; ``mask`` is not checked.
    """
    th = threading.current_thread()
    table = th._manager.__dict__.setdefault("_shfl_table", {})
    tid = th.thread_id
    table[tid] = value
    th.syncthreads()
    out = table.get((tid & ~31) | ((tid & 31) ^ int(lane_mask)), value)
    th.syncthreads()
    return out


if getattr(_nbconfig, "ENABLE_CUDASIM", 0):  # pragma: no branch - the simulator's missing intrinsic
    from numba.cuda.simulator import kernelapi as _kernelapi

    if not hasattr(_kernelapi.FakeCUDAModule, "shfl_xor_sync"):
        _kernelapi.FakeCUDAModule.shfl_xor_sync = _simulated_shfl_xor_sync


#: Alignment in bytes :func:`load4` declares, by the element's bits: four
#: elements' worth up to 16 bytes (float64: two 16-byte loads).
VEC_ALIGN = {16: 8, 32: 16, 64: 16}


def _load4_codegen(context, builder, signature, args):
    """``a[i], ..., a[i + 3]`` as one vector load: ``ld.global.v4.f32``, ``v4.f16``, two ``v2.f64``."""
    from llvmlite import ir

    arr, idx = args
    aty, ity = signature.args
    ary = context.make_array(aty)(context, builder, arr)
    i64 = ir.IntType(64)
    if idx.type.width < 64:
        idx = builder.zext(idx, i64) if not ity.signed else builder.sext(idx, i64)
    ptr = builder.gep(ary.data, [idx])
    vty = ir.VectorType(context.get_data_type(aty.dtype), 4)
    vec = builder.load(builder.bitcast(ptr, vty.as_pointer(addrspace=ptr.type.addrspace)),
                       align=VEC_ALIGN[aty.dtype.bitwidth])
    parts = [builder.extract_element(vec, ir.Constant(ir.IntType(32), j)) for j in range(4)]
    return context.make_tuple(builder, signature.return_type, parts)


if getattr(_nbconfig, "ENABLE_CUDASIM", 0):
    def load4(a, i):
        """``(a[i], a[i + 1], a[i + 2], a[i + 3])`` (the simulator: four loads)."""
        return a[i], a[i + 1], a[i + 2], a[i + 3]
else:
    from numba import types as _types
    from numba.cuda.extending import intrinsic as _intrinsic

    @_intrinsic
    def load4(typingctx, a, i):
        """``(a[i], a[i + 1], a[i + 2], a[i + 3])`` of a 1-d C-contiguous array in one vector load.

        The caller guarantees the alignment the load declares (:data:`VEC_ALIGN`) at ``a + i``, as
        :func:`linattn_nb.ops._cuda_launch.plan` checks (misaligned: a launch failure).  No bounds check.
        """
        if not (isinstance(a, _types.Array) and a.ndim == 1 and a.layout == "C"
                and isinstance(i, _types.Integer)):
            return None
        return _types.UniTuple(a.dtype, 4)(a, i), _load4_codegen


@cuda.jit(device=True, inline=True)
def stage(dst, t, i, x, flags, slot, count, mapped, code, zero, one):
    """``dst[t, i] = phi(x)`` (``mapped``, else ``x``) in the working type of ``zero``, counting a
    non-finite ``x`` into ``flags[slot]`` when ``count``: one staged input element."""
    y = x * one  # the working type (x * 1 folds away; zero + x would not: -0 + 0 is +0)
    if count and not (y - y == zero):
        cuda.atomic.add(flags, slot, 1)
    if mapped:
        y = phi(y, code, zero, one)
    dst[t, i] = y


@cuda.jit(device=True, inline=True)
def stage4(dst, t, i, src, off, flags, slot, count, mapped, code, zero, one):
    """:func:`stage` of ``src[off: off + 4]`` into ``dst[t, i: i + 4]``, read by one :func:`load4`."""
    x0, x1, x2, x3 = load4(src, off)
    stage(dst, t, i, x0, flags, slot, count, mapped, code, zero, one)
    stage(dst, t, i + uint32(1), x1, flags, slot, count, mapped, code, zero, one)
    stage(dst, t, i + uint32(2), x2, flags, slot, count, mapped, code, zero, one)
    stage(dst, t, i + uint32(3), x3, flags, slot, count, mapped, code, zero, one)


@cuda.jit(device=True, inline=True)
def fill4(dst, t, i, n, x, at, y):
    """``dst[t, i + j] = x`` for ``j < 4`` and ``i + j < n``, but ``y`` at column ``at``: a staged group
    of four rows or columns past the inputs (zero padding; the normaliser's column of ones)."""
    for j in range(4):
        c = uint32(i + uint32(j))
        if c < uint32(n):
            dst[t, c] = y if c == uint32(at) else x


@cuda.jit(device=True, inline=True)
def unravel4(idx, Bn, N, F):
    """C-order index -> (b1, b2, t, i) of a 4-d array with trailing shape (Bn, N, F) (the grid-stride
    helper kernels' walk over any-strided 4-d views)."""
    i = idx % F
    rest = idx // F
    t = rest % N
    rest = rest // N
    return rest // Bn, rest % Bn, t, i


@cuda.jit(device=True, inline=True)
def phi(x, code, zero, one):
    """The elementwise feature map ``code`` (:mod:`linattn_nb.ops._codes`) on the GPU; NaN propagates."""
    if code == KERNEL_CODE_ELU:
        # no branch: a warp whose lanes disagree in sign would run both sides one after the other
        # (and reconverge); exp of min(x, 0) is taken on every lane and the result selected.  NaN
        # fails x < 0 and gives x + 1 (NaN); -inf gives exp(-inf) = 0
        e = math.exp(x if x < zero else zero)
        return e if x < zero else x + one
    if code == KERNEL_CODE_RELU:
        return x if (x > zero or x != x) else zero
    if code == KERNEL_CODE_SQUARED_RELU:
        return x * x if (x > zero or x != x) else zero
    if code == KERNEL_CODE_SILU_L2:  # SiLU x sigmoid(x); exp only sees arguments <= 0 (no overflow)
        if x >= zero:
            return x / (one + math.exp(-x))
        e = math.exp(x)
        return x * e / (one + e)
    return x


@cuda.jit(device=True, inline=True)
def is_row_map(code):
    """True for the feature maps that normalise a whole row after :func:`phi` (codes 4 and 5)."""
    return code == KERNEL_CODE_L2 or code == KERNEL_CODE_SILU_L2


@cuda.jit(device=True, inline=True)
def l2_normalize_row(a, t, n):
    """Divide ``a[t, :n]`` by its Euclidean norm in place (the L2 half of codes 4 and 5).

    No epsilon; the sum of squares, root and division run in float64 and the quotient
    is rounded once, so a float32 row whose squares overflow is still normalised; a float64
    row whose squares overflow or underflow is scaled by a power of two first.  A
    zero row stays zero; a NaN row becomes NaN (the NumPy map gives 0).
    """
    ss = 0.0
    for i in range(n):
        x = float64(a[t, i])
        ss += x * x
    if ss < SS_TINY or ss > _DBL_MAX:
        # squares that underflowed or overflowed (a float64 row beyond 1e+-154): the row is scaled by a
        # power of two first (exact), as on the CPU; a zero or non-finite row is left to the plain path
        mx = 0.0
        for i in range(n):
            mx = max(mx, abs(float64(a[t, i])))
        if mx > 0.0 and mx <= _DBL_MAX:
            e = math.frexp(mx)[1]
            ss = 0.0
            for i in range(n):
                x = math.ldexp(float64(a[t, i]), -e)
                ss += x * x
            nrm = math.sqrt(ss)
            for i in range(n):
                a[t, i] = math.ldexp(float64(a[t, i]), -e) / nrm
            return
    if ss != 0.0:
        nrm = math.sqrt(ss)
        for i in range(n):
            a[t, i] = float64(a[t, i]) / nrm


def rule_factor_rows(rule: int, f: int) -> int:
    """Log-factors per token the kernels read for rule code ``rule`` and ``f`` features: 0 (additive),
    1 (decay), ``f`` (gate), 2 (the delta rules: the log-decay, 0 for ``delta``, then ``beta``).
    """
    if rule == RULE_DECAY:
        return 1
    if rule == RULE_GATE:
        return int(f)
    if rule == RULE_DELTA or rule == RULE_GATED_DELTA:
        return 2
    return 0


def is_delta_rule(rule: int) -> bool:
    """True for the rules with a rank-1 correction (delta, gated delta): see ``docs/cuda_kernels.md``."""
    return rule == RULE_DELTA or rule == RULE_GATED_DELTA


@cuda.jit(device=True, inline=True)
def carry(rule, before, inc, f):
    """State element after a chunk: ``before + inc`` (additive) or ``f before + inc`` (decay, gate).

    ``inc``: the chunk's own contribution (its state from zero); ``f``: the chunk's
    total factor of the element's row (0 across a reset).  An unknown code gives NaN.
    """
    if rule == RULE_ADDITIVE:
        return before + inc
    if rule == RULE_DECAY or rule == RULE_GATE:
        return f * before + inc
    return math.nan


# Decode-step hooks (:mod:`linattn_nb.ops.step.cuda`): one thread per value
# column m walks the features, so a token's update of the state is one
# element at a time; the delta rules first sum their column's ``k^T S[:, m]``
# (the kernel does, the hooks take its correction ``r``).
@cuda.jit(device=True, inline=True)
def step_factor(rule, lg, b, t, i):
    """Token t's factor of feature row i, float64: ``exp(lg[b, t, 0])`` (decay), ``exp(lg[b, t, i])``
    (gate), 1 for the other rules (the delta rules' factor is a scalar: :func:`step_scalars`)."""
    if rule == RULE_DECAY:
        return math.exp(lg[b, t, 0])
    if rule == RULE_GATE:
        return math.exp(lg[b, t, i])
    return 1.0


@cuda.jit(device=True, inline=True)
def step_scalars(rule, lg, b, t):
    """The delta rules' scalar factor ``exp(lg[b, t, 0])`` (1 for the delta rule, whose column 0 is 0)
    and write strength ``lg[b, t, 1]``; (1, 0) for the other rules."""
    if rule == RULE_DELTA or rule == RULE_GATED_DELTA:
        return math.exp(lg[b, t, 0]), lg[b, t, 1]
    return 1.0, 0.0


@cuda.jit(device=True, inline=True)
def step_element(rule, s, fk, g, w, a, r):
    """State element ``s`` after the token: additive ``s + fk w``, decay and gate ``g s + fk w`` (``g``
    the row's factor), the delta rules ``a s + r fk`` (``r = beta (w - a k^T S[:, m])``).  ``w``: the
    element's value (1 for the normaliser's column)."""
    if rule == RULE_DECAY or rule == RULE_GATE:
        return g * s + fk * w
    if rule == RULE_DELTA or rule == RULE_GATED_DELTA:
        return a * s + r * fk
    return s + fk * w


@cuda.jit(device=True, inline=True)
def step_z(rule, zi, fk, g):
    """Normaliser element ``zi`` after the token, for the rules without a correction: additive ``zi +
    fk``, decay and gate ``g zi + fk`` (the delta rules': :func:`step_element` with ``w = 1``)."""
    if rule == RULE_DECAY or rule == RULE_GATE:
        return g * zi + fk
    return zi + fk
