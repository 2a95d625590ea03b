"""``linattn report``: run the registered studies through :func:`~linattn_nb.studies.sweep` and write
``report.md`` with their tables and plots (docs/guide/studies.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import shlex
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .. import config
from .._interrupt import check as check_interrupt, interrupts
from .._validate import check_int
from ._study import PROFILES, STUDIES, Context, Rendered, get_study, markdown_table
from .sweep import (function_name, grid_points, header_problem, load_results, read_header, sweep, usable_cores,
                    version_problem)

__all__ = ["run_report", "ReportResult", "resolve_devices", "machine_info"]

DEVICE_CHOICES = ("auto", "cpu", "cuda")


@dataclass
class ReportResult:
    """What :func:`run_report` did.

    Attributes
    ----------
    path : Path
        The written ``report.md``.
    problems : list of str
        Failed checks, failed points, studies that raised.  Empty when all is well.
    skipped : list of (str, str)
        ``(study name, reason)`` for studies that could not run here.
    sections : dict
        Study name -> :class:`~linattn_nb.studies.Rendered`.
    elapsed_s : float
    cached_kernels : int or None
        Compiled kernels in the on-disk cache when the report started (0: cold; None: caching off).
    timings : dict
        Study name -> seconds it took (what ``report.md`` shows).
    over_budget : list of (str, float, float)
        ``(study name, seconds taken, budget)`` over :attr:`Study.budget_s` (not shown in ``report.md``).
    reused : dict
        Study name -> ``(new, reused)``: of its points, how many ran now and how many finished in an
        earlier run whose results were in the folder (``resume``); only studies with reused points.
        ``report.md`` gives both beside the time, which counts the new points alone.
    """

    path: Path
    problems: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    sections: dict = field(default_factory=dict)
    elapsed_s: float = 0.0
    cached_kernels: int | None = None
    timings: dict = field(default_factory=dict)
    over_budget: list = field(default_factory=list)
    reused: dict = field(default_factory=dict)


def resolve_devices(device: str) -> tuple:
    """The devices the studies run on: "auto" adds the GPU when a real one is present.

    Raises
    ------
    ValueError
        Unknown ``device``.
    RuntimeError
        ``device="cuda"`` without a real GPU (the CUDA simulator does not count:
        its timings mean nothing).
    """
    from ..device import cuda_status

    if device not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {', '.join(map(repr, DEVICE_CHOICES))}, got {device!r}")
    if device == "cpu":
        return ("cpu",)
    status = cuda_status()
    if device == "cuda":
        if status != "gpu":
            raise RuntimeError(
                f"device='cuda' but no usable CUDA GPU was found (CUDA status: {status}); "
                "the report's GPU studies need a real GPU. Use --device cpu or auto."
            )
        return ("cuda",)
    return ("cpu", "cuda") if status == "gpu" else ("cpu",)


def gpu_name() -> str:
    """The current CUDA device's name and compute capability."""
    from numba import cuda

    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    return f"{name} (compute capability {'.'.join(map(str, dev.compute_capability))})"


def machine_info() -> list[tuple[str, str]]:
    """(name, value) rows describing this machine and the software versions."""
    import numba
    import numpy as np

    import linattn_nb
    from .._tune import cpu_model
    from ..device import cuda_status

    try:
        layer = f"{numba.threading_layer()} threading layer"
    except ValueError:  # no parallel kernel ran in this process (a report whose points were all reused)
        layer = "threading layer not started"
    status = cuda_status()
    cuda = {"gpu": "GPU", "simulator": "CUDA simulator only (no GPU timings)", "none": "no GPU"}[status]
    if status == "gpu":
        with contextlib.suppress(Exception):
            cuda = gpu_name()
    import scipy

    return [
        ("linattn_nb", linattn_nb.__version__),
        ("CPU", f"{cpu_model()}, {usable_cores()} usable cores"),
        ("platform", platform.platform()),
        ("Python", platform.python_version()),
        ("NumPy / SciPy / Numba", f"{np.__version__} / {scipy.__version__} / {numba.__version__}"),
        ("Numba threads", f"{numba.get_num_threads()} ({layer})"),
        ("CUDA", cuda),
        # np.dot inside Numba's parallel kernels calls a BLAS that may start threads
        # of its own: the settings that decide it belong beside the timings.
        ("BLAS / OpenMP threads", ", ".join(f"{v}={os.environ.get(v, '(unset)')}" for v in
                                            ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"))),
    ]


def report_files(out: Path, studies) -> list:
    """The files a report of ``studies`` writes in ``out``: ``report.md`` (and its temporary file),
    each study's ``<name>.jsonl`` and the plots it declares (:attr:`Study.figures`)."""
    files = [out / "report.md", out / "report.md.tmp"]
    for s in studies:
        files.append(out / f"{s.name}.jsonl")
        files += [out / f"{name}.png" for name in s.figures]
    return files


def _prepare_out(out: Path, *, force: bool, resume: bool, studies=()) -> None:
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not (force or resume):
            raise FileExistsError(
                f"the report folder {str(out)!r} is not empty; pass --force to replace the report "
                "there, --resume to continue an interrupted report, or choose another --out"
            )
        if force:
            # Remove only the files this report writes (by their exact names): other files, and other
            # studies' results, stay.
            for p in report_files(out, studies):
                if p.is_file():
                    p.unlink()
        else:
            _check_resumable(out, studies)
            if (out / "report.md").exists() and not any((out / f"{s.name}.jsonl").is_file() for s in studies):
                raise FileExistsError(
                    f"--resume: the report folder {str(out)!r} holds a report.md but no results of this report's "
                    "studies to continue; pass --force to replace that report.md, or choose another --out"
                )
            others = _other_studies(out, studies)
            if (out / "report.md").exists() and others:
                names = [s.name for s in studies] + others
                raise ValueError(
                    f"--resume: the report folder {str(out)!r} also holds results of the "
                    f"{', '.join(others)} {'study' if len(others) == 1 else 'studies'} "
                    f"({', '.join(name + '.jsonl' for name in others)}), which this report does not run: its "
                    f"report.md would be rewritten without {'it' if len(others) == 1 else 'them'}; resume the "
                    f"report of all of them (linattn report --config FILE with studies = {names!r}, or "
                    f"run_report(..., studies={names!r})), or choose another --out"
                )
    out.mkdir(parents=True, exist_ok=True)


def _other_studies(out: Path, studies) -> list:
    """The registered studies, not among ``studies``, whose results file (``<name>.jsonl``, a sweep's: it starts
    with a header) is in the report folder ``out``: the studies its report.md holds besides ``studies``."""
    chosen = {s.name for s in studies}
    return [s.name for s in STUDIES if s.name not in chosen and (out / f"{s.name}.jsonl").is_file()
            and read_header(out / f"{s.name}.jsonl") is not None]


def _check_resumable(out: Path, studies) -> None:
    """ValueError, before anything runs, when a results file of ``studies`` in ``out`` cannot be resumed: it
    holds another function's results or another format, or another linattn_nb version wrote it (a resumed
    report would reuse its points)."""
    for s in studies:
        path = out / f"{s.name}.jsonl"
        header = read_header(path) if path.is_file() else None
        if header is None:
            continue
        problem = header_problem(header, path, function_name(_DictRun(s))) or version_problem(header, path)
        if problem:
            raise ValueError(f"{problem}; pass --force to run the report's studies again from the start (it deletes "
                             "their results files), or choose another --out")


def run_report(
    out="report",
    *,
    profile: str = "full",
    device: str = "auto",
    scheduler=None,
    workers: int | None = None,
    force: bool = False,
    resume: bool = False,
    studies=None,
    progress: bool = True,
    log=None,
    command: str | None = None,
    options: dict | None = None,
) -> ReportResult:
    """Run the built-in studies and write ``<out>/report.md``.

    Parameters
    ----------
    out : str or Path, default "report"
        The report folder (``report.md``, a ``<study>.jsonl`` of raw results and plots per study).
    profile : {"full", "quick", "tiny"}
        Problem sizes: the default, a first look, or a smoke test in seconds.
    device : {"auto", "cpu", "cuda"}
        ``"auto"``: the CPU, and the GPU when a real one is present.
    scheduler : str or distributed.Client, optional
        Run the untimed studies' points on this Dask cluster (timing studies always run here).
    workers : int, optional
        Without a scheduler: run the untimed studies in this many local worker processes.
    force : bool
        Replace the report in a non-empty ``out`` (its report files are deleted, others kept).
    resume : bool
        Continue an interrupted report in ``out``: finished points are kept.
    studies : list of str, or str, optional
        Names (or commands) of the studies to run, in report order; a single name (a str) is one
        study.  Default: every study with ``in_report``.
    progress : bool
        Progress bars on a terminal.
    log : callable, optional
        Called with one line of status text at a time (default: stderr).
    command : str, optional
        The command line to quote in the report.
    options : dict, optional
        Study name (or command) -> keyword arguments of its ``points`` function, overriding the
        profile's grid, e.g. ``{"error": {"dim": 32, "scales": [1.0], "seeds": 5}}``; only for
        studies being run.  Checked by building each such study's points before anything runs.

    Returns
    -------
    ReportResult

    Raises
    ------
    FileExistsError
        ``out`` is not empty and neither ``force`` nor ``resume`` is set.
    ValueError
        Bad ``profile``, ``device``, study name (or no study), ``workers`` < 1 or given with
        ``scheduler``, options a study's ``points`` refuses or for a study not being run, ``force``
        with ``resume``, ``resume`` on a results file of a study being run that another linattn_nb
        version wrote, or ``resume`` on a folder whose report.md also holds studies not being run (their
        results files are there: rewriting report.md would drop them).  Raised, like the TypeErrors,
        before anything is run or written.
    TypeError
        ``studies``, ``workers`` or ``options`` of the wrong type.
    ConnectionError
        The ``scheduler`` address cannot be reached.

    Examples
    --------
    >>> import tempfile
    >>> res = run_report(tempfile.mkdtemp(), profile="tiny", studies=["correctness"],
    ...                  progress=False, log=lambda line: None)
    >>> res.path.name, res.problems
    ('report.md', [])
    """
    t_start = time.perf_counter()
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(map(repr, PROFILES))}, got {profile!r}")
    if force and resume:
        raise ValueError("force (start afresh) and resume (continue) exclude each other")
    workers = check_workers(workers)
    if scheduler is not None and workers is not None:
        raise ValueError("workers= sizes the local worker processes and scheduler= brings its own workers: "
                         "pass one or the other")
    if log is None:
        def log(line):
            print(line, file=sys.stderr, flush=True)
    from . import _builtin  # noqa: F401  (importing the built-in studies registers them)

    selected = _check_studies(studies)
    study_options = _check_options(options, selected)
    devices = resolve_devices(device)
    out = Path(out)
    _check_points(selected, study_options, Context(out=out, profile=profile, devices=devices))
    client = _connect(scheduler)  # before the folder is touched: an unreachable scheduler changes nothing
    try:
        _prepare_out(out, force=force, resume=resume, studies=selected)
    except BaseException:
        if client is not None:
            client.close()
        raise
    try:
        import matplotlib  # noqa: F401

        plots = True
    except ImportError:
        plots = False
        log("matplotlib is not installed: the report has tables but no plots (pip install 'linattn_nb[plot]')")
    ctx = Context(out=out, profile=profile, devices=devices, plots=plots)

    from .. import _cache

    folder = _cache.cache_folder()[0]  # compiled kernels in it: *.nbc files
    result = ReportResult(path=out / "report.md",
                          cached_kernels=None if folder is None else sum(1 for _ in Path(folder).rglob("*.nbc")))
    timings = {}
    n_sel = len(selected)
    runnable = []  # (index in the report, study), in the report's order
    for i, study in enumerate(selected, 1):
        reason = study.requires()
        if reason:
            result.skipped.append((study.name, reason))
            log(f"[{i}/{n_sel}] {study.name}: not run: {reason}")
        else:
            runnable.append((i, study))
    # the points each study's results file already holds (--resume): they are not run, nor timed, again
    finished_before = {study.name: _finished_keys(out / f"{study.name}.jsonl") for _, study in runnable}
    # background studies start first in a spawned process, the untimed ones run here meanwhile and
    # the timed ones last, once it has finished (docs/guide/studies.md); the report keeps its order
    background = {}  # study name -> (process, start time, points, elapsed)
    if config.REPORT_BACKGROUND and scheduler is None and not workers:
        if any(not s.timing and not s.background for _, s in runnable):
            prepares = _prepares(runnable, study_options, ctx) if config.CACHE else []
            for i, study in runnable:
                if study.background and not study.timing:
                    started = _start_background(study, study_options.get(study.name, {}), ctx, out, prepares)
                    if started is not None:
                        prepares = []  # once, in the first background process
                        background[study.name] = started
                        log(f"{study.name}: {started[2]} points, started in a background process "
                            "beside the untimed studies")
    order = ([(i, s) for i, s in runnable if not s.timing and s.name not in background]
             + [(i, s) for i, s in runnable if s.name in background]
             + [(i, s) for i, s in runnable if s.timing])

    done = [0]  # progress lines are numbered in the order the studies finish

    def run_one(i, study):
        t0 = time.perf_counter()
        note = ""
        try:
            opts = study_options.get(study.name, {})
            pts = study.points(ctx, **opts)
            if study.name in background:
                proc, t_bg, _, elapsed = background[study.name]
                proc.join()
                t0 = t_bg if elapsed.value < 0 else time.perf_counter() - elapsed.value
                note = ", in the background"
                # The background process wrote its points to the results file:
                # this reads them back and runs here any it did not finish.
                kw = dict(backend="local")
            elif study.timing or (scheduler is None and not workers):
                kw = dict(backend="local")
            elif scheduler is not None:
                kw = dict(backend="dask", scheduler=client or scheduler)
            else:
                kw = dict(backend="local", workers=workers)
            if study.name not in background:
                log(f"[{done[0] + 1}/{len(runnable)}] {study.name}: {len(pts)} points"
                    f"{' (timed, one at a time)' if study.timing else ''}")
            records = sweep(_DictRun(study), pts, out=out / f"{study.name}.jsonl", resume=True,
                            errors="record", progress=progress and study.name not in background, **kw)
            reused = sum(1 for r in records if r.get("key") in finished_before[study.name])
            if reused:
                result.reused[study.name] = (len(records) - reused, reused)
                note += f"; {_points_text(*result.reused[study.name])}"
            rendered = study.render(records, ctx)
        except Exception as exc:  # noqa: BLE001 - the report goes on; the failure is shown
            import traceback

            rendered = Rendered(
                f"This study failed:\n\n```\n{traceback.format_exc()}```", "**failed**",
                [f"{study.name}: {type(exc).__name__}: {exc}"],
            )
        timings[study.name] = time.perf_counter() - t0
        result.sections[study.name] = rendered
        done[0] += 1
        log(f"[{done[0]}/{len(runnable)}] {study.name}: {rendered.summary or 'done'} "
            f"({timings[study.name]:.1f} s{note})")

    try:
        with interrupts():
            for i, study in order:
                run_one(i, study)
                check_interrupt()  # a Ctrl-C swallowed while the study ran (see _interrupt)
    finally:
        for proc, *_ in background.values():
            if proc.is_alive():  # interrupted: its finished points are in its results file
                proc.terminate()
                proc.join()
        if client is not None:
            client.close()
    result.problems = [p for _, s in runnable if s.name in result.sections for p in result.sections[s.name].problems]
    result.elapsed_s = time.perf_counter() - t_start
    result.timings = dict(timings)
    result.over_budget = [(s.name, timings[s.name], _budget(s, profile)) for _, s in runnable
                          if s.name in timings and _budget(s, profile) is not None
                          and timings[s.name] > _budget(s, profile)]
    _write_markdown(result, ctx, selected, timings, command)
    log(f"wrote {result.path} ({result.elapsed_s:.1f} s)")
    return result


class _DictRun:
    """A study's ``run`` that must return a dict (:attr:`Study.run`): anything else is a TypeError naming the
    study and the type, which the sweep records as the point's error.  It carries the name, module and
    qualified name of ``run`` (a results file's header names the function that wrote it) and pickles
    when ``run`` does (worker processes, Dask)."""

    def __init__(self, study):
        self.study = study.name
        self.run = study.run
        for attr in ("__module__", "__name__", "__qualname__"):
            if hasattr(study.run, attr):
                setattr(self, attr, getattr(study.run, attr))

    def __call__(self, **point):
        result = self.run(**point)
        if not isinstance(result, Mapping) and not (dataclasses.is_dataclass(result)
                                                    and not isinstance(result, type)):
            raise TypeError(f"the {self.study} study's run returned {type(result).__name__}, not a dict: "
                            "Study.run(**point) must return a dict of results")
        return result


#: How long :func:`run_report` tries to reach a ``scheduler`` address.
SCHEDULER_TIMEOUT = "30s"


def _connect(scheduler):
    """A distributed.Client of the ``scheduler`` address (None for no address, or a Client or cluster
    given as it is); ConnectionError naming the address when it cannot be reached."""
    if scheduler is None or not isinstance(scheduler, str):
        return None
    try:
        from distributed import Client
    except ImportError as exc:
        raise ImportError("--scheduler needs dask.distributed: pip install 'linattn_nb[dask]'") from exc
    try:
        return Client(scheduler, timeout=SCHEDULER_TIMEOUT)
    except OSError as exc:  # distributed's "Timed out trying to connect", a refused connection, ...
        raise ConnectionError(f"cannot reach the Dask scheduler at {scheduler!r} (tried for {SCHEDULER_TIMEOUT}): "
                              f"{exc}") from exc


def _background_sweep(run, points, path, prepares=(), elapsed=None) -> None:
    """In a spawned process: run a study's points into its results file, then each timed study's
    ``prepare(points)``.  Ctrl-C is left to the reporting process, which terminates this one.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    t0 = time.perf_counter()
    sweep(run, points, out=path, resume=True, errors="record", progress=False)
    if elapsed is not None:
        elapsed.value = time.perf_counter() - t0  # the study's own time, without the warm-ups after it
    for prepare, pts in prepares:
        with contextlib.suppress(Exception):  # only a warm-up: the timed study compiles what it needs itself
            prepare(pts)


def _start_background(study, opts, ctx, out, prepares=()):
    """Start ``study`` in a spawned process: ``(process, start time, points, elapsed)``.

    ``elapsed`` (a shared double) receives the time its sweep took, negative until it finishes.  None
    (the study then runs here, in its turn) when its points cannot be built or the process cannot start.
    """
    import multiprocessing

    t0 = time.perf_counter()
    mp = multiprocessing.get_context("spawn")
    try:
        pts = study.points(ctx, **opts)
        elapsed = mp.Value("d", -1.0, lock=False)
        proc = mp.Process(target=_background_sweep,
                          args=(_DictRun(study), pts, str(out / f"{study.name}.jsonl"), list(prepares), elapsed),
                          name=f"linattn-{study.name}", daemon=True)
        proc.start()
    except Exception:  # noqa: BLE001 - the study runs in the foreground instead, and fails there if it must
        return None
    return proc, t0, len(pts), elapsed


def _prepares(runnable, study_options, ctx) -> list:
    """``(prepare, points)`` of the timed studies that have a ``prepare`` (CPU warm-ups)."""
    found = []
    for _, study in runnable:
        if study.timing and study.prepare is not None and "cpu" in ctx.devices:
            with contextlib.suppress(Exception):  # the study reports its own failure in its turn
                found.append((study.prepare, study.points(ctx, **study_options.get(study.name, {}))))
    return found


def check_workers(workers, *, name: str = "workers"):
    """``workers`` as an int >= 1, or None (TypeError, ValueError naming ``name``; the CLI's check too)."""
    return check_int(name, workers, 1, allow_none=True)


def _check_studies(studies) -> list:
    """The studies ``run_report(studies=...)`` names, in order, each once (TypeError, ValueError)."""
    if studies is None:
        return [s for s in STUDIES if s.in_report]
    if isinstance(studies, str):
        studies = [studies]  # one study, not its letters
    if not isinstance(studies, (list, tuple)):
        raise TypeError(f"studies must be a list of study names (or one name), got {type(studies).__name__}")
    if not studies:
        raise ValueError("studies is empty: name at least one study, or pass None for the report's studies")
    selected = []
    for name in studies:
        if not isinstance(name, str):
            raise TypeError(f"studies must hold study names (str), got {name!r}")
        try:
            study = get_study(name)
        except KeyError as exc:
            raise ValueError(f"studies: {exc.args[0]}") from None
        if study not in selected:
            selected.append(study)
    return selected


def _check_points(selected, study_options, ctx) -> None:
    """Build the points of each study given options (that can run here): what its ``points`` or the sweep
    refuses (a bad value, an unknown map, a value given twice) is a ValueError or TypeError naming the study's
    options now, not a failed section of the report."""
    for study in selected:
        opts = study_options.get(study.name)
        if not opts or study.requires():
            continue
        try:
            grid_points(study.points(ctx, **opts))  # a duplicated point too (a value given twice)
        except TypeError as exc:
            raise TypeError(f"options[{study.name!r}]: {exc}") from exc
        except ValueError as exc:
            raise ValueError(f"options[{study.name!r}]: {exc}") from exc


def _check_options(options, selected=None) -> dict:
    """``options`` keyed by study name, each a dict of keywords its ``points`` accepts, for a study
    of ``selected`` (TypeError, ValueError otherwise)."""
    import inspect

    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"options must be a dict of study name -> dict of keywords, got {type(options).__name__}")
    out = {}
    for name, kw in options.items():
        try:
            study = get_study(name)
        except KeyError as exc:
            raise ValueError(f"options: {exc.args[0]}") from None
        if selected is not None and study not in selected:
            raise ValueError(f"options[{name!r}] sets options of the {study.name} study, which is not being run "
                             f"(studies: {', '.join(s.name for s in selected)})")
        if not isinstance(kw, dict):
            raise TypeError(f"options[{name!r}] must be a dict of keywords, got {type(kw).__name__}")
        params = inspect.signature(study.points).parameters
        accepted = [p for p, v in params.items() if v.kind == v.KEYWORD_ONLY]
        for key in kw:
            if key not in accepted:
                raise ValueError(f"options[{name!r}]: the {study.name} study takes no option {key!r}; "
                                 f"it takes {', '.join(accepted) or 'none'}")
        out[study.name] = dict(kw)
    return out


def _budget(study, profile):
    return (study.budget_s or {}).get(profile)


def _finished_keys(path: Path) -> frozenset:
    """The keys of the points finished (status ok) in the results file ``path`` (none when it is absent or
    unreadable: the sweep then says why)."""
    if not path.is_file():
        return frozenset()
    try:
        with warnings.catch_warnings():  # a damaged last line: the sweep warns about it
            warnings.simplefilter("ignore", RuntimeWarning)
            return frozenset(r.get("key") for r in load_results(path, status="ok"))
    except (OSError, ValueError):
        return frozenset()


def _points_text(new: int, reused: int) -> str:
    """"12 new points; 100 reused from an earlier run": what a resumed study's time counts."""
    return (f"{new} new point{'s' if new != 1 else ''}; {reused} reused from an earlier run")


def _write_markdown(result: ReportResult, ctx: Context, selected, timings, command) -> None:
    import datetime as dt

    now = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    cmd = command or "linattn_nb.studies.run_report(...)"
    lines = [
        "# linattn_nb report",
        "",
        f"Generated {now} by `{cmd}` in {result.elapsed_s:.0f} s; profile `{ctx.profile}`, "
        f"devices: {', '.join(ctx.devices)}; "
        + ("kernel cache off (every kernel compiles)" if result.cached_kernels is None else
           "kernel cache cold at the start (every kernel compiled first)" if result.cached_kernels == 0 else
           f"{result.cached_kernels} compiled kernels in the cache at the start") + ".",
        "",
    ]
    if result.problems:
        lines += [f"**{len(result.problems)} problem(s) found** -- see [Problems](#problems).", ""]
    lines += ["## Machine", "", markdown_table(["", ""], machine_info()), "", "## Contents", ""]
    for study in selected:
        if study.name in result.sections:
            r = result.sections[study.name]
            anchor = "".join(c for c in study.title.lower() if c.isalnum() or c in " -_").replace(" ", "-")
            lines.append(f"- [{study.title}](#{anchor})"
                         + (f" -- {r.summary}" if r.summary else ""))
    for name, _ in result.skipped:
        lines.append(f"- {get_study(name).title}: not run (see [Not run](#not-run))")
    lines.append("")
    ran = [s for s in selected if s.name in result.sections]
    if ran:
        lines += ["Time each study took (wall clock on this machine; a cold kernel cache compiles every kernel "
                  "first, and other work on the machine slows every study): "
                  + ", ".join(f"{s.name} {timings.get(s.name, 0):.0f} s"
                              + (f" ({_points_text(*result.reused[s.name])})" if s.name in result.reused else "")
                              for s in ran) + ".", ""]
    for study in selected:
        r = result.sections.get(study.name)
        if r is None:
            continue
        raw = f"{study.name}.jsonl"
        took = timings.get(study.name, 0)
        took_text = f"{took:.1f} s"
        if study.name in result.reused:
            new, reused = result.reused[study.name]
            took_text += f" for {new} new point{'s' if new != 1 else ''} ({reused} reused from an earlier run)"
        lines += [f"## {study.title}", "", r.markdown.strip(), "",
                  f"Raw results: [{raw}]({raw}); took {took_text}; "
                  f"rerun alone with `linattn {study.command}`.", ""]
    if result.skipped:
        lines += ["## Not run", ""]
        lines += [f"- **{get_study(name).title}** (`linattn {get_study(name).command}`): {reason}"
                  for name, reason in result.skipped]
        lines.append("")
    if result.problems:
        lines += ["## Problems", ""] + [f"- {p}" for p in result.problems] + [""]
    text = "\n".join(lines) + "\n"
    tmp = result.path.with_name(result.path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, result.path)


def command_line(argv) -> str:
    """``linattn`` plus the arguments, quoted for a shell."""
    return "linattn " + " ".join(shlex.quote(a) for a in argv)
