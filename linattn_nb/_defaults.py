"""The default of the ``eps`` arguments: ``config.DEFAULT_EPS``, read when a call runs, not at import."""
from __future__ import annotations


class _DefaultEps:
    """The default of an ``eps`` argument: ``config.DEFAULT_EPS``, read at call time (a state's: when it is
    built), so that assigning ``config.DEFAULT_EPS`` changes the calls that follow.

    A singleton whose repr makes signatures read ``eps=config.DEFAULT_EPS``; copy and pickle keep it.
    """

    __slots__ = ()
    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "config.DEFAULT_EPS"

    def __reduce__(self):
        return "DEFAULT_EPS"  # the module-level name: copies and unpickled values are the same object


#: Default marker of an ``eps`` argument (:func:`linattn_nb._validate.check_eps` resolves it).
DEFAULT_EPS = _DefaultEps()
