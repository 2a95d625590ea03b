"""One kernel body, two compiled kernels: serial and parallel.

Entering a Numba parallel region costs little on a quiet machine and
milliseconds on a loaded one (measured here under load with the OpenMP layer:
16-20 ms, against 0.1 ms of work for a short call), so the launchers run small
problems on the calling thread.  Numba's ``parallel`` option belongs to a
dispatcher, not a call, so each such kernel is compiled twice.
:func:`serial_and_parallel` does that from one Python function whose loops
over independent items use ``prange`` (a plain ``range`` when compiled
without ``parallel``), instead of two hand-kept copies of the body.

Each copy gets its own ``__qualname__`` (``<name>_serial`` /
``<name>_parallel``): Numba names on-disk cache files after the qualified
name and keys the entries on the signature only, so two dispatchers made
from one function under one name would load each other's machine code.
"""
from __future__ import annotations

import types

from numba import njit


def _copy(fn, suffix: str):
    g = types.FunctionType(fn.__code__, fn.__globals__, f"{fn.__name__}_{suffix}", fn.__defaults__,
                           fn.__closure__)
    g.__qualname__ = f"{fn.__qualname__}_{suffix}"
    g.__module__ = fn.__module__
    g.__doc__ = fn.__doc__
    g.__kwdefaults__ = fn.__kwdefaults__
    return g


def serial_and_parallel(fn=None, **options):
    """``(serial, parallel)`` Numba dispatchers compiled from ``fn`` with ``options``.

    Usable as a plain call, ``serial, parallel = serial_and_parallel(body,
    cache=True)``.  ``options`` are passed to :func:`numba.njit` for both;
    ``parallel`` must not be among them.
    """
    if "parallel" in options:
        raise TypeError("serial_and_parallel sets 'parallel' itself")
    return njit(**options)(_copy(fn, "serial")), njit(parallel=True, **options)(_copy(fn, "parallel"))
