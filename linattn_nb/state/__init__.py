"""Recurrent decoding: the linear-attention state and the softmax KV cache.

:class:`LinearAttentionState` (:mod:`~linattn_nb.state.linear`), :class:`KVCache`
(:mod:`~linattn_nb.state.kvcache`), :class:`DPLRState` (:mod:`~linattn_nb.state.dplr`, the
diagonal-plus-low-rank rules) and the file format (:mod:`~linattn_nb.state.fileformat`,
:class:`StateFileError`).  Guide: docs/guide/decoding.md.
"""
from .fileformat import FORMAT_VERSION, StateFileError  # noqa: F401  (FORMAT_VERSION: the old module-level name)
from .kvcache import KVCache
from .linear import LinearAttentionState
from .dplr import DPLRState

__all__ = ["LinearAttentionState", "DPLRState", "KVCache", "StateFileError"]
