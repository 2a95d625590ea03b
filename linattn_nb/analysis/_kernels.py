"""Numba row-block kernels of :mod:`linattn_nb.analysis.error`.

:func:`error_rows_kernel` reduces blocks of query rows to per-row statistics, parallel over (batch entry,
query block), never forming the N x N matrix; Spearman ranks come from an LSD radix sort.  Design:
docs/design-cpu.md ("Row statistics of approximation_error").
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .. import config
from .._blas import single_threaded_blas
from ..rules import get_rule

_RADIX_BITS = 8
_RADIX_PASSES = 8          # 8 * 8 = 64 bits
_RADIX_SIZE = 1 << _RADIX_BITS
#: Rows shorter than this are ordered by insertion sort.
_RADIX_MIN = 24
_LN2 = math.log(2.0)
#: How :func:`error_rows_kernel` forms a row's linear weights (its ``rule`` argument): plain
#: ``phi(q) . phi(k)``, times running products of scalar factors or of per-feature factors, or given
#: explicitly (the rules whose update reads the state).
_MODE_PLAIN, _MODE_SCALAR, _MODE_FEATURE, _MODE_EXPLICIT = 0, 1, 2, 3


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _radix_order(vals, n, keys, keys2, idx, idx2, counts):
    """Order (argsort) of ``vals[:n]`` into ``idx[:n]`` or ``idx2[:n]``; returns the one used.

    ``vals`` is float64 without NaN; ``-0.0`` and ``0.0`` get the same key.
    """
    bits = vals.view(np.uint64)
    sign = np.uint64(1) << np.uint64(63)
    mask = np.uint64(_RADIX_SIZE - 1)
    one = np.uint64(1)
    for i in range(n):
        b = bits[i]
        if (b << one) == np.uint64(0):
            b = np.uint64(0)  # -0.0 sorts with +0.0 (integer test: immune to fastmath nsz)
        if b & sign:
            keys[i] = ~b
        else:
            keys[i] = b | sign
        idx[i] = i
    counts[:, :] = 0
    for i in range(n):
        kk = keys[i]
        for p in range(_RADIX_PASSES):
            counts[p, np.int64((kk >> np.uint64(p * _RADIX_BITS)) & mask)] += 1
    src_k = keys
    dst_k = keys2
    src_i = idx
    dst_i = idx2
    for p in range(_RADIX_PASSES):
        shift = np.uint64(p * _RADIX_BITS)
        if counts[p, np.int64((src_k[0] >> shift) & mask)] == n:
            continue  # every key has the same digit: nothing moves
        tot = 0
        for d in range(_RADIX_SIZE):
            c = counts[p, d]
            counts[p, d] = tot
            tot += c
        for i in range(n):
            kk = src_k[i]
            d = np.int64((kk >> shift) & mask)
            pos = counts[p, d]
            counts[p, d] = pos + 1
            dst_k[pos] = kk
            dst_i[pos] = src_i[i]
        src_k, dst_k = dst_k, src_k
        src_i, dst_i = dst_i, src_i
    return src_i


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _average_ranks(x, n, vals, keys, keys2, idx, idx2, counts, ranks):
    """0-based ranks of ``x[:n]`` into ``ranks[:n]``, ties averaged (as scipy.stats.rankdata - 1)."""
    for i in range(n):
        vals[i] = x[i]
    if n >= _RADIX_MIN:
        order = _radix_order(vals, n, keys, keys2, idx, idx2, counts)
    else:
        order = idx
        for i in range(n):
            v = vals[i]
            j = i
            while j > 0 and vals[order[j - 1]] > v:
                order[j] = order[j - 1]
                j -= 1
            order[j] = i
    i = 0
    while i < n:
        j = i
        vi = vals[order[i]]
        while j + 1 < n and vals[order[j + 1]] == vi:
            j += 1
        r = 0.5 * (i + j)
        for t in range(i, j + 1):
            ranks[order[t]] = r
        i = j + 1


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _pearson_ranks(ra, rb, n):
    """Pearson correlation of two rank vectors (mean (n-1)/2 each); NaN if one is constant."""
    mu = 0.5 * (n - 1)
    sab = 0.0
    saa = 0.0
    sbb = 0.0
    for i in range(n):
        da = ra[i] - mu
        db = rb[i] - mu
        sab += da * db
        saa += da * da
        sbb += db * db
    if saa == 0.0 or sbb == 0.0:
        return np.nan
    return sab / math.sqrt(saa * sbb)


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def error_rows_kernel(q, k, fq, fk, scale, causal, softmax_mode, eps, clip, block, mode, fac,
                      kl, tv, hp, hw, rho, den_out, js):
    """Per-row statistics of linear against softmax attention weights.

    Writes per row (B, N) ``kl``, ``tv``, entropies ``hp``/``hw``, Spearman ``rho``, the raw normaliser
    ``den_out`` and ``js``; linear weights ``a_ij / max(den_i, eps)`` with ``clip``, else ``a_ij / den_i``
    (features ignored in ``softmax_mode``).  ``mode``/``fac``: plain, per-token factors (B, N, 1 or F)
    as running products, or (B, N, N) explicit unnormalised weights (docs/design-cpu.md).
    """
    B, N, D = q.shape
    nb = (N + block - 1) // block
    ntask = B * nb
    for task in prange(ntask):
        b = task // nb
        r = task % nb
        # Interleave cheap and expensive causal blocks across threads.
        if r % 2 == 0:
            qb = r // 2
        else:
            qb = nb - 1 - r // 2
        i0 = qb * block
        i1 = min(N, i0 + block)
        kend = i1 if causal else N
        if scale == 0.0:
            s = np.dot(q[b, i0:i1], k[b, :kend].T)  # q . k for the ranks; every softmax score is 0
        else:
            s = np.dot(q[b, i0:i1] * scale, k[b, :kend].T)  # q scaled first, as softmax's kernels do
        if softmax_mode:
            a = s
        elif mode == _MODE_EXPLICIT:
            a = fac[b, i0:i1, :kend].copy()
        else:
            a = np.dot(fq[b, i0:i1], fk[b, :kend].T)
            if mode == _MODE_SCALAR:
                for t in range(i1 - i0):
                    g = 1.0
                    for j in range(i0 + t, -1, -1):
                        a[t, j] *= g
                        g *= fac[b, j, 0]
            elif mode == _MODE_FEATURE:
                F = fq.shape[2]
                g = np.empty(F)
                for t in range(i1 - i0):
                    i = i0 + t
                    for f in range(F):
                        g[f] = 1.0
                    for j in range(i, -1, -1):
                        acc = 0.0
                        for f in range(F):
                            acc += fq[b, i, f] * g[f] * fk[b, j, f]
                        a[t, j] = acc
                        for f in range(F):
                            g[f] *= fac[b, j, f]
        p = np.empty(kend)
        lp = np.empty(kend)
        w = np.empty(kend)
        vals = np.empty(kend)
        keys = np.empty(kend, dtype=np.uint64)
        keys2 = np.empty(kend, dtype=np.uint64)
        idx = np.empty(kend, dtype=np.int64)
        idx2 = np.empty(kend, dtype=np.int64)
        counts = np.empty((_RADIX_PASSES, _RADIX_SIZE), dtype=np.int64)
        rs = np.empty(kend)
        rq = np.empty(kend)
        rw = np.empty(kend)
        scored = scale != 0.0  # else s holds q . k for the ranks only: every softmax score is 0
        for t in range(i1 - i0):
            i = i0 + t
            L = i + 1 if causal else N
            # softmax weights of row i
            mx = -np.inf
            for j in range(L):
                sj = s[t, j] if scored else 0.0
                if sj > mx:
                    mx = sj
            z = 0.0
            for j in range(L):
                sj = s[t, j] if scored else 0.0
                e = math.exp(sj - mx)
                p[j] = e
                z += e
            logz = math.log(z)
            inv = 1.0 / z
            h = 0.0
            for j in range(L):
                sj = s[t, j] if scored else 0.0
                lpj = sj - mx - logz
                lp[j] = lpj
                pj = p[j] * inv
                p[j] = pj
                if pj > 0.0:
                    h -= pj * lpj
            hp[b, i] = h
            if softmax_mode:
                den_out[b, i] = 1.0
                kl_i = 0.0
                tv_i = 0.0
                for j in range(L):
                    w[j] = p[j]
                    if p[j] > 0.0:
                        kl_i += p[j] * (lp[j] - lp[j])
                    tv_i += abs(p[j] - w[j])
                kl[b, i] = kl_i
                tv[b, i] = 0.5 * tv_i
                hw[b, i] = h
                js[b, i] = 0.0
            else:
                den = 0.0
                amin = np.inf
                for j in range(L):
                    aj = a[t, j]
                    den += aj
                    if aj < amin:
                        amin = aj
                den_out[b, i] = den
                if not clip and den == 0.0:
                    kl[b, i] = np.inf
                    tv[b, i] = np.inf
                    hw[b, i] = np.nan
                    rho[b, i] = np.nan
                    js[b, i] = np.nan
                    continue
                dd = den
                if clip and dd < eps:
                    dd = eps
                invd = 1.0 / dd
                tv_i = 0.0
                for j in range(L):
                    wj = a[t, j] * invd
                    w[j] = wj
                    tv_i += abs(p[j] - wj)
                tv[b, i] = 0.5 * tv_i
                # a distribution: no negative weight, and a normaliser > 0 that the floor leaves alone
                if den > 0.0 and amin >= 0.0 and not (clip and den < eps):
                    kl_i = 0.0
                    hw_i = 0.0
                    js_i = 0.0
                    for j in range(L):
                        wj = w[j]
                        pj = p[j]
                        if wj > 0.0:
                            lw = math.log(wj)
                            hw_i -= wj * lw
                            lm = math.log(0.5 * (pj + wj))
                            js_i += wj * (lw - lm)
                            if pj > 0.0:
                                kl_i += pj * (lp[j] - lw)
                                js_i += pj * (lp[j] - lm)
                        elif pj > 0.0:
                            kl_i = np.inf
                            js_i += pj * _LN2  # the mixture is p/2 there
                    if kl_i < 0.0:
                        kl_i = 0.0  # >= 0 in exact arithmetic: clip the round-off
                    js_i *= 0.5
                    if js_i < 0.0:
                        js_i = 0.0
                    kl[b, i] = kl_i
                    hw[b, i] = hw_i
                    js[b, i] = js_i
                elif den > 0.0 and amin >= 0.0:
                    # floored (den < eps): the weights sum to den / eps < 1, no distribution, but the KL
                    # of the weights linear attention applies is still defined
                    kl_i = 0.0
                    for j in range(L):
                        pj = p[j]
                        if pj > 0.0:
                            if w[j] > 0.0:
                                kl_i += pj * (lp[j] - math.log(w[j]))
                            else:
                                kl_i = np.inf
                    kl[b, i] = kl_i if kl_i > 0.0 else 0.0
                    hw[b, i] = np.nan
                    js[b, i] = np.nan
                else:
                    kl[b, i] = np.inf
                    hw[b, i] = np.nan
                    js[b, i] = np.nan
            # Spearman correlation between q . k (unscaled) and the weights
            if L < 2:
                rho[b, i] = np.nan
            else:
                # ranks of s: those of q . k for scale > 0 (and scale == 0, where s is q . k), reversed for
                # scale < 0 (average ranks of -x are L - 1 minus those of x)
                _average_ranks(s[t], L, vals, keys, keys2, idx, idx2, counts, rs)
                for j in range(L):
                    rq[j] = rs[j] if scale >= 0.0 else (L - 1) - rs[j]
                if softmax_mode:
                    # exp is increasing: softmax's ranks are the scaled scores' (the float64 weights would
                    # tie every score whose exp underflows to 0); scale == 0: equal weights, no correlation
                    rho[b, i] = np.nan if scale == 0.0 else _pearson_ranks(rq, rs, L)
                else:
                    _average_ranks(w, L, vals, keys, keys2, idx, idx2, counts, rw)
                    rho[b, i] = _pearson_ranks(rq, rw, L)


def error_rows(q, k, fq, fk, *, scale, causal, softmax_mode, eps, rule, inputs, block=None):
    """Launcher of :func:`error_rows_kernel`; returns the per-row arrays (each (B, N) float64).

    ``q, k`` (B, N, D) and ``fq, fk`` (B, N, F) C-contiguous float64 (``(B, N, 0)`` dummies in softmax
    mode); ``rule`` and ``inputs`` as the front end gives them (causal only).  The delta rules' weights are
    formed explicitly, one ``N x N`` matrix per batch entry at a time, the kernel run on each in turn.  A row
    whose normaliser is not finite (a product ``phi(q) . phi(k)`` overflowed: NaN or inf weights) has every
    statistic but ``hp`` and ``den`` NaN.
    """
    block = int(config.ANALYSIS_BLOCK_Q if block is None else block)
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    B, N, _ = q.shape
    outs = [np.full((B, N), np.nan) for _ in range(7)]
    r = get_rule(rule)
    lg = r.log_factor_of(inputs)
    if r.reads_state:  # no running-product form: the explicit weights
        mode = _MODE_EXPLICIT
    elif lg is None:
        mode, fac = _MODE_PLAIN, np.ones((1, 1, 1))
    elif lg.ndim == 2:
        mode, fac = _MODE_SCALAR, np.exp(lg)[:, :, None]
    else:
        mode, fac = _MODE_FEATURE, np.exp(lg)
    if mode != _MODE_PLAIN and not causal:
        raise ValueError("a decay or gate applies to causal attention only")
    if B and N:
        clip = eps is not None
        args = (float(scale), bool(causal), bool(softmax_mode), float(eps if clip else 0.0), clip, np.int64(block),
                np.int64(mode))
        with single_threaded_blas():
            if mode == _MODE_EXPLICIT:
                from ..ops.causal.naive import explicit_weights

                for b in range(B):
                    w = explicit_weights(r.code, fq[b], fk[b], inputs, b)[0]
                    error_rows_kernel(q[b:b + 1], k[b:b + 1], fq[b:b + 1], fk[b:b + 1], *args,
                                      np.ascontiguousarray(w[None], dtype=np.float64), *(o[b:b + 1] for o in outs))
            else:
                error_rows_kernel(q, k, fq, fk, *args, np.ascontiguousarray(fac, dtype=np.float64), *outs)
    st = dict(zip(("kl", "tv", "hp", "hw", "rho", "den", "js"), outs))
    if not softmax_mode:
        undefined = ~np.isfinite(st["den"])  # a product overflowed: NaN or inf weights, every statistic NaN
        if undefined.any():
            for key in ("kl", "tv", "hw", "rho", "js"):
                st[key][undefined] = np.nan
    return st
