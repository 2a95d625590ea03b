"""Study: memory horizon -- retrieval error against the distance between write and read.

n key-value pairs (Gaussian keys in R^d, Gaussian values in R^M) are written
into the state one per token and every key is read after the last write, so
pair j is read at distance n − 1 − j.  The state forgets with a constant
decay γ (RetNet, Sun et al. 2023, §2.1; REFERENCES.md "Decay and gating"):
``S = Σ_j γ^(n−1−j) φ(k_j) v_jᵀ``.  :func:`linattn_nb.analysis.recall_capacity`
(``decay=γ``) bins each pair's relative error ‖v̂_j − v_j‖²/‖v_j‖² by that
distance; the study plots it for γ ∈ {1 (the additive rule), 0.999, 0.99,
0.9} with the least-squares floor of a state of the same size on the same
axes, mean ± standard deviation over three seeds.

What it shows: the additive rule spreads its (capacity-limited) error evenly
over the ages of the pairs; a decay buys recent pairs a lower error than the
additive rule's -- below the uniform least-squares floor, which weighs every
pair alike -- and gives up the pairs older than about 1/(1 − γ).
"""
from __future__ import annotations

import warnings

import numpy as np

from ._study import Rendered, Study, fmt, markdown_table, register_study, split_failed
from .sweep import to_json

#: The decays compared; 1 is the additive rule (run with ``decay=None``).
GAMMAS = (1.0, 0.999, 0.99, 0.9)
#: Independent seeds per decay (every random quantity is averaged over them).
SEEDS = (0, 1, 2)


def _sizes(ctx):
    """(d, n pairs, value dimension M, trials per seed)."""
    return ctx.pick(
        tiny=(4, 64, 8, 1),
        quick=(16, 1024, 32, 1),
        full=(16, 2048, 32, 3),
    )


def points(ctx) -> list[dict]:
    d, n, m, trials = _sizes(ctx)
    return [dict(feature_map="elu", d=d, n=n, value_dim=m, trials=trials, gamma=g, seed=s)
            for g in GAMMAS for s in SEEDS]


def run(feature_map, d, n, value_dim, trials, gamma, seed) -> dict:
    from ..analysis import recall_capacity

    res = recall_capacity(feature_map, d, [n], value_dim=value_dim, trials=trials, seed=seed,
                          decay=None if gamma == 1.0 else gamma)
    out = to_json(res)
    out["gamma"] = gamma
    return out


def _label(gamma) -> str:
    return "additive (γ = 1)" if gamma == 1.0 else f"γ = {gamma:g}"


def _aggregate(ok):
    """{gamma: dict(edges, err (seeds, bins), opt (seeds, bins), mse (seeds,), opt_mse (seeds,))}."""
    by = {}
    for r in ok:
        g = float(r["params"]["gamma"])
        res = r["result"]
        e = by.setdefault(g, dict(edges=np.asarray(res["distance_edges"]), err=[], opt=[], mse=[], opt_mse=[],
                                  d_phi=res["d_phi"], seeds=[]))
        e["err"].append(np.asarray(res["error_by_distance"], dtype=float)[0])
        e["opt"].append(np.asarray(res["optimal_error_by_distance"], dtype=float)[0])
        e["mse"].append(float(res["mse"][0]))
        e["opt_mse"].append(float(res["optimal_mse"][0]))
        e["seeds"].append(r["params"]["seed"])
    for e in by.values():
        for key in ("err", "opt", "mse", "opt_mse"):
            e[key] = np.asarray(e[key], dtype=float)
    return dict(sorted(by.items(), reverse=True))


def _mean_std(x):
    """Mean and standard deviation (ddof=1 when there are >= 2 seeds) along axis 0, ignoring NaN."""
    x = np.asarray(x, dtype=float)
    with warnings.catch_warnings():  # an empty bin (NaN for every seed) is NaN, silently
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(x, axis=0)
        std = np.nanstd(x, axis=0, ddof=1) if x.shape[0] > 1 else np.zeros_like(mean)
    return mean, std


def _pm(mean, std) -> str:
    return f"{fmt(float(mean))} ± {fmt(float(std), 2)}"


def render(records, ctx) -> Rendered:
    ok, failed, problems, failed_md = split_failed("horizon", records)
    md = []
    if ok:
        p0 = ok[0]["params"]
        agg = _aggregate(ok)
        first = next(iter(agg.values()))
        edges = first["edges"]
        nb = len(edges) - 1
        nseeds = len(first["seeds"])
        md.append(
            f"Regime: feature map ELU+1, keys i.i.d. N(0, 1) in R^{p0['d']} (D_φ = {first['d_phi']}), "
            f"values i.i.d. N(0, 1) in R^{p0['value_dim']}, n = {p0['n']} pairs written one per token "
            f"(n / D_φ = {p0['n'] / first['d_phi']:g}) and all read after the last write; pair j is read at "
            f"distance n − 1 − j.  The state decays by a constant γ per token "
            "(S = Σ_j γ^(n−1−j) φ(k_j) v_jᵀ, normalised read-out).  Error: ‖v̂ − v‖²/‖v‖² over the pairs of "
            f"each distance bin.  Mean ± standard deviation over {nseeds} seeds "
            f"({p0['trials']} trial(s) each).  The optimal floor is the least-squares state of the same size "
            "(D_φ × M), which weighs every pair alike: a forgetting state can beat it on recent pairs by "
            "giving up old ones.")
        cols = sorted({0, nb // 3, (2 * nb) // 3, nb - 1})

        def bin_name(b):
            lo, hi = int(edges[b]), int(edges[b + 1]) - 1
            return f"d = {lo}" if lo == hi else f"d ∈ [{lo}, {hi}]"

        rows = []
        for g, e in agg.items():
            m, s = _mean_std(e["err"])
            mm, ms = _mean_std(e["mse"][:, None])
            rows.append([_label(g)] + [_pm(m[b], s[b]) for b in cols] + [_pm(mm[0], ms[0])])
        m, s = _mean_std(first["opt"])
        mm, ms = _mean_std(first["opt_mse"][:, None])
        rows.append(["optimal floor (least squares)"] + [_pm(m[b], s[b]) for b in cols] + [_pm(mm[0], ms[0])])
        md += ["", "Relative retrieval error by write–read distance d:", "",
               markdown_table(["state"] + [bin_name(b) for b in cols] + ["all pairs"], rows)]
        if ctx.plots:
            fig, (ax,) = ctx.figure(width=6.4, height=4.2)
            x = 0.5 * (edges[:-1] + edges[1:] - 1)  # bin midpoints
            for i, (g, e) in enumerate(agg.items()):
                m, s = _mean_std(e["err"])
                ax.errorbar(x, m, yerr=s, fmt="o-", ms=3, capsize=2, label=_label(g), color=ctx.style(i)["color"])
            m, s = _mean_std(first["opt"])
            ax.errorbar(x, m, yerr=s, fmt="k--", capsize=2, label="optimal floor (least squares)")
            ax.set_xscale("symlog", linthresh=1.0)
            ax.set(xlabel="distance between write and read (tokens, bin midpoints)",
                   ylabel="relative retrieval error",
                   title=f"Memory horizon: n = {p0['n']}, D_φ = {first['d_phi']}, M = {p0['value_dim']}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="x-small")
            md += ["", ctx.savefig(fig, "horizon", "retrieval error against write-read distance for several decays")]
    md += failed_md
    return Rendered("\n".join(md), f"γ ∈ {{{', '.join(f'{g:g}' for g in GAMMAS)}}}, {len(SEEDS)} seeds", problems)


STUDY = register_study(Study(
    name="horizon",
    title="Memory horizon: retrieval error against distance",
    command="horizon",
    help="retrieval error against the distance between write and read for decays gamma in {1, 0.999, 0.99, 0.9}",
    points=points,
    run=run,
    render=render,
))
