"""Kernels, launchers and naive references, one sub-package per operation.

Layout (see shared GUIDE): ``ops/<op>/naive.py`` holds the NumPy ground truth,
``ops/<op>/cpu.py`` the Numba CPU kernels and their launchers,
``ops/<op>/cuda.py`` the CUDA kernels.  Public functions live in
:mod:`linattn_nb.attention` and reach the launchers through the method table
in :mod:`linattn_nb.ops.registry`.
"""
