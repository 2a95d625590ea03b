"""The gradient of ``[num | den]`` from that of the normalised output, in one parallel pass.

For the gradient front end (:func:`linattn_nb._gradfront.backward`): per row, in float64,
``g / den'`` and ``-(g . num) / den'^2`` (0 where the ``eps`` floor is active), written in the
working dtype; NumPy's several passes and float64 temporaries over (B, N, M) arrays were a
tenth of an additive-rule VJP.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ... import config

#: Rows per task of the parallel loop.
_ROWS = 64

#: dtypes of ``g`` and ``nd`` the kernel takes (others: the caller's NumPy form).
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@njit(parallel=True, fastmath=False, error_model="numpy", cache=config.CACHE)
def _kernel(g, nd, g1, eps, floor):
    R, M = g.shape
    tasks = (R + _ROWS - 1) // _ROWS
    for t in prange(tasks):
        for r in range(t * _ROWS, min(R, (t + 1) * _ROWS)):
            den = np.float64(nd[r, M])
            active = True
            if floor and not den > eps:
                active = False
                den = eps
            inv = 1.0 / den
            dot = 0.0
            for i in range(M):
                x = np.float64(g[r, i])
                dot += x * np.float64(nd[r, i])
                g1[r, i] = x * inv
            g1[r, M] = -dot * inv * inv if active else 0.0


def output_gradient(g, nd, eps, out):
    """Write ``dL/d[num | den]`` (R, M + 1) into ``out`` from ``g = dL/dout`` (R, M) and ``nd = [num | den]``
    (R, M + 1); ``eps`` None: no floor.  ``g`` and ``nd`` float32 or float64 (see :data:`DTYPES`)."""
    if g.shape[0]:
        floor = eps is not None
        _kernel(g, nd, out, float(eps) if floor else 0.0, floor)
    return out
