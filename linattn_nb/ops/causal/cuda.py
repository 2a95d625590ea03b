"""CUDA launchers of causal linear attention: ``scan`` and ``chunked``.

See ``docs/cuda_kernels.md``, "Sequence launchers".
"""
from __future__ import annotations

from .. import _cuda_launch as C
from .._codes import RULE_ADDITIVE
from .._cuda_common import is_delta_rule


def causal_scan_cuda(q, k, v, H, out, *, code, eps, inputs=None, check_finite=False, normalize=True,
                     rule=RULE_ADDITIVE):
    """Causal scan on the GPU; see the module docstring for the contract."""
    p = C.plan(q, k, v, H, out, rule=rule, inputs=inputs, check_finite=check_finite)
    C.scan(p, H, code=code, eps=eps, normalize=normalize)
    C.raise_nonfinite(p)
    return out


def causal_chunked_cuda(q, k, v, H, out, *, code, eps, inputs=None, check_finite=False, normalize=True,
                        chunk_size=None, rule=RULE_ADDITIVE):
    """Chunkwise-parallel causal attention on the GPU (module docstring).

    ``chunk_size`` defaults to ``config.CUDA_CHUNK_SIZE``; a sequence of one
    chunk runs the scan, and so do the delta rules (module docstring).
    """
    p = C.plan(q, k, v, H, out, rule=rule, inputs=inputs, chunk=C.chunk_length(chunk_size),
               check_finite=check_finite)
    if p.empty:
        return out
    if p.chunks == 1 or is_delta_rule(p.rule):
        C.scan(p, H, code=code, eps=eps, normalize=normalize)
    else:
        Hc = C.chunk_sums(p, code=code, eps=eps)  # (1)
        C.chunk_prefix(p, Hc, H, exclusive=True)  # (2) Hc: state before each chunk; H: final state
        C.chunk_outputs(p, Hc, code=code, eps=eps, causal=True, normalize=normalize)  # (3)
    C.raise_nonfinite(p)
    return out
