"""Direct BLAS ``?gemm`` calls from ``@njit`` code, on sub-blocks and with ``beta``.

Design: ``docs/design-cpu.md``, "Direct BLAS calls".
"""
from __future__ import annotations

import numpy as np
from llvmlite import binding as _llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import get_cython_function_address, intrinsic, overload

_SYMBOLS = {
    types.float32: ("linattn_nb_sgemm", "sgemm"),
    types.float64: ("linattn_nb_dgemm", "dgemm"),
}
for _sym, _name in _SYMBOLS.values():
    _llvm.add_symbol(_sym, get_cython_function_address("scipy.linalg.cython_blas", _name))

_I8P = ir.IntType(8).as_pointer()


def _data_ptr(context, builder, aryty, ary, off):
    """i8* to ary.flat[off] (C-contiguous)."""
    a = context.make_array(aryty)(context, builder, ary)
    return builder.bitcast(builder.gep(a.data, [off]), _I8P)


@intrinsic
def _xgemm(typingctx, fa, fb, m, n, k, alpha, A, aoff, lda, B, boff, ldb, beta, C, coff, ldc):
    """Column-major Fortran ?gemm(fa, fb, m, n, k, alpha, A+aoff, lda, B+boff, ldb, beta, C+coff, ldc)."""
    if not isinstance(C, types.Array) or C.dtype not in _SYMBOLS:
        return None
    for x in (A, B, C):  # flat offsets address C-contiguous buffers
        if not isinstance(x, types.Array) or x.dtype != C.dtype or x.layout != "C":
            return None
    if fa != types.uint8 or fb != types.uint8 or alpha != C.dtype or beta != C.dtype:
        return None
    if any(x != types.int32 for x in (m, n, k, lda, ldb, ldc)):
        return None
    sym = _SYMBOLS[C.dtype][0]
    sig = types.none(fa, fb, m, n, k, alpha, A, aoff, lda, B, boff, ldb, beta, C, coff, ldc)

    def codegen(context, builder, signature, args):
        (fa_, fb_, m_, n_, k_, al_, A_, ao_, lda_, B_, bo_, ldb_, be_, C_, co_, ldc_) = args
        st = signature.args

        def ref(val):  # Fortran BLAS takes every argument by pointer
            return builder.bitcast(cgutils.alloca_once_value(builder, val), _I8P)

        call_args = [
            ref(fa_), ref(fb_), ref(m_), ref(n_), ref(k_), ref(al_),
            _data_ptr(context, builder, st[6], A_, ao_), ref(lda_),
            _data_ptr(context, builder, st[9], B_, bo_), ref(ldb_),
            ref(be_),
            _data_ptr(context, builder, st[13], C_, co_), ref(ldc_),
        ]
        fnty = ir.FunctionType(ir.VoidType(), [_I8P] * 13)
        fn = cgutils.get_or_insert_function(builder.module, fnty, sym)
        builder.call(fn, call_args)
        return context.get_dummy_value()

    return sig, codegen


def gemm(ta, tb, m, n, k, alpha, A, aoff, lda, B, boff, ldb, beta, C, coff, ldc):  # pragma: no cover
    """Row-major ``C = alpha op(A) op(B) + beta C`` on flat offsets (``docs/design-cpu.md``)."""
    a = np.asarray(A).ravel()[aoff:]
    b = np.asarray(B).ravel()[boff:]
    av = np.lib.stride_tricks.as_strided(a, (k, m) if ta else (m, k), (lda * a.itemsize, a.itemsize))
    bv = np.lib.stride_tricks.as_strided(b, (n, k) if tb else (k, n), (ldb * b.itemsize, b.itemsize))
    cv = np.lib.stride_tricks.as_strided(C.ravel()[coff:], (m, n), (ldc * C.itemsize, C.itemsize))
    cv[...] = alpha * ((av.T if ta else av) @ (bv.T if tb else bv)) + beta * cv


_N = np.uint8(ord("N"))
_T = np.uint8(ord("T"))


@overload(gemm)
def _gemm_ov(ta, tb, m, n, k, alpha, A, aoff, lda, B, boff, ldb, beta, C, coff, ldc):
    if not isinstance(C, types.Array) or C.dtype not in _SYMBOLS:
        return None
    ft = np.float32 if C.dtype == types.float32 else np.float64
    i32 = np.int32

    def impl(ta, tb, m, n, k, alpha, A, aoff, lda, B, boff, ldb, beta, C, coff, ldc):
        # row-major op(A) op(B) = column-major (op(B)^T op(A)^T): swap the operands
        _xgemm(_T if tb else _N, _T if ta else _N, i32(n), i32(m), i32(k), ft(alpha),
               B, boff, i32(ldb), A, aoff, i32(lda), ft(beta), C, coff, i32(ldc))

    return impl
