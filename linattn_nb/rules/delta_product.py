"""DeltaProduct (Siems et al. 2025): ``n_h`` delta-rule steps per token, each with its own key, value and beta.

Per token, for ``j = 1 .. n_h``: ``S <- (I - beta_tj k_tj k_tj^T) S + beta_tj k_tj v_tj^T``; the query
reads after the last.  The token's transition is a product of ``n_h`` generalised Householder
factors (rank ``n_h``); ``n_h = 1`` is the delta rule.  Keys and values carry the step axis:
k (..., N, n_h, D), v (..., N, n_h, M); ``beta`` (..., N, n_h) in [0, 2].
"""
import numpy as np

from . import _dplr as D


def _check(inputs, lead, N, F, r):
    if "beta" not in inputs:
        raise TypeError("missing argument: beta (shape (..., N, n_h))")
    return {"beta": D.in_range("beta", D.per_token("beta", inputs["beta"], lead, N, r), 0.0, 2.0)}


def householder_form(fk, v, beta, log_gate=None):
    """The general form of ``n_h`` delta steps per token, after a per-token log-gate (None: no gate):
    the gate scales the state once, before the first step, so the first factor's ``a`` carries it."""
    Bn, N, r, F = fk.shape
    bk = beta[..., None] * fk
    a = fk.copy()
    if log_gate is None:
        ld = np.zeros((Bn, N, 0))
    else:
        ld = log_gate.reshape(Bn, N, 1)
        a[:, :, 0] *= np.exp(ld)
    return D.GeneralForm(ld, a, -bk, bk, v)


def householder_keyed(fk, v, beta, log_gate=None):
    """:func:`householder_form` as a :class:`~linattn_nb.rules._dplr.KeyedForm` (``a`` the keys, the gate
    in the first factor's)."""
    Bn, N = fk.shape[:2]
    ld = np.zeros((Bn, N, 0)) if log_gate is None else log_gate.reshape(Bn, N, 1)
    return D.KeyedForm(ld, -beta, beta, v)


def householder_pullback(fk, v, beta, g, log_gate=None):
    """The gradient of :func:`householder_form`: ``(dfk, dv, d_beta, d_gate)`` (d_gate None without a gate)."""
    dA, dB, dK = g["a"], g["b"], g["kw"]
    dA = dA.copy()
    d_gate = None
    if log_gate is not None:
        gate = np.exp(log_gate)
        d_gate = g["diag"][..., 0] + (dA[:, :, 0] * fk[:, :, 0]).sum(-1)
        dA[:, :, 0] *= gate[..., None]
    dfk = dA + beta[..., None] * (dK - dB)
    return dfk, g["vw"], ((dK - dB) * fk).sum(-1), d_gate


def _build(fk, v, inp):
    return householder_form(fk, v, inp["beta"])


def _keyed(fk, v, inp):
    return householder_keyed(fk, v, inp["beta"])


def _pullback(fk, v, inp, g):
    dfk, dv, dbeta, _ = householder_pullback(fk, v, inp["beta"], g)
    return dfk, dv, {"beta": dbeta}


def _step(H, k, v1, inp):
    for j in range(k.shape[0]):
        H = H + inp["beta"][j] * np.outer(k[j], v1[j] - k[j] @ H)
    return H


def _sample(rng, b, n, f, r):
    return {"beta": rng.uniform(0.0, 2.0, size=(b, n, r))}


RULE = D.DPLRRule(
    name="delta_product", arguments=("beta",), substeps=True,
    formula="S <- (I - beta_tj k_tj k_tj^T) S + beta_tj k_tj v_tj^T, j = 1 .. n_h",
    check=_check, build=_build, step=_step, sample=_sample,
    pullback=_pullback, layer={"beta": "token_unit"}, keyed=_keyed)
