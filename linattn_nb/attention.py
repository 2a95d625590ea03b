"""Public attention functions: their documentation, then one call into :mod:`linattn_nb._frontend`."""
from __future__ import annotations

from . import _frontend, _gradfront
from ._frontend import LinearState
from ._gradfront import VJP
from ._defaults import DEFAULT_EPS

__all__ = ["linear_attention", "linear_attention_vjp", "softmax_attention", "LinearState", "VJP"]


def linear_attention(
    q,
    k,
    v,
    *,
    feature_map="elu",
    causal=False,
    method="auto",
    device="auto",
    eps=DEFAULT_EPS,
    check_finite=True,
    out=None,
    initial_state=None,
    return_state=False,
    decay=None,
    log_decay=None,
    beta=None,
    normalize=None,
):
    r"""Kernel-based linear attention.

    Computes, for every query ``i``,

    .. math:: o_i = \frac{\phi(q_i)^\top S}{\max(\phi(q_i)^\top z, \epsilon)},
       \quad S = \sum_j \phi(k_j) v_j^\top,\quad z = \sum_j \phi(k_j),

    with the sums over all tokens, or over ``j <= i`` with ``causal=True`` (docs/guide/attention.md).

    Parameters
    ----------
    q, k : array_like, shape (..., N, D)
    v : array_like, shape (..., N, M)
        Equal leading batch dimensions, any number of them (``(N, D)``, ``(B, H, N, D)``, ...).
        float16, float32 or float64 (mixed dtypes promoted to the widest), any memory layout
        (docs/guide/attention.md).
    feature_map : str, FeatureMap or None, default "elu"
        A registered name (:func:`linattn_nb.feature_maps.available`), a
        :class:`~linattn_nb.feature_maps.FeatureMap`, or None when ``q`` and ``k`` already are
        features.  A random map given by name is drawn afresh on every call: pass one instance to
        compare calls or carry a state across segments.
    causal : bool, default False
    method : {"auto", "quadratic", "scan", "chunked", "aggregate"}
        ``"quadratic"`` (the float64 N x N reference), ``"scan"``, ``"chunked"``, or ``"auto"`` (the
        fastest for the shape, docs/tuning.md); non-causal calls run ``"aggregate"`` for every method but
        ``"quadratic"``, which builds the N x N reference there too.
    device : {"auto", "cpu", "cuda"}
        ``"auto"`` follows the data (mixing GPU and host arrays raises ValueError); ``"cuda"`` with
        NumPy inputs copies them over and the result back (docs/guide/gpu.md).
    eps : float or None, default 1e-8
        Floor of the normaliser, ``den = max(phi(q)^T z, eps)``; ``eps=None`` divides by the raw
        normaliser (for signed maps; docs/guide/attention.md).
    check_finite : bool, default True
        Raise ValueError naming an input (q, k, v or ``initial_state``) that holds NaN or inf, and
        recompute in float64 when finite float16/float32 inputs overflow the working dtype; finite
        results that overflow float64 itself raise NonFiniteResult (except with ``eps=None``, whose
        zero normalisers give NaN) (docs/guide/attention.md).  With False none of this is checked.
    out : ndarray, optional
        Output buffer of shape (..., N, M) and the result dtype.
    initial_state : LinearState or tuple (S, z[, position]), optional
        Context absorbed before token 0 (segment-wise processing).  Never modified.
    return_state : bool, default False
        Also return the final :class:`LinearState` (float64).
    decay : float or array_like, optional
        Forgetting factors in [0, 1] (causal only): ``S_t = a_t S_{t-1} + phi(k_t) v_t^T`` (and
        ``z`` alike), one per sequence, per token (last axis N) or per token and feature (last axes
        (N, D_phi)), broadcast over the batch; ``decay=0`` resets the state (docs/guide/rules.md).
    log_decay : float or array_like, optional
        The same factors as logs (<= 0; ``-inf`` is a reset).  At most one of ``decay`` and
        ``log_decay``.
    beta : float or array_like, optional
        Write strengths in [0, 2] (causal only), per sequence or per token: the delta rule; with a
        decay per sequence or per token, the gated delta rule (docs/guide/rules.md).
    normalize : bool, optional
        Divide by the normaliser ``phi(q)^T z``.  None: True for the additive, decay and gate
        rules, False for the delta rules.  Maps that need the normaliser ("favor+", "hedgehog")
        raise ValueError with False.

    Returns
    -------
    out : ndarray, shape (..., N, M)
        In the (promoted) input dtype.  For GPU inputs a Numba device array
        (or the caller's ``out``).
    state : LinearState
        Only when ``return_state`` is True.  For GPU inputs ``S`` and ``z``
        are float64 Numba device arrays.

    Raises
    ------
    ValueError
        Mismatched shapes, non-finite inputs or a result too large for the input dtype
        (``check_finite``), unknown ``method``/``device``, a bad ``out`` or ``initial_state`` (or
        one of another rule); rule inputs with ``causal=False``, out of range or of no form above.
    TypeError
        Non-floating inputs, a bad ``feature_map`` or ``out`` dtype.
    linattn_nb.NonFiniteResult
        Finite inputs whose results are not finite even in float64 (``check_finite``, ``eps`` not None).

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb import linear_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.normal(size=(2, 2, 4, 16, 8))   # (B=2, H=4, N=16, D=8) each
    >>> v = rng.normal(size=(2, 4, 16, 6))
    >>> o = linear_attention(q, k, v, causal=True)
    >>> o.shape
    (2, 4, 16, 6)
    >>> ref = linear_attention(q, k, v, causal=True, method="quadratic")
    >>> bool(np.allclose(o, ref))
    True

    A decay per head (RetNet-like gammas, broadcast over the batch) and a
    per-token reset:

    >>> gamma = np.array([0.9, 0.99, 0.999, 1.0])[None, :]   # (1, H): one per head
    >>> o = linear_attention(q, k, v, causal=True, decay=gamma)
    >>> a = np.ones((2, 4, 16)); a[..., 8] = 0.0               # (B, H, N): reset at token 8
    >>> o2 = linear_attention(q, k, v, causal=True, decay=a)
    >>> bool(np.allclose(o2[..., 8:, :], linear_attention(q[..., 8:, :], k[..., 8:, :], v[..., 8:, :], causal=True)))
    True
    """
    return _frontend.linear_attention(
        q, k, v, feature_map=feature_map, causal=causal, method=method, device=device, eps=eps,
        check_finite=check_finite, out=out, initial_state=initial_state, return_state=return_state,
        decay=decay, log_decay=log_decay, beta=beta, normalize=normalize,
    )


def linear_attention_vjp(
    q,
    k,
    v,
    grad_out,
    *,
    feature_map="elu",
    causal=False,
    method="auto",
    device="auto",
    eps=DEFAULT_EPS,
    check_finite=True,
    initial_state=None,
    decay=None,
    log_decay=None,
    beta=None,
    normalize=None,
    grad_state=None,
):
    r"""Gradients of :func:`linear_attention`: the vector-Jacobian product with ``grad_out``.

    Returns ``dL/dq``, ``dL/dk``, ``dL/dv`` and the gradients of every other differentiable input
    given, for every rule and method (docs/guide/gradients.md).

    Parameters
    ----------
    q, k, v, feature_map, causal, method, device, eps, check_finite, initial_state, decay, log_decay, beta, normalize
        As for :func:`linear_attention` (same validation, same errors).  GPU arrays are copied to
        the host and the kernels run with ``device="cuda"``; the results are host arrays.
    grad_out : array_like, shape (..., N, M)
        The gradient of the loss with respect to the output.
    grad_state : LinearState or tuple (S, z), optional
        The gradient of the loss with respect to the final state (``S`` (..., D_phi, M), ``z``
        (..., D_phi)), for segment-wise training.

    Returns
    -------
    VJP
        A named tuple ``(dq, dk, dv, d_initial_state, d_decay, d_log_decay, d_beta, d_params)``;
        a field is None where the input was not given.  Gradients of broadcast inputs are summed
        back to the shape given; ``d_params`` are the feature map's parameter gradients.

    Notes
    -----
    Where the ``eps`` floor is active the gradient is zero through the normaliser.  ``d_decay``
    is finite at a reset (``decay = 0``); ``d_log_decay`` is ``decay * d_decay``.  Gradients that
    overflow float16/float32 are recomputed in float64 (``check_finite``).

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb import linear_attention, linear_attention_vjp
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(3, 2, 16, 8))
    >>> g = rng.normal(size=(2, 16, 8))                  # dL/do for L = sum(o * g)
    >>> grads = linear_attention_vjp(q, k, v, g, causal=True)
    >>> grads.dq.shape, grads.d_decay is None
    ((2, 16, 8), True)

    A decay per sequence (one float) gets one float back:

    >>> grads = linear_attention_vjp(q, k, v, g, causal=True, decay=0.9)
    >>> isinstance(grads.d_decay, float)
    True

    Central differences agree:

    >>> h = 1e-6
    >>> L = lambda vv: np.sum(linear_attention(q, k, vv, causal=True) * g)
    >>> e = np.zeros_like(v); e[0, 3, 2] = h
    >>> fd = (L(v + e) - L(v - e)) / (2 * h)
    >>> bool(abs(fd - linear_attention_vjp(q, k, v, g, causal=True).dv[0, 3, 2]) < 1e-6)
    True
    """
    return _gradfront.linear_attention_vjp(
        q, k, v, grad_out, feature_map=feature_map, causal=causal, method=method, device=device, eps=eps,
        check_finite=check_finite, initial_state=initial_state, decay=decay, log_decay=log_decay, beta=beta,
        normalize=normalize, grad_state=grad_state,
    )


def softmax_attention(q, k, v, *, causal=False, scale=None, device="auto", check_finite=True,
                      method="blocked"):
    r"""Softmax attention, numerically stable, in bounded memory.

    .. math:: o_i = \sum_j \operatorname{softmax}_j(\text{scale}\; q_i^\top k_j)\, v_j

    over all ``j`` or, with ``causal=True``, over ``j <= i`` (docs/guide/attention.md).

    Parameters
    ----------
    q, k : array_like, shape (..., N, D)
    v : array_like, shape (..., N, M)
        Same rules as :func:`linear_attention` (dtype promotion, batch dims).
        float16 inputs are computed in float32 and returned as float16.
    causal : bool, default False
    scale : float, optional
        Defaults to ``1 / sqrt(D)``.
    device : {"auto", "cpu"}
        Only a CPU kernel exists; GPU inputs raise ValueError.
    check_finite : bool, default True
        Raise ValueError when q, k or v holds NaN or inf, and recompute in float64 when finite
        float16/float32 inputs overflow the working dtype; finite inputs whose scores overflow float64
        itself raise NonFiniteResult.  With False none of this is checked.
    method : {"blocked", "quadratic"}
        ``"quadratic"`` is the naive float64 reference (explicit N x N).  Both form the scores as
        ``(scale q) . k``.

    Returns
    -------
    ndarray, shape (..., N, M), in the input dtype.

    Raises
    ------
    TypeError
        A ``method`` that is not a string (as :func:`linear_attention`), a ``scale`` that is not a real
        number, non-floating inputs.
    ValueError
        An unknown ``method``; a ``scale`` that is not finite or too large for a float; shapes that do not
        match; with ``check_finite``, NaN or inf in q, k or v.
    NonFiniteResult
        With ``check_finite``, finite inputs whose scores overflow float64 (every input dtype).

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb import softmax_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(3, 2, 32, 8))
    >>> o = softmax_attention(q, k, v, causal=True)
    >>> bool(np.allclose(o, softmax_attention(q, k, v, causal=True, method="quadratic")))
    True
    """
    return _frontend.softmax_attention(q, k, v, causal=causal, scale=scale, device=device,
                                       check_finite=check_finite, method=method)


# method="auto" on the CPU follows this machine's calibration when one is stored (docs/tuning.md)
from . import _tune  # noqa: E402

_tune.install(linear_attention, linear_attention_vjp)
