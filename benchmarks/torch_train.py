"""Training-step speed on the CPU: the torch adapter against plain torch, with its targets.

Run::

    python benchmarks/torch_train.py            # B*H = 16, N = 4096, D = M = 64, float32, ELU+1, additive, causal
    python benchmarks/torch_train.py --quick    # 3 rounds
    python benchmarks/torch_train.py --n 512 --method quadratic --rounds 2   # a smoke run of the reference

Three ways to compute the same causal, normalised ELU+1 linear attention
(``o_t = phi(q_t)^T S_t / phi(q_t)^T z_t``), each timed for the forward alone
and for forward + backward (``out.backward(g)`` for a fixed random ``g``),
side by side in interleaved rounds (every round times every case once, the
median of ``--inner`` calls; the table gives the median over rounds):

* ``adapter``: :func:`linattn_nb.torch.linear_attention` (the Numba forward
  and backward kernels through the autograd Function, ``method`` as given,
  ``check_finite=False``);
* ``torch chunked``: torch autograd through a plain torch implementation of
  the chunked form with chunk size ``--chunk`` (64), written with batched
  matmuls the way fla's naive chunk reference is: per-chunk ``K^T V``, an
  exclusive cumulative sum over chunks for the states, ``Q S`` plus the
  masked intra-chunk ``(Q K^T ⊙ M) V``, and the same for the normaliser;
* ``torch SDPA``: ``torch.nn.functional.scaled_dot_product_attention(q, k, v,
  is_causal=True)`` (softmax attention, the quadratic baseline).

Targets (forward + backward): the adapter >= 2x faster than ``torch
chunked`` and >= 3x faster than ``torch SDPA``.  The outputs and gradients
of the adapter and of ``torch chunked`` are compared once (relative
Frobenius error) so the two compute the same thing.  Thread counts are the
libraries' defaults (all cores for torch and for Numba); they are printed.
Results: benchmarks/results/torch_train.json.  Counts and sizes (``--rounds``,
``--inner``, ``--n``, ``--chunk``, ...) must be positive integers.
"""
from __future__ import annotations

import argparse

import numpy as np
from _common import cpu_model, interleaved_medians, machine, positive_int, print_machine, table, write_json

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import linattn_nb.torch as lt  # noqa: E402


def elu1(x):
    return F.elu(x) + 1.0


def torch_chunked(q, k, v, chunk=64, eps=1e-8):
    """Causal normalised ELU+1 linear attention in plain torch, chunk by chunk with batched matmuls.

    ``q, k`` (B, H, N, D), ``v`` (B, H, N, M), N a multiple of ``chunk``.  The
    state entering chunk ``c`` is the sum of ``phi(K_j)^T V_j`` over the chunks
    before it (an exclusive cumulative sum), so every chunk's output is
    ``phi(Q) S_prev + tril(phi(Q) phi(K)^T) V`` (mask including the diagonal,
    Yang et al. 2024, §2.2), and the normaliser the same with ``V = 1``.
    """
    B, H, N, D = q.shape
    M = v.shape[-1]
    n = N // chunk
    qf = elu1(q).reshape(B, H, n, chunk, D)
    kf = elu1(k).reshape(B, H, n, chunk, D)
    vc = v.reshape(B, H, n, chunk, M)
    kv = kf.transpose(-1, -2) @ vc  # (B, H, n, D, M)
    kv = torch.cat([torch.zeros_like(kv[:, :, :1]), kv[:, :, :-1]], dim=2).cumsum(2)  # state before each chunk
    ksum = kf.sum(-2)  # (B, H, n, D)
    ksum = torch.cat([torch.zeros_like(ksum[:, :, :1]), ksum[:, :, :-1]], dim=2).cumsum(2)
    mask = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    att = (qf @ kf.transpose(-1, -2)).masked_fill(~mask, 0.0)  # (B, H, n, C, C)
    num = qf @ kv + att @ vc
    den = (qf * ksum.unsqueeze(-2)).sum(-1) + att.sum(-1)
    return (num / den.clamp_min(eps).unsqueeze(-1)).reshape(B, H, N, M)


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    ap.add_argument("--bh", type=positive_int, default=16, help="B*H (as B=1, H=bh)")
    ap.add_argument("--n", type=positive_int, default=4096)
    ap.add_argument("--d", type=positive_int, default=64, help="D = M")
    ap.add_argument("--chunk", type=positive_int, default=64, help="chunk size of the torch chunked reference")
    ap.add_argument("--method", default="auto", help="the adapter's method (default auto)")
    ap.add_argument("--rounds", type=positive_int, default=None, help="interleaved rounds (default 7; --quick 3)")
    ap.add_argument("--inner", type=positive_int, default=1, help="calls per measurement (their median counts)")
    ap.add_argument("--torch-threads", type=positive_int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/torch_train.json)")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 7
    if args.n % args.chunk:
        ap.error(f"--n ({args.n}) must be a multiple of --chunk ({args.chunk})")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    import numba

    g = torch.Generator().manual_seed(0)
    shape = (1, args.bh, args.n, args.d)
    q, k, v = (torch.randn(*shape, generator=g).requires_grad_() for _ in range(3))
    gout = torch.randn(*shape, generator=g)

    def adapter(qq, kk, vv):
        return lt.linear_attention(qq, kk, vv, causal=True, method=args.method, check_finite=False)

    def chunked(qq, kk, vv):
        return torch_chunked(qq, kk, vv, args.chunk)

    def sdpa(qq, kk, vv):
        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)

    impls = {"adapter": adapter, "torch chunked": chunked, "torch SDPA": sdpa}

    def fwd(fn):
        def run():
            with torch.no_grad():
                fn(q, k, v)
        return run

    def fwd_bwd(fn):
        def run():
            q.grad = k.grad = v.grad = None
            fn(q, k, v).backward(gout)
        return run

    # the adapter and the torch reference compute the same thing
    o_a = adapter(q, k, v)
    ga = torch.autograd.grad(o_a, (q, k, v), gout)
    o_c = chunked(q, k, v)
    gc = torch.autograd.grad(o_c, (q, k, v), gout)
    agree = {"out": _rel(o_a, o_c), **{f"d{n}": _rel(a, c) for n, a, c in zip("qkv", ga, gc)}}

    cases = {}
    for name, fn in impls.items():
        cases[f"{name}|fwd"] = fwd(fn)
        cases[f"{name}|fwd+bwd"] = fwd_bwd(fn)
    med, times = interleaved_medians(cases, args.rounds, args.inner)

    print_machine()
    print(f"CPU: {cpu_model()}; torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"Numba {numba.__version__} ({numba.get_num_threads()} threads)")
    print(f"causal ELU+1 normalised linear attention, B*H = {args.bh}, N = {args.n}, D = M = {args.d}, float32; "
          f"adapter method={args.method!r}, torch chunk {args.chunk}; medians of {args.rounds} interleaved rounds "
          f"({args.inner} call(s) each)")
    base = med["adapter|fwd+bwd"]
    rows = []
    for name in impls:
        f_ms, fb_ms = med[f"{name}|fwd"] * 1e3, med[f"{name}|fwd+bwd"] * 1e3
        rows.append({"case": name, "forward ms": f_ms, "fwd+bwd ms": fb_ms, "bwd ms (diff)": fb_ms - f_ms,
                     "fwd+bwd / adapter": med[f"{name}|fwd+bwd"] / base})
    cols = ["forward ms", "fwd+bwd ms", "bwd ms (diff)", "fwd+bwd / adapter"]
    print(table(rows, ["case", *cols], {c: "{:.2f}" for c in cols}))
    print("adapter vs torch chunked (relative Frobenius): "
          + ", ".join(f"{key} {val:.1e}" for key, val in agree.items()))
    targets = {
        "adapter fwd+bwd >= 2x faster than torch chunked": med["torch chunked|fwd+bwd"] / base >= 2.0,
        "adapter fwd+bwd >= 3x faster than torch SDPA": med["torch SDPA|fwd+bwd"] / base >= 3.0,
    }
    for what, ok in targets.items():
        print(f"  {'met' if ok else 'NOT met'}: {what}")
    path = write_json("torch_train", {
        "machine": machine(), "cpu_model": cpu_model(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "args": vars(args), "rows": rows, "targets": targets,
        "agreement": agree, "ms_all": {key: [t * 1e3 for t in ts] for key, ts in times.items()}}, args.out)
    print(f"wrote {path}")
    return rows, targets


if __name__ == "__main__":
    main()
