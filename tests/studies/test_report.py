"""Tests of ``linattn report`` and the one-study subcommands (linattn_nb.studies.report, cli).

The report runs with ``--profile tiny`` (the smallest sizes, seconds): the
same code path as ``--quick`` and the default, on smaller grids.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import types

import numpy as np
import pytest

from linattn_nb import cli
from linattn_nb.device import cuda_status
from linattn_nb.studies import STUDIES, get_study, load_results, register_study, requires_modules, run_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _available(name):
    return get_study(name).requires() is None


class _CountingClock:
    """A ``time`` module stand-in whose clock advances by ``step`` seconds per reading.

    The throughput study decides how often to repeat a call from the time it
    took (a call of 2 s or more once, else >= 3 times and until ``min_time``):
    with this clock that count depends on the code alone, not on the
    machine's load.
    """

    def __init__(self, step=2.0 ** -10):  # a power of two: the differences of readings are exact
        self.step = step
        self.now = 0.0

    def perf_counter(self):
        self.now += self.step
        return self.now


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """One `linattn report --profile tiny` run shared by the tests that only read it.

    The throughput study reads a counting clock (:class:`_CountingClock`):
    every timed call "takes" 2**-10 s (~1 ms), so its repeat count is fixed.
    """
    from linattn_nb.studies import throughput

    out = tmp_path_factory.mktemp("rep") / "report"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(throughput, "time", _CountingClock())
        rc = cli.main(["report", "--profile", "tiny", "--out", str(out), "--no-progress", "--device", "cpu"])
    return out, rc


def test_report_writes_markdown_plots_and_raw_results(tiny_report):
    out, rc = tiny_report
    assert rc == 0
    text = (out / "report.md").read_text()
    assert text.startswith("# linattn_nb report")
    assert "`linattn report --profile tiny --out" in text
    assert "## Machine" in text and "## Correctness self-check" in text and "## Causal throughput against N" in text
    assert "checks passed" in text and "FAIL" not in text
    # every study of the default report is either a section or listed as not run, with its reason;
    # a study run only by name (in_report=False) is neither
    for study in STUDIES:
        if not study.in_report:
            assert f"## {study.title}" not in text and not (out / f"{study.name}.jsonl").exists()
        elif study.requires() is None:
            assert f"## {study.title}" in text
            assert f"[{study.name}.jsonl]({study.name}.jsonl)" in text
            recs = load_results(out / f"{study.name}.jsonl")
            assert recs and all(r["status"] == "ok" for r in recs)
        else:
            assert f"**{study.title}** (`linattn {study.command}`): {study.requires()}" in text
    # plots: every image the markdown shows exists and is a PNG
    images = [line.split("](")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert "throughput.png" in images and "horizon.png" in images and "rules.png" in images
    for name in images:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    # the throughput table has every N of the tiny grid for linear and softmax
    rows = [json.loads(line) for line in (out / "throughput.jsonl").read_text().splitlines()[1:]]
    assert {(r["params"]["kind"], r["params"]["n"]) for r in rows} >= {("linear", 64), ("linear", 256),
                                                                       ("softmax", 64), ("softmax", 256)}
    # the fixture's counting clock: every call "takes" 2**-10 s; the tiny profile's min_time of 5 ms makes 6 calls
    assert all(r["result"]["median_s"] == 2.0 ** -10 and r["result"]["repeats"] == 6 for r in rows)


def test_memory_horizon_section_states_its_regime_with_error_bars_over_seeds(tiny_report):
    """The memory-horizon study: every decay of the study, >= 5 seeds each, the floor, mean ± std."""
    from linattn_nb.studies import horizon

    out, _ = tiny_report
    recs = load_results(out / "horizon.jsonl")
    seen = {}
    for r in recs:
        p = r["params"]
        seen.setdefault((p["feature_map"], p["gamma"]), set()).add(p["seed"])
        res = r["result"]
        assert res["decay"] == (None if p["gamma"] == 1.0 else p["gamma"])
        assert len(res["distance_edges"]) == len(res["error_by_distance"][0]) + 1
    assert {g for _, g in seen} == {1.0, 0.999, 0.99, 0.9} == set(horizon.GAMMAS)
    assert all(len(seeds) >= 5 for seeds in seen.values())
    section = (out / "report.md").read_text().split("## Memory horizon")[1].split("\n## ")[0]
    for words in ("Regime:", "pairs", "D_φ", "values i.i.d. N(0, 1)", "5 seeds", "optimal floor (least squares)",
                  "additive (γ = 1)", "γ = 0.9 |", " ± ", "horizon.png"):
        assert words in section, words


def test_update_rules_section_states_its_regime_with_error_bars_over_seeds(tiny_report):
    """The update-rules study: additive, delta, gated delta, KDA, DeltaProduct and the floor, >= 5 seeds each,
    one-hot values, mean ± std."""
    from linattn_nb.studies import rules

    out, _ = tiny_report
    recs = load_results(out / "rules.jsonl")
    seeds = {}
    for r in recs:
        p, res = r["params"], r["result"]
        seeds.setdefault((p["kind"], p["rule"]), set()).add(p["seed"])
        assert res["value_dim"] is None and res["normalize"] is False  # one-hot values, unnormalised read-out
        assert res["beta"] == p["beta"] and res["decay"] == p["decay"]
        floor = np.maximum(0.0, 1.0 - res["d_phi"] / np.asarray(res["n_pairs"], dtype=float))
        np.testing.assert_allclose(res["optimal_mse"], floor, atol=1e-12)
        assert np.all(np.asarray(res["mse"]) >= floor - 1e-12)  # no rule beats the floor
    assert {rule for kind, rule in seeds if kind == "gaussian"} == (
        {label for label, _, _ in rules.RULES} | {label for label, _, _ in rules.DPLR_ROWS})
    assert all(len(s) >= 5 for s in seeds.values())
    section = (out / "report.md").read_text().split("## Update rules against the capacity floor")[1].split("\n## ")[0]
    for words in ("Regime:", "one-hot values", "D_φ", "5 seeds", "additive |", "delta, β = 1 |",
                  "gated delta, β = 1, γ = 0.95 |", "KDA, β = 1", "DeltaProduct, n_h = 2", "optimal floor (least squares)", " ± ", "What it shows",
                  "Every rule stays on or above the floor", "rules.png"):
        assert words in section, words


def test_non_empty_dir_is_refused_unless_force(tiny_report, tmp_path, capsys):
    out = tmp_path / "r"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "throughput.png").write_bytes(b"stale")
    rc = cli.main(["bench", "--profile", "tiny", "--out", str(out), "--no-progress"])
    assert rc == 2
    assert "is not empty; pass --force" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "throughput.png"]
    rc = cli.main(["bench", "--profile", "tiny", "--out", str(out), "--no-progress", "--force"])
    assert rc == 0
    assert (out / "notes.txt").read_text() == "mine"  # not ours: kept
    assert (out / "throughput.png").read_bytes()[:8] == PNG_MAGIC  # ours: replaced
    printed = capsys.readouterr().out
    assert "| N | linear " in printed and "linear scan (cpu) [ms]" in printed  # a one-study command prints its tables
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--out", str(tmp_path / "never"), "--force", "--resume"])
    assert info.value.code == 2


def test_resume_keeps_finished_points(tmp_path):
    out = tmp_path / "r"
    assert cli.main(["check", "--profile", "tiny", "--out", str(out), "--no-progress"]) == 0
    raw = (out / "correctness.jsonl").read_bytes()
    (out / "report.md").unlink()
    assert cli.main(["check", "--profile", "tiny", "--out", str(out), "--no-progress", "--resume"]) == 0
    assert (out / "correctness.jsonl").read_bytes() == raw  # nothing recomputed, nothing appended
    assert "## Correctness self-check" in (out / "report.md").read_text()


def test_resume_refuses_results_written_by_another_version(tmp_path, capsys):
    """`linattn bench --resume` on a results file of another linattn_nb version: exit 2 with one line naming the
    file, both versions, --force and --out, before anything runs (the file is left as it was)."""
    from linattn_nb import __version__

    out = tmp_path / "r"
    out.mkdir()
    path = out / "throughput.jsonl"
    path.write_text(json.dumps({"type": "header", "format": 1, "fn": "linattn_nb.studies.throughput:run",
                                "linattn_nb": "0.0.1-old"}) + "\n")
    before = path.read_bytes()
    rc = cli.main(["bench", "--profile", "tiny", "--out", str(out), "--no-progress", "--resume"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert str(path) in err and "linattn_nb 0.0.1-old" in err and f"linattn_nb {__version__}" in err
    assert "--force" in err and "--out" in err
    assert path.read_bytes() == before and sorted(p.name for p in out.iterdir()) == ["throughput.jsonl"]


@pytest.mark.parametrize("field, value, words", [("fn", "mymodule:other_run", "holds results of 'mymodule:other_run'"),
                                                  ("format", 99, "has format 99")])
def test_resume_refuses_results_of_another_function_or_format(tmp_path, capsys, field, value, words):
    """As for another version: a results file of another function, or of a format this version does not read,
    is refused before anything runs (exit 2, one line naming the file and --force), not failed as the study."""
    from linattn_nb import __version__

    out = tmp_path / "r"
    out.mkdir()
    path = out / "throughput.jsonl"
    header = {"type": "header", "format": 1, "fn": "linattn_nb.studies.throughput:run", "linattn_nb": __version__}
    header[field] = value
    path.write_text(json.dumps(header) + "\n")
    before = path.read_bytes()
    rc = cli.main(["bench", "--profile", "tiny", "--out", str(out), "--no-progress", "--resume"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert str(path) in err and words in err and "--force" in err
    assert path.read_bytes() == before and sorted(p.name for p in out.iterdir()) == ["throughput.jsonl"]


def test_resume_with_nothing_of_this_report_to_continue_keeps_a_report_md(tmp_path, capsys):
    """--resume into a folder whose report.md belongs to no results of these studies (a user's file, another
    study's report) replaced it without --force; it is refused (exit 2, one line) and the file kept."""
    out = tmp_path / "r"
    out.mkdir()
    (out / "report.md").write_text("# my notes\n")
    rc = cli.main(["bench", "--profile", "tiny", "--out", str(out), "--no-progress", "--resume"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "--force" in err, err
    assert (out / "report.md").read_text() == "# my notes\n" and sorted(p.name for p in out.iterdir()) == ["report.md"]


def test_resume_of_one_study_keeps_a_report_md_of_others(tmp_path, capsys):
    """A report of two studies, resumed with one of them (`linattn rank --resume`), rewrote report.md with that
    one alone; it is refused (exit 2, one line naming the other study), nothing changed, and so by the
    library (ValueError)."""
    from linattn_nb import __version__

    out = tmp_path / "r"
    out.mkdir()
    (out / "report.md").write_text("# report\n## Rank\n## Memory horizon\n")
    for name in ("rank", "horizon"):
        header = {"type": "header", "format": 1, "fn": f"linattn_nb.studies.{name}:run", "linattn_nb": __version__}
        (out / f"{name}.jsonl").write_text(json.dumps(header) + "\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rc = cli.main(["rank", "--profile", "tiny", "--out", str(out), "--no-progress", "--resume"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert "horizon" in err and "horizon.jsonl" in err and "'rank', 'horizon'" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(ValueError, match="also holds results of the horizon study"):
        run_report(out, profile="tiny", studies=["rank"], resume=True, progress=False, log=lambda line: None)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("study", ["error", "rank", "recall"])
def test_maps_given_as_one_string_is_refused_naming_maps(study, tmp_path):
    """options={"rank": {"maps": "elu"}} iterated the string ("unknown feature map 'e'"): a TypeError naming
    maps and how to write one map, before anything runs."""
    out = tmp_path / "r"
    with pytest.raises(TypeError, match=r"maps must be a list of feature map names, got the string 'elu' "
                                        r"\(for one map: \['elu'\]\)"):
        run_report(out, profile="tiny", studies=[study], options={study: {"maps": "elu"}}, progress=False,
                   log=lambda line: None)
    assert not out.exists()


def test_recall_refuses_a_number_of_pairs_given_twice(tmp_path):
    """options={"recall": {"n": [4, 4]}} ran the column twice; refused as a grid refuses a point given twice."""
    with pytest.raises(ValueError, match="n holds 4 more than once"):
        run_report(tmp_path / "r", profile="tiny", studies=["recall"], options={"recall": {"n": [4, 4]}},
                   progress=False, log=lambda line: None)


def test_horizon_summary_counts_the_seeds_run(tmp_path):
    """The summary quoted the constant horizon.SEEDS, not the seeds whose points ran."""
    from linattn_nb.studies import Context, horizon, sweep

    ctx = Context(out=tmp_path, profile="tiny", plots=False)
    pts = [p for p in horizon.points(ctx) if p["seed"] == 0 and p["feature_map"] == "elu"]
    records = sweep(horizon.run, pts, out=tmp_path / "h.jsonl", progress=False)
    res = horizon.render(records, ctx)
    assert res.summary.endswith("1 seed") and "1 seed," in res.markdown, res.summary


def test_bench_resume_reruns_points_timed_with_another_thread_count(tmp_path, monkeypatch):
    """A point's Numba thread count is one of its parameters: a resumed bench whose count differs from the
    first run's times every point again (none reused) and states the count they were measured with; a
    render of records measured with different counts says so, row by row, instead of stating one."""
    import numba

    from linattn_nb.studies import Context, throughput

    monkeypatch.setattr(throughput, "time", _CountingClock())
    monkeypatch.setattr(throughput, "machine_state", lambda: {"load1": 0.0, "sgemm_gflops": 1.0})
    monkeypatch.setattr(throughput, "_forward", lambda *args: None)  # no kernel: only the bookkeeping is tested
    now = numba.get_num_threads()
    kw = dict(profile="tiny", device="cpu", studies=["throughput"], progress=False, log=lambda line: None)
    out = tmp_path / "r"
    with pytest.MonkeyPatch.context() as mp:  # the first run "with one thread more"
        mp.setattr(numba, "get_num_threads", lambda: now + 1)
        mp.setattr(numba, "set_num_threads", lambda n: None)
        mp.setattr(numba.config, "NUMBA_NUM_THREADS", max(now + 1, numba.config.NUMBA_NUM_THREADS))
        run_report(out, **kw)
    path = out / "throughput.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) > 3
    path.write_text("\n".join(lines[:-1]) + "\n")  # interrupted before its last point
    again = run_report(out, resume=True, **kw)
    assert again.reused == {}
    section = _section(out, "Causal throughput against N")
    assert f"Numba threads: {now}." in section and f"Numba threads: {now + 1}" not in section
    recs = load_results(path)
    assert {r["params"]["numba_threads"] for r in recs} == {now, now + 1}
    assert all(p.get("numba_threads") == now for p in throughput.points(Context(out=tmp_path, profile="tiny")))
    # records of two thread counts (a render called on them directly): each count is named with its rows
    mixed = []
    for n, threads in ((64, 1), (256, 2)):
        params = dict(kind="linear", device="cpu", method="scan", n=n, batch=1, d=4, m=4, dtype="float32",
                      feature_map="elu", min_time=0.0)
        mixed.append(dict(status="ok", params=params, result=dict(median_s=1e-3, tokens_per_s=1e6, gflops=1.0,
                                                                  numba_threads=threads)))
    md = throughput.render(mixed, Context(out=tmp_path, profile="tiny", plots=False)).markdown
    assert "Numba threads: " not in md
    assert "Numba threads differ" in md and "1 for linear scan (cpu) at N = 64" in md
    assert "2 for linear scan (cpu) at N = 256" in md


def test_bad_arguments(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert cli.main(["bench", "--out", str(tmp_path / "file"), "--profile", "tiny"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert cli.main(["bench", "--out", str(tmp_path / "w"), "--profile", "tiny", "--workers", "0"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err
    never = str(tmp_path / "never")
    for argv in (["report", "--profile", "huge"], ["report", "--device", "tpu"], ["report", "--quick", "--profile", "full"],
                 ["bench", "--quick", "--profile", "tiny"], ["report", "--workers", "two"], ["rank", "--bogus"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv + ["--out", never])
        assert info.value.code == 2
    assert "--quick and --profile tiny contradict" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
    with pytest.raises(ValueError, match="profile must be one of"):
        run_report(tmp_path / "x", profile="huge")
    with pytest.raises(ValueError, match="studies: no study 'nope'"):
        run_report(tmp_path / "y", studies=["nope"], profile="tiny")


@pytest.mark.skipif(cuda_status() == "gpu", reason="a real GPU is present")
def test_device_cuda_without_a_gpu_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["bench", "--device", "cuda", "--out", str(tmp_path / "r"), "--profile", "tiny"]) == 2
    assert "no usable CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_every_command_has_help(capsys):
    commands = ["info", "demo", "report"] + [s.command for s in STUDIES]
    assert {"report", "bench", "error", "rank", "recall", "horizon", "rules"} <= set(commands)
    for cmd in commands:
        with pytest.raises(SystemExit) as info:
            cli.main([cmd, "--help"])
        assert info.value.code == 0
        assert f"usage: linattn {cmd}" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["error", "rank", "recall"])
def test_unavailable_study_exits_non_zero(command, tmp_path, capsys, monkeypatch):
    """Without an optional package it needs a study says why and exits 3; the report lists it as not run."""
    study = get_study(command)
    needy = dataclasses.replace(study, requires=requires_modules("matplotlib", install="pip install 'linattn_nb[plot]'"))
    register_study(needy, overwrite=True)
    try:
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
        assert not _available(command)
        rc = cli.main([command, "--out", str(tmp_path / "r"), "--profile", "tiny"])
        assert rc == 3
        assert ("cannot run here: needs the optional package 'matplotlib', not installed here "
                "(pip install 'linattn_nb[plot]')") in capsys.readouterr().err
        assert not (tmp_path / "r").exists()
        res = run_report(tmp_path / "all", profile="tiny", studies=["correctness", command], progress=False,
                         log=lambda line: None)
        assert res.problems == [] and [name for name, _ in res.skipped] == [get_study(command).name]
        assert "## Not run" in (tmp_path / "all" / "report.md").read_text()
    finally:
        register_study(study, overwrite=True)
    assert get_study(command) is study


def test_requires_modules_and_no_guards_on_the_package_itself(monkeypatch):
    """requires() checks optional third-party packages only: the package's own modules are always there."""
    assert requires_modules("numpy", "json")() is None
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert requires_modules("numpy", "matplotlib")() == "needs the optional package 'matplotlib', not installed here"
    with pytest.raises(TypeError, match="module names"):
        requires_modules("")
    # no built-in study guards an in-package module: hiding one changes nothing
    # (a study that needs an optional package, as mqar needs torch, is judged with that package present)
    before = {study.name: study.requires() for study in STUDIES}
    monkeypatch.setitem(sys.modules, "linattn_nb.analysis", None)
    assert {study.name: study.requires() for study in STUDIES} == before


def test_a_broken_kernel_fails_the_self_check(tmp_path, monkeypatch, capsys):
    """The self-check can fail: a registered method that leaves one output row unwritten."""
    from linattn_nb.ops import methods as _methods  # noqa: F401
    from linattn_nb.ops import registry
    scan = registry.get_method("scan", causal=True, device="cpu").forward

    def launcher(q, k, v, H, out, *, code, eps, inputs=None, check_finite=False, normalize=True):
        scan(q, k, v, H, out, code=code, eps=eps, check_finite=check_finite, normalize=normalize)
        if out.shape[1] > 5:
            out[:, 5] = np.nan if out.dtype.kind == "f" else 0  # as if the kernel skipped a row
        return out

    monkeypatch.setitem(registry._METHODS, ("additive", True, "broken", "cpu"),
                        registry.Method("additive", "broken", True, "cpu", launcher))
    rc = cli.main(["check", "--profile", "tiny", "--out", str(tmp_path / "r"), "--no-progress"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "linear causal additive cpu broken elu float32: relative error inf" in err
    text = (tmp_path / "r" / "report.md").read_text()
    assert "**FAIL**" in text and "## Problems" in text
    assert "| linear | causal | additive | cpu | scan | elu |" in text and "FAIL" not in text.split("| scan | elu |")[1].split("\n")[0]


def test_report_on_a_dask_scheduler(tmp_path):
    """--scheduler: untimed studies run on the cluster and give the same self-check as a local run.

    Compared check by check: the same verdicts, and errors that agree to
    within BLAS rounding (the softmax kernel's np.dot rounds differently with
    another OpenBLAS thread count, and the workers run single-threaded); the
    bit-for-bit comparison of the backends is tests/studies/test_sweep.py's.
    """
    distributed = pytest.importorskip("distributed")
    import logging

    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=None, silence_logs=logging.CRITICAL) as cluster:
        res = run_report(tmp_path / "d", profile="tiny", studies=["correctness"], progress=False,
                         scheduler=cluster.scheduler_address, log=lambda line: None)
    assert res.problems == []
    dask_recs = {r["key"]: r for r in load_results(tmp_path / "d" / "correctness.jsonl")}
    res = run_report(tmp_path / "l", profile="tiny", studies=["correctness"], progress=False,
                     log=lambda line: None)
    local_recs = {r["key"]: r for r in load_results(tmp_path / "l" / "correctness.jsonl")}
    assert dask_recs.keys() == local_recs.keys()
    assert {r["pid"] for r in dask_recs.values()}.isdisjoint({r["pid"] for r in local_recs.values()})
    for key, rec in dask_recs.items():
        for a, b in zip(rec["result"]["checks"], local_recs[key]["result"]["checks"]):
            assert (a["method"], a["dtype"], a["passed"], a["error"]) == (b["method"], b["dtype"], b["passed"], b["error"])
            for field in ("max_rel_error", "state_rel_error"):
                assert a[field] == pytest.approx(b[field], rel=0.5, abs=a["tol"] / 100)


# ---------------------------------------------------------------------------
# The plug-in studies, with stand-in analysis functions
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class _FakeError:
    output_rel_error: float
    kl_mean: float
    kl_max: float
    tv_mean: float
    tv_max: float
    entropy_softmax: float
    entropy_linear: float
    monotonicity: float
    nonpositive_normalizer_rate: float


@dataclasses.dataclass
class _FakeRecall:
    n_pairs: np.ndarray
    accuracy: np.ndarray
    mse: np.ndarray
    optimal_mse: np.ndarray
    softmax_accuracy: np.ndarray
    softmax_mse: np.ndarray


def _fake_analysis():
    """Minimal stand-ins with the signatures and return types of the analysis functions.

    They compute real (small, explicit) quantities so the studies' tables and
    plots have something to show, but this only tests the plumbing: the
    science is tested with the real functions.
    """
    from linattn_nb import feature_maps as fm
    from linattn_nb import linear_attention, softmax_attention

    def approximation_error(q, k, v, feature_map, *, causal=False, scale=None):
        o_lin = linear_attention(q, k, v, feature_map=feature_map, causal=causal)
        o_sm = softmax_attention(q, k, v, causal=causal)
        err = float(np.linalg.norm(o_lin - o_sm) / np.linalg.norm(o_sm))
        return _FakeError(err, 0.1, 0.2, 0.1, 0.2, 1.0, 1.1, 0.5, 0.0)

    def _weights(q, k, feature_map):
        if feature_map == "softmax":
            s = q @ k.T / np.sqrt(q.shape[-1])
            w = np.exp(s - s.max(axis=-1, keepdims=True))
        else:
            fmap = fm.resolve(feature_map)
            w = fmap(q) @ fmap(k).T
        return w / np.maximum(w.sum(axis=-1, keepdims=True), 1e-12)  # ReLU rows can be all zero

    def attention_rank(q, k, feature_map, *, causal=False):
        return int(np.linalg.matrix_rank(_weights(q, k, feature_map)))

    def semiseparable_rank(q, k, feature_map):
        w = np.tril(_weights(q, k, feature_map))
        return max(int(np.linalg.matrix_rank(w[i:, :i])) for i in range(1, len(w)))

    StateRankProfile = types.SimpleNamespace

    def state_rank_profile(k, v, feature_map, *, positions=None):
        fk = fm.resolve(feature_map)(k)
        ranks = [int(np.linalg.matrix_rank(fk[:t].T @ v[:t])) for t in positions]
        return StateRankProfile(positions=np.asarray(positions), rank=np.asarray(ranks),
                                max_rank=min(fk.shape[1], v.shape[1]))

    def recall_capacity(feature_map, d, n_pairs, *, trials=1, seed=0, key_scale=1.0, orthogonal_keys=False,
                       value_dim=None, normalize=None):
        n = np.asarray(n_pairs, dtype=float)
        dphi = feature_map.output_dim(d)
        opt = np.clip(1 - dphi / n, 0, None)
        return _FakeRecall(n.astype(int), 1 - opt / 2, opt + 0.05, opt, np.ones_like(n), np.zeros_like(n))

    def attention_weights(q, k, feature_map, *, causal=False, eps=None, normalize=True):
        fmap = fm.resolve(feature_map)
        w = np.einsum("bif,bjf->bij", fmap(np.atleast_3d(q)), fmap(np.atleast_3d(k)))
        w = np.tril(w) if causal else w
        return w / np.maximum(w.sum(axis=-1, keepdims=True), 1e-12) if normalize else w

    mod = types.ModuleType("linattn_nb.analysis")
    for f in (approximation_error, attention_rank, semiseparable_rank, state_rank_profile, recall_capacity,
              attention_weights):
        setattr(mod, f.__name__, f)
    return mod


def test_plug_in_studies_run_when_their_functions_exist(tmp_path, monkeypatch):
    """error, rank and recall plug in through the study list: points, sweep, tables, plots."""
    monkeypatch.setitem(sys.modules, "linattn_nb.analysis", _fake_analysis())
    for name in ("error", "rank", "recall"):
        assert get_study(name).requires() is None
    res = run_report(tmp_path / "r", profile="tiny", studies=["error", "rank", "recall"], progress=False,
                     log=lambda line: None)
    assert res.problems == [] and res.skipped == []
    text = (tmp_path / "r" / "report.md").read_text()
    for name in ("error", "rank", "recall"):
        study = get_study(name)
        assert f"## {study.title}" in text
        recs = load_results(tmp_path / "r" / f"{name}.jsonl")
        assert recs and all(r["status"] == "ok" for r in recs)
    for png in ("error_n.png", "error_m.png", "error_divergence.png", "rank.png", "recall.png"):
        assert (tmp_path / "r" / png).read_bytes()[:8] == PNG_MAGIC
    assert "| elu | 4 |" in text  # the rank table: ELU+1 at d = 4 has D_phi = 4


@pytest.mark.skipif(cuda_status() == "none", reason="neither a GPU nor the CUDA simulator")
def test_gpu_paths_of_the_studies_run_on_the_simulator():
    """The report's GPU points (a real GPU only) use these paths; the simulator checks them here."""
    from linattn_nb.ops import methods as _methods  # noqa: F401
    from linattn_nb.ops.registry import available_methods
    from linattn_nb.studies import correctness, throughput

    methods = [m for m in available_methods(causal=True, device="cuda") if m != "quadratic"]
    if not methods:
        pytest.skip("no CUDA methods registered")
    res = correctness.run("linear", "cuda", True, "elu", methods, ["float32"], [[1, 0, 4, 4], [2, 9, 6, 5]])
    assert [c["method"] for c in res["checks"]] == methods
    assert all(c["passed"] and c["error"] is None for c in res["checks"]), res["checks"]
    with pytest.MonkeyPatch.context() as mp:  # a counting clock: ~1 ms a call, whatever the simulator's speed
        mp.setattr(throughput, "time", _CountingClock())
        res = throughput.run("linear", "cuda", methods[0], 8, 1, 4, 4, "float32", "elu", 0.0)
    assert res["median_s"] == 2.0 ** -10 and res["repeats"] == 3, res


@pytest.mark.parametrize("step, min_time, repeats", [(2.0 ** -10, 0.0, 3), (2.0 ** -10, 10 * 2.0 ** -10, 10),
                                                     (2.5, 0.0, 1), (2.5, 10.0, 4), (2.0 ** -20, 1.0, 200)])
def test_throughput_repeats_are_set_by_the_call_time_not_the_machine(step, min_time, repeats, monkeypatch):
    """The throughput study's repeat rule on a counting clock.

    A call under 2 s is timed >= 3 times and until the total reaches
    ``min_time`` (at most 200 times); a call of 2 s or more once, more only
    while the total is under ``min_time``.
    """
    from linattn_nb.studies import throughput

    monkeypatch.setattr(throughput, "time", _CountingClock(step))
    # machine_state times an sgemm until min_time on the same clock: fixed here, it would loop 30000 times
    monkeypatch.setattr(throughput, "machine_state", lambda: {"load1": 0.0, "sgemm_gflops": 1.0})
    res = throughput.run("linear", "cpu", "chunked", 16, 1, 4, 4, "float32", "elu", min_time)
    assert res["repeats"] == repeats and res["median_s"] == step and res["min_s"] == step
    assert res["tokens_per_s"] == pytest.approx(16 / step) and res["gflops"] == pytest.approx(4 * 16 * 16 / step / 1e9)


# ---------------------------------------------------------------------------
# Stated regimes, seeds and error bars, finite divergences, noisy timings
# ---------------------------------------------------------------------------
def _section(out, title):
    return (out / "report.md").read_text().split(f"## {title}")[1].split("\n## ")[0]


def test_every_study_states_its_regime_and_the_time_it_took(tiny_report):
    """The reader sees the time each study took; the budgets are the maintainers' check, not in report.md."""
    out, _ = tiny_report
    text = (out / "report.md").read_text()
    assert "Time each study took" in text and "budget" not in text.lower()
    for study in STUDIES:
        if study.in_report and study.requires() is None:
            section = _section(out, study.title)
            assert "Regime:" in section, study.name
            assert study.budget_s and "tiny" in study.budget_s and "full" in study.budget_s, study.name
            assert "; took " in section, study.name


def _report_of(study, out):
    """``run_report`` of ``study`` alone (tiny profile, quiet), registered for the call only."""
    saved = list(STUDIES)
    try:
        register_study(study)
        return run_report(out, profile="tiny", studies=[study.name], progress=False, log=lambda line: None)
    finally:
        STUDIES[:] = saved


def test_over_budget_is_a_result_attribute_for_maintainers(tmp_path):
    from linattn_nb.studies import Study

    slow = Study(name="plugin_slow", title="Slow", command="plugin-slow", help="over its budget",
                 points=_plugin_points, run=_plugin_run, render=_plugin_render, budget_s={"tiny": -1.0, "full": 9})
    res = _report_of(slow, tmp_path / "r")
    assert [name for name, _, _ in res.over_budget] == ["plugin_slow"] and res.over_budget[0][2] == -1.0
    assert set(res.timings) == {"plugin_slow"}
    assert "budget" not in res.path.read_text().lower()


def test_error_section_two_regimes_seeds_entropy_and_finite_divergences(tiny_report):
    from linattn_nb.studies import error

    out, _ = tiny_report
    recs = load_results(out / "error.jsonl")
    seeds = {}
    for r in recs:
        p = r["params"]
        seeds.setdefault((p["qk_scale"], p["feature_map"], p["num_features"], p["n"], p["causal"]), set()).add(p["seed"])
        assert "js_mean" in r["result"] and "kl_infinite_rate" in r["result"]
    assert {k[0] for k in seeds} == set(error.SCALES) == {0.5, 1.0}
    assert all(len(s) >= 2 for s in seeds.values())  # tiny: 2 seeds; quick and full: 5
    section = _section(out, "Approximation error against softmax")
    for words in ("Regime:", "s = 0.5", "s = 1 (q, k ~ N(0, I))", "Softmax row entropy", "(ln N = ", " ± ",
                  "js_mean", "kl_infinite_rate", "KL(softmax ‖ linear) is infinite in some rows for",
                  "slope, all m [95% CI]", "Positive maps ranked by output error", "error_n.png", "error_m.png",
                  "error_divergence.png", "**Signed maps**", "error_signed.png", "95% Student-t interval"):
        assert words in section, words
    # the signed maps are not ranked beside the positive ones; they have their own table
    ranking = section.split("Positive maps ranked by output error")[1].split("\n\n")[1]
    signed = section.split("**Signed maps**")[1].split("\n\n")[1]
    assert "identity" not in ranking and "elu" in ranking
    assert "| identity |" in signed and "| elu |" not in signed
    assert "standard deviation over" not in section


def test_error_points_take_the_cli_keywords(tmp_path):
    from linattn_nb.studies import Context, error

    ctx = Context(out=tmp_path, profile="tiny")
    pts = error.points(ctx, dim=6, scales=[2.0], maps=["elu", "favor+"], m=[4, 8], n=[16, 32], seeds=3, causal=True)
    assert {p["d"] for p in pts} == {6} and {p["qk_scale"] for p in pts} == {2.0}
    assert {p["seed"] for p in pts} == {0, 1, 2} and {p["feature_map"] for p in pts} == {"elu", "favor+"}
    assert {p["num_features"] for p in pts if p["feature_map"] == "favor+"} == {4, 8}
    assert any(p["causal"] for p in pts)
    with pytest.raises(ValueError, match="unknown or unbuildable feature map 'nope' in maps"):
        error.points(ctx, maps=["nope"])
    with pytest.raises(ValueError, match=r"seeds must be an integer >= 1 \(the number of seeds K"):
        error.points(ctx, seeds=0)
    with pytest.raises(ValueError, match="takes no option 'bogus'"):
        run_report(tmp_path / "r", profile="tiny", studies=["error"], options={"error": {"bogus": 1}},
                   progress=False, log=lambda line: None)
    # a value given twice: the sweep's duplicate points, refused before anything runs or is written
    with pytest.raises(ValueError, match=r"options\['rank'\]: grid has duplicate points"):
        run_report(tmp_path / "dup", profile="tiny", studies=["rank"],
                   options={"rank": {"n": [16, 16], "seeds": 2, "maps": ["elu"]}}, progress=False,
                   log=lambda line: None)
    assert not (tmp_path / "dup").exists()


def test_fit_slope_recovers_inverse_sqrt_m_with_an_interval():
    from linattn_nb.studies._study import fit_slope

    rng = np.random.default_rng(0)
    m = np.array([16, 64, 256, 1024])
    ys = 3.0 / np.sqrt(m) * np.exp(0.05 * rng.standard_normal((5, m.size)))
    fit = fit_slope(m, ys)
    assert abs(fit["slope"] + 0.5) < 0.05 and fit["lo"] < fit["slope"] < fit["hi"]
    assert fit["hi"] - fit["lo"] < 0.2 and fit["seeds"] == 5 and fit["level"] == 0.95
    exact = fit_slope(m, [3.0 / np.sqrt(m) * (1 + 0.01 * s) for s in range(5)])  # same slope, other constants
    assert exact["slope"] == pytest.approx(-0.5) and exact["hi"] - exact["lo"] < 1e-9
    assert fit_slope(m, ys[:1]) is None  # one seed: no interval


def test_rank_state_profile_uses_m_at_least_every_d_phi(tiny_report):
    out, _ = tiny_report
    recs = load_results(out / "rank.jsonl")
    dphis = [r["result"]["d_phi"] for r in recs if r["result"]["d_phi"] is not None]
    assert all(r["params"]["m"] >= max(dphis) for r in recs)
    assert len({r["params"]["seed"] for r in recs}) >= 2
    for r in recs:  # every map's state rank saturates at its D_phi
        if r["result"].get("state_rank") and r["params"]["n"] >= 2 * r["result"]["d_phi"]:
            assert r["result"]["state_rank"][-1] == r["result"]["d_phi"], r["params"]


def test_recall_capacity_column_says_at_most_the_first_grid_point():
    from linattn_nb.studies.recall import _first_below

    n = np.array([20, 40, 60])
    assert _first_below(n, np.array([0.5, 0.4, 0.1])) == "≤ 20"
    assert _first_below(n, np.array([1.0, 0.5, 0.1])) == "40"
    assert _first_below(n, np.array([1.0, 1.0, 0.95])) == "> 60"


def test_throughput_records_machine_state_and_flags_noisy_points(tiny_report, tmp_path):
    from linattn_nb.studies import Context, throughput

    out, _ = tiny_report
    for r in load_results(out / "throughput.jsonl"):
        res = r["result"]
        for key in ("load1_before", "load1_after", "sgemm_gflops_before", "sgemm_gflops_after"):
            assert key in res, key
        assert res["sgemm_gflops_before"] > 0 and res["sgemm_gflops_after"] > 0
    assert "load; sgemm GFLOP/s" in _section(out, "Causal throughput against N")
    assert throughput.noisy_points({512: 90.0, 1024: 95.0, 2048: 96.0, 32768: 96.0, 65536: 9.6}) == [65536]
    assert throughput.noisy_points({512: 90.0, 1024: 30.0, 2048: 96.0}) == [1024]
    assert throughput.noisy_points({512: 90.0, 1024: 50.0, 2048: 96.0}) == []
    # a rendered slow point is marked in the tables and listed with the machine's state around it
    recs = []
    for n, g in ((512, 90.0), (1024, 95.0), (2048, 9.0), (4096, 97.0)):
        params = dict(kind="linear", device="cpu", method="scan", n=n, batch=1, d=4, m=4, dtype="float32",
                      feature_map="elu", min_time=0.0)
        recs.append(dict(status="ok", params=params, result=dict(
            median_s=1e-3, tokens_per_s=1e6, gflops=g, numba_threads=2, load1_before=1.0, load1_after=4.0,
            sgemm_gflops_before=50.0, sgemm_gflops_after=10.0)))
    md = throughput.render(recs, Context(out=tmp_path, profile="tiny", plots=False)).markdown
    assert "9 (noisy)" in md and "**Noisy**" in md and "linear scan (cpu) at N = 2048" in md


# ---------------------------------------------------------------------------
# The public study API (register_study, Context, Rendered, PROFILES, markdown_table,
# ReportResult) through a plug-in study
# ---------------------------------------------------------------------------
def _plugin_points(ctx):
    return [{"x": x} for x in ctx.pick(tiny=[1, 2], quick=[1, 2, 3], full=[1, 2, 3, 4])]


def _plugin_run(x):
    return {"y": 2 * x, "half": x / 2}


def _plugin_render(records, ctx):
    from linattn_nb.studies import Rendered, markdown_table, rows

    rs = rows(records)
    table = markdown_table(["x", "y", "x/2"], [[r["x"], r["y"], r["half"]] for r in rs])
    return Rendered(markdown=f"profile {ctx.profile}, devices {','.join(ctx.devices)}\n\n{table}",
                    summary=f"{len(rs)} points", problems=[f"planted problem at x = {r['x']}" for r in rs
                                                           if r["x"] == 2])


def test_markdown_table_formats_aligns_and_escapes():
    from linattn_nb.studies import markdown_table

    md = markdown_table(["map", "n", "err"], [["a|b", 3, 0.012345], ["c", 40, float("nan")], ["d", 5, 1.5e-7]])
    assert md.splitlines() == ["| map | n | err |", "| :--- | ---: | ---: |", "| a\\|b | 3 | 0.0123 |",
                               "| c | 40 | nan |", "| d | 5 | 1.50e-07 |"]
    assert markdown_table(["a", "b"], [[True, None]], align="cc").splitlines() == [
        "| a | b |", "| :---: | :---: |", "| yes | – |"]


def test_a_plug_in_study_through_register_study_and_run_report(tmp_path):
    """A study registered from outside: Context.pick chooses its grid per profile (PROFILES), its
    Rendered section, summary and problems reach report.md and the ReportResult; register_study
    refuses duplicates and non-studies; a study that cannot run is listed as skipped."""
    from linattn_nb.studies import PROFILES, Context, ReportResult, Rendered, Study

    assert PROFILES == ("tiny", "quick", "full")
    assert [len(_plugin_points(Context(out=tmp_path, profile=p))) for p in PROFILES] == [2, 3, 4]
    ctx = Context(out=tmp_path)
    assert ctx.profile == "full" and ctx.devices == ("cpu",) and ctx.plots is True
    with pytest.raises(KeyError):
        Context(out=tmp_path, profile="huge").pick(1, 2, 3)
    assert Rendered("x").summary == "" and Rendered("x").problems == []
    study = Study(name="plugin_x", title="Plug-in X", command="plugin-x", help="a test study",
                  points=_plugin_points, run=_plugin_run, render=_plugin_render, budget_s={"tiny": 5, "full": 9})
    absent = Study(name="plugin_absent", title="Absent", command="plugin-absent", help="needs a module",
                   points=_plugin_points, run=_plugin_run, render=_plugin_render,
                   requires=requires_modules("no_such_module_for_linattn_tests"))
    saved = list(STUDIES)
    try:
        assert register_study(study) is study and get_study("plugin-x") is study and STUDIES[-1] is study
        with pytest.raises(ValueError, match="already registered"):
            register_study(dataclasses.replace(study, title="Other"))
        with pytest.raises(TypeError, match="takes a Study"):
            register_study("plugin_x")
        register_study(absent)
        res = run_report(tmp_path / "r", profile="tiny", studies=["plugin_x", "plugin_absent"], progress=False,
                         log=lambda line: None)
    finally:
        STUDIES[:] = saved
    with pytest.raises(KeyError, match="no study"):
        get_study("plugin_x")
    assert isinstance(res, ReportResult)
    assert res.path == tmp_path / "r" / "report.md" and res.path.exists()
    assert any("planted problem at x = 2" in p for p in res.problems) and len(res.problems) == 1
    assert [name for name, _ in res.skipped] == ["plugin_absent"]
    assert "no_such_module_for_linattn_tests" in res.skipped[0][1]
    assert set(res.sections) == {"plugin_x"}
    sec = res.sections["plugin_x"]
    assert isinstance(sec, Rendered) and sec.summary == "2 points"
    assert sec.markdown.splitlines()[0] == "profile tiny, devices cpu"
    assert "| 2 | 4 | 1 |" in sec.markdown
    assert res.elapsed_s >= 0 and (res.cached_kernels is None or res.cached_kernels >= 0)
    text = res.path.read_text()
    assert "## Plug-in X" in text and "| 1 | 2 | 0.5 |" in text and "planted problem at x = 2" in text
    assert "**Absent** (`linattn plugin-absent`)" in text
    assert [r["result"]["y"] for r in load_results(tmp_path / "r" / "plugin_x.jsonl")] == [2, 4]


def test_force_deletes_only_the_files_the_report_writes_for_its_studies(tmp_path):
    """--force removes report.md and, of the studies being run only, <name>.jsonl and the exact plots
    they declare: never a user's PNG whose name starts like a study's, nor another study's results."""
    from linattn_nb.studies import Study

    study = Study(name="plugin_f", title="Plug-in F", command="plugin-f", help="a test study",
                  points=_plugin_points, run=_plugin_run, render=_plugin_render, figures=("plugin_f_plot",))
    out = tmp_path / "f1"
    out.mkdir()
    mine = {"ranking_for_paper.png": b"mine", "error_bars_mine.png": b"mine", "recall.jsonl": b'{"mine":1}\n',
            "plugin_f_for_paper.png": b"mine", "notes.txt": b"mine"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    (out / "plugin_f_plot.png").write_bytes(b"stale")
    (out / "report.md").write_text("stale")
    (out / "plugin_f.jsonl").write_text("stale, not even a results file\n")
    saved = list(STUDIES)
    try:
        register_study(study)
        run_report(out, profile="tiny", studies=["plugin_f"], force=True, progress=False, log=lambda line: None)
    finally:
        STUDIES[:] = saved
    assert {name: (out / name).read_bytes() for name in mine} == mine
    assert not (out / "plugin_f_plot.png").exists()  # declared, and not written again by this render
    assert "## Plug-in F" in (out / "report.md").read_text()
    assert [r["result"]["y"] for r in load_results(out / "plugin_f.jsonl")] == [2, 4]


def test_every_built_in_study_declares_the_plots_it_saves():
    """Study.figures is what --force deletes: it must list exactly the names each render saves."""
    import importlib
    import inspect
    import re

    for study in STUDIES:
        module = importlib.import_module(study.render.__module__)
        saved = set(re.findall(r"savefig\(\s*\w+\s*,\s*[\"']([^\"']+)[\"']", inspect.getsource(module)))
        assert not re.search(r"savefig\(\s*\w+\s*,\s*(?![\s\"'])", inspect.getsource(module)), \
            f"{module.__name__}: a plot name that is not a literal cannot be checked here"
        assert set(study.figures) == saved, study.name
    with pytest.raises(ValueError, match="figures must be plot names"):
        dataclasses.replace(get_study("rank"), figures=("../rank.png",))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(studies=["rank"], options={"rank": {"seeds": 0}}), ValueError,
     r"options\['rank'\]: rank study: seeds must be an integer >= 1, got 0"),
    (dict(studies=["rank"], options={"rank": {"maps": ["nope"]}}), ValueError,
     r"options\['rank'\]: .*unknown or unbuildable feature map 'nope'"),
    (dict(studies=["check"], options={"rank": {"seeds": 2}}), ValueError,
     r"options\['rank'\] sets options of the rank study, which is not being run \(studies: correctness\)"),
    (dict(studies=["check"], options=[("rank", {})]), TypeError, "options must be a dict"),
    (dict(studies=["check"], workers=-1), ValueError, "workers must be >= 1, got -1"),
    (dict(studies=["check"], workers=0), ValueError, "workers must be >= 1, got 0"),
    (dict(studies=["check"], workers=1.5), TypeError, "workers must be an integer or None"),
    (dict(studies=["check"], workers=2, scheduler="tcp://127.0.0.1:1"), ValueError,
     "workers= sizes the local worker processes and scheduler= brings its own workers"),
    (dict(studies=[]), ValueError, "studies is empty"),
    (dict(studies=["nope"]), ValueError, "studies: no study 'nope'"),
    (dict(studies=[3]), TypeError, r"studies must hold study names \(str\), got 3"),
    (dict(studies={"rank"}), TypeError, "studies must be a list of study names"),
])
def test_run_report_checks_its_arguments_before_anything_runs(tmp_path, kwargs, exc, match):
    """A bad argument is an exception naming it, raised before the folder is made or a study runs,
    not a report with a failed section (or an empty one)."""
    out = tmp_path / "r"
    with pytest.raises(exc, match=match):
        run_report(out, profile="tiny", progress=False, log=lambda line: None, **kwargs)
    assert not out.exists()


def test_run_report_takes_one_study_name_as_a_string(tmp_path, monkeypatch):
    """studies="rank" is the rank study (not the studies 'r', 'a', 'n', 'k')."""
    from linattn_nb.studies import report

    monkeypatch.setattr(report, "sweep", lambda *a, **k: [])  # nothing runs: only the selection matters
    res = run_report(tmp_path / "r", profile="tiny", studies="rank", progress=False, log=lambda line: None)
    assert list(res.sections) == ["rank"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(dim=[8, 16]), r"dim takes one integer >= 1 \(the head dimension d\), got \[8, 16\]"),
    (dict(dim=[8]), r"dim takes one integer >= 1"),
    (dict(seeds=[3, 5]), r"seeds takes one integer >= 1 \(the number of seeds K: seeds 0 .. K-1\), got \[3, 5\]"),
    (dict(scales=[0]), r"scales must hold positive finite numbers, got 0"),
    (dict(scales=0.0), r"scales must hold positive finite numbers, got 0.0"),
    (dict(scales=[1.0, -0.5]), r"scales must hold positive finite numbers, got -0.5"),
    (dict(scales=[float("inf")]), r"scales must hold positive finite numbers, got inf"),
    (dict(scales=[float("nan")]), r"scales must hold positive finite numbers, got nan"),
    (dict(causal="no"), r"causal must be True or False"),
])
def test_error_points_refuse_what_they_would_not_run(tmp_path, kwargs, match):
    """A list where the study takes one value (it ran the first, or seeds 0 .. 2 for seeds=[3, 5]) and a
    scale the CLI refuses (--scale 0) are ValueErrors, in error.points and so in run_report(options=...)."""
    from linattn_nb.studies import Context, error

    with pytest.raises(ValueError, match=match):
        error.points(Context(out=tmp_path, profile="tiny"), **kwargs)



def test_resumed_report_says_how_many_points_it_reused(tmp_path):
    """After --resume the time counts the new points only: report.md says how many came from the earlier run."""
    from linattn_nb.studies import Rendered, Study

    def points(ctx, *, n=2):
        return [{"x": x} for x in range(1, n + 1)]

    study = Study(name="plugin_resumed", title="Resumed", command="plugin-resumed", help="resumed",
                  points=points, run=_plugin_run, render=lambda records, ctx: Rendered("ok", "ok"))
    saved = list(STUDIES)
    kw = dict(profile="tiny", studies=["plugin_resumed"], progress=False, log=lambda line: None)
    try:
        register_study(study)
        first = run_report(tmp_path / "r", **kw)
        first_text = first.path.read_text()
        again = run_report(tmp_path / "r", resume=True, options={"plugin_resumed": {"n": 5}}, **kw)
    finally:
        STUDIES[:] = saved
    assert first.reused == {} and again.reused == {"plugin_resumed": (3, 2)}
    text = again.path.read_text()
    assert "plugin_resumed 0 s (3 new points; 2 reused from an earlier run)" in text
    assert " s for 3 new points (2 reused from an earlier run); rerun alone" in text
    assert "reused" not in first_text


@pytest.mark.parametrize("name, why", [
    ("../victim", "contains '/'"), ("a/b", "contains '/'"), ("a\\b", r"contains '\\\\'"), ("..", "starts with a dot"),
    (".", "starts with a dot"), (".hidden", "starts with a dot"), ("", "is empty"), ("a\0b", r"contains '\\x00'"),
])
def test_a_study_name_must_be_a_plain_file_name(tmp_path, name, why):
    """The name is the file name of the study's results: "../victim" made --force delete ../victim.jsonl."""
    from linattn_nb.studies import Study

    victim = tmp_path / "victim.jsonl"
    victim.write_text("precious\n")
    with pytest.raises(ValueError, match=rf"Study\(name=.*\): the name {why}; it is the file name"):
        Study(name=name, title="T", command="plugin-t", help="h", points=_plugin_points, run=_plugin_run,
              render=_plugin_render)
    with pytest.raises(TypeError, match=r"Study\(name=...\) must be a string, got int 3"):
        Study(name=3, title="T", command="plugin-t", help="h", points=_plugin_points, run=_plugin_run,
              render=_plugin_render)
    assert victim.read_text() == "precious\n"
    for study in STUDIES:  # the built-in names pass
        assert dataclasses.replace(study).name == study.name


def _run_list(x):
    return [x] if x == 2 else {"y": 2 * x, "half": x / 2}


def _run_none(x):
    return None if x == 2 else {"y": 2 * x, "half": x / 2}


@pytest.mark.parametrize("run, what", [(_run_list, "list"), (_run_none, "NoneType")])
def test_a_run_that_returns_no_dict_fails_its_point(tmp_path, run, what):
    """Study.run(**point) -> dict: a list or None was recorded as a successful point."""
    from linattn_nb.studies import Study

    study = Study(name="plugin_nodict", title="No dict", command="plugin-nodict", help="h",
                  points=_plugin_points, run=run, render=_plugin_render)
    res = _report_of(study, tmp_path / "r")
    recs = {r["params"]["x"]: r for r in load_results(tmp_path / "r" / "plugin_nodict.jsonl")}
    assert recs[1]["status"] == "ok" and recs[1]["result"]["y"] == 2  # the other point goes on
    assert recs[2]["status"] == "error"
    assert recs[2]["error"] == (f"TypeError: the plugin_nodict study's run returned {what}, not a dict: "
                                "Study.run(**point) must return a dict of results")
    assert res.sections["plugin_nodict"].summary == "1 points"  # rendered from the ok point alone


def test_a_report_reruns_an_ok_record_without_its_result(tmp_path):
    """An ok record whose result was removed from the results file failed the section with a bare KeyError."""
    from linattn_nb.studies import Study

    study = Study(name="plugin_noresult", title="No result", command="plugin-noresult", help="h",
                  points=_plugin_points, run=_plugin_run, render=_plugin_render)
    path = tmp_path / "r" / "plugin_noresult.jsonl"
    kw = dict(profile="tiny", studies=["plugin_noresult"], progress=False, log=lambda line: None)
    saved = list(STUDIES)
    try:
        register_study(study)
        run_report(tmp_path / "r", **kw)
        lines = path.read_text().splitlines(True)
        rec = json.loads(lines[1])
        del rec["result"]
        lines[1] = json.dumps(rec) + "\n"
        path.write_text("".join(lines))
        with pytest.warns(RuntimeWarning, match=r"plugin_noresult\.jsonl: line 2: the result record has status "
                                                r"'ok' but no 'result'"):
            res = run_report(tmp_path / "r", resume=True, **kw)
    finally:
        STUDIES[:] = saved
    assert res.sections["plugin_noresult"].summary == "2 points"
    assert res.problems == ["planted problem at x = 2"] and res.reused == {"plugin_noresult": (1, 1)}
