"""Study: associative-recall capacity of the fixed-size state against n / D_φ.

After Schlag, Irie & Schmidhuber 2021, §4.1 (training-free): n key-value
pairs (Gaussian keys in R^d, one-hot values) are written into the state and
every key is queried.  :func:`linattn_nb.analysis.recall_capacity` returns the
argmax accuracy and the relative retrieval error of linear attention's
read-out, the least-squares floor of any state of the same size
(1 − D_φ/n beyond n = D_φ) and softmax attention (a KV cache) as the
baseline.  The report shows all three: argmax accuracy alone hides the
capacity limit.
"""
from __future__ import annotations

import numpy as np

from ._maps import build_map, is_random, map_label
from ._study import Rendered, Study, fmt, markdown_table, register_study, split_failed
from .sweep import to_json


def _sizes(ctx):
    """(d, n_pairs, trials)."""
    return ctx.pick(
        tiny=(4, [2, 4, 8, 16], 1),
        quick=(16, [4, 8, 16, 32, 64, 128, 256], 2),
        full=(64, [20, 40, 60, 80, 100, 150, 200, 250, 300, 400, 500, 600], 3),  # Schlag et al. setting 1
    )


def _maps():
    from .. import feature_maps as fm

    maps = [("elu", None, {}), ("dpfp", None, {"nu": 1}), ("dpfp", None, {"nu": 2}), ("dpfp", None, {"nu": 3})]
    for name in ("favor+", "taylor2"):
        if name in fm.available():
            maps.append((name, 128 if is_random(name) else None, {}))
    return maps


def points(ctx) -> list[dict]:
    d, n_pairs, trials = _sizes(ctx)
    return [dict(feature_map=name, num_features=m, map_params=params, d=d, n_pairs=n_pairs,
                 trials=trials, seed=0) for name, m, params in _maps()]


def run(feature_map, num_features, map_params, d, n_pairs, trials, seed=0) -> dict:
    from ..analysis import recall_capacity

    fmap = build_map(feature_map, dim=d, num_features=num_features, seed=seed, **map_params)
    res = to_json(recall_capacity(fmap, d, np.asarray(n_pairs), trials=trials, seed=seed))
    res["d_phi"] = int(fmap.output_dim(d))
    return res


def render(records, ctx) -> Rendered:
    ok, failed, problems, failed_md = split_failed("recall", records)
    md = []
    if ok:
        p0 = ok[0]["params"]
        md.append(f"Keys i.i.d. N(0, 1) in R^{p0['d']}, one-hot values, {p0['trials']} trial(s) per n. "
                  "Relative retrieval error ‖V̂ − V‖²/‖V‖² of linear attention's read-out, of the best "
                  "state of the same size (least squares), and of softmax attention.")
        rows = []
        for r in ok:
            p, res = r["params"], r["result"]
            n = np.asarray(res["n_pairs"], dtype=float)
            dphi = res["d_phi"]
            acc = np.asarray(res["accuracy"], dtype=float)
            below = n[acc < 0.9]
            at = int(np.argmin(np.abs(n - 2 * dphi)))
            rows.append([map_label(p["feature_map"], p["num_features"], p["map_params"]), dphi,
                         fmt(float(below[0])) if below.size else f"> {int(n[-1])}",
                         int(n[at]), fmt(float(res["mse"][at])), fmt(float(res["optimal_mse"][at])),
                         fmt(float(res["softmax_mse"][at]))])
        md += ["", "Errors at the measured n closest to 2·D_φ:", "",
               markdown_table(["feature map", "D_φ", "first n with accuracy < 0.9", "n",
                               "error", "optimal error", "softmax error"], rows)]
        if ctx.plots:
            fig, (ax1, ax2) = ctx.figure(ncols=2)
            for i, r in enumerate(ok):
                p, res = r["params"], r["result"]
                x = np.asarray(res["n_pairs"], dtype=float) / res["d_phi"]
                label = map_label(p["feature_map"], p["num_features"], p["map_params"])
                color = ctx.style(i)["color"]
                ax1.plot(x, res["mse"], "o-", ms=3, label=label, color=color)
                ax1.plot(x, res["optimal_mse"], "--", color=color, lw=1)
                ax2.plot(x, res["accuracy"], "o-", ms=3, color=color, label=label)
            res = ok[0]["result"]
            x = np.asarray(res["n_pairs"], dtype=float) / res["d_phi"]
            ax1.plot(x, res["softmax_mse"], "k:", label=f"softmax, KV cache (x = n / {res['d_phi']})")
            ax1.set(xlabel="n / D_φ", ylabel="relative retrieval error",
                    title="Recall error (dashed: optimal state)")
            ax2.set(xlabel="n / D_φ", ylabel="argmax accuracy", title="Recall accuracy")
            ax1.legend(fontsize="x-small")
            for ax in (ax1, ax2):
                ax.grid(True, alpha=0.3)
            md += ["", ctx.savefig(fig, "recall", "recall error and accuracy against n / D_phi")]
    md += failed_md
    return Rendered("\n".join(md), f"{len(ok)} feature maps", problems)


STUDY = register_study(Study(
    name="recall",
    title="Recall capacity against n / D_φ",
    command="recall",
    help="associative-recall capacity of the state against n / D_phi, with the optimal floor and softmax",
    points=points,
    run=run,
    render=render,
))
