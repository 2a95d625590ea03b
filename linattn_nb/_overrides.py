"""Problem-size options of ``linattn error|rank|recall`` and ``linattn report --config FILE``.

:func:`apply_overrides` changes a study's grid of points (refusing an option the points have no key
for); :func:`load_config` reads and checks a TOML or JSON report description.  The options and the
point keys they set: docs/frontend.md, "Problem-size options of the studies".
"""
from __future__ import annotations

import itertools
import json
import math
import os

#: The problem options and the point keys they set.
OPTION_KEYS = {
    "dim": ("d",),
    "scale": ("qk_scale",),
    "maps": ("feature_map",),
    "m": ("num_features",),
    "n": ("n", "n_pairs"),
    "seeds": ("seed",),
}
#: The studies whose commands take the problem options.
PROBLEM_STUDIES = ("error", "rank", "recall")
#: Top-level keys of a report description (besides one table per study).
CONFIG_KEYS = ("profile", "device", "out", "studies", "workers", "scheduler")


class OptionError(ValueError):
    """A problem option or a report description that cannot be applied (the message says which and why)."""


# ---------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(name, x, *, minimum=1) -> int:
    if isinstance(x, str):
        try:
            x = int(x.strip())
        except ValueError:
            raise OptionError(f"{name} must be an integer >= {minimum}, got {x!r}") from None
    if not _is_int(x) or x < minimum:
        raise OptionError(f"{name} must be an integer >= {minimum}, got {x!r}")
    return x


def _no_empty_item(name, text: str, example: str) -> None:
    """OptionError when the comma-separated ``text`` has an empty item (``"16,,32"``, ``"16,"``): a value
    left out by mistake is not skipped silently."""
    parts = text.replace(" ", "").split(",")
    if text.strip() and any(not p for p in parts):
        raise OptionError(f"{name} has an empty item in {text!r}: separate the values by single commas "
                          f"(e.g. {example})")


def _values(name, x, one, *, what, example) -> list:
    """A comma-separated string, one value or a list or tuple of them, each checked by ``one(name, value)``:
    duplicates removed, in order."""
    if isinstance(x, str):
        _no_empty_item(name, x, example)
        x = [p for p in x.replace(" ", "").split(",") if p]
        if not x:
            raise OptionError(f"{name} must list {what} (e.g. {example}), got an empty string")
    elif not isinstance(x, (list, tuple)):
        x = [x]
    if not x:
        raise OptionError(f"{name} must list {what} (e.g. {example}), got an empty list")
    return list(dict.fromkeys(one(name, v) for v in x))


def _int_list(name, x) -> list:
    return _values(name, x, _int, what="integers >= 1", example="64,256")


def _positive_float(name, x) -> float:
    if isinstance(x, str):
        try:
            x = float(x)
        except ValueError:
            raise OptionError(f"{name} must be a positive number, got {x!r}") from None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        raise OptionError(f"{name} must be a positive finite number, got {x!r}")
    return float(x)


def _positive_float_list(name, x) -> list:
    return _values(name, x, _positive_float, what="positive numbers", example="0.5,1")


def _names(name, x) -> list:
    if isinstance(x, str):
        _no_empty_item(name, x, "elu,favor+")
        x = [p for p in x.replace(" ", "").split(",") if p]
    if not isinstance(x, (list, tuple)) or not x or not all(isinstance(v, str) and v for v in x):
        raise OptionError(f"{name} must be a non-empty list of feature map names, got {x!r}")
    return list(dict.fromkeys(x))


#: The largest ``seeds`` count an option may ask for: every seed is a point of every setting.
MAX_SEEDS = 100_000


def check_options(options: dict, *, where: str = "", section: str = "") -> dict:
    """``options`` with checked, normalised values (lists of ints for ``m``/``n``, ...).

    ``where`` starts every message (e.g. the file); ``section`` prefixes the option's name (``"--"``
    on the command line, ``"error."`` in a file).  OptionError names an unknown option or a bad value.
    """
    checked = {}
    for key, value in options.items():
        name = f"{where}{section}{key}"
        if key not in OPTION_KEYS:
            raise OptionError(f"{where}unknown key {section + key!r}; allowed: {', '.join(OPTION_KEYS)}")
        if value is None:
            continue
        if key in ("dim", "seeds"):
            checked[key] = _int(name, value)
            if key == "seeds" and checked[key] > MAX_SEEDS:  # range(10**23) overflowed; 10**9 ran out of memory
                raise OptionError(f"{name} must be at most {MAX_SEEDS} (each seed is a point of every setting), "
                                  f"got {checked[key]}")
        elif key == "scale":
            checked[key] = _positive_float_list(name, value)
        elif key == "maps":
            checked[key] = _names(name, value)
        else:
            checked[key] = _int_list(name, value)
    return checked


# ---------------------------------------------------------------------------
# points
# ---------------------------------------------------------------------------
def _has(points, key) -> bool:
    return any(key in p for p in points)


def _expand(points, key, values) -> list:
    return [dict(p, **{key: v}) for p in points for v in values] if values else points


def apply_overrides(points: list, options: dict, *, study: str, section: str = "") -> list:
    """The points of ``study`` changed by the checked problem ``options`` (:func:`check_options`): new
    points, duplicates removed, in order.  OptionError for an option the points have no key for, an
    unknown map name, or ``m`` when none of the selected maps is random; ``section`` prefixes the option's
    name in it, as :func:`check_options`'s (``"--"`` on the command line).

    Examples
    --------
    >>> pts = [dict(feature_map="elu", num_features=None, n=64, d=8, seed=0),
    ...        dict(feature_map="favor+", num_features=16, n=64, d=8, seed=0)]
    >>> [(p["feature_map"], p["num_features"], p["n"]) for p in
    ...  apply_overrides(pts, {"maps": ["favor+"], "m": [8, 32], "n": [128]}, study="error")]
    [('favor+', 8, 128), ('favor+', 32, 128)]
    """
    from .studies._maps import buildable_maps, is_random
    from .studies.sweep import point_key

    pts = [dict(p) for p in points]
    if not pts:
        return pts
    for key, value in options.items():
        keys = OPTION_KEYS[key]
        if value is not None and not any(_has(pts, k) for k in keys):
            raise OptionError(f"the {study} study does not take {section + key!r}: its points have no "
                              f"{' or '.join(repr(k) for k in keys)}")
    if "maps" in options:
        pts = _select_maps(pts, options["maps"], study=study, buildable=buildable_maps(), is_random=is_random,
                           m_default=(options.get("m") or [None])[0], section=section)
    if "dim" in options:
        if study == "recall":  # its key scales and value widths are functions of d
            from .studies.recall import with_dim

            pts = [with_dim(p, options["dim"]) for p in pts]
        else:
            pts = [dict(p, d=options["dim"]) if "d" in p else p for p in pts]
    if "scale" in options:  # one regime per scale, in place of the profile's
        pts = [q for p in pts for q in ([dict(p, qk_scale=s) for s in options["scale"]] if "qk_scale" in p
                                        else [p])]
    if "m" in options:
        if not any(p.get("num_features") is not None for p in pts):
            raise OptionError(f"{section}m: none of the {study} study's selected maps is random "
                              "(m is the number of random features, e.g. of favor+ or rff)")
        pts = [q for p in pts for q in ([dict(p, num_features=m) for m in options["m"]]
                                        if p.get("num_features") is not None else [p])]
    if "n" in options:
        if _has(pts, "n"):
            pts = [q for p in pts for q in (_expand([p], "n", options["n"]) if "n" in p else [p])]
        else:
            pts = [dict(p, n_pairs=sorted(options["n"])) if "n_pairs" in p else p for p in pts]
    if "seeds" in options:
        seeds = list(range(options["seeds"]))
        pts = [q for p in pts for q in (_expand([p], "seed", seeds) if "seed" in p else [p])]
    unique = {}
    for p in pts:
        unique.setdefault(point_key(p), p)  # duplicates removed, the first kept, in order
    return list(unique.values())


#: The options whose list is one value of the study's ``points`` keyword (the maps to run); the others list
#: values the grid is expanded over, each passed to ``points`` alone by :func:`check_study_values`.
WHOLE_LIST_OPTIONS = ("maps",)


def check_study_values(study, options: dict, ctx, *, section: str = "") -> None:
    """Refuse what ``study``'s own ``points`` refuses among the checked ``options`` (:func:`check_options`).

    Each option that is a keyword of ``study.points`` is passed to it as ``run_report(options=...)``
    passes it, one value at a time (``maps`` as its whole list, and given with each other value), so that
    the command line refuses what the study refuses through the library (such as the rank study's
    N >= 2); then, with two or more besides ``maps``, all together (``maps`` and ``n`` as whole lists, the
    others one value at a time), so that options that fit alone but make a point too large together
    (``dim`` with ``n``: the studies' own size checks against ``config.QUADRATIC_MAX_ELEMENTS``) are
    refused before anything runs.

    Parameters
    ----------
    study : Study
        The study whose ``points`` checks the values.
    options : dict
        Checked problem options.
    ctx : Context
        The context the points are built for.
    section : str, default ""
        Prefixes the option's name in the message (``"--"`` on the command line).

    Raises
    ------
    OptionError
        Naming the option and the value, with the study's own reason.
    """
    import inspect

    params = inspect.signature(study.points).parameters
    accepted = [name for name, p in params.items() if p.kind == p.KEYWORD_ONLY]
    given = {key: value for key, value in options.items() if key in accepted and value is not None}
    # the maps to run first (alone), then each other value with them: a dim that fits the maps
    # chosen is not refused for a default map left out (the size checks of the recall and rank studies)
    chosen = {key: value for key, value in given.items() if key in WHOLE_LIST_OPTIONS}
    for key in list(chosen) + [key for key in given if key not in chosen]:
        value = given[key]
        values = [value] if key in WHOLE_LIST_OPTIONS or not isinstance(value, (list, tuple)) else value
        for one in values:
            try:
                study.points(ctx, **({key: one} if key in chosen else dict(chosen, **{key: one})))
            except (TypeError, ValueError) as exc:
                shown = ",".join(map(str, one)) if isinstance(one, (list, tuple)) else one
                raise OptionError(f"{section}{key} {shown}: {exc}") from None
    # then together (each alone may fit, e.g. dim and n, where the point they make together is too
    # large): maps and n as whole lists (as points takes them), the others one value at a time
    if len(given) - len(chosen) < 2:
        return
    whole = WHOLE_LIST_OPTIONS + ("n",)
    fixed = {key: value for key, value in given.items() if key in whole or not isinstance(value, (list, tuple))}
    varied = [key for key in given if key not in fixed]
    for combo in itertools.product(*(given[key] for key in varied)):
        kw = dict(fixed, **dict(zip(varied, combo)))
        try:
            study.points(ctx, **kw)
        except (TypeError, ValueError) as exc:
            shown = ", ".join(f"{section}{key} " + (",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v))
                              for key, v in kw.items() if key not in chosen)
            raise OptionError(f"{shown}: {exc}") from None


def _select_maps(pts, names, *, study, buildable, is_random, m_default, section=""):
    present = list(dict.fromkeys(p["feature_map"] for p in pts if "feature_map" in p))
    out = [p for p in pts if p.get("feature_map") in names]
    for name in names:
        if name in present:
            continue
        if name not in buildable:
            from . import feature_maps as fm

            why = ("is not registered" if name not in fm.available() and name != "softmax" else
                   "is not part of this study" if name == "softmax" else
                   "needs parameters the study cannot choose")
            raise OptionError(f"{section}maps: {name!r} {why}; the {study} study has: {', '.join(present)}")
        rand = is_random(name)
        same = [t for t in present if t in buildable and is_random(t) == rand]
        plain = [t for t in same if all(not p.get("map_params") for p in pts if p.get("feature_map") == t)]
        template = (plain or same or [t for t in present if t in buildable] or [None])[0]
        if template is None:
            raise OptionError(f"{section}maps: the {study} study has no feature map to model {name!r}'s points "
                              "on")
        for p in pts:
            if p.get("feature_map") != template:
                continue
            q = dict(p, feature_map=name)
            if "map_params" in q:
                q["map_params"] = {}
            if "num_features" in q:
                if not rand:
                    q["num_features"] = None
                elif q["num_features"] is None:
                    q["num_features"] = m_default or 64
            out.append(q)
    return out


# ---------------------------------------------------------------------------
# report descriptions
# ---------------------------------------------------------------------------
def load_config(path) -> dict:
    """Read and check a report description (TOML, or JSON for a ``.json`` file).

    The description has the top-level keys of :data:`CONFIG_KEYS` (all
    optional) and one table per study with problem options, e.g.::

        profile = "quick"
        studies = ["error", "recall"]

        [error]
        dim = 32
        scale = 1.0
        maps = ["elu", "favor+", "taylor2"]
        m = [64, 256]
        seeds = 5

    Returns ``{"profile", "device", "out", "studies", "workers", "scheduler"}`` (None where absent)
    and ``"options"`` (study name -> checked options).  OptionError, naming the file and the key,
    when the file cannot be read or parsed or a key or value is wrong.
    """
    from .studies import PROFILES, get_study

    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise OptionError(f"--config {path!r}: {exc.strerror or exc}") from None
    try:
        if path.endswith(".json"):
            data = json.loads(raw.decode("utf-8"))
        else:
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise OptionError(f"--config {path!r}: reading TOML needs Python >= 3.11 (tomllib); "
                                  "use a .json file") from None
            data = tomllib.loads(raw.decode("utf-8"))
    except OptionError:
        raise
    except Exception as exc:  # noqa: BLE001 - JSON/TOML/Unicode errors, reported in one line
        raise OptionError(f"--config {path!r}: cannot be parsed: {exc}") from None
    if not isinstance(data, dict):
        raise OptionError(f"--config {path!r}: must hold a table (a JSON object), got {type(data).__name__}")
    where = f"--config {path!r}: "
    conf = {key: None for key in CONFIG_KEYS}
    conf["options"] = {}
    study_names = {}
    for key, value in data.items():
        if key in CONFIG_KEYS:
            conf[key] = value
            continue
        try:
            study = get_study(key)
        except KeyError:
            study = None
        if study is None or not isinstance(value, dict):
            what = "a table of options" if study is not None else "a known key"
            raise OptionError(f"{where}{key!r} is not {what}; allowed: {', '.join(CONFIG_KEYS)} and one table "
                              f"per study ({', '.join(PROBLEM_STUDIES)})")
        if study.name not in PROBLEM_STUDIES:
            raise OptionError(f"{where}[{key}]: the {study.name} study takes no options "
                              f"(those that do: {', '.join(PROBLEM_STUDIES)})")
        study_names[study.name] = key
        conf["options"][study.name] = check_options(value, where=where, section=f"{key}.")
    if conf["profile"] is not None and conf["profile"] not in PROFILES:
        raise OptionError(f"{where}profile must be one of {', '.join(PROFILES)}, got {conf['profile']!r}")
    if conf["device"] is not None and conf["device"] not in ("auto", "cpu", "cuda"):
        raise OptionError(f"{where}device must be 'auto', 'cpu' or 'cuda', got {conf['device']!r}")
    for key in ("out", "scheduler"):
        if conf[key] is not None and (not isinstance(conf[key], str) or not conf[key]):
            raise OptionError(f"{where}{key} must be a non-empty string, got {conf[key]!r}")
    if conf["workers"] is not None:
        conf["workers"] = _int(f"{where}workers", conf["workers"])
    if conf["studies"] is not None:
        names = conf["studies"]
        if not isinstance(names, list) or not names or not all(isinstance(s, str) for s in names):
            raise OptionError(f"{where}studies must be a non-empty list of study names, got {names!r}")
        resolved = []
        for s in names:
            try:
                resolved.append(get_study(s).name)
            except KeyError as exc:
                raise OptionError(f"{where}studies: {exc.args[0]}") from None
        conf["studies"] = list(dict.fromkeys(resolved))
        for name, key in study_names.items():
            if name not in conf["studies"]:
                raise OptionError(f"{where}[{key}] sets options of the {name} study, which 'studies' leaves out")
    return conf
