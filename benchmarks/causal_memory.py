"""Peak memory of the causal CPU forward, measured as a subprocess's peak RSS.

Run::

    python benchmarks/causal_memory.py                 # B*H = 1, N = 2**20, D = M = 64, float32
    python benchmarks/causal_memory.py --n 262144 --methods chunked,scan

Each (method, shape) runs in a fresh Python process that first compiles (or
loads from the on-disk cache) the kernel on a tiny input, records its RSS
(the interpreter, NumPy, Numba, LLVM: the baseline), creates q, k, v, calls
``linear_attention(causal=True)`` and reports its peak RSS (``VmHWM`` from
/proc/self/status, else ``ru_maxrss``).  Reported: the peak RSS over the bytes
of q, k, v and the output (the target is <= 1.5), and the peak above
baseline + those bytes (what the call itself allocated).  Results:
benchmarks/results/causal_memory.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from _common import ROOT, machine, positive_int, print_machine, table, write_json

CHILD = r"""
import json, os, resource, sys
import numpy as np
sys.path.insert(0, {root!r})
from linattn_nb import linear_attention

def peak_bytes():
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r * 1024 if sys.platform.startswith("linux") else r

def rss_bytes():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

B, N, D, M, dtype, method = {B}, {N}, {D}, {M}, np.dtype({dtype!r}), {method!r}
rng = np.random.default_rng(0)
# compile / load the kernel (and its B < threads variant) on a tiny input first
for b in (1, B):
    t = [rng.standard_normal((b, 64, d)).astype(dtype) for d in (D, D, M)]
    linear_attention(*t, causal=True, method=method)
base_peak = peak_bytes()
base_rss = rss_bytes()
q = rng.standard_normal((B, N, D), dtype=np.float32).astype(dtype, copy=False)
k = rng.standard_normal((B, N, D), dtype=np.float32).astype(dtype, copy=False)
v = rng.standard_normal((B, N, M), dtype=np.float32).astype(dtype, copy=False)
out = linear_attention(q, k, v, causal=True, method=method)
io = q.nbytes + k.nbytes + v.nbytes + out.nbytes
print(json.dumps(dict(base_peak=base_peak, base_rss=base_rss, peak=peak_bytes(), io_bytes=io,
                      finite=bool(np.isfinite(out).all()))))
"""


def measure(method, B, N, D, M, dtype):
    code = CHILD.format(root=str(ROOT), B=B, N=N, D=D, M=M, dtype=dtype, method=method)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({method}):\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    gib = 2.0**30
    return {
        "method": method, "B": B, "N": N, "D": D, "M": M, "dtype": dtype,
        "io_GiB": res["io_bytes"] / gib,
        "baseline_GiB": res["base_rss"] / gib,
        "peak_GiB": res["peak"] / gib,
        "peak_over_io": res["peak"] / res["io_bytes"],
        "extra_GiB": (res["peak"] - res["base_rss"] - res["io_bytes"]) / gib,
        "finite": res["finite"],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=positive_int, default=2**20)
    ap.add_argument("--b", type=positive_int, default=1)
    ap.add_argument("--d", type=positive_int, default=64)
    ap.add_argument("--m", type=positive_int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--methods", default="chunked")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    info = machine()
    rows = [measure(m, args.b, args.n, args.d, args.m, args.dtype) for m in args.methods.split(",")]
    print_machine("# ")
    print(f"# peak RSS, causal, B*H={args.b}, N={args.n}, D={args.d}, M={args.m}, {args.dtype} "
          f"-- {info['date']}, {info['cpu']}")
    print(table(rows, ["method", "io_GiB", "baseline_GiB", "peak_GiB", "peak_over_io", "extra_GiB", "finite"],
                {"io_GiB": "{:.3f}", "baseline_GiB": "{:.3f}", "peak_GiB": "{:.3f}", "peak_over_io": "{:.3f}",
                 "extra_GiB": "{:.3f}"}))
    print("target: peak_over_io <= 1.5")
    path = write_json("causal_memory", {"machine": info, "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
