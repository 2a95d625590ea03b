"""Recurrent decoding: the state step, query and prefill, and the KV-cache step.

``naive.py`` holds the NumPy references, ``cpu.py`` the Numba CPU kernels, ``cuda.py`` the CUDA
kernels; one step kernel per device for every rule, whose per-rule parts are the step hooks of
:mod:`linattn_nb.ops._rules` (CPU) and :mod:`linattn_nb.ops._cuda_common` (CUDA).  The public
objects are :class:`linattn_nb.LinearAttentionState` and :class:`linattn_nb.KVCache`.  Design:
``docs/design-cpu.md``, "Decode-step kernels".
"""
