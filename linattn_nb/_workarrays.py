"""Per-thread work arrays: one array per role, kept for the thread's next call of the same shape.

Fresh pages of large arrays cost the kernel's clearing on first touch, a sixth to a third of some
calls (docs/guide/configuration.md, ``DPLR_WORK_BYTES`` and ``GRAD_WORK_BYTES``).  A caller keeps its
own :class:`threading.local` and asks for arrays that it reads or writes but never returns.
"""
from __future__ import annotations

import numpy as np


def thread_array(local, role, shape, dtype, limit):
    """An empty array for ``role`` from ``local`` (a :class:`threading.local`), reused by this thread's next
    request of the same shape and dtype; fresh (and not kept) above ``limit`` bytes or with ``limit`` 0."""
    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize > limit:
        return np.empty(shape, dtype)
    pool = local.__dict__.setdefault("pool", {})
    a = pool.get(role)
    if a is None or a.shape != shape or a.dtype != dtype:
        pool.pop(role, None)  # the old one freed before the new one is made
        a = pool[role] = np.empty(shape, dtype)
    return a
