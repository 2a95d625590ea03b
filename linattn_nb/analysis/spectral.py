"""Spectral summaries of matrices: singular values, numerical, effective and stable rank.

Every function takes a stack of matrices ``(..., m, n)`` and returns one value (or vector) per matrix.
Conventions (dtypes, tolerances, zero and badly scaled matrices) and references: docs/guide/analysis.md.
"""
from __future__ import annotations

import numpy as np

from .. import _validate as V
from . import _common as C

__all__ = [
    "singular_values",
    "numerical_rank",
    "effective_rank",
    "stable_rank",
    "cumulative_spectrum",
]


def _work_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float32) if dtype == np.float16 else np.dtype(dtype)


def _as_matrices(name: str, A, check_finite: bool) -> np.ndarray:
    A = V.as_host_array(name, A)
    V.check_float_dtype(name, A.dtype)
    if A.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dimensions (..., m, n), got shape {tuple(A.shape)}")
    if check_finite:
        V.check_finite(name, A)
    return np.asarray(A, dtype=_work_dtype(A.dtype))


def _as_spectrum(name: str, s, check_finite: bool) -> np.ndarray:
    s = V.as_host_array(name, s)
    V.check_float_dtype(name, s.dtype)
    if s.ndim < 1:
        raise ValueError(f"{name} must have at least 1 dimension (..., k) of singular values, got a scalar")
    if check_finite:
        V.check_finite(name, s)
    s = np.asarray(s, dtype=_work_dtype(s.dtype))
    if s.size and np.any(s < 0):
        raise ValueError(f"{name}: singular values must be >= 0 (spectrum=True), got a negative entry")
    # descending order, as returned by singular_values
    return -np.sort(-s, axis=-1)


def _svals(A: np.ndarray) -> np.ndarray:
    k = min(A.shape[-2], A.shape[-1])
    if A.size == 0 or k == 0:
        return np.zeros(A.shape[:-2] + (k,), dtype=A.dtype)
    return np.linalg.svd(A, compute_uv=False)


def _scaled_svals(A: np.ndarray) -> np.ndarray:
    """Singular values of each matrix of ``A`` times a power of two that brings its largest entry into [0.5, 1).

    The exact scaling keeps the SVD clear of overflow and underflow for scale-invariant measures.
    """
    if A.size == 0:
        return _svals(A)
    amax = np.abs(A).max(axis=(-2, -1), keepdims=True)
    return _svals(np.ldexp(A, -np.frexp(amax)[1]))


def _spectrum(A, spectrum: bool, check_finite: bool, name: str = "A") -> np.ndarray:
    """Descending float64 singular values, times a power of two that brings the largest into [0.5, 1).

    Exact scaling: no square or sum of the values can overflow, nor the largest square underflow.
    """
    if spectrum:
        s = _as_spectrum(name, A, check_finite)
    else:
        s = _scaled_svals(_as_matrices(name, A, check_finite))
    s = s.astype(np.float64)
    if s.shape[-1] == 0:
        return s
    return np.ldexp(s, -np.frexp(s[..., :1])[1])


def rank_from_singular_values(s: np.ndarray, max_dim: int, rtol=None, eps=None) -> np.ndarray:
    """Count ``s > rtol * s.max()`` along the last axis (NumPy's ``matrix_rank`` rule), as int64.

    ``s``: (some of) the singular values of matrices whose larger dimension is ``max_dim``; default ``rtol``
    ``max_dim * eps`` with ``eps`` that of ``s``'s dtype (or the one given).
    """
    s = np.asarray(s)
    if eps is None:
        eps = np.finfo(s.dtype).eps
    if rtol is None:
        rtol = max(int(max_dim), 1) * eps
    else:
        rtol = C.check_rtol(rtol, s.shape[:-1])
    smax = s.max(axis=-1, keepdims=True, initial=0.0)
    tol = smax * np.asarray(rtol)[..., None] if np.ndim(rtol) else smax * rtol
    return np.count_nonzero(s > tol, axis=-1).astype(np.int64)


def _ratio(num, den):
    """``num / den`` where ``den > 0``, else 0, without warnings."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


def singular_values(A, *, check_finite=True):
    """Singular values of a stack of matrices, in descending order.

    Parameters
    ----------
    A : array_like, shape (..., m, n)
        float16, float32 or float64 (float16 is computed in float32).
    check_finite : bool, default True
        Raise ValueError on NaN or inf (LAPACK would return garbage or fail).

    Returns
    -------
    ndarray, shape (..., min(m, n))
        In the working dtype (float32 or float64).

    Raises
    ------
    ValueError
        Fewer than 2 dimensions, or non-finite entries.
    TypeError
        A non-floating dtype.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb.analysis import singular_values
    >>> singular_values(np.diag([1.0, 3.0, 2.0])).tolist()
    [3.0, 2.0, 1.0]
    >>> singular_values(np.zeros((5, 2, 3))).shape
    (5, 2)
    """
    check_finite = C.check_bool("check_finite", check_finite)
    return _svals(_as_matrices("A", A, check_finite))


def numerical_rank(A, rtol=None, *, check_finite=True):
    """Numerical rank of a stack of matrices (NumPy/LAPACK conventions).

    The number of singular values ``sigma_i > rtol * sigma_max`` (:func:`numpy.linalg.matrix_rank`).

    Parameters
    ----------
    A : array_like, shape (..., m, n)
    rtol : float or array_like, optional
        Relative tolerance: a number, or an array that broadcasts to the batch shape ``(...)`` (one
        tolerance per matrix; one that would grow it, such as ``[1e-12]`` for a single matrix, raises
        ValueError); default ``max(m, n) * eps`` of the working dtype.
    check_finite : bool, default True

    Returns
    -------
    int or ndarray of int64, shape (...)
        A Python int for a single matrix.

    Raises
    ------
    ValueError
        Fewer than 2 dimensions, non-finite entries, a negative ``rtol`` or one that does not broadcast
        to the batch shape.
    TypeError
        A non-floating dtype.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb.analysis import numerical_rank
    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(50, 3))
    >>> numerical_rank(x @ x.T)          # a 50 x 50 matrix of rank 3
    3
    >>> numerical_rank(np.stack([np.eye(4), np.zeros((4, 4))])).tolist()
    [4, 0]
    """
    check_finite = C.check_bool("check_finite", check_finite)
    A = _as_matrices("A", A, check_finite)
    if rtol is not None:
        rtol = C.check_rtol(rtol, A.shape[:-2])
    s = _scaled_svals(A)
    r = rank_from_singular_values(s, max(A.shape[-2:]), rtol)
    return int(r) if r.ndim == 0 else r


def effective_rank(A, *, spectrum=False, check_finite=True):
    """Effective rank ``exp(H(p))``, ``p_i = sigma_i / sum_j sigma_j`` (Roy & Vetterli 2007).

    Between 1 and the number of singular values; 0 for an all-zero matrix (docs/guide/analysis.md).

    Parameters
    ----------
    A : array_like, shape (..., m, n)
        Matrices, or singular values (..., k) with ``spectrum=True`` (non-negative, any order).
    spectrum : bool, default False
    check_finite : bool, default True

    Returns
    -------
    float or ndarray, shape (...)

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb.analysis import effective_rank
    >>> round(effective_rank(np.eye(5)), 12)
    5.0
    >>> round(effective_rank(np.array([3.0, 0.0, 0.0]), spectrum=True), 12)
    1.0
    """
    spectrum = C.check_bool("spectrum", spectrum)
    check_finite = C.check_bool("check_finite", check_finite)
    s = _spectrum(A, spectrum, check_finite)
    total = s.sum(axis=-1, keepdims=True)
    p = _ratio(s, total)
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    h = -plogp.sum(axis=-1)
    out = np.where(total[..., 0] > 0, np.exp(h), 0.0)
    return float(out) if out.ndim == 0 else out


def stable_rank(A, *, spectrum=False, check_finite=True):
    """Stable rank ``||A||_F^2 / ||A||_2^2 = sum sigma_i^2 / sigma_max^2``.

    Between 1 and the rank; 0 for an all-zero matrix (docs/guide/analysis.md).

    Parameters
    ----------
    A : array_like, shape (..., m, n)
        Matrices, or singular values (..., k) with ``spectrum=True``.
    spectrum : bool, default False
    check_finite : bool, default True

    Returns
    -------
    float or ndarray, shape (...)

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb.analysis import stable_rank
    >>> stable_rank(np.diag([2.0, 1.0, 1.0]))
    1.5
    """
    spectrum = C.check_bool("spectrum", spectrum)
    check_finite = C.check_bool("check_finite", check_finite)
    s = _spectrum(A, spectrum, check_finite)
    smax = s.max(axis=-1, initial=0.0)
    out = _ratio((s * s).sum(axis=-1), smax * smax)
    return float(out) if out.ndim == 0 else out


def cumulative_spectrum(A, *, squared=False, spectrum=False, check_finite=True):
    """Normalised cumulative singular values (Linformer, Wang et al. 2020, Fig. 1).

    ``c_k = (sigma_1 + ... + sigma_k) / sum_i sigma_i`` (descending values); ``squared=True``
    accumulates ``sigma_i^2`` (the fraction of ``||A||_F^2`` the best rank-k approximation keeps).

    Parameters
    ----------
    A : array_like, shape (..., m, n)
        Matrices, or singular values (..., k) with ``spectrum=True``.
    squared : bool, default False
    spectrum : bool, default False
    check_finite : bool, default True

    Returns
    -------
    ndarray, shape (..., min(m, n))  (or (..., k))
        Zeros for an all-zero matrix.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb.analysis import cumulative_spectrum
    >>> cumulative_spectrum(np.diag([3.0, 1.0])).tolist()
    [0.75, 1.0]
    >>> cumulative_spectrum(np.diag([3.0, 1.0]), squared=True).tolist()
    [0.9, 1.0]
    """
    squared = C.check_bool("squared", squared)
    spectrum = C.check_bool("spectrum", spectrum)
    check_finite = C.check_bool("check_finite", check_finite)
    s = _spectrum(A, spectrum, check_finite)
    if squared:
        s = s * s
    c = np.cumsum(s, axis=-1)
    total = c[..., -1:] if c.shape[-1] else np.zeros(c.shape[:-1] + (1,))
    return _ratio(c, total)
