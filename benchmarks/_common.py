"""Shared helpers of the benchmark scripts: timing, machine description, JSON output."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))


def _bounded(kind, low: float, inclusive: bool, what: str):
    """An ``argparse`` ``type=``: ``kind(text)`` (``int`` or ``float``, finite) at or above ``low``
    (``inclusive``) or above it; anything else is refused by argparse (exit 2, naming the option)."""

    def convert(text: str):
        import argparse
        import math

        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not (math.isfinite(value) and (value >= low if inclusive else value > low)):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    convert.__name__ = what.replace(" ", "_").replace("-", "_")
    return convert


#: ``argparse`` ``type=``s: a count or a size (>= 1); an option where 0 means something, e.g. a default
#: (>= 0); a time budget (> 0); a pause (>= 0).
positive_int = _bounded(int, 1, True, "a positive integer")
nonnegative_int = _bounded(int, 0, True, "a non-negative integer")
positive_float = _bounded(float, 0.0, False, "a positive number")
nonnegative_float = _bounded(float, 0.0, True, "a non-negative number")


def positive_int_list(text: str) -> list:
    """An ``argparse`` ``type=``: comma-separated integers >= 1 (e.g. ``--ns 512,4096``)."""
    import argparse

    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [positive_int(p) for p in parts]


def partial_run_note(what: str, name: str) -> None:
    """Print the one line a partial run without ``--out`` prints instead of overwriting
    ``benchmarks/results/<name>.json`` (``what``: the options that make it partial)."""
    print(f"not written: {what} is a partial run and does not replace benchmarks/results/{name}.json; "
          f"pass --out FILE to keep its results", flush=True)


def median_time(fn, *, repeats=5, budget_s=3.0, min_repeats=3, warmup=True, clock=time.perf_counter):
    """Median time of ``fn()`` over ``repeats`` calls (fewer, but at least
    ``min_repeats``, when the calls exceed ``budget_s`` seconds of wall time).
    The first call (compilation, page faults) is not timed when ``warmup``.
    ``clock``: wall time by default; ``time.process_time`` for CPU seconds."""
    if warmup:
        fn()
    times = []
    t0 = time.perf_counter()
    while True:
        t = clock()
        fn()
        times.append(clock() - t)
        spent = time.perf_counter() - t0
        if len(times) >= repeats or (len(times) >= min_repeats and spent > budget_s):
            break
    return statistics.median(times), times


def sgemm_gflops(n=2048, repeats=5):
    """This machine's float32 GEMM rate (np.dot of two n x n matrices), GFLOP/s, median."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    t, _ = median_time(lambda: np.dot(a, b), repeats=repeats, budget_s=10.0)
    return 2.0 * n**3 / t / 1e9


def machine_line() -> str:
    """One line naming the machine: CPU, Numba threads, the BLAS libraries (kernels, version,
    threads) and environment overrides of the BLAS kernels (``linattn_nb._tune.machine_line``,
    the line ``linattn info`` and ``linattn tune`` print), plus the load average."""
    from linattn_nb._tune import machine_line as line

    try:
        load = f"; load average {os.getloadavg()[0]:.2f}"
    except (OSError, AttributeError):
        load = ""
    return line() + load


def print_machine(prefix: str = "") -> str:
    """Print :func:`machine_line` (after ``prefix``, e.g. ``"# "``) and return it: every benchmark's header."""
    line = machine_line()
    print(f"{prefix}machine: {line}", flush=True)
    return line


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import numba
    import scipy

    info = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "numba_threads": numba.get_num_threads(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "numba": numba.__version__,
        "platform": platform.platform(),
    }
    try:
        info["load_avg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    from linattn_nb import _tune

    info["blas"] = [{k: lib.get(k) for k in ("internal_api", "architecture", "version", "num_threads", "filepath")}
                    for lib in _tune.blas_libraries()]
    info["blas_env"] = _tune.blas_env()
    info["machine_line"] = _tune.machine_line()
    return info


def cpu_model() -> str:
    """The CPU model as ``lscpu`` reports it (with /proc/cpuinfo as the fallback)."""
    try:
        proc = subprocess.run(["lscpu"], capture_output=True, text=True, check=True)
        for line in proc.stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return machine()["cpu"]


def interleaved_medians(cases, rounds, inner=1, clock="wall"):
    """Time the callables of ``cases`` (name -> function) side by side.

    Every case is called twice untimed (compilation, warm-up); then each of
    ``rounds`` rounds times every case once, as the median of ``inner`` calls
    back to back, so that a change of load on a shared machine falls on all
    cases alike.  ``clock="cpu"`` times the process's CPU seconds (every thread's,
    :func:`time.process_time`) instead of wall time: on a shared machine time spent
    preempted does not count, so ratios are steadier; with more than one thread it
    also counts threads that spin while they wait.

    Returns
    -------
    med : dict
        name -> median over the rounds, seconds.
    times : dict
        name -> the per-round times, seconds.
    """
    for fn in cases.values():
        fn()
        fn()
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    now = time.process_time if clock == "cpu" else time.perf_counter
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            calls = []
            for _ in range(inner):
                t = now()
                fn()
                calls.append(now() - t)
            times[name].append(statistics.median(calls))
    return {name: statistics.median(ts) for name, ts in times.items()}, times


def rel_error(out, ref) -> float:
    """Relative Frobenius error of ``out`` against ``ref`` (``out`` taken to float64)."""
    return float(np.linalg.norm((out.astype(np.float64) - ref).ravel()) / np.linalg.norm(ref.ravel()))


def scan_accuracy(run, q, k, v, **columns):
    """Rows of the float32 chunked and scan outputs' and the float64 chunked
    output's errors against the float64 scan of the same float32 inputs.

    ``run(q, k, v, method)`` computes one output; ``columns`` are put in every
    row after the method (e.g. ``N=``)."""
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    ref = run(q64, k64, v64, "scan")
    rows = []
    for label, inputs, method in (("chunked", (q, k, v), "chunked"), ("scan", (q, k, v), "scan"),
                                  ("float64 chunked", (q64, k64, v64), "chunked")):
        o = run(*inputs, method)
        rows.append({"float32 method": label, **columns, "rel. error vs float64 scan": rel_error(o, ref),
                     "nonfinite": int((~np.isfinite(o)).sum())})
    return rows


def rule_bench_args(doc, name, argv=None):
    """The command line of the per-rule CPU benchmarks (speed in interleaved
    rounds, accuracy at a long sequence); results go to ``--out`` or, for a full run
    (no ``--quick``, no ``--no-accuracy``), to ``results/<name>.json``."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 rounds, accuracy at N = 2**16")
    ap.add_argument("--bh", type=positive_int, default=16)
    ap.add_argument("--n", type=positive_int, default=4096)
    ap.add_argument("--d", type=positive_int, default=64)
    ap.add_argument("--rounds", type=positive_int, default=None, help="interleaved rounds (default 9; --quick 5)")
    ap.add_argument("--inner", type=positive_int, default=3, help="calls per measurement (their median counts)")
    ap.add_argument("--acc-n", type=positive_int, default=None,
                    help="accuracy sequence length (default 2**20; --quick 2**16)")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--out", default=None, help=f"JSON path (default benchmarks/results/{name}.json)")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 5 if args.quick else 9
    if args.acc_n is None:
        args.acc_n = 2**16 if args.quick else 2**20
    return args


def run_rule_bench(name, args, speed, accuracy, *, setting, columns, accuracy_setting):
    """Run and report a per-rule CPU benchmark (the arguments of :func:`rule_bench_args`).

    ``speed(args)`` returns the table rows (``case`` and ``columns``, printed with two
    decimals), the targets (description -> met) and every round's times in ms;
    ``accuracy(args)`` the rows of :func:`scan_accuracy`.  ``setting`` and
    ``accuracy_setting`` describe the two measurements in the printed headers.
    Everything goes to ``args.out``, or by default to ``results/<name>.json`` when the run is
    a full one (a ``--quick`` or ``--no-accuracy`` run without ``--out`` writes nothing)."""
    import numba

    print(f"CPU: {cpu_model()}, {numba.get_num_threads()} Numba threads")
    print_machine()
    print(f"speed: {setting}; medians of {args.rounds} interleaved rounds ({args.inner} calls each)")
    rows, targets, all_ms = speed(args)
    print(table(rows, ["case", *columns], {c: "{:.2f}" for c in columns}))
    for what, ok in targets.items():
        print(f"  {'met' if ok else 'NOT met'}: {what}")
    acc = []
    if not args.no_accuracy:
        acc = accuracy(args)
        print(f"accuracy: {accuracy_setting}")
        print(table(acc, ["float32 method", "N", "rel. error vs float64 scan", "nonfinite"],
                    {"rel. error vs float64 scan": "{:.2e}"}))
    partial = [o for o, on in (("--quick", args.quick), ("--no-accuracy", args.no_accuracy)) if on]
    if args.out is None and partial:
        partial_run_note(" ".join(partial), name)
        return
    path = write_json(name, {"machine": machine(), "cpu_model": cpu_model(), "args": vars(args),
                             "speed": rows, "targets": targets, "speed_ms_all": all_ms, "accuracy": acc},
                      args.out)
    print(f"wrote {path}")


def write_json(name: str, payload: dict, path=None) -> Path:
    out = Path(path) if path else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, default=float))
    return out


def table(rows, columns, fmt=None) -> str:
    """Plain-text table (also valid Markdown)."""
    fmt = fmt or {}
    cells = [[(fmt.get(c, "{}").format(r.get(c)) if r.get(c) is not None else "-") for c in columns]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    line = "| " + " | ".join(c.rjust(w) for c, w in zip(columns, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(v.rjust(w) for v, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join([line, sep, *body])
