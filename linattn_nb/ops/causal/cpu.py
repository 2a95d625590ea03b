"""Numba CPU kernel of causal linear attention: the per-token scan.

Kernel: :data:`causal_scan_kernel`; launcher: :func:`causal_scan`.  The state
``H = [S | z]`` (F x (M + 1)) is carried in float64 (the state array the
launcher is given), so float32 inputs do not lose accuracy over long
sequences; the normaliser ``z`` is the state of value column M, whose value
is always 1.  float16 inputs are passed as ``uint16`` bits and converted per
element (no full-size float32 copy); the output is rounded to float16 (from
the float64 result, through float32).  Token ``t`` updates the state first and
then reads it (prefix states include token t; Katharopoulos et al. 2020,
Eqs. 18-19).
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ... import config
from .._blocks import feature_row
from .._codes import NORM_FLOOR, NORM_NONE, RULE_ADDITIVE, norm_mode
from .._rules import check_rule, check_state, delta_token, is_delta, log_factors, token_step
from .._twins import pick, serial_and_parallel
from .._finite import new_flags, report
from .._vec import as_kernel_array, elu1, is_finite, store3, to_work


def _scan(q, k, v, H, out, code, eps, norm, rule, lg, flags):
    """Per-token recurrence over each sequence of the flattened batch (axis 0).

    q, k : (B, N, F) inputs (``code`` > 0: raw, the map is applied inline;
    code 0: already features).  v : (B, N, M).  H : (B, F, M + 1) float64:
    the initial state ``[S | z]`` on entry, the final state on return.
    out : (B, N, M).  ``norm`` (:data:`linattn_nb.ops._codes.NORM_RAW` and
    the others): divide by the raw normaliser, by the normaliser floored at
    ``eps``, or not at all.  ``rule``: update-rule code; each token's state update is the rule's
    :func:`linattn_nb.ops._rules.token_step`, with the token's factor per row
    from ``lg`` (B, N, G) float64, its log-factors
    (:func:`linattn_nb.ops._rules.log_factors`: G = 0 none, 1 one per token,
    F one per row; the delta rules: (log-decay, beta), each token through
    :func:`linattn_nb.ops._rules.delta_token`).  ``flags`` (B, 2) uint8 <- per
    sequence, whether a q, k or v element read was NaN or inf (checked on the
    elements the loop loads anyway), and whether an output, a normaliser or
    the final state is.  Compiled twice (:mod:`linattn_nb.ops._twins`):
    :data:`causal_scan_kernel`, parallel over the batch, and
    :data:`causal_scan_kernel_serial` for small problems.

    Each sequence's state is copied into a contiguous ``S`` block and ``z``
    vector for the scan and back at the end: the inner loop over rows of
    length M runs faster than over the (M + 1)-long rows of ``H``
    (docs/measurements-cpu.md).  The features of a token come from
    :func:`linattn_nb.ops._blocks.feature_row`, a loop of its own that
    vectorises (the row maps ``l2`` and ``silu_l2``: normalised in float64,
    the scan's feature dtype).
    """
    B, N, F = q.shape
    M = v.shape[2]
    G = lg.shape[2]
    for b in prange(B):
        Sb = np.empty((F, M), dtype=H.dtype)
        zb = np.empty(F, dtype=H.dtype)
        for i in range(F):
            for m in range(M):
                Sb[i, m] = H[b, i, m]
            zb[i] = H[b, i, M]
        fq = np.empty(F, dtype=H.dtype)
        fk = np.empty(F, dtype=H.dtype)
        num = np.empty(M, dtype=H.dtype)
        vrow = np.empty(M, dtype=H.dtype)
        fa = np.ones(F)  # the token's factor of each state row
        u = np.empty(M, dtype=H.dtype)  # the delta rules' correction
        delta = is_delta(rule)
        inputs_ok = True
        results_ok = True  # outputs, normalisers and the final state
        for t in range(N):
            for m in range(M):
                x = to_work(v[b, t, m])
                vrow[m] = x
                inputs_ok &= is_finite(x)
            inputs_ok &= feature_row(q, b, t, fq, code)
            inputs_ok &= feature_row(k, b, t, fk, code)
            if delta:  # lg[b, t] = (log-decay, beta): the whole token at once (ops/_rules.py)
                den = delta_token(Sb, zb, fk, fq, vrow, elu1(lg[b, t, 0]), lg[b, t, 1], num, u)
            else:
                if G == 1:
                    fa[:] = elu1(lg[b, t, 0])  # exp of a log-factor <= 0 (ops/_vec.py); -inf -> 0
                elif G > 1:
                    for i in range(F):
                        fa[i] = elu1(lg[b, t, i])
                num[:] = 0.0
                den = 0.0
                for i in range(F):
                    c = fq[i]
                    den += c * token_step(rule, Sb, zb, i, fk[i], c, vrow, num, fa[i])  # the rule's hook
            if norm == NORM_NONE:
                den = 1.0
            elif norm == NORM_FLOOR and den < eps:
                den = eps
            results_ok &= is_finite(den)  # an inf normaliser over finite numerators would give finite zeros
            for m in range(M):
                results_ok &= is_finite(store3(out, b, t, m, num[m] / den))
        for i in range(F):
            for m in range(M):
                H[b, i, m] = Sb[i, m]
                results_ok &= is_finite(Sb[i, m])
            H[b, i, M] = zb[i]
            results_ok &= is_finite(zb[i])
        flags[b, 0] = not inputs_ok
        flags[b, 1] = not results_ok


# error_model="numpy": raw division (eps=None) by a zero normaliser gives inf
# or NaN, as in every other kernel, not ZeroDivisionError
causal_scan_kernel_serial, causal_scan_kernel = serial_and_parallel(_scan, fastmath=config.FASTMATH,
                                                                    cache=config.CACHE, error_model="numpy")


def causal_scan(q, k, v, H, out, *, code, eps, inputs=None, check_finite=False, normalize=True,
                rule=RULE_ADDITIVE):
    """Launcher (the method table's forward signature).

    q, k (B, N, F); v (B, N, M); H (B, F, M + 1) float64 C-contiguous, the
    state ``[S | z]`` updated in place; ``out`` (B, N, M) written.  ``code``:
    inline feature map; ``eps``: normaliser floor or None; ``inputs``: the
    rule's per-token inputs (none for the additive rule); ``rule``: update-rule
    code (:data:`linattn_nb.ops._codes.RULES`); ``normalize``: False writes
    ``phi(q)^T S_t`` undivided.  ``check_finite``: raise
    ValueError naming the first of q, k, v holding NaN or inf, or
    :class:`~linattn_nb.ops._finite.NonFiniteResult` for finite inputs whose
    outputs or state are not (found by the kernel while it reads and writes;
    raised after it ran, ``out`` and ``H`` then unspecified).
    """
    B, N, F = q.shape
    M = v.shape[2]
    check_state(H, B, F, M)
    rule = check_rule(rule, inputs)
    lg = log_factors(rule, inputs, B, N, F)
    norm = norm_mode(eps, normalize)
    qk, kk, vk, o = (as_kernel_array(x) for x in (q, k, v, out))  # float16: uint16 bits, converted per element
    kernel = pick(causal_scan_kernel_serial, causal_scan_kernel, items=B, work=B * N * F * M,
                  limit=config.CPU_CHUNKED_SERIAL_MAX_WORK)
    flags = new_flags(B)
    kernel(qk, kk, vk, H, o, np.int64(code), float(eps if eps is not None else 0.0), np.int64(norm), rule,
           lg, flags)
    report(flags, (("q", q), ("k", k), ("v", v)), check_finite=check_finite)
    return out
