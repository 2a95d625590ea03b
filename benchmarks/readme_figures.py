"""The README's measured figures, computed from the files the benchmarks and studies wrote.

Run::

    python benchmarks/readme_figures.py          # one sentence per source, as the README quotes it
    python benchmarks/readme_figures.py --page   # rewrite docs/measured.md, the tables of every results file

Sources (all in the repository):

- ``benchmarks/results/causal_cpu.json`` (``python benchmarks/causal_cpu.py``): the CPU headline;
- ``benchmarks/results/decode.json`` (``python benchmarks/decode.py``): the decode step;
- the newest ``docs/logs/gpu_check_*.log`` (``bash benchmarks/gpu_check.sh`` on a GPU machine): the GPU line;
- ``benchmarks/results/{horizon,rules}.jsonl`` (``linattn report``'s raw results): the memory-horizon and
  update-rules studies' figures.

``--help`` lists the options; an unknown option is refused (exit 2) and writes nothing.

``tests/test_readme_figures.py`` checks that the README contains each sentence as printed and that
``docs/measured.md`` is the page the results files give.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from linattn_nb.studies import load_results
from linattn_nb.studies._study import fmt, mean_ci, pm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LOGS = ROOT / "docs" / "logs"


def _x(value: float) -> str:
    """A ratio as the README prints it: two significant figures, three from 100 on."""
    return f"{value:.0f}×" if value >= 10 else f"{value:.2g}×" if value >= 1 else f"{value:.2f}×"


def _blas(machine: dict) -> str:
    kinds = sorted({f"{b.get('internal_api')} {b.get('architecture')}" for b in machine.get("blas", [])})
    return ", ".join(kinds) or "unknown BLAS"


def cpu_figure(data: dict) -> str:
    """The CPU headline from ``causal_cpu.json``: the chunked call at N = 4096 and its ratios, measured
    side by side in one run (interleaved medians for sgemm, scan and SDPA; the table for blocked softmax)."""
    m, s, shape = data["machine"], data["summary"], data["shape"]
    inter = s["interleaved_medians_ms"]
    if shape["D"] != shape["M"]:
        raise ValueError(f"causal_cpu.json has D = {shape['D']} != M = {shape['M']}: the README quotes D = M")
    load = f", load {m['load_avg_1m']:.1f}" if "load_avg_1m" in m else ""
    text = (f"CPU ({m['cpu']}, {m['logical_cpus']} logical CPUs, {_blas(m)} kernels{load}, {m['date'][:10]}; "
            f"B·H = {shape['BH']}, N = 4096, D = M = {shape['D']}, float32, causal, "
            f"`python benchmarks/causal_cpu.py`): the chunked kernel takes {inter['chunked']:.1f} ms, "
            f"{s['headline_x_sgemm']:.2f}× the machine's sgemm rate, {_x(s['speedup_vs_scan'])} faster than the "
            f"per-token scan, {_x(s['table_speedup_vs_softmax_blocked'])} faster than blocked softmax")
    if "speedup_vs_torch_sdpa" in s:
        text += f" and {_x(s['speedup_vs_torch_sdpa'])} faster than torch {m.get('torch', '')}'s SDPA"
    return text + "."


def decode_figure(data: dict) -> str:
    """The decode line from ``decode.json``: the state step's median over the contexts (interleaved rounds
    where the run has them) and the KV-cache step at 64k tokens."""
    s, p, m = data["summary"], data["params"], data["machine"]
    meds = s.get("interleaved_state_median_us") or s["state_median_us_1k_256k"]
    ctx = sorted(int(c) for c in meds)
    lo, hi = min(meds.values()), max(meds.values())
    load = m.get("loadavg_start")
    text = (f"Decoding ({m['cpu']}, load {load[0]:.1f}, {data['date'][:10]}; H = {p['heads']}, D = M = {p['dim']}, "
            f"{p['dtype']}, `python benchmarks/decode.py`): a state step takes {lo:.1f}–{hi:.1f} µs at every "
            f"context from {ctx[0]:,} to {ctx[-1]:,} tokens")
    at64 = [r for r in data["rows"] if r["context"] == 65536]
    if at64:
        kv = at64[0]["kv"]["median_us"] / 1000
        text += f"; a KV-cache step takes {kv:.1f} ms at 64k tokens ({_x(s['kv_over_state_at_64k'])} the state step)"
    return text + "."


_GPU_ROW = re.compile(r"^linattn (scan|chunked)\s+N=\s*(\d+)\s+([\d.]+) ms", re.M)


def gpu_figure(log: str, name: str) -> str:
    """The GPU line from a ``gpu_check`` log: the faster of scan and chunked at N = 4096 and 65536."""
    best: dict = {}
    for method, n, ms in _GPU_ROW.findall(log):
        n = int(n)
        if n not in best or float(ms) < best[n][1]:
            best[n] = (method, float(ms))
    if 4096 not in best or 65536 not in best:
        raise ValueError(f"{name} has no causal rows at N = 4096 and 65536")
    gpu = re.search(r"^# linear attention on (.+?) \(", log, re.M)
    date = re.search(r"(\d{4}-\d{2}-\d{2})", name)
    return (f"GPU ({gpu.group(1).strip() if gpu else 'GPU'}, {date.group(1) if date else ''}; B = 8, H = 16, "
            f"D = M = 64, float32, `bash benchmarks/gpu_check.sh`): the causal call takes {best[4096][1]:.1f} ms "
            f"({best[4096][0]}) at N = 4,096 and {best[65536][1]:.0f} ms ({best[65536][0]}) at N = 65,536.")


def _ok(records):
    return [r for r in records if r.get("status") == "ok"]


def _span(edges, b) -> str:
    lo, hi = int(edges[b]), int(edges[b + 1]) - 1
    return f"distance {lo}" if lo == hi else f"distances {lo}–{hi}"


def horizon_figures(records, *, feature_map: str = "dpfp", gamma: float = 0.9) -> str:
    """The horizon study's figure: ``gamma`` against the additive rule for one map, nearest and oldest pairs."""
    recs = [r for r in _ok(records) if r["params"]["feature_map"] == feature_map]
    by = {}
    for r in recs:
        by.setdefault(float(r["params"]["gamma"]), []).append(r)
    if gamma not in by or 1.0 not in by:
        raise ValueError(f"horizon results lack gamma {gamma} or the additive rule for {feature_map!r}")
    res0 = by[gamma][0]["result"]
    p0 = by[gamma][0]["params"]
    edges = res0["distance_edges"]
    err = {g: np.asarray([r["result"]["error_by_distance"][0] for r in rs], dtype=float) for g, rs in by.items()}
    m_g, h_g = mean_ci(err[gamma])
    m_a, h_a = mean_ci(err[1.0])
    last = len(edges) - 2
    params = ", ".join(f"{ {'nu': 'ν'}.get(k, k)} = {v}" for k, v in p0["map_params"].items())
    name = {"dpfp": "DPFP"}.get(feature_map, feature_map)
    return (f"at {name}{f' ({params})' if params else ''}, D_φ = {res0['d_phi']}, n = {p0['n']}, γ = {fmt(gamma)}: "
            f"error {pm(m_g[0], h_g[0])} at {_span(edges, 0)} against {pm(m_a[0], h_a[0])} for the additive rule, "
            f"{pm(m_g[last], h_g[last])} at {_span(edges, last)} against {pm(m_a[last], h_a[last])}; "
            f"{len(err[gamma])} seeds, mean ± 95% Student-t half-width")


def rules_figures(records) -> str:
    """The rules study's figures: errors at n = D_φ, the accuracy reversal, repeated passes."""
    ok = _ok(records)

    def series(kind, rule):
        rs = [r for r in ok if r["params"]["kind"] == kind and r["params"]["rule"] == rule]
        if not rs:
            raise ValueError(f"rules results lack {kind!r} / {rule!r}")
        n = np.asarray(rs[0]["result"]["n_pairs"])
        return (n, int(rs[0]["result"]["d_phi"]), np.asarray([r["result"]["mse"] for r in rs], dtype=float),
                np.asarray([r["result"]["accuracy"] for r in rs], dtype=float))

    n, dphi, e_add, a_add = series("gaussian", "additive")
    _, _, e_d1, a_d1 = series("gaussian", "delta, β = 1")
    j = int(np.argmin(np.abs(n - dphi)))
    last = len(n) - 1
    passes = [r["params"]["passes"] for r in ok if r["params"]["kind"] == "passes"]
    text = (f"at n = D_φ = {dphi} the delta rule (β = 1) leaves an error of {pm(*mean_ci(e_d1[:, j]))} against the "
            f"additive rule's {pm(*mean_ci(e_add[:, j]))}, but its argmax accuracy falls to "
            f"{pm(*mean_ci(a_d1[:, last]))} at n = {int(n[last])} while the additive rule's is "
            f"{pm(*mean_ci(a_add[:, last]))}")
    if passes:
        p = max(passes)
        np_, _, e_p, _ = series("passes", f"delta, β = 1, {p} passes")
        jp = int(np.argmin(np.abs(np_ - dphi)))
        text += f"; {p} passes take the error at n = D_φ to {pm(*mean_ci(e_p[:, jp]))}"
    return text + f" ({e_add.shape[0]} seeds, mean ± 95% Student-t half-width)"


#: Study name -> the function that computes its README figures from the study's records.
FIGURES = {"horizon": horizon_figures, "rules": rules_figures}


def figures(root: Path = ROOT) -> dict:
    """{source: sentence} for every source present under ``root``."""
    res, out = root / "benchmarks" / "results", {}
    if (res / "causal_cpu.json").is_file():
        out["cpu"] = cpu_figure(json.loads((res / "causal_cpu.json").read_text()))
    if (res / "decode.json").is_file():
        out["decode"] = decode_figure(json.loads((res / "decode.json").read_text()))
    logs = sorted((root / "docs" / "logs").glob("gpu_check_*.log"))
    if logs:
        out["gpu"] = gpu_figure(logs[-1].read_text(encoding="utf-8", errors="replace"), logs[-1].name)
    for name, render in FIGURES.items():
        if (res / f"{name}.jsonl").is_file():
            out[name] = render(load_results(res / f"{name}.jsonl"))
    return out


PAGE = ROOT / "docs" / "measured.md"


def _head(title: str, command: str, m: dict, date: str, load) -> list:
    line = m.get("machine_line") or f"CPU {m.get('cpu')} ({m.get('cores', m.get('logical_cpus'))} logical CPUs)"
    return [f"## {title}", "", f"`{command}`, {date.replace('T', ' ')}; {line}; load {load:.1f} at the start.", ""]


def _md(rows: list, columns: list) -> list:
    """A Markdown table: ``columns`` of (header, function of a row)."""
    out = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    return out + ["| " + " | ".join(f(r) for _, f in columns) + " |" for r in rows] + [""]


def _causal(d: dict) -> list:
    m, s = d["machine"], d["summary"]
    names = {"chunked_65536": "chunked at N = 65,536", "chunked_65536_out": "the same with `out=`"}
    inter = ", ".join(f"{names.get(k, k)} {v:.1f} ms" for k, v in s["interleaved_medians_ms"].items())
    return _head("Causal forward on the CPU", "python benchmarks/causal_cpu.py", m, m["date"], m["load_avg_1m"]) + [
        f"B·H = {d['shape']['BH']}, D = {d['shape']['D']}, M = {d['shape']['M']}, feature map "
        f"`{d['shape']['feature_map']}`; sgemm (`np.dot` of 2048² float32) {d['sgemm_gflops_start']:.0f} GFLOP/s "
        f"at the start, {d['sgemm_gflops_end']:.0f} at the end. One method after another:", ""] + _md(d["rows"], [
            ("dtype", lambda r: r["dtype"]), ("N", lambda r: f"{r['N']:,}"), ("method", lambda r: r["method"]),
            ("median", lambda r: f"{r['median_ms']:.3g} ms"), ("GFLOP/s", lambda r: f"{r['gflops']:.3g}"),
            ("× sgemm", lambda r: f"{r['x_sgemm']:.3f}"), ("chunked is faster by", lambda r: "" if r["method"] == "chunked" else _x(r["chunked_speedup"]))]) + [
        f"Interleaved rounds (medians; N = 4096 unless stated): {inter}; the chunked call at {s['headline_x_sgemm']:.2f}× "
        f"sgemm, {_x(s['speedup_vs_scan'])} the scan's speed.", ""]


def _decode(d: dict) -> list:
    m, p = d["machine"], d["params"]
    return _head("Decoding", "python benchmarks/decode.py", m, d["date"], m["loadavg_start"][0]) + [
        f"H = {p['heads']}, D = M = {p['dim']}, {p['dtype']}; medians over {p['steps']} steps, Python overhead "
        "included (the kernel alone in its own column).", ""] + _md(d["rows"], [
            ("context", lambda r: f"{r['context']:,}"),
            ("state step", lambda r: f"{r['state']['median_us']:.1f} µs ({r['state']['p10_us']:.1f}–"
                                     f"{r['state']['p90_us']:.1f})"),
            ("kernel", lambda r: f"{r['kernel']['median_us']:.1f} µs"),
            ("KV-cache step", lambda r: f"{r['kv']['median_us']:,.0f} µs"),
            ("KV / state", lambda r: _x(r["kv"]["median_us"] / r["state"]["median_us"])),
            ("state", lambda r: f"{r['state_nbytes'] / 1024:.0f} KiB"),
            ("KV cache", lambda r: f"{r['kv_nbytes_used'] / 2**20:.1f} MiB")])


def _backward(d: dict) -> list:
    m, sh = d["machine"], d["shape"]
    return _head("Gradients on the CPU", "python benchmarks/backward_cpu.py", m, m["date"], m["load_avg_1m"]) + [
        f"B·H = {sh['BH']}, N = {sh['N']}, D = M = {sh['D']}, {sh['dtype']}, chunked; "
        + (f"map `{sh['feature_map']}`; " if "feature_map" not in d["speed"][0] else
           "each rule with its map (the delta rules' state overflows float32 with ELU+1 features); ")
        + f"medians of {d['rounds']} interleaved rounds; the range is the per-round ratio's.", ""] + _md(d["speed"], [
            ("rule", lambda r: r["rule"]), ("map", lambda r: f"`{r.get('feature_map', sh['feature_map'])}`"),
            ("forward", lambda r: f"{1e3 * r['forward_s']:.1f} ms"),
            ("backward launcher", lambda r: f"{1e3 * r['backward_s']:.1f} ms"), ("launcher / forward",
                                                                                 lambda r: f"{r['ratio']:.2f}"),
            ("linear_attention_vjp", lambda r: f"{1e3 * r['vjp_s']:.1f} ms"),
            ("vjp / forward", lambda r: f"{r['vjp_ratio']:.2f} ({r['vjp_ratio_range']})")])


def _auto(d: dict) -> list:
    m = d["machine"]
    return _head("`method=\"auto\"` against the faster method", "python benchmarks/auto_check.py", m, m["date"],
                 m["load_avg_1m"]) + [
        "Each BLAS setting calibrated (`linattn tune`) in its own process; float32, D = M = 64.", ""] + _md(
        d["rows"], [("BLAS", lambda r: r["BLAS"]), ("B·H", lambda r: str(r["B*H"])), ("N", lambda r: f"{r['N']:,}"),
                    ("scan", lambda r: f"{r['scan ms']:.3g} ms"), ("chunked", lambda r: f"{r['chunked ms']:.3g} ms"),
                    ("auto picks", lambda r: r["auto picks"]), ("auto / faster", lambda r: f"{r['auto / min']:.3f}"),
                    ("constants pick", lambda r: r["constants pick"]),
                    ("load", lambda r: f"{r['load']:.1f}")])


#: Results file -> its section of the page.
SECTIONS = {"causal_cpu.json": _causal, "backward_cpu.json": _backward, "decode.json": _decode,
            "auto_check.json": _auto}


def page(root: Path = ROOT) -> str:
    """``docs/measured.md``: one table per results file present, with its machine, date and load."""
    lines = ["# Measured: the current figures", "",
             "Generated by `python benchmarks/readme_figures.py --page` from the files in `benchmarks/results/`;",
             "rerun the commands on your machine to compare. Older figures behind the design choices:",
             "[Performance](performance.md) and [Measurements](measurements.md).", ""]
    for name, render in SECTIONS.items():
        path = root / "benchmarks" / "results" / name
        if path.is_file():
            lines += render(json.loads(path.read_text()))
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--page", action="store_true",
                    help="rewrite docs/measured.md (the tables of every results file) instead of printing "
                         "the README's sentences")
    args = ap.parse_args(argv)
    if args.page:
        PAGE.write_text(page(), encoding="utf-8")
        print(f"wrote {PAGE}")
        return 0
    for name, text in figures().items():
        print(f"{name}: {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
