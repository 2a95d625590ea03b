"""linattn_nb: Numba-accelerated kernel-based linear attention.

Public API (stable names)::

    linear_attention(q, k, v, *, feature_map="elu", causal=False, method="auto", device="auto", ...)
    linear_attention_vjp(q, k, v, grad_out, *, ..., grad_state=None) -> VJP   # gradients
    softmax_attention(q, k, v, *, causal=False, scale=None)
    dplr_attention(q, k, v, *, rule=None, a=, b=, log_diag=, beta=, ...)   # diagonal-plus-low-rank rules
    feature_maps            # FeatureMap base, registry: get / available / register; fit (to softmax)
    rules                   # the update rules, one module each: get_rule / rule_for / rule_names / reference
    fitting                 # fit / objective: learned maps (Hedgehog, T2R) fitted to softmax weights
    LinearState             # (S, z, position) returned by linear_attention(return_state=True)
    LinearAttentionState    # recurrent state for decoding: prefill / step / query / save / load
    KVCache                 # the softmax baseline with the same prefill / step API

Nothing is compiled at import; Numba compiles each kernel on first use and
caches it on disk, outside the package (see ``linattn_nb._cache``).
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
]
