"""Parallel kernels called from several Python threads at once, under Numba's ``workqueue`` layer.

That layer (the default of the macOS wheels) aborts the whole process when two
threads are in parallel regions at the same time; the front ends serialise
their calls under it (:func:`linattn_nb._blas.parallel_calls`).  The layer is
chosen once per process, so the check runs in a subprocess.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from linattn_nb import _blas

_SCRIPT = textwrap.dedent("""
    import sys, threading
    import numpy as np
    import numba
    import linattn_nb
    from linattn_nb import _blas, config

    if len(sys.argv) > 1:  # the check's own mutation: pretend the layer is thread-safe
        _blas._layer = "omp"
    config.CPU_CHUNKED_SERIAL_MAX_WORK = 0  # every call takes the parallel kernels, however small
    config.KV_PARALLEL_MIN_WORK = 0  # the KV cache's step and query kernels too
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((8, 256, 16)).astype(np.float32) for _ in range(4))
    ref = linattn_nb.linear_attention(q, k, v, causal=True)
    ref_dq = linattn_nb.linear_attention_vjp(q, k, v, g, causal=True).dq

    def kv_calls():
        cache = linattn_nb.KVCache(16, 16, batch_shape=(8,), dtype=np.float32)
        cache.prefill(k[:, :200], v[:, :200])
        return cache.step(q[:, 200:201], k[:, 200:201], v[:, 200:201]), cache.query(q[:, 201:203])

    ref_kv = kv_calls()
    shared = linattn_nb.LinearAttentionState(16, 16, batch_shape=(8,), dtype=np.float32)
    shared.prefill(k[:, :64], v[:, :64])
    ref_query = [shared.query(q[:, :32] * (i + 1)) for i in range(3)]
    print("layer", numba.threading_layer(), flush=True)
    bad = []

    def run(i):
        try:
            for _ in range(40):
                ok = np.array_equal(linattn_nb.linear_attention(q, k, v, causal=True), ref)
                ok &= np.array_equal(linattn_nb.linear_attention_vjp(q, k, v, g, causal=True).dq, ref_dq)
                ok &= all(np.array_equal(a, b) for a, b in zip(kv_calls(), ref_kv))
                ok &= np.array_equal(shared.query(q[:, :32] * (i + 1)), ref_query[i])
                if not ok:
                    bad.append("result differs")
        except Exception as exc:
            bad.append(repr(exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("done", bad, flush=True)
""")


def _run(*args):
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue", NUMBA_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-c", _SCRIPT, *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_workqueue_calls_from_threads_are_serialised():
    res = _run()
    assert res.returncode == 0, res.stdout + res.stderr
    assert "layer workqueue" in res.stdout
    assert "done []" in res.stdout, res.stdout + res.stderr


def test_lock_only_under_workqueue(monkeypatch):
    # under omp / tbb the context takes no lock: two threads may be inside it at once
    monkeypatch.setattr(_blas, "_layer", "omp")
    with _blas.parallel_calls():
        assert not _blas._layer_lock._is_owned()
    monkeypatch.setattr(_blas, "_layer", "workqueue")
    with _blas.parallel_calls(), _blas.single_threaded_blas():  # re-entrant: nested launchers
        assert _blas._layer_lock._is_owned()
    assert not _blas._layer_lock._is_owned()
    assert np.all(np.array(_blas.blas_threads()) >= 1)


def test_torch_spin_detection():
    pytest.importorskip("torch")
    from linattn_nb.torch import _torch_threads_spin as spins

    omp = "ATen parallel backend: OpenMP"
    first = ["sys", "torch", "numpy", "linattn_nb", "linattn_nb.config"]
    assert spins(first, {"PATH"}, omp)  # torch loaded its OpenMP before config asked for passive waiting
    assert not spins(first[:1] + first[2:] + ["torch"], {"PATH"}, omp)  # linattn_nb first
    assert not spins(first, {"PATH", "OMP_WAIT_POLICY"}, omp)  # the process was started with a policy
    assert not spins(first, {"PATH", "GOMP_SPINCOUNT"}, omp)
    assert not spins(first, None, omp)  # initial environment unknown: no claim
    assert not spins(first, {"PATH"}, "ATen parallel backend: native thread pool")


def test_threads_may_query_one_decode_state_at_once():
    """query reads the state only: it wrote each token's features into the state's own scratch row, so
    threads querying one shared state (under omp, where parallel regions may overlap) read each other's
    features, 0.1-0.6 off in a probe."""
    from concurrent.futures import ThreadPoolExecutor

    import linattn_nb

    rng = np.random.default_rng(0)
    k, v = rng.normal(size=(2, 2, 64, 16))
    st = linattn_nb.LinearAttentionState(16, 16, batch_shape=(2,))
    st.prefill(k, v)
    qs = [rng.normal(size=(2, 256, 16)) * (i + 1) for i in range(4)]
    expected = [st.query(x) for x in qs]

    def worst(i):
        return max(float(np.abs(st.query(qs[i]) - expected[i]).max()) for _ in range(150))

    with ThreadPoolExecutor(4) as ex:
        assert max(ex.map(worst, range(4))) == 0.0



_LAYER_SCRIPT = textwrap.dedent("""
    import numba
    import numpy as np
    from linattn_nb import _blas
    predicted = _blas.threading_layer()

    @numba.njit(parallel=True, cache=False)
    def total(x):
        s = 0.0
        for i in numba.prange(x.size):
            s += x[i]
        return s

    total(np.ones(8))
    print(predicted, numba.threading_layer())
""")


@pytest.mark.parametrize("layer", ["forksafe", "threadsafe", "default"])
def test_the_predicted_layer_is_the_one_numba_starts(layer):
    """Before the first parallel kernel, threading_layer() (what `linattn info` shows, and what decides whether
    parallel calls from Python threads are serialised) names the layer Numba then starts.  ``forksafe`` was
    predicted as GNU OpenMP, which Numba leaves out there on Linux: it starts workqueue."""
    env = dict(os.environ, NUMBA_THREADING_LAYER=layer)
    proc = subprocess.run([sys.executable, "-c", _LAYER_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    predicted, started = proc.stdout.split()[-2:]
    assert predicted == started, (layer, predicted, started)
