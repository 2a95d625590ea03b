"""The study abstraction (:class:`Study`), the list of studies, and shared rendering helpers.

Adding a study: one module that builds a :class:`Study` and calls :func:`register_study`.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

__all__ = [
    "Study",
    "Context",
    "Rendered",
    "STUDIES",
    "register_study",
    "get_study",
    "requires_modules",
    "PROFILES",
    "markdown_table",
    "fmt",
    "mean_std",
    "mean_ci",
    "CI_CAPTION",
    "pm",
    "fit_slope",
    "num",
    "seed_stat",
]

PROFILES = ("tiny", "quick", "full")
#: Series colours: the ten of matplotlib's default cycle, then ten darker ones.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#000000", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#e7ba52", "#5254a3",
           "#3182bd", "#31a354")
#: Series markers (filled, told apart at 4 pt).
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p", "d", "8")


@dataclass
class Context:
    """What a study knows about the run it is part of.

    Attributes
    ----------
    out : Path
        The report folder (plots go here).
    profile : {"tiny", "quick", "full"}
        A smoke test (the test suite), a first look (``linattn report --quick``), or the default.
    devices : tuple of str
        ``("cpu",)`` or ``("cpu", "cuda")`` (a real GPU is present).
    plots : bool
        False when matplotlib is not installed; studies then write tables only.
    """

    out: Path
    profile: str = "full"
    devices: tuple = ("cpu",)
    plots: bool = True
    _saved: list = field(default_factory=list)

    def pick(self, tiny, quick, full):
        """The value for this context's profile."""
        return {"tiny": tiny, "quick": quick, "full": full}[self.profile]

    def figure(self, *, ncols: int = 1, nrows: int = 1, width: float = 5.2, height: float = 3.6):
        """A matplotlib Figure with ``nrows`` x ``ncols`` axes (a flat list, row by row), drawn off-screen
        (no pyplot: a notebook's backend stays)."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
        return fig, list(fig.subplots(nrows, ncols, squeeze=False).ravel())

    @staticmethod
    def style(i: int) -> dict:
        """Colour, marker and line style of the i-th series (20 colours, 14 markers; the second ten dashed)."""
        return {"color": PALETTE[i % len(PALETTE)], "marker": MARKERS[i % len(MARKERS)],
                "linestyle": ("-", "--", ":")[(i // 10) % 3]}

    @staticmethod
    def legend_outside(fig, axes=None, *, title=None, fontsize="x-small", where="right"):
        """One legend for the figure outside every axes (``where``: "right" or "bottom"), each label once."""
        handles, labels = [], []
        for ax in (axes if axes is not None else fig.axes):
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels and not lab.startswith("_"):
                    handles.append(h)
                    labels.append(lab)
        if not handles:
            return None
        if where == "bottom":
            return fig.legend(handles, labels, loc="outside lower center", ncols=min(4, len(labels)),
                              fontsize=fontsize, title=title, title_fontsize=fontsize)
        return fig.legend(handles, labels, loc="outside right upper", fontsize=fontsize, title=title,
                          title_fontsize=fontsize)

    def savefig(self, fig, name: str, alt: str) -> str:
        """Save ``fig`` as ``<out>/<name>.png``; return the markdown that shows it.

        Log axes get plain labels at 1, 2, 5 x 10^k up to two decades, at 10^k beyond.
        """
        from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

        for ax in fig.axes:
            for axis, scale, lim in ((ax.xaxis, ax.get_xscale(), ax.get_xlim()),
                                     (ax.yaxis, ax.get_yscale(), ax.get_ylim())):
                if scale == "log" and isinstance(axis.get_major_locator(), FixedLocator):  # ticks chosen: plain labels
                    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                    axis.set_minor_locator(FixedLocator([]))
                elif scale == "log":
                    lo, hi = sorted(abs(v) for v in lim)
                    decades = math.log10(hi / lo) if lo > 0 and math.isfinite(hi / lo) else 99.0
                    subs = (1.0, 2.0, 5.0) if decades <= 2.0 else (1.0,)
                    axis.set_major_locator(LogLocator(base=10, subs=subs))
                    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                    axis.set_minor_formatter(NullFormatter())
        path = Path(self.out) / f"{name}.png"
        fig.savefig(path, dpi=110)
        self._saved.append(path)
        return f"![{alt}]({path.name})"


@dataclass
class Rendered:
    """A study's section of the report.

    Attributes
    ----------
    markdown : str
        The section body (without its heading).
    summary : str
        One line for the report's table of contents.
    problems : list of str
        What the results show to be wrong; the command exits non-zero when any study reports one.
    """

    markdown: str
    summary: str = ""
    problems: list = field(default_factory=list)


def _always_available():
    return None


def requires_modules(*modules: str, install: str | None = None) -> Callable[[], str | None]:
    """A ``requires`` for a study that needs optional third-party packages.

    Parameters
    ----------
    *modules : str
        Importable names, e.g. ``"matplotlib"``.
    install : str, optional
        How to install them, appended to the reason.

    Returns
    -------
    callable
        ``requires()``: None when every module imports, else one line naming the first that does
        not (the report lists the study under "Not run", its command exits 3).
    """
    names = tuple(modules)
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"requires_modules takes module names (non-empty strings), got {name!r}")

    def requires():
        for name in names:
            try:
                importlib.import_module(name)
            except ImportError:
                return (f"needs the optional package {name!r}, not installed here"
                        + (f" ({install})" if install else ""))
        return None

    return requires


@dataclass(frozen=True)
class Study:
    """A built-in study: four functions and a few names.

    Attributes
    ----------
    name : str
        Identifier; the results file is ``<name>.jsonl`` in the report folder, so a plain file name:
        non-empty, without a path separator, NUL or leading dot (ValueError otherwise).
    title : str
        Section heading.
    command : str
        The ``linattn`` subcommand that runs this study alone.
    help : str
        One line for ``linattn --help``.
    points : callable
        ``points(ctx) -> list[dict]``: the sweep grid for ``ctx.profile`` and ``ctx.devices``.
    run : callable
        ``run(**point) -> dict``: one point; module-level, so that worker processes can import it.  A
        point whose ``run`` returns anything else is recorded as failed (a TypeError naming the study).
    render : callable
        ``render(records, ctx) -> Rendered``: markdown (plots saved with :meth:`Context.savefig`)
        from the sweep's records, plus the problems the results show.
    requires : callable, optional
        ``requires() -> str | None``: None when the study can run here, else why not
        (:func:`requires_modules`); None: it always can.
    timing : bool
        The study measures time: its points run one at a time in the reporting process.
    budget_s : dict, optional
        Seconds the study is sized to take per profile on 2 shared cores (:attr:`ReportResult.over_budget`).
    background : bool
        Run in a spawned process beside the other untimed studies (docs/guide/studies.md).
    prepare : callable, optional
        A timed study's ``prepare(points)`` warm-up, run in the background process (errors ignored).
    in_report : bool
        Whether ``linattn report`` runs it by default; otherwise it runs only by name.
    figures : tuple of str
        The names (without ``.png``) of the plots ``render`` saves with :meth:`Context.savefig`: the
        files, besides ``<name>.jsonl`` and ``report.md``, that ``--force`` deletes before the study
        runs again (nothing else in the folder is touched).
    """

    name: str
    title: str
    command: str
    help: str
    points: Callable
    run: Callable
    render: Callable
    requires: Callable | None = None
    timing: bool = False
    budget_s: dict | None = None
    background: bool = False
    prepare: Callable | None = None
    in_report: bool = True
    figures: tuple = ()

    def __post_init__(self):
        _check_name(self.name)
        if self.requires is None:
            object.__setattr__(self, "requires", _always_available)
        figures = (self.figures,) if isinstance(self.figures, str) else tuple(self.figures)
        for name in figures:
            if not isinstance(name, str) or not name or name != Path(name).name or name.endswith(".png"):
                raise ValueError(f"study {self.name!r}: figures must be plot names such as 'rank' (no folder, "
                                 f"no .png), got {name!r}")
        object.__setattr__(self, "figures", figures)

    def __repr__(self) -> str:
        # the names, not the functions' reprs (addresses that change every run)
        budget = "" if self.budget_s is None else f", budget_s={self.budget_s!r}"
        return (f"Study(name={self.name!r}, command={self.command!r}, title={self.title!r}, "
                f"timing={self.timing!r}{budget}, points={_qualname(self.points)}, run={_qualname(self.run)})")


def _check_name(name) -> None:
    """TypeError or ValueError unless ``name`` can name a study's files (``<name>.jsonl`` in the report
    folder): a non-empty string with no path separator, NUL or leading dot (so not "." or "..")."""
    if not isinstance(name, str):
        raise TypeError(f"Study(name=...) must be a string, got {type(name).__name__} {name!r}")
    bad = next((c for c in ("/", "\\", "\0") if c in name), None)
    if not name or name.startswith(".") or bad is not None:
        why = "is empty" if not name else f"contains {bad!r}" if bad is not None else "starts with a dot"
        raise ValueError(f"Study(name={name!r}): the name {why}; it is the file name of the study's results "
                         "(<name>.jsonl in the report folder), so it must be a plain file name such as 'rank' "
                         "(no folder, no leading dot)")


def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


STUDIES: list[Study] = []


def register_study(study: Study, *, overwrite: bool = False) -> Study:
    """Add ``study`` to :data:`STUDIES` (the report runs them in this order).

    Raises
    ------
    ValueError
        A study of the same name or command is registered and ``overwrite`` is False.
    TypeError
        ``study`` is not a :class:`Study`.
    """
    if not isinstance(study, Study):
        raise TypeError(f"register_study takes a Study, got {type(study).__name__}")
    for i, s in enumerate(STUDIES):
        if s.name == study.name or s.command == study.command:
            if not overwrite:
                raise ValueError(f"a study named {s.name!r} (command {s.command!r}) is already registered")
            STUDIES[i] = study
            return study
    STUDIES.append(study)
    return study


def get_study(name: str) -> Study:
    """The registered study with this name or command."""
    for s in STUDIES:
        if name in (s.name, s.command):
            return s
    raise KeyError(f"no study {name!r}; registered: {', '.join(s.name for s in STUDIES)}")


def check_point_size(study: str, points) -> None:
    """Refuse points whose largest array would hold more than ``config.QUADRATIC_MAX_ELEMENTS`` numbers.

    A study's ``points`` calls it before any array is made, so that a ``dim`` or ``n`` too large for
    memory is refused up front (by ``run_report(options=...)`` and by the command line's problem options)
    instead of failing, or exhausting the memory, point by point.

    Parameters
    ----------
    study : str
        The study's name (starts the message).
    points : iterable of (str, list of (str, int, int))
        ``(setting, arrays)`` per kind of point: its options and values (e.g. ``"dim = 64, n = 600, map
        taylor2 (D_φ = 2145)"``) and the ``(what, rows, cols)`` of each array it forms.

    Raises
    ------
    ValueError
        Naming the setting of the point with the largest array, that array and the limit.
    """
    from .. import config

    limit = config.knob_int("QUADRATIC_MAX_ELEMENTS")
    sized = [(rows * cols, setting, what, rows, cols) for setting, arrays in points for what, rows, cols in arrays]
    if not sized:
        return
    _, setting, what, rows, cols = max(sized, key=lambda a: a[0])
    if rows * cols > limit:
        raise ValueError(f"{study} study: {setting}: a point forms the {what} = {rows} x {cols} array, more than "
                         f"config.QUADRATIC_MAX_ELEMENTS = {limit} numbers (LINATTN_QUADRATIC_MAX_ELEMENTS); "
                         "lower the dimension or the sizes")


# ---------------------------------------------------------------------------
# Formatting helpers
# ---------------------------------------------------------------------------
def split_failed(name: str, records) -> tuple:
    """``(ok, failed, problems, markdown_lines)`` of a study's records: the failed points as lines of the
    report's problem list and as the section's "Points that failed" list (empty when none failed)."""
    ok = [r for r in records if r.get("status") == "ok"]
    failed = [r for r in records if r.get("status") != "ok"]
    problems = [f"{name}: point {r['params']} failed: {r.get('error')}" for r in failed]
    lines = (["", "Points that failed:", ""] + [f"- `{r['params']}`: {r.get('error')}" for r in failed]
             if failed else [])
    return ok, failed, problems, lines


def fmt(x, digits: int = 3) -> str:
    """A number for a markdown table: ints as they are, floats in 3 significant digits."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        if x == 0:
            return "0"
        if 1e-3 <= abs(x) < 1e5:
            return f"{x:.{digits}g}"
        return f"{x:.{max(digits - 1, 0)}e}"
    return str(x)


def mean_std(x, axis=0):
    """Mean and sample standard deviation (ddof = 1; 0 for one sample) along ``axis``, ignoring NaN.

    Infinite values make the mean infinite (and the deviation NaN): they are not dropped.
    """
    import warnings

    import numpy as np

    x = np.asarray(x, dtype=float)
    with warnings.catch_warnings():  # all-NaN slices are NaN, silently
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(x, axis=axis)
        count = np.sum(~np.isnan(x), axis=axis)
        std = np.where(count > 1, np.nanstd(x, axis=axis, ddof=1) if x.shape[axis] > 1 else 0.0, 0.0)
    return mean, std


#: The uncertainty convention of every table and plot of the report, quoted in each caption.
CI_CAPTION = "mean ± half-width of the 95% Student-t interval over the seeds"


def mean_ci(x, axis=0, *, level: float = 0.95):
    """Mean and half-width of the Student-t confidence interval of the mean along ``axis``, ignoring NaN.

    The half-width is NaN for fewer than two samples (one seed gives no interval, not one of width 0: :func:`pm`
    shows it as "n/a"); an infinite value makes the mean infinite and the half-width NaN.

    Examples
    --------
    >>> m, h = mean_ci([1.0, 2.0, 3.0])
    >>> float(m), round(float(h), 3)      # t_{0.975, 2} = 4.303, sd = 1
    (2.0, 2.484)
    >>> m, h = mean_ci([3.0])
    >>> float(m), float(h)                # one sample: no interval
    (3.0, nan)
    """
    import warnings

    import numpy as np
    from scipy import stats

    x = np.asarray(x, dtype=float)
    mean, std = mean_std(x, axis=axis)
    count = np.sum(~np.isnan(x), axis=axis)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        t = stats.t.ppf(0.5 + level / 2, np.maximum(count - 1, 1))
        half = np.where(count > 1, t * std / np.sqrt(np.maximum(count, 1)), np.nan)
    return mean, half


def num(x) -> float:
    """A stored number as a float: None (a null in the results file) is NaN."""
    return float("nan") if x is None else float(x)


def seed_stat(x) -> tuple:
    """(mean, 95% Student-t half-width) of per-seed values; (inf, nan) if any is inf (-inf if those are all
    -inf; nan for both signs), (nan, nan) if none."""
    import numpy as np

    x = np.asarray(x, dtype=float)
    if x.size == 0:
        return float("nan"), float("nan")
    inf = x[np.isinf(x)]
    if inf.size:
        return (float(inf[0]) if (inf == inf[0]).all() else float("nan")), float("nan")
    m, h = mean_ci(x)
    return float(m), float(h)


def seeds_text(n: int) -> str:
    """``"1 seed"``, ``"3 seeds"``: the number of seeds a table or plot averages over."""
    return f"{n} seed" if n == 1 else f"{n} seeds"


def pm(mean, std, digits: int = 3) -> str:
    """``"mean ± spread"`` for a table cell: only the mean when the spread is 0 or round-off, or when the mean is
    not finite; ``"mean ± n/a"`` for a finite mean whose spread is NaN (:func:`mean_ci` of one seed: no interval).

    The studies pass the half-width of :func:`mean_ci` as the spread.

    Examples
    --------
    >>> pm(0.5, 0.0123), pm(0.5, 0.0), pm(0.5, float("nan")), pm(float("inf"), float("nan"))
    ('0.5 ± 0.012', '0.5', '0.5 ± n/a', 'inf')
    """
    mean, std = float(mean), float(std)
    if math.isfinite(mean) and math.isnan(std):
        return f"{fmt(mean, digits)} ± n/a"
    if not math.isfinite(mean) or not math.isfinite(std) or std <= 1e-9 * abs(mean):
        return fmt(mean, digits)
    return f"{fmt(mean, digits)} ± {fmt(std, 2)}"


def fit_slope(x, ys, *, level: float = 0.95) -> dict | None:
    """Slope of log y against log x, fitted per seed: ``x`` (P,), all > 0; ``ys`` (S, P), one row per seed.

    Returns ``slope`` (the mean of the per-seed slopes), ``lo``, ``hi`` (its Student-t interval over
    the seeds), ``seeds`` (a seed with a non-finite or non-positive value is left out) and ``level``;
    None when fewer than two seeds or two points are usable.
    """
    import numpy as np

    x = np.asarray(x, dtype=float)
    ys = np.atleast_2d(np.asarray(ys, dtype=float))
    if x.size < 2 or np.any(x <= 0):
        return None
    lx = np.log(x)
    slopes = []
    for y in ys:
        if np.all(np.isfinite(y)) and np.all(y > 0):
            slopes.append(float(np.polyfit(lx, np.log(y), 1)[0]))
    if len(slopes) < 2:
        return None
    mean, half = (float(v) for v in mean_ci(slopes, level=level))
    return {"slope": mean, "lo": mean - half, "hi": mean + half, "seeds": len(slopes), "level": level}


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence], *, align: str | None = None) -> str:
    """A GitHub-flavoured markdown table; ``align`` is one letter per column (l, r, c)."""
    headers = [str(h) for h in headers]
    body = [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    align = align or ("l" + "r" * (len(headers) - 1))
    sep = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep[a] for a in align) + " |"]
    for row in body:
        lines.append("| " + " | ".join(s.replace("|", "\\|") for s in row) + " |")
    return "\n".join(lines)
