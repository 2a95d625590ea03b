"""GEMM-shaped chunks of the CPU backward (kernel of :func:`linattn_nb.ops.grad.cpu.backward_chunked`).

Design: ``docs/design-cpu.md``, "Chunked backward".
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ... import config
from .._codes import KERNEL_CODE_ELU, KERNEL_CODE_NONE, KERNEL_CODE_RELU, RULE_ADDITIVE, RULE_DECAY
from .._gemm import gemm
from .._twins import serial_and_parallel
from .._vec import elu1, is_finite
from ._maps import dphi


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def chunk_factors_rows(rule, lg, b, s0, n, fa, fb, fe, tot):
    """Per-row factors of tokens [s0, s0 + n) of sequence ``b`` (float64, (C, F) each).

    ``fa[t] = a_t``, ``fb[t] = a_0 ... a_t``, ``fe[t] = a_{t+1} ... a_{n-1}``,
    ``tot = a_0 ... a_{n-1}``; the decay rule's scalar is broadcast over the
    F rows.  Running products of factors in [0, 1] (exact zeros across a
    reset).
    """
    F = fa.shape[1]
    for t in range(n):
        if rule == RULE_DECAY:
            x = elu1(lg[b, s0 + t, 0])  # exp: the log-factors are <= 0
            for i in range(F):
                fa[t, i] = x
        else:
            for i in range(F):
                fa[t, i] = elu1(lg[b, s0 + t, i])  # the vectorised exp (a scalar call per gate cost 6.6 ms a pass)
    for i in range(F):
        fb[0, i] = fa[0, i]
        fe[n - 1, i] = 1.0
    for t in range(1, n):
        for i in range(F):
            fb[t, i] = fb[t - 1, i] * fa[t, i]
    for t in range(n - 2, -1, -1):
        for i in range(F):
            fe[t, i] = fe[t + 1, i] * fa[t + 1, i]
    for i in range(F):
        tot[i] = fb[n - 1, i]


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def copy_state(H, Hw):
    for i in range(H.shape[0]):
        for m in range(H.shape[1]):
            Hw[i, m] = H[i, m]


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def copy_state_t(H, Ht):
    """``Ht`` (M', F) <- ``H`` (F, M') transposed, in ``Ht``'s dtype: a product with ``H^T`` on the right then
    runs as BLAS's non-transposed form (``G H^T`` 48 x 64 x 64 float32: 1.5 against 2.7 us a call, one core,
    AMD EPYC; docs/design-cpu.md, "Direct BLAS calls").  Rows of ``Ht`` in turn (0.65 us at 64 x 65 against
    1.05 us in ``H``'s order)."""
    for m in range(H.shape[1]):
        for i in range(H.shape[0]):
            Ht[m, i] = H[i, m]


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def times_rows(D, fa, n):
    """``D[:n] *= fa[:n]`` (rows of one chunk's factor gradient times its factors), row slices from 0 so
    that the loop keeps its vector form."""
    for t in range(n):
        dr = D[t]
        fr = fa[t]
        for i in range(dr.shape[0]):
            dr[i] = dr[i] * fr[i]


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def add_into(X, part):
    """``X`` (float64) ``+= part`` (the working dtype), elementwise: a state advanced by a chunk's product."""
    for i in range(X.shape[0]):
        for m in range(X.shape[1]):
            X[i, m] += part[i, m]


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def additive_reverse_chunk(qf, kf, v1, g1, R, Rw, Rt, part, dk, dv, qo, vo, n):
    """One chunk of the additive rule's reverse pass (tokens at flat offsets ``qo``, ``vo``, ``n`` of them):
    ``dk += [V 1] R^T``, ``dv += K R`` (through ``Rw`` and ``Rt``, R's working-dtype copy and its transpose),
    then ``R += Q^T g1``."""
    F = qf.shape[2]
    M1 = v1.shape[2]
    copy_state(R, Rw)
    copy_state_t(R, Rt)
    gemm(0, 0, n, F, M1, 1.0, v1, vo, M1, Rt, 0, F, 1.0, dk, qo, F)
    gemm(0, 0, n, M1, F, 1.0, kf, qo, F, Rw, 0, M1, 1.0, dv, vo, M1)
    gemm(1, 0, F, M1, n, 1.0, qf, qo, F, g1, vo, M1, 0.0, part, 0, M1)
    add_into(R, part)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def intra_columns(P, A, qf, g1, dk, dv, qo, vo, n, bs):
    """The intra-chunk parts ``dk = P^T Q`` and ``dv = A^T g1`` of one chunk (tokens at flat offsets ``qo``,
    ``vo``, ``n`` of them; ``P``, ``A`` (C, C) lower triangular in their first ``n`` rows and columns, as
    row blocks of ``bs`` leave them: zero above the diagonal within each diagonal block), in column blocks
    of ``bs`` over the rows at or below each block: the zero blocks above the diagonal are not read."""
    C = P.shape[1]
    F = qf.shape[2]
    M1 = g1.shape[2]
    for j0 in range(0, n, bs):
        je = min(j0 + bs, n)
        gemm(1, 0, je - j0, F, n - j0, 1.0, P, j0 * C + j0, C, qf, qo + j0 * F, F, 0.0, dk, qo + j0 * F, F)
        gemm(1, 0, je - j0, M1, n - j0, 1.0, A, j0 * C + j0, C, g1, vo + j0 * M1, M1, 0.0, dv, vo + j0 * M1, M1)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def map_span(x, f, d, code):
    """The feature map's VJP over a span of rows, written over ``d``: ``d <- d * phi'(x)``, ``f = phi(x)``
    the features, map ``code`` of :mod:`linattn_nb.ops.grad._maps` (1-D slices of one length: a chunk's
    rows).  The factors are those of :func:`linattn_nb.ops.grad._maps.dphi`, bit for bit: ELU+1's is
    ``f`` below 1, else 1 (``f = exp(x)`` for ``x < 0``, at most 1, and ``x + 1 >= 1`` above), ReLU's 1
    where ``f > 0``, else ``f - f`` (0, NaN for NaN); only the squared ReLU reads ``x`` (``2 x``; for the
    others ``x`` may be empty).  Code ``KERNEL_CODE_NONE``: features given as they are, ``d`` unchanged
    (the check alone).  From ``f``, in the cache, they cost no ``exp`` (0.5 ns an element with
    it, measured).  Returns whether every result, as stored, is finite.  For the fused normalised
    backwards, on a chunk's rows once their gradient is complete.

    1-D slices indexed from 0: the same loop over a whole array from a flat offset cost 4x as much, and
    row by row twice as much, after a GEMM had written the rows (measured)."""
    one = d.dtype.type(1.0)
    n = d.shape[0]
    if code == KERNEL_CODE_NONE:
        pass  # features given as they are (a map whose VJP passes the gradients through): the check alone
    elif code == KERNEL_CODE_ELU:
        for i in range(n):
            y = f[i]
            d[i] = d[i] * (one if y >= one else y)
    elif code == KERNEL_CODE_RELU:
        for i in range(n):
            y = f[i]
            d[i] = d[i] * (one if y > 0 else y - y)
    else:
        for i in range(n):
            d[i] = d[i] * dphi(x[i], code)
    bad = np.uint8(0)
    for i in range(n):
        bad |= np.uint8(not is_finite(d[i]))
    return bad == 0


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def map_chunk(x, f, d, code, b, s0, n):
    """:func:`map_span` on rows ``[s0, s0 + n)`` of sequence ``b`` of the C-contiguous (B, N, F) arrays
    ``x`` (of shape (1, 0, 0) where unread: an empty slice), ``f`` and ``d``, as 1-D slices."""
    F = d.shape[2]
    o = (b * d.shape[1] + s0) * F
    e = o + n * F
    return map_span(x.reshape(x.size)[o:e], f.reshape(f.size)[o:e], d.reshape(d.size)[o:e], code)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def rows_finite(d, b, s0, n, M):
    """Whether the first ``M`` columns of rows ``[s0, s0 + n)`` of sequence ``b`` of ``d`` are finite."""
    bad = np.uint8(0)
    for t in range(n):
        dr = d[b, s0 + t]
        for m in range(M):
            bad |= np.uint8(not is_finite(dr[m]))
    return bad == 0


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def start_adjoint(R, dHN, b, has_dHN):
    """The adjoint of sequence b's final state: dHN[b] when given, else zero (the reverse passes' start)."""
    if has_dHN:
        for i in range(R.shape[0]):
            for m in range(R.shape[1]):
                R[i, m] = dHN[b, i, m]
    else:
        R[:, :] = 0.0


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _mask_upper(X, n):
    z = X.dtype.type(0.0)
    for t in range(n):
        for j in range(t + 1, n):
            X[t, j] = z


#: The smallest running product ``b`` of a chunk's gates (per feature, from the chunk's start) for which
#: the gate rule's pass 1 runs its intra-chunk sums as float64 GEMMs on ``Q * b`` and ``K / b`` (``1 / b``
#: at most ``e^300``).  A chunk with a smaller product (a reset, strong gates) takes the loops that decay
#: each key as they read it.
LOG_SPACE_MIN = math.exp(-300.0)
#: The smallest gate of a float32 chunk for which the factor gradient's pair sum comes from the same GEMMs
#: (a difference of two running sums, whose float64 round-off is divided by the gate: at most
#: ``n^2 2^-53 / GATE_PAIRS_MIN`` relative); below it, and always in float64, its loop.
GATE_PAIRS_MIN = math.exp(-10.0)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def within(x, n, lo):
    """Whether every element of ``x[:n]`` lies in ``[lo, 1 / lo]`` (False for a NaN).  No early exit: the
    loop then takes its vector form (0.19 against 0.76 us for a 32 x 64 chunk that passes, AMD EPYC)."""
    hi = 1.0 / lo
    ok = True
    for t in range(n):
        r = x[t]
        for i in range(r.shape[0]):
            y = r[i]
            ok &= (y >= lo) & (y <= hi)
    return ok


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _factor_pairs(qf, kf, Pm, fa, Z, acc, dfac, b, s0, n, F, Gd):
    """The gate rule's factor gradient sum_{s < t <= u} W_{t-1,s} W_ut k_s q_u P0_us by loops, added to
    ``dfac``, through Z_t[u]."""
    for u in range(n):
        for i in range(F):
            Z[u, i] = 0.0
    for t in range(n):
        if t > 0:
            for i in range(F):
                acc[i] = 1.0  # W_ut, u = t
            x = 0.0
            for u in range(t, n):
                if u > t:
                    for i in range(F):
                        acc[i] *= fa[u, i]
                for i in range(F):
                    y = acc[i] * np.float64(qf[b, s0 + u, i]) * Z[u, i]
                    x += y
                    if Gd != 1:
                        dfac[b, s0 + t, i] += y
            if Gd == 1:
                dfac[b, s0 + t, 0] += x
        for u in range(t + 1, n):
            p = np.float64(Pm[u, t])
            for i in range(F):
                Z[u, i] = fa[t, i] * Z[u, i] + np.float64(kf[b, s0 + t, i]) * p


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _dk_loops(qf, Pm, fa, acc, fk, dk, b, s0, n, F):
    """The intra-chunk part of the gate rule's ``dk``, sum_{u >= t} W_ut q_u P0_ut, by loops: the queries
    decayed in place backwards."""
    for t in range(n - 1, -1, -1):
        p = np.float64(Pm[t, t])
        for i in range(F):
            fk[t, i] = qf[b, s0 + t, i]
            acc[i] = p * fk[t, i]
        for u in range(t + 1, n):  # each query decayed as it is read
            p = np.float64(Pm[u, t])
            for i in range(F):
                y = fk[u, i] * fa[t + 1, i]
                fk[u, i] = y
                acc[i] += p * y
        for i in range(F):
            dk[b, s0 + t, i] = acc[i]


@njit(fastmath=config.FASTMATH, cache=config.CACHE, error_model="numpy")  # 1/0 -> inf, as the forward
def normalise_row(den, gn, eps, floor, gr, g1r):
    """One row of ``g1 = [g / den' | -(g . num) / den'^2]`` from the row's normaliser ``den`` and
    ``gn = g . num`` (float64); ``den' = eps`` where ``floor`` and ``den <= eps`` (the second part then 0).

    Returns ``(r, c, fits, chk)``: ``r = 1 / den'``, ``c`` the second part, whether ``den`` and ``gn`` lie
    within the working dtype (as the forward would hold them: beyond it, the caller recomputes in float64)
    and the sum of ``g * 0`` over the row (0 while it is finite; the kernels' "reassoc" flag may sum the
    ``g`` first, so a large finite row can read as not finite, and the front end then checks ``g`` itself;
    ``x - x`` would not do, the flags fold it to 0).  For the fused normalised backwards.
    """
    wt = g1r.dtype.type
    wz = wt(0.0)
    fits = is_finite(wt(den)) and is_finite(wt(gn))
    active = True
    if floor and not den > eps:
        active = False
        den = eps
    r = 1.0 / den
    c = -gn * r * r if active else 0.0
    rw = wt(r)
    chk = wz
    M = gr.shape[0]
    for m in range(M):
        x = gr[m]
        chk += x * wz
        g1r[m] = x * rw
    g1r[M] = c
    return r, c, fits, chk


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _gate_weights(qf, kf, fa, fk, qr, Ad, b, s0, n, F):
    """``Ad[t, s] = sum_i W_ts[i] q_t[i] k_s[i]`` (s <= t) by the loops of pass 1 (keys decayed in place)."""
    for t in range(n):
        for i in range(F):
            fk[t, i] = kf[b, s0 + t, i]
            qr[i] = qf[b, s0 + t, i]
        for s in range(t + 1):
            x = 0.0
            if s < t:
                for i in range(F):
                    y = fk[s, i] * fa[t, i]
                    fk[s, i] = y
                    x += qr[i] * y
            else:
                for i in range(F):
                    x += qr[i] * fk[s, i]
            Ad[t, s] = x


@njit(fastmath=config.FASTMATH, cache=config.CACHE, error_model="numpy")  # 1/0 -> inf, as the forward
def _gate_norm_rows(qf, g, z, T, Ad, Pm, g1, fb, b, s0, n, eps, floor):
    """The gate rule's normalised outputs, rows of one chunk: from ``Ad`` (float64, the weighted ``A``,
    ``s <= t`` read), ``Pm = G V^T`` and ``T = G S^T`` (``S``, ``z`` the chunk-start state and normaliser
    sum), each row's ``den = (b_t * q_t) . z + sum_s A_ts`` and ``g . num`` (the same with ``T``, ``Pm``);
    writes ``g1``'s rows, ``Pm <- r Pm + c`` (what ``g1 [V 1]^T`` gives) and ``T <- r T + c z`` (``g1
    H^T``).  Returns ``(g_finite, results_finite)`` as the additive rule's
    (:func:`linattn_nb.ops.grad._cpu_chunked_norm._rows`)."""
    F = qf.shape[2]
    wt = Pm.dtype.type
    wz = wt(0.0)
    g_chk = wz  # sums of g * 0 (normalise_row)
    res_ok = True
    for t in range(n):
        den = 0.0
        gn = 0.0
        for s in range(t + 1):
            a = Ad[t, s]
            den += a
            gn += a * np.float64(Pm[t, s])
        for i in range(F):
            x = np.float64(qf[b, s0 + t, i]) * fb[t, i]
            den += x * z[i]
            gn += x * np.float64(T[t, i])
        r, c, fits, chk = normalise_row(den, gn, eps, floor, g[b, s0 + t], g1[b, s0 + t])
        res_ok &= fits
        g_chk += chk
        rw = wt(r)
        cw = wt(c)
        for s in range(t + 1):
            Pm[t, s] = rw * Pm[t, s] + cw
        for i in range(F):
            T[t, i] = rw * T[t, i] + c * z[i]
    return g_chk == wz, res_ok


def _chunked_backward(qf, kf, v1, H0, g1, dHN, has_dHN, rule, lg, C, ck, dq, dk, dv, dH0, dfac, proto, gout,
                      eps, floor, flags, xq, xk, mcode, logfac):
    """Two passes over the chunks of each sequence of the flattened batch (``docs/design-cpu.md``).

    qf, kf (B, N, F), v1, g1 (B, N, M') of the working dtype; H0, dHN (B, F, M')
    float64; rule the additive, decay or gate code; C the chunk size; ck (B, ceil(N /
    C), F, M') checkpoints of the working dtype ((B, 0, F, M') for the additive rule).  Every
    element of dq, dk, dv, dH0 and dfac (B, N, G') is written.

    Normalised outputs (the gate rule only): ``gout`` (B, N, M) the gradient of the outputs, from which pass 1
    writes ``g1`` chunk by chunk before it reads it (``eps``, ``floor``, ``flags`` as
    :func:`linattn_nb.ops.grad._cpu_chunked_norm._normalized_backward`'s); ``gout`` of shape (1, 0, 0):
    ``g1`` is given.  ``xq``, ``xk``, ``mcode``: the map's VJP on each chunk's complete rows of ``dq`` and
    ``dk`` and its flag, as :func:`linattn_nb.ops.grad._cpu_chunked_norm._normalized_backward`'s (normalised
    outputs only).  ``logfac``: ``dfac`` receives the gradient of the log-factors, ``a dL/da`` (each chunk's
    rows times its factors once complete, in pass 2), instead of that of the factors.
    """
    B, N, F = qf.shape
    M1 = v1.shape[2]
    wt = proto.dtype
    nch = (N + C - 1) // C
    fac = rule != RULE_ADDITIVE
    maps = xq.shape[1] > 0
    Gd = dfac.shape[2]
    for b in prange(B):
        H = np.empty((F, M1))
        H[:, :] = H0[b]
        Hw = np.empty((F, M1), wt)
        Ht = np.empty((M1, F), wt)
        part = np.empty((F, M1), wt)
        Pm = np.empty((C, C), wt)
        Am = np.empty((C, C), wt)
        T = np.empty((C, F), wt)
        Ks = np.empty((C, F), wt)
        Cf = C if fac else 1
        fa = np.ones((Cf, F))
        fb = np.ones((Cf, F))
        fe = np.ones((Cf, F))
        tot = np.ones(F)
        fk = np.empty((Cf, F))
        Z = np.empty((Cf, F))
        acc = np.empty(F)
        hr = np.empty(F)
        qr = np.empty(F)
        Cq = C if fac else 1  # the gate rule's GEMM form, float64
        Qd = np.empty((Cq, F))
        Kd = np.empty((Cq, F))
        Ib = np.empty((Cq, F))  # 1 / b
        Pd = np.empty((Cq, Cq))
        Ad = np.empty((Cq, Cq))
        X1 = np.empty((Cq, F))
        X2 = np.empty((Cq, F))
        pairs_by_gemm = qf.itemsize == 4
        norm = gout.shape[1] > 0
        M = M1 - 1
        z = np.empty(F)
        g_ok = True
        res_ok = True
        # ------------------------------------------------------------------
        # pass 1, chunks in order: H, dq, the intra-chunk parts of dk and dv
        # (and the factor gradient's two terms that need H but not R)
        # ------------------------------------------------------------------
        for c in range(nch):
            s0 = c * C
            n = min(C, N - s0)
            qo = (b * N + s0) * F
            vo = (b * N + s0) * M1
            copy_state_t(H, Ht)
            # P0 = G V^T (n x n); normalised: of g itself (M columns), g1's rows come below
            go = (b * N + s0) * M
            if norm:
                gemm(0, 1, n, n, M, 1.0, gout, go, M, v1, vo, M1, 0.0, Pm, 0, C)
            else:
                gemm(0, 1, n, n, M1, 1.0, g1, vo, M1, v1, vo, M1, 0.0, Pm, 0, C)
            if not fac:
                _mask_upper(Pm, n)
                gemm(0, 1, n, n, F, 1.0, qf, qo, F, kf, qo, F, 0.0, Am, 0, C)
                _mask_upper(Am, n)
                # dq = G H^T + P K; dk = P^T Q; dv = A^T G
                gemm(0, 0, n, F, M1, 1.0, g1, vo, M1, Ht, 0, F, 0.0, dq, qo, F)
                gemm(0, 0, n, F, n, 1.0, Pm, 0, C, kf, qo, F, 1.0, dq, qo, F)
                gemm(1, 0, n, F, n, 1.0, Pm, 0, C, qf, qo, F, 0.0, dk, qo, F)
                gemm(1, 0, n, M1, n, 1.0, Am, 0, C, g1, vo, M1, 0.0, dv, vo, M1)
                # H += K^T V
                gemm(1, 0, F, M1, n, 1.0, kf, qo, F, v1, vo, M1, 0.0, part, 0, M1)
                add_into(H, part)
                if maps:  # dq's rows are complete
                    res_ok &= map_chunk(xq, qf, dq, mcode, b, s0, n)
                continue
            copy_state(H, Hw)
            ck[b, c] = Hw  # the chunk-start state as the GEMMs read it (working dtype)
            chunk_factors_rows(rule, lg, b, s0, n, fa, fb, fe, tot)
            # T = G H^T: the chunk-start state read by each gradient row
            if norm:
                gemm(0, 0, n, F, M, 1.0, gout, go, M, Ht, 0, F, 0.0, T, 0, F)
                for i in range(F):
                    z[i] = H[i, M]
            else:
                gemm(0, 0, n, F, M1, 1.0, g1, vo, M1, Ht, 0, F, 0.0, T, 0, F)
            gemms = within(fb, n, LOG_SPACE_MIN)
            if gemms:
                # W_ts = b_t / b_s (b the running products from the chunk's start): with Qd = Q * b and
                # Kd = K / b, A = tril(Qd Kd^T), dq = b * (G H^T + tril(P) Kd) and the intra part of
                # dk = (tril(P)^T Qd) / b, float64 GEMMs
                for t in range(n):
                    for i in range(F):
                        h = fb[t, i]
                        r = 1.0 / h  # one division an element, for Kd and dk both
                        Ib[t, i] = r
                        Qd[t, i] = np.float64(qf[b, s0 + t, i]) * h
                        Kd[t, i] = np.float64(kf[b, s0 + t, i]) * r
                gemm(0, 1, n, n, F, 1.0, Qd, 0, F, Kd, 0, F, 0.0, Ad, 0, Cq)
                if norm:
                    ok_g, ok_r = _gate_norm_rows(qf, gout, z, T, Ad, Pm, g1, fb, b, s0, n, eps, floor)
                    g_ok &= ok_g
                    res_ok &= ok_r
                for t in range(n):
                    for s in range(n):
                        Pd[t, s] = np.float64(Pm[t, s]) if s <= t else 0.0
                gemm(0, 0, n, F, n, 1.0, Pd, 0, Cq, Kd, 0, F, 0.0, X1, 0, F)
                gemm(1, 0, n, F, n, 1.0, Pd, 0, Cq, Qd, 0, F, 0.0, X2, 0, F)
                for t in range(n):
                    for s in range(t + 1):
                        Am[t, s] = Ad[t, s]
                    for i in range(F):
                        h = fb[t, i]
                        dq[b, s0 + t, i] = h * (np.float64(T[t, i]) + X1[t, i])
                        dk[b, s0 + t, i] = X2[t, i] * Ib[t, i]
            else:
                if norm:
                    # the weighted A first (the loop below forms it with dq, which needs g1's rows)
                    _gate_weights(qf, kf, fa, fk, qr, Ad, b, s0, n, F)
                    ok_g, ok_r = _gate_norm_rows(qf, gout, z, T, Ad, Pm, g1, fb, b, s0, n, eps, floor)
                    g_ok &= ok_g
                    res_ok &= ok_r
                # rows in order, keys decayed in place: fk[s] = W_ts * k_s (each key decayed as it is read)
                for t in range(n):
                    for i in range(F):
                        fk[t, i] = kf[b, s0 + t, i]
                        acc[i] = fb[t, i] * T[t, i]
                        qr[i] = qf[b, s0 + t, i]
                    for s in range(t + 1):
                        p = np.float64(Pm[t, s])
                        x = 0.0
                        if s < t:
                            for i in range(F):
                                y = fk[s, i] * fa[t, i]
                                fk[s, i] = y
                                acc[i] += p * y
                                x += qr[i] * y
                        else:
                            for i in range(F):
                                y = fk[s, i]
                                acc[i] += p * y
                                x += qr[i] * y
                        Am[t, s] = x
                    for i in range(F):
                        dq[b, s0 + t, i] = acc[i]
            _mask_upper(Am, n)
            # factor gradient, b_{t-1} sum_{u >= t} W_ut q_u (G H^T)_u: a reverse running sum
            for i in range(F):
                acc[i] = 0.0
            for t in range(n - 1, -1, -1):
                for i in range(F):
                    s = np.float64(qf[b, s0 + t, i]) * T[t, i]
                    if t + 1 < n:
                        s += fa[t + 1, i] * acc[i]
                    acc[i] = s
                    Z[t, i] = s * (fb[t - 1, i] if t > 0 else 1.0)  # Z as scratch: this term per row
            for t in range(n):
                if Gd == 1:
                    x = 0.0
                    for i in range(F):
                        x += Z[t, i]
                    dfac[b, s0 + t, 0] = x
                else:
                    for i in range(F):
                        dfac[b, s0 + t, i] = Z[t, i]
            if gemms and pairs_by_gemm and within(fa, n, GATE_PAIRS_MIN):
                # factor gradient, sum_{s < t <= u} W_{t-1,s} W_ut k_s q_u P0_us = (1 / a_t) sum_{s < t <= u} E_us,
                # E_us = P0_us Qd_u Kd_s: the pairs with u >= t less those with s >= t, i.e. a reverse running
                # sum of D_u = Qd_u (tril(P) Kd)_u - Kd_u (tril(P)^T Qd)_u (the diagonal E_uu cancels)
                for i in range(F):
                    acc[i] = 0.0
                for t in range(n - 1, 0, -1):
                    x = 0.0
                    for i in range(F):
                        acc[i] += Qd[t, i] * X1[t, i] - Kd[t, i] * X2[t, i]
                        y = acc[i] / fa[t, i]
                        if Gd == 1:
                            x += y
                        else:
                            dfac[b, s0 + t, i] += y
                    if Gd == 1:
                        dfac[b, s0 + t, 0] += x
            else:
                _factor_pairs(qf, kf, Pm, fa, Z, acc, dfac, b, s0, n, F, Gd)
            if not gemms:
                _dk_loops(qf, Pm, fa, acc, fk, dk, b, s0, n, F)
            # dv (intra) = A^T G
            gemm(1, 0, n, M1, n, 1.0, Am, 0, C, g1, vo, M1, 0.0, dv, vo, M1)
            # H <- tot * H + (e * K)^T V
            for t in range(n):
                for i in range(F):
                    Ks[t, i] = fe[t, i] * kf[b, s0 + t, i]
            gemm(1, 0, F, M1, n, 1.0, Ks, 0, F, v1, vo, M1, 0.0, part, 0, M1)
            for i in range(F):
                g = tot[i]
                for m in range(M1):
                    H[i, m] = g * H[i, m] + part[i, m]
            if maps:  # dq's rows are complete
                res_ok &= map_chunk(xq, qf, dq, mcode, b, s0, n)
        # ------------------------------------------------------------------
        # pass 2, chunks in reverse: R, the inter-chunk parts of dk and dv
        # ------------------------------------------------------------------
        if norm:
            for i in range(F):
                for m in range(M1):
                    res_ok &= is_finite(H[i, m])
        R = H  # the forward state is no longer needed: reuse its storage
        start_adjoint(R, dHN, b, has_dHN)
        for c in range(nch - 1, -1, -1):
            s0 = c * C
            n = min(C, N - s0)
            qo = (b * N + s0) * F
            vo = (b * N + s0) * M1
            if not fac:
                additive_reverse_chunk(qf, kf, v1, g1, R, Hw, Ht, part, dk, dv, qo, vo, n)
                if maps:  # dk's and dv's rows are complete
                    res_ok &= map_chunk(xk, kf, dk, mcode, b, s0, n)
                    res_ok &= rows_finite(dv, b, s0, n, M1 - 1)
                continue
            copy_state(R, Hw)
            copy_state_t(R, Ht)
            chunk_factors_rows(rule, lg, b, s0, n, fa, fb, fe, tot)
            # T = V R^T (the adjoint after the chunk read by each key row)
            gemm(0, 0, n, F, M1, 1.0, v1, vo, M1, Ht, 0, F, 0.0, T, 0, F)
            for i in range(F):
                x = 0.0
                for m in range(M1):
                    x += np.float64(ck[b, c, i, m]) * R[i, m]
                hr[i] = x
                acc[i] = 0.0  # S3: sum_{s < t} W_{t-1,s} k_s (V R^T)_s
            for t in range(n):
                x = 0.0
                for i in range(F):
                    bp = fb[t - 1, i] if t > 0 else 1.0
                    y = fe[t, i] * (bp * hr[i] + acc[i])
                    if Gd == 1:
                        x += y
                    else:
                        dfac[b, s0 + t, i] += y
                    r = np.float64(T[t, i])
                    dk[b, s0 + t, i] = dk[b, s0 + t, i] + fe[t, i] * r
                    acc[i] = fa[t, i] * acc[i] + np.float64(kf[b, s0 + t, i]) * r
                if Gd == 1:
                    dfac[b, s0 + t, 0] += x
            if logfac:  # the chunk's rows of dfac are complete: d/d log a = a dL/da
                times_rows(dfac[b, s0:s0 + n], fa, n)
            # dv += (e * K) R
            for t in range(n):
                for i in range(F):
                    Ks[t, i] = fe[t, i] * kf[b, s0 + t, i]
            gemm(0, 0, n, M1, F, 1.0, Ks, 0, F, Hw, 0, M1, 1.0, dv, vo, M1)
            # R <- tot * R + (b * Q)^T G
            for t in range(n):
                for i in range(F):
                    Ks[t, i] = fb[t, i] * qf[b, s0 + t, i]
            gemm(1, 0, F, M1, n, 1.0, Ks, 0, F, g1, vo, M1, 0.0, part, 0, M1)
            for i in range(F):
                g = tot[i]
                for m in range(M1):
                    R[i, m] = g * R[i, m] + part[i, m]
            if maps:  # dk's and dv's rows are complete
                res_ok &= map_chunk(xk, kf, dk, mcode, b, s0, n)
                res_ok &= rows_finite(dv, b, s0, n, M1 - 1)
        for i in range(F):
            for m in range(M1):
                dH0[b, i, m] = R[i, m]
        if norm or maps:
            flags[b, 0] = not g_ok
            flags[b, 1] = not res_ok


chunked_backward_kernel_serial, chunked_backward_kernel = serial_and_parallel(
    _chunked_backward, fastmath=config.FASTMATH, cache=config.CACHE)
