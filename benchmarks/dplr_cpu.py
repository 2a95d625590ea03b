"""CPU speed of the diagonal-plus-low-rank rules against the additive and delta rules, side by side.

Run (the BLAS kernel as users get it: no forced OpenBLAS core type)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/dplr_cpu.py          # the headline
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/dplr_cpu.py --quick  # N = 1024
    python benchmarks/dplr_cpu.py --accuracy  # KDA in float32 at N = 2^20 against the float64 scan

At B*H = 16, N = 4096, D = M = 64, float32, ELU+1 features (``l2`` for the delta forms), timed in
interleaved rounds (medians): ``linear_attention`` additive chunked and scan, the delta rule chunked
and scan, and ``dplr_attention`` with the general form (per-feature diagonal, rank 1), KDA and the
delta rule through the general form, with ``method="scan"`` and the general form and KDA also with
``method="chunked"``.  The table gives each case's rate against the additive chunked call (the
targets: the general form chunked >= 0.3x, KDA chunked >= 0.35x, each faster than its own scan),
with the CPU model, the BLAS library and its kernel.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model, interleaved_medians, machine, print_machine, table  # noqa: E402

import linattn_nb as la  # noqa: E402


def blas_line() -> str:
    try:
        from threadpoolctl import threadpool_info

        return "; ".join(f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture')}, "
                         f"{i.get('num_threads')} threads)" for i in threadpool_info() if i.get("user_api") == "blas")
    except Exception as exc:  # pragma: no cover - reported, not fatal
        return f"unknown ({exc})"


def accuracy(n=1 << 20) -> int:
    """KDA, one sequence, D = M = 64, alpha in [0.9, 1), beta in (0, 1], l2 keys: float32 scan and chunked
    against the float64 scan of the same inputs (relative Frobenius)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, n, 64)).astype(np.float32) for _ in range(3))
    kw = dict(rule="kda", log_decay=np.log(rng.uniform(0.9, 1.0, (1, n, 64))), beta=1.0 - rng.uniform(0.0, 1.0, (1, n)),
              feature_map="l2")
    ref = la.dplr_attention(*(x.astype(np.float64) for x in (q, k, v)), method="scan", **kw)
    for method in ("scan", "chunked"):
        o = la.dplr_attention(q, k, v, method=method, **kw).astype(np.float64)
        print(f"KDA float32, N = {n}, {method}: {np.linalg.norm(o - ref) / np.linalg.norm(ref):.3g} relative "
              f"Frobenius against the float64 scan")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 1024, 5 rounds")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--accuracy", action="store_true", help="KDA float32 at N = 2^20 against the float64 scan")
    args = ap.parse_args(argv)
    if args.accuracy:
        return accuracy()
    BH, N, D, M = 16, (1024 if args.quick else 4096), 64, 64
    rounds = 5 if args.quick else args.rounds
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((BH, N, d)).astype(np.float32) for d in (D, D, M))
    fk = la.feature_maps.get("elu")(k).astype(np.float64)
    a = rng.standard_normal((BH, N, D)) * 0.02
    b = -fk * 0.01
    log_diag = np.log(rng.uniform(0.9, 1.0, size=(BH, N, D)))
    beta = rng.uniform(0.0, 1.0, size=(BH, N))
    kl = la.feature_maps.get("l2")(k).astype(np.float64)
    cases = {
        "additive chunked": lambda: la.linear_attention(q, k, v, causal=True, method="chunked", check_finite=False),
        "additive scan": lambda: la.linear_attention(q, k, v, causal=True, method="scan", check_finite=False),
        "delta chunked": lambda: la.linear_attention(q, k, v, causal=True, method="chunked", beta=beta,
                                                     feature_map="l2", check_finite=False),
        "delta scan": lambda: la.linear_attention(q, k, v, causal=True, method="scan", beta=beta, feature_map="l2",
                                                  check_finite=False),
        "dplr general scan": lambda: la.dplr_attention(q, k, v, a=a, b=b, log_diag=log_diag, method="scan",
                                                       check_finite=False),
        "dplr general chunked": lambda: la.dplr_attention(q, k, v, a=a, b=b, log_diag=log_diag, method="chunked",
                                                          check_finite=False),
        "dplr kda chunked": lambda: la.dplr_attention(q, k, v, rule="kda", log_decay=log_diag, beta=beta,
                                                      feature_map="l2", method="chunked", check_finite=False),
        "dplr kda scan": lambda: la.dplr_attention(q, k, v, rule="kda", log_decay=log_diag, beta=beta,
                                                   feature_map="l2", method="scan", check_finite=False),
        "dplr delta scan": lambda: la.dplr_attention(q, k, v, a=kl, b=-beta[..., None] * kl, beta=beta,
                                                     feature_map="l2", method="scan", check_finite=False),
    }
    med, _ = interleaved_medians(cases, rounds)
    base = med["additive chunked"]
    rows = [{"case": name, "ms": t * 1e3, "rate vs additive chunked": base / t} for name, t in med.items()]
    info = machine()
    print_machine("# ")
    print(f"# {info['date']} CPU {cpu_model()} ({info['logical_cpus']} logical, numba threads "
          f"{info['numba_threads']}, load {info.get('load_avg_1m', float('nan')):.2f}); BLAS {blas_line()}")
    print(f"# B*H = {BH}, N = {N}, D = M = {D}, float32; medians of {rounds} interleaved rounds")
    print(table(rows, ["case", "ms", "rate vs additive chunked"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
