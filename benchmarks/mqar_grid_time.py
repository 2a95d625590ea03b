"""The whole MQAR grid's time, from its per-step costs measured on a local Dask cluster.

Run::

    python benchmarks/mqar_grid_time.py                 # every point of the whole grid, one seed, 2 workers
    python benchmarks/mqar_grid_time.py --workers 1     # the same one after another (no Dask)
    python benchmarks/mqar_grid_time.py --layers delta,softmax --steps 6

Running the whole grid (``LINATTN_NB_MQAR_GRID=all linattn mqar``: every layer, four head dimensions,
kv 4, 8, 16, 32, three seeds, 600 steps and an evaluation every 100) takes hours on 2 cores.  This
script measures what it is made of instead: for every (layer, head dimension, kv) of that grid, on
seed 0, it builds the model and data exactly as a run of the study does (:func:`linattn_nb.studies.
mqar.run`), then times the set-up (data and model), ``--warm`` training steps (compilation and first
calls), ``--steps`` training steps (their median) and one evaluation, each point a task of a local Dask
cluster of ``--workers`` single-threaded worker processes (``LocalCluster(n_workers, threads_per_worker=1)``;
the study's own runs also use one torch thread each).  The whole grid's time is then

    sum over points of 3 seeds x (set-up + 600 x step + 6 evaluations)

one run after another, and that divided by the number of workers on the cluster measured (the runs
are independent; the points' own times were measured two at a time, so they include that contention).
Printed per layer, with the machine line; ``--out`` writes the per-point times as JSON.
"""
from __future__ import annotations

import argparse
import json
import time

from _common import machine, nonnegative_int, positive_int, print_machine


def _point_time(layer, head_dim, kv, warm, steps):
    """Seconds of one grid point: set-up, median training step, one evaluation (seed 0)."""
    import statistics

    import torch

    from linattn_nb.studies import mqar as S

    torch.set_num_threads(1)
    p = [q for q in S.points(_Ctx(), grid="all") if (q["layer"], q["head_dim"], q["kv"], q["seed"]) ==
         (layer, head_dim, kv, 0)][0]
    t0 = time.perf_counter()
    attn = S.LAYERS[layer][1]
    attn = dict(attention="softmax") if attn is None else dict(attn)
    attn["head_dim"] = head_dim
    x_train, y_train = S.mqar(p["n_train"], vocab=p["vocab"], kv=kv, length=p["length"], seed=[0, 1])
    x_test, y_test = S.mqar(p["n_test"], vocab=p["vocab"], kv=kv, length=p["length"], seed=[0, 2])
    torch.manual_seed(0)
    model = S.Model(p["vocab"], d=p["d_model"], heads=p["heads"], layers=S.LAYERS_N, **attn)
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], betas=(0.9, 0.98), weight_decay=0.1)
    setup = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    F = torch.nn.functional
    times = []
    for i in range(warm + steps):
        t = time.perf_counter()
        idx = torch.randint(0, len(x_train), (64,), generator=gen)
        loss = F.cross_entropy(model(x_train[idx]).reshape(-1, p["vocab"]), y_train[idx].reshape(-1),
                               ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i >= warm:
            times.append(time.perf_counter() - t)
    t = time.perf_counter()
    S.accuracy(model, x_test, y_test)
    ev = time.perf_counter() - t
    return dict(layer=layer, head_dim=head_dim, kv=kv, length=p["length"], setup_s=setup,
                step_s=statistics.median(times), eval_s=ev, steps=p["steps"], seeds=3,
                evals=-(-p["steps"] // p["eval_every"]))


class _Ctx:
    """The bits of a study context that ``points(grid="all")`` reads (none: the whole grid is fixed)."""

    def pick(self, **kw):  # pragma: no cover - not reached with grid="all"
        raise AssertionError


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=positive_int, default=2)
    ap.add_argument("--layers", default=None, help="comma-separated layer keys (default: every layer)")
    ap.add_argument("--warm", type=nonnegative_int, default=3)
    ap.add_argument("--steps", type=positive_int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from linattn_nb.studies import mqar as S

    pts = sorted({(q["layer"], q["head_dim"], q["kv"]) for q in S.points(_Ctx(), grid="all")},
                 key=lambda t: (list(S.LAYERS).index(t[0]), t[1], t[2]))
    if args.layers:
        keep = set(args.layers.split(","))
        pts = [p for p in pts if p[0] in keep]
    print_machine()
    print(f"# {len(pts)} points (layer, head dim, kv) of the whole grid, seed 0; {args.warm} warm-up and "
          f"{args.steps} timed steps each; {args.workers} worker(s)")
    t0 = time.perf_counter()
    if args.workers > 1:
        from dask.distributed import Client, LocalCluster

        with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                          dashboard_address=None) as cluster, Client(cluster) as client:
            futs = [client.submit(_point_time, *p, args.warm, args.steps, pure=False) for p in pts]
            res = client.gather(futs)
    else:
        res = [_point_time(*p, args.warm, args.steps) for p in pts]
    wall = time.perf_counter() - t0
    by_layer = {}
    for r in res:
        r["run_s"] = r["setup_s"] + r["steps"] * r["step_s"] + r["evals"] * r["eval_s"]
        by_layer.setdefault(r["layer"], []).append(r)
    total = 0.0
    width = max(len(S.LAYERS[layer][0]) for layer in by_layer)
    print(f"{'layer':<{width}} {'points':>6} {'step ms (min-max)':>18} {'3 seeds, h':>11}")
    for layer, rs in by_layer.items():
        h = sum(3 * r["run_s"] for r in rs) / 3600
        total += h
        steps = [1e3 * r["step_s"] for r in rs]
        print(f"{S.LAYERS[layer][0]:<{width}} {len(rs):>6} {f'{min(steps):.0f}-{max(steps):.0f}':>18} {h:>11.2f}")
    print(f"whole grid ({3 * len(res)} runs): {total:.1f} h of runs (each timed {max(args.workers, 1)} at a time on "
          f"this machine), so {total / max(args.workers, 1):.1f} h on {max(args.workers, 1)} worker(s) and about "
          f"{total:.1f} h / N on N such workers; this measurement took {wall:.0f} s wall")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(machine=machine(), workers=args.workers, warm=args.warm, steps=args.steps,
                           wall_s=wall, total_h=total, points=res), fh, indent=1)
        print(f"# wrote {args.out}")


if __name__ == "__main__":
    main()
