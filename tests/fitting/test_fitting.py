"""feature_maps.fit and the fitting losses (linattn_nb.fitting) against explicit references.

The streamed losses are checked against ``fitting.naive`` (explicit ``N x N``
matrices) on edge shapes and row blocks that do not divide N; the gradients
with respect to features against finite differences of the naive loss, and
the parameter gradients against finite differences of the objective.
"""
from __future__ import annotations

import sys
import tracemalloc
import warnings

import numpy as np
import pytest

from linattn_nb import config, feature_maps as fm
from linattn_nb.fitting import FitHistory, FitResult, fit, naive, objective
from linattn_nb.fitting._objective import WeightsLoss, row_block


def _data(shape, seed=0, sd=1.0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=shape) * sd, rng.normal(size=shape) * sd


def _features(name, q, k, causal, **params):
    phi = fm.get(name, **params)
    return phi.apply(q, role="query", causal=causal), phi.apply(k, role="key", causal=causal)


# ---------------------------------------------------------------------------
# The streamed weights loss against the explicit one
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kl", [False, True])
@pytest.mark.parametrize("n,rows", [(1, 1), (7, 3), (37, 5), (64, 64), (33, 100)])
def test_weights_loss_matches_naive(causal, kl, n, rows):
    q, k = _data((2, n, 5), seed=n)
    fq, fk = _features("hedgehog", q, k, causal)
    loss = WeightsLoss(q, k, scale=0.4, causal=causal, floor=0.0, kl=kl, block_bytes=16 * n * rows)
    assert loss.block == min(n, rows)
    value, dfq, dfk = loss(fq, fk)
    again, _, _ = loss(fq, fk)  # second call: cached softmax rows, entropy known
    ref = naive.weights_loss_naive(fq, fk, q, k, scale=0.4, causal=causal, kl=kl)
    assert value == pytest.approx(ref, rel=1e-13, abs=1e-14)
    assert again == value
    assert dfq.shape == fq.shape and dfk.shape == fk.shape


@pytest.mark.parametrize("causal", [False, True])
def test_weights_loss_uncached_equals_cached(causal):
    q, k = _data((3, 29, 4), seed=2)
    fq, fk = _features("hedgehog", q, k, causal)
    a = WeightsLoss(q, k, scale=0.5, causal=causal, floor=0.0, kl=True, block_bytes=16 * 29 * 4)
    b = WeightsLoss(q, k, scale=0.5, causal=causal, floor=0.0, kl=True, block_bytes=16 * 29 * 4, cache_bytes=0)
    assert b._cache is None and a._cache is not None
    ra, rb = a(fq, fk), b(fq, fk)
    assert ra[0] == pytest.approx(rb[0], rel=1e-14)
    np.testing.assert_allclose(ra[1], rb[1], rtol=1e-13, atol=1e-16)
    np.testing.assert_allclose(ra[2], rb[2], rtol=1e-13, atol=1e-16)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kl", [False, True])
def test_feature_gradients_match_finite_differences(causal, kl):
    q, k = _data((2, 23, 4), seed=5)
    fq, fk = _features("hedgehog", q, k, causal, W=np.random.default_rng(1).normal(size=(3, 4)) * 0.5)
    value, dfq, dfk = WeightsLoss(q, k, scale=0.6, causal=causal, floor=0.0, kl=kl, block_bytes=16 * 23 * 4)(fq, fk)

    def f(a, b):
        return naive.weights_loss_naive(a, b, q, k, scale=0.6, causal=causal, kl=kl)

    h = 1e-6
    rng = np.random.default_rng(0)
    for _ in range(12):
        i = tuple(int(rng.integers(s)) for s in fq.shape)
        for x, g, which in ((fq, dfq, 0), (fk, dfk, 1)):
            xp, xm = x.copy(), x.copy()
            xp[i] += h
            xm[i] -= h
            args_p = (xp, fk) if which == 0 else (fq, xp)
            args_m = (xm, fk) if which == 0 else (fq, xm)
            fd = (f(*args_p) - f(*args_m)) / (2 * h)
            assert g[i] == pytest.approx(fd, rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_floored_loss_and_right_derivative_for_relu_features(causal):
    """relu features: exact zeros; the floor keeps the loss finite, the gradient is the right derivative."""
    q, k = _data((2, 31, 5), seed=7)
    for x in (q, k):  # feature 0 > 0 everywhere: no dead row (den = 0, where the floored loss jumps)
        x[..., 0] = np.abs(x[..., 0]) + 0.1
    fq, fk = _features("relu", q, k, causal)
    floor = 1e-3
    value, dfq, dfk = WeightsLoss(q, k, scale=0.4, causal=causal, floor=floor, kl=False, block_bytes=16 * 31 * 4)(fq, fk)
    ref = naive.weights_loss_naive(fq, fk, q, k, scale=0.4, causal=causal, floor=floor)
    assert np.isfinite(value) and value == pytest.approx(ref, rel=1e-13)
    h = 1e-8
    rng = np.random.default_rng(1)
    for _ in range(12):
        i = tuple(int(rng.integers(s)) for s in fq.shape)
        for x, g, which in ((fq, dfq, 0), (fk, dfk, 1)):
            xp = x.copy()
            xp[i] += h
            args = (xp, fk) if which == 0 else (fq, xp)
            fd = (naive.weights_loss_naive(*args, q, k, scale=0.4, causal=causal, floor=floor) - ref) / h
            assert g[i] == pytest.approx(fd, rel=1e-3, abs=1e-6)


def test_dead_rows_and_zero_weights():
    """A query whose relu features are all 0: log(n/floor) with a floor, inf without; NaN never."""
    q = np.array([[[1.0, 0.5], [-1.0, -2.0], [0.3, 0.2]]])
    k = np.array([[[0.5, 1.0], [1.0, 0.1], [-1.0, -1.0]]])
    fq, fk = _features("relu", q, k, False)
    floored = WeightsLoss(q, k, scale=1.0, causal=False, floor=0.1, kl=False)
    value, dfq, dfk = floored(fq, fk)
    assert value == pytest.approx(naive.weights_loss_naive(fq, fk, q, k, scale=1.0, causal=False, floor=0.1))
    assert np.all(dfq[0, 1] == 0.0)
    bare = WeightsLoss(q, k, scale=1.0, causal=False, floor=0.0, kl=False)
    value, dfq, dfk = bare(fq, fk)
    assert value == np.inf and not dfq.any() and not dfk.any()


def test_float32_close_to_float64():
    q, k = _data((1, 200, 8), seed=3)
    res = {}
    for dt in (np.float32, np.float64):
        qq, kk = q.astype(dt), k.astype(dt)
        fq, fk = _features("hedgehog", qq, kk, False)
        res[dt] = WeightsLoss(qq, kk, scale=0.35, causal=False, floor=0.0, kl=False)(fq, fk)
        assert res[dt][1].dtype == dt
    assert res[np.float32][0] == pytest.approx(res[np.float64][0], rel=1e-6)
    np.testing.assert_allclose(res[np.float32][1], res[np.float64][1], rtol=1e-3, atol=1e-7)


def test_row_block_budget():
    assert row_block(16384, 64 << 20) == 256
    assert row_block(10, 1) == 1
    assert row_block(10, 1 << 30) == 10


# ---------------------------------------------------------------------------
# Parameter gradients (objective) against finite differences
# ---------------------------------------------------------------------------
def _hedgehog(seed=0, d_out=3, d=4):
    rng = np.random.default_rng(seed)
    return fm.get("hedgehog", W=rng.normal(size=(d_out, d)) * 0.5, b=rng.normal(size=d_out) * 0.1)


@pytest.mark.parametrize("loss", ["cross_entropy", "kl", "mse"])
@pytest.mark.parametrize("causal", [False, True])
def test_parameter_gradients_match_finite_differences(loss, causal):
    q, k = _data((2, 19, 4), seed=11)
    phi = _hedgehog()
    value, grads = objective(phi, q, k, causal=causal, loss=loss)
    assert sorted(grads) == ["W", "b"] and grads["W"].shape == (3, 4)
    h = 1e-6
    for name, idx in (("W", (0, 0)), ("W", (2, 3)), ("b", (1,))):
        def at(delta):
            other = fm.get("hedgehog", W=phi.W.copy(), b=phi.b.copy())
            getattr(other, name)[idx] += delta
            return objective(other, q, k, causal=causal, loss=loss)[0]

        fd = (at(h) - at(-h)) / (2 * h)
        assert grads[name][idx] == pytest.approx(fd, rel=2e-5, abs=1e-9)
    assert phi.W.shape == (3, 4)  # objective copies: the given map is untouched


def test_objective_values_match_naive():
    q, k = _data((2, 17, 4), seed=4)
    phi = _hedgehog(2)
    fq, fk = phi.apply(q, role="query", causal=True), phi.apply(k, role="key", causal=True)
    ce, _ = objective(phi, q, k, causal=True, scale=0.3)
    assert ce == pytest.approx(naive.weights_loss_naive(fq, fk, q, k, scale=0.3, causal=True), rel=1e-13)
    v = np.random.default_rng(9).normal(size=(2, 17, 3))
    mse, _ = objective(phi, q, k, causal=True, scale=0.3, loss="mse", values=v)
    from linattn_nb import linear_attention

    out = linear_attention(q, k, v, feature_map=phi, causal=True)
    assert mse == pytest.approx(naive.output_loss_naive(out, q, k, v, scale=0.3, causal=True), rel=1e-12)
    default, _ = objective(phi, q, k)
    assert default == pytest.approx(objective(phi, q, k, scale=0.5)[0], rel=1e-15)  # 1/sqrt(4)


# ---------------------------------------------------------------------------
# fit
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["lbfgs", "adam"])
@pytest.mark.parametrize("causal", [False, True])
def test_fit_lowers_the_loss_and_returns_a_new_map(optimizer, causal):
    q, k = _data((2, 64, 6), seed=1)
    qv, kv = _data((64, 6), seed=2)
    start = fm.get("hedgehog")
    result = fit(start, q, k, causal=causal, steps=8, optimizer=optimizer, learning_rate=0.05,
                 validation=(qv, kv), progress=False)
    assert isinstance(result, FitResult) and isinstance(result.history, FitHistory)
    fitted, hist = result
    assert start.W is None and start.b is None  # the input map is not mutated
    assert fitted is not start and fitted.W.shape == (6, 6) and fitted.b.shape == (6,)
    n = len(hist.step)
    assert 2 <= n <= 9 and hist.step[0] == 0 and np.array_equal(hist.step, np.arange(n))
    assert hist.train_loss.shape == hist.val_loss.shape == hist.seconds.shape == (n,)
    assert hist.train_loss[-1] < hist.train_loss[0]
    assert np.all(np.isfinite(hist.val_loss)) and np.all(np.diff(hist.seconds) >= 0)
    assert hist.optimizer == optimizer and hist.loss == "cross_entropy" and hist.evaluations >= n - 1
    # the history matches the returned map
    assert objective(fitted, q, k, causal=causal)[0] == pytest.approx(hist.train_loss[-1], rel=1e-12)
    assert objective(fitted, qv, kv, causal=causal)[0] == pytest.approx(hist.val_loss[-1], rel=1e-12)
    if optimizer == "adam":
        assert n == 9 and hist.message == "8 steps done"


def test_fit_steps_zero_and_tol():
    q, k = _data((40, 4), seed=3)
    fitted, hist = fit("hedgehog", q, k, steps=0, progress=False)
    assert len(hist.step) == 1 and np.isnan(hist.val_loss[0]) and "evaluated only" in hist.message
    np.testing.assert_array_equal(fitted.W, np.eye(4))
    _, hist = fit("hedgehog", q, k, steps=200, tol=1e3, optimizer="adam", progress=False)
    assert len(hist.step) == 1 and "tol" in hist.message


def test_fit_mse_and_kl():
    q, k = _data((1, 48, 4), seed=6)
    v = np.random.default_rng(0).normal(size=(1, 48, 2))
    _, h_mse = fit("hedgehog", q, k, loss="mse", values=v, steps=5, progress=False)
    assert h_mse.loss == "mse" and h_mse.train_loss[-1] < h_mse.train_loss[0]
    _, h_kl = fit("hedgehog", q, k, loss="kl", steps=5, progress=False)
    _, h_ce = fit("hedgehog", q, k, loss="cross_entropy", steps=0, progress=False)
    assert 0 < h_kl.train_loss[0] < h_ce.train_loss[0]  # KL = CE - entropy
    _, h_val = fit("hedgehog", q, k, loss="mse", steps=2, validation=(q[0], k[0]), progress=False)
    assert np.isfinite(h_val.val_loss).all()


def test_fit_float32_inputs():
    q, k = _data((2, 64, 6), seed=8)
    f32, h32 = fit("hedgehog", q.astype(np.float32), k.astype(np.float32), steps=5, progress=False)
    f64, h64 = fit("hedgehog", q, k, steps=5, progress=False)
    assert f32.W.dtype == np.float64
    assert h32.train_loss[0] == pytest.approx(h64.train_loss[0], rel=1e-6)
    assert h32.train_loss[-1] < h32.train_loss[0]


def test_fit_random_map_with_learned_projection():
    q, k = _data((1, 64, 4), seed=9)
    start = fm.get("favor+", num_features=8, seed=0, learn_projection=True)
    fitted, hist = fit(start, q, k, scale=0.5, steps=4, progress=False)
    assert start.W is None  # drawn on the copy only
    assert fitted.W.shape == (8, 4) and hist.train_loss[-1] < hist.train_loss[0]


def test_fit_keeps_results_on_interrupt():
    q, k = _data((1, 32, 4), seed=10)

    class Stops(fm.HedgehogFeatureMap):
        calls = 0

        def vjp(self, *args, **kwargs):
            type(self).calls += 1
            if type(self).calls > 8:
                raise KeyboardInterrupt
            return super().vjp(*args, **kwargs)

    with pytest.warns(RuntimeWarning, match="interrupted"):
        fitted, hist = fit(Stops(), q, k, steps=50, optimizer="adam", learning_rate=0.05, progress=False)
    assert "interrupted" in hist.message and 1 <= len(hist.step) < 51
    assert objective(fm.get("hedgehog", W=fitted.W, b=fitted.b), q, k)[0] == pytest.approx(hist.train_loss[-1])


def test_fit_floor_for_maps_with_zero_weights():
    q, k = _data((1, 50, 3), seed=12)

    class Relu(fm.HedgehogFeatureMap):  # a parametric map with exact zeros: relu(W x + b)
        strictly_positive = False

        def apply(self, x, *, role, causal=False, offset=0, total_length=None):
            return np.maximum(np.asarray(x, dtype=np.float64) @ self.W.T + self.b, 0.0)

        def vjp(self, x, g, *, role, causal=False, offset=0, total_length=None):
            u = np.asarray(x, dtype=np.float64) @ self.W.T + self.b
            du = np.where(u > 0, g, 0.0)
            du2, x2 = du.reshape(-1, du.shape[-1]), np.reshape(x, (-1, np.shape(x)[-1]))
            return du @ self.W, {"W": du2.T @ x2, "b": du2.sum(0)}

    with pytest.raises(ValueError, match="floor"):
        fit(Relu(), q, k, floor=0.0, steps=1, progress=False)
    fitted, hist = fit(Relu(), q, k, steps=5, progress=False)  # config.FIT_FLOOR by default
    assert np.isfinite(hist.train_loss).all() and hist.train_loss[-1] < hist.train_loss[0]
    value, _ = objective(Relu(), q, k, floor=config.FIT_FLOOR)
    assert value == pytest.approx(hist.train_loss[0])


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(loss="l2"), ValueError, "loss must be one of"),
    (dict(optimizer="sgd"), ValueError, "optimizer must be one of"),
    (dict(steps=-1), ValueError, "steps must be >= 0"),
    (dict(steps=2.5), TypeError, "steps must be an integer"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(scale=0.0), ValueError, "scale must be in"),
    (dict(floor=1.0), ValueError, "floor must be in"),
    (dict(learning_rate=-1.0), ValueError, "learning_rate"),
    (dict(values=np.ones((10, 4))), ValueError, "values are used by loss='mse' only"),
    (dict(validation=(np.ones((10, 4)),)), ValueError, "validation must be a tuple"),
    (dict(validation=(np.ones((10, 3)), np.ones((10, 3)))), ValueError, "validation queries have dimension 3"),
    (dict(progress="yes"), TypeError, "progress must be a bool"),
])
def test_fit_argument_errors(kwargs, exc, match):
    q, k = _data((10, 4), seed=0)
    with pytest.raises(exc, match=match):
        fit("hedgehog", q, k, **{"steps": 1, "progress": False, **kwargs})


def test_fit_input_errors():
    q, k = _data((10, 4), seed=0)
    with pytest.raises(ValueError, match="same shape"):
        fit("hedgehog", q, k[:5], progress=False)
    with pytest.raises(ValueError, match="fit: feature_map: .*hedgehg"):  # was a bare KeyError
        fit("hedgehg", q, k, progress=False)
    with pytest.raises(TypeError, match="floating point"):
        fit("hedgehog", q.astype(int), k, progress=False)
    bad = q.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="q holds NaN"):
        fit("hedgehog", bad, k, progress=False)
    with pytest.raises(ValueError, match=r"shape \(\.\.\., N, d\)"):
        fit("hedgehog", q[0], k[0], progress=False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        fit("elu", q, k, progress=False)
    with pytest.raises(TypeError, match="feature_map must be"):
        fit(3, q, k, progress=False)
    with pytest.raises(ValueError, match="values"):
        fit("hedgehog", q, k, loss="mse", values=np.ones((9, 2)), progress=False)


def test_fit_memory_streams_over_row_blocks(monkeypatch):
    """One evaluation holds a few row blocks, never an N x N matrix (benchmarks/fit_cpu.py: N = 16,384)."""
    n = 4096
    q, k = _data((n, 32), seed=0, sd=0.5)
    monkeypatch.setattr(config, "FIT_BLOCK_BYTES", 4 << 20)  # 64 rows per block
    monkeypatch.setattr(config, "FIT_CACHE_BYTES", 0)  # no cached softmax rows
    objective("hedgehog", q[:8], k[:8])  # compile first: Numba's compiler allocates too
    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            value, grads = objective("hedgehog", q, k)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.isfinite(value) and grads["W"].shape == (32, 32)
    assert peak < n * n * 8 // 4, f"peak {peak / 2**20:.1f} MiB"  # a quarter of the N x N float64 matrix


def test_feature_maps_fit_is_fitting_fit_in_a_fresh_process():
    """The package wires feature_maps.fit in (feature_maps never imports fitting: no import cycle)."""
    import subprocess
    import sys

    code = ("from linattn_nb.feature_maps import fit, FitResult, FitHistory\n"
            "import linattn_nb.fitting as f\n"
            "assert fit is f.fit and FitResult is f.FitResult and FitHistory is f.FitHistory\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_random_map_materialize_draws_its_projection_once():
    fmap = fm.get("favor+", num_features=6, seed=3, learn_projection=True)
    with pytest.raises(ValueError, match="materialize needs d"):
        fmap.materialize()
    w = fmap.materialize(4).parameters()["projection"].copy()
    assert w.shape == (6, 4)
    assert np.array_equal(fmap.materialize(4).W, w) and np.array_equal(fmap.materialize().W, w)
    with pytest.raises(ValueError, match="drawn for dim=4"):
        fmap.materialize(5)


class _SwallowsCtrlC(fm.HedgehogFeatureMap):
    """Its 9th gradient sends SIGINT to this process and swallows the KeyboardInterrupt, as an
    llvmlite destructor does during a Numba compile."""
    calls = 0

    def vjp(self, *args, **kwargs):
        import os
        import signal
        import time

        type(self).calls += 1
        if type(self).calls == 9:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            except KeyboardInterrupt:
                pass
        return super().vjp(*args, **kwargs)



@pytest.mark.skipif(sys.platform == "win32", reason="os.kill(SIGINT) to itself is POSIX")
def test_fit_stops_after_a_swallowed_ctrl_c(python_sigint_handler):
    """A Ctrl-C swallowed inside a step still stops the fit after that step, with its results."""
    q, k = _data((1, 32, 4), seed=10)
    _SwallowsCtrlC.calls = 0
    with pytest.warns(RuntimeWarning, match="interrupted"):
        fitted, hist = fit(_SwallowsCtrlC(), q, k, steps=50, optimizer="adam", learning_rate=0.05, progress=False)
    assert "interrupted" in hist.message and 2 <= len(hist.step) < 51
    assert objective(fm.get("hedgehog", W=fitted.W, b=fitted.b), q, k)[0] == pytest.approx(hist.train_loss[-1])


def _fit_point(seed):
    q, k = _data((1, 32, 4), seed=10)
    _, hist = fit(_SwallowsCtrlC(), q, k, steps=50, optimizer="adam", learning_rate=0.05, progress=False)
    return {"steps": len(hist.step)}


@pytest.mark.skipif(sys.platform == "win32", reason="os.kill(SIGINT) to itself is POSIX")
def test_ctrl_c_in_a_fit_inside_a_sweep_stops_the_sweep(tmp_path, python_sigint_handler):
    """Inside a sweep point the fit lets the KeyboardInterrupt through: the sweep stops and no
    half-fitted point is recorded as finished."""
    from linattn_nb.studies import load_results, sweep

    _SwallowsCtrlC.calls = 0
    path = tmp_path / "fits.jsonl"
    with pytest.raises(KeyboardInterrupt):
        sweep(_fit_point, [{"seed": 0}, {"seed": 1}], out=path, progress=False)
    assert load_results(path) == []


def test_adam_stops_at_the_last_finite_step_when_the_features_overflow():
    """A step that makes the features overflow raised FeatureOverflow out of fit and lost every step taken;
    L-BFGS rejected such a trial point.  Adam now stops there and returns the step before it."""
    from linattn_nb.feature_maps import fit

    rng = np.random.default_rng(10)
    q, k = rng.normal(size=(2, 8, 2)) * 3, rng.normal(size=(2, 8, 2)) * 3
    res = fit("hedgehog", q, k, steps=30, optimizer="adam", learning_rate=50.0, progress=False)
    t = len(res.history.step)
    assert 1 <= t < 31 and "became infinite" in res.history.message
    assert np.isfinite(res.history.train_loss).all()


@pytest.mark.parametrize("seed, err", [("abc", TypeError), (1.5, TypeError), (-1, ValueError)])
def test_fit_names_a_bad_seed(seed, err):
    from linattn_nb.feature_maps import fit

    q = np.random.default_rng(0).normal(size=(8, 2))
    with pytest.raises(err, match="seed must be None or a non-negative integer"):
        fit("hedgehog", q, q, steps=1, loss="mse", seed=seed, validation=(q, q), progress=False)


def test_fit_with_seed_none_draws_validation_values_too():
    from linattn_nb.feature_maps import fit

    q = np.random.default_rng(0).normal(size=(8, 2))
    res = fit("hedgehog", q, q, steps=1, loss="mse", seed=None, validation=(q, q), progress=False)
    assert np.isfinite(res.history.val_loss).all()


@pytest.mark.parametrize("optimizer", ["adam", "lbfgs"])
def test_validation_overflow_is_recorded_as_inf_and_the_fit_goes_on(optimizer):
    """A step whose parameters made the validation features overflow (FeatureOverflow) raised out of fit
    and lost the whole fit; the validation loss of that step is now inf, and the fit is the one without
    validation data."""
    from linattn_nb.feature_maps import fit

    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 32, 4)).astype(np.float32) * 20
    k = rng.normal(size=(1, 32, 4)).astype(np.float32) * 20
    kv = k.copy()
    kv[0, 0] = [85, 0, 0, 0]  # e^85 < float32's max e^88.7: finite at W = I, overflows as W[0, 0] grows
    kw = dict(steps=20, optimizer=optimizer, learning_rate=0.05, scale=0.05, progress=False)
    res = fit("hedgehog", q, k, validation=(q, kv), **kw)
    ref = fit("hedgehog", q, k, **kw)
    val = res.history.val_loss
    assert len(val) == len(res.history.step) == len(ref.history.step)
    assert np.isfinite(val[0]) and np.isposinf(val).any() and np.isfinite(val[-1])
    assert not np.isnan(val).any()
    np.testing.assert_array_equal(res.history.train_loss, ref.history.train_loss)
    np.testing.assert_array_equal(res.feature_map.W, ref.feature_map.W)


def test_declared_scipy_floor_has_the_callback_fit_uses():
    """fit's L-BFGS callback takes ``callback(intermediate_result)``, which SciPy passes an OptimizeResult
    only from 1.11 (1.10 passes the parameter array: AttributeError 'fun'); pyproject.toml allowed 1.10."""
    import re
    from pathlib import Path

    import scipy

    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    floors = re.findall(r'"scipy>=(\d+)\.(\d+)', text)
    assert floors, "no scipy>= requirement in pyproject.toml"
    assert all((int(a), int(b)) >= (1, 11) for a, b in floors), floors
    installed = tuple(int(p) for p in re.findall(r"\d+", scipy.__version__)[:2])
    assert installed >= (1, 11)
