"""The delta rule (Schlag, Irie & Schmidhuber 2021; DeltaNet, Yang et al. 2024).

``S_t = S_{t-1} + beta_t phi(k_t) (v_t - S_{t-1}^T phi(k_t))^T``: the state
overwrites the value stored under ``phi(k_t)`` with strength ``beta_t`` in [0, 2].
Outputs are not divided by the normaliser by default (DeltaNet's convention).
"""
import numpy as np

from ..ops._codes import RULE_DELTA
from ._base import UpdateRule


def _step(H, k, v1, log_factor, beta):
    return H + beta * np.outer(k, v1 - k @ H)


def _sample(rng, b, n, f):
    return {"beta": rng.uniform(0.0, 2.0, size=(b, n))}


RULE = UpdateRule(
    name="delta", code=RULE_DELTA, kernel_inputs=("beta",), factor=None, beta=True, normalize=False,
    reads_state=True, formula="S_t = S_{t-1} + beta_t phi(k_t) (v_t - S_{t-1}^T phi(k_t))^T",
    hint="pass beta, without decay or log_decay", reference_step=_step, sample=_sample, study_map="l2")
