"""Kernels, launchers and naive references, one sub-package per operation.

Layout: ``ops/<op>/naive.py`` holds the NumPy ground truth, ``ops/<op>/cpu.py``
(and ``causal/chunked.py``) the Numba CPU kernels and their launchers,
``ops/<op>/cuda.py`` the CUDA launchers.  Shared machinery: ``_codes.py`` (map
and rule codes, the rule table), ``_rules.py`` / ``_cuda_common.py`` (per-rule
hooks), ``_chunks.py`` / ``_cuda_launch.py`` (chunk plan, prefix, combine),
``registry.py`` (the method table) and ``methods.py`` (the registrations);
``cuda/`` the CUDA sequence kernel, its launch plan and helper kernels.
Public functions live in :mod:`linattn_nb.attention` and reach the launchers
through the front end (:mod:`linattn_nb._frontend`) and the method table.
"""
