"""Studies at scale: the sweep runner, the built-in studies and the report.

* :func:`sweep` runs ``fn(**point)`` over a parameter grid, locally or on a
  Dask cluster, streaming results to an append-only JSON Lines file that a
  rerun resumes from.
* :data:`STUDIES` lists the built-in studies (correctness self-check,
  throughput, approximation error, rank, recall capacity, memory horizon,
  update rules against the capacity floor, learned against fixed feature maps);
  :func:`register_study` adds one.
* :func:`run_report` runs them and writes ``report.md`` with tables and plots
  (the ``linattn report`` command).

Importing this package imports neither Dask nor matplotlib and compiles nothing.
"""
from ._study import (PROFILES, STUDIES, Context, Rendered, Study, get_study, markdown_table, register_study,
                     requires_modules)
from .sweep import SweepError, grid_points, load_results, point_key, rows, sweep
from . import _builtin  # noqa: F401  (registers the built-in studies)
from .report import ReportResult, run_report

__all__ = [
    "sweep",
    "grid_points",
    "point_key",
    "load_results",
    "rows",
    "SweepError",
    "Study",
    "Context",
    "Rendered",
    "STUDIES",
    "PROFILES",
    "register_study",
    "get_study",
    "requires_modules",
    "markdown_table",
    "run_report",
    "ReportResult",
]
