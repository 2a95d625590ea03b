"""Speed of the CPU kernels beside a busy core and inside a torch training loop, per thread setting.

Run::

    python benchmarks/contention.py                       # one busy process, the default configurations
    python benchmarks/contention.py --busy 0              # a quiet machine (as quiet as it is)
    python benchmarks/contention.py --configs "nb=1,torch=1" "nb=2,torch=1" --rounds 9
    python benchmarks/contention.py --cases fwd step      # some of the cases

Every configuration runs in a process of its own (the threading layer, the
thread counts and the OpenMP wait policy are fixed when a process starts),
kept alive for the whole run; the parent times every case in every
configuration once per round, the configurations in a new order each round
(interleaved rounds), and gives the median over rounds of each case's
median of ``--inner`` calls.  With ``--busy K`` the parent starts K
processes spinning on ``while True: pass`` before the first round and ends
them after the last.

Configurations (``--configs``, comma-separated ``key=value``):

* ``nb``: Numba threads (``NUMBA_NUM_THREADS``; default all cores);
* ``torch``: ``torch.set_num_threads`` (default torch's, all cores);
* ``layer``: ``NUMBA_THREADING_LAYER`` (``omp``, ``workqueue``, ``tbb`` where installed);
* ``wait``: ``OMP_WAIT_POLICY`` in the worker's environment.  The workers
  import torch before linattn_nb, as training scripts usually do, so without
  ``wait`` torch's OpenMP threads keep GNU OpenMP's default (spin a while
  between ops) and only Numba's pool gets the ``PASSIVE`` linattn_nb sets;
  ``wait=PASSIVE`` makes both wait passively, ``wait=ACTIVE`` both spin;
* ``blas``: ``1`` / ``0``, linattn_nb's single-threaded BLAS around parallel kernels
  (``LINATTN_BLAS_SINGLE_THREAD``);
* ``chunk``: ``numba.set_parallel_chunksize`` (0: Numba's static split);
* ``match``: ``1`` / ``0``, ``config.TORCH_MATCH_THREADS`` (the adapter runs the kernels on
  ``min(Numba's, torch's)`` threads);
* ``tune``: ``off`` / ``load``, ``LINATTN_AUTO_TUNE`` (``off``: the constants' chunk pairs; ``load``:
  this machine's calibration, ``linattn tune``), e.g. ``--busy 0 --configs tune=off tune=load``.

Cases (``--cases``):

* ``fwd``: the headline forward, :func:`linattn_nb.linear_attention` on
  NumPy float32 arrays, B*H = 16, N = 4096, D = M = 64, causal, ELU+1,
  default method;
* ``adapter``: :func:`linattn_nb.torch.linear_attention` forward + backward
  at notebook 05's size (B = 64, H = 2, N = 128, D = M = 32, float32, causal);
* ``step``: one training step of notebooks/05_training.ipynb's model (two
  blocks of :class:`linattn_nb.torch.LinearAttention` with ELU+1, d = 64,
  2 heads, conv 4, an MLP; AdamW; batch 64 of 128 tokens, vocabulary 64);
  random tokens instead of the notebook's task (the cost is the same).

The table gives the median ms per case and configuration, and each one's
ratio to the best configuration of its case in the same run.  Printed with
it: the CPU model, the BLAS (threadpoolctl), the load averages before and
after.  Results: ``--out FILE`` or, for a run of every default configuration and case,
benchmarks/results/contention.json (a ``--cases`` or ``--configs`` run without ``--out``
writes nothing and says so).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIGS = ["nb=1,torch=1", "nb=2,torch=1", "nb=1,torch=2", "nb=2,torch=2", "nb=1,torch=2,wait=PASSIVE",
                   "nb=2,torch=2,wait=PASSIVE", "nb=2,torch=2,wait=PASSIVE,layer=workqueue"]
CASES = ("fwd", "adapter", "step")


# ---------------------------------------------------------------------------
# worker (one per configuration)
# ---------------------------------------------------------------------------
def _worker(spec: dict) -> None:
    import numpy as np
    import torch

    if "torch" in spec:
        torch.set_num_threads(int(spec["torch"]))
    import numba

    import linattn_nb
    import linattn_nb.torch as lt
    from linattn_nb import config

    if "chunk" in spec:
        numba.set_parallel_chunksize(int(spec["chunk"]))
    if "match" in spec and hasattr(config, "TORCH_MATCH_THREADS"):
        config.TORCH_MATCH_THREADS = spec["match"] not in ("0", "false", "no")
    nn, F = torch.nn, torch.nn.functional

    rng = np.random.default_rng(0)
    fq, fk, fv = (rng.standard_normal((16, 4096, 64)).astype(np.float32) for _ in range(3))

    g = torch.Generator().manual_seed(0)
    aq, ak, av = (torch.randn(64, 2, 128, 32, generator=g).requires_grad_() for _ in range(3))
    ag = torch.randn(64, 2, 128, 32, generator=g)

    V, L, BATCH = 64, 128, 64

    class Block(nn.Module):
        def __init__(self, d, heads, **attn):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = lt.LinearAttention(d, heads, conv_size=4, **attn)
            self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class Model(nn.Module):
        def __init__(self, d=64, heads=2, layers=2, **attn):
            super().__init__()
            self.emb = nn.Embedding(V, d)
            self.blocks = nn.ModuleList(Block(d, heads, **attn) for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, V)

        def forward(self, x):
            h = self.emb(x)
            for block in self.blocks:
                h = block(h)
            return self.head(self.ln(h))

    torch.manual_seed(0)
    model = Model(feature_map="elu")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.1)
    x = torch.randint(0, V, (BATCH, L), generator=g)
    y = torch.randint(0, V, (BATCH, L), generator=g)

    def fwd():
        linattn_nb.linear_attention(fq, fk, fv, causal=True)

    def adapter():
        aq.grad = ak.grad = av.grad = None
        lt.linear_attention(aq, ak, av, causal=True, check_finite=False).backward(ag)

    def step():
        loss = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    fns = {"fwd": fwd, "adapter": adapter, "step": step}
    info = {"numba_threads": numba.get_num_threads(), "torch_threads": torch.get_num_threads()}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "warm":
            for name in cmd["cases"]:
                fns[name]()
                fns[name]()
            info["layer"] = numba.threading_layer()
            print(json.dumps(info), flush=True)
        elif cmd["op"] == "time":
            ts = []
            for _ in range(cmd["inner"]):
                t0 = time.perf_counter()
                fns[cmd["case"]]()
                ts.append(time.perf_counter() - t0)
            print(json.dumps({"t": statistics.median(ts)}), flush=True)
        else:
            return


def _parse(cfg: str) -> dict:
    out = {}
    for part in filter(None, cfg.split(",")):
        key, _, val = part.partition("=")
        out[key.strip()] = val.strip()
    return out


def _env(spec: dict) -> dict:
    env = dict(os.environ)
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        env.pop(var, None)
    if "nb" in spec:
        env["NUMBA_NUM_THREADS"] = spec["nb"]
    if "layer" in spec:
        env["NUMBA_THREADING_LAYER"] = spec["layer"]
    if "wait" in spec:
        env["OMP_WAIT_POLICY"] = spec["wait"]
    if "blas" in spec:
        env["LINATTN_BLAS_SINGLE_THREAD"] = spec["blas"]
    if "tune" in spec:
        env["LINATTN_AUTO_TUNE"] = spec["tune"]
    if "blocktime" in spec:
        env["KMP_BLOCKTIME"] = spec["blocktime"]
    return env


def _blas_line() -> str:
    try:
        import _common
        helper = getattr(_common, "blas_line", None)
        if helper is not None:
            return str(helper())
    except Exception:  # pragma: no cover - the helper is optional
        pass
    import scipy.linalg  # noqa: F401  (loads SciPy's BLAS)
    from threadpoolctl import threadpool_info
    return "; ".join(f"{i.get('internal_api')} {i.get('version')} ({i.get('threading_layer', '?')}, "
                     f"{i.get('num_threads')} threads, {os.path.basename(i.get('filepath', ''))})"
                     for i in threadpool_info() if i.get("user_api") == "blas")


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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--busy", type=_count0, default=1, help="busy processes running beside (default 1)")
    ap.add_argument("--rounds", type=_count, default=7)
    ap.add_argument("--inner", type=_count, default=3, help="calls per measurement (their median counts)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/contention.json)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        return _worker(json.loads(args.worker))

    from _common import cpu_model, machine, partial_run_note, write_json

    specs = [_parse(c) for c in args.configs]
    workers = []
    for cfg, spec in zip(args.configs, specs):
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(spec), cwd=HERE)
        workers.append(p)

    def ask(p, cmd):
        p.stdin.write(json.dumps(cmd) + "\n")
        p.stdin.flush()
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {p.args[-1]} ended (exit {p.wait()})")
        return json.loads(line)

    infos = [ask(p, {"op": "warm", "cases": args.cases}) for p in workers]
    load0 = os.getloadavg()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    times = {(c, i): [] for c in args.cases for i in range(len(workers))}
    try:
        time.sleep(0.5 if busy else 0.0)
        order = list(range(len(workers)))
        rnd = random.Random(0)
        for _ in range(args.rounds):
            for case in args.cases:
                rnd.shuffle(order)
                for i in order:
                    times[case, i].append(ask(workers[i], {"op": "time", "case": case, "inner": args.inner})["t"])
    finally:
        for b in busy:
            b.kill()
            b.wait()
        for p in workers:
            try:
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.close()
            except OSError:
                pass
            p.wait()
    load1 = os.getloadavg()

    med = {key: statistics.median(v) for key, v in times.items()}
    print(f"CPU: {cpu_model()}; BLAS: {_blas_line()}")
    print(f"busy processes: {args.busy}; load average (1, 5, 15 min) before {load0[0]:.2f} {load0[1]:.2f} "
          f"{load0[2]:.2f}, after {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; medians of {args.rounds} "
          f"interleaved rounds ({args.inner} calls each)")
    width = max(len(c) for c in args.configs)
    head = f"{'configuration':<{width}s} {'layer':>9s} " + " ".join(f"{c + ' ms':>11s} {'/best':>6s}"
                                                                   for c in args.cases)
    print(head)
    print("-" * len(head))
    rows = []
    for i, cfg in enumerate(args.configs):
        cells, row = [], {"config": cfg, **infos[i]}
        for case in args.cases:
            best = min(med[case, j] for j in range(len(workers)))
            cells.append(f"{med[case, i] * 1e3:11.2f} {med[case, i] / best:6.2f}")
            row[case + "_ms"] = med[case, i] * 1e3
            row[case + "_vs_best"] = med[case, i] / best
            row[case + "_all_ms"] = [t * 1e3 for t in times[case, i]]
        rows.append(row)
        print(f"{cfg:<{width}s} {infos[i]['layer']:>9s} " + " ".join(cells))
    partial = [o for o, on in (("--cases", set(args.cases) != set(CASES)),
                               ("--configs", set(args.configs) != set(DEFAULT_CONFIGS))) if on]
    if args.out is None and partial:
        partial_run_note(" ".join(partial), "contention")
        return rows
    path = write_json("contention", {"machine": machine(), "cpu_model": cpu_model(), "blas": _blas_line(),
                                     "busy": args.busy, "load_before": load0, "load_after": load1,
                                     "args": vars(args), "rows": rows}, args.out)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
