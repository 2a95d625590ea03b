"""Ctrl-C during a long study run that is never lost (:func:`interrupts`).

The signal is remembered as well as raised, and inside llvmlite it is sent again :data:`RETRY_S`
seconds later instead of raised; why: docs/frontend.md, "Ctrl-C during a long run".
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

_pending = False
_timer = None
#: Seconds after which a SIGINT that arrived inside llvmlite is sent again.
RETRY_S = 0.05


def _in_llvmlite(frame) -> bool:
    while frame is not None:
        if "llvmlite" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _resend() -> None:
    if signal.getsignal(signal.SIGINT) is _on_sigint:  # the block has not ended meanwhile
        os.kill(os.getpid(), signal.SIGINT)


def _on_sigint(signum, frame):
    global _pending, _timer
    _pending = True
    if _in_llvmlite(frame):
        _timer = threading.Timer(RETRY_S, _resend)
        _timer.daemon = True
        _timer.start()
        return
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
        if _timer is not None:
            _timer.cancel()
        _pending = False
