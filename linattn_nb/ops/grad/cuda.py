"""CUDA backward launchers: ``scan`` and ``chunked`` (causal, every rule) and ``aggregate`` (non-causal).

See ``docs/cuda_kernels.md``, "Backward launchers".
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ... import config
from .. import _cuda_launch as CL
from .. import _cuda_pool as P
from .._codes import RULE_ADDITIVE, RULE_DECAY, RULE_GATE, RULE_GATED_DELTA, check_rule_inputs
from .._cuda_common import is_delta_rule
from ..cuda.helpers import cast_copy_kernel
from ..cuda.plan import helper_grid
from ..cuda.views import is_sim_array
from . import Grads
from . import _cuda_kernels as GK

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def _shape(x):
    return tuple(int(s) for s in x.shape)


def _device(name, x):
    """``x`` as a device array (a simulator array or anything with ``__cuda_array_interface__``)."""
    if is_sim_array(x) or type(x).__module__.startswith("numba.cuda"):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return cuda.as_cuda_array(x)
    raise TypeError(f"{name} must be a CUDA device array, got {type(x).__name__}")


def _check(qf, kf, v1, H0, g1, dHN):
    """Check the arrays of the contract; return them as device arrays and ``(B, N, F, M', work dtype)``.
    TypeError for a non-device array, a working dtype other than float32/float64, mixed working dtypes or
    a non-float64 ``H0`` / ``dHN``; ValueError for shapes that do not match or negative strides."""
    qf, kf, v1, H0, g1 = (_device(n, x) for n, x in (("qf", qf), ("kf", kf), ("v1", v1), ("H0", H0), ("g1", g1)))
    if dHN is not None:
        dHN = _device("dHN", dHN)
    if len(qf.shape) != 3:
        raise ValueError(f"qf must have shape (B, N, F), got {_shape(qf)}")
    B, N, F = _shape(qf)
    if len(v1.shape) != 3 or _shape(v1)[:2] != (B, N):
        raise ValueError(f"v1 must have shape (B, N, M') = ({B}, {N}, M'), got {_shape(v1)}")
    M1 = _shape(v1)[2]
    if M1 < 1:
        raise ValueError("v1 must have at least one column (the normaliser's)")
    want = {"kf": (B, N, F), "g1": (B, N, M1), "H0": (B, F, M1), "dHN": (B, F, M1)}
    for name, x in (("kf", kf), ("g1", g1), ("H0", H0), ("dHN", dHN)):
        if x is not None and _shape(x) != want[name]:
            raise ValueError(f"{name} must have shape {want[name]}, got {_shape(x)}")
    work = np.dtype(qf.dtype)
    if work not in (_F32, _F64):
        raise TypeError(f"qf must be float32 or float64 (the working dtype), got {work}")
    for name, x in (("kf", kf), ("v1", v1), ("g1", g1)):
        if np.dtype(x.dtype) != work:
            raise TypeError(f"{name} must have the working dtype of qf, {work}, got {np.dtype(x.dtype)}")
    for name, x in (("H0", H0), ("dHN", dHN)):
        if x is not None and np.dtype(x.dtype) != _F64:
            raise TypeError(f"{name} must be float64, got {np.dtype(x.dtype)}")
    for name, x in (("qf", qf), ("kf", kf), ("v1", v1), ("g1", g1), ("H0", H0), ("dHN", dHN)):
        if x is not None and any(int(s) < 0 for s in x.strides):
            raise ValueError(f"{name}: negative strides are not supported; make a contiguous copy first")
    return (qf, kf, v1, H0, g1, dHN), (B, N, F, M1, work)


def _zeros(shape, dtype=_F64):
    """A new zero-filled device array (a result), zeroed on the device."""
    return P.zeros(shape, dtype)


def _initial_adjoint(dHN, shape):
    """dH0 when there are no tokens: a copy of ``dHN``, or zeros."""
    out = _zeros(shape)
    if dHN is not None and out.size:
        cast_copy_kernel[helper_grid(out.size)](dHN, out)
    return out


def _sum_blocks(src, dst):
    if dst.size:
        GK.sum_blocks_kernel[helper_grid(dst.size)](src, dst)
    return dst


def column_blocks(M1: int) -> tuple[int, int]:
    """``(MB, nCB)``: state columns per block and blocks, at most ``config.CUDA_VALUE_COLS`` per block,
    spread evenly (65 columns with 64 per block are two blocks of 33 and 32); no block is empty."""
    cap = max(1, int(config.CUDA_VALUE_COLS))
    MB = max(1, -(-int(M1) // max(1, -(-int(M1) // cap))))
    return MB, max(1, -(-int(M1) // MB))


def backward_scan_cuda(qf, kf, v1, H0, g1, dHN=None, *, inputs=None, rule=RULE_ADDITIVE, chunk_size=None):
    """Gradients of causal linear attention on the GPU (contract: ``docs/launchers.md``).

    ``chunk_size``: tokens between two checkpoints of the state (default
    ``config.CUDA_CHUNK_SIZE``); memory grows with ``N / chunk_size`` checkpoints
    plus ``chunk_size`` token states per batch entry.

    Raises
    ------
    ValueError
        For an unknown rule code, inputs other than the rule's or of the wrong
        shape, mismatched shapes, negative strides, or ``chunk_size`` < 1.
    TypeError
        For host arrays or wrong dtypes.
    """
    rule = check_rule_inputs(rule, inputs)
    (qf, kf, v1, H0, g1, dHN), (B, N, F, M1, work) = _check(qf, kf, v1, H0, g1, dHN)
    L = CL.chunk_length(chunk_size)
    lf = CL.rule_factors(rule, inputs, B, N, F)
    delta = is_delta_rule(rule)
    gate = rule == RULE_GATE
    scalar_factor = rule in (RULE_DECAY, RULE_GATED_DELTA)
    dq = cuda.device_array((B, N, F), dtype=work)
    dk = cuda.device_array((B, N, F), dtype=work)
    dv = cuda.device_array((B, N, M1), dtype=work)
    dfactor = cuda.device_array((B, N, F), dtype=_F64) if gate else (
        cuda.device_array((B, N), dtype=_F64) if scalar_factor else None)
    dbeta = cuda.device_array((B, N), dtype=_F64) if delta else None
    if B == 0 or N == 0:
        dH0 = _initial_adjoint(dHN, (B, F, M1))
        if dfactor is not None:
            dfactor = _zeros(_shape(dfactor))
        if dbeta is not None:
            dbeta = _zeros((B, N))
        return Grads(dq, dk, dv, dH0, dfactor, dbeta)

    L = min(L, N)
    nchunks = -(-N // L)
    MB, ncb = column_blocks(M1)
    # temporaries from the workspace pool (reused across calls, written before they are read);
    # the gradients themselves are new arrays
    ck = P.workspace("grad.checkpoints", (B, max(nchunks - 1, 1), F, M1), _F64)
    hs = P.workspace("grad.token_states", (B, L + 1, F, M1), _F64)
    dH0 = cuda.device_array((B, F, M1), dtype=_F64)
    pq = P.workspace("grad.dq_parts", (ncb, B, N, F), _F64)
    pk = P.workspace("grad.dk_parts", (ncb, B, N, F), _F64)
    one4 = (1, 1, 1, 1)
    pf = P.workspace("grad.dfactor_parts", (ncb, B, N, F) if gate else ((ncb, B, N, 1) if scalar_factor else one4),
                     _F64)
    pb = P.workspace("grad.dbeta_parts", (ncb, B, N, 1) if delta else one4, _F64)
    dhn = dHN if dHN is not None else P.workspace("grad.no_dHN", (1, 1, 1), _F64)
    kern = GK.causal_backward_kernel(MB)
    kern[(B, ncb), GK.backward_threads(F, MB)](qf, kf, v1, g1, H0, dhn, dHN is not None, lf, ck, hs, dH0, dv,
                                               pq, pk, pf, pb, L, nchunks, rule)
    _sum_blocks(pq, dq)
    _sum_blocks(pk, dk)
    if gate:
        _sum_blocks(pf, dfactor)
    elif scalar_factor:
        dfactor = _sum_blocks(pf, cuda.device_array((B, N, 1), dtype=_F64)).reshape(B, N)
    if delta:
        dbeta = _sum_blocks(pb, cuda.device_array((B, N, 1), dtype=_F64)).reshape(B, N)
    return Grads(dq, dk, dv, dH0, dfactor, dbeta)


def backward_chunked_cuda(qf, kf, v1, H0, g1, dHN=None, *, inputs=None, rule=RULE_ADDITIVE, chunk_size=None):
    """The backward of the CUDA ``chunked`` method: the checkpointed recurrence of
    :func:`backward_scan_cuda` (checkpoints every ``chunk_size`` tokens, default
    ``config.CUDA_CHUNK_SIZE``), not a chunkwise-parallel (GEMM-tiled) backward."""
    return backward_scan_cuda(qf, kf, v1, H0, g1, dHN, inputs=inputs, rule=rule, chunk_size=chunk_size)


def backward_aggregate_cuda(qf, kf, v1, H0, g1, dHN=None, *, inputs=None):
    """Gradients of non-causal linear attention on the GPU (module docstring; the additive rule only).

    Raises
    ------
    ValueError
        When ``inputs`` holds anything, or for mismatched shapes.
    TypeError
        For host arrays or wrong dtypes.
    """
    if inputs:
        raise ValueError("non-causal attention has the additive rule only: inputs must be None")
    (qf, kf, v1, H0, g1, dHN), (B, N, F, M1, work) = _check(qf, kf, v1, H0, g1, dHN)
    H = P.workspace("grad.aggregate_H", (B, F, M1), _F64)
    R = cuda.device_array((B, F, M1), dtype=_F64)  # dH0, a result
    dq = cuda.device_array((B, N, F), dtype=work)
    dk = cuda.device_array((B, N, F), dtype=work)
    dv = cuda.device_array((B, N, M1), dtype=work)
    if H.size:
        dhn = dHN if dHN is not None else P.workspace("grad.no_dHN", (1, 1, 1), _F64)
        GK.aggregate_sums_kernel[helper_grid(H.size)](qf, kf, v1, g1, H0, dhn, dHN is not None, H, R)
    total = B * N * (F + M1)
    if total:
        GK.aggregate_grads_kernel[helper_grid(total)](kf, v1, g1, H, R, dq, dk, dv)
    return Grads(dq, dk, dv, R)
