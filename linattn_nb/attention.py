"""Public attention functions: their documentation, then one call into the front end.

Validation, batch flattening, featurisation, the initial state, the method
choice and the device routing are in :mod:`linattn_nb._frontend`; the kernels
in :mod:`linattn_nb.ops`.
"""
from __future__ import annotations

from . import _frontend, _gradfront
from . import config
from ._frontend import LinearState
from ._gradfront import VJP

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
    eps=config.DEFAULT_EPS,
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

    with the sums over all tokens (``causal=False``) or over ``j <= i``
    (``causal=True``: the prefix states include token ``i``; Katharopoulos et
    al. 2020, Eqs. 7 and 10-12).  The ``N x N`` matrix is never formed except
    by ``method="quadratic"``.

    Parameters
    ----------
    q, k : array_like, shape (..., N, D)
    v : array_like, shape (..., N, M)
        Equal leading batch dimensions, any number of them (``(N, D)``,
        ``(B, H, N, D)``, ...).  float16, float32 or float64; mixed floating
        dtypes are promoted to the widest; integer, boolean and complex inputs
        raise TypeError.  Any memory layout (non-contiguous, Fortran-ordered
        and read-only inputs are accepted; a contiguous copy is made only when
        needed).
    feature_map : str, FeatureMap or None, default "elu"
        A registered name (see :func:`linattn_nb.feature_maps.available`), a
        :class:`~linattn_nb.feature_maps.FeatureMap`, or None when ``q`` and
        ``k`` already are features.  A random map given by name ("favor+",
        "rff") is drawn afresh, unseeded, on every call: to compare calls or
        carry a state across segments, pass one instance
        (``feature_maps.get("favor+", dim=D, num_features=m, seed=0)``).
    causal : bool, default False
    method : {"auto", "quadratic", "scan", "chunked", "aggregate"}
        ``"quadratic"``: the naive N x N reference (float64 inside);
        ``"scan"``: the per-token recurrence; ``"chunked"``: the
        chunkwise-parallel kernel (GEMM-shaped chunks, the default causal
        path on CPU and for long sequences on CUDA); ``"auto"``: the fastest
        for the shape, from the measured table in :mod:`linattn_nb.config`.
        Non-causal attention has no recurrence: ``"scan"``, ``"chunked"`` and
        ``"aggregate"`` all run the aggregate-then-query kernel.
    device : {"auto", "cpu", "cuda"}
        Where to run; ``"auto"`` follows the data: GPU arrays (anything with
        ``__cuda_array_interface__`` or a CUDA ``__dlpack__``: Numba device
        arrays, CuPy arrays, PyTorch CUDA tensors) run on the GPU zero-copy,
        host arrays on the CPU; mixing them raises ValueError.  ``"cuda"``
        with NumPy inputs copies them over and the result back.  On the GPU,
        ``method`` is ``"scan"``, ``"chunked"`` (causal) or ``"aggregate"``;
        feature maps without an inline form (``kernel_code`` None) are
        applied on the host for host inputs and refused for GPU inputs.
        A call on GPU arrays makes no host round-trip: the initial state is
        zeroed (or packed) on the device, temporaries come from a workspace
        pool reused by the next call with the same shapes
        (``config.CUDA_WORKSPACE_BYTES``), so that with the caller's ``out``
        nothing is copied to the device or allocated, and the only copy back
        is the finiteness counters' (one small read with ``check_finite``).
    eps : float or None, default 1e-8
        Floor of the normaliser: ``den = max(phi(q)^T z, eps)`` (the
        ``clip(1e-8)`` of the original NumPy reference).  With positive feature maps the normaliser is > 0 and
        the floor only guards underflow.  With signed maps ("identity", random
        Fourier features) a normaliser <= eps is replaced by ``eps``, which
        keeps the output finite but large; ``eps=None`` divides by the raw
        signed normaliser instead (a zero normaliser then gives inf/NaN).
    check_finite : bool, default True
        Raise ValueError when an input (q, k, v or ``initial_state``) holds
        NaN or inf, naming the first such input.  On the CPU, with a map that
        has an inline form, the kernels check q, k and v while they read
        them (no separate pass over the inputs); the error is raised after
        the kernel ran, so a caller's ``out`` then holds unspecified values
        (nothing else is modified: ``initial_state`` never is, and no state
        is returned).  Also guards against overflow of the working dtype: when
        finite float16/float32 inputs give a non-finite output or state (e.g.
        float32 products of inputs of magnitude 1e19), the call is recomputed
        in float64 and cast back, so the result is finite wherever the
        float64 computation is; a result that is finite in float64 but
        beyond the input dtype's range raises ValueError.  With False none of
        this is checked: NaN propagates to the affected outputs, and an
        overflow gives inf/NaN.
    out : ndarray, optional
        Output buffer of shape (..., N, M) and the result dtype.
    initial_state : LinearState or tuple (S, z[, position]), optional
        State to start from: context absorbed before token 0 (for
        segment-wise processing).  Never modified.
    return_state : bool, default False
        Also return the final :class:`LinearState` (float64).
    decay : float or array_like, optional
        Forgetting factors in [0, 1] (causal only): the state becomes
        ``S_t = a_t S_{t-1} + phi(k_t) v_t^T`` (and ``z`` the same with the
        value 1).  The form follows from the number of dimensions, ``b``
        being the number of batch dimensions of ``q``:

        * a scalar, or ``b`` dimensions broadcastable to the batch shape:
          one constant per sequence (RetNet's per-head ``gamma``);
        * ``b + 1`` dimensions, last axis N: one factor per token
          (Mamba-2/SSD, simple GLA);
        * ``b + 2`` dimensions, last axes (N, D_phi): one factor per token
          and feature, ``S_t = diag(alpha_t) S_{t-1} + ...`` (GLA's gate).

        ``decay=1`` is the additive rule; ``decay=0`` resets the state
        exactly at that token (document boundaries in packed sequences),
        with no NaN anywhere.  See ``docs/theory.md``, "Decay and gating"
        (RetNet, Sun et al. 2023; Mamba-2, Dao & Gu 2024; GLA, Yang et al.
        2024).
    log_decay : float or array_like, optional
        The same factors as logs (<= 0; ``-inf`` is a reset), as models
        produce them (better precision near 1).  At most one of ``decay``
        and ``log_decay``.
    beta : float or array_like, optional
        Write strengths in [0, 2] (causal only): the delta rule (Schlag et
        al. 2021; DeltaNet, Yang et al. 2024),
        ``S_t = S_{t-1} + beta_t phi(k_t) (v_t - S_{t-1}^T phi(k_t))^T``: a
        write replaces what the state returned for the key instead of adding
        to it.  A scalar or an array broadcastable to the batch shape (one
        per sequence), or with one more axis of length N (one per token).
        With ``decay``/``log_decay`` (per sequence or per token) as well, the
        gated delta rule (Yang, Kautz & Hatamizadeh 2025),
        ``S_t = a_t (I - beta_t phi(k_t) phi(k_t)^T) S_{t-1} + beta_t phi(k_t) v_t^T``;
        a per-feature gate with ``beta`` raises ValueError.  The state stays
        bounded for keys of unit norm (feature maps ``"l2"``, ``"silu_l2"``);
        with other keys and ``beta > 0`` it can grow without bound.
    normalize : bool, optional
        Divide by the normaliser ``phi(q)^T z``.  None (default) means True
        for the additive rule and for decay and gates (the normaliser of
        Katharopoulos et al. 2020, with ``z`` decayed like ``S``) and False
        for the delta rules (DeltaNet's convention).  With the delta rules, True divides by
        the state of a constant value 1, which can be <= 0: ``eps`` then
        floors it (or ``eps=None`` divides raw).  False returns
        ``phi(q_t)^T S_t`` (the convention of RetNet, GLA and fla, which
        normalise outputs elsewhere); ``eps`` is then unused.  Maps that
        stabilise their features with per-row factors that cancel only in the
        normaliser ("favor+", "hedgehog") raise ValueError with False.

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
        Mismatched N or D, batch dimensions, fewer than 2 dimensions,
        non-finite inputs (``check_finite``), a result too large for the
        input dtype (``check_finite``), unknown ``method``/``device``,
        badly shaped ``out`` or ``initial_state``; ``decay``/``log_decay``
        with ``causal=False``, out of range, NaN or of a shape that fits none
        of the forms; an ``initial_state`` made by another update rule.
    TypeError
        Non-floating inputs, a bad ``feature_map`` or ``out`` dtype.

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
    eps=config.DEFAULT_EPS,
    check_finite=True,
    initial_state=None,
    decay=None,
    log_decay=None,
    beta=None,
    normalize=None,
    grad_state=None,
):
    r"""Gradients of :func:`linear_attention`: the vector-Jacobian product with ``grad_out``.

    For a loss ``L`` of the output ``o = linear_attention(q, k, v, ...)``
    (and of the final state), given ``grad_out = dL/do``, returns ``dL/dq``,
    ``dL/dk``, ``dL/dv`` and the gradients of every other differentiable
    input that was given.  The forward is recomputed (the torch adapter,
    :mod:`linattn_nb.torch`, keeps it from its forward instead).  Every
    update rule, causal or not, on every method: ``"quadratic"`` (the naive
    float64 reference: a reverse-time scan that keeps every state),
    ``"scan"``, ``"chunked"`` and ``"aggregate"`` on the CPU and with CUDA.
    The fast methods keep at most one state per chunk, never one per token
    (Katharopoulos et al. 2020, §3.3.1: the causal gradients are cumulative
    sums too).

    Parameters
    ----------
    q, k, v, feature_map, causal, method, device, eps, check_finite, initial_state, decay, log_decay, beta, normalize
        As for :func:`linear_attention` (same validation, same errors).
        GPU arrays are copied to the host and the kernels run with
        ``device="cuda"``; the results are host arrays.
    grad_out : array_like, shape (..., N, M)
        The gradient of the loss with respect to the output.
    grad_state : LinearState or tuple (S, z), optional
        The gradient of the loss with respect to the final state (``S``
        (..., D_phi, M), ``z`` (..., D_phi)), for segment-wise training
        (truncated backpropagation through segments).

    Returns
    -------
    VJP
        A named tuple ``(dq, dk, dv, d_initial_state, d_decay, d_log_decay,
        d_beta, d_params)``; a field is None where the input was not given.
        Gradients of broadcast inputs (a decay per head, a scalar beta) are
        summed back to the shape given.  ``d_params``: the feature map's
        parameter gradients (hedgehog's ``W``, ``b``; favor+'s projection
        when built with ``learn_projection=True``).

    Notes
    -----
    With ``normalize=True`` the output is ``num / max(den, eps)``: where the
    floor is active (``den <= eps``) the gradient is that of
    ``num / eps``, i.e. zero through the normaliser.  ``d_decay`` is the
    gradient with respect to the factors themselves and is finite at
    ``decay = 0`` (a reset); ``d_log_decay`` is ``decay * d_decay`` (0 at
    a reset).  ``check_finite`` also guards the working dtype: float16 and
    float32 inputs whose gradients overflow are recomputed in float64.

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

    over all ``j`` or, with ``causal=True``, over ``j <= i``.  The default
    ``method="blocked"`` is a Numba kernel, parallel over (batch entry, query
    block) tasks, that streams over key blocks with a running maximum and
    never holds more than one ``block_q x block_k`` block of scores
    (:mod:`linattn_nb.config`), so causal N = 65,536 runs in bounded memory.

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
        Raise ValueError when q, k or v holds NaN or inf (the blocked kernel
        checks them while it reads them), and recompute in float64 when
        finite float16/float32 inputs overflow the working dtype (e.g.
        float32 scores of inputs of magnitude 1e19).  With False neither is
        checked.
    method : {"blocked", "quadratic"}
        ``"quadratic"`` is the naive float64 reference (explicit N x N).

    Returns
    -------
    ndarray, shape (..., N, M), in the input dtype.

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

_tune.install(linear_attention)
