"""Study: rank limits of linear attention.

For every feature map (and softmax as the contrast), across sequence lengths
N: the numerical rank of the non-causal attention weights
(:func:`linattn_nb.analysis.attention_rank`; at most D_φ for kernel maps),
the semiseparable rank of the causal weights (the largest rank of a
strictly-lower block, :func:`linattn_nb.analysis.semiseparable_rank`; at most
D_φ for kernel maps, growing with N for softmax), and the rank of the state
S_t as t grows (:func:`linattn_nb.analysis.state_rank_profile`; it saturates
at min(D_φ, M)).
"""
from __future__ import annotations

import numpy as np

from ._maps import build_map, buildable_maps, is_random, map_label
from ._study import Rendered, Study, fmt, markdown_table, register_study, split_failed

SOFTMAX = "softmax"


def _sizes(ctx):
    """(d, M, Ns, m of random maps, largest N for explicit softmax weights).

    M = 2d, so that the state rank saturates at D_φ for maps with D_φ < M and at
    M for the others: both sides of min(D_φ, M) show.
    """
    return ctx.pick(
        tiny=(4, 8, [16, 48], 8, 64),
        quick=(8, 16, [64, 256, 1024], 16, 1024),
        full=(16, 32, [128, 512, 2048, 8192], 32, 4096),
    )


def points(ctx) -> list[dict]:
    d, m, ns, m_rand, explicit_max = _sizes(ctx)
    pts = []
    for name in buildable_maps() + [SOFTMAX]:
        nf = m_rand if name != SOFTMAX and is_random(name) else None
        for n in ns:
            if name == SOFTMAX and n > explicit_max:
                continue
            pts.append(dict(feature_map=name, num_features=nf, n=n, d=d, m=m, seed=0))
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


def render(records, ctx) -> Rendered:
    ok, failed, problems, failed_md = split_failed("rank", records)
    series: dict = {}
    for r in ok:
        p = r["params"]
        series.setdefault((p["feature_map"], p["num_features"]), {})[p["n"]] = r["result"]
    ns = sorted({r["params"]["n"] for r in ok})
    md = []
    if ok:
        p0 = ok[0]["params"]
        md.append(f"Gaussian q, k (d = {p0['d']}) and v (M = {p0['m']}), one head. Attention rank: "
                  "non-causal weights; semiseparable rank: largest rank of a strictly-lower block of "
                  "the causal weights. Both are bounded by D_φ for kernel maps.")
        rows = []
        for (name, m), by_n in series.items():
            dphi = next(iter(by_n.values()))["d_phi"]
            cells = []
            for n in ns:
                res = by_n.get(n)
                cells.append("–" if res is None else
                             f"{res['attention_rank']} / {fmt(res['semiseparable_rank'])}")
                if res is not None and dphi is not None:
                    for key in ("attention_rank", "semiseparable_rank"):
                        if res[key] is not None and res[key] > dphi:
                            problems.append(f"rank: {map_label(name, m)} at N = {n}: {key} {res[key]} > D_φ = {dphi}")
            rows.append([map_label(name, m), fmt(dphi)] + cells)
        md += ["", "Attention rank / semiseparable rank:", "",
               markdown_table(["feature map", "D_φ", *[f"N = {n}" for n in ns]], rows)]
        if ctx.plots:
            fig, (ax1, ax2) = ctx.figure(ncols=2)
            for i, ((name, m), by_n) in enumerate(series.items()):
                xs = sorted(by_n)
                ax1.loglog(xs, [max(by_n[x]["attention_rank"], 1) for x in xs], marker="o", label=map_label(name, m),
                           **ctx.style(i))
            ax1.set(xlabel="sequence length N", ylabel="numerical rank", title="Rank of non-causal weights")
            ax1.legend(fontsize="x-small")
            n_top = ns[-1]
            for i, ((name, m), by_n) in enumerate(series.items()):
                res = by_n.get(n_top)
                if res and res.get("state_positions"):
                    ax2.semilogx(res["state_positions"], res["state_rank"], label=map_label(name, m),
                                 **ctx.style(i))
            ax2.set(xlabel="tokens absorbed t", ylabel="rank of S_t",
                    title=f"State rank (N = {n_top}, M = {p0['m']}): saturates at min(D_φ, M)")
            if ax2.lines:
                ax2.legend(fontsize="x-small")
            for ax in (ax1, ax2):
                ax.grid(True, which="both", alpha=0.3)
            md += ["", ctx.savefig(fig, "rank", "attention rank against N and state rank profile")]
    md += failed_md
    return Rendered("\n".join(md), f"{len(ok)} points", problems)


STUDY = register_study(Study(
    name="rank",
    title="Rank limits: attention, semiseparable and state rank",
    command="rank",
    help="attention rank, semiseparable rank and state rank profile for every feature map",
    points=points,
    run=run,
    render=render,
))
