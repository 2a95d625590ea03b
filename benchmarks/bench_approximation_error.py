"""Time linattn_nb.analysis.approximation_error at long N (target: N = 16,384, D = 64 well under a minute).

Usage::

    python benchmarks/bench_approximation_error.py                 # N = 16384, D = 64, favor+ and elu
    python benchmarks/bench_approximation_error.py --n 4096 8192 --maps elu --repeat 3

Prints a table (wall and process CPU seconds, median over ``--repeat``; every
cell first makes one untimed call with the same inputs, which compiles whatever
path that N takes) and writes JSON to ``--json``/``--out`` FILE (default
benchmarks/results/approximation_error.json).  Process CPU time counts every
thread, so it is a fairer figure than wall time on a shared machine.  Sizes and
counts (``--n``, ``--d``, ``--batch``, ``--repeat``) must be positive integers.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numba
import numpy as np

from linattn_nb import feature_maps as fm
from linattn_nb.analysis import approximation_error


def build(name, d):
    if name == "favor+":
        return fm.get("favor+", dim=d, num_features=256, seed=0)
    return name


def main(argv=None):
    from _common import positive_int

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=positive_int, nargs="+", default=[16384])
    ap.add_argument("--d", type=positive_int, default=64)
    ap.add_argument("--batch", type=positive_int, default=1, help="batch * heads")
    ap.add_argument("--maps", nargs="+", default=["favor+", "elu"])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--repeat", type=positive_int, default=1, help="timed calls per cell (their median counts)")
    ap.add_argument("--json", "--out", dest="json", metavar="FILE",
                    default=str(Path(__file__).parent / "results" / "approximation_error.json"),
                    help="JSON path (default benchmarks/results/approximation_error.json)")
    args = ap.parse_args(argv)
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    rng = np.random.default_rng(0)
    rows = []
    from _common import print_machine

    print_machine()
    print(f"numba {numba.__version__}, {numba.config.NUMBA_NUM_THREADS} threads, {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}")
    print(f"{'map':>8} {'causal':>6} {'B':>3} {'N':>6} {'D':>4} {'wall s':>8} {'cpu s':>8}  tv_mean  monotonicity")
    for n in args.n:
        q, k, v = rng.normal(size=(3, args.batch, n, args.d)) * 0.5
        for name in args.maps:
            fmap = build(name, args.d)
            for causal in causals:
                # untimed: compiles the path this N takes (a shorter warm-up may take another one)
                approximation_error(q, k, v, fmap, causal=causal)
                walls, cpus = [], []
                for _ in range(args.repeat):
                    t0, c0 = time.perf_counter(), time.process_time()
                    res = approximation_error(q, k, v, fmap, causal=causal)
                    walls.append(time.perf_counter() - t0)
                    cpus.append(time.process_time() - c0)
                row = dict(map=name, causal=causal, batch=args.batch, n=n, d=args.d,
                           wall_s=statistics.median(walls), cpu_s=statistics.median(cpus), repeat=args.repeat,
                           result=res.to_dict())
                rows.append(row)
                print(f"{name:>8} {str(causal):>6} {args.batch:>3} {n:>6} {args.d:>4} {row['wall_s']:8.2f} "
                      f"{row['cpu_s']:8.2f}  {res.tv_mean:.4f}   {res.monotonicity:.4f}", flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), cpus=os.cpu_count(), threads=numba.config.NUMBA_NUM_THREADS,
                load_avg=os.getloadavg(), numba=numba.__version__, numpy=np.__version__)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
