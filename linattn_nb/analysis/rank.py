"""Rank of attention weights and of the recurrent state, without forming N x N.

:func:`attention_rank`, :func:`semiseparable_rank` and :func:`state_rank_profile`, in float64, from the
``N x D_phi`` factors where the weights are low rank, with :func:`numpy.linalg.matrix_rank`'s tolerances.
Bounds: docs/theory.md; algorithms: docs/design-cpu.md.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit, prange
from scipy.linalg import lapack as _lapack

from .. import _frontend as FE
from .. import _validate as V
from .._blas import single_threaded_blas
from .. import config
from ..ops._codes import KERNEL_CODE_ELU, KERNEL_CODE_RELU, KERNEL_CODE_SQUARED_RELU
from ..ops._common import phi
from ..rules import get_rule
from . import _common as C
from .spectral import rank_from_singular_values, singular_values
from .._defaults import DEFAULT_EPS

__all__ = ["attention_rank", "semiseparable_rank", "state_rank_profile", "StateRankProfile"]

_EPS64 = float(np.finfo(np.float64).eps)


# ---------------------------------------------------------------------------
# Argument handling
# ---------------------------------------------------------------------------
def _check_method(method, allowed):
    if not isinstance(method, str) or method not in allowed:
        raise ValueError(f"method must be one of {', '.join(map(repr, allowed))}, got {method!r}")
    return method


#: Kernel codes of the maps that act element by element (``phi(x, code)``); the row-normalising codes
#: (``"l2"``, ``"silu_l2"``) need each row's norm and take the ``FeatureMap.apply`` path.
_ELEMENTWISE_CODES = (KERNEL_CODE_ELU, KERNEL_CODE_RELU, KERNEL_CODE_SQUARED_RELU)


def _inline_code(fmap, d):
    """The Numba kernel code of an elementwise map (as linear_attention's kernels use it), else None."""
    code = fmap.kernel_code
    if code is None or int(code) not in _ELEMENTWISE_CODES or C.feature_dim(fmap, d) != d:
        return None
    return int(code)


def _features(fmap, x, *, role, causal, name, offset=0):
    """Features (B, N, F) float64 of x (..., N, D) as linear_attention computes them, first row at ``offset``.

    Elementwise maps run in a Numba loop (the kernels' ``phi``); non-finite features raise ValueError.
    """
    d = x.shape[-1]
    code = _inline_code(fmap, d)
    if code is None:
        return C.features(fmap, x, role=role, causal=causal, name=name, check_finite=True, offset=offset)
    x3 = V.flatten_batch(x, np.float64)
    out = np.empty_like(x3)
    if x3.size:
        _feature_rows(x3.reshape((-1, d)), 0, code, np.zeros(d), 0.0, False, False, out.reshape((-1, d)))
    C.check_finite_features(fmap, out, name)
    return out


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _causal_normalise_kernel(fq, fk, eps, clip, out):
    """out[i] = fq[i] / max(fq[i] . sum_{j <= i} fk[j], eps); returns the number of bad normalisers."""
    n, f = fq.shape
    z = np.zeros(f)
    bad = 0
    for i in range(n):
        den = 0.0
        for j in range(f):
            z[j] += fk[i, j]
            den += fq[i, j] * z[j]
        if clip and den < eps:
            den = eps
        if den == 0.0 or not math.isfinite(den):
            bad += 1
        for j in range(f):
            out[i, j] = fq[i, j] / den
    return bad


def _causal_normalised_query_features(fq, fk, *, eps):
    """phi(q_i) / den_i with den_i = phi(q_i) . sum_{j <= i} phi(k_j), floored like linear_attention."""
    out = np.empty_like(fq)
    bad = _causal_normalise_kernel(np.ascontiguousarray(fq), np.ascontiguousarray(fk),
                                   0.0 if eps is None else float(eps), eps is not None, out)
    _check_normalisers(bad)
    return out


def _check_normalisers(bad):
    """Raise ValueError when ``bad`` normalisers ``phi(q_i) . z_i`` were zero or not finite."""
    if bad:
        raise ValueError(
            f"{int(bad)} normaliser(s) phi(q_i) . z_i are zero (signed feature map with eps=None?): "
            "the attention weights are undefined; pass eps > 0"
        )


def _check_explicit_n(n, limit_name, limit):
    if n > limit:
        raise ValueError(
            f"N = {n} is above the limit for explicit N x N weights ({limit}, "
            f"linattn_nb.config.{limit_name}); raise it if you have the memory and time"
        )


def _kernel_weights(fq, fk, *, causal, eps, rule, inputs, b, normalize):
    """Explicit weights (N x N) of batch entry ``b``, row-normalised (floored at ``eps``) if ``normalize``."""
    w = C.entry_weights(rule, fq, fk, inputs, b, causal=causal)
    if not normalize:
        return w
    w = C.normalise_rows(w, eps)
    if w.size and not np.isfinite(w).all():
        raise ValueError("a normaliser is zero (signed feature map with eps=None?): pass eps > 0")
    return w


# ---------------------------------------------------------------------------
# Streamed R factors
# ---------------------------------------------------------------------------
#: Fewest rows per LAPACK call of the streamed QR (amortises the call at small D_phi).
_QR_MIN_ROWS = 2048
#: Block size ``nb`` of ``dtpqrt`` (columns per compact-WY block), LAPACK's usual 32 (at most D_phi).
_QR_NB = 32


def _qr_rows():
    """Rows per block of the streamed QR: ``config.ANALYSIS_QR_BLOCK``, at least :data:`_QR_MIN_ROWS`."""
    return max(int(config.ANALYSIS_QR_BLOCK), _QR_MIN_ROWS)


def _qr_update(R, B):
    """R factor of ``[R; B]`` by LAPACK's triangular-pentagonal QR ``dtpqrt`` (docs/measurements-analysis.md).

    ``R`` (F, F) upper triangular and ``B`` (L, F), float64 Fortran order, are overwritten.
    """
    if B.shape[0] == 0:
        return R
    R, _, _, info = _lapack.dtpqrt(0, min(R.shape[0], _QR_NB), R, B, overwrite_a=1, overwrite_b=1)
    if info:  # pragma: no cover - only for an illegal argument
        raise RuntimeError(f"LAPACK dtpqrt failed (info = {info})")
    return R


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def _feature_rows(X, s0, code, z, eps, clip, normalise, out):
    """``out[t] = phi(X[s0 + t], code)``, divided by ``max(out[t] . z, eps)`` (``eps`` when ``clip``) when
    ``normalise``; returns the number of rows whose normaliser is zero or not finite."""
    L, F = out.shape
    bad = 0
    for t in prange(L):
        den = 0.0
        for j in range(F):
            y = phi(X[s0 + t, j], code)
            out[t, j] = y
            den += y * z[j]
        if normalise:
            if clip and den < eps:
                den = eps
            if den == 0.0 or not math.isfinite(den):
                bad += 1
            for j in range(F):
                out[t, j] = out[t, j] / den
    return bad


def _stream_r(X, code=0, z=None, eps=None, R=None):
    """R factor of the rows ``y_t = phi(X[t], code)``, divided by ``max(y_t . z, eps)`` when ``z`` is given.

    ``code`` 0 takes the rows as they are; ``R`` (F, F), not modified, is a factor to extend.  Returns
    upper triangular ``R`` with ``R^T R = Y^T Y (+ R0^T R0)`` and the column sums of ``Y`` (None with
    ``z``); streamed by blocks (docs/design-cpu.md).  A zero or non-finite normaliser raises ValueError.
    """
    n, f = X.shape
    R = np.zeros((f, f), order="F") if R is None else np.array(R, dtype=np.float64, order="F")
    normalise = z is not None
    colsum = None if normalise else np.zeros(f)
    if n == 0:
        return np.triu(R), colsum
    X = np.ascontiguousarray(X, dtype=np.float64)
    zz = np.zeros(f) if z is None else np.ascontiguousarray(z, dtype=np.float64)
    rows = min(n, _qr_rows())
    buf = np.empty((rows, f), order="F")
    bad = 0
    with single_threaded_blas():
        for s0 in range(0, n, rows):
            L = min(rows, n - s0)
            blk = buf if L == rows else np.empty((L, f), order="F")
            if code == 0 and not normalise:
                blk[...] = X[s0:s0 + L]
            else:
                bad += _feature_rows(X, s0, int(code), zz, 0.0 if eps is None else float(eps), eps is not None,
                                     normalise, blk)
            if not normalise:
                colsum += blk.sum(axis=0)
            R = _qr_update(R, blk)
    _check_normalisers(bad)
    return np.triu(R), colsum


def _append_rows(R, X):
    """R (F x F, upper triangular) <- R factor of ``[R; X]``, in place: O(n F^2) (:func:`_stream_r`)."""
    if X.shape[0]:
        R[...] = _stream_r(X, R=R)[0]
    return R


def _r_factor(X):
    """R (F x F) with ``R^T R = X^T X``: streamed LAPACK QR, O(N F^2) flops, scratch O(F^2 + block F)."""
    return _stream_r(X)[0]


def _span_changes(X, tau, block=1024):
    """Prefix lengths at which ``dim span(X[:i])`` grows (sorted int64, at most F entries).

    Blocked Gram-Schmidt (projected twice): a row is new when its residual exceeds ``tau * ||row||``.
    """
    n, f = X.shape
    basis = np.zeros((f, f))
    r = 0
    changes = []
    pos = 0
    while pos < n and r < f:
        blk = X[pos:pos + block]
        nx = np.sqrt(np.einsum("ij,ij->i", blk, blk))
        b = basis[:r]
        y = blk - (blk @ b.T) @ b
        y -= (y @ b.T) @ b
        ny = np.sqrt(np.einsum("ij,ij->i", y, y))
        j = 0
        while r < f:
            hits = np.flatnonzero(ny[j:] > tau * nx[j:])
            if hits.size == 0:
                break
            t = j + int(hits[0])
            row = blk[t].copy()
            for _ in range(2):
                row -= basis[:r].T @ (basis[:r] @ row)
            nr = math.sqrt(float(row @ row))
            if nr > tau * nx[t]:
                e = row / nr
                basis[r] = e
                r += 1
                changes.append(pos + t + 1)
                if t + 1 < len(blk):
                    rest = y[t + 1:]
                    rest -= np.outer(rest @ e, e)
                    ny[t + 1:] = np.sqrt(np.einsum("ij,ij->i", rest, rest))
            j = t + 1
        pos += len(blk)
    return np.asarray(changes, dtype=np.int64)


# ---------------------------------------------------------------------------
# attention_rank
# ---------------------------------------------------------------------------
def attention_rank(q, k, feature_map="elu", *, causal=False, scale=None, eps=DEFAULT_EPS,
                   rtol=None, method="auto", return_spectrum=False, check_finite=True, decay=None,
                   log_decay=None, normalize=None, beta=None):
    r"""Numerical rank of attention weights, from the factors when they are low rank.

    Non-causal kernel weights are ranked from R factors in O(N D_phi^2 + D_phi^3); causal and softmax
    weights are formed explicitly, ``N <= config.ANALYSIS_EXPLICIT_MAX_N`` (docs/design-cpu.md).

    Parameters
    ----------
    q : array_like, shape (..., Nq, D)
    k : array_like, shape (..., Nk, D)
        Equal batch dimensions; ``Nq == Nk`` when ``causal``; computed in float64.
    feature_map : str, FeatureMap or None, default "elu"
        A feature map as in :func:`linattn_nb.linear_attention`, or ``"softmax"``.
    causal : bool, default False
    scale : float, optional
        Softmax temperature, default ``1 / sqrt(D)``; ignored by kernel maps.
    eps : float or None, default 1e-8
        Floor of the normaliser, exactly as in :func:`linattn_nb.linear_attention`.
    rtol : float or array_like, optional
        Relative tolerance: a number, or an array that broadcasts to the batch shape ``(...)`` (one per
        batch entry; one that would grow it, such as ``[1e-12]`` for unbatched q and k, raises ValueError);
        default ``max(Nq, Nk) * eps64`` (as :func:`numpy.linalg.matrix_rank`).
    method : {"auto", "factor", "explicit"}
        ``"factor"``: from the R factors (non-causal kernel weights only); ``"explicit"``: the SVD
        of the formed matrix (the reference); ``"auto"``: ``"factor"`` where it applies.
    return_spectrum : bool, default False
        Also return the singular values, descending (``min(D_phi, Nq, Nk)`` of them for ``"factor"``,
        ``min(Nq, Nk)`` for ``"explicit"``), for ``effective_rank`` etc. with ``spectrum=True``.
    check_finite : bool, default True
    decay, log_decay, beta : float or array_like, optional
        As in :func:`linattn_nb.linear_attention` (causal only): ``attention_weights``' weights, explicitly.
    normalize : bool, optional
        False ranks the unnormalised weights; default the rule's (True; False for the delta rules).

    Returns
    -------
    rank : int or ndarray of int64, shape (...)
    spectrum : ndarray, shape (..., K)
        Only with ``return_spectrum``.

    Raises
    ------
    ValueError
        Shape mismatches, non-finite inputs or features, a zero normaliser with ``eps=None``, N above
        the explicit limit, ``method="factor"`` where there are no low-rank factors, an ``rtol`` that is
        negative or does not broadcast to the batch shape.
    TypeError
        Non-floating inputs, a bad ``feature_map``, ``causal`` not a bool.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb.analysis import attention_rank
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.normal(size=(2, 4096, 16))
    >>> attention_rank(q, k, "elu")                      # 4096 x 4096 weights of rank D_phi
    16
    >>> attention_rank(q[:512], k[:512], "softmax", scale=2.0) > 16
    True
    """
    return_spectrum = C.check_bool("return_spectrum", return_spectrum)
    check_finite = C.check_bool("check_finite", check_finite)
    fmap = C.resolve_map(feature_map)
    method = _check_method(method, ("auto", "factor", "explicit"))
    c = C.prepare(q, k, None, fmap, causal=causal, eps=eps, check_finite=check_finite, decay=decay,
                  log_decay=log_decay, beta=beta, normalize=normalize, same_n=causal)
    q, k, batch_shape, causal, eps = c.q, c.k, c.batch_shape, c.causal, c.eps
    rule, inputs, normalize = c.rule, c.inputs, c.normalize
    nq, nk, d, b = c.n, k.shape[-2], c.d, c.b
    if rtol is not None:
        rtol = np.broadcast_to(C.check_rtol(rtol, batch_shape), batch_shape).reshape(-1)
    factor_ok = fmap is not None and not causal
    if method == "factor" and not factor_ok:
        why = "softmax weights have no low-rank factors" if fmap is None else "causal weights are not low rank"
        raise ValueError(f"method='factor' does not apply here ({why}); use method='explicit'")
    use_factor = factor_ok and method != "explicit"
    if not use_factor:
        _check_explicit_n(max(nq, nk), "ANALYSIS_EXPLICIT_MAX_N", config.ANALYSIS_EXPLICIT_MAX_N)
    code = None if fmap is None else _inline_code(fmap, d)
    if fmap is None:
        scale = V.check_scale(scale, d)
        fq, fk = q, k
        f = None
    elif use_factor and code is not None:
        # elementwise map: the streamed QR applies it on the fly, features never stored
        fq, fk = q, k
        f = d
    else:
        fq = _features(fmap, q, role="query", causal=causal, name="q")
        fk = _features(fmap, k, role="key", causal=causal, name="k")
        f = fq.shape[-1]
        code = 0
    nsv = min(f, nq, nk) if use_factor else min(nq, nk)
    ranks = np.zeros(b, dtype=np.int64)
    spectra = np.zeros((b, nsv))
    for i in range(b):
        if nq == 0 or nk == 0:
            continue
        if use_factor:
            r_k, z = _stream_r(fk[i], code)
            r_q, _ = _stream_r(fq[i], code, z=z if normalize else None, eps=eps)
            s = singular_values(r_q @ r_k.T, check_finite=False)[:nsv]
        else:
            if fmap is None:
                w = C.softmax_weights(fq[i], fk[i], causal=causal, scale=scale)
            else:
                w = _kernel_weights(fq[i], fk[i], causal=causal, eps=eps, rule=rule, inputs=inputs, b=i,
                                    normalize=normalize)
            s = singular_values(w, check_finite=False)
        spectra[i] = s
        ranks[i] = rank_from_singular_values(s, max(nq, nk), None if rtol is None else rtol[i])
    rank = int(ranks[0]) if batch_shape == () else ranks.reshape(batch_shape)
    if return_spectrum:
        return rank, spectra.reshape(batch_shape + (nsv,))
    return rank


# ---------------------------------------------------------------------------
# semiseparable_rank
# ---------------------------------------------------------------------------
def _block_rank(s, rows, cols, rtol):
    return int(rank_from_singular_values(s, max(rows, cols), rtol))


def _semiseparable_explicit(w, rtol):
    """Largest numerical rank of w[i:, :i] over 1 <= i < N; splits by decreasing min(i, N - i)."""
    n = w.shape[0]
    if n < 2:
        return 0, 0
    splits = np.arange(1, n)
    bounds = np.minimum(splits, n - splits)
    order = np.lexsort((splits, -bounds))
    best, best_i = -1, 0
    for i in splits[order]:
        i = int(i)
        if min(i, n - i) < best:
            break
        r = _block_rank(singular_values(w[i:, :i], check_finite=False), n - i, i, rtol)
        if r > best or (r == best and i < best_i):
            best, best_i = r, i
    return best, best_i


def _sweep_r(x, splits, *, suffixes):
    """``{i: R factor of x[:i]}`` (or of ``x[i:]`` with ``suffixes``) for the ascending ``splits``, one pass."""
    r = np.zeros((x.shape[1], x.shape[1]))
    at = x.shape[0] if suffixes else 0
    out = {}
    for i in (splits[::-1] if suffixes else splits):
        i = int(i)
        _append_rows(r, x[i:at] if suffixes else x[at:i])
        at = i
        out[i] = r.copy()
    return out


def _semiseparable_factor(pq, fk, rtol, budget):
    """Largest numerical rank of B_i = pq[i:] fk[:i]^T over the splits (and its smallest split), from factors.

    Only split 1 and the points where a span dimension changes are candidates, visited in decreasing order
    of their bound (docs/design-cpu.md, "Rank of the weights and the state").
    """
    n, f = fk.shape
    if n < 2:
        return 0, 0
    tau = f * _EPS64
    cu = _span_changes(fk, tau)                     # prefix lengths where dim span(fk[:i]) grows
    cw = _span_changes(pq[::-1], tau)               # suffix lengths where dim span(pq[n-l:]) grows
    cand = {1}
    cand.update(int(i) for i in cu if 1 <= i <= n - 1)
    cand.update(int(n - l + 1) for l in cw if 1 <= n - l + 1 <= n - 1)
    cand = np.array(sorted(cand), dtype=np.int64)
    u = np.searchsorted(cu, cand, side="right")     # dim span(fk[:i])
    w = np.searchsorted(cw, n - cand, side="right")  # dim span(pq[i:])
    bound = np.minimum(u, w)
    order = np.lexsort((cand, -bound))
    cand, bound = cand[order], bound[order]
    group_size = max(1, int(budget // (16 * f * f)))
    best, best_i = -1, 0
    pos = 0
    while pos < len(cand) and bound[pos] >= best:
        group = cand[pos:pos + group_size]
        gbound = bound[pos:pos + group_size]
        pos += len(group)
        todo = np.sort(group[gbound >= best])
        r_p = _sweep_r(fk, todo, suffixes=False)  # R factors of the key prefixes at the group's splits
        r_s = _sweep_r(pq, todo, suffixes=True)   # and of the query suffixes
        # core SVDs in decreasing order of the bound, while a bound can still reach the best rank
        for i, bnd in zip(group, gbound):
            if bnd < best:
                break
            i = int(i)
            rk = _block_rank(singular_values(r_s.pop(i) @ r_p.pop(i).T, check_finite=False), n - i, i, rtol)
            if rk > best or (rk == best and i < best_i):
                best, best_i = rk, i
    return best, best_i


def semiseparable_rank(q, k, feature_map="elu", *, scale=None, eps=DEFAULT_EPS, rtol=None,
                       method="auto", return_split=False, check_finite=True, decay=None, log_decay=None,
                       normalize=None, beta=None):
    r"""Largest rank of the strictly-lower blocks ``A[i:, :i]`` of causal attention weights.

    At most ``D_phi`` for causal linear attention (docs/theory.md), unbounded for softmax.  Kernel
    maps are ranked from the factors, typically in O(N D_phi^2 + D_phi^3) (docs/design-cpu.md).

    Parameters
    ----------
    q, k : array_like, shape (..., N, D)
        Computed in float64.
    feature_map : str, FeatureMap or None, default "elu"
        A registered map, or ``"softmax"`` (always explicit).
    scale : float, optional
        Softmax temperature, default ``1 / sqrt(D)``.
    eps : float or None, default 1e-8
        Normaliser floor, as in :func:`linattn_nb.linear_attention`.
    rtol : float, optional
        Relative tolerance; default ``max(N - i, i) * eps64`` for block ``i``.
    method : {"auto", "factor", "explicit"}
        ``"explicit"``: an SVD per split of the N x N weights (worst case O(N^4),
        ``N <= config.ANALYSIS_SEMISEPARABLE_EXPLICIT_MAX_N``).  ``"auto"``: ``"factor"`` for kernel
        maps without a decay or ``beta``, else ``"explicit"``.
    return_split : bool, default False
        Also return the smallest split ``i`` reaching the largest rank (0 when N < 2).
    check_finite : bool, default True
    decay, log_decay, beta : float or array_like, optional
        As in :func:`linattn_nb.linear_attention`: ranked explicitly (``"factor"`` raises).
    normalize : bool, optional
        As for :func:`attention_rank`.

    Returns
    -------
    rank : int or ndarray of int64, shape (...)
        0 when N < 2 (no strictly-lower block).
    split : int or ndarray of int64, shape (...)
        Only with ``return_split``.

    Raises
    ------
    ValueError
        Shape mismatches, non-finite inputs, a zero normaliser with ``eps=None``, N above the explicit
        limit, ``method="factor"`` with softmax or a decay.
    TypeError
        Non-floating inputs, a bad ``feature_map``.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb.analysis import semiseparable_rank
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.normal(size=(2, 2000, 8))
    >>> semiseparable_rank(q, k, "elu")                  # <= D_phi = 8 at any N
    8
    >>> semiseparable_rank(q[:64], k[:64], "softmax", scale=4.0) > 8
    True
    >>> semiseparable_rank(q[:200], k[:200], "elu", decay=0.95, normalize=False) <= 8
    True
    >>> semiseparable_rank(q[:200], k[:200], "l2", beta=0.5) <= 8    # the delta rule: D_phi = 8
    True
    """
    return_split = C.check_bool("return_split", return_split)
    check_finite = C.check_bool("check_finite", check_finite)
    fmap = C.resolve_map(feature_map)
    method = _check_method(method, ("auto", "factor", "explicit"))
    c = C.prepare(q, k, None, fmap, causal=True, eps=eps, check_finite=check_finite, decay=decay,
                  log_decay=log_decay, beta=beta, normalize=normalize)
    q, k, batch_shape, n, d, eps = c.q, c.k, c.batch_shape, c.n, c.d, c.eps
    rule, inputs, normalize = c.rule, c.inputs, c.normalize
    if get_rule(rule).has_inputs and method == "factor":
        raise ValueError(f"method='factor' ranks the additive rule's weights; the {rule!r} rule's weights "
                         "(decay/log_decay/beta given) are ranked with method='explicit'")
    rtol = C.check_scalar_rtol(rtol, "semiseparable_rank")
    if fmap is None and method == "factor":
        raise ValueError("method='factor' does not apply to softmax weights (no low-rank factors); use 'explicit'")
    explicit = fmap is None or method == "explicit" or get_rule(rule).has_inputs
    if explicit:
        _check_explicit_n(n, "ANALYSIS_SEMISEPARABLE_EXPLICIT_MAX_N", config.ANALYSIS_SEMISEPARABLE_EXPLICIT_MAX_N)
    if fmap is None:
        scale = V.check_scale(scale, d)
        fq, fk = q, k
    else:
        fq = _features(fmap, q, role="query", causal=True, name="q")
        fk = _features(fmap, k, role="key", causal=True, name="k")
    b = fq.shape[0]
    ranks = np.zeros(b, dtype=np.int64)
    splits = np.zeros(b, dtype=np.int64)
    for i in range(b):
        if n < 2:
            continue
        if fmap is None:
            w = C.softmax_weights(fq[i], fk[i], causal=True, scale=scale)
            ranks[i], splits[i] = _semiseparable_explicit(w, rtol)
        elif explicit:
            w = _kernel_weights(fq[i], fk[i], causal=True, eps=eps, rule=rule, inputs=inputs, b=i,
                                normalize=normalize)
            ranks[i], splits[i] = _semiseparable_explicit(w, rtol)
        else:
            pq = _causal_normalised_query_features(fq[i], fk[i], eps=eps) if normalize else fq[i]
            ranks[i], splits[i] = _semiseparable_factor(pq, fk[i], rtol, config.ANALYSIS_MEMORY_BUDGET)
    if batch_shape == ():
        rank, split = int(ranks[0]), int(splits[0])
    else:
        rank, split = ranks.reshape(batch_shape), splits.reshape(batch_shape)
    return (rank, split) if return_split else rank


# ---------------------------------------------------------------------------
# state_rank_profile
# ---------------------------------------------------------------------------
class StateRankProfile(NamedTuple):
    """Numerical rank of the state ``S_t`` after ``t`` tokens (:func:`state_rank_profile`).

    Attributes
    ----------
    positions : ndarray of int64, shape (P,)
        Token counts ``t`` (ascending).
    rank : ndarray of int64, shape (..., P)
        ``rank(S_t)`` per batch entry.
    max_rank : int
        ``min(D_phi, M)``, the size bound the rank saturates at.
    """

    positions: np.ndarray
    rank: np.ndarray
    max_rank: int

    def to_dict(self) -> dict:
        """Plain-Python dict (lists instead of arrays), for JSON."""
        return C.plain_dict(zip(self._fields, self))


def _absorb(state, fk, v, lg):
    """``state`` after the rows ``fk`` (L, F), ``v`` (L, M) with log-factors ``lg`` (L, 1 or F) or None.

    The closed form of ``S <- a_j (.) S + phi(k_j) v_j^T`` from suffix sums of the log-factors (never
    differences: a reset's ``-inf`` gives exact zeros, no NaN).
    """
    if lg is None:
        return state + fk.T @ v
    with np.errstate(under="ignore"):
        rc = np.cumsum(lg[::-1], axis=0)[::-1]            # sum_{u >= j} lg_u
        keep = np.exp(rc[0])                              # (1,) or (F,)
        tail = np.exp(np.vstack([rc[1:], np.zeros((1, lg.shape[1]))]))  # sum_{u > j} lg_u
    return state * keep[:, None] + (fk * tail).T @ v


def state_rank_profile(k, v, feature_map="elu", *, positions=None, rtol=None, check_finite=True, decay=None,
                       log_decay=None, initial_state=None, beta=None, rule=None, rule_arguments=None):
    r"""Numerical rank of the linear-attention state ``S_t`` as the sequence grows.

    ``S_t`` is the ``D_phi x M`` state after ``t`` tokens; its rank saturates at ``min(D_phi, M)``
    (docs/theory.md).

    Parameters
    ----------
    k : array_like, shape (..., N, D)
    v : array_like, shape (..., N, M)
        Equal batch dimensions and N; computed in float64.
    feature_map : str, FeatureMap or None, default "elu"
        Applied to the keys as causal linear attention does; ``"softmax"`` is refused (no fixed state).
    positions : array_like of int, optional
        Token counts ``t`` in ``[0, N]`` to report (sorted, duplicates dropped); default ``1..N``.
        Each is ranked by an SVD, O(D_phi M min(D_phi, M)).
    rtol : float, optional
        Default ``max(D_phi, M) * eps64``.
    check_finite : bool, default True
    decay, log_decay, beta : float or array_like, optional
        As in :func:`linattn_nb.linear_attention`.
    rule : str, optional
        A named DPLR rule, not with ``decay``/``log_decay``/``beta``.
    rule_arguments : dict, optional
        Its arguments, full arrays as :func:`linattn_nb.dplr_attention` takes them.
    initial_state : LinearState or tuple (S, z[, position]), optional
        The state before token 0, as in ``linear_attention`` (``t = 0`` ranks it); with ``rule`` a
        ``LinearState`` of that rule or a tuple, handed to :func:`linattn_nb.dplr_attention` as a state of it.

    Returns
    -------
    StateRankProfile
        ``positions``, ``rank`` (batch shape + (P,)) and ``max_rank``.

    Raises
    ------
    ValueError
        Shape mismatches, non-finite inputs (``k``, ``v`` checked and named before any token is written,
        with ``rule`` too), positions outside ``[0, N]``, ``feature_map="softmax"``; rule arguments as
        ``linear_attention`` refuses them; an ``initial_state`` of the wrong shape or rule.
    TypeError
        Non-floating inputs, non-integer positions.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb.analysis import state_rank_profile
    >>> rng = np.random.default_rng(0)
    >>> k, v = rng.normal(size=(2, 40, 8))
    >>> prof = state_rank_profile(k, v, "elu", positions=[1, 4, 8, 20, 40])
    >>> prof.rank.tolist(), prof.max_rank
    ([1, 4, 8, 8, 8], 8)

    A reset (factor 0) at token 20 wipes the state; it refills from there:

    >>> gamma = np.where(np.arange(40) == 20, 0.0, 0.9)
    >>> state_rank_profile(k, v, "elu", decay=gamma, positions=[8, 20, 21, 24, 40]).rank.tolist()
    [8, 8, 1, 4, 8]
    """
    check_finite = C.check_bool("check_finite", check_finite)
    if C.is_softmax(feature_map):
        raise ValueError("feature_map='softmax' has no fixed-size state (its KV cache grows with N)")
    fmap = C.resolve_map(feature_map)
    rtol = C.check_scalar_rtol(rtol, "state_rank_profile")
    if rule is not None:
        if decay is not None or log_decay is not None or beta is not None:
            raise TypeError("state_rank_profile: pass a named rule's arguments in rule_arguments, not decay, "
                            "log_decay or beta")
        return _dplr_rank_profile(k, v, fmap, positions, rtol, rule, rule_arguments or {}, initial_state,
                                  check_finite)
    if rule_arguments is not None:
        raise TypeError("state_rank_profile: rule_arguments needs rule= (a named DPLR rule)")
    c = C.prepare(None, k, v, fmap, causal=True, eps=None, check_finite=check_finite, decay=decay,
                  log_decay=log_decay, beta=beta, initial_state=initial_state, required=("k", "v"))
    k, vf, batch_shape, n, m, f, b = c.k, c.v, c.batch_shape, c.n, c.m, c.f, c.b
    rule, inputs = c.rule, c.inputs
    pos = _positions(positions, n)
    H, position = FE.host_state(initial_state, batch_shape, f, m, check_finite=check_finite)
    S0 = H[:, :, :m]
    r = get_rule(rule)
    bt = inputs["beta"] if r.beta else None
    lg = r.log_factor_of(inputs)
    if lg is not None and lg.ndim == 2 and not r.reads_state:
        lg = lg[:, :, None]  # per token: one factor for every row of the state
    fk = _features(fmap, k, role="key", causal=True, name="k", offset=position)
    ranks = np.zeros((b, pos.size), dtype=np.int64)
    for i in range(b):
        state = S0[i].copy()
        at = 0
        for j, t in enumerate(pos):
            t = int(t)
            if t > at and r.reads_state:  # the recurrence itself, token by token: O(L F M)
                for u in range(at, t):
                    state = r.reference_step(state, fk[i, u], vf[i, u], None if lg is None else lg[i, u],
                                             None if bt is None else bt[i, u])
                at = t
            elif t > at:
                state = _absorb(state, fk[i, at:t], vf[i, at:t], None if lg is None else lg[i, at:t])
                at = t
            ranks[i, j] = _block_rank(singular_values(state, check_finite=False), f, m, rtol)
    return StateRankProfile(pos, ranks.reshape(batch_shape + (pos.size,)), int(min(f, m)))


def _positions(positions, n):
    """The sorted, distinct token counts of ``positions`` (default ``1..n``), checked to lie in [0, n]."""
    if positions is None:
        return np.arange(1, n + 1, dtype=np.int64)
    raw = np.asarray(positions)
    if raw.size == 0 and raw.ndim == 1:  # [] reads as float64: an empty profile
        raw = raw.astype(np.int64)
    if raw.dtype.kind not in "iu" or raw.ndim > 1:
        raise TypeError(f"positions must be a 1-D sequence of integers, got dtype {raw.dtype} and shape {raw.shape}")
    pos = np.unique(raw.astype(np.int64))
    if pos.size and (pos[0] < 0 or pos[-1] > n):
        raise ValueError(f"positions must lie in [0, N] = [0, {n}], got {pos[0]}..{pos[-1]}")
    return pos


def _dplr_rank_profile(k, v, fmap, positions, rtol, rule, args, initial_state, check_finite):
    """:func:`state_rank_profile` of a named DPLR rule: the recurrence run from position to position."""
    from ..dplr import dplr_attention
    from ..rules import get_dplr_rule

    spec = get_dplr_rule(rule)
    if not isinstance(args, dict):
        raise TypeError(f"rule_arguments must be a dict, got {type(args).__name__}")
    for name, x in (("k", k), ("v", v)):
        if x is None:
            raise TypeError(f"{name} must be an array of shape (..., N, {'M' if name == 'v' else 'D'}), got None")
    if spec.substeps:  # (..., N, r, D) and (..., N, r, M): the sub-step axis r where check_qkv reads N
        k, v = V.as_host_array("k", k), V.as_host_array("v", v)
        if k.ndim < 3 or v.ndim < 3 or k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"k and v must have shapes (..., N, r, D) and (..., N, r, M) with the same "
                             f"(..., N, r) for rule {spec.name!r}, got shapes {k.shape}, {v.shape}")
    # shapes, dtypes and (check_finite) values of k and v checked up front and named, as on the additive path
    _, k, v, _ = V.host_qkv(None, k, v, check_finite=check_finite)
    nb = v.ndim - 2 - (1 if spec.substeps else 0)  # batch dimensions
    n, m = v.shape[nb], v.shape[-1]
    pos = _positions(positions, n)
    f = C.feature_dim(fmap, k.shape[-1])
    batch = v.shape[:nb]
    b = int(np.prod(batch, dtype=np.int64))
    st, at = None, 0
    if initial_state is not None:
        # a LinearState of this rule or a tuple (S, z[, position]), checked as the additive path checks it, and
        # handed to dplr_attention as a LinearState of this rule
        FE.check_state_rule(initial_state, spec.name)
        H, position = FE.host_state(initial_state, batch, f, m, check_finite=check_finite)
        st = FE.state_from_H(H, batch, f, m, position, rule=spec.name)
    ranks = np.zeros((b, pos.size), dtype=np.int64)
    for j, t in enumerate(pos):
        t = int(t)
        if t > at:
            cut = (slice(None),) * nb + (slice(at, t),)
            ks = k[cut]
            _, st = dplr_attention(ks[..., 0, :] if spec.substeps else ks, ks, v[cut], rule=spec.name,
                                   feature_map=fmap, initial_state=st, return_state=True, check_finite=check_finite,
                                   **{name: np.asarray(x)[cut] for name, x in args.items()})
            at = t
        S = np.zeros((b, f, m)) if st is None else np.asarray(st.S, dtype=np.float64).reshape(b, f, m)
        for i in range(b):
            ranks[i, j] = _block_rank(singular_values(S[i], check_finite=False), f, m, rtol)
    return StateRankProfile(pos, ranks.reshape(batch + (pos.size,)), int(min(f, m)))
