"""Kernel-level theory of random-feature estimators of the softmax kernel.

A Monte-Carlo MSE of any map's kernel estimate (:func:`kernel_estimate_mse`) and Performer's closed forms
(:func:`favor_mse`, Lemma 2; :func:`orthogonal_mse_bound`, Theorem 2), stated in docs/theory.md.  The
closed forms are for ``exp(x . y)``: a map with ``scale = s`` compares with ``favor_mse(sqrt(s) x,
sqrt(s) y, ...)``.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np

from .. import _frontend as FE
from .. import _validate as V
from .. import feature_maps as fm
from . import _common as C

__all__ = ["KernelEstimate", "kernel_estimate_mse", "favor_mse", "orthogonal_mse_bound"]


@dataclass(frozen=True)
class KernelEstimate:
    """Monte-Carlo result of :func:`kernel_estimate_mse` (arrays over the pairs).

    Attributes
    ----------
    mse : ndarray
        Mean over draws of ``(phi(x) . phi(y) - target)^2``.
    stderr : ndarray
        Standard error of ``mse`` (sample standard deviation of the squared errors over ``sqrt(draws)``).
    mean : ndarray
        Mean estimate over draws (its distance to ``target`` is the bias).
    target : ndarray
        The kernel values estimated.
    draws : int
    """

    mse: np.ndarray
    stderr: np.ndarray
    mean: np.ndarray
    target: np.ndarray
    draws: int

    def to_dict(self) -> dict:
        """Plain-Python dict (lists instead of arrays), for JSON."""
        return C.plain_dict((name, getattr(self, name)) for name in self.__dataclass_fields__)


def _pairs(x, y):
    for name, a in (("x", x), ("y", y)):
        if np.iscomplexobj(a):  # asarray(..., float64) would drop the imaginary part with a warning only
            raise TypeError(f"{name} must be real, got a complex array")
    try:
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
    except (TypeError, ValueError) as exc:  # strings, ragged lists: NumPy's message names neither
        raise TypeError(f"x and y must be real arrays (..., d): {exc}") from None
    if x.ndim < 1 or y.ndim < 1:
        raise ValueError(f"x and y must have at least 1 dimension (..., d), got shapes {x.shape} and {y.shape}")
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"x and y must have the same last dimension, got shapes {x.shape} and {y.shape}")
    try:
        x, y = np.broadcast_arrays(x, y)
    except ValueError:
        raise ValueError(f"x and y do not broadcast: shapes {x.shape} and {y.shape}") from None
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("x and y must be finite")
    return x, y


def _log_expm1(u):
    """``log(expm1(u))`` for ``u >= 0`` without overflow (``-inf`` at 0)."""
    u = np.asarray(u, dtype=np.float64)
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(u > 1.0, u + np.log1p(-np.exp(-np.maximum(u, 1.0))), np.log(np.expm1(np.minimum(u, 1.0))))


def _exp_sum(*logs):
    """``exp(sum(logs))``: the product of factors given by their logs, so that a huge factor times a tiny one
    gives their finite product (or 0, or inf) rather than ``0 * inf = NaN``; a ``-inf`` log (a zero factor) gives 0."""
    with np.errstate(over="ignore", invalid="ignore"):
        total = sum(logs)
        # -inf + inf (a zero factor times an overflowing one) is 0: a zero factor wins
        zero = np.logical_or.reduce([np.isneginf(x) for x in np.broadcast_arrays(*logs)])
        return np.where(zero, 0.0, np.exp(np.where(zero, 0.0, total)))


def _scalar(r):
    """A 0-d result as a NumPy scalar, as the elementwise formulas give for one pair."""
    return r[()] if isinstance(r, np.ndarray) and r.ndim == 0 else r


def _check_count(name, x, minimum=1):
    return V.check_int(name, x, minimum)  # TypeError for a float or a string, ValueError below minimum


def kernel_estimate_mse(feature_map, x, y, draws, *, target=None):
    r"""Monte-Carlo MSE of the kernel estimate ``phi(x) . phi(y)``.

    A copy of the map is redrawn before every draw (reproducible for a seeded map); deterministic
    maps give their squared bias with a zero standard error.  A position-dependent map (cosFormer) sees
    ``x[i]`` and ``y[i]`` at the same position ``i``, so its estimate is its kernel at distance 0.

    Parameters
    ----------
    feature_map : FeatureMap or str
        E.g. ``feature_maps.get("favor+", dim=16, num_features=8, seed=0, scale=1.0)``.
    x, y : array_like, shape (..., d)
        Pairs (broadcast against each other).
    draws : int
        Number of independent draws (>= 2).
    target : array_like, optional
        Values to estimate; default ``feature_map.kernel(x, y)`` (softmax estimators: ``exp(scale x . y)``).

    Returns
    -------
    KernelEstimate
        ``mse``, ``stderr``, ``mean`` and ``target`` of the broadcast pair shape.

    Raises
    ------
    ValueError
        Mismatched shapes, non-finite pairs, ``draws < 2``.
    TypeError
        ``draws`` not an integer; ``x`` or ``y`` not real arrays.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb import feature_maps
    >>> from linattn_nb.analysis import kernel_estimate_mse, favor_mse
    >>> phi = feature_maps.get("favor+", num_features=4, orthogonal=False, seed=0, scale=1.0)
    >>> x, y = np.array([0.3, -0.2, 0.1]), np.array([0.1, 0.4, -0.3])
    >>> r = kernel_estimate_mse(phi, x, y, draws=4000)
    >>> bool(abs(r.mse - favor_mse(x, y, 4)) < 4 * r.stderr)
    True
    """
    draws = _check_count("draws", draws, 2)
    fmap = copy.deepcopy(fm.resolve(feature_map))
    x, y = _pairs(x, y)
    shape = x.shape[:-1]
    xf = x.reshape(-1, x.shape[-1])
    yf = y.reshape(-1, y.shape[-1])
    if target is None:
        tgt = np.asarray(fmap.kernel(xf, yf), dtype=np.float64)
    else:
        t = np.asarray(target, dtype=np.float64)
        try:
            tgt = np.broadcast_to(t, shape).reshape(-1)
        except ValueError:
            raise ValueError(f"target of shape {t.shape} does not broadcast to the pairs' shape {shape} (x and y "
                             "without their last axis)") from None
    p = xf.shape[0]
    # one sequence [x; y] for one feature pass; a position-dependent map would put y_i p positions after
    # x_i and weigh the pair by its kernel at that distance, so it gets x and y as two sequences
    apart = bool(getattr(fmap, "position_dependent", False))
    both = (xf, yf) if apart else (np.concatenate([xf, yf], axis=0),)
    redraw = getattr(fmap, "redraw", None)
    est = np.empty((draws, p))
    for r in range(draws):
        if redraw is not None:
            redraw()
        elif r > 0:
            est[r] = est[0]
            continue
        f = np.concatenate([np.asarray(FE.featurise(fmap, z, role=None, causal=False, dtype=np.float64,
                                                    name="the stacked pairs [x; y]"), dtype=np.float64)
                            for z in both], axis=0)
        est[r] = np.einsum("pf,pf->p", f[:p], f[p:])
    err2 = (est - tgt) ** 2
    mse = err2.mean(axis=0)
    stderr = err2.std(axis=0, ddof=1) / math.sqrt(draws)
    return KernelEstimate(mse=mse.reshape(shape), stderr=stderr.reshape(shape), mean=est.mean(axis=0).reshape(shape),
                          target=tgt.reshape(shape), draws=draws)


def favor_mse(x, y, num_features, kind="positive"):
    r"""Closed-form MSE of Performer's estimators of ``SM(x, y) = exp(x . y)`` (Lemma 2).

    ``m`` i.i.d. ``N(0, I_d)`` projections; the trigonometric and hyperbolic estimators have ``2m``
    features.  The formulas: docs/theory.md ("Feature maps").

    Parameters
    ----------
    x, y : array_like, shape (..., d)
    num_features : int
        ``m``.
    kind : {"positive", "trig", "hyperbolic"}

    Returns
    -------
    ndarray or float
        Broadcast pair shape.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([1.0, 0.0]); y = -x
    >>> float(favor_mse(x, y, 10)), round(float(favor_mse(x, y, 10, "trig")), 4)
    (0.0, 0.356)
    """
    if not isinstance(kind, str):
        raise TypeError(f"kind must be 'positive', 'trig' or 'hyperbolic', got {type(kind).__name__} {kind!r}")
    x, y = _pairs(x, y)
    m = _check_count("num_features", num_features)
    xy = np.sum(x * y, axis=-1)
    u2 = np.sum((x + y) ** 2, axis=-1)
    # each formula is a product of factors that can overflow and underflow at once (exp(2 x.y) and
    # expm1(|x + y|^2)): taken as a sum of logs, so a finite MSE is not 0 * inf = NaN
    if kind == "positive" or kind == "hyperbolic":
        logs = [2.0 * xy, _log_expm1(u2), np.full_like(xy, -math.log(m))]
        if kind == "hyperbolic":
            with np.errstate(divide="ignore"):
                logs.append(np.log(-0.5 * np.expm1(-u2)))
        return _scalar(_exp_sum(*logs))
    if kind == "trig":
        v2 = np.sum((x - y) ** 2, axis=-1)
        nx2 = np.sum(x * x, axis=-1) + np.sum(y * y, axis=-1)
        with np.errstate(divide="ignore"):
            return _scalar(_exp_sum(nx2, 2.0 * np.log(-np.expm1(-v2)), np.full_like(xy, -math.log(2.0 * m))))
    raise ValueError(f"kind must be 'positive', 'trig' or 'hyperbolic', got {kind!r}")


def orthogonal_mse_bound(x, y, num_features):
    r"""Performer's Theorem 2: MSE bound of the positive estimator with orthogonal projections.

    For ``m <= d`` orthogonal projections with rows marginally ``N(0, I_d)`` (``favor+`` with
    ``orthogonal=True, row_norm="chi"``); the bound: docs/theory.md ("Feature maps").

    Parameters
    ----------
    x, y : array_like, shape (..., d)
    num_features : int
        ``m``, at most ``d``.

    Returns
    -------
    ndarray or float

    Raises
    ------
    ValueError
        If ``m > d`` (the theorem covers one orthogonal block).
    TypeError
        ``num_features`` not an integer; ``x`` or ``y`` not real arrays.

    Examples
    --------
    >>> import numpy as np
    >>> x, y = np.full(8, 0.2), np.full(8, 0.1)
    >>> bool(orthogonal_mse_bound(x, y, 8) < favor_mse(x, y, 8))
    True
    """
    x, y = _pairs(x, y)
    m = _check_count("num_features", num_features)
    d = x.shape[-1]
    if m > d:
        raise ValueError(f"orthogonal_mse_bound: Theorem 2 needs num_features <= d, got m={m} > d={d}")
    # favor_mse - c (SM - exp(-(|x|^2 + |y|^2) / 2))^2 = exp(2 x.y) (expm1(u) / m - c expm1(-u / 2)^2),
    # u = |x + y|^2: the bracket in logs where expm1(u) would overflow, so that neither inf - inf nor 0 * inf
    # appears
    c = 2.0 * (m - 1) / (m * (d + 2.0))
    xy = np.sum(x * y, axis=-1)
    u = np.sum((x + y) ** 2, axis=-1)
    lead = _log_expm1(u) - math.log(m)  # log(expm1(u) / m)
    t2 = c * np.expm1(-0.5 * u) ** 2  # in [0, c]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        big = lead > 600.0
        small = np.exp(np.minimum(lead, 600.0)) - t2
        log_b = np.where(big, lead + np.log1p(-t2 * np.exp(-np.maximum(lead, 600.0))), np.log(np.abs(small)))
        sign = np.where(big, 1.0, np.sign(small))
    return _scalar(sign * _exp_sum(2.0 * xy, log_b))
