"""The method table: which launcher runs which (method, causal, device).

Every implementation of linear attention registers itself here with
:func:`register_method`; the public function :func:`linattn_nb.linear_attention`
looks methods up through :func:`get_method` and resolves ``method="auto"``
through :func:`select_auto`.  A launcher has the uniform signature::

    launcher(q, k, v, S, z, out, *, code, eps) -> out

with ``q, k`` of shape (B, N, F) (raw inputs when ``code`` > 0 and the method
applies maps inline, else features), ``v`` (B, N, M), the state ``S`` (B, F, M)
and ``z`` (B, F) updated in place from the initial to the final state, and
``out`` (B, N, M) written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Tuple

import numpy as np

from .. import config

METHOD_NAMES = ("auto", "quadratic", "scan", "chunked", "aggregate")


@dataclass(frozen=True)
class Method:
    """One registered implementation.

    Attributes
    ----------
    name : str
        The ``method=`` name.
    causal : bool
    device : str
        ``"cpu"`` or ``"cuda"``.
    launcher : callable
        See the module docstring.
    inline_features : bool
        The launcher applies elementwise maps itself (``code`` > 0).
    native_dtypes : frozenset of numpy.dtype
        Dtypes the launcher takes as they are; inputs of other supported
        dtypes are computed in float32 and cast back.
    """

    name: str
    causal: bool
    device: str
    launcher: Callable
    inline_features: bool = True
    native_dtypes: frozenset = field(
        default_factory=lambda: frozenset({np.dtype(np.float32), np.dtype(np.float64)})
    )


_METHODS: Dict[Tuple[str, bool, str], Method] = {}


def register_method(method: Method, *, overwrite: bool = False) -> None:
    key = (method.name, method.causal, method.device)
    if key in _METHODS and not overwrite:
        raise ValueError(f"method {key} already registered")
    _METHODS[key] = method


def available_methods(*, causal: bool, device: str = "cpu") -> list[str]:
    return sorted(name for (name, c, d) in _METHODS if c == causal and d == device)


def get_method(name: str, *, causal: bool, device: str) -> Method:
    if not isinstance(name, str):
        raise TypeError(f"method must be a string, got {type(name).__name__}")
    key = (name, causal, device)
    if key not in _METHODS:
        if name not in METHOD_NAMES:
            raise ValueError(
                f"unknown method {name!r}; choose one of {', '.join(repr(m) for m in METHOD_NAMES)}"
            )
        avail = available_methods(causal=causal, device=device)
        raise ValueError(
            f"method {name!r} is not available for causal={causal} on device {device!r}; "
            f"available: {', '.join(repr(m) for m in ['auto'] + avail)}"
        )
    return _METHODS[key]


def select_auto(*, causal: bool, device: str, batch: int, n: int, d: int, m: int, dtype) -> str:
    """Resolve ``method="auto"`` from the measured table in :mod:`linattn_nb.config`.

    ``config.AUTO_METHODS[(causal, device)]`` is a list of ``(max_n, method)``
    rows, the first row with ``n <= max_n`` wins (``None`` = no limit); rows
    naming a method that is not registered are skipped.
    """
    table = config.AUTO_METHODS.get((bool(causal), device), ())
    for max_n, name in table:
        if (max_n is None or n <= max_n) and (name, causal, device) in _METHODS:
            return name
    avail = available_methods(causal=causal, device=device)
    for fallback in ("chunked", "scan", "aggregate", "quadratic"):
        if fallback in avail:
            return fallback
    raise ValueError(f"no method registered for causal={causal} on device {device!r}")
