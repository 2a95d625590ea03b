"""Recurrent decoding: the state step, query and prefill, and the KV-cache step.

``cpu.py`` holds the Numba CPU kernels, ``cuda.py`` the CUDA kernels, ``launchers.py`` the method
table's step entries; the public objects are :class:`linattn_nb.LinearAttentionState` and
:class:`linattn_nb.KVCache`.  Design: ``docs/design-cpu.md``, "Decode-step kernels".
"""
