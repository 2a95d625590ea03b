"""The linattn command line and import-time behaviour."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from linattn_nb import cli

ROOT = Path(__file__).resolve().parents[1]


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for key in ("numba", "numpy", "scipy", "threading", "threads", "cuda", "cache dir"):
        assert key in out


def test_demo_small(capsys):
    assert cli.main(["demo", "--batch", "1", "--heads", "2", "--length", "33", "--dim", "8"]) == 0
    out = capsys.readouterr().out
    assert "scan" in out and "softmax_attention" in out
    assert "FAIL" not in out and "demo: all checks passed" in out


def test_demo_refuses_a_bad_auto_tune_before_its_table(capsys, monkeypatch):
    """A bad LINATTN_AUTO_TUNE printed part of the demo's table, then a traceback (exit 1), where `linattn tune`
    gives one line and exit 2; now the demo does the same before it runs anything."""
    from linattn_nb import config

    monkeypatch.setattr(config, "AUTO_TUNE", "bogus")
    assert cli.main(["demo", "--batch", "1", "--heads", "1", "--length", "8", "--dim", "4"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1 and "LINATTN_AUTO_TUNE" in cap.err, cap


@pytest.mark.parametrize("broken", ["scan", "softmax"])
def test_demo_exits_1_when_a_check_fails(broken, capsys, monkeypatch):
    """``linattn demo`` returns 1 (not 0) when a method is off, and names it."""
    import linattn_nb

    lin, sm = linattn_nb.linear_attention, linattn_nb.softmax_attention

    def bad_linear(q, k, v, **kw):
        out = lin(q, k, v, **kw)
        return out * 1.01 if kw.get("method") == "scan" and out.dtype == "float32" else out

    def bad_softmax(q, k, v, **kw):
        out = sm(q, k, v, **kw)
        return out + 1e-2 if out.dtype == "float32" else out

    if broken == "scan":
        monkeypatch.setattr(linattn_nb, "linear_attention", bad_linear)
    else:
        monkeypatch.setattr(linattn_nb, "softmax_attention", bad_softmax)
    assert cli.main(["demo", "--batch", "1", "--heads", "1", "--length", "17", "--dim", "4"]) == 1
    cap = capsys.readouterr()
    assert "FAIL" in cap.out and "all checks passed" not in cap.out
    if broken == "scan":
        assert "method='scan'" in cap.err and "method='auto'" not in cap.err
    else:
        assert "softmax_attention" in cap.err


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "usage" in capsys.readouterr().out


def test_bad_argument():
    with pytest.raises(SystemExit):
        cli.main(["demo", "--length", "0"])


def test_nothing_compiles_at_import():
    """Importing the package compiles no kernel (Numba compiles lazily)."""
    code = (
        "import linattn_nb, numba\n"
        "from linattn_nb.ops.causal.cpu import causal_scan_kernel\n"
        "from linattn_nb.ops.noncausal.cpu import noncausal_kernel\n"
        "from linattn_nb.ops.softmax.cpu import softmax_kernel\n"
        "assert not causal_scan_kernel.signatures and not noncausal_kernel.signatures\n"
        "assert not softmax_kernel.signatures\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_info_shows_cache_folder(capsys):
    from linattn_nb import _cache, config

    assert cli.main(["info"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("cache dir"))
    folder, origin = _cache.cache_folder()
    assert folder == config.CACHE_DIR
    assert folder is None or (folder in line and origin in line)


def _unwritable_outs(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    outs = [blocker / "report", blocker / "deeper" / "report"]  # a path under a regular file
    if sys.platform.startswith("linux"):
        outs += ["/proc/linattn_nb_report", "/proc/self/linattn_nb/report", "/sys/linattn_nb_report"]
    return outs


def test_report_out_unwritable_one_line_exit_2(tmp_path, capsys):
    """An --out that cannot be created or written: exit 2, one line on stderr (no traceback)."""
    for out in _unwritable_outs(tmp_path):
        assert cli.main(["report", "--profile", "tiny", "--no-progress", "--out", str(out)]) == 2, out
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and str(out) in lines[0] and "error" in lines[0], captured.err
        assert "Traceback" not in captured.err + captured.out
        assert not os.path.exists(out)


def test_report_out_unwritable_subprocess(tmp_path):
    """The same through the real command line: one line, exit 2."""
    out = "/proc/linattn_nb_report" if sys.platform.startswith("linux") else str(_unwritable_outs(tmp_path)[0])
    res = subprocess.run([sys.executable, "-m", "linattn_nb.cli", "report", "--profile", "tiny", "--out", out],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr


def test_unreachable_scheduler_is_named_not_a_folder_error(tmp_path, capsys, monkeypatch):
    """--scheduler that cannot be reached: exit 2 with a message naming the scheduler's address (not
    "cannot write the report to DIR"), before the folder is touched.  distributed.Client is a stand-in
    that fails at once as the real one does after its timeout (an OSError)."""
    import types

    calls = []

    def client(address, timeout=None):
        calls.append((address, timeout))
        raise OSError(f"Timed out trying to connect to {address} after 30 s")

    monkeypatch.setitem(sys.modules, "distributed", types.SimpleNamespace(Client=client))
    out = tmp_path / "s1"
    out.mkdir()
    (out / "rank.jsonl").write_text("kept\n")
    argv = ["rank", "--profile", "tiny", "--no-progress", "--scheduler", "tcp://127.0.0.1:1", "--out", str(out)]
    assert cli.main(argv + ["--force"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the Dask scheduler at 'tcp://127.0.0.1:1'" in err and "Timed out" in err, err
    assert "cannot write the report" not in err and len(err.strip().splitlines()) == 1, err
    assert calls == [("tcp://127.0.0.1:1", "30s")]
    assert sorted(p.name for p in out.iterdir()) == ["rank.jsonl"]  # --force deleted nothing
    new = tmp_path / "new" / "s2"
    assert cli.main(argv[:-1] + [str(new)]) == 2
    assert "cannot reach the Dask scheduler" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # the folders the command made are removed again


def test_report_ctrl_c_in_process(tmp_path, capsys, monkeypatch):
    """KeyboardInterrupt during the report: one line naming --resume, exit status 130."""
    import linattn_nb.studies as studies

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def main(argv):
        try:
            return cli.main(argv)
        except KeyboardInterrupt:
            pytest.fail("KeyboardInterrupt escaped cli.main (a traceback for the user)")

    monkeypatch.setattr(studies, "run_report", interrupted)
    out = tmp_path / "r"
    assert main(["report", "--profile", "tiny", "--no-progress", "--force", "--out", str(out)]) == 130
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "--resume" in lines[0] and "--force" not in lines[0] and str(out) in lines[0]
    assert "Traceback" not in captured.err + captured.out
    # the same for a single study's command
    assert main(["check", "--profile", "tiny", "--no-progress", "--resume", "--out", str(out)]) == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].count("--resume") == 1
    # an abbreviation such as --forc is no option (allow_abbrev=False): refused before the report starts
    with pytest.raises(SystemExit) as exc:
        main(["report", "--profile", "tiny", "--no-progress", "--forc", "--out", str(out)])
    assert exc.value.code == 2
    assert "linattn report: error: unrecognized arguments: --forc" in capsys.readouterr().err


def test_argument_checks_argparse_cannot_make(tmp_path, capsys, monkeypatch):
    """A negative demo seed (NumPy's traceback, exit 1), an empty --out (the default folder used instead,
    exit 0) and --workers with --scheduler (--workers silently ignored): exit 2, one line naming the option."""
    monkeypatch.chdir(tmp_path)  # where the default folder would go
    for argv, msg in ((["demo", "--seed", "-1"], "--seed must be >= 0"),
                      (["rank", "--profile", "tiny", "--no-progress", "--out", ""], "--out is empty"),
                      (["rank", "--profile", "tiny", "--no-progress", "--out", str(tmp_path / "w"), "--workers", "2",
                        "--scheduler", "tcp://127.0.0.1:1"], "--workers sizes the local worker processes")):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2, argv
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, err
    assert not (tmp_path / "w").exists() and not (tmp_path / "report-rank").exists()


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is POSIX")
def test_report_sigint_subprocess(tmp_path):
    """Ctrl-C (SIGINT) to a running `linattn report`: exit 130, one line saying how to resume."""
    out = tmp_path / "r"
    err_path = tmp_path / "stderr.txt"
    # Warm the kernel cache first, so that the interrupt lands within seconds.
    # (During a compile the KeyboardInterrupt may be raised in an llvmlite
    # destructor or ctypes callback, which print and swallow it; the report
    # remembers the signal and stops after the point: linattn_nb/_interrupt.py,
    # tested in test_sweep.py.  CI once saw that here: the report ran to its end.)
    # (the tiny profile: the same studies on small problems, a third of the quick profile's time;
    # without the correctness self-check, 90 of its 100 s warm, which the interrupted report runs in a
    # background process that the interrupt ends)
    from linattn_nb.studies import STUDIES, _builtin  # noqa: F401  (registers the built-in studies)

    warm = tmp_path / "warm.json"
    warm.write_text(json.dumps({"profile": "tiny", "studies": [s.name for s in STUDIES if s.in_report and s.name != "correctness"]}))
    subprocess.run([sys.executable, "-m", "linattn_nb.cli", "report", "--config", str(warm), "--no-progress",
                    "--out", str(tmp_path / "warm")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   cwd=ROOT, timeout=600, check=True)
    with open(err_path, "w") as err:
        # SIG_DFL in the child: a shell may have started this test with SIGINT
        # ignored, and Python keeps an inherited "ignore" (no KeyboardInterrupt).
        proc = subprocess.Popen(
            [sys.executable, "-m", "linattn_nb.cli", "report", "--profile", "tiny", "--no-progress", "--out",
             str(out)],
            stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 90
            while "points" not in err_path.read_text():  # the first study has started
                assert proc.poll() is None, err_path.read_text()
                assert time.monotonic() < deadline, "the report did not start"
                time.sleep(0.1)
            time.sleep(0.3)
            children = _children(proc.pid)  # the background self-check (and multiprocessing's tracker)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = err_path.read_text()
    assert proc.returncode == 130, text
    assert "Traceback" not in text, text
    lines = text.splitlines()
    # the studies that started (the self-check in its background process, the first untimed one),
    # then one line saying how to resume
    assert all(line.startswith("[") and line.endswith("points") or "background process" in line
               for line in lines[:-1]), text
    assert "--resume" in lines[-1] and str(out) in lines[-1], text
    assert any("background process" in line for line in lines), text
    assert children or not Path("/proc/self/stat").exists(), "no background process was started"
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)], "a child process outlived the interrupted report"


def _children(pid):
    """Process ids of the children of ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ---------------------------------------------------------------------------
# problem options of error / rank / recall, and report --config
# ---------------------------------------------------------------------------
def _points(study, profile="tiny"):
    from linattn_nb.studies import Context, get_study

    return get_study(study).points(Context(out=Path("."), profile=profile))


def test_overrides_set_dim_scale_maps_m_n_seeds():
    from linattn_nb._overrides import apply_overrides, check_options

    opts = check_options({"dim": "12", "scale": "1.0", "maps": "elu,favor+", "m": "8,32", "n": "16, 64",
                          "seeds": "3"})
    pts = apply_overrides(_points("error"), opts, study="error")
    assert {p["feature_map"] for p in pts} == {"elu", "favor+"}
    assert {p["d"] for p in pts} == {12} and {p["qk_scale"] for p in pts} == {1.0}
    assert {p["n"] for p in pts} == {16, 64} and {p["seed"] for p in pts} == {0, 1, 2}
    assert {p["num_features"] for p in pts if p["feature_map"] == "favor+"} == {8, 32}
    assert {p["num_features"] for p in pts if p["feature_map"] == "elu"} == {None}
    # every (map, m, n, seed, causal) once
    assert len(pts) == len({(p["feature_map"], p["num_features"], p["n"], p["seed"], p["causal"]) for p in pts})
    assert len(pts) == (1 + 2) * 2 * 3 * len({p["causal"] for p in pts})


def test_overrides_scale_takes_a_list_one_regime_each():
    """--scale 0.5,1,2: the profile's two regimes replaced by three (--help: "one regime per value")."""
    from linattn_nb._overrides import apply_overrides, check_options

    base = _points("error")
    assert {p["qk_scale"] for p in base} == {0.5, 1.0}  # what the help says the profiles run
    pts = apply_overrides(base, check_options({"scale": "0.5,1,2", "maps": "elu"}), study="error")
    assert sorted({p["qk_scale"] for p in pts}) == [0.5, 1.0, 2.0]
    per_scale = {s: sorted((p["n"], p["seed"], p["causal"]) for p in pts if p["qk_scale"] == s)
                 for s in (0.5, 1.0, 2.0)}
    assert per_scale[0.5] == per_scale[1.0] == per_scale[2.0] and len(per_scale[2.0]) > 0  # each point once per scale
    assert len(pts) == len({(p["qk_scale"], p["n"], p["seed"], p["causal"]) for p in pts})
    assert check_options({"scale": [1, 1.0, 2]})["scale"] == [1.0, 2.0]


def test_overrides_recall_n_is_the_pair_grid_and_maps_can_be_added():
    from linattn_nb._overrides import apply_overrides, check_options

    pts = apply_overrides(_points("recall"), check_options({"n": [32, 8], "maps": ["relu", "favor+"], "m": 16}),
                          study="recall")
    seeds = sorted({p["seed"] for p in _points("recall")})  # the profile's seeds are kept
    regimes = sorted({p["regime"] for p in _points("recall")}, key=[p["regime"] for p in _points("recall")].index)
    assert len(regimes) == 4  # the variance, small-logit, orthonormal-key and fixed-state regimes, every map and seed
    assert [(p["feature_map"], p["num_features"], p["regime"], p["seed"]) for p in pts] == (
        [("favor+", 16, r, s) for r in regimes for s in seeds] + [("relu", None, r, s) for r in regimes for s in seeds])
    assert all(p["n_pairs"] == [8, 32] and p["map_params"] == {} for p in pts)


def test_overrides_recall_dim_moves_the_key_scales_and_the_value_width():
    from linattn_nb._overrides import apply_overrides, check_options

    pts = apply_overrides(_points("recall"), check_options({"dim": 64}), study="recall")
    by = {p["regime"]: p for p in pts}
    assert all(p["d"] == 64 for p in pts)
    assert by["variance"]["key_scale"] == 1.0 and by["small logits"]["key_scale"] == 64 ** -0.25
    assert by["orthonormal keys"]["key_scale"] == 64 ** 0.25
    assert by["fixed state"]["value_dim"] == 64 and "value_dim" not in by["variance"]


def test_overrides_refuse_what_a_study_cannot_take():
    from linattn_nb._overrides import OptionError, apply_overrides, check_options

    with pytest.raises(OptionError, match="the rank study does not take 'scale'"):
        apply_overrides(_points("rank"), {"scale": 1.0}, study="rank")
    with pytest.raises(OptionError, match="none of the rank study's selected maps is random"):
        apply_overrides(_points("rank"), {"maps": ["elu"], "m": [8]}, study="rank")
    with pytest.raises(OptionError, match="'nope' is not registered"):
        apply_overrides(_points("error"), {"maps": ["nope"]}, study="error")
    for bad, match in [({"dim": 0}, "dim must be an integer >= 1"), ({"m": "8,x"}, "m must be an integer"),
                       ({"scale": "inf"}, "scale must be a positive finite"), ({"maps": []}, "maps must be"),
                       ({"seed": 3}, "unknown key 'seed'")]:
        with pytest.raises(OptionError, match=match):
            check_options(bad)


@pytest.mark.parametrize("argv, match", [
    (["rank", "--scale", "2"], "the rank study does not take '--scale'"),
    (["error", "--maps", "elu,nope"], "error: --maps: 'nope' is not registered"),
    (["rank", "--maps", "elu", "--m", "8"], "error: --m: none of the rank study's selected maps is random"),
    (["recall", "--n", "0"], "--n must be an integer >= 1"),
    (["error", "--seeds", "two"], "--seeds must be an integer >= 1"),
    # range(10**23) overflowed (a traceback, exit 1); 10**9 seeds ran out of memory building the points
    (["rank", "--seeds", "99999999999999999999999"], "--seeds must be at most 100000"),
    (["recall", "--seeds", "1000000000"], "--seeds must be at most 100000"),
    # refused by the study's own points, as run_report(options={"rank": {"n": [1]}}) refuses it
    (["rank", "--n", "1"], "error: --n 1: rank study: n must hold integers >= 2, got 1"),
    (["rank", "--n", "16,1"], "error: --n 1: rank study: n must hold integers >= 2, got 1"),
    # an empty item is a value left out, not skipped
    (["rank", "--n", "16,,32"], "error: --n has an empty item in '16,,32'"),
    (["recall", "--n", "16,"], "error: --n has an empty item in '16,'"),
    (["error", "--maps", "elu,,favor+"], "error: --maps has an empty item"),
])
def test_problem_option_errors_exit_2_before_running(argv, match, tmp_path, capsys):
    out = tmp_path / "r"
    assert cli.main(argv + ["--profile", "tiny", "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert not out.exists()


def test_error_command_runs_the_changed_grid(tmp_path, capsys):
    from linattn_nb.studies import load_results

    out = tmp_path / "r"
    argv = ["error", "--profile", "tiny", "--no-progress", "--out", str(out),
            "--maps", "elu", "--dim", "4", "--scale", "1", "--n", "16", "--seeds", "2"]
    assert cli.main(argv) == 0
    params = [r["params"] for r in load_results(out / "error.jsonl")]
    assert sorted((p["feature_map"], p["d"], p["qk_scale"], p["n"], p["seed"]) for p in params) == \
        [("elu", 4, 1.0, 16, 0), ("elu", 4, 1.0, 16, 1)]
    report = (out / "report.md").read_text()
    assert "s ∈ {1}" in report and "d = 4" in report  # the regime is stated
    assert "--dim 4" in report                                # and the command that made it
    assert "| elu |" in capsys.readouterr().out


@pytest.mark.parametrize("how", ["flags", "config"])
def test_rank_options_give_the_grid_of_the_studys_points(how, tmp_path, monkeypatch):
    """linattn rank --dim/--maps/--m (and a --config [rank] table) build the grid rank.points builds for the same
    options: M the largest D_φ of the maps chosen (not the profile's), softmax added, one series per m."""
    import types

    import linattn_nb.studies as studies
    from linattn_nb.studies import Context, get_study
    from linattn_nb.studies.rank import points

    seen = {}

    def fake_run_report(out, *, profile, options=None, studies=None, **kw):  # the grid the report would run
        ctx = Context(out=Path(out), profile=profile)
        seen["points"] = get_study("rank").points(ctx, **(options or {}).get("rank", {}))
        return types.SimpleNamespace(sections={}, problems=[])

    monkeypatch.setattr(studies, "run_report", fake_run_report)
    out = tmp_path / "r"
    if how == "flags":
        argv = ["rank", "--profile", "tiny", "--no-progress", "--out", str(out), "--dim", "8",
                "--maps", "taylor2,elu,favor+", "--m", "4,8", "--seeds", "1"]
    else:
        conf = _write(tmp_path / "c.toml", 'profile = "tiny"\nstudies = ["rank"]\n[rank]\ndim = 8\n'
                                           'maps = ["taylor2", "elu", "favor+"]\nm = [4, 8]\nseeds = 1\n')
        argv = ["report", "--config", conf, "--no-progress", "--out", str(out)]
    assert cli.main(argv) == 0
    expected = points(Context(out=out, profile="tiny"), dim=8, maps=["taylor2", "elu", "favor+"], m=[4, 8],
                      seeds=1)
    assert seen["points"] == expected
    assert {p["m"] for p in expected} == {45} and "softmax" in {p["feature_map"] for p in expected}
    assert {p["num_features"] for p in expected if p["feature_map"] == "favor+"} == {4, 8}


def test_error_n_keeps_the_n_sweep_at_one_m(tmp_path, capsys):
    """--n changes the N sweep; the m sweep stays at one N (the middle one), not at every N."""
    from linattn_nb.studies import load_results

    out = tmp_path / "r"
    argv = ["error", "--profile", "tiny", "--no-progress", "--out", str(out),
            "--maps", "favor+", "--dim", "4", "--scale", "1", "--n", "4,8", "--seeds", "2"]
    assert cli.main(argv) == 0
    grid = {(r["params"]["num_features"], r["params"]["n"]) for r in load_results(out / "error.jsonl")}
    assert grid == {(16, 4), (16, 8), (8, 8), (32, 8)}  # tiny: m = 16 across N, m = 8, 16, 32 at N = 8
    assert "random maps use m = 16 features in the N sweep and m ∈ {8, 16, 32} at N = 8" in capsys.readouterr().out


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_report_config_toml_runs_the_described_report(tmp_path):
    from linattn_nb.studies import load_results

    conf = _write(tmp_path / "r.toml", f'''
profile = "tiny"
device = "cpu"
out = "{tmp_path / 'rep'}"
studies = ["error"]

[error]
maps = ["elu"]
n = [16]
dim = 4
''')
    assert cli.main(["report", "--config", conf, "--no-progress"]) == 0
    params = [r["params"] for r in load_results(tmp_path / "rep" / "error.jsonl")]
    assert {(p["feature_map"], p["n"], p["d"]) for p in params} == {("elu", 16, 4)}
    # the profile's regimes and seeds are kept: one point each
    assert len(params) == len({(p["qk_scale"], p["seed"]) for p in params}) == len(
        {(p["qk_scale"], p["seed"]) for p in _points("error")})
    assert not (tmp_path / "rep" / "rank.jsonl").exists()


@pytest.mark.parametrize("text, suffix, match", [
    ('profile = "huge"', "toml", "profile must be one of tiny, quick, full"),
    ('colour = "red"', "toml", "'colour' is not a known key; allowed: profile"),
    ('[error]\nwidth = 3', "toml", "unknown key 'error.width'; allowed: dim, scale"),
    ('[error]\nm = "many"', "toml", "error.m must be an integer"),
    ('[throughput]\nn = [1]', "toml", "the throughput study takes no options"),
    ('studies = ["rank"]\n[error]\ndim = 4', "toml", "[error] sets options of the error study, which 'studies'"),
    ('studies = ["nope"]', "toml", "studies: no study 'nope'; registered: correctness"),
    ('profile = ', "toml", "cannot be parsed"),
    ('{"recall": {"seeds": 0}}', "json", "recall.seeds must be an integer >= 1"),
    ('[1, 2]', "json", "must hold a table"),
    # refused when applied to the study's points: the file and the table named too
    ('[error]\nmaps = ["nope"]', "toml", "[error] maps: 'nope' is not registered"),
    ('[error]\nmaps = ["elu"]\nm = [8]', "toml", "[error] m: none of the error study's selected maps is random"),
    ('studies = ["rank"]\n[rank]\nn = [1]', "toml", "[rank] n 1: rank study: n must hold integers >= 2, got 1"),
])
def test_report_config_errors_name_the_key(text, suffix, match, tmp_path, capsys):
    conf = _write(tmp_path / f"c.{suffix}", text)
    assert cli.main(["report", "--config", conf, "--no-progress", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert match in err and conf in err, err
    assert not (tmp_path / "r").exists()


def test_report_config_missing_file(tmp_path, capsys):
    assert cli.main(["report", "--config", str(tmp_path / "none.toml"), "--out", str(tmp_path / "r")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_study_help_says_each_thing_once(capsys):
    with pytest.raises(SystemExit):
        cli.main(["error", "--help"])
    out = capsys.readouterr().out
    assert out.lower().count("approximation error against softmax") == 1
    for flag in ("--dim", "--scale", "--maps", "--m ", "--n ", "--seeds"):
        assert flag in out
    assert cli.QUICK_TIME in " ".join(out.split())   # argparse wraps lines


def test_quick_time_is_quoted_the_same_in_help_and_notebook(capsys):
    import json

    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    assert cli.QUICK_TIME in " ".join(capsys.readouterr().out.split())
    nb = json.loads((ROOT / "notebooks" / "01_quickstart.ipynb").read_text(encoding="utf-8"))
    text = " ".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert cli.QUICK_TIME in " ".join(text.split())


@pytest.mark.parametrize("argv, command, match", [
    (["demo", "--length", "0"], "demo", "--length must be >= 1"),
    (["error", "--quick", "--profile", "full"], "error", "--quick and --profile full contradict each other"),
])
def test_errors_after_parsing_show_the_subcommand_usage(argv, command, match, tmp_path, capsys):
    """A check made after parsing is reported by the subcommand's parser: its usage line, its name."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv + (["--out", str(tmp_path / "r")] if command != "demo" else []))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: linattn {command} " in err and f"linattn {command}: error: {match}" in err, err
    assert not (tmp_path / "r").exists()


def test_demo_refuses_a_length_the_reference_cannot_take(monkeypatch, capsys):
    """The float64 reference is method='quadratic': a longer --length ended in its ValueError's traceback."""
    from linattn_nb import config

    monkeypatch.setattr(config, "QUADRATIC_MAX_ELEMENTS", 100)
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--length", "11", "--batch", "1", "--heads", "1", "--dim", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: linattn demo " in err and "the largest length allowed is 10" in err


def test_info_says_a_requested_threading_layer_cannot_be_loaded(monkeypatch):
    """NUMBA_THREADING_LAYER=tbb without TBB: info predicted "tbb layer" although the first parallel kernel fails."""
    import numba

    from linattn_nb import _blas

    def not_started():
        raise ValueError("not started")

    monkeypatch.setattr(numba, "threading_layer", not_started)
    monkeypatch.setattr(_blas, "_layer", None)
    monkeypatch.setattr(numba.config, "THREADING_LAYER", "tbb")
    monkeypatch.setitem(sys.modules, "numba.np.ufunc.tbbpool", None)  # importing it raises ImportError
    line = cli._threading_layer()
    assert "cannot be loaded" in line and "will fail" in line and "predicted" not in line


@pytest.mark.parametrize("text, flags, match", [
    ('scheduler = "tcp://127.0.0.1:1"\nworkers = 2', [],
     "--config {conf!r}: sets both scheduler and workers; workers sizes the local worker processes, scheduler "
     "brings its own workers: set one or the other"),
    ('scheduler = "tcp://127.0.0.1:1"', ["--workers", "2"],
     "--workers sizes the local worker processes; --scheduler brings its own workers: pass one or the other "
     "(--workers given here, scheduler set by --config {conf!r})"),
    ("workers = 2", ["--scheduler", "tcp://127.0.0.1:1"],
     "--workers sizes the local worker processes; --scheduler brings its own workers: pass one or the other "
     "(--scheduler given here, workers set by --config {conf!r})"),
])
def test_report_config_scheduler_with_workers_is_refused_before_connecting(text, flags, match, tmp_path, capsys,
                                                                            monkeypatch):
    """As --scheduler with --workers on the command line: exit 2 naming the file, no connection tried."""
    import types

    calls = []
    monkeypatch.setitem(sys.modules, "distributed", types.SimpleNamespace(Client=lambda *a, **k: calls.append(a)))
    conf = _write(tmp_path / "c.toml", f'profile = "tiny"\nstudies = ["rank"]\n{text}\n')
    out = tmp_path / "r"
    assert cli.main(["report", "--config", conf, "--no-progress", "--out", str(out)] + flags) == 2
    err = capsys.readouterr().err
    assert err == f"linattn report: error: {match.format(conf=conf)}\n", err
    assert calls == [] and not out.exists()


@pytest.mark.parametrize("argv, match", [
    (["recall", "--dim", "100000000"], "--dim 100000000: recall study: dim = 100000000"),
    (["recall", "--n", "100000000"], "--n 100000000: recall study: dim = 4, n = 100000000"),
    (["rank", "--dim", "100000000"], "--dim 100000000: rank study: dim = 100000000"),
    (["rank", "--n", "100000000"], "--n 100000000: rank study: dim = 4, n = 100000000"),
    (["recall", "--m", "100000000"], "--m 100000000: recall study:"),
    # the error study ran each point into NumPy's "Maximum allowed dimension exceeded" (exit 1)
    (["error", "--n", "99999999999999999999999"], "--n 99999999999999999999999: error study: dim = 8"),
    (["error", "--dim", "100000000"], "--dim 100000000: error study: dim = 100000000"),
    (["error", "--maps", "rff", "--m", "100000000"], "--m 100000000: error study:"),
    # each fits alone, not together
    (["rank", "--maps", "elu", "--dim", "4000", "--n", "20000"], "--dim 4000, --n 20000: rank study:"),
])
def test_study_sizes_too_large_for_memory_are_refused_in_one_line(argv, match, tmp_path, capsys, monkeypatch):
    """linattn recall|rank --dim 100000000 (or --n) failed point by point or ran out of memory: the
    study's points refuse a point whose largest array exceeds config.QUADRATIC_MAX_ELEMENTS, and the
    command line says so in one line, exit 2, before anything runs."""
    import linattn_nb.studies as studies

    def never(*args, **kwargs):
        pytest.fail("the report ran")

    monkeypatch.setattr(studies, "run_report", never)
    out = tmp_path / "r"
    assert cli.main(argv + ["--profile", "tiny", "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"linattn {argv[0]}: error: {match}"), err
    assert "config.QUADRATIC_MAX_ELEMENTS = " in err and "Traceback" not in err
    assert not out.exists()


def test_a_dim_that_fits_the_chosen_maps_is_not_refused_for_a_default_map(tmp_path, capsys, monkeypatch):
    """--dim is checked with the --maps given: Taylor-2 (D_φ ~ d²/2, a default map) does not refuse elu."""
    import linattn_nb.studies as studies

    ran = []

    def stop(*args, **kwargs):  # the options passed every check: stop here (reported as an interruption)
        ran.append(kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(studies, "run_report", stop)
    assert cli.main(["recall", "--maps", "elu", "--dim", "2000", "--n", "8", "--profile", "tiny", "--no-progress",
                     "--out", str(tmp_path / "r")]) == 130
    assert ran and "interrupted" in capsys.readouterr().err


@pytest.mark.parametrize("argv, command", [
    (["mqar", "--n", "4"], "mqar"),  # was taken as --no-progress, then "unrecognized arguments: 4"
    (["horizon", "--n", "4"], "horizon"),
    (["recall", "--no-prog"], "recall"),
    (["rank", "--di", "8"], "rank"),
])
def test_no_option_is_taken_by_a_prefix(argv, command, tmp_path, capsys, monkeypatch):
    """argparse's abbreviations read `linattn mqar --n 4` as --no-progress and printed the top-level
    usage with "unrecognized arguments: 4": every parser has allow_abbrev=False, and an unknown option is
    reported by the subcommand's parser, naming it."""
    import linattn_nb.studies as studies

    monkeypatch.setattr(studies, "run_report", lambda *a, **k: pytest.fail("the report ran"))
    with pytest.raises(SystemExit) as exc:
        cli.main(argv + ["--profile", "tiny", "--out", str(tmp_path / "r")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: linattn {command} " in err, err
    assert f"linattn {command}: error: unrecognized arguments: {' '.join(argv[1:])}" in err, err
    parser = cli.build_parser()
    assert parser.allow_abbrev is False
    assert all(sp.allow_abbrev is False for sp in parser._subparsers._group_actions[0].choices.values())
