"""One kernel body, two compiled kernels (serial and parallel), and the choice between them.

Entering a Numba parallel region costs little on a quiet machine and up to
milliseconds on a loaded one (it waits for every thread, and a late thread
can cost a scheduler time slice; docs/measurements-cpu.md), more than the
whole work of a short call, so the launchers run small problems on the
calling thread.  Numba's ``parallel`` option belongs to a dispatcher, not a
call, so each such kernel is compiled twice.  :func:`serial_and_parallel`
does that from one Python function whose loops over independent items use
``prange`` (a plain ``range`` when compiled without ``parallel``), instead of
two hand-kept copies of the body; :func:`pick` is the one rule by which every
CPU launcher chooses between the two (its thresholds live in
:mod:`linattn_nb.config`).

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


def pick(serial, parallel, *, items: int, work: int, limit: int, force=None):
    """The kernel of a twin pair to run: ``parallel`` only when it can pay for its region.

    Parameters
    ----------
    serial, parallel
        The pair from :func:`serial_and_parallel`.
    items : int
        Independent work items the parallel kernel would share out (batch
        entries, segments, query blocks).
    work : int
        The call's work in the launcher's own unit (multiply-adds, roughly).
    limit : int
        The least ``work`` worth a parallel region: the launcher's threshold
        from :mod:`linattn_nb.config`, read at call time.
    force : bool, optional
        True: always ``parallel``; False: always ``serial``; None (default):
        ``parallel`` when ``items >= 2`` and ``work >= limit``.
    """
    if force is not None:
        return parallel if force else serial
    return parallel if items > 1 and work >= limit else serial
