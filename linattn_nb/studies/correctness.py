"""Study: correctness self-check of every registered kernel on this machine.

Every method, feature map, update rule and dtype (:data:`PROFILE_DTYPES`) on edge shapes, against the
float64 quadratic reference, state included.  What is checked and how: docs/guide/studies.md.
"""
from __future__ import annotations

import time

import numpy as np

from ..rules import get_rule, rule_names
from ._study import Rendered, Study, fmt, markdown_table, register_study

#: Relative Frobenius error allowed per input dtype.  float16 inputs are
#: computed in float32 and rounded to float16 on output (unit round-off 4.9e-4).
TOLERANCES = {"float16": 3e-3, "float32": 2e-5, "float64": 1e-11}
DTYPES = ("float16", "float32", "float64")
#: The dtypes each profile checks.  A kernel compiles once per dtype (float16 twice), and compiling is
#: most of a cold run, so the quick profile checks float32 only: a quarter of the full profile's compilations.
PROFILE_DTYPES = {"tiny": DTYPES, "quick": ("float32",), "full": DTYPES}


def _cut(kw, lo, hi):
    """The per-token inputs ``kw`` of tokens [lo, hi)."""
    return {name: x[:, lo:hi] for name, x in kw.items()}


def _shapes(profile: str) -> list[list[int]]:
    """(B, N, D, M) edge shapes: empty, one token, odd N, B above any thread count, D != M."""
    base = [[1, 0, 4, 4], [1, 1, 4, 4], [3, 17, 8, 5], [2, 64, 6, 9], [33, 9, 4, 3]]
    if profile == "tiny":
        return base
    quick = base + [[2, 255, 16, 16], [5, 130, 8, 12]]
    if profile == "quick":
        return quick
    return quick + [[4, 1025, 32, 32], [1, 1025, 64, 64], [16, 257, 64, 16]]


def _feature_maps() -> list[str]:
    """Registered positive maps that build without parameters (random maps get a fixed seed)."""
    from ._maps import buildable_maps

    return buildable_maps(positive_only=True, defaults=True)


def points(ctx) -> list[dict]:
    """One point per (attention, device, causal, feature map); it checks every method and the profile's dtypes."""
    from ..ops import methods as _methods  # noqa: F401 - registers the built-in methods
    from ..ops.registry import available_methods

    shapes = _shapes(ctx.profile)
    dtypes = list(PROFILE_DTYPES[ctx.profile])
    pts = []
    for device in ctx.devices:
        for causal in (False, True):
            methods = [m for m in available_methods(causal=causal, device=device) if m != "quadratic"]
            if not methods:
                continue
            for fmap in _feature_maps():
                pts.append(dict(kind="linear", device=device, causal=causal, feature_map=fmap,
                                methods=methods, dtypes=dtypes, shapes=shapes))
            if causal:  # every rule with per-token inputs, with the feature map its study draw is made for
                for r in map(get_rule, rule_names()):
                    rmethods = [m for m in available_methods(causal=True, device=device, rule=r.name)
                                if m != "quadratic"]
                    if r.has_inputs and rmethods:
                        pts.append(dict(kind="linear", device=device, causal=True, feature_map=r.study_map,
                                        methods=rmethods, dtypes=dtypes, shapes=shapes, rule=r.name))
    for causal in (False, True):
        pts.append(dict(kind="softmax", device="cpu", causal=causal, feature_map=None,
                        methods=["blocked"], dtypes=dtypes, shapes=shapes))
    return pts


def _rel(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.size == 0:
        return 0.0
    diff = np.linalg.norm(a - b)
    if not np.isfinite(diff):
        return float("inf")
    den = np.linalg.norm(b)
    return float(diff / den) if den > 0 else float(diff)


def _to_host(x):
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


def _check_linear(q, k, v, ref, S_ref, z_ref, *, device, causal, method, feature_map, segments, rule_kw):
    """(output error, state error) of one linear-attention method on one input.

    ``S_ref``, ``z_ref``: the final state it must return (float64).
    """
    from .. import linear_attention

    if device == "cpu":
        buf = np.full(ref.shape, np.nan, dtype=q.dtype)
        out, state = linear_attention(q, k, v, feature_map=feature_map, causal=causal, method=method,
                                      device="cpu", out=buf, return_state=True, **rule_kw)
        if out is not buf:
            raise AssertionError("linear_attention did not return the out= buffer")
    else:
        out, state = linear_attention(q, k, v, feature_map=feature_map, causal=causal, method=method,
                                      device=device, return_state=True, **rule_kw)
        out = _to_host(out)
    if out.dtype != q.dtype or out.shape != ref.shape:
        raise AssertionError(f"{method} returned {out.dtype} {out.shape} for {q.dtype} {ref.shape}")
    state_err = max(_rel(_to_host(state.S), S_ref), _rel(_to_host(state.z), z_ref))
    n = q.shape[1]
    if segments and causal and n >= 2 and device == "cpu":
        cut = n // 3 + 1
        o1, st = linear_attention(q[:, :cut], k[:, :cut], v[:, :cut], feature_map=feature_map,
                                  causal=True, method=method, return_state=True, **_cut(rule_kw, 0, cut))
        o2 = linear_attention(q[:, cut:], k[:, cut:], v[:, cut:], feature_map=feature_map,
                              causal=True, method=method, initial_state=st, **_cut(rule_kw, cut, n))
        state_err = max(state_err, _rel(np.concatenate([o1, o2], axis=1), ref))
    return _rel(out, ref), state_err


def run(kind, device, causal, feature_map, methods, dtypes, shapes, seed=0, rule="additive") -> dict:
    """Check every method and dtype of one (attention, device, causal, feature map, rule) on every shape.

    One float64 quadratic reference per shape and dtype (from the rounded inputs), shared by the
    methods; the state is checked against its definition (additive rule) or the reference's.
    """
    from .. import linear_attention, softmax_attention
    from ._maps import build_map

    t0 = time.perf_counter()
    acc = {(m, dt): {"max_rel_error": 0.0, "state_rel_error": 0.0, "worst_shape": None, "error": None}
           for m in methods for dt in dtypes}
    for i, (b, n, d, m) in enumerate(shapes):
        rng = np.random.default_rng([seed, i])
        base = [rng.standard_normal((b, n, d)), rng.standard_normal((b, n, d)), rng.standard_normal((b, n, m))]
        # One instance per shape, shared by the reference and every method (a
        # random map is drawn once, seeded, for this D).
        fmap = build_map(feature_map, dim=d, seed=seed) if kind == "linear" else None
        rule_kw = get_rule(rule).sample(rng, b, n, fmap.output_dim(d)) if kind == "linear" else {}
        for dtype in dtypes:
            q, k, v = (x.astype(dtype) for x in base)
            q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
            if kind == "softmax":
                ref = softmax_attention(q64, k64, v64, causal=causal, method="quadratic")
            else:
                ref, st = linear_attention(q64, k64, v64, feature_map=fmap, causal=causal,
                                           method="quadratic", return_state=True, **rule_kw)
                S_ref, z_ref = st.S, st.z
                if not rule_kw:  # the additive state against its definition, not the reference's
                    fk64 = fmap.apply(k64, role="key", causal=causal, offset=0, total_length=n)
                    S_ref, z_ref = np.einsum("bnf,bnm->bfm", fk64, v64), fk64.sum(axis=1)
            for method in methods:
                a = acc[(method, dtype)]
                if a["error"] is not None:
                    continue
                try:
                    if kind == "softmax":
                        out = softmax_attention(q, k, v, causal=causal, method=method)
                        if out.dtype != q.dtype or out.shape != ref.shape:
                            raise AssertionError(f"returned {out.dtype} {out.shape} for {q.dtype} {ref.shape}")
                        err, serr = _rel(out, ref), 0.0
                    else:
                        err, serr = _check_linear(q, k, v, ref, S_ref, z_ref, device=device, causal=causal,
                                                  method=method, feature_map=fmap,
                                                  segments=not fmap.position_dependent, rule_kw=rule_kw)
                except Exception as exc:  # noqa: BLE001 - a failing method is a result here
                    a["error"] = f"{type(exc).__name__}: {exc} (shape B, N, D, M = {[b, n, d, m]})"
                    continue
                if a["worst_shape"] is None or err > a["max_rel_error"]:
                    a["max_rel_error"], a["worst_shape"] = err, [b, n, d, m]
                a["state_rel_error"] = max(a["state_rel_error"], serr)
    checks = []
    for (method, dtype), a in acc.items():
        tol = TOLERANCES[dtype]
        passed = a["error"] is None and a["max_rel_error"] <= tol and a["state_rel_error"] <= tol
        checks.append({"method": method, "dtype": dtype, "tol": tol, "passed": bool(passed), **a})
    return {"checks": checks, "time_s": time.perf_counter() - t0}


def render(records, ctx) -> Rendered:
    ok = [r for r in records if r.get("status") == "ok"]
    failed_points = [r for r in records if r.get("status") != "ok"]
    groups: dict = {}
    problems = []
    for r in ok:
        p = r["params"]
        for c in r["result"]["checks"]:
            label = (p["kind"], "causal" if p["causal"] else "non-causal", p.get("rule", "additive"), p["device"],
                     c["method"], p["feature_map"] or "–")
            groups.setdefault(label, {})[c["dtype"]] = c
            if not c["passed"]:
                what = c["error"] or (
                    f"relative error {fmt(max(c['max_rel_error'], c['state_rel_error']))} > tolerance "
                    f"{fmt(c['tol'])} (worst shape B, N, D, M = {c['worst_shape']})")
                problems.append(f"correctness: {' '.join(label)} {c['dtype']}: {what}")
    checked = [dt for dt in DTYPES if any(dt in g for g in groups.values())] or list(DTYPES)
    rows = []
    for label, by_dtype in groups.items():
        cells = []
        for dtype in checked:
            c = by_dtype.get(dtype)
            if c is None:
                cells.append("–")
            elif c["error"] is not None:
                cells.append("**raised**")
            else:
                err = max(c["max_rel_error"], c["state_rel_error"])
                cells.append(f"{fmt(err, 2)} {'ok' if c['passed'] else '**FAIL**'}")
        rows.append(list(label) + cells)
    for r in failed_points:
        problems.append(f"correctness: point {r['params']} raised {r.get('error')}")
    shapes = ok[0]["params"]["shapes"] if ok else []
    n_checks = sum(len(g) for g in groups.values())
    md = [
        "Every registered kernel against the float64 quadratic reference computed from the same "
        "(rounded) inputs: the largest relative Frobenius error over the shapes, of the output and, "
        "for linear attention, of the returned state against its definition and (causal) of a "
        "two-segment run through `initial_state`. Output buffers are pre-filled with NaN, so an "
        "unwritten element fails. Tolerances: "
        + ", ".join(f"{k} {fmt(v)}" for k, v in TOLERANCES.items()) + ".",
        "",
        f"Regime: q, k, v ~ N(0, I) (seed 0 per shape; softmax temperature 1/√D; decay factors in [0.5, 1] with a "
        "reset, write strengths β in [0, 2]); one seed, because a check is a worst case over the shapes, not an "
        f"average.  Shapes (B, N, D, M): {', '.join('(' + ', '.join(map(str, s)) + ')' for s in shapes)}.  "
        f"Input dtypes: {', '.join(checked)}"
        + ("" if len(checked) == len(DTYPES) else
           f" (the {ctx.profile} profile; the full profile checks {', '.join(DTYPES)}: every dtype is a kernel "
           "compilation of its own)") + ".",
        "",
        markdown_table(["attention", "mode", "rule", "device", "method", "feature map", *checked], rows,
                       align="llllll" + "r" * len(checked)),
    ]
    if problems:
        md += ["", "Failures:", ""] + [f"- {p}" for p in problems]
        summary = f"**{len(problems)} of {n_checks + len(failed_points)} checks FAILED**"
    else:
        summary = f"all {n_checks} checks passed"
    return Rendered("\n".join(md), summary, problems)


STUDY = register_study(Study(
    name="correctness",
    title="Correctness self-check",
    command="check",
    help="self-check every registered kernel against the quadratic reference",
    points=points,
    run=run,
    render=render,
    budget_s={"tiny": 120, "quick": 60, "full": 360},
    background=True,
))
