"""Study: associative-recall capacity of the fixed-size state against n / D_φ.

Accuracy and retrieval error of linear attention's read-out, the least-squares floor of a state of
the same size and softmax attention, in two regimes (large and small logits).  The setting and why
two regimes: docs/guide/studies.md.
"""
from __future__ import annotations

import numpy as np

from ._maps import build_map, is_random, map_label
from ._study import CI_CAPTION, Rendered, Study, fmt, markdown_table, mean_ci, pm, register_study, split_failed

#: The key scales of the two regimes: (name, scale as a function of d).
REGIMES = (("variance", lambda d: 1.0), ("small logits", lambda d: float(d) ** -0.25))
from .sweep import to_json


def _sizes(ctx):
    """(d, n_pairs, seeds)."""
    return ctx.pick(
        tiny=(4, [2, 4, 8, 16], 2),
        quick=(16, [4, 8, 16, 32, 64, 128, 256], 5),
        full=(64, [20, 40, 60, 80, 100, 150, 200, 250, 300, 400, 500, 600], 5),  # Schlag et al. setting 1
    )


#: Accuracy threshold of the capacity column.
ACCURACY = 0.9


def _maps(m=128):
    from .. import feature_maps as fm

    maps = [("elu", None, {}), ("dpfp", None, {"nu": 1}), ("dpfp", None, {"nu": 2}), ("dpfp", None, {"nu": 3})]
    for name in ("favor+", "taylor2"):
        if name in fm.available():
            maps.append((name, m if is_random(name) else None, {}))
    return maps


def points(ctx, *, dim=None, maps=None, m=None, n=None, seeds=None) -> list[dict]:
    """The sweep grid: one point per (feature map, seed), each over every n.

    Parameters
    ----------
    ctx : Context
    dim : int, optional
        Key dimension d (default 64, Schlag et al.'s setting 1; 16 quick, 4 tiny).
    maps : list of str, optional
        Feature-map names (default ELU+1, DPFP ν = 1, 2, 3, FAVOR+, Taylor-2); a name alone builds with
        its defaults (random maps with ``m`` features).
    m : int, optional
        Random features of the random maps (default 128).
    n : int or list of int, optional
        Numbers of stored pairs.
    seeds : int, optional
        Number of seeds 0..seeds-1 (default 5; 2 tiny); a seed draws the keys and the random features.
    """
    d, n_pairs, nseeds = _sizes(ctx)
    if dim is not None:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"recall study: dim must be an integer >= 1, got {dim!r}")
        d = dim
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise ValueError(f"recall study: m must be an integer >= 1, got {m!r}")
    if n is not None:
        n_pairs = sorted(n if isinstance(n, (list, tuple)) else [n])
        if not n_pairs or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in n_pairs):
            raise ValueError(f"recall study: n must hold integers >= 1, got {n!r}")
    if seeds is not None:
        if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
            raise ValueError(f"recall study: seeds must be an integer >= 1, got {seeds!r}")
        nseeds = seeds
    if maps is None:
        chosen = _maps(128 if m is None else m)
    else:
        from ._maps import buildable_maps

        known = buildable_maps()
        chosen = []
        for name in maps:
            if name not in known:
                raise ValueError(f"recall study: unknown or unbuildable feature map {name!r} in maps; "
                                 f"choose from {', '.join(sorted(known))}")
            chosen.append((name, (128 if m is None else m) if is_random(name) else None, {}))
    return [dict(feature_map=name, num_features=nf, map_params=params, d=d, n_pairs=list(n_pairs), trials=1,
                 seed=seed, regime=regime, key_scale=scale(d))
            for regime, scale in REGIMES for seed in range(nseeds) for name, nf, params in chosen]


def run(feature_map, num_features, map_params, d, n_pairs, trials, seed=0, regime="variance",
        key_scale=1.0) -> dict:
    from ..analysis import recall_capacity

    fmap = build_map(feature_map, dim=d, num_features=num_features, seed=seed, **map_params)
    res = to_json(recall_capacity(fmap, d, np.asarray(n_pairs), trials=trials, seed=seed, key_scale=key_scale))
    res["d_phi"] = int(fmap.output_dim(d))
    return res


def _first_below(n, acc) -> str:
    """The first n whose accuracy is below ACCURACY: "≤ n0" when the first grid point already is."""
    below = np.nonzero(acc < ACCURACY)[0]
    if not below.size:
        return f"> {int(n[-1])}"
    j = int(below[0])
    return f"≤ {int(n[0])}" if j == 0 else str(int(n[j]))


def render(records, ctx) -> Rendered:
    ok, failed, problems, failed_md = split_failed("recall", records)
    md = []
    groups: dict = {}
    for r in ok:
        p = r["params"]
        key = (p.get("regime", "variance"), map_label(p["feature_map"], p["num_features"], p["map_params"]))
        groups.setdefault(key, []).append(r)
    regimes = list(dict.fromkeys(k[0] for k in groups))
    if ok:
        p0 = ok[0]["params"]
        d = p0["d"]
        seeds = sorted({r["params"]["seed"] for r in ok})
        scales = {k[0]: groups[k][0]["params"].get("key_scale", 1.0) for k in groups}
        md.append(f"Regime: keys i.i.d. s·N(0, 1) in R^{d} (d = {d}), one-hot values (M = n), n ∈ "
                  f"{{{', '.join(map(str, ok[0]['result']['n_pairs']))}}} pairs stored and every key read back "
                  "(non-causal, q = k); softmax baseline at temperature 1/√d; "
                  f"{len(seeds)} seeds (a seed draws the keys and the random features), {p0['trials']} trial(s) "
                  f"each; cells are {CI_CAPTION}.  Two key scales s: "
                  + "; ".join(f"**{reg}**, s = {fmt(scales[reg])} (self-logit ‖k‖²/√d ≈ "
                              f"{fmt(scales[reg] ** 2 * d / np.sqrt(d))})" for reg in regimes)
                  + ".  The larger the self-logit, the larger the variance of a random-feature estimate of "
                    "exp(q·k/√d).  Relative retrieval error ‖V̂ − V‖²/‖V‖² of linear attention's "
                    "normalised read-out, of the best state of the same size (least squares; the capacity "
                    "floor: 0 up to n = D_φ) and of softmax attention.")
        agg = {}
        for reg in regimes:
            rows = []
            for (reg2, label), recs in groups.items():
                if reg2 != reg:
                    continue
                res0 = recs[0]["result"]
                n = np.asarray(res0["n_pairs"], dtype=float)
                dphi = res0["d_phi"]
                stack = {f: np.asarray([np.asarray(r["result"][f], dtype=float) for r in recs])
                         for f in ("accuracy", "mse", "optimal_mse", "softmax_mse")}
                stats = {f: mean_ci(x) for f, x in stack.items()}
                agg[(reg, label)] = (n, dphi, stats)
                at = int(np.argmin(np.abs(n - 2 * dphi)))
                first = _first_below(n, stats["accuracy"][0])
                rows.append([label, dphi, first, pm(stats["accuracy"][0][0], stats["accuracy"][1][0]), int(n[at])]
                            + [pm(stats[f][0][at], stats[f][1][at]) for f in ("mse", "optimal_mse", "softmax_mse")])
            md += ["", f"**{reg} regime** (s = {fmt(scales[reg])}): accuracy at the smallest n ({int(n[0])}); "
                       f"the first n whose mean accuracy is below {ACCURACY} (\"≤ n\" when already the smallest "
                       "n is); errors at the measured n closest to 2·D_φ:", "",
                   markdown_table(["feature map", "D_φ", f"first n with accuracy < {ACCURACY}",
                                   f"accuracy at n = {int(n[0])}", "n", "error", "optimal error (floor)",
                                   "softmax error"], rows)]
        md += ["", "What it shows (computed from the tables above):", ""] + _findings(agg, regimes)
        if ctx.plots:
            fig, axes = ctx.figure(ncols=2 * len(regimes), width=4.0, height=3.6)
            for r_i, reg in enumerate(regimes):
                ax1, ax2 = axes[2 * r_i], axes[2 * r_i + 1]
                items = [(label, v) for (reg2, label), v in agg.items() if reg2 == reg]
                for i, (label, (n, dphi, stats)) in enumerate(items):
                    sty = ctx.style(i)
                    x = n / dphi
                    for ax, f in ((ax1, "mse"), (ax2, "accuracy")):
                        m, s = stats[f]
                        ax.plot(x, m, ms=4, label=f"{label} (D_φ = {dphi})", **sty)
                        hi = 1.0 if f == "accuracy" else np.inf  # bands clipped to the possible range
                        ax.fill_between(x, np.clip(m - s, 0.0, hi), np.clip(m + s, 0.0, hi), color=sty["color"],
                                        alpha=0.2, lw=0)
                    m, s = stats["optimal_mse"]
                    ax1.plot(x, m, "--", color=sty["color"], lw=1, label="_")
                ax1.set(xlabel="n / D_φ", ylabel="relative retrieval error", title=f"{reg}: error (dashed: floor)")
                ax2.axhline(ACCURACY, color="0.5", lw=0.8)
                ax2.set(xlabel="n / D_φ", ylabel="argmax accuracy", title=f"{reg}: accuracy")
                for ax in (ax1, ax2):
                    ax.set_xscale("log")
                    ax.grid(True, alpha=0.3)
            ctx.legend_outside(fig, axes, title=f"mean, 95% CI over {len(seeds)} seeds")
            md += ["", ctx.savefig(fig, "recall", "recall error and accuracy against n / D_phi in both regimes"),
                   "", f"{CI_CAPTION}; dashed: the least-squares floor of each map's state."]
    md += failed_md
    return Rendered("\n".join(md), f"{len(groups)} feature maps and regimes", problems)


def _findings(agg, regimes) -> list:
    """Per map present in both regimes: where accuracy first falls below ACCURACY in each, said in words."""
    out = []
    if len(regimes) >= 2:
        var, cap = regimes[0], regimes[1]
        for (reg, label), (n, dphi, stats) in agg.items():
            if reg != var or (cap, label) not in agg:
                continue
            nv, _, sv = agg[(var, label)]
            nc, _, sc = agg[(cap, label)]
            fv, fc = _first_below(nv, sv["accuracy"][0]), _first_below(nc, sc["accuracy"][0])
            line = f"- {label} (D_φ = {dphi}): accuracy first < {ACCURACY} at n {fv} ({var}) and n {fc} ({cap})"
            if fv.startswith("≤") and not fc.startswith("≤") and n[0] < dphi:
                line += (f": with n = {int(n[0])} < D_φ pairs the state has room (floor 0), and the failure goes "
                         "away with smaller logits: it is the estimator's variance, not capacity")
            out.append(line + ".")
    if len(regimes) >= 2:
        out += _capacity_findings(agg, regimes[1])
    errs, floors = [], []
    for (_, _), (n, dphi, stats) in agg.items():
        j = int(np.argmin(np.abs(n - dphi)))
        errs.append(float(stats["mse"][0][j]))
        floors.append(float(stats["optimal_mse"][0][j]))
    if errs:
        out.append(f"- At n ≈ D_φ the normalised read-out's error is {fmt(min(errs))}–{fmt(max(errs))} across maps "
                   f"and regimes while the floor is {fmt(max(floors))} at most: the read-out is a weighted average "
                   "of the one-hot values, with error 1 − 2w_ii + Σ_j w_ij² per key, 0 only when the right pair "
                   "takes all the weight.  The floor is reached by an unnormalised least-squares read-out, not by "
                   "the normalised one of any map.")
    return out


def _capacity_findings(agg, regime) -> list:
    """Per map in the small-logit regime: whether its failure can be the state's capacity.

    A first fall below ACCURACY at n <= D_φ happens while the state has room (floor 0): the kernel or
    estimator, not capacity; a first fall at n > D_φ is consistent with capacity.
    """
    out = []
    for (reg, label), (n, dphi, stats) in agg.items():
        if reg != regime:
            continue
        acc = stats["accuracy"][0]
        below = np.nonzero(acc < ACCURACY)[0]
        if not below.size:
            out.append(f"- {label} ({regime}): accuracy ≥ {ACCURACY} up to the largest n = {int(n[-1])} "
                       f"(n / D_φ = {fmt(n[-1] / dphi)}): no capacity limit reached in this range.")
            continue
        j = int(below[0])
        nj, floor = int(n[j]), float(stats["optimal_mse"][0][j])
        if nj <= dphi:
            out.append(f"- {label} ({regime}): accuracy {fmt(acc[j])} at n = {nj} ≤ D_φ = {dphi}, where the floor "
                       f"is {fmt(floor)}: its state has room, so this is the map's kernel (its weights do not single "
                       "out the queried key), not capacity.")
        else:
            out.append(f"- {label} ({regime}): accuracy ≥ {ACCURACY} while n ≤ D_φ = {dphi}, first below at n = {nj} "
                       f"(n / D_φ = {fmt(nj / dphi)}, floor {fmt(floor)}): consistent with the state's capacity.")
    return out


STUDY = register_study(Study(
    name="recall",
    title="Recall capacity against n / D_φ",
    command="recall",
    help="associative-recall capacity of the state against n / D_phi, with the optimal floor and softmax",
    points=points,
    run=run,
    render=render,
    budget_s={"tiny": 30, "quick": 10, "full": 60},
))
