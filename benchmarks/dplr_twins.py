"""The DPLR kernels' serial and batch-parallel twins side by side, around the work limit that picks one.

Run (the BLAS kernel as users get it: no forced OpenBLAS core type)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/dplr_twins.py
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/dplr_twins.py --rounds 5

For each shape (general-form rows, a per-feature diagonal, float64 features; the chunked forward in
float32) and each kernel (``dplr_scan``, ``dplr_scan_backward``, ``dplr_chunked``,
``dplr_chunked_backward``), the serial and the parallel twin are timed in interleaved rounds (medians of
medians of 15 calls), and the table gives their ratio and the twin that
:func:`linattn_nb.ops.dplr.cpu.pick_kernel` picks at the default limits
(``config.CPU_CHUNKED_SERIAL_MAX_WORK``, ``DPLR_SCAN_WORK_WEIGHT``, ``DPLR_SCAN_BACKWARD_WORK_WEIGHT``).
``loss`` is the picked twin's time over the faster one's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved_medians, positive_int, print_machine, table  # noqa: E402

from linattn_nb import config  # noqa: E402
from linattn_nb.ops.dplr import chunked, chunked_grad, cpu  # noqa: E402

SHAPES = [(2, 32, 32, 32, 1), (2, 64, 32, 32, 1), (2, 128, 32, 32, 1), (4, 128, 32, 32, 1), (2, 256, 32, 32, 2),
          (4, 256, 64, 64, 1)]


def _kernels(B, N, F, M, r, rng):
    fq = rng.random((B, N, F))
    ld = rng.uniform(-0.3, 0.0, (B, N, F))
    A, Bv, KW = (rng.standard_normal((B, N, r, F)) * 0.1 for _ in range(3))
    VW = rng.standard_normal((B, N, r, M))
    H0 = rng.random((B, F, M + 1))
    dout = rng.standard_normal((B, N, M))
    dH = np.zeros((B, F, M + 1))
    fq32 = fq.astype(np.float32)
    return {
        "scan": (lambda: cpu.dplr_scan(fq, ld, A, Bv, KW, VW, H0.copy(), np.empty((B, N, M)), 0, 0.0),
                 config.DPLR_SCAN_WORK_WEIGHT),
        "scan backward": (lambda: cpu.dplr_scan_backward(fq, ld, A, Bv, KW, VW, H0.copy(), dout, dH, 0, 0.0, 16),
                          config.DPLR_SCAN_BACKWARD_WORK_WEIGHT),
        "chunked f32": (lambda: chunked.dplr_chunked(fq32, ld, A, Bv, KW, VW, H0.copy(), np.empty((B, N, M)), 0, 0.0),
                        1),
        "chunked backward": (lambda: chunked_grad.dplr_chunked_backward(fq, ld, A, Bv, KW, VW, H0.copy(), dout, dH,
                                                                        0, 0.0), 1),
    }, (fq, A, VW)


def _with_limit(fn, limit):
    def call():
        saved = config.CPU_CHUNKED_SERIAL_MAX_WORK
        config.CPU_CHUNKED_SERIAL_MAX_WORK = limit
        try:
            for _ in range(15):
                fn()
        finally:
            config.CPU_CHUNKED_SERIAL_MAX_WORK = saved
    return call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=positive_int, default=7)
    args = ap.parse_args(argv)
    print_machine()
    rng = np.random.default_rng(0)
    limit = config.CPU_CHUNKED_SERIAL_MAX_WORK
    rows = []
    for B, N, F, M, r in SHAPES:
        kernels, (fq, A, VW) = _kernels(B, N, F, M, r, rng)
        for name, (fn, weight) in kernels.items():
            picked = cpu.pick_kernel("serial", "parallel", fq, A, VW, weight)
            med, _ = interleaved_medians({"serial": _with_limit(fn, 1 << 62), "parallel": _with_limit(fn, 0)},
                                         args.rounds)
            s, p = med["serial"] / 15, med["parallel"] / 15
            rows.append({"shape": f"B={B} N={N} F={F} M={M} r={r}", "work/limit": B * N * r * F * (M + 1) / limit,
                         "kernel": name, "serial ms": s * 1e3, "parallel ms": p * 1e3, "parallel/serial": p / s,
                         "picks": picked, "loss": (s if picked == "serial" else p) / min(s, p)})
    print(table(rows, ["shape", "work/limit", "kernel", "serial ms", "parallel ms", "parallel/serial", "picks",
                       "loss"],
                {"work/limit": "{:.3f}", "serial ms": "{:.3f}", "parallel ms": "{:.3f}", "parallel/serial": "{:.2f}",
                 "loss": "{:.2f}"}))


if __name__ == "__main__":
    main()
