"""A scalar decay per sequence or per token.

``S_t = a_t S_{t-1} + phi(k_t) v_t^T`` with ``a_t = exp(log_decay_t)`` in [0, 1]
(0 a reset): a constant per sequence is RetNet's per-head gamma (Sun et al.
2023, "Retentive Network"); one per token is Mamba-2/SSD's scalar decay (Dao &
Gu 2024) and simple GLA.
"""
import numpy as np

from ..ops._codes import RULE_DECAY
from ._base import UpdateRule, draw_factors


def _step(H, k, v1, log_factor, beta):
    return np.exp(log_factor) * H + np.outer(k, v1)


def _sample(rng, b, n, f):
    return {"decay": draw_factors(rng, (b, n))}


RULE = UpdateRule(
    name="decay", code=RULE_DECAY, kernel_inputs=("log_decay",), factor="scalar", beta=False, normalize=True,
    reads_state=False, formula="S_t = a_t S_{t-1} + phi(k_t) v_t^T",
    hint="pass decay or log_decay with one factor per sequence or per token, without beta",
    reference_step=_step, sample=_sample)
