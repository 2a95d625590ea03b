"""``seq_config`` against the shared memory the sequence kernel allocates, every branch.

The simulator has no shared-memory limit, so a wrong per-token size in
:func:`linattn_nb.ops.cuda.plan.seq_config` (a staged array left out, a
factor counted once instead of per row) would pass every result test and
fail at launch on a GPU.  Here the simulator's ``cuda.shared.array`` is
wrapped to record what one block of the kernel really allocates (one
array per call site), and the total is checked against
``config.CUDA_SHARED_BYTES`` with small limits that make the budget decide
the tile size and that reach every branch of ``seq_config``: the owner
layout, the row-group layout with its rows doubled, its columns halved
and its value block halved, and the two errors.  Each launch's output is
checked against the CPU as well.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import config
from linattn_nb.device import cuda_status
from linattn_nb.ops.cuda import owner, rows, tiles
from linattn_nb.ops.cuda import plan as KP
from linattn_nb.ops._codes import RULE_ADDITIVE, RULE_DECAY, RULE_DELTA, RULE_GATE, RULE_GATED_DELTA

cuda = pytest.importorskip("numba.cuda")
pytestmark = pytest.mark.skipif(cuda_status() != "simulator", reason="records shared arrays on the CUDA simulator")

#: The files of the sequence kernel's three layouts: the call sites whose shared arrays one block allocates.
KERNEL_FILES = {owner.__file__, rows.__file__, tiles.__file__}


@pytest.fixture
def recorded(monkeypatch):
    """Bytes of shared memory per call site of the kernels launched while the test runs (each array made under
    a lock, as tests/conftest.py makes the simulator's: its threads may otherwise each make their own)."""
    import threading

    from numba.cuda.simulator import kernelapi

    sites = {}
    real = kernelapi.FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0:  # dynamic shared memory (the sequence kernel has none)
            return real(self, shape, dtype, alignment)
        if hasattr(dtype, "key"):  # a Numba type
            from numba.np import numpy_support

            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        site = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            res = self._allocations.get(site)  # one array per call site and block, as the simulator keys them
            if res is None:
                res = self._allocations[site] = np.empty(shape, dtype)
            sites[site] = res.nbytes
        return res

    monkeypatch.setattr(kernelapi.FakeCUDAShared, "array", array)
    return sites


def _limits(monkeypatch, **knobs):
    for name, value in knobs.items():
        target = KP if name.isupper() and hasattr(KP, name) and not name.startswith("CUDA_") else config
        monkeypatch.setattr(target, name, value)


def _run(F, M, rule, dtype=np.float32, n=11):
    """One causal call on the simulator with D_phi = F (identity map on D = F) and the CPU's answer."""
    rng = np.random.default_rng(F * 100 + M)
    q, k = (rng.uniform(0.1, 1.0, size=(1, n, F)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((1, n, M)).astype(dtype)
    kw = {}
    if rule == RULE_DECAY:
        kw["decay"] = np.full((1, n), 0.9)
    elif rule == RULE_GATE:
        kw["decay"] = np.full((1, n, F), 0.8)
    elif rule in (RULE_DELTA, RULE_GATED_DELTA):
        kw["beta"] = np.full((1, n), 0.5)
        if rule == RULE_GATED_DELTA:
            kw["decay"] = np.full((1, n), 0.9)
        q = q / np.linalg.norm(q, axis=-1, keepdims=True)
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    normalize = rule not in (RULE_DELTA, RULE_GATED_DELTA)
    got = la.linear_attention(q, k, v, causal=True, feature_map="identity", method="scan", device="cuda",
                              normalize=normalize, **kw)
    want = la.linear_attention(q, k, v, causal=True, feature_map="identity", method="scan", device="cpu",
                               normalize=normalize, **kw)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


# (F, M, rule, dtype, limits, the branch it reaches: a predicate on (R, C, G, MB, T))
CASES = {
    "owner": (16, 6, RULE_ADDITIVE, np.float32, dict(CUDA_TILE_TOKENS=64),
              lambda R, C, G, MB, T: G == 1 and C == 1),
    "owner-gate": (8, 3, RULE_GATE, np.float32, dict(CUDA_TILE_TOKENS=64),
                   lambda R, C, G, MB, T: G == 1),
    "rows-doubled": (24, 4, RULE_ADDITIVE, np.float32,
                     dict(OWNER_MAX_ROWS=4, CUDA_ROWS_PER_THREAD=2, CUDA_COLS_PER_THREAD=2, CUDA_MAX_THREADS=16,
                          CUDA_TILE_TOKENS=64),
                     lambda R, C, G, MB, T: G > 1 and R > 2),
    "cols-halved": (8, 5, RULE_DECAY, np.float64,
                    dict(OWNER_MAX_ROWS=4, CUDA_ROWS_PER_THREAD=4, CUDA_COLS_PER_THREAD=4, MAX_TILE_WORDS=16,
                         CUDA_TILE_TOKENS=64),
                    lambda R, C, G, MB, T: G > 1 and C < 4),
    "values-halved": (16, 9, RULE_GATE, np.float32,
                      dict(OWNER_MAX_ROWS=4, CUDA_ROWS_PER_THREAD=4, CUDA_MAX_ROWS_PER_THREAD=4,
                           CUDA_COLS_PER_THREAD=1, CUDA_MAX_THREADS=12, CUDA_TILE_TOKENS=64),
                      lambda R, C, G, MB, T: G > 1 and MB < 9),
    "delta": (8, 4, RULE_DELTA, np.float32, dict(CUDA_TILE_TOKENS=64),
              lambda R, C, G, MB, T: C > 1),  # the row-group layout (the owner layout has C = 1)
}


#: Tokens per tile the budgets are sized for (< 8, the occupancy rule's floor; < N, so several tiles run).
TILE = 4


def _tile(monkeypatch, budget, F, M, item, rule):
    monkeypatch.setattr(config, "CUDA_SHARED_BYTES", budget)
    try:
        return KP.seq_config(F, M, item, rule)[4]
    except ValueError:
        return 0


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_allocates_within_the_budget(case, monkeypatch, recorded):
    F, M, rule, dtype, limits, branch = CASES[case]
    _limits(monkeypatch, **limits)
    item = np.dtype(dtype).itemsize
    # the smallest budget (in steps of 8 bytes) that seq_config says holds a tile of TILE tokens: then
    # the budget decides the tile, and any byte seq_config leaves out of its count shows as an excess
    budget = next(b for b in range(8, 1 << 16, 8) if _tile(monkeypatch, b, F, M, item, rule) >= TILE)
    cfg = KP.seq_config(F, M, item, rule)
    assert cfg[4] == TILE and branch(*cfg), (case, cfg)
    _run(F, M, rule, dtype)
    total = sum(nbytes for (path, _), nbytes in recorded.items() if path in KERNEL_FILES)
    assert 0 < total <= config.CUDA_SHARED_BYTES, (case, cfg, total)


def test_errors_name_the_limit(monkeypatch):
    _limits(monkeypatch, OWNER_MAX_ROWS=4, CUDA_ROWS_PER_THREAD=2, CUDA_MAX_ROWS_PER_THREAD=2, CUDA_MAX_THREADS=8)
    with pytest.raises(ValueError, match="threads per block"):
        KP.seq_config(64, 4, 4, RULE_ADDITIVE)
    monkeypatch.undo()
    _limits(monkeypatch, CUDA_SHARED_BYTES=64)
    with pytest.raises(ValueError, match="CUDA_SHARED_BYTES"):
        KP.seq_config(64, 64, 4, RULE_ADDITIVE)
    with pytest.raises(ValueError, match="CUDA_MAX_FEATURES"):
        KP.seq_config(int(config.CUDA_MAX_FEATURES) + 1, 4, 4, RULE_ADDITIVE)


@pytest.mark.parametrize("rule", [RULE_ADDITIVE, RULE_DECAY, RULE_GATE, RULE_DELTA, RULE_GATED_DELTA],
                         ids=["additive", "decay", "gate", "delta", "gated_delta"])
def test_tile_layout_allocates_what_it_counts(rule, monkeypatch, recorded):
    """The tile layout's tile is D_phi / 4 tokens whatever the budget, so the budget decides only
    whether the layout applies (:func:`tiles_fits`): what one block allocates must be exactly the
    bytes ``_tiles_sizes`` counts, the decay rule's per-token factors, the gate rule's scaled
    copies and product rows and the delta rules' beta, L, W and U' included."""
    monkeypatch.setattr(config, "CUDA_SEQ_LAYOUT", "tiles")
    F, M = 12, 5
    assert KP.seq_config(F, M, 4, rule, "tiles")[2] == 0
    _run(F, M, rule)
    total = sum(nbytes for (path, _), nbytes in recorded.items() if path in KERNEL_FILES)
    assert total == KP._tiles_sizes(F, M, 4, rule)[4], (total, KP._tiles_sizes(F, M, 4, rule))
