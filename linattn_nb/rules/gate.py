"""A per-feature gate (Yang et al. 2024, "Gated Linear Attention Transformers with Hardware-Efficient Training").

``S_t = diag(alpha_t) S_{t-1} + phi(k_t) v_t^T`` with ``alpha_t = exp(log_gate_t)``
in [0, 1]^D_phi, one factor per token and feature.
"""
import numpy as np

from ..ops._codes import RULE_GATE
from ._base import UpdateRule, draw_factors


def _step(H, k, v1, log_factor, beta):
    return np.exp(np.asarray(log_factor))[:, None] * H + np.outer(k, v1)


def _sample(rng, b, n, f):
    return {"decay": draw_factors(rng, (b, n, f))}


RULE = UpdateRule(
    name="gate", code=RULE_GATE, kernel_inputs=("log_gate",), factor="feature", beta=False, normalize=True,
    reads_state=False, formula="S_t = diag(alpha_t) S_{t-1} + phi(k_t) v_t^T",
    hint="pass decay or log_decay with one factor per feature (last axes N, D_phi), without beta",
    reference_step=_step, sample=_sample)
