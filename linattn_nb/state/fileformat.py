"""The state file format: what :meth:`LinearAttentionState.save` writes and ``load`` reads.

An ``.npz`` (no pickles); its entries and versions: docs/frontend.md, "State files".
:func:`write` is atomic; :func:`read` validates everything and raises :class:`StateFileError`.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import tempfile
import zipfile
from typing import NamedTuple

import numpy as np

from .. import _frontend as FE
from .. import feature_maps as fm
from ..rules import dplr_rule_names, rule_names
from ._checks import STATE_DTYPES, check_batch_shape, check_dim, check_state_dtype

__all__ = ["StateFileError", "FORMAT_NAME", "FORMAT_VERSION", "write", "read"]

FORMAT_NAME = "linattn_nb.LinearAttentionState"
FORMAT_VERSION = 2
REQUIRED_KEYS = ("format", "version", "S", "z", "position", "key_dim", "value_dim", "batch_shape",
                 "eps", "feature_map", "feature_map_params", "feature_map_rebuild_error",
                 "feature_map_probe")
#: Entries added by each version after the first.
VERSION_KEYS = {2: ("rule", "normalize")}
def file_rules() -> tuple:
    """The rules a file may name: the rules registered now, by name ("": not fixed yet; "dplr" and the DPLR
    rules: state/dplr.py), so that a rule a researcher registered after import loads too."""
    return ("",) + rule_names() + ("dplr",) + dplr_rule_names()


PROBE_TOKENS = 3


class StateFileError(ValueError):
    """A saved state that cannot be loaded: corrupted, truncated, from another
    format version, inconsistent, or not what the caller expected."""


class StateFile(NamedTuple):
    """The validated contents of a state file (host arrays in the canonical layout)."""

    S: np.ndarray
    z: np.ndarray
    position: int
    key_dim: int
    value_dim: int
    batch_shape: tuple
    eps: object
    feature_map: object
    rule: object = "additive"
    normalize: object = None


# ---------------------------------------------------------------------------
# Feature-map description
# ---------------------------------------------------------------------------
def probe_features(fmap, d: int) -> np.ndarray:
    """float64 features ``(3, output_dim(d))`` (keys, causal, from position 0) of a fixed input on which a
    rebuilt feature map must reproduce the saved one."""
    x = np.linspace(-2.0, 2.0, PROBE_TOKENS * d).reshape(PROBE_TOKENS, d)
    feats = FE.featurise(fmap, x, role="key", causal=True, offset=0, total_length=PROBE_TOKENS,
                         dtype=np.float64, name="the probe input")
    return np.asarray(feats, dtype=np.float64)


def feature_map_spec(fmap, d: int):
    """(params_json, arrays, rebuild_error): how to rebuild ``fmap`` through the registry, from the
    attributes named like its constructor's parameters (JSON values, or arrays in their own entries).
    A map rebuilt from them that does not give the same features on the probe input is recorded as not
    rebuildable (``rebuild_error``)."""
    cls = type(fmap)
    name = getattr(fmap, "name", "")
    if not name:
        return "", {}, f"{cls.__name__} has no registry name"
    params, arrays = {}, {}
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        for p in list(sig.parameters.values())[1:]:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            for attr in (p.name, "_" + p.name):
                if hasattr(fmap, attr):
                    val = getattr(fmap, attr)
                    break
            else:
                return "", {}, (f"parameter {p.name!r} of {cls.__name__} is not stored as an attribute "
                                f"({p.name!r} or '_{p.name}')")
            if val is None and p.default is None:
                continue  # left at its default: files stay readable by releases that predate the parameter
            if isinstance(val, np.ndarray):
                if val.dtype.kind not in "biuf":
                    return "", {}, f"parameter {p.name!r} is a {val.dtype} array"
                arrays[p.name] = val
                continue
            if isinstance(val, np.generic):
                val = val.item()
            if isinstance(val, tuple):
                val = list(val)
            try:
                json.dumps(val, allow_nan=False)
            except (TypeError, ValueError):
                return "", {}, f"parameter {p.name!r} ({type(val).__name__}) cannot be written to a file"
            params[p.name] = val
    try:
        rebuilt = fm.get(name, **params, **arrays)
    except Exception as exc:
        return "", {}, f"feature_maps.get({name!r}, ...) failed: {type(exc).__name__}: {exc}"
    if type(rebuilt) is not cls:
        return "", {}, (f"the registry builds {type(rebuilt).__name__} for {name!r}, "
                        f"not {cls.__name__}")
    try:
        same = np.array_equal(probe_features(rebuilt, d), probe_features(fmap, d), equal_nan=True)
    except Exception as exc:
        return "", {}, f"the rebuilt map fails on a probe input: {type(exc).__name__}: {exc}"
    if not same:
        return "", {}, "the map rebuilt from its parameters gives different features (hidden state?)"
    return json.dumps(params, allow_nan=False, sort_keys=True), arrays, ""


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------
def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``os.umask`` sets it while it
    reads it, which another thread creating a file at that moment would see)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path, fill) -> None:
    """``fill(f)`` writes a binary file into a temporary file in the target's directory, fsync'ed, then
    ``os.replace``: an interrupted write never leaves a half-written file at ``path``.

    A symbolic link at ``path`` is followed (its target is replaced, the link kept); the file gets the mode of
    the file it replaces, or a new file's (``0o666`` less the umask)."""
    given = os.fsdecode(os.fspath(path))  # bytes paths too, as load() reads them
    if not given or given.endswith(os.sep) or (os.altsep and given.endswith(os.altsep)) \
            or os.path.isdir(given):  # realpath would drop a trailing "/" and write another file than load reads
        raise IsADirectoryError(f"cannot write {given!r}: the path names a folder, not a file")
    path = os.path.realpath(given)
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):  # named here: mkstemp's error names its temporary file
        raise FileNotFoundError(f"cannot write {given!r}: the folder {directory!r} does not exist")
    base = os.path.basename(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(OSError):  # exotic file systems
            os.chmod(tmp, os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _int64_position(position) -> int:
    if not 0 <= position <= FE.MAX_POSITION:
        raise ValueError(f"cannot save the state: its position {position} does not fit the file's int64")
    return position


def write(path, *, S, z, position, key_dim, value_dim, batch_shape, eps, feature_map, rule="additive",
          normalize=None) -> None:
    """Write a state file (atomically); ``S``, ``z`` are host arrays in the canonical layout, ``rule`` the
    state's rule (None: not fixed yet).  ValueError when the feature map fails on the probe input (a
    file without its probe could never be loaded)."""
    fmap = feature_map
    try:
        probe_f = probe_features(fmap, key_dim)
    except Exception as exc:
        raise ValueError(f"cannot save the state: its feature map {getattr(fmap, 'name', fmap)!r} fails on "
                         f"the probe input that load() checks it with ({type(exc).__name__}: {exc})") from exc
    params, parrays, err = feature_map_spec(fmap, key_dim)
    arrays = {
        "format": np.array(FORMAT_NAME),
        "version": np.array(FORMAT_VERSION, dtype=np.int64),
        "S": S,
        "z": z,
        "position": np.array(_int64_position(position), dtype=np.int64),
        "key_dim": np.array(key_dim, dtype=np.int64),
        "value_dim": np.array(value_dim, dtype=np.int64),
        "batch_shape": np.array(batch_shape, dtype=np.int64).reshape(-1),
        "eps": np.array(np.nan if eps is None else eps, dtype=np.float64),
        "feature_map": np.array(getattr(fmap, "name", "") or ""),
        "feature_map_class": np.array(f"{type(fmap).__module__}.{type(fmap).__qualname__}"),
        "feature_map_params": np.array(params),
        "feature_map_rebuild_error": np.array(err),
        "feature_map_probe": probe_f,
        "rule": np.array(rule or ""),
        "normalize": np.array(-1 if normalize is None else int(bool(normalize)), dtype=np.int64),
    }
    for name, arr in parrays.items():
        arrays["feature_map_param__" + name] = arr
    atomic_write(path, lambda f: np.savez(f, **arrays))


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------
def read(path, *, feature_map=None, key_dim=None, value_dim=None, batch_shape=None, dtype=None,
         rule=None) -> StateFile:
    """Read and validate a state file written by :func:`write`.

    ``feature_map``: use this map instead of rebuilding the saved one (it must reproduce the saved
    probe features).  ``key_dim``, ``value_dim``, ``batch_shape``, ``dtype``, ``rule``: when given,
    the file must match them.  StateFileError for anything wrong with the file or a mismatch,
    FileNotFoundError for no file.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no state file at {path!r}")
    if os.path.isdir(path):
        raise StateFileError(f"{path}: is a folder, not a state file")
    try:
        loaded = np.load(path, allow_pickle=False)
        if not hasattr(loaded, "files"):  # np.load of a .npy file gives its array
            raise StateFileError(f"{path}: not a LinearAttentionState file (one NumPy array, .npy; a state "
                                 "file is an .npz archive written by save)")
        with loaded as npz:
            keys = set(npz.files)
            if "format" not in keys or "version" not in keys:
                raise StateFileError(f"{path}: not a LinearAttentionState file (no format/version entries; "
                                     f"entries: {sorted(keys)})")
            data = {}
            for name in sorted(keys):
                try:
                    data[name] = npz[name]
                except Exception as exc:  # a damaged member, or a pickled object array
                    raise StateFileError(f"{path}: cannot read the state file, it is corrupted or truncated "
                                         f"(entry {name!r}: {type(exc).__name__}: {exc})") from exc
    except StateFileError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError, RuntimeError) as exc:
        raise StateFileError(f"{path}: cannot read the state file, it is corrupted or truncated "
                             f"({type(exc).__name__}: {exc})") from exc
    except Exception as exc:  # zlib.error and friends
        raise StateFileError(f"{path}: cannot read the state file ({type(exc).__name__}: {exc})") from exc
    return parse(path, data, feature_map=feature_map,
                 expect=dict(key_dim=key_dim, value_dim=value_dim, batch_shape=batch_shape, dtype=dtype,
                             rule=rule))


def parse(path, data, *, feature_map, expect) -> StateFile:
    """Validate the entries ``data`` of the file at ``path`` (see :func:`read`)."""
    def bad(msg):
        return StateFileError(f"{path}: {msg}")

    def scalar(name, kind):
        a = data[name]
        if a.shape != () or a.dtype.kind not in kind:
            raise bad(f"entry {name!r} must be a scalar of kind {kind!r}, got dtype {a.dtype} shape {a.shape}")
        return a.item()

    fmt = data["format"]
    if fmt.dtype.kind != "U" or fmt.shape != () or str(fmt) != FORMAT_NAME:
        raise bad(f"not a LinearAttentionState file (format {fmt!r})")
    version = scalar("version", "iu")
    if version > FORMAT_VERSION:
        raise bad(f"format version {version} was written by a newer linattn_nb; this one reads "
                  f"versions up to {FORMAT_VERSION}")
    if version < 1:
        raise bad(f"invalid format version {version}")
    want = REQUIRED_KEYS + tuple(k for v, keys in VERSION_KEYS.items() if version >= v for k in keys)
    missing = [k for k in want if k not in data]
    if missing:
        raise bad(f"missing entries {missing} (truncated or hand-edited file?)")
    d = scalar("key_dim", "iu")
    m = scalar("value_dim", "iu")
    position = scalar("position", "iu")
    eps = scalar("eps", "f")
    bs_arr = data["batch_shape"]
    if bs_arr.ndim != 1 or bs_arr.dtype.kind not in "iu" or (bs_arr < 0).any():
        raise bad(f"entry 'batch_shape' must be a 1-d array of non-negative integers, got {bs_arr!r}")
    bs = tuple(int(x) for x in bs_arr)
    if d < 1 or m < 1 or position < 0 or position > FE.MAX_POSITION:
        raise bad(f"invalid dimensions key_dim={d}, value_dim={m}, position={position}")
    if not (math.isnan(eps) or (eps >= 0 and math.isfinite(eps))):
        raise bad(f"invalid eps {eps}")
    # The update rule (version 1 files: additive, normalize by the rule's convention).
    rule, normalize = "additive", None
    if version >= 2:
        r = data["rule"]
        known = file_rules()
        if r.dtype.kind != "U" or r.shape != () or str(r) not in known:
            got = repr(str(r)) if r.dtype.kind == "U" and r.shape == () else repr(r)
            raise bad(f"entry 'rule' must be a registered rule, one of {known}, got {got} (a rule of your own: "
                      "register it before loading)")
        rule = str(r) or None
        nz = scalar("normalize", "iu")
        if nz not in (-1, 0, 1):
            raise bad(f"entry 'normalize' must be -1 (None), 0 or 1, got {nz}")
        normalize = None if nz == -1 else bool(nz)
    S, z = data["S"], data["z"]
    if S.dtype not in STATE_DTYPES or z.dtype != S.dtype:
        raise bad(f"S and z must both be float32 or float64, got {S.dtype} and {z.dtype}")
    # The feature map.
    name = str(data["feature_map"])
    rebuild_error = str(data["feature_map_rebuild_error"])
    probe_saved = data["feature_map_probe"]
    if feature_map is None:
        if rebuild_error:
            raise bad(f"its feature map {name!r} cannot be rebuilt from the file ({rebuild_error}); "
                      "pass feature_map= to load()")
        try:
            params = json.loads(str(data["feature_map_params"]))
            if not isinstance(params, dict):
                raise ValueError("parameters are not a JSON object")
        except ValueError as exc:
            raise bad(f"unreadable feature-map parameters ({exc})") from exc
        for key in data:
            if key.startswith("feature_map_param__"):
                params[key[len("feature_map_param__"):]] = data[key]
        try:
            fmap = fm.get(name, **params)
        except Exception as exc:
            raise bad(f"cannot rebuild feature map {name!r} with {sorted(params)}: "
                      f"{type(exc).__name__}: {exc}") from exc
    else:
        fmap = fm.resolve(feature_map)
    try:
        f = FE.feature_dim(fmap, d)
    except ValueError as exc:
        raise bad(str(exc)) from exc
    if S.shape != bs + (f, m) or z.shape != bs + (f,):
        raise bad(f"S has shape {S.shape} and z {z.shape}, expected {bs + (f, m)} and {bs + (f,)} "
                  f"(batch_shape {bs}, feature map {fmap.name!r} with D_phi={f}, value_dim {m})")
    # The probe is always checked: an empty or reshaped one cannot vouch for the map.
    if probe_saved.shape != (PROBE_TOKENS, f) or probe_saved.dtype.kind != "f":
        raise bad(f"feature map {fmap.name!r} cannot be checked against the map this state was saved with: "
                  f"the file's feature-map probe has shape {probe_saved.shape} and dtype {probe_saved.dtype}, "
                  f"expected {(PROBE_TOKENS, f)} floats (hand-edited file?)")
    try:
        same = np.array_equal(probe_features(fmap, d), probe_saved, equal_nan=True)
    except Exception as exc:
        raise bad(f"feature map {fmap.name!r} fails on the probe input: {exc}") from exc
    if not same:
        raise bad(f"feature map {fmap.name!r} gives other features than the map this state was "
                  "saved with")
    if not (np.isfinite(S).all() and np.isfinite(z).all()):
        raise bad("S or z holds non-finite values")
    # The caller's expectations.
    for key, got in (("key_dim", d), ("value_dim", m)):
        if expect[key] is not None and check_dim(key, expect[key]) != got:
            raise bad(f"{key} is {got}, expected {expect[key]}")
    if expect["batch_shape"] is not None and check_batch_shape(expect["batch_shape"]) != bs:
        raise bad(f"batch_shape is {bs}, expected {check_batch_shape(expect['batch_shape'])}")
    if expect["dtype"] is not None and check_state_dtype(expect["dtype"]) != S.dtype:
        raise bad(f"dtype is {S.dtype}, expected {np.dtype(expect['dtype'])}")
    if expect.get("rule") is not None and rule is not None and expect["rule"] != rule:
        raise bad(f"the state runs the {rule!r} update rule, expected {expect['rule']!r} (a state continues "
                  "only the rule that made it)")
    return StateFile(S, z, int(position), int(d), int(m), bs, None if math.isnan(eps) else float(eps), fmap,
                     rule, normalize)
