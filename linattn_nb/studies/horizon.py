"""Study: memory horizon -- retrieval error against the distance between write and read.

Each pair's error, written with a constant decay γ and read after the last write, binned by its age
(docs/guide/studies.md).
"""
from __future__ import annotations

import numpy as np

from ._maps import build_map, map_label
from ._study import (CI_CAPTION, Rendered, Study, fmt, markdown_table, mean_ci, register_study, seeds_text,
                     split_failed)
from .sweep import to_json

#: The decays compared; 1 is the additive rule (run with ``decay=None``).
GAMMAS = (1.0, 0.999, 0.99, 0.9)
#: Independent seeds per decay (every random quantity is averaged over them).
SEEDS = (0, 1, 2, 3, 4)
#: The feature maps, one panel each: the default ELU+1, and DPFP (Schlag et al. 2021, §4.2), whose
#: sparse features make the read-out selective (ELU+1's positive, correlated features average).
MAPS = (("elu", {}), ("dpfp", {"nu": 2}))


def _sizes(ctx):
    """(d, n pairs, value dimension M, trials per seed)."""
    return ctx.pick(
        tiny=(4, 64, 8, 1),
        quick=(32, 1024, 32, 1),
        full=(32, 2048, 32, 2),
    )


def points(ctx) -> list[dict]:
    d, n, m, trials = _sizes(ctx)
    return [dict(feature_map=name, map_params=params, d=d, n=n, value_dim=m, trials=trials, gamma=g, seed=s)
            for name, params in MAPS for g in GAMMAS for s in SEEDS]


def run(feature_map, map_params, d, n, value_dim, trials, gamma, seed) -> dict:
    from ..analysis import recall_capacity

    fmap = build_map(feature_map, dim=d, seed=seed, **map_params)
    res = recall_capacity(fmap, d, [n], value_dim=value_dim, trials=trials, seed=seed,
                          decay=None if gamma == 1.0 else gamma)
    out = to_json(res)
    out["gamma"] = gamma
    return out


def _label(gamma) -> str:
    return "additive (γ = 1)" if gamma == 1.0 else f"γ = {gamma:g}"


def _aggregate(ok):
    """{map label: {gamma: dict(edges, d_phi, seeds, err (seeds, bins), opt (seeds, bins), mse, opt_mse)}}."""
    by = {}
    for r in ok:
        p, res = r["params"], r["result"]
        per_map = by.setdefault(map_label(p["feature_map"], None, p["map_params"]), {})
        e = per_map.setdefault(float(p["gamma"]), dict(edges=np.asarray(res["distance_edges"]), d_phi=res["d_phi"],
                                                        err=[], opt=[], mse=[], opt_mse=[], seeds=[]))
        e["err"].append(np.asarray(res["error_by_distance"], dtype=float)[0])
        e["opt"].append(np.asarray(res["optimal_error_by_distance"], dtype=float)[0])
        e["mse"].append(float(res["mse"][0]))
        e["opt_mse"].append(float(res["optimal_mse"][0]))
        e["seeds"].append(p["seed"])
    for per_map in by.values():
        for e in per_map.values():
            for key in ("err", "opt", "mse", "opt_mse"):
                e[key] = np.asarray(e[key], dtype=float)
    return {name: dict(sorted(per_map.items(), reverse=True)) for name, per_map in by.items()}


def _pm(mean, std) -> str:
    """``"mean ± half-width"``, always with its ±: ``"± n/a"`` where one seed gives no interval."""
    std = float(std)
    return f"{fmt(float(mean))} ± {'n/a' if np.isnan(std) and np.isfinite(float(mean)) else fmt(std, 2)}"


def render(records, ctx) -> Rendered:
    ok, failed, problems, failed_md = split_failed("horizon", records)
    md = []
    if ok:
        p0 = ok[0]["params"]
        agg = _aggregate(ok)
        dphis = ", ".join(f"{name}: {next(iter(per.values()))['d_phi']}" for name, per in agg.items())
        nseeds = max(len(e["seeds"]) for per in agg.values() for e in per.values())
        md.append(
            f"Regime: n = {p0['n']} pairs, keys i.i.d. N(0, 1) in R^{p0['d']}, values i.i.d. N(0, 1) in "
            f"R^{p0['value_dim']}, written one per token and all read after the last write (pair j at distance "
            f"n − 1 − j); D_φ ({dphis}).  The state decays by a constant γ per token "
            "(S = Σ_j γ^(n−1−j) φ(k_j) v_jᵀ, z likewise; normalised read-out φ(k)ᵀS / φ(k)ᵀz).  Error: "
            f"‖v̂ − v‖²/‖v‖² over the pairs of each distance bin; {CI_CAPTION} ("
            f"{seeds_text(nseeds)}, {p0['trials']} trial(s) each; a seed draws the keys and values).  "
            "The optimal floor is the least-squares state of the same size (D_φ × M), which weighs every pair "
            "alike: a forgetting state can beat it on recent pairs by giving up the old ones, whose error then "
            "exceeds 1 (the read-out is a mix of other values).")
        for name, per in agg.items():
            first = next(iter(per.values()))
            edges = first["edges"]
            nb = len(edges) - 1
            cols = sorted({0, nb // 3, (2 * nb) // 3, nb - 1})

            def bin_name(b):
                lo, hi = int(edges[b]), int(edges[b + 1]) - 1
                return f"d = {lo}" if lo == hi else f"d ∈ [{lo}, {hi}]"

            rows = []
            for g, e in per.items():
                m, s = mean_ci(e["err"])
                mm, ms = mean_ci(e["mse"][:, None])
                rows.append([_label(g)] + [_pm(m[b], s[b]) for b in cols] + [_pm(mm[0], ms[0])])
            m, s = mean_ci(first["opt"])
            mm, ms = mean_ci(first["opt_mse"][:, None])
            rows.append(["optimal floor (least squares)"] + [_pm(m[b], s[b]) for b in cols] + [_pm(mm[0], ms[0])])
            md += ["", f"{name}, D_φ = {first['d_phi']}: relative retrieval error by write–read distance d", "",
                   markdown_table(["state"] + [bin_name(b) for b in cols] + ["all pairs"], rows)]
        if ctx.plots:
            fig, axes = ctx.figure(ncols=len(agg), width=5.2, height=4.0)
            for ax, (name, per) in zip(axes, agg.items()):
                first = next(iter(per.values()))
                edges = first["edges"]
                x = 0.5 * (edges[:-1] + edges[1:] - 1)  # bin midpoints
                for i, (g, e) in enumerate(per.items()):
                    m, s = mean_ci(e["err"])
                    ax.errorbar(x, m, yerr=s, ms=3, capsize=2, label=_label(g), **ctx.style(i))
                m, s = mean_ci(first["opt"])
                ax.errorbar(x, m, yerr=s, fmt="k--", capsize=2, label="optimal floor (least squares)")
                ax.set_xscale("symlog", linthresh=1.0)
                ax.set(xlabel="distance between write and read (tokens)", ylabel="relative retrieval error",
                       title=f"{name}, D_φ = {first['d_phi']}, n = {p0['n']}")
                ax.grid(True, alpha=0.3)
            ctx.legend_outside(fig, axes, title=f"state (mean, 95% CI, {seeds_text(nseeds)})")
            md += ["", ctx.savefig(fig, "horizon", "retrieval error against write-read distance for several decays")]
    md += failed_md
    ran = len({r["params"]["seed"] for r in ok})  # the seeds run, whatever SEEDS holds
    return Rendered("\n".join(md), f"γ ∈ {{{', '.join(f'{g:g}' for g in GAMMAS)}}}, {seeds_text(ran)}", problems)


STUDY = register_study(Study(
    name="horizon",
    title="Memory horizon: retrieval error against distance",
    command="horizon",
    help="retrieval error against the distance between write and read for decays gamma in {1, 0.999, 0.99, 0.9}",
    points=points,
    run=run,
    render=render,
    figures=("horizon",),
    budget_s={"tiny": 30, "quick": 10, "full": 30},
))
