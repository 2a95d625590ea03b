"""Analysis tools: spectra and ranks of attention, state rank, recall capacity."""
from .spectral import cumulative_spectrum, effective_rank, numerical_rank, singular_values, stable_rank
from .rank import StateRankProfile, attention_rank, semiseparable_rank, state_rank_profile
from .capacity import MQAR, RecallCapacity, mqar, recall_capacity, state_size
