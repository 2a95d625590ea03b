"""The report's conclusions are computed from its statistics: the claim rules on small synthetic numbers.

Each rule is checked on both sides (supported, not supported) and where its
precondition fails (not applicable); the rendered studies are checked on
synthetic records, so that a table and the sentence under it cannot disagree.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from linattn_nb.studies._claims import NOT_APPLICABLE, NOT_SUPPORTED, SUPPORTED, compare_claim, slope_claim
from linattn_nb.studies._study import CI_CAPTION, fit_slope, mean_ci


# ---------------------------------------------------------------------------
# One uncertainty convention
# ---------------------------------------------------------------------------
def test_mean_ci_is_the_student_t_interval_over_the_seeds():
    from scipy import stats

    x = np.array([[1.0, 10.0], [2.0, 12.0], [4.0, 11.0], [5.0, 15.0]])
    m, h = mean_ci(x)
    np.testing.assert_allclose(m, x.mean(0))
    np.testing.assert_allclose(h, stats.t.ppf(0.975, 3) * x.std(0, ddof=1) / 2.0)
    m1, h1 = mean_ci([3.0])  # one seed: no interval (NaN, not a width of 0)
    assert float(m1) == 3.0 and math.isnan(float(h1))
    m2, h2 = mean_ci([1.0, np.nan, 3.0])  # NaN left out: two samples
    assert float(m2) == 2.0 and float(h2) == pytest.approx(stats.t.ppf(0.975, 1) * math.sqrt(2) / math.sqrt(2))
    assert "95% Student-t" in CI_CAPTION


def _one_seed_recall_records(accuracy=0.5):
    """Records of the recall study with one seed: one map, one regime, n = 2 and 8 pairs."""
    params = dict(feature_map="elu", num_features=None, map_params=None, regime="variance", d=4, seed=0, trials=1,
                  key_scale=1.0, orthogonal_keys=False, value_dim=None)
    result = dict(n_pairs=[2, 8], accuracy=[accuracy, 0.25], mse=[0.5, 0.8], optimal_mse=[0.0, 0.5],
                  softmax_accuracy=[1.0, 0.5], softmax_mse=[0.1, 0.6], optimal_accuracy=[1.0, 0.5], d_phi=4,
                  estimator="", readout="normalised")
    return [dict(type="result", key="k", params=params, status="ok", result=result)]


def test_one_seed_gives_no_interval_and_no_conclusion_from_one(tmp_path):
    """With one seed the spread is "n/a", never "± 0"; a claim that compares intervals is not applicable, and
    a claim that quotes an accuracy says that one seed gives no interval."""
    from linattn_nb.studies import Context, recall
    from linattn_nb.studies._claims import capacity_claim
    from linattn_nb.studies._study import pm

    m, h = mean_ci(np.array([[0.5, 0.25]]))  # one seed, two n
    assert np.all(np.isnan(h)) and pm(m[0], h[0]) == "0.5 ± n/a"
    c = compare_claim("additive", 1.0, float("nan"), "delta", 0.3, float("nan"), higher_is_better=True,
                      measure="accuracy")
    assert c.verdict == NOT_APPLICABLE and "one seed gives no 95% interval" in c.text and "± 0" not in c.text
    c = capacity_claim(np.array([2.0, 8.0]), m, h, np.array([0.0, 0.5]), 4)
    assert "accuracy 0.5 (one seed gives no 95% interval) at n = 2" in c.text and "±" not in c.text
    md = recall.render(_one_seed_recall_records(), Context(out=tmp_path, profile="tiny", plots=False)).markdown
    assert not re.search(r"± 0(?![.\d])", md)  # no interval of width 0
    assert "0.5 ± n/a" in md and "accuracy 0.5 (one seed gives no 95% interval) at n = 2" in md
    assert "1 seed (a seed draws" in md and "1 seeds" not in md  # the regime line counted "1 seeds"


def test_seeds_text_counts_one_seed_and_many():
    from linattn_nb.studies._study import seeds_text

    assert [seeds_text(n) for n in (1, 2, 5)] == ["1 seed", "2 seeds", "5 seeds"]


def test_mqar_checks_are_not_applicable_with_one_seed():
    """The MQAR checks compare intervals: with one seed each says it is not tested rather than concluding."""
    from linattn_nb.studies import mqar

    recs = []
    for kv in (4, 16):
        for d in (8, 16, 32):
            for layer, acc in (("softmax", 0.99), ("additive-elu", 1.0 if kv <= d else 0.3),
                               ("delta", 1.0 if kv <= 2 * d else 0.6)):
                length = mqar.seq_length(kv)
                params = dict(layer=layer, head_dim=d, kv=kv, length=length, seed=0, steps=600, vocab=mqar.VOCAB,
                              d_model=mqar.D_MODEL, heads=mqar.HEADS, n_train=100, n_test=10, eval_every=100,
                              lr=mqar.LR)
                result = dict(final_accuracy=acc, best_accuracy=acc, steps=600, seconds=1.0,
                              curve=[dict(step=600, loss=1.0, acc=acc, seconds=1.0)], parameters=1,
                              d_phi=mqar.feature_dim(layer, d), state=mqar.state_numbers(layer, d, length=length),
                              machine="cpu", threads=1)
                recs.append(dict(type="result", key=f"{layer}{d}{kv}", params=params, status="ok", result=result))
    claims = mqar.findings(mqar._Agg(recs))
    assert [c.verdict for c in claims] == [NOT_APPLICABLE] * 3, [c.text for c in claims]
    assert all("one seed gives no 95% interval" in c.text for c in claims)


# ---------------------------------------------------------------------------
# Slopes
# ---------------------------------------------------------------------------
def _fit(slope, lo, hi):
    return {"slope": slope, "lo": lo, "hi": hi, "seeds": 5, "level": 0.95}


def test_slope_claim_supported_only_inside_the_interval_with_small_errors():
    c = slope_claim(_fit(-0.48, -0.55, -0.41), [0.4, 0.2, 0.1, 0.05])
    assert c.verdict == SUPPORTED and c.supported and "contains -0.5" in c.text
    assert "interval" in c.rule and "below 1" in c.rule


def test_slope_claim_not_supported_when_the_interval_excludes_the_rate():
    # FAVOR+ at s = 0.5 in the full report: -0.39 [-0.45, -0.34]
    c = slope_claim(_fit(-0.39, -0.45, -0.34), [0.43, 0.28, 0.15, 0.08])
    assert c.verdict == NOT_SUPPORTED and "excludes -0.5" in c.text and "shallower" in c.text
    c = slope_claim(_fit(-0.9, -1.0, -0.8), [0.5, 0.1])
    assert c.verdict == NOT_SUPPORTED and "steeper" in c.text


def test_slope_claim_not_applicable_where_the_errors_are_not_small():
    # rff at s = 1 in the full report: -1.93 [-4.30, 0.44] on errors of 6e8 to 7e10
    c = slope_claim(_fit(-1.93, -4.30, 0.44), [7e10, 3e9, 6e8])
    assert c.verdict == NOT_APPLICABLE and "7.00e+10" in c.text and not c.supported
    # FAVOR+ at s = 1: flat on errors above 1
    assert slope_claim(_fit(-0.05, -0.2, 0.1), [1.3, 1.2, 1.25]).verdict == NOT_APPLICABLE
    assert slope_claim(_fit(-0.5, -0.6, -0.4), [0.5, float("inf")]).verdict == NOT_APPLICABLE
    assert slope_claim(None, [0.1, 0.05]).verdict == NOT_APPLICABLE


def test_slope_claim_an_interval_that_also_contains_zero_shows_no_rate():
    c = slope_claim(_fit(-0.24, -1.14, 0.66), [0.48, 0.29, 0.32])
    assert c.verdict == NOT_SUPPORTED and "and 0 as well" in c.text


def test_slope_claim_on_fitted_synthetic_errors():
    rng = np.random.default_rng(1)
    m = np.array([16, 64, 256, 1024])
    ys = 2.0 / np.sqrt(m) * np.exp(0.05 * rng.standard_normal((5, m.size)))
    assert slope_claim(fit_slope(m, ys), ys.mean(0)).verdict == SUPPORTED
    ys = 2.0 / m ** 0.3 * np.exp(0.02 * rng.standard_normal((5, m.size)))
    assert slope_claim(fit_slope(m, ys), ys.mean(0)).verdict == NOT_SUPPORTED


# ---------------------------------------------------------------------------
# Comparisons and thresholds
# ---------------------------------------------------------------------------
def test_compare_claim_needs_separate_intervals():
    c = compare_claim("additive", 1.0, 0.0, "delta", 0.3, 0.05, higher_is_better=True, measure="accuracy")
    assert c.verdict == SUPPORTED and c.text.startswith("additive beats delta on accuracy")
    c = compare_claim("delta", 0.3, 0.05, "additive", 1.0, 0.0, higher_is_better=True, measure="accuracy")
    assert c.verdict == NOT_SUPPORTED and c.text.startswith("additive beats delta")
    c = compare_claim("delta", 0.6, 0.1, "additive", 0.97, 0.05, higher_is_better=False, measure="error")
    assert c.verdict == SUPPORTED and "delta beats additive on error" in c.text
    c = compare_claim("delta", 0.74, 0.16, "additive", 1.06, 0.38, higher_is_better=False, measure="error")
    assert c.verdict == NOT_SUPPORTED and "no difference shown" in c.text and "overlap" in c.text
    assert compare_claim("a", float("nan"), 0.0, "b", 1.0, 0.0, higher_is_better=True,
                         measure="x").verdict == NOT_APPLICABLE


# ---------------------------------------------------------------------------
# The rules study's findings on synthetic statistics
# ---------------------------------------------------------------------------
def _entry(n, acc, mse, opt=None, seeds=5, jitter=0.0):
    rng = np.random.default_rng(0)
    acc = np.asarray(acc, dtype=float)
    mse = np.asarray(mse, dtype=float)
    a = np.clip(acc + jitter * rng.standard_normal((seeds, acc.size)), 0, 1)
    return dict(n=np.asarray(n, dtype=float), d_phi=32, acc=a,
                mse=mse + jitter * rng.standard_normal((seeds, mse.size)),
                opt=np.zeros((seeds, len(n))) if opt is None else np.tile(opt, (seeds, 1)), seeds=list(range(seeds)))


def test_rules_findings_state_the_reversal_and_where_the_delta_rule_wins():
    from linattn_nb.studies import rules

    n = [16, 32, 64, 128]
    agg = {"additive": _entry(n, [1, 1, 1, 1], [0.52, 0.97, 1.95, 3.98], jitter=0.0),
           "delta, β = 1": _entry(n, [1.0, 0.9, 0.6, 0.3], [0.31, 0.60, 1.05, 1.50], jitter=0.01)}
    agg["additive"]["mse"] = agg["additive"]["mse"] + 0.01 * np.random.default_rng(3).standard_normal((5, 4))
    passes = {"delta, β = 1, 20 passes": _entry(n, [1, 1, 0.8, 0.3], [0.0, 0.19, 1.0, 1.5], jitter=0.01)}
    orth = {"additive": _entry([16, 32], [1, 1], [1e-31, 1e-31]),
            "delta, β = 1": _entry([16, 32], [1, 1], [1e-32, 1e-32])}
    rewrite = {"additive": _entry([8, 16, 32], [0, 0, 0], [1.0, 1.4, 2.9]),
               "delta, β = 1": _entry([8, 16, 32], [1, 1, 0.93], [0.2, 0.4, 0.7], jitter=0.01)}
    lines = rules.findings(agg, passes, orth, rewrite, 32)
    text = "\n".join(lines)
    assert "additive beats delta, β = 1 on argmax accuracy at n = 128" in text
    assert "delta, β = 1 beats additive on error at n = 32" in text
    assert "A reversal" in text and "Cauchy–Schwarz" in text
    assert "accuracy is 1 at every n up to 128" in text
    assert "Every rule is exact here: orthonormal keys do not tell the rules apart" in text
    assert "delta, β = 1 beats additive on accuracy at n = 32" in text and "Here the delta rule wins" in text
    assert "Error below 0.001" in text and "none of them" in text
    # without a separation the reversal is not claimed
    agg["delta, β = 1"] = _entry(n, [1.0, 0.99, 0.98, 0.97], [0.5, 0.97, 1.9, 3.9], jitter=0.05)
    text = "\n".join(rules.findings(agg, {}, {}, {}, 32))
    assert "A reversal" not in text


# ---------------------------------------------------------------------------
# The error study's render on synthetic records: signed maps apart, claims from the data
# ---------------------------------------------------------------------------
def _error_records(rate=0.5):
    recs = []
    ms = [16, 64, 256]
    for seed in range(4):
        noise = 1.0 + 0.02 * (seed - 1.5)
        for n in (64, 128):
            for name, pos, err in (("elu", True, 0.3), ("identity", False, 3e9)):
                res = dict(output_rel_error=err * noise, tv_mean=0.1, js_mean=0.01, kl_mean=0.02,
                           kl_infinite_rate=0.0, entropy_softmax=4.0, entropy_linear=4.0, monotonicity=0.5,
                           nonpositive_normalizer_rate=0.0 if pos else 0.5, d_phi=8, is_positive=pos)
                if not pos:
                    res.update(normalizer_le_eps_rate=0.5, unnormalized_rel_error=0.9)
                recs.append(dict(status="ok", result=res, params=dict(
                    feature_map=name, num_features=None, n=n, d=8, causal=False, qk_scale=0.5, seed=seed)))
            for m in ms:
                if n != 128 and m != 64:
                    continue
                err = 3.0 / math.sqrt(m) if rate == 0.5 else 0.75 * (m / 16) ** -rate
                res = dict(output_rel_error=err * noise, tv_mean=0.1, js_mean=0.01, kl_mean=0.02,
                           kl_infinite_rate=0.0, entropy_softmax=4.0, entropy_linear=4.0, monotonicity=0.5,
                           nonpositive_normalizer_rate=0.0, d_phi=m, is_positive=True)
                recs.append(dict(status="ok", result=res, params=dict(
                    feature_map="favor+", num_features=m, n=n, d=8, causal=False, qk_scale=0.5, seed=seed)))
    return recs


def test_error_render_keeps_signed_maps_out_of_the_ranking_and_computes_the_slope_claim(tmp_path):
    from linattn_nb.studies import Context, error

    md = error.render(_error_records(), Context(out=tmp_path, profile="tiny", plots=False)).markdown
    ranking = md.split("Positive maps ranked by output error")[1].split("\n\n")[1]
    assert "identity" not in ranking and "| elu |" in ranking
    signed = md.split("**Signed maps**")[1].split("\n\n")[1]
    assert "| identity |" in signed and "0.5 / 0.9" in signed and "elu" not in signed
    assert "- favor+, s = 0.5: supported: slope -0.50" in md
    assert CI_CAPTION in md and "standard deviation over" not in md
    assert "O(1/m) bias" not in md  # a supported rate needs no account


def test_error_render_says_why_a_positive_map_falls_more_slowly_than_one_over_root_m(tmp_path):
    from linattn_nb.studies import Context, error

    md = error.render(_error_records(rate=0.3), Context(out=tmp_path, profile="tiny", plots=False)).markdown
    line = [x for x in md.splitlines() if x.startswith("- favor+, s = 0.5")][0]
    assert "not supported: slope -0.30" in line and "shallower than m^-0.5" in line
    assert "falls more slowly than 1/√m over the whole grid, and still over m ≥ 64" in line
    assert "Not the ratio's O(1/m) bias, which would make the slope steeper" in line


# ---------------------------------------------------------------------------
# The throughput headline: only from points that pass the noise rule
# ---------------------------------------------------------------------------
def _tp_records(rates_lin, times_soft):
    recs = []
    for (n, g), ts in zip(rates_lin, times_soft):
        for kind, method in (("linear", "scan"), ("softmax", "blocked")):
            params = dict(kind=kind, device="cpu", method=method, n=n, batch=1, d=4, m=4, dtype="float32",
                          feature_map="elu", min_time=0.0)
            res = dict(median_s=1e-3 if kind == "linear" else ts, tokens_per_s=1e6, numba_threads=2,
                       load1_before=1.0 + n / 1e4, load1_after=2.0, sgemm_gflops_before=50.0 + n / 512,
                       sgemm_gflops_after=10.0)
            if kind == "linear":
                res["gflops"] = g
            recs.append(dict(status="ok", params=params, result=res))
    return recs


def test_throughput_headline_skips_a_point_at_half_its_neighbours_rate(tmp_path):
    from linattn_nb.studies import Context, throughput

    assert throughput.clean_points({1: 100.0, 2: 90.0, 3: 50.1, 4: 100.0}) == [1, 2, 4]
    # the largest N's linear rate is 0.501 of its neighbours': not noisy by the 0.5 flag, but no headline
    recs = _tp_records([(1024, 100.0), (2048, 100.0), (4096, 100.0), (8192, 50.1)], [1e-3, 4e-3, 16e-3, 64e-3])
    r = throughput.render(recs, Context(out=tmp_path, profile="tiny", plots=False))
    assert "(noisy)" not in r.markdown
    assert r.summary.startswith("linear 16× faster than softmax at N = 4096")
    assert "Headline: linear scan (cpu) is 16× faster than softmax at N = 4096, the largest N at which" in r.markdown
    # sgemm per point, not a range
    assert "| 8192 | 1.8 → 2; 66 → 10 | 1.8 → 2; 66 → 10 |" in r.markdown and "–" not in r.markdown.split("Machine state")[1]


# ---------------------------------------------------------------------------
# Recall: capacity told apart from a map that fails while its state has room
# ---------------------------------------------------------------------------
def _recall_entry(n, acc, dphi=16, softmax=None, est="", opt_acc=None):
    acc = np.asarray(acc, dtype=float)
    floor = np.maximum(0.0, 1.0 - dphi / n)
    stats = {"accuracy": (acc, 0 * acc), "optimal_mse": (floor, 0 * floor), "mse": (0 * acc + 0.9, 0 * acc),
             "softmax_accuracy": (np.ones_like(acc) if softmax is None else np.asarray(softmax, float), 0 * acc)}
    if opt_acc is not None:
        stats["optimal_accuracy"] = (np.asarray(opt_acc, dtype=float), 0 * acc)
    return n, dphi, stats, est


def test_recall_findings_call_a_failure_capacity_only_past_d_phi():
    from linattn_nb.studies.recall import ACCURACY, _findings

    n = np.array([4.0, 8.0, 16.0, 32.0, 64.0])
    agg = {("small logits", "elu"): _recall_entry(n, [0.5, 0.4, 0.3, 0.2, 0.1]),
           ("small logits", "dpfp"): _recall_entry(n, [1.0, 1.0, 1.0, 0.7, 0.4]),
           ("small logits", "taylor2"): _recall_entry(n, [1.0] * 5, dphi=273),
           ("variance", "elu"): _recall_entry(n, [0.1] * 5)}
    lines = _findings(agg, ["variance", "small logits"])
    assert lines[0].startswith("Rule: ") and "n > D_φ" in lines[0]
    var_elu, elu, dpfp, taylor = lines[1:5]  # one per map and regime, in the regimes' order
    assert var_elu.startswith("- elu, variance regime: capacity not supported")
    assert "at n = 4, first below 0.9, D_φ = 16" in elu and "not capacity" in elu and "the map's kernel" in elu
    assert "capacity supported" in dpfp and f"at n = 32, first below {ACCURACY}, D_φ = 16" in dpfp
    assert "consistent with the state's capacity" in dpfp
    assert "capacity not applicable" in taylor and "no n past D_φ measured" in taylor and "n = 64" in taylor
    assert "- small logits regime: capacity binds for dpfp." in lines
    assert "- variance regime: capacity binds for no map." in lines
    # a failure exactly at n = D_φ is not capacity: the floor is still 0 there
    agg = {("small logits", "m"): _recall_entry(n, [1.0, 1.0, 0.5, 0.2, 0.1])}
    assert "not capacity" in _findings(agg, ["small logits"])[1]


def test_recall_findings_in_the_fixed_state_regime_judge_the_least_squares_state():
    from linattn_nb.studies.recall import _findings

    n = np.array([4.0, 8.0, 16.0, 32.0, 64.0])
    agg = {("fixed state", "elu"): _recall_entry(n, [0.3, 0.1, 0.1, 0.05, 0.0], opt_acc=[1, 1, 1, 0.6, 0.1]),
           ("fixed state", "dpfp"): _recall_entry(n, [1.0, 0.8, 0.5, 0.2, 0.1], dphi=32, opt_acc=[1, 1, 1, 1, 0.5]),
           ("fixed state", "wide"): _recall_entry(n, [1.0] * 5, dphi=128, opt_acc=[1.0] * 5),
           ("variance", "elu"): _recall_entry(n, [0.1] * 5, opt_acc=[1, 1, 1, 1, 0.95])}
    lines = _findings(agg, ["variance", "fixed state"], fixed={"fixed state"})
    ls = [x for x in lines if "least-squares state of each map's size" in x]
    assert len(ls) == 1 and ls[0].startswith("- fixed state regime")  # judged only where the width is fixed
    assert ("binds for elu (D_φ = 16, first below at n = 32 = 2 D_φ); dpfp (D_φ = 32, first below at n = 64 = 2 D_φ)"
            in ls[0])
    assert "a larger D_φ never brings the fall earlier" in ls[0]
    assert "not for wide (not applicable" in ls[0]
    assert "The read-out of elu, dpfp falls before its state is full" in ls[0]
    # the one-hot regime keeps its own account: the best state passes D_φ there because M = n
    passes = [x for x in lines if x.startswith("- With one-hot values")]
    assert len(passes) == 1 and "elu, variance: n = 64 = 4 D_φ" in passes[0] and "fixed state" not in passes[0]


def test_capacity_claim_names_the_estimators_variance_only_where_softmax_reads():
    from linattn_nb.studies._claims import capacity_claim

    n = np.array([4.0, 8.0, 16.0, 32.0])
    _, dphi, st, _ = _recall_entry(n, [1.0, 0.8, 0.5, 0.3], dphi=128)
    args = (n, st["accuracy"][0], st["accuracy"][1], st["optimal_mse"][0], dphi)
    c = capacity_claim(*args, reference=np.array([1.0, 0.95, 0.9, 0.9]), estimator="random")
    assert c.verdict == NOT_SUPPORTED and "the estimator's variance" in c.text and "reads 0.95 there" in c.text
    c = capacity_claim(*args, reference=np.array([1.0, 0.5, 0.4, 0.3]), estimator="random")
    assert "the kernel it estimates (softmax too reads only 0.5)" in c.text and "variance" not in c.text
    c = capacity_claim(*args, reference=np.array([1.0, 0.95, 0.9, 0.9]), estimator="deterministic")
    assert "its approximation of softmax" in c.text and "variance" not in c.text
    assert "the map's kernel" in capacity_claim(*args, reference=np.ones(4)).text
    # accuracy >= threshold past D_φ: argmax accuracy does not measure capacity
    c = capacity_claim(n, np.ones(4), 0 * n, np.maximum(0, 1 - 8 / n), 8)
    assert c.verdict == NOT_SUPPORTED and "passes the capacity limit" in c.text and "floor is 0.75" in c.text


def test_recall_findings_call_a_fall_capacity_where_the_floor_is_above_0_before_d_phi():
    """Features of rank below n (DPFP's of a few random keys in a small d) fill the state before D_φ: the least-squares
    floor is above 0 there, and the report must not say the state has room."""
    from linattn_nb.studies._claims import capacity_claim
    from linattn_nb.studies.recall import _findings

    n = np.array([3.0, 4.0, 6.0, 8.0, 16.0])
    n_, dphi, st, est = _recall_entry(n, [1.0, 0.8, 0.6, 0.5, 0.3], dphi=8, opt_acc=[1.0, 0.95, 0.85, 0.8, 0.5])
    st["optimal_mse"] = (np.array([0.0, 0.02, 0.15, 0.2, 0.53]), 0 * n)  # rank-deficient from n = 4
    c = capacity_claim(n, st["accuracy"][0], st["accuracy"][1], st["optimal_mse"][0], dphi)
    assert c.supported and "at n = 4, first below 0.9" in c.text and "rank below n" in c.text
    assert "has room" not in c.text and "least-squares floor is above 0" in c.rule
    lines = _findings({("fixed state", "dpfp"): (n_, dphi, st, est)}, ["fixed state"], fixed={"fixed state"})
    assert "capacity binds for dpfp." in " ".join(lines)
    ls = [x for x in lines if "least-squares state of each map's size" in x][0]
    assert "binds for dpfp (D_φ = 8, first below at n = 6" in ls
    assert "For dpfp the floor is above 0 already at some n ≤ D_φ" in ls
    assert "exact while n ≤ D_φ" not in ls and "falls before its state is full" not in ls
    # a floor of rounding size is 0: the state still has room there
    st["optimal_mse"] = (np.array([0.0, 1e-16, 1e-14, 0.0, 0.5]), 0 * n)
    c = capacity_claim(n, st["accuracy"][0], st["accuracy"][1], st["optimal_mse"][0], dphi)
    assert not c.supported and "has room" in c.text


def test_recall_findings_say_where_the_least_squares_state_reads_past_d_phi():
    from linattn_nb.studies.recall import _findings

    n = np.array([8.0, 16.0, 32.0, 64.0])
    agg = {("variance", "elu"): _recall_entry(n, [0.5] * 4, opt_acc=[1.0, 1.0, 0.95, 0.6]),
           ("variance", "dpfp"): _recall_entry(n, [0.5] * 4, dphi=32, opt_acc=[1.0, 1.0, 1.0, 0.5])}
    line = [x for x in _findings(agg, ["variance"]) if x.startswith("- With one-hot values the least-squares state")]
    assert len(line) == 1 and "elu, variance: n = 32 = 2 D_φ" in line[0] and "dpfp" not in line[0]
    assert "M = n, so the state (D_φ × n) grows" in line[0]
