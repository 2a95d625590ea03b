"""Kernels, launchers and naive references, one sub-package per operation.

``ops/<op>/naive.py`` holds the NumPy ground truth, ``cpu.py`` (and
``causal/chunked.py``) the Numba CPU kernels, ``cuda.py`` the CUDA launchers;
``registry.py`` is the method table and ``methods.py`` its registrations.  The
layout of the modules: ``docs/contributing.md``.
"""
