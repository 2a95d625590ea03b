"""The README's measured figures are the ones its results files give (benchmarks/results/*.jsonl).

``python -m linattn_nb.studies.readme_figures benchmarks/results`` regenerates them.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from linattn_nb.studies import readme_figures

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


#: The studies whose figures the README quotes from benchmarks/results/.
QUOTED = ["horizon", "rules"]


@pytest.mark.parametrize("study", QUOTED)
def test_readme_quotes_the_figures_of_the_results_files(study):
    if not (RESULTS / f"{study}.jsonl").is_file():
        pytest.fail(f"benchmarks/results/{study}.jsonl is missing: the README's figures have no source")
    text = readme_figures.figures(RESULTS, [study])[study]
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert text in readme, f"README does not quote {study}'s figures as computed: {text}"


def test_horizon_figures_on_synthetic_records():
    recs = []
    for g, base in ((1.0, 0.97), (0.9, 0.2)):
        for seed in range(3):
            recs.append(dict(status="ok", params=dict(feature_map="dpfp", map_params={"nu": 2}, n=64, gamma=g,
                                                      seed=seed),
                             result=dict(distance_edges=[0, 1, 2, 4, 64], d_phi=16,
                                         error_by_distance=[[base + 0.01 * seed, 0.5, 0.6, 1.0 + 0.07 * (g < 1)]])))
    text = readme_figures.horizon_figures(recs)
    assert text.startswith("at DPFP (ν = 2), D_φ = 16, n = 64, γ = 0.9: error 0.21 ± 0.025 at distance 0 against "
                           "0.98 ± 0.025 for the additive rule, 1.07 at distances 4–63 against 1")
    assert text.endswith("3 seeds, mean ± 95% Student-t half-width")


def test_the_script_prints_one_line_per_study(capsys, tmp_path):
    import shutil

    for name in QUOTED:
        shutil.copy(RESULTS / f"{name}.jsonl", tmp_path / f"{name}.jsonl")
    assert readme_figures.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == QUOTED
