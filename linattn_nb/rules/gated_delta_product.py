"""Gated DeltaProduct (Siems et al. 2025): DeltaProduct after a scalar gate applied once per token.

Per token: ``S <- a_t S``, then the ``n_h`` delta steps of :mod:`linattn_nb.rules.delta_product`.
Arguments: ``decay`` (in [0, 1]) or ``log_decay`` (<= 0, -inf a reset), shape (..., N); ``beta``
(..., N, n_h) in [0, 2]; k, v with the step axis.
"""
import numpy as np

from . import _dplr as D
from .delta_product import householder_form, householder_keyed, householder_pullback


def _check(inputs, lead, N, F, r):
    if "beta" not in inputs:
        raise TypeError("missing argument: beta (shape (..., N, n_h))")
    lg = D.log_factors(inputs, lead, N, F, feature=False)
    if lg.shape[-1] != 1:
        raise ValueError(f"gated_delta_product takes one gate per token: decay/log_decay of shape (..., N) = "
                         f"{lead + (N,)}, got one per feature")
    return {"log_gate": lg[..., 0], "beta": D.in_range("beta", D.per_token("beta", inputs["beta"], lead, N, r),
                                                       0.0, 2.0)}


def _build(fk, v, inp):
    return householder_form(fk, v, inp["beta"], inp["log_gate"])


def _keyed(fk, v, inp):
    return householder_keyed(fk, v, inp["beta"], inp["log_gate"])


def _pullback(fk, v, inp, g):
    dfk, dv, dbeta, dgate = householder_pullback(fk, v, inp["beta"], g, inp["log_gate"])
    return dfk, dv, {"beta": dbeta, "decay": dgate}


def _step(H, k, v1, inp):
    H = np.exp(inp["log_gate"]) * H
    for j in range(k.shape[0]):
        H = H + inp["beta"][j] * np.outer(k[j], v1[j] - k[j] @ H)
    return H


def _sample(rng, b, n, f, r):
    return {"decay": D.sample_factors(rng, (b, n)), "beta": rng.uniform(0.0, 2.0, size=(b, n, r))}


RULE = D.DPLRRule(
    name="gated_delta_product", arguments=("decay", "log_decay", "beta"), substeps=True,
    formula="S <- a_t S; then S <- (I - beta_tj k_tj k_tj^T) S + beta_tj k_tj v_tj^T, j = 1 .. n_h",
    check=_check, build=_build, step=_step, sample=_sample,
    pullback=_pullback, layer={"log_decay": "token_decay", "beta": "token_unit"}, keyed=_keyed)
