"""Block helpers shared by the blocked CPU kernels (chunked causal, non-causal).

Each works on rows ``[s0, s0 + n)`` of sequence ``b`` and writes the working
dtype; LLVM inlines them into the kernels' loops.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .. import config
from ._codes import KERNEL_CODE_NONE
from ._common import is_row_map, l2_row, phi
from ._vec import f16_to_f32, is_finite, to_work


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def load_chunk(q, k, v, b, s0, n, fq, fk, R, row0, code, with_q):
    """Read tokens [s0, s0 + n) of sequence b once, token by token, into the working dtype.

    ``fq[t, :F] = phi(q[b, s0 + t])`` (when ``with_q``), ``fk[t] = phi(k[b, s0 + t])``
    and ``R[row0 + t, :M] = v[b, s0 + t]``.  Returns ``(v_finite, inputs_finite)``.
    One pass over the three streams (docs/measurements-cpu.md); the raw inputs are checked, not the
    features (ELU+1 and ReLU map ``-inf`` to 0).
    """
    F = k.shape[2]
    M = v.shape[2]
    vok = True
    qkok = True
    if is_row_map(code):  # the L2 maps: a whole row at a time, normalised in float64
        tmp = np.empty(F)
        for t in range(n):
            if with_q:
                qkok &= l2_row(q, b, s0 + t, tmp, code)
                for i in range(F):
                    fq[t, i] = tmp[i]
            qkok &= l2_row(k, b, s0 + t, tmp, code)
            for i in range(F):
                fk[t, i] = tmp[i]
            for m in range(M):
                x = to_work(v[b, s0 + t, m])
                R[row0 + t, m] = x
                vok &= is_finite(x)
        return vok, vok and qkok
    if code == KERNEL_CODE_NONE:
        # features computed outside (every map without a kernel code): the constant lets LLVM compile
        # a plain copy, which it vectorised at twice the speed of the identity's branch of the general loop
        return _read_tokens(q, k, v, b, s0, n, fq, fk, R, row0, KERNEL_CODE_NONE, with_q)
    return _read_tokens(q, k, v, b, s0, n, fq, fk, R, row0, code, with_q)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _read_tokens(q, k, v, b, s0, n, fq, fk, R, row0, code, with_q):
    """:func:`load_chunk` of an element-wise map ``code``."""
    F = k.shape[2]
    M = v.shape[2]
    vok = True
    qkok = True
    for t in range(n):
        if with_q:
            for i in range(F):
                x = to_work(q[b, s0 + t, i])
                fq[t, i] = phi(x, code)
                qkok &= is_finite(x)
        for i in range(F):
            x = to_work(k[b, s0 + t, i])
            fk[t, i] = phi(x, code)
            qkok &= is_finite(x)
        for m in range(M):
            x = to_work(v[b, s0 + t, m])
            R[row0 + t, m] = x
            vok &= is_finite(x)
    return vok, vok and qkok


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def features(src, b, s0, n, dst, code):
    """dst[:n] = phi(src[b, s0:s0+n]) in the working dtype; returns whether every element read is finite."""
    F = src.shape[2]
    ok = True
    if is_row_map(code):
        tmp = np.empty(F)
        for t in range(n):
            ok &= l2_row(src, b, s0 + t, tmp, code)
            for i in range(F):
                dst[t, i] = tmp[i]
        return ok
    for t in range(n):
        for i in range(F):
            x = to_work(src[b, s0 + t, i])
            dst[t, i] = phi(x, code)
            ok &= is_finite(x)
    return ok


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def feature_row(src, b, t, dst, code):
    """dst[:] = phi(src[b, t]) in dst's dtype; returns whether every element read is finite.

    A function of its own so that LLVM hoists the branch on ``code`` and vectorises each map.
    ``dst`` must be float64 for the row maps (L2), normalised in place in it.
    """
    if is_row_map(code):
        return l2_row(src, b, t, dst, code)
    ok = True
    for i in range(dst.shape[0]):
        x = to_work(src[b, t, i])
        dst[i] = phi(x, code)
        ok &= is_finite(x)
    return ok


def values(v, b, s0, n, buf):  # pragma: no cover - replaced inside Numba
    """The value block v[b, s0:s0+n] in the working dtype (a view, or converted into buf)."""
    return v[b, s0:s0 + n]


@overload(values)
def _values_ov(v, b, s0, n, buf):
    if isinstance(v.dtype, types.Integer):  # float16 bits
        def impl(v, b, s0, n, buf):
            M = v.shape[2]
            for t in range(n):
                for m in range(M):
                    buf[t, m] = f16_to_f32(v[b, s0 + t, m])
            return buf[:n]

        return impl

    def impl_view(v, b, s0, n, buf):
        return v[b, s0:s0 + n]

    return impl_view


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def state_sums(k, v, b, s_begin, s_end, H, code, fk, vb, part):
    """H (F, M + 1) float64 += sum of phi(K)^T [V 1] over tokens [s_begin, s_end), in blocks of fk.shape[0].

    ``H[:, :M]`` through BLAS per block (``part`` (F, M) scratch of the working
    dtype), the normaliser column token by token in float64 in a contiguous copy.
    Returns whether every k and v element read is finite.
    """
    F = k.shape[2]
    M = v.shape[2]
    blk = fk.shape[0]
    z = np.empty(F)
    for i in range(F):
        z[i] = H[i, M]
    ok = True
    for s0 in range(s_begin, s_end, blk):
        n = min(blk, s_end - s0)
        fkn = fk[:n]
        ok &= features(k, b, s0, n, fkn, code)
        vc = values(v, b, s0, n, vb)
        for t in range(n):
            for m in range(M):
                ok &= is_finite(vc[t, m])
        np.dot(fkn.T, vc, part)
        for i in range(F):
            for m in range(M):
                H[i, m] += part[i, m]
        for t in range(n):
            for i in range(F):
                z[i] += fkn[t, i]
    for i in range(F):
        H[i, M] = z[i]
    return ok


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def state_finite(H):
    """Whether every element of a state ``H`` (F, M + 1) is finite (one pass)."""
    ok = True
    for i in range(H.shape[0]):
        for m in range(H.shape[1]):
            ok &= is_finite(H[i, m])
    return ok
