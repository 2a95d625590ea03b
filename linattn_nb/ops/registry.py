"""The method table: which launcher runs which (rule, causal, method, device).

The forward launcher contract: ``docs/launchers.md``, "Sequence methods".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from .. import config

METHOD_NAMES = ("auto", "quadratic", "scan", "chunked", "aggregate")


@dataclass(frozen=True)
class Rule:
    """A state-update rule as the kernels know it (registered by :mod:`linattn_nb.ops.methods` from
    :data:`linattn_nb.ops._codes.RULES`); everything else about it is :class:`linattn_nb.rules.UpdateRule`'s.

    Attributes
    ----------
    name : str
        The registry name (``"additive"``).
    code : int
        The integer the kernels' per-rule hooks branch on (0 for additive).
    inputs : tuple of str
        Per-token inputs besides q, k, v, passed to the launcher as ``inputs``.
    """

    name: str
    code: int = 0
    inputs: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Method:
    """One registered implementation.

    Attributes
    ----------
    rule : str
        The :class:`Rule` it implements.
    name : str
        The ``method=`` name.
    causal : bool
    device : str
        ``"cpu"`` or ``"cuda"``.
    forward : callable
        The forward launcher (contract: ``docs/launchers.md``).
    backward : callable or None
        The backward launcher, when the method has one.
    inline_features : bool
        The launcher applies elementwise maps itself (``code`` > 0).
    native_dtypes : frozenset of numpy.dtype
        Dtypes the launcher takes as they are (others are computed in float32 and cast back).
    kind : str
        ``"sequence"`` or ``"step"`` (decoding).
    grad_pair : tuple of int or None
        ``(chunk, row block)`` of the fused normalised CPU backward a gradient of this method runs
        (:func:`linattn_nb.ops.grad.cpu.backward_chunked_normalized`), where this machine's calibration set
        one (:func:`grad_pair`); None: ``config``'s.
    """

    rule: str
    name: str
    causal: bool
    device: str
    forward: Callable
    backward: Optional[Callable] = None
    inline_features: bool = True
    native_dtypes: frozenset = field(
        default_factory=lambda: frozenset({np.dtype(np.float32), np.dtype(np.float64)})
    )
    kind: str = "sequence"
    grad_pair: Optional[Tuple[int, int]] = None

    @property
    def key(self) -> tuple:
        return (self.rule, self.causal, self.name, self.device)


_RULES: Dict[str, Rule] = {}
_METHODS: Dict[Tuple[str, bool, str, str], Method] = {}


def register_rule(rule: Rule, *, overwrite: bool = False) -> Rule:
    """Add an update rule to the table."""
    if rule.name in _RULES and not overwrite:
        raise ValueError(f"rule {rule.name!r} already registered")
    _RULES[rule.name] = rule
    return rule


def get_rule(name: str) -> Rule:
    """The registered :class:`Rule` called ``name``."""
    if not isinstance(name, str):
        raise TypeError(f"rule must be a string, got {type(name).__name__}")
    try:
        return _RULES[name]
    except KeyError:
        raise ValueError(f"unknown rule {name!r}; registered: {', '.join(map(repr, sorted(_RULES)))}") from None


def available_rules() -> list[str]:
    return sorted(_RULES)


def register_method(method: Method, *, overwrite: bool = False) -> None:
    """Add an implementation under ``(rule, causal, method, device)``."""
    if method.rule not in _RULES:
        raise ValueError(f"method {method.key} names an unregistered rule {method.rule!r}")
    if method.key in _METHODS and not overwrite:
        raise ValueError(f"method {method.key} already registered")
    _METHODS[method.key] = method


def available_methods(*, causal: bool, device: str = "cpu", rule: str = "additive",
                      kind: str = "sequence") -> list[str]:
    """Names of the registered methods for a rule, causality and device."""
    return sorted(m.name for m in _METHODS.values()
                  if m.rule == rule and m.causal == causal and m.device == device and m.kind == kind)


def get_method(name: str, *, causal: bool, device: str, rule: str = "additive") -> Method:
    """The :class:`Method` registered under ``(rule, causal, name, device)``."""
    if not isinstance(name, str):
        raise TypeError(f"method must be a string, got {type(name).__name__}")
    key = (rule, causal, name, device)
    if key not in _METHODS:
        get_rule(rule)
        if name not in METHOD_NAMES and name != "step":
            raise ValueError(
                f"unknown method {name!r}; choose one of {', '.join(repr(m) for m in METHOD_NAMES)}"
            )
        avail = available_methods(causal=causal, device=device, rule=rule)
        raise ValueError(
            f"method {name!r} is not available for causal={causal} on device {device!r} "
            f"(rule {rule!r}); available: {', '.join(repr(m) for m in ['auto'] + avail)}"
        )
    return _METHODS[key]


#: ``(rule, dtype) -> rows or None``: this machine's calibration of ``method="auto"`` (causal CPU),
#: installed by :func:`linattn_nb._tune.install` when the front end is imported; None until then.
_calibration = None


def set_calibration(lookup, pairs=None, grad_pairs=None) -> None:
    """Install the calibration lookups :func:`select_auto`, :func:`chunk_pair` and :func:`grad_pair` consult
    (None removes them)."""
    global _calibration, _pairs, _grad_pairs
    _calibration = lookup
    _pairs = pairs
    _grad_pairs = grad_pairs


#: ``(rule, dtype, f, m, auto) -> (chunk, row block) or None``: the pair a causal CPU chunked call runs
#: (:func:`linattn_nb._tune.chunk_choice`), installed with :data:`_calibration`.
_pairs = None


def chunk_pair(rule: str, dtype, f: int, m: int, *, auto: bool):
    """The ``(chunk, row block)`` a causal CPU chunked call of ``rule`` runs, from this machine's calibration
    (``auto``: the call asked for ``method="auto"``), or None for ``config``'s (``docs/tuning.md``)."""
    return None if _pairs is None else _pairs(rule, dtype, f, m, auto=auto)


#: ``(rule, dtype, f, m, auto) -> (chunk, row block) or None``: the pair the fused normalised CPU backward runs
#: (:func:`linattn_nb._tune.grad_choice`), installed with :data:`_calibration`.
_grad_pairs = None


def grad_pair(rule: str, dtype, f: int, m: int, *, auto: bool):
    """The ``(chunk, row block)`` the fused normalised CPU backward of a causal chunked ``rule`` runs, from this
    machine's calibration (``auto``: the call asked for ``method="auto"``), or None for ``config``'s
    (``docs/tuning.md``)."""
    return None if _grad_pairs is None else _grad_pairs(rule, dtype, f, m, auto=auto)


def select_auto(*, causal: bool, device: str, n: int, dtype, rule: str = "additive") -> str:
    """Resolve ``method="auto"`` from the measured table in :mod:`linattn_nb.config`.

    The first ``(max_n, method)`` row of ``config.AUTO_METHODS[(rule, causal, device)]`` with
    ``n <= max_n`` (``None``: no limit) whose method is registered; causal on the CPU, this
    machine's calibration replaces the rows when ``config.AUTO_TUNE`` allows it (``docs/tuning.md``).
    The batch and the feature and value widths do not enter the choice (the tables and the calibration
    are measured at D = M = 64), so they are not arguments.
    """
    table = None
    if causal and device == "cpu" and config.AUTO_TUNE != "off" and _calibration is not None:
        table = _calibration(rule, np.dtype(dtype))
    if table is None:
        table = config.AUTO_METHODS.get((rule, bool(causal), device), ())
    for max_n, name in table:
        if (max_n is None or n <= max_n) and (rule, causal, name, device) in _METHODS:
            return name
    avail = available_methods(causal=causal, device=device, rule=rule)
    for fallback in ("chunked", "scan", "aggregate", "quadratic"):
        if fallback in avail:
            return fallback
    raise ValueError(f"no method registered for rule {rule!r} with causal={causal} on device {device!r}")
