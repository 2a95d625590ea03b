"""The front end of gradients: :func:`linattn_nb.linear_attention_vjp` and the torch adapter's calls.

``prepare`` validates a request like a forward one, ``forward`` runs it and keeps what the backward
needs, ``backward`` returns the :class:`VJP`; the torch adapter calls them from its forward and
backward.  Design (the unnormalised problem, the normaliser's gradient): docs/frontend.md, "Gradients".
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

from . import _cuda_dispatch as CD
from . import _validate as V
from . import config
from ._blas import parallel_entry
from ._workarrays import thread_array
from ._frontend import (LinearState, feature_overflow64, featurise, float64_overflow, host_array, host_call,
                        host_state, parse_state, resolve_call, state_from_H, floor_is_zero)
from .device import on_device
from .feature_maps._base import FeatureOverflow
from .ops import methods  # noqa: F401  (registers the built-in rules and methods)
from .ops._finite import all_finite
from .ops._vec import work_dtype
from .ops.grad import _maps, _outgrad, _rowmaps
from .ops.grad.cpu import (backward_chunked_normalized, fuses_normalized, keeps_values, save_arrays,
                           takes_saved)
from .rules import get_rule

_F64 = np.dtype(np.float64)


class VJP(NamedTuple):
    """Gradients returned by :func:`linattn_nb.linear_attention_vjp`.

    Attributes
    ----------
    dq, dk, dv : ndarray
        Gradients of the loss with respect to ``q``, ``k``, ``v``, in their
        (promoted) dtype and shape.
    d_initial_state : LinearState or None
        Gradients with respect to ``initial_state.S`` and ``initial_state.z``
        (float64, in the ``S`` and ``z`` fields; position and rule copied);
        None when no initial state was given.
    d_decay, d_log_decay : ndarray, float or None
        The gradient with respect to the argument given (the other is None),
        summed back to its shape (a float for a scalar).  With respect to
        ``decay`` it is finite at ``decay = 0``; with respect to
        ``log_decay`` it is ``decay * d_decay`` (0 at a reset).
    d_beta : ndarray, float or None
        With respect to ``beta``, summed back to its shape.
    d_params : dict or None
        Parameter gradients of the feature map (name -> array, the query and
        key roles summed), for maps with parameters
        (:meth:`linattn_nb.feature_maps.FeatureMap.vjp`); None otherwise.
    """

    dq: Any
    dk: Any
    dv: Any
    d_initial_state: Optional[LinearState] = None
    d_decay: Any = None
    d_log_decay: Any = None
    d_beta: Any = None
    d_params: Optional[dict] = None


@dataclass
class Request:
    """A validated gradient request (see the module docstring)."""

    fmap: Any
    q: np.ndarray
    k: np.ndarray
    causal: bool
    dev: str
    impl: Any
    rule: str
    inputs: Optional[dict]
    normalize: bool
    eps: Optional[float]
    check_finite: bool
    batch_shape: tuple
    n: int
    d: int
    m: int
    f: int
    dtype: np.dtype
    work: np.dtype
    position: int
    H0: np.ndarray  # (B, F, M + 1) float64
    has_state: bool
    qf: np.ndarray  # (B, N, F) work
    kf: np.ndarray
    v1: np.ndarray  # (B, N, M + 1) work
    decay_arg: Optional[tuple] = None  # ("decay" | "log_decay", given shape)
    beta_shape: Optional[tuple] = None
    saved: Optional[tuple] = None  # what the forward kept for the backward launcher (see forward)
    reuse: bool = False  # own arrays from this thread's work arrays (_buffer): a single backward follows
    nd_finite: Optional[bool] = None  # whether forward's [num | den] is finite, where its outputs pass read it

    @property
    def b(self) -> int:
        return int(np.prod(self.batch_shape, dtype=np.int64))


# ---------------------------------------------------------------------------
# work arrays
# ---------------------------------------------------------------------------
_WORK = threading.local()


def _buffer(role, shape, dtype, reuse):
    """An empty array for ``role``: with ``reuse``, this thread's work array of that role, kept for its next
    call of the same shape up to :data:`linattn_nb.config.GRAD_WORK_BYTES` (never returned to the caller)."""
    if not reuse:
        return np.empty(tuple(int(s) for s in shape), dtype)
    return thread_array(_WORK, role, shape, dtype, config.GRAD_WORK_BYTES)


def _maker(req):
    """``empty(name, shape, dtype)`` for a launcher's own arrays of request ``req`` (:func:`_buffer`)."""
    return lambda name, shape, dtype: _buffer(name, shape, dtype, req.reuse)


# ---------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------
def _fast_map(fmap):
    """The module with the parallel features and VJP of ``fmap`` (:mod:`~linattn_nb.ops.grad._maps` for the
    elementwise maps, :mod:`~linattn_nb.ops.grad._rowmaps` for ``l2``/``silu_l2``), None for the other maps."""
    code = getattr(fmap, "kernel_code", None)
    if code in _maps.ELEMENTWISE_CODES:
        return _maps
    if code in _rowmaps.ROW_CODES:
        return _rowmaps
    return None


def _given_shape(name, x):
    return tuple(int(d) for d in x.shape) if on_device(x) else tuple(np.shape(V.as_host_array(name, x)))


@parallel_entry
def prepare(q, k, v, *, feature_map, causal, method, device, eps, check_finite, initial_state, decay=None,
            log_decay=None, beta=None, normalize=None, work=None, reuse=False) -> Request:
    """Validate a gradient request and compute the features (arguments as :func:`linattn_nb.linear_attention`).

    GPU arrays are copied to the host (the backward launchers of the CUDA
    methods then run on copies made from the host: ``device="cuda"``).
    ``work``: force a working dtype (the float64 recomputation).  ``reuse``: the request's own arrays
    (features, ``[v | 1]``, the forward's) are this thread's work arrays (:func:`_buffer`), for a
    caller that runs one backward before its next request (:func:`linear_attention_vjp`).
    """
    dev, fmap, eps, causal = resolve_call(device, (q, k, v), ("q", "k", "v"), feature_map, eps, causal, method)
    # one parallel pass for features and their vjp (elementwise maps, and DeltaNet's row maps)
    fast = _fast_map(fmap)
    inline = fast is not None
    # a request used once (reuse) reads the caller's log-factors where they need no conversion: no copy of a
    # per-feature gate, as large as q and k; the torch adapter keeps its request until its backward
    c = host_call(q, k, v, dev=dev, fmap=fmap, eps=eps, causal=causal, method=method, decay=decay,
                  log_decay=log_decay, beta=beta, normalize=normalize, initial_state=initial_state,
                  check_qkv=check_finite and not inline, copy=not reuse, to_host=True, extra_columns=1,
                  work=(lambda role, shape, dtype: _buffer(role, shape, dtype, True)) if reuse else None)
    q, k, v, batch_shape, n, d, m, f, b, dtype = c.q, c.k, c.v, c.batch_shape, c.n, c.d, c.m, c.f, c.b, c.dtype
    rule, inputs, normalize, impl = c.rule, c.inputs, c.normalize, c.impl
    if impl.backward is None:
        raise ValueError(f"method {impl.name!r} (rule {rule!r}, causal={causal}, device {dev!r}) has no backward "
                         "launcher; choose another method")
    H0, position = host_state(initial_state, batch_shape, f, m, check_finite=check_finite)
    if work is None:
        work = work_dtype(dtype)
    v1 = _buffer("v1", (b, n, m + 1), work, reuse)
    v_ok = None
    if v.dtype in _outgrad.DTYPES and v.flags.c_contiguous:
        v_ok = _outgrad.values_with_ones(v.reshape(b * n, m), v1.reshape(b * n, m + 1))
    else:
        v1[:, :, :m] = V.flatten_batch(v, work)
        v1[:, :, m] = 1
    if check_finite and inline and not v_ok:
        V.check_finite("v", v)  # raises for a v found not finite; q and k: while their features are computed
    if inline:
        feats = []
        for name, x in (("q", q), ("k", k)):
            xf, finite = fast.features(x, fmap.kernel_code, work, out=_buffer(name + "f", x.shape, work, reuse))
            if check_finite and not finite:
                V.check_finite(name, x)  # raises, naming the input
            feats.append(V.flatten_batch(xf, work))
        qf, kf = feats
    else:
        feat_kw = dict(causal=causal, offset=position, total_length=position + n, dtype=work)
        qf = V.flatten_batch(featurise(fmap, q, role="query", name="q", **feat_kw), work)
        kf = V.flatten_batch(featurise(fmap, k, role="key", name="k", **feat_kw), work)
    decay_arg = None
    if decay is not None:
        decay_arg = ("decay", _given_shape("decay", decay))
    elif log_decay is not None:
        decay_arg = ("log_decay", _given_shape("log_decay", log_decay))
    beta_shape = None if beta is None else _given_shape("beta", beta)
    return Request(fmap, q, k, causal, dev, impl, rule, inputs, normalize, eps, check_finite, tuple(batch_shape),
                   n, d, m, f, dtype, work, position, H0, initial_state is not None, qf, kf, v1, decay_arg,
                   beta_shape, reuse=bool(reuse))


# ---------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------
def _floored(req: Request, den):
    """``(den', active)``: the denominator used and where the eps floor is not active."""
    if req.eps is None:
        return den, np.ones(den.shape, dtype=bool)
    active = den > req.eps
    return np.where(active, den, req.eps), active


def _saves(req: Request, unread: bool = False) -> bool:
    """Whether the forward keeps its chunk values for the backward (CPU, chunked): the delta rules always
    (their backward would otherwise run the forward's WY/UT transform again in a first pass); the decay rule's
    unnormalised outputs where the forward runs anyway (``unread`` False: the PyTorch adapter's), so that its
    backward skips the first pass, which would sum the chunk-start states again (:func:`takes_saved`; its
    normalised outputs go to the fused backward, which reads nothing of the forward)."""
    code = get_rule(req.rule).code
    if not (req.dev == "cpu" and req.causal and req.impl.name == "chunked" and takes_saved(code)):
        return False
    return keeps_values(code) or not (unread or req.normalize)


@parallel_entry
def forward(req: Request, want_out: bool = True):
    """``(out, nd, HN)``: the output (batch_shape + (N, M), the input dtype; None when not ``want_out``),
    ``[num | den]`` (B, N, M + 1) in the working dtype and the final state (B, F, M + 1) float64.

    The delta rules' CPU chunked forward keeps each chunk's start state, residuals and ``K K^T`` in
    ``req.saved`` (about three times the bytes of ``v``), which the backward reads instead of
    computing them again; that of the decay rule's unnormalised outputs keeps each chunk's start state
    (at the backward's chunk size: about twice the bytes of ``v`` at D = M = 64).  The delta rules'
    forward, unnormalised and without ``want_out``, computes nothing else (``nd`` is then left
    unwritten: the backward's gradient of the outputs does not read it).  The other rules'
    forward, unnormalised and without ``want_out``, is not run at all (their backward launchers read
    nothing of it): ``nd`` is left unwritten and ``HN`` is None.
    """
    b, n, m = req.b, req.n, req.m
    nd = _buffer("nd", (b, n, m + 1), req.work, req.reuse and not want_out)  # an output comes from nd
    Hx = np.zeros((b, req.f, m + 2))  # the launcher's own column of ones rides along unused
    Hx[:, :, : m + 1] = req.H0
    req.saved = None
    unread = not want_out and not req.normalize  # neither the outputs nor the normaliser are read
    saves = _saves(req, unread)
    if unread and not saves:
        return None, nd, None
    if n > 0 and b > 0:
        if req.dev == "cuda":
            CD.run_host(req.impl, req.qf, req.kf, req.v1, Hx, nd, code=0, eps=None, inputs=req.inputs,
                        normalize=False)
        elif saves:
            saved = save_arrays(get_rule(req.rule).code, b, n, req.f, m + 1, req.work, empty=_maker(req))
            # out None where the outputs are not read: the backward's former first pass alone
            req.impl.forward(req.qf, req.kf, req.v1, Hx, None if unread else nd, code=0, eps=None, inputs=req.inputs,
                             check_finite=False, normalize=False, chunk=saved[0], save=saved[1:])
            req.saved = saved
        else:
            req.impl.forward(req.qf, req.kf, req.v1, Hx, nd, code=0, eps=None, inputs=req.inputs,
                             check_finite=False, normalize=False)
    HN = np.ascontiguousarray(Hx[:, :, : m + 1])
    if not want_out:
        return None, nd, HN
    return _outputs_of(req, nd), nd, HN


def _outputs_of(req: Request, nd):
    """The outputs (batch_shape + (N, M), the inputs' dtype) from ``[num | den]``: ``num / den'`` with a float64
    ``den'`` (the ``eps`` floor), or ``num``; ValueError where a finite quotient overflows the dtype."""
    b, n, m = req.b, req.n, req.m
    if np.dtype(req.dtype) in _outgrad.DTYPES and nd.dtype in _outgrad.DTYPES:
        # one parallel pass, the same values as NumPy's below without its float64 temporary
        out = np.empty((b, n, m), req.dtype)
        ok, req.nd_finite = _outgrad.outputs_from(nd.reshape(b * n, m + 1), req.eps if req.normalize else None,
                                                  out.reshape(b * n, m), normalize=req.normalize, nd_finite=True)
        if not ok:
            _overflow("the result", np.float64, req.dtype)
        return out.reshape(req.batch_shape + (n, m))
    num = nd[:, :, :m]
    if req.normalize:
        den, _ = _floored(req, nd[:, :, m].astype(np.float64))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            out = num / den[:, :, None]
    else:
        out = num
    return _narrow(np.asarray(out), req.dtype, "the result").reshape(req.batch_shape + (n, m))


def _narrow(x, dtype, what):
    """``x`` cast to ``dtype``; ValueError where a finite value of ``x`` overflows it (``what`` names ``x``)."""
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(dtype, copy=False)
    if y is not x and x.dtype.itemsize > y.dtype.itemsize and (np.isfinite(x) & ~np.isfinite(y)).any():
        _overflow(what, x.dtype, dtype)
    return y


def _overflow(what, wide, dtype):
    """The ValueError of a finite ``wide`` value (``what``) that overflows ``dtype``."""
    raise ValueError(f"{what} overflows {np.dtype(dtype).name} (it is finite in {np.dtype(wide).name}); pass "
                     "float64 inputs or rescale them")


def _checks_float64(req: Request) -> bool:
    """Whether a non-finite result of ``req`` is an error: a float64 request with finite inputs
    (``check_finite``) and no normaliser that can be 0 (``eps=None``'s NaN is documented)."""
    return req.check_finite and req.work == _F64 and (req.eps is not None or not req.normalize)


def check_float64(req: Request, arrays, what: str, qkv) -> None:
    """:func:`~linattn_nb._frontend.float64_overflow` raised where ``arrays`` (``what``) of a request that
    :func:`_checks_float64` are not all finite.  ``qkv``: the host inputs, for the message."""
    if not _checks_float64(req):
        return
    if all(x is None or all_finite(x) for x in arrays):
        return
    raise float64_overflow(what, req.fmap, *qkv, zero_floor=floor_is_zero(req.normalize, req.eps))


def overflowed(req: Request, nd, HN, want_out: bool) -> bool:
    """Whether :func:`forward` of a request with finite inputs (``check_finite``) overflowed its working dtype
    (below float64): a non-finite final state, or ``[num | den]`` where it was written.  The caller then
    prepares the request again with ``work=float64``, as :func:`linattn_nb.linear_attention` recomputes an
    overflowed float32 result in float64 (the float32 values would be silently wrong: 0 or NaN outputs
    where a normaliser overflowed)."""
    if req.work == _F64 or not req.check_finite or HN is None:
        return False
    if not all_finite(HN):
        return True
    written = want_out or req.normalize or not _saves(req, unread=True)  # see forward: a saving forward may skip nd
    if written and want_out and req.nd_finite is not None:  # read by the outputs' pass (_outputs_of)
        return not req.nd_finite
    return bool(written and not all_finite(nd))


# ---------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------
def _grad_state(grad_state, req: Request):
    """The final-state gradient as (B, F, M + 1) float64, or None."""
    if grad_state is None:
        return None
    dS, dz, _ = parse_state(grad_state, "grad_state")
    dS = _checked_grad("grad_state.S", dS, req.batch_shape + (req.f, req.m), "the final state", req)
    dz = _checked_grad("grad_state.z", dz, req.batch_shape + (req.f,), "the final state", req)
    dH = np.empty((req.b, req.f, req.m + 1))
    dH[:, :, : req.m] = dS.reshape(req.b, req.f, req.m)
    dH[:, :, req.m] = dz.reshape(req.b, req.f)
    return dH


def _host_qkv(q, k, v):
    """q, k, v as host arrays (for the magnitudes an overflow error quotes)."""
    return tuple(host_array(nm, x) for nm, x in (("q", q), ("k", k), ("v", v)))


def _checked_grad(name, x, want, of, req: Request, finite: bool = True) -> np.ndarray:
    """``x`` as a host array, checked: the shape ``want`` (that of ``of``), floating, finite (``check_finite``;
    ``finite`` False: left to the caller)."""
    x = host_array(name, x)
    if tuple(x.shape) != want:
        raise ValueError(f"{name} must have the shape of {of}, {want}, got {tuple(x.shape)}")
    V.check_float_dtype(name, x.dtype)  # float16, float32 or float64, as q, k, v
    if req.check_finite and finite:
        V.check_finite(name, x)
    return x


def _grad_out(grad_out, req: Request, finite: bool = True) -> np.ndarray:
    return _checked_grad("grad_out", grad_out, req.batch_shape + (req.n, req.m),
                         f"the output (q {tuple(req.q.shape)}, v (..., N, M={req.m}))", req, finite)


def _unbroadcast(grad, given_shape, full_shape):
    """``grad`` (``full_shape``) summed back to ``given_shape`` (numpy broadcasting rules); a float for ()."""
    grad = np.asarray(grad).reshape(full_shape)
    extra = grad.ndim - len(given_shape)
    if extra > 0:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, s in enumerate(given_shape) if s == 1 and grad.shape[i] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    grad = grad.reshape(given_shape)
    return float(grad) if grad.ndim == 0 else grad


def _wants_log_grad(req: Request) -> bool:
    """Whether the request's factor argument is given as log-factors (its gradient is ``a dL/da``)."""
    return req.decay_arg is not None and req.decay_arg[0] == "log_decay"


def _factor_grads(req: Request, dfactor, is_log=False):
    """``(d_decay, d_log_decay)`` summed back to the shape of the argument given; ``is_log``: ``dfactor`` is
    the launcher's gradient of the log-factors already (``log_grad`` of
    :func:`~linattn_nb.ops.grad.cpu.backward_chunked_normalized`)."""
    if req.decay_arg is None or dfactor is None:
        return None, None
    name, given = req.decay_arg
    lg = get_rule(req.rule).log_factor_of(req.inputs)  # (B, N) per token, (B, N, F) per feature
    full = req.batch_shape + lg.shape[1:]
    g = np.asarray(dfactor, np.float64)
    if name == "log_decay" and not is_log:
        # d/d log a = a d/da: 0 at a reset; over the launcher's own result where it can take it
        own = g is dfactor and g.flags.c_contiguous and g.flags.writeable and lg.flags.c_contiguous
        g = _outgrad.times_factor(g if own else np.array(g, dtype=np.float64, order="C"),
                                  np.ascontiguousarray(lg))
    g = g.reshape(full)
    if lg.ndim == 2 and len(given) in (0, len(req.batch_shape)):
        g = g.sum(axis=-1)  # a constant per sequence: summed over the tokens
        full = req.batch_shape
    out = _unbroadcast(g, given, full)
    return (out, None) if name == "decay" else (None, out)  # not a rule: the argument given


def _beta_grad(req: Request, dbeta):
    if req.beta_shape is None or dbeta is None:
        return None
    nb = len(req.batch_shape)
    g = np.asarray(dbeta, np.float64).reshape(req.batch_shape + (req.n,))
    full = req.batch_shape + (req.n,)
    if len(req.beta_shape) in (0, nb):
        g, full = g.sum(axis=-1), req.batch_shape
    return _unbroadcast(g, req.beta_shape, full)


def _run_backward(req: Request, g1, dHN):
    """The method's backward launcher on the request's arrays (copies to and from the GPU for CUDA)."""
    if req.dev != "cuda":
        if req.saved is not None:
            return req.impl.backward(req.qf, req.kf, req.v1, req.H0, g1, dHN, inputs=req.inputs, saved=req.saved)
        return req.impl.backward(req.qf, req.kf, req.v1, req.H0, g1, dHN, inputs=req.inputs)
    cuda = CD._cuda()
    grads = req.impl.backward(cuda.to_device(req.qf), cuda.to_device(req.kf), cuda.to_device(req.v1),
                              cuda.to_device(req.H0), cuda.to_device(g1),
                              None if dHN is None else cuda.to_device(dHN), inputs=req.inputs)
    return type(grads)(*(None if x is None else (x.copy_to_host() if on_device(x) else np.asarray(x))
                         for x in grads))


def _merge_params(a, b):
    if a is None:
        return b
    if b is None:
        return a
    merged = dict(a)
    for key, val in b.items():
        merged[key] = merged[key] + val if key in merged else val
    return merged


def _output_gradient(req: Request, nd, g, overwrite_nd=False):
    """``(g1, g_finite)``: ``g1 = dL/d[num | den]`` (B, N, M + 1) in the working dtype, from ``g = dL/dout``,
    written over ``nd`` when ``overwrite_nd`` (each row read before it is written); ``g_finite`` whether
    every element of ``g`` is finite, or None where that was not looked at.

    Built in place in the working dtype (no float64 copy of an (N, M) array):
    ``g / den'`` and ``-(g . num) / den'^2`` (0 where the floor is active), or ``[g | 0]`` unnormalised,
    in one parallel pass (:mod:`~linattn_nb.ops.grad._outgrad`) for float32 and float64 gradients.
    """
    b, n, m = req.b, req.n, req.m
    gw = g.reshape(b, n, m)
    fused = (gw.dtype in _outgrad.DTYPES and gw.flags.c_contiguous
             and (nd.dtype in _outgrad.DTYPES or not req.normalize))
    own = overwrite_nd and (fused or not req.normalize) and nd.dtype == req.work
    g1 = nd if own else np.empty((b, n, m + 1), dtype=req.work)
    if fused:
        rows = b * n
        ok = _outgrad.output_gradient(gw.reshape(rows, m), nd.reshape(rows, m + 1), req.eps,
                                      g1.reshape(rows, m + 1), normalize=req.normalize)
        return g1, ok
    if not req.normalize:
        g1[:, :, :m] = gw
        g1[:, :, m] = 0
        return g1, None
    den, active = _floored(req, np.asarray(nd[:, :, m], np.float64))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = 1.0 / den  # (B, N) float64
        np.multiply(gw, inv[:, :, None].astype(req.work), out=g1[:, :, :m], casting="unsafe")
        dot = np.einsum("bnm,bnm->bn", gw, nd[:, :, :m])
        g1[:, :, m] = np.where(active, -dot * inv * inv, 0.0)
    return g1, None


@parallel_entry
def backward(req: Request, nd, grad_out, grad_state=None, overwrite_nd=False, finite=None, out_dtype=None) -> VJP:
    """The gradients of a prepared request, given its forward's ``[num | den]`` (see :func:`forward`);
    ``overwrite_nd``: ``nd`` may hold the gradient of ``[num | den]`` afterwards (a single backward).
    ``finite``: a set that receives the names of the results (``"dq"``, ``"dk"``) found finite on the way.
    ``out_dtype``: the dtype of ``dq``, ``dk``, ``dv`` (default the inputs'; the float64 recomputation keeps
    float64 so that its caller can tell a cast that overflows)."""
    g = _grad_out(grad_out, req, finite=False)
    g1, g_ok = _output_gradient(req, nd, g, overwrite_nd)
    if req.check_finite and not g_ok:
        V.check_finite("grad_out", g)  # raises for a g found not finite; the full check where not looked at
    dHN = _grad_state(grad_state, req)
    if req.n > 0 and req.b > 0:
        grads = _run_backward(req, g1, dHN)
        del g1  # freed before the maps' products allocate: the peak memory of long sequences
        return _finish(req, grads, finite, out_dtype)
    return _finish(req, None, finite, out_dtype, dHN)


def _finish(req: Request, grads, finite=None, out_dtype=None, dHN=None, mapped=None, log_grad=False) -> VJP:
    """The :class:`VJP` from a backward launcher's :class:`~linattn_nb.ops.grad.Grads` (None: no token, then
    ``dHN`` is the final state's gradient): the maps' vjps, the factor and ``beta`` gradients summed back to
    their arguments' shapes, ``dq``, ``dk``, ``dv`` cast (arguments as :func:`backward`).  ``mapped``: the
    launcher ran the map's VJP already (its ``dq``, ``dk`` are those of ``q``, ``k``) and found every
    element of ``dq``, ``dk``, ``dv`` finite (True) or not (False); None: it did not.  ``log_grad``: the
    launcher's factor gradient is that of the log-factors already."""
    b, n, m, f = req.b, req.n, req.m, req.f
    log_grad = log_grad and grads is not None  # no token: the zeros below
    if grads is not None:
        dqf, dkf, dv1, dH0, dfactor, dbeta = grads
        del grads
    else:
        dqf = np.zeros((b, n, f))
        dkf = np.zeros((b, n, f))
        dv1 = np.zeros((b, n, m + 1))
        dH0 = np.zeros((b, f, m + 1)) if dHN is None else dHN.copy()
        dfactor = np.zeros((b, n, f) if get_rule(req.rule).factor == "feature" else (b, n))
        dbeta = np.zeros((b, n))
    kw = dict(causal=req.causal, offset=req.position, total_length=req.position + n)
    fshape = req.batch_shape + (n, f)
    code, fast = req.fmap.kernel_code, _fast_map(req.fmap)
    if mapped is not None:
        dq, pq = np.asarray(dqf).reshape(fshape), None
        dk, pk = np.asarray(dkf).reshape(fshape), None
        del dqf
        if finite is not None and req.dtype == req.work and mapped:
            finite.update(("dq", "dk", "dv"))
    elif fast is not None:
        # over the launcher's own results: no fresh (B, N, F) arrays
        chk = req.check_finite
        (dq, q_ok), pq = fast.vjp_checked(req.q, dqf, code, req.work, overwrite=True, check=chk), None
        del dqf
        (dk, k_ok), pk = fast.vjp_checked(req.k, dkf, code, req.work, overwrite=True, check=chk), None
        if finite is not None and req.dtype == req.work:  # no cast below that could overflow
            finite.update(name for name, ok in (("dq", q_ok), ("dk", k_ok)) if ok)
    else:
        dq, pq = req.fmap.vjp(req.q.astype(req.work, copy=False), np.asarray(dqf).reshape(fshape), role="query",
                              **kw)
        del dqf
        dk, pk = req.fmap.vjp(req.k.astype(req.work, copy=False), np.asarray(dkf).reshape(fshape), role="key", **kw)
    del dkf
    dv = np.asarray(dv1)[:, :, :m].reshape(req.batch_shape + (n, m))  # a view: no copy of the largest result
    d_state = None
    if req.has_state:
        d_state = state_from_H(np.asarray(dH0, np.float64), req.batch_shape, f, m, req.position, req.rule)
    d_decay, d_log_decay = _factor_grads(req, dfactor, is_log=log_grad)
    d_beta = _beta_grad(req, dbeta)
    dq, dk, dv = (_narrow(np.asarray(x), out_dtype or req.dtype, f"the gradient {nm}")
                  for nm, x in (("dq", dq), ("dk", dk), ("dv", dv)))
    return VJP(dq, dk, dv, d_state, d_decay, d_log_decay, d_beta, _merge_params(pq, pk))


def _normalized_fused(req: Request, grad_out) -> bool:
    """Whether :func:`backward_normalized` takes the request: the additive, decay or gate rule's normalised
    causal outputs by the CPU chunked method, with a gradient whose dtype the working one holds exactly."""
    # another array type (a torch tensor, whose dtype NumPy cannot read; a list) is converted by _grad_out
    return _fused_for(req, grad_out.dtype if isinstance(grad_out, np.ndarray) else None)


def _fused_for(req: Request, dt) -> bool:
    """:func:`_normalized_fused` for a gradient of dtype ``dt`` (None: not an array)."""
    if not (req.dev == "cpu" and req.causal and req.normalize and req.impl.name == "chunked"
            and fuses_normalized(get_rule(req.rule).code) and req.b > 0 and req.n > 0):
        return False
    return dt is not None and np.dtype(dt).kind == "f" and np.dtype(dt).itemsize <= np.dtype(req.work).itemsize


@parallel_entry
def backward_normalized(req: Request, grad_out, grad_state=None, finite=None, out_dtype=None):
    """The gradients of a prepared request (:func:`_normalized_fused`) with no forward run before: the backward
    kernel computes the normalisers and ``g . num`` from its own products
    (:func:`~linattn_nb.ops.grad.cpu.backward_chunked_normalized`).  Returns the :class:`VJP`, or None where
    the working dtype (below float64) overflowed on finite inputs (``check_finite``): the caller recomputes
    in float64.  Arguments as :func:`backward`."""
    g = _grad_out(grad_out, req, finite=False)
    b, n, m = req.b, req.n, req.m
    gw = np.ascontiguousarray(g.reshape(b, n, m), dtype=req.work)
    dHN = _grad_state(grad_state, req)
    g1 = _buffer("nd", (b, n, m + 1), req.work, req.reuse)
    maps = None
    if _fast_map(req.fmap) is _maps:  # the map's VJP in the kernel, on each chunk's complete rows
        if req.fmap.kernel_code in _maps.FROM_FEATURES:  # a derivative from the features: no pass over q, k
            maps = (req.qf, req.kf, req.fmap.kernel_code)
        else:
            maps = tuple(np.ascontiguousarray(x, dtype=req.work).reshape(b, n, req.f) for x in (req.q, req.k))
            maps += (req.fmap.kernel_code,)
    log_grad = _wants_log_grad(req)
    # the (chunk, row block) this machine's calibration chose for method="auto" (None: config's)
    chunk, block = req.impl.grad_pair or (None, None)
    grads, g_ok, res_ok = backward_chunked_normalized(req.qf, req.kf, req.v1, req.H0, gw, dHN, eps=req.eps,
                                                      g1=g1, rule=get_rule(req.rule).code, inputs=req.inputs,
                                                      maps=maps, log_grad=log_grad, empty=_maker(req),
                                                      chunk=chunk, block=block)
    del g1, gw
    if req.check_finite and not g_ok:
        V.check_finite("grad_out", g)  # raises, naming it
    if req.check_finite and req.work != _F64 and not res_ok:
        return None
    return _finish(req, grads, finite, out_dtype, mapped=None if maps is None else bool(res_ok), log_grad=log_grad)


def _finite(vjp: VJP, known=()) -> bool:
    """Whether every gradient in ``vjp`` is finite (those named in ``known`` are, already)."""
    parts = [getattr(vjp, name) for name in ("dq", "dk", "dv") if name not in known]
    parts += [vjp.d_decay, vjp.d_log_decay, vjp.d_beta]
    if vjp.d_initial_state is not None:
        parts += [vjp.d_initial_state.S, vjp.d_initial_state.z]
    if vjp.d_params:
        parts += list(vjp.d_params.values())
    return all(all_finite(x) for x in parts if x is not None)


@parallel_entry
def linear_attention_vjp(q, k, v, grad_out, *, feature_map, causal, method, device, eps, check_finite,
                         initial_state, decay=None, log_decay=None, beta=None, normalize=None, grad_state=None):
    """The request path of :func:`linattn_nb.linear_attention_vjp` (arguments and results as there)."""
    check_finite = V.check_bool("check_finite", check_finite)
    kw = dict(feature_map=feature_map, causal=causal, method=method, device=device, eps=eps,
              check_finite=check_finite, initial_state=initial_state, decay=decay, log_decay=log_decay,
              beta=beta, normalize=normalize)
    try:
        req = prepare(q, k, v, reuse=True, **kw)
    except FeatureOverflow as e:
        if e.dtype == _F64:  # as linear_attention raises it
            raise feature_overflow64(e, *_host_qkv(q, k, v)) from None
        return _vjp_float64(q, k, v, grad_out, grad_state, kw)  # the map's features overflowed float32
    known = set()
    work = req.work
    checks64, fmap = _checks_float64(req), req.fmap  # read before the request is freed
    floor0 = floor_is_zero(req.normalize, req.eps)
    if _normalized_fused(req, grad_out):
        res = backward_normalized(req, grad_out, grad_state, finite=known)
        del req
        if res is None:  # the working dtype overflowed
            return _vjp_float64(q, k, v, grad_out, grad_state, kw)
    else:
        _, nd, HN = forward(req, want_out=False)
        if overflowed(req, nd, HN, want_out=False):
            del req, nd, HN  # freed before the float64 recomputation allocates its own
            return _vjp_float64(q, k, v, grad_out, grad_state, kw)
        res = backward(req, nd, grad_out, grad_state, overwrite_nd=True, finite=known)
        del req, nd, HN
    if check_finite and work != _F64 and not _finite(res, known):
        # finite inputs, non-finite gradients: the working dtype overflowed; float64 throughout
        return _vjp_float64(q, k, v, grad_out, grad_state, kw)
    if checks64 and not _finite(res, known):
        raise float64_overflow("a gradient", fmap, *_host_qkv(q, k, v), zero_floor=floor0)
    return res


def fuses_after_forward(req: Request) -> bool:
    """Whether :func:`backward_after_forward` of a request whose forward ran will take the fused normalised
    kernel for a gradient of the outputs' dtype (then it reads nothing of the forward's ``[num | den]``)."""
    return _fused_for(req, req.dtype)


def backward_after_forward(req: Request, nd, grad_out, grad_state, qkv, kw) -> VJP:
    """The gradients of a request whose :func:`forward` ran (the PyTorch adapter's backward).

    The additive, decay and gate rules' normalised outputs (:func:`_normalized_fused`) take the fused kernel of
    :func:`linear_attention_vjp`, which reads nothing of the forward (``nd`` may be None) and is faster than a
    backward from ``nd`` (side by side, B*H = 16, N = 4096, D = M = 64, float32, 2-vCPU Intel Xeon: additive 33.5
    against 43.5 ms, gate 77 against 93 ms; docs/performance.md); where the working dtype overflows there,
    float64 throughout, as :func:`linear_attention_vjp` (``qkv`` the host inputs and ``kw`` the request's
    arguments).  Other requests: :func:`backward` from ``nd`` (computed again where None)."""
    if _normalized_fused(req, grad_out):
        known = set()
        res = backward_normalized(req, grad_out, grad_state, finite=known)
        if res is None or (req.check_finite and req.work != _F64 and not _finite(res, known)):
            return _vjp_float64(*qkv, grad_out, grad_state, kw)
    else:
        if nd is None:
            _, nd, _ = forward(req, want_out=False)
        res = backward(req, nd, grad_out, grad_state)
        known = set()
    if _checks_float64(req) and not _finite(res, known):
        raise float64_overflow("a gradient", req.fmap, *qkv, zero_floor=floor_is_zero(req.normalize, req.eps))
    return res


def _vjp_float64(q, k, v, grad_out, grad_state, kw):
    """:func:`linear_attention_vjp` in float64 throughout, ``dq``, ``dk``, ``dv`` cast to the inputs' dtype
    (ValueError naming the gradient where a finite float64 value overflows it)."""
    req = prepare(q, k, v, work=_F64, reuse=True, **kw)
    if _normalized_fused(req, grad_out):
        res = backward_normalized(req, grad_out, grad_state, out_dtype=_F64)  # never None in float64
    else:
        _, nd, _ = forward(req, want_out=False)
        res = backward(req, nd, grad_out, grad_state, overwrite_nd=True, out_dtype=_F64)
    if _checks_float64(req) and not _finite(res):  # as float64 inputs raise (eps=0's 0 / 0), not NaN returned
        raise float64_overflow("a gradient", req.fmap, *_host_qkv(q, k, v),
                               zero_floor=floor_is_zero(req.normalize, req.eps))
    return res._replace(**{nm: _narrow(getattr(res, nm), req.dtype, f"the gradient {nm}")
                           for nm in ("dq", "dk", "dv")})
