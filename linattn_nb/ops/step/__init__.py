"""Recurrent decoding: the state step, query and prefill, and the KV-cache step.

``naive.py`` holds the NumPy references, ``cpu.py`` the Numba CPU kernels,
``cuda.py`` the CUDA kernels.  Each device has one step kernel for every
update rule (and one prefill; the delta rules' is the step kernel without
outputs): the rule is an integer argument, its per-token inputs one float64
array ``lg`` (B, T, G) as the sequence kernels take them, and what a rule
changes in a step are the step hooks of :mod:`linattn_nb.ops._rules` (CPU)
and :mod:`linattn_nb.ops._cuda_common` (CUDA).  The public objects are
:class:`linattn_nb.LinearAttentionState` and :class:`linattn_nb.KVCache`
(:mod:`linattn_nb.state`).

State layout on the CPU: the kernels keep ``S`` transposed, one ``(M, D_phi)``
block per batch entry, so that a decode step is one contiguous row of
``D_phi`` elements per output coordinate: the update ``S += phi(k) v^T`` and
the read ``phi(q)^T S`` fuse into one pass over each row with a register
accumulator.  (With ``S`` as ``(D_phi, M)`` the read is a column reduction
that reloads and stores the accumulator row once per feature, which measured
slower; docs/measurements-cpu.md.)  On the GPU the state keeps the canonical
``(D_phi, M)`` layout: one thread per output coordinate ``m`` walks the
features, so a warp reads consecutive ``m`` (coalesced).
"""
