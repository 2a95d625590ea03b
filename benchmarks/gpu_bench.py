"""GPU benchmark of causal linear attention: time, TFLOP/s, GB/s against the roofline.

Run by ``benchmarks/gpu_check.sh`` (which also runs the CUDA tests first)::

    PYTHONPATH=. python3 benchmarks/gpu_bench.py --json benchmarks/results/gpu_bench.json

Default problem: B = 8, H = 16, D = M = 64, float32, causal, N = 4096 .. 65536, and the
decode step (H = 16 heads, batch 1 and 8, D = M = 64, float32).  Targets: the
headline N = 16384 <= 1.5 ms (<= 3x roofline), faster than torch SDPA from N = 4096, decode
step <= 10 us of device time.
Rows:

* ``linattn scan`` / ``linattn chunked`` / ``linattn auto``: this package on
  Numba device arrays (zero-copy, ``check_finite=False`` like the other
  contestants, ``out=`` preallocated); the check's overhead is timed once.
* ``sdpa fp32``: ``torch.nn.functional.scaled_dot_product_attention`` on the
  same float32 data, backend chosen by PyTorch (FlashAttention has no float32
  kernel);
* ``sdpa flash bf16``: the same restricted to the FlashAttention backend, on
  bfloat16 copies (what "torch SDPA (flash)" can only mean);
* ``cpu``: this package's CPU path (NumPy in and out), for the smaller N.

Roofline of linear attention per call: bytes = 4 tensors (q, k, v, out) x
B H N D x 4 bytes, FLOPs = B H N (4 F M + 4 F) (state update and read-out,
normaliser); bound = max(bytes / HBM bandwidth, FLOPs / fp32 peak).  The HBM
bandwidth is measured here with a device-to-device copy (read + write) and the
datasheet-style figure from the device attributes is printed beside it; the
fp32 peak is 2 x 128 lanes x SMs x max clock (no tensor cores: Numba has no
matrix instructions).  Softmax attention FLOPs (for its TFLOP/s column):
4 N^2 D B H / 2 causal.

Timing: CUDA events around each call on the default stream, after a warm-up
call (which compiles), median of repeats (at least 3, up to ~0.3 s of calls).
A deadline (``--budget-s``) skips what would not fit; skipped cells say so.
Also measured: the method crossover (scan vs chunked over batch x heads) and a
small launch-configuration sweep at N = 16384, whose best rows are what
``linattn_nb.config`` should hold (CUDA_* knobs, AUTO_METHODS), and every update
rule's scan in row groups and in tiles at the headline (``--rule-layouts``, or
with the sweeps): the tile layout is ``auto``'s choice there for every rule on
static counts alone (``config.CUDA_SEQ_LAYOUT``).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import linattn_nb as la  # noqa: E402
from linattn_nb import config  # noqa: E402


class Deadline:
    def __init__(self, seconds):
        self.end = time.perf_counter() + seconds

    def left(self):
        return self.end - time.perf_counter()


def _torch():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def device_info(cuda):
    dev = cuda.get_current_device()
    name = getattr(dev, "name", "simulator")
    name = name.decode() if isinstance(name, bytes) else str(name)
    sms = int(getattr(dev, "MULTIPROCESSOR_COUNT", 1))
    clock_khz = int(getattr(dev, "CLOCK_RATE", 1_000_000))
    info = {"name": name, "cc": list(dev.compute_capability), "sms": sms, "clock_mhz": clock_khz / 1e3}
    # fp32 lanes per SM: 64 on V100 (7.0), T4 (7.5) and A100 (8.0); 128 on 8.6/8.9 and on
    # H100/H200 (9.0), the parts this benchmark is written for.
    lanes = {(7, 0): 64, (7, 5): 64, (8, 0): 64}.get(tuple(dev.compute_capability), 128)
    info["fp32_peak_tflops"] = 2 * lanes * sms * clock_khz * 1e3 / 1e12
    try:
        mem_khz = int(dev.MEMORY_CLOCK_RATE)
        bus = int(dev.GLOBAL_MEMORY_BUS_WIDTH)
        info["hbm_attr_tbs"] = 2 * mem_khz * 1e3 * bus / 8 / 1e12
    except Exception:
        info["hbm_attr_tbs"] = None
    return info


def time_gpu(cuda, fn, *, min_reps=3, target_s=0.3, max_reps=50):
    """Median seconds per call (CUDA events), after one warm-up call."""
    fn()
    cuda.synchronize()
    times = []
    start, stop = cuda.event(), cuda.event()
    t_wall = time.perf_counter()
    while len(times) < max_reps:
        t1 = time.perf_counter()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        ms = start.elapsed_time(stop)
        times.append(ms / 1e3 if ms > 0 else time.perf_counter() - t1)  # simulator: wall time
        if len(times) >= min_reps and time.perf_counter() - t_wall > target_s:
            break
        if times[0] > 1.0:  # slow contestant: one timed call is enough
            break
    return statistics.median(times), len(times)


def measure_copy_bandwidth(cuda, torch, n=1 << 29):
    """Achievable HBM bandwidth (bytes read + written per second) from a device copy (2 GiB)."""
    if torch is not None:
        a = torch.empty(n, device="cuda", dtype=torch.float32)
        b = torch.empty_like(a)
        t, _ = time_gpu(cuda, lambda: b.copy_(a))
        del a, b
    else:
        a = cuda.device_array(n, dtype=np.float32)
        b = cuda.device_array(n, dtype=np.float32)
        t, _ = time_gpu(cuda, lambda: b.copy_to_device(a))
        del a, b
    return 2 * n * 4 / t / 1e12


def make_inputs(cuda, torch, shape, m, seed=0):
    """float32 q, k of ``shape`` (..., N, D) and v of (..., N, m), on the GPU.

    Returns the PyTorch tensors (None without PyTorch) and Numba views of them.
    """
    shapes = [shape, shape, tuple(shape[:-1]) + (m,)]
    if torch is not None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        ts = [torch.randn(s, device="cuda", dtype=torch.float32, generator=g) for s in shapes]
        return ts, [cuda.as_cuda_array(t) for t in ts]
    rng = np.random.default_rng(seed)
    ds = [cuda.to_device(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
    return None, ds


def roofline(B, H, N, D, M, bw_tbs, peak_tflops, itemsize=4):
    bytes_ = B * H * N * (2 * D + 2 * M) * itemsize
    flops = B * H * N * (4 * D * M + 4 * D)
    return bytes_, flops, max(bytes_ / (bw_tbs * 1e12), flops / (peak_tflops * 1e12))


def main(argv=None):
    from _common import nonnegative_int, positive_float, positive_int

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=positive_int, default=8)
    ap.add_argument("--H", type=positive_int, default=16)
    ap.add_argument("--D", type=positive_int, default=64)
    ap.add_argument("--M", type=positive_int, default=64)
    ap.add_argument("--N", type=positive_int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--target-n", type=positive_int, default=16384,
                    help="N of the target row and of the check_finite overhead row")
    ap.add_argument("--cpu-max-n", type=nonnegative_int, default=4096, help="largest N timed on the CPU path")
    ap.add_argument("--budget-s", type=positive_float, default=170.0, help="stop starting new measurements after this")
    ap.add_argument("--no-sweep", action="store_true", help="skip the crossover and launch-config sweeps")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode-step timing")
    ap.add_argument("--rule-layouts", action="store_true",
                    help="time every rule's scan in row groups and in tiles even with --no-sweep (as time allows)")
    ap.add_argument("--dry-run", action="store_true",
                    help="allow the CUDA simulator (exercises this script with tiny shapes; times mean nothing)")
    ap.add_argument("--json", default=None, help="write the results here (default benchmarks/results/gpu_bench.json)")
    args = ap.parse_args(argv)
    deadline = Deadline(args.budget_s)

    from numba import cuda

    from linattn_nb.device import cuda_status

    status = cuda_status()
    if status != "gpu" and not (args.dry_run and status == "simulator"):
        print("no usable CUDA GPU (numba.cuda.is_available() is False or the simulator is on): nothing to time")
        return 2
    torch = _torch() if status == "gpu" else None
    info = device_info(cuda)
    info["hbm_copy_tbs"] = measure_copy_bandwidth(cuda, torch, n=(1 << 29) if status == "gpu" else 1024)
    bw = info["hbm_copy_tbs"]
    peak = info["fp32_peak_tflops"]
    meta = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "gpu": info,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": __import__("numba").__version__,
        "numba_cuda": _version("numba_cuda"),
        "torch": getattr(torch, "__version__", None),
        "linattn_nb": la.__version__,
        "config": {k: getattr(config, k) for k in dir(config) if k.startswith("CUDA_")},
        "problem": {"B": args.B, "H": args.H, "D": args.D, "M": args.M, "dtype": "float32", "causal": True},
    }
    from _common import print_machine

    print_machine("# ")
    print(f"# linear attention on {info['name']} (cc {info['cc'][0]}.{info['cc'][1]}, {info['sms']} SMs, "
          f"{info['clock_mhz']:.0f} MHz), {meta['date']}")
    print(f"# roofline: HBM {bw:.2f} TB/s measured by a device copy (attributes say "
          f"{info['hbm_attr_tbs'] or float('nan'):.2f}), fp32 peak {peak:.1f} TFLOP/s")
    print(f"# numba {meta['numba']}, numba-cuda {meta['numba_cuda']}, torch {meta['torch']}, numpy {np.__version__}")
    B, H, D, M = args.B, args.H, args.D, args.M
    rows = []

    def add(row):
        rows.append(row)
        t = row.get("time_ms")
        cells = f"{t:10.3f} ms" if t is not None else f"{'skipped':>13}"
        extra = ""
        if t is not None and row.get("roofline_ms"):
            extra = (f"  {row['tflops']:7.2f} TFLOP/s  {row['gbs']:8.1f} GB/s  "
                     f"{t / row['roofline_ms']:6.2f} x roofline ({row['roofline_ms']:.3f} ms)")
        elif t is not None and row.get("tflops"):
            extra = f"  {row['tflops']:7.2f} TFLOP/s (softmax FLOPs)"
        print(f"{row['name']:<20} N={row['N']:>6}  {cells}{extra}{'  ' + row['note'] if row.get('note') else ''}",
              flush=True)

    skip_sdpa32 = skip_flash = False
    for N in args.N:
        shape = (B, H, N, D)
        if deadline.left() < 5:
            add({"name": "(all)", "N": N, "time_ms": None, "note": "deadline"})
            continue
        ts, (q, k, v) = make_inputs(cuda, torch, shape, M)
        out = cuda.device_array((B, H, N, M), dtype=np.float32)
        nbytes, flops, bound = roofline(B, H, N, D, M, bw, peak)
        for method in ("scan", "chunked", "auto"):
            if deadline.left() < 3:
                add({"name": f"linattn {method}", "N": N, "time_ms": None, "note": "deadline"})
                continue
            fn = lambda: la.linear_attention(q, k, v, causal=True, method=method, device="cuda", check_finite=False, out=out)  # noqa: E731
            t, reps = time_gpu(cuda, fn)
            name = method
            if method == "auto":
                from linattn_nb._cuda_dispatch import select_auto_cuda

                name = "auto=" + select_auto_cuda(rule="additive", causal=True, batch=B * H, n=N, f=D, m=M,
                                                  dtype=np.float32)
            add({"name": f"linattn {name}", "N": N, "time_ms": t * 1e3, "reps": reps, "tflops": flops / t / 1e12,
                 "gbs": nbytes / t / 1e9, "roofline_ms": bound * 1e3})
        if N == args.target_n and deadline.left() > 5:
            fn = lambda: la.linear_attention(q, k, v, causal=True, device="cuda", check_finite=True, out=out)  # noqa: E731
            t, reps = time_gpu(cuda, fn)
            add({"name": "linattn auto+check", "N": N, "time_ms": t * 1e3, "reps": reps,
                 "tflops": flops / t / 1e12, "gbs": nbytes / t / 1e9, "roofline_ms": bound * 1e3,
                 "note": "check_finite=True (one extra read of q, k, v)"})
        sm_flops = 4 * N * N * D * B * H / 2
        if torch is not None:
            import torch.nn.functional as Fnn

            tq, tk, tv = ts
            if not skip_sdpa32 and deadline.left() > 10:
                t, reps = time_gpu(cuda, lambda: Fnn.scaled_dot_product_attention(tq, tk, tv, is_causal=True))
                add({"name": "sdpa fp32", "N": N, "time_ms": t * 1e3, "reps": reps, "tflops": sm_flops / t / 1e12})
                skip_sdpa32 = t * 4 * 2 > min(4.0, deadline.left() / 4)  # next N: ~4x
            else:
                add({"name": "sdpa fp32", "N": N, "time_ms": None, "note": "skipped (time)"})
            if not skip_flash and deadline.left() > 10:
                try:
                    from torch.nn.attention import SDPBackend, sdpa_kernel

                    bq, bk, bv = (x.to(torch.bfloat16) for x in ts)

                    def flash():
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            return Fnn.scaled_dot_product_attention(bq, bk, bv, is_causal=True)

                    t, reps = time_gpu(cuda, flash)
                    add({"name": "sdpa flash bf16", "N": N, "time_ms": t * 1e3, "reps": reps,
                         "tflops": sm_flops / t / 1e12})
                    skip_flash = t * 4 * 2 > min(4.0, deadline.left() / 4)
                    del bq, bk, bv
                except Exception as exc:  # no flash backend on this build/GPU
                    add({"name": "sdpa flash bf16", "N": N, "time_ms": None, "note": f"unavailable: {exc}"[:80]})
                    skip_flash = True
        else:
            add({"name": "sdpa", "N": N, "time_ms": None, "note": "torch with CUDA not installed"})
        if N <= args.cpu_max_n and deadline.left() > 20:
            hq, hk, hv = (x.copy_to_host() for x in (q, k, v))
            la.linear_attention(hq[:1, :1, :8], hk[:1, :1, :8], hv[:1, :1, :8], causal=True, device="cpu")
            t0 = time.perf_counter()
            la.linear_attention(hq, hk, hv, causal=True, device="cpu")
            t = time.perf_counter() - t0
            add({"name": "cpu (numba)", "N": N, "time_ms": t * 1e3, "reps": 1, "tflops": flops / t / 1e12,
                 "gbs": nbytes / t / 1e9, "roofline_ms": bound * 1e3,
                 "note": f"{os.cpu_count()} CPUs, one call; vs GPU roofline"})
        del q, k, v, out, ts
        if torch is not None:
            torch.cuda.empty_cache()

    decode = None
    if not args.no_decode and deadline.left() > 10:
        decode = decode_step(cuda, D, M, heads=H, batches=sorted({1, B}), tiny=status != "gpu")
    sweeps = {}
    if not args.no_sweep:
        tiny = status != "gpu"
        sweeps["crossover"] = crossover(cuda, torch, D, M, deadline,
                                        bhs=(1, 2) if tiny else (8, 32, 128, 512, 2048),
                                        ns=(5,) if tiny else (1024, 8192))
        sweeps["launch_config"] = launch_sweep(cuda, torch, B, H, D, M, deadline, N=7 if tiny else 16384)
    if not args.no_sweep or args.rule_layouts:
        sweeps["rule_layouts"] = rule_layouts(cuda, torch, B, H, D, M, deadline, N=7 if status != "gpu" else 16384)
    result = {"meta": meta, "rows": rows, "decode": decode, "sweeps": sweeps}
    path = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_bench.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"# wrote {path}")
    # the targets: headline <= 1.5 ms (<= 3x roofline), faster than torch SDPA from N = 4096,
    # decode step <= 10 us of device time
    target = [r for r in rows if r["name"].startswith("linattn") and r["N"] == args.target_n and r.get("time_ms")
              and "check" not in r["name"]]
    if target:
        best = min(target, key=lambda r: r["time_ms"])
        ok = best["time_ms"] <= 1.5 and best["time_ms"] <= 3 * best["roofline_ms"]
        print(f"# {'met' if ok else 'NOT met'}: headline (B={B}, H={H}, N={args.target_n}, D={D}, M={M} fp32 causal) "
              f"<= 1.5 ms and <= 3x roofline: best {best['name']} {best['time_ms']:.3f} ms = "
              f"{best['time_ms'] / best['roofline_ms']:.2f} x roofline")
    for N in sorted({r["N"] for r in rows if r["N"] >= 4096}):
        ours = [r["time_ms"] for r in rows if r["N"] == N and r["name"].startswith("linattn") and r.get("time_ms")
                and "check" not in r["name"]]
        sdpa = [r["time_ms"] for r in rows if r["N"] == N and r["name"].startswith("sdpa") and r.get("time_ms")]
        if ours and sdpa:
            print(f"# {'met' if min(ours) < min(sdpa) else 'NOT met'}: faster than torch SDPA at N={N}: "
                  f"{min(ours):.3f} ms vs {min(sdpa):.3f} ms")
    if decode:
        d = decode[0]
        print(f"# {'met' if d['device_us'] <= 10 else 'NOT met'}: decode step <= 10 us device time "
              f"(B={d['B']}, H={d['H']}): {d['device_us']:.2f} us")
    return 0


def decode_step(cuda, D, M, *, heads, batches, tiny=False, steps=200):
    """Decode-step time per token on float32 device arrays (H heads, D = M).

    ``device_us``: CUDA events around ``steps`` back-to-back launches of the step
    kernel alone (``linattn_nb.ops.step.cuda.step`` on prepared device arrays),
    divided by ``steps``; ``call_us``: wall time per ``LinearAttentionState.step``
    call on device arrays (``check_finite=False``), host work included.
    """
    from linattn_nb import LinearAttentionState
    from linattn_nb.ops.step import cuda as SC

    res = []
    print(f"# decode step, float32, D=M={D}: device time per token (step kernel alone) and per call", flush=True)
    steps = 3 if tiny else steps
    for B in batches:
        try:
            rng = np.random.default_rng(3)
            BH = B * heads
            q, k, v = (cuda.to_device(np.abs(rng.standard_normal((BH, 1, n), dtype=np.float32)))
                       for n in (D, D, M))
            S = SC.DoubleBuffer((BH, D, M), np.float32)
            z = SC.DoubleBuffer((BH, D), np.float32)
            scratch = SC.StepScratch(BH, D, np.float32)
            out = cuda.device_array((BH, 1, M), dtype=np.float32)
            SC.step(q, k, v, S, z, out, scratch, code=0, eps=None)  # compile
            cuda.synchronize()
            start, stop = cuda.event(), cuda.event()
            t0 = time.perf_counter()
            start.record()
            for _ in range(steps):
                SC.step(q, k, v, S, z, out, scratch, code=0, eps=None)
            stop.record()
            stop.synchronize()
            ms = start.elapsed_time(stop)
            ms = ms if ms > 0 else (time.perf_counter() - t0) * 1e3  # simulator: wall time
            dev_us = ms * 1e3 / steps
            st = LinearAttentionState(D, M, batch_shape=(B, heads), dtype=np.float32, device="cuda")
            q4, k4, v4 = (x.reshape(B, heads, 1, x.shape[2]) for x in (q, k, v))
            st.step(q4, k4, v4, check_finite=False)
            cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                st.step(q4, k4, v4, check_finite=False)
            cuda.synchronize()
            call_us = (time.perf_counter() - t0) * 1e6 / steps
            row = {"B": B, "H": heads, "device_us": dev_us, "call_us": call_us}
            print(f"  B={B:>3} H={heads}: step kernel {dev_us:8.2f} us/token on the device, "
                  f"state.step {call_us:8.2f} us/call", flush=True)
        except Exception as exc:  # report and go on: the rest of the benchmark still counts
            row = {"B": B, "H": heads, "device_us": float("nan"), "call_us": float("nan"),
                   "error": f"{type(exc).__name__}: {exc}"[:200]}
            print(f"  B={B} H={heads}: failed: {row['error']}", flush=True)
        res.append(row)
    return res


def crossover(cuda, torch, D, M, deadline, bhs, ns):
    """scan vs chunked over batch x heads at two lengths: where scan starts to win."""
    res = []
    print("# crossover: scan vs chunked (B*H, N) -> ms", flush=True)
    for BH in bhs:
        for N in ns:
            if BH * N > 2048 * 1024 * 4 or deadline.left() < 8:
                continue
            _, (q, k, v) = make_inputs(cuda, torch, (BH, N, D), M, seed=1)
            out = cuda.device_array((BH, N, M), dtype=np.float32)
            cell = {"BH": BH, "N": N}
            for method in ("scan", "chunked"):
                t, _ = time_gpu(cuda, lambda: la.linear_attention(q, k, v, causal=True, method=method, device="cuda",
                                                                   check_finite=False, out=out), target_s=0.1)
                cell[method + "_ms"] = t * 1e3
            cell["faster"] = "scan" if cell["scan_ms"] <= cell["chunked_ms"] else "chunked"
            print(f"  BH={BH:>5} N={N:>6}  scan {cell['scan_ms']:9.3f}  chunked {cell['chunked_ms']:9.3f}  "
                  f"-> {cell['faster']}", flush=True)
            res.append(cell)
            del q, k, v, out
    return res


def launch_sweep(cuda, torch, B, H, D, M, deadline, N=16384):
    """A few launch configurations at one length (each one compiles a kernel)."""
    res = []
    print(f"# launch-configuration sweep at B={B}, H={H}, N={N}, D={D}, M={M} (ms)", flush=True)
    _, (q, k, v) = make_inputs(cuda, torch, (B, H, N, D), M, seed=2)
    out = cuda.device_array((B, H, N, M), dtype=np.float32)
    saved = {k_: getattr(config, k_) for k_ in dir(config) if k_.startswith("CUDA_")}
    tiles = [(16, 1), (8, 2), (4, 4), (8, 8), (16, 4)]  # (rows, cols) per thread; default in config
    # first the scan's three thread layouts (config.CUDA_SEQ_LAYOUT; "auto" takes the tile layout at
    # the headline's 128 sequences on 132 SMs, row groups before it), then the row-group tiles
    variants = [("scan", {"CUDA_SEQ_LAYOUT": lay}) for lay in ("owner", "rows", "tiles")]
    variants += [(m, {"CUDA_ROWS_PER_THREAD": r, "CUDA_COLS_PER_THREAD": c}) for m in ("scan", "chunked")
                 for r, c in tiles]
    variants += [("chunked", {"CUDA_CHUNK_SIZE": L}) for L in (64, 128, 512, 1024)]
    variants += [(m, {"CUDA_VALUE_COLS": 32}) for m in ("scan", "chunked")]
    variants += [("chunked", {"CUDA_TILE_TOKENS": 16})]
    try:
        for method, knobs in variants:
            if deadline.left() < 8:
                res.append({"method": method, **knobs, "ms": None, "note": "deadline"})
                continue
            for k_, val in saved.items():
                setattr(config, k_, val)
            for k_, val in knobs.items():
                setattr(config, k_, val)
            t, _ = time_gpu(cuda, lambda: la.linear_attention(q, k, v, causal=True, method=method, device="cuda",
                                                               check_finite=False, out=out), target_s=0.1)
            res.append({"method": method, **knobs, "ms": t * 1e3})
            print(f"  {method:<8} {json.dumps(knobs):<60} {t * 1e3:9.3f}", flush=True)
    finally:
        for k_, val in saved.items():
            setattr(config, k_, val)
    return res


def rule_layouts(cuda, torch, B, H, D, M, deadline, N=16384):
    """The scan of every update rule in row groups and in tiles (config.CUDA_SEQ_LAYOUT) at one shape:
    the static argument for the tile layout of the decay, gate and delta rules, timed.
    The rules' per-token inputs live on the GPU as their users pass them (float32 ``log_decay`` and
    ``beta``, read in place: no host copy, no converted copy per call); 'l2' keys for the delta rules."""
    res = []
    print(f"# rules x layouts: scan at B={B}, H={H}, N={N}, D={D}, M={M} (ms)", flush=True)
    _, (q, k, v) = make_inputs(cuda, torch, (B, H, N, D), M, seed=3)
    out = cuda.device_array((B, H, N, M), dtype=np.float32)
    rng = np.random.default_rng(3)
    decay = cuda.to_device(np.log(rng.uniform(0.9, 1.0, size=(B, H, N))).astype(np.float32))
    gate = cuda.to_device(np.log(rng.uniform(0.9, 1.0, size=(B, H, N, D))).astype(np.float32))
    beta = cuda.to_device(rng.uniform(0.0, 1.0, size=(B, H, N)).astype(np.float32))
    rules = {"additive": ({}, "elu"), "decay": ({"log_decay": decay}, "elu"), "gate": ({"log_decay": gate}, "elu"),
             "delta": ({"beta": beta}, "l2"), "gated_delta": ({"beta": beta, "log_decay": decay}, "silu_l2")}
    saved = config.CUDA_SEQ_LAYOUT
    try:
        for rule, (kw, fmap) in rules.items():
            cell = {"rule": rule}
            for lay in ("rows", "tiles"):
                if deadline.left() < 25:  # a first call compiles its kernel (seconds)
                    cell[lay + "_ms"] = None
                    continue
                config.CUDA_SEQ_LAYOUT = lay
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always", RuntimeWarning)
                        t, _ = time_gpu(cuda, lambda: la.linear_attention(
                            q, k, v, causal=True, method="scan", device="cuda", feature_map=fmap,
                            check_finite=False, out=out, **kw), target_s=0.1)
                    cell[lay + "_ms"] = t * 1e3
                    for w in caught:  # e.g. a tile kernel the device refused, run in row groups instead
                        cell[lay + "_warning"] = str(w.message)[:200]
                        print(f"  {rule} {lay}: {w.message}", flush=True)
                except Exception as exc:  # report and go on: the other rules and layouts still count
                    cell[lay + "_ms"] = None
                    cell[lay + "_error"] = f"{type(exc).__name__}: {exc}"[:200]
                    print(f"  {rule} {lay}: failed: {cell[lay + '_error']}", flush=True)
            res.append(cell)
            print(f"  {rule:<12} rows {cell.get('rows_ms') or float('nan'):9.3f}  "
                  f"tiles {cell.get('tiles_ms') or float('nan'):9.3f}", flush=True)
    finally:
        config.CUDA_SEQ_LAYOUT = saved
    return res


def _version(mod):
    try:
        return __import__(mod).__version__
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
