"""Ctrl-C during a long study run that is never lost.

Python turns SIGINT into a ``KeyboardInterrupt`` in whatever Python code runs
next.  When that code is a destructor (``__del__``), a ctypes callback (LLVM
calling back into llvmlite while Numba compiles) or a ``weakref`` callback,
the exception is printed ("Exception ignored in ...") and dropped, and the
run goes on as if nothing had happened.  ``interrupts()`` remembers the signal
as well: the sweep checks between points and the report between studies, and
leaving the block raises the interrupt if nothing else did.
"""
from __future__ import annotations

import contextlib
import signal
import threading

_pending = False


def _on_sigint(signum, frame):
    global _pending
    _pending = True
    raise KeyboardInterrupt


def check() -> None:
    """Raise ``KeyboardInterrupt`` if a Ctrl-C arrived inside ``interrupts()``
    and was swallowed where it was first raised."""
    if _pending:
        raise KeyboardInterrupt


def active() -> bool:
    """True inside an ``interrupts()`` block of this thread's process (the main thread's handler
    is this module's): an interrupted unit of work should then let ``KeyboardInterrupt`` through
    to the block's owner (a sweep records no point for it) rather than return a partial result."""
    return (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is _on_sigint)


@contextlib.contextmanager
def interrupts():
    """Within: SIGINT raises ``KeyboardInterrupt`` as usual, and is remembered.

    Only Python's own handler is replaced (a handler the caller installed, or
    an ignored SIGINT, is left alone), only in the main thread; nested blocks
    leave the outer one in charge.  A block that ends normally after a
    swallowed interrupt raises it on the way out.
    """
    global _pending
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    _pending = False
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
        check()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _pending = False
