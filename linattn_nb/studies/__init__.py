"""Studies at scale: the sweep runner (:func:`sweep`), the built-in studies (:data:`STUDIES`,
:func:`register_study`) and the report (:func:`run_report`, ``linattn report``); docs/guide/studies.md.

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
