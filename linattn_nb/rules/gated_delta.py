"""The gated delta rule (Yang, Kautz & Hatamizadeh 2025, "Gated Delta Networks").

``S_t = a_t (I - beta_t phi(k_t) phi(k_t)^T) S_{t-1} + beta_t phi(k_t) v_t^T``:
the delta rule after a scalar decay ``a_t`` in [0, 1] per sequence or per token.
Outputs are not divided by the normaliser by default.
"""
import numpy as np

from ..ops._codes import RULE_GATED_DELTA
from ._base import UpdateRule, draw_factors


def _step(H, k, v1, log_factor, beta):
    H = np.exp(log_factor) * H
    return H + beta * np.outer(k, v1 - k @ H)


def _sample(rng, b, n, f):
    beta = rng.uniform(0.0, 2.0, size=(b, n))  # beta first: the order the correctness study has always drawn
    return {"beta": beta, "decay": draw_factors(rng, (b, n))}


RULE = UpdateRule(
    name="gated_delta", code=RULE_GATED_DELTA, kernel_inputs=("beta", "log_decay"), factor="scalar", beta=True,
    normalize=False, reads_state=True,
    formula="S_t = a_t (I - beta_t phi(k_t) phi(k_t)^T) S_{t-1} + beta_t phi(k_t) v_t^T",
    hint="pass beta with decay or log_decay (one factor per sequence or per token)",
    reference_step=_step, sample=_sample, study_map="l2")
