"""Analysis tools for expressivity studies of linear attention.

* how far linear attention is from softmax attention: approximation error at
  the attention level (:mod:`.error`) and kernel-level theory (:mod:`.theory`);
* the limits of the fixed-size state: spectra and ranks of attention
  (:mod:`.spectral`, :mod:`.rank`) and recall capacity (:mod:`.capacity`);
* reading stored values back from any state (:mod:`.readout`).

Importing compiles nothing.
"""
from .error import ApproximationError, approximation_error, approximation_error_naive, attention_weights
from .theory import KernelEstimate, favor_mse, kernel_estimate_mse, orthogonal_mse_bound
from .spectral import cumulative_spectrum, effective_rank, numerical_rank, singular_values, stable_rank
from .rank import StateRankProfile, attention_rank, semiseparable_rank, state_rank_profile
from .capacity import MQAR, RecallCapacity, mqar, recall_capacity, state_size
from .readout import Readout, read_back

__all__ = [
    # approximation error (error.py)
    "ApproximationError", "approximation_error", "approximation_error_naive", "attention_weights",
    # kernel-level theory (theory.py)
    "KernelEstimate", "kernel_estimate_mse", "favor_mse", "orthogonal_mse_bound",
    # spectra (spectral.py)
    "singular_values", "numerical_rank", "effective_rank", "stable_rank", "cumulative_spectrum",
    # ranks (rank.py)
    "attention_rank", "semiseparable_rank", "state_rank_profile", "StateRankProfile",
    # recall capacity (capacity.py)
    "RecallCapacity", "recall_capacity", "MQAR", "mqar", "state_size",
    # reading values back from a state (readout.py)
    "Readout", "read_back",
]
