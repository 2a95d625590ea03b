"""Decode latency and memory: linear-attention state vs softmax KV cache.

"Transformers are RNNs" (Katharopoulos et al. 2020, §3.4, Fig. 1 and §4.2)
reports constant time and memory per generated token for the recurrent form,
against softmax attention whose per-token cost grows with the context.  This
script reproduces that shape on the CPU:

* for each context length L, prefill L tokens into a
  :class:`linattn_nb.LinearAttentionState` and a :class:`linattn_nb.KVCache`
  (H heads, D = M, float32 by default), then time single-token decode steps
  as a user calls them (``state.step(q, k, v)``, Python overhead included);
* report the median step latency (and the 10th/90th percentiles), tokens per
  second, the bytes each holds, the crossover length where the KV cache
  becomes slower than the state, and the KV/state ratio at 64k.  The KV step
  is timed with its serial and its parallel kernel (the better one counts):
  on a shared machine a parallel region can wait a scheduler time slice for
  its second thread.  Each KV step attends to exactly L + 1 tokens (the new
  token is dropped again, untimed, with ``KVCache.truncate``).

Targets: state step <= 10 us at H = 16, D = M = 64, float32, flat
within +-20% from 1k to 256k; KV step at 64k >= 100x the state step.  The
table measures one context after another; the flatness is then measured
again in interleaved rounds over the contexts from 1k (``--rounds``), which a
shared host's changing load cannot bias towards one context.

Usage::

    python benchmarks/decode.py                  # full sweep, 16 .. 262144 tokens
    python benchmarks/decode.py --quick          # up to 16k, fewer steps
    python benchmarks/decode.py --contexts 1024 65536 --steps 5000

Prints a table and writes JSON to ``--out FILE`` or, for a full run, to
benchmarks/results/decode.json (a partial run -- ``--quick``, ``--contexts``,
``--rounds 0``, ``--no-kernel-compare`` -- without ``--out`` writes nothing and
says so).  Counts and sizes must be positive (``--rounds`` may be 0).  Timings are
medians over many steps; on a shared machine, run it when it is quiet and
compare numbers from one run only.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import linattn_nb as la  # noqa: E402
from linattn_nb import config  # noqa: E402
from linattn_nb.ops.step import cpu as step_cpu  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine_info():
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import numba

    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "numpy": np.__version__, "numba": numba.__version__, "platform": platform.platform()}
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def fill(obj, L, H, D, M, dtype, rng, chunk=8192):
    """Prefill ``obj`` with L random tokens, chunk by chunk (bounded extra memory)."""
    done = 0
    while done < L:
        n = min(chunk, L - done)
        k = rng.standard_normal((H, n, D), dtype=np.float32).astype(dtype, copy=False)
        v = rng.standard_normal((H, n, M), dtype=np.float32).astype(dtype, copy=False)
        for o in obj:
            o.prefill(k, v)
        done += n


def time_steps(fn, tokens, steps, warmup):
    """Per-call wall times (ns) of fn(q, k, v) over ``steps`` calls, tokens cycled."""
    P = len(tokens)
    for i in range(warmup):
        fn(*tokens[i % P])
    times = np.empty(steps, dtype=np.int64)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        clock = time.perf_counter_ns
        for i in range(steps):
            q, k, v = tokens[i % P]
            t0 = clock()
            fn(q, k, v)
            times[i] = clock() - t0
    finally:
        if gc_was:
            gc.enable()
    return times


def time_budget(fn, tokens, budget_s, min_steps, max_steps, after=None):
    """As :func:`time_steps`, for as many calls as fit in ``budget_s`` (within the bounds);
    ``after()`` runs untimed after each call."""
    P = len(tokens)
    fn(*tokens[0])
    if after is not None:
        after()
    out = []
    clock = time.perf_counter_ns
    start = clock()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        i = 0
        while i < max_steps and (i < min_steps or clock() - start < budget_s * 1e9):
            q, k, v = tokens[i % P]
            t0 = clock()
            fn(q, k, v)
            out.append(clock() - t0)
            if after is not None:
                after()
            i += 1
    finally:
        if gc_was:
            gc.enable()
    return np.array(out, dtype=np.int64)


def stats(times_ns):
    t = np.asarray(times_ns, dtype=np.float64) / 1e3
    return {"median_us": float(np.median(t)), "p10_us": float(np.percentile(t, 10)),
            "p90_us": float(np.percentile(t, 90)), "n": int(t.size)}


def crossover(rows):
    """Smallest context where the KV step is slower than the state step (log-linear interpolation)."""
    prev = None
    for r in rows:
        if r.get("kv") is None:
            continue
        ratio = r["kv"]["median_us"] / r["state"]["median_us"]
        if ratio >= 1.0:
            if prev is None:
                return {"tokens": r["context"], "bracket": [None, r["context"]]}
            (L0, q0), (L1, q1) = prev, (r["context"], ratio)
            x0, x1 = np.log(L0), np.log(L1)
            y0, y1 = np.log(q0), np.log(q1)
            x = x0 + (0.0 - y0) * (x1 - x0) / (y1 - y0) if y1 != y0 else x1
            return {"tokens": float(np.exp(x)), "bracket": [L0, L1]}
        prev = (r["context"], ratio)
    return None


def kernel_only(st, tokens, steps, warmup):
    """The Numba step kernel alone (no validation, preallocated output): the Python-overhead baseline."""
    out = np.empty(tokens[0][2].shape, dtype=tokens[0][2].dtype)
    kern = st._kern1
    S, z, feat, code, eps = st._S, st._z, st._feat, st._c_code, st._eps_f

    def call(q, k, v):
        kern(q, k, v, S, z, out, feat, code, eps, True)

    return time_steps(call, tokens, steps, warmup)


def main(argv=None):
    from _common import nonnegative_int, partial_run_note, positive_float, positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=positive_int, nargs="+",
                   default=[1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144])
    p.add_argument("--heads", type=positive_int, default=16)
    p.add_argument("--dim", type=positive_int, default=64, help="D = M")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--steps", type=positive_int, default=5000, help="timed state steps per context")
    p.add_argument("--kv-budget", type=positive_float, default=3.0, help="seconds of timed KV steps per context")
    p.add_argument("--quick", action="store_true", help="contexts up to 16k, 1000 steps")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode.json; a partial run "
                   "-- --quick, --contexts, --rounds 0, --no-kernel-compare -- writes only to --out)")
    p.add_argument("--rounds", type=nonnegative_int, default=15,
                   help="interleaved rounds of the flatness check (0: skip it)")
    p.add_argument("--round-steps", type=positive_int, default=400, help="state steps per context per round")
    p.add_argument("--no-kernel-compare", action="store_true",
                   help="skip the serial/parallel kernel comparison")
    args = p.parse_args(argv)
    partial = [o for o, on in (("--quick", args.quick), ("--contexts", args.contexts != p.get_default("contexts")),
                               ("--rounds 0", args.rounds == 0), ("--no-kernel-compare", args.no_kernel_compare))
               if on]
    if args.quick:
        args.contexts = [c for c in args.contexts if c <= 16384] or args.contexts
        args.steps = min(args.steps, 1000)
        args.kv_budget = min(args.kv_budget, 1.0)
    H, D, M = args.heads, args.dim, args.dim
    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(0)
    tokens = [tuple(rng.standard_normal((H, 1, x), dtype=np.float32).astype(dtype) for x in (D, D, M))
              for _ in range(64)]
    info = machine_info()
    from _common import print_machine

    print_machine("# ")
    print(f"# decode benchmark: H={H}, D=M={D}, {dtype.name}; {info['cpu']}, {info['cores']} cores; "
          f"numba {info['numba']}; {_dt.datetime.now().isoformat(timespec='seconds')}")
    print(f"# state kernel: {'parallel' if H * D * M >= config.STEP_PARALLEL_MIN_WORK else 'serial'} "
          f"(config.STEP_PARALLEL_MIN_WORK={config.STEP_PARALLEL_MIN_WORK})")
    rows = []
    # Compile everything first.
    warm_s = la.LinearAttentionState(D, M, batch_shape=(H,), dtype=dtype)
    warm_kv = la.KVCache(D, M, batch_shape=(H,), dtype=dtype)
    fill([warm_s, warm_kv], 64, H, D, M, dtype, rng)
    time_steps(warm_s.step, tokens, 10, 10)
    time_steps(warm_kv.step, tokens, 10, 10)

    hdr = (f"{'context':>8} | {'state us':>9} {'p10':>7} {'p90':>7} {'kernel':>7} | {'tok/s':>9} | "
           f"{'state B':>8} | {'KV 1thr us':>10} {'KV par us':>10} {'tok/s':>8} | {'KV MiB':>8} | {'KV/state':>9}")
    print(hdr)
    print("-" * len(hdr))
    for L in args.contexts:
        st = la.LinearAttentionState(D, M, batch_shape=(H,), dtype=dtype)
        kv = la.KVCache(D, M, batch_shape=(H,), dtype=dtype, capacity=0)
        kv.reserve(L + 1)  # no growth (a copy of the whole cache) inside the timing
        t0 = time.perf_counter()
        fill([st, kv], L, H, D, M, dtype, rng)
        t_fill = time.perf_counter() - t0
        s_times = time_steps(st.step, tokens, args.steps, warmup=200)
        k_times = kernel_only(st, tokens, args.steps, warmup=50)
        # Every timed step attends to L + 1 tokens: the appended token is dropped after each.
        drop = lambda: kv.truncate(L)  # noqa: E731
        kv_runs = {}
        old = config.KV_PARALLEL_MIN_WORK
        try:
            for name, thr in (("serial", 1 << 62), ("parallel", 0)):
                config.KV_PARALLEL_MIN_WORK = thr
                kv_runs[name] = stats(time_budget(kv.step, tokens, args.kv_budget / 2, 5, 2000, after=drop))
        finally:
            config.KV_PARALLEL_MIN_WORK = old
        best = min(kv_runs, key=lambda n: kv_runs[n]["median_us"])
        row = {"context": L, "state": stats(s_times), "kernel": stats(k_times), "kv": kv_runs[best],
               "kv_kernel": best, "kv_serial": kv_runs["serial"], "kv_parallel": kv_runs["parallel"],
               "state_nbytes": st.nbytes, "kv_nbytes_allocated": kv.nbytes,
               "kv_nbytes_used": kv.length * H * (D + M) * dtype.itemsize, "prefill_s": t_fill}
        rows.append(row)
        s, kk = row["state"], row["kv"]
        print(f"{L:>8} | {s['median_us']:>9.2f} {s['p10_us']:>7.2f} {s['p90_us']:>7.2f} "
              f"{row['kernel']['median_us']:>7.2f} | {1e6 / s['median_us']:>9.0f} | {st.nbytes:>8} | "
              f"{kv_runs['serial']['median_us']:>10.1f} {kv_runs['parallel']['median_us']:>10.1f} "
              f"{1e6 / kk['median_us']:>8.0f} | {row['kv_nbytes_used'] / 2**20:>8.1f} | "
              f"{kk['median_us'] / s['median_us']:>9.1f}", flush=True)
        del st, kv
        gc.collect()

    summary = {}
    flat = [r for r in rows if 1024 <= r["context"] <= 262144]
    if flat:
        med = np.array([r["state"]["median_us"] for r in flat])
        ref = med.mean()
        summary["state_median_us_1k_256k"] = {str(r["context"]): r["state"]["median_us"] for r in flat}
        summary["state_max_deviation_from_mean"] = float(np.max(np.abs(med / ref - 1.0)))
        summary["state_worst_median_us"] = float(med.max())
        summary["target_10us_met"] = bool(med.max() <= 10.0)
        summary["target_flat_20pct_met"] = bool(summary["state_max_deviation_from_mean"] <= 0.2)
    if flat and args.rounds > 0:
        # The flatness target again, robust to a shared host: states at every
        # context from 1k up, stepped in turn round after round (a batch of
        # steps each), the median over rounds of each batch's median -- load
        # that comes and goes then falls on every context alike.
        states = {}
        for r in flat:
            st = la.LinearAttentionState(D, M, batch_shape=(H,), dtype=dtype)
            fill([st], r["context"], H, D, M, dtype, rng)
            states[r["context"]] = st
        per = {L: [] for L in states}
        for _ in range(args.rounds):
            for L, st in states.items():
                per[L].append(float(np.median(time_steps(st.step, tokens, args.round_steps, warmup=20))) / 1e3)
        inter = np.array([np.median(per[L]) for L in states])
        ref = inter.mean()
        summary["interleaved_state_median_us"] = {str(L): float(m) for L, m in zip(states, inter)}
        summary["interleaved_max_deviation_from_mean"] = float(np.max(np.abs(inter / ref - 1.0)))
        summary["interleaved_worst_median_us"] = float(inter.max())
        summary["interleaved_target_10us_met"] = bool(inter.max() <= 10.0)
        summary["interleaved_target_flat_20pct_met"] = bool(summary["interleaved_max_deviation_from_mean"] <= 0.2)
        print(f"# interleaved ({args.rounds} rounds x {args.round_steps} steps): "
              + ", ".join(f"{L}: {m:.2f} us" for L, m in zip(states, inter))
              + f"; max deviation {summary['interleaved_max_deviation_from_mean']:.1%}")
        del states
    summary["state_bytes_constant"] = len({r["state_nbytes"] for r in rows}) == 1
    summary["crossover"] = crossover(rows)
    at64 = [r for r in rows if r["context"] == 65536]
    if at64:
        summary["kv_over_state_at_64k"] = at64[0]["kv"]["median_us"] / at64[0]["state"]["median_us"]
        summary["target_100x_met"] = bool(summary["kv_over_state_at_64k"] >= 100)

    if not args.no_kernel_compare:
        # Serial vs parallel step kernel, side by side at one context.
        comp = {}
        old = config.STEP_PARALLEL_MIN_WORK
        try:
            for name, thr in (("serial", 1 << 62), ("parallel", 0)):
                config.STEP_PARALLEL_MIN_WORK = thr
                st = la.LinearAttentionState(D, M, batch_shape=(H,), dtype=dtype)
                fill([st], 1024, H, D, M, dtype, rng)
                comp[name] = stats(time_steps(st.step, tokens, args.steps, warmup=200))
        finally:
            config.STEP_PARALLEL_MIN_WORK = old
        summary["kernel_compare_1k"] = comp
        print(f"# step kernels at 1k context: serial {comp['serial']['median_us']:.2f} us, "
              f"parallel {comp['parallel']['median_us']:.2f} us (medians, one run)")

    try:
        info["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    print("# summary:", json.dumps(summary, indent=None, default=float))
    if args.out is None and partial:
        partial_run_note(" ".join(partial), "decode")
        return rows, summary
    if args.out is None:
        args.out = os.path.join(RESULTS, "decode.json")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": _dt.datetime.now().isoformat(timespec="seconds"), "machine": info,
                   "params": {"heads": H, "dim": D, "dtype": dtype.name, "steps": args.steps,
                              "step_parallel_min_work": config.STEP_PARALLEL_MIN_WORK},
                   "rows": rows, "summary": summary}, f, indent=1, default=float)
    print(f"# wrote {args.out}")
    return rows, summary


if __name__ == "__main__":
    main()
