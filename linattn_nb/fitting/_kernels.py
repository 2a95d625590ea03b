"""Numba row kernels of the fitting losses (one block of query rows against its keys), in place.

Row ``i`` of a block starting at query ``r0`` sees keys ``j < n_i`` with ``n_i = r0 + i + 1`` (causal) or
all keys; the other entries are set to 0.  Design: docs/design-cpu.md ("Fitting losses").
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .. import config


@njit(parallel=True, cache=config.CACHE)
def softmax_rows(S, r0, causal, entropy):
    """Scores -> softmax weights, in place, per row; ``entropy[i]`` = row entropy (nats).

    ``S`` is ``(rows, keys)`` float64.  The entropy is computed only when
    ``entropy`` has one entry per row (pass an empty array to skip its logs).
    """
    rows, nk = S.shape
    want_h = entropy.shape[0] == rows
    for i in prange(rows):
        n_i = min(r0 + i + 1, nk) if causal else nk
        m = -np.inf
        for j in range(n_i):
            if S[i, j] > m:
                m = S[i, j]
        total = 0.0
        for j in range(n_i):
            e = math.exp(S[i, j] - m)
            S[i, j] = e
            total += e
        inv = 1.0 / total
        h = 0.0
        for j in range(n_i):
            p = S[i, j] * inv
            S[i, j] = p
            if want_h and p > 0.0:
                h -= p * math.log(p)
        for j in range(n_i, nk):
            S[i, j] = 0.0
        if want_h:
            entropy[i] = h


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def floored_weights(A, r0, causal, floor, T, den):
    """Pass 1: row sums ``den_i`` of ``A`` and the floored weights ``T`` (their logs are taken next).

    ``T_ij = (1 - floor) max(L_ij, 0) + floor / n_i`` with ``L_ij = a_ij / den_i``, in the precision of
    ``A``; entries past a causal row's end, and rows with ``den_i <= 0``, are set to 1 (log 0).  The
    launcher takes ``log(T)`` with NumPy's vectorised ``log`` (docs/design-cpu.md, "Fitting losses").
    """
    rows, nk = A.shape
    ty = T.dtype.type
    keep = ty(1.0 - floor)
    zero = ty(0.0)
    one = ty(1.0)
    for i in prange(rows):
        n_i = min(r0 + i + 1, nk) if causal else nk
        total = 0.0
        for j in range(n_i):
            total += A[i, j]
        den[i] = total
        if total > 0.0:
            inv = ty(1.0 / total)
            base = ty(floor / n_i)
            for j in range(n_i):
                T[i, j] = keep * max(A[i, j] * inv, zero) + base
            for j in range(n_i, nk):
                T[i, j] = one
        else:
            for j in range(nk):
                T[i, j] = one


def log_floored_weights(A, r0, causal, floor, T, den):
    """:func:`floored_weights`, then ``T = log(T)`` in place (``-inf`` for a zero weight without a floor)."""
    floored_weights(A, r0, causal, floor, T, den)
    with np.errstate(divide="ignore"):
        np.log(T, out=T)


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def cross_entropy_rows(P, A, logT, den, r0, causal, floor, want_grad, loss):
    """Pass 2: the soft-label cross-entropy of each row; ``A`` becomes ``dloss_i/da_ij`` in place.

    ``loss_i = -sum_j P_ij log T_ij`` (``logT`` from :func:`log_floored_weights`, ``floor > 0``: without
    one, :func:`cross_entropy_rows_unfloored`); the gradient and the rows without weights (loss
    ``log(n_i / floor)``, zero gradient): docs/design-cpu.md, "Fitting losses".
    """
    rows, nk = A.shape
    ty = A.dtype.type  # the weights' arithmetic in their own precision; the loss sums in float64
    keep = ty(1.0 - floor)
    zero = ty(0.0)
    for i in prange(rows):
        n_i = min(r0 + i + 1, nk) if causal else nk
        d = den[i]
        ok = d > 0.0
        total = 0.0
        c = 0.0
        if ok:
            inv = ty(1.0 / d)
            base = ty(floor / n_i)
            for j in range(n_i):  # one pass: the loss, w_ij (stored in A) and c_i
                p = P[i, j]
                total -= p * logT[i, j] if p > 0.0 else 0.0  # 0 log 0 = 0 (P underflows in spiky rows)
                lw = A[i, j] * inv
                w = p / (keep * lw + base) if lw >= zero else zero
                c += w * lw
                A[i, j] = w
        if not ok:
            loss[i] = math.log(n_i / floor)
            if want_grad:
                for j in range(nk):
                    A[i, j] = zero
            continue
        loss[i] = total
        if want_grad:
            coef = -keep * inv
            cc = ty(c)
            for j in range(n_i):
                A[i, j] = coef * (A[i, j] - cc)
            for j in range(n_i, nk):
                A[i, j] = zero


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def cross_entropy_rows_unfloored(P, A, logA, r0, causal, want_grad, den, loss):
    """:func:`cross_entropy_rows` without a floor, from ``log(a_ij)`` directly (no pass for ``T``).

    ``logA`` is ``log(A)`` (entries with ``a_ij <= 0`` are never read); ``den_i`` is formed in the same
    pass.  The loss and gradient without a floor: docs/design-cpu.md, "Fitting losses".
    """
    rows, nk = A.shape
    ty = A.dtype.type
    zero = ty(0.0)
    for i in prange(rows):
        n_i = min(r0 + i + 1, nk) if causal else nk
        d = 0.0
        s = 0.0
        total = 0.0
        misses = 0
        for j in range(n_i):
            p = P[i, j]
            a = A[i, j]
            d += a
            w = zero
            if p > 0.0:
                if a > zero:
                    total -= p * logA[i, j]
                    s += p
                    w = p / a
                else:
                    misses += 1
            A[i, j] = w
        den[i] = d
        if not d > 0.0 or misses > 0:
            loss[i] = np.inf
            if want_grad:
                for j in range(nk):
                    A[i, j] = zero
            continue
        loss[i] = total + s * math.log(d)
        if want_grad:
            cc = ty(s / d)
            for j in range(n_i):
                A[i, j] = cc - A[i, j]
            for j in range(n_i, nk):
                A[i, j] = zero
