"""How far linear attention is from softmax attention, at the attention level.

:func:`approximation_error` (Numba kernels over row blocks), :func:`attention_weights` (explicit, small
N) and :func:`approximation_error_naive` (the tests' reference), in float64: docs/guide/analysis.md.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields

import numpy as np

from .. import _validate as V
from .. import config
from ..attention import linear_attention, softmax_attention
from .._blas import single_threaded_blas
from ..rules import get_rule
from . import _common as C
from ._kernels import error_rows

__all__ = [
    "ApproximationError",
    "approximation_error",
    "approximation_error_naive",
    "attention_weights",
]

_DEFAULT = C.DEFAULT


@dataclass(frozen=True)
class ApproximationError:
    """Statistics of linear against softmax attention (see :func:`approximation_error`).

    Attributes
    ----------
    output_rel_error : float
        ``||O_lin - O_sm||_F / ||O_sm||_F`` over all batch entries.
    kl_mean, kl_max : float
        Over rows, ``KL(softmax || linear)``; ``inf`` where a row's linear weights put zero or
        negative mass where softmax has mass, or have a normaliser <= 0.
    tv_mean, tv_max : float
        Row total variation ``1/2 sum_j |p_ij - w_ij|``; ``inf`` for a row whose normaliser is exactly 0
        with ``eps=None`` (its linear weights are undefined), which then makes both infinite.
    entropy_softmax : float
        Mean row entropy of the softmax weights (nats).
    entropy_linear : float
        The same for the linear weights, over the rows where they form a distribution (else NaN): no
        negative weight and a normaliser ``>= eps`` (a row floored at ``eps`` sums to ``d_i / eps < 1``).
    monotonicity : float
        Mean row Spearman correlation between ``q_i . k_j`` (unscaled: whatever the sign of ``scale``)
        and ``w_ij`` (rows with fewer than two keys or constant values left out; NaN if none is left).
        Softmax weights score 1 for ``scale > 0`` and -1 for ``scale < 0``: their ranks are taken as
        those of the scores, which exp keeps, also where the float64 weights underflow to 0.
    nonpositive_normalizer_rate : float
        Fraction of rows with ``sum_j phi(q_i) . phi(k_j) <= 0`` (before the ``eps`` floor).
    kl_infinite_rate : float
        Fraction of rows whose KL is infinite.
    js_mean : float
        Mean row Jensen-Shannon divergence (nats, at most ``ln 2``), over the rows where the linear
        weights form a distribution (as for ``entropy_linear``); NaN if none does (a signed map).
    n_rows : int
        Number of rows (query positions times batch entries).
    """

    output_rel_error: float
    kl_mean: float
    kl_max: float
    tv_mean: float
    tv_max: float
    entropy_softmax: float
    entropy_linear: float
    monotonicity: float
    nonpositive_normalizer_rate: float
    kl_infinite_rate: float
    n_rows: int
    js_mean: float = float("nan")

    def to_dict(self) -> dict:
        """The fields as a dict of plain Python values (for tables and JSON).

        Examples
        --------
        >>> import numpy as np
        >>> from linattn_nb.analysis import approximation_error
        >>> x = np.random.default_rng(0).standard_normal((1, 8, 4))
        >>> d = approximation_error(x, x, x, "elu").to_dict()
        >>> d["n_rows"], sorted(d)[:3]
        (8, ['entropy_linear', 'entropy_softmax', 'js_mean'])
        """
        return C.plain_dict((f.name, getattr(self, f.name)) for f in fields(self))

    def as_dict(self) -> dict:
        """Deprecated alias of :meth:`to_dict` (every result class names it ``to_dict``)."""
        warnings.warn("ApproximationError.as_dict() is deprecated; use to_dict()", DeprecationWarning, stacklevel=2)
        return self.to_dict()


# ---------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------
def attention_weights(q, k, feature_map, *, causal=False, scale=None, eps=_DEFAULT, check_finite=True,
                      decay=None, log_decay=None, normalize=None, beta=None):
    r"""The explicit attention weight matrix (small N).

    Parameters
    ----------
    q, k : array_like, shape (..., N, D)
    feature_map : "softmax", str, FeatureMap or None
        ``"softmax"``, or a feature map as for :func:`linattn_nb.linear_attention` (docs/guide/analysis.md).
    causal : bool, default False
    scale : float, optional
        Softmax temperature, default ``1/sqrt(D)``.
    eps : float or None, default ``config.DEFAULT_EPS``
        Floor of the linear normaliser, as in ``linear_attention``; None divides by the raw normaliser.
    check_finite : bool, default True
        Refuse inf and NaN in the inputs, in the features and in the linear weights (a product
        ``phi(q) . phi(k)`` that overflows float64).  False checks none of them: such weights come back
        NaN or inf (softmax scores that are not finite are refused whatever its value).
    decay, log_decay : float or array_like, optional
        A decay or gate, as in ``linear_attention`` (causal only): the weight of token ``s`` in
        output ``t`` is multiplied by the factors of tokens ``s+1..t``.
    normalize : bool, optional
        As in ``linear_attention`` (default True, False for the delta rules).  Softmax weights are
        normalised by definition: ``"softmax"`` takes None or True and refuses False.
    beta : float or array_like, optional
        The delta rule's write strength (causal only): its equivalent causal weight matrix
        (docs/theory.md), whose entries and row sums can be negative.

    Returns
    -------
    ndarray, shape (..., N, N), float64

    Raises
    ------
    ValueError
        Bad shapes, non-finite inputs, ``N * N`` above ``config.QUADRATIC_MAX_ELEMENTS``; rule
        arguments as ``linear_attention`` refuses them, or given with ``"softmax"``; a softmax score
        ``(scale q) . k`` that is not finite; with ``check_finite``, features or linear weights that
        overflow float64.
    TypeError
        Non-floating inputs, ``causal`` not a bool.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb.analysis import attention_weights
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.normal(size=(2, 6, 4))
    >>> w = attention_weights(q, k, "softmax", causal=True)
    >>> w.shape, bool(np.allclose(w.sum(-1), 1)), float(w[0, 1])
    ((6, 6), True, 0.0)
    >>> bool(np.allclose(attention_weights(q, k, "elu").sum(-1), 1))
    True

    A constant decay ``gamma`` multiplies the unnormalised causal weights by ``gamma^(t - s)``:

    >>> raw = attention_weights(q, k, "elu", causal=True, normalize=False)
    >>> ret = attention_weights(q, k, "elu", causal=True, decay=0.9, normalize=False)
    >>> t, s = np.indices((6, 6))
    >>> bool(np.allclose(ret, 0.9 ** np.maximum(t - s, 0) * raw))
    True

    With one key written twice (unit keys, ``beta = 1``) the delta rule's second write replaces the
    first, so the last query reads only the last value:

    >>> kk = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    >>> attention_weights(kk, kk, "l2", causal=True, beta=1.0)[2].round(12).tolist()
    [0.0, 0.0, 1.0]
    """
    check_finite = C.check_bool("check_finite", check_finite)
    c, fmap, scale, fq, fk = _setup(q, k, None, feature_map, causal, scale, eps, decay, log_decay, beta,
                                    check_finite, normalize, required=("q", "k"))
    n, batch_shape = c.n, c.batch_shape
    if n * n > config.QUADRATIC_MAX_ELEMENTS:
        raise ValueError(
            f"attention_weights builds an N x N matrix per batch entry; N={n} exceeds "
            f"config.QUADRATIC_MAX_ELEMENTS={config.QUADRATIC_MAX_ELEMENTS} elements. "
            "Use approximation_error for statistics at long N."
        )
    if fq is None:
        w = np.zeros((c.b, n, n))
    elif fmap is None:
        w = C.softmax_weights(c.q, c.k, causal=c.causal, scale=scale, batch_shape=batch_shape)
    else:
        w = C.explicit_rule_weights(c.rule, fq, fk, c.inputs, normalize=False, eps=None, causal=c.causal)
        if check_finite:
            C.check_linear_weights(fmap, w.sum(axis=-1), batch_shape)
        if c.normalize:
            w = C.normalise_rows(w, c.eps)
    return w.reshape(batch_shape + (n, n))


def approximation_error(q, k, v, feature_map, *, causal=False, scale=None, eps=_DEFAULT,
                        check_finite=True, block=None, decay=None, log_decay=None, beta=None):
    r"""How far linear attention with ``feature_map`` is from softmax attention.

    Row by row, softmax's weights against linear attention's (docs/guide/analysis.md), and the
    outputs; memory O(block * N) per thread, never the whole ``N x N``.

    Parameters
    ----------
    q, k : array_like, shape (..., N, D)
    v : array_like, shape (..., N, M)
        Any leading batch dimensions; float16/32/64.
    feature_map : str, FeatureMap or None
        The linear map, or ``"softmax"`` (softmax against itself: every difference is 0).
    causal : bool, default False
    scale : float, optional
        Softmax temperature, default ``1/sqrt(D)``; a map's own ``scale`` that differs warns.
    eps : float or None, default ``config.DEFAULT_EPS``
        Floor of the linear normaliser, as in ``linear_attention``.
    check_finite : bool, default True
        Refuse inf and NaN in the inputs, in the features and in the linear weights (a product
        ``phi(q) . phi(k)`` that overflows float64), as ValueError naming the map.  False checks none of
        them: a row whose normaliser is not finite has NaN statistics (softmax scores that are not finite
        are refused whatever its value).
    block : int, optional
        Query rows per task (default ``config.ANALYSIS_BLOCK_Q``).
    decay, log_decay : float or array_like, optional
        A decay or gate of linear attention's state, as in :func:`attention_weights`, against plain softmax.
    beta : float or array_like, optional
        The delta rule's write strength: its weights are formed explicitly
        (``N * N <= config.QUADRATIC_MAX_ELEMENTS``); rows whose sum is <= 0 have ``kl = inf``.

    Returns
    -------
    ApproximationError
        Every statistic NaN when there are no rows (N = 0 or an empty batch).

    Raises
    ------
    ValueError, TypeError
        As :func:`linattn_nb.linear_attention` for bad inputs and rule arguments; rule arguments with
        ``"softmax"``; ``beta`` with ``N * N`` above ``config.QUADRATIC_MAX_ELEMENTS``; ValueError for a
        softmax score ``(scale q) . k`` that a row reads and that is not finite, and with ``check_finite``
        for features or linear weights that overflow float64.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb import feature_maps
    >>> from linattn_nb.analysis import approximation_error
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(3, 2, 128, 16)) * 0.5
    >>> approximation_error(q, k, v, "softmax").kl_max
    0.0
    >>> err = approximation_error(q, k, v, feature_maps.get("favor+", num_features=256, seed=0))
    >>> err.nonpositive_normalizer_rate, bool(0 < err.tv_mean < 0.5), bool(err.monotonicity > 0.5)
    (0.0, True, True)

    A decay moves the linear weights towards recent tokens; softmax keeps its own:

    >>> e1 = approximation_error(q, k, v, "elu", causal=True)
    >>> e9 = approximation_error(q, k, v, "elu", causal=True, decay=0.9)
    >>> bool(e9.entropy_linear < e1.entropy_linear), e9.entropy_softmax == e1.entropy_softmax
    (True, True)
    """
    check_finite = C.check_bool("check_finite", check_finite)
    c, fmap, scale, fq, fk = _setup(q, k, v, feature_map, causal, scale, eps, decay, log_decay, beta,
                                    check_finite)
    q64, k64, v64, n, causal, eps, rule, inputs = c.q, c.k, c.v, c.n, c.causal, c.eps, c.rule, c.inputs
    if get_rule(rule).reads_state and n * n > config.QUADRATIC_MAX_ELEMENTS:
        raise ValueError(
            f"approximation_error forms the delta rule's N x N weights (no running-product form; beta given); "
            f"N={n} exceeds config.QUADRATIC_MAX_ELEMENTS={config.QUADRATIC_MAX_ELEMENTS} elements"
        )
    if block is not None and (isinstance(block, (bool, np.bool_)) or not isinstance(block, (int, np.integer))
                              or block < 1):
        raise ValueError(f"block must be an integer >= 1 or None, got {block!r}")
    if fq is None:
        return _no_rows()
    C.check_scores(q64, k64, causal=causal, scale=scale, batch_shape=c.batch_shape)
    # the kernels call np.dot inside prange: one BLAS thread per call, or its threads compete with Numba's
    with single_threaded_blas():
        st = error_rows(q64, k64, fq, fk, scale=scale, causal=causal, softmax_mode=fmap is None, eps=eps,
                        block=block, rule=rule, inputs=inputs)
        if check_finite and fmap is not None:
            C.check_linear_weights(fmap, st["den"], c.batch_shape)
        o_sm = softmax_attention(q64, k64, v64, causal=causal, scale=scale, check_finite=False)
        if fmap is None:
            o_lin = o_sm
        else:
            o_lin = linear_attention(q64, k64, v64, feature_map=fmap, causal=causal, eps=eps,
                                     check_finite=False, **_rule_call(rule, inputs, n))
    return _summarise(st, o_lin, o_sm, c.b * n)


def _setup(q, k, v, feature_map, causal, scale, eps, decay, log_decay, beta, check_finite, normalize=None,
           required=("q", "k", "v")):
    """``(call, fmap, scale, fq, fk)`` of the three public functions: the request (inputs flattened to
    float64), the map (None: softmax), the softmax scale and the features (B, N, F) (no columns for
    softmax; None when there are no rows)."""
    fmap = C.resolve_map(feature_map)
    c = C.prepare(q, k, v, fmap, causal=causal, eps=eps, check_finite=check_finite, decay=decay,
                  log_decay=log_decay, beta=beta, normalize=normalize, required=required)
    scale = V.check_scale(scale, c.d)
    C.warn_scale(fmap, c.d, scale)
    if c.b * c.n == 0:
        return c, fmap, scale, None, None
    if fmap is None:
        return c, fmap, scale, np.zeros((c.b, c.n, 0)), np.zeros((c.b, c.n, 0))
    fq = C.features(fmap, c.q, role="query", causal=c.causal, name="q", check_finite=check_finite)
    fk = C.features(fmap, c.k, role="key", causal=c.causal, name="k", check_finite=check_finite)
    return c, fmap, scale, fq, fk


def _no_rows() -> ApproximationError:
    nan = float("nan")
    return ApproximationError(nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, 0)


def _rule_call(rule, inputs, n) -> dict:
    """``linear_attention`` keywords that replay the parsed rule on the flattened (B, N, .) batch (normalised)."""
    r = get_rule(rule)
    if not r.has_inputs:
        return {}
    if r.reads_state:  # only the explicit method runs them at every size the weights allow
        return dict(inputs, normalize=True, method="quadratic")
    method = "quadratic" if n * n <= config.QUADRATIC_MAX_ELEMENTS else "auto"
    return {"log_decay": r.log_factor_of(inputs), "method": method}  # (B, N) per token, (B, N, F) per feature


def _summarise(st, o_lin, o_sm, rows) -> ApproximationError:
    """Reduce per-row statistics (dict of (B, N) arrays) to an ApproximationError."""
    def mean_defined(x):
        x = x[~np.isnan(x)]
        return float(x.mean()) if x.size else float("nan")

    ref = float(np.linalg.norm(o_sm))
    diff = float(np.linalg.norm(np.asarray(o_lin, dtype=np.float64) - o_sm))
    if ref > 0:
        rel = diff / ref
    else:
        rel = 0.0 if diff == 0 else float("inf")
    kl = st["kl"]
    tv = st["tv"]
    return ApproximationError(
        output_rel_error=rel,
        kl_mean=float(kl.mean()),
        kl_max=float(kl.max()),
        tv_mean=float(tv.mean()),
        tv_max=float(tv.max()),
        entropy_softmax=float(st["hp"].mean()),
        entropy_linear=mean_defined(st["hw"]),
        monotonicity=mean_defined(st["rho"]),
        nonpositive_normalizer_rate=float(np.count_nonzero(st["den"] <= 0.0)) / rows,
        kl_infinite_rate=float(np.count_nonzero(np.isinf(kl))) / rows,
        n_rows=int(rows),
        js_mean=mean_defined(st["js"]),
    )


def approximation_error_naive(q, k, v, feature_map, *, causal=False, scale=None, eps=_DEFAULT, decay=None,
                              log_decay=None, beta=None):
    """Reference of :func:`approximation_error` from explicit ``N x N`` matrices (NumPy, SciPy).

    Same parameters and result; for tests and small N only.  Decayed weights
    come from :func:`linattn_nb.ops.causal.naive.explicit_weights`.
    """
    from scipy.stats import rankdata

    c, fmap, scale, fq, fk = _setup(q, k, v, feature_map, causal, scale, eps, decay, log_decay, beta, True)
    q64, k64, v64, n, b, causal, eps = c.q, c.k, c.v, c.n, c.b, c.causal, c.eps
    rule, inputs = c.rule, c.inputs
    if fq is None:
        return _no_rows()
    p_all = C.softmax_weights(q64, k64, causal=causal, scale=scale, batch_shape=c.batch_shape)
    s_all = C.scores(q64, k64, scale)  # a read score that overflows was refused above; the masked ones are unread
    with np.errstate(over="ignore", invalid="ignore"):
        qk_all = np.einsum("bid,bjd->bij", q64, k64)  # monotonicity ranks q . k itself, whatever the sign of scale
    if fmap is None:
        w_all = p_all
        den_all = np.ones((b, n))
        a_all = p_all
    else:
        a_all = C.explicit_rule_weights(rule, fq, fk, inputs, normalize=False, eps=None, causal=causal)
        den_all = a_all.sum(axis=-1)
        C.check_linear_weights(fmap, den_all, c.batch_shape)
        w_all = C.normalise_rows(a_all, eps)
    st = {key: np.full((b, n), np.nan) for key in ("kl", "tv", "hp", "hw", "rho", "den", "js")}
    for bb in range(b):
        for i in range(n):
            L = i + 1 if causal else n
            p = p_all[bb, i, :L]
            s = s_all[bb, i, :L]
            qk = qk_all[bb, i, :L]
            w = w_all[bb, i, :L]
            a = a_all[bb, i, :L]
            den = den_all[bb, i]
            st["den"][bb, i] = den
            with np.errstate(divide="ignore"):
                st["hp"][bb, i] = -np.sum(p[p > 0] * np.log(p[p > 0]))
            if fmap is not None and eps is None and den == 0:
                st["kl"][bb, i] = np.inf
                st["tv"][bb, i] = np.inf
                continue
            st["tv"][bb, i] = 0.5 * np.abs(p - w).sum()
            is_dist = den > 0 and (a >= 0).all() and (eps is None or den >= eps)  # floored: sums to den / eps < 1
            if is_dist:
                pos = p > 0
                if np.any(w[pos] <= 0):
                    st["kl"][bb, i] = np.inf
                else:  # >= 0 in exact arithmetic: clip the round-off
                    st["kl"][bb, i] = max(0.0, float(np.sum(p[pos] * (np.log(p[pos]) - np.log(w[pos])))))
                st["hw"][bb, i] = -np.sum(w[w > 0] * np.log(w[w > 0]))
                mix = 0.5 * (p + w)
                st["js"][bb, i] = 0.5 * sum(float(np.sum(x[x > 0] * (np.log(x[x > 0]) - np.log(mix[x > 0]))))
                                            for x in (p, w))
            elif den > 0 and (a >= 0).all():  # floored: the KL of the weights applied, no entropy or JS
                pos = p > 0
                st["kl"][bb, i] = (np.inf if np.any(w[pos] <= 0) else
                                   max(0.0, float(np.sum(p[pos] * (np.log(p[pos]) - np.log(w[pos]))))))
            else:
                st["kl"][bb, i] = np.inf
            if L >= 2:
                rs = rankdata(qk)
                rw = rankdata(s) if fmap is None else rankdata(w)  # softmax: exp keeps the scores' order (kernel)
                if np.ptp(rs) > 0 and np.ptp(rw) > 0:
                    st["rho"][bb, i] = np.corrcoef(rs, rw)[0, 1]
    o_sm = p_all @ v64
    o_lin = w_all @ v64
    return _summarise(st, o_lin, o_sm, b * n)
