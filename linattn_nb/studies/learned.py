"""Study: learned feature maps against fixed ones -- how much of the gap to softmax does fitting close?

The maps, regimes, measures and sizes: docs/guide/studies.md.
"""
from __future__ import annotations

import math
import time

import numpy as np

from ._study import (CI_CAPTION, Rendered, Study, fmt, markdown_table, num, pm, register_study, seed_stat,
                     seeds_text, split_failed)
from .error import QK_SCALE
from .sweep import to_json

#: The input regimes: (name, input scale s with q, k ~ s·N(0, I), temperature factor c with scale = c/√d).
REGIMES = (
    ("benign", QK_SCALE, 1.0),
    ("gaussian", 1.0, 1.0),
    ("low-entropy", 1.0, 2.0),
)
#: The maps compared, in table order: key -> label.  "t2r*" rows need the registered "t2r" map.
MAP_LABELS = {
    "elu": "ELU+1",
    "taylor2": "Taylor-2",
    "favor+": "FAVOR+ (m = 2d)",
    "hedgehog_start": "Hedgehog, W = I (not fitted)",
    "hedgehog": "Hedgehog, fitted",
    "t2r_start": "T2R, W = [I; −I] (not fitted)",
    "t2r": "T2R, fitted",
}
#: Short names for the findings' prose.
SHORT = {"elu": "ELU+1", "taylor2": "Taylor-2", "favor+": "FAVOR+", "hedgehog_start": "unfitted Hedgehog",
         "hedgehog": "fitted Hedgehog", "t2r_start": "unfitted T2R", "t2r": "fitted T2R"}
#: The maps that are fitted (key in MAP_LABELS -> registered name).
FITTED = {"hedgehog": "hedgehog", "t2r": "t2r"}
#: The measures of the tables, from ``approximation_error``.
FIELDS = ("kl_mean", "kl_infinite_rate", "js_mean", "entropy_linear", "entropy_softmax", "monotonicity",
          "output_rel_error")
#: The fit's working precision (the dtype of the training inputs it is given).
FIT_DTYPE = "float32"


def _sizes(ctx):
    """(d, N, L-BFGS steps, seeds)."""
    return ctx.pick(
        tiny=(8, 64, 10, 2),
        quick=(16, 256, 30, 5),
        full=(16, 512, 50, 5),
    )


def t2r_available() -> bool:
    """True when the ``"t2r"`` feature map is registered (the study then fits it too)."""
    from .. import feature_maps as fm

    return "t2r" in fm.available()


def points(ctx) -> list[dict]:
    """One point per (regime, seed): a fit of each learned map and the evaluation of every map."""
    d, n, steps, nseeds = _sizes(ctx)
    t2r = t2r_available()
    return [dict(regime=name, input_scale=float(s), temperature=float(c), d=d, n=n, steps=steps, seed=seed,
                 fit_dtype=FIT_DTYPE, t2r=t2r)
            for name, s, c in REGIMES for seed in range(nseeds)]


def start_maps(d: int, *, t2r: bool = True) -> dict:
    """The learned maps' starting points: ``{"hedgehog": W = I, b = 0, "t2r": W = [I; -I], b = 0}``.

    Both have D_φ = 2d.  ``t2r=False`` leaves T2R out.
    """
    from .. import feature_maps as fm

    eye = np.eye(d)
    out = {"hedgehog": fm.get("hedgehog", W=eye, b=np.zeros(d))}
    if t2r:
        out["t2r"] = fm.get("t2r", W=np.vstack([eye, -eye]), b=np.zeros(2 * d))
    return out


def draw(seed: int, d: int, n: int, input_scale: float):
    """``(q_train, k_train, q_eval, k_eval, v_eval)``, each (1, n, d) float64; q, k scaled by ``input_scale``."""
    rng = np.random.default_rng([seed, d, n])
    qt, kt, qe, ke, ve = (rng.standard_normal((1, n, d)) for _ in range(5))
    return qt * input_scale, kt * input_scale, qe * input_scale, ke * input_scale, ve


_WARM: set = set()


def _warm_up(start, dtype) -> None:
    """One tiny fit per map and dtype and process, so that compiling the kernels is not counted as fit time."""
    from .. import feature_maps as fm

    key = (start.name, np.dtype(dtype).name)
    if key not in _WARM:
        x = np.random.default_rng(0).standard_normal((2, 1, 8, start.W.shape[1])).astype(dtype)
        fm.fit(start, x[0], x[1], steps=1, progress=False)
        _WARM.add(key)


def run(regime, input_scale, temperature, d, n, steps, seed, fit_dtype=FIT_DTYPE, t2r=True) -> dict:
    """Fit the learned maps on a training draw; measure every map on a fresh draw.

    Returns
    -------
    dict
        ``maps``: map key (:data:`MAP_LABELS`) -> the ``approximation_error`` fields plus ``d_phi``;
        ``fits``: fitted map key -> the loss before and after on the training draw (``train_start``,
        ``train_end``) and the evaluation draw (``heldout_start``, ``heldout_end``), ``steps_done``,
        ``seconds``, ``message``, ``loss``.
    """
    from .. import feature_maps as fm
    from .._blas import single_threaded_blas
    from ..analysis import approximation_error
    from ..fitting import objective

    scale = float(temperature) / math.sqrt(d)
    qt, kt, qe, ke, ve = draw(seed, d, n, input_scale)
    dt = np.dtype(fit_dtype)
    qt32, kt32, qe32, ke32 = (x.astype(dt) for x in (qt, kt, qe, ke))
    starts = start_maps(d, t2r=t2r)
    maps = {"elu": fm.get("elu"), "taylor2": fm.get("taylor2", scale=scale),
            "favor+": fm.get("favor+", num_features=2 * d, seed=seed, scale=scale)}
    fits = {}
    with single_threaded_blas():
        for key, start in starts.items():
            _warm_up(start, dt)
            t0 = time.perf_counter()
            fitted, hist = fm.fit(start, qt32, kt32, scale=scale, steps=steps, progress=False)
            seconds = time.perf_counter() - t0
            held0, _ = objective(start, qe32, ke32, scale=scale)
            held1, _ = objective(fitted, qe32, ke32, scale=scale)
            fits[key] = dict(train_start=float(hist.train_loss[0]), train_end=float(hist.train_loss[-1]),
                             heldout_start=float(held0), heldout_end=float(held1), steps_done=int(hist.step[-1]),
                             seconds=seconds, message=str(hist.message), loss=str(hist.loss))
            maps[f"{key}_start"] = start
            maps[key] = fitted
        results = {}
        for key in MAP_LABELS:
            if key not in maps:
                continue
            fmap = maps[key]
            res = to_json(approximation_error(qe, ke, ve, fmap, scale=scale))
            res = {f: res.get(f) for f in FIELDS}
            res["d_phi"] = int(fmap.output_dim(d))
            results[key] = res
    return {"maps": results, "fits": fits, "scale": scale}


# ---------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------
def _pct(rate) -> str:
    """A fraction as a percentage, e.g. ``"99.6%"``."""
    text = f"{100.0 * rate:.3g}"
    if rate < 1.0 and float(text) >= 100.0:
        return "> 99.9%"
    return f"{text}%"


class _Agg:
    """The ok records as {regime: {seed: result}}, regimes in REGIMES order."""

    def __init__(self, ok):
        self.by: dict = {}
        self.params: dict = {}
        order = [r[0] for r in REGIMES]
        for r in ok:
            p = r["params"]
            self.by.setdefault(p["regime"], {})[p["seed"]] = r["result"]
            self.params.setdefault(p["regime"], p)
        self.regimes = sorted(self.by, key=lambda x: order.index(x) if x in order else len(order))
        self.seeds = sorted({s for v in self.by.values() for s in v})

    def maps(self, regime):
        first = next(iter(self.by[regime].values()))
        return [k for k in MAP_LABELS if k in first["maps"]]

    def values(self, regime, key, field, part="maps"):
        res = self.by[regime]
        return np.asarray([num(res[s][part].get(key, {}).get(field)) for s in sorted(res)], dtype=float)

    def stat(self, regime, key, field, part="maps"):
        return seed_stat(self.values(regime, key, field, part))

    def d_phi(self, regime, key):
        return next(iter(self.by[regime].values()))["maps"][key]["d_phi"]


def _regime_line(agg) -> str:
    parts = []
    for regime in agg.regimes:
        p = agg.params[regime]
        s, c = p["input_scale"], p["temperature"]
        parts.append(f"**{regime}**: q, k ~ {fmt(s)}·N(0, I), softmax temperature {fmt(c)}/√d "
                     f"(logit standard deviation {fmt(c * s * s)})")
    p = agg.params[agg.regimes[0]]
    return (f"Regime: {len(parts)} input regimes, " + "; ".join(parts) + f".  In each: d = {p['d']}, N = {p['n']} "
            f"(training and evaluation draws of the same size, v ~ N(0, I) in R^{p['d']}), non-causal, one head; "
            f"{seeds_text(len(agg.seeds))} "
            "(a seed draws the training set, the fresh evaluation set and FAVOR+'s features; the same seed draws "
            f"the same standard-normal q, k, v in every regime).  Fits: `feature_maps.fit(..., loss="
            f"'cross_entropy', optimizer='lbfgs', steps={p['steps']})` on {p['fit_dtype']} copies of the training "
            "draw, one BLAS thread; every measure is taken on the evaluation draw in float64 by "
            f"`approximation_error`.  Cells: {CI_CAPTION}.")


def _kl_cell(agg, regime, key) -> str:
    m, se = agg.stat(regime, key, "kl_mean")
    if math.isinf(m):
        rate, _ = agg.stat(regime, key, "kl_infinite_rate")
        return f"∞ ({_pct(rate)} of rows)"
    return pm(m, se)


def _map_table(agg, regime) -> str:
    rows = []
    for key in agg.maps(regime):
        rows.append([MAP_LABELS[key], fmt(agg.d_phi(regime, key)), _kl_cell(agg, regime, key),
                     pm(*agg.stat(regime, key, "js_mean")), pm(*agg.stat(regime, key, "entropy_linear")),
                     pm(*agg.stat(regime, key, "monotonicity")), pm(*agg.stat(regime, key, "output_rel_error"))])
    return markdown_table(["feature map", "D_φ", "KL(softmax ‖ linear)", "JS", "row entropy (linear)",
                           "monotonicity (Spearman)", "output error"], rows)


def _fit_table(agg) -> str:
    rows = []
    for regime in agg.regimes:
        for key in FITTED:
            if key not in agg.maps(regime):
                continue
            v = {f: agg.stat(regime, key, f, part="fits")
                 for f in ("train_start", "train_end", "heldout_start", "heldout_end", "steps_done", "seconds")}
            rows.append([regime, MAP_LABELS[key], f"{pm(*v['train_start'])} → {pm(*v['train_end'])}",
                         f"{pm(*v['heldout_start'])} → {pm(*v['heldout_end'])}", fmt(v["steps_done"][0], 3),
                         pm(*v["seconds"])])
    return markdown_table(["regime", "map", "training loss, start → fitted", "held-out loss, start → fitted",
                           "steps", "fit seconds"], rows)


def _paired(agg, regime, a, b, field):
    """(seeds where a's field is below b's, seeds where it is above, seeds compared)."""
    x, y = agg.values(regime, a, field), agg.values(regime, b, field)
    ok = ~(np.isnan(x) | np.isnan(y))
    return int(np.sum(x[ok] < y[ok])), int(np.sum(x[ok] > y[ok])), int(np.sum(ok))


def _every(total) -> str:
    return {1: "in the one seed", 2: "in both seeds"}.get(total, f"in all {total} seeds")


def _compare(agg, regime, other, field) -> str:
    below, above, total = _paired(agg, regime, "hedgehog", other, field)
    m, _ = agg.stat(regime, other, field)
    name = SHORT[other]
    if total and below == total:
        return f"below {name}'s ({fmt(m)}) {_every(total)}"
    if total and above == total:
        return f"above {name}'s ({fmt(m)}) {_every(total)}"
    return f"below {name}'s ({fmt(m)}) in {below} and above it in {above} of {total} seeds"


def _generalisation(agg, regime) -> str:
    """How much of the training loss's fall the held-out loss kept (fitted Hedgehog)."""
    drop = {}
    for part in ("train", "heldout"):
        a, _ = agg.stat(regime, "hedgehog", f"{part}_start", part="fits")
        b, _ = agg.stat(regime, "hedgehog", f"{part}_end", part="fits")
        drop[part] = a - b
    if not all(math.isfinite(v) for v in drop.values()):
        return ""

    def moved(x):
        return f"fell by {fmt(x)}" if x >= 0 else f"rose by {fmt(-x)}"

    held = (f"by {fmt(abs(drop['heldout']))}" if (drop["heldout"] >= 0) == (drop["train"] >= 0)
            else moved(drop["heldout"]))
    return f"; its loss {moved(drop['train'])} nats on the training draw and {held} on the evaluation draw"


def _findings(agg) -> list:
    """What the tables show, regime by regime, from their numbers (paired by seed)."""
    out = []
    for regime in agg.regimes:
        maps = agg.maps(regime)
        if "hedgehog" not in maps:
            continue
        kl, _ = agg.stat(regime, "hedgehog", "kl_mean")
        mono, _ = agg.stat(regime, "hedgehog", "monotonicity")
        hs, _ = agg.stat(regime, "hedgehog", "entropy_softmax")
        hl, _ = agg.stat(regime, "hedgehog", "entropy_linear")
        hl0, _ = agg.stat(regime, "hedgehog_start", "entropy_linear")
        text = [f"*{regime}*: fitted Hedgehog's KL ({fmt(kl)}) is "
                + "; ".join(_compare(agg, regime, o, "kl_mean")
                            for o in ("elu", "favor+", "taylor2", "hedgehog_start") if o in maps)
                + f".  Its monotonicity ({fmt(mono)}) is "
                + "; ".join(_compare(agg, regime, o, "monotonicity")
                            for o in ("elu", "favor+", "taylor2", "hedgehog_start") if o in maps)
                + f".  Fitting moved its row entropy from {fmt(hl0)} to {fmt(hl)} nats (softmax: {fmt(hs)})"
                + _generalisation(agg, regime) + "."]
        if "t2r" in maps:
            rate, _ = agg.stat(regime, "t2r", "kl_infinite_rate")
            js_t, _ = agg.stat(regime, "t2r", "js_mean")
            js_h, _ = agg.stat(regime, "hedgehog", "js_mean")
            below, above, total = _paired(agg, regime, "t2r", "hedgehog", "js_mean")
            inf = (f"KL infinite in {_pct(rate)} of the rows (relu weights exactly 0 where softmax has mass)"
                   if rate > 0 else "KL finite in every row")
            order = (f"below fitted Hedgehog's ({fmt(js_h)}) {_every(total)}" if total and below == total else
                     f"above fitted Hedgehog's ({fmt(js_h)}) {_every(total)}" if total and above == total else
                     f"below fitted Hedgehog's ({fmt(js_h)}) in {below} of {total} seeds")
            text.append(f"Fitted T2R: {inf}; its JS ({fmt(js_t)}) is {order}.")
        out.append("- " + "  ".join(text))
    return out


def _plot(agg, ctx) -> list:
    keys = [k for k in MAP_LABELS if any(k in agg.maps(r) for r in agg.regimes)]
    fig, axes = ctx.figure(ncols=3, width=3.6, height=0.36 * len(keys) + 1.7)
    ypos = np.arange(len(keys))
    beyond = []
    panels = (("kl_mean", "KL(softmax ‖ linear), nats", "log"), ("js_mean", "Jensen–Shannon, nats", "log"),
              ("monotonicity", "monotonicity (Spearman ρ)", "linear"))
    for j, (ax, (field, title, xscale)) in enumerate(zip(axes, panels)):
        finite_all = []
        for i, regime in enumerate(agg.regimes):
            sty = ctx.style(i)
            xs, es, ys, over = [], [], [], []
            for y, key in zip(ypos, keys):
                if key not in agg.maps(regime):
                    continue
                yy = y + (i - (len(agg.regimes) - 1) / 2) * 0.22
                m, se = agg.stat(regime, key, field)
                if math.isfinite(m):
                    xs.append(m)
                    es.append(se if math.isfinite(se) else 0.0)
                    ys.append(yy)
                    finite_all.append(m)
                else:
                    over.append(yy)
                    beyond.append(f"{MAP_LABELS[key]} ({regime})")
            es = np.asarray(es)
            if xscale == "log":  # keep the lower bar above 0 on a log axis
                es = np.minimum(es, 0.999 * np.asarray(xs))
            ax.errorbar(xs, ys, xerr=es, linestyle="none", marker=sty["marker"], color=sty["color"], ms=5,
                        capsize=2, label=regime)
            if over:
                ax.plot([1.0] * len(over), over, linestyle="none", marker=">", ms=7, mfc="none", mec=sty["color"],
                        clip_on=False, transform=ax.get_yaxis_transform(), label="_")
        ax.set_xscale(xscale)
        if xscale == "log" and finite_all:
            lo, hi = min(x for x in finite_all if x > 0), max(finite_all)
            ax.set_xlim(lo / 2, hi * 2)
        ax.set_yticks(ypos, [MAP_LABELS[k] for k in keys] if j == 0 else [""] * len(keys))
        ax.set_ylim(len(keys) - 0.5, -0.5)
        ax.set(xlabel=title)
        ax.grid(True, which="both", alpha=0.3)
    ctx.legend_outside(fig, axes, title=f"regime (mean, 95% CI, {len(agg.seeds)} seeds)", where="bottom")
    md = ["", ctx.savefig(fig, "learned", "KL, Jensen-Shannon divergence and monotonicity of every map in every "
                                          "regime, fitted Hedgehog and T2R against fixed maps")]
    if beyond:
        md += ["", "Infinite KL (open triangles on the right edge of the KL panel): "
                   + ", ".join(sorted(set(beyond))) + "."]
    return md


def render(records, ctx) -> Rendered:
    """The section: the regimes, one table of every map per regime, the fits, what the numbers show, the plot."""
    ok, failed, problems, failed_md = split_failed("learned", records)
    if not ok:
        return Rendered("\n".join(failed_md), "0 points", problems)
    agg = _Agg(ok)
    md = [_regime_line(agg)]
    if not any("t2r" in agg.maps(r) for r in agg.regimes):
        md += ["", "T2R is not in this build (the `\"t2r\"` feature map is not registered): its rows are left out."]
    for regime in agg.regimes:
        h, se = agg.stat(regime, "elu", "entropy_softmax")
        n = agg.params[regime]["n"]
        md += ["", f"**{regime}** (softmax row entropy {pm(h, se)} nats; ln N = {fmt(math.log(n))} for uniform "
                   "rows; KL is ∞ in a row where a linear weight is 0 and softmax's is not):", "",
               _map_table(agg, regime)]
    md += ["", "The fits (loss: soft-label cross-entropy over rows, nats, Hedgehog's; T2R's weights are floored "
               "at `config.FIT_FLOOR`/n in the loss; held-out: the same loss on the evaluation draw; fit seconds: "
               "wall time on the machine above, one BLAS thread, compiling excluded):", "", _fit_table(agg)]
    md += ["", "What the numbers show (comparisons paired by seed; mean over the seeds in parentheses):", ""]
    md += _findings(agg)
    if ctx.plots:
        md += _plot(agg, ctx)
    md += failed_md
    return Rendered("\n".join(md), f"{len(agg.regimes)} regimes, {len(agg.seeds)} seeds, {len(ok)} points", problems)


STUDY = register_study(Study(
    name="learned",
    title="Learned against fixed feature maps",
    command="learned",
    help="fit Hedgehog and T2R to softmax weights and compare them with ELU+1, Taylor-2 and FAVOR+ on held-out "
         "inputs, in three regimes",
    points=points,
    run=run,
    render=render,
    figures=("learned",),
    budget_s={"tiny": 15, "quick": 10, "full": 60},
))
