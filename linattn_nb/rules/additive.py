"""The additive rule of linear attention (Katharopoulos et al. 2020, "Transformers are RNNs").

``S_t = S_{t-1} + phi(k_t) v_t^T``, ``z_t = z_{t-1} + phi(k_t)``: no forgetting.
"""
import numpy as np

from ..ops._codes import RULE_ADDITIVE
from ._base import UpdateRule


def _step(H, k, v1, log_factor, beta):
    return H + np.outer(k, v1)


def _sample(rng, b, n, f):
    return {}


RULE = UpdateRule(
    name="additive", code=RULE_ADDITIVE, kernel_inputs=(), factor=None, beta=False, normalize=True,
    reads_state=False, formula="S_t = S_{t-1} + phi(k_t) v_t^T",
    hint="pass neither decay nor log_decay nor beta", reference_step=_step, sample=_sample)
