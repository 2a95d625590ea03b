"""Small Numba helpers shared by the CPU kernels.

Note on the on-disk cache: Numba keys a cached kernel on the source file of
the kernel itself, so an edit here is not seen by kernels cached from other
modules.  After changing this file, clear the ``__pycache__`` folders (or set
``LINATTN_NO_CACHE=1``).
"""
from __future__ import annotations

import math

from numba import njit

from .. import config


@njit(inline="always", fastmath=config.FASTMATH, cache=config.CACHE)
def phi(x, code):
    """Elementwise feature map selected by ``code`` (see feature_maps.KERNEL_CODE_*).

    0: identity (inputs already are features); 1: ELU+1 (overflow-safe);
    2: ReLU; 3: squared ReLU.  NaN propagates through every branch.  The
    result may be wider than ``x`` (Numba's int-literal promotion); callers
    store it straight into a scratch array of the working dtype.
    """
    if code == 1:
        if x >= 0:
            return x + 1
        return math.exp(x)  # x < 0 here (or NaN): no overflow
    if code == 2:
        if x > 0 or x != x:  # positive, or NaN (propagates)
            return x
        return 0.0
    if code == 3:
        if x > 0 or x != x:
            return x * x
        return 0.0
    return x
