"""Vectorisable scalar helpers for the CPU kernels: float16 bits, fast exp, feature maps.

Design: ``docs/design-cpu.md``, "Vectorisable scalar helpers".
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from .. import config

_LOG2E = 1.4426950408889634
# Cody-Waite split of ln 2: the high parts have few significant bits, so
# k * hi is exact for the |k| that occur.
_LN2_HI_F32 = 0.693359375
_LN2_LO_F32 = -2.12194440e-4
_LN2_HI_F64 = 0.6931471803691238
_LN2_LO_F64 = 1.9082149292705877e-10
_MAGIC_F32 = 12582912.0  # 1.5 * 2**23: x + M - M rounds x to an integer
_MAGIC_F64 = 6755399441055744.0  # 1.5 * 2**52
# Kernels' own flag set for the exp: FMA contraction only; reassociation would
# fold the (x + M) - M rounding and the Cody-Waite steps away.
_EXP_FLAGS = {"contract"}


# ---------------------------------------------------------------------------
# intrinsics (bit reinterpretation)
# ---------------------------------------------------------------------------
@intrinsic
def f16_to_f32(typingctx, x):
    """float16 bits (uint16) -> float32, exact (LLVM ``fpext half``)."""
    if not isinstance(x, types.Integer) or x.bitwidth != 16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(x), codegen


@intrinsic
def f32_to_f16(typingctx, x):
    """float32 -> float16 bits (uint16), round to nearest even (LLVM ``fptrunc``)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(x), codegen


@intrinsic
def _bits_f32(typingctx, x):
    """float32 holding an integer value < 2**31 -> the float32 with those bits."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptosi(args[0], ir.IntType(32)), ir.FloatType())

    return types.float32(x), codegen


@intrinsic
def _pow2_f64(typingctx, k):
    """``2**k`` for a float64 ``k`` holding an integer in [-1022, 1023]: the exponent bits by integer
    operations, ``((bits(k + 1.5 * 2**52) + 1023) << 52)``, whose low 12 bits of the sum are ``k + 1023``.
    No float64 -> int64 conversion, as ``_bits_f32`` has for float32: AVX2 has no packed form of that
    (AVX-512DQ has), so the float64 ELU+1 with one ran scalar there (the chunked float64 call at
    N = 4096 took 1.75x as long, AMD EPYC, AVX2; docs/design-cpu.md)."""
    if k != types.float64:
        return None

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        y = builder.fadd(args[0], ir.Constant(ir.DoubleType(), _MAGIC_F64))  # exact: no fast-math flags
        e = builder.add(builder.bitcast(y, i64), ir.Constant(i64, 1023))
        return builder.bitcast(builder.shl(e, ir.Constant(i64, 52)), ir.DoubleType())

    return types.float64(k), codegen


# ---------------------------------------------------------------------------
# ELU + 1
# ---------------------------------------------------------------------------
# exp(r) on |r| <= ln2/2: degree-6 polynomial fitted (relative least squares at
# Chebyshev nodes, near-minimax), max error 1.5 ulp over [-87, 0] with the
# reduction below; one FMA cheaper than the degree-7 Taylor series.
_EXP_F32_COEFFS = (1.0, 1.0000000436, 0.49999991243, 0.16666421201, 0.041668363013,
                   0.0083747679964, 0.0013829378402)


@njit(fastmath=_EXP_FLAGS, cache=config.CACHE)
def _elu1_f32(x):
    xc = x if x < np.float32(0.0) else np.float32(0.0)
    xc = xc if xc > np.float32(-87.3) else np.float32(-87.3)
    kf = xc * np.float32(_LOG2E) + np.float32(_MAGIC_F32)
    kf = kf - np.float32(_MAGIC_F32)
    r = xc - kf * np.float32(_LN2_HI_F32)
    r = r - kf * np.float32(_LN2_LO_F32)
    p = np.float32(_EXP_F32_COEFFS[6])
    p = p * r + np.float32(_EXP_F32_COEFFS[5])
    p = p * r + np.float32(_EXP_F32_COEFFS[4])
    p = p * r + np.float32(_EXP_F32_COEFFS[3])
    p = p * r + np.float32(_EXP_F32_COEFFS[2])
    p = p * r + np.float32(_EXP_F32_COEFFS[1])
    p = p * r + np.float32(_EXP_F32_COEFFS[0])
    # 2**k from its exponent bits: (k + 127) << 23, k in [-126, 0]
    p = p * _bits_f32(kf * np.float32(8388608.0) + np.float32(127.0 * 8388608.0))
    # exp(x) below -87 would be subnormal: flush it to 0 (the clamp above kept
    # the exponent bits valid).  NaN fails x < 0 and comes out as x + 1 = NaN.
    p = p if not (x < np.float32(-87.3)) else np.float32(0.0)
    return p if x < np.float32(0.0) else x + np.float32(1.0)


@njit(fastmath=_EXP_FLAGS, cache=config.CACHE)
def _elu1_f64(x):
    xc = x if x < 0.0 else 0.0
    xc = xc if xc > -708.3 else -708.3
    kf = xc * _LOG2E + _MAGIC_F64
    kf = kf - _MAGIC_F64
    r = xc - kf * _LN2_HI_F64
    r = r - kf * _LN2_LO_F64
    p = 1.0 / 6227020800.0
    p = p * r + 1.0 / 479001600.0
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    p = p * _pow2_f64(kf)  # kf in [-1022, 0]: the clamp above
    p = p if not (x < -708.3) else 0.0  # (nearly) subnormal range: flushed to 0
    return p if x < 0.0 else x + 1.0


def elu1(x):  # pragma: no cover - replaced by the overload inside Numba
    """ELU(x) + 1 (``x + 1`` for x >= 0, ``exp(x)`` below); NaN propagates."""
    return x + 1.0 if x >= 0 else float(np.exp(x))


@overload(elu1)
def _elu1_ov(x):
    if x == types.float32:
        return lambda x: _elu1_f32(x)
    if x == types.float64:
        return lambda x: _elu1_f64(x)
    return None


def silu(x):  # pragma: no cover - replaced by the overload inside Numba
    """SiLU: ``x * sigmoid(x)``; NaN propagates."""
    return x / (1.0 + float(np.exp(-x)))


@njit(fastmath=config.FASTMATH, cache=config.CACHE, error_model="numpy")
def _silu(x):
    # error_model="numpy": a division under the default model checks its
    # divisor for 0, a branch that keeps the loop from vectorising
    zero = x * 0  # 0 in x's own type
    one = zero + 1
    a = x if x < zero else -x
    e = elu1(a)  # exp(-|x|) in (0, 1]: never overflows
    p = x if x >= zero else x * e  # sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below
    return p / (one + e)  # NaN: NaN throughout


@overload(silu)
def _silu_ov(x):
    if isinstance(x, types.Float):
        return lambda x: _silu(x)
    return None


# ---------------------------------------------------------------------------
# ReLU, squared ReLU, conversion to the working dtype
# ---------------------------------------------------------------------------
def relu(x):  # pragma: no cover
    return x if (x > 0 or x != x) else 0.0


def relu2(x):  # pragma: no cover
    return x * x if (x > 0 or x != x) else 0.0


@overload(relu)
def _relu_ov(x):
    if isinstance(x, types.Float):
        zero = x(0.0)

        def impl(x):
            return x if (x > zero or x != x) else zero

        return impl
    return None


@overload(relu2)
def _relu2_ov(x):
    if isinstance(x, types.Float):
        zero = x(0.0)

        def impl(x):
            return x * x if (x > zero or x != x) else zero

        return impl
    return None


def to_work(x):  # pragma: no cover
    """Input element -> working dtype: float16 bits (uint16) -> float32, floats unchanged."""
    return x


@overload(to_work)
def _to_work_ov(x):
    if isinstance(x, types.Integer) and x.bitwidth == 16:
        return lambda x: f16_to_f32(x)
    if isinstance(x, types.Float):
        return lambda x: x
    return None


def put3(a, i, j, l, x):  # pragma: no cover
    """``a[i, j, l] = x`` with the conversion the array's type needs (float16 bits: RNE)."""
    a[i, j, l] = x


@overload(put3)
def _put3_ov(a, i, j, l, x):
    if isinstance(a.dtype, types.Integer) and a.dtype.bitwidth == 16:
        def impl(a, i, j, l, x):
            a[i, j, l] = f32_to_f16(np.float32(x))

        return impl
    if isinstance(a.dtype, types.Float):
        def impl(a, i, j, l, x):
            a[i, j, l] = x

        return impl
    return None


def store3(a, i, j, l, x):  # pragma: no cover
    """:func:`put3`, returning the stored value in the working dtype (float16 bits: converted back)."""
    a[i, j, l] = x
    return x


@overload(store3)
def _store3_ov(a, i, j, l, x):
    if isinstance(a.dtype, types.Integer) and a.dtype.bitwidth == 16:
        def impl(a, i, j, l, x):
            h = f32_to_f16(np.float32(x))
            a[i, j, l] = h
            return f16_to_f32(h)

        return impl
    if isinstance(a.dtype, types.Float):
        def impl(a, i, j, l, x):
            a[i, j, l] = x
            return a[i, j, l]  # as stored: a float64 value beyond the float32 range reads back as inf

        return impl
    return None


def is_finite(x):  # pragma: no cover
    """Whether ``x`` is neither NaN nor inf."""
    return bool(np.isfinite(x))


@overload(is_finite)
def _is_finite_ov(x):
    # x * 0 == 0 in x's own type: False exactly for NaN and +-inf.  A
    # comparison per element, and-ed into a flag: a sum of x * 0 terms would
    # be rewritten as (sum x) * 0 under the kernels' "reassoc" flag, and that
    # sum overflows to inf for large finite x.
    if isinstance(x, types.Float):
        zero = x(0.0)

        def impl(x):
            return x * zero == zero

        return impl
    return None


def work_dtype(dtype) -> np.dtype:
    """Working (compute) dtype of the kernels for an input dtype (float16 -> float32)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype in (np.dtype(np.float16), np.dtype(np.uint16)) else dtype


def as_kernel_array(x: np.ndarray) -> np.ndarray:
    """float16 arrays -> their ``uint16`` view (what the kernels take); others unchanged."""
    return x.view(np.uint16) if x.dtype == np.float16 else x
