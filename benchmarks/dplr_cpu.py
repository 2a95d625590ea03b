"""CPU speed of the diagonal-plus-low-rank rules against the additive and delta rules, side by side.

Run (the BLAS kernel as users get it: no forced OpenBLAS core type)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/dplr_cpu.py          # the headline
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/dplr_cpu.py --quick  # N = 1024
    python benchmarks/dplr_cpu.py --accuracy  # KDA in float32 at N = 2^20 against the float64 scan
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/dplr_cpu.py --vjp    # gradients / forward
    git archive <commit> | tar -x -C /tmp/old && env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
        python benchmarks/dplr_cpu.py --against /tmp/old      # that checkout and this one, side by side

At B*H = 16, N = 4096, D = M = 64, float32, ELU+1 features (``l2`` for the delta forms), timed in
interleaved rounds (medians): ``linear_attention`` additive chunked and scan, the delta rule chunked
and scan, and ``dplr_attention`` with the general form (per-feature diagonal, rank 1), KDA and the
delta rule through the general form, with ``method="scan"`` and the general form and KDA also with
``method="chunked"``.  The table gives each case's rate against the additive chunked call (the
targets: the general form chunked >= 0.3x, KDA chunked >= 0.35x, each faster than its own scan),
with the CPU model, the BLAS library and its kernel.  ``--against DIR`` times the chunked and scan
calls of the general form and KDA, and the additive chunked call, in two worker processes, the
checkout at DIR (first on ``sys.path``) and this one, alternately case by case, so that both see the
same load; the rates are against each checkout's own additive chunked call.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model, interleaved_medians, machine, positive_int, print_machine, table  # noqa: E402

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


def _cases(N, names=None):
    BH, D, M = 16, 64, 64
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
    return cases if names is None else {n: cases[n] for n in names}


def _vjp_cases(N):
    """The forwards of KDA and the general form (chunked) and their ``dplr_attention_vjp`` with the
    chunked and the scan backward, at the shape of :func:`_cases`."""
    BH, D, M = 16, 64, 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((BH, N, d)).astype(np.float32) for d in (D, D, M))
    g = rng.standard_normal((BH, N, M)).astype(np.float32)
    fk = la.feature_maps.get("elu")(k).astype(np.float64)
    kda = dict(rule="kda", log_decay=np.log(rng.uniform(0.9, 1.0, size=(BH, N, D))),
               beta=rng.uniform(0.0, 1.0, size=(BH, N)), feature_map="l2", check_finite=False)
    gen = dict(a=rng.standard_normal((BH, N, D)) * 0.02, b=-fk * 0.01,
               log_diag=np.log(rng.uniform(0.9, 1.0, size=(BH, N, D))), check_finite=False)
    cases = {}
    for name, kw in (("kda", kda), ("general", gen)):
        cases[f"dplr {name} forward"] = lambda kw=kw: la.dplr_attention(q, k, v, method="chunked", **kw)
        for m in ("chunked", "scan"):
            cases[f"dplr {name} vjp, {m} backward"] = (
                lambda kw=kw, m=m: la.dplr_attention_vjp(q, k, v, g, method=m, **kw))
    return cases


AGAINST = ("additive chunked", "dplr general chunked", "dplr kda chunked", "dplr general scan", "dplr kda scan")


def _worker(N) -> int:
    """Time one case per line of stdin (its name), printing seconds; "ready" once warm."""
    cases = _cases(N, AGAINST)
    for fn in cases.values():
        fn()
        fn()
    print("ready", flush=True)
    for line in sys.stdin:
        fn = cases[line.strip()]
        t = time.perf_counter()
        fn()
        print(time.perf_counter() - t, flush=True)
    return 0


def against(other, N, rounds) -> int:
    """The cases of :data:`AGAINST` in the checkout ``other`` and in this one, alternately."""
    here = Path(__file__).resolve()
    workers = {}
    for label, path in (("before", str(Path(other).resolve())), ("after", str(here.parent.parent))):
        env = dict(os.environ, PYTHONPATH=path)
        workers[label] = subprocess.Popen([sys.executable, str(here), "--worker", str(N)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env=env, cwd=path)
        if workers[label].stdout.readline().strip() != "ready":
            raise RuntimeError(f"the worker for {path} did not start")
    times = {(w, c): [] for w in workers for c in AGAINST}
    for _ in range(rounds):
        for c in AGAINST:
            for w, p in workers.items():
                p.stdin.write(c + "\n")
                p.stdin.flush()
                times[w, c].append(float(p.stdout.readline()))
    for p in workers.values():
        p.stdin.close()
        p.wait()
    info = machine()
    print(f"# {info['date']} CPU {cpu_model()} ({info['logical_cpus']} logical, load "
          f"{info.get('load_avg_1m', float('nan')):.2f}); before = {other}")
    print(f"# B*H = 16, N = {N}, D = M = 64, float32; medians of {rounds} interleaved rounds")
    rows = []
    for c in AGAINST:
        row = {"case": c}
        for w in workers:
            m, base = statistics.median(times[w, c]), statistics.median(times[w, "additive chunked"])
            row[f"{w} ms"], row[f"{w} rate"] = m * 1e3, base / m
        rows.append(row)
    print(table(rows, ["case", "before ms", "before rate", "after ms", "after rate"],
                {"before ms": "{:.1f}", "after ms": "{:.1f}", "before rate": "{:.3f}", "after rate": "{:.3f}"}))
    return 0


def vjp(N, rounds) -> int:
    """The gradients' time against the forward (:func:`_vjp_cases`), interleaved rounds."""
    med, per = interleaved_medians(_vjp_cases(N), rounds)
    rows = []
    for name, t in med.items():
        fwd = "dplr " + name.split()[1] + " forward"
        ratios = [a / b for a, b in zip(per[name], per[fwd])]
        rows.append({"case": name, "ms": t * 1e3, "x forward": t / med[fwd],
                     "per-round range": f"{min(ratios):.2f}-{max(ratios):.2f}"})
    info = machine()
    print_machine("# ")
    print(f"# {info['date']} CPU {cpu_model()} ({info['logical_cpus']} logical, numba threads "
          f"{info['numba_threads']}, load {info.get('load_avg_1m', float('nan')):.2f}); BLAS {blas_line()}")
    print(f"# B*H = 16, N = {N}, D = M = 64, float32 inputs; medians of {rounds} interleaved rounds")
    print(table(rows, ["case", "ms", "x forward", "per-round range"], {"ms": "{:.1f}", "x forward": "{:.2f}"}))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 1024, 5 rounds")
    ap.add_argument("--rounds", type=positive_int, default=9)
    ap.add_argument("--accuracy", action="store_true", help="KDA float32 at N = 2^20 against the float64 scan")
    ap.add_argument("--against", metavar="DIR", help="a checkout of linattn_nb to time side by side with this one")
    ap.add_argument("--vjp", action="store_true", help="dplr_attention_vjp (chunked and scan backward) against "
                    "the forward, KDA and the general form")
    ap.add_argument("--worker", type=positive_int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.accuracy:
        return accuracy()
    if args.worker:
        return _worker(args.worker)
    BH, N, D = 16, (1024 if args.quick else 4096), 64
    rounds = 5 if args.quick else args.rounds
    if args.against:
        return against(args.against, N, rounds)
    if args.vjp:
        return vjp(N, rounds)
    cases = _cases(N)
    med, _ = interleaved_medians(cases, rounds)
    base = med["additive chunked"]
    rows = [{"case": name, "ms": t * 1e3, "rate vs additive chunked": base / t} for name, t in med.items()]
    info = machine()
    print_machine("# ")
    print(f"# {info['date']} CPU {cpu_model()} ({info['logical_cpus']} logical, numba threads "
          f"{info['numba_threads']}, load {info.get('load_avg_1m', float('nan')):.2f}); BLAS {blas_line()}")
    print(f"# B*H = {BH}, N = {N}, D = M = {D}, float32; medians of {rounds} interleaved rounds")
    print(table(rows, ["case", "ms", "rate vs additive chunked"], {"ms": "{:.1f}", "rate vs additive chunked": "{:.3f}"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
