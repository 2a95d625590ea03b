"""Study: update rules against the capacity floor -- retrieval error against n / D_φ.

n key-value pairs (keys i.i.d. N(0, 1) in R^d, one-hot values, so M = n) are
written into a D_φ × M state one per token and every key is read after the
last write (Schlag, Irie & Schmidhuber 2021, §4.1, setting 1, training-free).
The feature map is ``"l2"`` (φ(k) = k/‖k‖: unit keys, D_φ = d, DeltaNet's
convention) and the read-out is unnormalised (φ(k)ᵀS) for every rule, so the
rules differ only in how they write:

* the additive rule, S = Σ_j φ(k_j) v_jᵀ;
* the delta rule (Schlag et al. 2021, §4.2),
  S_j = S_{j−1} + β φ(k_j)(v_j − S_{j−1}ᵀφ(k_j))ᵀ, with β = 1 (a write replaces
  what the state returned for the key) and β = 0.5;
* the gated delta rule (Yang, Kautz & Hatamizadeh 2025),
  S_j = γ(I − β φ(k_j)φ(k_j)ᵀ) S_{j−1} + β φ(k_j) v_jᵀ, β = 1, γ = 0.95;
* the least-squares optimal state of the same size, min_W ‖φ(K) W − V‖²,
  whose relative error is exactly 1 − D_φ/n past D_φ for one-hot values
  (Eckart–Young): no read-out φ(K) S of any rule can go below it.

:func:`linattn_nb.analysis.recall_capacity` (``beta=``, ``decay=``,
``normalize=False``) measures the relative error ‖V̂ − V‖²/‖V‖²; the delta
rules' sequences run through ``linear_attention(..., beta=..., method=METHOD)``.
Five seeds per rule (a seed draws the keys), mean ± standard deviation.  A
second small table reads orthonormal keys at n ≤ D_φ, where the delta rule
with β = 1 (and, keys being orthogonal, the additive rule) retrieves every pair
exactly.  A rule whose error falls below the floor is reported as a problem
(it would contradict the floor).
"""
from __future__ import annotations

import warnings

import numpy as np

from ._study import Rendered, Study, fmt, markdown_table, register_study, split_failed
from .sweep import to_json

#: The rules compared: (label, beta, decay); beta None is the additive rule.
RULES = (
    ("additive", None, None),
    ("delta, β = 1", 1.0, None),
    ("delta, β = 0.5", 0.5, None),
    ("gated delta, β = 1, γ = 0.95", 1.0, 0.95),
)
#: Independent seeds per rule (each draws its own keys).
SEEDS = (0, 1, 2, 3, 4)
#: The feature map: unit keys, D_phi = d.
FEATURE_MAP = "l2"
#: The linear_attention method that runs the delta rules' sequences (the explicit float64 form).
METHOD = "quadratic"
#: A rule counts as below the floor when its error is lower by more than this (round-off).
FLOOR_TOL = 1e-9


def _sizes(ctx):
    """(d = D_phi, n pairs, trials per seed)."""
    return ctx.pick(
        tiny=(4, [2, 4, 8, 16], 1),
        quick=(16, [4, 8, 12, 16, 20, 24, 32, 48, 64], 2),
        full=(32, [8, 16, 24, 32, 40, 48, 64, 96, 128], 2),
    )


def points(ctx) -> list[dict]:
    d, ns, trials = _sizes(ctx)
    pts = [dict(kind="gaussian", rule=label, beta=beta, decay=decay, d=d, n_pairs=ns, trials=trials, seed=s,
                method=METHOD)
           for label, beta, decay in RULES for s in SEEDS]
    orth = sorted({max(1, d // 2), d})
    pts += [dict(kind="orthonormal", rule=label, beta=beta, decay=None, d=d, n_pairs=orth, trials=trials, seed=s,
                 method=METHOD)
            for label, beta, decay in RULES[:2] for s in SEEDS]
    return pts


def run(kind, rule, beta, decay, d, n_pairs, trials, seed, method=METHOD) -> dict:
    from ..analysis import recall_capacity

    res = recall_capacity(FEATURE_MAP, d, np.asarray(n_pairs), trials=trials, seed=seed, beta=beta, decay=decay,
                          normalize=False, orthogonal_keys=(kind == "orthonormal"), method=method)
    return to_json(res)


def _mean_std(x):
    """Mean and standard deviation (ddof=1 when there are >= 2 seeds) along axis 0."""
    x = np.asarray(x, dtype=float)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = x.mean(axis=0)
        std = x.std(axis=0, ddof=1) if x.shape[0] > 1 else np.zeros_like(mean)
    return mean, std


def _pm(mean, std) -> str:
    if abs(float(mean)) < 1e-12 and float(std) < 1e-12:
        return "< 1e-12"
    return f"{fmt(float(mean))} ± {fmt(float(std), 2)}"


def _findings(agg, dphi, ns) -> str:
    """What the table shows, computed from its numbers: errors at n = D_phi, the rule nearest the floor at the largest n."""
    def mean_at(e, j):
        return float(_mean_std(e["mse"])[0][j])

    at = int(np.argmin(np.abs(ns - dphi)))
    last = len(ns) - 1
    floor = float(_mean_std(next(iter(agg.values()))["opt"])[0][last])
    at_d = "; ".join(f"{label}: {fmt(mean_at(e, at))}" for label, e in agg.items())
    text = f"What it shows: at n = {int(ns[at])} (≈ D_φ), where the floor is 0, the errors are {at_d}"
    if "additive" in agg and RULES[1][0] in agg:
        a, b = mean_at(agg["additive"], at), mean_at(agg[RULES[1][0]], at)
        text += (f" -- one pass over keys in general position leaves interference under every rule; the delta "
                 f"rule's (β = 1) error is {fmt(b / a, 2)} times the additive rule's")
    best = min(agg.items(), key=lambda kv: mean_at(kv[1], last))
    text += (f".  At n = {int(ns[last])} ({fmt(float(ns[last]) / dphi, 2)} D_φ) the nearest to the floor "
             f"({fmt(floor)}) is {best[0]} ({fmt(mean_at(best[1], last))})")
    over = [label for label, e in agg.items() if mean_at(e, last) > 1.0]
    if over:
        text += ("; " + " and ".join(f"'{label}'" for label in over) + " exceed 1, i.e. read out worse than a zero "
                 "read-out would (each read returns a mix of other values)")
    return text + "."


def _aggregate(ok, kind):
    """{rule label: dict(n, d_phi, mse (seeds, n), opt (seeds, n))} in RULES order, for one key kind."""
    by = {}
    for r in ok:
        p, res = r["params"], r["result"]
        if p["kind"] != kind:
            continue
        e = by.setdefault(p["rule"], dict(n=np.asarray(res["n_pairs"], dtype=float), d_phi=int(res["d_phi"]),
                                          mse=[], opt=[], seeds=[]))
        e["mse"].append(np.asarray(res["mse"], dtype=float))
        e["opt"].append(np.asarray(res["optimal_mse"], dtype=float))
        e["seeds"].append(p["seed"])
    order = [label for label, _, _ in RULES]
    out = {}
    for label in sorted(by, key=lambda x: order.index(x) if x in order else len(order)):
        e = by[label]
        e["mse"] = np.asarray(e["mse"])
        e["opt"] = np.asarray(e["opt"])
        out[label] = e
    return out


def _below_floor(agg) -> list:
    """Problems: a (rule, seed, n) whose error is below the least-squares floor of the same keys."""
    bad = []
    for label, e in agg.items():
        gap = e["mse"] - e["opt"]
        for i, j in zip(*np.nonzero(gap < -FLOOR_TOL)):
            bad.append(f"rules: {label} beats the least-squares floor at n = {int(e['n'][j])}, seed "
                       f"{e['seeds'][i]} (error {e['mse'][i, j]:.6g} < floor {e['opt'][i, j]:.6g})")
    return bad


def render(records, ctx) -> Rendered:
    ok, failed, problems, failed_md = split_failed("rules", records)
    md = []
    agg = _aggregate(ok, "gaussian")
    orth = _aggregate(ok, "orthonormal")
    problems = problems + _below_floor(agg) + _below_floor(orth)
    if agg:
        first = next(iter(agg.values()))
        dphi, ns = first["d_phi"], first["n"]
        p0 = next(r["params"] for r in ok if r["params"]["kind"] == "gaussian")
        nseeds = max(len(e["seeds"]) for e in agg.values())
        md.append(
            f"Regime: keys i.i.d. N(0, 1) in R^{p0['d']} mapped by φ(k) = k/‖k‖ (unit keys, D_φ = {dphi}), "
            "one-hot values (M = n), the n pairs written one per token into a D_φ × M state and every key read "
            "after the last write; unnormalised read-out φ(k)ᵀS for every rule; delta rules run by "
            f"`linear_attention(..., beta=, method={p0['method']!r})` in float64.  Error: ‖V̂ − V‖²/‖V‖²; "
            f"mean ± standard deviation over {nseeds} seeds ({p0['trials']} trial(s) each).  The floor is the "
            "least-squares state of the same size on the same keys: 0 up to n = D_φ, 1 − D_φ/n beyond (for "
            "one-hot values every read-out φ(K)S has rank ≤ D_φ, and no update rule can do better).")
        cols = list(range(len(ns)))
        if len(cols) > 7:
            cols = sorted({0, len(ns) // 4, len(ns) // 2, (3 * len(ns)) // 4, len(ns) - 1}
                          | {int(np.argmin(np.abs(ns - dphi))), int(np.argmin(np.abs(ns - 2 * dphi)))})
        rows = []
        for label, e in agg.items():
            m, s = _mean_std(e["mse"])
            rows.append([label] + [_pm(m[j], s[j]) for j in cols])
        m, s = _mean_std(first["opt"])
        rows.append(["optimal floor (least squares)"] + [_pm(m[j], s[j]) for j in cols])
        rows.append(["1 − D_φ/n"] + [fmt(max(0.0, 1.0 - dphi / float(ns[j]))) for j in cols])
        md += ["", f"Relative retrieval error against n (D_φ = {dphi}):", "",
               markdown_table(["state"] + [f"n = {int(ns[j])} ({fmt(float(ns[j]) / dphi, 2)} D_φ)" for j in cols],
                              rows)]
        if orth:
            orows = []
            for label, e in orth.items():
                orows.append([label] + [fmt(float(e["mse"][:, j].max())) for j in range(len(e["n"]))])
            on = next(iter(orth.values()))["n"]
            md += ["", "Orthonormal keys (a random orthonormal frame), n ≤ D_φ: the largest error over the seeds "
                   "(exact retrieval up to round-off; with keys in general position, above, neither rule is exact):",
                   "", markdown_table(["state"] + [f"n = {int(n)}" for n in on], orows)]
        md += ["", _findings(agg, dphi, ns), ""]
        if problems:
            md.append("**Some rule fell below the floor (see the problems).**")
        else:
            md.append("Every rule stays on or above the floor at every n and seed.")
        if ctx.plots:
            fig, (ax,) = ctx.figure(ncols=1, width=6.0, height=4.2)
            x = ns / dphi
            for i, (label, e) in enumerate(agg.items()):
                m, s = _mean_std(e["mse"])
                ax.errorbar(x, m, yerr=s, ms=3, capsize=2, label=label, **ctx.style(i))
            m, s = _mean_std(first["opt"])
            ax.errorbar(x, m, yerr=s, fmt="k--", capsize=2, label="optimal floor (least squares)")
            ax.set(xlabel="n / D_φ", ylabel="relative retrieval error ‖V̂ − V‖² / ‖V‖²",
                   title=f"Update rules and the floor (D_φ = {dphi})")
            ax.axvline(1.0, color="0.6", lw=0.8)
            ax.grid(True, alpha=0.3)
            ctx.legend_outside(fig, [ax], title=f"mean ± sd, {nseeds} seeds")
            md += ["", ctx.savefig(fig, "rules", "retrieval error against n / D_phi for the additive, delta and "
                                                 "gated delta rules with the least-squares floor")]
    md += failed_md
    return Rendered("\n".join(md), f"{len(RULES)} update rules, {len(SEEDS)} seeds", problems)


STUDY = register_study(Study(
    name="rules",
    title="Update rules against the capacity floor",
    command="rules",
    help="retrieval error against n / D_phi for the additive, delta and gated delta rules and the optimal state",
    points=points,
    run=run,
    render=render,
    budget_s={"tiny": 30, "quick": 5, "full": 15},
))
