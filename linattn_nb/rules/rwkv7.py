"""RWKV-7 "Goose" (Peng et al. 2025) as a DPLR rule: ``a = -kappa``, ``b = kappa * iclr``, decay ``w``.

RWKV-7's transposed state and receptance map onto this toolkit's state and query as docs/dplr.md
says (the model's replacement key is passed as ``k``).  Arguments: ``decay`` (w, in [0, 1]) or
``log_decay``, ``kappa`` and ``iclr``, each (..., N, D_phi).
"""
import numpy as np

from . import _dplr as D


def _check(inputs, lead, N, F, r):
    out = {"log_w": D.log_factors(inputs, lead, N, F, feature=True)}
    for name in ("kappa", "iclr"):
        if inputs.get(name) is None:
            raise TypeError(f"missing argument: {name} (shape (..., N, D_phi))")
        x = D.per_feature(name, inputs[name], lead, N, F)
        if not np.isfinite(x).all():
            raise ValueError(f"{name} contains non-finite values (NaN or inf)")
        out[name] = x
    D.in_range("iclr", out["iclr"], 0.0, 1.0)
    return out


def _build(fk, v, inp):
    kappa = inp["kappa"]
    return D.GeneralForm(inp["log_w"], -kappa[:, :, None], (kappa * inp["iclr"])[:, :, None], fk[:, :, None],
                         v[:, :, None])


def _step(H, k, v1, inp):
    """The paper's step on the transposed state S' = H^T: S' (diag(w) + alpha^T beta) + v^T k."""
    St = H.T
    alpha, beta = -inp["kappa"], inp["kappa"] * inp["iclr"]
    St = St @ (np.diag(np.exp(inp["log_w"])) + np.outer(alpha, beta)) + np.outer(v1, k)
    return St.T


def _sample(rng, b, n, f, r):
    return {"decay": D.sample_factors(rng, (b, n, f)), "kappa": D.unit_rows(rng.standard_normal((b, n, f))),
            "iclr": rng.uniform(0.0, 1.0, size=(b, n, f))}


def _pullback(fk, v, inp, g):
    dA, dB = g["a"][:, :, 0], g["b"][:, :, 0]
    return g["kw"][:, :, 0], g["vw"][:, :, 0], {"decay": g["diag"], "kappa": inp["iclr"] * dB - dA,
                                                  "iclr": inp["kappa"] * dB}

RULE = D.DPLRRule(
    name="rwkv7", arguments=("decay", "log_decay", "kappa", "iclr"), substeps=False,
    formula="S'_t = S'_{t-1} (diag(w_t) - kappa_t^T (kappa_t * iclr_t)) + v_t^T k_t  (S' = S^T)",
    check=_check, build=_build, step=_step, sample=_sample,
    pullback=_pullback, layer={"log_decay": "feature_gate", "kappa": "unit_key", "iclr": "feature_unit"})
