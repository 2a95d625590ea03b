"""The report's background process (``Study.background``, ``Study.prepare``, ``config.REPORT_BACKGROUND``).

A study marked ``background`` (the correctness self-check) runs in a spawned
process while the untimed studies run in the reporting process; the timed
studies run after it, once the background process has also run their
``prepare`` (compiling what they will time).  These tests use plug-in studies
whose functions live at module level here, so that the spawned process can
import them, and that report the process id they ran in.
"""
from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from linattn_nb import config
from linattn_nb.studies import STUDIES, Rendered, Study, load_results, register_study, run_report


def _points(ctx):
    return [{"x": x} for x in range(3)]


def _pid_run(x):
    return {"x": x, "pid": os.getpid()}


def _slow_pid_run(x):
    time.sleep(0.05)
    return {"x": x, "pid": os.getpid()}


def _interrupting_run(x, wait_for):
    # Ctrl-C once the background study has finished a few points
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if Path(wait_for).exists() and len(Path(wait_for).read_text().splitlines()) >= 4:  # header + 3 points
            break
        time.sleep(0.05)
    raise KeyboardInterrupt


def _timed_run(x, marker):
    # the timed study runs only after the background process has prepared it
    return {"x": x, "pid": os.getpid(), "prepared_by": int(Path(marker).read_text()) if Path(marker).exists() else 0}


def _prepare(points):
    Path(points[0]["marker"]).write_text(str(os.getpid()))


def _render(records, ctx):
    ok = [r for r in records if r.get("status") == "ok"]
    return Rendered(markdown=f"{len(ok)} points", summary=f"{len(ok)} points")


def _study(name, run=_pid_run, points=_points, **kw):
    return Study(name=name, title=name, command=name.replace("_", "-"), help="a test study", points=points,
                 run=run, render=_render, **kw)


@pytest.fixture
def plugins():
    """Register plug-in studies for one test, then restore the registry."""
    saved = list(STUDIES)
    added = []

    def add(*studies):
        for s in studies:
            register_study(s)
            added.append(s.name)
        return [s.name for s in studies]

    yield add
    STUDIES[:] = saved


def _pids(out, name):
    return {r["result"]["pid"] for r in load_results(out / f"{name}.jsonl") if r.get("status") == "ok"}


def test_a_background_study_runs_in_another_process_and_the_timed_one_after_its_prepare(tmp_path, plugins):
    marker = tmp_path / "prepared.txt"

    def timed_points(ctx):
        return [{"x": x, "marker": str(marker)} for x in range(2)]

    lines = []
    names = plugins(_study("bg_x", background=True), _study("fg_x"),
                    _study("timed_x", run=_timed_run, points=timed_points, timing=True, prepare=_prepare))
    res = run_report(tmp_path / "r", profile="tiny", studies=names, progress=False, log=lines.append)
    out = tmp_path / "r"
    me = os.getpid()
    bg = _pids(out, "bg_x")
    assert len(bg) == 1 and me not in bg, "the background study ran in this process"
    assert _pids(out, "fg_x") == {me}
    timed = [r["result"] for r in load_results(out / "timed_x.jsonl") if r.get("status") == "ok"]
    assert len(timed) == 2 and {t["pid"] for t in timed} == {me}
    assert {t["prepared_by"] for t in timed} == bg, "prepare did not run in the background process before the timed study"
    assert any("bg_x: 3 points, started in a background process" in line for line in lines), lines
    # numbered progress lines count up, in the order the studies finish
    numbered = [int(line[1:line.index("/")]) for line in lines if line.startswith("[")]
    assert numbered == sorted(numbered) and numbered[-1] == 3, lines
    assert any("bg_x: 3 points (" in line and "in the background)" in line for line in lines), lines
    # the report keeps its order, whatever the execution order
    text = res.path.read_text()
    assert text.index("## bg_x") < text.index("## fg_x") < text.index("## timed_x")
    assert res.problems == [] and set(res.sections) == {"bg_x", "fg_x", "timed_x"}
    assert multiprocessing.active_children() == []


def test_without_an_untimed_study_beside_it_or_when_switched_off_it_runs_here(tmp_path, plugins, monkeypatch):
    me = os.getpid()
    names = plugins(_study("bg_y", background=True), _study("fg_y"))
    run_report(tmp_path / "alone", profile="tiny", studies=["bg_y"], progress=False, log=lambda line: None)
    assert _pids(tmp_path / "alone", "bg_y") == {me}  # nothing to overlap with (e.g. `linattn check`)
    monkeypatch.setattr(config, "REPORT_BACKGROUND", False)
    run_report(tmp_path / "off", profile="tiny", studies=names, progress=False, log=lambda line: None)
    assert _pids(tmp_path / "off", "bg_y") == {me}
    monkeypatch.setattr(config, "REPORT_BACKGROUND", True)
    lines = []  # with a worker pool, the untimed studies (the background one too) go to the pool
    run_report(tmp_path / "pool", profile="tiny", studies=names, progress=False, log=lines.append, workers=2)
    assert not any("background" in line for line in lines), lines
    assert len(_pids(tmp_path / "pool", "bg_y")) >= 1 and me not in _pids(tmp_path / "pool", "bg_y")


def test_an_interrupt_stops_the_background_process_and_resume_keeps_its_points(tmp_path, plugins):
    def many(ctx):
        return [{"x": x} for x in range(30)]

    out = tmp_path / "r"
    names = plugins(_study("bg_z", run=_slow_pid_run, points=many, background=True),
                    _study("fg_z", run=_interrupting_run,
                           points=lambda ctx: [{"x": 0, "wait_for": str(out / "bg_z.jsonl")}]))
    with pytest.raises(KeyboardInterrupt):
        run_report(out, profile="tiny", studies=names, progress=False, log=lambda line: None)
    assert multiprocessing.active_children() == [], "the background process outlived the report"
    done = [r for r in load_results(out / "bg_z.jsonl") if r.get("status") == "ok"]
    assert 3 <= len(done) < 30, "the report waited for the background study (30 points of 0.05 s)"
    # --resume: the finished points are kept, the rest run (here, since fg_z would interrupt again)
    res = run_report(out, profile="tiny", studies=["bg_z"], progress=False, log=lambda line: None, resume=True)
    recs = [r for r in load_results(out / "bg_z.jsonl") if r.get("status") == "ok"]
    assert sorted(r["result"]["x"] for r in recs) == list(range(30))
    assert res.sections["bg_z"].summary == "30 points"
