"""The calibration of method="auto" on the CPU (linattn_nb._tune), ``linattn tune`` and the BLAS lines of ``linattn info``."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from linattn_nb import _cache, _tune, cli, config
from linattn_nb.ops.registry import select_auto

ROOT = Path(__file__).resolve().parents[1]
KW = dict(causal=True, device="cpu")


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """Calibrations go to a temporary folder, and the process forgets the one it had before and after."""
    monkeypatch.setattr(_tune, "calibration_folder", lambda: str(tmp_path))
    _tune.forget()
    yield tmp_path
    _tune.forget()


def fake(rows_f32=((100, "scan"), (None, "chunked")), *, key=None, quick=False):
    rows = [list(r) for r in rows_f32]
    return {"format": _tune.FORMAT, "key": _tune.calibration_key() if key is None else key,
            "created": "2026-01-01T00:00:00+00:00",
            "setting": {**{k: list(v) if isinstance(v, tuple) else v for k, v in _tune.FULL.items()}, "quick": quick},
            "entries": {"additive/float32": {"n": [1, 4096], "scan_ms": [0.1, 20.0], "chunked_ms": [0.2, 9.0],
                                             "ratio": [2.0, 0.45], "rows": rows, "crossover": _tune.crossover(rows)}}}


def constant_edge():
    rows = config.AUTO_METHODS[("additive", True, "cpu")]
    assert rows[0][1] == "scan" and rows[-1] == (None, "chunked")
    return rows[0][0]


def test_round_trip(folder):
    cal = fake()
    path = _tune.save(cal)
    assert path is not None and Path(path).parent == folder and Path(path).name.startswith(_tune.FILE_PREFIX)
    assert [p.name for p in folder.iterdir()] == [Path(path).name]  # the temporary file was renamed
    _tune.forget()
    assert _tune.load() == cal
    assert _tune.clear() == path and not Path(path).exists() and _tune.load() is None


def test_no_folder_keeps_it_in_memory(monkeypatch):
    monkeypatch.setattr(_tune, "calibration_folder", lambda: None)
    monkeypatch.setattr(config, "AUTO_TUNE", "load")
    _tune.forget()
    try:
        assert _tune.save(fake()) is None
        assert select_auto(n=100, dtype=np.float32, **KW) == "scan"
    finally:
        _tune.forget()


@pytest.mark.parametrize("what", ["cpu", "blas", "blas_env", "linattn_nb", "numba", "format"])
def test_other_machine_blas_or_version_is_ignored(folder, monkeypatch, what):
    monkeypatch.setattr(config, "AUTO_TUNE", "load")
    cal = fake()
    key = dict(cal["key"])
    if what == "cpu":
        key["cpu"] = "Some Other CPU"
    elif what == "blas":
        key["blas"] = [{"internal_api": "openblas", "architecture": "Prescott", "version": "0.1"}]
    elif what == "blas_env":
        key["blas_env"] = {"OPENBLAS_CORETYPE": "Sandybridge"}
    elif what in ("linattn_nb", "numba"):
        key[what] = "0.0.0"
    if what == "format":
        cal["format"] = _tune.FORMAT + 1
    cal["key"] = key
    # under this machine's file name, as if copied from elsewhere
    Path(_tune.calibration_path()).write_text(json.dumps(cal))
    assert _tune.load() is None
    assert select_auto(n=100, dtype=np.float32, **KW) == ("scan" if constant_edge() >= 100 else "chunked")


@pytest.mark.parametrize("text", ["{not json", "", "[]", "null", "[" * 100000,
                                  '{"format": 1, "key": "KEY", "entries": {"additive/float32": {"rows": [[4, "x"]]}}}',
                                  '{"format": 1, "key": "KEY", "entries": {"additive/float32": {"rows": [[4, "scan"]]}}}',
                                  '{"format": 1, "key": "KEY", "entries": {"additive/float32": '
                                  '{"rows": [[8, "scan"], [4, "chunked"], [null, "scan"]]}}}'])
def test_corrupt_file_is_ignored(folder, monkeypatch, text):
    monkeypatch.setattr(config, "AUTO_TUNE", "load")
    Path(_tune.calibration_path()).write_text(text.replace('"KEY"', json.dumps(_tune.calibration_key())))
    assert _tune.load() is None
    edge = constant_edge()
    assert select_auto(n=edge, dtype=np.float32, **KW) == "scan"
    assert select_auto(n=edge + 1, dtype=np.float32, **KW) == "chunked"


def test_auto_uses_the_stored_calibration(folder, monkeypatch):
    monkeypatch.setattr(config, "AUTO_TUNE", "load")
    _tune.save(fake([(100, "scan"), (None, "chunked")]))
    _tune.forget()  # read from the file
    assert select_auto(n=100, dtype=np.float32, **KW) == "scan"
    assert select_auto(n=101, dtype=np.float32, **KW) == "chunked"
    assert select_auto(n=100, dtype=np.float16, **KW) == "scan"  # float16 runs in float32
    # no entry for float64 or for the decay rule: the constants
    edge = constant_edge()
    assert select_auto(n=edge + 1, dtype=np.float64, **KW) == "chunked"
    assert select_auto(n=100, dtype=np.float32, rule="decay", **KW) == "chunked"
    # non-causal and CUDA tables are never replaced
    assert select_auto(causal=False, device="cpu", n=50, dtype=np.float32) == "aggregate"
    # a scan everywhere (an AVX2-only BLAS, say), through the front end's choice
    _tune.use(fake([(None, "scan")]))
    from linattn_nb._frontend import choose_method

    m = choose_method("auto", rule="additive", causal=True, device="cpu", batch=16, n=65536, f=64, m=64,
                      dtype=np.float32)
    assert m.name == "scan"


def test_constants_when_tuning_is_off(folder, monkeypatch):
    _tune.save(fake([(None, "scan")]))
    _tune.forget()
    monkeypatch.setattr(config, "AUTO_TUNE", "off")
    assert select_auto(n=4096, dtype=np.float32, **KW) == "chunked"
    monkeypatch.setattr(config, "AUTO_TUNE", "load")
    assert select_auto(n=4096, dtype=np.float32, **KW) == "scan"
    monkeypatch.setattr(config, "AUTO_TUNE", "sometimes")
    with pytest.raises(ValueError, match="AUTO_TUNE"):
        select_auto(n=4096, dtype=np.float32, **KW)


def test_quick_calibration_is_not_used(folder, monkeypatch):
    monkeypatch.setattr(config, "AUTO_TUNE", "load")
    _tune.save(fake([(None, "scan")], quick=True))
    _tune.forget()
    assert select_auto(n=4096, dtype=np.float32, **KW) == "chunked"


def test_first_use_measures_once_and_stores(folder, monkeypatch, capsys):
    monkeypatch.setattr(config, "AUTO_TUNE", "first-use")
    calls = []

    def calibrate(rules, dtypes, **kw):
        calls.append((list(rules), list(dtypes)))
        cal = fake([(5000, "scan"), (None, "chunked")])
        cal["entries"] = {f"{rules[0]}/{dtypes[0]}": cal["entries"]["additive/float32"]}
        return cal

    monkeypatch.setattr(_tune, "calibrate", calibrate)
    assert select_auto(n=4096, dtype=np.float32, **KW) == "scan"
    assert select_auto(n=5001, dtype=np.float32, **KW) == "chunked"
    assert calls == [(["additive"], ["float32"])]
    assert "linattn_nb: timing the scan against the chunked kernel" in capsys.readouterr().err
    assert select_auto(n=4096, dtype=np.float64, **KW) == "scan"  # one more (rule, dtype), merged
    assert calls[-1] == (["additive"], ["float64"])
    _tune.forget()
    monkeypatch.setattr(config, "AUTO_TUNE", "load")
    assert set(_tune.load()["entries"]) == {"additive/float32", "additive/float64"}
    assert select_auto(n=4096, dtype=np.float64, **KW) == "scan" and len(calls) == 2


def test_first_use_failure_falls_back_to_the_constants(folder, monkeypatch, capsys):
    monkeypatch.setattr(config, "AUTO_TUNE", "first-use")
    calls = []

    def calibrate(rules, dtypes, **kw):
        calls.append(1)
        raise RuntimeError("no timer")

    monkeypatch.setattr(_tune, "calibrate", calibrate)
    edge = constant_edge()
    assert select_auto(n=edge + 1, dtype=np.float32, **KW) == "chunked"
    assert "the timing failed (RuntimeError: no timer)" in capsys.readouterr().err
    assert select_auto(n=edge, dtype=np.float32, **KW) == "scan" and calls == [1]  # not tried again


def test_rows_from_timings():
    n = [1, 2, 4, 8, 16, 64, 256, 1024, 4096]
    rows = _tune.rows_from(n, [1.5, 1.2, 0.8, 0.5, 0.4, 0.4, 0.5, 0.45, 0.45])
    assert rows == [[2, "scan"], [None, "chunked"]] and _tune.crossover(rows) == 3
    # one length within noise does not make a row of its own
    rows = _tune.rows_from(n, [1.5, 1.2, 0.8, 0.5, 1.02, 0.4, 0.5, 0.45, 0.45])
    assert rows == [[2, "scan"], [None, "chunked"]]
    rows = _tune.rows_from(n, [1.5, 1.2, 1.1, 1.1, 1.2, 1.1, 1.15, 1.12, 1.14])  # an AVX2 BLAS on AVX-512
    assert rows == [[None, "scan"]] and _tune.crossover(rows) is None
    rows = _tune.rows_from(n, [0.5] * 9)
    assert rows == [[None, "chunked"]] and _tune.crossover(rows) == 1
    rows = _tune.rows_from(n, [1.5, 0.8, 0.8, 0.8, 0.9, 1.2, 1.3, 1.2, 1.2])
    assert rows == [[32, "chunked"], [None, "scan"]] and _tune.crossover(rows) is None


def test_forced_kernel_warnings():
    avx512, avx2 = {"sse2", "avx", "avx2", "avx512f"}, {"sse2", "avx", "avx2"}
    lib = {"internal_api": "openblas", "version": "0.3.30", "num_threads": 2,
           "filepath": "/x/site-packages/scipy.libs/libscipy_openblas.so"}
    haswell, skx = dict(lib, architecture="Haswell"), dict(lib, architecture="SkylakeX")
    assert _tune.forced_kernel_warnings([skx], avx512, {}) == []
    assert _tune.forced_kernel_warnings([haswell], avx2, {}) == []
    (w,) = _tune.forced_kernel_warnings([haswell], avx512, {"OPENBLAS_CORETYPE": "Haswell"})
    assert "Haswell" in w and "AVX-512" in w and "OPENBLAS_CORETYPE=Haswell" in w and "scipy" in w
    assert _tune.forced_kernel_warnings([dict(lib, architecture="Sandybridge")], avx2, {})
    # kernels above the CPU (OPENBLAS_CORETYPE=SkylakeX on an AVX2 CPU): every BLAS call dies of SIGILL
    (w,) = _tune.forced_kernel_warnings([skx], avx2, {"OPENBLAS_CORETYPE": "SkylakeX"})
    assert "SkylakeX" in w and "only AVX2" in w and "illegal instruction" in w
    assert _tune.forced_kernel_warnings([haswell], {"sse2", "avx"}, {})
    mkl = {"internal_api": "mkl", "version": "2024.0", "num_threads": 2, "filepath": "/x/lib/libmkl_rt.so.2"}
    assert _tune.forced_kernel_warnings([skx, mkl], avx512, {"MKL_ENABLE_INSTRUCTIONS": "AVX2"})
    assert not _tune.forced_kernel_warnings([skx, mkl], avx512, {"MKL_ENABLE_INSTRUCTIONS": "AVX512"})
    assert "scipy" in _tune.blas_line([haswell]) and "Haswell" in _tune.blas_line([haswell])


def test_info_shows_blas_and_calibration(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    lines = {line[:12].strip(): line[13:] for line in out.splitlines()}
    assert "threads" in lines["threading"] and "not started" not in lines["threading"]
    assert lines["blas"] and "threads" in lines["blas"]
    assert "blas env" in lines and "auto tune" in lines and "cpu" in lines


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "NUMBA_CACHE_DIR")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.mark.skipif("avx512f" not in (_tune.cpu_flags() or ()), reason="the CPU has no AVX-512")
def test_info_warns_about_avx2_kernels_forced_on_avx512():
    # the one place the tests set OPENBLAS_CORETYPE: in this subprocess only
    proc = subprocess.run([sys.executable, "-m", "linattn_nb.cli", "info"], capture_output=True, text=True,
                          env=_env(OPENBLAS_CORETYPE="Haswell"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "OPENBLAS_CORETYPE=Haswell" in proc.stdout
    warning = [line for line in proc.stdout.splitlines() if line.startswith("WARNING")]
    assert warning and "Haswell" in warning[0] and "AVX-512" in warning[0]
    # a fresh process: the layer is named without starting Numba's pool just to ask
    (threading,) = [line for line in proc.stdout.splitlines() if line.startswith("threading")]
    assert "layer (predicted" in threading and "threads" in threading


def test_tune_command(tmp_path, folder, capsys):
    # the kernels the quick calibration runs, compiled here and handed to the subprocess's cache folder
    _tune.calibrate(["additive"], ["float32"], quick=True)
    src = _cache.cache_folder()[0]
    if src is not None and os.path.isdir(src):
        shutil.copytree(src, tmp_path / "cache" / os.path.basename(src))
    proc = subprocess.run([sys.executable, "-m", "linattn_nb.cli", "tune", "--quick", "--rules", "additive",
                           "--dtypes", "float32"], capture_output=True, text=True, timeout=300,
                          env=_env(LINATTN_CACHE_DIR=str(tmp_path / "cache")))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("machine: CPU ") and "BLAS" in out.splitlines()[0]
    assert "additive/float32" in out and "chunked/scan" in out
    stored = [line for line in out.splitlines() if line.startswith("stored in ")]
    assert stored
    path = Path(stored[0][len("stored in "):])
    assert path.is_file() and (tmp_path / "cache") in path.parents
    cal = json.loads(path.read_text())
    assert cal["setting"]["quick"] is True and list(cal["entries"]) == ["additive/float32"]
    assert cal["entries"]["additive/float32"]["n"] == list(_tune.QUICK["sizes"])
    # --show and --clear in the same environment as the run that stored it: a calibration is keyed by the
    # BLAS kernels, and this process's may differ (OPENBLAS_CORETYPE set by the host, unset above)
    def tune(*args):
        p = subprocess.run([sys.executable, "-m", "linattn_nb.cli", "tune", *args], capture_output=True, text=True,
                           timeout=300, env=_env(LINATTN_CACHE_DIR=str(tmp_path / "cache")))
        assert p.returncode == 0, p.stderr
        return p.stdout

    assert "additive/float32" in tune("--show")
    assert "removed" in tune("--clear") and not path.exists()
    assert "no calibration stored" in tune("--show")
    capsys.readouterr()
    assert cli.main(["tune", "--rules", "nonexistent"]) == 2


@pytest.mark.parametrize("args", [["--show", "--quick"], ["--clear", "--rules", "additive"],
                                  ["--show", "--dtypes", "float32"]])
def test_tune_show_and_clear_refuse_the_timing_options(args, capsys):
    """--quick, --rules, --dtypes choose what to time: with --show or --clear they were silently ignored."""
    assert cli.main(["tune", *args]) == 2
    err = capsys.readouterr().err
    assert "cannot be combined with " + args[0] in err and args[1] in err


@pytest.mark.parametrize("args", [["--rules", "additive,,decay"], ["--dtypes", "float32,,"]])
def test_tune_refuses_an_empty_item(args, capsys, monkeypatch):
    """"additive,,decay" and "float32,," dropped the blank item and started timing; the study options refuse it."""
    monkeypatch.setattr(_tune, "calibrate", lambda *a, **k: pytest.fail("timed despite the empty item"))
    assert cli.main(["tune", *args]) == 2
    assert f"{args[0]} has an empty item" in capsys.readouterr().err


def test_mkl_variables_warn_only_with_mkl_loaded():
    """MKL_ENABLE_INSTRUCTIONS limits nothing when only OpenBLAS is loaded: no WARNING then."""
    lib = {"internal_api": "openblas", "version": "0.3.30", "num_threads": 2, "architecture": "SkylakeX",
           "filepath": "/x/site-packages/scipy.libs/libscipy_openblas.so"}
    avx512 = {"sse2", "avx", "avx2", "avx512f"}
    assert _tune.forced_kernel_warnings([lib], avx512, {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}) == []


def _quick_calibrate(rules, dtypes, *, quick=False, **kw):
    """Stands in for _tune.calibrate in the CLI tests: no timing, a quick or full calibration of the additive rule."""
    return fake([(None, "scan")], quick=quick)


def test_quick_never_replaces_a_full_calibration(folder, monkeypatch, capsys):
    """`linattn tune --quick` over a full calibration replaced it with a smoke test that auto ignores."""
    monkeypatch.setattr(_tune, "calibrate", _quick_calibrate)
    full = fake()
    _tune.save(full)
    assert cli.main(["tune", "--quick", "--rules", "additive", "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    assert "not stored: the full calibration" in out and "is kept" in out and "stored in " not in out
    _tune.forget()
    assert _tune.load() == full
    # a quick run over a quick one, and a full run over a quick one, are stored
    _tune.save(fake(quick=True))
    assert cli.main(["tune", "--quick", "--rules", "additive", "--dtypes", "float32"]) == 0
    assert _tune.load()["entries"]["additive/float32"]["rows"] == [[None, "scan"]]
    assert cli.main(["tune", "--rules", "additive", "--dtypes", "float32"]) == 0
    assert _tune.load()["setting"]["quick"] is False


def _drop(*fields):
    def f(cal):
        for field in fields:
            cal["entries"]["additive/float32"].pop(field)
    return f


DAMAGE = {
    "setting is a list": lambda cal: cal.__setitem__("setting", [1]),
    "setting is null": lambda cal: cal.__setitem__("setting", None),
    "quick is a string": lambda cal: cal["setting"].__setitem__("quick", "false"),
    "no created": lambda cal: cal.pop("created"),
    "no n, scan_ms": _drop("n", "scan_ms"),
    "short ratio": lambda cal: cal["entries"]["additive/float32"].__setitem__("ratio", [1.0]),
    "no entries": lambda cal: cal.__setitem__("entries", {}),
    "extra entry of rows only": lambda cal: cal["entries"].__setitem__("additive/float64", {"rows": [[None, "scan"]]}),
    "bad entry name": lambda cal: cal["entries"].__setitem__("additive", cal["entries"]["additive/float32"]),
    # a JSON integer beyond a float's range: math.isfinite raised OverflowError in every reader and in auto
    "huge integer time": lambda cal: cal["entries"]["additive/float32"]["scan_ms"].__setitem__(0, 10**400),
    "huge integer chunk time": lambda cal: cal["entries"]["additive/float32"].update(chunk=[48, 48],
                                                                                    chunk_ms=[[48, 48, 10**400]]),
    "huge integer gradient pair time": lambda cal: cal["entries"]["additive/float32"].update(
        grad_chunk=[48, 48], grad_chunk_ms=[[48, 48, 10**400]]),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_file_is_no_calibration_and_is_named(folder, monkeypatch, capsys, damage):
    """A file of this machine's key with a field missing or of the wrong type: auto uses the constants, and
    info and --show say the file is ignored (they raised AttributeError or KeyError, or said "none stored")."""
    monkeypatch.setattr(config, "AUTO_TUNE", "load")
    cal = fake([(None, "scan")])
    DAMAGE[damage](cal)
    path = _tune.save(cal)
    _tune.forget()
    assert _tune.load() is None
    assert select_auto(n=4096, dtype=np.float32, **KW) == "chunked"  # the constants, not the file's scan
    line = _tune.status_line()
    assert path in line and "ignored" in line and "none stored" not in line
    assert cli.main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert path in out and "ignored" in out and "no calibration stored" not in out


def test_info_derives_the_crossover_from_the_rows(folder, monkeypatch):
    """info printed the file's 'crossover' field (a KeyError without it) while --show recomputed it from the rows."""
    monkeypatch.setattr(config, "AUTO_TUNE", "load")
    cal = fake([(100, "scan"), (None, "chunked")])
    cal["entries"]["additive/float32"]["crossover"] = 7
    _tune.save(cal)
    assert _tune.status_line().endswith("chunked from N = additive/float32 101")
    del cal["entries"]["additive/float32"]["crossover"]
    _tune.save(cal)
    assert _tune.status_line().endswith("chunked from N = additive/float32 101")


@pytest.mark.parametrize("args", [["--rules", ""], ["--rules", " , "], ["--dtypes", ""]])
def test_tune_refuses_an_empty_list(folder, monkeypatch, capsys, args):
    """`--rules ""` calibrated nothing, stored a file without entries and exited 0."""
    monkeypatch.setattr(_tune, "calibrate", lambda *a, **k: pytest.fail("timed with nothing to time"))
    assert cli.main(["tune", "--quick", *args]) == 2
    assert f"{args[0]}" in capsys.readouterr().err and not list(folder.iterdir())


def test_tune_checks_auto_tune_before_timing(folder, monkeypatch, capsys):
    """A bad LINATTN_AUTO_TUNE was found after the timing and storing, as a traceback."""
    monkeypatch.setattr(config, "AUTO_TUNE", "bogus")
    monkeypatch.setattr(_tune, "calibrate", lambda *a, **k: pytest.fail("timed before checking AUTO_TUNE"))
    assert cli.main(["tune", "--quick", "--rules", "additive", "--dtypes", "float32"]) == 2
    err = capsys.readouterr().err
    assert "linattn tune: error: config.AUTO_TUNE (LINATTN_AUTO_TUNE) is 'bogus'" in err
    assert not list(folder.iterdir())


def test_first_use_keeps_what_another_process_stored_meanwhile(folder, monkeypatch):
    """A first-use timing merges into the file as it is when it stores, not as this process read it: an
    entry that another process (``linattn tune --rules decay``) stored in between stays."""
    monkeypatch.setattr(config, "AUTO_TUNE", "first-use")

    def calibrate(rules, dtypes, **kw):
        cal = fake([(5000, "scan"), (None, "chunked")])
        cal["entries"] = {f"{rules[0]}/{dtypes[0]}": cal["entries"]["additive/float32"]}
        return cal

    monkeypatch.setattr(_tune, "calibrate", calibrate)
    assert select_auto(n=4096, dtype=np.float32, **KW) == "scan"  # times additive/float32, stores it
    other = json.loads(Path(_tune.calibration_path()).read_text())  # another process adds decay/float32
    other["entries"]["decay/float32"] = other["entries"]["additive/float32"]
    Path(_tune.calibration_path()).write_text(json.dumps(other))
    assert select_auto(n=4096, dtype=np.float64, **KW) == "scan"  # times additive/float64 here
    stored = json.loads(Path(_tune.calibration_path()).read_text())["entries"]
    assert set(stored) == {"additive/float32", "additive/float64", "decay/float32"}


def test_clear_that_cannot_remove_the_file_says_so(folder, monkeypatch, capsys):
    """``linattn tune --clear`` where the file cannot be removed: an error naming it and exit 1 (it said
    "no calibration stored" and exited 0, and the file went on being used)."""
    path = _tune.save(fake())

    def unlink(p):
        raise PermissionError(13, "Permission denied", p)

    monkeypatch.setattr(_tune.os, "unlink", unlink)
    with pytest.raises(PermissionError):
        _tune.clear()
    assert cli.main(["tune", "--clear"]) == 1
    err = capsys.readouterr().err
    assert f"cannot remove {path}: Permission denied" in err and os.path.exists(path)


def test_the_librarys_knobs_key_the_calibration(monkeypatch):
    """A chunk size or another ``LINATTN_*`` knob set in the environment changes what is timed, so it keys
    its own calibration file; the cache folder and the tuning mode do not."""
    _tune.forget()
    base = _tune.calibration_key()
    for name, value, same in (("LINATTN_CPU_CHUNK_SIZE", "8", False), ("LINATTN_BLAS_SINGLE_THREAD", "0", False),
                              ("LINATTN_AUTO_TUNE", "off", True), ("LINATTN_CACHE_DIR", "/tmp/x", True)):
        monkeypatch.setenv(name, value)
        _tune.forget()
        assert (_tune.calibration_key() == base) == same, name
        monkeypatch.delenv(name)
    _tune.forget()
    assert _tune.calibration_key() == base


# ---------------------------------------------------------------------------
# The chunked kernel's (chunk, row block) pair
# ---------------------------------------------------------------------------
def _with_pair(pair, *, quick=False):
    cal = fake([(None, "chunked")], quick=quick)
    cal["entries"]["additive/float32"]["chunk"] = list(pair)
    return cal


def _qkv(d=64, n=200, dtype=np.float32):
    rng = np.random.default_rng(3)
    return [rng.standard_normal((2, n, d)).astype(dtype) for _ in range(3)]


def _chunked_with(monkeypatch, q, k, v, pair):
    import linattn_nb as la

    with monkeypatch.context() as m:
        m.setattr(config, "CPU_CHUNK_SIZE", pair[0])
        m.setattr(config, "CPU_CHUNK_BLOCK", pair[1])
        return la.linear_attention(q, k, v, causal=True, method="chunked")


def test_auto_runs_the_calibrated_chunk_pair(folder, monkeypatch):
    """An entry's "chunk" is the pair method="auto" runs; an explicit method="chunked" keeps the table's."""
    import linattn_nb as la

    monkeypatch.setattr(config, "AUTO_TUNE", "load")
    q, k, v = _qkv()
    table = la.linear_attention(q, k, v, causal=True, method="chunked")
    _tune.save(_with_pair([5, 5]))
    _tune.forget()  # read from the file
    auto = la.linear_attention(q, k, v, causal=True)
    assert np.array_equal(auto, _chunked_with(monkeypatch, q, k, v, (5, 5)))
    assert not np.array_equal(auto, table)  # the pair changes the float32 rounding: the test can tell
    assert np.array_equal(la.linear_attention(q, k, v, causal=True, method="chunked"), table)
    # the torch-free gradient entry point runs its forward with the pair too, and stays right
    g = np.random.default_rng(4).standard_normal(v.shape).astype(np.float32)
    grads = la.linear_attention_vjp(q, k, v, g, causal=True)
    monkeypatch.setattr(config, "AUTO_TUNE", "off")
    want = la.linear_attention_vjp(q, k, v, g, causal=True)
    for a, b in zip(grads, want):
        if b is not None:
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("case", ["off", "quick", "knob", "small heads", "float64", "other rule"])
def test_calibrated_pair_is_not_used(folder, monkeypatch, case):
    """The table's pair where tuning is off, for a smoke test, under a chunk knob, for heads in another row
    of CPU_CHUNK_TABLE than the calibration's D = M, and for an entry without a pair."""
    import linattn_nb as la

    monkeypatch.setattr(config, "AUTO_TUNE", "off" if case == "off" else "load")
    d = 8 if case == "small heads" else 64
    q, k, v = _qkv(d, dtype=np.float64 if case == "float64" else np.float32)
    kw = {}
    if case == "other rule":
        kw["log_decay"] = np.full(q.shape[:2], -0.01)
    table = la.linear_attention(q, k, v, causal=True, method="chunked", **kw)
    if case == "knob":
        monkeypatch.setattr(config, "CPU_CHUNK_SIZE", 7)
        table = la.linear_attention(q, k, v, causal=True, method="chunked", **kw)
    cal = _with_pair([5, 5], quick=case == "quick")
    cal["entries"]["additive/float64"] = dict(cal["entries"]["additive/float32"])
    del cal["entries"]["additive/float64"]["chunk"]
    _tune.use(cal)
    assert np.array_equal(la.linear_attention(q, k, v, causal=True, **kw), table)


def test_calibrate_times_the_pairs(folder, monkeypatch):
    """A (quick) calibration stores the pair chosen from the timed ones, and no pair under a chunk knob;
    the pair timed last does not stay behind on the thread."""
    for margin in (2.0, 0.01):  # any other pair within 2x of the table's is taken; none is 100x faster
        monkeypatch.setattr(_tune, "CHUNK_MARGIN", margin)
        cal = _tune.calibrate(["additive"], ["float32"], quick=True)
        e = cal["entries"]["additive/float32"]
        ms = {tuple(x[:2]): x[2] for x in e["chunk_ms"]}
        c0 = config.cpu_chunk_size(32, 16, 16, np.float32)
        table = (c0, config.cpu_chunk_block(c0, 16, 16, np.float32))
        assert list(ms)[0] == table and len(ms) > 1 and all(c <= _tune.QUICK["chunk_n"] for c, _ in ms)
        best = min(ms, key=ms.get)
        assert tuple(e["chunk"]) == (best if ms[best] < margin * ms[table] else table)
        assert margin < 1 or tuple(e["chunk"]) == best
        assert margin > 1 or tuple(e["chunk"]) == table
    _valid_and_no_pair_under_a_knob(monkeypatch, cal, _tune.chunk_choice, "CPU_CHUNK_BLOCK", 4, "chunk")


def _valid_and_no_pair_under_a_knob(monkeypatch, cal, choice, knob, value, field):
    """``cal`` is valid, the trial pair did not stay on the thread, and with ``knob`` set a calibration times no
    ``field`` pair."""
    assert _tune._invalid(cal, _tune.calibration_key()) is None
    assert choice("additive", np.float32, 64, 64, auto=False) is None
    monkeypatch.setattr(config, knob, value)
    cal = _tune.calibrate(["additive"], ["float32"], quick=True)
    assert field not in cal["entries"]["additive/float32"]
    assert f"{field}_ms" not in cal["entries"]["additive/float32"]


@pytest.mark.parametrize("field", ["chunk", "grad_chunk"])
@pytest.mark.parametrize("pair", [[8, 16], [0, 1], [8], "8,8", [8.0, 8], [True, 1]])
def test_bad_chunk_pair_is_no_calibration(folder, pair, field):
    """The forward's pair and the backward's: each field and its timings checked."""
    cal = _with_pair([8, 8])
    cal["entries"]["additive/float32"][field] = pair
    assert f"'{field}'" in _tune._invalid(cal, _tune.calibration_key())
    cal = _with_pair([8, 8])
    cal["entries"]["additive/float32"][f"{field}_ms"] = [pair + [1.0] if isinstance(pair, list) else pair]
    assert f"'{field}_ms'" in _tune._invalid(cal, _tune.calibration_key())


def test_tune_show_prints_the_pair(folder, capsys):
    cal = _with_pair([48, 48])
    cal["entries"]["additive/float32"]["chunk_ms"] = [[32, 8, 13.6], [48, 48, 9.4]]
    _tune.save(cal)
    assert cli.main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert "(32, 8) 13.600, (48, 48) 9.400" in out and "chunks of 48 in row blocks of 48" in out
    # and `linattn info`'s line names the pair auto runs
    assert _tune.status_line().endswith("additive/float32 1 (chunks of 48, row blocks of 48)")


# ---------------------------------------------------------------------------
# The fused normalised backward's (chunk, row block) pair
# ---------------------------------------------------------------------------
def _with_grad_pair(pair, *, quick=False, rule="additive"):
    cal = fake([(None, "chunked")], quick=quick)
    e = cal["entries"].pop("additive/float32")
    e["grad_chunk"] = list(pair)
    cal["entries"][f"{rule}/float32"] = e
    return cal


def _vjp_with(monkeypatch, args, pair, **kw):
    import linattn_nb as la

    with monkeypatch.context() as m:
        m.setattr(config, "BACKWARD_NORM_CHUNK", pair[0])
        m.setattr(config, "BACKWARD_NORM_BLOCK", pair[1])
        return la.linear_attention_vjp(*args, causal=True, method="chunked", **kw)


def _grads_equal(a, b) -> bool:
    return all((x is None and y is None) or np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("rule", ["additive", "decay"])
def test_auto_vjp_runs_the_calibrated_grad_pair(folder, monkeypatch, rule):
    """An entry's "grad_chunk" is the pair the gradient of method="auto" runs in the fused normalised backward;
    an explicit method="chunked" keeps config's."""
    import linattn_nb as la

    monkeypatch.setattr(config, "AUTO_TUNE", "load")
    q, k, v = _qkv()
    g = np.random.default_rng(4).standard_normal(v.shape).astype(np.float32)
    kw = {"log_decay": np.full(q.shape[:2], -0.05, np.float32)} if rule == "decay" else {}
    table = la.linear_attention_vjp(q, k, v, g, causal=True, method="chunked", **kw)
    _tune.save(_with_grad_pair([5, 3], rule=rule))
    _tune.forget()  # read from the file
    auto = la.linear_attention_vjp(q, k, v, g, causal=True, **kw)
    assert _grads_equal(auto, _vjp_with(monkeypatch, (q, k, v, g), (5, 3), **kw))
    assert not _grads_equal(auto, table)  # the pair changes the float32 rounding: the test can tell
    assert _grads_equal(la.linear_attention_vjp(q, k, v, g, causal=True, method="chunked", **kw), table)
    for a, b in zip(auto, table):
        if b is not None:
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("case", ["off", "quick", "knob", "small heads", "other rule"])
def test_calibrated_grad_pair_is_not_used(folder, monkeypatch, case):
    """config's pair where tuning is off, for a smoke test, under a backward knob, for heads in another row of
    CPU_CHUNK_TABLE than the calibration's D = M, and for an entry of another rule."""
    import linattn_nb as la

    monkeypatch.setattr(config, "AUTO_TUNE", "off" if case == "off" else "load")
    q, k, v = _qkv(8 if case == "small heads" else 64)
    g = np.random.default_rng(4).standard_normal(v.shape).astype(np.float32)
    if case == "knob":
        monkeypatch.setattr(config, "BACKWARD_NORM_BLOCK", 4)
    table = la.linear_attention_vjp(q, k, v, g, causal=True, method="chunked")
    _tune.use(_with_grad_pair([5, 3], quick=case == "quick", rule="decay" if case == "other rule" else "additive"))
    # the constants choose the chunked method too, where the calibration's rows are not used
    rows = {**config.AUTO_METHODS, ("additive", True, "cpu"): ((None, "chunked"),)}
    monkeypatch.setattr(config, "AUTO_METHODS", rows)
    assert select_auto(n=q.shape[1], dtype=np.float32, **KW) == "chunked"
    assert _grads_equal(la.linear_attention_vjp(q, k, v, g, causal=True), table)


def test_calibrate_times_the_grad_pairs(folder, monkeypatch):
    """A (quick) calibration stores the backward's pair for the additive and decay rules and not for the gate
    rule (no row blocks), nor under a backward knob; the pair timed last does not stay behind on the thread."""
    monkeypatch.setattr(_tune, "CHUNK_MARGIN", 2.0)  # any pair within 2x of config's is taken
    cal = _tune.calibrate(["additive", "gate"], ["float32"], quick=True)
    e = cal["entries"]["additive/float32"]
    ms = {tuple(x[:2]): x[2] for x in e["grad_chunk_ms"]}
    c0 = config.cpu_backward_norm_chunk(32, 16, 17, np.float32)
    table = (c0, config.cpu_backward_norm_block(c0, 16, 17, np.float32))
    assert list(ms)[0] == table and len(ms) > 1 and all(c <= _tune.QUICK["chunk_n"] for c, _ in ms)
    assert tuple(e["grad_chunk"]) == min(ms, key=ms.get)
    assert "grad_chunk" not in cal["entries"]["gate/float32"]
    _valid_and_no_pair_under_a_knob(monkeypatch, cal, _tune.grad_choice, "BACKWARD_NORM_CHUNK", 16, "grad_chunk")


def test_tune_show_prints_the_grad_pair(folder, capsys):
    cal = _with_pair([48, 48])
    cal["entries"]["additive/float32"].update(grad_chunk=[48, 16], grad_chunk_ms=[[48, 8, 20.5], [48, 16, 17.25]])
    _tune.save(cal)
    assert cli.main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert "config's first: (48, 8) 20.500, (48, 16) 17.250" in out
    assert "its gradient's chunks of 48 in row blocks of 16" in out
    assert _tune.status_line().endswith(
        "additive/float32 1 (chunks of 48, row blocks of 48; gradient: chunks of 48, row blocks of 16)")


def test_overlapping_calibrations_leave_first_use_working(folder):
    """Two calibrations from two threads, the first ending while the second runs: the second restored the
    busy flag it had saved (set), so first-use timing stayed off for the rest of the process."""
    import threading

    first_in, second_in, first_done = threading.Event(), threading.Event(), threading.Event()

    def first():
        _tune.calibrate(["additive"], ["float32"], quick=True,
                        progress=lambda r, d: (first_in.set(), second_in.wait(60)))
        first_done.set()

    def second():
        first_in.wait(60)
        _tune.calibrate(["additive"], ["float32"], quick=True,
                        progress=lambda r, d: (second_in.set(), first_done.wait(60)))

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert first_done.is_set()
    assert not _tune._busy  # method="auto" under AUTO_TUNE="first-use" times missing entries again


# ---------------------------------------------------------------------------
# Pairs timed for the heads of the other rows of CPU_CHUNK_TABLE
# ---------------------------------------------------------------------------
def _with_heads(heads, *, own=(7, 7), own_grad=(7, 4), rule="additive"):
    cal = _with_grad_pair(own_grad, rule=rule)
    e = cal["entries"][f"{rule}/float32"]
    e["chunk"] = list(own)
    e["heads"] = heads
    return cal


def test_head_dims_cover_every_other_row_of_the_table():
    for dtype in (np.float32, np.float64):
        name = np.dtype(dtype).name
        rows = config.CPU_CHUNK_TABLE[name]
        for dim in (16, 32, 64):
            dims = _tune.head_dims(dtype, dim)
            got = [config.chunk_table_row(d, d, name) for d in dims]
            own = config.chunk_table_row(dim, dim, name)
            assert sorted(got + [own], key=rows.index) == list(rows), (name, dim, dims)


@pytest.mark.parametrize("d, want", [(32, "head"), (64, "own"), (8, "table")])
def test_auto_runs_the_pair_timed_for_its_heads(folder, monkeypatch, d, want):
    """Heads in the table row of a "heads" item run its pairs, forward and gradient; heads in the calibration's own
    row the entry's pairs; heads of a row timed by neither, config's.  An explicit method="chunked" keeps config's."""
    import linattn_nb as la

    monkeypatch.setattr(config, "AUTO_TUNE", "load")
    _tune.save(_with_heads([{"dim": 32, "chunk": [5, 5], "grad_chunk": [5, 3]}]))
    _tune.forget()  # read from the file
    q, k, v = _qkv(d)
    g = np.random.default_rng(4).standard_normal(v.shape).astype(np.float32)
    fwd = {"head": (5, 5), "own": (7, 7), "table": None}[want]
    bwd = {"head": (5, 3), "own": (7, 4), "table": None}[want]
    auto = la.linear_attention(q, k, v, causal=True)
    table = la.linear_attention(q, k, v, causal=True, method="chunked")
    assert np.array_equal(auto, table if fwd is None else _chunked_with(monkeypatch, q, k, v, fwd))
    if fwd is not None:
        assert not np.array_equal(auto, table)  # the pair changes the float32 rounding: the test can tell
    grads = la.linear_attention_vjp(q, k, v, g, causal=True)
    gtable = la.linear_attention_vjp(q, k, v, g, causal=True, method="chunked")
    assert _grads_equal(grads, gtable if bwd is None else _vjp_with(monkeypatch, (q, k, v, g), bwd))
    if bwd is not None:
        assert not _grads_equal(grads, gtable)


@pytest.mark.parametrize("heads, says", [
    ({"dim": 32}, "'heads' is not a list"),
    ([[32, 5, 5]], "'heads' item 0 is not an object"),
    ([{"dim": 16}, {"dim": "32", "chunk": [5, 5]}], "'heads' item 1: 'dim' must be a positive integer, got '32'"),
    ([{"dim": 0, "chunk": [5, 5]}], "'heads' item 0: 'dim' must be a positive integer, got 0"),
    ([{"chunk": [5, 5]}], "'heads' item 0: 'dim' must be a positive integer, got None"),
    ([{"dim": 32, "chunk": [5, 6]}], "heads of D = 32: 'chunk' is not"),
    ([{"dim": 32, "grad_chunk_ms": [[5, 5]]}], "heads of D = 32: 'grad_chunk_ms' is not"),
])
def test_bad_heads_are_no_calibration(folder, heads, says):
    assert says in _tune._invalid(_with_heads(heads), _tune.calibration_key())


def test_calibrate_times_the_pairs_of_other_heads(folder, monkeypatch):
    """A (quick) calibration times both pairs again at each D of head_dims and stores them as "heads"; under
    the knobs it times none of them."""
    monkeypatch.setattr(_tune, "CHUNK_MARGIN", 2.0)  # any pair within 2x of config's is taken
    cal = _tune.calibrate(["additive"], ["float32"], quick=True)
    assert _tune._invalid(cal, _tune.calibration_key()) is None
    heads = cal["entries"]["additive/float32"]["heads"]
    assert [h["dim"] for h in heads] == _tune.head_dims(np.float32, _tune.QUICK["dim"])
    for h in heads:
        d = h["dim"]
        ms = {tuple(x[:2]): x[2] for x in h["chunk_ms"]}
        c0 = config.cpu_chunk_size(32, d, d, np.float32)
        assert list(ms)[0] == (c0, config.cpu_chunk_block(c0, d, d, np.float32)) and len(ms) > 1
        assert tuple(h["chunk"]) == min(ms, key=ms.get)
        gms = {tuple(x[:2]): x[2] for x in h["grad_chunk_ms"]}
        assert tuple(h["grad_chunk"]) == min(gms, key=gms.get)
    monkeypatch.setattr(config, "CPU_CHUNK_SIZE", 16)
    monkeypatch.setattr(config, "BACKWARD_NORM_CHUNK", 16)
    cal = _tune.calibrate(["additive"], ["float32"], quick=True)
    assert "heads" not in cal["entries"]["additive/float32"]


def test_tune_show_prints_the_heads_pairs(folder, capsys):
    _tune.save(_with_heads([{"dim": 32, "chunk": [48, 48], "chunk_ms": [[24, 8, 3.5], [48, 48, 2.75]],
                             "grad_chunk": [64, 64]}]))
    assert cli.main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert "at N = 1024, D = M = 32, the table's first: (24, 8) 3.500, (48, 48) 2.750" in out
    assert ("heads in the table row of D = M = 32: chunks of 48 in row blocks of 48, its gradient's chunks of 64 "
            "in row blocks of 64") in out
    assert _tune.status_line().endswith(
        "additive/float32 1 (chunks of 7, row blocks of 7; gradient: chunks of 7, row blocks of 4; D = 32: chunks of "
        "48, row blocks of 48, gradient: chunks of 64, row blocks of 64)")


def test_heads_items_no_call_reaches_are_neither_run_nor_shown(folder, monkeypatch, capsys):
    """An item in the calibration's own row (D = 40 with D = 64 in float32) and a second item of one row (a hand-edited
    file, or a table changed since): calls run the entry's pair and the first item's, and info and --show list only
    those (they listed all three as the pairs auto runs)."""
    import linattn_nb as la

    monkeypatch.setattr(config, "AUTO_TUNE", "load")
    assert config.chunk_table_row(40, 40, "float32") == config.chunk_table_row(64, 64, "float32")
    _tune.save(_with_heads([{"dim": 40, "chunk": [9, 9]}, {"dim": 16, "chunk": [5, 5]}, {"dim": 16, "chunk": [6, 6]}]))
    _tune.forget()
    for d, pair in ((40, (7, 7)), (16, (5, 5))):
        q, k, v = _qkv(d)
        assert np.array_equal(la.linear_attention(q, k, v, causal=True), _chunked_with(monkeypatch, q, k, v, pair))
    line = _tune.status_line()
    assert "D = 16: chunks of 5, row blocks of 5)" in line and "D = 40" not in line and "chunks of 6" not in line
    assert cli.main(["tune", "--show"]) == 0
    picks = capsys.readouterr().out.split("method='auto' (causal, CPU) on this machine:")[1]
    assert "D = M = 16: chunks of 5 in row blocks of 5" in picks
    assert "D = M = 40" not in picks and "chunks of 6" not in picks and "chunks of 9" not in picks
