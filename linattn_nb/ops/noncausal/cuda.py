"""CUDA launcher of non-causal linear attention: aggregate, then query.

Launcher contract as in :mod:`linattn_nb.ops.causal.cuda`.  Three launches:
(1) the state increment ``sum phi(k_j) v_j^T``, ``sum phi(k_j)`` of every
chunk of ``config.CUDA_CHUNK_SIZE`` tokens, in parallel over (batch, chunk,
column block); (2) the sum over chunks plus the initial state, in float64,
which is the final state; (3) every token reads that state:
``o_i = phi(q_i)^T S / max(phi(q_i)^T z, eps)`` (Katharopoulos et al. 2020,
Eq. 7; ``normalize=False``: ``o_i = phi(q_i)^T S``), in parallel over
(batch, chunk of queries, column block).  Additive rule only.  The passes
are those of :mod:`linattn_nb.ops._cuda_launch`.
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
