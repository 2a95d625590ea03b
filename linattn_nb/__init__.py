"""linattn_nb: Numba-accelerated kernel-based linear attention.

The functions ``linear_attention`` (and its gradients ``linear_attention_vjp``), ``softmax_attention``
and ``dplr_attention``; the decoding objects ``LinearAttentionState``, ``KVCache`` and ``DPLRState``;
the modules ``feature_maps``, ``rules``, ``fitting`` and ``config`` (guide: docs/guide/); the error
``NonFiniteResult`` (finite inputs whose results overflow a dtype).  Nothing is
compiled at import: each kernel compiles on first use and is cached on disk, outside the package.
"""
from ._version import __version__  # noqa: E402

# First: Numba picks a kernel's cache folder when the kernel is decorated.
from . import _cache, config  # noqa: E402

_cache.install(__version__)

from . import feature_maps, rules  # noqa: E402
from .attention import VJP, LinearState, linear_attention, linear_attention_vjp, softmax_attention  # noqa: E402
from .state import DPLRState, KVCache, LinearAttentionState  # noqa: E402
from .dplr import dplr_attention, dplr_attention_vjp  # noqa: E402
from . import fitting  # noqa: E402
from .ops._finite import NonFiniteResult  # noqa: E402

# ``feature_maps.fit`` is the documented entry point for fitting maps to
# softmax.  The fitting code builds on the feature maps and on the front end,
# so it cannot be imported by feature_maps itself; the package wires the names
# in (``import linattn_nb.feature_maps`` always runs this file first).
feature_maps.fit = fitting.fit
feature_maps.FitResult = fitting.FitResult
feature_maps.FitHistory = fitting.FitHistory

__all__ = [
    "__version__",
    "config",
    "feature_maps",
    "rules",
    "fitting",
    "linear_attention",
    "linear_attention_vjp",
    "VJP",
    "softmax_attention",
    "dplr_attention",
    "dplr_attention_vjp",
    "LinearState",
    "LinearAttentionState",
    "KVCache",
    "DPLRState",
    "NonFiniteResult",
]
