"""Fitting Hedgehog to softmax attention on the CPU: time of 200 L-BFGS iterations, memory at N = 16,384.

Run::

    python benchmarks/fit_cpu.py              # 3 rounds per precision, memory at N = 16,384
    python benchmarks/fit_cpu.py --quick      # 1 round of 20 iterations, memory at N = 4096
    python benchmarks/fit_cpu.py --rounds 5 --skip-memory --cases float32

Only a full run (no ``--quick``, ``--skip-memory`` or ``--cases`` subset) writes
benchmarks/results/fit_cpu.json by default; a partial run writes only to ``--out FILE``.

Speed: ``feature_maps.fit("hedgehog", q, k, steps=200,
tol=0)`` (``tol=0``: no early stop, all 200 iterations run unless the line
search fails; the table says how many ran) on one sequence, q, k ~ N(0, I),
N = 4096, d = 64 (D_phi = 128), scale 1/sqrt(d), cross-entropy, in float32
and float64 inputs (the fit's working precision follows them), without and
with a validation set of the same size (its loss is evaluated after every
step).  The rounds of the cases are interleaved, so that a change of load
falls on all of them alike; the table gives the median and the range.
Target: <= 60 s on 2 cores (AMD EPYC).

Memory: one loss-and-gradient evaluation (float64) at N = 16,384, d = 64 in
a fresh subprocess: the peak of NumPy's allocations (``tracemalloc``) and the
rise of the peak resident set (``ru_maxrss``), against the 2 GiB that the
N x N float64 matrix alone would take (target: the fit fits in 2 GiB).

Every run prints the CPU model, the load average before and after, and the
float32 GEMM rate before and after (a busy machine shows in both).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from _common import (cpu_model, machine, partial_run_note, positive_int, print_machine, sgemm_gflops, table,
                     write_json)

MEMORY_CODE = r"""
import json, resource, sys, tracemalloc
import numpy as np
from linattn_nb.fitting import objective
n, d = int(sys.argv[1]), int(sys.argv[2])
objective("hedgehog", *np.random.default_rng(1).normal(size=(2, 8, d)))  # compile outside the measurement
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tracemalloc.start()
q, k = np.random.default_rng(0).normal(size=(2, n, d))
value, grads = objective("hedgehog", q, k)
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"loss": value, "tracemalloc_peak_bytes": peak, "rss_rise_bytes": (rss1 - rss0) * 1024,
                  "peak_rss_bytes": rss1 * 1024}))
"""


def run_fit(q, k, steps, validation):
    from linattn_nb import feature_maps

    t = time.perf_counter()
    _, hist = feature_maps.fit("hedgehog", q, k, steps=steps, tol=0.0, validation=validation, progress=False)
    return time.perf_counter() - t, hist


def memory(n, d):
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.path.dirname(here) + os.pathsep + env.get("PYTHONPATH", "")
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", MEMORY_CODE, str(n), str(d)], capture_output=True, text=True,
                         env=env, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["seconds"] = time.perf_counter() - t
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round of 20 iterations, memory at N = 4096")
    p.add_argument("--rounds", type=positive_int, default=None, help="interleaved rounds (default 3; --quick 1)")
    p.add_argument("--steps", type=positive_int, default=None, help="L-BFGS iterations (default 200; --quick 20)")
    p.add_argument("--n", type=positive_int, default=4096)
    p.add_argument("--dim", type=positive_int, default=64)
    p.add_argument("--memory-n", type=positive_int, default=None,
                   help="N of the memory check (default 16384; --quick 4096)")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--cases", default=None,
                   help="comma-separated subset of: float32, float32+validation, float64, float64+validation")
    p.add_argument("--out", default=None, help="JSON results file (default benchmarks/results/fit_cpu.json)")
    args = p.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    steps = args.steps if args.steps is not None else (20 if args.quick else 200)
    mem_n = args.memory_n if args.memory_n is not None else (4096 if args.quick else 16384)

    info = machine()
    print_machine()
    print(f"CPU: {cpu_model()}  ({info['logical_cpus']} logical CPUs, numba threads {info['numba_threads']})")
    load0 = os.getloadavg()[0]
    gemm0 = sgemm_gflops()
    print(f"load average (1 min) {load0:.2f}; sgemm {gemm0:.0f} GFLOP/s")

    rng = np.random.default_rng(0)
    q, k, qv, kv = rng.normal(size=(4, args.n, args.dim))
    cases = {}
    for dt in (np.float32, np.float64):
        name = np.dtype(dt).name
        cases[name] = (q.astype(dt), k.astype(dt), None)
        cases[name + " + validation"] = (q.astype(dt), k.astype(dt), (qv.astype(dt), kv.astype(dt)))
    if args.cases:
        wanted = {c.strip().replace("+", " + ") for c in args.cases.split(",")}
        unknown = wanted - set(cases)
        if unknown:
            p.error(f"--cases: unknown {sorted(unknown)}; choose from {sorted(cases)}")
        cases = {name: case for name, case in cases.items() if name in wanted}
    from linattn_nb import feature_maps

    feature_maps.fit("hedgehog", q[:64].astype(np.float32), k[:64].astype(np.float32), steps=2, progress=False)
    feature_maps.fit("hedgehog", q[:64], k[:64], steps=2, progress=False)  # compile both precisions
    times = {name: [] for name in cases}
    hists = {}
    for r in range(rounds):
        for name, (qq, kk, val) in cases.items():
            sec, hist = run_fit(qq, kk, steps, val)
            times[name].append(sec)
            hists[name] = hist
            print(f"  round {r + 1}/{rounds} {name}: {sec:.1f} s, {len(hist.step) - 1} iterations, "
                  f"{hist.evaluations} evaluations, loss {hist.train_loss[0]:.4f} -> {hist.train_loss[-1]:.4f}",
                  flush=True)
    load1 = os.getloadavg()[0]
    gemm1 = sgemm_gflops()
    rows = []
    for name, ts in times.items():
        h = hists[name]
        its = len(h.step) - 1
        med = statistics.median(ts)
        rows.append({"case": name, "median_s": med, "min_s": min(ts), "max_s": max(ts), "iterations": its,
                     "evaluations": h.evaluations, "s_per_iteration": med / max(its, 1),
                     "loss_start": float(h.train_loss[0]), "loss_end": float(h.train_loss[-1]),
                     "message": h.message})
    print()
    print(f"Hedgehog fit, N = {args.n}, d = {args.dim}, {steps} L-BFGS iterations (tol=0), {rounds} rounds")
    print(table(rows, ["case", "median_s", "min_s", "max_s", "iterations", "evaluations", "s_per_iteration",
                       "loss_start", "loss_end"],
                {"median_s": "{:.1f}", "min_s": "{:.1f}", "max_s": "{:.1f}", "s_per_iteration": "{:.3f}",
                 "loss_start": "{:.4f}", "loss_end": "{:.4f}"}))
    best = min((r["median_s"] for r in rows if "validation" not in r["case"]), default=float("nan"))
    target = {"fit_200_lbfgs_s": best, "target_s": 60.0, "met": bool(steps == 200 and best <= 60.0)}
    print(f"target (200 iterations <= 60 s, fastest precision, no validation): {best:.1f} s -> "
          f"{'met' if target['met'] else 'not met' if steps == 200 else 'not measured (steps != 200)'}")
    print(f"load average (1 min) after {load1:.2f}; sgemm after {gemm1:.0f} GFLOP/s")
    mem = None
    if not args.skip_memory:
        mem = memory(mem_n, args.dim)
        nn = mem_n * mem_n * 8
        print(f"memory, one evaluation at N = {mem_n}, d = {args.dim} (float64): NumPy peak "
              f"{mem['tracemalloc_peak_bytes'] / 2**20:.0f} MiB, peak RSS rise {mem['rss_rise_bytes'] / 2**20:.0f} MiB, "
              f"peak RSS {mem['peak_rss_bytes'] / 2**20:.0f} MiB (the N x N float64 matrix: {nn / 2**20:.0f} MiB); "
              f"{mem['seconds']:.1f} s")
    partial = [o for o, on in (("--quick", args.quick), ("--skip-memory", args.skip_memory),
                               ("--cases", len(cases) < 4)) if on]
    if args.out is None and partial:
        partial_run_note(" ".join(partial), "fit_cpu")
        return
    path = write_json("fit_cpu", {"machine": info, "cpu_model": cpu_model(), "args": vars(args),
                                  "load_before": load0, "load_after": load1, "sgemm_before": gemm0,
                                  "sgemm_after": gemm1, "rows": rows, "times": times, "target": target,
                                  "memory": mem}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
