"""Sweep functions for tests/studies/test_sweep.py.

They live in an importable module (not in the test file) so that spawned
pool workers and Dask worker processes can import them by name.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np


def square(x):
    return {"y": x * x}


def attention_point(n, method, causal, seed):
    """A deterministic numerical result: the same on every backend, bit for bit."""
    from linattn_nb import linear_attention

    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((3, n, 8)) for _ in range(3))
    import numba

    out = linear_attention(q, k, v, causal=causal, method=method)
    return {"sum": float(out.sum()), "row0": out[0, 0], "norm": float(np.linalg.norm(out)),
            "threads": numba.get_num_threads(), "env": os.environ.get("NUMBA_NUM_THREADS")}


def kill_once(x, marker, delay=0.0):
    """SIGKILL the worker process running point x == 3, the first time only."""
    time.sleep(delay)
    if x == 3 and not os.path.exists(marker):
        with open(marker, "w"):
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    return {"y": x * 10, "pid": os.getpid()}


def kill_always(x):
    if x == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"y": x}


def numba_threads(x):
    import numba

    return {"threads": numba.get_num_threads(), "env": os.environ.get("NUMBA_NUM_THREADS"),
            "pool": int(numba.config.NUMBA_NUM_THREADS)}


def slow(x, delay):
    time.sleep(delay)
    return {"y": x}


class TwoArgError(Exception):
    """An exception that pickles but cannot be rebuilt: unpickling calls ``TwoArgError(message)``."""

    def __init__(self, code, detail):
        super().__init__(f"code {code}: {detail}")
        self.code = code
        self.detail = detail


def raise_two_arg(x, log):
    """Append x to the file ``log`` (one line per call), then raise TwoArgError for x == 1."""
    with open(log, "a") as fh:
        fh.write(f"{x}\n")
    if x == 1:
        raise TwoArgError(x, "cannot be rebuilt")
    return {"y": x}


def swallowed_ctrl_c(x):
    """Point x == 1 receives a SIGINT whose KeyboardInterrupt is swallowed where
    it lands, as a ``__del__`` or an llvmlite ctypes callback swallows it."""
    if x == 1:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler runs here (the main thread) and raises
        except KeyboardInterrupt:
            pass
    return {"y": x}
