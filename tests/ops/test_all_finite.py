"""The parallel finiteness check of the gradient front end against NumPy's."""
import numpy as np
import pytest

from linattn_nb.ops._finite import all_finite


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape", [(0, 3), (5,), (1, 1), (3, 300, 7), (2, 257, 65)])
@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
def test_matches_numpy(dtype, shape, bad):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(dtype)
    if x.size:
        x.flat[-1] = np.finfo(dtype).max  # large finite values are finite
        x.flat[0] = -np.finfo(dtype).max
    if bad is not None and x.size:
        x.flat[x.size // 2] = bad
    assert all_finite(x) == bool(np.isfinite(x).all())


@pytest.mark.parametrize("col", [0, 63, 64])
def test_strided_column_slice(col):
    """A column slice reads only its own columns (the VJP's dv is one)."""
    a = np.ones((2, 300, 65), np.float32)
    a[1, 299, col] = np.nan
    view = a[:, :, :64]
    assert all_finite(view) == (col >= 64)
    assert all_finite(view) == bool(np.isfinite(view).all())
