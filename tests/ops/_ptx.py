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


def seq_kernel_ptx_script(kernels, helper: str, helper_sig: str) -> str:
    """A PTX script for :func:`run_ptx_script`: the sequence kernels ``kernels``, ``(acc, rule code,
    layout)`` triples, at D_phi = M = 64 (``layout`` "default": the configuration ``seq_config``
    picks, the owner layout or row groups; "tiles": the tile layout a GPU with few sequences per
    multiprocessor takes), each as the launchers run it on contiguous inputs, and the helper kernel
    ``helper`` of ``linattn_nb.ops.cuda.helpers`` with the Numba signature ``helper_sig`` (an
    expression in ``types``, ``i`` = int64, ``f64`` = float64).  The JSON maps
    ``"<acc>/<rule>/<layout>"`` and ``helper`` to ``{"target", "entry", "local"}`` (local: PTX local
    memory).
    """
    return f"""
import json
from numba import cuda, types
from linattn_nb.ops.cuda import helpers as KH, plan as KP, seq as KS
res = {{}}
i, b, f64 = types.int64, types.boolean, types.float64
for acc, rule, layout in {tuple(tuple(x) for x in kernels)!r}:
    item = 4 if acc == "float32" else 8
    cfg = KP.seq_config(64, 64, item, rule, "tiles" if layout == "tiles" else "owner")
    assert (cfg[2] == 0) == (layout == "tiles"), cfg
    kern = KS.seq_kernel(*cfg, acc, rule, None, True, KP.VEC_QK | KP.VEC_V)  # contiguous inputs' kernel
    text, _ = cuda.compile_ptx(kern.py_func, KS.seq_signature(acc, acc), cc=(9, 0))
    res["%s/%d/%s" % (acc, rule, layout)] = {{"target": ".target sm_90" in text, "entry": ".entry" in text,
                                             "local": ("ld.local" in text) or ("st.local" in text)}}
text, _ = cuda.compile_ptx(KH.{helper}.py_func, {helper_sig}, cc=(9, 0))
res["{helper}"] = {{"target": ".target sm_90" in text, "entry": ".entry" in text, "local": False}}
print(json.dumps(res))
"""
