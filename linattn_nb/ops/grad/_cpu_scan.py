"""The checkpointed token recurrence of the CPU backward (kernel of :func:`linattn_nb.ops.grad.cpu.backward_scan`).

Design: ``docs/design-cpu.md``, "Checkpointed token recurrence".
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ... import config
from .._codes import RULE_DECAY, RULE_DELTA, RULE_GATE, RULE_GATED_DELTA
from .._twins import serial_and_parallel


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def token_factors(rule, lg, b, t, a):
    """a (F,) float64 <- the factors ``a_t`` of token ``t`` of sequence ``b`` per state row (1 without a decay).

    ``lg`` (B, N, G): the log-factors of :func:`linattn_nb.ops._rules.log_factors`
    (the delta rules: column 0 the log-decay, column 1 ``beta``).
    """
    F = a.shape[0]
    if rule == RULE_DECAY or rule == RULE_GATED_DELTA:
        x = math.exp(lg[b, t, 0])
        for i in range(F):
            a[i] = x
    elif rule == RULE_GATE:
        for i in range(F):
            a[i] = math.exp(lg[b, t, i])
    else:
        for i in range(F):
            a[i] = 1.0


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def token_state(P, Hn, k, v, a, beta, delta, u):
    """Hn <- the state after one token from the state P (both (F, M') float64; may be the same array).

    Not delta: ``Hn = diag(a) P + k v^T``.  Delta: ``u = P^T k`` (scratch
    (M',)), ``Hn = a_0 P + k (beta (v - a_0 u))^T``.
    """
    F, M1 = P.shape
    if delta:
        for m in range(M1):
            u[m] = 0.0
        for i in range(F):
            ki = k[i]
            for m in range(M1):
                u[m] += ki * P[i, m]
        a0 = a[0]
        for m in range(M1):
            u[m] = beta * (v[m] - a0 * u[m])
        for i in range(F):
            ki = k[i]
            for m in range(M1):
                Hn[i, m] = a0 * P[i, m] + ki * u[m]
    else:
        for i in range(F):
            ai = a[i]
            ki = k[i]
            for m in range(M1):
                Hn[i, m] = ai * P[i, m] + ki * v[m]


def _scan_backward(qf, kf, v1, H0, g1, dHN, has_dHN, rule, lg, L, ck, dq, dk, dv, dH0, dfac, dbeta):
    """Checkpointed reverse scan over each sequence of the flattened batch (``docs/design-cpu.md``).

    qf, kf (B, N, F), v1, g1 (B, N, M') of the working dtype; H0, dHN (B, F, M')
    float64; lg (B, N, G) log-factors; L the checkpoint interval, ck (B, ceil(N / L),
    F, M') float64 scratch.  Every element of dq, dk, dv, dH0, dfac (B, N, G') and
    dbeta ((B, 0) outside the delta rules) is written.
    """
    B, N, F = qf.shape
    M1 = v1.shape[2]
    nck = ck.shape[1]
    delta = rule == RULE_DELTA or rule == RULE_GATED_DELTA
    Gd = dfac.shape[2]
    gate = rule == RULE_GATE
    for b in prange(B):
        a = np.ones(F)
        u = np.empty(M1)
        w = np.empty(M1)
        acc = np.empty(M1)
        H = np.empty((F, M1))
        for i in range(F):
            for m in range(M1):
                H[i, m] = H0[b, i, m]
        # pass 1: the checkpoints
        for c in range(nck):
            ck[b, c] = H
            for t in range(c * L, min(N, (c + 1) * L)):
                token_factors(rule, lg, b, t, a)
                token_state(H, H, kf[b, t], v1[b, t], a, lg[b, t, 1] if delta else 0.0, delta, u)
        # pass 2: spans in reverse, states recomputed from their checkpoint
        Hs = np.empty((L + 1, F, M1))
        D = np.zeros((F, M1))
        if has_dHN:
            for i in range(F):
                for m in range(M1):
                    D[i, m] = dHN[b, i, m]
        for c in range(nck - 1, -1, -1):
            s0 = c * L
            n = min(N, s0 + L) - s0
            Hs[0] = ck[b, c]
            for j in range(n):
                token_factors(rule, lg, b, s0 + j, a)
                token_state(Hs[j], Hs[j + 1], kf[b, s0 + j], v1[b, s0 + j], a,
                            lg[b, s0 + j, 1] if delta else 0.0, delta, u)
            for j in range(n - 1, -1, -1):
                t = s0 + j
                token_factors(rule, lg, b, t, a)
                P = Hs[j]
                Hn = Hs[j + 1]
                q = qf[b, t]
                k = kf[b, t]
                v = v1[b, t]
                g = g1[b, t]
                for i in range(F):
                    qi = np.float64(q[i])
                    for m in range(M1):
                        D[i, m] += qi * g[m]
                for i in range(F):
                    s = 0.0
                    for m in range(M1):
                        s += Hn[i, m] * g[m]
                    dq[b, t, i] = s
                if delta:
                    at = a[0]
                    bt = lg[b, t, 1]
                    for m in range(M1):
                        u[m] = 0.0
                        w[m] = 0.0
                    for i in range(F):
                        ki = np.float64(k[i])
                        for m in range(M1):
                            u[m] += ki * P[i, m]
                            w[m] += ki * D[i, m]
                    dpp = 0.0
                    for i in range(F):
                        s1 = 0.0
                        s2 = 0.0
                        for m in range(M1):
                            s1 += D[i, m] * (bt * v[m] - at * bt * u[m]) - at * bt * P[i, m] * w[m]
                            s2 += D[i, m] * P[i, m]
                        dk[b, t, i] = s1
                        dpp += s2
                    wu = 0.0
                    wv = 0.0
                    for m in range(M1):
                        dv[b, t, m] = bt * w[m]
                        wu += w[m] * u[m]
                        wv += w[m] * v[m]
                    dbeta[b, t] = wv - at * wu
                    if Gd > 0:
                        dfac[b, t, 0] = dpp - bt * wu
                    for i in range(F):
                        ki = np.float64(k[i])
                        for m in range(M1):
                            D[i, m] = at * (D[i, m] - bt * ki * w[m])
                else:
                    for m in range(M1):
                        acc[m] = 0.0
                    tot = 0.0
                    for i in range(F):
                        ki = np.float64(k[i])
                        s1 = 0.0
                        s2 = 0.0
                        for m in range(M1):
                            d = D[i, m]
                            s1 += d * v[m]
                            s2 += d * P[i, m]
                            acc[m] += d * ki
                        dk[b, t, i] = s1
                        if gate:
                            dfac[b, t, i] = s2
                        tot += s2
                        ai = a[i]
                        for m in range(M1):
                            D[i, m] *= ai
                    if Gd == 1:
                        dfac[b, t, 0] = tot
                    for m in range(M1):
                        dv[b, t, m] = acc[m]
        for i in range(F):
            for m in range(M1):
                dH0[b, i, m] = D[i, m]


scan_backward_kernel_serial, scan_backward_kernel = serial_and_parallel(_scan_backward, fastmath=config.FASTMATH,
                                                                        cache=config.CACHE)
