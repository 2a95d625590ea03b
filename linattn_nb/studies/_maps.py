"""Building feature maps from JSON sweep parameters (a name plus numbers), inside a study's ``run``:
one instance per point, so that a random map is drawn once per point.
"""
from __future__ import annotations

import inspect


def factory_params(name: str) -> set:
    """Keyword parameters the registered factory of ``name`` accepts (empty if unknown)."""
    from .. import feature_maps as fm

    try:
        factory = fm.factory(name)
    except KeyError:
        return set()
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return set()
    return {p.name for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}


def is_random(name: str) -> bool:
    """True for maps with random features (their factory takes ``num_features``)."""
    return "num_features" in factory_params(name)


def build_map(name: str, *, dim=None, num_features=None, seed=None, **params):
    """``feature_maps.get(name, ...)`` passing ``dim``, ``num_features``, ``seed`` where accepted."""
    from .. import feature_maps as fm

    accepted = factory_params(name)
    kw = dict(params)
    for key, value in (("dim", dim), ("num_features", num_features), ("seed", seed)):
        if value is not None and key in accepted:
            kw[key] = value
    return fm.get(name, **kw)


def buildable_maps(*, positive_only: bool = False, defaults: bool = False) -> list[str]:
    """Registered maps that build with at most ``dim``/``num_features``/``seed`` given.

    ``defaults``: leave out the maps whose default features are another's (``FeatureMap.same_as``).
    """
    from .. import feature_maps as fm

    names = []
    for name in fm.available():
        try:
            fmap = build_map(name, seed=0)
        except Exception:  # the map needs parameters a study cannot guess
            continue
        if positive_only and not fmap.is_positive:
            continue
        if defaults and getattr(fmap, "same_as", None) in fm.available():
            continue
        names.append(name)
    return names


def map_label(name: str, num_features=None, params=None) -> str:
    extra = [f"m={num_features}"] if num_features is not None else []
    extra += [f"{k}={v}" for k, v in (params or {}).items()]
    return f"{name} ({', '.join(extra)})" if extra else name


def map_arrays(name: str, d: int, *, num_features=None, **params) -> tuple:
    """``(D_φ, arrays)`` of map ``name`` at key dimension ``d``, found without drawing its random matrix.

    ``arrays``: the ``(what, rows, cols)`` the map itself forms at ``d`` (a random map's ``m x d``
    projection and, when orthogonal, its ``d x d`` blocks), for :func:`._study.check_point_size`.
    """
    from ..analysis._common import map_arrays as own

    fmap = build_map(name, num_features=num_features, seed=0, **params)  # no dim: nothing drawn yet
    return int(fmap.output_dim(d)), own(fmap, d)
