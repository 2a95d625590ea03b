"""The direct-BLAS helper of the chunked kernel, against NumPy.

``linattn_nb.ops._gemm.gemm`` calls SciPy's ?gemm on flat offsets with
leading dimensions; a wrong operand swap, transpose flag or stride would give
wrong numbers here on non-square shapes.
"""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import njit

from linattn_nb.ops._gemm import gemm


# Not cached on disk: Numba keys a cached function on its own file only, so a
# cached _call would keep running the old machine code of ops/_gemm.py after an
# edit there (the package's own kernels are keyed on all its sources).
@njit(cache=False)
def _call(ta, tb, m, n, k, alpha, A, aoff, lda, B, boff, ldb, beta, C, coff, ldc):
    gemm(ta, tb, m, n, k, alpha, A, aoff, lda, B, boff, ldb, beta, C, coff, ldc)


def _view(buf, off, rows, cols, ld):
    return np.lib.stride_tricks.as_strided(buf.ravel()[off:], (rows, cols), (ld * buf.itemsize, buf.itemsize))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ta", [0, 1])
@pytest.mark.parametrize("tb", [0, 1])
@pytest.mark.parametrize("beta", [0.0, 1.0, -0.5])
def test_gemm_on_sub_blocks(rng, dtype, ta, tb, beta):
    """Sub-blocks of wider buffers (offsets, leading dims > columns), every transpose, beta."""
    m, n, k = 5, 3, 7
    lda, ldb, ldc = 11, 9, 6
    A = rng.standard_normal((12, lda)).astype(dtype)
    B = rng.standard_normal((10, ldb)).astype(dtype)
    C = rng.standard_normal((8, ldc)).astype(dtype)
    aoff, boff, coff = 2 * lda + 1, ldb + 2, 2 * ldc + 3
    a = _view(A, aoff, *((k, m) if ta else (m, k)), lda)
    b = _view(B, boff, *((n, k) if tb else (k, n)), ldb)
    expect = C.copy()
    c = _view(expect, coff, m, n, ldc)
    c[...] = 1.5 * ((a.T if ta else a).astype(np.float64) @ (b.T if tb else b)) + beta * c
    got = C.copy()
    _call(ta, tb, m, n, k, 1.5, A, aoff, lda, B, boff, ldb, beta, got, coff, ldc)
    tol = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(got, expect, rtol=tol, atol=tol)  # outside the block: untouched


def test_gemm_python_fallback_matches(rng):
    """The pure-Python body (what coverage tools and plain calls run) follows the same convention."""
    A = rng.standard_normal((4, 6))
    B = rng.standard_normal((6, 5))
    C = np.zeros((4, 5))
    gemm(0, 0, 4, 5, 6, 1.0, A, 0, 6, B, 0, 5, 0.0, C, 0, 5)
    np.testing.assert_allclose(C, A @ B)


def test_gemm_kernels_cache_across_processes(tmp_path):
    """The BLAS is bound by symbol name, not a baked-in address: a kernel
    that calls it is cached on disk and loads in a fresh process."""
    mod = tmp_path / "gemm_cache_probe.py"
    mod.write_text(textwrap.dedent("""
        import numpy as np
        from numba import njit
        from linattn_nb.ops._gemm import gemm

        @njit(cache=True)
        def prod(A, B, C):
            gemm(0, 0, A.shape[0], B.shape[1], A.shape[1], 1.0, A, 0, A.shape[1], B, 0, B.shape[1],
                 0.0, C, 0, C.shape[1])

        A = np.arange(6.0).reshape(2, 3); B = np.ones((3, 2)); C = np.empty((2, 2))
        prod(A, B, C)
        assert np.array_equal(C, A @ B)
        print(sum(prod.stats.cache_hits.values()))
    """))
    runs = [subprocess.run([sys.executable, str(mod)], capture_output=True, text=True, cwd=tmp_path,
                           env={**__import__("os").environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")})
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert [r.stdout.strip() for r in runs] == ["0", "1"]
