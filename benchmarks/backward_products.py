"""The BLAS products of one chunk: the additive rule's forward against its fused normalised backward.

Run::

    python benchmarks/backward_products.py                # chunk 48, D = M = 64, float32, 7 rounds
    python benchmarks/backward_products.py --chunk 64 --rounds 9

What it answers: how far below 2.5x the forward ``linear_attention_vjp`` of the additive rule can go on
this machine while it runs the same products.  Each product of one chunk of C tokens is called through
the package's own ``gemm`` (:mod:`linattn_nb.ops._gemm`, the direct BLAS call of the kernels) from a
compiled loop, with the operand shapes and transposes of the kernels at a row block equal to the chunk
(one block: the pair ``linattn tune`` picks for both on the AMD EPYC hosts measured), on one thread with
the BLAS pinned to one thread:

* the forward (``linattn_nb/ops/causal/chunked.py``): ``A = Q K^T``, ``[Q | A] [H ; V 1]`` and the
  transition ``K^T [V 1]``;
* the backward (``linattn_nb/ops/grad/_cpu_chunked_norm.py``): pass 1 ``T = G S^T``, ``A = Q K^T``,
  ``P0 = G V^T``, ``dq += dA K``, ``dk = dA^T Q``, ``dv = A^T g1`` and the state ``K^T [V 1]``; pass 2
  ``dk += [V 1] R^T``, ``dv += K R`` and ``R += Q^T g1``.

The time of each product is the median over interleaved rounds of 2000 calls each; the table gives its
GFLOP/s and the sums, and ``backward / forward`` is the ratio the products alone set: the whole vjp also
computes the features and ``[v | 1]``, checks and normalises rows, and touches the fresh pages of its three
results, so it sits above it.  Five state-sized and five intra-chunk products against two and two (the
forward's output product does both at once) put the ratio at 2.5 when every product runs at one rate.
Results: a table on stdout and ``benchmarks/results/backward_products.json`` (``--out`` elsewhere).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from _common import interleaved_medians, machine, print_machine, table, write_json

from numba import njit  # noqa: E402

from linattn_nb._blas import single_threaded_blas  # noqa: E402
from linattn_nb.ops._gemm import gemm  # noqa: E402

# (name, pass, flops as a function of C, F, M1)
PRODUCTS = (
    ("fwd A = Q K^T", "forward", lambda C, F, M1: C * C * F),
    ("fwd [Q | A] [H ; V 1]", "forward", lambda C, F, M1: C * M1 * (F + C)),
    ("fwd K^T [V 1]", "forward", lambda C, F, M1: F * M1 * C),
    ("T = G S^T", "backward", lambda C, F, M1: C * F * (M1 - 1)),
    ("A = Q K^T", "backward", lambda C, F, M1: C * C * F),
    ("P0 = G V^T", "backward", lambda C, F, M1: C * C * (M1 - 1)),
    ("dq += dA K", "backward", lambda C, F, M1: C * F * C),
    ("dk = dA^T Q", "backward", lambda C, F, M1: C * F * C),
    ("dv = A^T g1", "backward", lambda C, F, M1: C * M1 * C),
    ("K^T [V 1]", "backward", lambda C, F, M1: F * M1 * C),
    ("dk += [V 1] R^T", "backward", lambda C, F, M1: C * F * M1),
    ("dv += K R", "backward", lambda C, F, M1: C * M1 * F),
    ("R += Q^T g1", "backward", lambda C, F, M1: F * M1 * C),
)


@njit
def _run(which, reps, Q, K, V1, G1, Ht, Hw, X, R, P, A, outF, outC, outM, part):
    C, F = Q.shape
    M1 = V1.shape[1]
    M = M1 - 1
    LX = F + C
    for _ in range(reps):
        if which == 0:
            gemm(0, 1, C, C, F, 1.0, Q, 0, F, K, 0, F, 0.0, X, F, LX)
        elif which == 1:
            gemm(0, 0, C, M1, F + C, 1.0, X, 0, LX, R, 0, M1, 0.0, outM, 0, M1)
        elif which == 2 or which == 9:
            gemm(1, 0, F, M1, C, 1.0, K, 0, F, V1, 0, M1, 0.0, part, 0, M1)
        elif which == 3:
            gemm(0, 0, C, F, M, 1.0, G1, 0, M1, Ht, 0, F, 0.0, outF, 0, F)
        elif which == 4:
            gemm(0, 1, C, C, F, 1.0, Q, 0, F, K, 0, F, 0.0, outC, 0, C)
        elif which == 5:
            gemm(0, 1, C, C, M, 1.0, G1, 0, M1, V1, 0, M1, 0.0, outC, 0, C)
        elif which == 6:
            gemm(0, 0, C, F, C, 1.0, P, 0, C, K, 0, F, 1.0, outF, 0, F)
        elif which == 7:
            gemm(1, 0, C, F, C, 1.0, P, 0, C, Q, 0, F, 0.0, outF, 0, F)
        elif which == 8:
            gemm(1, 0, C, M1, C, 1.0, A, 0, C, G1, 0, M1, 0.0, outM, 0, M1)
        elif which == 10:
            gemm(0, 0, C, F, M1, 1.0, V1, 0, M1, Ht, 0, F, 1.0, outF, 0, F)
        elif which == 11:
            gemm(0, 0, C, M1, F, 1.0, K, 0, F, Hw, 0, M1, 1.0, outM, 0, M1)
        else:
            gemm(1, 0, F, M1, C, 1.0, Q, 0, F, G1, 0, M1, 0.0, part, 0, M1)


def measure(C, D, rounds, reps=2000):
    """Rows of the table: each product's median time (s) and GFLOP/s, float32, C tokens, D = M."""
    F, M1 = D, D + 1
    rng = np.random.default_rng(0)

    def mat(*shape):
        return rng.random(shape).astype(np.float32)

    arrays = (mat(C, F), mat(C, F), mat(C, M1), mat(C, M1), mat(M1, F), mat(F, M1), mat(C, F + C),
              mat(F + C, M1), mat(C, C), mat(C, C), np.zeros((C, F), np.float32), np.zeros((C, C), np.float32),
              np.zeros((C, M1), np.float32), np.zeros((F, M1), np.float32))
    for i in range(len(PRODUCTS)):
        _run(i, 2, *arrays)  # compile and warm
    cases = {name: (lambda i=i: _run(i, reps, *arrays)) for i, (name, _, _) in enumerate(PRODUCTS)}
    with single_threaded_blas(True):
        med, _ = interleaved_medians(cases, rounds)
    rows = []
    for name, which, flops in PRODUCTS:
        t = med[name] / reps
        rows.append({"product": name, "pass": which, "us": t * 1e6, "gflops": 2.0 * flops(C, F, M1) / t / 1e9})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk", type=int, default=48, help="tokens a chunk (default 48)")
    ap.add_argument("--dim", type=int, default=64, help="D = M (default 64)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/backward_products.json)")
    args = ap.parse_args(argv)
    for name, value in (("--chunk", args.chunk), ("--dim", args.dim), ("--rounds", args.rounds)):
        if value < 1:
            ap.error(f"{name} must be >= 1, got {value}")
    print_machine()
    t0 = time.perf_counter()
    rows = measure(args.chunk, args.dim, args.rounds)
    fwd = sum(r["us"] for r in rows if r["pass"] == "forward")
    bwd = sum(r["us"] for r in rows if r["pass"] == "backward")
    print(f"one chunk of {args.chunk} tokens, D = M = {args.dim}, float32, one thread; medians of {args.rounds} "
          "interleaved rounds of 2000 calls")
    print(table(rows, ["product", "pass", "us", "gflops"], {"us": "{:.2f}", "gflops": "{:.1f}"}))
    print(f"forward products {fwd:.2f} us, backward products {bwd:.2f} us: backward / forward = {bwd / fwd:.3f} "
          f"({time.perf_counter() - t0:.0f} s)")
    write_json("backward_products", {"machine": machine(), "chunk": args.chunk, "dim": args.dim,
                                     "rounds": args.rounds, "rows": rows, "forward_us": fwd, "backward_us": bwd,
                                     "ratio": bwd / fwd}, path=args.out)


if __name__ == "__main__":
    main()
