"""Causal forward on the CPU: every method side by side, against this machine's limits.

Run::

    python benchmarks/causal_cpu.py                 # full table (a few minutes on 2 cores)
    python benchmarks/causal_cpu.py --quick         # N = 512 and 4096 only
    NUMBA_NUM_THREADS=1 python benchmarks/causal_cpu.py --sweep-chunk   # config.CPU_CHUNK_TABLE
    python benchmarks/causal_cpu.py --sweep-auto    # scan vs chunked at small N (config.AUTO_METHODS)
    python benchmarks/causal_cpu.py --check-cost    # check_finite=True vs False, interleaved

Shape: B*H = 16 sequences, D = M = 64, feature map "elu", N from 512 to
65,536, float32 and float64.  In the same run: the sgemm rate of this machine
(np.dot of two 2048 x 2048 float32 matrices) as the ceiling, softmax_attention
(causal, blocked Numba kernel) and torch's scaled_dot_product_attention
(is_causal=True) when torch is importable.

For each cell: the median wall time, the effective rate
4 * B*H * N * D * M / time (GFLOP/s; the useful work of linear attention, the
same formula for every method so that the rates compare times), that rate over
the sgemm rate, and speed-ups of "chunked" over "scan" and over torch SDPA.
Calls go through the public functions with check_finite=False (the same for
every method).

The target ratios (chunked vs sgemm, scan and torch SDPA at N = 4096;
time(65,536) / time(4096)) are then measured once more in interleaved rounds
(``--headline-rounds``, default 9): each call in turn, round after round,
ratios of medians -- on a shared machine the load changes under all of them
alike.  Results: a table on stdout and benchmarks/results/causal_cpu.json (or ``--out FILE``).
A partial run of the table (``--quick``, ``--headline-only``, ``--ns``, ``--dtypes``, a lower
``--*-max-n``) writes only to ``--out FILE``: without it, it says so and leaves the committed
file alone.  ``--sweep-chunk``, ``--sweep-auto`` and ``--check-cost`` write their own files
(``causal_cpu_chunk_sweep.json``, ``causal_cpu_auto_sweep.json``, ``causal_cpu_check_cost.json``
in benchmarks/results/) or ``--out FILE``; ``--sweep-chunk --quick`` only to ``--out FILE``.

``--check-cost`` measures what the default ``check_finite=True`` costs: the
headline call (B*H = 16, N = 4096, D = M = 64, float32, ELU+1, chunked) with
``check_finite=True`` and ``False`` side by side in interleaved rounds
(``--headline-rounds``; the order of the two alternates from round to round),
the ratio of the medians and the median of the per-round ratios, with the CPU
model from ``lscpu``.  ``--check-cost-all`` adds the scan, the non-causal
kernel and softmax_attention (N = 1024) at the same shape.  Results:
benchmarks/results/causal_cpu_check_cost.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from _common import (cpu_model, machine, median_time, nonnegative_float, nonnegative_int, partial_run_note,
                     positive_float, positive_int, positive_int_list, print_machine, sgemm_gflops, table,
                     write_json)

import linattn_nb  # noqa: E402  (path set by _common)
from linattn_nb import linear_attention, softmax_attention  # noqa: E402

BH, D, M = 16, 64, 64


TORCH_CHILD = r"""
import json, statistics, sys, time
import numpy as np
import torch
import torch.nn.functional as tf
torch.set_num_threads({threads})
BH, D, M = {BH}, {D}, {M}
out = {{}}
for n, dtype, repeats in {jobs!r}:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((BH, n, d), dtype=np.float32).astype(dtype, copy=False) for d in (D, D, M))
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(x))[None] for x in (q, k, v))
    with torch.no_grad():
        tf.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        ts = []
        t0 = time.perf_counter()
        while len(ts) < repeats and not (len(ts) >= 3 and time.perf_counter() - t0 > {budget}):
            t = time.perf_counter()
            tf.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
            ts.append(time.perf_counter() - t)
    out[f"{{n}}:{{dtype}}"] = statistics.median(ts)
print(json.dumps(out))
"""


def torch_version():
    """torch's version when it is importable (checked in a subprocess), else None."""
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def torch_sdpa_times(jobs, budget):
    """Median times of torch's scaled_dot_product_attention(is_causal=True) for
    ``jobs`` = [(n, dtype name, repeats), ...], measured in a subprocess: torch's
    OpenMP workers keep spinning after a call and would slow every measurement
    that follows in the same process (seen here: sgemm and the Numba kernels
    2x slower once SDPA had run)."""
    code = TORCH_CHILD.format(threads=max(1, os.cpu_count() or 1), BH=BH, D=D, M=M, jobs=list(jobs),
                              budget=budget)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"torch SDPA failed, skipped:\n{proc.stderr[-2000:]}")
        return {}
    return {tuple(key.split(":")): t for key, t in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def _inputs(n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((BH, n, d), dtype=np.float32).astype(dtype, copy=False)
                 for d in (D, D, M))


def run_table(args):
    info = machine()
    info["torch"] = torch_version()
    ns = list(args.ns)
    dtypes = [np.dtype(x) for x in args.dtypes.split(",") if x]
    print_machine("# ")
    print(f"# causal forward, B*H={BH}, D=M={D}, feature map elu -- {info['date']}, {info['cpu']}, "
          f"{info['logical_cpus']} logical CPUs, numba threads {info['numba_threads']}")
    sg0 = sgemm_gflops()
    print(f"sgemm (np.dot 2048^2 float32): {sg0:.1f} GFLOP/s")
    rows = []
    seen = set()  # (method, dtype) already run once: compiled, no untimed warm-up needed

    def timed(key, fn):
        warm = key not in seen
        seen.add(key)
        return median_time(fn, repeats=args.repeats, budget_s=args.budget, warmup=warm)[0]

    for dtype in dtypes:
        for n in ns:
            q, k, v = _inputs(n, dtype)
            flops = 4.0 * BH * n * D * M
            cell = {}
            methods = ["chunked", "scan"]
            if n <= args.quadratic_max_n:
                methods.append("quadratic")
            for meth in methods:
                if meth == "scan" and n > args.scan_max_n:
                    continue
                fn = lambda meth=meth: linear_attention(q, k, v, causal=True, method=meth, check_finite=False)
                cell[meth] = timed((meth, dtype), fn)
            if n <= args.softmax_max_n:
                fn = lambda: softmax_attention(q, k, v, causal=True, check_finite=False)
                cell["softmax"] = timed(("softmax", dtype), fn)
            if info["torch"] and n <= args.torch_max_n:
                res = torch_sdpa_times([(n, dtype.name, args.repeats)], args.budget)
                if res:
                    cell["torch_sdpa"] = res[(str(n), dtype.name)]
            for meth, t in cell.items():
                row = {
                    "dtype": dtype.name, "N": n, "method": meth, "median_ms": t * 1e3,
                    "gflops": flops / t / 1e9, "x_sgemm": flops / t / 1e9 / sg0,
                    "chunked_speedup": cell["chunked"] and t / cell["chunked"],
                }
                rows.append(row)
            print(table([r for r in rows if r["dtype"] == dtype.name and r["N"] == n],
                        ["dtype", "N", "method", "median_ms", "gflops", "x_sgemm", "chunked_speedup"],
                        {"median_ms": "{:.2f}", "gflops": "{:.1f}", "x_sgemm": "{:.3f}",
                         "chunked_speedup": "{:.2f}"}))
            sys.stdout.flush()
    sg1 = sgemm_gflops()
    print(f"sgemm again at the end: {sg1:.1f} GFLOP/s (start {sg0:.1f})")

    # summary against the targets (float32, N = 4096 and 65,536)
    def t_of(dt, n, meth):
        for r in rows:
            if r["dtype"] == dt and r["N"] == n and r["method"] == meth:
                return r["median_ms"] / 1e3
        return None

    summary = {}
    if args.headline_rounds > 0:
        summary = headline(args, info["torch"])
        summary["table_sgemm_gflops"] = sg0
        c4t, m4 = t_of("float32", 4096, "chunked"), t_of("float32", 4096, "softmax")
        summary["table_speedup_vs_softmax_blocked"] = m4 / c4t if (m4 and c4t) else None
    c4 = None if summary else t_of("float32", 4096, "chunked")
    if c4:
        eff = 4.0 * BH * 4096 * D * M / c4 / 1e9
        summary["headline_gflops"] = eff
        summary["headline_x_sgemm"] = eff / sg0
        summary["headline_x_sgemm_end"] = eff / sg1
        s4 = t_of("float32", 4096, "scan")
        summary["speedup_vs_scan"] = s4 / c4 if s4 else None
        p4 = t_of("float32", 4096, "torch_sdpa")
        summary["speedup_vs_torch_sdpa"] = p4 / c4 if p4 else None
        m4 = t_of("float32", 4096, "softmax")
        summary["speedup_vs_softmax_blocked"] = m4 / c4 if m4 else None
        c64 = t_of("float32", 65536, "chunked")
        summary["scaling_65536_over_4096"] = c64 / c4 if c64 else None
    print("\nsummary (float32, N = 4096; interleaved rounds when headline_rounds > 0):")
    targets = {"headline_x_sgemm": ">= 0.40 (method='chunked')", "default_x_sgemm": ">= 0.40 (method='auto')",
               "speedup_vs_scan": ">= 2.5", "speedup_vs_torch_sdpa": ">= 25",
               "scaling_65536_over_4096": "<= 17", "scaling_65536_over_4096_out": "(out= given)"}
    for key, val in summary.items():
        if isinstance(val, dict):
            continue
        print(f"  {key:30s} {'-' if val is None else f'{val:.3f}':>10s}   {targets.get(key, '')}")
    if args.out is None and args.partial:
        partial_run_note(" ".join(args.partial), "causal_cpu")
        return
    path = write_json("causal_cpu", {"machine": info, "sgemm_gflops_start": sg0, "sgemm_gflops_end": sg1,
                                     "shape": {"BH": BH, "D": D, "M": M, "feature_map": "elu"},
                                     "rows": rows, "summary": summary}, args.out)
    print(f"wrote {path}")


def headline(args, have_torch):
    """The target ratios from interleaved rounds: sgemm, chunked and scan at N = 4096
    and chunked at N = 65,536 are timed in turn, round after round, and each ratio
    is taken between medians -- on a shared machine the load then changes under
    all of them alike.  Within a round every call runs twice back to back and
    the second run is timed: the first absorbs what the previous call left
    behind (a cold thread pool, caches).  After sgemm the round rests for
    ``--pause`` seconds: OpenBLAS's threads spin-wait after a product and
    took one of the two cores from the next call (measured: chunked 28 ms
    instead of 13 ms without the rest; a rest before every call instead made
    the N = 65,536 call 17% slower).  torch SDPA (N = 4096) runs in a
    subprocess just before and just after the rounds (median over both).

    ``chunked_65536_out`` is the same call writing into a preallocated
    ``out=``: the difference to ``chunked_65536`` is the operating system
    mapping 256 MiB of fresh output pages, not the kernel."""
    q, k, v = _inputs(4096, np.float32)
    qL, kL, vL = _inputs(65536, np.float32)
    oL = np.empty_like(vL)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2048, 2048), dtype=np.float32)
    b = rng.standard_normal((2048, 2048), dtype=np.float32)
    calls = {
        "sgemm": lambda: np.dot(a, b),
        "chunked": lambda: linear_attention(q, k, v, causal=True, method="chunked", check_finite=False),
        # the default call: method="auto", which follows this machine's calibration where one is stored
        "default": lambda: linear_attention(q, k, v, causal=True, check_finite=False),
        "scan": lambda: linear_attention(q, k, v, causal=True, method="scan", check_finite=False),
        "chunked_65536": lambda: linear_attention(qL, kL, vL, causal=True, method="chunked", check_finite=False),
        "chunked_65536_out": lambda: linear_attention(qL, kL, vL, causal=True, method="chunked",
                                                      check_finite=False, out=oL),
    }
    from linattn_nb import _tune

    print(f"# method='auto' (the 'default' call): calibration {_tune.status_line()}")
    sdpa = []
    if have_torch:
        sdpa.append(torch_sdpa_times([(4096, "float32", args.headline_rounds)], 60.0).get(("4096", "float32")))
    for fn in calls.values():
        fn()
    times = {name: [] for name in calls}
    for _ in range(args.headline_rounds):
        for name, fn in calls.items():
            fn()  # untimed: settles what the previous call left behind
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
            if name == "sgemm" and args.pause:
                time.sleep(args.pause)  # let OpenBLAS's threads stop spinning
    if have_torch:
        sdpa.append(torch_sdpa_times([(4096, "float32", args.headline_rounds)], 60.0).get(("4096", "float32")))
    med = {name: float(np.median(ts)) for name, ts in times.items()}
    sdpa = [t for t in sdpa if t]
    if sdpa:
        med["torch_sdpa"] = float(np.mean(sdpa))
    sg = 2.0 * 2048**3 / med["sgemm"] / 1e9
    eff = 4.0 * BH * 4096 * D * M / med["chunked"] / 1e9
    print(f"\ninterleaved headline ({args.headline_rounds} rounds, medians): "
          + ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in med.items()))
    return {
        "headline_gflops": eff,
        "sgemm_gflops": sg,
        "headline_x_sgemm": eff / sg,
        "default_x_sgemm": eff * med["chunked"] / med["default"] / sg,
        "default_over_chunked": med["default"] / med["chunked"],
        "speedup_vs_scan": med["scan"] / med["chunked"],
        "speedup_vs_torch_sdpa": med["torch_sdpa"] / med["chunked"] if "torch_sdpa" in med else None,
        "scaling_65536_over_4096": med["chunked_65536"] / med["chunked"],
        "scaling_65536_over_4096_out": med["chunked_65536_out"] / med["chunked"],
        "interleaved_medians_ms": {n: t * 1e3 for n, t in med.items()},
        "interleaved_ms_all": {n: [t * 1e3 for t in ts] for n, ts in times.items()},
    }


def run_check_cost(args):
    """check_finite=True against check_finite=False in interleaved rounds, per call."""
    info = machine()
    info["lscpu_model"] = cpu_model()
    rounds = max(args.headline_rounds, 3)
    print_machine("# ")
    print(f"# cost of check_finite=True, B*H={BH}, D=M={D}, float32, elu -- {info['date']}, "
          f"CPU {info['lscpu_model']}, {info['logical_cpus']} logical CPUs, numba threads "
          f"{info['numba_threads']}, {rounds} interleaved rounds")
    q, k, v = _inputs(4096, np.float32)
    calls = {"chunked causal N=4096": lambda cf: linear_attention(q, k, v, causal=True, method="chunked",
                                                                   check_finite=cf)}
    if args.check_cost_all:
        qs, ks, vs = _inputs(1024, np.float32)
        calls["scan causal N=4096"] = lambda cf: linear_attention(q, k, v, causal=True, method="scan",
                                                                   check_finite=cf)
        calls["aggregate non-causal N=4096"] = lambda cf: linear_attention(q, k, v, causal=False,
                                                                           method="aggregate", check_finite=cf)
        calls["softmax causal N=1024"] = lambda cf: softmax_attention(qs, ks, vs, causal=True, check_finite=cf)
    rows = []
    for name, fn in calls.items():
        fn(True), fn(False)
        times = {True: [], False: []}
        for r in range(rounds):
            for cf in ((True, False) if r % 2 == 0 else (False, True)):
                fn(cf)  # untimed: settles what the previous call left behind
                t = time.perf_counter()
                fn(cf)
                times[cf].append(time.perf_counter() - t)
        on, off = float(np.median(times[True])), float(np.median(times[False]))
        per_round = float(np.median(np.array(times[True]) / np.array(times[False])))
        rows.append({"call": name, "check_true_ms": on * 1e3, "check_false_ms": off * 1e3,
                     "ratio_of_medians": on / off, "median_round_ratio": per_round,
                     "true_ms_all": [t * 1e3 for t in times[True]],
                     "false_ms_all": [t * 1e3 for t in times[False]]})
        print(table(rows[-1:], ["call", "check_true_ms", "check_false_ms", "ratio_of_medians",
                                "median_round_ratio"],
                    {"check_true_ms": "{:.2f}", "check_false_ms": "{:.2f}", "ratio_of_medians": "{:.3f}",
                     "median_round_ratio": "{:.3f}"}))
        sys.stdout.flush()
    print("target: check_finite=True costs < 3% (ratio < 1.03) on the chunked headline call")
    path = write_json("causal_cpu_check_cost", {"machine": info, "rounds": rounds, "rows": rows}, args.out)
    print(f"wrote {path}")


SWEEP_COMBOS = [(16, 16), (16, 8), (24, 12), (24, 8), (32, 16), (32, 8), (32, 32), (48, 16), (48, 24),
                (48, 48), (64, 16), (64, 32), (64, 64)]


def run_sweep_chunk(args):
    """(chunk, row block) pairs for config.CPU_CHUNK_TABLE: every pair timed in
    interleaved rounds (``--repeats`` rounds, at least 9), medians and the
    ratio to the best.  Run it single-threaded (``NUMBA_NUM_THREADS=1``): the
    table is per core, and one thread is less disturbed by other load."""
    global D, M
    from linattn_nb import config

    info = machine()
    sg = sgemm_gflops()
    print_machine("# ")
    print(f"# chunk / row-block sweep, B*H={BH} -- {info['date']}, sgemm {sg:.1f} GFLOP/s, "
          f"numba threads {info['numba_threads']}")
    rows = []
    dims = list(args.dims)
    for dtype, dim, n in [(np.dtype(t), dm, n) for t in args.dtypes.split(",") for dm in dims
                          for n in ((4096, 65536) if not args.quick else (4096,))]:
        D = M = dim
        q, k, v = _inputs(n, dtype)
        out = np.empty_like(v)

        def call(c, blk):
            config.CPU_CHUNK_SIZE, config.CPU_CHUNK_BLOCK = c, blk
            linear_attention(q, k, v, causal=True, method="chunked", check_finite=False, out=out)

        times = {cb: [] for cb in SWEEP_COMBOS}
        for cb in SWEEP_COMBOS:
            call(*cb)
        for _ in range(max(args.repeats, 9)):
            for cb in SWEEP_COMBOS:
                t = time.perf_counter()
                call(*cb)
                times[cb].append(time.perf_counter() - t)
        config.CPU_CHUNK_SIZE = config.CPU_CHUNK_BLOCK = 0
        best = min(float(np.median(ts)) for ts in times.values())
        sub = []
        for (c, blk), ts in times.items():
            t = float(np.median(ts))
            sub.append({"dtype": dtype.name, "D=M": dim, "N": n, "chunk": c, "block": blk, "median_ms": t * 1e3,
                        "gflops": 4.0 * BH * n * D * M / t / 1e9, "x_best": t / best})
        rows += sub
        print(table(sub, ["dtype", "D=M", "N", "chunk", "block", "median_ms", "gflops", "x_best"],
                    {"median_ms": "{:.2f}", "gflops": "{:.1f}", "x_best": "{:.3f}"}))
        sys.stdout.flush()
    D = M = 64
    if args.out is None and args.quick:
        partial_run_note("--quick", "causal_cpu_chunk_sweep")
        return
    path = write_json("causal_cpu_chunk_sweep", {"machine": info, "sgemm_gflops": sg, "rows": rows}, args.out)
    print(f"wrote {path}")


def run_sweep_auto(args):
    info = machine()
    print_machine("# ")
    print(f"# scan vs chunked at small N, B*H={BH}, D=M={D} -- {info['date']}")
    rows = []
    for dtype in [np.dtype(x) for x in args.dtypes.split(",")]:
        for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
            q, k, v = _inputs(n, dtype)
            cell = {}
            for meth in ("scan", "chunked"):
                fn = lambda meth=meth: linear_attention(q, k, v, causal=True, method=meth, check_finite=False)
                cell[meth] = median_time(fn, repeats=max(args.repeats, 15), budget_s=args.budget)[0]
            rows.append({"dtype": dtype.name, "N": n, "scan_us": cell["scan"] * 1e6,
                         "chunked_us": cell["chunked"] * 1e6, "scan_over_chunked": cell["scan"] / cell["chunked"]})
        print(table([r for r in rows if r["dtype"] == dtype.name],
                    ["dtype", "N", "scan_us", "chunked_us", "scan_over_chunked"],
                    {"scan_us": "{:.1f}", "chunked_us": "{:.1f}", "scan_over_chunked": "{:.2f}"}))
    path = write_json("causal_cpu_auto_sweep", {"machine": info, "rows": rows}, args.out)
    print(f"wrote {path}")


def _dtypes(text):
    """``--dtypes``: comma-separated, each float32 or float64 (returned as given)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in ("float32", "float64")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown dtype(s) {', '.join(bad) or repr(text)}; "
                                         "choose from float32, float64")
    return ",".join(names)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N = 512 and 4096 only (float32 only with sweeps)")
    ap.add_argument("--ns", type=positive_int_list, default=None, help="comma-separated sequence lengths")
    ap.add_argument("--dtypes", type=_dtypes, default="float32,float64", help="comma-separated, of float32, float64")
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--budget", type=positive_float, default=4.0,
                    help="seconds per cell before repeats are cut to 3")
    ap.add_argument("--scan-max-n", type=nonnegative_int, default=65536)
    ap.add_argument("--quadratic-max-n", type=nonnegative_int, default=2048)
    ap.add_argument("--softmax-max-n", type=nonnegative_int, default=8192)
    ap.add_argument("--torch-max-n", type=nonnegative_int, default=8192)
    ap.add_argument("--headline-rounds", type=nonnegative_int, default=9,
                    help="interleaved rounds for the target ratios (0: take them from the table)")
    ap.add_argument("--pause", type=nonnegative_float, default=0.5,
                    help="seconds of rest after sgemm in each interleaved round (OpenBLAS threads spin-wait)")
    ap.add_argument("--headline-only", action="store_true", help="only the interleaved target ratios")
    ap.add_argument("--sweep-chunk", action="store_true")
    ap.add_argument("--dims", type=positive_int_list, default=[64],
                    help="D = M values of the chunk sweep, comma-separated (default 64)")
    ap.add_argument("--sweep-auto", action="store_true")
    ap.add_argument("--check-cost", action="store_true",
                    help="check_finite=True vs False on the headline call, interleaved rounds")
    ap.add_argument("--check-cost-all", action="store_true",
                    help="with --check-cost: also the scan, the non-causal kernel and softmax_attention")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/causal_cpu.json; "
                    "a partial run of the table writes only to --out)")
    args = ap.parse_args(argv)
    args.partial = [o for o, on in (("--quick", args.quick), ("--headline-only", args.headline_only),
                                    ("--ns", args.ns is not None),
                                    ("--dtypes", args.dtypes != ap.get_default("dtypes")),
                                    *((f"--{k.replace('_', '-')}", getattr(args, k) < ap.get_default(k))
                                      for k in ("scan_max_n", "quadratic_max_n", "softmax_max_n", "torch_max_n")))
                    if on]
    if args.ns is None:
        args.ns = [512, 4096] if args.quick else [2**p for p in range(9, 17)]
    if args.sweep_chunk:
        return run_sweep_chunk(args)
    if args.sweep_auto:
        return run_sweep_auto(args)
    if args.check_cost or args.check_cost_all:
        return run_check_cost(args)
    if args.headline_only:
        args.ns = []
        args.dtypes = ""
    return run_table(args)


if __name__ == "__main__":
    main()
