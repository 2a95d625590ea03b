"""PyTorch autograd adapter (the only module that imports torch; extra ``torch``).

:func:`linear_attention` and :func:`dplr_attention` are differentiable forms of
:func:`linattn_nb.linear_attention` and :func:`linattn_nb.dplr_attention` on the package's kernels;
:class:`LinearAttention` is a multi-head layer.  Guide: docs/guide/gradients.md; threads: docs/threads.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import contextlib
import copy
import os
import sys
import threading
import warnings

import numpy as np
import torch
from torch import nn

from . import _gradfront
from . import feature_maps as fm
from . import rules
from ._frontend import LinearState, feature_overflow64
from ._validate import check_bool, check_eps
from .feature_maps._base import FeatureOverflow
from ._defaults import DEFAULT_EPS

__all__ = ["linear_attention", "dplr_attention", "LinearAttention", "LinearState"]

_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)

#: Built-in elementwise maps applied with torch ops to CUDA tensors (float32 and float64; exactly these
#: classes, not subclasses).  CPU tensors keep the library's map: the gradient front end computes the
#: features in one parallel pass, keeps them for the backward and runs the map's VJP in the fused backward
#: kernel or a parallel pass of its own, which was faster than torch's ops and autograd in every case
#: measured (the adapter's step at B*H = 16, N = 4096, D = M = 64, float32, one torch thread, 2-vCPU Intel
#: Xeon: 0.68-0.95 of the time, docs/frontend.md, "Gradients").
_TORCH_MAPS = {
    # + 1 in place: ELU's backward reads its input, not its output, and "elu(x) + 1.0" made a second fresh
    # (B, N, D) tensor (6.6 against 17.9 ms at 16 x 4096 x 64 float32, one thread, Intel Xeon)
    fm.EluFeatureMap: lambda x: nn.functional.elu(x).add_(1.0),
    fm.ReluFeatureMap: nn.functional.relu,
    fm.SquaredReluFeatureMap: lambda x: nn.functional.relu(x).square(),
    fm.IdentityFeatureMap: lambda x: x,
}


class _Precomputed(fm.IdentityFeatureMap):
    """Queries and keys that already are features (mapped by torch): the feature gradients pass through."""

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        return np.asarray(grad_features), None


_PRECOMPUTED = _Precomputed()


# ---------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------
_SPIN_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_spin_warned = False


def _initial_environment():
    """Names of the variables the process started with (Linux: /proc/self/environ), None where unknown."""
    try:
        with open("/proc/self/environ", "rb") as f:
            return {item.split(b"=", 1)[0].decode(errors="replace") for item in f.read().split(b"\0") if item}
    except OSError:
        return None


def _torch_threads_spin(modules=None, environment="read", backend=None) -> bool:
    """Whether torch's OpenMP threads were started to spin between ops (docs/threads.md): torch imported
    before :mod:`linattn_nb.config` (``modules``, in import order), the process started without
    ``OMP_WAIT_POLICY``/``GOMP_SPINCOUNT`` (``environment``: names, ``"read"`` to read them, None
    unknown: False) and an OpenMP backend (``backend``: ``torch.__config__.parallel_info()``)."""
    names = list(sys.modules) if modules is None else list(modules)
    if "torch" not in names or "linattn_nb.config" not in names:
        return False
    if names.index("torch") > names.index("linattn_nb.config"):
        return False  # torch's OpenMP started after config asked for passive waiting
    env = _initial_environment() if environment == "read" else environment
    if env is None or any(var in env for var in _SPIN_VARS):
        return False
    info = torch.__config__.parallel_info() if backend is None else backend
    return "parallel backend: OpenMP" in info


def _warn_if_torch_spins() -> None:
    """One warning per process when torch runs more than one thread that spins between ops."""
    global _spin_warned
    if _spin_warned or torch.get_num_threads() < 2:
        return
    _spin_warned = True
    if os.environ.get("OMP_WAIT_POLICY", "").upper() == "ACTIVE" or not _torch_threads_spin():
        return
    warnings.warn(
        "torch was imported before linattn_nb and its OpenMP threads spin between ops: on a machine with "
        "other busy processes a training step can run many times slower (docs/threads.md). Start Python "
        "with OMP_WAIT_POLICY=PASSIVE, import linattn_nb before torch, or call torch.set_num_threads(1).",
        RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------
def _check_tensor(name: str, x, *, floating: bool = True) -> torch.Tensor:
    """``x`` as given, after checking that it is a tensor of a dtype NumPy has."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be a real floating tensor, got dtype {x.dtype}")
    if x.requires_grad and not x.is_floating_point():
        raise TypeError(f"{name} requires grad but has the integer dtype {x.dtype}; gradients need float tensors")
    if (floating or x.is_floating_point()) and x.dtype not in _NUMPY_DTYPES:
        hint = " (NumPy has no bfloat16: cast to float32)" if x.dtype == torch.bfloat16 else ""
        raise TypeError(f"{name} must be float16, float32 or float64, got dtype {x.dtype}{hint}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on device {x.device}; only CPU and CUDA tensors are supported")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout} (call .to_dense())")
    return x


def _host(x):
    """What the front end gets for tensor ``x``: a NumPy view (CPU) or the detached CUDA tensor (read in place
    through ``__cuda_array_interface__``)."""
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach() if x.device.type == "cuda" else _host_array(x)


def _to_tensor(a, like: torch.Tensor, shape=None) -> torch.Tensor:
    """A host result as a tensor with the dtype and device of ``like`` (and ``shape``)."""
    a = np.asarray(a)
    t = torch.from_numpy(np.ascontiguousarray(a)) if a.ndim else torch.tensor(a.item(), dtype=torch.float64)
    if shape is not None:
        t = t.reshape(shape)
    return t.to(device=like.device, dtype=like.dtype)


def _check_one_device(named) -> None:
    """ValueError unless the tensors of ``named`` [(name, tensor or None)] are on one device."""
    devices = {}
    for nm, t in named:
        if t is not None:
            devices.setdefault(str(t.device), []).append(nm)
    if len(devices) > 1:
        where = "; ".join(f"{', '.join(ns)} on {dev}" for dev, ns in devices.items())
        raise ValueError(f"all tensors must be on one device, got {where}")


def _write_map_params(fmap, names, params, host) -> None:
    """Write the parameter tensors into the map's own arrays (``host``: a tensor's NumPy array)."""
    stored = _map_parameters(fmap)
    for name, t in zip(names, params):
        dst, src = stored[name], host(t)
        if not np.shares_memory(dst, src):
            dst[...] = src  # the map computes with the tensor's current values


#: Held while a call that writes ``feature_map_params`` into its map computes with them (forward or backward):
#: the values live in the map object, so two threads sharing one map with different parameters would each
#: compute with whichever the other wrote last (docs/threads.md).  Calls without parameters never take it.
_PARAMS_LOCK = threading.RLock()


def _params_held(params):
    """:data:`_PARAMS_LOCK` where the call writes map parameters (``params`` not empty), else no lock."""
    return _PARAMS_LOCK if params else contextlib.nullcontext()


def _map_parameters(fmap) -> dict:
    get = getattr(fmap, "parameters", None)
    return dict(get()) if callable(get) else {}


def _map_param_tensors(fmap, feature_map_params, check_finite):
    """``(names, tensors)`` of ``feature_map_params``, checked against the map's own parameters (names and
    shapes) and, with ``check_finite``, refused when they hold NaN or inf (before any is written into the
    map); ``((), ())`` when none are given."""
    if not feature_map_params:
        return (), ()
    stored = _map_parameters(fmap)
    unknown = sorted(set(feature_map_params) - set(stored))
    if unknown:
        raise ValueError(f"feature_map_params: the map {fmap.name!r} has no parameter(s) {unknown}; its "
                         f"parameters are {sorted(stored)} (hedgehog, t2r: call materialize(d) to store their "
                         "defaults)")
    names = tuple(feature_map_params)
    params = tuple(_check_tensor(f"feature_map_params[{n!r}]", feature_map_params[n]) for n in names)
    for n, t in zip(names, params):
        if tuple(t.shape) != tuple(np.shape(stored[n])):
            raise ValueError(f"feature_map_params[{n!r}] has shape {tuple(t.shape)}, the map's {n} has "
                             f"shape {tuple(np.shape(stored[n]))}")
        if check_finite:  # as q, k, v: a NaN parameter would be blamed on the inputs' features
            bad = int(t.numel() - torch.isfinite(t.detach()).sum().item())
            if bad:
                raise ValueError(f"feature_map_params[{n!r}] contains {bad} non-finite value(s) (NaN or inf); "
                                 "pass check_finite=False to skip this check")
    return names, params


@dataclass
class _Spec:
    """The non-tensor arguments of one call (carried through ``Function.apply``)."""

    fmap: Any
    causal: bool
    method: str
    device: str
    eps: Optional[float]
    check_finite: bool
    normalize: Optional[bool]
    return_state: bool
    decay: Any = None  # non-tensor values; tensors travel as Function inputs
    log_decay: Any = None
    beta: Any = None
    position: int = 0
    state_rule: Optional[str] = None
    param_names: tuple = ()
    rule: str = field(default="additive")  # set by the forward


_SECOND_ORDER = ("linattn_nb.torch: the backward passes of linear attention, dplr attention and the short "
                 "convolution are not differentiable, so a second derivative through them (a gradient penalty, "
                 "double backward, Hessian-vector products) is not available")


class _NoSecondDerivative(torch.autograd.Function):
    """The gradients a backward returns under ``create_graph=True``, unchanged: differentiating them raises."""

    @staticmethod
    def forward(ctx, *grads):
        return tuple(g.clone() for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(_SECOND_ORDER)


def _first_order_only(backward):
    """A backward run outside autograd (as ``once_differentiable``) whose gradients, under ``create_graph=True``,
    raise RuntimeError when differentiated.  ``once_differentiable`` guards them only when an incoming gradient
    requires grad: a gradient penalty on a loss linear in the outputs, ``grad((o * w).sum(), q,
    create_graph=True)``, got gradients detached from ``q``, and the penalty's second-order term was dropped
    without an error.  The error is raised only where a second derivative is asked for."""

    def wrapper(ctx, *grads):
        with torch.no_grad():
            res = backward(ctx, *grads)
        if not torch.is_grad_enabled():  # a plain backward (create_graph=False)
            return res
        outs = list(res) if isinstance(res, tuple) else [res]
        idx = [i for i, g in enumerate(outs) if isinstance(g, torch.Tensor) and g.is_floating_point()]
        if idx:
            guarded = _NoSecondDerivative.apply(*[outs[i].detach().requires_grad_() for i in idx])
            for i, g in zip(idx, guarded):
                outs[i] = g
        return tuple(outs) if isinstance(res, tuple) else outs[0]

    wrapper.__doc__, wrapper.__name__ = backward.__doc__, backward.__name__
    return wrapper


class _LinearAttentionFunction(torch.autograd.Function):
    """Forward and backward through :mod:`linattn_nb._gradfront` (see :func:`linear_attention`)."""

    @staticmethod
    def forward(ctx, spec: _Spec, q, k, v, decay, log_decay, beta, S0, z0, *params):
        with _params_held(params):
            return _LinearAttentionFunction._forward(ctx, spec, q, k, v, decay, log_decay, beta, S0, z0, *params)

    @staticmethod
    def _forward(ctx, spec: _Spec, q, k, v, decay, log_decay, beta, S0, z0, *params):
        fmap = spec.fmap
        if params:
            _write_map_params(fmap, spec.param_names, params, _host_array)
        initial_state = None
        if S0 is not None:
            if spec.state_rule is None:
                initial_state = (_host(S0), _host(z0), spec.position)
            else:
                initial_state = LinearState(_host(S0), _host(z0), spec.position, spec.state_rule)
        qkv = (_host(q), _host(k), _host(v))
        kw = dict(feature_map=fmap, causal=spec.causal, method=spec.method, device=spec.device, eps=spec.eps,
                  check_finite=spec.check_finite, initial_state=initial_state,
                  decay=_host(decay) if decay is not None else spec.decay,
                  log_decay=_host(log_decay) if log_decay is not None else spec.log_decay,
                  beta=_host(beta) if beta is not None else spec.beta, normalize=spec.normalize)
        try:
            req = _gradfront.prepare(*qkv, **kw)
            out, nd, HN = _gradfront.forward(req)
            redo = _gradfront.overflowed(req, nd, HN, want_out=True)
        except FeatureOverflow as e:
            if e.dtype == np.float64:
                if all(isinstance(x, np.ndarray) for x in qkv):  # host inputs: their magnitudes in the message
                    raise feature_overflow64(e, *qkv) from None  # as linear_attention raises it
                raise
            redo = True  # the map's features of finite q or k overflowed float32
        if redo:
            # finite inputs whose float32 features or sums overflowed: the forward, and so the backward, in
            # float64 (as linattn_nb.linear_attention recomputes such a result), outputs cast back to the
            # inputs' dtype
            req = _gradfront.prepare(*qkv, work=np.float64, **kw)
            out, nd, HN = _gradfront.forward(req)
        _gradfront.check_float64(req, (out, HN), "an output or the state", qkv)
        spec.rule = req.rule
        # the fused backward reads nothing of the forward: [num | den] is not kept for it
        ctx.spec, ctx.req, ctx.nd = spec, req, None if _gradfront.fuses_after_forward(req) else nd
        ctx.kw = kw
        ctx.meta = [None if t is None else (t.dtype, t.device, tuple(t.shape))
                    for t in (q, k, v, decay, log_decay, beta, S0, z0) + tuple(params)]
        # saved so that autograd refuses a backward after an in-place change of an input (the request holds
        # views of q and k), and for the float64 recomputation of a backward that overflows float32
        # and the map's parameters, written back into the map for the backward: another forward through the
        # same map object (two layers sharing it) writes its own in between
        ctx.save_for_backward(q, k, v, *params)
        ctx.set_materialize_grads(False)
        out_t = torch.from_numpy(np.ascontiguousarray(out)).to(q.device)
        if not spec.return_state:
            return out_t
        m = req.m
        S = torch.from_numpy(np.ascontiguousarray(HN[:, :, :m]).reshape(req.batch_shape + (req.f, m)))
        z = torch.from_numpy(np.ascontiguousarray(HN[:, :, m]).reshape(req.batch_shape + (req.f,)))
        return out_t, S.to(q.device), z.to(q.device)

    @staticmethod
    @_first_order_only
    def backward(ctx, grad_out, grad_S=None, grad_z=None):
        with _params_held(ctx.spec.param_names):
            return _LinearAttentionFunction._backward(ctx, grad_out, grad_S, grad_z)

    @staticmethod
    def _backward(ctx, grad_out, grad_S=None, grad_z=None):
        spec, req = ctx.spec, ctx.req
        meta = ctx.meta
        if grad_out is None:
            grad_out = np.zeros(req.batch_shape + (req.n, req.m), dtype=req.dtype)
        grad_state = None
        if grad_S is not None or grad_z is not None:
            gS = np.zeros(req.batch_shape + (req.f, req.m)) if grad_S is None else _host(grad_S)
            gz = np.zeros(req.batch_shape + (req.f,)) if grad_z is None else _host(grad_z)
            grad_state = (gS, gz)
        q, k, v, *params = ctx.saved_tensors
        if params:
            _write_map_params(spec.fmap, spec.param_names, params, _host_array)
        res = _gradfront.backward_after_forward(req, ctx.nd, _host(grad_out), grad_state,
                                                (_host(q), _host(k), _host(v)), ctx.kw)

        def conv(a, i):
            if a is None or meta[i] is None or not ctx.needs_input_grad[i + 1]:
                return None
            dtype, device, shape = meta[i]
            return _to_tensor(a, torch.empty(0, dtype=dtype, device=device), shape)

        dS0 = dz0 = None
        if res.d_initial_state is not None:
            dS0, dz0 = conv(res.d_initial_state.S, 6), conv(res.d_initial_state.z, 7)
        dparams = [conv((res.d_params or {}).get(name), 8 + j) for j, name in enumerate(spec.param_names)]
        return (None, conv(res.dq, 0), conv(res.dk, 1), conv(res.dv, 2), conv(res.d_decay, 3),
                conv(res.d_log_decay, 4), conv(res.d_beta, 5), dS0, dz0, *dparams)


class _ShortConvFunction(torch.autograd.Function):
    """The layer's causal depthwise convolution on CPU tensors by :mod:`linattn_nb.ops._shortconv`."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        from .ops._shortconv import short_conv

        w = weight.detach()[:, 0, :].numpy()
        ctx.save_for_backward(x, weight)
        y = short_conv(x.detach().numpy(), w, None if bias is None else bias.detach().numpy())
        return torch.from_numpy(y)

    @staticmethod
    @_first_order_only
    def backward(ctx, g):
        from .ops._shortconv import short_conv_vjp

        x, weight = ctx.saved_tensors
        dx, dw, db = short_conv_vjp(x.detach().numpy(), weight.detach()[:, 0, :].numpy(), g.detach().numpy())
        db = torch.from_numpy(db).to(weight.dtype) if ctx.needs_input_grad[2] else None
        return torch.from_numpy(dx), torch.from_numpy(dw[:, None, :]).to(weight.dtype), db


def _short_conv(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """``conv`` (depthwise, padding K - 1) on ``x`` (B, N, C) as a causal convolution, (B, N, C): the
    package's kernel for float32/float64 CPU tensors, torch's convolution otherwise."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and conv.weight.dtype == x.dtype:
        return _ShortConvFunction.apply(x.contiguous(), conv.weight, conv.bias)
    return conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)


def _tensor_or_value(name: str, x):
    """Split an optional rule input: ``(tensor, None)`` for a tensor, ``(None, value)`` otherwise."""
    if isinstance(x, torch.Tensor):
        _check_tensor(name, x, floating=False)
        return x, None
    if x is not None and hasattr(x, "__cuda_array_interface__"):
        raise TypeError(f"{name}: pass a torch.Tensor (or a float / NumPy array), got {type(x).__name__}")
    return None, x


def linear_attention(q, k, v, *, feature_map="elu", causal=False, method="auto", eps=DEFAULT_EPS,
                     check_finite=True, initial_state=None, return_state=False, decay=None, log_decay=None,
                     beta=None, normalize=None, feature_map_params=None):
    r"""Differentiable linear attention on torch tensors (the Numba kernels of :func:`linattn_nb.linear_attention`).

    Same computation, arguments and errors as :func:`linattn_nb.linear_attention`; gradients flow
    to every tensor that requires grad.  See docs/guide/gradients.md.

    Parameters
    ----------
    q, k : torch.Tensor, shape (..., N, D)
    v : torch.Tensor, shape (..., N, M)
        float16, float32 or float64 (promoted as by :func:`linattn_nb.linear_attention`; each gradient
        in its input's dtype), all on the CPU (read in place) or all on one CUDA device.
    feature_map, causal, method, eps, normalize
        As for :func:`linattn_nb.linear_attention` (the map needs a
        :meth:`~linattn_nb.feature_maps.FeatureMap.vjp`; ``"quadratic"`` runs the float64
        references, forward and backward).
    check_finite : bool, default True
        Refuse NaN/inf in the inputs (and in ``grad_out`` in the backward).
    initial_state : LinearState or tuple (S, z[, position]), optional
        ``S`` (..., D_phi, M) and ``z`` (..., D_phi) tensors; both get gradients when they require
        grad (segment-wise training).
    return_state : bool, default False
        Also return the final state as a :class:`LinearState` of float64 tensors ``S``, ``z``,
        whose gradients flow into the backward.
    decay, log_decay, beta : torch.Tensor, float or array_like, optional
        As for :func:`linattn_nb.linear_attention`; tensors that require grad get gradients summed
        back to their shape.
    feature_map_params : dict of str to torch.Tensor, optional
        Values for the map's trainable parameters, by the names of ``feature_map.parameters()``
        (e.g. Hedgehog's ``"W"`` and ``"b"``), written into the map's own arrays before the forward;
        they receive the gradients ``d_params``.

    Returns
    -------
    out : torch.Tensor, shape (..., N, M)
        In the promoted input dtype, on the inputs' device.
    state : LinearState
        Only with ``return_state=True``: float64 tensors ``S``, ``z``, the
        position after the last token and the update rule.

    Raises
    ------
    TypeError
        A non-tensor ``q``, ``k``, ``v`` (or state, or parameter); dtypes
        NumPy lacks (bfloat16), integer, boolean or complex tensors; sparse
        tensors.
    ValueError
        Tensors on different devices, unknown parameter names, parameters
        holding NaN or inf (with ``check_finite``), and everything
        :func:`linattn_nb.linear_attention` refuses.

    Warns
    -----
    RuntimeWarning
        Once per process, when torch runs more than one thread and was imported before
        :mod:`linattn_nb`, so that torch's OpenMP threads spin between ops (docs/threads.md).

    Examples
    --------
    >>> import torch
    >>> from linattn_nb.torch import linear_attention
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(2, 4, 32, 8, generator=g, requires_grad=True) for _ in range(3))
    >>> out = linear_attention(q, k, v, causal=True, method="quadratic")
    >>> out.shape
    torch.Size([2, 4, 32, 8])
    >>> out.square().sum().backward()
    >>> q.grad.shape == q.shape
    True
    """
    check_finite, return_state = check_bool("check_finite", check_finite), check_bool("return_state", return_state)
    q, k, v = (_check_tensor(nm, x) for nm, x in (("q", q), ("k", k), ("v", v)))
    _warn_if_torch_spins()
    fmap = fm.resolve(feature_map)
    decay_t, decay_val = _tensor_or_value("decay", decay)
    log_decay_t, log_decay_val = _tensor_or_value("log_decay", log_decay)
    beta_t, beta_val = _tensor_or_value("beta", beta)
    S0 = z0 = None
    position, state_rule = 0, None
    if initial_state is not None:
        from ._frontend import parse_state

        S0, z0, position = parse_state(initial_state)
        S0, z0 = _check_tensor("initial_state.S", S0), _check_tensor("initial_state.z", z0)
        state_rule = getattr(initial_state, "rule", None)
    names, params = _map_param_tensors(fmap, feature_map_params, check_finite)
    named = [("q", q), ("k", k), ("v", v), ("decay", decay_t), ("log_decay", log_decay_t), ("beta", beta_t),
             ("initial_state.S", S0), ("initial_state.z", z0)]
    named += [(f"feature_map_params[{n!r}]", t) for n, t in zip(names, params)]
    _check_one_device(named)
    device = "cuda" if q.device.type == "cuda" else "cpu"
    if device == "cuda" and params:
        raise ValueError("feature_map_params: maps with parameters are applied on the host; they are not "
                         "supported for CUDA tensors")
    torch_map = _TORCH_MAPS.get(type(fmap))
    # torch's elementwise kernels take other code paths (other exp/expm1 roundings) for strided and
    # expanded tensors: contiguous q, k (a differentiable no-op when they already are) make the result
    # and the gradients those of contiguous copies, bit for bit
    q, k = q.contiguous(), k.contiguous()
    if torch_map is not None and device == "cuda" and q.dtype != torch.float16 and k.dtype != torch.float16:
        q, k, fmap = torch_map(q), torch_map(k), _PRECOMPUTED
    spec = _Spec(fmap, causal, method, device, eps, check_finite, normalize, bool(return_state), decay_val,
                 log_decay_val, beta_val, position, state_rule, names)
    res = _LinearAttentionFunction.apply(spec, q, k, v, decay_t, log_decay_t, beta_t, S0, z0, *params)
    if not return_state:
        return res
    out, S, z = res
    return out, LinearState(S, z, position + q.shape[-2], spec.rule)


# ---------------------------------------------------------------------------
# Diagonal-plus-low-rank attention
# ---------------------------------------------------------------------------
def _host_array(x: torch.Tensor) -> np.ndarray:
    """A NumPy array of tensor ``x``: a view of its memory on the CPU, a host copy of a CUDA tensor."""
    x = x.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    return x.resolve_conj().resolve_neg().numpy()


@dataclass
class _DPLRSpec:
    """The non-tensor arguments of one :func:`dplr_attention` call (carried through ``Function.apply``)."""

    values: dict  # keyword arguments passed to the NumPy functions as they are
    names: tuple  # the keywords of the tensor arguments after q, k, v (a, b, log_diag, beta, a rule's arrays)
    param_names: tuple
    fmap: Any
    state: Optional[tuple]  # (position, rule) of a tensor initial state
    return_state: bool
    shapes: tuple = ()  # out, S, z (set by the forward)
    rule: str = "dplr"
    position: int = 0


def _dplr_arguments(spec: _DPLRSpec, q, k, v, S0, z0, rest):
    """The NumPy arguments of the call: arrays of the tensors, the map's parameters written into the map."""
    n = len(spec.names)
    tensors, params = rest[:n], rest[n:]
    if params:
        _write_map_params(spec.fmap, spec.param_names, params, _host_array)
    kw = dict(spec.values)
    kw.update({name: _host_array(t) for name, t in zip(spec.names, tensors)})
    if spec.state is not None:
        position, rule = spec.state
        kw["initial_state"] = LinearState(_host_array(S0), _host_array(z0), position, rule)
    return (_host_array(q), _host_array(k), _host_array(v)), kw


class _DPLRFunction(torch.autograd.Function):
    """Forward through :func:`linattn_nb.dplr.dplr_attention`, backward through
    :func:`linattn_nb.dplr.dplr_attention_vjp` (see :func:`dplr_attention`)."""

    @staticmethod
    def forward(ctx, spec: _DPLRSpec, q, k, v, S0, z0, *rest):
        with _params_held(spec.param_names):
            return _DPLRFunction._forward(ctx, spec, q, k, v, S0, z0, *rest)

    @staticmethod
    def _forward(ctx, spec: _DPLRSpec, q, k, v, S0, z0, *rest):
        from . import dplr as _dplr

        qkv, kw = _dplr_arguments(spec, q, k, v, S0, z0, rest)
        out, st = _dplr.dplr_attention(*qkv, return_state=True, **kw)
        spec.shapes = (out.shape, st.S.shape, st.z.shape)
        spec.rule, spec.position = st.rule, st.position
        ctx.spec = spec
        # saved so that autograd refuses a backward after an in-place change of an input
        ctx.save_for_backward(q, k, v, S0, z0, *rest)
        ctx.set_materialize_grads(False)
        out_t = torch.from_numpy(np.ascontiguousarray(out)).to(q.device)
        if not spec.return_state:
            return out_t
        S = torch.from_numpy(np.ascontiguousarray(st.S)).to(q.device)
        z = torch.from_numpy(np.ascontiguousarray(st.z)).to(q.device)
        return out_t, S, z

    @staticmethod
    @_first_order_only
    def backward(ctx, grad_out, grad_S=None, grad_z=None):
        with _params_held(ctx.spec.param_names):
            return _DPLRFunction._backward(ctx, grad_out, grad_S, grad_z)

    @staticmethod
    def _backward(ctx, grad_out, grad_S=None, grad_z=None):
        from . import dplr as _dplr

        spec = ctx.spec
        q, k, v, S0, z0, *rest = ctx.saved_tensors  # raises if an input was modified in place
        qkv, kw = _dplr_arguments(spec, q, k, v, S0, z0, rest)
        out_shape, S_shape, z_shape = spec.shapes
        go = np.zeros(out_shape) if grad_out is None else _host_array(grad_out)
        grad_state = None
        if grad_S is not None or grad_z is not None:
            gS = np.zeros(S_shape) if grad_S is None else _host_array(grad_S)
            gz = np.zeros(z_shape) if grad_z is None else _host_array(grad_z)
            grad_state = LinearState(gS, gz, spec.position, spec.rule)
        g = _dplr.dplr_attention_vjp(*qkv, go, grad_state=grad_state, **kw)
        inputs = (q, k, v, S0, z0, *rest)

        def conv(a, i):
            t = inputs[i]
            if a is None or t is None or not ctx.needs_input_grad[i + 1]:
                return None
            return _to_tensor(a, t, tuple(t.shape))

        dS0 = dz0 = None
        if g.d_initial_state is not None:
            dS0, dz0 = conv(g.d_initial_state.S, 3), conv(g.d_initial_state.z, 4)
        n = len(spec.names)
        d_named = [conv(g.d_inputs.get(name), 5 + j) for j, name in enumerate(spec.names)]
        d_params = [conv((g.d_params or {}).get(name), 5 + n + j) for j, name in enumerate(spec.param_names)]
        return (None, conv(g.dq, 0), conv(g.dk, 1), conv(g.dv, 2), dS0, dz0, *d_named, *d_params)


def dplr_attention(q, k, v, *, rule=None, a=None, b=None, log_diag=None, beta=None, feature_map="elu",
                   method="auto", normalize=False, eps=DEFAULT_EPS, check_finite=True, initial_state=None,
                   return_state=False, feature_map_params=None, **rule_arguments):
    r"""Differentiable diagonal-plus-low-rank attention on torch tensors (:func:`linattn_nb.dplr_attention`).

    The general form (``a``, ``b``, ``log_diag``, ``beta``) or a named rule of the family
    (:func:`linattn_nb.rules.dplr_rule_names`); the backward calls
    :func:`linattn_nb.dplr.dplr_attention_vjp`.  Arguments that are not tensors are constants.

    Parameters
    ----------
    q : torch.Tensor, shape (..., N, D)
    k : torch.Tensor, shape (..., N, D), or (..., N, r, D) with ``r`` writes per token
    v : torch.Tensor, shape (..., N, M), or (..., N, r, M) with k
        float16, float32 or float64 (the outputs in the widest; each gradient in its input's
        dtype).  CPU tensors are read in place; CUDA tensors are computed on the host (there is no
        GPU kernel of this recurrence).
    rule : str, optional
        A named rule; its arguments are passed as keywords (``**rule_arguments``).
    a, b : torch.Tensor or array_like, shape (..., N, D_phi) or (..., N, r, D_phi), optional
    log_diag : torch.Tensor or array_like, shape (..., N) or (..., N, D_phi), optional
    beta : torch.Tensor or array_like, shape (..., N) or (..., N, r), optional
        As for :func:`linattn_nb.dplr_attention`; tensors receive gradients in their own shape (0
        for ``log_diag`` where it is ``-inf``, a reset).
    feature_map, method, normalize, eps
        As for :func:`linattn_nb.dplr_attention`.
    check_finite : bool, default True
        Refuse NaN/inf in the inputs and in the backward's ``grad_out``.
    initial_state : LinearState, optional
        A state from an earlier call of the same rule; when its ``S`` and ``z`` are tensors they
        receive gradients.
    return_state, feature_map_params
        As for :func:`linear_attention`.
    **rule_arguments : torch.Tensor or array_like
        The named rule's arguments (see :func:`linattn_nb.dplr_attention`).

    Returns
    -------
    out : torch.Tensor, shape (..., N, M)
        On the inputs' device.
    state : LinearState
        Only with ``return_state=True``, as for :func:`linear_attention` (the rule ``"dplr"`` for
        the general form).

    Raises
    ------
    TypeError, ValueError
        As for :func:`linear_attention` (``out=`` is a TypeError here), and what
        :func:`linattn_nb.dplr_attention` refuses.

    Examples
    --------
    KDA with per-feature gates, every input trained:

    >>> import torch
    >>> from linattn_nb.torch import dplr_attention
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(2, 16, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    >>> decay = (0.5 + 0.5 * torch.rand(2, 16, 8, generator=g, dtype=torch.float64)).requires_grad_()
    >>> beta = torch.rand(2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    >>> out = dplr_attention(q, k, v, rule="kda", decay=decay, beta=beta, feature_map="l2")
    >>> out.shape
    torch.Size([2, 16, 8])
    >>> out.square().sum().backward()
    >>> decay.grad.shape, beta.grad.shape
    (torch.Size([2, 16, 8]), torch.Size([2, 16]))
    """
    check_finite, return_state = check_bool("check_finite", check_finite), check_bool("return_state", return_state)
    q, k, v = (_check_tensor(nm, x) for nm, x in (("q", q), ("k", k), ("v", v)))
    if "out" in rule_arguments:
        raise TypeError("out= is not supported for torch tensors: use the returned tensor")
    fmap = fm.resolve(feature_map)
    values = dict(rule=rule, feature_map=fmap, method=method, normalize=normalize, eps=eps,
                  check_finite=check_finite)
    names, tensors = [], []
    for nm, x in (("a", a), ("b", b), ("log_diag", log_diag), ("beta", beta), *rule_arguments.items()):
        t, val = _tensor_or_value(nm, x)
        if t is not None:
            names.append(nm)
            tensors.append(t)
        elif val is not None:
            values[nm] = val
    S0 = z0 = None
    state = None
    if initial_state is not None:
        S, z = getattr(initial_state, "S", None), getattr(initial_state, "z", None)
        if isinstance(S, torch.Tensor) or isinstance(z, torch.Tensor):
            S0, z0 = _check_tensor("initial_state.S", S), _check_tensor("initial_state.z", z)
            made_by = getattr(initial_state, "rule", None)
            if made_by is None:  # no rule recorded: taken as this call's own, as the NumPy function does
                made_by = "dplr" if rule is None else rules.get_dplr_rule(rule).name
            state = (int(getattr(initial_state, "position", 0)), made_by)
        else:
            values["initial_state"] = initial_state  # NumPy arrays (constants) or something NumPy refuses
    param_names, params = _map_param_tensors(fmap, feature_map_params, check_finite)
    named = [("q", q), ("k", k), ("v", v), ("initial_state.S", S0), ("initial_state.z", z0), *zip(names, tensors)]
    named += [(f"feature_map_params[{n!r}]", t) for n, t in zip(param_names, params)]
    _check_one_device(named)
    if rule is not None and torch.is_grad_enabled() and any(t is not None and t.requires_grad for _, t in named):
        from .dplr import check_pullback

        check_pullback(rules.get_dplr_rule(rule))  # refused now, not at the backward
    spec = _DPLRSpec(values, tuple(names), param_names, fmap, state, bool(return_state))
    res = _DPLRFunction.apply(spec, q, k, v, S0, z0, *tensors, *params)
    if not return_state:
        return res
    out, S, z = res
    return out, LinearState(S, z, spec.position, spec.rule)


# ---------------------------------------------------------------------------
# Module
# ---------------------------------------------------------------------------
#: The layer's ``decay`` options and the form of factor each gives (:data:`linattn_nb.rules.FACTOR_KINDS`).
_DECAY_FACTOR = {None: None, "head": "scalar", "token": "scalar", "gate": "feature"}  # not a rule: the options
#: The forms of a DPLR rule's arguments (:attr:`linattn_nb.rules.DPLRRule.layer`): form -> (per feature
#: (else per token), per sub-step on a rule with sub-steps, the map of the projection ``W x + b``).
_DPLR_FORMS = {
    "feature_gate": (True, False, lambda a: nn.functional.logsigmoid(a) / 16.0),
    "feature_unit": (True, False, torch.sigmoid),
    "unit_key": (True, False, lambda a: nn.functional.normalize(a, dim=-1)),
    "token_unit": (False, True, torch.sigmoid),
    "token_decay": (False, False, lambda a: -nn.functional.softplus(a)),
}
#: ``token_decay``'s initial bias: ``exp(-softplus(b)) = 0.95``, as ``decay="token"``.
_DECAY_BIAS = float(np.log(np.expm1(-np.log(0.95))))


def _dplr_layer_rules() -> list:
    """The diagonal-plus-low-rank rules :class:`LinearAttention` can parameterise (a ``layer`` form)."""
    return tuple(name for name in rules.dplr_rule_names() if rules.get_dplr_rule(name).layer)


def _dplr_layer_rule(rule, decay, causal):
    """The :class:`~linattn_nb.rules.DPLRRule` of a layer's ``rule``, None for the update rules of
    :func:`linattn_nb.rules.rule_names`; ValueError for a DPLR rule without a layer form, with ``decay``
    (the rule brings its own) or without ``causal``."""
    if not isinstance(rule, str) or rule not in rules.dplr_rule_names():
        return None
    spec = rules.get_dplr_rule(rule)
    if not spec.layer:
        raise ValueError(f"rule {rule!r} has no layer form yet (its arguments are not made from the input); "
                         f"the layer takes {rules.rule_names() + _dplr_layer_rules()}")
    unknown = {name: form for name, form in spec.layer.items() if form not in _DPLR_FORMS}
    if unknown:
        raise ValueError(f"rule {rule!r} asks for layer forms the layer does not know: {unknown}; it knows "
                         f"{tuple(_DPLR_FORMS)}")
    if decay is not None:
        raise ValueError(f"rule {rule!r} makes its own {', '.join(spec.layer)} from the input: pass decay=None")
    if not causal:
        raise ValueError(f"rule {rule!r} is a recurrence: it needs causal=True")
    return spec


def _layer_map(feature_map):
    """The layer's map (:func:`linattn_nb.feature_maps.resolve`), built without the warning on a random map
    given by name: the layer keeps one map and fixes its ``W``."""
    if isinstance(feature_map, str):
        try:
            feature_map = fm.get(feature_map)
        except KeyError as exc:
            raise ValueError(f"feature_map: {exc.args[0]}") from None
    return fm.resolve(feature_map)


def _check_positive_ints(**values) -> None:
    for name, val in values.items():
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")


def _layer_rule(rule: str, decay):
    """The registered update rule that the layer's ``rule`` and ``decay`` options select
    (:func:`linattn_nb.rules.rule_for`); ValueError naming the options that fit when none does."""
    r = rules.get_rule(rule)

    def select(option):
        factor = _DECAY_FACTOR[option]
        if r.forgets and factor != r.factor:
            raise ValueError(f"rule {rule!r} forgets by itself: {r.hint}")
        return rules.rule_for(factor=factor, beta=r.beta)

    try:
        return select(decay)
    except ValueError as exc:
        fits = []
        for option in _DECAY_FACTOR:
            try:
                select(option)
                fits.append(option)
            except ValueError:
                pass
        raise ValueError(f"decay={decay!r} cannot be combined with rule={rule!r}; use decay= one of "
                         f"{', '.join(map(repr, fits))}") from exc


class LinearAttention(nn.Module):
    r"""Multi-head linear attention layer on the Numba kernels (``(B, N, d_model) -> (B, N, d_model)``).

    ``x`` is projected to ``H`` heads of queries, keys and values (``(B, H, N, D)``), passed through
    :func:`linear_attention` (or :func:`dplr_attention`) and projected back; ``rule`` and ``decay``
    select the update rule (:func:`linattn_nb.rules.rule_for`).  See docs/guide/gradients.md.

    Parameters
    ----------
    d_model : int
        Model width.
    num_heads : int
    head_dim : int, optional
        Query/key width per head; default ``d_model // num_heads``.
    value_dim : int, optional
        Value width per head; default ``head_dim``.
    feature_map : str or FeatureMap, default "elu"
        Applied to queries and keys (one map shared by the heads); the delta rule wants unit-norm
        keys ("silu_l2", "l2").
    causal : bool, default True
        Decay and the delta rule need True.
    rule : str, default "additive"
        A registered update rule (:func:`linattn_nb.rules.rule_names`), or a diagonal-plus-low-rank
        rule with a layer form (:attr:`linattn_nb.rules.DPLRRule.layer`: ``"kda"``, ``"rwkv7"``,
        ``"delta_product"``, ``"gated_delta_product"``), run with ``decay=None``.
    decay : {None, "head", "token", "gate"}, default None
        A forgetting factor per head, per head and token, or per head, token and feature (GLA's
        gate; not with a rule that takes ``beta``).
    n_h : int, optional
        Only for a rule with sub-steps (:attr:`linattn_nb.rules.DPLRRule.substeps`, DeltaProduct):
        keys, values (and ``beta``) per token and head; default 2.
    method, normalize, eps
        Passed to :func:`linear_attention` (``normalize=None``: the rule's convention).
    conv_size : int, optional
        Width of a causal depthwise convolution on the projected queries, keys and values.
    learn_feature_map : bool, default False
        Make the map's parameters (``feature_map.parameters()``, materialised to their defaults
        first) :class:`torch.nn.Parameter` s of the module, which then owns the map.
    bias : bool, default False
        Biases in the q, k, v and output projections.
    check_finite : bool, default True
    device, dtype : optional
        For the parameters (float16, float32 or float64).

    Attributes
    ----------
    feature_map : FeatureMap
        The map instance used by every call.
    feature_map_params : torch.nn.ParameterDict
        The map's parameters (empty unless ``learn_feature_map``).
    feature_map_projection : torch.Tensor or None
        A random map's projection ``W`` (``"favor+"``, ``"rff"``; shape ``(m, head_dim)``, in the layer's
        dtype): a persistent buffer, drawn at construction (a map given by name from torch's generator,
        so ``torch.manual_seed`` fixes it; a map instance from its own ``seed``, or its given ``W``), that
        ``state_dict``, ``.to()`` and ``copy.deepcopy`` carry and every call computes with.  None for the
        other maps and for a projection learned through ``learn_feature_map``.
    update_rule : str
        The name of the rule that ``rule`` and ``decay`` select.

    Raises
    ------
    TypeError
        ``causal``, ``learn_feature_map``, ``bias`` or ``check_finite`` not a bool.

    Examples
    --------
    >>> import torch
    >>> from linattn_nb.torch import LinearAttention
    >>> _ = torch.manual_seed(0)
    >>> layer = LinearAttention(32, 4, rule="delta", feature_map="silu_l2", decay="token", method="quadratic")
    >>> x = torch.randn(2, 16, 32)
    >>> y = layer(x)
    >>> y.shape
    torch.Size([2, 16, 32])
    >>> y.square().mean().backward()
    >>> layer.q_proj.weight.grad.shape
    torch.Size([32, 32])
    """

    def __init__(self, d_model: int, num_heads: int, *, head_dim: Optional[int] = None,
                 value_dim: Optional[int] = None, feature_map="elu", causal: bool = True, rule: str = "additive",
                 decay: Optional[str] = None, n_h: Optional[int] = None, method: str = "auto",
                 normalize: Optional[bool] = None, eps: Optional[float] = DEFAULT_EPS,
                 conv_size: Optional[int] = None, learn_feature_map: bool = False, bias: bool = False,
                 check_finite: bool = True, device=None, dtype=None):
        super().__init__()
        causal, learn_feature_map = check_bool("causal", causal), check_bool("learn_feature_map", learn_feature_map)
        bias, check_finite = check_bool("bias", bias), check_bool("check_finite", check_finite)
        _check_positive_ints(d_model=d_model, num_heads=num_heads)
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}; pass head_dim")
            head_dim = d_model // num_heads
        value_dim = head_dim if value_dim is None else value_dim
        _check_positive_ints(head_dim=head_dim, value_dim=value_dim)
        self.dplr = _dplr_layer_rule(rule, decay, causal)
        if self.dplr is None:
            if not isinstance(rule, str) or rule not in rules.rule_names():
                raise ValueError(f"rule must be one of {rules.rule_names() + _dplr_layer_rules()}, got {rule!r}")
            if decay not in tuple(_DECAY_FACTOR):
                raise ValueError(f"decay must be one of {tuple(_DECAY_FACTOR)}, got {decay!r}")
            if not causal and (rules.get_rule(rule).has_inputs or decay is not None):
                raise ValueError(f"decay={decay!r} and rule={rule!r}: a decay and the rules with inputs are "
                                 "recurrences, they need causal=True")
        if n_h is not None:
            _check_positive_ints(n_h=n_h)
            if self.dplr is None or not self.dplr.substeps:
                raise ValueError(f"n_h applies only to rules with sub-steps (DPLRRule.substeps); rule {rule!r} "
                                 "has none")
        self.n_h = (2 if n_h is None else n_h) if self.dplr is not None and self.dplr.substeps else None
        # checked here as the first call would check them: a misconfigured layer is refused when built
        from .dplr import DPLR_METHODS
        from .ops.registry import METHOD_NAMES

        methods = DPLR_METHODS if self.dplr is not None else METHOD_NAMES
        if not isinstance(method, str):
            raise TypeError(f"method must be a string, got {type(method).__name__}")
        if method not in methods:
            raise ValueError(f"method must be one of {methods}, got {method!r}")
        if normalize is not None:
            normalize = check_bool("normalize", normalize)
        check_eps(eps)  # not kept: the default marker reads config.DEFAULT_EPS at each call
        if dtype is not None and dtype not in (torch.float16, torch.float32, torch.float64):
            raise TypeError(f"dtype must be torch.float16, torch.float32 or torch.float64 (or None), got {dtype}")
        self.update_rule = rule if self.dplr is not None else _layer_rule(rule, decay).name
        if conv_size is not None and (isinstance(conv_size, bool) or not isinstance(conv_size, int)
                                      or conv_size < 1):
            raise ValueError(f"conv_size must be a positive int or None, got {conv_size!r}")
        kw = dict(device=device, dtype=dtype)
        self.d_model, self.num_heads, self.head_dim, self.value_dim = d_model, num_heads, head_dim, value_dim
        self.causal, self.rule, self.decay, self.method = causal, rule, decay, method
        self.normalize, self.eps, self.check_finite, self.conv_size = normalize, eps, check_finite, conv_size
        self.feature_map = _layer_map(feature_map)
        if not isinstance(feature_map, str) and (learn_feature_map
                                                 or isinstance(self.feature_map, fm.RandomFeatureMap)):
            # the layer fixes a random map's W (rounded to its dtype) and materialises a learnable map's
            # parameters: on its own copy, so that the caller's instance gives the results it gave before
            self.feature_map = copy.deepcopy(self.feature_map)
        self.feature_dim = int(self.feature_map.output_dim(head_dim))
        H, n = num_heads, self.n_h or 1
        self.q_proj = nn.Linear(d_model, H * head_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(d_model, H * n * head_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(d_model, H * n * value_dim, bias=bias, **kw)
        self.out_proj = nn.Linear(H * value_dim, d_model, bias=bias, **kw)
        if conv_size is not None:
            ch = H * (head_dim + n * (head_dim + value_dim))
            self.conv = nn.Conv1d(ch, ch, conv_size, groups=ch, padding=conv_size - 1, **kw)
        self.beta_proj = nn.Linear(d_model, H, **kw) if self.dplr is None and rules.get_rule(rule).beta else None
        # a diagonal-plus-low-rank rule: one projection per argument, of the form its rule module names
        self.dplr_proj = nn.ModuleDict({name: nn.Linear(d_model, H * self._dplr_width(form), **kw)
                                        for name, form in (self.dplr.layer.items() if self.dplr is not None else ())})
        for name, form in (self.dplr.layer.items() if self.dplr is not None else ()):
            if form == "token_decay":
                with torch.no_grad():
                    self.dplr_proj[name].bias.fill_(_DECAY_BIAS)
        if decay == "head":
            gamma = 1.0 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float64))
            self.decay_logit = nn.Parameter(torch.logit(gamma).to(device=device,
                                                                   dtype=dtype or torch.get_default_dtype()))
        elif decay == "token":
            self.decay_proj = nn.Linear(d_model, H, **kw)
            with torch.no_grad():  # a_t = exp(-softplus(b)) ~ 0.95 at the start
                self.decay_proj.bias.fill_(float(np.log(np.expm1(-np.log(0.95)))))
        elif decay == "gate":  # not a rule: the layer's option
            self.gate_proj = nn.Linear(d_model, H * self.feature_dim, **kw)
        self.feature_map_params = nn.ParameterDict()
        if learn_feature_map:
            if hasattr(self.feature_map, "materialize"):
                self.feature_map.materialize(head_dim)
            stored = _map_parameters(self.feature_map)
            if not stored:
                raise ValueError(f"learn_feature_map=True, but the feature map {self.feature_map.name!r} has no "
                                 "trainable parameters")
            for name, arr in stored.items():
                self.feature_map_params[name] = nn.Parameter(
                    torch.tensor(np.asarray(arr), dtype=dtype or torch.get_default_dtype(), device=device))
        # a random map's W: a buffer (not drawn anew by each layer call, saved with the layer); drawn last, so
        # that the projections' initial values do not depend on the map
        projection = None
        if isinstance(self.feature_map, fm.RandomFeatureMap) and "projection" not in self.feature_map_params:
            if isinstance(feature_map, str):  # the layer's own map: its W from torch's generator
                self.feature_map.redraw(int(torch.randint(0, 2 ** 62, ())))
            self.feature_map.materialize(head_dim)
            projection = torch.tensor(self.feature_map.W, dtype=dtype or torch.get_default_dtype())
            self.feature_map.W = projection.to(torch.float64).numpy().copy()  # the values the buffer holds
            projection = projection.to(device)
        self.register_buffer("feature_map_projection", projection)  # None: no state_dict entry

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"value_dim={self.value_dim}, feature_map={self.feature_map.name!r}, causal={self.causal}, "
                f"rule={self.rule!r}, decay={self.decay!r}, method={self.method!r}"
                + (f", n_h={self.n_h}" if self.n_h else ""))

    def _dplr_width(self, form) -> int:
        """Projection outputs per head of a DPLR argument's form."""
        per_feature, per_step, _ = _DPLR_FORMS[form]
        return self.feature_dim if per_feature else (self.n_h or 1) if per_step else 1

    def _map(self):
        """The map of this call: :attr:`feature_map`, with a random map's ``W`` the buffer's current values
        (a changed buffer replaces :attr:`feature_map` by a copy: a map shared with others is not written)."""
        fmap, w = self.feature_map, self.feature_map_projection
        if w is None:
            return fmap
        w = w.detach().to(device="cpu", dtype=torch.float64).numpy()
        if fmap.W is None or fmap.W.shape != w.shape or not np.array_equal(fmap.W, w):
            fmap = copy.copy(fmap)
            fmap.W, fmap.dim = w.copy(), int(w.shape[1])
            self.feature_map = fmap
        return fmap

    def _heads(self, t, *d):
        B, N, _ = t.shape
        return t.reshape(B, N, self.num_heads, *d).transpose(1, 2)  # (B, H, N, *d)

    def forward(self, x, *, initial_state=None, return_state: bool = False):
        """Attend over ``x`` of shape (B, N, d_model).

        Parameters
        ----------
        x : torch.Tensor, shape (B, N, d_model)
        initial_state : LinearState, optional
            A state returned by an earlier call with ``return_state=True``
            (tensors ``S`` (B, H, D_phi, M), ``z`` (B, H, D_phi)); not with
            ``conv_size`` (the convolution would need the previous tokens).
        return_state : bool, default False

        Returns
        -------
        y : torch.Tensor, shape (B, N, d_model)
        state : LinearState
            Only with ``return_state=True``.
        """
        _check_tensor("x", x)
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (B, N, d_model={self.d_model}), got {tuple(x.shape)}")
        if initial_state is not None and self.conv_size is not None:
            raise ValueError("initial_state with conv_size: the convolution would need the previous segment's "
                             "last tokens, which the state does not hold")
        B, N, _ = x.shape
        H, D, M = self.num_heads, self.head_dim, self.value_dim
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.conv_size is not None:
            qkv = _short_conv(torch.cat([q, k, v], dim=-1), self.conv)  # (B, N, C)
            q, k, v = qkv.split([q.shape[-1], k.shape[-1], v.shape[-1]], dim=-1)
        step = () if self.n_h is None else (self.n_h,)  # k, v (B, H, N, n_h, D) on a rule with sub-steps
        q, k, v = self._heads(q, D), self._heads(k, *step, D), self._heads(v, *step, M)
        kw = dict(feature_map=self._map(), causal=self.causal, method=self.method, eps=self.eps,
                  check_finite=self.check_finite, normalize=self.normalize, initial_state=initial_state,
                  return_state=return_state)
        if self.beta_proj is not None:
            kw["beta"] = torch.sigmoid(self.beta_proj(x)).transpose(1, 2)  # (B, H, N)
        if self.decay == "head":
            kw["log_decay"] = nn.functional.logsigmoid(self.decay_logit)[None, :]  # (1, H)
        elif self.decay == "token":
            kw["log_decay"] = -nn.functional.softplus(self.decay_proj(x)).transpose(1, 2)  # (B, H, N)
        elif self.decay == "gate":  # not a rule: the layer's option
            g = nn.functional.logsigmoid(self.gate_proj(x)) / 16.0
            kw["log_decay"] = g.reshape(B, N, H, self.feature_dim).transpose(1, 2)  # (B, H, N, F)
        if len(self.feature_map_params):
            kw["feature_map_params"] = dict(self.feature_map_params)
        if self.dplr is not None:
            for name, form in self.dplr.layer.items():
                per_feature, per_step, fn = _DPLR_FORMS[form]
                a = fn(self._heads(self.dplr_proj[name](x), self._dplr_width(form)))
                kw[name] = a if per_feature or (per_step and self.n_h) else a[..., 0]  # (B, H, N[, F or n_h])
            del kw["causal"]
            kw["normalize"] = bool(self.normalize)  # None: the family's convention, undivided
            res = dplr_attention(q, k, v, rule=self.rule, **kw)
        else:
            res = linear_attention(q, k, v, **kw)
        o, state = res if return_state else (res, None)
        y = self.out_proj(o.transpose(1, 2).reshape(B, N, H * M))
        return (y, state) if return_state else y
