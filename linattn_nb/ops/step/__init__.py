"""Recurrent decoding: the state step, query and prefill, and the KV-cache step.

``naive.py`` holds the NumPy references, ``cpu.py`` the Numba CPU kernels,
``cuda.py`` the CUDA kernels.  Besides the additive rule's kernels, each has
``rule_*`` kernels for the rules whose tokens scale the state first (decay,
gate: ``S_t = a_t (.) S_{t-1} + phi(k_t) v_t^T``, ``z`` alike) and for
``normalize=False``; they take the log-factors of each token, ``-inf`` a
reset.  The public objects are
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
