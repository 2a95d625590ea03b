"""Analysis tools for expressivity studies of linear attention.

Approximation error against softmax (:mod:`.error`), kernel-level theory (:mod:`.theory`), spectra and
ranks (:mod:`.spectral`, :mod:`.rank`), recall capacity (:mod:`.capacity`) and reading stored values back
from a state (:mod:`.readout`).  Guide: docs/guide/analysis.md.  Importing compiles nothing.
"""
from .error import ApproximationError, approximation_error, approximation_error_naive, attention_weights
from .theory import KernelEstimate, favor_mse, kernel_estimate_mse, orthogonal_mse_bound
from .spectral import cumulative_spectrum, effective_rank, numerical_rank, singular_values, stable_rank
from .rank import StateRankProfile, attention_rank, semiseparable_rank, state_rank_profile
from .capacity import MQAR, RecallCapacity, mqar, recall_capacity, state_size
from .readout import Readout, read_back

__all__ = [
    "ApproximationError", "approximation_error", "approximation_error_naive", "attention_weights",
    "KernelEstimate", "kernel_estimate_mse", "favor_mse", "orthogonal_mse_bound",
    "singular_values", "numerical_rank", "effective_rank", "stable_rank", "cumulative_spectrum",
    "attention_rank", "semiseparable_rank", "state_rank_profile", "StateRankProfile",
    "RecallCapacity", "recall_capacity", "MQAR", "mqar", "state_size",
    "Readout", "read_back",
]
