"""The gradient front end's parallel helpers against NumPy: the finiteness check and the log-factor gradient."""
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


# --------------------------------------------------------------------------
# the log-factor gradient from the factor gradient (_outgrad.times_factor)
# --------------------------------------------------------------------------
from linattn_nb.ops.grad._outgrad import times_factor  # noqa: E402


@pytest.mark.parametrize("shape", [(0,), (1,), (3, 5), (2, 40000), (2, 7, 3)])
def test_times_factor_is_g_exp_lg(shape):
    rng = np.random.default_rng(2)
    lg = -rng.exponential(2.0, shape)
    g = rng.standard_normal(shape)
    if lg.size > 4:
        lg.flat[0] = 0.0
        lg.flat[1] = -np.inf  # a reset: 0
        lg.flat[2] = -800.0  # below the float64 range: 0
        lg.flat[3] = -700.0
    want = g * np.exp(lg)
    got = times_factor(g.copy(), lg)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=4 * np.finfo(np.float64).eps, atol=1e-300)


def test_times_factor_writes_over_g_and_keeps_nan():
    g = np.array([1.0, np.nan, 2.0])
    lg = np.array([0.0, -1.0, -np.inf])
    out = times_factor(g, lg)
    assert out is g
    assert out[0] == 1.0 and np.isnan(out[1]) and out[2] == 0.0


@pytest.mark.parametrize("bad", ["dtype", "shape", "order"])
def test_times_factor_errors(bad):
    g, lg = np.ones((3, 4)), np.zeros((3, 4))
    if bad == "dtype":
        g = g.astype(np.float32)
    elif bad == "shape":
        lg = np.zeros((4, 3))
    else:
        g = np.ones((4, 3)).T
    with pytest.raises(ValueError, match="g"):
        times_factor(g, lg)


def test_factor_counts_across_spans():
    """The parallel count of bad and reset log-factors against NumPy's, with hits in several spans."""
    from linattn_nb._validate import factor_counts

    rng = np.random.default_rng(3)
    x = -rng.exponential(1.0, 3 * (1 << 15) + 17)
    x[[0, 40000, len(x) - 1]] = [np.nan, 0.5, -1e300]
    x[70000] = -np.inf
    lo, hi, reset = -np.inf, 0.0, -1e30
    bad = int(np.isnan(x).sum() + ((x < lo) | (x > hi)).sum())
    assert factor_counts(x, lo, hi, reset) == (bad, int((x <= reset).sum()))
    assert factor_counts(x[:0], lo, hi, reset) == (0, 0)


from linattn_nb.ops.grad._cpu_chunked import copy_state_t  # noqa: E402


@pytest.mark.parametrize("src, dst", [(np.float64, np.float32), (np.float64, np.float64), (np.float32, np.float32)])
@pytest.mark.parametrize("shape", [(64, 65), (3, 7), (1, 1), (5, 1)])
def test_copy_state_t_is_the_rounded_transpose(src, dst, shape):
    # the chunked backwards' products with S^T, R^T read this copy: it must be H.T rounded as astype rounds,
    # every element written (a stale element would survive from the previous chunk)
    rng = np.random.default_rng(3)
    H = (rng.standard_normal(shape) * 1e3).astype(src)
    H[0, -1] = np.nextafter(1.0, 2.0)  # not a float32: rounds
    Ht = np.full(shape[::-1], np.nan, dst)
    copy_state_t(H, Ht)
    np.testing.assert_array_equal(Ht, H.T.astype(dst))


from linattn_nb.ops.grad._cpu_chunked import within  # noqa: E402


@pytest.mark.parametrize("n", [0, 1, 5, 8])
@pytest.mark.parametrize("bad", [None, "nan", "low", "high", "edge"])
def test_within_is_the_range_test_of_the_first_rows(n, bad):
    # the gate kernel's choice of its GEMM form reads it: any element of rows [0, n) outside [lo, 1 / lo], or
    # NaN, makes it False; rows from n on are not read
    rng = np.random.default_rng(n)
    lo = 1e-3
    x = rng.uniform(0.01, 10.0, (8, 6))
    x[-1, -1] = np.nan if n < 8 else x[-1, -1]  # beyond the rows read
    if bad is not None and n:
        t, i = rng.integers(0, n), rng.integers(0, 6)
        x[t, i] = {"nan": np.nan, "low": lo / 2, "high": 2 / lo, "edge": lo}[bad]
    want = bool(np.all((x[:n] >= lo) & (x[:n] <= 1 / lo)))
    assert bool(within(x, n, lo)) == want
    if bad in ("nan", "low", "high") and n:
        assert not want


def test_float32_log_factors_in_one_pass_across_spans():
    """float32 log-factors: converted (exactly), reset at LOG_RESET and counted in one parallel pass, against
    NumPy's float64 conversion, ``np.where`` and counts, with hits in several spans."""
    from linattn_nb._validate import log_factors_into
    from linattn_nb.ops._codes import LOG_RESET

    rng = np.random.default_rng(4)
    x = (-rng.exponential(1.0, 3 * (1 << 15) + 17)).astype(np.float32)
    x[[0, 40000, len(x) - 1]] = [np.nan, 0.5, -1e30]
    x[[70000, 70001, 70002]] = [-np.inf, np.float32(LOG_RESET), np.nextafter(np.float32(LOG_RESET), 0)]
    x[5] = -0.0
    out = np.full(x.shape, 7.0)
    x64 = x.astype(np.float64)
    bad = int(np.isnan(x64).sum() + (x64 > 0).sum())
    assert log_factors_into(x, out, LOG_RESET) == (bad, int((x64 <= LOG_RESET).sum()))
    want = np.where(x64 <= LOG_RESET, -np.inf, x64)
    np.testing.assert_array_equal(out, want)
    assert out[70002] == x64[70002] > LOG_RESET  # the float32 just above the reset is kept, exactly
    assert log_factors_into(x[:0], out[:0], LOG_RESET) == (0, 0)


@pytest.mark.parametrize("shape", [(2, 3, 9, 4), (2, 3, 9), (2, 3), ()])
def test_float32_log_decay_inputs_are_those_of_float64(shape):
    """``decay_inputs`` of float32 ``log_decay`` (the one-pass conversion) gives the float64 path's inputs
    bit for bit, in a fresh array or in the ``work`` array given, never the caller's; NaN and positive
    values are refused, naming ``log_decay``."""
    from linattn_nb._validate import decay_inputs

    rng = np.random.default_rng(6)
    x = np.asarray(-rng.exponential(1.0, shape), np.float32)
    if x.ndim:
        x.flat[0] = -np.inf
        x.flat[-1] = -800.0  # below LOG_RESET: a reset
    made = []

    def work(role, shp, dtype):
        made.append(np.full(shp, 3.0, dtype))
        return made[-1]

    want = decay_inputs(None, x.astype(np.float64), (2, 3), 9, 4, causal=True)
    for kw in ({}, {"work": work}):
        for copy in (True, False):
            got = decay_inputs(None, x, (2, 3), 9, 4, causal=True, copy=copy, **kw)
            assert got[0] == want[0]
            (key, a), = got[1].items()
            np.testing.assert_array_equal(a, want[1][key])
            assert a.dtype == np.float64 and a.flags.c_contiguous and a.flags.writeable
            assert not np.shares_memory(a, x)
    assert len(made) == 2
    if shape == (2, 3, 9, 4):  # the full-size gate is the work array itself
        assert got[1]["log_gate"] is made[-1] or np.shares_memory(got[1]["log_gate"], made[-1])
    for badv, msg in ((np.nan, "log_decay contains NaN"), (0.25, "log_decay must be <= 0")):
        y = x.copy()
        y.reshape(-1)[-1] = badv
        with pytest.raises(ValueError, match=msg):
            decay_inputs(None, y, (2, 3), 9, 4, causal=True)
