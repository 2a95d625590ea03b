"""serial_and_parallel: one body, a serial and a parallel kernel, separate caches."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import prange

from linattn_nb.ops._twins import serial_and_parallel


def _body(x, out):
    for i in prange(x.shape[0]):
        out[i] = 2.0 * x[i] + 1.0


def test_both_kernels_compute_the_body():
    ser, par = serial_and_parallel(_body)
    x = np.arange(1000.0)
    a, b = np.empty_like(x), np.empty_like(x)
    ser(x, a)
    par(x, b)
    assert np.array_equal(a, 2 * x + 1) and np.array_equal(b, a)
    assert par.targetoptions.get("parallel") is True
    assert not ser.targetoptions.get("parallel")
    assert ser.py_func.__qualname__.endswith("_body_serial")
    assert par.py_func.__qualname__.endswith("_body_parallel")


def test_parallel_option_is_refused():
    with pytest.raises(TypeError, match="parallel"):
        serial_and_parallel(_body, parallel=True)


def test_on_disk_caches_are_separate(tmp_path):
    """A cached serial kernel is never loaded as the parallel one (or back):
    each has its own cache files, and a second process loads both from disk."""
    mod = tmp_path / "twin_probe.py"
    mod.write_text(textwrap.dedent("""
        import numpy as np
        from numba import prange
        from linattn_nb.ops._twins import serial_and_parallel

        def body(x, out):
            for i in prange(x.shape[0]):
                out[i] = x[i] + 1.0

        ser, par = serial_and_parallel(body, cache=True)
        x = np.ones(64); o = np.empty(64)
        ser(x, o); par(x, o)
        print(sum(ser.stats.cache_hits.values()), sum(par.stats.cache_hits.values()))
    """))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, str(mod)], capture_output=True, text=True, cwd=tmp_path, env=env)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert runs[0].stdout.split() == ["0", "0"]
    assert runs[1].stdout.split() == ["1", "1"]
    names = sorted(p.name for p in (tmp_path / "cache").rglob("*.nbi"))
    assert any("body_serial" in n for n in names) and any("body_parallel" in n for n in names)


def test_pick_rule_and_force():
    from linattn_nb.ops._twins import pick

    ser, par = object(), object()
    assert pick(ser, par, items=4, work=100, limit=100) is par
    assert pick(ser, par, items=4, work=99, limit=100) is ser  # too little work for a parallel region
    assert pick(ser, par, items=1, work=10**9, limit=100) is ser  # nothing to share out
    assert pick(ser, par, items=1, work=0, limit=100, force=True) is par
    assert pick(ser, par, items=8, work=10**9, limit=100, force=False) is ser
