"""Associative-recall capacity of the fixed-size state, training-free.

:func:`recall_capacity`, Zoology's MQAR sequences (:func:`mqar`) and state sizes (:func:`state_size`).
The capacity bound: docs/theory.md; usage and measured figures: docs/guide/analysis.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .. import _frontend as FE
from .. import _validate as V
from .. import config
from .._seeds import generator
from ..attention import linear_attention, softmax_attention
from ..rules import get_rule
from . import _common as C
from .readout import strictly_nearest
from .._defaults import DEFAULT_EPS

__all__ = ["RecallCapacity", "recall_capacity", "MQAR", "mqar", "state_size"]


@dataclass(frozen=True)
class RecallCapacity:
    """Result of :func:`recall_capacity`: one entry per number of stored pairs, metrics averaged over trials.

    Attributes
    ----------
    feature_map : str
        ``repr`` of the feature map.
    d, d_phi : int
        Key dimension and feature dimension ``D_phi``.
    value_dim : int or None
        ``None`` for one-hot values (``M = n``).
    key_scale : float
    trials : int
    n_pairs : ndarray of int64
    accuracy : ndarray
        Fraction of queries whose read-out is strictly nearest (Euclidean) to the right stored value; a tie
        (up to a relative :data:`~linattn_nb.analysis.readout.TIE_RTOL`, e.g. a read-out of 0 among one-hot
        values) counts as a miss, as in :func:`~linattn_nb.analysis.read_back`.
    mse : ndarray
        ``||V_hat - V||_F^2 / ||V||_F^2`` of the read-out of the state the update rule wrote.
    optimal_mse : ndarray
        The same for the least-squares state of size ``D_phi x M`` (one-hot values:
        ``1 - rank(phi(K))/n``; docs/guide/analysis.md).
    optimal_accuracy : ndarray
        ``accuracy`` of that least-squares state's read-out.
    softmax_accuracy, softmax_mse : ndarray
        Softmax attention over the same pairs (the KV cache baseline).
    softmax_scale : float
    decay : float or None
        The constant decay ``gamma`` of the state (None: the additive rule).
    beta : float or None
        The delta rule's write strength (None: no delta rule).
    normalize : bool
        Whether the read-out was divided by the normaliser ``phi(k) . z``.
    orthogonal_keys : bool
        Keys were orthonormal (times ``key_scale``) instead of Gaussian.
    distance_edges : ndarray of int64, shape (n_bins + 1,)
        Bin edges of the write-read distance ``n - 1 - j`` of pair ``j``: bin ``b`` is
        ``[edges[b], edges[b + 1])``; a pair whose distance is below ``edges[0]`` or at or past
        ``edges[-1]`` falls in no bin.
    error_by_distance : ndarray, shape (len(n_pairs), n_bins)
        ``sum ||v_hat_j - v_j||^2 / sum ||v_j||^2`` over each bin's pairs (NaN for an empty bin).
    optimal_error_by_distance : ndarray, shape (len(n_pairs), n_bins)
        The same for the least-squares state of ``optimal_mse``.
    """

    feature_map: str
    d: int
    d_phi: int
    value_dim: Optional[int]
    key_scale: float
    trials: int
    n_pairs: np.ndarray
    accuracy: np.ndarray
    mse: np.ndarray
    optimal_mse: np.ndarray
    softmax_accuracy: np.ndarray
    softmax_mse: np.ndarray
    softmax_scale: float = field(default=float("nan"))
    decay: Optional[float] = None
    beta: Optional[float] = None
    normalize: bool = True
    orthogonal_keys: bool = False
    distance_edges: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    error_by_distance: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    optimal_error_by_distance: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    rule: Optional[str] = None
    optimal_accuracy: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def to_dict(self) -> dict:
        """Plain-Python dict (lists instead of arrays), for JSON."""
        return C.plain_dict((name, getattr(self, name)) for name in self.__dataclass_fields__)

    def table(self) -> str:
        """A plain-text table, one row per ``n``."""
        head = (f"feature_map={self.feature_map} d={self.d} D_phi={self.d_phi} "
                f"values={'one-hot' if self.value_dim is None else f'gaussian M={self.value_dim}'} "
                f"key_scale={self.key_scale:g} trials={self.trials}"
                + ("" if self.decay is None else f" decay={self.decay:g}")
                + ("" if self.beta is None else f" beta={self.beta:g}")
                + ("" if self.rule is None else f" rule={self.rule}")
                + ("" if self.normalize else " unnormalised")
                + (" orthonormal keys" if self.orthogonal_keys else ""))
        cols = ("n", "acc", "mse", "opt_mse", "smax_acc", "smax_mse")
        lines = [head, "".join(f"{c:>10}" for c in cols)]
        for i, n in enumerate(self.n_pairs):
            vals = (self.accuracy[i], self.mse[i], self.optimal_mse[i], self.softmax_accuracy[i], self.softmax_mse[i])
            lines.append(f"{int(n):>10}" + "".join(f"{v:>10.4f}" for v in vals))
        return "\n".join(lines)


def _nearest_accuracy(vhat, v):
    """Fraction of rows i of vhat strictly nearest (Euclidean) to row i of v (:func:`strictly_nearest`, as
    :func:`linattn_nb.analysis.read_back` scores: a read-out of 0 is as near to every one-hot value, and
    argmax gave it to the first)."""
    n = v.shape[0]
    # ||vhat_i - v_j||^2 = ||vhat_i||^2 - 2 vhat_i . v_j + ||v_j||^2, without an (n, n, M) temporary
    dist = np.einsum("im,im->i", vhat, vhat)[:, None] - 2.0 * (vhat @ v.T) + np.einsum("jm,jm->j", v, v)[None, :]
    diag = np.arange(n)
    own = dist[diag, diag].copy()
    dist[diag, diag] = np.inf  # one pair: no other value, and other is inf
    return float(np.mean(strictly_nearest(own, dist.min(axis=1))))


def _rel_err(vhat, v):
    return float(np.sum((vhat - v) ** 2) / np.sum(v * v))


def _optimal_residual(phi, v):
    """Rows of ``phi W* - v`` for the least-squares ``W*`` (orthonormal basis of range(phi), numerical rank)."""
    u, s, _ = np.linalg.svd(phi, full_matrices=False)
    if s.size == 0:
        return -v
    r = int(np.count_nonzero(s > s.max() * max(phi.shape) * np.finfo(np.float64).eps))
    ur = u[:, :r]
    return ur @ (ur.T @ v) - v


def _binned_rel_err(res, v, dist, edges):
    """``sum ||res_j||^2 / sum ||v_j||^2`` over the rows whose ``dist`` falls in each bin (NaN: empty bin).

    Rows whose ``dist`` lies outside ``[edges[0], edges[-1])`` (below the first edge or at and past the last)
    fall in no bin and are left out."""
    idx = np.searchsorted(edges, dist, side="right") - 1
    nb = len(edges) - 1
    keep = (idx >= 0) & (idx < nb)
    idx = idx[keep]
    num = np.bincount(idx, weights=np.einsum("jm,jm->j", res[keep], res[keep]), minlength=nb)
    den = np.bincount(idx, weights=np.einsum("jm,jm->j", v[keep], v[keep]), minlength=nb)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _check_constant(name, x, hi, what):
    """A real number (not a bool) in [0, ``hi``], or None; ``what`` says what it is in the messages."""
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number in [0, {hi}] ({what}), got {type(x).__name__}")
    x = float(x)
    if not 0.0 <= x <= hi:
        raise ValueError(f"{name} must lie in [0, {hi}] ({what}), got {x!r}")
    return x


def _draw_keys(rng, n, d, key_scale, orthogonal):
    """``n`` keys in R^d: i.i.d. N(0, 1), or orthonormal rows (a random orthogonal frame; n <= d), times key_scale."""
    if not orthogonal:
        return key_scale * rng.standard_normal((n, d))
    qmat, r = np.linalg.qr(rng.standard_normal((d, n)))
    return key_scale * (qmat * np.where(np.diag(r) < 0, -1.0, 1.0)).T


def _check_trial_size(fmap, d, d_phi, n, value_dim) -> None:
    """ValueError naming ``d`` or ``value_dim`` when a trial of ``n`` pairs would form an array of more than
    ``config.QUADRATIC_MAX_ELEMENTS`` numbers (n x d keys, n x D_phi features, n x M values, the D_phi x M
    state, a random map's projection), before any is made (the n x n arrays: the n_pairs check)."""
    width = n if value_dim is None else value_dim
    arrays = [(("d", d), "n x d keys", n, d), (("d", d), "n x D_phi features", n, d_phi)]
    arrays += [(("d", d), what, rows, cols) for what, rows, cols in C.map_arrays(fmap, d)]
    if value_dim is not None:
        arrays.append((("value_dim", value_dim), "n x M values", n, width))
    arrays.append((("d", d) if value_dim is None else ("value_dim", value_dim), "D_phi x M state", d_phi, width))
    limit = config.QUADRATIC_MAX_ELEMENTS
    for (name, value), what, rows, cols in arrays:
        if rows * cols > limit:
            raise ValueError(f"{name} = {value}: a trial of n = {n} pairs forms the {what} = {rows} x {cols} array "
                             f"(D_phi = {d_phi}), more than config.QUADRATIC_MAX_ELEMENTS = {limit} elements; raise it "
                             f"to run larger sizes")


def _distance_edges(distance_bins, n_max):
    """Bin edges of the write-read distance: default 0, 1, 2, 4, ... up to the first power of 2 >= n_max."""
    if distance_bins is None:
        top = 1
        while top < n_max:
            top *= 2
        edges = [0] + [2 ** i for i in range(int(math.log2(top)) + 1)]
        return np.asarray(edges, dtype=np.int64)
    e = np.asarray(distance_bins)
    if e.ndim != 1 or e.dtype.kind not in "iu":
        raise TypeError(f"distance_bins must be a 1-D sequence of integers (bin edges), got {distance_bins!r}")
    if e.size < 2 or e[0] < 0 or np.any(np.diff(e) <= 0):
        raise ValueError(f"distance_bins must hold at least two increasing edges >= 0, got {distance_bins!r}")
    return e.astype(np.int64)


def recall_capacity(feature_map, d, n_pairs, *, value_dim=None, key_scale=1.0, trials=8, seed=0,
                    softmax_scale=None, eps=DEFAULT_EPS, decay=None, distance_bins=None, beta=None,
                    normalize=None, orthogonal_keys=False, method="quadratic", rule=None, rule_arguments=None):
    r"""Training-free associative recall through linear attention's state.

    Writes ``n`` random pairs in order and reads the state back with every key (Schlag et al. 2021,
    §4.1, setting 1), against the least-squares state of the same size and softmax (docs/guide/analysis.md).

    Parameters
    ----------
    feature_map : str or FeatureMap
        A registered feature map (``"softmax"`` is the baseline, always reported).
    d : int
        Key dimension (>= 1).
    n_pairs : int or sequence of int
        Numbers of stored pairs (each >= 1).
    value_dim : int, optional
        Gaussian values of this dimension; default one-hot values (memory O(n^2) per trial).
    key_scale : float, default 1.0
        Keys are ``key_scale * N(0, I_d)``; ``1/sqrt(d)`` gives keys of norm ~1.
    trials : int, default 8
        Independent draws per ``n`` (each ``(seed, n, trial)`` has its own random stream).
    seed : int, default 0
    softmax_scale : float, optional
        Temperature of the softmax baseline, default ``1/sqrt(d)``.
    eps : float or None, default 1e-8
        Normaliser floor of the linear read-out (:func:`linattn_nb.linear_attention`).  ``None`` divides
        by the raw normaliser ``phi(k) . z``: where that is 0 for some key (a map whose features can all
        vanish, ``"relu"``), the read-out 0/0 is not defined and ``normalize=True`` raises ValueError, as
        :func:`~linattn_nb.analysis.attention_rank` does for a zero normaliser with ``eps=None``.
    decay : float, optional
        A constant decay ``gamma`` in [0, 1] of the state (default: none, the additive rule).
    distance_bins : sequence of int, optional
        Increasing bin edges (>= 0) of the write-read distance; default ``0, 1, 2, 4, ...`` up to the
        first power of 2 >= ``max(n_pairs)``.  The pairs whose distance lies outside
        ``[distance_bins[0], distance_bins[-1])`` are left out of ``error_by_distance`` (e.g. ``[1, 2, 4]``
        leaves out the last pair, read at distance 0, and those at distance 4 or more).
    beta : float, optional
        The delta rule's write strength in [0, 2] (default: none); with ``decay``, the gated delta rule.
    normalize : bool, optional
        Divide the read-out by ``phi(k) . z`` (``eps`` floors it); default True for the additive and
        decay rules, False with ``beta`` and ``rule``.  Signed maps (``"l2"``) need False: where one
        gives a key a normaliser at or below ``eps`` (any update rule: additive, ``decay``, ``beta``,
        ``rule``), True raises ValueError.
    orthogonal_keys : bool, default False
        Orthonormal keys (a random orthogonal frame, times ``key_scale``); needs every ``n <= d``.
    method : str, default "quadratic"
        The causal ``linear_attention`` method that runs the delta rules (unused without ``beta``).
    rule : str, optional
        A named DPLR rule (:func:`linattn_nb.rules.dplr_rule_names`) instead of ``decay``/``beta``,
        run by :func:`linattn_nb.dplr_attention` (``normalize`` default False).
    rule_arguments : dict, optional
        The rule's arguments as constants repeated at every token: a scalar, a (D_phi,) vector, (n_h,)
        for the DeltaProduct rules' ``beta`` (n_h sub-steps per pair); ``"keys"`` stands for the unit
        key features (RWKV-7's removal key ``kappa`` as the written key).

    Returns
    -------
    RecallCapacity

    Raises
    ------
    ValueError
        Non-positive sizes, ``key_scale`` or ``softmax_scale``; an empty ``n_pairs``; an ``n_pairs``,
        ``d`` or ``value_dim`` whose trial would form an array of more than
        ``config.QUADRATIC_MAX_ELEMENTS`` elements (the n x n one-hot values and distances, n x d keys,
        n x D_phi features, n x M values, the D_phi x M state, a random map's projection), before any is
        made; ``feature_map="softmax"``; features
        not of shape ``(n, output_dim(d))``; ``decay`` outside [0, 1]; ``beta`` outside [0, 2];
        ``distance_bins`` not increasing; ``orthogonal_keys`` with some ``n > d``;
        ``normalize=False`` with a map that needs its normaliser (FAVOR+); ``normalize=True`` with a
        map of signed features (``"l2"``) whose normaliser ``phi(k) . z`` is at or below ``eps`` for
        some key (with every update rule), or with ``eps=None`` and a normaliser of 0 for some key
        (any map).
    TypeError
        Non-integer sizes, a bad ``feature_map``, a non-real ``decay`` or ``beta``, ``normalize`` or
        ``orthogonal_keys`` not a bool.
    linattn_nb.NonFiniteResult
        Keys so large (``key_scale`` of about 1e200 with ELU+1) that the state overflows even in float64.

    Examples
    --------
    >>> from linattn_nb.analysis import recall_capacity
    >>> res = recall_capacity("elu", 16, [8, 64], trials=2)
    >>> res.d_phi, res.n_pairs.tolist()
    (16, [8, 64])
    >>> res.optimal_mse.round(3).tolist()             # 0 below D_phi, 1 - 16/64 above
    [0.0, 0.75]
    >>> bool(res.mse[1] >= res.optimal_mse[1])
    True

    With a decay the recent pairs are read better, the old ones worse:

    >>> add = recall_capacity("elu", 16, 64, trials=2, distance_bins=[0, 8, 64])
    >>> dec = recall_capacity("elu", 16, 64, trials=2, distance_bins=[0, 8, 64], decay=0.8)
    >>> bool(dec.error_by_distance[0, 0] < add.error_by_distance[0, 0])
    True
    >>> bool(dec.error_by_distance[0, 1] > add.error_by_distance[0, 1])
    True

    The delta rule stores orthonormal unit keys exactly, up to ``D_phi``:

    >>> dr = recall_capacity("l2", 16, [8, 16], trials=2, beta=1.0, orthogonal_keys=True)
    >>> bool(dr.mse.max() < 1e-12)
    True
    """
    if C.is_softmax(feature_map):
        raise ValueError("feature_map='softmax' is the baseline (softmax_accuracy, softmax_mse); pass a feature map")
    fmap = C.resolve_map(feature_map)
    d = C.check_int("d", d, 1)
    ns = np.atleast_1d(np.asarray(n_pairs))
    if ns.ndim == 1 and ns.size == 0:  # np.asarray([]) is float: refused as empty, not as non-integer
        raise ValueError(f"n_pairs must be non-empty and every entry >= 1, got {n_pairs!r}")
    if ns.ndim != 1 or ns.dtype.kind not in "iu":
        raise TypeError(f"n_pairs must be an integer or a 1-D sequence of integers, got {n_pairs!r}")
    if ns.min() < 1:
        raise ValueError(f"n_pairs must be non-empty and every entry >= 1, got {n_pairs!r}")
    ns = ns.astype(np.int64)
    if int(ns.max()) ** 2 > config.QUADRATIC_MAX_ELEMENTS:
        # each trial forms n x n matrices (the one-hot values, the nearest-value distances)
        raise ValueError(f"n_pairs: n = {int(ns.max())} forms n x n matrices per trial, more than "
                         f"config.QUADRATIC_MAX_ELEMENTS = {config.QUADRATIC_MAX_ELEMENTS} elements; raise it to run "
                         "larger n")
    if value_dim is not None:
        value_dim = C.check_int("value_dim", value_dim, 1)
    key_scale = C.check_positive_float("key_scale", key_scale)
    trials = C.check_int("trials", trials, 1)
    seed = C.check_int("seed", seed, 0)
    softmax_scale = 1.0 / math.sqrt(d) if softmax_scale is None else C.check_positive_float("softmax_scale", softmax_scale)
    eps = V.check_eps(eps)
    decay = _check_constant("decay", decay, 1, "a constant gamma; 1 is the additive rule")
    beta = _check_constant("beta", beta, 2, "one write strength")
    if not isinstance(orthogonal_keys, (bool, np.bool_)):
        raise TypeError(f"orthogonal_keys must be True or False, got {orthogonal_keys!r}")
    orthogonal_keys = bool(orthogonal_keys)
    if orthogonal_keys and ns.max() > d:
        raise ValueError(f"orthogonal_keys needs every n <= d = {d} (at most d orthonormal keys), "
                         f"got n = {int(ns.max())}")
    d_phi = C.feature_dim(fmap, d)
    _check_trial_size(fmap, d, d_phi, int(ns.max()), value_dim)
    dplr = None
    if rule is not None:
        from ..rules import get_dplr_rule

        if decay is not None or beta is not None:
            raise TypeError("recall_capacity: pass a named rule's arguments in rule_arguments, not decay or beta")
        if rule_arguments is not None and not isinstance(rule_arguments, dict):
            raise TypeError(f"rule_arguments must be a dict, got {type(rule_arguments).__name__}")
        dplr = get_dplr_rule(rule)
        normalize = False if normalize is None else normalize
        if not isinstance(normalize, (bool, np.bool_)):
            raise TypeError(f"normalize must be True or False, got {normalize!r}")
        rule = dplr.name
    elif rule_arguments is not None:
        raise TypeError("recall_capacity: rule_arguments needs rule= (a named DPLR rule)")
    else:
        rule, _, normalize = FE.rule_arguments(fmap, decay, None, normalize, (), 1, d_phi, causal=True,
                                               beta=beta)
    edges = _distance_edges(distance_bins, int(ns.max()))

    metrics = np.zeros((6, ns.size, trials))
    by_dist = np.zeros((2, ns.size, trials, len(edges) - 1))
    for a, n in enumerate(ns):
        n = int(n)
        for t in range(trials):
            rng = np.random.default_rng([seed, n, t])
            keys = _draw_keys(rng, n, d, key_scale, orthogonal_keys)
            vals = np.eye(n) if value_dim is None else rng.standard_normal((n, value_dim))
            phi = C.features(fmap, keys, role="key", causal=False, name="keys")[0]
            dist = np.arange(n - 1, -1, -1)
            if dplr is not None:
                vhat = _dplr_readout(fmap, dplr, keys, vals, rule_arguments or {}, normalize, eps)
            elif get_rule(rule).reads_state:
                vhat = _delta_readout(fmap, keys, vals, beta, decay, normalize, eps, method)
            elif decay is None and normalize:
                _check_normaliser(fmap, phi, phi.sum(axis=0), eps)
                vhat = linear_attention(keys, keys, vals, feature_map=fmap, causal=False, eps=eps)
            else:
                w = np.ones(n) if decay is None else decay ** dist.astype(np.float64)
                if normalize:
                    _check_normaliser(fmap, phi, (phi * w[:, None]).sum(axis=0), eps)
                vhat = _decayed_readout(phi, vals, w, eps, normalize=normalize)
            vs = softmax_attention(keys, keys, vals, scale=softmax_scale)
            opt_res = _optimal_residual(phi, vals)
            metrics[:, a, t] = (
                _nearest_accuracy(vhat, vals),
                _rel_err(vhat, vals),
                float(np.sum(opt_res * opt_res) / np.sum(vals * vals)),
                _nearest_accuracy(vs, vals),
                _rel_err(vs, vals),
                _nearest_accuracy(vals + opt_res, vals),
            )
            by_dist[0, a, t] = _binned_rel_err(vhat - vals, vals, dist, edges)
            by_dist[1, a, t] = _binned_rel_err(opt_res, vals, dist, edges)
    acc, mse, opt, sacc, smse, opt_acc = metrics.mean(axis=-1)
    err_d, opt_d = by_dist.mean(axis=2)
    return RecallCapacity(
        feature_map=repr(fmap), d=d, d_phi=d_phi, value_dim=value_dim, key_scale=key_scale,
        trials=trials, n_pairs=ns, accuracy=acc, mse=mse, optimal_mse=opt,
        softmax_accuracy=sacc, softmax_mse=smse, softmax_scale=softmax_scale,
        decay=decay, beta=beta, normalize=normalize, orthogonal_keys=orthogonal_keys, distance_edges=edges,
        error_by_distance=err_d, optimal_error_by_distance=opt_d,
        rule=None if dplr is None else dplr.name, optimal_accuracy=opt_acc,
    )


def _dplr_readout(fmap, spec, keys, vals, args, normalize, eps):
    """Every key's read-out of the state a named DPLR rule leaves after writing the pairs in order.

    ``args``: constants repeated per token; the string ``"keys"`` stands for the unit key features.
    """
    from ..dplr import dplr_attention

    n = keys.shape[0]
    phi = C.features(fmap, keys, role="key", causal=True, name="keys")[0]
    full = {}
    for name, x in args.items():
        if isinstance(x, str):
            if x != "keys":
                raise ValueError(f"rule_arguments[{name!r}] must be an array, a number or 'keys', got {x!r}")
            full[name] = phi / np.maximum(np.linalg.norm(phi, axis=-1, keepdims=True), np.finfo(float).tiny)
        else:
            x = np.asarray(x, dtype=np.float64)
            full[name] = np.broadcast_to(x, (n,) + x.shape).copy()
    k, v = keys, vals
    if spec.substeps:
        beta = full.get("beta")
        if beta is None or beta.ndim != 2:
            raise ValueError(f"rule {spec.name!r} writes n_h steps a token: give rule_arguments['beta'] of shape (n_h,)")
        r = beta.shape[1]
        k, v = np.repeat(keys[:, None], r, axis=1), np.repeat(vals[:, None], r, axis=1)
    _, st = dplr_attention(keys, k, v, rule=spec.name, feature_map=fmap, normalize=normalize, eps=eps,
                           return_state=True, **full)
    q = C.features(fmap, keys, role="query", causal=True, name="keys")[0]
    if normalize:
        _check_normaliser(fmap, q, st.z, eps)
    return FE.read_state(q, st.S, st.z, normalize, eps)


def _delta_readout(fmap, keys, vals, beta, decay, normalize, eps, method):
    """Every key's read-out of the state causal ``linear_attention(..., beta=beta, decay=decay)`` leaves."""
    _, st = linear_attention(keys, keys, vals, feature_map=fmap, causal=True, eps=eps, beta=beta, decay=decay,
                             normalize=normalize, method=method, return_state=True)
    phi = C.features(fmap, keys, role="query", causal=True, name="keys")[0]
    if normalize:
        _check_normaliser(fmap, phi, st.z, eps)
    return FE.read_state(phi, st.S, st.z, normalize, eps)


def _check_normaliser(fmap, phi, z, eps) -> None:
    """ValueError when the normaliser ``phi(k) . z`` of the normalised read-out (features ``phi`` (n, F) of
    the keys, the state's ``z`` (F,)) is not defined for some key, whatever update rule wrote ``z``.

    A map with signed features (``l2``, ``identity``, ...) that gives some key a normaliser at or below the
    floor: the read-out then divides by the floor (or by a number of either sign) and its error measures
    that, not the map.  A map with non-negative features keeps its floored rows (a key whose features are
    all 0 reads 0, a defined result); with ``eps=None`` a normaliser of 0 gives 0/0, refused as
    :func:`~linattn_nb.analysis.attention_rank` refuses it."""
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowed state is the read-out's NonFiniteResult
        den = phi @ np.asarray(z, dtype=np.float64)
    if getattr(fmap, "is_positive", False):
        bad = 0 if eps is not None else np.count_nonzero(~(den > 0.0))
        if bad:
            raise ValueError(f"recall_capacity: {bad} of the {den.size} keys have a zero normaliser phi(k) . z "
                             f"(feature map {fmap.name!r} with eps=None): the normalised read-out 0/0 is not "
                             "defined; pass eps > 0")
        return
    low = np.count_nonzero(~(den > (0.0 if eps is None else eps)))
    if low:
        raise ValueError(f"recall_capacity: feature map {fmap.name!r} has signed features, and the normaliser "
                         f"phi(k) . z of {low} of the {den.size} keys is <= {0.0 if eps is None else eps}: the "
                         "normalised read-out would divide by the floor; pass normalize=False (the read-out "
                         "phi(k)^T S)")


def _decayed_readout(phi, vals, weights, eps, normalize=True):
    """Every key's read-out of the state ``S = sum_j w_j phi_j v_j^T``, ``z = sum_j w_j phi_j``."""
    wphi = phi * weights[:, None]
    return FE.read_state(phi, wphi.T @ vals, wphi.sum(axis=0), normalize, eps)


# ---------------------------------------------------------------------------
# MQAR (Zoology)
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MQAR:
    """A batch of multi-query associative recall sequences (:func:`mqar`).

    Attributes
    ----------
    inputs : ndarray of int64, shape (n_examples, seq_len)
        Token ids.
    labels : ndarray of int64, shape (n_examples, seq_len)
        The value to predict at each query position, ``-100`` (ignored by cross-entropy) elsewhere.
    keys, values : ndarray of int64, shape (n_examples, n_kv)
        The pairs, in the order they appear in the context.
    query_positions : ndarray of int64, shape (n_examples, n_kv)
        Position of the query of ``keys[:, j]``.
    """

    inputs: np.ndarray
    labels: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    query_positions: np.ndarray

    def to_dict(self) -> dict:
        """Plain-Python dict (lists instead of arrays), for JSON."""
        return C.plain_dict((name, getattr(self, name)) for name in self.__dataclass_fields__)


def mqar(n_examples, seq_len, n_kv, *, vocab_size=8192, power_a=0.01, random_non_queries=True, seed=None):
    r"""Multi-query associative recall sequences (Zoology; Arora et al. 2023, §3 and App.).

    ``n_kv`` key-value pairs, then every key queried once at a power-law position, labelled with its
    value; the layout: docs/guide/analysis.md.

    Parameters
    ----------
    n_examples : int
    seq_len : int
        Even, at least ``4 n_kv``, smaller than ``vocab_size``.
    n_kv : int
        Key-value pairs per example (>= 1).
    vocab_size : int, default 8192
    power_a : float, default 0.01
        Exponent ``a`` of the query-position power law (0 < a, finite): the queries' slots after the
        pairs are drawn without replacement with ``p_i ∝ a i^(a-1)``.  Where a large ``a`` leaves fewer
        than ``n_kv`` slots of non-zero ``p_i`` in float64, the same law is drawn from its logarithms
        (Gumbel top-k, equal in law to the successive draws), all but certainly the ``n_kv`` last slots.
    random_non_queries : bool, default True
    seed : int or numpy.random.Generator, optional

    Returns
    -------
    MQAR
        ``inputs``, ``labels`` and, for convenience, ``keys``, ``values``, ``query_positions``.

    Raises
    ------
    ValueError
        When Zoology's constraints fail: ``seq_len`` odd, ``vocab_size <= seq_len``,
        ``4 n_kv > seq_len``; non-positive sizes; ``power_a`` not finite and > 0.

    Examples
    --------
    >>> from linattn_nb.analysis import mqar
    >>> batch = mqar(2, 16, 2, vocab_size=32, seed=0)
    >>> batch.inputs.shape, batch.labels.shape
    ((2, 16), (2, 16))
    >>> bool(((batch.labels == -100).sum(axis=1) == 14).all())
    True
    """
    random_non_queries = C.check_bool("random_non_queries", random_non_queries)
    n_examples = C.check_int("n_examples", n_examples, 0)
    seq_len = C.check_int("seq_len", seq_len, 2)
    n_kv = C.check_int("n_kv", n_kv, 1)
    vocab_size = C.check_int("vocab_size", vocab_size, 4)
    power_a = C.check_positive_float("power_a", power_a)
    if seq_len % 2:
        raise ValueError(f"seq_len must be even (Zoology's MQAR), got {seq_len}")
    if vocab_size <= seq_len:
        raise ValueError(f"vocab_size must be larger than seq_len, got vocab_size={vocab_size}, seq_len={seq_len}")
    if 4 * n_kv > seq_len:
        raise ValueError(f"4 * n_kv must be <= seq_len, got n_kv={n_kv}, seq_len={seq_len}")
    rng = generator(seed)

    half = vocab_size // 2
    context = 2 * n_kv
    slots = (seq_len - context) // 2
    idx = np.arange(1, slots + 1, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        p = power_a * idx ** (power_a - 1.0)
        p /= p.sum()
    if not np.isfinite(p).all():  # a large exponent overflows idx ** (a - 1): the same law from its logs
        with np.errstate(over="ignore", invalid="ignore"):
            logp = (power_a - 1.0) * np.log(idx)
            p = np.exp(logp - logp.max())
            p /= p.sum()
    # a larger one (a > 1 only: |a - 1| log(slots) > ~745) underflows all but the last slots' p to 0,
    # fewer than n_kv, which rng.choice refuses (or overflows the logs, a > ~1e307): then the same law
    # drawn from its logs (<= 0, shifted so that they cannot overflow), the Gumbel top-k trick, equal in
    # law to rng.choice's successive draws without replacement: for such an a all but certainly the n_kv
    # last slots (ties: the later slot)
    gumbel = not np.isfinite(p).all() or np.count_nonzero(p) < n_kv
    if gumbel:
        with np.errstate(over="ignore"):
            logp = (power_a - 1.0) * (np.log(idx) - math.log(slots))

    inputs = np.zeros((n_examples, seq_len), dtype=np.int64)
    labels = np.full((n_examples, seq_len), -100, dtype=np.int64)
    keys = np.empty((n_examples, n_kv), dtype=np.int64)
    values = np.empty((n_examples, n_kv), dtype=np.int64)
    qpos = np.empty((n_examples, n_kv), dtype=np.int64)
    for e in range(n_examples):
        ks = rng.choice(np.arange(1, half), size=n_kv, replace=False)
        vs = rng.choice(np.arange(half, vocab_size), size=n_kv, replace=False)
        if gumbel:
            chosen = np.lexsort((-idx, -(logp + rng.gumbel(size=slots))))[:n_kv]
        else:
            chosen = rng.choice(slots, size=n_kv, replace=False, p=p)
        pos = context + 2 * chosen
        row = inputs[e]
        row[0:context:2] = ks
        row[1:context:2] = vs
        if random_non_queries:
            # uniform over the vocabulary minus this example's keys
            free = np.ones(seq_len, dtype=bool)
            free[:context] = False
            free[pos] = False
            u = rng.integers(0, vocab_size - n_kv, size=int(free.sum()))
            for kk in np.sort(ks):
                u += u >= kk
            row[free] = u
        row[pos] = ks
        labels[e, pos] = vs
        keys[e], values[e], qpos[e] = ks, vs, pos
    return MQAR(inputs, labels, keys, values, qpos)


# ---------------------------------------------------------------------------
# State size
# ---------------------------------------------------------------------------
def state_size(feature_map, d, value_dim, heads=1, *, dtype=np.float64, seq_len=None):
    """Recurrent state size in bytes, counted as Zoology counts it.

    ``heads * (M * D_phi + D_phi)`` numbers (``S`` and ``z`` per head), times the item size of ``dtype``;
    for ``feature_map="softmax"`` the KV cache of ``seq_len`` tokens, ``heads * seq_len * (d + M)``.

    Parameters
    ----------
    feature_map : str or FeatureMap
        Its ``output_dim(d)`` is ``D_phi``; or ``"softmax"``.
    d : int
        Query/key dimension per head.
    value_dim : int
        Value dimension per head ``M`` (Zoology's ``head_dim``).
    heads : int, default 1
    dtype : numpy dtype, default float64
        The dtype the state is held in (:class:`linattn_nb.LinearState` is float64).
    seq_len : int, optional
        Required for ``"softmax"``; not used by a feature map's fixed-size state (checked all the same).

    Returns
    -------
    int
        Bytes.

    Examples
    --------
    >>> from linattn_nb.analysis import state_size
    >>> state_size("elu", 64, 64, heads=8)                 # 8 * (64*64 + 64) * 8 bytes
    266240
    >>> state_size("softmax", 64, 64, heads=8, seq_len=1024, dtype="float16")
    2097152
    """
    d = C.check_int("d", d, 1)
    value_dim = C.check_int("value_dim", value_dim, 1)
    heads = C.check_int("heads", heads, 1)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.kind != "f":
        raise TypeError(f"dtype must be a floating dtype (float16, float32, float64), got {dtype!r}")
    itemsize = dt.itemsize
    if seq_len is not None:
        seq_len = C.check_int("seq_len", seq_len, 0)
    if C.is_softmax(feature_map):
        if seq_len is None:
            raise ValueError("feature_map='softmax': the KV cache grows with the sequence; pass seq_len")
        return heads * seq_len * (d + value_dim) * itemsize
    d_phi = C.feature_dim(C.resolve_map(feature_map), d)
    return heads * (value_dim * d_phi + d_phi) * itemsize
