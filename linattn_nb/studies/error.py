"""Study: approximation error of linear attention against softmax attention.

For every registered feature map (random maps across their number of
features m), across sequence lengths N: the relative error of the output
against :func:`linattn_nb.softmax_attention` and the row-wise divergences of
the attention weights, from :func:`linattn_nb.analysis.approximation_error`
(Gaussian q, k, v, one head of dimension d; every map that estimates the
softmax kernel estimates ``exp(q.k / sqrt(d))``).
"""
from __future__ import annotations

import numpy as np

from ._maps import build_map, buildable_maps, is_random, map_label
from ._study import Rendered, Study, fmt, markdown_table, register_study, split_failed
from .sweep import to_json

#: q and k are N(0, 1) times this: logits q.k/sqrt(d) of variance QK_SCALE**4, the regime
#: where the random-feature estimators of exp(q.k/sqrt(d)) have usable variance.
QK_SCALE = 0.5
#: Series whose error exceeds this are left out of the plots (they are in the tables).
PLOT_MAX_ERROR = 10.0

FIELDS = ("output_rel_error", "kl_mean", "tv_mean", "entropy_softmax", "entropy_linear",
          "monotonicity", "nonpositive_normalizer_rate")


def _sizes(ctx):
    """(d, Ns, m for the N sweep, ms for the m sweep, causal modes)."""
    return ctx.pick(
        tiny=(8, [32, 64], 16, [8, 16], [False]),
        quick=(16, [256, 1024], 64, [16, 64, 256], [False]),
        full=(16, [256, 1024, 4096], 64, [8, 16, 32, 64, 128, 256, 512], [False, True]),
    )


def points(ctx) -> list[dict]:
    d, ns, m_default, ms, modes = _sizes(ctx)
    pts = []
    for name in buildable_maps():
        rand = is_random(name)
        for causal in modes:
            for n in ns:
                pts.append(dict(feature_map=name, num_features=m_default if rand else None, n=n, d=d,
                                causal=causal, qk_scale=QK_SCALE, seed=0))
            if rand:  # the m sweep at the middle N
                n_mid = ns[len(ns) // 2]
                pts += [dict(feature_map=name, num_features=m, n=n_mid, d=d, causal=causal,
                             qk_scale=QK_SCALE, seed=0) for m in ms if m != m_default]
    return pts


def run(feature_map, num_features, n, d, causal, qk_scale=QK_SCALE, seed=0) -> dict:
    """approximation_error of one map on Gaussian q, k (times ``qk_scale``) and v of shape (1, n, d)."""
    from ..analysis import approximation_error

    fmap = build_map(feature_map, dim=d, num_features=num_features, seed=seed)
    rng = np.random.default_rng([seed, n, d])
    q, k, v = (rng.standard_normal((1, n, d)) for _ in range(3))
    q, k = q * qk_scale, k * qk_scale
    res = to_json(approximation_error(q, k, v, fmap, causal=causal))
    if not isinstance(res, dict):
        res = {"output_rel_error": res}
    res["d_phi"] = int(fmap.output_dim(d))
    return res


def render(records, ctx) -> Rendered:
    ok, failed, problems, failed_md = split_failed("error", records)
    md = []
    if ok:
        d, s = ok[0]["params"]["d"], ok[0]["params"].get("qk_scale", 1.0)
        md.append(f"q, k ~ {s}·N(0, I), v ~ N(0, I), one head, d = {d}; softmax temperature 1/√d. "
                  "Output error: ‖o_linear − o_softmax‖_F / ‖o_softmax‖_F. "
                  "Random maps use m features in the N sweep and are swept over m at the middle N.")
    for causal in sorted({r["params"]["causal"] for r in ok}):
        sub = [r for r in ok if r["params"]["causal"] == causal]
        ns = sorted({r["params"]["n"] for r in sub})
        m_of = {}
        for r in sub:  # the m used in the N sweep = the m present at every N
            p = r["params"]
            m_of.setdefault(p["feature_map"], {}).setdefault(p["num_features"], set()).add(p["n"])
        series = {}
        for r in sub:
            p = r["params"]
            if len(m_of[p["feature_map"]][p["num_features"]]) == len(ns):
                series.setdefault((p["feature_map"], p["num_features"]), {})[p["n"]] = r["result"]
        mode = "causal" if causal else "non-causal"
        rows = [[map_label(name, m), fmt(next(iter(by_n.values()))["d_phi"])]
                + [fmt(by_n[n]["output_rel_error"]) if n in by_n else "–" for n in ns]
                for (name, m), by_n in series.items()]
        md += ["", f"**{mode}**: output relative error against N", "",
               markdown_table(["feature map", "D_φ", *[f"N = {n}" for n in ns]], rows)]
        n_top = ns[-1]
        rows = [[map_label(name, m)] + [fmt(by_n[n_top].get(f)) for f in FIELDS]
                for (name, m), by_n in series.items() if n_top in by_n]
        md += ["", f"All measures at N = {n_top} ({mode}):", "", markdown_table(["feature map", *FIELDS], rows)]
        if ctx.plots:
            fig, (ax1, ax2) = ctx.figure(ncols=2)
            left_out = []
            for i, ((name, m), by_n) in enumerate(series.items()):
                xs = sorted(by_n)
                ys = [by_n[x]["output_rel_error"] for x in xs]
                if not all(np.isfinite(ys)) or max(ys) > PLOT_MAX_ERROR:
                    left_out.append(map_label(name, m))
                    continue
                ax1.loglog(xs, ys, marker="o", label=map_label(name, m), **ctx.style(i))
            ax1.set(xlabel="sequence length N", ylabel="output relative error", title=f"Error against N ({mode})")
            ax1.legend(fontsize="x-small")
            n_mid = ns[len(ns) // 2]
            for i, name in enumerate(sorted({p for p, _ in series})):
                by_m = {r["params"]["num_features"]: r["result"] for r in sub
                        if r["params"]["feature_map"] == name and r["params"]["num_features"] is not None
                        and r["params"]["n"] == n_mid}
                xs = sorted(by_m)
                ys = [by_m[x]["output_rel_error"] for x in xs]
                if len(xs) > 1 and all(np.isfinite(ys)) and max(ys) <= PLOT_MAX_ERROR:
                    ax2.loglog(xs, ys, marker="o", label=name, **ctx.style(i))
                    ax2.loglog(xs, [ys[0] * (xs[0] / x) ** 0.5 for x in xs], ":", color="gray", lw=1)
            ax2.set(xlabel="random features m", ylabel="output relative error",
                    title=f"Random maps against m (N = {n_mid}; dotted: ∝ 1/√m)")
            if ax2.lines:
                ax2.legend(fontsize="x-small")
            for ax in (ax1, ax2):
                ax.grid(True, which="both", alpha=0.3)
            md += ["", ctx.savefig(fig, f"error_{'causal' if causal else 'noncausal'}",
                                   f"approximation error ({mode})")]
            if left_out:
                md += ["", f"Not plotted (error above {fmt(PLOT_MAX_ERROR)} or not finite: signed features "
                           f"whose normaliser can be <= 0, see `nonpositive_normalizer_rate`): "
                           f"{', '.join(left_out)}."]
    md += failed_md
    return Rendered("\n".join(md), f"{len(ok)} points", problems)


STUDY = register_study(Study(
    name="error",
    title="Approximation error against softmax",
    command="error",
    help="approximation error against softmax attention for every feature map, across N and m",
    points=points,
    run=run,
    render=render,
))
