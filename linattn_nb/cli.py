"""The ``linattn`` command line: ``info``, ``tune``, ``demo``, ``report`` and one command per study
(docs/guide/studies.md; every command has ``--help``).

Exit status: 0 success; 1 a check failed or a study raised (the report is still written); 2 usage
errors (bad arguments, a non-empty --out without --force, an --out that cannot be created or
written, a --scheduler that cannot be reached); 3 the study cannot run in this installation; 130
interrupted (Ctrl-C): the finished points stay in the report folder and the same command with
``--resume`` continues.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shlex
import sys
import tempfile
import time


def _info_lines() -> list[str]:
    import numba
    import numpy as np
    import scipy

    import linattn_nb
    from linattn_nb.device import cuda_status

    layer = _threading_layer()
    status = cuda_status()
    if status == "gpu":
        from linattn_nb.studies.report import gpu_name

        cuda_line = f"GPU: {gpu_name()}"
    elif status == "simulator":
        cuda_line = "simulator (NUMBA_ENABLE_CUDASIM=1; kernels run on the CPU, slowly)"
    else:
        cuda_line = "none (no usable CUDA GPU)"
    try:
        import numba_cuda  # noqa: F401

        nbcuda = getattr(numba_cuda, "__version__", "installed")
    except Exception:
        nbcuda = "not installed"
    from linattn_nb import _cache, _tune

    libs, flags, env = _tune.blas_libraries(), _tune.cpu_flags(), _tune.blas_env()
    level = _tune._vector_level(flags)
    cpu = f"{_tune.cpu_model()} ({os.cpu_count()} logical CPUs{', ' + level if level else ''})"
    cache_dir, origin = _cache.cache_folder()
    if cache_dir is None:
        cache_line = f"(caching {origin})" if origin.startswith("off") else f"({origin})"
    else:
        writable = os.path.isdir(cache_dir) and os.access(cache_dir, os.W_OK)
        cache_line = f"{cache_dir} ({'writable' if writable else 'not writable'}; from {origin})"
    return [
        f"linattn_nb   {linattn_nb.__version__}",
        f"python       {platform.python_version()} ({sys.executable})",
        f"platform     {platform.platform()}",
        f"numba        {numba.__version__}",
        f"numba-cuda   {nbcuda}",
        f"numpy        {np.__version__}",
        f"scipy        {scipy.__version__}",
        f"threading    {layer}, {_tune.numba_threads()} threads (NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS})",
        f"cpu          {cpu}",
        f"blas         {_tune.blas_line(libs)}",
        f"blas env     {', '.join(f'{k}={v}' for k, v in env.items()) or 'no overrides'}",
        *(f"WARNING      {w}" for w in _tune.forced_kernel_warnings(libs, flags, env)),
        f"auto tune    {_tune.status_line()}",
        f"cuda         {cuda_line}",
        f"cache dir    {cache_line}",
        f"feature maps {', '.join(linattn_nb.feature_maps.available())}",
    ]


def _threading_layer() -> str:
    """Numba's threading layer; before the first parallel kernel, the one Numba will pick.

    The pool is not started just to ask (GNU OpenMP would then refuse parallel kernels in forked children).
    """
    import numba

    with contextlib.suppress(ValueError):  # raised before the first parallel kernel of this process
        return f"{numba.threading_layer()} layer"
    try:
        from linattn_nb import _blas

        layer = _blas.threading_layer()
        name = str(numba.config.THREADING_LAYER).lower()
        problem = _blas.layer_problem(layer) if name == layer else None
        if problem:  # NUMBA_THREADING_LAYER names a layer that cannot be loaded
            return (f"{layer} layer requested (NUMBA_THREADING_LAYER={numba.config.THREADING_LAYER}) but it cannot "
                    f"be loaded ({problem}): the first parallel kernel will fail")
        return f"{layer} layer (predicted: Numba picks it at the first parallel kernel)"
    except Exception as exc:  # pragma: no cover - no usable layer
        return f"no usable layer ({exc})"


def cmd_info(args) -> int:
    for line in _info_lines():
        print(line)
    return 0


def _print_calibration(cal) -> None:
    from linattn_nb._tune import crossover, used_heads

    st = cal.get("setting", {})
    print(f"B*H = {st.get('batch')}, D = M = {st.get('dim')}, medians of {st.get('rounds')} interleaved rounds "
          f"(ratio: median of the rounds' chunked / scan){'; QUICK smoke test, not used by auto' if st.get('quick') else ''}")
    for name, e in sorted(cal["entries"].items()):
        print(f"{name}:")
        print(f"  {'N':>6} {'scan ms':>10} {'chunked ms':>11} {'chunked/scan':>13}")
        for n, s, c, r in zip(e["n"], e["scan_ms"], e["chunked_ms"], e.get("ratio", e["chunked_ms"])):
            print(f"  {n:>6} {s:>10.3f} {c:>11.3f} {r:>13.2f}")
        for x, at in [(e, "")] + [(h, f", D = M = {h['dim']}") for h in e.get("heads", ())]:
            if x.get("chunk_ms"):
                timed = ", ".join(f"({c}, {b}) {ms:.3f}" for c, b, ms in x["chunk_ms"])
                print(f"  chunked kernel, ms by (chunk, row block) at N = {st.get('chunk_n')}{at}, "
                      f"the table's first: {timed}")
            if x.get("grad_chunk_ms"):
                timed = ", ".join(f"({c}, {b}) {ms:.3f}" for c, b, ms in x["grad_chunk_ms"])
                print(f"  linear_attention_vjp, ms by the backward's (chunk, row block) at N = {st.get('chunk_n')}"
                      f"{at}, config's first: {timed}")
    print("method='auto' (causal, CPU) on this machine:")
    for name, e in sorted(cal["entries"].items()):
        rows, cross = e["rows"], crossover(e["rows"])
        text = (f"{rows[0][1]} at every N" if len(rows) == 1
                else f"{rows[0][1]} up to N = {rows[0][0]}, {rows[1][1]} above")
        pair = f"; chunks of {e['chunk'][0]} in row blocks of {e['chunk'][1]}" if "chunk" in e else ""
        if "grad_chunk" in e:
            pair += f"; its gradient's chunks of {e['grad_chunk'][0]} in row blocks of {e['grad_chunk'][1]}"
        for h in used_heads(e, name.partition("/")[2], cal):
            hp = [f"chunks of {h['chunk'][0]} in row blocks of {h['chunk'][1]}"] if "chunk" in h else []
            if "grad_chunk" in h:
                hp.append(f"its gradient's chunks of {h['grad_chunk'][0]} in row blocks of {h['grad_chunk'][1]}")
            if hp:
                pair += f"; heads in the table row of D = M = {h['dim']}: {', '.join(hp)}"
        print(f"  {name:<22} {text}{f'  (chunked from N = {cross})' if cross is not None else ''}{pair}")


def cmd_tune(args) -> int:
    """Time the scan against the chunked kernel here and store the rows ``method="auto"`` uses."""
    from linattn_nb import _tune

    if args.show or args.clear:
        ignored = [f for f, given in (("--quick", args.quick), ("--rules", args.rules is not None),
                                      ("--dtypes", args.dtypes is not None)) if given]
        if ignored:
            which = "--show" if args.show else "--clear"
            print(f"linattn tune: {', '.join(ignored)} cannot be combined with {which} (they choose what to time)",
                  file=sys.stderr)
            return 2
    print(f"machine: {_tune.machine_line()}")
    for w in _tune.forced_kernel_warnings():
        print(f"WARNING: {w}")
    path = _tune.calibration_path()
    if args.clear:
        try:
            removed = _tune.clear()
        except OSError as exc:
            print(f"linattn tune: cannot remove {path}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        print(f"removed {removed}" if removed else f"no calibration stored for this machine ({path or 'no cache folder'})")
        return 0
    if args.show:
        cal, problem = _tune.read()
        if problem:
            print(f"the stored file {path} {problem}: ignored, method='auto' uses config.AUTO_METHODS "
                  "(the next `linattn tune` replaces it)")
        elif cal is None:
            print(f"no calibration stored for this machine ({path or 'no cache folder'}); "
                  "method='auto' uses config.AUTO_METHODS")
        else:
            print(f"stored {cal['created']} in {path}")
            _print_calibration(cal)
        others = _tune.other_files()
        if others:
            print(f"{len(others)} other calibration file(s) in the folder (other CPU, BLAS, threads or versions)")
        return 0
    try:
        mode = _tune.mode()  # before any timing: a bad LINATTN_AUTO_TUNE is a usage error, not a late traceback
    except ValueError as exc:
        print(f"linattn tune: error: {exc}", file=sys.stderr)
        return 2
    avail = _tune.tuned_rules()
    for opt, text in (("--rules", args.rules), ("--dtypes", args.dtypes)):
        items = [] if text is None else [x.strip() for x in text.split(",")]
        if any(items) and not all(items):  # "float32,," or "additive,,decay": a value left out, not skipped
            print(f"linattn tune: error: {opt} has an empty item in {text!r}; separate the values by single "
                  "commas", file=sys.stderr)
            return 2
    rules = avail if args.rules is None else [r.strip() for r in args.rules.split(",") if r.strip()]
    if not rules:
        print(f"linattn tune: error: --rules names no rule (choose from {', '.join(avail)})", file=sys.stderr)
        return 2
    bad = [r for r in rules if r not in avail]
    if bad:
        print(f"linattn tune: error: no rule with both a scan and a chunked CPU kernel: {', '.join(bad)} "
              f"(choose from {', '.join(avail)})", file=sys.stderr)
        return 2
    dtypes = _tune.DTYPES if args.dtypes is None else [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in _tune.DTYPES for d in dtypes):
        print(f"linattn tune: error: --dtypes takes {', '.join(_tune.DTYPES)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    cal = _tune.calibrate(rules, dtypes, quick=args.quick,
                          progress=lambda r, d: print(f"timing {r}, {d} ...", flush=True))
    old = _tune.load()
    # a smoke test never replaces a full calibration: auto would ignore it and the full one would be lost
    keep = args.quick and old is not None and not old["setting"]["quick"]
    if not keep:
        cal = _tune.merge(old, cal)
        stored = _tune.save(cal)
    print(f"calibrated in {time.perf_counter() - t0:.1f} s"
          + (f"; load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""))
    _print_calibration(cal)
    if keep:
        print(f"not stored: the full calibration of {old['created']} in {path} is kept (a --quick smoke test "
              "never replaces a full calibration; `linattn tune --clear` removes it)")
    elif stored:
        print(f"stored in {stored}")
    else:
        print("not stored: no writable cache folder (LINATTN_NO_CACHE, or the folder cannot be written)")
    if mode == "off":
        print("note: config.AUTO_TUNE is 'off' (LINATTN_AUTO_TUNE): method='auto' ignores it until that changes")
    return 0


#: The demo's check: float32 outputs within this relative (Frobenius) error of the float64 reference.
#: float32 round-off of these sizes is about 1e-7..1e-6; a wrong kernel is off by far more.
DEMO_RTOL = 1e-4


def cmd_demo(args) -> int:
    """Every CPU method (and softmax) in float32 against a float64 reference; 1 if any check fails."""
    import numpy as np

    from linattn_nb import _tune, linear_attention, softmax_attention
    from linattn_nb.ops.registry import available_methods

    try:
        _tune.mode()  # method="auto" reads it: a bad LINATTN_AUTO_TUNE is a usage error, not a traceback mid-table
    except ValueError as exc:
        print(f"linattn demo: error: {exc}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    shape = (args.batch, args.heads, args.length, args.dim)
    print(f"demo: q, k, v of shape {shape}, float32, feature map 'elu'; check: relative error <= {DEMO_RTOL:g}")
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    failed = []

    def check(what, out, ref):
        err = float(np.linalg.norm(np.asarray(out, dtype=np.float64) - ref) / np.linalg.norm(ref))
        ok = bool(np.isfinite(err) and err <= DEMO_RTOL)
        if not ok:
            failed.append(f"{what}: relative error {err:.3g} > {DEMO_RTOL:g}")
        return err, "ok" if ok else "FAIL"

    print(f"{'causal':>7} {'method':>10} {'time [ms]':>10} {'rel. error vs float64 reference':>32} {'check':>6}")
    for causal in (False, True):
        ref = linear_attention(q64, k64, v64, causal=causal, method="quadratic")
        for method in ["auto"] + [m for m in available_methods(causal=causal) if m != "quadratic"]:
            linear_attention(q, k, v, causal=causal, method=method)  # compile / load from cache
            t0 = time.perf_counter()
            out = linear_attention(q, k, v, causal=causal, method=method)
            dt = time.perf_counter() - t0
            err, verdict = check(f"linear_attention causal={causal} method={method!r}", out, ref)
            print(f"{str(causal):>7} {method:>10} {dt * 1e3:10.2f} {err:32.2e} {verdict:>6}")
    softmax_attention(q, k, v, causal=True)
    t0 = time.perf_counter()
    out = softmax_attention(q, k, v, causal=True)
    dt = time.perf_counter() - t0
    err, verdict = check("softmax_attention causal=True", out, softmax_attention(q64, k64, v64, causal=True))
    print(f"softmax_attention causal: {dt * 1e3:.2f} ms, rel. error {err:.2e} {verdict}")
    if failed:
        print(f"demo: {len(failed)} check(s) failed:", file=sys.stderr)
        for line in failed:
            print(f"  {line}", file=sys.stderr)
        return 1
    print("demo: all checks passed")
    return 0


#: What ``--quick`` costs on the 2-core development VM (AMD EPYC): a first run with a cold kernel cache,
#: most of it compiling the kernels, took 140 s at load 1.4-1.6, 30 s of it the MQAR section that runs
#: where torch is installed (docs/guide/studies.md); notebook 01 quotes the same words (tests/test_cli.py).
QUICK_TIME = "about 2.5 minutes on 2 cores on a first run, most of it compiling the kernels"


def _study_options(p, *, default_out: str) -> None:
    p.set_defaults(default_out=default_out)
    p.add_argument("--out", metavar="DIR", default=None,
                   help=f"report folder: report.md, PNG plots, raw <study>.jsonl (default: {default_out})")
    p.add_argument("--quick", action="store_true",
                   help=f"same as --profile quick (the whole report: {QUICK_TIME})")
    p.add_argument("--profile", choices=("tiny", "quick", "full"), default=None,
                   help="problem sizes: full (default; about 5 min on 2 cores on a first run, which compiles the "
                        "kernels, and about 16 min more for the MQAR training study where torch is installed; "
                        "report.md states the time each study took), quick, or tiny (a smoke test)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                   help="auto (default): the CPU, plus the GPU when a real one is present; cpu; cuda (GPU only)")
    p.add_argument("--scheduler", metavar="ADDR", default=None,
                   help="run the points of untimed studies on this Dask scheduler (e.g. tcp://host:8786); "
                        "timed studies always run here, one point at a time")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="without --scheduler: run untimed studies in N local worker processes")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--force", action="store_true",
                       help="replace the report in a non-empty DIR (deletes its previous report files only)")
    again.add_argument("--resume", action="store_true",
                       help="continue an interrupted report in DIR, keeping the finished points")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def _problem_options(p, study) -> None:
    """``--dim`` ... ``--seeds``: change the profile's grid of ``study`` (see linattn_nb._overrides)."""
    g = p.add_argument_group("problem options", "change the profile's grid (values: one number, or a "
                                                "comma-separated list where several are allowed)")
    g.add_argument("--dim", metavar="D", default=None, help="key dimension d of q and k")
    g.add_argument("--scale", metavar="S", default=None,
                   help="q, k ~ S·N(0, I) (logits q·k/√d of standard deviation S²), one regime per value, "
                        "e.g. 0.5,1,2 (the profiles run 0.5 and 1)"
                   if study.name == "error" else
                   f"input scale: refused, the {study.name} study sets its own inputs' scales (its points have no "
                   "qk_scale)")
    g.add_argument("--maps", metavar="NAMES", default=None,
                   help="feature maps to run, e.g. elu,favor+,taylor2 (default: the study's)")
    g.add_argument("--m", metavar="M", default=None, help="random maps' number of features, e.g. 64,256,1024")
    g.add_argument("--n", metavar="N", default=None,
                   help="numbers of stored pairs n, e.g. 16,64,256" if study.name == "recall"
                   else "sequence lengths N, e.g. 256,1024,4096")
    g.add_argument("--seeds", metavar="K", default=None, help="run every point for seeds 0 .. K-1")


@contextlib.contextmanager
def _studies_with_options(options):
    """Register, for the duration, each study of ``options`` with its points changed by its options."""
    from dataclasses import replace

    from linattn_nb._overrides import apply_overrides
    from linattn_nb.studies import get_study, register_study

    originals = []
    try:
        for name, opts in options.items():
            if not opts:
                continue
            study = get_study(name)

            def points(ctx, _study=study, _opts=opts):
                return apply_overrides(_study.points(ctx), _opts, study=_study.name)

            originals.append(study)
            register_study(replace(study, points=points), overwrite=True)
        yield
    finally:
        for study in originals:
            register_study(study, overwrite=True)


@contextlib.contextmanager
def _mqar_grid(grid):
    """``linattn mqar --grid``: for the duration, the mqar study's points on that grid (None: as registered)."""
    if grid is None:
        yield
        return
    from dataclasses import replace

    from linattn_nb.studies import get_study, register_study

    study = get_study("mqar")
    register_study(replace(study, points=lambda ctx, _p=study.points: _p(ctx, grid=grid)), overwrite=True)
    try:
        yield
    finally:
        register_study(study, overwrite=True)


def _first_missing(path: str) -> str | None:
    """The outermost folder that creating ``path`` would make (None when ``path`` exists)."""
    top, p = None, os.path.abspath(path)
    while not os.path.exists(p):
        top, parent = p, os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return top


def _unwritable(out: str) -> str | None:
    """Why the report folder ``out`` cannot be created or written (None when it can).

    Creates it and writes a temporary file there, so that a bad ``--out`` is refused before any study
    runs (as root, permission bits alone say nothing).
    """
    if os.path.exists(out) and not os.path.isdir(out):
        return "exists and is not a directory"
    try:
        os.makedirs(out, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and os.path.abspath(exc.filename) != os.path.abspath(out) else ""
        return f"cannot be created or written: {exc.strerror or exc}{where}"
    return None


#: Why --scheduler and --workers exclude each other (main() and a --config file's values).
SCHEDULER_AND_WORKERS = ("--workers sizes the local worker processes; --scheduler brings its own workers: "
                         "pass one or the other")


def _scheduler_and_workers(config: str, from_file: set) -> str:
    """The refusal of a scheduler with workers when one or both come from the ``--config`` file."""
    if {"scheduler", "workers"} <= from_file:
        return (f"--config {config!r}: sets both scheduler and workers; workers sizes the local worker "
                "processes, scheduler brings its own workers: set one or the other")
    flag, key = ("--workers", "scheduler") if "scheduler" in from_file else ("--scheduler", "workers")
    return f"{SCHEDULER_AND_WORKERS} ({flag} given here, {key} set by --config {config!r})"


def _run_studies(args, names, argv) -> int:
    from pathlib import Path

    from linattn_nb._overrides import (OPTION_KEYS, OptionError, apply_overrides, check_options,
                                       check_study_values, load_config)
    from linattn_nb.studies import Context, get_study, run_report
    from linattn_nb.studies.report import command_line

    options = {}
    try:
        if getattr(args, "config", None) is not None:
            conf = load_config(args.config)
            # the command line wins over the description
            from_file = set()
            for key in ("out", "device", "scheduler", "workers"):
                if getattr(args, key) is None:
                    setattr(args, key, conf[key])
                    if conf[key] is not None:
                        from_file.add(key)
            if args.scheduler is not None and args.workers is not None:  # as main() refuses the two flags
                raise OptionError(_scheduler_and_workers(os.fspath(args.config), from_file))
            if args.profile is None:
                args.profile = conf["profile"]
            names = conf["studies"]
            options = conf["options"]
        elif names is not None:
            given = {key: getattr(args, key) for key in OPTION_KEYS if getattr(args, key, None) is not None}
            opts = check_options(given, section="--")
            if opts:
                options = {names[0]: opts}
        args.profile = args.profile or "full"
        args.device = args.device or "auto"
        args.out = args.out or args.default_out
        for name, opts in options.items():  # refuse options a study cannot take before anything runs
            section = "" if getattr(args, "config", None) is not None else "--"
            ctx = Context(out=Path(args.out), profile=args.profile)
            try:
                apply_overrides(get_study(name).points(ctx), opts, study=name, section=section)
                check_study_values(get_study(name), opts, ctx, section=section)
            except OptionError as exc:
                if getattr(args, "config", None) is None:
                    raise
                # name the file and the study's table, as load_config's own messages do
                raise OptionError(f"--config {os.fspath(args.config)!r}: [{name}] {exc}") from None
    except OptionError as exc:
        print(f"linattn {args.command}: error: {exc}", file=sys.stderr)
        return 2
    from linattn_nb.studies.report import check_workers

    try:
        check_workers(args.workers, name="--workers")  # run_report's own check, before --out is made
    except (TypeError, ValueError) as exc:
        print(f"linattn {args.command}: error: {exc}", file=sys.stderr)
        return 2
    env_grid = os.environ.get("LINATTN_NB_MQAR_GRID")
    if (names is None or "mqar" in names) and getattr(args, "grid", None) is None and env_grid \
            and env_grid not in ("profile", "all"):  # what --grid takes, refused as --grid refuses it
        print(f"linattn {args.command}: error: LINATTN_NB_MQAR_GRID must be 'profile' or 'all' (as --grid), got "
              f"{env_grid!r}", file=sys.stderr)
        return 2
    if names is not None:
        study = get_study(names[0])
        reason = study.requires()
        if reason:
            print(f"linattn {args.command}: the {study.title.lower()} study cannot run here: {reason}",
                  file=sys.stderr)
            return 3
    created = _first_missing(args.out)
    problem = _unwritable(args.out)
    if problem:
        print(f"linattn {args.command}: error: --out {args.out!r}: {problem}", file=sys.stderr)
        return 2

    def usage_error(message: str) -> int:
        print(f"linattn {args.command}: error: {message}", file=sys.stderr)
        # the folders made by the check above, if nothing was written there
        path = os.path.abspath(args.out)
        while created is not None:
            try:
                os.rmdir(path)
            except OSError:
                break
            if path == created:
                break
            path = os.path.dirname(path)
        return 2

    # The error and rank studies build their grids from the options themselves (their points' keywords), as
    # run_report(options=...) does: the generic override would expand every point of the error study's m sweep
    # to every N of --n, and would keep the rank study's value width M (the largest D_φ) and drop its softmax.
    from linattn_nb.studies.error import OPTION_KEYWORDS

    keywords = {"error": OPTION_KEYWORDS, "rank": {k: k for k in ("dim", "maps", "m", "n", "seeds")}}
    own = {name: {keywords[name][k]: v for k, v in opts.items()} for name, opts in options.items()
           if name in keywords and opts}
    options = {name: opts for name, opts in options.items() if name not in own}
    try:
        with _studies_with_options(options), _mqar_grid(getattr(args, "grid", None)):
            res = run_report(args.out, profile=args.profile, device=args.device, scheduler=args.scheduler,
                             workers=args.workers, force=args.force, resume=args.resume, studies=names,
                             progress=args.progress, command=command_line(argv), options=own or None)
    except KeyboardInterrupt:
        # --force contradicts --resume (the parsers take no abbreviation: --force is spelt out)
        again = [a for a in argv if a != "--force"]
        if not args.resume:
            again.append("--resume")
        print(f"linattn {args.command}: interrupted; the finished points are kept in {args.out!r}: "
              f"`linattn {shlex.join(again)}` continues", file=sys.stderr)
        return 130
    except (FileExistsError, NotADirectoryError, ValueError, RuntimeError) as exc:
        return usage_error(str(exc))
    except ConnectionError as exc:  # run_report could not reach --scheduler: not a folder problem
        return usage_error(str(exc))
    except OSError as exc:
        what = exc.strerror or str(exc) or type(exc).__name__
        return usage_error(f"cannot write the report to {args.out!r}: "
                           + (f"{what}: {exc.filename!r}" if exc.filename else what))
    if names is not None and getattr(args, "config", None) is None:
        for name in names:
            section = res.sections.get(get_study(name).name)
            if section is not None:
                print(section.markdown)
    if res.problems:
        print(f"linattn {args.command}: {len(res.problems)} problem(s):", file=sys.stderr)
        for p in res.problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    from linattn_nb import __version__

    # allow_abbrev=False on every parser: a prefix such as --n must not be read as --no-progress
    parser = argparse.ArgumentParser(prog="linattn", description="linattn_nb: Numba-accelerated linear attention",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"linattn_nb {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("info", allow_abbrev=False,
                       help="versions, threading layer, CPU and BLAS kernels, CUDA status, cache directory")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser(
        "tune", allow_abbrev=False,
        help="time scan against chunked on this CPU and BLAS; method='auto' then follows the result",
        description="Time the causal CPU methods (scan against chunked) for every update rule that has both, "
                    "in float32 and float64, at B*H = 16, D = M = 64, N = 1 ... 4096 (tens of seconds on 2 cores once "
                    "the kernels are compiled; a first run compiles them), and "
                    "store the rows method='auto' uses in the kernel cache folder, keyed by the CPU, the BLAS "
                    "(its kernels and overrides such as OPENBLAS_CORETYPE), the threads and the versions. "
                    "config.AUTO_TUNE (LINATTN_AUTO_TUNE) decides whether auto reads it (docs/tuning.md).")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--show", action="store_true", help="print the calibration stored for this machine")
    what.add_argument("--clear", action="store_true", help="remove the calibration stored for this machine")
    p.add_argument("--rules", default=None, metavar="NAMES", help="comma-separated rules (default: all that have both)")
    p.add_argument("--dtypes", default=None, metavar="NAMES", help="float32,float64 (default: both)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke test at tiny sizes (seconds); stored, but marked so that method='auto' ignores it, "
                        "and never over a full calibration (which is kept)")
    p.set_defaults(func=cmd_tune)
    p = sub.add_parser("demo", allow_abbrev=False, help="run every CPU method on a small problem against the reference")
    p.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    p.add_argument("--heads", type=int, default=4, help="heads (default 4)")
    p.add_argument("--length", type=int, default=1024, help="sequence length N (default 1024)")
    p.add_argument("--dim", type=int, default=64, help="D = M (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "report", allow_abbrev=False,
        help="run every built-in study; write DIR/report.md with tables, plots and raw JSONL",
        description="Run the built-in studies (correctness self-check, causal throughput against N, "
                    "approximation error, rank limits, recall capacity, MQAR training, ...; those whose "
                    "optional packages are not installed, e.g. torch for MQAR, are listed as not run) and "
                    "write DIR/report.md with tables and PNG plots beside the raw results (one JSON Lines "
                    "file per study).")
    _study_options(p, default_out="report")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="run the report a TOML (or .json) file describes: profile, device, out, studies, "
                        "workers, scheduler and one table of problem options per study ([error], [rank], "
                        "[recall]: dim, scale, maps, m, n, seeds); options given here win over the file")
    p.set_defaults(func=lambda args, argv: _run_studies(args, None, argv), wants_argv=True)

    from linattn_nb.studies import STUDIES
    from linattn_nb.studies import _builtin  # noqa: F401  (registers the built-in studies)

    from linattn_nb._overrides import PROBLEM_STUDIES

    for study in STUDIES:
        p = sub.add_parser(study.command, help=study.help, allow_abbrev=False,
                           description=f"{study.help[:1].upper()}{study.help[1:]}. Writes DIR/report.md with "
                                       "this study alone and prints its tables.")
        _study_options(p, default_out=f"report-{study.command}")
        if study.name in PROBLEM_STUDIES:
            _problem_options(p, study)
        if study.name == "mqar":
            from linattn_nb.studies.mqar import WHOLE_GRID_TIME

            p.add_argument("--grid", choices=("profile", "all"), default=None,
                           help="profile (default, or LINATTN_NB_MQAR_GRID): the profile's grid; all: the "
                                "whole grid, every layer at four head dimensions, kv 4, 8, 16, 32, three "
                                f"seeds ({WHOLE_GRID_TIME}); --resume continues it")
        p.set_defaults(func=lambda args, argv, _n=study.name: _run_studies(args, [_n], argv), wants_argv=True)
    for sp in sub.choices.values():  # errors found after parsing are the subcommand's: its usage line
        sp.set_defaults(subparser=sp)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand's parser where there is one: its usage line, its name
        (getattr(args, "subparser", None) or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    # checks argparse cannot make: reported by the subcommand's parser ("usage: linattn demo ...")
    subparser = args.subparser
    if args.command == "demo":
        for name in ("batch", "heads", "length", "dim"):
            if getattr(args, name) < 1:
                subparser.error(f"--{name} must be >= 1")
        if args.seed < 0:
            subparser.error("--seed must be >= 0")
        import math

        from linattn_nb import config

        limit = config.knob_int("QUADRATIC_MAX_ELEMENTS")  # the float64 reference is method='quadratic': N x N
        if args.length * args.length > limit:
            subparser.error(f"--length {args.length} is too long for the float64 reference (method='quadratic', an "
                            f"N x N matrix): the largest length allowed is {math.isqrt(limit)} "
                            f"(config.QUADRATIC_MAX_ELEMENTS = {limit}, LINATTN_QUADRATIC_MAX_ELEMENTS)")
    if getattr(args, "wants_argv", False):
        # Checked here, not by an argparse group: argparse does not see
        # "--quick --profile full" as a conflict when "full" is the default.
        if args.quick and args.profile not in (None, "quick"):
            subparser.error(f"--quick and --profile {args.profile} contradict each other")
        args.profile = "quick" if args.quick else args.profile  # None: the --config file's, else full
        if getattr(args, "out", None) == "":
            subparser.error("--out is empty: give a folder (or leave it out for the default)")
        if getattr(args, "scheduler", None) is not None and getattr(args, "workers", None) is not None:
            subparser.error(SCHEDULER_AND_WORKERS)
    try:
        return int((args.func(args, argv) if getattr(args, "wants_argv", False) else args.func(args)) or 0)
    except KeyboardInterrupt:
        print(f"linattn {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
