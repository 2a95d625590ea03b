"""Backward launchers: the vector-Jacobian products of the sequence methods.

The backward launcher contract: ``docs/launchers.md``, "Backward launchers".
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np


class Grads(NamedTuple):
    """What a backward launcher returns (``docs/launchers.md``, "Backward launchers")."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dH0: np.ndarray
    dfactor: Optional[np.ndarray] = None
    dbeta: Optional[np.ndarray] = None
