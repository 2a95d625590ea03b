"""Does method="auto" pick the faster causal CPU method with the BLAS kernels it finds?

Times ``linear_attention(..., causal=True)`` with ``method="scan"``, ``"chunked"``
and ``"auto"`` side by side (interleaved rounds, medians) at the headline
shape (float32, D = M = 64; B*H = 16 at N = 512 and 4096, B*H = 2 at
N = 65536 to stay quick) and prints ``auto / min(scan, chunked)``, twice,
each in a subprocess that first calibrates ``auto`` in its environment
(``linattn_nb._tune``; the calibrations are keyed by the BLAS kernels, so
the two do not collide):

* AVX2 forced: ``OPENBLAS_CORETYPE=Haswell`` (OpenBLAS runs its AVX2 kernels
  even on an AVX-512 CPU, as on hosts that set it);
* native: ``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE`` unset.

Target: ``auto`` within 5% of the faster method in both.  Usage::

    python benchmarks/auto_check.py [--rounds 9] [--inner 3] [--no-calibrate] [--store]

``--no-calibrate`` uses the calibrations already stored (``linattn tune``);
``--store`` stores the new ones (by default they serve the measuring process only).
Results: ``benchmarks/results/auto_check.json``.  Design: ``docs/tuning.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (cpu_model, interleaved_medians, machine, positive_int, print_machine, table,  # noqa: E402
                     write_json)

#: (B*H, N) of the check.
SHAPES = ((16, 512), (16, 4096), (2, 65536))
DIM = 64
TARGET = 1.05

ENVS = (("AVX2 forced (OPENBLAS_CORETYPE=Haswell)", {"OPENBLAS_CORETYPE": "Haswell"}, ("OPENBLAS_L2_SIZE",)),
        ("native (OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE unset)", {}, ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")))


def child(args) -> list:
    import numpy as np

    import linattn_nb.config as cfg
    from linattn_nb import _tune, linear_attention
    from linattn_nb.ops.registry import select_auto

    cfg.AUTO_TUNE = "load"
    line = print_machine("  ")
    if not args.no_calibrate:
        t0 = time.perf_counter()
        cal = _tune.calibrate(["additive"], ["float32"])
        if args.store:
            where = f"stored in {_tune.save(_tune.merge(_tune.load(), cal))}"
        else:
            _tune.use(cal)
            where = "used in this process only"
        print(f"  calibrated additive/float32 in {time.perf_counter() - t0:.1f} s: "
              f"{cal['entries']['additive/float32']['rows']} ({where})", flush=True)
    elif _tune.current() is None:
        print("  no stored calibration: auto uses config.AUTO_METHODS", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for bh, n in SHAPES:
        q, k, v = (rng.standard_normal((bh, n, DIM), dtype=np.float32) for _ in range(3))
        cases = {m: (lambda m=m: linear_attention(q, k, v, causal=True, method=m)) for m in ("scan", "chunked", "auto")}
        med, _ = interleaved_medians(cases, args.rounds, inner=args.inner)
        pick = select_auto(causal=True, device="cpu", n=n, dtype=np.float32)
        cfg.AUTO_TUNE = "off"
        const = select_auto(causal=True, device="cpu", n=n, dtype=np.float32)
        cfg.AUTO_TUNE = "load"
        best = min(med["scan"], med["chunked"])
        rows.append({"B*H": bh, "N": n, "scan ms": med["scan"] * 1e3, "chunked ms": med["chunked"] * 1e3,
                     "auto ms": med["auto"] * 1e3, "auto picks": pick, "auto / min": med["auto"] / best,
                     "pick / min": med[pick] / best,
                     "constants pick": const, "constants / min": med[const] / best,
                     "load": os.getloadavg()[0]})
        print(f"  N = {n}: auto picks {pick}, auto / min = {med['auto'] / best:.3f}", flush=True)
    return rows, line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=positive_int, default=9, help="interleaved rounds (default 9)")
    ap.add_argument("--inner", type=positive_int, default=3,
                    help="calls per measurement (their median counts; default 3)")
    ap.add_argument("--no-calibrate", action="store_true", help="use the stored calibrations")
    ap.add_argument("--store", action="store_true",
                    help="store the calibrations (kernel cache folder), as `linattn tune` does; default: "
                         "use them in the measuring process only")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/auto_check.json)")
    args = ap.parse_args(argv)
    if args.child:
        rows, line = child(args)
        with open(args.child, "w") as fh:
            json.dump({"rows": rows, "machine_line": line}, fh)
        return 0

    print(f"CPU: {cpu_model()}")
    print_machine()
    print(f"float32, D = M = {DIM}, causal; medians of {args.rounds} interleaved rounds "
          f"({args.inner} calls each, their median); "
          f"target: auto / min(scan, chunked) <= {TARGET}")
    results, ok = {}, True
    for label, setenv, unset in ENVS:
        env = {k: v for k, v in os.environ.items() if k not in unset}
        env.update(setenv)
        env["LINATTN_AUTO_TUNE"] = "load"
        print(f"{label}:", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", out, "--rounds", str(args.rounds),
                   "--inner", str(args.inner)] + (["--no-calibrate"] if args.no_calibrate else []) + \
                (["--store"] if args.store else [])
            proc = subprocess.run(cmd, env=env)
            if proc.returncode != 0:
                print(f"  failed (exit status {proc.returncode})")
                ok = False
                continue
            with open(out) as fh:
                results[label] = json.load(fh)
    rows = [{"BLAS": label.split(" (")[0], **r} for label, res in results.items() for r in res["rows"]]
    cols = ["BLAS", "B*H", "N", "scan ms", "chunked ms", "auto ms", "auto picks", "auto / min", "pick / min",
            "constants pick", "constants / min", "load"]
    print(table(rows, cols, {c: "{:.2f}" for c in ("scan ms", "chunked ms", "auto ms", "load")} |
                {"auto / min": "{:.3f}", "pick / min": "{:.3f}", "constants / min": "{:.3f}"}))
    print("  pick / min: the median of the method auto picks over the faster median (auto / min less the noise "
          "between two timings of one method)")
    print("  constants: the pick of config.AUTO_METHODS (LINATTN_AUTO_TUNE=off), timed as that method")
    met = bool(rows) and all(r["auto / min"] <= TARGET for r in rows)
    print(f"  {'met' if met and ok else 'NOT met'}: auto within {TARGET - 1:.0%} of the faster method everywhere")
    path = write_json("auto_check", {"machine": machine(), "cpu_model": cpu_model(), "args": vars(args),
                                     "runs": results, "rows": rows, "target_met": met and ok}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
