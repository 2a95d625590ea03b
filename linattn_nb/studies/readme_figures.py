"""The README's measured figures, computed from a report's raw results (``<study>.jsonl``).

``python -m linattn_nb.studies.readme_figures benchmarks/results`` prints the sentences the README
quotes from the memory-horizon and update-rules studies; the test suite checks that the README
contains exactly these sentences for the files in ``benchmarks/results/``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ._study import fmt, mean_ci, pm
from .sweep import load_results

__all__ = ["horizon_figures", "rules_figures", "figures", "FIGURES"]


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


def figures(folder, studies=None) -> dict:
    """{study name: sentence} for the results files present in ``folder`` (all of ``FIGURES`` by default)."""
    folder = Path(folder)
    out = {}
    for name in (FIGURES if studies is None else studies):
        path = folder / f"{name}.jsonl"
        if path.is_file():
            out[name] = FIGURES[name](load_results(path))
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    folder = args[0] if args else "benchmarks/results"
    for name, text in figures(folder).items():
        print(f"{name}: {text}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
