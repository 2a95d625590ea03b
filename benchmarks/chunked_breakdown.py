"""Where the chunked causal kernel's time goes: each step of its chunk loop timed alone, per token.

Run::

    python benchmarks/chunked_breakdown.py              # B*H = 16, N = 4096, 15 rounds
    python benchmarks/chunked_breakdown.py --n 16384 --rounds 9
    git worktree add /tmp/old <rev>
    python benchmarks/chunked_breakdown.py --against /tmp/old   # old against new, interleaved

Shape: B*H = 16 sequences, D = M = 64, float32, feature map "elu", the chunk
size and row block that :mod:`linattn_nb.config` picks; one Numba thread and
the BLAS pinned to one thread, so the figures are per core.

Each step of the kernel's chunk loop (``linattn_nb/ops/causal/chunked.py``)
runs alone over the same chunks, through the kernel's own helpers and with
its scratch shapes:

* ``products``: the three BLAS products of every chunk (``A = phi(Q) phi(K)^T``
  and ``[phi(Q) | A] [H ; V 1]`` per row block, ``phi(K)^T [V 1]``);
* ``read q, k, v + features``: :func:`linattn_nb.ops._blocks.load_chunk`;
* ``state update``: the float64 state sum and its working-dtype copy
  (:func:`linattn_nb.ops._rules.absorb`);
* ``normalise + write output``: the division by the normaliser and the store.

The whole kernel (its launcher, ``causal_chunked``: no input checks) is timed
in the same rounds, interleaved with the steps, on the same data and once
more on its first sequence alone, 16 times over (N KiB of q, k, v and
output: 4 MiB at N = 4096, which stays in the L3 cache): the difference
between the two is what streaming q, k, v from memory and the output to it
costs.  The steps
overlap in the kernel (a load that misses the cache runs while the products
of the previous chunk finish), so the whole takes less than their sum.
Results: a table on stdout and ``benchmarks/results/chunked_breakdown.json``.

``--against DIR`` times another checkout's kernel and helpers beside this
one's: one worker process per checkout (its package first on ``sys.path``,
its own Numba cache, one thread), the rounds interleaved and their order
alternated, so both see the same load; the table gives each step old and
new per token, their ratio, and the work around the BLAS products (whole
kernel minus products).  The steps are this script's,
called with the other checkout's helpers: a revision whose helpers changed
signature stops its worker with an error.
``benchmarks/results/chunked_breakdown_against.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numba
import numpy as np
from _common import ROOT, machine, positive_int, print_machine, table, write_json
from numba import njit

if "--worker" in sys.argv:  # --against: this process times the steps of the checkout named after --worker
    sys.path.insert(0, sys.argv[sys.argv.index("--worker") + 1])

from linattn_nb import config
from linattn_nb._blas import single_threaded_blas
from linattn_nb.ops._blocks import load_chunk
from linattn_nb.ops._codes import KERNEL_CODE_ELU
from linattn_nb.ops._gemm import gemm
from linattn_nb.ops._rules import absorb
from linattn_nb.ops.causal.chunked import causal_chunked

BH, D, M = 16, 64, 64
ELU = KERNEL_CODE_ELU


def _scratch(C):
    """The kernel's per-thread scratch for chunk size C, filled with small finite values."""
    F, M1 = D, M + 1
    X = np.full((C, F + C), 0.01, np.float32)
    R = np.full((F + C, M1), 0.01, np.float32)
    fk = np.full((C, F), 0.01, np.float32)
    o = np.ones((C, M1), np.float32)
    part = np.zeros((F, M1), np.float32)
    return X, R, fk, o, part


@njit(cache=False)
def _products(B, N, X, R, fk, o, part, bs):
    F = fk.shape[1]
    C = fk.shape[0]
    LX = F + C
    M1 = R.shape[1]
    for b in range(B):
        for s0 in range(0, N, C):
            n = min(C, N - s0)
            for r0 in range(0, n, bs):
                ce = min(r0 + bs, n)
                gemm(0, 1, ce - r0, ce, F, 1.0, X, r0 * LX, LX, fk, 0, F, 0.0, X, r0 * LX + F, LX)
                gemm(0, 0, ce - r0, M1, F + ce, 1.0, X, r0 * LX, LX, R, 0, M1, 0.0, o, r0 * M1, M1)
            gemm(1, 0, F, M1, n, 1.0, fk, 0, F, R, F * M1, M1, 0.0, part, 0, M1)


@njit(cache=False)
def _read(q, k, v, X, R, fk):
    B, N, F = q.shape
    C = fk.shape[0]
    ok = True
    for b in range(B):
        for s0 in range(0, N, C):
            _, read_ok = load_chunk(q, k, v, b, s0, min(C, N - s0), X, fk, R, F, ELU, True)
            ok &= read_ok  # (values finite, every element read finite): the kernel keeps both
    return ok


@njit(cache=False)
def _state(B, N, C, R, part):
    for b in range(B):
        H = np.zeros(part.shape)
        for _ in range(0, N, C):
            absorb(H, part, R)


@njit(cache=False, error_model="numpy")
def _output(out, o):
    B, N, M = out.shape
    C = o.shape[0]
    for b in range(B):
        for s0 in range(0, N, C):
            for t in range(min(C, N - s0)):
                r = 1.0 / o[t, M]
                for m in range(M):
                    out[b, s0 + t, m] = o[t, m] * r


def _product_flops(C, bs):
    """FLOP per token of the three products, for a whole chunk of C tokens."""
    total = 2.0 * D * (M + 1) * C  # phi(K)^T [V 1]
    for r0 in range(0, C, bs):
        rows, ce = min(bs, C - r0), min(r0 + bs, C)
        total += 2.0 * rows * ce * D + 2.0 * rows * (D + ce) * (M + 1)
    return total / C


def _steps(N):
    """(steps, C, bs): name -> a call timing one step of the chunk loop over B*H sequences of N tokens."""
    numba.set_num_threads(1)
    C = config.cpu_chunk_size(N, D, M, np.float32)
    bs = max(1, min(C, config.cpu_chunk_block(C, D, M, np.float32)))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((BH, N, d), dtype=np.float32) for d in (D, D, M))
    qc, kc, vc = (x[:1].copy() for x in (q, k, v))  # one sequence: N KiB of q, k, v and output
    out = np.empty_like(v)
    X, R, fk, o, part = _scratch(C)
    oc = np.empty_like(vc)

    def kernel(q, k, v, out):
        # the launcher of method="chunked", without the public function's checks
        H = np.zeros((q.shape[0], D, M + 1))
        causal_chunked(q, k, v, H, out, code=ELU, eps=config.DEFAULT_EPS, chunk=C, block=bs)

    def cached():
        for _ in range(BH):
            kernel(qc, kc, vc, oc)

    steps = {
        "whole kernel": lambda: kernel(q, k, v, out),
        "products (3 BLAS calls per chunk)": lambda: _products(BH, N, X, R, fk, o, part, bs),
        "read q, k, v + features": lambda: _read(q, k, v, X, R, fk),
        "state update (float64)": lambda: _state(BH, N, C, R, part),
        "normalise + write output": lambda: _output(out, o),
        "whole kernel, one sequence 16x (in L3)": cached,
    }
    return steps, C, bs


def _worker(N):
    """--against's worker: each request line runs every step once (in the order given) and replies with seconds."""
    import linattn_nb

    steps, C, bs = _steps(N)
    with single_threaded_blas():
        for fn in steps.values():  # compile, fault the pages in
            fn()
        print(json.dumps({"file": linattn_nb.__file__, "chunk": C, "block": bs, "steps": list(steps)}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            if req.get("op") == "quit":
                return
            res = {}
            for name in req["order"]:
                t = time.perf_counter()
                steps[name]()
                res[name] = time.perf_counter() - t
            print(json.dumps(res), flush=True)


def _against(args):
    """Old (``--against``) and new (this checkout) side by side: each round times every step in both workers."""
    from compare_revisions import Worker

    info = machine()
    ws = {"new": Worker(ROOT, 1, __file__, ("--n", str(args.n))),
          "old": Worker(Path(args.against).resolve(), 1, __file__, ("--n", str(args.n)))}
    hello = {}
    for k, w in ws.items():
        line = w.p.stdout.readline()
        if not line:
            raise SystemExit(f"the {k} worker died ({w.p.wait()}): its helpers may not match this script's steps")
        hello[k] = json.loads(line)
    names = hello["new"]["steps"]
    print_machine("# ")
    print(f"# chunked kernel steps, old against new, one core: B*H={BH}, N={args.n}, D=M={D}, float32, elu, "
          f"chunk {hello['new']['chunk']}/{hello['old']['chunk']} (new/old) -- {info['date']}, {info['cpu']}")
    print(f"# new: {hello['new']['file']}\n# old: {hello['old']['file']}")
    times = {k: {n: [] for n in names} for k in ws}
    for r in range(args.rounds):
        for k in (("new", "old") if r % 2 else ("old", "new")):
            w = ws[k]
            w.p.stdin.write(json.dumps({"order": names}) + "\n")
            w.p.stdin.flush()
            for n, t in json.loads(w.p.stdout.readline()).items():
                times[k][n].append(t)
    for w in ws.values():
        w.p.stdin.write(json.dumps({"op": "quit"}) + "\n")
        w.p.stdin.flush()
        w.p.wait()
    ns = {k: {n: float(np.median(ts)) / (BH * args.n) * 1e9 for n, ts in times[k].items()} for k in ws}
    for k in ws:  # the work around the BLAS products: whole - products
        ns[k]["non-BLAS (whole - products)"] = ns[k]["whole kernel"] - ns[k]["products (3 BLAS calls per chunk)"]
    rows = [{"step": n, "old ns/token": ns["old"][n], "new ns/token": ns["new"][n],
             "new/old": ns["new"][n] / ns["old"][n]} for n in ns["new"]]
    print(table(rows, ["step", "old ns/token", "new ns/token", "new/old"],
                {"old ns/token": "{:.1f}", "new ns/token": "{:.1f}", "new/old": "{:.3f}"}))
    write_json("chunked_breakdown_against", {"machine": info, "n": args.n, "rounds": args.rounds,
                                             "against": str(Path(args.against).resolve()), "rows": rows,
                                             "times_s": times})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=positive_int, default=4096, help="tokens per sequence")
    ap.add_argument("--rounds", type=positive_int, default=15)
    ap.add_argument("--against", metavar="DIR", help="another checkout (the 'old' one): both timed side by side, "
                    "interleaved, each in its own process (e.g. git worktree add /tmp/old <rev>)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.n < 1 or args.rounds < 1:
        ap.error("--n and --rounds must be >= 1")
    if args.worker:
        return _worker(args.n)
    if args.against:
        return _against(args)
    N = args.n
    steps, C, bs = _steps(N)
    info = machine()
    print_machine("# ")
    print(f"# chunked kernel, one core: B*H={BH}, N={N}, D=M={D}, float32, elu, chunk {C}, "
          f"row block {bs} -- {info['date']}, {info['cpu']}")
    tokens = {name: BH * N for name in steps}
    with single_threaded_blas():
        for fn in steps.values():  # compile, fault the pages in
            fn()
        times = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, fn in steps.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    per_tok = {name: float(np.median(ts)) / tokens[name] * 1e9 for name, ts in times.items()}
    parts = [n for n in steps if not n.startswith("whole")]
    rows = [{"step": n, "ns_per_token": per_tok[n],
             "of_whole": per_tok[n] / per_tok["whole kernel"]} for n in steps]
    rows.append({"step": "sum of the steps", "ns_per_token": sum(per_tok[n] for n in parts),
                 "of_whole": sum(per_tok[n] for n in parts) / per_tok["whole kernel"]})
    print(table(rows, ["step", "ns_per_token", "of_whole"], {"ns_per_token": "{:.1f}", "of_whole": "{:.2f}"}))
    flops = _product_flops(C, bs)
    print(f"products: {flops / per_tok[parts[0]]:.0f} GFLOP/s per core ({flops:.0f} FLOP per token in "
          f"chunks of {C}, row blocks of {bs}; the useful work 4*D*M is {4 * D * M})")
    write_json("chunked_breakdown", {"machine": info, "n": N, "chunk": C, "block": bs,
                                     "rounds": args.rounds, "rows": rows,
                                     "times_s": {n: ts for n, ts in times.items()}})


if __name__ == "__main__":
    main()
