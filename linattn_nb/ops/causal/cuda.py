"""CUDA launchers of causal linear attention: ``scan`` and ``chunked``.

Both follow the launcher contract of :mod:`linattn_nb.ops.registry`, on
device arrays::

    launcher(q, k, v, H, out, *, code, eps, inputs=None, check_finite=False, normalize=True,
             rule=RULE_ADDITIVE) -> out

q, k : (B, N, F) or (B1, B2, N, F) device arrays (any non-negative strides;
raw inputs when ``code`` > 0, the elementwise map is applied in the kernel),
v, out : (B, N, M) or (B1, B2, N, M); H : (B, F, M + 1) float64 C-contiguous
device array, the state ``[S | z]`` (column M is the normaliser, the state of
a value column of ones), updated in place from the initial to the final
state; ``inputs``: the rule's extra per-token inputs, none for the additive
rule, ``{"log_decay": (B, N)}`` for the decay rule, ``{"log_gate": (B, N,
F)}`` for the gate rule (float64 log-factors <= 0, ``-inf`` a reset),
``{"beta": (B, N)}`` for the delta rule and ``{"beta": (B, N), "log_decay":
(B, N)}`` for the gated delta rule (write strengths in [0, 2]); host NumPy
arrays are copied to the device, device arrays read in place (the delta
rules' two inputs are first packed into one (B, N, 2) device array);
``normalize=False`` writes ``phi(q_t)^T S_t`` without the division;
``check_finite=True``: the sequence kernels count the NaN/inf values of q, k,
v while staging them and the launcher reads the three counts once after its
launches, raising ValueError naming the first argument that held one (the
output and ``H`` have been written by then); ``False`` adds nothing;
``rule``: the update-rule code (:data:`linattn_nb.ops._codes.RULES`; the
method table binds it per rule), whose per-token and per-chunk steps are the
hooks of :mod:`linattn_nb.ops._cuda_common`.  Any dtype mix of
float16/32/64; accumulation in float32, or float64 when an input is float64
(see :mod:`linattn_nb.ops.cuda`).

* ``scan``: one block per (batch entry, block of value columns) walks the
  sequence; parallelism B x ceil(M / config.CUDA_VALUE_COLS) blocks.
* ``chunked``: three launches. (1) the state increment of every chunk of
  ``config.CUDA_CHUNK_SIZE`` tokens, in parallel over (batch, chunk, column
  block); (2) an exclusive prefix over chunks in float64, plus the initial
  state, which also gives the final state (a rule with per-token factors
  scales the state entering each chunk by the chunk's total factor); (3) every
  chunk runs the scan from its own starting state, in parallel.  Parallelism B x chunks x column
  blocks, for long sequences with few batch entries (Yang et al. 2024, GLA,
  Sec. 2.2, for the chunk decomposition).

  The delta rules (``"delta"``, ``"gated_delta"``) are the exception: their
  chunk transition is an (F, F) matrix (``prod_t a_t (I - beta_t k_t
  k_t^T)``), not a factor per state row, so the combine of step (2) does not
  apply.  For them ``chunked`` runs the scan (one block per batch entry and
  column block walks the chunks of its sequence in order): correct, with the
  scan's parallelism.  A chunkwise-parallel form (WY/UT chunks and an
  (F, F) transition per chunk) is future work.

The passes are those of :mod:`linattn_nb.ops._cuda_launch`.
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
