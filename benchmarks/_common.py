"""Shared helpers of the benchmark scripts: timing, machine description, JSON output."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))


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
    return info


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
