"""Feature maps phi for kernel-based linear attention, and their registry (see ``_base``).

Transitional: the single-file module, moved to ``_base.py`` unchanged but for its
relative imports, re-exported whole; the next commit cuts it into modules.
"""
from . import _base

globals().update({k: v for k, v in vars(_base).items() if not k.startswith("__")})
__doc__ = _base.__doc__
__all__ = _base.__all__
