"""Tests of the sweep runner (linattn_nb.studies.sweep).

The file is the sweep's state: these tests read it back line by line and
check that every grid point appears exactly once after interruptions, killed
workers, truncated lines and reruns, on the in-process, process-pool and Dask
backends.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import sys
import warnings

import numpy as np
import pytest

import _sweep_helpers as H
from linattn_nb.studies import SweepError, grid_points, load_results, point_key, rows, sweep


def _lines(path):
    """Parsed records of the file, header excluded; asserts every line is complete JSON."""
    data = open(path, "rb").read()
    assert data.endswith(b"\n")
    recs = [json.loads(line) for line in data.decode().splitlines()]
    assert recs[0]["type"] == "header"
    return recs[1:]


def _assert_exactly_once(path, points):
    recs = _lines(path)
    keys = [r["key"] for r in recs]
    assert len(keys) == len(set(keys)), "a point was written twice"
    assert sorted(keys) == sorted(point_key(p) for p in points)
    return recs


# ---------------------------------------------------------------------------
# Grids
# ---------------------------------------------------------------------------
def test_grid_product_order_and_list_of_dicts():
    pts = grid_points({"a": [1, 2], "b": ["x", "y"]})
    assert pts == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]
    assert grid_points([{"n": 1}, {"n": 2, "m": None}]) == [{"n": 1}, {"n": 2, "m": None}]
    # numpy scalars, ranges and 1-D arrays are accepted and unwrapped
    pts = grid_points({"n": np.arange(2), "r": range(1), "f": [np.float32(0.5)], "t": [(1, 2)]})
    assert pts == [{"n": 0, "r": 0, "f": 0.5, "t": [1, 2]}, {"n": 1, "r": 0, "f": 0.5, "t": [1, 2]}]
    assert type(pts[0]["n"]) is int


@pytest.mark.parametrize("grid, exc, match", [
    ({}, ValueError, "empty dict"),
    ([], ValueError, "empty list"),
    ({"n": []}, ValueError, r"grid\['n'\] is an empty list"),
    ({"n": 5}, TypeError, r"grid\['n'\] must be a list.*\[5\]"),
    ({"n": "abc"}, TypeError, r"grid\['n'\] must be a list"),
    ({"n": [1, 1]}, ValueError, "duplicate points"),
    ([{"n": 1}, {"n": 1}], ValueError, "duplicate points: #0 and #1"),
    ({"n": [1], "x": [np.zeros(3)]}, TypeError, r"grid\['x'\]\[0\].*ndarray.*JSON"),
    ({"n": [{1, 2}]}, TypeError, "set"),
    ({"n": {2, 1}}, TypeError, r"whose order is not fixed; write the list \[1, 2\]"),
    ({"n": [object()]}, TypeError, "object"),
    ({"n": [float("nan")]}, ValueError, "finite"),
    ([{"n": 1}, 5], TypeError, r"grid\[1\] must be a dict"),
    ([{}], ValueError, "empty dict"),
    ({1: [1]}, TypeError, "non-empty strings"),
    ({"n": [{"a": {2: 1}}]}, TypeError, "non-string key"),
    ("n=1", TypeError, "dict of lists or a list of dicts"),
])
def test_bad_grids_are_refused_clearly(grid, exc, match, tmp_path):
    with pytest.raises(exc, match=match):
        grid_points(grid)
    out = tmp_path / "r.jsonl"
    with pytest.raises(exc, match=match):
        sweep(H.square, grid, out=out, progress=False)
    assert not out.exists(), "a bad grid must not create the results file"


def test_point_key_is_stable_and_canonical():
    canon = json.dumps({"a": 1, "b": [1, 2]}, sort_keys=True, separators=(",", ":"))
    assert point_key({"b": (1, 2), "a": np.int64(1)}) == hashlib.sha1(canon.encode()).hexdigest()[:16]
    assert point_key({"a": 1}) != point_key({"a": 1.0}) != point_key({"a": True})
    assert point_key({"a": 1, "b": 2}) == point_key({"b": 2, "a": 1})


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(backend="spark"), ValueError, "backend must be one of"),
    (dict(scheduler="tcp://127.0.0.1:1"), ValueError, "backend='dask'"),
    (dict(workers=0), ValueError, "workers must be >= 1"),
    (dict(workers="2"), TypeError, "workers must be an integer"),
    (dict(workers=True), TypeError, "workers must be an integer"),
    (dict(numba_threads=0), ValueError, "numba_threads"),
    (dict(errors="ignore"), ValueError, "errors must be"),
    (dict(max_retries=-1), ValueError, "max_retries"),
    (dict(resume="yes"), TypeError, "resume must be a bool"),
    (dict(backend="dask", scheduler="tcp://127.0.0.1:1", workers=2), ValueError, "one or the other"),
])
def test_bad_arguments_are_refused(kwargs, exc, match, tmp_path):
    with pytest.raises(exc, match=match):
        sweep(H.square, {"x": [1]}, out=tmp_path / "r.jsonl", progress=False, **kwargs)
    assert not (tmp_path / "r.jsonl").exists()


def test_bad_fn_and_out(tmp_path):
    with pytest.raises(TypeError, match="fn must be callable"):
        sweep(5, {"x": [1]}, out=tmp_path / "r.jsonl")
    with pytest.raises(TypeError, match="out must be a path"):
        sweep(H.square, {"x": [1]}, out=None)
    with pytest.raises(ValueError, match="is a directory"):
        sweep(H.square, {"x": [1]}, out=tmp_path)
    with pytest.raises(TypeError, match="cannot be sent to worker processes"):
        sweep(lambda x: x, {"x": [1]}, out=tmp_path / "r.jsonl", workers=2)


# ---------------------------------------------------------------------------
# In-process: the file, resume, truncation, errors
# ---------------------------------------------------------------------------
def test_results_stream_in_grid_order_and_load_back(tmp_path):
    out = tmp_path / "sub" / "r.jsonl"
    recs = sweep(H.square, {"x": [3, 1, 2]}, out=out, progress=False)
    assert [r["result"]["y"] for r in recs] == [9, 1, 4]
    assert all(r["status"] == "ok" and r["elapsed_s"] >= 0 for r in recs)
    header = json.loads(out.read_text().splitlines()[0])
    assert header["fn"] == "_sweep_helpers:square" and header["format"] == 1
    _assert_exactly_once(out, grid_points({"x": [3, 1, 2]}))
    assert [r["params"]["x"] for r in load_results(out)] == [3, 1, 2]
    assert rows(recs) == [{"x": 3, "y": 9}, {"x": 1, "y": 1}, {"x": 2, "y": 4}]


def test_each_line_is_flushed_before_the_next_point_runs(tmp_path):
    out = tmp_path / "r.jsonl"
    seen = []

    def fn(x):
        # What another process would read now: every earlier point, complete.
        seen.append(len(out.read_bytes().decode().splitlines()) - 1)
        return {"x": x}

    sweep(fn, {"x": [0, 1, 2, 3]}, out=out, progress=False)
    assert seen == [0, 1, 2, 3]


@pytest.mark.parametrize("fsync", [False, True])
def test_fsync_syncs_every_line_or_only_at_the_end(fsync, tmp_path, monkeypatch):
    """``sweep(fsync=True)`` syncs after every line it writes, each complete when it is synced;
    the default syncs the file once, when the sweep ends."""
    out = tmp_path / "r.jsonl"
    synced = []  # lines in the file at each fsync
    real = os.fsync

    def counting_fsync(fd):
        synced.append(out.read_bytes().count(b"\n"))
        assert out.read_bytes().endswith(b"\n")
        real(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    sweep(H.square, {"x": [1, 2, 3]}, out=out, progress=False, fsync=fsync)
    # header + 3 points; with fsync one sync per line, then the sync at the end
    assert synced == ([1, 2, 3, 4, 4] if fsync else [4])
    with pytest.raises(TypeError, match="fsync"):
        sweep(H.square, {"x": [1]}, out=tmp_path / "other.jsonl", progress=False, fsync="yes")


def test_resume_skips_finished_points(tmp_path):
    out = tmp_path / "r.jsonl"
    calls = []

    def fn(x):
        calls.append(x)
        return {"y": -x}

    first = sweep(fn, {"x": [1, 2, 3]}, out=out, progress=False)
    recs = sweep(fn, {"x": [1, 2, 3, 4, 5]}, out=out, progress=False)
    assert calls == [1, 2, 3, 4, 5]
    assert [r["result"]["y"] for r in recs] == [-1, -2, -3, -4, -5]
    assert recs[:3] == first  # the finished records come back unchanged
    _assert_exactly_once(out, grid_points({"x": [1, 2, 3, 4, 5]}))
    # A rerun of a finished sweep calls nothing and writes nothing.
    size = out.stat().st_size
    sweep(fn, {"x": [5, 4]}, out=out, progress=False)
    assert calls == [1, 2, 3, 4, 5] and out.stat().st_size == size


def test_resume_false_never_overwrites(tmp_path):
    out = tmp_path / "r.jsonl"
    sweep(H.square, {"x": [1]}, out=out, progress=False)
    before = out.read_bytes()
    with pytest.raises(FileExistsError, match="resume=True"):
        sweep(H.square, {"x": [1, 2]}, out=out, resume=False, progress=False)
    assert out.read_bytes() == before


def test_another_function_cannot_append_to_the_file(tmp_path):
    out = tmp_path / "r.jsonl"
    sweep(H.square, {"x": [1]}, out=out, progress=False)
    with pytest.raises(ValueError, match="holds results of '_sweep_helpers:square'"):
        sweep(H.kill_always, {"x": [1]}, out=out, progress=False)


def _power(x, p, scale=1):
    return {"y": scale * x ** p}


def test_a_partial_with_other_bound_arguments_is_another_function(tmp_path):
    """A functools.partial is named with its bound arguments: the file of partial(f, p=2) is not resumed by
    partial(f, p=3) (its results were returned as p=3's), and the same partial resumes it."""
    import functools

    out = tmp_path / "r.jsonl"
    assert [r["result"]["y"] for r in sweep(functools.partial(_power, p=2), {"x": [2, 3]}, out=out,
                                            progress=False)] == [4, 9]
    with pytest.raises(ValueError, match=r"holds results of 'partial\(.*:_power, p=2\)', not of .*p=3"):
        sweep(functools.partial(_power, p=3), {"x": [2, 3]}, out=out, progress=False)
    with pytest.raises(ValueError, match="holds results of"):
        sweep(functools.partial(_power, 2), {"p": [2]}, out=out, progress=False)
    assert [r["result"]["y"] for r in sweep(functools.partial(_power, p=2), {"x": [2, 3, 4]}, out=out,
                                            progress=False)] == [4, 9, 16]
    # arrays by their values (not a summarised repr), callables by their names
    from linattn_nb.studies.sweep import function_name

    big = np.arange(2000.0)
    other = big.copy()
    other[1000] = -1.0
    assert function_name(functools.partial(_power, scale=big)) != function_name(functools.partial(_power,
                                                                                                  scale=other))
    assert "0x" not in function_name(functools.partial(_power, scale=H.square))


def test_a_partial_binding_an_object_without_a_stable_repr_is_not_resumed(tmp_path):
    """A bound argument whose repr holds a memory address cannot identify the function: a new file is written,
    an existing one is refused (ValueError naming the file and why), untouched."""
    import functools

    class Scale:
        def __mul__(self, other):
            return 2 * other

    out = tmp_path / "r.jsonl"
    fn = functools.partial(_power, p=1, scale=Scale())
    assert [r["result"]["y"] for r in sweep(fn, {"x": [2]}, out=out, progress=False)] == [4]
    before = out.read_bytes()
    with pytest.raises(ValueError, match="no stable text .* new results file"):
        sweep(fn, {"x": [2, 3]}, out=out, progress=False)
    assert out.read_bytes() == before


@pytest.mark.parametrize("damage", ["another function", "another version"])
def test_a_refused_file_with_a_torn_last_line_is_left_untouched(tmp_path, damage):
    """The torn last line of a file that is refused (another function's, another version's) stays: only a file
    the sweep goes on with is repaired."""
    out = tmp_path / "r.jsonl"
    sweep(H.square, {"x": [1, 2]}, out=out, progress=False)
    if damage == "another version":
        out.write_text(out.read_text().replace('"linattn_nb":"', '"linattn_nb":"0.0.1-old', 1))
    with open(out, "ab") as fh:
        fh.write(b'{"type":"result","key":"ab')
    before = out.read_bytes()
    fn = H.kill_always if damage == "another function" else H.square
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="holds results of|written by linattn_nb 0.0.1-old"):
            sweep(fn, {"x": [1]}, out=out, progress=False)
    assert out.read_bytes() == before


def test_resume_false_on_a_file_with_no_result_runs_and_says_what_a_file_holds(tmp_path):
    """A file holding only its header (the first point failed) is no reason to refuse resume=False; a file with
    results is refused with their number."""
    out = tmp_path / "r.jsonl"

    def fail(x):
        raise ValueError("a bug")

    fail.__module__, fail.__qualname__ = H.square.__module__, H.square.__qualname__
    with pytest.raises(SweepError):
        sweep(fail, {"x": [1, 2]}, out=out, progress=False)
    assert len(out.read_text().splitlines()) == 1
    assert [r["result"]["y"] for r in sweep(H.square, {"x": [1, 2]}, out=out, resume=False,
                                            progress=False)] == [1, 4]
    with pytest.raises(FileExistsError, match="already holds 2 result records; pass resume=True"):
        sweep(H.square, {"x": [1, 2]}, out=out, resume=False, progress=False)


@pytest.mark.parametrize("written", ["0.0.1-old", 1, None])
def test_a_file_written_by_another_version_is_not_resumed(tmp_path, written):
    """A results file of another linattn_nb version is refused, untouched: its points are never reused, and the
    message names the file, both versions and what to do.  A header without a version (written by hand) is
    resumed."""
    from linattn_nb import __version__

    out = tmp_path / "r.jsonl"
    sweep(H.square, {"x": [1, 2]}, out=out, progress=False)
    lines = out.read_text().splitlines()
    header = json.loads(lines[0])
    if written is None:
        del header["linattn_nb"]
    else:
        header["linattn_nb"] = written
    out.write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n")
    before = out.read_bytes()
    calls = []

    def fn(x):
        calls.append(x)
        return {"y": x * x}

    fn.__module__, fn.__qualname__ = H.square.__module__, H.square.__qualname__  # the file's function
    if written is None:
        assert [r["result"]["y"] for r in sweep(fn, {"x": [1, 2, 3]}, out=out, progress=False)] == [1, 4, 9]
        assert calls == [3]
        return
    with pytest.raises(ValueError) as info:
        sweep(fn, {"x": [1, 2, 3]}, out=out, progress=False)
    message = str(info.value)
    assert str(out) in message and f"the installed linattn_nb {__version__}" in message
    assert f"written by linattn_nb {written}," in message
    assert "new results file" in message and "delete this one" in message
    assert calls == [] and out.read_bytes() == before


@pytest.mark.parametrize("damage", ["cut", "cut_at_newline", "garbage_line"])
def test_truncated_last_line_is_ignored_and_not_duplicated(tmp_path, damage):
    out = tmp_path / "r.jsonl"
    grid = {"x": [1, 2, 3, 4]}
    sweep(H.square, {"x": [1, 2, 3]}, out=out, progress=False)
    data = out.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    if damage == "cut":  # a crash in the middle of the last write
        out.write_bytes(data[: last_start + 25])
    elif damage == "cut_at_newline":  # the whole line but its newline
        out.write_bytes(data[:-1])
    else:  # a final line that is not JSON
        out.write_bytes(data + b'{"type": "result", "key": "abc"\n')
    with pytest.warns(RuntimeWarning, match="ignored"):
        assert len(load_results(out)) == (3 if damage == "garbage_line" else 2)
    with pytest.warns(RuntimeWarning, match="will run again"):
        recs = sweep(H.square, grid, out=out, progress=False)
    assert [r["result"]["y"] for r in recs] == [1, 4, 9, 16]
    _assert_exactly_once(out, grid_points(grid))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_results(out)  # the file is clean again


def test_damaged_middle_line_is_an_error(tmp_path):
    out = tmp_path / "r.jsonl"
    sweep(H.square, {"x": [1, 2]}, out=out, progress=False)
    lines = out.read_bytes().split(b"\n")
    lines[1] = lines[1][:10]
    out.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        sweep(H.square, {"x": [1, 2]}, out=out, progress=False)


@pytest.mark.parametrize("content", [b"my important notes\n", b"my important notes", b'{"a": 1}\n',
                                     b"\n".join([b'{"type": "result", "key": "k"}'] * 2) + b"\n"])
@pytest.mark.parametrize("resume", [True, False])
def test_a_file_without_a_sweep_header_is_refused_untouched(tmp_path, content, resume):
    """Notes, another program's JSON Lines: not a damaged results file to repair and append to."""
    out = tmp_path / "notes.txt"
    out.write_bytes(content)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "damaged last line" repair either
        with pytest.raises(ValueError, match=r"out='.*notes\.txt' is not a sweep results file.*left untouched"):
            sweep(H.square, {"x": [1]}, out=out, resume=resume, progress=False)
    assert out.read_bytes() == content
    # The one headerless first line still repaired: a header torn by a crash while it was written.
    torn = tmp_path / "r.jsonl"
    sweep(H.square, {"x": [1]}, out=torn, progress=False)
    torn.write_bytes(torn.read_bytes()[:30])
    with pytest.warns(RuntimeWarning, match="will run again"):
        assert rows(sweep(H.square, {"x": [1]}, out=torn, progress=False)) == [{"x": 1, "y": 1}]


def test_errors_raise_keeps_finished_points_and_resumes(tmp_path):
    out = tmp_path / "r.jsonl"
    fail = {"on": True}

    def fn(x):
        if x == 2 and fail["on"]:
            raise ZeroDivisionError("boom at 2")
        return {"y": x}

    with pytest.raises(SweepError, match=r"point \{'x': 2\} failed: ZeroDivisionError: boom at 2") as info:
        sweep(fn, {"x": [1, 2, 3]}, out=out, progress=False)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert info.value.params == {"x": 2} and "boom at 2" in info.value.worker_traceback
    assert [r["params"]["x"] for r in _lines(out)] == [1]
    fail["on"] = False
    recs = sweep(fn, {"x": [1, 2, 3]}, out=out, progress=False)
    assert [r["result"]["y"] for r in recs] == [1, 2, 3]
    _assert_exactly_once(out, grid_points({"x": [1, 2, 3]}))


def test_errors_record_then_retry_on_resume(tmp_path):
    out = tmp_path / "r.jsonl"
    fail = {"on": True}

    def fn(x):
        if x == 2 and fail["on"]:
            raise ValueError("bad point")
        return {"y": x}

    recs = sweep(fn, {"x": [1, 2, 3]}, out=out, progress=False, errors="record")
    assert [r["status"] for r in recs] == ["ok", "error", "ok"]
    assert recs[1]["error"] == "ValueError: bad point" and "bad point" in recs[1]["traceback"]
    fail["on"] = False
    recs = sweep(fn, {"x": [1, 2, 3]}, out=out, progress=False, errors="record")
    assert [r["status"] for r in recs] == ["ok", "ok", "ok"]
    assert [r["status"] for r in load_results(out)] == ["ok", "ok", "ok"]
    ok_keys = [r["key"] for r in _lines(out) if r["status"] == "ok"]
    assert len(ok_keys) == len(set(ok_keys)) == 3  # the error line stays; no ok record twice


def test_interrupted_run_keeps_finished_points(tmp_path):
    out = tmp_path / "r.jsonl"
    interrupt = {"on": True}
    calls = []

    def fn(x):
        calls.append(x)
        if x == 3 and interrupt["on"]:
            raise KeyboardInterrupt  # Ctrl-C while point 3 runs
        return {"y": x}

    with pytest.raises(KeyboardInterrupt):
        sweep(fn, {"x": [0, 1, 2, 3, 4]}, out=out, progress=False)
    assert [r["params"]["x"] for r in _lines(out)] == [0, 1, 2]
    interrupt["on"] = False
    recs = sweep(fn, {"x": [0, 1, 2, 3, 4]}, out=out, progress=False)
    assert calls == [0, 1, 2, 3, 3, 4]
    assert [r["result"]["y"] for r in recs] == [0, 1, 2, 3, 4]
    _assert_exactly_once(out, grid_points({"x": [0, 1, 2, 3, 4]}))


def test_killed_parent_process_then_resume(tmp_path):
    """SIGKILL the process running a sweep (a crash), then resume: every point exactly once."""
    import signal
    import subprocess
    import time

    out = tmp_path / "r.jsonl"
    grid = {"x": list(range(40)), "delay": [0.05]}
    code = ("import sys; sys.path.insert(0, sys.argv[2]); import _sweep_helpers as H; "
            "from linattn_nb.studies import sweep; "
            f"sweep(H.slow, {grid!r}, out=sys.argv[1], progress=False)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", code, str(out), os.path.dirname(H.__file__)], env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if out.exists() and out.read_bytes().count(b"\n") >= 6:
                break
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    done_before = len(_lines(out))
    assert 5 <= done_before < 40, "the sweep was not killed mid-way: the test tested nothing"
    recs = sweep(H.slow, grid, out=out, progress=False)
    assert [r["result"]["y"] for r in recs] == list(range(40))
    _assert_exactly_once(out, grid_points(grid))


def test_results_are_converted_to_json(tmp_path):
    @dataclasses.dataclass
    class Res:
        a: np.ndarray
        b: np.float32

    def fn(x):
        return {"arr": np.arange(3) * x, "dc": Res(np.ones(2), np.float32(0.5)), "t": (np.int8(1), None),
                "nan": float("nan")}

    rec = sweep(fn, {"x": [2]}, out=tmp_path / "r.jsonl", progress=False)[0]
    assert rec["result"]["arr"] == [0, 2, 4] and rec["result"]["dc"] == {"a": [1.0, 1.0], "b": 0.5}
    assert rec["result"]["t"] == [1, None] and np.isnan(rec["result"]["nan"])

    def bad(x):
        return {"obj": object()}

    rec = sweep(bad, {"x": [1]}, out=tmp_path / "s.jsonl", progress=False, errors="record")[0]
    assert rec["status"] == "error" and "cannot be stored as JSON" in rec["error"]


def _strict_loads(line):
    """json.loads that refuses NaN, Infinity and -Infinity (as strict JSON parsers do)."""
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=refuse)


def _nan_safe(obj):
    """obj with every NaN replaced by a marker string, so that == compares NaN as equal."""
    if isinstance(obj, float) and math.isnan(obj):
        return "<nan>"
    if isinstance(obj, dict):
        return {k: _nan_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_safe(v) for v in obj]
    return obj


def _nonfinite_result(x):
    return {"nan": float("nan"), "inf": np.float32(np.inf), "ninf": -math.inf,
            "arr": np.array([1.0, np.nan, np.inf, -np.inf]) * x,
            "nested": {"m": [[np.nan, 2.0], [3.0, -np.inf]], "t": (np.float64(np.nan),)},
            "words": ["nan", "inf", "-inf", "NaN"], "none": None, "x": x}


def _check_nonfinite(res, x):
    assert math.isnan(res["nan"]) and res["inf"] == math.inf and res["ninf"] == -math.inf
    assert res["arr"][0] == x and math.isnan(res["arr"][1]) and res["arr"][2:] == [math.inf, -math.inf]
    assert all(type(v) is float for v in res["arr"])
    assert math.isnan(res["nested"]["m"][0][0]) and res["nested"]["m"][0][1] == 2.0
    assert res["nested"]["m"][1] == [3.0, -math.inf] and math.isnan(res["nested"]["t"][0])
    assert res["words"] == ["nan", "inf", "-inf", "NaN"] and res["none"] is None and res["x"] == x


def test_nonfinite_results_are_strict_json_and_read_back_as_floats(tmp_path):
    out = tmp_path / "r.jsonl"
    returned = sweep(_nonfinite_result, {"x": [1, 2]}, out=out, progress=False)
    lines = out.read_text().splitlines()
    assert len(lines) == 3
    raw = [_strict_loads(line) for line in lines]  # a strict parser reads every line
    for rec in raw:
        json.dumps(rec, allow_nan=False)
    loaded = load_results(out)
    for recs in (returned, loaded):
        assert [r["params"]["x"] for r in recs] == [1, 2]
        for r in recs:
            _check_nonfinite(r["result"], r["params"]["x"])
    assert _nan_safe(loaded) == _nan_safe(returned)  # no marker left in what the loader returns
    # rows() gives floats back, from loaded records and from records a plain parser read
    for table in (rows(loaded), rows(raw[1:])):
        assert [row["x"] for row in table] == [1, 2]
        for row in table:
            _check_nonfinite(row, row["x"])
    # a resumed sweep keeps the finished records as they were and appends strict JSON
    more = sweep(_nonfinite_result, {"x": [1, 2, 3]}, out=out, progress=False)
    assert _nan_safe(more[:2]) == _nan_safe(returned)
    _check_nonfinite(more[2]["result"], 3)
    for line in out.read_text().splitlines():
        json.dumps(_strict_loads(line), allow_nan=False)


def test_a_damaged_nonfinite_marker_is_a_damaged_line(tmp_path):
    out = tmp_path / "r.jsonl"
    sweep(_nonfinite_result, {"x": [1, 2]}, out=out, progress=False)
    lines = out.read_text().splitlines(keepends=True)
    rec = json.loads(lines[1])
    rec["nonfinite"][0][0] = ["result", "x"]  # names a value that is not null
    lines[1] = json.dumps(rec) + "\n"
    out.write_text("".join(lines))
    with pytest.raises(ValueError, match=r"line 2 is not a valid record \(its 'nonfinite' marker names"):
        load_results(out)
    out.write_text("".join(lines[:1] + lines[2:] + lines[1:2]))  # the same line last: dropped, run again
    with pytest.warns(RuntimeWarning, match=r"last line \(line 3\) is not a valid record"):
        assert [r["params"]["x"] for r in load_results(out)] == [2]
    with pytest.warns(RuntimeWarning, match="will run again"):
        recs = sweep(_nonfinite_result, {"x": [1, 2]}, out=out, progress=False)
    for r in recs:
        _check_nonfinite(r["result"], r["params"]["x"])


@pytest.mark.parametrize("tail", [b"\n\n", b"\n\n\n\n", b"\n \t\r\n  \n", b"\n   "])
def test_blank_lines_after_a_truncated_last_record(tmp_path, tail):
    """A crash mid-write, then blank lines (an editor, a shell's echo >>): still a truncated last record."""
    out = tmp_path / "r.jsonl"
    sweep(H.square, {"x": [1, 2, 3]}, out=out, progress=False)
    data = out.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    out.write_bytes(data[: last_start + 25] + tail)
    with pytest.warns(RuntimeWarning, match="ignored"):
        loaded = load_results(out)
    assert rows(loaded) == [{"x": 1, "y": 1}, {"x": 2, "y": 4}]
    with pytest.warns(RuntimeWarning, match="will run again"):
        recs = sweep(H.square, {"x": [1, 2, 3, 4]}, out=out, progress=False)
    assert [r["result"]["y"] for r in recs] == [1, 4, 9, 16]
    _assert_exactly_once(out, grid_points({"x": [1, 2, 3, 4]}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rows(load_results(out)) == [{"x": x, "y": x * x} for x in (1, 2, 3, 4)]


def test_a_later_error_never_replaces_an_ok_record(tmp_path):
    """A results file as written by hand: for each point an ok record and error records around it."""
    out = tmp_path / "r.jsonl"

    def rec(x, status, **fields):
        return {"type": "result", "key": point_key({"x": x}), "params": {"x": x}, "status": status, **fields}

    lines = [
        {"type": "header", "format": 1, "fn": "_sweep_helpers:square"},
        rec(1, "ok", result={"y": 1}),
        rec(1, "error", error="ValueError: a later failure", traceback=""),
        rec(2, "error", error="ValueError: an earlier failure", traceback=""),
        rec(2, "ok", result={"y": 4}),
        rec(2, "error", error="WorkerDied: a later failure", traceback=""),
        rec(3, "error", error="ValueError: only failures", traceback=""),
    ]
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    loaded = load_results(out)
    assert [(r["params"]["x"], r["status"]) for r in loaded] == [(1, "ok"), (2, "ok"), (3, "error")]
    assert rows(loaded) == [{"x": 1, "y": 1}, {"x": 2, "y": 4}]
    assert [r["error"] for r in load_results(out, status="error")] == ["ValueError: only failures"]
    # A resumed sweep counts points 1 and 2 as finished: it runs and writes only point 3.
    recs = sweep(H.square, {"x": [1, 2, 3]}, out=out, progress=False)
    assert [(r["status"], r["result"]["y"]) for r in recs] == [("ok", 1), ("ok", 4), ("ok", 9)]
    assert len(out.read_text().splitlines()) == len(lines) + 1


@pytest.mark.parametrize("status", ["okay", "OK", "failed", 1])
def test_load_results_refuses_an_unknown_status(tmp_path, status):
    out = tmp_path / "r.jsonl"
    sweep(H.square, {"x": [1]}, out=out, progress=False)
    with pytest.raises(ValueError, match=r"status must be None or one of 'ok', 'error', got "):
        load_results(out, status=status)


def test_one_writer_per_file(tmp_path):
    out = tmp_path / "r.jsonl"

    def nested(x):
        return sweep(H.square, {"x": [x]}, out=out, progress=False)

    with pytest.raises(SweepError, match="locked") as info:
        sweep(nested, {"x": [1]}, out=out, progress=False)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    for tty, expect in ((True, True), (False, False)):
        stream = Tty() if tty else io.StringIO()
        monkeypatch.setattr(sys, "stderr", stream)
        sweep(H.square, {"x": [1, 2, 3]}, out=tmp_path / f"{tty}.jsonl")
        assert ("3/3" in stream.getvalue()) is expect
    stream = Tty()
    monkeypatch.setattr(sys, "stderr", stream)
    sweep(H.square, {"x": [1, 2, 4]}, out=tmp_path / "True.jsonl", progress=False)
    assert stream.getvalue() == ""


# ---------------------------------------------------------------------------
# Worker processes: spawned local pool and Dask
# ---------------------------------------------------------------------------
ATTN_GRID = {"n": [1, 17, 64], "method": ["scan", "aggregate"], "causal": [True, False], "seed": [0]}


def _numbers(recs):
    """The numerical results; the thread count differs by backend and is checked separately."""
    return [(r["params"], {k: v for k, v in r["result"].items() if k not in ("threads", "env")}) for r in recs]


@pytest.fixture(scope="module")
def reference_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "inproc.jsonl"
    grid = [p for p in grid_points(ATTN_GRID) if not (p["causal"] and p["method"] == "aggregate")]
    return grid, sweep(H.attention_point, grid, out=out, progress=False)


def test_local_pool_kill_and_identical_results(tmp_path, reference_results):
    """A spawned pool: same numbers as in-process; a killed worker loses nothing, duplicates nothing."""
    grid, ref = reference_results
    recs = sweep(H.attention_point, grid, out=tmp_path / "pool.jsonl", workers=2, progress=False)
    assert _numbers(recs) == _numbers(ref)
    assert {r["pid"] for r in recs}.isdisjoint({os.getpid()})

    marker = tmp_path / "killed"
    kgrid = {"x": list(range(8)), "marker": [str(marker)]}
    recs = sweep(H.kill_once, kgrid, out=tmp_path / "kill.jsonl", workers=2, progress=False)
    assert marker.exists(), "the worker was not killed: the test tested nothing"
    assert [r["result"]["y"] for r in recs] == [10 * x for x in range(8)]
    _assert_exactly_once(tmp_path / "kill.jsonl", grid_points(kgrid))

    # A point that kills its worker every time: recorded as an error after the
    # retries, and only that point (it is retried alone).
    recs = sweep(H.kill_always, {"x": [0, 1, 2, 3]}, out=tmp_path / "always.jsonl", workers=2,
                 max_retries=1, errors="record", progress=False)
    assert [r["status"] for r in recs] == ["ok", "ok", "error", "ok"]
    assert "died 2 time(s)" in recs[2]["error"]
    # Its elapsed time is NaN: written as strict JSON, read back as a float.
    assert math.isnan(recs[2]["elapsed_s"])
    for line in (tmp_path / "always.jsonl").read_text().splitlines():
        _strict_loads(line)
    died = [r for r in load_results(tmp_path / "always.jsonl") if r["params"]["x"] == 2]
    assert len(died) == 1 and math.isnan(died[0]["elapsed_s"])


@pytest.mark.parametrize("workers", [1, 2])
def test_exception_that_cannot_be_rebuilt_is_recorded_not_retried(tmp_path, workers):
    """An exception that pickles but fails to unpickle (a two-argument __init__) is the point's
    error, in a spawned pool as in this process: not a dead worker, not retried."""
    log = tmp_path / "calls"
    grid = {"x": [0, 1, 2], "log": [str(log)]}
    recs = sweep(H.raise_two_arg, grid, out=tmp_path / "r.jsonl", workers=workers, errors="record",
                 max_retries=2, progress=False)
    assert [r["status"] for r in recs] == ["ok", "error", "ok"]
    assert recs[1]["error"] == "TwoArgError: code 1: cannot be rebuilt"
    assert "raise_two_arg" in recs[1]["traceback"] and "TwoArgError" in recs[1]["traceback"]
    assert sorted(log.read_text().split()) == ["0", "1", "2"], "a point ran more than once"
    log.unlink()
    with pytest.raises(SweepError, match=r"point \{'x': 1, 'log': .*\} failed: TwoArgError: code 1") as info:
        sweep(H.raise_two_arg, {"x": [1], "log": [str(log)]}, out=tmp_path / "s.jsonl", workers=workers,
              progress=False)
    assert "raise_two_arg" in info.value.worker_traceback
    assert log.read_text().split() == ["1"]


def test_dask_embedded_cluster_gives_identical_results(tmp_path, reference_results):
    """backend="dask" with no scheduler: an embedded LocalCluster of two worker processes on loopback."""
    pytest.importorskip("distributed")
    grid, ref = reference_results
    recs = sweep(H.attention_point, grid, out=tmp_path / "dask.jsonl", backend="dask", workers=2,
                 progress=False)
    assert _numbers(recs) == _numbers(ref)
    pids = {r["pid"] for r in recs}
    assert os.getpid() not in pids and len(pids) <= 2
    # Numba threads per worker: the cores shared by the two workers, set for each point with
    # numba.set_num_threads; the workers' environment is this process's (see the test below).
    per = max(1, len(os.sched_getaffinity(0)) // 2)
    assert {(r["result"]["threads"], r["result"]["env"]) for r in recs} == {(per, os.environ.get("NUMBA_NUM_THREADS"))}


_MAIN_IMPORTS_NUMBA = """\
import sys
import numba  # at the top, as a script importing linattn_nb does: Dask's spawned workers import it too
from linattn_nb.studies import sweep


def point(x):
    f = numba.njit(lambda y: y + 1)  # compiled in the worker: Numba reloads its config from the environment
    return {"y": f(x), "threads": numba.get_num_threads()}


if __name__ == "__main__":
    recs = sweep(point, {"x": [1, 2]}, out=sys.argv[1], backend="dask", workers=1, numba_threads=1,
                 errors="record", progress=False)
    print([(r["status"], r.get("error"), r.get("result")) for r in recs])
"""


@pytest.mark.slow
def test_dask_embedded_cluster_compiles_when_main_imports_numba(tmp_path):
    """A script whose __main__ imports Numba at the top (re-imported by every spawned Dask worker
    before a LocalCluster's env= applies) compiles kernels in the workers: the thread count is set
    there with numba.set_num_threads, never through NUMBA_NUM_THREADS."""
    pytest.importorskip("distributed")
    import subprocess

    import numba

    if numba.config.NUMBA_DEFAULT_NUM_THREADS < 2:
        pytest.skip("one CPU: numba_threads=1 is Numba's default, the worker's pool size cannot differ")
    script = tmp_path / "main_imports_numba.py"
    script.write_text(_MAIN_IMPORTS_NUMBA)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "r.jsonl")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str([("ok", None, {"y": 2, "threads": 1}), ("ok", None, {"y": 3, "threads": 1})])


@pytest.fixture(scope="module")
def dask_cluster():
    distributed = pytest.importorskip("distributed")
    import logging

    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                       dashboard_address=None, silence_logs=logging.CRITICAL)
    yield cluster
    cluster.close()


def test_dask_killed_worker_every_point_exactly_once(tmp_path, dask_cluster):
    """A worker of an existing cluster (given by address) is SIGKILLed mid-sweep."""
    marker = tmp_path / "killed"
    grid = {"x": list(range(10)), "marker": [str(marker)], "delay": [0.05]}
    out = tmp_path / "kill.jsonl"
    recs = sweep(H.kill_once, grid, out=out, backend="dask", scheduler=dask_cluster.scheduler_address,
                 progress=False)
    assert marker.exists(), "the worker was not killed: the test tested nothing"
    assert [r["status"] for r in recs] == ["ok"] * 10
    assert [r["result"]["y"] for r in recs] == [10 * x for x in range(10)]
    _assert_exactly_once(out, grid_points(grid))


def test_dask_numba_threads_do_not_oversubscribe(tmp_path, dask_cluster):
    # The killed-worker test shares this cluster: wait for its restarted worker,
    # or the sweep would size threads for the one worker it sees.
    import distributed

    with distributed.Client(dask_cluster) as c:
        c.wait_for_workers(2, timeout=60)
    recs = sweep(H.numba_threads, {"x": list(range(4))}, out=tmp_path / "t.jsonl", backend="dask",
                 scheduler=dask_cluster, progress=False)
    cores = len(os.sched_getaffinity(0))
    slots = sum(w["nthreads"] for w in dask_cluster.scheduler_info["workers"].values())
    assert {r["result"]["threads"] for r in recs} == {max(1, cores // slots)}
    recs = sweep(H.numba_threads, {"x": [0]}, out=tmp_path / "u.jsonl", workers=2, progress=False)
    assert recs[0]["result"]["threads"] == max(1, cores // 2)


def test_dask_worker_on_unlisted_host_sizes_its_own_threads(dask_cluster):
    """A worker whose host joined after the sweep sized threads (or came back
    from a restart elsewhere) divides its host's cores by its own task slots."""
    import distributed

    from linattn_nb.studies.sweep import _run_point

    with distributed.Client(dask_cluster) as c:
        c.wait_for_workers(2, timeout=60)
        known = c.submit(_run_point, H.numba_threads, {"x": 0}, {"127.0.0.1": 1}, pure=False).result()
        other = c.submit(_run_point, H.numba_threads, {"x": 1}, {"10.255.255.1": 1}, pure=False).result()
    assert known["result"]["threads"] == 1
    cores = len(os.sched_getaffinity(0))
    # one task slot per worker in this cluster; no more than the worker's Numba pool (NUMBA_NUM_THREADS)
    assert other["result"]["threads"] == max(1, min(cores, other["result"]["pool"]))


def test_dask_exception_that_cannot_be_rebuilt_is_recorded(tmp_path, dask_cluster):
    log = tmp_path / "calls"
    recs = sweep(H.raise_two_arg, {"x": [0, 1], "log": [str(log)]}, out=tmp_path / "r.jsonl", backend="dask",
                 scheduler=dask_cluster.scheduler_address, errors="record", progress=False)
    assert [r["status"] for r in recs] == ["ok", "error"]
    assert recs[1]["error"] == "TwoArgError: code 1: cannot be rebuilt"
    assert "raise_two_arg" in recs[1]["traceback"]
    assert sorted(log.read_text().split()) == ["0", "1"]


def test_to_json_is_public_and_the_studies_import_no_private_name_from_sweep():
    import ast
    import importlib

    sweep_module = importlib.import_module("linattn_nb.studies.sweep")  # the package's `sweep` is the function
    assert "to_json" in sweep_module.__all__
    assert sweep_module.to_json({"a": np.arange(2), "b": (np.float32(0.5),)}) == {"a": [0, 1], "b": [0.5]}
    for name in ("error", "recall"):
        mod = importlib.import_module(f"linattn_nb.studies.{name}")
        tree = ast.parse(open(mod.__file__).read())
        imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and node.module == "sweep" for alias in node.names]
        assert "to_json" in imported and not [n for n in imported if n.startswith("_")], (name, imported)



@pytest.mark.skipif(sys.platform == "win32", reason="os.kill(SIGINT) to itself is POSIX")
def test_swallowed_ctrl_c_stops_the_sweep(tmp_path, python_sigint_handler):
    """A Ctrl-C whose KeyboardInterrupt is swallowed inside a point (a __del__, a
    ctypes callback during a Numba compile) still stops the sweep after that
    point, with the finished points kept; the next sweep is not affected."""
    import signal

    path = tmp_path / "r.jsonl"
    points = [{"x": x} for x in range(4)]
    with pytest.raises(KeyboardInterrupt):
        sweep(H.swallowed_ctrl_c, points, out=path, progress=False)
    assert [r["params"]["x"] for r in _lines(path)] == [0, 1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    recs = sweep(H.square, points, out=tmp_path / "s.jsonl", progress=False)  # no stale interrupt
    assert len(recs) == 4


@pytest.mark.skipif(sys.platform == "win32", reason="os.kill(SIGINT) to itself is POSIX")
def test_swallowed_ctrl_c_stops_the_report(tmp_path, python_sigint_handler):
    """The same inside a study's render (no sweep point left to check it): the
    report stops before the next study and raises KeyboardInterrupt."""
    from linattn_nb.studies import _builtin  # noqa: F401  (registers the built-in studies)
    from linattn_nb.studies import _study, run_report

    study = _study.get_study("rank")

    def render(records, ctx):
        H.swallowed_ctrl_c(1)
        return study.render(records, ctx)

    _study.register_study(dataclasses.replace(study, render=render), overwrite=True)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_report(tmp_path / "r", profile="tiny", studies=["rank", "recall"], progress=False,
                       log=lambda line: None)
    finally:
        _study.register_study(study, overwrite=True)
    assert (tmp_path / "r" / "rank.jsonl").exists()
    assert not (tmp_path / "r" / "recall.jsonl").exists()


@pytest.mark.skipif(sys.platform == "win32", reason="os.kill(SIGINT) to itself is POSIX")
def test_ctrl_c_inside_llvmlite_is_raised_after_it(python_sigint_handler):
    """A SIGINT that arrives while llvmlite's code runs (LLVM calling back into Python during a
    Numba compile or cache load; raising there once crashed the process) is not raised there: the
    handler sends it again a moment later, and it is raised in the first code outside llvmlite."""
    import os
    import signal
    import time

    from linattn_nb import _interrupt

    # code whose frames read as llvmlite's: the signal arrives, and the loop runs on to its end
    src = ("def callback(wait):\n"
           "    os.kill(os.getpid(), signal.SIGINT)\n"
           "    t = time.monotonic()\n"
           "    while time.monotonic() - t < wait:\n"
           "        pass\n"
           "    return 'done'\n")
    ns = {"os": os, "signal": signal, "time": time}
    exec(compile(src, "/site-packages/llvmlite/binding/fake_callback.py", "exec"), ns)
    finished = []
    with pytest.raises(KeyboardInterrupt):
        with _interrupt.interrupts():
            finished.append(ns["callback"](0.01))  # shorter than RETRY_S: no resend inside it
            time.sleep(5)  # the resent SIGINT lands here
    assert finished == ["done"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # outside llvmlite the interrupt is raised at once, as Python's own handler does
    with pytest.raises(KeyboardInterrupt):
        with _interrupt.interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            finished.append("late")
    assert finished == ["done"]


def _edit_record(path, x, edit):
    """Apply ``edit`` to the result record of point ``x`` in the file; return its line number (from 1)."""
    lines = path.read_text().splitlines(True)
    for i, line in enumerate(lines):
        rec = json.loads(line)
        if rec.get("type") == "result" and rec["params"] == {"x": x}:
            edit(rec)
            lines[i] = json.dumps(rec) + "\n"
            path.write_text("".join(lines))
            return i + 1
    raise AssertionError(f"no record of x = {x}")


def test_a_record_whose_params_do_not_match_its_key_is_not_trusted(tmp_path):
    """A line whose params were changed after the sweep wrote it: its key is that of the real point.  It is
    never read as data, a warning names the file and line, and a resumed sweep runs the real point again."""
    out = tmp_path / "r.jsonl"
    sweep(H.square, {"x": [1, 2, 3]}, out=out, progress=False)
    lineno = _edit_record(out, 2, lambda rec: rec["params"].update(x=9999))
    where = rf"r\.jsonl: line {lineno}: the result record has params \{{'x': 9999\}} whose key is"
    with pytest.warns(RuntimeWarning, match=where):
        assert rows(load_results(out)) == [{"x": 1, "y": 1}, {"x": 3, "y": 9}]
    with pytest.warns(RuntimeWarning, match=where):
        recs = sweep(H.square, {"x": [1, 2, 3]}, out=out, progress=False)
    assert rows(recs) == [{"x": 1, "y": 1}, {"x": 2, "y": 4}, {"x": 3, "y": 9}]
    assert [r["params"]["x"] for r in _lines(out)] == [1, 9999, 3, 2]  # the real point ran again, once


@pytest.mark.parametrize("edit, why", [
    (lambda rec: rec.pop("result"), "has status 'ok' but no 'result'"),
    (lambda rec: rec.update(status="error"), "has status 'error' but no 'error'"),
    (lambda rec: rec.update(status="done"), "has status 'done', not one of 'ok', 'error'"),
    (lambda rec: rec.pop("key"), "has no 'key'"),
    (lambda rec: rec.update(params=[2]), "has no valid 'params'"),
])
def test_a_record_missing_what_its_status_needs_is_run_again(tmp_path, edit, why):
    """An ok record without its result (the report's render then failed with a bare KeyError), an error
    record without its error, an unknown status, no key: a warning naming file and line, the point runs
    again, the other points are kept."""
    out = tmp_path / "r.jsonl"
    sweep(H.square, {"x": [1, 2, 3]}, out=out, progress=False)
    lineno = _edit_record(out, 2, edit)
    match = rf"r\.jsonl: line {lineno}: the result record {why}.*its point runs again"
    with pytest.warns(RuntimeWarning, match=match):
        assert rows(load_results(out)) == [{"x": 1, "y": 1}, {"x": 3, "y": 9}]
    with pytest.warns(RuntimeWarning, match=match):
        recs = sweep(H.square, {"x": [1, 2, 3]}, out=out, progress=False)
    assert [(r["status"], r["result"]) for r in recs] == [("ok", {"y": 1}), ("ok", {"y": 4}), ("ok", {"y": 9})]
    assert len(_lines(out)) == 4  # only point 2 ran again
