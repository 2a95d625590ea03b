"""What the CPU launchers do with the finiteness flags their kernels raise: :func:`report` turns them
into the launcher contract's errors (docs/launchers.md).
"""
from __future__ import annotations

import numpy as np


def check_finite_values(name: str, x: np.ndarray) -> None:
    """Raise ValueError if ``x`` holds NaN or infinity (the count in the message, naming ``name``)."""
    if x.size and not np.isfinite(x).all():
        bad = int(x.size - np.count_nonzero(np.isfinite(x)))
        raise ValueError(
            f"{name} contains {bad} non-finite value(s) (NaN or inf); "
            "pass check_finite=False to skip this check"
        )


class NonFiniteResult(FloatingPointError):
    """A launcher's result holds NaN or inf although its inputs are finite.

    Raised (with ``check_finite=True``) after ``out`` and ``H`` were written:
    the working dtype overflowed -- e.g. float32 products of inputs of
    magnitude 1e19 -- or, with ``eps=None``, a normaliser is exactly 0.
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

