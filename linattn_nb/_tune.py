"""The machine line and the calibration of ``method="auto"`` on the CPU.

Times the scan against the chunked kernel on this machine, per update rule and dtype, and stores the
rows ``method="auto"`` follows in the kernel cache folder, keyed by the CPU, the BLAS and the
versions.  Design and measurements: docs/tuning.md.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import threading
import time

from . import config

#: Version of the calibration file's layout; files of another version are ignored.
FORMAT = 1

#: Calibration files are ``<cache folder>/auto-tune-<hash of the key>.json``.
FILE_PREFIX = "auto-tune-"

#: The causal CPU rules calibrated by default (those of them with both a scan
#: and a chunked kernel registered).
RULES = ("additive", "decay", "gate", "delta", "gated_delta")

#: The working dtypes calibrated (float16 inputs run in float32).
DTYPES = ("float32", "float64")

#: Environment variables that change which kernels the BLAS runs; their values
#: are part of the calibration key and of the machine line.
BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE",
            "MKL_CBWR")

#: Sizes of a full calibration: ``batch`` sequences (B*H) of each length N in
#: ``sizes``, D = M = ``dim``, ``rounds`` interleaved rounds per length; the chunked
#: kernel's (chunk, row block) pair is chosen first, at N = ``chunk_n``.
FULL = {"batch": 16, "dim": 64, "rounds": 7, "chunk_n": 1024,
        "sizes": (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)}
#: A smoke-test calibration (``linattn tune --quick``): seconds, not meant to be kept.
QUICK = {"batch": 2, "dim": 16, "rounds": 3, "chunk_n": 32, "sizes": (1, 4, 16, 64)}

#: The (chunk, row block) pairs timed for the chunked kernel (with the pair of ``config.CPU_CHUNK_TABLE``).
#: Row blocks of 8 suit OpenBLAS's AVX-512 small-matrix kernels; its AVX2 kernels run whole chunks of 48
#: about 1.45x faster than (32, 8) (docs/tuning.md, "The chunk size").
CHUNK_CANDIDATES = ((16, 16), (24, 8), (32, 8), (32, 16), (32, 32), (48, 16), (48, 48), (64, 32), (64, 64))

#: The (chunk, row block) pairs timed for the fused normalised backward (with ``config``'s pair, 48 and 8), for the
#: rules whose gradient runs it with row blocks (:func:`grad_tuned`).  On the AVX2 host whole chunks of 48 ran
#: ``linear_attention_vjp`` 1.15-1.3x faster than (48, 8) (docs/tuning.md, "The backward's chunk size").
GRAD_CANDIDATES = ((32, 8), (32, 16), (32, 32), (48, 16), (48, 48), (64, 16), (64, 64))

#: A pair replaces the table's only where its median time is below this fraction of the table pair's (a pair
#: within noise of the constants leaves them).
CHUNK_MARGIN = 0.97

MODES = ("off", "load", "first-use")

# OpenBLAS core names (lower case) by the widest vector extension their kernels use.
_OPENBLAS_AVX512 = {"skylakex", "cooperlake", "sapphirerapids"}
_OPENBLAS_AVX2 = {"haswell", "zen", "skylake", "excavator"}
_OPENBLAS_OLD = {"sandybridge", "nehalem", "core2", "penryn", "dunnington", "prescott", "atom", "katmai",
                 "coppermine", "northwood", "banias", "opteron", "opteron_sse3", "barcelona", "bobcat",
                 "bulldozer", "piledriver", "steamroller", "nano", "generic"}

_lock = threading.RLock()
#: How many calibrations run in this process now (a count, not a flag: two overlapping ones from two threads
#: each end by taking one off, whichever ends first).  While any runs, ``method="auto"`` times nothing more.
_busy = 0
#: The calibration of this process: None before the first look, False when none applies.
_current = None
_key_memo = None
#: (rule, dtype) entries whose first-use timing raised: not tried again in this process.
_failed = set()
#: ``pair``: the (chunk, row block) every CPU chunked call of this thread runs while the calibration times it;
#: ``grad``: the same for the fused normalised backward.
_trial = threading.local()


# ---------------------------------------------------------------------------
# The machine: CPU, BLAS, environment
# ---------------------------------------------------------------------------
def _cpuinfo(*prefixes: str) -> str | None:
    """The value of the first ``/proc/cpuinfo`` line starting with one of ``prefixes`` (None: none)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith(prefixes):
                return line.split(":", 1)[1]
    return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    name = _cpuinfo("model name", "Model name")
    if name is not None:
        return name.strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags() -> set | None:
    """The CPU's feature flags from ``/proc/cpuinfo`` (None where there is none)."""
    flags = _cpuinfo("flags")
    return None if flags is None else set(flags.split())


def _vector_level(flags) -> str | None:
    if flags is None:
        return None
    if "avx512f" in flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    if "avx" in flags:
        return "AVX"
    return "SSE"


def blas_libraries() -> list:
    """The BLAS libraries loaded (SciPy's, which the kernels' ``np.dot`` calls, and NumPy's).

    threadpoolctl's dicts (``internal_api``, ``architecture``: the kernels OpenBLAS chose, ``version``,
    ``num_threads``, ``filepath``, ...).
    """
    import scipy.linalg.cython_blas  # noqa: F401  (load the BLAS Numba's np.dot calls)
    from threadpoolctl import threadpool_info

    libs = [dict(i) for i in threadpool_info() if i.get("user_api") == "blas"]
    return sorted(libs, key=lambda i: str(i.get("filepath", "")))


def _owner(filepath: str) -> str:
    parts = str(filepath).replace("\\", "/").split("/")
    for part in reversed(parts[:-1]):
        if part.endswith(".libs"):
            return part[:-5]
        if part in ("site-packages", "lib", "lib64"):
            break
    return os.path.basename(str(filepath))


def blas_env() -> dict:
    """The variables of :data:`BLAS_ENV` set in the environment (name -> value)."""
    return {name: os.environ[name] for name in BLAS_ENV if os.environ.get(name)}


def blas_line(libs=None) -> str:
    """One line describing the BLAS libraries: kind, version, kernels, threads, whose."""
    libs = blas_libraries() if libs is None else libs
    if not libs:
        return "none found (threadpoolctl sees no BLAS)"
    parts = []
    for i in libs:
        arch = i.get("architecture")
        arch = f" {arch} kernels" if arch else ""
        parts.append(f"{i.get('internal_api')} {i.get('version')}{arch}, {i.get('num_threads')} threads "
                     f"({_owner(i.get('filepath', ''))})")
    return "; ".join(parts)


def forced_kernel_warnings(libs=None, flags=None, env=None) -> list:
    """One sentence per BLAS setting below what the CPU supports (``libs``, ``flags``, ``env``: default
    :func:`blas_libraries`, :func:`cpu_flags`, :func:`blas_env`): OpenBLAS kernels older than the CPU's
    vector level, an ``MKL_ENABLE_INSTRUCTIONS`` below it or an ``MKL_DEBUG_CPU_TYPE`` (both only with MKL loaded);
    also OpenBLAS kernels above it (``OPENBLAS_CORETYPE=SkylakeX`` on an AVX2 CPU), whose first call stops the
    process with an illegal instruction.
    """
    libs = blas_libraries() if libs is None else libs
    flags = cpu_flags() if flags is None else flags
    env = blas_env() if env is None else env
    level = _vector_level(flags)
    out = []
    why = f" (OPENBLAS_CORETYPE={env['OPENBLAS_CORETYPE']} is set)" if "OPENBLAS_CORETYPE" in env else ""
    for i in libs:
        if i.get("internal_api") != "openblas" or not i.get("architecture"):
            continue
        arch = str(i["architecture"]).lower()
        low = (level == "AVX-512" and (arch in _OPENBLAS_AVX2 or arch in _OPENBLAS_OLD)) or \
              (level == "AVX2" and arch in _OPENBLAS_OLD)
        high = (level in ("AVX2", "AVX", "SSE") and arch in _OPENBLAS_AVX512) or \
               (level in ("AVX", "SSE") and arch in _OPENBLAS_AVX2)
        if low:
            out.append(f"{_owner(i.get('filepath', ''))}'s OpenBLAS runs {i['architecture']} kernels on a CPU "
                       f"with {level}{why}: BLAS-heavy methods (chunked) run slower than they could")
        elif high:
            out.append(f"{_owner(i.get('filepath', ''))}'s OpenBLAS runs {i['architecture']} kernels on a CPU "
                       f"with only {level}{why}: its first BLAS call will stop the process (illegal instruction)")
    if not out and "OPENBLAS_CORETYPE" in env and level == "AVX-512" and \
            env["OPENBLAS_CORETYPE"].lower() in (_OPENBLAS_AVX2 | _OPENBLAS_OLD):
        out.append(f"OPENBLAS_CORETYPE={env['OPENBLAS_CORETYPE']} names kernels below the CPU's {level}")
    mkl = any(i.get("internal_api") == "mkl" for i in libs)
    instr = env.get("MKL_ENABLE_INSTRUCTIONS", "").upper()
    if mkl and instr and ((level == "AVX-512" and not instr.startswith("AVX512"))
                  or (level == "AVX2" and instr in ("AVX", "SSE4_2", "SSE4_1", "SSSE3", "SSE3", "SSE2"))):
        out.append(f"MKL_ENABLE_INSTRUCTIONS={instr} limits MKL below the CPU's {level}")
    if mkl and "MKL_DEBUG_CPU_TYPE" in env:
        out.append(f"MKL_DEBUG_CPU_TYPE={env['MKL_DEBUG_CPU_TYPE']} forces MKL's code path")
    return out


def numba_threads() -> int:
    """``numba.get_num_threads()``, without starting Numba's thread pool when no parallel kernel has run
    (the pool's size, ``NUMBA_NUM_THREADS``, then)."""
    import numba

    try:
        numba.threading_layer()
    except ValueError:  # the pool is not started: get_num_threads() would start it
        return int(numba.config.NUMBA_NUM_THREADS)
    return int(numba.get_num_threads())


def machine_line() -> str:
    """One line naming the machine the timings ran on: CPU, BLAS kernels and threads, overrides.

    The same line is printed by ``linattn info``, ``linattn tune`` and every
    script under ``benchmarks/``.
    """
    flags = cpu_flags()
    level = _vector_level(flags)
    env = blas_env()
    cpu = f"{cpu_model()} ({os.cpu_count()} logical CPUs{', ' + level if level else ''})"
    over = ", ".join(f"{k}={v}" for k, v in env.items()) or "none"
    return (f"CPU {cpu}; Numba {numba_threads()} threads; BLAS {blas_line()}; "
            f"BLAS overrides: {over}")


# ---------------------------------------------------------------------------
# The calibration file
# ---------------------------------------------------------------------------
#: ``LINATTN_*`` variables that leave the timed kernels as they are (so not in :func:`calibration_key`).
_NOT_KNOBS = frozenset({"LINATTN_CACHE_DIR", "LINATTN_NO_CACHE", "LINATTN_AUTO_TUNE"})


def calibration_key() -> dict:
    """What a calibration is valid for: CPU, BLAS, BLAS overrides, threads and versions (memoised)."""
    global _key_memo
    if _key_memo is None:
        import numba
        import numpy as np

        from ._version import __version__

        _key_memo = {
            "cpu": cpu_model(),
            "blas": [{k: str(i.get(k)) for k in ("internal_api", "architecture", "version")}
                     for i in blas_libraries()],
            "blas_env": blas_env(),
            "numba_threads": int(numba.config.NUMBA_NUM_THREADS),
            # the library's own knobs set in the environment (a chunk size, BLAS threads inside the kernels,
            # ...) change what is timed; where the calibration is kept, and whether it is read, do not
            "knobs": {k: os.environ[k] for k in sorted(os.environ)
                      if k.startswith("LINATTN_") and k not in _NOT_KNOBS},
            "linattn_nb": __version__,
            "numba": numba.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        }
    return _key_memo


def calibration_folder() -> str | None:
    """The folder calibrations are stored in: the kernel cache folder (None when caching is off)."""
    from . import _cache

    return _cache.cache_folder()[0]


def calibration_path(key: dict | None = None) -> str | None:
    """The file of the calibration for ``key`` (default: this machine's); None without a folder."""
    folder = calibration_folder()
    if folder is None:
        return None
    digest = hashlib.sha1(json.dumps(calibration_key() if key is None else key, sort_keys=True).encode())
    return os.path.join(folder, f"{FILE_PREFIX}{digest.hexdigest()[:16]}.json")


def _valid_rows(rows) -> bool:
    if not isinstance(rows, list) or not rows:
        return False
    last = 0
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != 2 or row[1] not in ("scan", "chunked"):
            return False
        max_n = row[0]
        if max_n is None:
            if i != len(rows) - 1:
                return False
        elif not _is_int(max_n) or max_n <= last:
            return False
        else:
            last = max_n
    return rows[-1][0] is None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond a float's range (a JSON integer of hundreds of digits)
        return False


def _invalid(cal, key) -> str | None:
    """Why ``cal`` is not a usable calibration for ``key`` (None: it is).

    Checks every field a reader uses (:func:`auto_rows`, :func:`status_line`, ``linattn tune --show``),
    types and shapes, so that a damaged file is no calibration rather than an error in a reader.
    """
    if not isinstance(cal, dict):
        return "not a JSON object"
    if cal.get("format") != FORMAT:
        return f"format {cal.get('format')!r}, not {FORMAT}"
    if cal.get("key") != key:
        return "made for another CPU, BLAS, thread count or version"
    if not isinstance(cal.get("created"), str):
        return "no 'created' date"
    st = cal.get("setting")
    if not isinstance(st, dict) or not isinstance(st.get("quick"), bool) \
            or not all(_is_int(st.get(k)) and st[k] > 0 for k in ("batch", "dim", "rounds")):
        return "no valid 'setting' (batch, dim, rounds, quick)"
    entries = cal.get("entries")
    if not isinstance(entries, dict) or not entries:
        return "no 'entries'"
    for name, e in entries.items():
        rule, _, dtype = name.partition("/")
        if not rule or dtype not in DTYPES:
            return f"entry {name!r}: not '<rule>/<dtype>'"
        if not isinstance(e, dict) or not _valid_rows(e.get("rows")):
            return f"entry {name!r}: no valid 'rows'"
        n = e.get("n")
        if not isinstance(n, list) or not n or not all(_is_int(x) and x > 0 for x in n):
            return f"entry {name!r}: no valid 'n'"
        for field in ("scan_ms", "chunked_ms", "ratio"):
            col = e.get(field)
            if not isinstance(col, list) or len(col) != len(n) or not all(_is_num(x) for x in col):
                return f"entry {name!r}: no valid {field!r}"
        problem = _invalid_pairs(e)
        if problem:
            return f"entry {name!r}: {problem}"
        heads = e.get("heads", [])
        if not isinstance(heads, list):
            return f"entry {name!r}: 'heads' is not a list"
        for i, h in enumerate(heads):
            if not isinstance(h, dict):
                return f"entry {name!r}: 'heads' item {i} is not an object"
            if not _is_int(h.get("dim")) or h["dim"] < 1:
                return f"entry {name!r}: 'heads' item {i}: 'dim' must be a positive integer, got {h.get('dim')!r}"
            problem = _invalid_pairs(h)
            if problem:
                return f"entry {name!r}, heads of D = {h['dim']}: {problem}"
    return None


def _invalid_pairs(e) -> str | None:
    """Why the pair fields of an entry, or of one of its ``"heads"`` items, are not usable (None: they are)."""
    for field in ("chunk", "grad_chunk"):
        if field in e and not _valid_pair(e[field]):
            return f"{field!r} is not [chunk, row block] with 1 <= row block <= chunk"
        timed = e.get(f"{field}_ms", [])
        if not isinstance(timed, list) or not all(
                isinstance(x, list) and len(x) == 3 and _valid_pair(x[:2]) and _is_num(x[2]) for x in timed):
            return f"'{field}_ms' is not a list of [chunk, row block, ms]"
    return None


def _valid_pair(pair) -> bool:
    """``[chunk, row block]`` of positive ints, the block at most the chunk."""
    return isinstance(pair, list) and len(pair) == 2 and all(_is_int(x) for x in pair) and 1 <= pair[1] <= pair[0]


def _valid(cal, key) -> bool:
    return _invalid(cal, key) is None


def read(path: str | None = None) -> tuple:
    """``(calibration, problem)`` for the file at ``path`` (default: this machine's): the calibration or
    None, and None or why a file that exists there is ignored (it cannot be read, is not JSON, or is not
    a valid calibration for this machine)."""
    path = calibration_path() if path is None else path
    if path is None or not os.path.lexists(path):
        return None, None
    try:
        with open(path, encoding="utf-8") as fh:
            cal = json.load(fh)
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the parser's stack
        return None, "is not valid JSON"
    problem = _invalid(cal, calibration_key())
    return (None, f"is not a valid calibration ({problem})") if problem else (cal, None)


def load(path: str | None = None) -> dict | None:
    """The stored calibration for this machine, or None (no file, a file of another machine,
    CPU, BLAS or version, or a file that cannot be read, parsed or validated: all ignored, never an
    error; :func:`read` says why)."""
    return read(path)[0]


def save(cal: dict) -> str | None:
    """Store ``cal`` atomically and use it in this process; the file written, or None when there is no
    cache folder or it cannot be written (the calibration is then kept for this process only)."""
    global _current
    with _lock:
        _current = cal
    path = calibration_path()
    if path is None:
        return None
    from .state.fileformat import atomic_write

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, lambda fh: fh.write(json.dumps(cal, indent=1).encode("utf-8")))
    except OSError:
        return None
    return path


def other_files() -> list:
    """Calibration files in the folder other than this machine's (other CPU, BLAS, threads or versions)."""
    folder, mine = calibration_folder(), calibration_path()
    if folder is None:
        return []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names
            if n.startswith(FILE_PREFIX) and n.endswith(".json") and os.path.join(folder, n) != mine]


def clear() -> str | None:
    """Remove this machine's stored calibration (and forget it in this process); the file removed, or None
    where there was none.  OSError (naming the file) where it is there and cannot be removed."""
    global _current
    with _lock:
        _current = False
    path = calibration_path()
    if path is None or not os.path.lexists(path):
        return None
    try:
        os.unlink(path)
    except FileNotFoundError:  # removed by another process meanwhile
        return None
    return path


def current() -> dict | None:
    """The calibration ``method="auto"`` uses in this process (loaded once), or None."""
    global _current
    with _lock:
        if _current is None:
            _current = load() or False
        return _current or None


def forget() -> None:
    """Drop what this process remembers (the calibration and the key); the next use reads the file again."""
    global _current, _key_memo
    with _lock:
        _current = None
        _key_memo = None
        _failed.clear()


def use(cal: dict | None) -> None:
    """Use ``cal`` (a dict as :func:`calibrate` returns) in this process without storing it; None: none."""
    global _current
    with _lock:
        _current = cal if cal is not None else False


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------
def tuned_rules() -> list:
    """The rules of :data:`RULES` with both a causal CPU scan and a chunked kernel registered."""
    from .ops import methods  # noqa: F401  (registers the built-in methods)
    from .ops.registry import available_methods

    return [r for r in RULES if {"scan", "chunked"} <= set(available_methods(causal=True, device="cpu", rule=r))]


def _problem(rule, dtype, batch, n, dim, rng):
    from .rules import get_rule

    r = get_rule(rule)
    q, k, v = (rng.standard_normal((batch, n, dim)).astype(dtype) for _ in range(3))
    kw = {"causal": True}
    if r.beta:  # the delta rules: unit keys, a write strength per token
        kw["feature_map"] = "l2"
        kw["beta"] = rng.uniform(0.1, 0.9, (batch, n))
    if r.factor == "scalar":
        kw["log_decay"] = rng.uniform(-0.1, -0.001, (batch, n))
    elif r.factor == "feature":
        kw["log_decay"] = rng.uniform(-0.1, -0.001, (batch, n, dim))
    return q, k, v, kw


#: The function timed: :func:`linattn_nb.linear_attention`, handed over by :func:`install` when the front end
#: is imported (the kernel layer asks this module for rows; this module never imports the front end).
_runner = None
#: :func:`linattn_nb.linear_attention_vjp`, handed over the same way.
_vjp_runner = None


def install(run, vjp=None) -> None:
    """Make ``method="auto"`` consult this module's calibration (its rows, the chunked kernel's (chunk, row
    block) pair and that of the fused normalised backward), and time ``run`` (``linear_attention``) and ``vjp``
    (``linear_attention_vjp``) for it.

    Called once by :mod:`linattn_nb.attention` at import, so that neither the kernel layer (which asks
    :func:`auto_rows` through a hook) nor this module imports the front end.
    """
    global _runner, _vjp_runner
    from .ops import registry

    _runner = run
    _vjp_runner = vjp
    registry.set_calibration(auto_rows, chunk_choice, grad_choice)


def _time_pair(rule, dtype, batch, n, dim, rounds, rng):
    """The scan's and the chunked kernel's median times (seconds) and the median of their ratios
    (chunked / scan, each round's pair timed back to back, so that a change of load falls on both)."""
    linear_attention = _runner
    if linear_attention is None:
        raise RuntimeError("linattn_nb._tune.install was not called (import linattn_nb first)")

    q, k, v, kw = _problem(rule, dtype, batch, n, dim, rng)
    inner, pair = 1, 0.0
    for method in ("scan", "chunked"):
        linear_attention(q, k, v, method=method, **kw)  # compile or load, page in
        t = time.perf_counter()
        linear_attention(q, k, v, method=method, **kw)
        dt = max(time.perf_counter() - t, 1e-7)
        inner = max(inner, min(50, int(2e-3 / dt)))
        pair += dt
    # short calls are cheap and the most disturbed by a busy machine: more rounds for them, up to 0.2 s
    rounds = max(rounds, min(3 * rounds, int(0.2 / (inner * pair))))
    times = {"scan": [], "chunked": []}
    for r in range(rounds):
        for method in (("scan", "chunked") if r % 2 == 0 else ("chunked", "scan")):
            t = time.perf_counter()
            for _ in range(inner):
                linear_attention(q, k, v, method=method, **kw)
            times[method].append((time.perf_counter() - t) / inner)
    ratio = statistics.median(c / s for s, c in zip(times["scan"], times["chunked"]))
    return statistics.median(times["scan"]), statistics.median(times["chunked"]), ratio


def chunk_knobs_set() -> bool:
    """Whether ``config.CPU_CHUNK_SIZE`` or ``config.CPU_CHUNK_BLOCK`` is set (they then fix the pair; nothing is
    timed or replaced)."""
    return config.knob_int("CPU_CHUNK_SIZE") > 0 or config.knob_int("CPU_CHUNK_BLOCK") > 0


def grad_knobs_set() -> bool:
    """Whether ``config.BACKWARD_NORM_CHUNK`` or ``config.BACKWARD_NORM_BLOCK`` is set (they then fix the fused
    normalised backward's pair)."""
    return config.knob_int("BACKWARD_NORM_CHUNK") > 0 or config.knob_int("BACKWARD_NORM_BLOCK") > 0


@contextlib.contextmanager
def _trying(pair, slot="pair"):
    """Every CPU chunked call of this thread runs ``pair`` (chunk, row block) inside (None: as outside);
    ``slot`` ``"grad"``: the fused normalised backward of every gradient request prepared inside."""
    was = getattr(_trial, slot, None)
    setattr(_trial, slot, None if pair is None else (int(pair[0]), int(pair[1])))
    try:
        yield
    finally:
        setattr(_trial, slot, was)


def _stored_pair(field, rule, dtype, f, m):
    """The ``field`` (``"chunk"``, ``"grad_chunk"``) pair of this machine's calibration entry for ``rule`` and
    ``dtype``, where one is stored and used, timed at a D = M whose row of ``config.CPU_CHUNK_TABLE`` is that of
    ``f`` by ``m``: the entry's own (the calibration's D) or one of its ``"heads"`` items; else None."""
    name = "float64" if str(getattr(dtype, "name", dtype)) == "float64" else "float32"
    with _lock:
        cal = _current
    if not cal or cal["setting"].get("quick") or mode() == "off":
        return None
    entry = cal["entries"].get(f"{rule}/{name}")
    if not entry:
        return None
    row = config.chunk_table_row(f, m, name)
    for e, d in [(entry, cal["setting"]["dim"])] + [(h, h["dim"]) for h in used_heads(entry, name, cal)]:
        if config.chunk_table_row(d, d, name) == row:
            return tuple(e[field]) if field in e else None
    return None


def used_heads(entry, dtype, cal) -> list:
    """The ``"heads"`` items of ``entry`` (of calibration ``cal``) that a call can run: each the first of its row
    of ``config.CPU_CHUNK_TABLE`` for ``dtype``, and not in the row of the calibration's own D (whose pairs are
    the entry's).  A hand-edited file, or a table changed since the calibration, can hold others; they are
    neither run nor shown as run."""
    rows = [config.chunk_table_row(cal["setting"]["dim"], cal["setting"]["dim"], dtype)]
    out = []
    for h in entry.get("heads", ()):
        row = config.chunk_table_row(h["dim"], h["dim"], dtype)
        if row not in rows:
            rows.append(row)
            out.append(h)
    return out


def head_dims(dtype, dim: int) -> list:
    """The D = M at which a calibration also times the pairs, besides its own ``dim``: one per other row of
    ``config.CPU_CHUNK_TABLE`` for ``dtype``, the largest square D * D within the row's bound (the last row:
    ``FULL``'s D), so that heads of every row run a pair timed in their own row."""
    import numpy as np

    name = "float64" if np.dtype(dtype) == np.float64 else "float32"
    own = config.chunk_table_row(dim, dim, name)
    dims = []
    for row in config.CPU_CHUNK_TABLE.get(name, ()):
        d = FULL["dim"] if row[0] is None else math.isqrt(int(row[0]))
        r = config.chunk_table_row(d, d, name)
        if d >= 1 and r == row and r != own and d not in dims:
            dims.append(d)
    return dims


def chunk_choice(rule: str, dtype, f: int, m: int, *, auto: bool):
    """The ``(chunk, row block)`` a causal CPU chunked call runs, or None for ``config``'s
    (``CPU_CHUNK_SIZE``, ``CPU_CHUNK_BLOCK``, ``CPU_CHUNK_TABLE``).

    With ``auto`` (the call asked for ``method="auto"``), the pair of this machine's calibration entry for
    ``rule`` and ``dtype`` where there is one and neither knob is set, timed at a D = M in the same row of
    ``CPU_CHUNK_TABLE`` as ``f`` features by ``m`` value columns (:func:`_stored_pair`).  An explicit
    ``method="chunked"`` keeps the constants, so that its result does not depend on a timing (a chunk size
    moves the last bits of a float32 output).  While :func:`calibrate` times a pair, that pair, on its thread.
    """
    pair = getattr(_trial, "pair", None)
    if pair is not None:
        return pair
    if not auto or chunk_knobs_set():
        return None
    return _stored_pair("chunk", rule, dtype, f, m)


def grad_choice(rule: str, dtype, f: int, m: int, *, auto: bool):
    """The ``(chunk, row block)`` the fused normalised CPU backward of a causal chunked request runs
    (:func:`linattn_nb.ops.grad.cpu.backward_chunked_normalized`), or None for ``config``'s
    (``BACKWARD_NORM_CHUNK``, ``BACKWARD_NORM_BLOCK``).

    As :func:`chunk_choice`: with ``auto``, the calibration entry's ``"grad_chunk"`` where one is stored, neither
    knob is set and it was timed at a D = M in the table row of ``f`` by ``m``; while :func:`calibrate` times a pair,
    that pair, on its thread.
    """
    pair = getattr(_trial, "grad", None)
    if pair is not None:
        return pair
    if not auto or grad_knobs_set():
        return None
    return _stored_pair("grad_chunk", rule, dtype, f, m)


def grad_tuned(rule: str) -> bool:
    """Whether the calibration times the fused normalised backward's pair for ``rule``: the rules whose
    normalised gradient runs it in row blocks (the additive and decay rules; the gate rule's has none)."""
    from .ops.grad.cpu import norm_row_blocks
    from .rules import get_rule

    return norm_row_blocks(get_rule(rule).code)


def _best_pair(call, pairs, rounds):
    """``(pick, rows)``: ``pairs[0]`` (the constants' pair) unless another pair's median time of ``call(pair)``
    is below :data:`CHUNK_MARGIN` times its, and each pair's ``[chunk, block, ms]``; interleaved rounds,
    alternating the order, after one call of each (compile or load, page in)."""
    for pair in pairs:
        call(pair)
    times = {pair: [] for pair in pairs}
    for r in range(rounds):
        for pair in (pairs if r % 2 == 0 else pairs[::-1]):
            t = time.perf_counter()
            call(pair)
            times[pair].append(time.perf_counter() - t)
    med = {pair: statistics.median(ts) for pair, ts in times.items()}
    best = min(pairs, key=med.__getitem__)
    pick = best if med[best] < CHUNK_MARGIN * med[pairs[0]] else pairs[0]
    return list(pick), [[c, b, med[(c, b)] * 1e3] for c, b in pairs]


def _time_grad_chunks(rule, dtype, batch, n, dim, rounds, rng):
    """As :func:`_time_chunks`, for the fused normalised backward: ``linear_attention_vjp`` timed with each pair
    of :data:`GRAD_CANDIDATES` up to ``n`` tokens a chunk and ``config``'s pair."""
    vjp = _vjp_runner
    if vjp is None:
        raise RuntimeError("linattn_nb._tune.install was not called (import linattn_nb first)")
    q, k, v, kw = _problem(rule, dtype, batch, n, dim, rng)
    g = rng.standard_normal(q.shape).astype(dtype)
    c0 = config.cpu_backward_norm_chunk(n, dim, dim + 1, dtype)
    table = (c0, config.cpu_backward_norm_block(c0, dim, dim + 1, dtype))
    pairs = [table] + [p for p in GRAD_CANDIDATES if p != table and p[0] <= n]

    def call(pair):
        with _trying(pair, "grad"):
            vjp(q, k, v, g, method="chunked", **kw)

    return _best_pair(call, pairs, rounds)


def _time_chunks(rule, dtype, batch, n, dim, rounds, rng):
    """``(pair, rows)``: the (chunk, row block) pair the chunked kernel runs here, as a list, and each timed
    pair's median time ``[chunk, block, ms]``.  The table's pair unless another is faster than
    :data:`CHUNK_MARGIN` times it; every pair of :data:`CHUNK_CANDIDATES` up to ``n`` tokens a chunk, timed in
    interleaved rounds (alternating the order)."""
    linear_attention = _runner
    if linear_attention is None:
        raise RuntimeError("linattn_nb._tune.install was not called (import linattn_nb first)")
    q, k, v, kw = _problem(rule, dtype, batch, n, dim, rng)
    c0 = config.cpu_chunk_size(n, dim, dim, dtype)
    table = (c0, config.cpu_chunk_block(c0, dim, dim, dtype))
    pairs = [table] + [p for p in CHUNK_CANDIDATES if p != table and p[0] <= n]

    def call(pair):
        with _trying(pair):
            linear_attention(q, k, v, method="chunked", **kw)

    return _best_pair(call, pairs, rounds)  # the pair is a run-time argument: one compilation


def _pairs_at(rule, dtype, setting, dim, rng) -> dict:
    """The pair fields of a calibration entry timed at D = M = ``dim``: ``"chunk"`` and ``"chunk_ms"``
    (:func:`_time_chunks`) unless a chunk knob is set, ``"grad_chunk"`` and ``"grad_chunk_ms"``
    (:func:`_time_grad_chunks`) for the rules of :func:`grad_tuned` unless a backward knob is set."""
    out = {}
    if not chunk_knobs_set():
        pair, timed = _time_chunks(rule, dtype, setting["batch"], setting["chunk_n"], dim, setting["rounds"], rng)
        out.update(chunk=pair, chunk_ms=timed)
    if not grad_knobs_set() and grad_tuned(rule) and _vjp_runner is not None:
        pair, timed = _time_grad_chunks(rule, dtype, setting["batch"], setting["chunk_n"], dim, setting["rounds"],
                                        rng)
        out.update(grad_chunk=pair, grad_chunk_ms=timed)
    return out


def rows_from(sizes, ratios) -> list:
    """The ``[max_n, method]`` rows of ``config.AUTO_METHODS`` that follow from measured ratios.

    ``ratios[i]`` is the chunked kernel's time over the scan's at ``sizes[i]``.  The three longest
    lengths decide the last row; at most one switch before it, where the summed log loss is least
    (the rule and why: docs/tuning.md).
    """
    logs = [math.log(r) for r in ratios]
    last = "chunked" if statistics.median(logs[-3:]) < 0 else "scan"
    other = "scan" if last == "chunked" else "chunked"
    lose = {"scan": [max(0.0, -x) for x in logs], "chunked": [max(0.0, x) for x in logs]}
    best = (sum(lose[last]), 0)  # (loss, b): the first b lengths take `other`
    for b in range(1, len(ratios)):
        loss = sum(lose[other][:b]) + sum(lose[last][b:]) + 1e-3
        if loss < best[0]:
            best = (loss, b)
    b = best[1]
    if b == 0:
        return [[None, last]]
    return [[math.isqrt(int(sizes[b - 1]) * int(sizes[b])), other], [None, last]]


def crossover(rows):
    """The smallest N from which ``rows`` choose the chunked kernel for every longer sequence (None: never)."""
    if rows[-1][1] != "chunked":
        return None
    return 1 if len(rows) == 1 else int(rows[-2][0]) + 1


def calibrate(rules=None, dtypes=DTYPES, *, quick=False, progress=None, seed=0) -> dict:
    """Time the scan against the chunked kernel here, per rule (default :func:`tuned_rules`) and dtype;
    ``progress(rule, dtype)`` is called before each pair.  Returns ``format``, ``key``, ``created``,
    ``setting`` and ``entries``: ``"<rule>/<dtype>" -> {"n", "scan_ms", "chunked_ms", "ratio", "rows",
    "crossover"}`` (median ms, the median of the rounds' chunked / scan ratios, :func:`rows_from`'s rows),
    and where no knob fixes them, ``"chunk"`` with ``"chunk_ms"`` (:func:`_time_chunks`) and, for the rules of
    :func:`grad_tuned`, ``"grad_chunk"`` with ``"grad_chunk_ms"`` (:func:`_time_grad_chunks`); ``"heads"``, the
    same pair fields with their ``"dim"`` timed at each D of :func:`head_dims` (heads of other rows of
    ``config.CPU_CHUNK_TABLE``).
    """
    import numpy as np

    global _busy
    setting = dict(QUICK if quick else FULL)
    rules = tuned_rules() if rules is None else list(rules)
    rng = np.random.default_rng(seed)
    entries = {}
    with _lock:
        _busy += 1
    try:
        for rule in rules:
            for dtype in dtypes:
                if progress is not None:
                    progress(rule, dtype)
                pairs = _pairs_at(rule, np.dtype(dtype), setting, setting["dim"], rng)
                heads = [{"dim": d, **_pairs_at(rule, np.dtype(dtype), setting, d, rng)}
                         for d in head_dims(dtype, setting["dim"])]
                heads = [h for h in heads if len(h) > 1]
                scan, chunked, ratio = [], [], []
                with _trying(pairs.get("chunk")):  # the chunked kernel as auto will run it
                    for n in setting["sizes"]:
                        s, c, r = _time_pair(rule, np.dtype(dtype), setting["batch"], n, setting["dim"],
                                             setting["rounds"], rng)
                        scan.append(s * 1e3)
                        chunked.append(c * 1e3)
                        ratio.append(r)
                sizes = list(setting["sizes"])
                rows = rows_from(sizes, ratio)
                entry = {"n": sizes, "scan_ms": scan, "chunked_ms": chunked, "ratio": ratio,
                         "rows": rows, "crossover": crossover(rows)}
                entry.update(pairs)
                if heads:
                    entry["heads"] = heads
                entries[f"{rule}/{np.dtype(dtype).name}"] = entry
    finally:
        with _lock:
            _busy -= 1
    return {"format": FORMAT, "key": calibration_key(),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "setting": {**{k: list(v) if isinstance(v, tuple) else v for k, v in setting.items()},
                        "quick": bool(quick)},
            "entries": entries}


def merge(old: dict | None, new: dict) -> dict:
    """``new`` with the entries of ``old`` it does not have (same key and sizes only)."""
    if not old or old.get("key") != new.get("key") or old.get("setting") != new.get("setting"):
        return new
    out = dict(new)
    out["entries"] = {**old.get("entries", {}), **new["entries"]}
    return out


# ---------------------------------------------------------------------------
# method="auto"
# ---------------------------------------------------------------------------
def mode() -> str:
    """``config.AUTO_TUNE``, checked."""
    m = str(config.AUTO_TUNE).strip().lower()
    if m not in MODES:
        raise ValueError(f"config.AUTO_TUNE (LINATTN_AUTO_TUNE) is {config.AUTO_TUNE!r}; "
                         f"choose one of {', '.join(map(repr, MODES))}")
    return m


def _no_files() -> bool:
    folder = calibration_folder()
    if folder is None:
        return True
    try:
        return not any(name.startswith(FILE_PREFIX) for name in os.listdir(folder))
    except OSError:
        return True


def auto_rows(rule: str, dtype) -> list | None:
    """The calibrated ``(max_n, method)`` rows for the causal CPU ``rule`` and ``dtype``, or None.

    None means ``config.AUTO_METHODS``.  ``config.AUTO_TUNE``: ``"off"`` always None; ``"load"`` the
    stored calibration (read once per process); ``"first-use"`` the same, timing a missing entry now.
    """
    global _current
    m = mode()
    if m == "off":
        return None
    name = "float64" if str(getattr(dtype, "name", dtype)) == "float64" else "float32"
    entry_key = f"{rule}/{name}"
    with _lock:
        cal = _current
        if cal is None:  # first look in this process
            cal = _current = (False if m == "load" and _no_files() else (load() or False))
        if cal and entry_key in cal["entries"] and not cal.get("setting", {}).get("quick"):
            return [tuple(r) for r in cal["entries"][entry_key]["rows"]]
        if m != "first-use" or _busy or rule not in RULES or entry_key in _failed:
            return None
    return _first_use(rule, name, entry_key)


def _first_use(rule, name, entry_key):
    global _busy
    with _lock:
        if _busy:
            return None
        _busy += 1
    try:
        if rule not in tuned_rules():
            return None
        print(f"linattn_nb: timing the scan against the chunked kernel for rule {rule!r}, {name}, once on "
              "this CPU and BLAS (a few seconds; `linattn tune` does it ahead, LINATTN_AUTO_TUNE=load skips it)",
              file=sys.stderr, flush=True)
        try:
            new = calibrate([rule], [name])
        except Exception as exc:  # the call that asked goes on with the constants, and so do later ones
            _failed.add(entry_key)
            print(f"linattn_nb: the timing failed ({type(exc).__name__}: {exc}); method='auto' uses "
                  "config.AUTO_METHODS", file=sys.stderr, flush=True)
            return None
        stored = load()  # the file as it is now: another process may have stored rules since this one read it
        with _lock:
            cal = merge(stored or _current or None, new)
        save(cal)
        return [tuple(r) for r in cal["entries"][entry_key]["rows"]]
    finally:
        with _lock:
            _busy -= 1


def _pairs_text(e, dtype, cal) -> str:
    """`` (chunks of C, row blocks of b; gradient: chunks of C', row blocks of b'; D = 32: ...)`` for an entry's
    stored pairs and those of its heads that calls run (:func:`used_heads`)."""
    def parts(x):
        return [f"{what}chunks of {x[field][0]}, row blocks of {x[field][1]}"
                for field, what in (("chunk", ""), ("grad_chunk", "gradient: ")) if field in x]

    text = parts(e) + [f"D = {h['dim']}: {', '.join(parts(h))}" for h in used_heads(e, dtype, cal) if parts(h)]
    return f" ({'; '.join(text)})" if text else ""


def status_line() -> str:
    """The calibration ``method="auto"`` uses here, in one line (for ``linattn info``)."""
    try:
        m = mode()
    except ValueError as exc:
        return str(exc)
    cal, problem = read()
    if problem:
        return (f"the stored file {calibration_path()} {problem}: ignored (the next `linattn tune` replaces it); "
                f"constants (config.AUTO_METHODS), AUTO_TUNE={m}")
    if cal is None:
        return f"none stored for this machine; constants (config.AUTO_METHODS), AUTO_TUNE={m}"
    cross = ", ".join(f"{k} {crossover(e['rows']) or 'never'}{_pairs_text(e, k.partition('/')[2], cal)}"
                      for k, e in sorted(cal["entries"].items()))
    if cal["setting"]["quick"]:
        use = "a --quick smoke test, not used"
    else:
        use = "used" if m != "off" else "not used: AUTO_TUNE=off"
    return f"stored {cal['created']} ({use}); chunked from N = {cross}"
