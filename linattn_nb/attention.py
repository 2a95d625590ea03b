"""Public attention functions: validation, shape handling, dispatch.

The kernels live in :mod:`linattn_nb.ops`; this module validates inputs,
flattens the leading batch dimensions, chooses the implementation through the
method table (:mod:`linattn_nb.ops.registry`) and restores shapes.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _validate as V
from . import config
from . import feature_maps as fm
from .device import resolve_device
from .ops import methods as _methods  # noqa: F401  (registers the built-in methods)
from .ops.registry import get_method, select_auto
from .ops.softmax.cpu import softmax_blocked
from .ops.softmax.naive import softmax_attention_quadratic

__all__ = ["linear_attention", "softmax_attention", "LinearState"]


class LinearState(NamedTuple):
    """Recurrent state of linear attention after a sequence (or a prefix).

    Attributes
    ----------
    S : ndarray, shape (..., D_phi, M)
        ``sum_j phi(k_j) v_j^T`` over the tokens seen.
    z : ndarray, shape (..., D_phi)
        ``sum_j phi(k_j)``.
    position : int
        Number of tokens absorbed, i.e. the position of the next token
        (used by position-dependent feature maps).
    """

    S: np.ndarray
    z: np.ndarray
    position: int = 0


# kept under its old name: state.py, analysis and the CUDA dispatcher import it
_check_eps = V.check_eps


def _check_state(initial_state, batch_shape, f, m, check_finite):
    """Validate an initial state; return float64 copies flattened to (B, F, M), (B, F) and the position."""
    if isinstance(initial_state, LinearState) or (
        isinstance(initial_state, tuple) and len(initial_state) in (2, 3)
    ):
        S0, z0 = initial_state[0], initial_state[1]
        position = int(initial_state[2]) if len(initial_state) == 3 else 0
    elif hasattr(initial_state, "S") and hasattr(initial_state, "z"):
        S0, z0 = initial_state.S, initial_state.z
        position = int(getattr(initial_state, "position", 0))
    else:
        raise TypeError(
            "initial_state must be a LinearState (or a tuple (S, z[, position])), "
            f"got {type(initial_state).__name__}"
        )
    S0 = V.as_host_array("initial_state.S", S0)
    z0 = V.as_host_array("initial_state.z", z0)
    position = V.check_state_arrays(S0, z0, position, batch_shape, f, m)
    if check_finite:
        V.check_finite("initial_state.S", S0)
        V.check_finite("initial_state.z", z0)
    S = np.array(S0, dtype=np.float64, order="C").reshape((-1, f, m))
    z = np.array(z0, dtype=np.float64, order="C").reshape((-1, f))
    return S, z, position


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
        See :mod:`linattn_nb._cuda_dispatch`.
    eps : float or None, default 1e-8
        Floor of the normaliser: ``den = max(phi(q)^T z, eps)`` (the seed's
        ``clip(1e-8)``).  With positive feature maps the normaliser is > 0 and
        the floor only guards underflow.  With signed maps ("identity", random
        Fourier features) a normaliser <= eps is replaced by ``eps``, which
        keeps the output finite but large; ``eps=None`` divides by the raw
        signed normaliser instead (a zero normaliser then gives inf/NaN).
    check_finite : bool, default True
        Raise ValueError when an input holds NaN or inf.  With False, NaN
        propagates to the affected outputs.
    out : ndarray, optional
        Output buffer of shape (..., N, M) and the result dtype.
    initial_state : LinearState or tuple (S, z[, position]), optional
        State to start from: context absorbed before token 0 (for
        segment-wise processing).  Never modified.
    return_state : bool, default False
        Also return the final :class:`LinearState` (float64).

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
        non-finite inputs (``check_finite``), unknown ``method``/``device``,
        badly shaped ``out`` or ``initial_state``.
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
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be one of 'auto', 'cpu', 'cuda', got {device!r}")
    dev = resolve_device(device, q, k, v, out, names=("q", "k", "v", "out"))
    if dev == "cuda":
        from . import _cuda_dispatch

        return _cuda_dispatch.linear_attention_cuda(
            q, k, v, feature_map=feature_map, causal=causal, method=method, eps=eps,
            check_finite=check_finite, out=out, initial_state=initial_state,
            return_state=return_state, host_inputs=not any(map(_is_dev, (q, k, v))),
        )

    fmap = fm.resolve(feature_map)
    eps = _check_eps(eps)
    causal = bool(causal)
    q, k, v, (batch_shape, n, d, m, dtype) = V.host_qkv(q, k, v, check_finite=check_finite)
    f = int(fmap.output_dim(d))
    out_shape = batch_shape + (n, m)
    if out is not None:
        V.check_out(out, out_shape, dtype)

    if not isinstance(method, str):
        raise TypeError(f"method must be a string, got {type(method).__name__}")
    b = int(np.prod(batch_shape, dtype=np.int64))
    name = method
    if method == "auto":
        name = select_auto(causal=causal, device="cpu", batch=b, n=n, d=d, m=m, dtype=dtype)
    impl = get_method(name, causal=causal, device="cpu")

    # (scaffolding until the front end is rewritten: the launchers take the state H = [S | z])
    H = np.zeros((b, f, m + 1))
    if initial_state is not None:
        S, z, position = _check_state(initial_state, batch_shape, f, m, check_finite)
        H[..., :m] = S.reshape(b, f, m)
        H[..., m] = z.reshape(b, f)
    else:
        position = 0

    work_dtype = dtype if dtype in impl.native_dtypes else np.dtype(np.float32)
    result = out if out is not None else np.empty(out_shape, dtype=dtype)
    if n > 0 and b > 0:
        vf = V.flatten_batch(v, work_dtype)
        if impl.inline_features and fmap.kernel_code is not None:
            code = int(fmap.kernel_code)
            qf = V.flatten_batch(q, work_dtype)
            kf = V.flatten_batch(k, work_dtype)
        else:
            code = 0
            kw = dict(causal=causal, offset=position, total_length=position + n)
            # NumPy-side maps of float16 inputs run in float32 (no float16 overflow
            # or rounding of the features); the kernels take float32 features
            # next to float16 values.
            feat_dtype = np.dtype(np.float32) if work_dtype == np.float16 else work_dtype
            qf = V.flatten_batch(fmap.apply(np.asarray(q, dtype=feat_dtype), role="query", **kw), feat_dtype)
            kf = V.flatten_batch(fmap.apply(np.asarray(k, dtype=feat_dtype), role="key", **kw), feat_dtype)
            if qf.shape[-1] != f or kf.shape[-1] != f:
                raise ValueError(
                    f"feature map {fmap.name!r} returned {qf.shape[-1]} features for D={d}, "
                    f"but output_dim({d}) says {f}"
                )
        direct = (
            result.dtype == work_dtype and result.flags.c_contiguous and result.flags.writeable
        )
        target = result.reshape((b, n, m)) if direct else np.empty((b, n, m), dtype=work_dtype)
        impl.launcher(qf, kf, vf, H, target, code=code, eps=eps, inputs=None)
        if not direct:
            result[...] = target.reshape(out_shape)
    if not return_state:
        return result
    S, z = np.ascontiguousarray(H[..., :m]), np.ascontiguousarray(H[..., m])
    state = LinearState(S.reshape(batch_shape + (f, m)), z.reshape(batch_shape + (f,)), position + n)
    return result, state


def _is_dev(x) -> bool:
    from .device import on_device  # GPU arrays, and the simulator's device arrays

    return on_device(x)


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
    dev = resolve_device(device if device != "cuda" else "auto", q, k, v, names=("q", "k", "v"))
    if device == "cuda" or dev == "cuda":
        raise ValueError(
            "softmax_attention has a CPU kernel only; pass host arrays (device='cpu'). "
            "GPU inputs: copy them to the host first."
        )
    q, k, v, (batch_shape, n, d, m, dtype) = V.host_qkv(q, k, v, check_finite=check_finite)
    scale = V.check_scale(scale, d)
    if method not in ("blocked", "quadratic"):
        raise ValueError(f"unknown method {method!r} for softmax_attention; choose 'blocked' or 'quadratic'")
    out_shape = batch_shape + (n, m)
    result = np.empty(out_shape, dtype=dtype)
    b = int(np.prod(batch_shape, dtype=np.int64))
    if n == 0 or b == 0:
        return result
    work = np.dtype(np.float32) if dtype == np.float16 else dtype
    qf, kf, vf = (V.flatten_batch(x, work) for x in (q, k, v))
    if method == "quadratic":
        res = softmax_attention_quadratic(qf, kf, vf, causal=bool(causal), scale=scale)
        result[...] = res.reshape(out_shape)
        return result
    direct = work == dtype
    target = result.reshape((b, n, m)) if direct else np.empty((b, n, m), dtype=work)
    softmax_blocked(qf, kf, vf, target, causal=bool(causal), scale=scale)
    if not direct:
        result[...] = target.reshape(out_shape)
    return result
