"""Reading stored values back from a linear-attention state.

:func:`read_back` queries a state with the keys written into it and compares the read-out with
the stored values (what the recall and update-rule studies of ``linattn report`` measure).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _validate as V

__all__ = ["Readout", "read_back"]

#: Two distances closer than this (relative to the larger) count as a tie.
TIE_RTOL = 1e-9


def strictly_nearest(own, other) -> np.ndarray:
    """Per row, whether its squared distance to its own value, ``own``, is below that to the nearest other
    candidate, ``other``, by more than a relative ``TIE_RTOL``: a tie is a miss.  With no other candidate
    (``other`` inf) a finite ``own`` is a hit (``inf - TIE_RTOL * inf`` would be NaN, a miss)."""
    own, other = np.asarray(own), np.asarray(other)
    alone = np.isinf(other) & np.isfinite(own)
    with np.errstate(invalid="ignore"):
        return alone | (own < other - TIE_RTOL * np.maximum(np.abs(own), other))


@dataclass(frozen=True)
class Readout:
    """Result of :func:`read_back`.

    Attributes
    ----------
    values : ndarray, shape (n, M)
        The read-out ``V_hat``: row i is what the state returns for key i.
    accuracy : float or None
        Fraction of keys whose read-out is strictly nearest (Euclidean) to their own stored value; a
        tie (up to a relative ``TIE_RTOL``) counts as a miss.  None when no values were given.
    error : float or None
        ``||V_hat - V||_F^2 / ||V||_F^2``; None when no values were given.
    """

    values: np.ndarray
    accuracy: float | None = None
    error: float | None = None


def _features(feature_map, keys):
    from .. import feature_maps as fm

    fmap = fm.resolve(feature_map) if isinstance(feature_map, str) else feature_map  # unknown: ValueError
    if not hasattr(fmap, "apply"):
        raise TypeError(f"feature_map must be a registered name or a FeatureMap, got {type(feature_map).__name__}")
    return np.asarray(fmap.apply(keys[None], role="query", causal=False), dtype=np.float64)[0]


def _real(name: str, x) -> np.ndarray:
    """``x`` as float64 after the package's checks (TypeError naming ``name`` for complex, integer, boolean,
    long-double, masked and object inputs, as :func:`linattn_nb.linear_attention` refuses them)."""
    x = V.as_host_array(name, x)
    V.check_float_dtype(name, x.dtype)
    return x.astype(np.float64, copy=False)


def read_back(state, keys, values=None, *, feature_map=None, normalize=None, eps=1e-8, candidates=None) -> Readout:
    """Query ``state`` with ``keys`` and compare the read-out with ``values``.

    Parameters
    ----------
    state : LinearAttentionState or LinearState
        An unbatched state (``S`` of shape ``(D_phi, M)``): a :class:`linattn_nb.LinearAttentionState`
        is read with its own ``query``; a :class:`linattn_nb.LinearState` needs ``feature_map``.
    keys : array_like, shape (n, d)
        The keys to read (the queries): n >= 1, finite.
    values : array_like, shape (n, M), optional
        The values stored under ``keys``; without them only the read-out is returned.
    feature_map : str or FeatureMap, optional
        Required for a ``LinearState``; not allowed for a ``LinearAttentionState``.
    normalize : bool, optional
        For a ``LinearState``: divide by ``max(phi(k) . z, eps)`` (default: the state's rule's
        convention, as :func:`linattn_nb.linear_attention`).  Not for a ``LinearAttentionState``.
    eps : float or None, default 1e-8
        Floor of the normaliser (``LinearState`` only; checked for either kind of state), a finite
        number >= 0 as in :func:`linattn_nb.linear_attention`; None divides by the raw normaliser.
    candidates : array_like, shape (C, M), optional
        The stored values the accuracy chooses among (default ``values``), e.g. old and new values
        of keys written twice; row i of ``values`` must be one of them.

    Returns
    -------
    Readout

    Raises
    ------
    TypeError
        ``state`` is neither kind of state, or ``feature_map``/``normalize`` given where not allowed;
        ``normalize`` not None, True or False; ``eps`` not a real number or None; ``keys``, ``values``,
        ``candidates`` or the state's ``S``/``z`` not float16/32/64 arrays (complex, integer, boolean,
        long-double, masked), as :func:`linattn_nb.linear_attention` refuses them.
    ValueError
        Shapes that do not match the state (``z`` included), or a batched state; ``keys`` with no row
        (n = 0: no accuracy to report); inf or NaN in ``keys``, ``values``, ``candidates`` or the state;
        ``eps`` negative or not finite; an unknown ``feature_map`` name.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb import LinearAttentionState
    >>> from linattn_nb.analysis import read_back
    >>> keys = np.eye(4)[:3]                     # orthonormal unit keys
    >>> vals = np.eye(3)                         # one-hot values
    >>> st = LinearAttentionState(4, 3, feature_map="l2", rule="delta")
    >>> st.prefill(keys, vals, beta=1.0)
    >>> r = read_back(st, keys, vals)
    >>> r.accuracy, round(r.error, 12)
    (1.0, 0.0)
    """
    from .._frontend import LinearState, read_state
    from ..state.linear import LinearAttentionState

    eps = V.check_eps(eps)
    k = _real("keys", keys)
    if k.ndim != 2:
        raise ValueError(f"keys must have shape (n, d), got shape {k.shape}")
    if k.shape[0] == 0:  # no read-out to score: the accuracy of no keys is not a number
        raise ValueError(f"keys must hold at least one key (shape (n, d) with n >= 1), got shape {k.shape}")
    if not np.isfinite(k).all():
        raise ValueError("read_back: keys contain non-finite values (inf or NaN)")
    if isinstance(state, LinearAttentionState):
        if feature_map is not None or normalize is not None:
            raise TypeError("read_back: feature_map and normalize are for a LinearState; a LinearAttentionState "
                            "reads with its own")
        if state.batch_shape:
            raise ValueError(f"read_back takes an unbatched state, got batch_shape {state.batch_shape}")
        if k.shape[1] != state.key_dim:
            raise ValueError(f"keys have dimension {k.shape[1]}, the state's key_dim is {state.key_dim}")
        out = np.asarray(state.query(k), dtype=np.float64)
    elif isinstance(state, LinearState):
        if feature_map is None:
            raise TypeError("read_back: a LinearState needs feature_map (the map the state was written with)")
        S = _real("state.S", state.S)
        z = _real("state.z", state.z)
        if S.ndim != 2:
            raise ValueError(f"read_back takes an unbatched state, got S of shape {S.shape}")
        if z.shape != S.shape[:1]:
            raise ValueError(f"state.z must have shape ({S.shape[0]},) (D_phi of S, shape {S.shape}), got {z.shape}")
        if not (np.isfinite(S).all() and np.isfinite(z).all()):
            raise ValueError("read_back: the state's S or z holds non-finite values (inf or NaN)")
        phi = _features(feature_map, k)
        if phi.shape[1] != S.shape[0]:
            raise ValueError(f"the feature map gives {phi.shape[1]} features for keys of shape {k.shape}, the "
                             f"state has D_phi = {S.shape[0]}")
        if normalize is None:  # the rule's own convention (the registry's default)
            from ..rules import get_rule

            normalize = get_rule(state.rule).normalize
        else:  # True or False, checked as linear_attention checks it (a truthy "no" is a TypeError)
            normalize = V.check_normalize(normalize, False)
        out = read_state(phi, S, z, normalize, eps)
    else:
        raise TypeError(f"state must be a LinearAttentionState or a LinearState, got {type(state).__name__}")
    if values is None:
        return Readout(out)
    v = _real("values", values)
    if v.shape != out.shape:
        raise ValueError(f"values must have shape {out.shape} (keys x value_dim), got {v.shape}")
    cand = v if candidates is None else _real("candidates", candidates)
    if cand.ndim != 2 or cand.shape[1] != v.shape[1]:
        raise ValueError(f"candidates must have shape (C, {v.shape[1]}), got {cand.shape}")
    for name, x in (("values", v), ("candidates", cand)):
        if not np.isfinite(x).all():
            raise ValueError(f"read_back: {name} contain non-finite values (inf or NaN)")
    own = ((out - v) ** 2).sum(-1)
    others = ((out[:, None, :] - cand[None, :, :]) ** 2).sum(-1)  # (n, C) distances, own value masked below
    same = np.all(cand[None, :, :] == v[:, None, :], axis=-1)  # the candidate that is row i's own value
    if not np.all(same.any(axis=1)):
        raise ValueError("read_back: every row of values must be one of the candidates")
    others[same] = np.inf
    nearest_other = others.min(axis=1) if cand.shape[0] > 1 else np.full(len(v), np.inf)
    hit = strictly_nearest(own, nearest_other)
    denom = float((v ** 2).sum())
    err = float(((out - v) ** 2).sum() / denom) if denom > 0 else float("nan")
    return Readout(out, float(hit.mean()), err)
