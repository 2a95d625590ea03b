"""Argument handling and featurisation shared by the analysis functions.

Features come through :func:`linattn_nb._frontend.featurise`, the call and shape check of
:func:`linattn_nb.linear_attention`, so a map of the wrong shape raises the same ValueError everywhere.
"""
from __future__ import annotations

import math
import numbers
import warnings

import numpy as np

from .. import _frontend as FE
from .. import _validate as V
from .._defaults import DEFAULT_EPS
from .. import feature_maps as fm
from ..rules import get_rule


#: Default marker of an ``eps`` argument: ``config.DEFAULT_EPS`` read at call time.
DEFAULT = DEFAULT_EPS
#: The ``feature_map`` value that asks for softmax weights instead of a map.
SOFTMAX = "softmax"


def plain_dict(fields) -> dict:
    """``(name, value)`` pairs as a dict for :func:`json.dumps`: arrays as lists, NumPy scalars unboxed."""
    out = {}
    for name, val in fields:
        if isinstance(val, np.ndarray):
            val = val.tolist()
        elif isinstance(val, np.generic):
            val = val.item()
        out[name] = val
    return out


check_causal = FE.check_causal
feature_dim = FE.feature_dim


def is_softmax(feature_map) -> bool:
    """True for ``feature_map="softmax"`` (softmax weights, no feature map)."""
    return isinstance(feature_map, str) and feature_map == SOFTMAX


def resolve_map(feature_map):
    """``None`` for ``"softmax"``, else the :class:`~linattn_nb.feature_maps.FeatureMap`."""
    return None if is_softmax(feature_map) else fm.resolve(feature_map)


def warn_scale(fmap, d: int, scale: float, stacklevel: int = 4) -> None:
    """Warn when ``fmap`` estimates softmax at another temperature than ``scale`` (``stacklevel``: by
    default the caller of the public function that called its own helper)."""
    if fmap is not None and getattr(fmap, "estimates_softmax", False) and hasattr(fmap, "effective_scale"):
        s_map = float(fmap.effective_scale(d))
        if not math.isclose(s_map, scale, rel_tol=1e-12):
            warnings.warn(
                f"feature map {fmap.name!r} estimates exp({s_map:g} q.k) but softmax uses scale={scale:g}; "
                "pass the same scale to both (feature_maps.get(..., scale=...))",
                stacklevel=stacklevel,
            )


def resolve_eps(eps):
    """The normaliser floor: ``config.DEFAULT_EPS`` for :data:`DEFAULT`, else checked as in linear_attention."""
    return V.check_eps(eps)


def features(fmap, x, *, role: str, causal: bool, name: str, check_finite: bool = False,
             offset: int = 0) -> np.ndarray:
    """Features of ``x`` (..., N, D) as linear attention computes them: float64, flattened to (B, N, F).

    ``total_length = offset + N``; a wrong shape, and with ``check_finite`` inf or NaN, raise ValueError.
    """
    x = np.asarray(x)
    n = int(x.shape[-2])
    feats = FE.featurise(fmap, x, role=role, causal=causal, offset=offset, total_length=offset + n,
                         dtype=np.float64, name=name)
    if check_finite:
        check_finite_features(fmap, feats, name)
    b = int(np.prod(x.shape[:-2], dtype=np.int64))
    return np.ascontiguousarray(feats, dtype=np.float64).reshape((b, n, feats.shape[-1]))


def check_finite_features(fmap, feats, name: str) -> None:
    """Raise ValueError, naming the map and ``name``, when ``feats`` holds inf or NaN (an overflow)."""
    if feats.size and not np.isfinite(feats).all():
        raise ValueError(
            f"feature map {fmap.name!r} produced non-finite features of {name} (overflow?); "
            "rescale the inputs"
        )


def check_rtol(rtol, batch_shape) -> np.ndarray:
    """A relative tolerance: a real number >= 0 or an array of them broadcasting to ``batch_shape``.

    To it, not only with it: the result has one tolerance per matrix of the batch, so an array that would
    grow the batch (``[1e-12]`` for a single matrix, batch shape ``()``) raises ValueError naming rtol.
    ``batch_shape`` None: any shape (the caller checks it)."""
    if isinstance(rtol, (bool, np.bool_)):
        raise TypeError("rtol must be a non-negative real number (or an array of them), got a bool")
    try:
        r = np.asarray(rtol, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"rtol must be a non-negative real number (or an array of them), got {rtol!r}") from None
    if r.size and (not np.all(np.isfinite(r)) or np.any(r < 0)):
        raise ValueError(f"rtol must be finite and >= 0, got {rtol!r}")
    if r.ndim and batch_shape is not None:
        try:
            fits = np.broadcast_shapes(r.shape, tuple(batch_shape)) == tuple(batch_shape)
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(
                f"rtol of shape {r.shape} does not broadcast to the batch shape {tuple(batch_shape)}"
                + ("" if batch_shape else " (a single matrix: pass a scalar rtol)")
            )
    return r


def check_scalar_rtol(rtol, func: str):
    """A scalar relative tolerance (:func:`check_rtol`) as a float, or None; an array raises ValueError naming ``func``."""
    if rtol is None:
        return None
    r = check_rtol(rtol, None)
    if r.ndim:
        raise ValueError(f"rtol of {func} must be a scalar")
    return float(r)


check_int = V.check_int  # counts, sizes and seeds, checked as the attention functions check theirs


def map_arrays(fmap, d: int) -> list:
    """The ``(what, rows, cols)`` arrays a random map not yet drawn will form at input dimension ``d``: its
    ``m x d`` projection and, when orthogonal, ``d x d`` blocks (none for other maps, or one already drawn)."""
    if getattr(fmap, "W", None) is not None or not hasattr(fmap, "num_projections"):
        return []
    arrays = [("m x d random projection", int(fmap.num_projections(d)), d)]
    if getattr(fmap, "orthogonal", False):
        arrays.append(("d x d orthogonal block", d, d))
    return arrays


check_bool = V.check_bool  # the flags of the analysis functions, as those of the attention functions


def check_positive_float(name: str, x) -> float:
    """A finite real number > 0 (not a bool)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a positive real number, got {type(x).__name__}")
    x = float(x)
    if not (x > 0) or math.isinf(x):
        raise ValueError(f"{name} must be finite and > 0, got {x}")
    return x


def prepare(q, k, v, fmap, *, causal, eps, check_finite, decay=None, log_decay=None, beta=None,
            normalize=None, initial_state=None, names=("q", "k", "v"), same_n=True, required=("q", "k")):
    """The request of an analysis call: :func:`linattn_nb._frontend.host_call` without a method or device.

    ``fmap`` None (softmax weights) has no update rule: ``decay``/``log_decay``/``beta`` and
    ``normalize=False`` raise ValueError.  ``required``: the names of ``names`` a user must give (TypeError
    for None).  Returns the :class:`~linattn_nb._frontend.Call` with ``q``, ``k``, ``v`` flattened to
    C-contiguous float64 (B, N, .) (None stays None).
    """
    for name, x in zip(names, (q, k, v)):
        if x is None and name in required:
            raise TypeError(f"{name} must be an array of shape (..., N, {'M' if name == 'v' else 'D'}), got None")
    c = FE.host_call(q, k, v, fmap=fmap, eps=resolve_eps(eps), causal=check_causal(causal), decay=decay,
                     log_decay=log_decay, beta=beta, normalize=normalize, check_qkv=check_finite,
                     initial_state=initial_state, names=names, same_n=same_n)
    arrays = {nm: getattr(c, nm) for nm in ("q", "k", "v")}
    return c._replace(**{nm: V.flatten_batch(x, np.float64) for nm, x in arrays.items() if x is not None})


def _entry_text(entry) -> str:
    """`` of batch entry ...`` for the messages, empty for None."""
    return "" if entry is None else f" of batch entry {entry}"


def _batch_entry(idx, batch_shape):
    """The batch entry of a flat index ``idx`` of a (B, ...) array in the user's ``batch_shape``: None without
    a batch (``()``), an int for one batch dimension, else a tuple."""
    if not batch_shape:
        return None
    where = np.unravel_index(int(idx), tuple(batch_shape))
    return int(where[0]) if len(where) == 1 else tuple(int(x) for x in where)


def _refuse_overflowed(s, causal, offset=0, entry=None, q=None, k=None, batch_shape=None) -> None:
    """ValueError where a score of ``s`` (..., rows, Nk) that a row reads (``causal``: ``j <= i``, the rows being
    queries ``offset ...``) is not finite: the softmax weights of that row are not defined (``s - max`` would be
    ``inf - inf``: NaN weights).  With the rows ``q`` (..., rows, D) and the keys ``k`` (..., Nk, D) of ``s``, a
    score whose query or key holds inf or NaN (inputs not checked, ``check_finite=False``) is named as such;
    else ``scale * q . k`` overflowed float64.  ``entry``: the batch entry of a 2-D ``s``; ``batch_shape``:
    the batch shape of the user's input, of which the leading dimension of a 3-D ``s`` is the flattened form
    (``()``: no batch, no entry named)."""
    bad = ~np.isfinite(s)
    if causal:
        rows, cols = s.shape[-2:]
        bad &= np.arange(cols)[None, :] <= offset + np.arange(rows)[:, None]
    if not bad.any():
        return
    where = [int(x) for x in np.argwhere(bad)[0]]
    if entry is None and len(where) > 2:
        if batch_shape is not None and len(where) == 3:
            entry = _batch_entry(where[0], batch_shape)
        else:
            entry = where[0] if len(where) == 3 else tuple(where[:-2])
    at = f"query {offset + where[-2]}, key {where[-1]}{_entry_text(entry)}"
    if q is not None and k is not None:
        lead = tuple(where[:-2])
        names = [nm for nm, row in (("q", q[lead + (where[-2],)]), ("k", k[lead + (where[-1],)]))
                 if not np.isfinite(row).all()]
        if names:
            what = "NaN" if np.isnan(s[tuple(where)]) else "inf"
            raise ValueError(f"the softmax scores scale * q . k hold {what} ({at}): {' and '.join(names)} "
                             f"{'hold' if len(names) > 1 else 'holds'} inf or NaN there (inputs not checked with "
                             "check_finite=False); the softmax weights are not defined there")
    raise ValueError(f"the softmax scores scale * q . k overflow float64 ({at}): the softmax weights are not "
                     "defined there; pass a smaller scale or scale q and k down")


def scores(q, k, scale: float) -> np.ndarray:
    """The softmax scores ``(scale q) . k`` of (..., Nq, D) and (..., Nk, D), float64: ``q`` scaled first, as
    the softmax kernels do, so that a representable score is not lost to an overflow of ``q . k`` (inputs
    near 1e160 with ``scale = 1e-300``).  Overflows give inf or NaN, without a warning."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return (scale * q) @ np.swapaxes(k, -1, -2)


def check_scores(q, k, *, causal: bool, scale: float, batch_shape=None) -> None:
    """:func:`_refuse_overflowed` on every score of (B, N, D) float64 ``q`` and ``k``, for a kernel that forms
    them one row at a time: none is formed where ``scale * max|q_i| * max|k_j|`` (Cauchy-Schwarz) is far from
    float64's range, else the scores in blocks of rows.  ``batch_shape``: the user's (unflattened) batch shape,
    for the entry a message names (None: the flat index where ``B > 1``)."""
    if q.size == 0 or k.size == 0:
        return
    with np.errstate(over="ignore", invalid="ignore"):
        nq = np.sqrt(np.einsum("bnd,bnd->bn", q, q)).max()
        nk = np.sqrt(np.einsum("bnd,bnd->bn", k, k)).max()
        if abs(scale) * nq * nk < 1e300:  # False for inf and NaN too
            return
    rows = max(1, (1 << 22) // max(1, k.shape[1]))
    for b in range(q.shape[0]):
        entry = b if q.shape[0] > 1 else None
        if batch_shape is not None:
            entry = _batch_entry(b, batch_shape)
        for r0 in range(0, q.shape[1], rows):
            qb = q[b, r0:r0 + rows]
            _refuse_overflowed(scores(qb, k[b], scale), causal, r0, entry=entry, q=qb, k=k[b])


def softmax_weights(q, k, *, causal: bool, scale: float, batch_shape=None) -> np.ndarray:
    """Softmax weights ``softmax_j(scale q_i . k_j)`` of (..., Nq, D) and (..., Nk, D), float64.

    ``causal``: the weights of ``j > i`` are 0.  The scores are those of :func:`scores`; one that a row reads
    and that is not finite raises ValueError (:func:`_refuse_overflowed`, ``batch_shape`` as there).
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    s = scores(q, k, scale)
    _refuse_overflowed(s, causal, q=q, k=k, batch_shape=batch_shape)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
    if s.shape[-1]:
        s = s - s.max(axis=-1, keepdims=True)
    w = np.exp(s)
    w /= w.sum(axis=-1, keepdims=True)
    return w


def check_linear_weights(fmap, den, batch_shape) -> None:
    """ValueError, naming the map, where a row sum ``den`` (B, N) of the linear weights
    ``phi(q_i) . phi(k_j)`` is not finite: a product (or their sum) overflowed float64, and the weights of that
    row are NaN or inf.  ``batch_shape``: the user's batch shape, for the entry the message names."""
    bad = ~np.isfinite(den)
    if bad.any():
        b, i = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"feature map {fmap.name!r}: the linear weights phi(q) . phi(k) of query {i}"
            f"{_entry_text(_batch_entry(b, batch_shape))} overflow float64 (their row sum is {den[b, i]}); "
            "rescale the inputs"
        )


def entry_weights(rule, fq, fk, inputs, b: int = 0, *, causal: bool = True) -> np.ndarray:
    """Unnormalised linear-attention weights (N, N) of batch entry ``b`` under update rule ``rule``, float64.

    ``fq``, ``fk`` (N, F): the entry's features; ``inputs``: the flattened (B, N[, F]) rule inputs.  The
    weights come from :func:`linattn_nb.ops.causal.naive.explicit_weights` (decays: exact at resets; delta
    rules: the closed form of docs/theory.md).  ``causal=False`` (no rule inputs): ``phi(Q) phi(K)^T``.
    """
    if not get_rule(rule).has_inputs:
        a = np.asarray(fq, dtype=np.float64) @ np.asarray(fk, dtype=np.float64).T
        return np.tril(a) if causal else a
    from ..ops.causal.naive import explicit_weights

    return explicit_weights(get_rule(rule).code, fq, fk, inputs, b)[0]


def normalise_rows(a, eps) -> np.ndarray:
    """``a`` (..., N, N) with each row divided by its sum (the normaliser ``phi(q_t) . z_t``), floored at ``eps``.

    ``eps=None``: the raw sum; a row whose sum is 0 then holds NaN (0/0) or inf.
    """
    den = a.sum(axis=-1, keepdims=True)
    if eps is not None:
        den = np.maximum(den, eps)
    with np.errstate(divide="ignore", invalid="ignore"):
        return a / den


def explicit_rule_weights(rule: str, fq, fk, inputs, *, normalize: bool, eps, causal: bool = True):
    """:func:`entry_weights` (B, N, N) of each batch entry of ``fq``, ``fk`` (B, N, F).

    Divided by their row sums with ``normalize`` (:func:`normalise_rows`).
    """
    fq = np.asarray(fq, dtype=np.float64)
    fk = np.asarray(fk, dtype=np.float64)
    a = np.empty((fq.shape[0], fq.shape[1], fk.shape[1]))
    for i in range(fq.shape[0]):
        a[i] = entry_weights(rule, fq[i], fk[i], inputs, i, causal=causal)
    return normalise_rows(a, eps) if normalize else a
