"""Numba CPU kernel of non-causal linear attention: aggregate, then query.

Kernels: :data:`noncausal_kernel` (parallel) and :data:`noncausal_kernel_serial`; launcher:
:func:`noncausal_aggregate`.  Design: ``docs/design-cpu.md``, "Non-causal kernel".
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from ... import config
from ..._blas import single_threaded_blas
from .._blocks import features, state_finite, state_sums
from .._chunks import absorb_parts, part_range, segments, token_range
from .._codes import NORM_FLOOR, NORM_NONE, RULE_ADDITIVE, norm_mode
from .._rules import check_rule, check_state
from .._twins import pick, serial_and_parallel
from .._finite import report
from .._vec import as_kernel_array, is_finite, store3, work_dtype


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _piece(j, pieces, N, block):
    """Token range [lo, hi) of piece j of ``pieces`` (whole blocks)."""
    lo, hi = part_range(j, pieces, 0, (N + block - 1) // block)
    return token_range(lo, hi, block, N)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _aggregate_item(it, k, v, Hp, wt, code, block, flags):
    N, F = k.shape[1], k.shape[2]
    M = v.shape[2]
    pieces = Hp.shape[1]
    b = it // pieces
    j = it % pieces
    lo, hi = _piece(j, pieces, N, block)
    fk = np.empty((block, F), wt)
    vb = np.empty((block, M), wt)
    part = np.empty((F, M), wt)
    Hp[b, j] = 0.0
    flags[it, 0] = not state_sums(k, v, b, lo, hi, Hp[b, j], code, fk, vb, part)
    flags[it, 1] = not state_finite(Hp[b, j])


@njit(fastmath=config.FASTMATH, cache=config.CACHE, error_model="numpy")  # 1/0 -> inf, not an exception
def _query_item(it, q, H, out, wt, code, eps, norm, block, pieces, flags):
    N, F = q.shape[1], q.shape[2]
    M = H.shape[2] - 1
    b = it // pieces
    j = it % pieces
    lo, hi = _piece(j, pieces, N, block)
    Sw = np.empty((F, M), wt)
    zb = np.empty(F)  # the normaliser column, contiguous for the dot products below
    for i in range(F):
        for m in range(M):
            Sw[i, m] = H[b, i, m]
        zb[i] = H[b, i, M]
    fq = np.empty((block, F), wt)
    num = np.empty((block, M), wt)
    rden = np.empty(block, wt)
    inputs_ok = True
    results_ok = True  # outputs and normalisers
    for s0 in range(lo, hi, block):
        n = min(block, hi - s0)
        fqn = fq[:n]
        numn = num[:n]
        inputs_ok &= features(q, b, s0, n, fqn, code)
        np.dot(fqn, Sw, numn)
        for t in range(n):
            den = 0.0
            for i in range(F):
                den += fqn[t, i] * zb[i]
            if norm == NORM_NONE:
                den = 1.0
            elif norm == NORM_FLOOR and den < eps:
                den = eps
            results_ok &= is_finite(den)  # an inf normaliser over finite numerators would give finite zeros
            rden[t] = 1.0 / den
        for t in range(n):
            r = rden[t]
            for m in range(M):
                results_ok &= is_finite(store3(out, b, s0 + t, m, numn[t, m] * r))
    flags[it, 0] = not inputs_ok
    flags[it, 1] = not results_ok


def _noncausal_phase(mode, q, k, v, parts, H, out, proto, code, eps, norm, block, flags):
    """One phase over (sequence, piece) items (serial and parallel twins).

    mode 0 (aggregate): ``parts`` (B, P, F, M+1) float64 <- each piece's
    ``phi(K)^T [V 1]``.  mode 1 (query): ``out`` (B, N, M) from the final state
    ``H``.  ``flags`` (2, B * P, 2) uint8: ``flags[mode, item]`` <- whether an input
    read or a result was NaN or inf.  q, k, v may be uint16 (float16 bits);
    ``proto`` an empty array of the working dtype.
    """
    B = q.shape[0]
    pieces = parts.shape[1]
    wt = proto.dtype
    # np.int64(it): one compilation of the item functions for both twins (prange's index is unsigned)
    for it in prange(B * pieces):
        if mode == 0:
            _aggregate_item(np.int64(it), k, v, parts, wt, code, block, flags[0])
        else:
            _query_item(np.int64(it), q, H, out, wt, code, eps, norm, block, pieces, flags[1])


noncausal_kernel_serial, noncausal_kernel = serial_and_parallel(_noncausal_phase, fastmath=config.FASTMATH,
                                                                cache=config.CACHE)


def noncausal_aggregate(q, k, v, H, out, *, code, eps, inputs=None, check_finite=False, normalize=True,
                        block=None, pieces=None, rule=RULE_ADDITIVE):
    """Launcher (the forward contract, ``docs/launchers.md``): H updated in place, ``out`` written.

    H (B, F, M + 1) float64 is the context seen by every query, updated to include
    the N tokens.  ``pieces`` (per sequence) defaults to 1 when the flattened batch
    fills the threads and to ceil(threads / B) otherwise (at least ``block`` tokens each).
    """
    B, N, F = q.shape
    M = v.shape[2]
    check_state(H, B, F, M)
    rule = check_rule(rule, inputs)
    if rule != RULE_ADDITIVE:  # pragma: no cover - no other rule is registered yet
        raise ValueError(f"the non-causal kernel implements the additive rule only, got rule={rule}")
    block = config.knob_int("CPU_NONCAUSAL_BLOCK") if block is None else int(block)
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if N == 0 or B == 0:
        return out
    if pieces is None:
        pieces = segments(B, -(-N // block), threads=numba.get_num_threads())
    pieces = int(pieces)
    kernel = pick(noncausal_kernel_serial, noncausal_kernel, items=B * pieces, work=B * N * F * M,
                  limit="CPU_CHUNKED_SERIAL_MAX_WORK")
    wt = work_dtype(q.dtype)
    norm = norm_mode(eps, normalize)
    qk, kk, vk = (as_kernel_array(np.ascontiguousarray(x)) for x in (q, k, v))
    parts = np.empty((B, pieces, F, M + 1))
    flags = np.zeros((2, B * pieces, 2), np.uint8)
    args = (as_kernel_array(out), np.empty(0, wt), np.int64(code), float(eps if eps is not None else 0.0), np.int64(norm),
            np.int64(block), flags)
    # BLAS pinned inside the parallel kernel only (see causal/chunked.py)
    with single_threaded_blas(kernel is noncausal_kernel):
        kernel(np.int64(0), qk, kk, vk, parts, H, *args)
        absorb_parts(rule, H, parts)
        kernel(np.int64(1), qk, kk, vk, parts, H, *args)
    report(flags.reshape(-1, 2), (("q", q), ("k", k), ("v", v)), check_finite=check_finite)
    return out
