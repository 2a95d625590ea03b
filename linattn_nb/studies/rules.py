"""Study: update rules against the capacity floor -- retrieval error against n / D_φ.

The rules, their settings and the least-squares optimal state beside them: docs/guide/studies.md.
"""
from __future__ import annotations

import numpy as np

from ..rules import delta_product, kda
from ._claims import compare_claim
from ._study import CI_CAPTION, Rendered, Study, fmt, markdown_table, mean_ci, pm, register_study, split_failed
from .sweep import to_json

#: The rules compared: (label, beta, decay); beta None is the additive rule.
RULES = (
    ("additive", None, None),
    ("delta, β = 1", 1.0, None),
    ("delta, β = 0.5", 0.5, None),
    ("gated delta, β = 1, γ = 0.95", 1.0, 0.95),
)
#: Rules of the diagonal-plus-low-rank family in the one-pass regime: (label, rule, its arguments as constants
#: per token; ``decay_range`` (low, high): a per-feature ``decay`` spread evenly over the features).
DPLR_ROWS = (
    ("KDA, β = 1, α ∈ [0.9, 1] per feature", kda.RULE.name, {"decay_range": [0.9, 1.0], "beta": 1.0}),
    ("DeltaProduct, n_h = 2, β = 0.5", delta_product.RULE.name, {"beta": [0.5, 0.5]}),
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


#: Passes over the pairs of the repeated-passes regime (the delta rule converges towards the least-squares state).
PASSES = (5, 20)


def points(ctx) -> list[dict]:
    d, ns, trials = _sizes(ctx)
    pts = [dict(kind="gaussian", rule=label, beta=beta, decay=decay, d=d, n_pairs=ns, trials=trials, seed=s,
                method=METHOD)
           for label, beta, decay in RULES for s in SEEDS]
    pts += [dict(kind="gaussian", rule=label, beta=None, decay=None, d=d, n_pairs=ns, trials=trials, seed=s,
                 method=METHOD, dplr=name, dplr_arguments=args)
            for label, name, args in DPLR_ROWS for s in SEEDS]
    orth = sorted({max(1, d // 2), d})
    pts += [dict(kind="orthonormal", rule=label, beta=beta, decay=None, d=d, n_pairs=orth, trials=trials, seed=s,
                 method=METHOD)
            for label, beta, decay in RULES[:2] for s in SEEDS]
    small = sorted({max(1, d // 4), max(1, d // 2), d})
    pts += [dict(kind="passes", rule=f"{label}, {p} passes", beta=beta, decay=None, d=d, n_pairs=ns, trials=1,
                 seed=s, method=METHOD, passes=p)
            for label, beta, _ in RULES[1:3] for p in PASSES for s in SEEDS]
    pts += [dict(kind="rewrite", rule=label, beta=beta, decay=None, d=d, n_pairs=small, trials=1, seed=s,
                 method=METHOD)
            for label, beta, _ in RULES[:3] for s in SEEDS]
    return pts


def run(kind, rule, beta, decay, d, n_pairs, trials, seed, method=METHOD, passes=1, dplr=None,
        dplr_arguments=None) -> dict:
    """One rule in one regime: accuracy and error of the read-out against n (docs/guide/studies.md)."""
    if kind in ("gaussian", "orthonormal"):
        from ..analysis import recall_capacity

        if dplr is not None:
            args = dict(dplr_arguments or {})
            if "decay_range" in args:
                args["decay"] = np.linspace(*args.pop("decay_range"), d)  # one gate per feature
            res = recall_capacity(FEATURE_MAP, d, np.asarray(n_pairs), trials=trials, seed=seed, normalize=False,
                                  orthogonal_keys=(kind == "orthonormal"), rule=dplr, rule_arguments=args)
            return to_json(res)
        res = recall_capacity(FEATURE_MAP, d, np.asarray(n_pairs), trials=trials, seed=seed, beta=beta,
                              decay=decay, normalize=False, orthogonal_keys=(kind == "orthonormal"), method=method)
        return to_json(res)
    return _run_written(kind, beta, d, list(n_pairs), seed, passes)


def _unit_keys(rng, n, d):
    k = rng.standard_normal((n, d))
    return k / np.linalg.norm(k, axis=1, keepdims=True)


def _run_written(kind, beta, d, n_pairs, seed, passes) -> dict:
    """The regimes written through a LinearAttentionState and read back with ``analysis.read_back``:
    repeated passes over the pairs (``kind="passes"``), or every key written with an old, then a new
    value (``kind="rewrite"``; the new one is to be read among all 2n)."""
    from .. import LinearAttentionState
    from ..analysis import read_back

    acc, mse, opt = [], [], []
    for n in n_pairs:
        rng = np.random.default_rng([seed, n, d, 7])
        keys = _unit_keys(rng, n, d)
        if kind == "passes":
            vals, cand = np.eye(n), None
            writes = [(keys, vals)] * passes
        else:
            eye = np.eye(2 * n)
            vals, cand = eye[n:], eye
            writes = [(keys, eye[:n]), (keys, eye[n:])]
        st = LinearAttentionState(d, vals.shape[1], feature_map=FEATURE_MAP,
                                  rule="additive" if beta is None else "delta", normalize=False)
        for kk, vv in writes:
            if beta is None:
                st.prefill(kk, vv)
            else:
                st.prefill(kk, vv, beta=beta)
        r = read_back(st, keys, vals, candidates=cand)
        acc.append(r.accuracy)
        mse.append(r.error)
        opt.append(max(0.0, 1.0 - np.linalg.matrix_rank(keys) / n))
    return {"n_pairs": list(n_pairs), "d_phi": d, "accuracy": acc, "mse": mse, "optimal_mse": opt,  # not a rule: the argument decay
            "beta": beta, "decay": None, "passes": passes if kind == "passes" else 1, "normalize": False,
            "value_dim": None}


def _pm(mean, half) -> str:
    if abs(float(mean)) < 1e-12 and not float(half) >= 1e-12:  # NaN (one seed): no interval either
        return "< 1e-12"
    return pm(float(mean), float(half))


def _aggregate(ok, kind):
    """{rule label: dict(n, d_phi, mse, acc, opt (seeds, n), seeds)} in study order, for one regime."""
    by = {}
    for r in ok:
        p, res = r["params"], r["result"]
        if p["kind"] != kind:
            continue
        e = by.setdefault(p["rule"], dict(n=np.asarray(res["n_pairs"], dtype=float), d_phi=int(res["d_phi"]),
                                          mse=[], opt=[], acc=[], seeds=[]))
        e["mse"].append(np.asarray(res["mse"], dtype=float))
        e["opt"].append(np.asarray(res["optimal_mse"], dtype=float))
        e["acc"].append(np.asarray(res.get("accuracy", np.full(len(res["mse"]), np.nan)), dtype=float))
        e["seeds"].append(p["seed"])
    out = {}
    for label in by:  # records come in the grid's order
        e = by[label]
        for f in ("mse", "opt", "acc"):
            e[f] = np.asarray(e[f])
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


def _table(agg, cols, dphi, *, floor=True) -> str:
    """Rows: accuracy / error per rule at the columns ``cols`` of n."""
    first = next(iter(agg.values()))
    ns = first["n"]
    rows = []
    for label, e in agg.items():
        ma, ha = mean_ci(e["acc"])
        me, he = mean_ci(e["mse"])
        rows.append([label] + [f"{pm(float(ma[j]), float(ha[j]))} / {_pm(me[j], he[j])}" for j in cols])
    if floor:
        m, h = mean_ci(first["opt"])
        rows.append(["optimal floor (least squares), error"] + [_pm(m[j], h[j]) for j in cols])
        rows.append(["1 − D_φ/n"] + [fmt(max(0.0, 1.0 - dphi / float(ns[j]))) for j in cols])
    return markdown_table(["state"] + [f"n = {int(ns[j])} ({fmt(float(ns[j]) / dphi, 2)} D_φ)" for j in cols], rows)


def _at(e, f, j):
    m, h = mean_ci(e[f])
    return float(m[j]), float(h[j])


def findings(agg, passes, orth, rewrite, dphi) -> list:
    """What each regime shows, in words computed from the statistics (rules stated in the claims)."""
    out = []
    add, d1 = RULES[0][0], RULES[1][0]
    if add in agg and d1 in agg:
        e_add, e_d1 = agg[add], agg[d1]
        ns = e_add["n"]
        at = int(np.argmin(np.abs(ns - dphi)))
        last = len(ns) - 1
        acc_claim = compare_claim(add, *_at(e_add, "acc", last), d1, *_at(e_d1, "acc", last),
                                  higher_is_better=True, measure=f"argmax accuracy at n = {int(ns[last])}")
        err_claim = compare_claim(d1, *_at(e_d1, "mse", at), add, *_at(e_add, "mse", at),
                                  higher_is_better=False, measure=f"error at n = {int(ns[at])}")
        text = (f"- **Random unit keys, one pass.** {acc_claim.text}; {err_claim.text}.")
        if acc_claim.supported and err_claim.supported:
            text += ("  A reversal: by accuracy the additive rule wins, by error the delta rule does.  With unit "
                     "keys and one-hot values the additive read-out of key i for value j is k_i·k_j, largest at "
                     "j = i (Cauchy–Schwarz), so its argmax is right at every n while its error grows with the "
                     "interference; the delta rule's corrections lower the error but move the argmax.")
        ma = mean_ci(e_add["acc"])[0]
        if np.all(ma == 1.0):
            text += f"  The additive rule's accuracy is 1 at every n up to {int(ns[last])}."
        out.append(text)
    if passes:
        lines = []
        for label, e in passes.items():
            ns = e["n"]
            at = int(np.argmin(np.abs(ns - dphi)))
            m, h = _at(e, "mse", at)
            lines.append(f"{label}: {_pm(m, h)}")
        one = _at(agg[d1], "mse", int(np.argmin(np.abs(agg[d1]["n"] - dphi)))) if d1 in agg else None
        text = (f"- **Repeated passes.** At n = D_φ = {dphi} the floor is 0; one pass of the delta rule (β = 1) "
                + (f"leaves {_pm(*one)}, " if one else "") + "repeated passes leave " + "; ".join(lines) + ".")
        reached = [label for label, e in passes.items()
                   if _at(e, "mse", int(np.argmin(np.abs(e["n"] - dphi))))[0] < EXACT]
        text += (f"  Error below {fmt(EXACT)} (retrieval exact to that tolerance) at n = D_φ: "
                 + (", ".join(reached) if reached else "none of them") + ".  Exact recall up to D_φ for keys "
                 "in general position is the least-squares state, which the delta rule approaches only over "
                 "many passes (it is a stochastic-gradient step on the squared read-out error).")
        out.append(text)
    if orth:
        worst = {label: float(np.max(e["mse"])) for label, e in orth.items()}
        exact = [label for label, w in worst.items() if w < 1e-9]
        text = ("- **Orthonormal keys.** Largest error over seeds and n ≤ D_φ: "
                + "; ".join(f"{label}: {fmt(w)}" for label, w in worst.items()) + ".")
        if len(exact) == len(worst) and len(worst) > 1:
            text += "  Every rule is exact here: orthonormal keys do not tell the rules apart."
        out.append(text)
    if rewrite and add in rewrite and d1 in rewrite:
        e_add, e_d1 = rewrite[add], rewrite[d1]
        j = len(e_add["n"]) - 1
        claim = compare_claim(d1, *_at(e_d1, "acc", j), add, *_at(e_add, "acc", j), higher_is_better=True,
                              measure=f"accuracy at n = {int(e_add['n'][j])}")
        text = f"- **Keys rewritten with new values.** {claim.text}."
        if claim.supported:
            text += ("  Here the delta rule wins: a write replaces what the state returned for the key, while the "
                     "additive rule returns old and new values with equal weight (a tie, counted as a miss).")
        out.append(text)
    return out


#: An error below this counts as exact retrieval in the findings.
EXACT = 1e-3


def render(records, ctx) -> Rendered:
    ok, failed, problems, failed_md = split_failed("rules", records)
    md = []
    agg = _aggregate(ok, "gaussian")
    orth = _aggregate(ok, "orthonormal")
    passes = _aggregate(ok, "passes")
    rewrite = _aggregate(ok, "rewrite")
    problems = problems + _below_floor(agg) + _below_floor(orth) + _below_floor(passes)
    if agg:
        first = next(iter(agg.values()))
        dphi, ns = first["d_phi"], first["n"]
        p0 = next(r["params"] for r in ok if r["params"]["kind"] == "gaussian")
        nseeds = max(len(e["seeds"]) for e in agg.values())
        md.append(
            f"Regime: keys i.i.d. N(0, 1) in R^{p0['d']} mapped by φ(k) = k/‖k‖ (unit keys, D_φ = {dphi}), "
            "one-hot values (M = n), the n pairs written one per token into a D_φ × M state and every key read "
            "after the last write; unnormalised read-out φ(k)ᵀS for every rule; delta rules run by "
            f"`linear_attention(..., beta=, method={p0['method']!r})` in float64 (repeated passes and rewrites "
            "by `LinearAttentionState.prefill`, read by `linattn_nb.analysis.read_back`; KDA and DeltaProduct by "
            "`dplr_attention`).  Each cell: argmax "
            "accuracy / relative error ‖V̂ − V‖²/‖V‖², "
            f"{CI_CAPTION} ({nseeds} seeds).  The floor is the least-squares state of the same size on the "
            "same keys: 0 up to n = D_φ, 1 − D_φ/n beyond (for one-hot values every read-out φ(K)S has rank "
            "≤ D_φ, and no update rule can do better).  Rule for \"beats\": the two 95% intervals do not "
            "overlap.")
        cols = list(range(len(ns)))
        if len(cols) > 7:
            cols = sorted({0, len(ns) // 4, len(ns) // 2, (3 * len(ns)) // 4, len(ns) - 1}
                          | {int(np.argmin(np.abs(ns - dphi))), int(np.argmin(np.abs(ns - 2 * dphi)))})
        md += ["", f"Random unit keys, one pass: accuracy / error against n (D_φ = {dphi}):", "",
               _table(agg, cols, dphi)]
        if passes:
            md += ["", f"Random unit keys, the pairs written {' or '.join(map(str, PASSES))} times over (delta "
                       "rules), accuracy / error:", "", _table(passes, cols, dphi)]
        if orth:
            oc = list(range(len(next(iter(orth.values()))["n"])))
            md += ["", "Orthonormal keys (a random orthonormal frame), n ≤ D_φ, accuracy / error:", "",
                   _table(orth, oc, dphi, floor=False)]
        if rewrite:
            rc = list(range(len(next(iter(rewrite.values()))["n"])))
            md += ["", "Random unit keys written twice, first with old values and then with new ones (one-hot in "
                       "2n dimensions); accuracy: the new value is strictly nearest among all 2n; error against "
                       "the new values:", "", _table(rewrite, rc, dphi, floor=False)]
        md += ["", "What it shows (computed from the tables above):", ""] + findings(agg, passes, orth, rewrite, dphi)
        md.append("")
        if problems:
            md.append("**Some rule fell below the floor (see the problems).**")
        else:
            md.append("Every rule stays on or above the floor at every n and seed.")
        if ctx.plots:
            fig, (ax, ax2) = ctx.figure(ncols=2, width=4.6, height=4.0)
            x = ns / dphi
            series = list(agg.items()) + list(passes.items())
            for i, (label, e) in enumerate(series):
                m, h = mean_ci(e["mse"])
                ax.errorbar(x, m, yerr=h, ms=3, capsize=2, label=label, **ctx.style(i))
                m, h = mean_ci(e["acc"])
                ax2.errorbar(x, m, yerr=h, ms=3, capsize=2, label="_", **ctx.style(i))
            m, h = mean_ci(first["opt"])
            ax.errorbar(x, m, yerr=h, fmt="k--", capsize=2, label="optimal floor (least squares)")
            ax.set(xlabel="n / D_φ", ylabel="relative retrieval error ‖V̂ − V‖² / ‖V‖²",
                   title=f"Error (D_φ = {dphi})")
            ax2.set(xlabel="n / D_φ", ylabel="argmax accuracy", title="Accuracy")
            for a in (ax, ax2):
                a.axvline(1.0, color="0.6", lw=0.8)
                a.grid(True, alpha=0.3)
            ctx.legend_outside(fig, [ax, ax2], title=f"mean, 95% CI, {nseeds} seeds")
            md += ["", ctx.savefig(fig, "rules", "retrieval error and argmax accuracy against n / D_phi for the "
                                                 "additive, delta, gated delta, KDA and DeltaProduct rules with the least-squares floor"),
                   "", f"Random unit keys; {CI_CAPTION}."]
    md += failed_md
    return Rendered("\n".join(md), f"{len(RULES) + len(DPLR_ROWS)} update rules, {len(SEEDS)} seeds", problems)


STUDY = register_study(Study(
    name="rules",
    title="Update rules against the capacity floor",
    command="rules",
    help="retrieval error against n / D_phi for the additive, delta, gated delta, KDA and DeltaProduct rules and the optimal state",
    points=points,
    run=run,
    render=render,
    figures=("rules",),
    budget_s={"tiny": 30, "quick": 5, "full": 15},
))
