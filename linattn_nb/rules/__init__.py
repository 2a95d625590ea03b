"""The update rules: one module per rule, and the registry that every other part asks.

Each rule is an :class:`~linattn_nb.rules._base.UpdateRule` record in its own module
(``linattn_nb/rules/<name>.py``), registered below; a call's ``decay``/``log_decay`` and ``beta``
select the rule (:func:`rule_for`).  The rules and their recurrences: docs/guide/rules.md; adding
one: docs/adding_an_update_rule.md.

Examples
--------
>>> from linattn_nb import rules
>>> rules.get_rule("gated_delta").normalize
False
>>> rules.rule_for(factor="scalar", beta=True).name
'gated_delta'
>>> rules.rule_names()
('additive', 'decay', 'gate', 'delta', 'gated_delta')
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from ..ops._codes import RULES as _KERNEL_RULES
from . import additive, decay, delta, gate, gated_delta
from . import delta_product, gated_delta_product, kda, rwkv7
from ._base import FACTOR_KINDS, UpdateRule
from ._base import reference as _reference_loop
from ._dplr import DPLRRule

#: Every update rule by name, in the order the documentation lists them.
RULES: Dict[str, UpdateRule] = {}


def register(rule: UpdateRule, *, overwrite: bool = False) -> UpdateRule:
    """Add ``rule`` to :data:`RULES`.

    Its code and kernel inputs must be those of its entry in :data:`linattn_nb.ops._codes.RULES`.
    Raises ValueError otherwise, or when the name or the combination of ``factor`` and ``beta`` is
    already taken (unless ``overwrite``).
    """
    if not isinstance(rule, UpdateRule):
        raise TypeError(f"rule must be an UpdateRule, got {type(rule).__name__}")
    entry = _KERNEL_RULES.get(rule.name)
    if entry is None or entry[0] != rule.code or tuple(sorted(entry[1])) != tuple(sorted(rule.kernel_inputs)):
        raise ValueError(f"rule {rule.name!r} (code {rule.code}, inputs {rule.kernel_inputs}) is not in the "
                         f"kernels' rule table linattn_nb.ops._codes.RULES (got {entry!r})")
    if not overwrite:
        if rule.name in RULES:
            raise ValueError(f"rule {rule.name!r} already registered")
        for other in RULES.values():
            if (other.factor, other.beta) == (rule.factor, rule.beta):
                raise ValueError(f"rule {rule.name!r} takes the same arguments as {other.name!r} "
                                 f"(factor={rule.factor!r}, beta={rule.beta})")
    RULES[rule.name] = rule
    return rule


for _module in (additive, decay, gate, delta, gated_delta):
    register(_module.RULE)
del _module


def rule_names() -> Tuple[str, ...]:
    """The registered rules' names."""
    return tuple(RULES)


def get_rule(rule) -> UpdateRule:
    """The :class:`UpdateRule` called ``rule`` (an UpdateRule is returned as it is).

    Raises TypeError for a non-string, ValueError naming the registered rules
    for an unknown name.
    """
    if isinstance(rule, UpdateRule):
        return rule
    if not isinstance(rule, str):
        raise TypeError(f"rule must be a string, got {type(rule).__name__}")
    try:
        return RULES[rule]
    except KeyError:
        raise ValueError(f"unknown rule {rule!r}; registered: {', '.join(map(repr, RULES))}") from None


def reference(rule, fq, fk, v, *, inputs=None, H0=None, normalize=None, eps=None):
    return _reference_loop(get_rule(rule), fq, fk, v, inputs=inputs, H0=H0, normalize=normalize, eps=eps)


reference.__doc__ = _reference_loop.__doc__


def rule_for(*, factor: Optional[str], beta: bool) -> UpdateRule:
    """The rule that a call's arguments select.

    Parameters
    ----------
    factor : {None, "scalar", "feature"}
        The form of the ``decay``/``log_decay`` given (:attr:`UpdateRule.factor`).
    beta : bool
        Whether ``beta`` was given.

    Raises
    ------
    ValueError
        No rule takes this combination (e.g. a per-feature gate with beta).
    """
    for rule in RULES.values():
        if rule.factor == factor and rule.beta == bool(beta):
            return rule
    form = {None: "no decay", "scalar": "a decay per sequence or per token",
            "feature": "a per-feature gate (decay/log_decay with last axes (N, D_phi))"}[factor]
    takes = "; ".join(f"{r.name!r}: {r.hint}" for r in RULES.values())
    raise ValueError(f"no update rule takes {form} {'with' if beta else 'without'} beta; the rules: {takes}")


#: The named rules of the diagonal-plus-low-rank family (:func:`linattn_nb.dplr_attention`) by name.
DPLR_RULES: Dict[str, DPLRRule] = {}


#: Keywords of ``dplr_attention``, its VJP and the torch adapter's, which a rule's own arguments cannot take
#: (``beta`` is the one a rule may take: those functions pass it on to the rule).
RESERVED_ARGUMENTS = frozenset({"q", "k", "v", "rule", "a", "b", "log_diag", "feature_map", "method", "normalize",
                                "eps", "check_finite", "out", "initial_state", "return_state", "device", "grad_out",
                                "grad_state", "feature_map_params"})


#: The fields of a :class:`DPLRRule` that may be None: the paper's step and the random draw (for tests),
#: ``pullback`` (gradients only) and ``keyed``; ``check`` and ``build`` run at every call.
_OPTIONAL_DPLR_FIELDS = frozenset({"step", "sample", "pullback", "keyed"})


def register_dplr(rule: DPLRRule, *, overwrite: bool = False) -> DPLRRule:
    """Add a named DPLR rule to :data:`DPLR_RULES` (a researcher's own rule too: see ``docs/dplr.md``).

    Raises TypeError for anything but a :class:`DPLRRule`, a name that is not a string, ``arguments``
    that are not a tuple of strings, a ``check`` or ``build`` that is not callable, or a ``step``,
    ``sample``, ``pullback`` or ``keyed`` that is neither callable nor None (naming the rule and the
    field); ValueError for an empty name, an argument name that ``dplr_attention`` takes itself
    (:data:`RESERVED_ARGUMENTS`), and a name that is taken: by a DPLR rule unless ``overwrite``, by a
    rule of the other registry (or ``"dplr"``, the general form) always.
    """
    if not isinstance(rule, DPLRRule):
        raise TypeError(f"rule must be a DPLRRule, got {type(rule).__name__}")
    name = rule.name
    if not isinstance(name, str):
        raise TypeError(f"rule.name must be a string, got {type(name).__name__} {name!r}")
    if not name:
        raise ValueError("rule.name must not be empty")
    args = rule.arguments
    if not isinstance(args, tuple) or not all(isinstance(a, str) and a for a in args):
        raise TypeError(f"rule {name!r}: arguments must be a tuple of non-empty strings (the keyword names it "
                        f"takes), got {args!r}")
    for field in ("check", "build", "step", "sample", "pullback", "keyed"):
        fn = getattr(rule, field)
        if not callable(fn) and not (fn is None and field in _OPTIONAL_DPLR_FIELDS):
            may = " or None" if field in _OPTIONAL_DPLR_FIELDS else ""
            raise TypeError(f"rule {name!r}: {field} must be a callable{may}, got {type(fn).__name__}")
    clash = sorted(set(args) & RESERVED_ARGUMENTS)
    if clash:
        raise ValueError(f"rule {name!r}: argument(s) {clash} are keywords of dplr_attention itself; name them "
                         "otherwise")
    if name in RULES or name == "dplr":
        raise ValueError(f"rule {name!r} is a name of the built-in rules (linear_attention's) or of the general "
                         "form; overwrite replaces DPLR rules only: choose another name")
    if not overwrite and name in DPLR_RULES:
        raise ValueError(f"rule {name!r} already registered")
    DPLR_RULES[name] = rule
    return rule


for _module in (kda, rwkv7, delta_product, gated_delta_product):
    register_dplr(_module.RULE)
del _module

#: The package's own DPLR rules, as registered at import (a researcher's rules, and a rule registered over one
#: of these names, have what their check and build return checked at each call).
BUILTIN_DPLR_RULES = tuple(DPLR_RULES.values())


def dplr_rule_names() -> Tuple[str, ...]:
    """The named DPLR rules' names."""
    return tuple(DPLR_RULES)


def get_dplr_rule(rule) -> DPLRRule:
    """The :class:`DPLRRule` called ``rule`` (a DPLRRule is returned as it is); ValueError naming the
    registered ones for an unknown name, TypeError for a non-string."""
    if isinstance(rule, DPLRRule):
        return rule
    if not isinstance(rule, str):
        raise TypeError(f"rule must be a string, got {type(rule).__name__}")
    try:
        return DPLR_RULES[rule]
    except KeyError:
        raise ValueError(f"unknown DPLR rule {rule!r}; registered: {', '.join(map(repr, DPLR_RULES))}") from None


__all__ = ["BUILTIN_DPLR_RULES", "DPLR_RULES", "DPLRRule", "FACTOR_KINDS", "RESERVED_ARGUMENTS", "RULES", "UpdateRule",
           "dplr_rule_names", "get_dplr_rule", "get_rule", "reference", "register", "register_dplr", "rule_for",
           "rule_names"]
