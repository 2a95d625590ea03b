"""Timing of the factor-based rank tools at long sequence lengths.

    python benchmarks/analysis_rank.py [--n 1000000] [--d 64] [--repeat 3]

Prints a table (median of ``--repeat`` runs, after one warm-up call that
compiles the Numba kernels) and writes benchmarks/results/analysis_rank.json.
Columns: the whole ``attention_rank`` / ``semiseparable_rank`` call, and for
reference the feature map alone and one streamed R factor (N x D_phi).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numba
import numpy as np

from linattn_nb import feature_maps
from linattn_nb.analysis import attention_rank, semiseparable_rank
from linattn_nb.analysis import rank as rank_mod


def _median_time(fn, repeat):
    times = []
    out = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def main(argv=None):
    from _common import positive_int

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=positive_int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--d", type=positive_int, default=64)
    ap.add_argument("--maps", nargs="+", default=["elu", "dpfp"])
    ap.add_argument("--repeat", type=positive_int, default=3)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    small = rng.standard_normal((2, 256, args.d))
    for m in args.maps:  # warm-up: compile the kernels
        attention_rank(small[0], small[1], m)
        semiseparable_rank(small[0], small[1], m)

    from _common import print_machine

    print_machine()
    rows = []
    print(f"{'map':>6} {'N':>9} {'D_phi':>6} {'features s':>11} {'R factor s':>11} "
          f"{'attn_rank s':>12} {'rank':>5} {'semisep s':>10} {'semisep':>8}")
    for n in args.n:
        q = rng.standard_normal((n, args.d))
        k = rng.standard_normal((n, args.d))
        for m in args.maps:
            fmap = feature_maps.get(m)
            t_feat, fk = _median_time(lambda: np.asarray(fmap(k), dtype=np.float64), args.repeat)
            t_qr, _ = _median_time(lambda: rank_mod._r_factor(fk), args.repeat)
            t_ar, r = _median_time(lambda: attention_rank(q, k, m), args.repeat)
            t_ss, s = _median_time(lambda: semiseparable_rank(q, k, m), args.repeat)
            row = dict(map=m, n=n, d=args.d, d_phi=fk.shape[1], features_s=t_feat, r_factor_s=t_qr,
                       attention_rank_s=t_ar, rank=int(r), semiseparable_s=t_ss, semiseparable_rank=int(s))
            rows.append(row)
            print(f"{m:>6} {n:>9} {fk.shape[1]:>6} {t_feat:>11.3f} {t_qr:>11.3f} {t_ar:>12.3f} {r:>5} "
                  f"{t_ss:>10.3f} {s:>8}", flush=True)
            del fk

    meta = dict(date=time.strftime("%Y-%m-%d"), machine=platform.machine(), processor=platform.processor(),
                cpus=os.cpu_count(), numba_threads=numba.get_num_threads(), numpy=np.__version__,
                numba=numba.__version__, repeat=args.repeat)
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(__file__), "results", "analysis_rank.json")
    with open(path, "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
