"""Device functions shared by the CUDA kernels (imported with the CUDA path only).

:func:`phi` is the elementwise feature map of :func:`linattn_nb.ops._common.phi`
on the GPU: codes 0 identity, 1 ELU+1 (``exp`` only sees negative arguments),
2 ReLU, 3 squared ReLU; NaN propagates through every branch.  ``zero`` and
``one`` carry the working type, so a float32 kernel does no float64
arithmetic (an integer literal would promote it).

It is compiled with ``inline=True``: numba-cuda inlines such a function at the
Numba IR level, so kernels that call it still compile to PTX without a GPU
(``numba.cuda.compile_ptx`` in the tests); a non-inlined device function asks
the driver for the current device's compute capability and fails there.
"""
from __future__ import annotations

import math

from numba import cuda


@cuda.jit(device=True, inline=True)
def phi(x, code, zero, one):
    if code == 1:
        return x + one if x >= zero else math.exp(x)
    if code == 2:
        return x if (x > zero or x != x) else zero
    if code == 3:
        return x * x if (x > zero or x != x) else zero
    return x
