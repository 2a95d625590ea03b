"""Study: causal throughput against sequence length, linear against softmax attention.

The methods, the timing rule and the FLOP count: docs/guide/studies.md.
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np

from ._study import Rendered, Study, fmt, markdown_table, register_study, split_failed


def _sizes(ctx):
    """(B*H, D, Ns, largest softmax N, min_time) for the profile."""
    return ctx.pick(
        tiny=(2, 16, [64, 256], 256, 0.005),
        quick=(8, 64, [256, 1024, 4096], 4096, 0.1),
        full=(16, 64, [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536], 8192, 0.5),
    )


def points(ctx) -> list[dict]:
    """The grid for ``ctx``: every point carries this process's Numba thread count (``numba_threads``), so that
    a resumed report reuses only the times measured with the same count."""
    import numba

    from ..ops import methods as _methods  # noqa: F401 - registers the built-in methods
    from ..ops.registry import available_methods

    bh, d, ns, softmax_max, min_time = _sizes(ctx)
    common = dict(batch=bh, d=d, m=d, dtype="float32", feature_map="elu", min_time=min_time,
                  numba_threads=int(numba.get_num_threads()))
    pts = []
    for device in ctx.devices:
        for method in available_methods(causal=True, device=device):
            if method == "quadratic":
                continue
            pts += [dict(kind="linear", device=device, method=method, n=n, **common) for n in ns]
    pts += [dict(kind="softmax", device="cpu", method="blocked", n=n, **common) for n in ns if n <= softmax_max]
    return pts


#: Length of the warm-up call (at most N): past the first block of every kernel.
WARMUP_N = 512
#: Size of the square float32 matrices of the sgemm probe.
SGEMM_SIZE = 256
#: A point whose effective rate is below this fraction of each neighbour's (in N) is flagged as noisy.
NOISY_FRACTION = 0.5


def machine_state(min_time: float = 0.03) -> dict:
    """The 1-minute load average and the rate of a float32 matrix product (GFLOP/s) right now.

    Multiplies two ``SGEMM_SIZE`` square matrices for ``min_time`` seconds: a drop in its rate between
    two points means the machine, not the kernel, changed.
    """
    try:
        load = float(os.getloadavg()[0])
    except (AttributeError, OSError):  # pragma: no cover - not on every platform
        load = float("nan")
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((SGEMM_SIZE, SGEMM_SIZE)).astype(np.float32) for _ in range(2))
    np.dot(a, b)
    reps, t0 = 0, time.perf_counter()
    while True:
        np.dot(a, b)
        reps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time:
            break
    return {"load1": load, "sgemm_gflops": 2.0 * SGEMM_SIZE ** 3 * reps / elapsed / 1e9}


def _inputs(rng, batch, length, d, m, dtype):
    q, k = (rng.standard_normal((batch, length, d)).astype(dtype) for _ in range(2))
    return q, k, rng.standard_normal((batch, length, m)).astype(dtype)


def _forward(kind, method, feature_map, device, q, k, v) -> None:
    from .. import linear_attention, softmax_attention

    if kind == "linear":
        linear_attention(q, k, v, feature_map=feature_map, causal=True, method=method, device=device)
    else:
        softmax_attention(q, k, v, causal=True, method=method)


def run(kind, device, method, n, batch, d, m, dtype, feature_map, min_time, seed=0, numba_threads=None) -> dict:
    """Time one causal forward; returns the median and derived rates.

    ``numba_threads``: the Numba thread count the point is measured with (None: this thread's); a count this
    process cannot run (above ``NUMBA_NUM_THREADS``) is a ValueError.
    """
    import numba

    if kind not in ("linear", "softmax"):
        raise ValueError(f"unknown kind {kind!r}")
    if numba_threads is None:
        return _run(kind, device, method, n, batch, d, m, dtype, feature_map, min_time, seed)
    if not 1 <= numba_threads <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"numba_threads = {numba_threads}: this process runs 1 to NUMBA_NUM_THREADS = "
                         f"{numba.config.NUMBA_NUM_THREADS} Numba threads")
    before = numba.get_num_threads()
    numba.set_num_threads(numba_threads)
    try:
        return _run(kind, device, method, n, batch, d, m, dtype, feature_map, min_time, seed)
    finally:
        numba.set_num_threads(before)


def _run(kind, device, method, n, batch, d, m, dtype, feature_map, min_time, seed) -> dict:
    import numba

    rng = np.random.default_rng(seed)
    sync = None
    if device == "cuda":
        from numba import cuda

        sync = cuda.synchronize

    def inputs(length):
        q, k, v = _inputs(rng, batch, length, d, m, dtype)
        if device == "cuda":
            q, k, v = (cuda.to_device(x) for x in (q, k, v))
        return q, k, v

    def timed(q, k, v):
        t0 = time.perf_counter()
        _forward(kind, method, feature_map, device, q, k, v)
        if sync is not None:
            sync()
        return time.perf_counter() - t0

    # warm up on up to WARMUP_N tokens: past softmax's first block, so no compile is timed (guide)
    first = timed(*inputs(min(n, WARMUP_N)))
    q, k, v = inputs(n)
    before = machine_state()
    times = [timed(q, k, v)]
    want = 3 if times[0] < 2.0 else 1  # a call of seconds is timed once
    while len(times) < want or (sum(times) < min_time and len(times) < 200):
        times.append(timed(q, k, v))
    after = machine_state()
    med = statistics.median(times)
    res = {"median_s": med, "min_s": min(times), "repeats": len(times), "warmup_s": first,
           "tokens_per_s": batch * n / med, "numba_threads": numba.get_num_threads(),
           "load1_before": before["load1"], "load1_after": after["load1"],
           "sgemm_gflops_before": before["sgemm_gflops"], "sgemm_gflops_after": after["sgemm_gflops"]}
    if kind == "linear":
        res["gflops"] = 4.0 * batch * n * d * m / med / 1e9
    return res


def prepare(points) -> None:
    """Compile (or load from the cache) what the CPU points will time, untimed.

    Run by :func:`run_report`'s background process beside the other studies: every CPU point once at
    its warm-up length and once at its N (a kernel can take another compiled path past its first block).
    """
    rng = np.random.default_rng(0)
    for p in points:
        if p["device"] != "cpu":
            continue
        for length in sorted({min(p["n"], WARMUP_N), p["n"]}):
            q, k, v = _inputs(rng, p["batch"], length, p["d"], p["m"], p["dtype"])
            _forward(p["kind"], p["method"], p["feature_map"], "cpu", q, k, v)


def _label(p) -> str:
    name = "softmax" if p["kind"] == "softmax" else f"linear {p['method']}"
    return f"{name} ({p['device']})"


def noisy_points(rates: dict) -> list:
    """The N of a series ``{N: rate}`` whose rate is below NOISY_FRACTION of each of its neighbours'.

    The neighbours: one on each side, or at an end of the grid the next two inward (the last N is
    where a slow point hides most easily).
    """
    return [x for x, nb in _neighbours(rates) if nb and all(rates[x] < NOISY_FRACTION * r for r in nb)]


def _neighbours(rates: dict) -> list:
    """``(N, [the rates of its two nearest neighbours])`` for every N of ``{N: rate}``, in order (see
    :func:`noisy_points`)."""
    xs = sorted(rates)
    out = []
    for i, x in enumerate(xs):
        if 0 < i < len(xs) - 1:
            idx = (i - 1, i + 1)
        else:
            idx = (1, 2) if i == 0 else (i - 1, i - 2)
        out.append((x, [rates[xs[j]] for j in idx if 0 <= j < len(xs) and j != i]))
    return out


#: The headline speed-up is taken only at an N where both points' effective rates are at least this
#: fraction of each of their two nearest neighbours' (a steadier rule than the "noisy" flag's).
HEADLINE_FRACTION = 0.8


def clean_points(rates: dict, fraction: float = HEADLINE_FRACTION) -> list:
    """The N of a series ``{N: rate}`` whose rate is at least ``fraction`` of each of its neighbours'.

    The neighbours are those of :func:`noisy_points`.  A series of one point has no neighbour: none is clean.
    """
    return [x for x, nb in _neighbours(rates) if nb and all(rates[x] >= fraction * r for r in nb)]


def _rate(params, res) -> float:
    """Effective rate of a point for the noise rules: linear attention's GFLOP/s, softmax's N²-scaled one."""
    if "gflops" in res:
        return float(res["gflops"])
    n = params["n"]
    return 2.0 * params["batch"] * n * n * (params["d"] + params["m"]) / res["median_s"] / 1e9


def headline(series, lin, soft):
    """(N, speed-up, linear label) at the largest N where the fastest linear point and the softmax point are
    both clean (:func:`clean_points`); None when there is no such N."""
    clean = {lab: set(clean_points({n: _rate(*pr) for n, pr in series[lab].items()})) for lab in lin + soft}
    for n in sorted({n for lab in soft for n in series[lab]}, reverse=True):
        lins = [(series[lab][n][1]["median_s"], lab) for lab in lin if n in series[lab]]
        softs = [(series[lab][n][1]["median_s"], lab) for lab in soft if n in series[lab]]
        if not lins or not softs:
            continue
        (t_lin, lab_lin), (t_soft, lab_soft) = min(lins), min(softs)
        if n in clean[lab_lin] and n in clean[lab_soft]:
            return n, t_soft / t_lin, lab_lin
    return None


def render(records, ctx) -> Rendered:
    ok, failed, problems, failed_md = split_failed("throughput", records)
    series: dict = {}
    for r in ok:
        series.setdefault(_label(r["params"]), {})[r["params"]["n"]] = (r["params"], r["result"])
    ns = sorted({r["params"]["n"] for r in ok})
    labels = list(series)
    lin = [lab for lab in labels if lab.startswith("linear")]
    soft = [lab for lab in labels if lab.startswith("softmax")]
    noisy = {lab: noisy_points({n: pr[1]["gflops"] for n, pr in series[lab].items() if "gflops" in pr[1]})
             for lab in lin}
    rows = []
    for n in ns:
        row = [n]
        for lab in labels:
            pr = series[lab].get(n)
            row.append(fmt(pr[1]["median_s"] * 1e3) + (" (noisy)" if n in noisy.get(lab, ()) else "") if pr else "–")
        best_lin = min((series[lab][n][1]["median_s"] for lab in lin if n in series[lab]), default=None)
        best_soft = min((series[lab][n][1]["median_s"] for lab in soft if n in series[lab]), default=None)
        row.append(fmt(best_soft / best_lin) + "×" if best_lin and best_soft else "–")
        rows.append(row)
    md = []
    if ok:
        p0 = ok[0]["params"]
        threads = _threads_text(ok)
        md.append(
            f"Regime: causal forward, q, k, v ~ N(0, I) (seed {p0.get('seed', 0)}; timing does not depend on the "
            f"values), B·H = {p0['batch']}, D = M = {p0['d']}, {p0['dtype']}, feature map `{p0['feature_map']}`, "
            f"N ∈ {{{', '.join(map(str, ns))}}}; median of >= 3 timed calls (one for calls over 2 s; more while the "
            f"total stays under {p0['min_time']} s) after a short warm-up call; {threads}. "
            "Times in milliseconds; the last column is softmax time over the fastest linear method."
        )
        md += ["", markdown_table(["N", *[f"{lab} [ms]" for lab in labels], "linear speed-up"], rows)]
        if lin:
            grows = [[n] + [(fmt(series[lab][n][1]["gflops"]) + (" (noisy)" if n in noisy[lab] else ""))
                            if n in series[lab] else "–" for lab in lin]
                     for n in ns]
            md += ["", "Effective GFLOP/s of linear attention (4·B·H·N·D·M per forward):", "",
                   markdown_table(["N", *lin], grows)]
        md += _load_md(series, ns, noisy)
        if ctx.plots and ns:
            fig, (ax1, ax2) = ctx.figure(ncols=2, width=4.4, height=3.6)
            for i, lab in enumerate(labels):
                xs = sorted(series[lab])
                sty = ctx.style(i)
                ax1.loglog(xs, [series[lab][x][1]["median_s"] * 1e3 for x in xs], ms=4, label=lab, **sty)
                ax2.loglog(xs, [series[lab][x][1]["tokens_per_s"] for x in xs], ms=4, label="_", **sty)
                bad = noisy.get(lab, [])
                if bad:
                    ax2.plot(bad, [series[lab][x][1]["tokens_per_s"] for x in bad], linestyle="none", marker="o",
                             ms=11, mfc="none", mec="red", label="noisy point (rate < ½ of its neighbours')")
            for ax in (ax1, ax2):
                ax.set_xticks(ns if len(ns) <= 5 else ns[::2])
            ax1.set(xlabel="sequence length N", ylabel="time per forward [ms]", title="Causal forward time")
            ax2.set(xlabel="sequence length N", ylabel="tokens / s", title="Throughput")
            ax1.grid(True, which="both", alpha=0.3)
            ax2.grid(True, which="both", alpha=0.3)
            ctx.legend_outside(fig, [ax1, ax2])
            md += ["", ctx.savefig(fig, "throughput", "causal forward time and throughput against N")]
    md += failed_md
    summary = ""
    if ns and lin and soft:
        head = headline(series, lin, soft)
        rule = (f"the largest N at which the fastest linear method's and softmax's effective rates are each at "
                f"least {HEADLINE_FRACTION:g} of their two nearest neighbours' in N")
        if head is None:
            summary = "no N passes the headline's noise rule; see the table"
            md.insert(1, "")
            md.insert(2, f"Headline: none -- no N passes the rule ({rule}); read the speed-up per N in the table.")
        else:
            summary = f"linear {fmt(head[1])}× faster than softmax at N = {head[0]}"
            md.insert(1, "")
            md.insert(2, f"Headline: {head[2]} is {fmt(head[1])}× faster than softmax at N = {head[0]}, "
                         f"{rule}.")
    nflag = sum(len(v) for v in noisy.values())
    if nflag:
        summary += f"{'; ' if summary else ''}{nflag} noisy point(s)"
    return Rendered("\n".join(md), summary, problems)


def _threads_text(ok) -> str:
    """"Numba threads: 2", the count every point was measured with; when the points differ (records that
    did not come from one grid), the count of each point, so that no row is read under another's."""
    by: dict = {}
    for r in ok:
        t = r["result"].get("numba_threads", r["params"].get("numba_threads"))
        by.setdefault(t, []).append(f"{_label(r['params'])} at N = {r['params']['n']}")
    if len(by) == 1:
        return f"Numba threads: {fmt(next(iter(by)))}"
    return ("Numba threads differ between the points, so their times are not comparable: "
            + "; ".join(f"{fmt(t)} for {', '.join(where)}" for t, where in by.items()))


def _load_md(series, ns, noisy) -> list:
    """The machine's state around each point: load average and sgemm rate before → after."""
    labels = [lab for lab in series if any("load1_before" in pr[1] for pr in series[lab].values())]
    rows = []
    for n in ns:
        row = [n]
        for lab in labels:
            r = series[lab].get(n, (None, {}))[1]
            if "load1_before" not in r:
                row.append("–")
                continue
            row.append(f"{fmt(r['load1_before'], 2)} → {fmt(r['load1_after'], 2)}; "
                       f"{fmt(r['sgemm_gflops_before'])} → {fmt(r['sgemm_gflops_after'])}")
        rows.append(row)
    if not labels:
        return []
    md = ["", f"Machine state around each point: 1-minute load average, then the rate (GFLOP/s) of a "
              f"{SGEMM_SIZE}×{SGEMM_SIZE} float32 matrix product (NumPy's BLAS), each just before → just after "
              "that point's timed calls:", "",
          markdown_table(["N", *[f"{lab}: load; sgemm GFLOP/s" for lab in labels]], rows)]
    flagged = [(lab, n) for lab, xs in noisy.items() for n in xs]
    if flagged:
        items = []
        for lab, n in flagged:
            r = series[lab][n][1]
            items.append(f"{lab} at N = {n}: {fmt(r['gflops'])} GFLOP/s (load {fmt(r.get('load1_before'), 2)} → "
                         f"{fmt(r.get('load1_after'), 2)}, sgemm {fmt(r.get('sgemm_gflops_before'))} → "
                         f"{fmt(r.get('sgemm_gflops_after'))} GFLOP/s)")
        md += ["", f"**Noisy** (effective rate under {NOISY_FRACTION:g} of each of its two nearest neighbours' in N: a "
                   "busy machine, or at the smallest N call overhead; rerun on a quiet machine before reading them): " + "; ".join(items) + "."]
    else:
        md += ["", f"No point's effective rate is under {NOISY_FRACTION:g} of its neighbours'."]
    return md


STUDY = register_study(Study(
    name="throughput",
    title="Causal throughput against N",
    command="bench",
    help="causal throughput against N: every linear method and softmax attention",
    points=points,
    run=run,
    render=render,
    figures=("throughput",),
    timing=True,
    budget_s={"tiny": 30, "quick": 25, "full": 90},
    prepare=prepare,
))
