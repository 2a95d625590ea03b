"""The front end: every public entry point goes through here, once.

Validation, batch flattening, featurisation, the initial state, the method choice and the device
routing of :func:`linear_attention` and :func:`softmax_attention`, and the pieces the states and
the analysis functions share with them.  Design: docs/frontend.md, "The request path".
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import threading
from typing import NamedTuple

import numpy as np

from . import _cuda_dispatch as CD
from . import config
from . import _validate as V
from ._overlap import call_reads, out_overlaps
from ._blas import parallel_entry
from ._workarrays import thread_array
from . import feature_maps as fm
from .device import on_device, resolve_device
from .ops import methods  # noqa: F401  (registers the built-in rules and methods)
from .feature_maps._base import FeatureOverflow
from .ops._finite import NonFiniteResult
from .ops._vec import work_dtype
from .ops.registry import chunk_pair, get_method, grad_pair, select_auto
from .ops.softmax.cpu import softmax_blocked
from .ops.softmax.naive import softmax_attention_quadratic
from .rules import dplr_rule_names, get_rule as get_update_rule, rule_for, rule_names

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


class LinearState(NamedTuple):
    """Recurrent state of linear attention after a sequence (or a prefix): what a call returns.

    A named tuple of plain arrays (the tuple cannot be changed; its arrays are the caller's own, new
    for each call, and writable): what :func:`linattn_nb.linear_attention` returns with
    ``return_state=True`` and takes back as ``initial_state`` to process a long sequence segment by
    segment.  For token-by-token decoding, :class:`linattn_nb.LinearAttentionState` (its
    ``from_linear_state`` and ``to_linear_state`` convert).

    Attributes
    ----------
    S : ndarray, shape (..., D_phi, M)
        ``sum_j phi(k_j) v_j^T`` over the tokens seen.
    z : ndarray, shape (..., D_phi)
        ``sum_j phi(k_j)``.
    position : int
        Number of tokens absorbed, i.e. the position of the next token
        (used by position-dependent feature maps).
    rule : str
        The update rule that made the state; a call with another rule refuses the state.
    """

    S: np.ndarray
    z: np.ndarray
    position: int = 0
    rule: str = "additive"


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------
def host_array(name: str, x) -> np.ndarray:
    """The argument ``name`` as a host array: GPU arrays copied to the host, others ``V.as_host_array``."""
    return CD.to_host(name, x) if on_device(x) else V.as_host_array(name, x)


def check_causal(causal) -> bool:
    """``causal`` as a bool; anything but a bool or NumPy bool raises TypeError."""
    if isinstance(causal, (bool, np.bool_)):
        return bool(causal)
    raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")


def check_method_name(method) -> str:
    if not isinstance(method, str):
        raise TypeError(f"method must be a string, got {type(method).__name__}")
    return method


#: The largest token position: an int64 in the kernels and the state files.
MAX_POSITION = (1 << 63) - 1


def check_position(position, name: str = "initial_state.position") -> int:
    """A token position: a non-negative integer (an integral float is accepted)."""
    if isinstance(position, (bool, np.bool_)) or position is None:
        raise TypeError(f"{name} must be a non-negative integer, got {position!r}")
    if isinstance(position, numbers.Integral):
        position = int(position)
    elif isinstance(position, numbers.Real):
        p = float(position)
        if not math.isfinite(p) or p != int(p):
            raise ValueError(f"{name} must be a non-negative integer, got {position!r}")
        position = int(p)
    else:
        raise TypeError(f"{name} must be a non-negative integer, got {type(position).__name__} {position!r}")
    if position < 0:
        raise ValueError(f"{name} must be >= 0, got {position}")
    if position > MAX_POSITION:
        raise ValueError(f"{name} must be at most 2**63 - 1, got {position}")
    return position


# ---------------------------------------------------------------------------
# Feature maps
# ---------------------------------------------------------------------------
def feature_dim(fmap, d: int) -> int:
    """``fmap.output_dim(d)``, checked to be an integer >= 1."""
    f = fmap.output_dim(d)
    if isinstance(f, (bool, np.bool_)) or not isinstance(f, numbers.Integral) or int(f) < 1:
        raise ValueError(
            f"feature map {getattr(fmap, 'name', type(fmap).__name__)!r} has output_dim({d}) = {f!r}; "
            "it must be an integer >= 1"
        )
    return int(f)


def featurise(fmap, x, *, role: str | None, causal: bool, offset: int = 0, total_length=None,
              dtype=None, name: str = "x") -> np.ndarray:
    """Features ``fmap.apply(x)`` of ``x`` (..., N, D) (``role`` None: the plain call ``fmap(x)``), ``x`` cast
    to ``dtype`` first if given.  Another shape than (..., N, output_dim(D)) raises ValueError naming the map
    and both shapes, before any kernel sees the array; non-float features raise TypeError.
    """
    x = np.asarray(x) if dtype is None else np.asarray(x, dtype=dtype)
    d = int(x.shape[-1])
    f = feature_dim(fmap, d)
    n = int(x.shape[-2])
    if total_length is None:
        total_length = offset + n
    feats = np.asarray(fmap(x) if role is None else
                       fmap.apply(x, role=role, causal=causal, offset=offset, total_length=total_length))
    want = tuple(x.shape[:-1]) + (f,)
    if tuple(feats.shape) != want:
        raise ValueError(
            f"feature map {fmap.name!r} returned features of shape {tuple(feats.shape)} for {name} of shape "
            f"{tuple(x.shape)}; expected {want} (the input's leading dimensions and N, then "
            f"output_dim({d}) = {f})"
        )
    if feats.dtype.kind != "f":
        raise TypeError(f"feature map {fmap.name!r} returned {feats.dtype} features for {name}; "
                        "expected a floating dtype")
    return feats


def host_features(fmap, inline: bool, q, k, v, work, *, causal: bool, position: int, n: int):
    """Flattened (B, N, ·) kernel inputs of a CPU or CUDA-host launcher, or a decode step (None stays None).

    ``inline``: the kernel applies the map itself (q and k as they are), else q and k become features.
    """
    # NumPy-side maps of float16 inputs run in float32 (no float16 overflow or rounding of the
    # features); the kernels take float32 features next to float16 values.
    feat = work if inline else work_dtype(work)
    kw = dict(causal=causal, offset=position, total_length=position + n, dtype=feat)
    if not inline:
        q = None if q is None else featurise(fmap, q, role="query", name="q", **kw)
        k = None if k is None else featurise(fmap, k, role="key", name="k", **kw)
    return tuple(None if x is None else V.flatten_batch(x, w) for x, w in ((q, feat), (k, feat), (v, work)))


# ---------------------------------------------------------------------------
# States
# ---------------------------------------------------------------------------
def parse_state(initial_state, name: str = "initial_state"):
    """``(S, z, position)`` of a LinearState, a tuple ``(S, z[, position])`` or an object with .S, .z.

    The position is checked (:func:`check_position`); errors name ``name``.
    """
    if isinstance(initial_state, tuple) and len(initial_state) in (2, 3):
        S0, z0 = initial_state[0], initial_state[1]
        position = initial_state[2] if len(initial_state) == 3 else 0
    elif hasattr(initial_state, "S") and hasattr(initial_state, "z"):
        S0, z0 = initial_state.S, initial_state.z
        position = getattr(initial_state, "position", 0)
    else:
        raise TypeError(
            f"{name} must be a LinearState (or a tuple (S, z[, position])), "
            f"got {type(initial_state).__name__}"
        )
    return S0, z0, check_position(position, f"{name}.position")


def check_state_rule(state, rule: str, name: str = "initial_state") -> None:
    """Raise ValueError when ``state`` records an update rule other than ``rule``.

    A state without a record (a plain tuple ``(S, z[, position])``) is
    taken as it is: the caller vouches for it.
    """
    got = getattr(state, "rule", None)
    if got is not None and got != rule:
        if got in rule_names():
            hint = f" ({get_update_rule(got).hint})"
        elif got in dplr_rule_names():
            hint = f" (a diagonal-plus-low-rank rule: dplr_attention(rule={got!r}) continues it)"
        else:
            hint = ""
        raise ValueError(f"{name} is a state of the {got!r} update rule, but this call runs the {rule!r} rule; "
                         f"a state continues only the rule that made it{hint}")


def host_state(initial_state, batch_shape, f: int, m: int, *, check_finite: bool):
    """The initial state as a float64 host ``H`` (B, F, M + 1) = [S | z], and its position.

    ``None`` gives zeros at position 0.  Device arrays in the state are copied
    to the host.
    """
    b = int(np.prod(batch_shape, dtype=np.int64))
    H = np.zeros((b, f, m + 1))
    if initial_state is None:
        return H, 0
    S0, z0, position = parse_state(initial_state)
    S0, z0 = host_array("initial_state.S", S0), host_array("initial_state.z", z0)
    V.check_state_arrays(S0, z0, position, batch_shape, f, m)
    if check_finite:
        V.check_finite("initial_state.S", S0)
        V.check_finite("initial_state.z", z0)
    H[:, :, :m] = np.reshape(S0, (b, f, m))
    H[:, :, m] = np.reshape(z0, (b, f))
    return H, position


def state_from_H(H, batch_shape, f: int, m: int, position: int, rule: str = "additive") -> LinearState:
    """The :class:`LinearState` of a host ``H`` (B, F, M + 1): C-contiguous float64 S and z."""
    S = np.ascontiguousarray(H[:, :, :m]).reshape(tuple(batch_shape) + (f, m))
    z = np.ascontiguousarray(H[:, :, m]).reshape(tuple(batch_shape) + (f,))
    return LinearState(S, z, int(position), rule)


def rule_arguments(fmap, decay, log_decay, normalize, batch_shape, n: int, f: int, *, causal: bool, beta=None,
                   copy: bool = True, work=None):
    """``(rule, inputs, normalize)`` of a call's ``decay``, ``log_decay``, ``beta``, ``normalize``: the rule
    they select (:func:`linattn_nb.rules.rule_for`; ValueError for a per-feature gate with ``beta``), its
    inputs (:func:`~linattn_nb._validate.decay_inputs`, ``beta_inputs``; ``copy=False``: maybe the caller's
    array; ``work``: as there) and ``normalize`` (:func:`rule_normalize`).  ``fmap`` None (softmax weights) has no rule:
    ``decay``/``log_decay``/``beta`` and ``normalize=False`` raise ValueError."""
    if fmap is None:  # softmax weights (the analyses' feature_map="softmax"): no recurrence
        for name, x in (("decay", decay), ("log_decay", log_decay), ("beta", beta)):
            if x is not None:
                raise ValueError(f"{name} applies to linear attention's recurrence; feature_map='softmax' "
                                 "has none (pass a feature map)")
        if V.check_normalize(normalize, True) is False:
            raise ValueError("normalize=False does not apply to feature_map='softmax' (softmax weights are "
                             "normalised by definition)")
        return "additive", None, True
    rule, inputs = V.decay_inputs(decay, log_decay, batch_shape, n, f, causal=causal, copy=copy, work=work)
    if beta is not None:
        if not causal:
            raise ValueError("beta (the delta rule's write strength) applies to causal attention; it needs "
                             "causal=True")
        base = get_update_rule(rule)
        with_beta = rule_for(factor=base.factor, beta=True)  # ValueError: no rule takes this decay with beta
        rule = with_beta.name
        inputs = with_beta.kernel_arguments(base.log_factor_of(inputs), V.beta_inputs(beta, batch_shape, n))
    return rule, inputs, rule_normalize(fmap, rule, normalize)


def rule_normalize(fmap, rule: str, normalize) -> bool:
    """``normalize`` as a bool: None takes the rule's convention; ValueError for a map that needs the normaliser."""
    normalize = V.check_normalize(normalize, get_update_rule(rule).normalize)
    if not normalize and getattr(fmap, "needs_normalizer", False):
        raise ValueError(
            f"feature map {fmap.name!r} stabilises its features with per-row factors (shifts inside exp) that "
            "cancel only between numerator and normaliser; normalize=False would return outputs scaled by "
            "them. Use normalize=True, or a map without such factors (e.g. 'elu', 'relu', 'taylor')"
        )
    return normalize


def read_state(fq, S, z, normalize: bool, eps) -> np.ndarray:
    """Float64 read-out ``phi(q)^T S`` of features ``fq`` (..., T, F) from a state ``S`` (..., F, M), ``z``
    (..., F), divided by ``max(phi(q)^T z, eps)`` (the raw normaliser for ``eps=None``) with ``normalize``."""
    out = fq @ np.asarray(S, dtype=np.float64)
    if not normalize:
        return out
    z = np.asarray(z, dtype=np.float64)
    den = fq @ z if z.ndim == 1 else (fq @ z[..., None])[..., 0]
    if eps is not None:
        den = np.maximum(den, eps)
    with np.errstate(divide="ignore", invalid="ignore"):
        return out / den[..., None]


# ---------------------------------------------------------------------------
# Method choice
# ---------------------------------------------------------------------------
def choose_method(method: str, *, rule: str, causal: bool, device: str, batch: int, n: int, f: int, m: int,
                  dtype):
    """The registered :class:`~linattn_nb.ops.registry.Method` for a request (``"auto"`` resolved)."""
    name = check_method_name(method)
    auto = name == "auto"
    if auto:
        if device == "cuda":
            name = CD.select_auto_cuda(rule=rule, causal=causal, batch=batch, n=n, f=f, m=m, dtype=dtype)
        else:
            name = select_auto(rule=rule, causal=causal, device=device, n=n, dtype=dtype)
    impl = get_method(name, causal=causal, device=device, rule=rule)
    if device == "cpu" and causal and impl.name == "chunked":
        # auto runs the chunk size and row block this machine's calibration chose (docs/tuning.md)
        pair = chunk_pair(rule, dtype, f, m, auto=auto)
        if pair is not None:
            impl = dataclasses.replace(impl, forward=functools.partial(impl.forward, chunk=pair[0], block=pair[1]))
        # and its gradient the pair calibrated for the fused normalised backward
        gpair = grad_pair(rule, dtype, f, m, auto=auto)
        if gpair is not None:
            impl = dataclasses.replace(impl, grad_pair=tuple(gpair))
    return impl


# ---------------------------------------------------------------------------
# The request: one preparation for every entry point
# ---------------------------------------------------------------------------
class Call(NamedTuple):
    """A validated request on host arrays (:func:`host_call`): what an entry point computes from its arguments."""

    dev: str
    fmap: object  # None: softmax weights (an analysis)
    eps: object
    causal: bool
    q: np.ndarray  # C-contiguous host arrays (None where the entry takes no such array)
    k: np.ndarray
    v: np.ndarray
    batch_shape: tuple
    n: int
    d: int
    m: int
    f: int
    b: int
    dtype: np.dtype
    rule: str
    inputs: object  # the rule's launcher inputs (None for the additive rule)
    normalize: bool
    impl: object  # the registered Method (None for an entry without one: the analyses)


def resolve_call(device, arrays, names, feature_map, eps, causal, method):
    """``(device, map, eps, causal)`` of a call's arguments, checked; the method name is checked too."""
    dev = resolve_device(device, *arrays, names=names)
    fmap = fm.resolve(feature_map)
    eps = V.check_eps(eps)
    causal = check_causal(causal)
    check_method_name(method)
    return dev, fmap, eps, causal


def plan_call(method, rule, initial_state, *, dev, causal, batch_shape, n, f, m, dtype, extra_columns=0):
    """The :class:`~linattn_nb.ops.registry.Method` of a request, after the checks that need no work.

    ``initial_state`` must be of ``rule``; on CUDA the shape must fit the
    kernels' limits (with ``extra_columns`` more value columns: the
    gradient's).  ``method="auto"`` is resolved; ``method=None`` plans none (returns None).
    """
    if initial_state is not None:
        check_state_rule(initial_state, rule)
    if method is None:
        return None
    if dev == "cuda":
        CD.check_limits(f, m + extra_columns, dtype, rule)  # fail before any work
    b = int(np.prod(batch_shape, dtype=np.int64))
    return choose_method(method, rule=rule, causal=causal, device=dev, batch=b, n=n, f=f, m=m, dtype=dtype)


def host_call(q, k, v, *, fmap, eps, causal, decay, log_decay, beta, normalize, check_qkv: bool, dev="cpu",
              method=None, initial_state=None, copy: bool = True, to_host: bool = False,
              extra_columns: int = 0, names=("q", "k", "v"), same_n: bool = True, work=None) -> Call:
    """The validated request of a call on host arrays (:class:`Call`): every entry point's preparation.

    ``check_qkv``: scan q, k, v for non-finite values here (kernels with an inline map scan them as
    they read).  ``copy``: the rule's inputs are copies (for a request that keeps them); ``work``: where
    converted ones may go (:func:`~linattn_nb._validate.decay_inputs`).
    ``to_host``: GPU arrays among q, k, v and the rule's arguments are copied to the host first.
    ``method=None``: no method is planned (``impl`` None; the analyses).  One of q, k, v may be
    None (an analysis of two arrays, named ``names``); ``same_n=False`` lets q and k differ in N.
    ``fmap`` None: softmax weights (``f = d``, the additive rule, no rule arguments).
    """
    if to_host:
        q, k, v, decay, log_decay, beta = (
            CD.to_host(nm, x) if on_device(x) else x
            for nm, x in (("q", q), ("k", k), ("v", v), ("decay", decay), ("log_decay", log_decay), ("beta", beta)))
    q, k, v, (batch_shape, n, d, m, dtype) = V.host_qkv(q, k, v, check_finite=check_qkv, names=names,
                                                        same_n=same_n)
    f = d if fmap is None else feature_dim(fmap, d)
    rule, inputs, normalize = rule_arguments(fmap, decay, log_decay, normalize, batch_shape, n, f, causal=causal,
                                             beta=beta, copy=copy, work=work)
    impl = plan_call(method, rule, initial_state, dev=dev, causal=causal, batch_shape=batch_shape, n=n, f=f, m=m,
                     dtype=dtype, extra_columns=extra_columns)
    b = int(np.prod(batch_shape, dtype=np.int64))
    return Call(dev, fmap, eps, causal, q, k, v, tuple(batch_shape), n, d, m, f, b, dtype, rule, inputs, normalize,
                impl)


# ---------------------------------------------------------------------------
# linear attention
# ---------------------------------------------------------------------------
_WORK = threading.local()


def _factor_work(role, shape, dtype):
    """This thread's work array for ``role`` (float32 log-factors converted to float64), reused by its next
    call of the same shape up to :data:`linattn_nb.config.FACTOR_WORK_BYTES`."""
    return thread_array(_WORK, role, shape, dtype, config.FACTOR_WORK_BYTES)


@parallel_entry
def linear_attention(q, k, v, *, feature_map, causal, method, device, eps, check_finite, out, initial_state,
                     return_state, decay=None, log_decay=None, beta=None, normalize=None):
    """The request path of :func:`linattn_nb.linear_attention` (arguments and results as there)."""
    check_finite, return_state = V.check_bool("check_finite", check_finite), V.check_bool("return_state", return_state)
    dev, fmap, eps, causal = resolve_call(device, (q, k, v, out), ("q", "k", "v", "out"), feature_map, eps, causal,
                                          method)
    # everything the call reads, as the caller passed it: an out= overlapping any of it is written last
    reads = () if out is None else call_reads(q, k, v, decay, log_decay, beta, initial_state=initial_state,
                                                fmap=fmap)
    if dev == "cuda" and any(on_device(x) for x in (q, k, v)):
        return _linear_device(q, k, v, fmap, causal, method, eps, check_finite, out, initial_state,
                              return_state, decay, log_decay, beta, normalize, reads)

    # CPU kernels with an inline map check q, k, v while they read them; the
    # other paths scan them here (NumPy), as the CUDA path always did
    c = host_call(q, k, v, dev=dev, fmap=fmap, eps=eps, causal=causal, method=method, decay=decay,
                  log_decay=log_decay, beta=beta, normalize=normalize, initial_state=initial_state,
                  check_qkv=check_finite and dev == "cuda", copy=False,
                  work=_factor_work if dev == "cpu" else None)  # the CPU kernels keep nothing after the call
    q, k, v, batch_shape, n, m, f, b, dtype = c.q, c.k, c.v, c.batch_shape, c.n, c.m, c.f, c.b, c.dtype
    rule, inputs, normalize, impl = c.rule, c.inputs, c.normalize, c.impl
    out_shape = batch_shape + (n, m)
    if out is not None:
        V.check_out(out, out_shape, dtype)
    inline = impl.inline_features and fmap.kernel_code is not None
    if check_finite and dev == "cpu" and not inline:
        # features computed in NumPy: the kernel sees features, so the raw q, k are scanned here
        V.check_finite("q", q)
        V.check_finite("k", k)
    H, position = host_state(initial_state, batch_shape, f, m, check_finite=check_finite)
    work = dtype if dtype in impl.native_dtypes else _F32
    result = out if out is not None else np.empty(out_shape, dtype=dtype)
    if n > 0 and b > 0:
        try:
            qf, kf, vf = host_features(fmap, inline, q, k, v, work, causal=causal, position=position, n=n)
        except FeatureOverflow as e:
            if e.dtype == _F64:  # also the NonFiniteResult that results beyond float64 raise
                raise feature_overflow64(e, q, k, v) from None
            qf = kf = vf = None  # the map's features of finite q or k overflowed float32: float64 below
        code = int(fmap.kernel_code) if inline else 0
        if dev == "cuda":
            def run(qf, kf, vf, H, target):  # the GPU kernels; the result checked on the host, as it arrives
                CD.run_host(impl, qf, kf, vf, H, target, code=code, eps=eps, inputs=inputs, normalize=normalize)
                if check_finite and not (np.isfinite(target).all() and np.isfinite(H).all()):
                    raise NonFiniteResult("finite inputs gave an output or a state that is not finite")

            direct, target, run64 = True, result, run  # run_host copies into any out=
        else:
            def run(qf, kf, vf, H, target):
                # check_finite: the kernel raises ValueError naming a non-finite input, and
                # NonFiniteResult when finite inputs gave a non-finite output or state
                impl.forward(qf, kf, vf, H, target, code=code, eps=eps, inputs=inputs, check_finite=check_finite,
                             normalize=normalize)

            # an out= that overlaps anything the call reads is written last, from a scratch result
            direct = (result.dtype == work and result.flags.c_contiguous and result.flags.writeable
                      and not out_overlaps(out, reads + (q, k, v) + tuple((inputs or {}).values())))
            target = result.reshape((b, n, m)) if direct else np.empty((b, n, m), dtype=work)
            run64 = None
        try:
            if qf is None:
                raise NonFiniteResult(f"feature map {fmap.name!r} overflowed {work}")
            if check_finite and not inline:
                _check_features(fmap, qf, kf, work)  # finite q, k (scanned above): the map overflowed?
            run(qf, kf, vf, H, target)
        except NonFiniteResult:
            if work != _F64:  # float64 throughout, on the same device
                H, out64, finite64 = _recompute_float64(fmap, impl, q, k, v, initial_state, batch_shape, f, m,
                                                        causal, eps, inline, inputs, normalize, run=run64)
                if not finite64 and (eps is not None or not normalize):  # as float64 inputs raise (eps=0's 0 / 0)
                    raise float64_overflow("an output or the state", fmap, q, k, v,
                                           zero_floor=floor_is_zero(normalize, eps)) from None
                result[...] = _cast_result(out64, dtype, q, k, v, eps if normalize else None).reshape(out_shape)
                direct = True  # result written
            elif eps is not None or not normalize:
                # no normaliser of 0 here (eps=None's documented NaN): float64 itself overflowed
                raise float64_overflow("an output or the state", fmap, q, k, v,
                                       zero_floor=floor_is_zero(normalize, eps)) from None
            # eps=None: the result is what float64 gives (0 / 0 where a normaliser is 0): kept
        if not direct:
            result[...] = target.reshape(out_shape)
    if not return_state:
        return result
    return result, state_from_H(H, batch_shape, f, m, position + n, rule)


class Float64FeatureOverflow(FeatureOverflow, NonFiniteResult):
    """A map's features of finite inputs overflow float64 inside an attention call: the map's own
    :class:`~linattn_nb.feature_maps.FeatureOverflow` (a ValueError, as a direct call of the map raises) and
    the attention functions' :class:`~linattn_nb.NonFiniteResult` for finite inputs whose results are not
    finite even in float64, with the inputs' largest magnitudes added to the map's message."""


def _magnitudes(q, k, v) -> str:
    return ", ".join(f"{nm} {float(np.max(np.abs(x), initial=0.0)):.3g}" for nm, x in (("q", q), ("k", k), ("v", v)))


def feature_overflow64(err: FeatureOverflow, q, k, v) -> Float64FeatureOverflow:
    """:class:`Float64FeatureOverflow` of the map's float64 ``err`` (host q, k, v: their magnitudes)."""
    return Float64FeatureOverflow(f"{err} (largest magnitudes: {_magnitudes(q, k, v)})", _F64)


def floor_is_zero(normalize, eps) -> bool:
    """Whether a call's floor is 0 (``eps=0`` on normalised outputs): a normaliser of 0 then divides by 0, which
    :func:`float64_overflow` names instead of an overflow."""
    return bool(normalize) and eps is not None and eps == 0


def float64_overflow(what: str, fmap, q, k, v, *, zero_floor: bool = False) -> NonFiniteResult:
    """The error for finite inputs whose results (``what``) are not finite even in float64, with the
    largest magnitudes of q, k and v (host arrays); ``fmap`` None: softmax attention's.  ``zero_floor``: a
    normalised call with ``eps=0``, whose floor lets a normaliser of 0 divide by 0 (0 / 0, not an overflow)."""
    sizes = _magnitudes(q, k, v)
    where = ("in the scores scale * q . k or the weighted sums" if fmap is None else
             f"in the features of feature map {fmap.name!r} or in the products and sums")
    if zero_floor:
        return NonFiniteResult(
            f"finite inputs gave {what} that is not finite in float64: with eps=0 a normaliser of 0 (a query "
            "whose features meet no key's, e.g. 'relu' features that are all 0) is divided by, or float64 "
            f"overflowed {where} (largest magnitudes: {sizes}); pass eps > 0 for a floor, eps=None to get NaN "
            "where a normaliser is 0, or check_finite=False to get the non-finite values")
    return NonFiniteResult(
        f"finite inputs gave {what} that is not finite even in float64: float64 overflowed {where} (largest "
        f"magnitudes: {sizes}); scale the inputs down, or pass check_finite=False to get the non-finite values")


def _check_features(fmap, qf, kf, work):
    """NumPy-side features of finite inputs: NonFiniteResult where they overflowed ``work`` (below float64),
    ValueError naming the map and the input where they are not finite even in float64."""
    for name, x in (("q", qf), ("k", kf)):
        if not np.isfinite(x).all():
            if work != _F64:
                raise NonFiniteResult(f"feature map {fmap.name!r} overflowed {work} on {name}")
            raise ValueError(
                f"feature map {fmap.name!r} returns non-finite features for the finite {name}, even in float64: "
                f"{name} is too large for this map, or the map gives NaN or inf for finite inputs"
            )


def _recompute_float64(fmap, impl, q, k, v, initial_state, batch_shape, f, m, causal, eps, inline, inputs,
                       normalize, run=None):
    """``(H, out, finite)`` of a call recomputed in float64 (features included): the float32 result overflowed;
    ``finite``: whether float64's own result and state are finite.
    ``run(qf, kf, vf, H, out)``: the kernels (raising NonFiniteResult for a result that is not finite);
    default: ``impl.forward`` on the CPU."""
    H, position = host_state(initial_state, batch_shape, f, m, check_finite=False)
    b, n = H.shape[0], int(q.shape[-2])
    qf, kf, vf = host_features(fmap, inline, q, k, v, _F64, causal=causal, position=position, n=n)
    code = int(fmap.kernel_code) if inline else 0
    if not inline:
        _check_features(fmap, qf, kf, _F64)
    out64 = np.empty((b, n, m))
    if run is None:
        def run(qf, kf, vf, H, out64):
            impl.forward(qf, kf, vf, H, out64, code=code, eps=eps, inputs=inputs, check_finite=True,
                         normalize=normalize)
    try:
        run(qf, kf, vf, H, out64)  # still checked: a map's features may have overflowed before the kernel saw v
    except NonFiniteResult:
        return H, out64, False  # non-finite in float64 too: the caller decides (eps=None's 0 / 0 is kept)
    return H, out64, True


def _cast_result(res64, dtype, q, k, v, eps=None):
    """A float64 result cast to ``dtype``; ValueError where a finite value overflows ``dtype``.  ``eps``: the
    floor of a normalised call (None: no floor), which the message names as the other cause (a signed map's
    normaliser at or below it divides a numerator by ``eps``, whatever the inputs' scale)."""
    with np.errstate(over="ignore", invalid="ignore"):
        res = res64.astype(dtype)
    if dtype != _F64 and (np.isfinite(res64) & ~np.isfinite(res)).any():
        sizes = ", ".join(f"|{nm}| <= {float(np.max(np.abs(x))):.3g}" for nm, x in (("q", q), ("k", k), ("v", v)))
        floor = ("" if eps is None else
                 f", or a normaliser at or below the floor eps = {eps:g} divided a numerator by it (signed maps "
                 "such as 'identity' or 'l2': rescaling does not help; pass eps=None or a larger eps)")
        raise ValueError(
            f"the result overflows {dtype} (it is finite in float64): q, k or v is too large for {dtype} "
            f"({sizes}){floor}; pass float64 inputs or rescale them"
        )
    return res


def _linear_device(q, k, v, fmap, causal, method, eps, check_finite, out, initial_state, return_state, decay,
                   log_decay, beta, normalize, reads=()):
    """GPU inputs: zero-copy views, the kernels on the device, a device result (and state)."""
    dq, dk, dv = CD.wrap("q", q), CD.wrap("k", k), CD.wrap("v", v)
    batch_shape, n, d, m, dtype = V.check_qkv(CD.meta(dq), CD.meta(dk), CD.meta(dv))
    in_place = None
    if (on_device(decay) or on_device(log_decay) or on_device(beta)) and causal:
        in_place = CD.device_rule_inputs(decay, log_decay, beta, batch_shape, n, d)
    if in_place is None:
        decay, log_decay, beta = (CD.to_host(nm, x) if on_device(x) else x
                                  for nm, x in (("decay", decay), ("log_decay", log_decay), ("beta", beta)))
        rule, inputs, normalize = rule_arguments(fmap, decay, log_decay, normalize, batch_shape, n, d,
                                                 causal=causal, beta=beta, copy=False)
    else:  # read in place or converted on the device, checked there below
        rule, rule_plan = in_place
        normalize = rule_normalize(fmap, rule, normalize)
    if fmap.kernel_code is None:
        raise ValueError(
            f"feature map {fmap.name!r} has no inline CUDA form (only maps with a kernel_code: "
            f"{', '.join(repr(x) for x in fm.inline_maps())}); for GPU inputs compute the features "
            "yourself and pass feature_map=None, or pass host (NumPy) arrays with device='cuda'"
        )
    f = d
    impl = plan_call(method, rule, initial_state, dev="cuda", causal=causal, batch_shape=batch_shape, n=n, f=f, m=m,
                     dtype=dtype)
    out_shape = batch_shape + (n, m)
    dout = CD.device_out(out, out_shape, dtype)
    b = int(np.prod(batch_shape, dtype=np.int64))
    empty = n == 0 or b == 0
    if not empty:
        q4, k4, v4 = CD.input_4d(dq), CD.input_4d(dk), CD.input_4d(dv)
    # No host round-trips: H is a pooled workspace zeroed or packed on the device; q, k, v
    # (and a device initial state) are counted on the device and the counters read once.
    try:
        if in_place is not None:
            inputs = CD.device_rule_values(rule_plan, b, n, d)
        if initial_state is None:
            H, position = CD.zero_state(b, f, m), 0
        else:
            S0, z0, position = parse_state(initial_state)
            if on_device(S0) and on_device(z0):
                H = CD.pack_state(S0, z0, position, batch_shape, b, f, m, check_finite=check_finite)
            else:
                Hh, position = host_state(initial_state, batch_shape, f, m, check_finite=check_finite)
                H = CD.to_device(Hh)
        if not empty:
            CD.run_device(impl, q4, k4, v4, H, dout, out_shape, code=int(fmap.kernel_code), eps=eps,
                          inputs=inputs, normalize=normalize, check_finite=check_finite,
                          scratch=out_overlaps(out, reads))
        else:
            CD.finish_checks()
    except BaseException:
        CD.discard_checks()
        raise
    result = out if out is not None else dout
    if not return_state:
        return result
    S, z = CD.unpack_state(H, batch_shape, f, m)
    return result, LinearState(S, z, position + n, rule)


# ---------------------------------------------------------------------------
# softmax attention
# ---------------------------------------------------------------------------
@parallel_entry
def softmax_attention(q, k, v, *, causal, scale, device, check_finite, method):
    """The request path of :func:`linattn_nb.softmax_attention` (arguments and results as there)."""
    check_finite = V.check_bool("check_finite", check_finite)
    dev = resolve_device(device if device != "cuda" else "auto", q, k, v, names=("q", "k", "v"))
    if device == "cuda" or dev == "cuda":
        raise ValueError(
            "softmax_attention has a CPU kernel only; pass host arrays (device='cpu'). "
            "GPU inputs: copy them to the host first."
        )
    causal = check_causal(causal)
    # the blocked kernel checks q, k, v itself (while it reads them); the reference is scanned here
    q, k, v, (batch_shape, n, d, m, dtype) = V.host_qkv(q, k, v, check_finite=check_finite and method != "blocked")
    scale = V.check_scale(scale, d)
    if check_method_name(method) not in ("blocked", "quadratic"):
        raise ValueError(f"unknown method {method!r} for softmax_attention; choose 'blocked' or 'quadratic'")
    out_shape = batch_shape + (n, m)
    result = np.empty(out_shape, dtype=dtype)
    b = int(np.prod(batch_shape, dtype=np.int64))
    if n == 0 or b == 0:
        return result
    work = work_dtype(dtype)
    qf, kf, vf = (V.flatten_batch(x, work) for x in (q, k, v))
    if method == "quadratic":
        res = softmax_attention_quadratic(qf, kf, vf, causal=causal, scale=scale)
        result[...] = res.reshape(out_shape)
        if check_finite and not np.isfinite(res).all():  # float64 inside: its scores overflowed
            raise float64_overflow("an output", None, q, k, v)
        return result
    direct = work == dtype
    target = result.reshape((b, n, m)) if direct else np.empty((b, n, m), dtype=work)
    try:
        softmax_blocked(qf, kf, vf, target, causal=causal, scale=scale, check_finite=check_finite)
    except NonFiniteResult:
        if work != _F64:  # the working dtype overflowed (e.g. float32 scores of inputs of 1e19): float64
            out64 = np.empty((b, n, m))
            try:  # checked again: scores that overflow float64 itself raise as for float64 inputs
                softmax_blocked(*(V.flatten_batch(x, _F64) for x in (q, k, v)), out64, causal=causal, scale=scale,
                                check_finite=True)
            except NonFiniteResult:
                raise float64_overflow("an output", None, q, k, v) from None
            result[...] = _cast_result(out64, dtype, q, k, v).reshape(out_shape)
            return result
        if check_finite:  # softmax has no normaliser of 0: float64 itself overflowed
            if not direct:
                result[...] = target.reshape(out_shape)
            raise float64_overflow("an output", None, q, k, v) from None
    if not direct:
        result[...] = target.reshape(out_shape)
    return result
