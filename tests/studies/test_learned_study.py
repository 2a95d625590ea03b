"""The 'learned' study (linattn_nb.studies.learned): Hedgehog's qualitative claim and the study's tiny profile.

Claim (Zhang et al., ICLR 2024, in the low-entropy regime): a Hedgehog map fitted to softmax weights
on one draw has, on a fresh draw, a lower KL(softmax ‖ linear) and a higher Spearman monotonicity than
ELU+1 and than FAVOR+ with as many features (m = 2d = Hedgehog's D_φ).  T2R's parts run only where the
"t2r" map is registered.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from linattn_nb import cli
from linattn_nb import feature_maps as fm
from linattn_nb.studies import Context, get_study, load_results, run_report
from linattn_nb.studies import error as error_study
from linattn_nb.studies import learned

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LOW = dict(zip(("regime", "input_scale", "temperature"), learned.REGIMES[2]))


def _needs_t2r():
    if "t2r" not in fm.available():
        pytest.skip("the 't2r' feature map is not registered in this build")


@pytest.fixture(scope="module")
def low_entropy():
    """One point of the study in the low-entropy regime, fixed seed, d = 16, N = 256, 30 L-BFGS steps."""
    assert LOW["regime"] == "low-entropy" and LOW["temperature"] == 2.0 and LOW["input_scale"] == 1.0
    return learned.run(**LOW, d=16, n=256, steps=30, seed=0, t2r="t2r" in fm.available())


def test_fitted_hedgehog_beats_elu_and_favor_at_the_same_size_on_held_out_inputs(low_entropy):
    maps = low_entropy["maps"]
    hh, elu, favor = maps["hedgehog"], maps["elu"], maps["favor+"]
    assert hh["d_phi"] == favor["d_phi"] == 2 * 16 == maps["hedgehog_start"]["d_phi"]
    for other in (elu, favor):
        assert hh["kl_mean"] < other["kl_mean"], (hh["kl_mean"], other["kl_mean"])
        assert hh["monotonicity"] > other["monotonicity"], (hh["monotonicity"], other["monotonicity"])
    # the fit did something, on the training draw and on the fresh one
    fit = low_entropy["fits"]["hedgehog"]
    assert fit["steps_done"] >= 1 and fit["train_end"] < fit["train_start"]
    assert fit["heldout_end"] < fit["heldout_start"]
    assert hh["kl_mean"] < maps["hedgehog_start"]["kl_mean"]


def test_the_evaluation_draw_is_not_the_training_draw():
    qt, kt, qe, ke, ve = learned.draw(0, 16, 256, 1.0)
    assert qt.shape == qe.shape == ve.shape == (1, 256, 16)
    assert not np.allclose(qt, qe) and not np.allclose(kt, ke)
    # the regimes are paired: the same seed draws the same standard-normal inputs, scaled
    q5 = learned.draw(0, 16, 256, 0.5)[0]
    np.testing.assert_allclose(q5, 0.5 * qt)


def test_fitted_maps_are_new_objects_and_the_start_is_the_identity():
    starts = learned.start_maps(4, t2r=False)
    np.testing.assert_array_equal(starts["hedgehog"].W, np.eye(4))
    np.testing.assert_array_equal(starts["hedgehog"].b, np.zeros(4))
    assert starts["hedgehog"].output_dim(4) == 8


def test_t2r_starts_at_plus_minus_identity_and_is_measured(low_entropy):
    _needs_t2r()
    start = learned.start_maps(4)["t2r"]
    np.testing.assert_array_equal(start.W, np.vstack([np.eye(4), -np.eye(4)]))
    assert start.output_dim(4) == 8
    x = np.array([[1.0, -2.0, 0.0, 3.0]])
    np.testing.assert_array_equal(start(x), np.maximum(np.concatenate([x, -x], axis=-1), 0.0))
    maps = low_entropy["maps"]
    assert maps["t2r"]["d_phi"] == maps["t2r_start"]["d_phi"] == 32
    assert 0.0 <= maps["t2r"]["kl_infinite_rate"] <= 1.0 and np.isfinite(maps["t2r"]["js_mean"])
    assert low_entropy["fits"]["t2r"]["train_end"] < low_entropy["fits"]["t2r"]["train_start"]


def test_profiles_and_regimes(tmp_path):
    """Three regimes, the benign one the error study's; >= 5 seeds in quick and full; sizes as the studies
    guide gives them."""
    assert learned.REGIMES[0] == ("benign", error_study.QK_SCALE, 1.0)
    assert [r[0] for r in learned.REGIMES] == ["benign", "gaussian", "low-entropy"]
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "guide" / "studies.md").read_text(
        encoding="utf-8").split())
    for profile in ("tiny", "quick", "full"):
        pts = learned.points(Context(out=tmp_path, profile=profile))
        d, n, steps, seeds = learned._sizes(Context(out=tmp_path, profile=profile))
        assert {p["regime"] for p in pts} == {r[0] for r in learned.REGIMES}
        assert len(pts) == 3 * seeds and {p["seed"] for p in pts} == set(range(seeds))
        assert all(p["d"] == d and p["n"] == n and p["steps"] == steps for p in pts)
        assert all(p["t2r"] == ("t2r" in fm.available()) for p in pts)
        assert f"{profile} {d}, {n}, {steps}, {seeds}" in doc
        if profile != "tiny":
            assert seeds >= 5
    study = get_study("learned")
    assert study.command == "learned" and study.budget_s["full"] <= 60 and study.budget_s["quick"] <= 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("learned") / "report"
    res = run_report(out, profile="tiny", studies=["learned"], device="cpu", progress=False, log=lambda line: None)
    return out, res


def test_tiny_profile_runs_and_writes_its_tables(tiny):
    out, res = tiny
    assert res.problems == []
    recs = load_results(out / "learned.jsonl")
    assert len(recs) == 6 and all(r["status"] == "ok" for r in recs)
    for r in recs:
        assert set(r["result"]["fits"]) == ({"hedgehog", "t2r"} if r["params"]["t2r"] else {"hedgehog"})
        for key, res_map in r["result"]["maps"].items():
            assert key in learned.MAP_LABELS and res_map["d_phi"] >= 1
    text = (out / "report.md").read_text()
    section = text.split("## Learned against fixed feature maps")[1].split("\n## ")[0]
    # the regime line: distribution, scale, d, N, seeds, the error bars
    for needle in ("Regime: 3 input regimes", "**benign**: q, k ~ 0.5·N(0, I), softmax temperature 1/√d",
                   "**gaussian**: q, k ~ 1·N(0, I), softmax temperature 1/√d",
                   "**low-entropy**: q, k ~ 1·N(0, I), softmax temperature 2/√d",
                   "d = 8, N = 64", "2 seeds", "95% Student-t interval", "float32 copies of the training draw",
                   "in float64"):
        assert needle in section, needle
    # one table per regime with every map and its D_φ; the fit table; the findings; the plot
    for regime in ("benign", "gaussian", "low-entropy"):
        assert f"**{regime}** (softmax row entropy" in section
    header = "| feature map | D_φ | KL(softmax ‖ linear) | JS | row entropy (linear) | monotonicity (Spearman) |"
    assert section.count(header) == 3
    lines = section.splitlines()

    def rows(label):  # rows of the per-regime tables (the fit table's rows start with the regime)
        return sum(line.startswith(f"| {label} |") for line in lines)

    for label in ("ELU+1", "Taylor-2", "FAVOR+ (m = 2d)", "Hedgehog, W = I (not fitted)", "Hedgehog, fitted"):
        assert rows(label) == 3, label
    assert re.search(r"\| Hedgehog, fitted \| 16 \|", section)  # D_φ = 2d at d = 8
    assert "| FAVOR+ (m = 2d) | 16 |" in section and "| Taylor-2 | 45 |" in section
    assert "training loss, start → fitted" in section and "held-out loss, start → fitted" in section
    assert "What the numbers show" in section and " ± " in section
    if "t2r" in fm.available():
        assert rows("T2R, fitted") == 3 and rows("T2R, W = [I; −I] (not fitted)") == 3
        assert "| low-entropy | T2R, fitted |" in section and "T2R is not in this build" not in section
    else:
        assert "T2R is not in this build" in section and "T2R, fitted" not in section
    assert "![" in section and (out / "learned.png").read_bytes()[:8] == PNG_MAGIC


def test_results_are_plain_json(tiny):
    out, _ = tiny
    for line in (out / "learned.jsonl").read_text().splitlines():
        json.loads(line)


def test_the_command_exists(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["learned", "--help"])
    assert info.value.code == 0
    assert "usage: linattn learned" in capsys.readouterr().out
