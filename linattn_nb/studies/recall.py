"""Study: associative-recall capacity of the fixed-size state against n / D_φ.

Accuracy and retrieval error beside the least-squares floor and softmax, in three key regimes
(docs/guide/studies.md).
"""
from __future__ import annotations

import numpy as np

from ._maps import build_map, is_random, map_arrays, map_label
from ._claims import FLOOR_ZERO, capacity_claim, state_full
from ._study import (CI_CAPTION, Rendered, Study, check_point_size, fmt, markdown_table, mean_ci, pm,
                     register_study, seeds_text, split_failed)

#: The regimes: (name, key scale as a function of d, orthonormal keys, value width as a function of d or
#: None for one-hot values).  Orthonormal keys have equal norms and zero cross logits; they exist only for
#: n <= d.  One-hot values have M = n, so the state (D_φ × n) grows with n; Gaussian values of a fixed
#: width M keep it at D_φ × M, the regime in which the state's size binds.
REGIMES = (("variance", lambda d: 1.0, False, None), ("small logits", lambda d: float(d) ** -0.25, False, None),
           ("orthonormal keys", lambda d: float(d) ** 0.25, True, None),
           ("fixed state", lambda d: float(d) ** -0.25, False, lambda d: d))
from .sweep import to_json


def _sizes(ctx):
    """(d, n_pairs, seeds)."""
    return ctx.pick(
        tiny=(4, [2, 4, 8, 16], 2),
        quick=(16, [4, 8, 16, 32, 64, 128, 256], 5),
        full=(64, [20, 40, 60, 80, 100, 150, 200, 250, 300, 400, 500, 600], 5),  # Schlag et al. setting 1
    )


#: The label suffix of a map read out unnormalised (signed features: its normaliser can be 0 or negative).
UNNORMALISED = " [unnormalised read-out]"

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

    Raises
    ------
    ValueError
        A value below its least, an unknown map, or a ``dim``, ``n`` or ``m`` whose point would form an
        array of more than ``config.QUADRATIC_MAX_ELEMENTS`` numbers (n x n one-hot values, n x d keys,
        n x D_φ features, the D_φ x M state, a random map's m x d projection).
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
        twice = sorted({x for x in n_pairs if n_pairs.count(x) > 1})
        if twice:  # one column of the tables each: a value given twice is refused, as a grid refuses it
            raise ValueError(f"recall study: n holds {', '.join(map(str, twice))} more than once, got {n!r}; "
                             "give each number of pairs once")
    if seeds is not None:
        if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
            raise ValueError(f"recall study: seeds must be an integer >= 1, got {seeds!r}")
        nseeds = seeds
    if isinstance(maps, str):
        raise TypeError(f"recall study: maps must be a list of feature map names, got the string {maps!r} "
                        f"(for one map: [{maps!r}])")
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
    _check_sizes(chosen, d, max(n_pairs))
    return [dict(feature_map=name, num_features=nf, map_params=params, d=d, n_pairs=list(n_pairs), trials=1,
                 seed=seed, regime=regime, key_scale=scale(d), **({"orthogonal_keys": True} if ortho else {}),
                 **({} if width is None else {"value_dim": int(width(d))}))
            for regime, scale, ortho, width in REGIMES for seed in range(nseeds) for name, nf, params in chosen]


def _check_sizes(chosen, d, n) -> None:
    """ValueError when a point of ``chosen`` maps at key dimension ``d`` and up to ``n`` pairs would form an
    array of more than ``config.QUADRATIC_MAX_ELEMENTS`` numbers (:func:`recall_capacity`'s n x n one-hot
    values and softmax weights, n x d keys, n x D_φ features, the D_φ x M state), before any is made."""
    widths = sorted({n if width is None else int(width(d)) for _, _, _, width in REGIMES})
    sized = []
    for name, nf, params in chosen:
        dphi, arrays = map_arrays(name, d, num_features=nf, **params)
        arrays += [("n x n one-hot values", n, n), ("n x d keys", n, d), ("n x D_φ features", n, dphi)]
        arrays += [("n x M values", n, w) for w in widths] + [("D_φ x M state", dphi, w) for w in widths]
        sized.append((f"dim = {d}, n = {n}, map {map_label(name, nf, params)} (D_φ = {dphi})", arrays))
    check_point_size("recall", sized)


def with_dim(point: dict, d: int) -> dict:
    """``point`` at key dimension ``d``: its regime's key scale and value width follow ``d`` (the
    ``--dim`` option)."""
    p = dict(point, d=d)
    for name, scale, _, width in REGIMES:
        if p.get("regime") == name:
            p["key_scale"] = scale(d)
            if width is not None:
                p["value_dim"] = int(width(d))
    return p


def run(feature_map, num_features, map_params, d, n_pairs, trials, seed=0, regime="variance",
        key_scale=1.0, orthogonal_keys=False, value_dim=None) -> dict:
    """One map and seed over every n (orthonormal keys: the n <= d, else d alone); one-hot values, or
    Gaussian values of width ``value_dim``."""
    from ..analysis import recall_capacity

    fmap = build_map(feature_map, dim=d, num_features=num_features, seed=seed, **map_params)
    kw = {"orthogonal_keys": True} if orthogonal_keys else {}
    if value_dim is not None:
        kw["value_dim"] = value_dim
    ns = ([x for x in n_pairs if x <= d] or [d]) if orthogonal_keys else n_pairs
    # a map of signed features (l2, rff, identity) can give a key a normaliser at or below eps, and then
    # recall_capacity refuses the normalised read-out: such maps read phi(k)^T S, as the MQAR study does
    normalize = None if getattr(fmap, "is_positive", False) else False
    res = to_json(recall_capacity(fmap, d, np.asarray(ns), trials=trials, seed=seed, key_scale=key_scale,
                                  normalize=normalize, **kw))
    res["readout"] = "unnormalised" if normalize is False else "normalised"
    res["d_phi"] = int(fmap.output_dim(d))
    res["estimator"] = ("random" if is_random(feature_map) else "deterministic") if getattr(
        fmap, "estimates_softmax", False) else ""
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
        label = map_label(p["feature_map"], p["num_features"], p["map_params"])
        if r["result"].get("readout") == "unnormalised":
            label += UNNORMALISED
        groups.setdefault((p.get("regime", "variance"), label), []).append(r)
    regimes = list(dict.fromkeys(k[0] for k in groups))
    if ok:
        p0 = ok[0]["params"]
        d = p0["d"]
        seeds = sorted({r["params"]["seed"] for r in ok})
        scales = {k[0]: groups[k][0]["params"].get("key_scale", 1.0) for k in groups}
        ortho = {k[0]: bool(groups[k][0]["params"].get("orthogonal_keys")) for k in groups}
        grids = {k[0]: groups[k][0]["result"]["n_pairs"] for k in groups}
        widths = {k[0]: groups[k][0]["params"].get("value_dim") for k in groups}
        md.append(f"Regime: n key-value pairs in R^{d} (d = {d}) stored and every key read back (non-causal, q = k); "
                  "a read-out is right when it is nearest (Euclidean) to its own stored value; softmax baseline at "
                  f"temperature 1/√d; random maps with the m in their label; {seeds_text(len(seeds))} "
                  f"(a seed draws the keys, values and random features), {p0['trials']} trial(s) each; "
                  f"cells are {CI_CAPTION}.  "
                  f"{len(regimes)} regimes: "
                  + "; ".join(_regime_text(reg, scales[reg], ortho[reg], d, grids[reg], widths[reg]) for reg in regimes)
                  + ".  The larger the self-logit, the larger the variance of a random-feature estimate of "
                    "exp(q·k/√d).  Orthonormal keys (at most d of them) have equal norms and zero cross logits, "
                    "so softmax, and any kernel increasing in q·k, weighs each key's own pair most.  One-hot values "
                    "have width M = n, so the state (D_φ × M numbers) grows with n; Gaussian values of a fixed width "
                    "keep it at D_φ × M, and only there can n outgrow it.  Relative retrieval error "
                    "‖V̂ − V‖²/‖V‖² of linear attention's normalised read-out (the unnormalised φ(k)ᵀS for maps of "
                    f"signed features, marked \"{UNNORMALISED.strip()}\"), of the best state of the same size "
                    "(least squares; the capacity floor: 0 up to n = D_φ) and of softmax attention.")
        agg = {}
        for reg in regimes:
            rows = []
            for (reg2, label), recs in groups.items():
                if reg2 != reg:
                    continue
                res0 = recs[0]["result"]
                n = np.asarray(res0["n_pairs"], dtype=float)
                dphi = res0["d_phi"]
                fields = ("accuracy", "mse", "optimal_mse", "softmax_accuracy", "softmax_mse", "optimal_accuracy")
                stack = {f: np.asarray([np.asarray(r["result"][f], dtype=float) for r in recs])
                         for f in fields if all(f in r["result"] for r in recs)}
                stack["optimal_mse"][np.abs(stack["optimal_mse"]) < 1e-12] = 0.0  # round-off of an exact fit
                stats = {f: mean_ci(x) for f, x in stack.items()}
                agg[(reg, label)] = (n, dphi, stats, res0.get("estimator", ""))
                at = int(np.argmin(np.abs(n - 2 * dphi)))
                first = _first_below(n, stats["accuracy"][0])
                first_opt = _first_below(n, stats["optimal_accuracy"][0]) if "optimal_accuracy" in stats else "–"
                rows.append([label, dphi, first, first_opt, pm(stats["accuracy"][0][0], stats["accuracy"][1][0]),
                             int(n[at])]
                            + [pm(stats[f][0][at], stats[f][1][at]) for f in ("mse", "optimal_mse", "softmax_mse")])
            md += ["", f"**{reg} regime** (s = {fmt(scales[reg])}, {_values_text(widths[reg])}): accuracy at the "
                       f"smallest n ({int(n[0])}); the first n whose mean accuracy is below {ACCURACY} (\"≤ n\" when "
                       "already the smallest n is), of the map's read-out and of the least-squares state of its "
                       "size; errors at the measured n closest to 2·D_φ:", "",
                   markdown_table(["feature map", "D_φ", f"first n with accuracy < {ACCURACY}",
                                   "the same, least-squares state", f"accuracy at n = {int(n[0])}", "n", "error",
                                   "optimal error (floor)", "softmax error"], rows)]
        fixed = {reg for reg in regimes if widths[reg] is not None}
        md += ["", "What it shows (computed from the tables above):", ""] + _findings(agg, regimes, fixed=fixed)
        if ctx.plots:
            md += _plot(agg, regimes, seeds, ctx)
    md += failed_md
    return Rendered("\n".join(md), f"{len(groups)} feature maps and regimes", problems)


def _values_text(width) -> str:
    return "one-hot values, M = n" if width is None else f"Gaussian values of fixed width M = {width}"


def _regime_text(reg, s, ortho, d, grid, width=None) -> str:
    keys = "the rows of a random orthogonal frame" if ortho else "i.i.d. N(0, 1) entries"
    logit = f"= {fmt(s * s / np.sqrt(d))}" if ortho else f"≈ {fmt(s * s * np.sqrt(d))}"
    return (f"**{reg}**: keys {keys} times s = {fmt(s)}, self-logit ‖k‖²/√d {logit}, {_values_text(width)}, "
            f"n ∈ {{{', '.join(map(str, grid))}}}")


def _plot(agg, regimes, seeds, ctx) -> list:
    fig, axes = ctx.figure(ncols=2, nrows=len(regimes), width=4.4, height=3.4)  # a row per regime
    for r_i, reg in enumerate(regimes):
        ax1, ax2 = axes[2 * r_i], axes[2 * r_i + 1]
        items = [(label, v) for (reg2, label), v in agg.items() if reg2 == reg]
        for i, (label, (n, dphi, stats, _)) in enumerate(items):
            sty = ctx.style(i)
            x = n / dphi
            for ax, f in ((ax1, "mse"), (ax2, "accuracy")):
                m, s = stats[f]
                ax.plot(x, m, ms=4, label=f"{label} (D_φ = {dphi})", **sty)
                hi = 1.0 if f == "accuracy" else np.inf  # bands clipped to the possible range
                ax.fill_between(x, np.clip(m - s, 0.0, hi), np.clip(m + s, 0.0, hi), color=sty["color"],
                                alpha=0.2, lw=0)
            ax1.plot(x, stats["optimal_mse"][0], "--", color=sty["color"], lw=1, label="_")
            if "optimal_accuracy" in stats:
                ax2.plot(x, stats["optimal_accuracy"][0], "--", color=sty["color"], lw=1, label="_")
        ax1.set(xlabel="n / D_φ", ylabel="relative retrieval error", title=f"{reg}: error (dashed: floor)")
        ax2.axhline(ACCURACY, color="0.5", lw=0.8)
        ax2.set(xlabel="n / D_φ", ylabel="nearest-value accuracy", title=f"{reg}: accuracy (dashed: least squares)")
        for ax in (ax1, ax2):
            ax.set_xscale("log")
            ax.grid(True, alpha=0.3)
    ctx.legend_outside(fig, axes, title=f"mean, 95% CI over {seeds_text(len(seeds))}")
    return ["", ctx.savefig(fig, "recall", "recall error and accuracy against n / D_phi in every regime"),
            "", f"{CI_CAPTION}; dashed: the least-squares state of each map's size (its error is the floor)."]


def _findings(agg, regimes, fixed=()) -> list:
    """Per map and regime, whether its first fall below ACCURACY is capacity (``capacity_claim``), then the
    regimes in which capacity binds, for the map's read-out and for the least-squares state, and the
    read-out's error against the floor.  ``fixed``: the regimes whose values have a fixed width (the others
    have one-hot values, M = n)."""
    out, binds, ls_binds = [], {}, {}
    for reg in regimes:
        for (reg2, label), (n, dphi, stats, est) in agg.items():
            if reg2 != reg:
                continue
            c = capacity_claim(n, stats["accuracy"][0], stats["accuracy"][1], stats["optimal_mse"][0], dphi,
                               reference=stats["softmax_accuracy"][0], estimator=est, threshold=ACCURACY)
            if not out:
                out.append(f"Rule: {c.rule}.")
            out.append(f"- {label}, {reg} regime: capacity {c.verdict}: {c.text}.")
            binds.setdefault(reg, []).extend([label] if c.supported else [])
    for reg, labels in binds.items():
        out.append(f"- {reg} regime: capacity binds for " + (", ".join(labels) if labels else "no map") + ".")
    for (reg, label), (n, dphi, stats, _) in agg.items():
        if reg in fixed and "optimal_accuracy" in stats:
            acc = stats["optimal_accuracy"][0]
            c = capacity_claim(n, acc, stats["optimal_accuracy"][1], stats["optimal_mse"][0], dphi, threshold=ACCURACY)
            first = n[np.nonzero(acc < ACCURACY)[0][0]] if c.supported else None
            where = (f"{label} (D_φ = {dphi}, first below at n = {int(first)} = {fmt(first / dphi)} D_φ)"
                     if c.supported else f"{label} ({c.verdict}: {c.text})")
            ls_binds.setdefault(reg, ([], [], []))[0 if c.supported else 1].append(where)
            if c.supported:
                ls_binds[reg][2].append((dphi, first))
    for reg, (yes, no, points) in ls_binds.items():
        early = [label for (reg2, label), (n, dphi, stats, _) in agg.items() if reg2 == reg
                 and any(a < ACCURACY and not state_full(n[j], stats["optimal_mse"][0][j], dphi)
                         for j, a in enumerate(stats["accuracy"][0]))]
        rank_short = [label for (reg2, label), (n, dphi, stats, _) in agg.items() if reg2 == reg
                      and any(n[j] <= dphi and f > FLOOR_ZERO for j, f in enumerate(stats["optimal_mse"][0]))]
        points.sort()
        moves = ""
        if len({dp for dp, _ in points}) > 1:
            later = all(f1 <= f2 for (_, f1), (_, f2) in zip(points, points[1:]))
            moves = ("  Across these maps a larger D_φ never brings the fall earlier: the state's size sets it."
                     if later else "  Across these maps the fall does not move monotonically with D_φ.")
        out.append(f"- {reg} regime, the least-squares state of each map's size (the best state any rule could write "
                   f"into D_φ × M numbers): capacity binds for " + ("; ".join(yes) if yes else "no map")
                   + (f"; not for {'; '.join(no)}" if no else "") + ".  With values of a fixed width that state is "
                   "exact while the map's features of the n keys have rank n (up to n = D_φ for features of full "
                   f"rank) and falls below {ACCURACY} only once its floor is above 0, at the n given." + moves
                   + (f"  For {', '.join(rank_short)} the floor is above 0 already at some n ≤ D_φ: the map's "
                      "features of these random keys have rank below n there." if rank_short else "")
                   + (f"  The read-out of {', '.join(early)} falls before its state is full: crosstalk "
                      "between the keys in its sum, not the state's size, limits it." if early else ""))
    passes = []
    for (reg, label), (n, dphi, stats, _) in agg.items():
        ok = np.nonzero(stats["optimal_accuracy"][0] >= ACCURACY)[0] if "optimal_accuracy" in stats else []
        if reg not in fixed and len(ok) and n[ok[-1]] > dphi:
            passes.append(f"{label}, {reg}: n = {int(n[ok[-1]])} = {fmt(n[ok[-1]] / dphi)} D_φ")
    if passes:
        out.append("- With one-hot values the least-squares state, which stores as many pairs exactly as its "
                   "features' rank (up to D_φ), still reads "
                   f"≥ {ACCURACY} past D_φ (largest such n): " + "; ".join(passes) + ".  One-hot values have width "
                   "M = n, so the state (D_φ × n) grows with the pairs it holds; argmax accuracy there does not see "
                   "the capacity limit even for the best state, the error does (the floor is 1 − D_φ/n past D_φ).")
    errs, floors = [], []
    for (reg, label), (n, dphi, stats, _) in agg.items():
        if reg in fixed or label.endswith(UNNORMALISED):  # only a normalised read-out is a weighted average
            continue
        j = int(np.argmin(np.abs(n - dphi)))
        errs.append(float(stats["mse"][0][j]))
        floors.append(float(stats["optimal_mse"][0][j]))
    if errs:
        out.append(f"- One-hot values: at the n closest to D_φ the normalised read-out's error is "
                   f"{fmt(min(errs))}–{fmt(max(errs))} across maps and regimes while the floor is {fmt(max(floors))} "
                   "at most: the read-out is a "
                   "weighted average of the one-hot values, with error 1 − 2w_ii + Σ_j w_ij² per key, 0 only when "
                   "the right pair takes all the weight.  The floor is reached by an unnormalised least-squares "
                   "read-out, not by the normalised one of any map.")
    return out


STUDY = register_study(Study(
    name="recall",
    title="Recall capacity against n / D_φ",
    command="recall",
    help="associative-recall capacity of the state against n / D_phi, with the optimal floor and softmax",
    points=points,
    run=run,
    render=render,
    figures=("recall",),
    budget_s={"tiny": 30, "quick": 10, "full": 60},
))
