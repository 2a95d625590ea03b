"""Static GPU report without a GPU: registers, spills, occupancy, SASS loop mix, modelled traffic.

For every CUDA kernel of the package at its default launch configuration
(D_phi = M = 64; float32 and float64; every update rule for the sequence
kernel), compiled to sm_90 PTX and assembled by ``ptxas``
(``tools/cuda_resources.py``, the measuring tool outside the package):

1. registers per thread, spill stores/loads, stack, static shared memory,
   threads per block, resident blocks and warps per multiprocessor on
   sm_90 (H100/H200) and what limits them;
2. the static SASS instruction mix of each innermost loop (a loop is closed by
   a backward branch), with ``nvdisasm`` (or ``cuobjdump``) when found: the
   ``nvidia-cuda-nvdisasm`` / ``nvidia-cuda-cuobjdump`` wheels put them in
   ``nvidia/cu13/bin``; the per-token loop of the causal sequence kernel (its
   innermost loop without global loads or stores with the most FFMA/DFMA) is
   reported on its own, against the target FFMA >= 60 %.  Static counts: the
   per-tile work around that loop (staging, the G-way reduction of the partial
   outputs) is in other loops and is not amortised into it;
3. the launch plans at the headline shape (B = 8, H = 16, N = 16384,
   D = M = 64, float32, causal ``scan`` and ``chunked``): modelled
   global-memory traffic per stream and FLOPs executed
   (``tools/cuda_traffic.py``), against the minimum
   (q, k, v, out once; 4 B H N D M FLOPs) and the roofline (4.8 TB/s HBM,
   67 TFLOP/s FP32); the targets are checked for the plan ``method="auto"``
   picks on an H200; then every update rule at the same shape (the plan
   ``auto`` picks for it, float32 device inputs, the front end's range check
   of the rule's inputs counted), against the floor of its own inputs;
4. the q, k staging loops of the float32 additive kernel (global loads and
   the exp of ELU+1): the kernel for every feature map against the one
   specialised on ELU+1 that the launchers run (``config.CUDA_SPECIALIZE_MAPS``),
   with four elements per vector load (contiguous inputs, ``vec`` 3, no
   suffix), one per load (``/vec0``: strided inputs) and that with 64-bit
   offsets (``/off64``).

Runs on any machine with the ``cuda`` extra (no GPU needed); the
``gpu-static`` extra adds nvdisasm for the SASS tables::

    python -m pip install -e ".[gpu-static]"
    python benchmarks/gpu_static.py [--json PATH] [--no-sass] [--all-loops]

The first run compiles every kernel (minutes); results are cached per source
revision in linattn_nb's kernel cache folder.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import sys
import time

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # this process never launches; subprocesses compile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, cpu_model, positive_int, print_machine, table, write_json  # noqa: E402

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from linattn_nb import config  # noqa: E402
from linattn_nb.ops._codes import RULE_ADDITIVE, RULES  # noqa: E402

if str(ROOT / "tools") not in sys.path:  # the measuring tool: tools/ of the checkout, outside the package
    sys.path.insert(0, str(ROOT / "tools"))
import cuda_resources as CR  # noqa: E402

HBM_TBS = 4.8
FP32_TFLOPS = 67.0
FP64_TFLOPS = 34.0  # H100/H200 SXM vector FP64 (no tensor cores)
HEADLINE = {"B": 8, "H": 16, "N": 16384, "D": 64, "M": 64}
FMA_OPS = {"FFMA", "DFMA", "HFMA2"}
GLOBAL_OPS = {"LDG", "STG", "LD", "ST", "ATOM", "ATOMG", "RED"}


# ---------------------------------------------------------------------------
# Traffic and FLOP model of the launch plans at the headline shape
# ---------------------------------------------------------------------------
H200_SMS = 132  # the method auto picks on the headline machine (no GPU here: the simulator reports 1)


def headline_model():
    """Rows of the modelled plans (``scan``, ``chunked``) at the headline shape, the totals and the targets
    (traffic <= 2.5 GB, FLOPs <= 1.5 x 4 B H N D M).

    The model is ``traffic_model`` of ``tools/cuda_traffic.py`` (global
    bytes per stream and FLOPs executed, from the launch plan); the targets
    are checked for the plan ``method="auto"`` picks on an H200 (132 SMs).
    """
    from linattn_nb import _cuda_dispatch as CD
    from cuda_traffic import traffic_model

    B, H, N, D, M = (HEADLINE[k] for k in ("B", "H", "N", "D", "M"))
    min_bytes = B * H * N * (2 * D + 2 * M) * 4
    min_flops = 4 * B * H * N * D * M
    auto = CD.select_auto_cuda(rule="additive", causal=True, batch=B * H, n=N, f=D, m=M, dtype="float32",
                               sms=H200_SMS)
    rows, plans = [], {}
    for method in ("scan", "chunked"):
        tm = traffic_model((B * H, N, D, M), method=method, dtype="float32", rule=RULE_ADDITIVE, sms=H200_SMS)
        t = max(tm["bytes"] / (HBM_TBS * 1e12), tm["flops"] / (FP32_TFLOPS * 1e12))
        plans[method] = tm
        rows.append({"plan": method + (" (auto)" if method == auto else ""), "layout": tm["layout"],
                     "warps/SM": tm["warps"] / H200_SMS, "launches": tm["launches"],
                     **{f"{k} GB": v / 1e9 for k, v in tm["parts"].items()}, "total GB": tm["bytes"] / 1e9,
                     "GFLOP": tm["flops"] / 1e9, "x 4BHNDM": tm["flops_ratio"], "roofline ms": t * 1e3})
    t_min = max(min_bytes / (HBM_TBS * 1e12), min_flops / (FP32_TFLOPS * 1e12)) * 1e3
    rows.append({"plan": "minimum (q, k, v, out once)", "layout": "", "warps/SM": float("nan"), "launches": 1,
                 "q GB": B * H * N * D * 4 / 1e9,
                 "k GB": B * H * N * D * 4 / 1e9, "v GB": B * H * N * M * 4 / 1e9,
                 "out GB": B * H * N * M * 4 / 1e9, "factors GB": 0.0, "states GB": 0.0,
                 "total GB": min_bytes / 1e9, "GFLOP": min_flops / 1e9, "x 4BHNDM": 1.0, "roofline ms": t_min})
    pick = plans[auto]
    summary = {"model": "tools/cuda_traffic.py:traffic_model", "auto": auto,
               "traffic_gb": pick["bytes"] / 1e9, "flops_g": pick["flops"] / 1e9,
               "min_traffic_gb": min_bytes / 1e9, "min_flops_g": min_flops / 1e9,
               "flops_ratio": pick["flops_ratio"], "roofline_ms": rows[("scan", "chunked").index(auto)]["roofline ms"],
               "min_roofline_ms": t_min,
               "targets": {f"traffic <= 2.5 GB ({auto}, the auto plan)": pick["bytes"] <= 2.5e9,
                           f"FLOPs <= 1.5 x 4 BHNDM ({auto})": pick["flops"] <= 1.5 * min_flops}}
    return rows, summary


def rule_model():
    """Rows of the plan ``method="auto"`` picks for each update rule at the headline shape on an H200
    (the headline's targets, for every rule), for the whole call with the rule's inputs on the device as its
    users pass them: float32 q, k, v and float32 ``log_decay`` (read in place), ``beta`` float32 (packed
    into the delta rules' float64 (B, N, 2) array); the front end's range check of those inputs is
    counted (``traffic_model(range_check=True)``).  ``floor GB``: q, k, v, out and the rule's inputs
    read once each, in float32 -- no plan of any form moves less."""
    from linattn_nb import _cuda_dispatch as CD
    from cuda_traffic import traffic_model

    B, H, N, D, M = (HEADLINE[k] for k in ("B", "H", "N", "D", "M"))
    io = B * H * N * (2 * D + 2 * M) * 4
    inputs = {"additive": 0, "decay": B * H * N, "gate": B * H * N * D, "delta": B * H * N,
              "gated_delta": 2 * B * H * N}
    rows = []
    for name, (code, _) in RULES.items():
        auto = CD.select_auto_cuda(rule=name, causal=True, batch=B * H, n=N, f=D, m=M, dtype="float32",
                                   sms=H200_SMS)
        tm = traffic_model((B * H, N, D, M), method=auto, dtype="float32", rule=code, sms=H200_SMS,
                           factor_dtype="float32", range_check=True)
        floor = io + inputs[name] * 4
        rows.append({"rule": name, "plan": tm["method"], "layout": tm["layout"],
                     "factors GB": tm["parts"]["factors"] / 1e9, "checks GB": tm["parts"]["checks"] / 1e9,
                     "total GB": tm["bytes"] / 1e9,
                     "floor GB": floor / 1e9, "x 4BHNDM": tm["flops_ratio"],
                     "traffic <= 2.5 GB": tm["bytes"] <= 2.5e9, "FLOPs <= 1.5 x": tm["flops_ratio"] <= 1.5})
    return rows


# ---------------------------------------------------------------------------
# Kernels and their SASS
# ---------------------------------------------------------------------------
def default_specs():
    """Every kernel at its default configuration (D_phi = M = 64), the sequence kernel in every layout."""
    specs = []
    for acc in ("float32", "float64"):
        for name, (code, _) in RULES.items():
            specs.append(CR.sequence_spec(64, 64, acc, code))
            for lay in ("rows", "tiles"):
                extra = CR.sequence_spec(64, 64, acc, code, layout=lay)
                if extra.key not in {x.key for x in specs}:
                    specs.append(extra)
    # what the launchers run: the kernel specialised on its feature map (here ELU+1, map code 1), with
    # vector loads (contiguous inputs); then one element per load (strided inputs: vec=0) and that
    # with 64-bit offsets (sequences of 2^31 elements or more)
    for kw in ({}, {"vec": 0}, {"vec": 0, "off32": False}):
        specs += [CR.sequence_spec(64, 64, "float32", RULE_ADDITIVE, layout=lay, code=1, **kw)
                  for lay in ("owner", "rows", "tiles")]
    return specs + CR.helper_specs() + CR.backward_specs() + CR.step_specs()


def loop_rows(spec, result, *, all_loops=False, min_insns=12):
    """Rows of the innermost loops of one kernel's SASS (FMA share and the top opcodes)."""
    sass = result.get("sass") or ""
    if not sass:
        return [], None
    loops = [lp for lp in CR.sass_loops(CR.parse_sass(sass)) if lp.innermost and len(lp.insns) >= min_insns]
    rows = []
    for i, lp in enumerate(loops):
        mix = lp.mix()
        n = sum(mix.values())
        fma = sum(mix[o] for o in FMA_OPS)
        rows.append({"kernel": spec.key, "loop": f"#{i} 0x{lp.start:x}", "insns": n, "FMA": fma,
                     "FMA %": 100.0 * fma / n if n else 0.0, "global": any(o in mix for o in GLOBAL_OPS),
                     "top opcodes": ", ".join(f"{o} {c}" for o, c in mix.most_common(6))})
    # the per-token loop works on shared memory and registers only: the staging loops (global loads,
    # and the FMAs of exp in the feature maps) are not it; of loops with as many FMA, the lowest share
    # (the conservative reading: a first version of the gate's tile kernel had three loops of 64 FFMA,
    # the query mode's plain start-state read at 66 % and the causal path's two at 56-57 %)
    token = max((r for r in rows if not r["global"]), key=lambda r: (r["FMA"], -r["FMA %"]), default=None)
    if not all_loops:
        rows = sorted(rows, key=lambda r: -r["FMA"])[:3]
    return rows, token


def _loaded_elements(lp) -> int:
    """float32 elements the global loads of loop ``lp`` read (``LDG.E.128``: 4, ``.64``: 2, else 1)."""
    n = 0
    for ins in lp.insns:
        if ins.opcode.split(".")[0] in ("LD", "LDG"):
            n += 4 if ".128" in ins.opcode else 2 if ".64" in ins.opcode else 1
    return n


def staging_rows(specs, res):
    """Per float32 additive sequence kernel: its registers, SASS size and the loops that stage q and k
    (global loads and MUFU, the exp of ELU+1), as instructions per staged (q, k) pair of elements
    (elements loaded / 2: a vector load counts its four) in the main staging loop (the one that loads
    the most elements per iteration; its unrolled copies and remainder loops are listed by size)."""
    rows = []
    for s in specs:
        if not s.key.startswith("seq/float32/additive/") or not res.get(s.key, {}).get("sass"):
            continue
        insns = CR.parse_sass(res[s.key]["sass"])
        sizes, main, bra = [], None, 0
        for lp in CR.sass_loops(insns):
            mix = lp.mix()
            loads = sum(mix[o] for o in ("LD", "LDG"))
            if lp.innermost and loads and mix["MUFU"]:
                n = sum(mix.values())
                sizes.append(n)
                cand = (_loaded_elements(lp), -n / max(1, _loaded_elements(lp) / 2))
                main = cand if main is None or cand > main else main
                bra = max(bra, mix["BRA"])
        rows.append({"kernel": s.key, "regs": CR.resources(res[s.key]).registers, "SASS insns": len(insns),
                     "loops": ", ".join(str(n) for n in sizes),
                     "insns per (q, k) pair": -main[1] if main else 0.0,
                     "BRA": bra})
    return rows


def tile_rows(specs, res):
    """The tile layout's work per tile and thread, modelled from its static SASS (no per-token loop there).

    The tile loop (the outer loop that loads the inputs) holds the staging
    loops (global loads), the compute loops in program order -- the causal
    scores when they are a loop of their own (one per thread of the first
    T (T + 1) / 2: weight T (T + 1) / 2 / threads), the outputs' product with
    the start state (run 4 F / its FMA times: 4 F products per thread) and
    the state update (16 T / its FMA times) -- and straight-line code,
    counted once: the scores when ptxas unrolled them (at D_phi = M = 64
    each thread has at most one; counted for every thread, though half of
    them skip it), the tile tokens' product with [v | 1], the normaliser,
    the division and stores, the barriers -- and every branch not taken
    (the other v staging path, the division's slow path), so an upper bound.
    ``compute``: the compute loops and the straight-line code; ``whole``:
    with the staging loops once each (one item per thread at D_phi = M = 64;
    both v staging loops, of which one runs).
    """
    rows = []
    for s in specs:
        if "/tiles" not in s.key or not res.get(s.key, {}).get("sass"):
            continue
        insns = CR.parse_sass(res[s.key]["sass"])
        loops = CR.sass_loops(insns)
        outer = [lp for lp in loops if not lp.innermost and any(i.base in GLOBAL_OPS for i in lp.insns)]
        if not outer:
            continue
        tile = max(outer, key=lambda lp: len(lp.insns))
        inner = [lp for lp in loops if lp.innermost and tile.start <= lp.start and lp.end <= tile.end]
        R, C, G, MB, T = s.info["cfg"]
        nth = s.threads
        fma_of = lambda mix: sum(mix[o] for o in FMA_OPS)  # noqa: E731
        comp = [lp for lp in inner if fma_of(lp.mix()) and not any(o in lp.mix() for o in GLOBAL_OPS)]
        stag = [lp for lp in inner if any(o in lp.mix() for o in GLOBAL_OPS)]
        if len(comp) not in (2, 3):
            rows.append({"kernel": s.key, "phases": f"{len(comp)} compute loops (expected 2 or 3): not modelled"})
            continue
        weights = [4 * R / fma_of(comp[-2].mix()), 16 * T / fma_of(comp[-1].mix())]
        if len(comp) == 3:
            weights.insert(0, T * (T + 1) / 2 / nth)
        in_loops = {i.addr for lp in inner for i in lp.insns}
        rest = CR.opcode_mix([i for i in tile.insns if i.addr not in in_loops])
        n_c = sum(w * sum(lp.mix().values()) for w, lp in zip(weights, comp)) + sum(rest.values())
        f_c = sum(w * fma_of(lp.mix()) for w, lp in zip(weights, comp)) + fma_of(rest)
        n_s = sum(sum(lp.mix().values()) for lp in stag)
        f_s = sum(fma_of(lp.mix()) for lp in stag)
        rows.append({"kernel": s.key, "threads": nth, "tokens/tile": T,
                     "phases": ", ".join(f"{sum(lp.mix().values())}x{w:.2g}" for w, lp in zip(weights, comp)),
                     "straight": sum(rest.values()), "staging": n_s,
                     "compute insns": n_c, "compute FMA %": 100.0 * f_c / n_c,
                     "whole FMA %": 100.0 * (f_c + f_s) / (n_c + n_s),
                     "insns/token": (n_c + n_s) * nth / T})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="results (default benchmarks/results/gpu_static.json)")
    ap.add_argument("--no-sass", action="store_true", help="skip the disassembly and the loop tables")
    ap.add_argument("--all-loops", action="store_true", help="every innermost loop (default: 3 per kernel)")
    ap.add_argument("--jobs", type=positive_int, default=None, help="compiling subprocesses (default: CPUs)")
    args = ap.parse_args(argv)

    import numba

    ptxas = CR.find_tool("ptxas")
    dis = CR.find_tool("nvdisasm") or CR.find_tool("cuobjdump")
    try:
        from importlib.metadata import version

        ncv = version("numba-cuda")
    except Exception:
        ncv = "?"
    print_machine("# ")
    print("# gpu_static: sm_90 (H100/H200) resources of linattn_nb's CUDA kernels, no GPU needed")
    print(f"# {_dt.datetime.now().astimezone().isoformat(timespec='seconds')} on {cpu_model()} "
          f"({os.cpu_count()} CPUs), python {platform.python_version()}, numba {numba.__version__}, "
          f"numba-cuda {ncv}")
    print(f"# ptxas: {ptxas or 'NOT FOUND'} ({CR.tool_version(ptxas)})")
    print(f"# disassembler: {dis or 'none (pip install nvidia-cuda-nvdisasm): no loop tables'}"
          + (f" ({CR.tool_version(dis)})" if dis else ""))
    out = {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"), "cpu": cpu_model(),
           "numba": numba.__version__, "numba_cuda": ncv, "ptxas": CR.tool_version(ptxas),
           "disassembler": CR.tool_version(dis)}

    rows, summary = headline_model()
    B, H, N, D, M = (HEADLINE[k] for k in ("B", "H", "N", "D", "M"))
    print(f"\n## launch plans at B={B}, H={H}, N={N}, D={D}, M={M}, float32, causal (chunked: chunk "
          f"{config.CUDA_CHUNK_SIZE}); model: {summary['model']}; auto picks {summary['auto']} on {H200_SMS} SMs")
    cols = ["plan", "layout", "warps/SM", "launches", "q GB", "k GB", "v GB", "out GB", "factors GB", "states GB",
            "total GB", "GFLOP",
            "x 4BHNDM", "roofline ms"]
    fmt = {c: "{:.3f}" for c in cols if c.endswith("GB")}
    fmt.update({"GFLOP": "{:.1f}", "x 4BHNDM": "{:.2f}", "roofline ms": "{:.3f}", "warps/SM": "{:.1f}"})
    print(table(rows, cols, fmt))
    print(f"auto plan: modelled traffic {summary['traffic_gb']:.2f} GB (minimum {summary['min_traffic_gb']:.2f}), "
          f"FLOPs {summary['flops_g']:.1f} G = {summary['flops_ratio']:.2f} x 4 BHNDM; roofline "
          f"{summary['roofline_ms']:.3f} ms vs {summary['min_roofline_ms']:.3f} ms "
          f"({HBM_TBS} TB/s, {FP32_TFLOPS} TFLOP/s FP32)")
    for what, ok in summary["targets"].items():
        print(f"  {'met' if ok else 'NOT met'}: {what}")
    out["headline"] = {"rows": rows, **summary}
    rrows = rule_model()
    print("\n## every rule at the same shape, the plan auto picks, the whole call with float32 device inputs "
          "(log_decay read in place, its range checked in one more read: 'checks'); 'floor': q, k, v, out and "
          "the rule's inputs once")
    print(table(rrows, ["rule", "plan", "layout", "factors GB", "checks GB", "total GB", "floor GB", "x 4BHNDM"],
                {"factors GB": "{:.3f}", "checks GB": "{:.3f}", "total GB": "{:.3f}", "floor GB": "{:.3f}",
                 "x 4BHNDM": "{:.2f}"}))
    for r in rrows:
        for what in ("traffic <= 2.5 GB", "FLOPs <= 1.5 x"):
            why = ""
            if what.startswith("traffic") and not r[what] and r["floor GB"] > 2.5:
                why = f" -- the target is below the floor of its own inputs, {r['floor GB']:.2f} GB"
            print(f"  {'met' if r[what] else 'NOT met'}: {what} ({r['rule']}, {r['plan']}: "
                  f"{r['total GB']:.2f} GB, {r['x 4BHNDM']:.2f} x 4 BHNDM){why}")
    out["rules"] = rrows

    if not ptxas:
        print("\nptxas not found: install the 'cuda' extra (nvidia-cuda-nvcc-cu12) for the kernel tables")
        write_json("gpu_static", out, args.json)
        return 1
    specs = default_specs()
    t0 = time.perf_counter()
    res = CR.measure(specs, ptxas=ptxas, disasm=dis, sass=bool(dis) and not args.no_sass, jobs=args.jobs)
    cached = sum(1 for r in res.values() if r.get("cached"))
    print(f"\n## kernels at D_phi = M = 64 ({len(specs)} compiled in {time.perf_counter() - t0:.0f} s, "
          f"{cached} from the cache)")
    krows = []
    for s in specs:
        r = res.get(s.key, {"error": "missing"})
        if "error" in r:
            krows.append({"kernel": s.key, "launch": "ERROR " + r["error"].splitlines()[-1][:60]})
            continue
        k = CR.resources(r)
        occ = CR.occupancy(k.registers, s.threads, k.shared + s.dynamic_shared)
        probs = CR.launch_problems(k.registers, s.threads, k.shared, s.dynamic_shared)
        krows.append({"kernel": s.key, "threads": s.threads, "regs": k.registers,
                      "spill st/ld B": f"{k.spill_stores}/{k.spill_loads}", "stack B": k.stack, "smem B": k.shared,
                      "blocks/SM": occ.blocks, "warps/SM": occ.warps, "limiter": occ.limiter,
                      "launch": "ok" if not probs else "FAILS: " + "; ".join(probs)})
    print(table(krows, ["kernel", "threads", "regs", "spill st/ld B", "stack B", "smem B", "blocks/SM", "warps/SM",
                        "limiter", "launch"]))
    out["kernels"] = krows

    if dis and not args.no_sass:
        lrows, tokens = [], []
        for s in specs:
            rs, token = loop_rows(s, res.get(s.key, {}), all_loops=args.all_loops)
            lrows += rs
            if s.group == "sequence" and token:
                tokens.append({**token, "kernel": s.key})
        print("\n## innermost SASS loops (static instruction mix; the 3 with the most FMA per kernel)")
        print(table(lrows, ["kernel", "loop", "insns", "FMA", "FMA %", "top opcodes"], {"FMA %": "{:.0f}"}))
        print("\n## per-token loop of the sequence kernel (its innermost loop without global memory access with the "
              "most FFMA/DFMA, ties: the lowest share: the causal scan's update + read-out, staged tiles in shared memory)")
        print(table(tokens, ["kernel", "loop", "insns", "FMA", "FMA %", "top opcodes"], {"FMA %": "{:.0f}"}))
        for t in tokens:  # the target: FFMA >= 60 % of the per-token loop, for every rule
            if t["kernel"].startswith("seq/float32/"):
                lay = ("row groups" if "/rows" in t["kernel"] else "tiles (its outputs loop)" if "/tiles" in t["kernel"]
                       else "default layout")
                lay += ", the kernel specialised on ELU+1" if "/map1" in t["kernel"] else ""
                lay += ", one element per load (strided inputs)" if "/vec0" in t["kernel"] else ""
                lay += ", 64-bit offsets" if "/off64" in t["kernel"] else ""
                print(f"  {'met' if t['FMA %'] >= 60 else 'NOT met'}: FFMA >= 60 % of the per-token loop at "
                      f"D = M = 64 float32, {t['kernel'].split('/')[2]} rule, {lay} ({t['FMA %']:.0f} %)")
        out["loops"] = lrows
        out["token_loops"] = tokens
        srows = staging_rows(specs, res)
        print("\n## q, k staging loops of the float32 additive sequence kernel (global loads and exp): the "
              "kernel for every map against the one specialised on ELU+1 (map1, what the launchers run), "
              "with vector loads (no suffix), one element per load (/vec0) and 64-bit offsets (/off64)")
        print(table(srows, ["kernel", "regs", "SASS insns", "loops", "insns per (q, k) pair", "BRA"],
                    {"insns per (q, k) pair": "{:.0f}"}))
        out["staging_loops"] = srows
        trows = tile_rows(specs, res)
        if trows:
            print("\n## tile layout: work of one tile per thread, modelled from the static SASS (scores x their "
                  "share of threads, outputs x 4 D_phi / FMA, state x 16 T / FMA; 'straight': the code run once "
                  "per tile; 'staging': the loops that load q, k, v, once each)")
            print(table(trows, ["kernel", "threads", "tokens/tile", "phases", "straight", "staging", "compute insns",
                                "compute FMA %", "whole FMA %", "insns/token"],
                        {"compute insns": "{:.0f}", "compute FMA %": "{:.0f}", "whole FMA %": "{:.0f}",
                         "insns/token": "{:.0f}"}))
            for t in trows:
                if t["kernel"].startswith("seq/float32/") and "compute FMA %" in t:
                    print(f"  {'met' if t['compute FMA %'] >= 60 else 'NOT met'}: FFMA >= 60 % of the tile "
                          f"layout's compute per tile ({t['kernel']}: {t['compute FMA %']:.0f} %; with the "
                          f"staging {t['whole FMA %']:.0f} %)")
            out["tile_work"] = trows
    path = write_json("gpu_static", out, args.json)
    print(f"\n# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
