"""Recurrent decoding: the linear-attention state and the softmax KV cache.

Causal linear attention is an RNN (Katharopoulos et al. 2020, "Transformers
are RNNs", Eqs. 18-19): generation keeps a fixed-size state

.. math:: S = \\sum_j \\phi(k_j) v_j^\\top, \\qquad z = \\sum_j \\phi(k_j),

and each new token costs ``O(D_phi * M)`` whatever the context length.
Softmax attention keeps every key and value instead (:class:`KVCache`), so a
step costs ``O(L * (D + M))`` at context length L.  Both objects share the
``prefill`` / ``step`` / ``query`` / ``nbytes`` API so that studies compare
like with like (``benchmarks/decode.py``).

Modules: :mod:`~linattn_nb.state.linear` (:class:`LinearAttentionState`),
:mod:`~linattn_nb.state.kvcache` (:class:`KVCache`), :mod:`~linattn_nb.state.dplr` (:class:`DPLRState`,
the diagonal-plus-low-rank rules),
:mod:`~linattn_nb.state.fileformat` (save/load, :class:`StateFileError`).  The decode-step
launchers the states run are entries of the method table (:mod:`linattn_nb.ops.step.launchers`).
"""
from .fileformat import FORMAT_VERSION, StateFileError  # noqa: F401  (FORMAT_VERSION: the old module-level name)
from .kvcache import KVCache
from .linear import LinearAttentionState
from .dplr import DPLRState

__all__ = ["LinearAttentionState", "DPLRState", "KVCache", "StateFileError"]
