"""The float64 reference of the DPLR recurrence: a token-by-token NumPy loop (see the package docstring)."""
from __future__ import annotations

import numpy as np

from .._codes import NORM_FLOOR, NORM_NONE


def dplr_reference(fq, ld, A, Bv, KW, VW, H0, *, norm, eps):
    """Outputs (B, N, M) and the final state (B, F, M + 1), both float64, of the general recurrence.

    ``norm``: :data:`linattn_nb.ops._codes.NORM_NONE` (numerators), ``NORM_RAW`` or ``NORM_FLOOR``
    (the normaliser floored at ``eps``).  Nothing passed in is modified.
    """
    fq, ld, A, Bv, KW, VW = (np.asarray(x, dtype=np.float64) for x in (fq, ld, A, Bv, KW, VW))
    H = np.array(H0, dtype=np.float64)
    B, N, F = fq.shape
    M = VW.shape[3]
    r, W, w = A.shape[2], ld.shape[2], KW.shape[2]
    out = np.empty((B, N, M))
    ones = np.ones((B, 1))
    for t in range(N):
        for j in range(r):
            proj = np.einsum("bi,bim->bm", A[:, t, j], H)  # a^T H, before the diagonal
            if j == 0 and W:
                H = np.exp(ld[:, t])[:, :, None] * H
            H = H + Bv[:, t, j][:, :, None] * proj[:, None, :]
            if w == r or j == r - 1:
                jj = j if w == r else 0
                H = H + KW[:, t, jj][:, :, None] * np.concatenate([VW[:, t, jj], ones], axis=1)[:, None, :]
        red = np.einsum("bi,bim->bm", fq[:, t], H)
        num, den = red[:, :M], red[:, M]
        if norm == NORM_NONE:
            out[:, t] = num
        else:
            if norm == NORM_FLOOR:
                den = np.maximum(den, eps)
            with np.errstate(divide="ignore", invalid="ignore"):
                out[:, t] = num / den[:, None]
    return out, H
