"""Chunkwise-parallel causal linear attention on the CPU (``method="chunked"``).

Design: ``docs/design-cpu.md``, "Chunked causal attention".
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ... import config
from ..._blas import single_threaded_blas
from .._blocks import load_chunk, state_finite
from .._chunks import check_chunk_arrays, part_range, plan, segment_states, token_range
from .._codes import NORM_FLOOR, NORM_NONE, RULE_ADDITIVE, norm_mode
from .._finite import new_flags, report
from .._gemm import gemm
from .._rules import (check_rule, check_state, chunk_factors, chunk_transition, chunk_values, intra_weights, is_delta,
                      log_factors)
from .._twins import pick, serial_and_parallel
from .._vec import as_kernel_array, is_finite, store3, work_dtype


# ---------------------------------------------------------------------------
# per-chunk helpers (inlined into the kernel by LLVM)
# ---------------------------------------------------------------------------
@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _init_scratch(H, R):
    """R = [H ; . 1]: the state (working dtype) over the value rows' column of ones."""
    F, M1 = H.shape
    one = R.dtype.type(1.0)
    for i in range(F):
        for m in range(M1):
            R[i, m] = H[i, m]
    for t in range(F, R.shape[0]):
        R[t, M1 - 1] = one


@njit(fastmath=config.FASTMATH, cache=config.CACHE, error_model="numpy")  # 1/0 -> inf, not an exception
def _span(q, k, v, out, b, s_begin, s_end, H, code, eps, norm, bs, X, R, fk, o, part, rule, lg, fs, fw, tot, w,
          sck, sY, sKK):
    """Chunked recurrence over tokens [s_begin, s_end) of sequence b from state H (F, M + 1), in place.

    Scratch (working dtype), C = fk.shape[0]: X (C, F + C) = [phi(Q_c) | A],
    R (F + C, M + 1) = [H ; V_c 1], fk (C, F) = phi(K_c), o (C, M + 1), part
    (F, M + 1); fs, fw, tot, w: the rule's factors (:func:`linattn_nb.ops._rules.chunk_factors`).
    When ``sck`` (chunks, F, M') has columns (the delta rules, for their backward), chunk ``s0 // C``
    leaves its start state (first M' columns, working dtype) in ``sck`` and its residuals and ``K K^T``
    in ``sY``, ``sKK`` (:func:`linattn_nb.ops._rules.chunk_values`).  An ``out`` with no tokens
    asks for no outputs: the chunks' intra weights and output products are skipped.
    Returns ``(inputs_finite, results_finite)``.
    """
    F = q.shape[2]
    M = v.shape[2]
    C = fk.shape[0]
    LX = F + C
    M1 = M + 1
    zero = X.dtype.type(0.0)
    inputs_ok = True
    results_ok = True  # outputs and normalisers
    Ms = sck.shape[2]
    save = Ms > 0
    outputs = out.shape[1] > 0  # none (a (B, 0, M) out): the state and the saved values only
    _init_scratch(H, R)
    for s0 in range(s_begin, s_end, C):
        n = min(C, s_end - s0)
        finite, read_ok = load_chunk(q, k, v, b, s0, n, X, fk, R, F, code, True)
        inputs_ok &= read_ok
        chunk_factors(rule, lg, b, s0, n, fs, fw, tot)
        c = s0 // C if save else 0
        if save:
            for i in range(F):
                for m in range(Ms):
                    sck[c, i, m] = R[i, m]
        if is_delta(rule):
            # the value rows become U' (a NaN/inf key too reaches them, below the diagonal only)
            chunk_values(rule, X, R, fk, o, n, F, fs, fw, w, sY[c], sKK[c])
            finite = read_ok
        if outputs:
            # Row blocks of bs: block r needs A and V_c only up to its own last
            # row, so the upper triangle is computed for the diagonal blocks only.
            for r0 in range(0, n, bs):
                ce = min(r0 + bs, n)
                intra_weights(rule, X, fk, r0, ce, F, fs, fw, w)
                if finite:
                    # [phi(Q) | A] [H ; V 1]: numerators and normalisers at once
                    gemm(0, 0, ce - r0, M1, F + ce, 1.0, X, r0 * LX, LX, R, 0, M1, 0.0, o, r0 * M1, M1)
            if not finite:
                # a NaN/inf value must not reach earlier rows through 0 * NaN in the
                # masked upper triangle: sum over j <= t only (check_finite=False)
                for t in range(n):
                    for m in range(M1):
                        acc = zero
                        for i in range(F):
                            acc += X[t, i] * R[i, m]
                        for j in range(t + 1):
                            acc += X[t, F + j] * R[F + j, m]
                        o[t, m] = acc
            for t in range(n):
                den = o[t, M]
                if norm == NORM_NONE:
                    den = 1.0
                elif norm == NORM_FLOOR and den < eps:
                    den = eps
                # an inf normaliser over finite numerators would give finite zeros
                results_ok &= is_finite(den)
                r = 1.0 / den
                for m in range(M):
                    results_ok &= is_finite(store3(out, b, s0 + t, m, o[t, m] * r))
        chunk_transition(rule, H, R, fk, part, n, fs, tot, outputs)
    return inputs_ok, results_ok and state_finite(H)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _sum_span(k, v, b, s_begin, s_end, H, code, R, fk, part, rule, lg, fs, fw, tot, pf):
    """H <- the state after tokens [s_begin, s_end), chunk by chunk exactly as :func:`_span`.

    ``pf`` (G,) is multiplied by the tokens' factors (the span's factor of
    the state before it, for the combine).
    """
    F = k.shape[2]
    C = fk.shape[0]
    _init_scratch(H, R)
    for s0 in range(s_begin, s_end, C):
        n = min(C, s_end - s0)
        load_chunk(k, k, v, b, s0, n, fk, fk, R, F, code, False)
        chunk_factors(rule, lg, b, s0, n, fs, fw, tot)
        chunk_transition(rule, H, R, fk, part, n, fs, tot, False)
        for g in range(pf.shape[0]):
            pf[g] *= tot[g]


# ---------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------
@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _rule_scratch(lg, C, wt):
    """Per-thread scratch of the rule's chunk factors: fs (3, C, G), fw (C, G), tot (G,), w (C,)."""
    G = lg.shape[2]
    return np.ones((3, C, G)), np.ones((C, G), wt), np.ones(G), np.ones(C)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _sum_item(it, k, v, Hp, Fp, wt, code, C, P, sub, rule, lg):
    """Pass 1, work item ``it``: piece ``j`` of sequence ``b`` (pieces split segments 0..P-2).

    Hp[b, j] <- the piece's contribution from a zero state, Fp[b, j] (G,) <- its factor.
    """
    N, F = k.shape[1], k.shape[2]
    M = v.shape[2]
    npc = Hp.shape[1]
    b = it // npc
    j = it % npc
    c0, c1 = part_range(j // sub, P, 0, (N + C - 1) // C)
    lo, hi = part_range(j % sub, sub, c0, c1)
    t0, t1 = token_range(lo, hi, C, N)
    # chunks of C tokens, as in pass 2, so the working-dtype parts are the same numbers
    R = np.empty((F + C, M + 1), wt)
    fk = np.empty((C, F), wt)
    part = np.empty((F, M + 1), wt)
    fs, fw, tot, w = _rule_scratch(lg, C, wt)
    Hp[b, j] = 0.0
    Fp[b, j] = 1.0
    _sum_span(k, v, b, t0, t1, Hp[b, j], code, R, fk, part, rule, lg, fs, fw, tot, Fp[b, j])


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _span_item(it, q, k, v, Hst, out, wt, code, eps, norm, C, bs, rule, lg, flags, sck, sY, sKK):
    """Pass 2, work item ``it``: segment ``p`` of sequence ``b`` from state Hst[b, p].

    ``flags[it]`` <- (an input read was NaN/inf, a result or the state is); sck, sY, sKK
    (B, chunks, ...) as :func:`_span`'s, or (1, 1, 0, 0) arrays when nothing is saved.
    """
    N, F = q.shape[1], q.shape[2]
    M = v.shape[2]
    P = Hst.shape[1]
    b = it // P
    p = it % P
    lo, hi = part_range(p, P, 0, (N + C - 1) // C)
    t0, t1 = token_range(lo, hi, C, N)
    X = np.zeros((C, F + C), wt)
    R = np.empty((F + C, M + 1), wt)
    fk = np.empty((C, F), wt)
    o = np.empty((C, M + 1), wt)
    part = np.empty((F, M + 1), wt)
    fs, fw, tot, w = _rule_scratch(lg, C, wt)
    sb = b if sck.shape[3] > 0 else 0  # nothing saved: (1, 1, 0, 0) arrays
    inputs_ok, results_ok = _span(q, k, v, out, b, t0, t1, Hst[b, p], code, eps, norm, bs, X, R, fk, o, part,
                                  rule, lg, fs, fw, tot, w, sck[sb], sY[sb], sKK[sb])
    flags[it, 0] = not inputs_ok
    flags[it, 1] = not results_ok


def _chunked_pass(mode, q, k, v, Hst, Fp, out, proto, code, eps, norm, C, sub, bs, rule, lg, flags, sck, sY, sKK):
    """One pass of the chunked causal kernel over its work items (serial and parallel twins).

    ``mode`` 0 (pass 1): ``Hst`` (B, (P-1)*sub, F, M+1) receives each piece of segments 0..P-2 summed
    from a zero state, ``Fp`` its factor of the state before it.  ``mode`` 1 (pass 2): ``Hst`` (B, P, F,
    M+1) holds each segment's start state, advanced in place to its end (``Hst[:, P-1]`` ends as the
    final state); outputs written; ``flags`` (B * P, 2) gets per segment whether an input read (column
    0) or a result (column 1) was NaN or inf.  q, k, v, out may be uint16 (float16 bits); ``proto`` an
    empty array of the working dtype; sck, sY, sKK the saved chunk values of :func:`_span` (B, chunks,
    ...), or (1, 1, 0, 0) arrays of the working dtype for none.
    """
    B = q.shape[0]
    wt = proto.dtype
    nitems = B * Hst.shape[1]
    # np.int64(it): prange's index is unsigned in the parallel kernel; without the cast each item
    # function compiles a second time, for uint64, besides the int64 of the serial twin's range
    for it in prange(nitems):
        if mode == 0:
            _sum_item(np.int64(it), k, v, Hst, Fp, wt, code, C, Hst.shape[1] // sub + 1, sub, rule, lg)
        else:
            _span_item(np.int64(it), q, k, v, Hst, out, wt, code, eps, norm, C, bs, rule, lg, flags, sck, sY, sKK)


chunked_kernel_serial, chunked_kernel = serial_and_parallel(_chunked_pass, fastmath=config.FASTMATH,
                                                            cache=config.CACHE)


# ---------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------
def _saved_arrays(save, B, N, F, M, C, wt, rule):
    """``save`` checked against the call (see :func:`causal_chunked`), or the kernel's empty stand-ins."""
    if save is None:
        return tuple(np.empty((1, 1, 0, 0), wt) for _ in range(3))
    P = (N + C - 1) // C
    ck, Ys, KKs = save
    Ms = ck.shape[3] if getattr(ck, "ndim", 0) == 4 else -1
    Cw = C if is_delta(rule) else 0  # residuals and K K^T: the delta rules only
    check_chunk_arrays("save", (("ck", ck, (B, P, F, Ms)), ("Ys", Ys, (B, P, Cw, Ms)), ("KKs", KKs, (B, P, Cw, Cw))),
                       wt, C)
    if not 1 <= Ms <= M + 1:
        raise ValueError(f"save: ck must keep between 1 and {M + 1} value columns, got {Ms}")
    return ck, Ys, KKs


def causal_chunked(q, k, v, H, out, *, code, eps, inputs=None, check_finite=False, normalize=True, chunk=None,
                   block=None, seq_parallel=None, rule=RULE_ADDITIVE, save=None):
    """Launcher of :func:`chunked_kernel` (the method table's forward contract, ``docs/launchers.md``).

    ``chunk`` and ``block`` (the intra-chunk row block) default from :mod:`linattn_nb.config`;
    ``seq_parallel`` forces (True) or forbids (False) splitting sequences across threads (default:
    when B is below the thread count; never for the delta rules).  ``save``: ``(ck, Ys, KKs)``, arrays
    of the working dtype of shapes (B, P, F, M'), (B, P, C', M') and (B, P, C', C') with P = ceil(N / C),
    M' <= M + 1 and C' = C for the delta rules, 0 for the others, which receive each chunk's start state,
    and for the delta rules its residuals and ``K K^T`` (what
    :func:`linattn_nb.ops.grad.cpu.backward_chunked` would compute again in its first pass).  ``out``
    None (with ``save`` only): no outputs, the state and the saved values alone (a gradient request whose
    outputs are not needed).  Returns ``out``.
    """
    B, N, F = q.shape
    M = v.shape[2]
    check_state(H, B, F, M)
    rule = check_rule(rule, inputs)
    lg = log_factors(rule, inputs, B, N, F)
    if N == 0 or B == 0:
        return out
    C = int(chunk if chunk is not None else config.cpu_chunk_size(N, F, M, q.dtype))
    if C < 1:
        raise ValueError(f"chunk must be >= 1, got {C}")
    C = min(C, N)  # no scratch beyond the sequence
    bs = max(1, min(C, int(block if block is not None else config.cpu_chunk_block(C, F, M, q.dtype))))
    if is_delta(rule):
        # the delta rules carry an (F, F) transition across a piece: batch-parallel only
        P, sub = 1, 1
    else:
        P, sub = plan(B, N, chunk=C, seq_parallel=seq_parallel)
    kernel = pick(chunked_kernel_serial, chunked_kernel, items=B * P, work=B * N * F * M,
                  limit="CPU_CHUNKED_SERIAL_MAX_WORK", force=True if seq_parallel is True else None)
    wt = work_dtype(q.dtype)
    norm = norm_mode(eps, normalize)
    qk, kk, vk = (as_kernel_array(np.ascontiguousarray(x)) for x in (q, k, v))
    if out is None:
        if save is None:
            raise ValueError("out: None (no outputs) only with save=")
        out = np.empty((B, 0, M), wt)
    ok = as_kernel_array(out)
    proto = np.empty(0, wt)
    flags = new_flags(B * P)
    saved = _saved_arrays(save, B, N, F, M, C, wt, rule)
    args = (np.int64(code), float(eps if eps is not None else 0.0), np.int64(norm), np.int64(C), np.int64(sub),
            np.int64(bs), rule, lg, flags) + saved
    # BLAS pinned to one thread inside the parallel kernel only: there, its own
    # threads would oversubscribe the cores; on the calling thread alone they
    # may help, and the pinning costs a tenth of a small call.
    with single_threaded_blas(kernel is chunked_kernel):
        if P == 1:
            # batch-parallel: the state array holds the segment states
            kernel(np.int64(1), qk, kk, vk, H.reshape(B, 1, F, M + 1), np.empty((B, 1, lg.shape[2])), ok, proto,
                   *args)
        else:
            # pass 1: contributions of the pieces before the last segment
            parts = np.empty((B, (P - 1) * sub, F, M + 1))
            facs = np.empty((B, (P - 1) * sub, lg.shape[2]))  # each piece's factor (none for the additive rule)
            kernel(np.int64(0), qk, kk, vk, parts, facs, ok, proto, *args)
            # prefix over segments, starting from the initial state
            Hst = segment_states(rule, H, parts, sub, P, facs)
            # pass 2: all segments in parallel
            kernel(np.int64(1), qk, kk, vk, Hst, facs, ok, proto, *args)
            H[...] = Hst[:, P - 1]
    report(flags, (("q", q), ("k", k), ("v", v)), check_finite=check_finite)
    return out
