"""KDA, Kimi Delta Attention (Kimi Linear, Moonshot AI 2025): the gated delta rule with a gate per feature.

``S_t = (I - beta_t k_t k_t^T) diag(alpha_t) S_{t-1} + beta_t k_t v_t^T`` (``k_t`` for
``phi(k_t)``), ``alpha_t = exp(log_decay_t)`` per feature.  As a DPLR transition: ``D_t =
diag(alpha_t)``, ``a_t = alpha_t * k_t``, ``b_t = -beta_t k_t``, write ``beta_t k_t v_t^T``.
Arguments: ``decay`` (in [0, 1]) or ``log_decay`` (<= 0), shape (..., N, D_phi); ``beta`` (..., N)
in [0, 2].  Unit keys (``feature_map="l2"``) keep the transition a contraction.
"""
import numpy as np

from . import _dplr as D


def _check(inputs, lead, N, F, r):
    if "beta" not in inputs:
        raise TypeError("missing argument: beta (shape (..., N))")
    return {"log_gate": D.log_factors(inputs, lead, N, F, feature=True),
            "beta": D.in_range("beta", D.per_token("beta", inputs["beta"], lead, N), 0.0, 2.0)}


def _build(fk, v, inp):
    g, beta = inp["log_gate"], inp["beta"][:, :, None]
    bk = beta * fk
    return D.GeneralForm(g, (np.exp(g) * fk)[:, :, None], -bk[:, :, None], bk[:, :, None], v[:, :, None])


def _keyed(fk, v, inp):
    beta = inp["beta"][:, :, None]
    return D.KeyedForm(inp["log_gate"], -beta, beta, v[:, :, None])


def _step(H, k, v1, inp):
    H = np.exp(inp["log_gate"])[:, None] * H
    return H - inp["beta"] * np.outer(k, k @ H) + inp["beta"] * np.outer(k, v1)


def _sample(rng, b, n, f, r):
    return {"decay": D.sample_factors(rng, (b, n, f)), "beta": rng.uniform(0.0, 2.0, size=(b, n))}


def _pullback(fk, v, inp, g):
    alpha, beta = np.exp(inp["log_gate"]), inp["beta"][:, :, None]
    dA, dB, dK = g["a"][:, :, 0], g["b"][:, :, 0], g["kw"][:, :, 0]
    dfk = alpha * dA + beta * (dK - dB)
    return dfk, g["vw"][:, :, 0], {"decay": g["diag"] + dA * fk, "beta": ((dK - dB) * fk).sum(-1)}

RULE = D.DPLRRule(
    name="kda", arguments=("decay", "log_decay", "beta"), substeps=False,
    formula="S_t = (I - beta_t k_t k_t^T) diag(alpha_t) S_{t-1} + beta_t k_t v_t^T",
    check=_check, build=_build, step=_step, sample=_sample,
    pullback=_pullback, layer={"log_decay": "feature_gate", "beta": "token_unit"}, keyed=_keyed)
