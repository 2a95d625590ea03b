"""Accuracy of the causal CPU forward at long sequence length.

Run::

    python benchmarks/causal_accuracy.py              # B*H = 1, N = 2**20, D = M = 64, "elu"
    python benchmarks/causal_accuracy.py --n 65536

Gaussian q, k, v (float32).  The reference is the float64 result of the same
float32 inputs computed by the per-token scan in float64 (an algorithm
independent of the chunked one); the float64 chunked result is checked against
it too.  Reported: relative Frobenius error ||o - o_ref||_F / ||o_ref||_F over
the whole output and over the last 4096 rows, for float32 "chunked" (targets:
<= 5e-7 and <= 1e-6), float32 "scan", and float16 "chunked" (inputs rounded to
float16, against the float64 result of those rounded inputs).  Results:
benchmarks/results/causal_accuracy.json.  The sizes (``--n``, ``--b``, ``--d``,
``--m``) must be positive integers, ``--seed`` a non-negative one.
"""
from __future__ import annotations

import argparse

import numpy as np

from _common import machine, nonnegative_int, positive_int, print_machine, table, write_json

from linattn_nb import linear_attention  # noqa: E402


def rel(o, ref, rows=None):
    o = o.reshape(-1, o.shape[-2], o.shape[-1])
    ref = ref.reshape(o.shape)
    if rows is not None:
        o, ref = o[:, -rows:], ref[:, -rows:]
    return float(np.linalg.norm((o.astype(np.float64) - ref).ravel()) / np.linalg.norm(ref.ravel()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=positive_int, default=2**20)
    ap.add_argument("--b", type=positive_int, default=1)
    ap.add_argument("--d", type=positive_int, default=64)
    ap.add_argument("--m", type=positive_int, default=64)
    ap.add_argument("--seed", type=nonnegative_int, default=0)
    ap.add_argument("--no-float16", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    info = machine()
    rng = np.random.default_rng(args.seed)
    B, N, D, M = args.b, args.n, args.d, args.m
    q = rng.standard_normal((B, N, D), dtype=np.float32)
    k = rng.standard_normal((B, N, D), dtype=np.float32)
    v = rng.standard_normal((B, N, M), dtype=np.float32)
    last = min(4096, N)
    kw = dict(causal=True, check_finite=False)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    ref = linear_attention(q64, k64, v64, method="scan", **kw)
    rows = []
    o = linear_attention(q64, k64, v64, method="chunked", **kw)
    rows.append({"case": "float64 chunked vs float64 scan", "rel_fro": rel(o, ref), "rel_fro_last": rel(o, ref, last)})
    del o
    for meth in ("chunked", "scan"):
        o = linear_attention(q, k, v, method=meth, **kw)
        rows.append({"case": f"float32 {meth}", "rel_fro": rel(o, ref), "rel_fro_last": rel(o, ref, last)})
        del o
    del q64, k64, v64
    if not args.no_float16:
        q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
        ref16 = linear_attention(q16.astype(np.float64), k16.astype(np.float64), v16.astype(np.float64),
                                 method="chunked", **kw)
        o = linear_attention(q16, k16, v16, method="chunked", **kw)
        # the floor: rounding the exact result to float16
        floor = rel(ref16.astype(np.float16), ref16)
        rows.append({"case": "float16 chunked (vs float64 of the float16 inputs)", "rel_fro": rel(o, ref16),
                     "rel_fro_last": rel(o, ref16, last)})
        rows.append({"case": "float16 rounding of the exact result (floor)", "rel_fro": floor,
                     "rel_fro_last": rel(ref16.astype(np.float16), ref16, last)})
    print_machine("# ")
    print(f"# causal accuracy, B*H={B}, N={N}, D={D}, M={M}, elu, Gaussian inputs -- {info['date']}, {info['cpu']}")
    print(table(rows, ["case", "rel_fro", "rel_fro_last"], {"rel_fro": "{:.3e}", "rel_fro_last": "{:.3e}"}))
    print(f"targets (float32 chunked): rel_fro <= 5e-7, rel_fro_last (last {last} rows) <= 1e-6")
    path = write_json("causal_accuracy", {"machine": info, "shape": {"B": B, "N": N, "D": D, "M": M},
                                          "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
