"""Study: rank limits of linear attention.

Attention rank, semiseparable rank and the state rank profile for every feature map and softmax,
across N (docs/guide/studies.md).
"""
from __future__ import annotations

import numpy as np

from ._maps import build_map, buildable_maps, is_random, map_arrays, map_label
from ._study import (CI_CAPTION, Rendered, Study, check_point_size, fmt, markdown_table, mean_ci, pm,
                     register_study, seeds_text, split_failed)

SOFTMAX = "softmax"


def _sizes(ctx):
    """(d, Ns, m of random maps, largest N for explicit softmax weights, seeds)."""
    return ctx.pick(
        tiny=(4, [16, 48], 8, 64, 2),
        quick=(8, [64, 256, 1024], 16, 256, 5),
        full=(16, [128, 512, 2048, 8192], 32, 512, 5),
    )


def _dphi(name, d, m_rand) -> int:
    # built without dim: a random map draws nothing until it sees the inputs (D_φ is m, or 2m, whatever d)
    return map_arrays(name, d, num_features=m_rand if is_random(name) else None)[0]


def points(ctx, *, dim=None, maps=None, m=None, n=None, seeds=None, value_dim=None) -> list[dict]:
    """The sweep grid.

    Parameters
    ----------
    ctx : Context
    dim : int, optional
        Head dimension d of q, k (default 16; 8 quick, 4 tiny).
    maps : list of str, optional
        Feature maps (default every registered map that builds from d alone); softmax is always added.
    m : int or list of int, optional
        Random features of the random maps, one series per value (default 32; 16 quick, 8 tiny).
    n : int or list of int, optional
        Sequence lengths.
    seeds : int, optional
        Number of seeds 0..seeds-1 (default 5; 2 tiny); a seed draws q, k, v and the random features.
    value_dim : int, optional
        Value dimension M of the state-rank profile; default (and least value, else ValueError) the
        largest D_φ of the maps.

    Raises
    ------
    ValueError
        A value below its least, an unknown map, or a ``dim``, ``n``, ``m`` or ``value_dim`` whose point
        would form an array of more than ``config.QUADRATIC_MAX_ELEMENTS`` numbers (n x d inputs, n x M
        values, n x D_φ features, the D_φ x M state, a random map's m x d projection).
    """
    d, ns, m_rand, explicit_max, nseeds = _sizes(ctx)
    if dim is not None:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"rank study: dim must be an integer >= 1, got {dim!r}")
        d = dim
    ms = [m_rand]
    if m is not None:
        ms = list(dict.fromkeys(m)) if isinstance(m, (list, tuple)) else [m]
        if not ms or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in ms):
            raise ValueError(f"rank study: m must be an integer >= 1 or a list of them, got {m!r}")
    if n is not None:
        ns = sorted(n if isinstance(n, (list, tuple)) else [n])
        if not ns or any(isinstance(x, bool) or not isinstance(x, int) or x < 2 for x in ns):
            raise ValueError(f"rank study: n must hold integers >= 2, got {n!r}")
    if seeds is not None:
        if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
            raise ValueError(f"rank study: seeds must be an integer >= 1, got {seeds!r}")
        nseeds = seeds
    if isinstance(maps, str):
        raise TypeError(f"rank study: maps must be a list of feature map names, got the string {maps!r} "
                        f"(for one map: [{maps!r}])")
    known = buildable_maps()
    names = buildable_maps(defaults=True) if maps is None else [x for x in maps if x != SOFTMAX]
    for name in names:
        if name not in known:
            raise ValueError(f"rank study: unknown or unbuildable feature map {name!r} in maps; "
                             f"choose from {', '.join(sorted(known))}")
    # (map, its number of random features): one series per m for a random map
    series = [(name, nf) for name in names for nf in (ms if is_random(name) else [None])]
    max_dphi = max((_dphi(name, d, nf) for name, nf in series), default=d)
    mv = max_dphi if value_dim is None else value_dim
    if isinstance(mv, bool) or not isinstance(mv, int) or mv < max_dphi:
        raise ValueError(f"rank study: value_dim must be an integer >= the largest D_φ ({max_dphi}), got {mv!r}")
    nmax, sized = max(ns), []
    for name, nf in series:
        # q, k (n x d), v (n x M), the n x D_φ features, their D_φ x D_φ R factors, the D_φ x M state
        # (M >= D_φ); softmax's n x n weights only up to the profile's small explicit_max
        dphi, arrays = map_arrays(name, d, num_features=nf)
        arrays += [("n x d queries", nmax, d), ("n x M values", nmax, mv), ("n x D_φ features", nmax, dphi),
                   ("D_φ x M state", dphi, mv)]
        sized.append((f"dim = {d}, n = {nmax}, value_dim = {mv}, map {name} (D_φ = {dphi})", arrays))
    check_point_size("rank", sized)
    pts = []
    for seed in range(nseeds):
        for name, nf in series + [(SOFTMAX, None)]:
            for nn in ns:
                # softmax: explicit N x N weights, full rank for inputs in general position whatever the
                # draw (its semiseparable rank costs O(N^3)): small N and one seed
                if name == SOFTMAX and (nn > explicit_max or seed > 0):
                    continue
                pts.append(dict(feature_map=name, num_features=nf, n=nn, d=d, m=mv, seed=seed))
    return pts


def _as_int(x):
    return int(np.asarray(x).reshape(-1)[0])


def run(feature_map, num_features, n, d, m, seed=0) -> dict:
    """Ranks for one map on Gaussian (q, k, v) of shape (n, d), (n, m)."""
    from ..analysis import attention_rank, semiseparable_rank, state_rank_profile

    fmap = SOFTMAX if feature_map == SOFTMAX else build_map(feature_map, dim=d, num_features=num_features,
                                                             seed=seed)
    rng = np.random.default_rng([seed, n, d])
    q, k = (rng.standard_normal((n, d)) for _ in range(2))
    v = rng.standard_normal((n, m))
    res = {"d_phi": None if fmap == SOFTMAX else int(fmap.output_dim(d)),
           "attention_rank": _as_int(attention_rank(q, k, fmap, causal=False))}
    res["semiseparable_rank"] = _as_int(semiseparable_rank(q, k, fmap))
    if fmap != SOFTMAX:
        positions = np.unique(np.geomspace(1, n, num=min(n, 24)).astype(int))
        prof = state_rank_profile(k, v, fmap, positions=positions)
        res["state_positions"] = np.asarray(prof.positions).tolist()
        res["state_rank"] = np.asarray(prof.rank).reshape(-1).tolist()
        res["state_max_rank"] = int(prof.max_rank)
    return res


def _cell(values) -> str:
    """One integer when every seed gives it, else the mean ± the 95% Student-t half-width over the seeds."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "–"
    if min(vals) == max(vals):
        return str(vals[0])
    return pm(*mean_ci(np.asarray(vals, dtype=float)))


def render(records, ctx) -> Rendered:
    ok, failed, problems, failed_md = split_failed("rank", records)
    series: dict = {}
    for r in ok:
        p = r["params"]
        series.setdefault((p["feature_map"], p["num_features"]), {}).setdefault(p["n"], {})[p["seed"]] = r["result"]
    ns = sorted({r["params"]["n"] for r in ok})
    seeds = sorted({r["params"]["seed"] for r in ok})
    md = []
    explicit = max((r["params"]["n"] for r in ok if r["params"]["feature_map"] == SOFTMAX), default=0)
    if ok:
        p0 = ok[0]["params"]
        md.append(f"Regime: q, k ~ N(0, I) in R^{p0['d']} (one head; softmax temperature 1/√d), v ~ N(0, I) in "
                  f"R^{p0['m']} (M = {p0['m']}, the largest D_φ, so that every map's state rank can reach its D_φ); "
                  f"N ∈ {{{', '.join(map(str, ns))}}}; {seeds_text(len(seeds))} (a seed draws q, k, v and the random "
                  f"features; softmax: seed 0 and N ≤ {explicit}, its explicit weights full-rank for any draw).  "
                  f"A cell is an integer when every seed gives that rank, else the {CI_CAPTION}.  Attention rank: "
                  "non-causal weights; semiseparable rank: largest rank of a strictly-lower block of "
                  "the causal weights. Both are bounded by D_φ for kernel maps.")
        rows = []
        for (name, m), by_n in series.items():
            dphi = next(iter(next(iter(by_n.values())).values()))["d_phi"]
            cells = []
            for n in ns:
                per = by_n.get(n, {})
                if not per:
                    cells.append("–")
                    continue
                cells.append(f"{_cell([res['attention_rank'] for res in per.values()])} / "
                             f"{_cell([res['semiseparable_rank'] for res in per.values()])}")
                if dphi is not None:
                    for seed, res in per.items():
                        for key in ("attention_rank", "semiseparable_rank"):
                            if res[key] is not None and res[key] > dphi:
                                problems.append(f"rank: {map_label(name, m)} at N = {n}, seed {seed}: {key} "
                                                f"{res[key]} > D_φ = {dphi}")
            rows.append([map_label(name, m), fmt(dphi)] + cells)
        md += ["", "Attention rank / semiseparable rank:", "",
               markdown_table(["feature map", "D_φ", *[f"N = {n}" for n in ns]], rows)]
        if ctx.plots:
            md += _plots(series, ns, p0, ctx)
    md += failed_md
    return Rendered("\n".join(md), f"{len(series)} maps, {seeds_text(len(seeds))}, {len(ok)} points", problems)


def _group(curves):
    """Series with identical curves share one entry: [(labels, curve)] in first-seen order."""
    groups = []
    for label, curve in curves:
        for g in groups:
            if g[1] == curve:
                g[0].append(label)
                break
        else:
            groups.append(([label], curve))
    return groups


def _plots(series, ns, p0, ctx) -> list:
    import textwrap

    fig, (ax1, ax2) = ctx.figure(ncols=2, width=4.4, height=3.8)
    curves = []
    for (name, m), by_n in series.items():
        xs = sorted(by_n)
        stats = [mean_ci(np.asarray([res["attention_rank"] for res in by_n[x].values()], dtype=float)) for x in xs]
        curves.append(((name, m), (tuple(xs), tuple(float(a) for a, _ in stats), tuple(float(h) for _, h in stats))))
    groups = _group(curves)
    n_top = ns[-1]
    saturation = []
    for i, (members, (xs, mid, half)) in enumerate(groups):
        sty = ctx.style(i)
        label = textwrap.fill(", ".join(map_label(*mk) for mk in members), 34)
        ax1.errorbar(xs, [max(v, 1) for v in mid], yerr=half, label=label, ms=4, capsize=2, **sty)
        for mk in members:  # the state rank of every member, in its group's style
            per = series[mk].get(n_top, {})
            res = per.get(min(per)) if per else None
            if res and res.get("state_positions"):
                ax2.plot(res["state_positions"], res["state_rank"], ms=3, label="_", **sty)
                saturation.append(f"{map_label(*mk)} → {res['state_rank'][-1]} (D_φ = {res['d_phi']})")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xticks(ns)
    ax1.set(xlabel="sequence length N", ylabel="numerical rank (bars: 95% CI over seeds)",
            title="Rank of non-causal weights")
    ax2.set_xscale("log")
    ax2.set(xlabel="tokens absorbed t", ylabel="rank of S_t",
            title=f"State rank, N = {n_top}, M = {p0['m']}")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
    ctx.legend_outside(fig, [ax1], title="maps with identical rank curves")
    md = ["", ctx.savefig(fig, "rank", "attention rank against N and state rank profile")]
    if saturation:
        md += ["", f"State rank of S_t at t = N = {n_top} (seed 0; min(D_φ, M) = D_φ since M is the largest D_φ): "
                   + "; ".join(saturation) + "."]
    return md


STUDY = register_study(Study(
    name="rank",
    title="Rank limits: attention, semiseparable and state rank",
    command="rank",
    help="attention rank, semiseparable rank and state rank profile for every feature map",
    points=points,
    run=run,
    render=render,
    figures=("rank",),
    budget_s={"tiny": 30, "quick": 15, "full": 60},
))
