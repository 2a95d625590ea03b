"""Numba CPU kernel of causal linear attention: the per-token scan.

Kernel: :func:`causal_scan_kernel`; launcher: :func:`causal_scan`.  The state
``S`` (F x M) and ``z`` (F) are carried in the dtype of the state arrays the
launcher passes (float64 by default), so float32 inputs do not lose accuracy
over long sequences.  float16 inputs are passed as ``uint16`` bits and
converted per element (no full-size float32 copy); the output is rounded to
float16 (from the float64 result, through float32).  Token ``t`` updates the state first and then reads it
(prefix states include token t; Katharopoulos et al. 2020, Eqs. 18-19).
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ... import config
from .._common import phi
from .._twins import serial_and_parallel
from .._vec import as_kernel_array, put3, to_work


def _scan(q, k, v, S, z, out, code, eps, clip):
    """Per-token recurrence over each sequence of the flattened batch (axis 0).

    q, k : (B, N, F) inputs (``code`` > 0: raw, the map is applied inline;
    code 0: already features).  v : (B, N, M).  S : (B, F, M), z : (B, F):
    the initial state on entry, the final state on return.  out : (B, N, M).
    ``clip``: floor the normaliser at ``eps``; else divide raw.  Compiled
    twice (:mod:`linattn_nb.ops._twins`): :data:`causal_scan_kernel`, parallel
    over the batch, and :data:`causal_scan_kernel_serial` for small problems.
    """
    B, N, F = q.shape
    M = v.shape[2]
    for b in prange(B):
        Sb = S[b]
        zb = z[b]
        fq = np.empty(F, dtype=S.dtype)
        fk = np.empty(F, dtype=S.dtype)
        num = np.empty(M, dtype=S.dtype)
        vrow = np.empty(M, dtype=S.dtype)
        for t in range(N):
            for m in range(M):
                vrow[m] = to_work(v[b, t, m])
            for i in range(F):
                fq[i] = phi(to_work(q[b, t, i]), code)
                fk[i] = phi(to_work(k[b, t, i]), code)
            num[:] = 0.0
            den = 0.0
            for i in range(F):
                a = fk[i]
                c = fq[i]
                zb[i] += a
                den += c * zb[i]
                for m in range(M):
                    s = Sb[i, m] + a * vrow[m]
                    Sb[i, m] = s
                    num[m] += c * s
            if clip and den < eps:
                den = eps
            for m in range(M):
                put3(out, b, t, m, num[m] / den)


# error_model="numpy": raw division (eps=None) by a zero normaliser gives inf
# or NaN, as in every other kernel, not ZeroDivisionError
causal_scan_kernel_serial, causal_scan_kernel = serial_and_parallel(_scan, fastmath=config.FASTMATH,
                                                                    cache=config.CACHE, error_model="numpy")


def causal_scan(q, k, v, S, z, out, *, code, eps):
    """Launcher: q, k (B, N, F); v (B, N, M); state S, z updated in place; writes out."""
    clip = eps is not None
    q, k, v, o = (as_kernel_array(x) for x in (q, k, v, out))  # float16: uint16 bits, converted per element
    B, N, F = q.shape
    small = B == 1 or B * N * F * v.shape[2] < int(config.CPU_CHUNKED_SERIAL_MAX_WORK)
    kernel = causal_scan_kernel_serial if small else causal_scan_kernel
    kernel(q, k, v, S, z, o, np.int64(code), float(eps if clip else 0.0), clip)
    return out
