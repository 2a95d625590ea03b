"""The README's measured figures and docs/measured.md are the ones the committed results give.

``python benchmarks/readme_figures.py`` prints the sentences, ``--page`` rewrites the page.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_figures_benchmarks", ROOT / "benchmarks" / "readme_figures.py")
rf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rf)


def _readme() -> str:
    return " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())


@pytest.mark.parametrize("source", ["cpu", "decode", "gpu", "horizon", "rules"])
def test_readme_quotes_each_figure_as_computed(source):
    figures = rf.figures()
    assert source in figures, f"no results file for the README's {source} figure"
    assert figures[source] in _readme(), f"README does not quote the {source} figure as computed: {figures[source]}"


def _machine(**extra):
    return dict(cpu="Some CPU", logical_cpus=2, date="2026-01-02T03:04:05", load_avg_1m=0.5,
                blas=[dict(internal_api="openblas", architecture="SkylakeX")], **extra)


def test_cpu_figure_on_a_synthetic_file():
    data = dict(machine=_machine(torch="2.0"), shape=dict(BH=16, D=64, M=64),
                summary=dict(interleaved_medians_ms=dict(chunked=9.04), headline_x_sgemm=0.456, speedup_vs_scan=3.14,
                             table_speedup_vs_softmax_blocked=48.6, speedup_vs_torch_sdpa=0.5))
    text = rf.cpu_figure(data)
    assert text.startswith("CPU (Some CPU, 2 logical CPUs, openblas SkylakeX kernels, load 0.5, 2026-01-02;")
    assert text.endswith("the chunked kernel takes 9.0 ms, 0.46× the machine's sgemm rate, 3.1× faster than the "
                         "per-token scan, 49× faster than blocked softmax and 0.50× faster than torch 2.0's SDPA.")
    data["shape"]["M"] = 32
    with pytest.raises(ValueError, match="D = 64 != M = 32"):
        rf.cpu_figure(data)


def test_decode_figure_prefers_the_interleaved_rounds():
    data = dict(date="2026-01-02T00:00:00", machine=dict(cpu="Some CPU", loadavg_start=[0.25, 0, 0]),
                params=dict(heads=16, dim=64, dtype="float32"),
                summary=dict(state_median_us_1k_256k={"1024": 50.0, "65536": 60.0},
                             interleaved_state_median_us={"1024": 8.04, "262144": 8.96}, kv_over_state_at_64k=2000.0),
                rows=[dict(context=65536, kv=dict(median_us=17000.0))])
    text = rf.decode_figure(data)
    assert "a state step takes 8.0–9.0 µs at every context from 1,024 to 262,144 tokens" in text
    assert text.endswith("a KV-cache step takes 17.0 ms at 64k tokens (2000× the state step).")


def test_gpu_figure_takes_the_faster_method_per_length():
    log = ("# linear attention on Some GPU (cc 9.0)\nlinattn scan         N=  4096       2.436 ms\n"
           "linattn chunked      N=  4096       2.495 ms\nlinattn scan         N= 65536      27.611 ms\n"
           "linattn chunked      N= 65536      24.088 ms\n")
    text = rf.gpu_figure(log, "gpu_check_x_2026-01-02.log")
    assert text.startswith("GPU (Some GPU, 2026-01-02;")
    assert text.endswith("2.4 ms (scan) at N = 4,096 and 24 ms (chunked) at N = 65,536.")
    with pytest.raises(ValueError, match="no causal rows"):
        rf.gpu_figure(log.replace("65536", "32768"), "x.log")


def test_the_measured_page_is_the_one_the_results_files_give():
    page = (ROOT / "docs" / "measured.md").read_text(encoding="utf-8")
    assert page == rf.page(), "docs/measured.md is stale: run `python benchmarks/readme_figures.py --page`"
    for name in rf.SECTIONS:
        assert (ROOT / "benchmarks" / "results" / name).is_file(), f"benchmarks/results/{name} is missing"


def test_horizon_figures_on_synthetic_records():
    recs = []
    for g, base in ((1.0, 0.97), (0.9, 0.2)):
        for seed in range(3):
            recs.append(dict(status="ok", params=dict(feature_map="dpfp", map_params={"nu": 2}, n=64, gamma=g,
                                                      seed=seed),
                             result=dict(distance_edges=[0, 1, 2, 4, 64], d_phi=16,
                                         error_by_distance=[[base + 0.01 * seed, 0.5, 0.6, 1.0 + 0.07 * (g < 1)]])))
    text = rf.horizon_figures(recs)
    assert text.startswith("at DPFP (ν = 2), D_φ = 16, n = 64, γ = 0.9: error 0.21 ± 0.025 at distance 0 against "
                           "0.98 ± 0.025 for the additive rule, 1.07 at distances 4–63 against 1")
    assert text.endswith("3 seeds, mean ± 95% Student-t half-width")


def test_the_script_prints_one_line_per_source(capsys):
    assert rf.main([]) == 0
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == list(rf.figures())
