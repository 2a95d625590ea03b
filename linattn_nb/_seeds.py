"""Random generators from the ``seed`` arguments of the public functions, with errors that name them."""
from __future__ import annotations

import numpy as np


def generator(seed, name: str = "seed") -> np.random.Generator:
    """``numpy.random.default_rng(seed)`` (a Generator passes through); an error naming ``name`` for a value
    NumPy refuses, instead of NumPy's own message, which names no argument."""
    why = (f"{name} must be None, a non-negative integer, a sequence of them or a numpy.random.Generator, "
           f"got {seed!r}")
    if isinstance(seed, (bool, np.bool_)):  # NumPy takes True as 1
        raise TypeError(why)
    try:
        return np.random.default_rng(seed)
    except (TypeError, ValueError) as exc:
        raise type(exc)(why) from None
