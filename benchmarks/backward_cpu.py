"""CPU backward: speed against the forward, float32 accuracy, peak memory, against their targets.

Run::

    python benchmarks/backward_cpu.py              # everything; accuracy and memory at N = 2**20
    python benchmarks/backward_cpu.py --quick      # fewer rounds, accuracy and memory at N = 2**16
    python benchmarks/backward_cpu.py --skip-long  # speed rows only
    NUMBA_NUM_THREADS=1 python benchmarks/backward_cpu.py --skip-long --clock cpu  # CPU seconds, one thread

Only the full run (no ``--quick``, ``--skip-long``, ``--rules`` subset or ``--feature-map``)
writes benchmarks/results/backward_cpu.json by default (docs/measured.md is built from it); a
partial run writes its results only to ``--out FILE`` and otherwise says it wrote nothing.

Speed (B*H = 16, N = 4096, D = M = 64, float32; ELU+1 for the additive, decay
and gate rules, SiLU+L2 for the delta rules: ``STANDARD_MAPS``), timed side by side
in interleaved rounds (:func:`_common.interleaved_medians`): the forward
``linear_attention(..., causal=True, method="chunked")``, the backward
launcher alone (``linattn_nb.ops.grad.cpu.backward_chunked`` /
``backward_scan`` on the features, values with the ones column and a
gradient of the outputs) and the whole ``linear_attention_vjp(...,
method="chunked")`` (features, forward, backward, the map's vjp), for the
additive, decay, gate, delta and gated delta rules, each against its own
chunked forward (``--rules`` picks some).  ``vjp_ratio_range`` is the
spread of the per-round ratio vjp / forward (the two timed side by side in
each round); ``forward_default_s`` the same forward with the default
``method="auto"``, which follows this machine's calibration (``linattn tune``:
on an AVX2 host its chunk pair made the forward 0.69x the time), and
``vjp_x_default`` the vjp against it; ``vjp_default_s`` the vjp with ``method="auto"``, whose fused
normalised backward also runs the calibrated pair (additive and decay rules), and ``default_ratio``
with its ``default_range`` that vjp against the default forward: the ratio a user of a calibrated
machine meets; ``forward_faults`` and ``vjp_faults`` the minor page faults of
one call of each after the rounds (fresh pages the system had to clear).  Targets on AMD EPYC: the whole vjp <= 2.5x the forward for
the additive, decay and gate rules, <= 3.5x for the delta rules.  The
additive and delta rows also time the checkpointed token recurrence
(``backward_scan``).

Accuracy: float32 gradients of the additive chunked backward against the
float64 backward of the same inputs at B*H = 1, D = M = 64 (relative
Frobenius error per gradient; target 1e-5).

Peak memory: the forward and ``linear_attention_vjp`` (forward + backward,
chunked, ELU+1, float32) at B*H = 1, N = 2**20, D = M = 64 in a fresh
subprocess, inputs made inside the measurement: the peak of NumPy's
allocations (``tracemalloc``; the kernels' per-thread scratch is not
counted, it is O(C^2 + C (F + M) + F M)) and the rise of the peak resident
set (``VmHWM``; ``ru_maxrss`` would carry over the parent's, 7 GiB after the accuracy
rows, as Linux keeps it across ``exec``) over the resident set just before the inputs are made,
against the bytes of q, k, v, o, grad_out, dq, dk, dv together (target <=
2x).

Until the feature maps' vjps land, the ELU+1 map gets its elementwise vjp
here (``dx = g * (1 if x > 0 else exp(x))``) where it has none.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import numpy as np

from _common import (cpu_model, interleaved_medians, machine, partial_run_note, positive_int, print_machine,
                     rel_error, table, write_json)

import linattn_nb  # noqa: E402
from linattn_nb.ops._codes import RULES  # noqa: E402
from linattn_nb.ops.grad import cpu as gcpu  # noqa: E402


def _elu1(x):
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0))).astype(x.dtype)


def _data(bh, n, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal((bh, n, d)).astype(dtype) for _ in range(4))
    return q, k, v, g


def _features(x, feature_map):
    if feature_map == "elu":
        return _elu1(x)
    from linattn_nb import feature_maps

    return np.ascontiguousarray(feature_maps.resolve(feature_map)(x), dtype=x.dtype)


def _launcher_args(q, k, v, g, dtype, feature_map="elu"):
    bh, n, d = q.shape
    qf, kf = _features(q, feature_map), _features(k, feature_map)
    v1 = np.concatenate([v, np.ones((bh, n, 1), dtype)], axis=2)
    g1 = np.concatenate([g, -np.full((bh, n, 1), 0.01, dtype)], axis=2)
    return qf, kf, v1, np.zeros((bh, d, d + 1)), g1


def _rule_inputs(name, bh, n, d, seed=1):
    rng = np.random.default_rng(seed)
    if name == "decay":
        return {"log_decay": rng.uniform(-0.1, -0.001, (bh, n))}, {"log_decay": None}
    if name == "gate":
        return {"log_gate": rng.uniform(-0.5, -0.001, (bh, n, d))}, {"log_decay": None}
    if name == "delta":
        return {"beta": rng.uniform(0.0, 1.0, (bh, n))}, {"beta": None}
    if name == "gated_delta":
        return {"beta": rng.uniform(0.0, 1.0, (bh, n)), "log_decay": rng.uniform(-0.1, -0.001, (bh, n))}, {}
    return {}, {}


def _spread(times, num, den):
    """(min, max) over the rounds of the per-round ratio ``num / den`` (timed side by side in each round)."""
    r = [a / b for a, b in zip(times[num], times[den])]
    return min(r), max(r)


def _page_faults(fn):
    """Minor page faults of this process during one call of ``fn`` (after the timed rounds): pages the
    kernel had to find and clear, mostly those of the arrays a call returns once the allocator has given
    the previous call's back to the system (docs/performance.md, "Fresh pages")."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


RULE_NAMES = ("additive", "decay", "gate", "delta", "gated_delta")

#: The map of each rule's standard row: ELU+1 for the rules that add to their state; SiLU+L2
#: (DeltaNet's, unit-norm keys) for the delta rules, whose state stays bounded only while
#: beta * |phi(k)|^2 <= 2.  With ELU+1 features (|phi(k)|^2 about 100 at D = 64) and beta up to 1 the
#: delta state overflows float32: 99.4% of the outputs of the benchmark's data are inf or NaN, and a
#: time measured on them is not that of any real call.
STANDARD_MAPS = {"additive": "elu", "decay": "elu", "gate": "elu", "delta": "silu_l2", "gated_delta": "silu_l2"}


def speed(rounds, rules=RULE_NAMES, feature_map=None, clock="wall"):
    """The speed rows; ``feature_map`` None: each rule's map of :data:`STANDARD_MAPS`."""
    bh, n, d = 16, 4096, 64
    q, k, v, g = _data(bh, n, d, np.float32)
    args = {}
    rows = []
    for name in rules:
        fmap = feature_map or STANDARD_MAPS[name]
        if fmap not in args:
            args[fmap] = _launcher_args(q, k, v, g, np.float32, fmap)
        qf, kf, v1, H0, g1 = args[fmap]
        code = RULES[name][0]
        inputs, _ = _rule_inputs(name, bh, n, d)
        fkw = {}
        if name in ("decay", "gate"):
            fkw["log_decay"] = inputs["log_decay" if name == "decay" else "log_gate"]
        if name in ("delta", "gated_delta"):
            fkw.update(inputs)
        common = dict(causal=True, method="chunked", feature_map=fmap, check_finite=False)
        # timed on values that stay finite, or the row says it was not
        finite = float(np.isfinite(linattn_nb.linear_attention(q, k, v, **common, **fkw)).mean())
        if finite < 1.0:
            print(f"# WARNING: {name} with map {fmap}: only {100 * finite:.1f}% of the outputs are finite on the "
                  "benchmark's data (the state overflowed); its times are not those of a real call")
        cases = {
            "forward": lambda fkw=fkw: linattn_nb.linear_attention(q, k, v, **common, **fkw),
            "backward": lambda code=code, inputs=inputs: gcpu.backward_chunked(qf, kf, v1, H0, g1, inputs=inputs,
                                                                               rule=code),
            "vjp": lambda fkw=fkw: linattn_nb.linear_attention_vjp(q, k, v, g, **common, **fkw),
            # the default call (method="auto"), which runs this machine's calibrated chunk pair where one is stored
            "forward_default": lambda fkw=fkw: linattn_nb.linear_attention(q, k, v, **{**common, "method": "auto"},
                                                                           **fkw),
            "vjp_default": lambda fkw=fkw: linattn_nb.linear_attention_vjp(q, k, v, g, **{**common, "method": "auto"},
                                                                           **fkw),
        }
        if name in ("additive", "delta"):
            cases["backward_scan"] = lambda code=code, inputs=inputs: gcpu.backward_scan(
                qf, kf, v1, H0, g1, inputs=inputs, rule=code)
        med, times = interleaved_medians(cases, rounds, clock=clock)
        lo, hi = _spread(times, "vjp", "forward")
        dlo, dhi = _spread(times, "vjp_default", "forward_default")
        faults = {name: _page_faults(cases[name]) for name in ("forward", "vjp")}
        row = {"rule": name, "feature_map": fmap, "finite_outputs": finite, "forward_s": med["forward"],
               "backward_s": med["backward"],
               "ratio": med["backward"] / med["forward"], "vjp_s": med["vjp"],
               "vjp_ratio": med["vjp"] / med["forward"], "vjp_ratio_range": f"{lo:.2f}-{hi:.2f}",
               "forward_default_s": med["forward_default"], "vjp_x_default": med["vjp"] / med["forward_default"],
               "vjp_default_s": med["vjp_default"], "default_ratio": med["vjp_default"] / med["forward_default"],
               "default_range": f"{dlo:.2f}-{dhi:.2f}",
               "forward_faults": faults["forward"], "vjp_faults": faults["vjp"]}
        if "backward_scan" in med:
            row["scan_backward_s"] = med["backward_scan"]
        rows.append(row)
    return rows


def accuracy(n):
    q, k, v, g = _data(1, n, 64, np.float32, seed=2)
    a32 = _launcher_args(q, k, v, g, np.float32)
    a64 = [x.astype(np.float64) for x in a32]
    r32 = gcpu.backward_chunked(*a32)
    r64 = gcpu.backward_chunked(*a64)
    row = {"n": n}
    for field in ("dq", "dk", "dv", "dH0"):
        row[field] = rel_error(np.asarray(getattr(r32, field)), np.asarray(getattr(r64, field)))
    return row


_MEMORY_CHILD = r"""
import json, resource, sys, tracemalloc
import numpy as np
sys.path.insert(0, sys.argv[2])
import backward_cpu as bc
import linattn_nb
n = int(sys.argv[1])
kw = dict(causal=True, method="chunked", feature_map="elu", check_finite=False)
w = bc._data(1, 64, 64, np.float32)
linattn_nb.linear_attention_vjp(*w, **kw)     # compile and warm up on a small call
linattn_nb.linear_attention(*w[:3], **kw)
with open("/proc/self/statm") as fh:
    rss0 = int(fh.read().split()[1]) * resource.getpagesize()
tracemalloc.start()
q, k, v, g = bc._data(1, n, 64, np.float32)
o = linattn_nb.linear_attention(q, k, v, **kw)
res = linattn_nb.linear_attention_vjp(q, k, v, g, **kw)
traced = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
with open("/proc/self/status") as fh:  # this process's own high-water mark: ru_maxrss keeps the parent's across exec
    peak = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
arrays = (q, k, v, o, g, res.dq, res.dk, res.dv)
del res, o
largs = bc._launcher_args(q, k, v, g, np.float32)
del q, k, v, g
tracemalloc.start()
grads = bc.gcpu.backward_chunked(*largs)
launcher_peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
outs = sum(x.nbytes for x in grads if x is not None)
print(json.dumps({"n": n, "traced_peak_bytes": traced, "rss_rise_bytes": max(0, peak - rss0),
                  "arrays_bytes": sum(a.nbytes for a in arrays), "launcher_peak_bytes": launcher_peak,
                  "launcher_outputs_bytes": outs}))
"""


def memory(n):
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, str(n), here], capture_output=True, text=True,
                          check=True, env={**os.environ, "PYTHONPATH": os.path.dirname(here)})
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["ratio"] = row["traced_peak_bytes"] / row["arrays_bytes"]
    row["rss_ratio"] = row["rss_rise_bytes"] / row["arrays_bytes"]
    return row


def _rules(text):
    """The rules of ``--rules`` (comma-separated), each one of :data:`RULE_NAMES`."""
    if isinstance(text, tuple):
        return text
    rules = tuple(r.strip() for r in text.split(",") if r.strip())
    bad = [r for r in rules if r not in RULE_NAMES]
    if bad or not rules:
        raise argparse.ArgumentTypeError(f"unknown rule(s) {', '.join(bad) or repr(text)}; "
                                         f"choose from {', '.join(RULE_NAMES)}")
    return rules


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds; accuracy and memory at N = 2**16")
    ap.add_argument("--skip-long", action="store_true", help="speed rows only")
    ap.add_argument("--rounds", type=positive_int, default=None, help="interleaved rounds (default 7; --quick 3)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="time the speed rows in wall or CPU seconds (cpu: steadier on a shared machine; "
                         "run with NUMBA_NUM_THREADS=1 so that no thread spins while it waits)")
    ap.add_argument("--rules", type=_rules, default=",".join(RULE_NAMES),
                    help=f"comma-separated rules of the speed rows (of {', '.join(RULE_NAMES)}; default all)")
    ap.add_argument("--feature-map", default=None, help="one map for every speed row (default: ELU+1 for the "
                    "additive, decay and gate rules, SiLU+L2 for the delta rules, whose state overflows with ELU+1)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/backward_cpu.json)")
    args = ap.parse_args(argv)
    import numba

    print(f"CPU: {cpu_model()}; Numba threads: {numba.get_num_threads()}")
    print_machine()
    from linattn_nb import _tune

    print(f"method='auto' (forward_default): calibration {_tune.status_line()}")
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 7)
    rules = _rules(args.rules)
    rows = speed(rounds, rules, args.feature_map, args.clock)
    print(f"\nSpeed: B*H = 16, N = 4096, D = M = 64, float32, map {args.feature_map or 'per rule'}, median of "
          f"{rounds} interleaved rounds, {args.clock} time")
    print(table(rows, ["rule", "feature_map", "finite_outputs", "forward_s", "backward_s", "ratio", "vjp_s",
                       "vjp_ratio", "vjp_ratio_range", "forward_default_s", "vjp_x_default", "vjp_default_s",
                       "default_ratio", "default_range", "forward_faults", "vjp_faults", "scan_backward_s"],
                {"finite_outputs": "{:.3f}", "forward_s": "{:.4f}", "backward_s": "{:.4f}", "ratio": "{:.2f}",
                 "vjp_s": "{:.4f}",
                 "vjp_ratio": "{:.2f}", "forward_default_s": "{:.4f}", "vjp_x_default": "{:.2f}",
                 "vjp_default_s": "{:.4f}", "default_ratio": "{:.2f}",
                 "scan_backward_s": "{:.4f}"}))
    result = {"machine": machine(), "shape": {"BH": 16, "N": 4096, "D": 64, "M": 64, "dtype": "float32",
                                              "feature_map": args.feature_map or "per rule"}, "rounds": rounds,
              "clock": args.clock, "speed": rows}
    partial = [o for o, on in (("--quick", args.quick), ("--skip-long", args.skip_long),
                               ("--rules", rules != tuple(RULE_NAMES)),
                               ("--feature-map", args.feature_map is not None)) if on]
    if args.out is None and partial:
        # the committed results file holds the full run's rows (docs/measured.md is built from it)
        partial_run_note(" ".join(partial), "backward_cpu")
        args.out = False
    if args.skip_long:
        if args.out is not False:
            print(f"# wrote {write_json('backward_cpu', result, args.out)}")
        return
    n = 2 ** 16 if args.quick else 2 ** 20
    acc = accuracy(n)
    print(f"\nAccuracy: float32 vs float64 chunked backward, additive, B*H = 1, N = {n}, D = M = 64 "
          "(relative Frobenius error; target <= 1e-5)")
    print(table([acc], ["n", "dq", "dk", "dv", "dH0"], {c: "{:.2e}" for c in ("dq", "dk", "dv", "dH0")}))
    mem = memory(n)
    print(f"\nPeak memory: forward + linear_attention_vjp (chunked, ELU+1, float32), B*H = 1, N = {n}, "
          "D = M = 64 (NumPy peak by tracemalloc, inputs included; peak RSS rise over the RSS before the "
          "inputs; target <= 2x the arrays)")
    print(table([{"n": mem["n"], "traced_MiB": mem["traced_peak_bytes"] / 2**20,
                  "rss_rise_MiB": mem["rss_rise_bytes"] / 2**20,
                  "arrays_MiB": mem["arrays_bytes"] / 2**20, "ratio": mem["ratio"], "rss_ratio": mem["rss_ratio"]}],
                ["n", "traced_MiB", "rss_rise_MiB", "arrays_MiB", "ratio", "rss_ratio"],
                {"traced_MiB": "{:.0f}", "rss_rise_MiB": "{:.0f}", "arrays_MiB": "{:.0f}", "ratio": "{:.2f}",
                 "rss_ratio": "{:.2f}"}))
    result.update(accuracy=acc, memory=mem)
    if args.out is not False:
        print(f"# wrote {write_json('backward_cpu', result, args.out)}")
    print(f"The additive chunked launcher alone allocates {mem['launcher_peak_bytes'] / 2**20:.1f} MiB, "
          f"its results {mem['launcher_outputs_bytes'] / 2**20:.1f} MiB of it (the rest: the front end's "
          "features, values with ones, float64 gradient of [num | den] and copies)")


if __name__ == "__main__":
    main()
