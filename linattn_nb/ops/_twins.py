"""One kernel body, two compiled kernels (serial and parallel), and the choice between them.

Design: ``docs/design-cpu.md``, "Serial and parallel twins".
"""
from __future__ import annotations

import types

from numba import njit

from .. import config


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


def pick(serial, parallel, *, items: int, work: int, limit, force=None):
    """The kernel of a twin pair to run: ``parallel`` only when it can pay for its region.

    ``parallel`` when ``items >= 2`` independent work items and ``work`` (multiply-adds, roughly)
    ``>= limit``: a number, or the name of a threshold of :mod:`linattn_nb.config`, read when the call is
    made (:func:`linattn_nb.config.knob_int`: TypeError or ValueError naming it); ``force`` True/False overrides.
    """
    if force is not None:
        return parallel if force else serial
    if isinstance(limit, str):
        limit = config.knob_int(limit)
    return parallel if items > 1 and work >= limit else serial
