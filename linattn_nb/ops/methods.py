"""Registration of the built-in implementations in the method table.

Importing this module compiles nothing (Numba compiles on first call).
"""
from __future__ import annotations

import numpy as np

from .. import config
from .causal.chunked import causal_chunked
from .causal.cpu import causal_scan
from .causal.naive import causal_linear_quadratic
from .noncausal.cpu import noncausal_aggregate
from .noncausal.naive import noncausal_linear_quadratic
from .registry import Method, register_method

_ALL_FLOATS = frozenset({np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)})


def _quadratic_launcher(reference):
    def launcher(q, k, v, H, out, *, code, eps, inputs=None):
        B, N, _ = q.shape
        M = v.shape[2]
        if N * N > config.QUADRATIC_MAX_ELEMENTS:
            raise ValueError(
                f"method='quadratic' builds an N x N matrix per batch entry; N={N} exceeds "
                f"config.QUADRATIC_MAX_ELEMENTS={config.QUADRATIC_MAX_ELEMENTS} elements. "
                "Use method='auto' (or raise the limit in linattn_nb.config)."
            )
        res, S_new, z_new = reference(q, k, v, eps=eps, S0=H[..., :M], z0=H[..., M])
        out[...] = res
        H[..., :M] = S_new
        H[..., M] = z_new
        return out

    return launcher


register_method(Method("quadratic", True, "cpu", _quadratic_launcher(causal_linear_quadratic),
                       inline_features=False, native_dtypes=_ALL_FLOATS))
register_method(Method("quadratic", False, "cpu", _quadratic_launcher(noncausal_linear_quadratic),
                       inline_features=False, native_dtypes=_ALL_FLOATS))
register_method(Method("scan", True, "cpu", causal_scan, native_dtypes=_ALL_FLOATS))
register_method(Method("chunked", True, "cpu", causal_chunked, native_dtypes=_ALL_FLOATS))
# Non-causal attention has no recurrence: every linear method runs the
# aggregate-then-query kernel (the names are accepted so that sweeps over
# (causal, method) need no special case).
for _name in ("aggregate", "scan", "chunked"):
    register_method(Method(_name, False, "cpu", noncausal_aggregate, native_dtypes=_ALL_FLOATS))


# CUDA launchers (linattn_nb/ops/causal/cuda.py, noncausal/cuda.py): registered
# here so the method table lists them, imported on first call so that the
# package imports without numba-cuda and compiles nothing at import.
def _cuda_launcher(module: str, attr: str):
    def launcher(q, k, v, S, z, out, *, code, eps):
        import importlib

        fn = getattr(importlib.import_module(module, __package__), attr)
        return fn(q, k, v, S, z, out, code=code, eps=eps)

    launcher.__name__ = attr
    launcher.__qualname__ = attr
    launcher.__doc__ = f"{module}.{attr}, imported on first call (device arrays in and out)."
    return launcher


register_method(Method("scan", True, "cuda", _cuda_launcher(".causal.cuda", "causal_scan_cuda"),
                       native_dtypes=_ALL_FLOATS))
register_method(Method("chunked", True, "cuda", _cuda_launcher(".causal.cuda", "causal_chunked_cuda"),
                       native_dtypes=_ALL_FLOATS))
for _name in ("aggregate", "scan", "chunked"):
    register_method(Method(_name, False, "cuda",
                           _cuda_launcher(".noncausal.cuda", "noncausal_aggregate_cuda"),
                           native_dtypes=_ALL_FLOATS))
