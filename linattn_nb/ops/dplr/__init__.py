"""Kernels of the diagonal-plus-low-rank (DPLR) recurrence: the float64 reference and the CPU scan.

Both take the recurrence in its general form (:mod:`linattn_nb.dplr` builds it from a call):
per token ``t``, ``r`` sub-steps ``j``,

    H <- (D_t + b_tj a_tj^T) H + kw_tj [vw_tj 1]^T     (D_t at j = 0 only; the identity after)

on the state ``H = [S | z]`` (F x (M + 1), float64), then the token's read-out
``o_t = phi(q_t)^T H``.  Arrays (batch flattened to B):

* ``fq`` (B, N, F) query features; ``ld`` (B, N, W) log-diagonal, ``W`` 0 (none), 1 (one value for
  every feature) or F; ``A``, ``Bv`` (B, N, r, F) the low-rank vectors;
* ``KW`` (B, N, w, F) and ``VW`` (B, N, w, M) the writes, ``w`` = r (one write after each sub-step)
  or 1 (one write after the last sub-step).
"""
