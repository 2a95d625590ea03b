"""A helper shared by the state-file tests (test_state.py, test_state_decay.py, test_mutation_catches.py)."""
from __future__ import annotations

import numpy as np


def rewrite_state_file(src, dst, **changes):
    """Copy the state file ``src`` to ``dst`` with entries replaced (``None``: removed)."""
    with np.load(src, allow_pickle=False) as npz:
        data = {k: npz[k] for k in npz.files}
    for key, val in changes.items():
        if val is None:
            data.pop(key)
        else:
            data[key] = val
    np.savez(dst, **data)
