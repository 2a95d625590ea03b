"""The elementwise feature maps of the CPU kernels, defined once.

:func:`phi` is the map every CPU kernel applies to ``q`` and ``k`` when it is
given raw inputs (``code`` > 0): the blocked kernels (through
:mod:`linattn_nb.ops._blocks`), the per-token scan, the decode-step kernels
(:mod:`linattn_nb.ops.step.cpu`) and the analysis kernels.  It is built from
the vectorisable scalar forms of :mod:`linattn_nb.ops._vec` (a branch-free
``exp`` for ELU+1), so a loop that calls it compiles to SIMD code.

Note on the on-disk cache: Numba keys a cached kernel on the source file of
the kernel itself, so an edit here is not seen by kernels cached from other
modules.  After changing this file, clear the ``__pycache__`` folders (or set
``LINATTN_NO_CACHE=1``).
"""
from __future__ import annotations

from numba import njit

from .. import config
from ._codes import KERNEL_CODE_ELU, KERNEL_CODE_RELU, KERNEL_CODE_SQUARED_RELU
from ._vec import elu1, relu, relu2


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def phi(x, code):
    """Feature map ``code`` (:mod:`linattn_nb.ops._codes`) on one element, in ``x``'s own dtype.

    ``KERNEL_CODE_ELU``: ELU+1 (overflow-safe, see :func:`linattn_nb.ops._vec.elu1`);
    ``KERNEL_CODE_RELU``: ReLU; ``KERNEL_CODE_SQUARED_RELU``: squared ReLU;
    anything else (``KERNEL_CODE_NONE``): the identity.  NaN propagates
    through every branch.  The branch on ``code`` is loop-invariant in the
    callers' loops, so LLVM takes it out of the loop and each map's loop
    still vectorises.
    """
    if code == KERNEL_CODE_ELU:
        return elu1(x)
    if code == KERNEL_CODE_RELU:
        return relu(x)
    if code == KERNEL_CODE_SQUARED_RELU:
        return relu2(x)
    return x
