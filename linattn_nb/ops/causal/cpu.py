"""Numba CPU kernel of causal linear attention: the per-token scan.

Kernel: :data:`causal_scan_kernel`; launcher: :func:`causal_scan`.  Design:
``docs/design-cpu.md``, "Per-token scan".
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
    """Per-token recurrence over each sequence of the flattened batch (axis 0); serial and parallel twins.

    q, k (B, N, F) raw (``code`` > 0) or features; v, out (B, N, M); H (B, F, M + 1)
    float64, initial state in, final state out; ``norm`` a ``NORM_*`` mode; ``lg``
    (B, N, G) the rule's log-factors.  ``flags`` (B, 2) uint8 <- per sequence,
    whether an input element read was NaN or inf, and whether a result or the
    final state is.
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
    """Launcher (the method table's forward contract, ``docs/launchers.md``).

    q, k (B, N, F); v (B, N, M); H (B, F, M + 1) float64 C-contiguous, the state
    ``[S | z]`` updated in place; ``out`` (B, N, M) written; ``code``, ``eps``,
    ``inputs``, ``rule``, ``normalize`` and ``check_finite`` as the contract.
    """
    B, N, F = q.shape
    M = v.shape[2]
    check_state(H, B, F, M)
    rule = check_rule(rule, inputs)
    lg = log_factors(rule, inputs, B, N, F)
    norm = norm_mode(eps, normalize)
    qk, kk, vk, o = (as_kernel_array(x) for x in (q, k, v, out))  # float16: uint16 bits, converted per element
    kernel = pick(causal_scan_kernel_serial, causal_scan_kernel, items=B, work=B * N * F * M,
                  limit="CPU_CHUNKED_SERIAL_MAX_WORK")
    flags = new_flags(B)
    kernel(qk, kk, vk, H, o, np.int64(code), float(eps if eps is not None else 0.0), np.int64(norm), rule,
           lg, flags)
    report(flags, (("q", q), ("k", k), ("v", v)), check_finite=check_finite)
    return out
