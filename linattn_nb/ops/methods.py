"""Registration of the built-in rules and implementations in the method table.

Importing this module compiles nothing (Numba compiles on first call).
"""
from __future__ import annotations

import numpy as np

from .. import config
from .._validate import check_finite_values
from ._finite import NonFiniteResult
from .causal.chunked import causal_chunked
from .causal.cpu import causal_scan
from .causal.naive import causal_linear_quadratic
from .noncausal.cpu import noncausal_aggregate
from .noncausal.naive import noncausal_linear_quadratic
from ._codes import RULE_ADDITIVE
from .registry import Method, Rule, register_method, register_rule

_ALL_FLOATS = frozenset({np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)})

#: The additive rule (Katharopoulos et al. 2020): S_t = S_{t-1} + phi(k_t) v_t^T.
ADDITIVE = register_rule(Rule("additive", code=RULE_ADDITIVE))


def _quadratic_launcher(reference):
    def forward(q, k, v, H, out, *, code, eps, inputs=None, check_finite=False):
        B, N, _ = q.shape
        if N * N > config.QUADRATIC_MAX_ELEMENTS:
            raise ValueError(
                f"method='quadratic' builds an N x N matrix per batch entry; N={N} exceeds "
                f"config.QUADRATIC_MAX_ELEMENTS={config.QUADRATIC_MAX_ELEMENTS} elements. "
                "Use method='auto' (or raise the limit in linattn_nb.config)."
            )
        M = v.shape[2]
        if check_finite:  # the reference is the slow path: a NumPy scan costs nothing here
            for name, x in (("q", q), ("k", k), ("v", v)):
                check_finite_values(name, x)
        res, S_new, z_new = reference(q, k, v, eps=eps, S0=H[:, :, :M], z0=H[:, :, M])
        with np.errstate(over="ignore", invalid="ignore"):
            out[...] = res
        H[:, :, :M] = S_new
        H[:, :, M] = z_new
        if check_finite and not (np.isfinite(out).all() and np.isfinite(H).all()):
            raise NonFiniteResult("the result holds NaN or inf although the inputs are finite: "
                                  f"it overflows {out.dtype} (or a normaliser is 0 with eps=None)")
        return out

    return forward


def _cpu(name, causal, forward, **kw):
    register_method(Method("additive", name, causal, "cpu", forward, native_dtypes=_ALL_FLOATS, **kw))


_cpu("quadratic", True, _quadratic_launcher(causal_linear_quadratic), inline_features=False)
_cpu("quadratic", False, _quadratic_launcher(noncausal_linear_quadratic), inline_features=False)
_cpu("scan", True, causal_scan)
_cpu("chunked", True, causal_chunked)
# Non-causal attention has no recurrence: every linear method runs the
# aggregate-then-query kernel (the names are accepted so that sweeps over
# (causal, method) need no special case).
for _name in ("aggregate", "scan", "chunked"):
    _cpu(_name, False, noncausal_aggregate)


# CUDA launchers (ops/causal/cuda.py, ops/noncausal/cuda.py): registered here
# so the method table lists them, imported on first call so that the package
# imports without numba-cuda and compiles nothing at import.
def _cuda_launcher(module: str, attr: str):
    def forward(q, k, v, H, out, *, code, eps, inputs=None, check_finite=False):
        import importlib

        fn = getattr(importlib.import_module(module, __package__), attr)
        return fn(q, k, v, H, out, code=code, eps=eps, inputs=inputs, check_finite=check_finite)

    forward.__name__ = forward.__qualname__ = attr
    forward.__doc__ = f"{module}.{attr}, imported on first call (device arrays in and out)."
    return forward


def _gpu(name, causal, forward):
    register_method(Method("additive", name, causal, "cuda", forward, native_dtypes=_ALL_FLOATS))


_gpu("scan", True, _cuda_launcher(".causal.cuda", "causal_scan_cuda"))
_gpu("chunked", True, _cuda_launcher(".causal.cuda", "causal_chunked_cuda"))
for _name in ("aggregate", "scan", "chunked"):
    _gpu(_name, False, _cuda_launcher(".noncausal.cuda", "noncausal_aggregate_cuda"))
