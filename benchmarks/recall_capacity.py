"""Training-free recall capacity, Schlag et al. 2021 §4.1 setting 1 (d_key = 64, one-hot values).

    python benchmarks/recall_capacity.py [--trials 3] [--n 20 60 128 256 384 600]

For ELU+1 and DPFP(nu = 1, 2, 3), with N(0, 1) keys and with keys of norm ~1
(key_scale = 1/sqrt(d)), prints argmax accuracy, the sum rule's relative
error, the least-squares floor of a state of the same size, and softmax over
the same pairs; writes benchmarks/results/recall_capacity.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from linattn_nb.analysis import recall_capacity
from linattn_nb.feature_maps import DpfpFeatureMap, EluFeatureMap


def main(argv=None):
    from _common import positive_int

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=positive_int, default=64)
    ap.add_argument("--n", type=positive_int, nargs="+", default=[20, 60, 128, 256, 384, 600])
    ap.add_argument("--trials", type=positive_int, default=3)
    args = ap.parse_args(argv)
    maps = [EluFeatureMap(), DpfpFeatureMap(1), DpfpFeatureMap(2), DpfpFeatureMap(3)]
    from _common import print_machine

    print_machine()
    results = []
    t0 = time.perf_counter()
    for key_scale, label in ((1.0, "N(0,1) keys"), (1 / np.sqrt(args.d), "unit-norm keys")):
        for fmap in maps:
            res = recall_capacity(fmap, args.d, args.n, key_scale=key_scale, trials=args.trials, seed=0)
            print(f"# {label}")
            print(res.table(), "\n", flush=True)
            results.append(res.to_dict())
    meta = dict(date=time.strftime("%Y-%m-%d"), machine=platform.machine(), cpus=os.cpu_count(),
                seconds=time.perf_counter() - t0)
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(__file__), "results", "recall_capacity.json")
    with open(path, "w") as fh:
        json.dump(dict(meta=meta, results=results), fh, indent=1)
    print(f"wrote {path} ({meta['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
