"""Compile CUDA kernels to sm_90 PTX in a subprocess (the simulator off), for the PTX tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import linattn_nb as la


def run_ptx_script(script: str) -> dict:
    """Run ``script`` with NUMBA_ENABLE_CUDASIM=0 and return the JSON dict on its last stdout line.

    Skips the calling test when numba-cuda's NVVM is not importable or not installed.
    """
    try:
        from numba.cuda.cudadrv import nvvm  # noqa: F401
    except Exception as exc:  # pragma: no cover
        pytest.skip(f"numba-cuda NVVM not importable: {exc}")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(la.__file__)))] + sys.path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0 and ("NvvmSupportError" in proc.stderr or "libnvvm" in proc.stderr.lower()):
        pytest.skip("the CUDA toolkit's NVVM is not installed (install the 'cuda' extra)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
