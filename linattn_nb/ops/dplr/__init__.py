"""Kernels of the diagonal-plus-low-rank (DPLR) recurrence: reference, CPU scan and chunks, CUDA scan.

Per token ``t``, ``r`` sub-steps ``j``: ``H <- (D_t + b_tj a_tj^T) H + kw_tj [vw_tj 1]^T`` (``D_t`` at
``j = 0`` only) on ``H = [S | z]`` float64, then ``o_t = phi(q_t)^T H``.  The arrays ``fq``, ``ld``,
``A``, ``Bv``, ``KW``, ``VW``: ``docs/dplr.md``, "Kernels".
"""
