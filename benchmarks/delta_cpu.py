"""CPU speed and accuracy of the delta and gated delta rules (issue 15 targets).

Run::

    python benchmarks/delta_cpu.py            # B*H = 16, N = 4096, D = M = 64, float32, silu_l2; accuracy at N = 2**20
    python benchmarks/delta_cpu.py --quick    # fewer rounds, accuracy at N = 2**16

Speed: ``linear_attention(q, k, v, causal=True, method=..., beta=...,
[log_decay=...], feature_map="silu_l2", check_finite=False)`` for the additive
rule (chunked and scan, ``normalize=False`` like the delta rules), the delta
rule and the gated delta rule (chunked and scan), timed side by side in
interleaved rounds (each round times every case once, the median of
``--inner`` calls); the table gives the median over rounds, the effective
rate ``4 B H N D M / t`` (GFLOP/s) and the ratios the targets are stated in:

* delta chunked >= 3x faster than the delta scan;
* delta chunked's effective rate >= 0.5x the additive chunked kernel's.

The additive scan is there for scale: a chunked kernel can beat its own scan
by about as much as the additive chunked kernel beats the additive scan on
the machine at hand.  ``beta`` is drawn per token in (0, 1) (a sigmoid's
range), the gated rule's log-decays per token in [-0.1, -0.001].

Accuracy: float32 q, k, v (B*H = 1, D = M = 64, silu_l2, beta per token)
at N = 2**20: relative Frobenius error of the float32 chunked and scan
outputs of the delta rule against the float64 scan of the same float32
inputs (target: chunked <= 1e-6).  Results: benchmarks/results/delta_cpu.json.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import numpy as np

from _common import machine, table, write_json

import linattn_nb  # noqa: E402


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


def _cases(bh, n, d, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((bh, n, d)).astype(np.float32)
    k = rng.standard_normal((bh, n, d)).astype(np.float32)
    v = rng.standard_normal((bh, n, d)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (bh, n))
    ld = rng.uniform(-0.1, -0.001, (bh, n))
    out = np.empty_like(v)

    def call(method, **kw):
        return lambda: linattn_nb.linear_attention(q, k, v, causal=True, method=method, feature_map="silu_l2",
                                                   normalize=False, check_finite=False, out=out, **kw)

    return {
        "additive chunked": call("chunked"),
        "additive scan": call("scan"),
        "delta chunked": call("chunked", beta=beta),
        "delta scan": call("scan", beta=beta),
        "gated_delta chunked": call("chunked", beta=beta, log_decay=ld),
        "gated_delta scan": call("scan", beta=beta, log_decay=ld),
    }


def speed(args):
    cases = _cases(args.bh, args.n, args.d)
    for fn in cases.values():  # compile and warm up
        fn()
        fn()
    times = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            inner = []
            for _ in range(args.inner):
                t = time.perf_counter()
                fn()
                inner.append(time.perf_counter() - t)
            times[name].append(statistics.median(inner))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    flops = 4.0 * args.bh * args.n * args.d * args.d
    base = med["additive chunked"]
    rows = []
    for name, t in med.items():
        rule, method = name.split()
        own_scan = med.get(f"{rule} scan")
        rows.append({"case": name, "ms": t * 1e3, "GFLOP/s": flops / t / 1e9, "rate / additive chunked": base / t,
                     "scan / this": (own_scan / t) if method == "chunked" else None})
    targets = {
        "delta chunked >= 3x faster than its scan": med["delta scan"] / med["delta chunked"] >= 3.0,
        "delta chunked rate >= 0.5x additive chunked": base / med["delta chunked"] >= 0.5,
    }
    return rows, targets, {n: [t * 1e3 for t in ts] for n, ts in times.items()}


def rel(o, ref):
    return float(np.linalg.norm((o.astype(np.float64) - ref).ravel()) / np.linalg.norm(ref.ravel()))


def accuracy(args):
    n, d = args.acc_n, args.d
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, n, d)).astype(np.float32) for _ in range(3))
    beta = rng.uniform(0.0, 1.0, (1, n))

    def run(x, y, z, method):
        return linattn_nb.linear_attention(x, y, z, causal=True, method=method, beta=beta, feature_map="silu_l2",
                                           check_finite=False)

    ref = run(*(x.astype(np.float64) for x in (q, k, v)), "scan")
    rows = []
    for method in ("chunked", "scan"):
        o = run(q, k, v, method)
        rows.append({"float32 method": method, "N": n, "rel. error vs float64 scan": rel(o, ref),
                     "nonfinite": int((~np.isfinite(o)).sum())})
    o64 = run(*(x.astype(np.float64) for x in (q, k, v)), "chunked")
    rows.append({"float32 method": "float64 chunked", "N": n, "rel. error vs float64 scan": rel(o64, ref),
                 "nonfinite": int((~np.isfinite(o64)).sum())})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 rounds, accuracy at N = 2**16")
    ap.add_argument("--bh", type=int, default=16)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 9; --quick 5)")
    ap.add_argument("--inner", type=int, default=3, help="calls per measurement (their median counts)")
    ap.add_argument("--acc-n", type=int, default=None, help="accuracy sequence length (default 2**20; --quick 2**16)")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/delta_cpu.json)")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 5 if args.quick else 9
    if args.acc_n is None:
        args.acc_n = 2**16 if args.quick else 2**20

    import numba

    print(f"CPU: {cpu_model()}, {numba.get_num_threads()} Numba threads")
    print(f"speed: B*H = {args.bh}, N = {args.n}, D = M = {args.d}, float32, silu_l2, beta per token; "
          f"medians of {args.rounds} interleaved rounds ({args.inner} calls each)")
    rows, targets, all_ms = speed(args)
    print(table(rows, ["case", "ms", "GFLOP/s", "rate / additive chunked", "scan / this"],
                {"ms": "{:.2f}", "GFLOP/s": "{:.2f}", "rate / additive chunked": "{:.2f}", "scan / this": "{:.2f}"}))
    for name, ok in targets.items():
        print(f"  {'met' if ok else 'NOT met'}: {name}")
    acc = []
    if not args.no_accuracy:
        acc = accuracy(args)
        print(f"accuracy: delta rule, B*H = 1, N = {args.acc_n}, D = M = {args.d}, silu_l2, beta per token "
              "(target: float32 chunked <= 1e-6)")
        print(table(acc, ["float32 method", "N", "rel. error vs float64 scan", "nonfinite"],
                    {"rel. error vs float64 scan": "{:.2e}"}))
    path = write_json("delta_cpu", {"machine": machine(), "cpu_model": cpu_model(), "args": vars(args),
                                    "speed": rows, "targets": targets, "speed_ms_all": all_ms, "accuracy": acc},
                      args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
