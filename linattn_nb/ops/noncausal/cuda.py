"""CUDA launcher of non-causal linear attention (additive rule): aggregate, then query.

Three launches: every chunk's state increment, their float64 sum with the initial
state (the final state), and every token's read of it (Katharopoulos et al. 2020,
Eq. 7).  The passes are those of :mod:`linattn_nb.ops._cuda_launch`.
"""
from __future__ import annotations

from .. import _cuda_launch as C


def noncausal_aggregate_cuda(q, k, v, H, out, *, code, eps, inputs=None, check_finite=False, normalize=True,
                             chunk_size=None):
    """Non-causal linear attention on the GPU (see the module docstring)."""
    p = C.plan(q, k, v, H, out, inputs=inputs, chunk=C.chunk_length(chunk_size), check_finite=check_finite)
    if p.empty:
        return out
    Hc = C.chunk_sums(p, code=code, eps=eps, count=True)  # (1), counts non-finite k, v
    Hq = C.chunk_prefix(p, Hc, H, exclusive=False)  # (2) H: final state; Hq: it in the accumulation dtype
    C.chunk_outputs(p, Hq, code=code, eps=eps, causal=False, normalize=normalize)  # (3), counts q
    C.raise_nonfinite(p)
    return out
