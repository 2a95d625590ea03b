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

from _common import interleaved_medians, machine, positive_int, print_machine, table, write_json

from numba import njit  # noqa: E402

from linattn_nb._blas import single_threaded_blas  # noqa: E402
from linattn_nb.ops._gemm import gemm  # noqa: E402

@njit
def _run(reps, ta, tb, m, n, k, A, lda, B, ldb, beta, out, ldc):
    """``reps`` calls of ``out = op(A) op(B) + beta out`` through the kernels' ``gemm``."""
    for _ in range(reps):
        gemm(ta, tb, m, n, k, 1.0, A, 0, lda, B, 0, ldb, beta, out, 0, ldc)


def products(C, F, M1, rng):
    """``(name, pass, flops, gemm arguments)`` of each product of one chunk, float32 operands."""
    M = M1 - 1

    def mat(*shape):
        return rng.random(shape).astype(np.float32)

    Q, K, V1, G1 = mat(C, F), mat(C, F), mat(C, M1), mat(C, M1)
    Ht, Hw, X, R, P, A = mat(M1, F), mat(F, M1), mat(C, F + C), mat(F + C, M1), mat(C, C), mat(C, C)
    outF, outC, outM, part = (np.zeros(s, np.float32) for s in ((C, F), (C, C), (C, M1), (F, M1)))
    # gemm arguments: (ta, tb, m, n, k, A, lda, B, ldb, beta, out, ldc), row-major as the kernels call it
    return (
        ("fwd A = Q K^T", "forward", C * C * F, (0, 1, C, C, F, Q, F, K, F, 0.0, outC, C)),
        ("fwd [Q | A] [H ; V 1]", "forward", C * M1 * (F + C), (0, 0, C, M1, F + C, X, F + C, R, M1, 0.0, outM, M1)),
        ("fwd K^T [V 1]", "forward", F * M1 * C, (1, 0, F, M1, C, K, F, V1, M1, 0.0, part, M1)),
        ("T = G S^T", "backward", C * F * M, (0, 0, C, F, M, G1, M1, Ht, F, 0.0, outF, F)),
        ("A = Q K^T", "backward", C * C * F, (0, 1, C, C, F, Q, F, K, F, 0.0, outC, C)),
        ("P0 = G V^T", "backward", C * C * M, (0, 1, C, C, M, G1, M1, V1, M1, 0.0, outC, C)),
        ("dq += dA K", "backward", C * F * C, (0, 0, C, F, C, P, C, K, F, 1.0, outF, F)),
        ("dk = dA^T Q", "backward", C * F * C, (1, 0, C, F, C, P, C, Q, F, 0.0, outF, F)),
        ("dv = A^T g1", "backward", C * M1 * C, (1, 0, C, M1, C, A, C, G1, M1, 0.0, outM, M1)),
        ("K^T [V 1]", "backward", F * M1 * C, (1, 0, F, M1, C, K, F, V1, M1, 0.0, part, M1)),
        ("dk += [V 1] R^T", "backward", C * F * M1, (0, 0, C, F, M1, V1, M1, Ht, F, 1.0, outF, F)),
        ("dv += K R", "backward", C * M1 * F, (0, 0, C, M1, F, K, F, Hw, M1, 1.0, outM, M1)),
        ("R += Q^T g1", "backward", F * M1 * C, (1, 0, F, M1, C, Q, F, G1, M1, 0.0, part, M1)),
    )


def measure(C, D, rounds, reps=2000):
    """Rows of the table: each product's median time (s) and GFLOP/s, float32, C tokens, D = M."""
    table_ = products(C, D, D + 1, np.random.default_rng(0))
    cases = {name: (lambda a=args: _run(reps, *a)) for name, _, _, args in table_}
    with single_threaded_blas(True):
        med, _ = interleaved_medians(cases, rounds)  # calls each case twice first: compiled and warm
    rows = []
    for name, which, flops, _ in table_:
        t = med[name] / reps
        rows.append({"product": name, "pass": which, "us": t * 1e6, "gflops": 2.0 * flops / t / 1e9})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk", type=positive_int, default=48, help="tokens a chunk (default 48)")
    ap.add_argument("--dim", type=positive_int, default=64, help="D = M (default 64)")
    ap.add_argument("--rounds", type=positive_int, default=7, help="interleaved rounds (default 7)")
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
