"""CPU speed and accuracy of the delta and gated delta rules, against their targets.

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
inputs (target: chunked <= 1e-6).

Results: ``--out FILE``, or by default benchmarks/results/delta_cpu.json for a full run (a
``--quick`` or ``--no-accuracy`` run without ``--out`` writes nothing and says so).  Counts and
sizes (``--rounds``, ``--inner``, ``--n``, ...) must be positive integers.
"""
from __future__ import annotations

import numpy as np

from _common import interleaved_medians, rule_bench_args, run_rule_bench, scan_accuracy

import linattn_nb  # noqa: E402


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
    med, times = interleaved_medians(_cases(args.bh, args.n, args.d), args.rounds, args.inner)
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


def accuracy(args):
    n, d = args.acc_n, args.d
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, n, d)).astype(np.float32) for _ in range(3))
    beta = rng.uniform(0.0, 1.0, (1, n))

    def run(x, y, z, method):
        return linattn_nb.linear_attention(x, y, z, causal=True, method=method, beta=beta, feature_map="silu_l2",
                                           check_finite=False)

    return scan_accuracy(run, q, k, v, N=n)


def main(argv=None):
    args = rule_bench_args(__doc__, "delta_cpu", argv)
    run_rule_bench("delta_cpu", args, speed, accuracy,
                   setting=f"B*H = {args.bh}, N = {args.n}, D = M = {args.d}, float32, silu_l2, beta per token",
                   columns=["ms", "GFLOP/s", "rate / additive chunked", "scan / this"],
                   accuracy_setting=(f"delta rule, B*H = 1, N = {args.acc_n}, D = M = {args.d}, silu_l2, beta per token "
                                     "(target: float32 chunked <= 1e-6)"))


if __name__ == "__main__":
    main()
