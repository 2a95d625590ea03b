"""The DPLR kernels' serial and batch-parallel twins (``linattn_nb.ops.dplr.cpu.pick_kernel``).

The other DPLR tests run short sequences, below ``config.CPU_CHUNKED_SERIAL_MAX_WORK``, so they run (and
compile) the serial twins only; here each parallel twin runs the same calls and must give the serial
twin's results, and the choice between them is checked at its edges."""
from __future__ import annotations

import numpy as np
import pytest

from linattn_nb import config
from linattn_nb.ops._codes import NORM_FLOOR, NORM_NONE, NORM_RAW
from linattn_nb.ops.dplr import chunked, chunked_grad, cpu


def _arrays(rng, B, N, F, M, r, dtype=np.float64):
    fq = rng.random((B, N, F)).astype(dtype)
    ld = rng.uniform(-0.7, 0.0, (B, N, F))
    ld[1, 5, 2] = -np.inf  # a reset in one sequence: the chunked kernels run that token by the scan
    A, Bv, KW = (rng.standard_normal((B, N, r, F)) * 0.3 for _ in range(3))
    VW = rng.standard_normal((B, N, r, M))
    return fq, ld, A, Bv, KW, VW


def _both(monkeypatch, call):
    """``call()`` with every kernel serial, then with every kernel parallel."""
    monkeypatch.setattr(config, "CPU_CHUNKED_SERIAL_MAX_WORK", 1 << 62)
    serial = call()
    monkeypatch.setattr(config, "CPU_CHUNKED_SERIAL_MAX_WORK", 0)
    return serial, call()


def _same(a, b):
    for x, y in zip(a, b):
        np.testing.assert_allclose(y, x, rtol=1e-12, atol=1e-12 * max(1.0, np.abs(x).max(initial=0.0)))


@pytest.mark.slow
def test_parallel_twins_give_the_serial_results(rng, monkeypatch):
    B, N, F, M, r = 3, 21, 4, 3, 2
    fq, ld, A, Bv, KW, VW = _arrays(rng, B, N, F, M, r)
    H0 = rng.random((B, F, M + 1)) + 0.5
    dout = rng.standard_normal((B, N, M))
    dH = rng.standard_normal((B, F, M + 1))

    def forward(kernel, dtype):
        def call():
            H, out = H0.copy(), np.empty((B, N, M), dtype)
            bad = kernel(fq.astype(dtype), ld, A, Bv, KW, VW, H, out, NORM_FLOOR, 0.25)
            return bad, H, out
        return call

    for kernel in (cpu.dplr_scan, chunked.dplr_chunked):  # float64: a race would show in any dtype
        serial, parallel = _both(monkeypatch, forward(kernel, np.float64))
        assert not serial[0].any()
        _same(serial, parallel)
    serial, parallel = _both(monkeypatch, lambda: cpu.dplr_scan_backward(fq, ld, A, Bv, KW, VW, H0, dout, dH,
                                                                         NORM_RAW, 0.0, 5))
    _same(serial, parallel)
    serial, parallel = _both(monkeypatch, lambda: chunked_grad.dplr_chunked_backward(fq, ld, A, Bv, KW, VW, H0, dout,
                                                                                     dH, NORM_RAW, 0.0, 8, 2))
    _same(serial, parallel)
    for twin in (cpu.dplr_scan_parallel, chunked.dplr_chunked_parallel, cpu.dplr_scan_backward_parallel,
                 chunked_grad.dplr_chunked_backward_parallel):  # each parallel kernel ran
        assert twin.signatures, twin


def test_the_choice_between_the_twins(monkeypatch):
    """Parallel from the work limit (B N r F (M + 1) multiply-adds) with two sequences or more, else serial."""
    monkeypatch.setattr(config, "CPU_CHUNKED_SERIAL_MAX_WORK", 2 * 10 * 3 * 4 * 6)

    def pick(B, N=10, r=3, F=4, M=5, weight=1):
        return cpu.pick_kernel("serial", "parallel", np.empty((B, N, F)), np.empty((B, N, r, F)),
                               np.empty((B, N, 1, M)), weight)

    assert pick(2) == "parallel"
    assert pick(2, N=9) == "serial"  # one token short of the limit
    assert pick(1, N=20) == "serial"  # one sequence: nothing to share out
    assert pick(4, r=1) == "serial" and pick(6, r=1) == "parallel"
    assert pick(2, N=3, weight=3) == "serial" and pick(2, N=3, weight=4) == "parallel"  # the scans' weights


def test_the_scans_count_their_work_by_their_weights(monkeypatch):
    """The scan kernels' picks use config.DPLR_SCAN_WORK_WEIGHT and DPLR_SCAN_BACKWARD_WORK_WEIGHT."""
    seen = []
    monkeypatch.setattr(cpu, "pick_kernel", lambda s, p, fq, A, VW, weight=1: seen.append(weight) or s)
    monkeypatch.setattr(config, "DPLR_SCAN_WORK_WEIGHT", 5)
    monkeypatch.setattr(config, "DPLR_SCAN_BACKWARD_WORK_WEIGHT", 7)
    B, N, F, M = 1, 2, 3, 2
    fq, ld = np.ones((B, N, F)), np.zeros((B, N, F))
    A = np.zeros((B, N, 1, F))
    VW = np.ones((B, N, 1, M))
    cpu.dplr_scan(fq, ld, A, A, A, VW, np.zeros((B, F, M + 1)), np.empty((B, N, M)), NORM_NONE, 0.0)
    cpu.dplr_scan_backward(fq, ld, A, A, A, VW, np.zeros((B, F, M + 1)), np.ones((B, N, M)),
                           np.zeros((B, F, M + 1)), NORM_NONE, 0.0, 2)
    assert seen == [5, 7]
