"""Decode-step launchers: the method table's ``method="step"`` entries.

The step launcher contract: ``docs/launchers.md``, "Decode-step launchers".
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

import numpy as np

from .._codes import check_rule_inputs, rule_name
from ..registry import Method, available_rules, get_rule, register_method
from . import cpu as _cpu

__all__ = ["StepLauncher", "CPU_STEP", "CUDA_STEP", "aligned_zeros", "cpu_launcher", "cuda_launcher",
           "register_step_methods"]

_NATIVE = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


def aligned_zeros(shape, dtype, align=64):
    """Zeros whose data starts on a cache-line boundary (NumPy only guarantees 16 bytes):
    a decode step streams every row of S, and unaligned 256-byte rows touch five lines, not four."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    buf = np.zeros(n * dtype.itemsize + align, dtype=np.uint8)
    off = (-buf.ctypes.data) % align
    return buf[off:off + n * dtype.itemsize].view(dtype).reshape(shape)


@dataclass(frozen=True)
class StepLauncher:
    """A decode-step launcher (the contract is in the module docstring)."""

    device: str
    step: Callable
    query: Callable
    prefill: Callable
    zeros: Callable
    put: Callable
    view: Callable
    kernel: Optional[Callable] = None

    def __call__(self, q, k, v, S, z, out, scratch, *, code, eps, check, inputs=None, normalize=True) -> int:
        return self.step(q, k, v, S, z, out, scratch, code=code, eps=eps, check=check, inputs=inputs,
                         normalize=normalize)


# ---------------------------------------------------------------------------
# CPU: S stored transposed, one (M, F) block per batch entry (ops/step/cpu.py)
# ---------------------------------------------------------------------------
def _cpu_zeros(B, F, M, dtype):
    scratch = (aligned_zeros((3, B, F), dtype),)  # phi(k), phi(q), the factors of a token
    return aligned_zeros((B, M, F), dtype), aligned_zeros((B, F), dtype), scratch


def _cpu_query(q, S, z, out, scratch, *, code, eps, check, normalize=True):
    if check and q.size and not np.isfinite(q).all():
        return 1
    _cpu.state_query(q, S, z, out, code=code, eps=eps, normalize=normalize)
    return 0


def _cpu_put(S, z, S_src, z_src):
    if S_src is None and z_src is None:
        S[...] = 0
        z[...] = 0
        return
    B, M, F = S.shape
    S[...] = np.asarray(S_src).reshape((B, F, M)).transpose(0, 2, 1)
    z[...] = np.asarray(z_src).reshape((B, F))


def _cpu_view(S, z):
    return S.transpose(0, 2, 1), z


@lru_cache(maxsize=None)
def cpu_launcher(rule: int) -> StepLauncher:
    """The CPU step launcher of rule code ``rule`` (one object per rule): the step kernel and the prefill
    of :mod:`linattn_nb.ops.step.cpu`, the rule's ``inputs=`` checked first (ValueError naming them)."""

    def step(q, k, v, S, z, out, scratch, *, code, eps, check, inputs=None, normalize=True):
        check_rule_inputs(rule, inputs)
        return _cpu.step(q, k, v, S, z, out, scratch[0], code=code, eps=eps, check=check, rule=rule, inputs=inputs,
                         normalize=normalize)

    def prefill(k, v, S, z, scratch=None, *, code, check, inputs=None):
        check_rule_inputs(rule, inputs)
        bad = _cpu.first_nonfinite(k, k, v) if check else 0
        if bad:
            return 1 if bad < 3 else 2
        feat = scratch[0] if scratch else np.empty((2,) + z.shape, dtype=S.dtype)
        _cpu.prefill(k, v, S, z, feat, code=code, rule=rule, inputs=inputs)
        return 0

    kernel = None if get_rule(rule_name(rule)).inputs else _cpu.pick_step_kernel  # the additive decode step
    return StepLauncher("cpu", step, _cpu_query, prefill, _cpu_zeros, _cpu_put, _cpu_view, kernel=kernel)


# ---------------------------------------------------------------------------
# CUDA: S in the canonical (B, F, M) layout (ops/step/cuda.py, imported on first use; one kernel per
# operation, no host round-trips: docs/cuda_kernels.md)
# ---------------------------------------------------------------------------
def _kernels():
    from . import cuda as _scuda

    return _scuda


def _launch():
    from .. import _cuda_launch

    return _cuda_launch


def _cuda_zeros(B, F, M, dtype):
    K = _kernels()
    return K.DoubleBuffer((B, F, M), dtype), K.DoubleBuffer((B, F), dtype), K.StepScratch(B, F, dtype)


def _cuda_query(q, S, z, out, scratch, *, code, eps, check, normalize=True):
    return _kernels().state_query(q, S, z, out, scratch, code=code, eps=eps, normalize=normalize, check=check)


def _cuda_put(S, z, S_src, z_src):
    for dst, src in ((S.cur, S_src), (z.cur, z_src)):
        if src is None:
            _launch().fill(dst, 0)  # zeroed on the device
        elif isinstance(src, np.ndarray):
            dst.copy_to_device(np.ascontiguousarray(src, dtype=dst.dtype).reshape(dst.shape))
        else:
            _launch().copy(src.reshape(dst.shape), dst)


def _cuda_view(S, z):
    return S.cur, z.cur


@lru_cache(maxsize=None)
def cuda_launcher(rule: int) -> StepLauncher:
    """The CUDA step launcher of rule code ``rule`` (one object per rule): the step and prefill kernels
    of :mod:`linattn_nb.ops.step.cuda`, the rule's ``inputs=`` checked first (ValueError naming them)."""

    def step(q, k, v, S, z, out, scratch, *, code, eps, check, inputs=None, normalize=True):
        check_rule_inputs(rule, inputs)
        return _kernels().step(q, k, v, S, z, out, scratch, code=code, eps=eps, rule=rule, inputs=inputs,
                               normalize=normalize, check=check)

    def prefill(k, v, S, z, scratch, *, code, check, inputs=None):
        check_rule_inputs(rule, inputs)
        return _kernels().prefill(k, v, S, z, scratch, code=code, rule=rule, inputs=inputs, check=check)

    return StepLauncher("cuda", step, _cuda_query, prefill, _cuda_zeros, _cuda_put, _cuda_view)


def register_step_methods() -> None:
    """Register the step launchers (CPU and CUDA) of every registered rule in the method table."""
    for name in available_rules():
        code = get_rule(name).code
        for launcher in (cpu_launcher(code), cuda_launcher(code)):
            register_method(Method(name, "step", True, launcher.device, launcher, native_dtypes=_NATIVE,
                                   kind="step"), overwrite=True)


register_step_methods()

#: The additive rule's launchers (the decode step of plain linear attention).
CPU_STEP = cpu_launcher(get_rule("additive").code)
CUDA_STEP = cuda_launcher(get_rule("additive").code)
