"""The registry of feature maps by name (:func:`register`, :func:`get`, :func:`resolve`, ...); the
built-in maps are registered at the end of this module, always in the same order."""
from __future__ import annotations

import inspect
import os
import sys
import warnings
from typing import Callable, Dict, Union

import numpy as np

from ..ops._codes import (KERNEL_CODE_ELU, KERNEL_CODE_L2, KERNEL_CODE_NONE, KERNEL_CODE_RELU, KERNEL_CODE_SILU_L2,
                          KERNEL_CODE_SQUARED_RELU)
from ._base import FeatureMap
from ._elementwise import EluFeatureMap, IdentityFeatureMap, ReluFeatureMap, SquaredReluFeatureMap
from ._learned import HedgehogFeatureMap, T2RFeatureMap
from ._normalized import L2FeatureMap, SiluL2FeatureMap
from ._polynomial import DpfpFeatureMap, Taylor2FeatureMap
from ._positional import CosformerFeatureMap
from ._random import FavorPlusFeatureMap, RandomFeatureMap, RandomFourierFeatureMap

#: The map codes the kernels apply inline (:mod:`linattn_nb.ops._codes`; 0: the inputs are the features).
KERNEL_CODES = (KERNEL_CODE_NONE, KERNEL_CODE_ELU, KERNEL_CODE_RELU, KERNEL_CODE_SQUARED_RELU, KERNEL_CODE_L2,
                KERNEL_CODE_SILU_L2)


Factory = Callable[..., FeatureMap]
REGISTRY: Dict[str, Factory] = {}


def register(name: str, factory: Factory, *, overwrite: bool = False) -> None:
    """Register a feature map under ``name``.

    Parameters
    ----------
    name : str
        Registry name (case-sensitive, non-empty).
    factory : callable
        A :class:`FeatureMap` subclass, or a callable of the map's keyword parameters returning one.
    overwrite : bool, default False
        Replace an existing registration of the same name.

    Raises
    ------
    ValueError
        If ``name`` is empty or already registered and ``overwrite`` is False.
    TypeError
        If ``name`` is not a string, or ``factory`` is not callable.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a non-empty string, got {type(name).__name__} {name!r}")
    if not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if isinstance(factory, FeatureMap):
        raise TypeError(
            f"register({name!r}, ...) needs a FeatureMap class or a factory that builds one, got an instance "
            f"of {type(factory).__name__}; register the class (register({name!r}, {type(factory).__name__})) "
            "or pass the instance itself as feature_map="
        )
    if not callable(factory):
        raise TypeError(f"factory for {name!r} must be callable, got {type(factory).__name__}")
    if name in REGISTRY and not overwrite:
        raise ValueError(f"feature map {name!r} is already registered; pass overwrite=True to replace it")
    REGISTRY[name] = factory


def available() -> list[str]:
    """Names of the registered feature maps, sorted."""
    return sorted(REGISTRY)


def factory(name: str) -> Factory:
    """The class or factory registered under ``name``.

    Raises
    ------
    KeyError
        If no map of that name is registered (the message lists those that are).
    """
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise KeyError(f"unknown feature map {name!r}; available: {', '.join(available())}") from None


def _check_parameters(name: str, make, params: dict) -> None:
    """TypeError naming the map and the parameters it takes when ``params`` holds one it does not (a
    factory taking ``**kwargs``, or one whose signature cannot be read, is called as it is)."""
    try:
        sig = inspect.signature(make)
    except (TypeError, ValueError):
        return
    takes = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    unknown = sorted(set(params) - set(takes))
    if unknown:
        raise TypeError(f"feature map {name!r} takes no parameter(s) {unknown}; its parameters: "
                        f"{', '.join(takes) if takes else 'none'}")


def get(name: str, **params) -> FeatureMap:
    """Build the registered feature map ``name`` with ``params``.

    Raises
    ------
    KeyError
        If no map of that name is registered (the message lists those that are).
    """
    if isinstance(name, FeatureMap):
        if params:
            raise TypeError("parameters given together with a FeatureMap instance")
        return name
    make = factory(name)
    if params:  # no parameter cannot be an unknown one; inspect.signature costs 0.4 ms a call (a map by name)
        _check_parameters(name, make, params)
    fmap = make(**params)
    if not isinstance(fmap, FeatureMap):
        raise TypeError(f"factory of feature map {name!r} returned {type(fmap).__name__}, not a FeatureMap")
    return fmap


def resolve(feature_map: Union[str, FeatureMap, None]) -> FeatureMap:
    """Turn the ``feature_map`` argument of the public functions into a map.

    ``None`` means "q and k already are features" (the identity map).
    """
    if feature_map is None:
        return IdentityFeatureMap()
    if isinstance(feature_map, FeatureMap):
        return _check_kernel_code(feature_map)
    if isinstance(feature_map, str):
        try:
            fmap = _check_kernel_code(get(feature_map))
        except KeyError as exc:
            raise ValueError(f"feature_map: {exc.args[0]}") from None
        warned = _warned_by_name()
        if isinstance(fmap, RandomFeatureMap) and feature_map not in warned:
            warned.add(feature_map)
            warnings.warn(
                f"feature_map={feature_map!r} given by name builds a new, unseeded map at every call: "
                "each call draws another random projection W (results differ from call to call, and "
                "calls linked by initial_state do not share W). Build the map once, e.g. "
                f"feature_maps.get({feature_map!r}, dim=D, num_features=m, seed=0), and pass it instead. "
                "(Shown once per process for each map name.)",
                UserWarning, stacklevel=_outside_stacklevel(),
            )
        return fmap
    raise TypeError(
        "feature_map must be a registered name, a FeatureMap instance or None, "
        f"got {type(feature_map).__name__}"
    )


#: The linattn_nb folder (this file is in linattn_nb/feature_maps/), with a trailing separator.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _warned_by_name() -> set:
    """The package's ``_WARNED_BY_NAME``: random maps whose by-name use has warned in this process, looked
    up at every call (rebinding it there starts afresh)."""
    return sys.modules[__package__]._WARNED_BY_NAME


def _outside_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside this package (for a warning raised deep inside it)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def _check_kernel_code(fmap: FeatureMap) -> FeatureMap:
    code = fmap.kernel_code
    if code is not None and (isinstance(code, bool) or not isinstance(code, (int, np.integer))
                             or int(code) not in KERNEL_CODES):
        raise ValueError(
            f"feature map {fmap.name!r} has kernel_code {code!r}; the kernels know "
            f"{', '.join(map(str, KERNEL_CODES))} (identity, ELU+1, ReLU, squared ReLU, L2, SiLU then L2) or None "
            "(the map is applied in NumPy)"
        )
    return fmap


def inline_maps() -> list[str]:
    """Names of the registered maps with an inline kernel form (``kernel_code`` not None)."""
    names = []
    for nm in available():
        try:
            if get(nm).kernel_code is not None:
                names.append(nm)
        except Exception:  # maps that need parameters
            continue
    return names


register("elu", EluFeatureMap)
register("relu", ReluFeatureMap)
register("squared_relu", SquaredReluFeatureMap)
register("identity", IdentityFeatureMap)
register("dpfp", DpfpFeatureMap)
register("favor+", FavorPlusFeatureMap)
register("rff", RandomFourierFeatureMap)
register("taylor2", Taylor2FeatureMap)
register("cosformer", CosformerFeatureMap)
register("hedgehog", HedgehogFeatureMap)
register("t2r", T2RFeatureMap)
register("l2", L2FeatureMap)
register("silu_l2", SiluL2FeatureMap)
