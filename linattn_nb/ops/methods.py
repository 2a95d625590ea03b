"""Registration of the built-in rules and implementations in the method table.

Every rule of :data:`linattn_nb.ops._codes.RULES` gets every rule-generic causal launcher bound to
its code, so a new rule needs no edit here; non-causal methods are the additive rule's only; the
decode-step launchers register themselves on import.  Importing compiles nothing.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import config
from ._codes import RULES
from ._finite import NonFiniteResult, check_finite_values
from .causal.chunked import causal_chunked
from .causal.cpu import causal_scan
from .causal.naive import causal_linear_quadratic
from .noncausal.cpu import noncausal_aggregate
from .noncausal.naive import noncausal_linear_quadratic
from .registry import Method, Rule, register_method, register_rule

_ALL_FLOATS = frozenset({np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)})

#: Causal methods every rule gets, per device (rule-generic launchers).
CAUSAL_METHODS = {"cpu": ("quadratic", "scan", "chunked"), "cuda": ("scan", "chunked")}


def _quadratic_launcher(reference, **rule_kw):
    def forward(q, k, v, H, out, *, code, eps, inputs=None, check_finite=False, normalize=True):
        B, N, _ = q.shape
        limit = config.knob_int("QUADRATIC_MAX_ELEMENTS")
        if N * N > limit:
            raise ValueError(
                f"method='quadratic' builds an N x N matrix per batch entry; N={N} exceeds "
                f"config.QUADRATIC_MAX_ELEMENTS={limit} elements. "
                "Use method='auto' (or raise the limit in linattn_nb.config)."
            )
        M = v.shape[2]
        if check_finite:  # the reference is the slow path: a NumPy scan costs nothing here
            for name, x in (("q", q), ("k", k), ("v", v)):
                check_finite_values(name, x)
        kw = dict(rule_kw, inputs=inputs) if rule_kw else {}  # the non-causal reference: additive only
        res, S_new, z_new = reference(q, k, v, eps=eps, S0=H[:, :, :M], z0=H[:, :, M], normalize=normalize,
                                      **kw)
        with np.errstate(over="ignore", invalid="ignore"):
            out[...] = res
        H[:, :, :M] = S_new
        H[:, :, M] = z_new
        if check_finite and not (np.isfinite(out).all() and np.isfinite(H).all()):
            raise NonFiniteResult("the result holds NaN or inf although the inputs are finite: "
                                  f"it overflows {out.dtype} (or a normaliser is 0 with eps=None)")
        return out

    forward.__name__ = forward.__qualname__ = reference.__name__
    forward.__doc__ = f"{reference.__module__}.{reference.__name__} on the launcher contract."
    return forward


def _bind(launcher, code):
    """``launcher`` with ``rule=code`` bound (its name and docstring kept)."""
    return functools.update_wrapper(functools.partial(launcher, rule=code), launcher)


# CUDA launchers (ops/causal/cuda.py, ops/noncausal/cuda.py): registered here
# so the method table lists them, imported on first call so that the package
# imports without numba-cuda and compiles nothing at import.
def _cuda_launcher(module: str, attr: str, **rule_kw):
    def forward(q, k, v, H, out, *, code, eps, inputs=None, check_finite=False, normalize=True):
        import importlib

        fn = getattr(importlib.import_module(module, __package__), attr)
        return fn(q, k, v, H, out, code=code, eps=eps, inputs=inputs, check_finite=check_finite,
                  normalize=normalize, **rule_kw)

    forward.__name__ = forward.__qualname__ = attr
    forward.__doc__ = f"{module}.{attr}, imported on first call (device arrays in and out)."
    return forward


def _cpu(rule, name, causal, forward, **kw):
    register_method(Method(rule, name, causal, "cpu", forward, native_dtypes=_ALL_FLOATS, **kw))


def _gpu(rule, name, causal, forward, backward=None):
    register_method(Method(rule, name, causal, "cuda", forward, backward=backward, native_dtypes=_ALL_FLOATS))


# Backward launchers (contract: linattn_nb/ops/grad/__init__.py), imported on
# first call like the CUDA forward launchers (nothing compiles at import).
def _lazy_backward(module: str, attr: str, **rule_kw):
    def backward(qf, kf, v1, H0, g1, dHN=None, *, inputs=None, **kw):
        import importlib

        fn = getattr(importlib.import_module(module, __package__), attr)
        return fn(qf, kf, v1, H0, g1, dHN, inputs=inputs, **rule_kw, **kw)

    backward.__name__ = backward.__qualname__ = attr
    backward.__doc__ = f"{module}.{attr}, imported on first call (backward launcher contract)."
    return backward


def _causal_backward(device: str, name: str, code: int):
    """The backward launcher of causal method ``name`` on ``device``, bound to rule ``code``."""
    if device == "cpu":
        if name == "quadratic":
            return _lazy_backward(".grad.naive", "causal_backward_naive", rule=code)
        return _lazy_backward(".grad.cpu", {"scan": "backward_scan", "chunked": "backward_chunked"}[name],
                              rule=code)
    attr = {"scan": "backward_scan_cuda", "chunked": "backward_chunked_cuda"}[name]
    return _lazy_backward(".grad.cuda", attr, rule=code)


def _causal_launcher(device: str, name: str, code: int):
    """The rule-generic causal launcher ``name`` on ``device``, bound to rule ``code``."""
    if device == "cpu":
        if name == "quadratic":
            return _quadratic_launcher(causal_linear_quadratic, rule=code)
        return _bind({"scan": causal_scan, "chunked": causal_chunked}[name], code)
    attr = {"scan": "causal_scan_cuda", "chunked": "causal_chunked_cuda"}[name]
    return _cuda_launcher(".causal.cuda", attr, rule=code)


for _rule, (_code, _inputs) in RULES.items():
    register_rule(Rule(_rule, code=_code, inputs=tuple(_inputs)))
    for _device, _names in CAUSAL_METHODS.items():
        for _name in _names:
            _forward = _causal_launcher(_device, _name, _code)
            _backward = _causal_backward(_device, _name, _code)
            if _device == "cpu":
                _cpu(_rule, _name, True, _forward, inline_features=_name != "quadratic", backward=_backward)
            else:
                _gpu(_rule, _name, True, _forward, _backward)

# Non-causal attention (the additive rule only): every linear method runs the
# aggregate-then-query kernel (the names are accepted so that sweeps over
# (causal, method) need no special case).
_cpu("additive", "quadratic", False, _quadratic_launcher(noncausal_linear_quadratic), inline_features=False,
     backward=_lazy_backward(".grad.naive", "noncausal_backward_naive"))
for _name in ("aggregate", "scan", "chunked"):
    _cpu("additive", _name, False, noncausal_aggregate,
         backward=_lazy_backward(".grad.noncausal", "noncausal_backward"))
    _gpu("additive", _name, False, _cuda_launcher(".noncausal.cuda", "noncausal_aggregate_cuda"),
         _lazy_backward(".grad.cuda", "backward_aggregate_cuda"))

# The decode-step launchers of every rule registered above (method "step").
from .step import launchers  # noqa: E402,F401
