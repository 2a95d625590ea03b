"""CPU speed and accuracy of the decay and gate rules, against their targets.

Run::

    python benchmarks/decay_cpu.py            # B*H = 16, N = 4096, D = M = 64, float32, ELU+1; accuracy at N = 2**20
    python benchmarks/decay_cpu.py --quick    # fewer rounds, accuracy at N = 2**16

Speed: ``linear_attention(q, k, v, causal=True, method=..., log_decay=...,
check_finite=False)`` for the additive rule (chunked and scan), a per-token scalar
decay (chunked and scan) and a per-feature gate (chunked and scan), timed
side by side in interleaved rounds (each round times every case once, the
median of ``--inner`` calls); the table gives the median over rounds and the
ratios the targets are stated in (the additive scan is there for scale: a
chunked rule can beat its own scan by about as much as the additive chunked
kernel beats the additive scan on the same machine):

* decay chunked <= 1.3x additive chunked, and >= 3x faster than decay scan;
* gate chunked <= 2.5x additive chunked, and >= 2x faster than gate scan.

The log-factors are drawn per token (decay: log a in [-0.1, -0.001]; gate:
per feature in [-0.5, -0.001]), float64, as models produce them.

Accuracy: float32 q, k, v (B*H = 1, D = M = 64, ELU+1) at N = 2**20 with a
constant gamma = 0.999 (per head, broadcast per token): relative Frobenius
error of the float32 chunked and scan outputs against the float64 scan of the
same float32 inputs (target: chunked <= 5e-7).

Results: ``--out FILE``, or by default benchmarks/results/decay_cpu.json for a full run (a
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
    ld = rng.uniform(-0.1, -0.001, (bh, n))
    lgate = rng.uniform(-0.5, -0.001, (bh, n, d))
    out = np.empty_like(v)

    def call(method, log_decay=None):
        return lambda: linattn_nb.linear_attention(q, k, v, causal=True, method=method, log_decay=log_decay,
                                                   feature_map="elu", check_finite=False, out=out)

    return {
        "additive chunked": call("chunked"),
        "additive scan": call("scan"),
        "decay chunked": call("chunked", ld),
        "decay scan": call("scan", ld),
        "gate chunked": call("chunked", lgate),
        "gate scan": call("scan", lgate),
    }


def speed(args):
    med, times = interleaved_medians(_cases(args.bh, args.n, args.d), args.rounds, args.inner)
    base = med["additive chunked"]
    rows = []
    for name, t in med.items():
        rule, method = name.split()
        own_scan = med.get(f"{rule} scan")
        rows.append({"case": name, "ms": t * 1e3, "x additive chunked": t / base,
                     "scan / this": (own_scan / t) if (own_scan and method == "chunked") else None})
    targets = {
        "decay chunked <= 1.3x additive": med["decay chunked"] / base <= 1.3,
        "decay chunked >= 3x faster than its scan": med["decay scan"] / med["decay chunked"] >= 3.0,
        "gate chunked <= 2.5x additive": med["gate chunked"] / base <= 2.5,
        "gate chunked >= 2x faster than its scan": med["gate scan"] / med["gate chunked"] >= 2.0,
    }
    return rows, targets, {n: [t * 1e3 for t in ts] for n, ts in times.items()}


def accuracy(args):
    n, d = args.acc_n, args.d
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, n, d)).astype(np.float32) for _ in range(3))
    gamma = 0.999

    def run(x, y, z, method):
        return linattn_nb.linear_attention(x, y, z, causal=True, method=method, decay=np.array([gamma]),
                                           feature_map="elu", check_finite=False)

    return scan_accuracy(run, q, k, v, N=n, gamma=gamma)


def main(argv=None):
    args = rule_bench_args(__doc__, "decay_cpu", argv)
    run_rule_bench("decay_cpu", args, speed, accuracy,
                   setting=f"B*H = {args.bh}, N = {args.n}, D = M = {args.d}, float32, ELU+1",
                   columns=["ms", "x additive chunked", "scan / this"],
                   accuracy_setting=(f"B*H = 1, N = {args.acc_n}, D = M = {args.d}, gamma = 0.999, ELU+1 "
                                     "(target: float32 chunked <= 5e-7)"))


if __name__ == "__main__":
    main()
