"""Parameter sweeps that stream results to an append-only JSON Lines file, the sweep's only state:
rerunning the same call skips the points it already holds.  The file format and what the runner
guarantees: docs/guide/studies.md.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime as _dt
import functools
import hashlib
import itertools
import json
import math
import os
import pickle
import socket
import sys
import time
import traceback
import types
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from .._interrupt import check as check_interrupt, interrupts
from .._validate import check_int

__all__ = [
    "sweep",
    "grid_points",
    "point_key",
    "load_results",
    "rows",
    "to_json",
    "SweepError",
    "FORMAT_VERSION",
]

FORMAT_VERSION = 1
BACKENDS = ("local", "dask")
ERROR_MODES = ("raise", "record")
#: The statuses of a result record.
_STATUSES = ("ok", "error")


class SweepError(RuntimeError):
    """A point of a sweep failed (``errors="raise"``) or a worker kept dying.

    Attributes
    ----------
    params : dict
        The parameters of the point that failed.
    worker_traceback : str
        The traceback formatted where the point ran (possibly another process).
    """

    def __init__(self, message: str, params: dict | None = None, worker_traceback: str = ""):
        super().__init__(message)
        self.params = params
        self.worker_traceback = worker_traceback


# ---------------------------------------------------------------------------
# Parameters: validation, canonical form, keys
# ---------------------------------------------------------------------------
def _canonical_value(value, where: str):
    """Return ``value`` as plain JSON data (numpy scalars unwrapped) or raise TypeError."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}: parameters must be finite numbers")
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where} has a non-string key {k!r}; parameter dicts need string keys")
            out[k] = _canonical_value(v, f"{where}[{k!r}]")
        return out
    raise TypeError(
        f"{where} = {value!r} has type {type(value).__name__}; sweep parameters must be JSON "
        "values (None, bool, int, float, str, and lists / dicts of them) so that a point has a "
        "stable identity in the results file. Pass a name or a number and build the object inside fn."
    )


def _canonical_point(point, where: str) -> dict:
    if not isinstance(point, Mapping):
        raise TypeError(f"{where} must be a dict of parameters, got {type(point).__name__}")
    if not point:
        raise ValueError(f"{where} is an empty dict; a point needs at least one parameter")
    out = {}
    for name, value in point.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"{where}: parameter names must be non-empty strings, got {name!r}")
        out[name] = _canonical_value(value, f"{where}[{name!r}]")
    return out


def _canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def point_key(params: Mapping) -> str:
    """Stable identity of a point: SHA-1 of its canonical JSON, 16 hex digits.

    Parameters
    ----------
    params : dict
        The point's parameters (JSON values; numpy scalars unwrapped, tuples as lists).

    Returns
    -------
    str

    Examples
    --------
    >>> point_key({"n": 1, "method": "scan"}) == point_key({"method": "scan", "n": 1})
    True
    >>> point_key({"n": 1}) == point_key({"n": 2})
    False
    """
    canon = _canonical_point(params, "point")
    return hashlib.sha1(_canonical_json(canon).encode("ascii")).hexdigest()[:16]


def grid_points(grid) -> list[dict]:
    """Expand and validate a parameter grid.

    Parameters
    ----------
    grid : dict of lists, or list of dicts
        A dict gives the cartesian product (the last name varies fastest); a list of dicts gives
        exactly those points, in that order.

    Returns
    -------
    list of dict
        The points, in canonical form (numpy scalars unwrapped, tuples as lists).

    Raises
    ------
    TypeError
        ``grid`` is neither a dict nor a list, a dict value is not a list, a point is not a dict,
        or a parameter is not a JSON value.
    ValueError
        An empty grid or list of values, a non-finite float, or two equal points.  Points are equal when
        their canonical JSON is (:func:`point_key`): ``1`` and ``1.0`` are different points, as ``fn``
        receives different values (an ``int`` and a ``float``), and a results file keeps them apart.

    Examples
    --------
    >>> grid_points({"n": [1, 2], "m": ["a"]})
    [{'n': 1, 'm': 'a'}, {'n': 2, 'm': 'a'}]
    >>> grid_points([{"n": 1}, {"n": 5, "m": "b"}])
    [{'n': 1}, {'n': 5, 'm': 'b'}]
    """
    if isinstance(grid, Mapping):
        if not grid:
            raise ValueError("grid is an empty dict; give at least one parameter with a list of values")
        names, values = [], []
        for name, vals in grid.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"grid: parameter names must be non-empty strings, got {name!r}")
            if isinstance(vals, np.ndarray) and vals.ndim == 1:
                vals = vals.tolist()
            if isinstance(vals, range):
                vals = list(vals)
            if isinstance(vals, (set, frozenset)):
                try:
                    shown = sorted(vals)
                except TypeError:  # values that do not compare
                    shown = list(vals)
                raise TypeError(
                    f"grid[{name!r}] must be a list of values, got {type(vals).__name__} {vals!r}, whose order "
                    f"is not fixed; write the list {shown!r} (the values in the order to run them)"
                )
            if not isinstance(vals, (list, tuple)):
                raise TypeError(
                    f"grid[{name!r}] must be a list of values, got {type(vals).__name__} {vals!r}; "
                    f"write [{vals!r}] for a single value"
                )
            if len(vals) == 0:
                raise ValueError(f"grid[{name!r}] is an empty list: the grid would have no points")
            names.append(name)
            values.append([_canonical_value(v, f"grid[{name!r}][{i}]") for i, v in enumerate(vals)])
        points = [dict(zip(names, combo)) for combo in itertools.product(*values)]
    elif isinstance(grid, (list, tuple)):
        if len(grid) == 0:
            raise ValueError("grid is an empty list of points")
        points = [_canonical_point(p, f"grid[{i}]") for i, p in enumerate(grid)]
    else:
        raise TypeError(f"grid must be a dict of lists or a list of dicts, got {type(grid).__name__}")
    seen: dict[str, int] = {}
    for i, p in enumerate(points):
        key = _canonical_json(p)
        if key in seen:
            raise ValueError(
                f"grid has duplicate points: #{seen[key]} and #{i} are both {p}; "
                "each point must be unique (it is the point's identity in the results file)"
            )
        seen[key] = i
    return points


# ---------------------------------------------------------------------------
# Results: JSON conversion
# ---------------------------------------------------------------------------
def to_json(obj, where: str = "result"):
    """Convert a result to plain JSON data (what a sweep stores for a point).

    Parameters
    ----------
    obj : object
        JSON scalars, numpy scalars and numeric arrays, dataclasses, dicts with string keys, lists
        and tuples, nested in any way.
    where : str, default "result"
        How ``obj`` is named in error messages (nested values extend it).

    Returns
    -------
    object
        The same data as dicts, lists and Python scalars (non-finite floats stay floats).

    Raises
    ------
    TypeError
        A value of another type, a non-numeric array, or a non-string dict key (named by ``where``).

    Examples
    --------
    >>> to_json({"a": np.arange(3), "b": (np.float32(0.5), None)})
    {'a': [0, 1, 2], 'b': [0.5, None]}
    """
    if obj is None or isinstance(obj, (bool, str, int, float)):
        return obj
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf":
            raise TypeError(f"{where} is an array of dtype {obj.dtype}; only numeric arrays can be stored")
        return obj.tolist()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name), f"{where}.{f.name}") for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where} has a non-string key {k!r}; results must be JSON objects")
            out[k] = to_json(v, f"{where}[{k!r}]")
        return out
    if isinstance(obj, (list, tuple)):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(f"{where} has type {type(obj).__name__}, which cannot be stored as JSON")


#: Bound arguments of a ``functools.partial`` whose text is longer are named by a hash of that text.
_BOUND_TEXT_MAX = 80


def _bound_text(value) -> str:
    """A stable text for an argument bound by a ``functools.partial``: its JSON (:func:`to_json`, so an array is
    written in full, not summarised as its repr is) when it has one, else its ``repr``; a text longer than
    ``_BOUND_TEXT_MAX`` is replaced by its type and a hash of it."""
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type, functools.partial)):
        return function_name(value)  # not its repr, which holds its address
    try:
        text = json.dumps(to_json(value), sort_keys=True, separators=(",", ":"), allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > _BOUND_TEXT_MAX and not unstable_name(text):
        text = f"<{type(value).__name__} sha256:{hashlib.sha256(text.encode('utf-8', 'replace')).hexdigest()[:16]}>"
    return text


def function_name(fn) -> str:
    """The name of ``fn`` a results file's header records (``"fn"``), which a resumed sweep must match.

    ``module:qualname`` for a function, ``module:ClassName`` for a callable instance; a
    ``functools.partial`` adds its bound arguments, ``partial(module:f, 2, p=3)`` (see :func:`_bound_text`).
    The state of a closure or of a callable instance is not part of the name.
    """
    inner = getattr(fn, "func", None)  # functools.partial
    if inner is not None and not hasattr(fn, "__qualname__"):
        bound = [_bound_text(a) for a in getattr(fn, "args", ())]
        bound += [f"{k}={_bound_text(v)}" for k, v in sorted((getattr(fn, "keywords", None) or {}).items())]
        return f"partial({', '.join([function_name(inner), *bound])})"
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def unstable_name(fn_name: str) -> bool:
    """Whether the recorded name ``fn_name`` (:func:`function_name`) holds the repr of an object with no stable
    text (a memory address, ``" at 0x"``): another run of the same sweep names it differently."""
    return " at 0x" in fn_name


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------
# What runs on a worker
# ---------------------------------------------------------------------------
def _set_numba_threads(threads) -> None:
    """Limit Numba's threads for the calling thread: an int, None (leave as is) or ``{host: threads}`` (Dask).

    A host missing from the dict divides its cores by its task slots.
    """
    if isinstance(threads, dict):
        try:
            from distributed import get_worker
            from distributed.comm import get_address_host

            worker = get_worker()
            threads = threads.get(get_address_host(worker.address))
            if not threads:
                threads = max(1, usable_cores() // max(1, int(worker.state.nthreads)))
        except Exception:
            threads = None
    if not threads:
        return
    import numba

    numba.set_num_threads(max(1, min(int(threads), int(numba.config.NUMBA_NUM_THREADS))))


def _describe(exc: BaseException) -> str:
    """``"TypeName: message"``, even for an exception whose ``str`` fails."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the error itself
        message = "<str() of the exception failed>"
    return f"{type(exc).__name__}: {message}"


def _pickled_exception(exc: BaseException) -> bytes | None:
    """The exception as pickle bytes, or None when it cannot be pickled."""
    try:
        return pickle.dumps(exc)
    except Exception:  # noqa: BLE001
        return None


def _rebuilt_exception(exc) -> BaseException | None:
    """The exception shipped by a worker (pickle bytes), or None when it cannot be rebuilt here."""
    if exc is None or isinstance(exc, BaseException):
        return exc
    try:
        obj = pickle.loads(exc)
    except Exception:  # noqa: BLE001 - any failure to rebuild
        return None
    return obj if isinstance(obj, BaseException) else None


def _run_point(fn, params: dict, threads=None, *, keep_exception: bool = False) -> dict:
    """Run one point; an exception of ``fn`` is returned, not raised (pickled unless ``keep_exception``)."""
    _set_numba_threads(threads)
    t0 = time.perf_counter()
    try:
        result = to_json(fn(**params))
        payload = {"status": "ok", "result": result}
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        payload = {
            "status": "error",
            "error": _describe(exc),
            "traceback": traceback.format_exc(),
            "exception": exc if keep_exception else _pickled_exception(exc),
        }
    payload["elapsed_s"] = time.perf_counter() - t0
    payload["host"] = socket.gethostname()
    payload["pid"] = os.getpid()
    return payload


# ---------------------------------------------------------------------------
# The results file
# ---------------------------------------------------------------------------
def _parse_lines(data: bytes, path) -> tuple[list[dict], list[int], int, str | None]:
    """The records, their line numbers (from 1), the byte length of the valid prefix, and why a damaged
    tail was dropped (or None)."""
    records: list[dict] = []
    linenos: list[int] = []
    pos = 0
    n = len(data)
    lineno = 0
    while pos < n:
        nl = data.find(b"\n", pos)
        lineno += 1
        if nl < 0:
            return records, linenos, pos, (
                f"{path}: the last line ({n - pos} bytes, line {lineno}) has no newline: "
                "a write was interrupted; it is ignored and its point will run again"
            )
        raw = data[pos:nl]
        if raw.strip():
            what = "is not valid JSON"
            try:
                rec = json.loads(raw.decode("utf-8"))
                if not isinstance(rec, dict):
                    raise ValueError("not a JSON object")
                what = "is not a valid record"
                rec = _decode_nonfinite(rec)
            except (ValueError, UnicodeDecodeError) as exc:
                # Only whitespace after it (blank lines added after a crash): still the last record.
                if not data[nl + 1:].strip():
                    return records, linenos, pos, (
                        f"{path}: the last line (line {lineno}) {what} ({exc}); "
                        "it is ignored (with any blank lines after it) and its point will run again"
                    )
                raise ValueError(
                    f"{path}: line {lineno} {what} ({exc}) and is not the last line; "
                    "the file was damaged by something other than an interrupted sweep. Repair or "
                    "remove that line (or use a new results file)."
                ) from None
            records.append(rec)
            linenos.append(lineno)
        pos = nl + 1
    return records, linenos, pos, None


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _encode_nonfinite(record: dict) -> dict:
    """A copy of ``record`` with every NaN/inf float replaced by null and listed in ``"nonfinite"`` as
    ``[path, "nan" | "inf" | "-inf"]`` (docs/guide/studies.md)."""
    marks: list = []

    def walk(obj, path):
        if isinstance(obj, float) and not math.isfinite(obj):
            marks.append([path, "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")])
            return None
        if isinstance(obj, dict):
            return {k: walk(v, path + [k]) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [walk(v, path + [i]) for i, v in enumerate(obj)]
        return obj

    out = walk({k: v for k, v in record.items() if k != "nonfinite"}, [])
    if marks:
        out["nonfinite"] = marks
    return out


def _decode_nonfinite(record: dict) -> dict:
    """``record``, mutated, with the floats its ``"nonfinite"`` marker lists put back (ValueError if bad)."""
    marks = record.pop("nonfinite", None)
    if marks is None:
        return record
    if not isinstance(marks, list):
        raise ValueError(f"its 'nonfinite' marker is a {type(marks).__name__}, not a list")
    for mark in marks:
        if (not isinstance(mark, list) or len(mark) != 2 or not isinstance(mark[0], list) or not mark[0]
                or mark[1] not in _NONFINITE):
            raise ValueError(f"its 'nonfinite' marker has a bad entry {mark!r}; "
                             "expected [path, 'nan' | 'inf' | '-inf']")
        container = record
        path = mark[0]
        for depth, step in enumerate(path):
            in_dict = isinstance(container, dict) and isinstance(step, str) and step in container
            in_list = (isinstance(container, list) and isinstance(step, int) and not isinstance(step, bool)
                       and 0 <= step < len(container))
            if not (in_dict or in_list):
                raise ValueError(f"its 'nonfinite' marker names {path!r}, which is not in the record")
            if depth == len(path) - 1:
                if container[step] is not None:
                    raise ValueError(f"its 'nonfinite' marker names {path!r}, which is not null")
                container[step] = _NONFINITE[mark[1]]
            else:
                container = container[step]
    return record


def _untrusted(rec: dict) -> str | None:
    """Why a result record cannot be used (None when it can): a missing or wrong key, bad params, an
    unknown status, an ok record without its result or an error record without its error."""
    key = rec.get("key")
    if not isinstance(key, str):
        return "has no 'key'" if key is None else f"has a 'key' that is not a string ({key!r})"
    params = rec.get("params")
    try:
        expected = point_key(params)
    except (TypeError, ValueError) as exc:
        return f"has no valid 'params' ({exc})"
    if expected != key:
        return (f"has params {params} whose key is {expected}, not its stored key {key}: the line was "
                "changed after the sweep wrote it")
    status = rec.get("status")
    if status not in _STATUSES:
        return f"has status {status!r}, not one of {', '.join(map(repr, _STATUSES))}"
    if status == "ok" and "result" not in rec:
        return "has status 'ok' but no 'result'"
    if status == "error" and "error" not in rec:
        return "has status 'error' but no 'error'"
    return None


def _latest(records: Iterable[dict], linenos: Iterable[int] | None = None,
            path=None) -> tuple[dict[str, dict], list[str]]:
    """The last record per key, an ``ok`` record never replaced by a later error, and one message per
    result record left out as untrusted (:func:`_untrusted`), naming ``path`` and the record's line."""
    latest: dict[str, dict] = {}
    problems: list[str] = []
    records = list(records)
    linenos = list(linenos) if linenos is not None else [None] * len(records)
    for rec, lineno in zip(records, linenos):
        if rec.get("type") != "result":
            continue
        why = _untrusted(rec)
        if why is not None:
            where = f"{path}: " if path is not None else ""
            where += f"line {lineno}: " if lineno is not None else ""
            problems.append(f"{where}the result record {why}; it is ignored, and its point runs again unless "
                            "another line of the file records it")
            continue
        prev = latest.get(rec["key"])
        if prev is not None and prev.get("status") == "ok" and rec.get("status") != "ok":
            continue
        latest[rec["key"]] = rec
    return latest, problems


def load_results(path, *, status: str | None = None) -> list[dict]:
    """Read the records of a sweep file (one per point, in file order).

    A damaged last line is ignored (with a warning), and so is a result record that cannot be
    trusted (with a warning naming its line): one whose ``key`` is not :func:`point_key` of its
    ``params``, with an unknown ``status``, an ``ok`` record without its ``result`` or an ``error``
    record without its ``error`` (a sweep resumed on the file runs such a point again).  Of a point
    recorded more than once, the successful record wins, else the latest.

    Parameters
    ----------
    path : str or Path
    status : {"ok", "error"}, optional
        Keep only records with this status.

    Returns
    -------
    list of dict

    Raises
    ------
    FileNotFoundError
    ValueError
        A damaged line before the last one, or an unknown ``status``.

    Examples
    --------
    >>> import tempfile, os
    >>> def square(x):
    ...     return {"y": x * x}
    >>> path = os.path.join(tempfile.mkdtemp(), "demo.jsonl")
    >>> _ = sweep(square, {"x": [1, 2, 3]}, out=path, progress=False)
    >>> [(r["params"]["x"], r["result"]["y"]) for r in load_results(path)]
    [(1, 1), (2, 4), (3, 9)]
    """
    if status is not None and status not in _STATUSES:
        raise ValueError(f"status must be None or one of {', '.join(map(repr, _STATUSES))}, got {status!r}")
    path = Path(path)
    data = path.read_bytes()
    records, linenos, _, problem = _parse_lines(data, path)
    if problem:
        warnings.warn(problem, RuntimeWarning, stacklevel=2)
    latest, untrusted = _latest(records, linenos, path)
    for message in untrusted:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    out = list(latest.values())
    if status is not None:
        out = [r for r in out if r.get("status") == status]
    return out


def rows(records: Iterable[dict]) -> list[dict]:
    """Flatten ok records to ``{**params, **result}`` dicts (for tables and plots).

    Records as :func:`load_results` returns them or as a plain JSON parser reads them (non-finite
    floats listed in ``"nonfinite"`` come back; the records passed in are not changed).

    Examples
    --------
    >>> rows([{"status": "ok", "params": {"n": 2}, "result": {"t": 0.5}}])
    [{'n': 2, 't': 0.5}]
    """
    out = []
    for rec in records:
        if rec.get("status") != "ok":
            continue
        if "nonfinite" in rec:  # a record read from the file by a plain JSON parser
            rec = _decode_nonfinite(copy.deepcopy(rec))
        res = rec.get("result")
        row = dict(rec.get("params", {}))
        if isinstance(res, dict):
            row.update(res)
        else:
            row["result"] = res
        out.append(row)
    return out


#: How every results file starts: its header line (``_ResultsFile`` writes it first, in one write).
_HEADER_START = b'{"type":"header"'


def _check_is_results_file(data: bytes, path) -> None:
    """ValueError unless ``data`` (a file's bytes) is empty or a sweep's results: its first line is the
    sweep header, or the torn start of one (a sweep interrupted while writing it).  Nothing else is
    repaired or appended to: a file with other content is left untouched."""
    first = data.lstrip()
    if not first:
        return
    nl = first.find(b"\n")
    line = (first if nl < 0 else first[:nl]).strip()
    if nl < 0 and (line.startswith(_HEADER_START) or _HEADER_START.startswith(line)):
        return  # a header cut off by a crash: dropped below as a damaged last line
    try:
        rec = json.loads(line.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        rec = None
    if isinstance(rec, dict) and rec.get("type") == "header":
        return
    raise ValueError(
        f"out={str(path)!r} is not a sweep results file (its first line is not a sweep header); "
        "it was left untouched: give a new file, or one an earlier sweep wrote"
    )


def version_problem(header: Mapping, path) -> str | None:
    """Why the results file ``path``, whose header is ``header``, cannot be resumed by this linattn_nb (None when
    it can): its ``"linattn_nb"`` field names another version, whose results may differ from what this one
    computes.  A header without that field (written by hand: every sweep records its version) is accepted.

    The message names the file and both versions; the caller adds what to do (a sweep's options, or the
    command line's).
    """
    from .. import __version__

    written = header.get("linattn_nb")
    if written is None or written == __version__:
        return None
    return (f"{path} was written by linattn_nb {written}, not by the installed linattn_nb {__version__}; its "
            "points are not reused by another version, whose results may differ")


def header_problem(header: Mapping, path, fn_name: str) -> str | None:
    """Why a sweep of the function named ``fn_name`` cannot resume the results file ``path``, whose header is
    ``header`` (None when it can, the version aside: :func:`version_problem`): it holds another function's
    results, or a format this version does not read."""
    if header.get("fn") != fn_name:
        return (f"{path} holds results of {header.get('fn')!r}, not of {fn_name!r}; use another results file for "
                "another function")
    if header.get("format") != FORMAT_VERSION:
        return f"{path} has format {header.get('format')!r}; this version reads format {FORMAT_VERSION}"
    return None


def read_header(path) -> dict | None:
    """The header of the results file ``path``: its first line as a dict, or None when the file is absent,
    empty, or does not start with a header line (the sweep itself then says why)."""
    try:
        with open(path, "rb") as fh:
            line = fh.readline()
    except OSError:
        return None
    try:
        rec = json.loads(line.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) and rec.get("type") == "header" else None


class _ResultsFile:
    """The append-only JSONL file, locked, repaired, written by this process only."""

    def __init__(self, path: Path, fn_name: str, *, resume: bool, fsync: bool):
        self.path = path
        self.fsync = fsync
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(path, "a+b")
        try:
            self._lock()
            self.fh.seek(0)
            data = self.fh.read()
            _check_is_results_file(data, path)
            records, linenos, valid, problem = _parse_lines(data, path)
            # every refusal before the file is changed (the damaged last line is cut off only from a file used)
            header = next((r for r in records if r.get("type") == "header"), None)
            if header is not None:
                refusal = header_problem(header, path, fn_name)
                if refusal:
                    raise ValueError(refusal)
                refusal = version_problem(header, path)
                if refusal:
                    raise ValueError(f"{refusal}: give a new results file (out=...), or delete this one to run "
                                     "the sweep again from the start (resume=False refuses a file that holds results)")
                if unstable_name(fn_name):
                    raise ValueError(
                        f"{path} cannot be resumed by {fn_name}: a bound argument has no stable text (its repr "
                        "holds a memory address), so the file cannot be told to hold this function's results; "
                        "give a new results file (out=...), or bind arguments with a stable repr")
            held = sum(1 for r in records if r.get("type") == "result")
            if held and not resume:
                raise FileExistsError(
                    f"{path} already holds {held} result record{'' if held == 1 else 's'}; pass resume=True to "
                    "continue that sweep, or choose another file (nothing was changed)"
                )
            if problem:
                warnings.warn(problem, RuntimeWarning, stacklevel=3)
                self.fh.truncate(valid)
                self.fh.flush()
            self.latest, untrusted = _latest(records, linenos, path)
            for message in untrusted:
                warnings.warn(message, RuntimeWarning, stacklevel=3)
            if header is None:
                from .. import __version__

                self.write({"type": "header", "format": FORMAT_VERSION, "fn": fn_name,
                            "created": _now(), "linattn_nb": __version__,
                            "python": sys.version.split()[0], "host": socket.gethostname()})
        except BaseException:
            self.fh.close()
            raise

    def _lock(self):
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no advisory lock
            return
        try:
            fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise RuntimeError(
                f"{self.path} is being written by another sweep (it is locked); "
                "wait for it to finish or use another results file"
            ) from None

    def write(self, record: dict) -> None:
        try:
            line = json.dumps(record, separators=(",", ":"), allow_nan=False)
        except ValueError:  # NaN or inf somewhere: null plus a "nonfinite" marker (strict JSON)
            line = json.dumps(_encode_nonfinite(record), separators=(",", ":"), allow_nan=False)
        line += "\n"
        self.fh.seek(0, os.SEEK_END)
        self.fh.write(line.encode("utf-8"))  # one write per line: a crash cuts at most this line
        self.fh.flush()
        if self.fsync:
            os.fsync(self.fh.fileno())

    def close(self):
        if self.fh.closed:
            return
        with contextlib.suppress(OSError):
            self.fh.flush()
            os.fsync(self.fh.fileno())
        self.fh.close()  # closing releases the flock


# ---------------------------------------------------------------------------
# sweep
# ---------------------------------------------------------------------------
def usable_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def sweep(
    fn: Callable[..., Any],
    grid,
    *,
    out,
    backend: str = "local",
    scheduler=None,
    resume: bool = True,
    progress: bool = True,
    workers: int | None = None,
    numba_threads: int | None = None,
    errors: str = "raise",
    max_retries: int = 2,
    fsync: bool = False,
) -> list[dict]:
    """Run ``fn(**point)`` over a grid, streaming results to a JSON Lines file.

    Parameters
    ----------
    fn : callable
        Called as ``fn(**point)``; returns what :func:`to_json` stores.  With worker processes it
        must be importable by them (Dask also ships lambdas and closures).  The results file records
        its name (:func:`function_name`): ``module:qualname``, and for a ``functools.partial`` its bound
        arguments too, so that a partial with other bound arguments does not resume the file.  The state
        of a closure or of a callable instance is not part of the name: give each variant its own
        ``out``.  A partial binding an object whose repr holds a memory address cannot resume a file.
    grid : dict of lists or list of dicts
        See :func:`grid_points`.
    out : str or Path
        The results file (JSON Lines, appended to; created with its folder).
    backend : {"local", "dask"}
        ``"local"``: in this process, or a pool of ``workers`` spawned processes.  ``"dask"``: on a
        dask.distributed cluster (extra ``dask``).
    scheduler : str, distributed.Client or cluster, optional
        With ``backend="dask"``: an address, a Client or a cluster; None starts a LocalCluster of
        ``workers`` processes (default 2) on loopback.
    resume : bool, default True
        Skip points already finished in ``out``; with False an ``out`` holding a result record is an
        error (one holding only its header, as after a first point that failed, is used).
    progress : bool, default True
        A tqdm progress bar on stderr when it is a terminal.
    workers : int, optional
        Worker processes (see ``backend``).
    numba_threads : int, optional
        Numba threads per worker; default: unchanged in this process, else a host's cores divided by
        its task slots.
    errors : {"raise", "record"}
        An exception in ``fn``: ``"raise"`` stops the sweep with :class:`SweepError`; ``"record"``
        writes an error record (run again on resume) and goes on.
    max_retries : int, default 2
        Retries of a point whose worker process dies (on Dask the scheduler's own setting applies).
    fsync : bool, default False
        ``os.fsync`` after every line (the file is always flushed per line, fsynced at the end).

    Returns
    -------
    list of dict
        One record per grid point, in grid order (fields: docs/guide/studies.md).

    Raises
    ------
    TypeError, ValueError
        Bad grid (see :func:`grid_points`) or arguments.
    ValueError
        ``out`` holds results of another function, another file format or another linattn_nb version
        (never reused: give a new ``out``, or delete that file to start again), or ``fn`` is a partial
        that cannot be identified (above) and ``out`` exists.  A refused file is left untouched.
    FileExistsError
        ``resume=False`` and ``out`` already holds a result record.
    RuntimeError
        ``out`` is being written by another sweep.
    SweepError
        A point failed with ``errors="raise"``, or its worker died more than ``max_retries`` times.

    Examples
    --------
    >>> import os, tempfile
    >>> def power(x, p):
    ...     return {"y": x ** p}
    >>> path = os.path.join(tempfile.mkdtemp(), "powers.jsonl")
    >>> recs = sweep(power, {"x": [2, 3], "p": [2]}, out=path, progress=False)
    >>> [r["result"]["y"] for r in recs]
    [4, 9]
    >>> recs = sweep(power, {"x": [2, 3, 4], "p": [2]}, out=path, progress=False)  # resumes
    >>> [r["result"]["y"] for r in recs]
    [4, 9, 16]
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if errors not in ERROR_MODES:
        raise ValueError(f"errors must be 'raise' or 'record', got {errors!r}")
    if scheduler is not None and backend != "dask":
        raise ValueError(f"scheduler= is given but backend={backend!r}; pass backend='dask' to use a Dask cluster")
    if scheduler is not None and workers is not None:
        raise ValueError("workers= sizes the embedded LocalCluster or the local pool; an existing "
                         "scheduler= brings its own workers: pass one or the other")
    if out is None or not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"out must be a path (str or os.PathLike), got {type(out).__name__}")
    workers = check_int("workers", workers, 1, allow_none=True)
    numba_threads = check_int("numba_threads", numba_threads, 1, allow_none=True)
    max_retries = check_int("max_retries", max_retries, 0)
    for flag_name, flag in (("resume", resume), ("progress", progress), ("fsync", fsync)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{flag_name} must be a bool, got {flag!r}")
    points = grid_points(grid)
    keys = [point_key(p) for p in points]
    path = Path(out)
    if path.is_dir():
        raise ValueError(f"out={str(path)!r} is a directory; give a file path such as {str(path / 'results.jsonl')!r}")
    if backend == "local" and workers and workers > 1:
        try:
            pickle.dumps(fn)
        except Exception as exc:
            raise TypeError(
                f"fn {function_name(fn)} cannot be sent to worker processes ({exc}); define it at module "
                "level in an importable module, or run with workers=None (in this process)"
            ) from None

    rf = _ResultsFile(path, function_name(fn), resume=bool(resume), fsync=bool(fsync))
    try:
        done = {k for k, r in rf.latest.items() if r.get("status") == "ok"}
        todo = [(k, p) for k, p in zip(keys, points) if k not in done]
        bar = _progress_bar(bool(progress), total=len(points), initial=len(points) - len(todo), fn=fn)
        state = _RunState(rf, done, bar, errors)
        try:
            with interrupts():
                if todo:
                    if backend == "dask":
                        _run_dask(fn, todo, state, scheduler=scheduler, workers=workers,
                                  numba_threads=numba_threads)
                    elif workers and workers > 1:
                        _run_pool(fn, todo, state, workers=workers, max_retries=max_retries,
                                  numba_threads=numba_threads or max(1, usable_cores() // workers))
                    else:
                        for key, params in todo:
                            state.finish(key, params,
                                         _run_point(fn, params, numba_threads, keep_exception=True))
                            check_interrupt()  # a Ctrl-C swallowed inside the point (see _interrupt)
        finally:
            if bar is not None:
                bar.close()
        latest = rf.latest
    finally:
        rf.close()
    return [latest[k] for k in keys if k in latest]


def _progress_bar(progress: bool, *, total: int, initial: int, fn):
    if not progress:
        return None
    from tqdm.auto import tqdm

    name = getattr(fn, "__name__", "sweep")
    # disable=None: tqdm shows the bar only when stderr is a terminal.
    return tqdm(total=total, initial=initial, desc=name, unit="pt", disable=None, file=sys.stderr,
                dynamic_ncols=True)


class _RunState:
    """What the parent knows while a sweep runs: the file, finished keys, the bar."""

    def __init__(self, rf: _ResultsFile, done: set, bar, errors: str):
        self.rf = rf
        self.done = done
        self.bar = bar
        self.errors = errors

    def finish(self, key: str, params: dict, payload: dict) -> None:
        if key in self.done:  # a duplicate delivery (never expected): write nothing twice
            return
        exc = _rebuilt_exception(payload.pop("exception", None))
        record = {"type": "result", "key": key, "params": params, **payload, "finished": _now()}
        ok = payload["status"] == "ok"
        if not ok and self.errors == "raise":
            raise SweepError(
                f"point {params} failed: {payload['error']}\n\nTraceback where it ran "
                f"(host {payload.get('host')}, pid {payload.get('pid')}):\n{payload.get('traceback', '')}",
                params, payload.get("traceback", ""),
            ) from exc
        self.rf.write(record)
        self.rf.latest[key] = record
        if ok:
            self.done.add(key)
        if self.bar is not None:
            self.bar.update(1)


def _worker_died(attempts: int) -> dict:
    return {
        "status": "error",
        "error": f"WorkerDied: the worker process running this point died {attempts} time(s) "
                 "(killed, out of memory, or crashed)",
        "traceback": "",
        "elapsed_s": float("nan"),
        "host": socket.gethostname(),
        "pid": None,
    }


def _run_pool(fn, todo, state: _RunState, *, workers: int, max_retries: int, numba_threads: int):
    """A spawned process pool with at most ``workers`` points in flight.

    A dying worker breaks the whole pool: the points in flight are retried, each alone in a fresh
    pool, so only the point that kills its worker uses up its ``max_retries``.
    """
    import multiprocessing
    from collections import deque
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    ctx = multiprocessing.get_context("spawn")
    attempts = {key: 0 for key, _ in todo}
    queue = deque(todo)
    while queue:
        pool = ProcessPoolExecutor(max_workers=min(workers, len(queue)), mp_context=ctx)
        inflight: dict = {}
        broken = False
        retry = []
        try:
            while queue or inflight:
                while queue and not broken and len(inflight) < workers:
                    key, params = queue[0]
                    suspect = attempts[key] > 0
                    if inflight and (suspect or any(attempts[k] > 0 for k, _ in inflight.values())):
                        break  # a suspect runs alone
                    queue.popleft()
                    inflight[pool.submit(_run_point, fn, params, numba_threads)] = (key, params)
                if not inflight:
                    break
                finished, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
                for fut in finished:
                    key, params = inflight.pop(fut)
                    try:
                        payload = fut.result()
                    except BrokenProcessPool:
                        broken = True
                        attempts[key] += 1
                        if attempts[key] > max_retries:
                            state.finish(key, params, _worker_died(attempts[key]))
                        else:
                            retry.append((key, params))
                        continue
                    state.finish(key, params, payload)
                if broken and not inflight:
                    break
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        queue.extendleft(reversed(retry))


def _dask_threads_per_worker(client) -> dict:
    """Numba threads per task on each host of an existing cluster: host cores / task slots on the host."""
    info = client.scheduler_info(n_workers=-1) if _accepts_n_workers(client) else client.scheduler_info()
    wk = info.get("workers", {})
    cores = client.run(usable_cores)
    slots: dict[str, int] = {}
    host_cores: dict[str, int] = {}
    for addr, w in wk.items():
        host = w.get("host") or addr.rsplit(":", 1)[0]
        slots[host] = slots.get(host, 0) + int(w.get("nthreads", 1) or 1)
        host_cores[host] = int(cores.get(addr, host_cores.get(host, 1)))
    return {host: max(1, host_cores[host] // max(1, n)) for host, n in slots.items()}


def _accepts_n_workers(client) -> bool:
    import inspect

    try:
        return "n_workers" in inspect.signature(client.scheduler_info).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def _run_dask(fn, todo, state: _RunState, *, scheduler, workers, numba_threads):
    try:
        import distributed
    except ImportError as exc:
        raise ImportError(
            "backend='dask' needs dask.distributed: pip install 'linattn_nb[dask]'"
        ) from exc
    from distributed import Client, LocalCluster, as_completed

    cluster = None
    own_client = True
    if scheduler is None:
        n = workers or 2
        threads = numba_threads or max(1, usable_cores() // n)
        import logging

        # Not env={"NUMBA_NUM_THREADS": ...}: a spawned worker imports the caller's __main__ (and so
        # Numba, at its default pool size) before that environment applies, and Numba then refuses
        # the first compile ("Cannot set NUMBA_NUM_THREADS ... once the threads have been launched").
        # Each point sets its threads with numba.set_num_threads instead (_run_point).
        cluster = LocalCluster(
            n_workers=n, threads_per_worker=1, processes=True, host="127.0.0.1",
            dashboard_address=None, silence_logs=logging.ERROR,
        )
        client = Client(cluster)
        per_worker = threads
    else:
        if isinstance(scheduler, Client):
            client, own_client = scheduler, False
        elif isinstance(scheduler, str):
            client = Client(scheduler, timeout="30s")
        elif hasattr(scheduler, "scheduler_address"):
            client = Client(scheduler)
        else:
            raise TypeError(
                f"scheduler must be an address string, a distributed.Client or a cluster, got {type(scheduler).__name__}"
            )
        per_worker = numba_threads or _dask_threads_per_worker(client)
    token = uuid.uuid4().hex[:8]
    futures = {}
    try:
        for key, params in todo:
            fut = client.submit(_run_point, fn, params, per_worker, key=f"linattn-sweep-{key}-{token}", pure=False)
            futures[fut] = (key, params)
        for fut in as_completed(list(futures)):
            key, params = futures[fut]
            try:
                payload = fut.result()
            except distributed.scheduler.KilledWorker as exc:
                payload = _worker_died(0)
                payload["error"] = f"KilledWorker: {exc}"
            except Exception as exc:  # noqa: BLE001 - infrastructure failure for this point
                payload = {"status": "error", "error": _describe(exc),
                           "traceback": traceback.format_exc(), "elapsed_s": float("nan"),
                           "host": None, "pid": None, "exception": exc}
            state.finish(key, params, payload)
    finally:
        pending = [f for f in futures if not f.done()]
        if pending:
            with contextlib.suppress(Exception):  # the cluster may be gone already
                client.cancel(pending)
        if own_client:
            client.close()
        if cluster is not None:
            cluster.close()
