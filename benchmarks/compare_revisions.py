"""Two checkouts of linattn_nb side by side: same outputs? same speed?

Run::

    git worktree add /tmp/linattn_old <commit>     # or: git archive <commit> | tar -x -C /tmp/linattn_old
    python benchmarks/compare_revisions.py --against /tmp/linattn_old --check
    python benchmarks/compare_revisions.py --against /tmp/linattn_old --rounds 9

Each checkout runs in its own worker process (its directory first on
``sys.path``, its own Numba cache directory keyed on a hash of its sources, so
that neither loads machine code compiled from the other's helpers).  The
driver sends the workers one request at a time, so only one of them computes
at any moment.

``--check`` runs a fixed set of calls through the public API (every CPU
method, the four inline feature-map codes, float16/32/64, sequence-parallel
and batch-parallel, initial states, non-causal, softmax, the decode-step
kernels and the KV cache) in both checkouts and reports, per call, whether
the outputs and final states are bit-identical (``np.array_equal``, NaN equal
to NaN) and otherwise the largest difference relative to the output's scale.

Without ``--check`` it times the cases below in interleaved rounds: in every
round each case runs once in each checkout (the order old/new alternates
between rounds), ``--inner`` calls per measurement, of which the median
counts.  Per case it prints the median over the rounds of each checkout and
``new / old`` -- the ratio of the medians, the median of the per-round
ratios and the ratio of the fastest rounds.  On a shared machine the load changes under both alike; ``--clock
cpu --threads 1`` (the workers' CPU time on one thread) is steadier still,
as time spent preempted does not count.

Cases (B*H = 16, D = M = 64, feature map "elu", ``check_finite=False``,
through :func:`linattn_nb.linear_attention`): chunked float32 at N = 4096,
N = 512 and N = 64 (where the per-call overhead shows), chunked float64 at N = 4096, the scan at N = 4096 (float32), the
non-causal kernel at N = 4096 (float32), a decode step of
:class:`linattn_nb.LinearAttentionState` (H = 16, one token, float32); the
forgetting rules at N = 4096, float32: the chunked kernel with a per-token
decay and with a per-feature gate, and the gate's scan (log-factors drawn as
``decay_cpu.py`` draws them); and one training step of the training
notebook's model through each checkout's torch adapter, with the delta rule
and with the additive rule (needs torch; N = 128, batch 64, see
``_train_step``); ``linear_attention_vjp`` at N = 1024 and 4096 (additive), and at
N = 4096 with a per-token decay, a per-feature gate and the delta rule (SiLU+L2).
Results: a table on stdout and ``benchmarks/results/compare_revisions.json``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BH, D, M = 16, 64, 64

CASES = {
    # name: (kind, N, dtype)
    "chunked f32 N=4096": ("chunked", 4096, "float32"),
    "chunked f32 N=512": ("chunked", 512, "float32"),
    "chunked f32 N=64": ("chunked", 64, "float32"),
    "chunked f64 N=4096": ("chunked", 4096, "float64"),
    "scan f32 N=4096": ("scan", 4096, "float32"),
    # maps without a kernel code: features computed outside, the kernel reads them as they are
    "chunked identity f32 N=4096": ("chunked-map/identity", 4096, "float32"),
    "chunked dpfp f32 N=4096": ("chunked-map/dpfp", 4096, "float32"),
    "noncausal f32 N=4096": ("noncausal", 4096, "float32"),
    "decode step f32 H=16": ("step", 1, "float32"),
    "vjp causal f32 N=1024": ("vjp", 1024, "float32"),
    "vjp causal f32 N=4096": ("vjp", 4096, "float32"),
    "vjp delta f32 N=4096": ("vjp/delta", 4096, "float32"),
    "vjp gate f32 N=4096": ("vjp/gate", 4096, "float32"),
    "vjp decay f32 N=4096": ("vjp/decay", 4096, "float32"),
    # unnormalised (RetNet's form: no normaliser), the decay and gate rules
    "vjp decay unnormalised f32 N=4096": ("vjp/decay-unnormalised", 4096, "float32"),
    "vjp gate unnormalised f32 N=4096": ("vjp/gate-unnormalised", 4096, "float32"),
    # the forgetting rules: a per-token decay and a per-feature gate, log-factors as decay_cpu.py draws them
    "decay chunked f32 N=4096": ("chunked/decay", 4096, "float32"),
    "gate chunked f32 N=4096": ("chunked/gate", 4096, "float32"),
    "gate scan f32 N=4096": ("scan/gate", 4096, "float32"),
    # the torch adapter's forward and backward (one thread of torch's own), as a training step runs them
    "adapter causal f32 N=4096": ("adapter/additive", 4096, "float32"),
    "adapter gate f32 N=4096": ("adapter/gate", 4096, "float32"),
    "adapter decay unnormalised f32 N=4096": ("adapter/decay", 4096, "float32"),
    "train step delta (nb05)": ("train/delta", 128, "float32"),
    "train step additive (nb05)": ("train/additive", 128, "float32"),
}


# ---------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------
def _train_step(rule: str, n: int):
    """One AdamW step of the training notebook's MQAR model (two blocks of ``LinearAttention``, d = 64,
    2 heads, short convolution 4, vocabulary 64, batch 64, length ``n``; torch on one thread, as the
    notebook sets it), on a fixed random batch.  Built from the checkout's own ``linattn_nb.torch``."""
    import torch
    from torch import nn

    from linattn_nb.torch import LinearAttention

    torch.set_num_threads(1)
    torch.manual_seed(0)
    attn = dict(feature_map="silu_l2", rule="delta") if rule == "delta" else dict(feature_map="elu")
    V, d = 64, 64

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = LinearAttention(d, 2, conv_size=4, **attn)
            self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    emb, blocks, head = nn.Embedding(V, d), nn.ModuleList(Block() for _ in range(2)), nn.Linear(d, V)
    model = nn.ModuleList([emb, blocks, head])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.1)
    x = torch.randint(0, V, (64, n))
    y = torch.where(torch.rand(64, n) < 0.1, torch.randint(0, V, (64, n)), torch.full((64, n), -100))

    def step():
        h = emb(x)
        for b in blocks:
            h = b(h)
        loss = nn.functional.cross_entropy(head(h).reshape(-1, V), y.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


def _adapter_step(np, rule: str, n: int, dtype):
    """Forward and backward of the checkout's ``linattn_nb.torch.linear_attention`` (causal, chunked, ELU+1) at
    B*H = 16, D = M = 64; the decay rule unnormalised (RetNet's form), the gate per feature."""
    import torch

    from linattn_nb.torch import linear_attention

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    q, k, v = (torch.from_numpy(rng.standard_normal((BH, n, d)).astype(dtype)).requires_grad_() for d in (D, D, M))
    g = torch.from_numpy(rng.standard_normal((BH, n, M)).astype(dtype))
    kw = dict(causal=True, method="chunked")
    if rule == "decay":
        kw.update(log_decay=torch.from_numpy(rng.uniform(-0.1, -0.001, size=(BH, n))), normalize=False)
    elif rule == "gate":
        kw.update(log_decay=torch.from_numpy(rng.uniform(-0.5, -0.001, size=(BH, n, D))))

    def step():
        for x in (q, k, v):
            x.grad = None
        linear_attention(q, k, v, **kw).backward(g)

    return step


def _make_case(la, np, name):
    kind, n, dtype = CASES[name]
    if kind.startswith("train/"):
        return _train_step(kind.split("/")[1], n)
    if kind.startswith("adapter/"):
        return _adapter_step(np, kind.split("/")[1], n, dtype)
    rng = np.random.default_rng(0)
    if kind == "step":
        st = la.LinearAttentionState(D, M, batch_shape=(BH,), dtype=dtype)
        q, k, v = (rng.standard_normal((BH, 1, d)).astype(dtype) for d in (D, D, M))
        st.step(q, k, v)
        return lambda: st.step(q, k, v, check_finite=False)
    q, k, v = (rng.standard_normal((BH, n, d)).astype(dtype) for d in (D, D, M))
    out = np.empty((BH, n, M), dtype)
    if kind.startswith("vjp"):
        g = rng.standard_normal((BH, n, M)).astype(dtype)
        kw = {}
        if kind == "vjp/delta":  # SiLU+L2 (DeltaNet's): with ELU+1 features the delta state overflows
            kw = dict(beta=rng.uniform(0.0, 1.0, size=(BH, n)), feature_map="silu_l2")
        elif kind == "vjp/gate":
            kw = dict(log_decay=rng.uniform(-0.5, -0.001, size=(BH, n, D)), method="chunked")
        elif kind == "vjp/decay":  # a per-token decay, drawn as backward_cpu.py draws it
            kw = dict(log_decay=rng.uniform(-0.1, -0.001, size=(BH, n)), method="chunked")
        elif kind == "vjp/decay-unnormalised":
            kw = dict(log_decay=rng.uniform(-0.1, -0.001, size=(BH, n)), method="chunked", normalize=False)
        elif kind == "vjp/gate-unnormalised":
            kw = dict(log_decay=rng.uniform(-0.5, -0.001, size=(BH, n, D)), method="chunked", normalize=False)
        return lambda: la.linear_attention_vjp(q, k, v, g, causal=True, check_finite=False, **kw)
    if kind == "noncausal":
        return lambda: la.linear_attention(q, k, v, causal=False, check_finite=False, out=out)
    if kind.startswith("chunked-map/"):
        fmap = kind.split("/")[1]
        return lambda: la.linear_attention(q, k, v, causal=True, method="chunked", feature_map=fmap,
                                           check_finite=False, out=out)
    if "/" in kind:
        kind, rule = kind.split("/")
        if rule == "decay":
            lg = rng.uniform(-0.1, -0.001, size=(BH, n))
        else:
            lg = rng.uniform(-0.5, -0.001, size=(BH, n, D))  # per feature: ELU+1 keeps D_phi = D
        return lambda: la.linear_attention(q, k, v, causal=True, method=kind, log_decay=lg, check_finite=False,
                                           out=out)
    return lambda: la.linear_attention(q, k, v, causal=True, method=kind, check_finite=False, out=out)


def _check_outputs(la, np):
    """name -> array: the calls of ``--check``."""
    res = {}
    rng = np.random.default_rng(1)
    shapes = [(3, 37, 5, 3), (1, 61, 4, 3), (5, 130, 8, 6)]
    for dtype in ("float16", "float32", "float64"):
        for B, N, Dk, Mv in shapes:
            q, k = (rng.standard_normal((B, N, Dk)).astype(dtype) for _ in range(2))
            v = rng.standard_normal((B, N, Mv)).astype(dtype)
            S0 = rng.standard_normal((B, Dk, Mv))
            z0 = rng.uniform(1, 2, size=(B, Dk))
            for fmap in ("elu", "relu", "squared_relu", "dpfp"):
                qq, kk = (q, k) if fmap == "elu" else (np.abs(q) + 0.25, np.abs(k) + 0.25)
                qq, kk = qq.astype(dtype), kk.astype(dtype)
                for method in ("chunked", "scan", "aggregate"):
                    causal = method != "aggregate"
                    init = None
                    if fmap != "dpfp":
                        init = (S0, z0)
                    key = f"{method}/{dtype}/{B}x{N}x{Dk}x{Mv}/{fmap}"
                    o, s = la.linear_attention(qq, kk, v, causal=causal, method=method, feature_map=fmap,
                                               initial_state=init, return_state=True, check_finite=False)
                    res[key + "/out"] = o
                    res[key + "/S"] = s.S
                    res[key + "/z"] = s.z
            if dtype != "float16":
                for causal in (False, True):
                    res[f"softmax/{dtype}/{B}x{N}/{causal}"] = la.softmax_attention(q, k, v, causal=causal)
    # sequence-parallel splits: force them through the config
    from linattn_nb import config

    old = config.CPU_CHUNKED_MIN_SEGMENT_CHUNKS
    config.CPU_CHUNKED_MIN_SEGMENT_CHUNKS = 1
    try:
        for dtype in ("float32", "float64"):
            q, k = (rng.standard_normal((1, 301, 6)).astype(dtype) for _ in range(2))
            v = rng.standard_normal((1, 301, 5)).astype(dtype)
            o, s = la.linear_attention(q, k, v, causal=True, method="chunked", return_state=True,
                                       initial_state=(rng.standard_normal((1, 6, 5)), rng.uniform(1, 2, (1, 6))))
            res[f"chunked-seqpar/{dtype}/out"] = o
            res[f"chunked-seqpar/{dtype}/S"] = s.S
            res[f"chunked-seqpar/{dtype}/z"] = s.z
    finally:
        config.CPU_CHUNKED_MIN_SEGMENT_CHUNKS = old
    # NaN in the values (check_finite=False): the explicit loop of the chunked kernel
    q, k, v = (rng.standard_normal((2, 40, 4)).astype("float32") for _ in range(3))
    v[0, 17, 1] = np.nan
    res["chunked-nan/out"] = la.linear_attention(q, k, v, causal=True, method="chunked", check_finite=False)
    # decode: state step / query / prefill, KV cache
    for dtype in ("float32", "float64"):
        for fmap in ("elu", "relu", "squared_relu", "identity"):
            st = la.LinearAttentionState(6, 5, batch_shape=(3,), dtype=dtype, feature_map=fmap)
            kp, vp = rng.standard_normal((3, 50, 6)).astype(dtype), rng.standard_normal((3, 50, 5)).astype(dtype)
            if fmap == "identity":
                kp = np.abs(kp) + 0.5
            st.prefill(kp, vp)
            outs = []
            for T in (1, 1, 3):
                q, k = (rng.standard_normal((3, T, 6)).astype(dtype) for _ in range(2))
                if fmap == "identity":
                    q, k = np.abs(q) + 0.5, np.abs(k) + 0.5
                outs.append(st.step(q, k, rng.standard_normal((3, T, 5)).astype(dtype)).ravel())
            q = rng.standard_normal((3, 2, 6)).astype(dtype)
            if fmap == "identity":
                q = np.abs(q) + 0.5
            outs.append(st.query(q).ravel())
            ls = st.to_linear_state()
            res[f"state/{dtype}/{fmap}/out"] = np.concatenate(outs)
            res[f"state/{dtype}/{fmap}/S"] = np.asarray(ls.S)
            res[f"state/{dtype}/{fmap}/z"] = np.asarray(ls.z)
        kv = la.KVCache(6, 5, batch_shape=(3,), dtype=dtype)
        kv.prefill(*(rng.standard_normal((3, 40, d)).astype(dtype) for d in (6, 5)))
        res[f"kv/{dtype}"] = np.concatenate([
            kv.step(*(rng.standard_normal((3, T, d)).astype(dtype) for d in (6, 6, 5))).ravel() for T in (1, 4)])
    return res


def worker(root: str) -> None:
    sys.path.insert(0, root)
    import numpy as np

    import linattn_nb as la

    assert Path(la.__file__).resolve().is_relative_to(Path(root).resolve()), la.__file__
    made = {}
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            return
        if req["op"] == "time":
            fn = made.get(req["case"])
            if fn is None:
                fn = made[req["case"]] = _make_case(la, np, req["case"])
                fn()  # compile / load from the cache, fault the pages in
            clock = time.process_time if req.get("clock") == "cpu" else time.perf_counter
            ts = []
            for _ in range(int(req["inner"])):
                t = clock()
                fn()
                ts.append(clock() - t)
            reply = {"t": statistics.median(ts)}
        elif req["op"] == "check":
            np.savez(req["path"], **_check_outputs(la, np))
            reply = {"ok": True}
        elif req["op"] == "info":
            import numba

            reply = {"file": la.__file__, "threads": numba.get_num_threads()}
        else:
            reply = {"error": f"unknown op {req['op']!r}"}
        print(json.dumps(reply), flush=True)


# ---------------------------------------------------------------------------
# driver side
# ---------------------------------------------------------------------------
def _source_cache_dir(root: Path) -> str:
    digest = hashlib.sha1()
    for path in sorted((root / "linattn_nb").rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    d = root / ".numba_cache" / f"compare-{digest.hexdigest()[:16]}"
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


class Worker:
    """A worker process for one checkout: ``script --worker ROOT [args]``, one JSON request and reply per line.

    ``script`` defaults to this file (``benchmarks/chunked_breakdown.py --against`` runs its own).
    """

    def __init__(self, root: Path, threads, script=None, args=()):
        env = dict(os.environ)
        env["NUMBA_CACHE_DIR"] = _source_cache_dir(root)
        env.pop("NUMBA_ENABLE_CUDASIM", None)
        if threads:
            env["NUMBA_NUM_THREADS"] = str(threads)
        script = Path(script or __file__).resolve()
        self.p = subprocess.Popen([sys.executable, str(script), "--worker", str(root), *args],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/")

    def ask(self, **req):
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker died ({self.p.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def close(self):
        try:
            self.ask(op="quit")
        except (RuntimeError, BrokenPipeError, ValueError):
            pass
        self.p.wait()


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def check(old: Worker, new: Worker, tmp: Path) -> bool:
    import numpy as np

    paths = {}
    for name, w in (("old", old), ("new", new)):
        paths[name] = tmp / f"compare_{name}_{os.getpid()}.npz"
        w.ask(op="check", path=str(paths[name]))
    a, b = (np.load(paths[n]) for n in ("old", "new"))
    same, rows = 0, []
    for key in a.files:
        x, y = a[key], b[key]
        if x.shape == y.shape and np.array_equal(x, y, equal_nan=True):
            same += 1
            continue
        if x.shape != y.shape:
            rows.append((key, "shape", f"{x.shape} vs {y.shape}"))
            continue
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        scale = max(float(np.nanmax(np.abs(x64))), 1e-300)
        diff = float(np.nanmax(np.abs(x64 - y64))) / scale
        rows.append((key, "differs", f"max |new - old| / max |old| = {diff:.3g}"))
    print(f"{same} of {len(a.files)} arrays bit-identical")
    for key, what, detail in rows:
        print(f"  {key}: {what}, {detail}")
    for p in paths.values():
        p.unlink()
    return not rows


def bench(old: Worker, new: Worker, cases, rounds: int, inner: int, clock: str = "wall"):
    times = {c: {"old": [], "new": []} for c in cases}
    for r in range(rounds):
        order = (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))
        for c in cases:
            for name, w in order:
                times[c][name].append(w.ask(op="time", case=c, inner=inner, clock=clock)["t"])
    rows = []
    for c in cases:
        o, n = times[c]["old"], times[c]["new"]
        rows.append({
            "case": c, "old_ms": statistics.median(o) * 1e3, "new_ms": statistics.median(n) * 1e3,
            "ratio_of_medians": statistics.median(n) / statistics.median(o),
            "median_ratio": statistics.median(b / a for a, b in zip(o, n)),
            "ratio_of_minima": min(n) / min(o),
        })
    return rows, times


def _count(text):
    """``type=`` of the count options: :func:`_common.positive_int`, imported only when an option is given
    (a worker process must not import ``_common`` before it sets up its own environment)."""
    from _common import positive_int

    return positive_int(text)


def _count0(text):
    """``type=`` of the options where 0 means something: :func:`_common.nonnegative_int`, imported lazily."""
    from _common import nonnegative_int

    return nonnegative_int(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--against", help="root of the other checkout (the 'old' one)")
    ap.add_argument("--new", default=str(HERE.parent), help="root of the 'new' checkout (default: this one)")
    ap.add_argument("--check", action="store_true", help="compare outputs instead of timing")
    ap.add_argument("--rounds", type=_count, default=9)
    ap.add_argument("--inner", type=_count, default=3, help="calls per measurement (their median counts)")
    ap.add_argument("--threads", type=_count0, default=0, help="NUMBA_NUM_THREADS of the workers (0: Numba's default)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall time, or the worker's CPU time (all its threads; steadier on a shared machine)")
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES), metavar="CASE")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    if not args.against:
        ap.error("--against PATH is required")
    old_root, new_root = Path(args.against).resolve(), Path(args.new).resolve()
    for root in (old_root, new_root):
        if not (root / "linattn_nb" / "__init__.py").is_file():
            ap.error(f"{root} holds no linattn_nb package")
    old, new = Worker(old_root, args.threads), Worker(new_root, args.threads)
    try:
        info = {"old": old.ask(op="info"), "new": new.ask(op="info")}
        print(f"# old: {info['old']['file']}\n# new: {info['new']['file']}")
        print(f"# CPU: {_cpu_model()}, {os.cpu_count()} logical CPUs, Numba threads {info['new']['threads']}")
        from _common import print_machine

        print_machine("# ")
        if args.check:
            ok = check(old, new, Path(os.environ.get("TMPDIR", "/tmp")))
            sys.exit(0 if ok else 1)
        rows, times = bench(old, new, args.cases, args.rounds, args.inner, args.clock)
    finally:
        old.close()
        new.close()
    print(f"# {args.rounds} interleaved rounds, median of {args.inner} calls per measurement, {args.clock} time")
    w = max(len(r["case"]) for r in rows)
    print(f"{'case':<{w}}  {'old ms':>9}  {'new ms':>9}  {'new/old (medians)':>17}  {'median of ratios':>16}  "
          f"{'minima':>6}")
    for r in rows:
        print(f"{r['case']:<{w}}  {r['old_ms']:9.3f}  {r['new_ms']:9.3f}  {r['ratio_of_medians']:17.3f}  "
              f"{r['median_ratio']:16.3f}  {r['ratio_of_minima']:6.3f}")
    sys.path.insert(0, str(HERE))
    from _common import machine, write_json

    write_json("compare_revisions", {"machine": {**machine(), "lscpu_model": _cpu_model()},
                                     "old": str(old_root), "new": str(new_root), "rounds": args.rounds,
                                     "inner": args.inner, "clock": args.clock, "threads": args.threads,
                                     "rows": rows, "times_s": times})


if __name__ == "__main__":
    main()
