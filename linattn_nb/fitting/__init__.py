"""Fitting the parameters of a feature map to softmax attention (Hedgehog, T2R, any map with ``vjp``).

The public entry point is :func:`linattn_nb.feature_maps.fit` (this module's :func:`fit`);
:func:`objective` evaluates one loss and its parameter gradients, for checks and custom optimisers.
The losses and how a fit runs: docs/guide/feature_maps.md.
"""
from __future__ import annotations

import copy
import math
import numbers
import time
import warnings
from typing import NamedTuple

import numpy as np

from .. import config
from .. import feature_maps as fm
from .._blas import single_threaded_blas
from .._seeds import generator
from .._interrupt import active as interrupt_active, check as check_interrupt, interrupts
from .._validate import check_int
from ..attention import linear_attention, linear_attention_vjp, softmax_attention
from ._objective import LOSSES, WeightsLoss

__all__ = ["fit", "objective", "FitResult", "FitHistory", "LOSSES", "OPTIMIZERS"]

OPTIMIZERS = ("lbfgs", "adam")


class FitHistory(NamedTuple):
    """The course of a fit, one entry per optimiser step (entry 0: the starting point).

    Attributes
    ----------
    step : ndarray of int
        ``0, 1, ..., steps_done``.
    train_loss, val_loss : ndarray
        The training and validation loss after each step (``val_loss`` NaN without ``validation``;
        ``inf`` at a step where the validation features overflow, the fit going on).
    seconds : ndarray
        Wall time since the start of the fit.
    evaluations : int
        Loss-and-gradient evaluations on the training set (several per L-BFGS step).
    loss, optimizer : str
    message : str
        Why the optimiser stopped.
    """

    step: np.ndarray
    train_loss: np.ndarray
    val_loss: np.ndarray
    seconds: np.ndarray
    evaluations: int
    loss: str
    optimizer: str
    message: str


class FitResult(NamedTuple):
    """What :func:`fit` returns: the fitted map (a new object) and its :class:`FitHistory`."""

    feature_map: object
    history: FitHistory


# ---------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------
def _as_inputs(name, x):
    if isinstance(x, (bool, np.bool_)) or x is None:
        raise TypeError(f"fit: {name} must be a floating-point array (..., N, d), got {type(x).__name__}")
    arr = np.asarray(x)
    if arr.ndim < 2:
        raise ValueError(f"fit: {name} must have shape (..., N, d), got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise TypeError(f"fit: {name} must be floating point, got dtype {arr.dtype}")
    if not np.isfinite(arr).all():
        raise ValueError(f"fit: {name} holds NaN or inf")
    return arr


def _check_pair(qname, kname, q, k):
    q, k = _as_inputs(qname, q), _as_inputs(kname, k)
    if q.shape != k.shape:
        raise ValueError(f"fit: {qname} and {kname} must have the same shape (..., N, d), got {q.shape} and "
                         f"{k.shape}")
    if q.shape[-1] == 0 or q.shape[-2] == 0:
        raise ValueError(f"fit: {qname} has no rows or no dimensions, shape {q.shape}")
    d = q.shape[-1]
    wd = working_dtype(q, k)
    return (q.reshape(-1, q.shape[-2], d).astype(wd, copy=False),
            k.reshape(-1, k.shape[-2], d).astype(wd, copy=False))


def working_dtype(*arrays):
    """float64 when any input is float64, else float32 (float16 inputs are worked on in float32)."""
    return np.float64 if any(np.asarray(a).dtype == np.float64 for a in arrays) else np.float32


def _check_values(name, v, q_shape):
    v = _as_inputs(name, v)
    if v.shape[:-1] != tuple(q_shape[:-1]):
        raise ValueError(f"fit: {name} must have shape (..., N, M) matching the queries' {tuple(q_shape)} in "
                         f"(..., N), got {v.shape}")
    return v.reshape(-1, v.shape[-2], v.shape[-1]).astype(working_dtype(v), copy=False)


def _check_choice(name, value, options):
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"fit: {name} must be one of {', '.join(map(repr, options))}, got {value!r}")
    return value


def _check_float(name, value, *, low, high=None, low_open=False):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"fit: {name} must be a number, got {type(value).__name__}")
    value = float(value)
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and (high is None or value < high)
    if not ok:
        span = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'})"
        raise ValueError(f"fit: {name} must be in {span}, got {value!r}")
    return value


def _resolve_map(feature_map, d):
    if isinstance(feature_map, str):
        try:
            fmap = fm.get(feature_map)
        except KeyError as exc:  # a ValueError, as linear_attention's feature_map argument
            raise ValueError(f"fit: feature_map: {exc.args[0]}") from None
    elif isinstance(feature_map, fm.FeatureMap):
        fmap = copy.deepcopy(feature_map)
    else:
        raise TypeError(f"fit: feature_map must be a registered name or a FeatureMap, got "
                        f"{type(feature_map).__name__}")
    if hasattr(fmap, "materialize"):
        fmap.materialize(d)  # defaults stored explicitly; a random map draws its projection now
    params = fmap.parameters()
    if not params:
        raise ValueError(f"fit: feature map {fmap.name!r} has no trainable parameters (parameters() is empty); "
                         f"fit a parametric map such as 'hedgehog' or 't2r' (or favor+ with "
                         f"learn_projection=True)")
    for name, arr in params.items():
        if not (isinstance(arr, np.ndarray) and arr.dtype == np.float64 and arr.flags.writeable):
            raise TypeError(f"fit: parameter {name!r} of {fmap.name!r} must be a writeable float64 ndarray (fit "
                            f"trains the map's own arrays in place), got {type(arr).__name__}")
    return fmap, params


# ---------------------------------------------------------------------------
# The objective
# ---------------------------------------------------------------------------
class _Objective:
    """Loss and flat parameter gradient of one data set, for one map whose parameters it sets."""

    def __init__(self, fmap, params, q, k, v, *, loss, scale, causal, floor):
        self.fmap, self.params = fmap, params
        self.q, self.k, self.v = q, k, v
        self.loss, self.scale, self.causal = loss, scale, causal
        self.calls = 0
        if loss == "mse":
            self.target = softmax_attention(q, k, v, causal=causal, scale=scale)
        else:
            self.weights = WeightsLoss(q, k, scale=scale, causal=causal, floor=floor, kl=loss == "kl")

    # flat parameter vector <-> the map's arrays
    def get(self):
        return np.concatenate([p.ravel() for p in self.params.values()])

    def set(self, x):
        i = 0
        for p in self.params.values():
            p[...] = x[i:i + p.size].reshape(p.shape)
            i += p.size

    def _flat(self, grads):
        parts = []
        for name, p in self.params.items():
            g = None if grads is None else grads.get(name)
            parts.append(np.zeros(p.size) if g is None else np.asarray(g, dtype=np.float64).ravel())
        return np.concatenate(parts)

    def serial_blas(self):
        """True when one evaluation is small enough for one BLAS thread (``config.FIT_SERIAL_BLAS_MAX_WORK``)."""
        b, n, d = self.q.shape
        feats = self.fmap.output_dim(d)
        return b * n * n * feats < config.FIT_SERIAL_BLAS_MAX_WORK

    def __call__(self, x=None, want_grad=True):
        """``(loss, flat gradient or None)`` at parameters ``x`` (None: as they are)."""
        if x is not None:
            self.set(x)
        self.calls += 1
        fmap, causal = self.fmap, self.causal
        if self.loss == "mse":
            out = linear_attention(self.q, self.k, self.v, feature_map=fmap, causal=causal)
            r = np.asarray(out, dtype=np.float64) - self.target
            value = float(np.mean(r * r))
            if not want_grad:
                return value, None
            if not math.isfinite(value):
                return float("inf"), np.zeros(sum(p.size for p in self.params.values()))
            vjp = linear_attention_vjp(self.q, self.k, self.v, (2.0 / r.size) * r, feature_map=fmap,
                                       causal=causal)
            return value, self._flat(vjp.d_params)
        wd = self.q.dtype
        if want_grad:  # the pullbacks keep what the backward pass needs from the forward
            fq, pull_q = fmap.apply_with_vjp(self.q, role="query", causal=causal)
            fk, pull_k = fmap.apply_with_vjp(self.k, role="key", causal=causal)
        else:
            fq = fmap.apply(self.q, role="query", causal=causal)
            fk = fmap.apply(self.k, role="key", causal=causal)
        fq, fk = np.asarray(fq, dtype=wd), np.asarray(fk, dtype=wd)
        value, dfq, dfk = self.weights(fq, fk, want_grad=want_grad)
        if not want_grad:
            return value, None
        if not math.isfinite(value):
            return value, self._flat(None)
        _, gq = pull_q(dfq)
        _, gk = pull_k(dfk)
        return value, self._flat(gq) + self._flat(gk)


def _prepare(feature_map, q, k, *, causal, scale, loss, values, floor, seed):
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"fit: causal must be a bool, got {type(causal).__name__}")
    causal = bool(causal)
    loss = _check_choice("loss", loss, LOSSES)
    q64, k64 = _check_pair("q", "k", q, k)
    d = q64.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else _check_float("scale", scale, low=0.0, low_open=True)
    fmap, params = _resolve_map(feature_map, d)
    if floor is None:
        floor = 0.0 if getattr(fmap, "strictly_positive", False) else config.FIT_FLOOR
    floor = _check_float("floor", floor, low=0.0, high=1.0)
    if seed is not None:
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"fit: seed must be None or a non-negative integer, got {seed!r}")
        if seed < 0:
            raise ValueError(f"fit: seed must be None or a non-negative integer, got {seed!r}")
    v64 = None
    if loss == "mse":
        if values is None:
            v64 = generator(seed).standard_normal(q64.shape).astype(q64.dtype)
        else:
            v64 = _check_values("values", values, np.shape(q))
    elif values is not None:
        raise ValueError(f"fit: values are used by loss='mse' only (loss={loss!r})")
    kw = dict(loss=loss, scale=scale, causal=causal, floor=floor)
    return fmap, params, q64, k64, v64, kw


def objective(feature_map, q, k, *, causal=False, scale=None, loss="cross_entropy", values=None, floor=None,
              seed=0):
    """A fitting loss of ``feature_map`` on ``(q, k)`` and its gradients with respect to the parameters.

    Parameters
    ----------
    feature_map, q, k, causal, scale, loss, values, floor, seed
        As for :func:`fit`.

    Returns
    -------
    loss : float
        The mean loss over rows (``inf`` where a row's linear weights cannot be normalised, or are 0
        where softmax has mass without a floor).
    grads : dict
        ``name -> dloss/dparameter`` for the arrays ``parameters()`` returns; zeros where loss is inf.

    Examples
    --------
    >>> import numpy as np
    >>> q, k = np.random.default_rng(0).normal(size=(2, 64, 8))
    >>> from linattn_nb.fitting import objective
    >>> value, grads = objective("hedgehog", q, k)
    >>> sorted(grads), grads["W"].shape, bool(value > 0)
    (['W', 'b'], (8, 8), True)
    """
    fmap, params, q64, k64, v64, kw = _prepare(feature_map, q, k, causal=causal, scale=scale, loss=loss,
                                               values=values, floor=floor, seed=seed)
    obj = _Objective(fmap, params, q64, k64, v64, **kw)
    with single_threaded_blas(obj.serial_blas()):
        value, g = obj()
    out, i = {}, 0
    for name, p in params.items():
        out[name] = g[i:i + p.size].reshape(p.shape)
        i += p.size
    return value, out


# ---------------------------------------------------------------------------
# fit
# ---------------------------------------------------------------------------
def fit(feature_map, q, k, *, causal=False, scale=None, loss="cross_entropy", steps=200, optimizer="lbfgs",
        seed=0, validation=None, values=None, floor=None, learning_rate=0.01, tol=None, progress=True):
    """Fit the parameters of a feature map so that linear attention's weights match softmax's.

    Any map with ``parameters()`` and ``vjp``, trained full batch (L-BFGS-B or Adam), one map for all
    batch entries.  The losses and how a fit runs: docs/guide/feature_maps.md.

    Parameters
    ----------
    feature_map : str or FeatureMap
        The map to start from: a registered name or a map object, which is copied (never modified).
    q, k : array_like, shape (..., N, d)
        Training queries and keys (finite, the same shape); float64 is fitted in float64, else float32.
    causal : bool, default False
        Fit causal weights.
    scale : float, optional
        Softmax temperature, default ``1/sqrt(d)``.
    loss : {"cross_entropy", "kl", "mse"}, default "cross_entropy"
        Between the softmax and linear weights, or (``"mse"``) the outputs for ``values``.
    steps : int, default 200
        Optimiser iterations (0: evaluate only); ``history.message`` says why L-BFGS stopped.
    optimizer : {"lbfgs", "adam"}, default "lbfgs"
    seed : int or None, default 0
        Seeds the values drawn for ``loss="mse"`` when none are given (``seed + 1`` those of a validation
        set); None draws fresh ones.
    validation : tuple, optional
        ``(q_val, k_val)`` (and ``v_val`` for ``loss="mse"``): held-out data, its loss recorded per step
        (``inf`` at a step whose parameters make the validation features overflow, as the training loss
        of such a point is; the fit goes on, the validation set never stops it).
    values : array_like, shape (..., N, M), optional
        Values for ``loss="mse"``.
    floor : float in [0, 1), optional
        Floor of the linear weights in the cross-entropy and KL (default 0 for ``strictly_positive``
        maps, else ``config.FIT_FLOOR``).
    learning_rate : float, default 0.01
        Adam's step size.
    tol : float, optional
        L-BFGS: its ``ftol`` and ``gtol`` (default SciPy's); Adam: stop once the gradient's max-norm
        is <= ``tol``.
    progress : bool, default True
        A progress bar (tqdm) with the current loss.

    Returns
    -------
    FitResult
        ``(feature_map, history)``: the fitted map (a new object); Ctrl-C returns the last finished step.

    Raises
    ------
    ValueError, TypeError
        Bad inputs, ``loss`` or ``optimizer``, a map without trainable parameters, ``values`` with a
        weights loss, or an infinite starting loss (pass ``floor``).

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb import feature_maps
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.normal(size=(2, 256, 16))
    >>> fitted, hist = feature_maps.fit("hedgehog", q, k, steps=30, progress=False)
    >>> bool(hist.train_loss[-1] < hist.train_loss[0]), fitted.W.shape, len(hist.step) <= 31
    (True, (16, 16), True)
    """
    from tqdm.auto import tqdm

    optimizer = _check_choice("optimizer", optimizer, OPTIMIZERS)
    steps = check_int("fit: steps", steps, 0)
    learning_rate = _check_float("learning_rate", learning_rate, low=0.0, low_open=True)
    if tol is not None:
        tol = _check_float("tol", tol, low=0.0)
    if not isinstance(progress, (bool, np.bool_)):
        raise TypeError(f"fit: progress must be a bool, got {type(progress).__name__}")
    fmap, params, q64, k64, v64, kw = _prepare(feature_map, q, k, causal=causal, scale=scale, loss=loss,
                                               values=values, floor=floor, seed=seed)
    train = _Objective(fmap, params, q64, k64, v64, **kw)
    val = None
    if validation is not None:
        if not isinstance(validation, (tuple, list)) or len(validation) not in (2, 3):
            raise ValueError("fit: validation must be a tuple (q_val, k_val) or (q_val, k_val, v_val)")
        qv, kv = _check_pair("validation q_val", "validation k_val", validation[0], validation[1])
        if qv.shape[-1] != q64.shape[-1]:
            raise ValueError(f"fit: validation queries have dimension {qv.shape[-1]}, the training ones "
                             f"{q64.shape[-1]}")
        vv = None
        if kw["loss"] == "mse":
            vv = (_check_values("validation v_val", validation[2], np.shape(validation[0]))
                  if len(validation) == 3
                  else generator(None if seed is None else seed + 1).standard_normal(qv.shape).astype(qv.dtype))
        elif len(validation) == 3:
            raise ValueError(f"fit: a validation v_val is used by loss='mse' only (loss={kw['loss']!r})")
        val = _Objective(fmap, params, qv, kv, vv, **kw)

    t0 = time.perf_counter()
    x0 = train.get()
    f0, g0 = train(x0)
    if not math.isfinite(f0):
        raise ValueError(f"fit: the loss of {fmap.name!r} is not finite at the starting parameters (a linear "
                         f"weight is 0 or its row sum is not positive where softmax has mass); pass floor= "
                         f"(e.g. {config.FIT_FLOOR}) or loss='mse'")
    rec = {"loss": [f0], "val": [], "t": [], "x": x0.copy()}

    def record(x, fx):
        if val is not None:
            try:
                vloss, _ = val(x, want_grad=False)
            except (ValueError, FloatingPointError):  # the validation features overflow (FeatureOverflow)
                vloss = float("inf")
            rec["val"].append(vloss)
        rec["t"].append(time.perf_counter() - t0)
        rec["x"] = np.array(x, copy=True)
        check_interrupt()  # a Ctrl-C swallowed during the step (a Numba compile): stop after it

    record(x0, f0)
    message = ""
    bar = tqdm(total=steps, desc=f"fit {fmap.name}", disable=not progress, leave=False)
    blas = single_threaded_blas(train.serial_blas())
    blas.__enter__()

    def advance(fx):
        rec["loss"].append(fx)
        bar.update(1)
        bar.set_postfix(loss=f"{fx:.4g}", refresh=False)

    inside_sweep = interrupt_active()  # a sweep or report owns Ctrl-C: let it through, record nothing
    try:
        with interrupts():  # Ctrl-C: the steps so far are returned (a swallowed one too)
            if optimizer == "lbfgs" and steps > 0:
                from scipy.optimize import minimize

                def fun(x):
                    try:
                        return train(x)
                    except (ValueError, FloatingPointError):  # features overflow at a trial point: reject it
                        return float("inf"), np.zeros_like(x)

                def callback(intermediate_result):
                    advance(float(intermediate_result.fun))
                    record(intermediate_result.x, intermediate_result.fun)

                options = {"maxiter": steps, "maxfun": max(15000, 20 * steps)}
                if tol is not None:
                    options.update(ftol=tol, gtol=tol)
                res = minimize(fun, x0, jac=True, method="L-BFGS-B", callback=callback, options=options)
                message = str(res.message)
            elif optimizer == "adam" and steps > 0:
                x, g, fx = x0.copy(), g0, f0
                m, s = np.zeros_like(x), np.zeros_like(x)
                b1, b2, eps = 0.9, 0.999, 1e-8
                message = f"{steps} steps done"
                for t in range(1, steps + 1):
                    if tol is not None and float(np.max(np.abs(g))) <= tol:
                        message = f"gradient max-norm <= tol after {t - 1} steps"
                        break
                    m = b1 * m + (1 - b1) * g
                    s = b2 * s + (1 - b2) * g * g
                    x = x - learning_rate * (m / (1 - b1 ** t)) / (np.sqrt(s / (1 - b2 ** t)) + eps)
                    try:
                        fx, g = train(x)
                    except (ValueError, FloatingPointError):  # the features overflow there, as L-BFGS's rejects
                        fx = float("inf")
                    if not math.isfinite(fx):
                        message = (f"the loss (or the features) became infinite at step {t}; stopped at step "
                                   f"{t - 1}")
                        break
                    advance(fx)
                    record(x, fx)
            else:
                message = "steps=0: evaluated only"
    except KeyboardInterrupt:
        if inside_sweep:
            raise
        done = len(rec["loss"]) - 1
        message = f"interrupted after {done} steps"
        warnings.warn(f"fit: {message}; returning the parameters of step {done}", RuntimeWarning, stacklevel=2)
    finally:
        blas.__exit__(None, None, None)
        bar.close()
    n_rec = len(rec["t"])
    train.set(rec["x"])
    loss_hist = np.asarray(rec["loss"][:n_rec], dtype=np.float64)
    val_hist = np.asarray(rec["val"], dtype=np.float64) if val is not None else np.full(n_rec, np.nan)
    history = FitHistory(step=np.arange(n_rec), train_loss=loss_hist, val_loss=val_hist,
                         seconds=np.asarray(rec["t"]), evaluations=train.calls, loss=kw["loss"],
                         optimizer=optimizer, message=message)
    return FitResult(fmap, history)
