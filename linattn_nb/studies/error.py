"""Study: approximation error of linear attention against softmax attention, in two input regimes.

Every registered feature map across N, m and seeds; the regimes and the rules behind the
conclusions: docs/guide/studies.md.
"""
from __future__ import annotations

import math

import numpy as np

from ._maps import build_map, buildable_maps, is_random, map_arrays, map_label
from ._claims import NOT_SUPPORTED, SUPPORTED, slope_claim
from ._study import (CI_CAPTION, Rendered, Study, check_point_size, fit_slope, fmt, markdown_table, mean_ci, num,
                     pm, register_study, seed_stat, seeds_text, split_failed)
from .sweep import to_json

#: The default input scales s (q, k ~ s·N(0, I)): the benign regime (logit standard deviation
#: s² = 0.25) and standard Gaussian inputs (logit standard deviation 1).
SCALES = (0.5, 1.0)
#: Kept for callers of the single-regime study: the benign scale.
QK_SCALE = SCALES[0]
#: Output errors above this are drawn on the top edge of the plots with an open triangle, and listed
#: with their values under the figure.
PLOT_MAX_ERROR = 10.0
#: The measures of the divergence table (besides the output error).
FIELDS = ("output_rel_error", "tv_mean", "js_mean", "kl_mean", "kl_infinite_rate", "entropy_softmax",
          "entropy_linear", "monotonicity", "nonpositive_normalizer_rate")


def _sizes(ctx):
    """(d, Ns, m for the N sweep, ms for the m sweep, seeds, causal at the middle N)."""
    return ctx.pick(
        tiny=(8, [32, 64], 16, [8, 32], 2, False),
        quick=(16, [256, 1024], 64, [16, 64, 256], 5, False),
        full=(16, [256, 1024, 2048], 64, [16, 64, 256, 1024], 5, True),
    )


#: The problem options of ``linattn error`` and ``[error]`` in ``linattn report --config`` (checked by
#: linattn_nb._overrides.check_options) and the keywords of :func:`points` they are passed as: the study
#: builds its own grid from them, so that the N sweep keeps one m and the m sweep its one N.
OPTION_KEYWORDS = {"dim": "dim", "scale": "scales", "maps": "maps", "m": "m", "n": "n", "seeds": "seeds"}


def _check_list(name, values, kind, minimum, *, positive=False):
    """``values`` (one or a list) as a list, each a ``kind`` >= ``minimum`` (> 0 with ``positive``), finite."""
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    what = "positive finite numbers" if positive else f"integers >= {minimum}" if kind is int else \
        f"numbers >= {minimum}"
    if not values:
        raise ValueError(f"error study: {name} must hold {what}, got an empty list")
    for x in values:
        if (isinstance(x, bool) or not isinstance(x, kind) or (isinstance(x, float) and not math.isfinite(x))
                or x < minimum or (positive and x <= 0)):
            raise ValueError(f"error study: {name} must hold {what}, got {x!r}")
    return values


def _check_one(name, value, meaning):
    """``value``: one integer >= 1 (a list is refused: the study takes one value, ``meaning``)."""
    if isinstance(value, (list, tuple)):
        raise ValueError(f"error study: {name} takes one integer >= 1 ({meaning}), got {value!r}; "
                         "run the study once per value for several")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"error study: {name} must be an integer >= 1 ({meaning}), got {value!r}")
    return value


def points(ctx, *, dim=None, scales=None, maps=None, m=None, n=None, seeds=None, causal=None) -> list[dict]:
    """The sweep grid.

    Parameters
    ----------
    ctx : Context
    dim : int, optional
        Head dimension d (default 16; 8 for the tiny profile); one value (a list is a ValueError).
    scales : float or list of float, optional
        Input scales s > 0, q, k ~ s·N(0, I), one regime each (default ``SCALES``; logit std s²).
    maps : list of str, optional
        Feature-map names (default: every registered map that builds from d alone).
    m : int or list of int, optional
        Random features of the m sweep (at the middle N); the N sweep uses the profile's m (64) if
        listed, else the first.
    n : int or list of int, optional
        Sequence lengths of the N sweep.
    seeds : int, optional
        Number of seeds K, run as seeds 0 .. K-1 (default 5, 2 for tiny); one value (a list is a
        ValueError).
    causal : bool, optional
        Add a causal run at the middle N (default: in the full profile).
    """
    d, ns, m_default, ms, nseeds, causal_mid = _sizes(ctx)
    if dim is not None:
        d = _check_one("dim", dim, "the head dimension d")
    scales = _check_list("scales", SCALES if scales is None else scales, (int, float), 0, positive=True)
    scales = [float(s) for s in scales]
    if n is not None:
        ns = sorted(_check_list("n", n, int, 1))
    if m is not None:
        ms = sorted(_check_list("m", m, int, 1))
        if m_default not in ms:
            m_default = ms[0]
    if seeds is not None:
        nseeds = _check_one("seeds", seeds, "the number of seeds K: seeds 0 .. K-1")
    if causal is not None:
        if not isinstance(causal, (bool, np.bool_)):
            raise ValueError(f"error study: causal must be True or False, got {causal!r}")
        causal_mid = bool(causal)
    if isinstance(maps, str):
        raise TypeError(f"error study: maps must be a list of feature map names, got the string {maps!r} "
                        f"(for one map: [{maps!r}])")
    names = buildable_maps(defaults=True) if maps is None else list(maps)
    known = set(buildable_maps())
    for name in names:
        if name not in known:
            raise ValueError(f"error study: unknown or unbuildable feature map {name!r} in maps; "
                             f"choose from {', '.join(sorted(known))}")
    n_mid = ns[len(ns) // 2]
    # refused up front, as the rank and recall studies refuse them: q, k, v (n x d), the features (n x D_φ),
    # the map's own arrays, and a signed map's n x n weights (signed_metrics)
    sized = []
    for name in names:
        for nf, nn in ([(m_default, ns[-1])] + [(mm, n_mid) for mm in ms]) if is_random(name) else [(None, ns[-1])]:
            dphi, arrays = map_arrays(name, d, num_features=nf)
            arrays += [("n x d inputs", nn, d), ("n x D_φ features", nn, dphi)]
            if not getattr(build_map(name, num_features=nf, seed=0), "is_positive", False):
                arrays.append(("n x n weights of a signed map", nn, nn))
            label = f", m = {nf}" if nf is not None else ""
            sized.append((f"dim = {d}, n = {nn}{label}, map {name} (D_φ = {dphi})", arrays))
    check_point_size("error", sized)
    pts = []
    for s in scales:
        for seed in range(nseeds):
            for name in names:
                rand = is_random(name)
                base = dict(feature_map=name, d=d, qk_scale=s, seed=seed)
                for nn in ns:
                    pts.append(dict(base, num_features=m_default if rand else None, n=nn, causal=False))
                if rand:  # the m sweep at the middle N
                    pts += [dict(base, num_features=mm, n=n_mid, causal=False) for mm in ms if mm != m_default]
                if causal_mid:
                    pts.append(dict(base, num_features=m_default if rand else None, n=n_mid, causal=True))
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
    res["is_positive"] = bool(getattr(fmap, "is_positive", False))
    if not res["is_positive"]:
        res.update(signed_metrics(q, k, v, fmap, causal=causal))
    return res


def signed_metrics(q, k, v, fmap, *, causal=False, eps=None) -> dict:
    """The measures that mean something for a map whose normaliser can cross zero.

    * ``normalizer_le_eps_rate``: the fraction of rows whose normaliser is at or below ``eps``;
    * ``unnormalized_rel_error``: ``min_c ||c phi(Q) phi(K)^T V - E V||_F / ||E V||_F`` with
      ``E = exp(Q K^T / sqrt(d))`` (masked when causal): the unnormalised read-out against
      softmax's numerator up to one scale, in [0, 1].
    """
    from .. import config
    from ..analysis import attention_weights

    eps = config.DEFAULT_EPS if eps is None else eps
    w = np.asarray(attention_weights(q, k, fmap, causal=causal, eps=None, normalize=False), dtype=np.float64)[0]
    d = q.shape[-1]
    logits = (q[0] @ k[0].T) / math.sqrt(d)
    if causal:
        logits = np.where(np.tril(np.ones_like(logits, dtype=bool)), logits, -np.inf)
    num_sm = np.exp(logits) @ v[0]
    num_lin = w @ v[0]
    den = w.sum(axis=1)
    nn = float(np.vdot(num_lin, num_lin))
    c = float(np.vdot(num_lin, num_sm)) / nn if nn > 0 else 0.0
    ref = float(np.linalg.norm(num_sm))
    return {"normalizer_le_eps_rate": float(np.mean(den <= eps)),
            "unnormalized_rel_error": float(np.linalg.norm(c * num_lin - num_sm) / ref) if ref > 0 else float("nan")}


# ---------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------
class _Agg:
    """The ok records grouped as {(scale, causal, map, m, n): {seed: result}}."""

    def __init__(self, ok):
        self.by: dict = {}
        for r in ok:
            p = r["params"]
            key = (float(p.get("qk_scale", 1.0)), bool(p["causal"]), p["feature_map"], p["num_features"], p["n"])
            self.by.setdefault(key, {})[p["seed"]] = r["result"]
        self.scales = sorted({k[0] for k in self.by})
        self.maps = sorted({k[2] for k in self.by})
        self.seeds = sorted({s for v in self.by.values() for s in v})

    def values(self, key, field):
        res = self.by.get(key, {})
        return np.asarray([num(res[s].get(field)) for s in sorted(res)], dtype=float)

    def stat(self, key, field):
        """(mean, 95% Student-t half-width) over the seeds; inf when any seed is inf (not averaged away)."""
        return seed_stat(self.values(key, field))

    def positive(self, mk) -> bool:
        """Whether the series (map, m) has a positive map (its normaliser never crosses zero)."""
        for k, res in self.by.items():
            if (k[2], k[3]) == mk:
                return bool(next(iter(res.values())).get("is_positive", False))
        return False

    def first(self, key):
        res = self.by.get(key, {})
        return next(iter(res.values())) if res else {}

    def ns(self, causal=False):
        return sorted({k[4] for k in self.by if k[1] == causal})

    def m_sweep(self, scale, name, n):
        """{m: key} of the non-causal records of a random map at N = n."""
        return {k[3]: k for k in self.by if k[0] == scale and not k[1] and k[2] == name and k[3] is not None
                and k[4] == n}

    def n_series(self, scale, causal=False):
        """{(map, m): {n: key}} for the (map, m) present at every N (the N sweep)."""
        ns = self.ns(causal)
        cand: dict = {}
        for k in self.by:
            if k[0] == scale and k[1] == causal:
                cand.setdefault((k[2], k[3]), {})[k[4]] = k
        return {mk: byn for mk, byn in sorted(cand.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))
                if len(byn) == len(ns)}


def _regime(scale) -> str:
    return f"s = {fmt(scale)}" + (" (q, k ~ N(0, I))" if scale == 1.0 else "")


def _js_applicable(agg, key) -> bool:
    """JS where the weights are a distribution: a positive map, or every row of every seed one (no infinite KL)."""
    res = agg.first(key)
    if "js_mean" not in res:
        return False
    if res.get("is_positive", False):
        return True
    inf_rate = agg.values(key, "kl_infinite_rate")
    js = agg.values(key, "js_mean")
    return bool(inf_rate.size and np.all(inf_rate == 0) and np.all(np.isfinite(js)))


def _cell(agg, key, field):
    if field == "js_mean":
        return pm(*agg.stat(key, field)) if _js_applicable(agg, key) else "n/a"
    m, s = agg.stat(key, field)
    if field == "kl_infinite_rate" and math.isfinite(m):
        return pm(m, s) if m else "0"
    return pm(m, s)


def _entropy_table(agg, ns) -> str:
    rows = []
    for scale in agg.scales:
        cells = []
        for n in ns:
            keys = [k for k in agg.by if k[0] == scale and not k[1] and k[4] == n]
            if not keys:
                cells.append("–")
                continue
            m, s = mean_ci(np.concatenate([agg.values(k, "entropy_softmax") for k in keys[:1]]))
            cells.append(f"{pm(float(m), float(s))} (ln N = {fmt(math.log(n))})")
        rows.append([_regime(scale), fmt(scale ** 2)] + cells)
    return markdown_table(["regime", "logit std s²", *[f"N = {n}" for n in ns]], rows)


def _ranking_table(agg, n) -> str:
    """Maps ranked by mean output error at N = n in every regime, side by side."""
    per = {}
    for scale in agg.scales:
        series = {mk: byn for mk, byn in agg.n_series(scale).items() if agg.positive(mk)}
        errs = {mk: agg.stat(byn[n], "output_rel_error") for mk, byn in series.items() if n in byn}
        order = sorted(errs, key=lambda mk: (not math.isfinite(errs[mk][0]), errs[mk][0]))
        per[scale] = {mk: (i + 1, errs[mk]) for i, mk in enumerate(order)}
    maps = sorted({mk for d in per.values() for mk in d}, key=lambda mk: per[agg.scales[-1]].get(mk, (99,))[0] or 99)
    rows = []
    for mk in maps:
        row = [map_label(*mk)]
        for scale in agg.scales:
            rank, (m, s) = per[scale].get(mk, (None, (float("nan"), float("nan"))))
            row += [fmt(rank), pm(m, s)]
        rows.append(row)
    heads = ["feature map"]
    for scale in agg.scales:
        heads += [f"rank, {_regime(scale)}", f"error, {_regime(scale)}"]
    return markdown_table(heads, rows)


def _clip_plot(ax, xs, means, stds, style, label, top, beyond, tag, name=None):
    """Error bars of the finite points below ``top``; the rest as open triangles on the top edge."""
    xs = np.asarray(xs, dtype=float)
    means = np.asarray(means, dtype=float)
    stds = np.nan_to_num(np.asarray(stds, dtype=float))
    inside = np.isfinite(means) & (means <= top)
    kw = dict(color=style["color"], marker=style["marker"], linestyle=style["linestyle"], ms=4, capsize=2, lw=1.2)
    if inside.any():
        ax.errorbar(xs[inside], means[inside], yerr=np.minimum(stds[inside], 0.999 * means[inside]), label=label,
                    **kw)
    if (~inside).any():
        ax.plot(xs[~inside], [top] * int((~inside).sum()), linestyle="none", marker="^", ms=7, mfc="none",
                mec=style["color"], clip_on=False, label=label if not inside.any() else "_")
        for x, m in zip(xs[~inside], means[~inside]):
            beyond.append((name or label, tag, int(x), float(m)))


def render(records, ctx) -> Rendered:
    ok, failed, problems, failed_md = split_failed("error", records)
    md = []
    agg = _Agg(ok)
    if not ok:
        return Rendered("\n".join(failed_md), "0 points", problems)
    ns = agg.ns(False)
    n_top, n_mid = ns[-1], ns[len(ns) // 2]
    p0 = ok[0]["params"]
    d = p0["d"]
    ms_all = sorted({k[3] for k in agg.by if k[3] is not None})
    md.append(
        f"Regime: q, k ~ s·N(0, I) and v ~ N(0, I) in R^{d} (one head, d = {d}), softmax temperature 1/√d, so "
        f"the logits q·k/√d have standard deviation s²; s ∈ {{{', '.join(fmt(s) for s in agg.scales)}}}.  "
        f"N ∈ {{{', '.join(map(str, ns))}}}, non-causal"
        + (f" (and causal at N = {n_mid})" if any(k[1] for k in agg.by) else "")
        + f"; {seeds_text(len(agg.seeds))} (a seed draws q, k, v and the random features)"
        + (f"; random maps use {_m_text(_n_sweep_m(agg))} and m ∈ {{{', '.join(map(str, ms_all))}}} "
           f"at N = {n_mid}" if ms_all else "")
        + f".  Output error: ‖o_linear − o_softmax‖_F / ‖o_softmax‖_F; cells are {CI_CAPTION}.  Positive maps "
          "(normaliser > 0 always) are ranked by it; signed maps, whose normaliser can cross zero, have their "
          "own table below and are not ranked beside them.")
    md += ["", f"Softmax row entropy (nats, mean over rows, {CI_CAPTION}; ln N is the entropy of uniform "
               "weights):", "",
           _entropy_table(agg, ns), "",
           "The smaller s², the closer softmax is to uniform weights and the easier it is to approximate: "
           "the ranking below is a property of the regime as much as of the maps.", "",
           f"Positive maps ranked by output error at N = {n_top} (1 = closest to softmax; {CI_CAPTION}):", "",
           _ranking_table(agg, n_top)]
    for scale in agg.scales:
        series = {mk: byn for mk, byn in agg.n_series(scale).items() if agg.positive(mk)}
        rows = [[map_label(*mk), fmt(agg.first(next(iter(byn.values()))).get("d_phi"))]
                + [pm(*agg.stat(byn[n], "output_rel_error")) for n in ns] for mk, byn in series.items()]
        md += ["", f"**{_regime(scale)}**, positive maps: output relative error against N ({CI_CAPTION})", "",
               markdown_table(["feature map", "D_φ", *[f"N = {n}" for n in ns]], rows)]
        rows = [[map_label(*mk)] + [_cell(agg, byn[n_top], f) for f in FIELDS] for mk, byn in series.items()]
        md += ["", f"All measures at N = {n_top}, {_regime(scale)}, positive maps (JS: Jensen–Shannon divergence; "
               f"kl_infinite_rate: fraction of rows with KL = ∞; {CI_CAPTION}):", "",
               markdown_table(["feature map", *FIELDS], rows)]
        inf_maps = [map_label(*mk) for mk, byn in series.items()
                    if agg.stat(byn[n_top], "kl_infinite_rate")[0] > 0]
        md += ["", f"KL(softmax ‖ linear) is infinite in some rows for {len(inf_maps)} of {len(series)} positive maps "
               f"({', '.join(inf_maps) or 'none'}): TV and JS are the finite measures to compare them by."]
    md += _signed_md(agg, ns, n_top)
    md += _m_sweep_md(agg, n_mid)
    if any(k[1] for k in agg.by):
        rows = []
        for (name, m), byn in agg.n_series(agg.scales[0], causal=True).items():
            if not agg.positive((name, m)):
                continue
            row = [map_label(name, m)]
            for scale in agg.scales:
                kc = (scale, True, name, m, n_mid)
                kn = (scale, False, name, m, n_mid)
                row += [pm(*agg.stat(kn, "output_rel_error")), pm(*agg.stat(kc, "output_rel_error"))]
            rows.append(row)
        heads = ["feature map"]
        for scale in agg.scales:
            heads += [f"non-causal, {_regime(scale)}", f"causal, {_regime(scale)}"]
        md += ["", f"Causal against non-causal output error at N = {n_mid}, positive maps ({CI_CAPTION}):", "",
               markdown_table(heads, rows)]
    if ctx.plots:
        md += _plots(agg, ctx, ns, n_top, n_mid)
    md += failed_md
    return Rendered("\n".join(md), f"{len(agg.scales)} regimes, {seeds_text(len(agg.seeds))}, {len(ok)} points",
                    problems)


def _signed_md(agg, ns, n_top) -> list:
    """The signed maps' table: fraction of normalisers <= eps and the unnormalised read-out's error, per N."""
    rows = []
    for scale in agg.scales:
        for mk, byn in agg.n_series(scale).items():
            if agg.positive(mk) or "unnormalized_rel_error" not in agg.first(byn[ns[0]]):
                continue
            rows.append([map_label(*mk), _regime(scale)]
                        + [f"{pm(*agg.stat(byn[n], 'normalizer_le_eps_rate'))} / "
                           f"{pm(*agg.stat(byn[n], 'unnormalized_rel_error'))}" for n in ns]
                        + [fmt(agg.stat(byn[n_top], "output_rel_error")[0])])
    if not rows:
        return []
    return ["", "**Signed maps** (the normaliser φ(q)·Σφ(k) can be ≤ 0; where it is at or below eps = "
                "1e-8 the normalised read-out divides by eps, so its error measures the floor, not the map).  "
                "Each cell: fraction of rows whose normaliser is ≤ eps / error of the unnormalised read-out, "
                "min_c ‖c·φ(Q)φ(K)ᵀV − exp(QKᵀ/√d)V‖_F / ‖exp(QKᵀ/√d)V‖_F (softmax's numerator up to one scale; "
                f"0 is exact, 1 captures nothing); {CI_CAPTION}.  The last column is the normalised output error, "
                "for reference only -- not comparable with the positive maps':", "",
            markdown_table(["feature map", "regime", *[f"N = {n}" for n in ns],
                            f"normalised error at N = {n_top}"], rows)]


def _n_sweep_m(agg) -> list:
    """The m of the random maps' series in the N sweep (those at every N, as the tables show them), sorted."""
    return sorted({mk[1] for s in agg.scales for mk in agg.n_series(s) if mk[1] is not None})


def _m_text(ms) -> str:
    """How many features the random maps use in the N sweep, from its records (one table row per m)."""
    if not ms:
        return "no m at every N (they are not in the N sweep)"
    one = f"m = {ms[0]}" if len(ms) == 1 else f"m ∈ {{{', '.join(map(str, ms))}}}"
    return f"{one} features in the N sweep"


def _m_sweep_md(agg, n_mid) -> list:
    rows, claims = [], []
    ms_all = sorted({k[3] for k in agg.by if k[3] is not None and k[4] == n_mid and not k[1]})
    if len(ms_all) < 2:
        return []
    for scale in agg.scales:
        for name in agg.maps:
            by_m = agg.m_sweep(scale, name, n_mid)
            if len(by_m) < 2:
                continue
            xs = sorted(by_m)
            fit = _fit(agg, by_m, xs)
            means = [agg.stat(by_m[x], "output_rel_error")[0] for x in xs]
            claim = slope_claim(fit, means)
            upper = _fit(agg, by_m, xs[-2:]) if len(xs) >= 3 else None
            upper_claim = slope_claim(upper, means[-2:]) if upper is not None else None
            rows.append([name, _regime(scale)] + [pm(*agg.stat(by_m[x], "output_rel_error")) if x in by_m else "–"
                                                  for x in ms_all]
                        + [_fit_text(fit), _fit_text(upper), claim.verdict])
            claims.append((name, scale, xs, claim, upper_claim))
    if not rows:
        return []
    md = ["", f"Random maps against m at N = {n_mid}: output error ({CI_CAPTION}) and the slope of log error "
              "against log m (least squares per seed; mean and 95% Student-t interval over the seeds), over the "
              "whole grid and over its two largest m.  Rule: the error is " + claims[0][3].rule + ".  A "
              "Monte-Carlo rate m^−0.5 describes an estimator in its variance regime; an error ≥ 1 is not that "
              "regime, and no rate is claimed there.", "",
          markdown_table(["feature map", "regime", *[f"m = {m}" for m in ms_all], "slope, all m [95% CI]",
                          f"slope, m ≥ {ms_all[-2]} [95% CI]", "m^−0.5 (all m)"], rows), ""]
    for name, scale, xs, claim, upper_claim in claims:
        line = f"- {name}, {_regime(scale)}: {claim.verdict}: {claim.text}."
        if claim.verdict == NOT_SUPPORTED and upper_claim is not None:
            line += (f"  Over m ≥ {xs[-2]} alone: {upper_claim.verdict}: {upper_claim.text}.")
            if "shallower" in claim.text and agg.positive((name, xs[0])):
                if upper_claim.verdict == SUPPORTED:
                    line += "  The error falls more slowly than 1/√m at small m and at that rate at large m."
                elif "shallower" in upper_claim.text:
                    line += (f"  The error falls more slowly than 1/√m over the whole grid, and still over "
                             f"m ≥ {xs[-2]}.")
                else:
                    line += "  The error falls more slowly than 1/√m over the whole grid."
                line += ("  Not the ratio's O(1/m) bias, which would make the slope steeper: the positive features "
                         "exp(w·x − ‖x‖²/2) are heavy-tailed, so at small m a typical draw misses the rare "
                         "large features and its error is below the 1/√m law of the mean square, and the "
                         "self-normalised ratio stays below its first-order error; both fade as m grows, so the "
                         "slope nears −0.5 only at larger m.")
        md.append(line)
    return md


def _fit(agg, by_m, xs):
    seeds = sorted(set.intersection(*(set(agg.by[by_m[x]]) for x in xs)))
    ys = [[num(agg.by[by_m[x]][s].get("output_rel_error")) for x in xs] for s in seeds]
    return fit_slope(xs, ys)


def _fit_text(fit) -> str:
    if fit is None:
        return "– (fewer than two usable seeds)"
    return f"{fit['slope']:.2f} [{fit['lo']:.2f}, {fit['hi']:.2f}]"


def _plots(agg, ctx, ns, n_top, n_mid) -> list:
    md = []
    style_of = {name: ctx.style(i) for i, name in enumerate(agg.maps)}
    # 1. error against N, one panel per regime, shared axis clipped at PLOT_MAX_ERROR
    fig, axes = ctx.figure(ncols=len(agg.scales), width=4.6, height=3.8)
    beyond = []
    lo = math.inf
    for ax, scale in zip(axes, agg.scales):
        for (name, m), byn in agg.n_series(scale).items():
            if not agg.positive((name, m)):
                continue
            xs = sorted(byn)
            st = [agg.stat(byn[x], "output_rel_error") for x in xs]
            means = [a for a, _ in st]
            lo = min([lo] + [a for a in means if a > 0 and math.isfinite(a)])
            _clip_plot(ax, xs, means, [b for _, b in st], style_of[name], map_label(name, m), PLOT_MAX_ERROR,
                       beyond, (f"s = {fmt(scale)}", "N"))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(ns)
        ax.set(xlabel="sequence length N", title=f"s = {fmt(scale)}: logit std {fmt(scale ** 2)}")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes:
        ax.set_ylim(min(lo, 1.0) / 2, PLOT_MAX_ERROR)
    axes[0].set_ylabel(f"output relative error (mean, 95% CI, {seeds_text(len(agg.seeds))})")
    ctx.legend_outside(fig, axes, title="positive feature map")
    md += ["", ctx.savefig(fig, "error_n", "output error of the positive maps against N in each regime"),
           "", f"Positive maps; {CI_CAPTION}."]
    md += _beyond_md(beyond)
    md += _signed_plot(agg, ctx, ns)
    # 2. random maps against m, with the fitted slopes
    rand = [name for name in agg.maps if any(len(agg.m_sweep(s, name, n_mid)) > 1 for s in agg.scales)
            and any(agg.positive(mk) for mk in {(k[2], k[3]) for k in agg.by if k[2] == name})]
    if rand:
        fig, axes = ctx.figure(ncols=len(agg.scales), width=4.6, height=3.8)
        beyond = []
        for ax, scale in zip(axes, agg.scales):
            for name in rand:
                by_m = agg.m_sweep(scale, name, n_mid)
                xs = sorted(by_m)
                st = [agg.stat(by_m[x], "output_rel_error") for x in xs]
                fit = _fit(agg, by_m, xs)
                label = (f"{name}, s = {fmt(scale)}"
                         + (f": slope {fit['slope']:.2f} [{fit['lo']:.2f}, {fit['hi']:.2f}]" if fit else ""))
                _clip_plot(ax, xs, [a for a, _ in st], [b for _, b in st], style_of[name], label, PLOT_MAX_ERROR,
                           beyond, (f"s = {fmt(scale)}", "m"), name=name)
                finite = [(x, a) for x, (a, _) in zip(xs, st) if math.isfinite(a) and a <= PLOT_MAX_ERROR]
                if len(finite) >= 2:  # reference 1/sqrt(m) through the last plotted point, over the plotted m
                    x0, y0 = finite[-1]
                    gx = [x for x, _ in finite]
                    ax.plot(gx, [y0 * (x0 / x) ** 0.5 for x in gx], ":", color=style_of[name]["color"], lw=1,
                            label="_")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(sorted({x for name in rand for x in agg.m_sweep(scale, name, n_mid)}))
            ax.set(xlabel="random features m", title=f"s = {fmt(scale)}, N = {n_mid}")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("output relative error (mean, 95% CI; dotted: ∝ 1/√m)")
        for ax in axes:
            ymin = min([y for line in ax.get_lines() for y in line.get_ydata() if y > 0] or [0.01])
            ax.set_ylim(ymin / 2, PLOT_MAX_ERROR)
        ctx.legend_outside(fig, axes, title="map, fitted slope [95% CI]")
        md += ["", ctx.savefig(fig, "error_m", "output error of the positive random maps against m, with fitted slopes"),
               "", f"Positive random maps; {CI_CAPTION}; dotted: ∝ 1/√m through the largest m."]
        md += _beyond_md(beyond)
    # 3. finite divergences at N = n_top: TV and JS per map, one marker per regime
    series = {mk for s in agg.scales for mk in agg.n_series(s) if agg.positive(mk)}
    labels = sorted(series, key=lambda mk: (mk[0], mk[1] or 0))
    fig, axes = ctx.figure(ncols=2, width=4.2, height=0.3 * len(labels) + 1.6)
    ypos = np.arange(len(labels))
    jsna, tvout = [], []
    for j, (ax, field, title, top) in enumerate(zip(axes, ("tv_mean", "js_mean"),
                                                    ("total variation", "Jensen–Shannon (nats)"),
                                                    (1.0, math.log(2.0)))):
        lo = top
        for i, scale in enumerate(agg.scales):
            sty = ctx.style(i)  # one colour and marker per regime
            xs, es, ys, over = [], [], [], []
            for y, (name, m) in zip(ypos, labels):
                key = (scale, False, name, m, n_top)
                if key not in agg.by:
                    continue
                yy = y + (i - (len(agg.scales) - 1) / 2) * 0.25
                if field == "js_mean" and not _js_applicable(agg, key):
                    if map_label(name, m) not in jsna:
                        jsna.append(map_label(name, m))
                    continue
                a, b = agg.stat(key, field)
                if math.isfinite(a) and a <= top:
                    xs.append(a)
                    es.append(0.0 if not math.isfinite(b) else min(b, 0.999 * a))
                    ys.append(yy)
                    lo = min(lo, a) if a > 0 else lo
                else:  # TV of signed weights can exceed 1 (and be inf): on the right edge, listed below
                    over.append(yy)
                    tvout.append(f"{map_label(name, m)} ({_regime(scale)}): {fmt(a)}")
            ax.errorbar(xs, ys, xerr=es, linestyle="none", marker=sty["marker"], color=sty["color"], ms=5,
                        capsize=2, label=_regime(scale))
            if over:
                ax.plot([top] * len(over), over, linestyle="none", marker=">", ms=7, mfc="none", mec=sty["color"],
                        clip_on=False, label="_")
        ax.set_yticks(ypos, [map_label(*mk) for mk in labels] if j == 0 else [""] * len(labels))
        ax.set_xscale("log")
        ax.set_xlim(lo / 2, top)
        ax.set(xlabel=f"{title} at N = {n_top}")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylim(len(labels) - 0.5, -0.5)
    ctx.legend_outside(fig, axes, title="regime (mean, 95% CI over seeds)", where="bottom")
    md += ["", ctx.savefig(fig, "error_divergence", "total variation and Jensen-Shannon divergence per map")]
    if jsna:
        md += ["", f"JS not applicable (the weights of these maps are not a distribution in every row): "
                   f"{', '.join(jsna)}."]
    if tvout:
        md += ["", f"Total variation above 1 (signed weights; open triangles on the right edge), mean over the seeds: "
                   f"{'; '.join(tvout)}."]
    return md


def _signed_plot(agg, ctx, ns) -> list:
    """The signed maps: unnormalised read-out error against N, one panel per regime."""
    signed = [(scale, mk, byn) for scale in agg.scales for mk, byn in agg.n_series(scale).items()
              if not agg.positive(mk) and "unnormalized_rel_error" in agg.first(byn[ns[0]])]
    if not signed:
        return []
    fig, axes = ctx.figure(ncols=len(agg.scales), width=4.2, height=3.4)
    names = sorted({mk for _, mk, _ in signed}, key=lambda mk: (mk[0], mk[1] or 0))
    for ax, scale in zip(axes, agg.scales):
        for scale2, mk, byn in signed:
            if scale2 != scale:
                continue
            st = [agg.stat(byn[n], "unnormalized_rel_error") for n in ns]
            sty = ctx.style(names.index(mk))
            ax.errorbar(ns, [a for a, _ in st], yerr=[0.0 if not math.isfinite(b) else b for _, b in st],
                        ms=4, capsize=2, lw=1.2, label=map_label(*mk), **sty)
        ax.set_xscale("log")
        ax.set_xticks(ns)
        ax.set_ylim(0.0, 1.05)
        ax.set(xlabel="sequence length N", title=f"s = {fmt(scale)}")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("unnormalised read-out error (best scale)")
    ctx.legend_outside(fig, axes, title="signed feature map")
    return ["", ctx.savefig(fig, "error_signed", "signed maps: error of the unnormalised read-out against N"), "",
            f"Signed maps; {CI_CAPTION}; 0 is softmax's numerator up to one scale, 1 captures none of it."]


def _beyond_md(beyond) -> list:
    if not beyond:
        return []
    groups: dict = {}
    for name, (regime, var), x, value in beyond:
        groups.setdefault((name, regime, var), []).append(f"{x}: {fmt(value)}")
    text = "; ".join(f"{name}, {regime}, at {var} = {', '.join(vals)}" for (name, regime, var), vals in groups.items())
    return ["", f"Beyond the axis (drawn as open triangles on its top edge at {fmt(PLOT_MAX_ERROR)}; mean over the "
                f"seeds): {text}."]


STUDY = register_study(Study(
    name="error",
    title="Approximation error against softmax",
    command="error",
    help="approximation error against softmax attention for every feature map, across N and m, in two regimes",
    points=points,
    run=run,
    render=render,
    figures=("error_n", "error_m", "error_divergence", "error_signed"),
    budget_s={"tiny": 60, "quick": 50, "full": 180},
))
