"""What the CPU launchers do with the finiteness flags their kernels raise: :func:`report` turns them
into the launcher contract's errors (docs/launchers.md).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import config
from ._vec import is_finite


def check_finite_values(name: str, x: np.ndarray, hint: str = "pass check_finite=False to skip this check") -> None:
    """Raise ValueError if ``x`` holds NaN or infinity (the count in the message, naming ``name``, then
    ``hint``: what to do, for a caller that has no ``check_finite`` switch)."""
    if x.size and not np.isfinite(x).all():
        bad = int(x.size - np.count_nonzero(np.isfinite(x)))
        raise ValueError(f"{name} contains {bad} non-finite value(s) (NaN or inf); {hint}")


#: Rows per task of :func:`_all_finite_rows`.
_ROWS = 256


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def _all_finite_rows(x):
    R, D = x.shape
    tasks = (R + _ROWS - 1) // _ROWS
    ok = np.ones(tasks, dtype=np.bool_)
    for t in prange(tasks):
        bad = np.uint8(0)  # or-ed as an integer: a boolean flag kept the loop from its vector form (measured)
        for r in range(t * _ROWS, min(R, (t + 1) * _ROWS)):
            row = x[r]
            for i in range(D):
                bad |= np.uint8(not is_finite(row[i]))
        ok[t] = bad == 0
    return ok.all()


def all_finite(x) -> bool:
    """Whether every element of ``x`` is finite: ``np.isfinite(x).all()`` in one parallel pass with no
    boolean temporary for float32/float64 arrays of two or more dimensions (strided views included: the
    VJP's ``dv`` is a column slice), NumPy's form for the others.  4M float32 elements of a strided view:
    0.6 against 1.1 ms for NumPy's, 2 cores, AMD EPYC."""
    x = np.asarray(x)
    if x.size == 0:
        return True
    if x.dtype not in (np.float32, np.float64) or x.ndim < 2:
        return bool(np.isfinite(x).all())
    return bool(_all_finite_rows(x.reshape(-1, x.shape[-1])))


class NonFiniteResult(FloatingPointError):
    """A launcher's result holds NaN or inf although its inputs are finite.

    Raised (with ``check_finite=True``) after ``out`` and ``H`` were written:
    the working dtype overflowed -- e.g. float32 products of inputs of
    magnitude 1e19 -- or, with ``eps=None``, a normaliser is exactly 0.  The
    front ends recompute a float32 overflow in float64; what they raise to
    the caller is a float64 result that is not finite (inputs of magnitude
    1e200, or a map whose features overflow float64).
    """


def new_flags(items: int) -> np.ndarray:
    """The zeroed ``flags`` array (items, 2) uint8 a kernel fills: column 0 set where an input it read held
    NaN or inf, column 1 where a result it wrote did."""
    return np.zeros((max(int(items), 0), 2), np.uint8)


def report(flags: np.ndarray, inputs, *, check_finite: bool, what: str = "the result") -> None:
    """Raise what ``flags`` says (nothing when ``check_finite`` is False): a ValueError naming the first of
    ``inputs`` that holds NaN or inf (counted by NumPy, on the error path only), or :class:`NonFiniteResult`
    for finite inputs whose results are not.  ``inputs``: ``(name, array)`` pairs in the order to report
    them, the arrays as the caller passed them (float16 as float16, not as bits).
    """
    if not check_finite or flags.size == 0:
        return
    if flags[:, 0].any():
        for name, x in inputs:
            check_finite_values(name, np.asarray(x))
        names = " or ".join(name for name, _ in inputs)
        raise ValueError(f"{names} contains non-finite values (NaN or inf); "
                         "pass check_finite=False to skip this check")
    if flags[:, 1].any():
        raise NonFiniteResult(f"{what} holds NaN or inf although the inputs are finite: the working dtype "
                              "overflowed (or a normaliser is 0 with eps=None)")

