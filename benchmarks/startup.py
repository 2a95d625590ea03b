"""Start-up time: a fresh interpreter that imports linattn_nb and runs one causal call.

Run::

    python benchmarks/startup.py            # 5 warm runs + 1 cold run

Warm: the on-disk Numba cache is already filled (one untimed run first).
Cold: ``NUMBA_CACHE_DIR`` points at an empty temporary folder, so every kernel
the call needs is compiled.  The child runs
``linear_attention(q, k, v, causal=True)`` at shape (1, 1, 128, 64) float32.
Reported: median wall time of the whole ``python -c`` (target warm <= 2 s)
and the cold time.  Results: benchmarks/results/startup.json (or ``--out FILE``).
``--repeats`` must be a positive integer.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _common import ROOT, machine, positive_int, print_machine, table, write_json

CHILD = (
    "import sys; sys.path.insert(0, {root!r}); import numpy as np, linattn_nb; "
    "q, k, v = np.random.default_rng(0).standard_normal((3, 1, 1, 128, 64)).astype(np.float32); "
    "o = linattn_nb.linear_attention(q, k, v, causal=True); assert np.isfinite(o).all()"
)


def run_once(env=None):
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT))], env=env,
                          capture_output=True, text=True)
    dt = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return dt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=positive_int, default=5, help="warm runs (default 5)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/startup.json)")
    args = ap.parse_args(argv)
    info = machine()
    run_once()  # fill the cache
    warm = [run_once() for _ in range(args.repeats)]
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, NUMBA_CACHE_DIR=tmp)
        cold = run_once(env)
    base = [0.0]
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    base[0] = time.perf_counter() - t
    rows = [
        {"case": "python -c pass", "wall_s": base[0]},
        {"case": f"warm cache (median of {len(warm)})", "wall_s": statistics.median(warm)},
        {"case": "cold (empty NUMBA_CACHE_DIR)", "wall_s": cold},
    ]
    print_machine("# ")
    print(f"# start-up, import + one causal call at (1, 1, 128, 64) float32 -- {info['date']}, {info['cpu']}")
    print(table(rows, ["case", "wall_s"], {"wall_s": "{:.2f}"}))
    print("target: warm <= 2 s")
    path = write_json("startup", {"machine": info, "warm_s": warm, "cold_s": cold, "python_s": base[0]}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
