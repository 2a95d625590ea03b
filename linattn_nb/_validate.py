"""Input checks shared by every public function.

The dtype rule (float16/32/64, promoted to the widest; anything else a TypeError naming the argument):
docs/frontend.md, "The dtype rule".
"""
from __future__ import annotations

import math
import numbers
from typing import Sequence

import numpy as np
from numba import njit, prange

from . import config
from ._arrays import as_host_array  # noqa: F401  (the callers read it as V.as_host_array)
from ._defaults import DEFAULT_EPS
from .ops._finite import check_finite_values  # the kernel layer's check, shared with the front end
from .rules import rule_for

SUPPORTED_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def check_float_dtype(name: str, dtype) -> np.dtype:
    """Raise TypeError unless ``dtype`` is float16/32/64."""
    dtype = np.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        if dtype.kind in "iub":
            hint = f"; cast it explicitly, e.g. {name}.astype(np.float32)"
        else:
            hint = ""
        raise TypeError(
            f"{name} must have dtype float16, float32 or float64, got {dtype}{hint}"
        )
    return dtype


check_finite = check_finite_values  # the name the callers use


def check_bool(name: str, x) -> bool:
    """``x`` as a bool: True, False or a NumPy bool; anything else (a truthy string such as ``"False"``) is a
    TypeError naming ``name``."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {x!r}")
    return bool(x)


def check_int(name: str, x, minimum: int = 0, *, allow_none: bool = False):
    """``x`` as an int: a Python or NumPy integer (not a bool) ``>= minimum``, e.g. a token position, a
    length or a count (``None`` returned as it is with ``allow_none``).  TypeError naming ``name`` for
    anything else (a float such as 1.7, a string, a bool), ValueError below ``minimum``."""
    if x is None and allow_none:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an integer{' or None' if allow_none else ''}, got {type(x).__name__} {x!r}")
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return int(x)


def check_qkv(q, k, v, *, names: Sequence[str] = ("q", "k", "v"), same_n: bool = True):
    """Validate the shapes and dtypes of q, k, v: ``(batch_shape, n, d, m, promoted dtype)``.

    Any one of them may be None (an analysis of two arrays: q and k, or k and v); ``same_n=False``
    lets q and k differ in N (non-causal weights).  ``d`` is the first array's last dimension, ``m``
    v's (0 without v); ``n`` the first array's N.
    """
    given = [(name, x) for name, x in zip(names, (q, k, v)) if x is not None]
    for name, x in given:
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., N, features), got shape {tuple(x.shape)}")
        check_float_dtype(name, x.dtype)
    who = (", " if len(given) == 3 else " and ").join(name for name, _ in given)
    shapes = ", ".join(str(tuple(x.shape)) for _, x in given)
    xs = [x for _, x in given]
    for same, what in ((len({x.ndim for x in xs}) == 1, "the same number of dimensions (equal leading batch "
                        "dimensions)"),
                       (len({tuple(x.shape[:-2]) for x in xs}) == 1, "equal leading batch dimensions"),
                       (not same_n or len({x.shape[-2] for x in xs}) == 1,
                        "the same sequence length N (axis -2)")):
        if not same:
            raise ValueError(f"{who} must have {what}, got shapes {shapes}")
    if q is not None and k is not None and q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{names[0]} and {names[1]} must have the same feature dimension D (axis -1), got shapes "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    d, m = int(xs[0].shape[-1]), (0 if v is None else int(v.shape[-1]))
    if d == 0 or (v is not None and m == 0):
        raise ValueError(f"feature dimensions must be at least 1, got D={d} and M={m}")
    dtype = np.result_type(*[x.dtype for x in xs])
    return tuple(xs[0].shape[:-2]), int(xs[0].shape[-2]), d, m, np.dtype(dtype)


def host_qkv(q, k, v, *, check_finite: bool, names: Sequence[str] = ("q", "k", "v"), same_n: bool = True):
    """``as_host_array`` + :func:`check_qkv` + (optionally) :func:`check_finite` on q, k, v (None stays None).

    Returns ``(q, k, v, (batch_shape, n, d, m, dtype))``.
    """
    q, k, v = (None if x is None else as_host_array(name, x) for name, x in zip(names, (q, k, v)))
    info = check_qkv(q, k, v, names=names, same_n=same_n)
    # C-contiguous (a copy only of a view): whatever reads them next (a kernel, a feature map's
    # NumPy products) then gives, bit for bit, the result of a contiguous copy
    q, k, v = (x if x is None or x.flags.c_contiguous else np.ascontiguousarray(x) for x in (q, k, v))
    if check_finite:
        for name, x in zip(names, (q, k, v)):
            if x is not None:
                check_finite_values(name, x)
    return q, k, v, info


def check_out(out, shape, dtype) -> np.ndarray:
    """Validate a user-supplied output buffer."""
    if not isinstance(out, np.ndarray) or isinstance(out, (np.matrix, np.ma.MaskedArray)):
        raise TypeError(f"out must be a numpy.ndarray for CPU inputs, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        order = "; its byte order is not the machine's" if out.dtype.newbyteorder("=") == dtype else ""
        raise TypeError(f"out must have dtype {dtype}, got {out.dtype}{order}")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    return out


def flatten_batch(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``(..., N, F)`` -> C-contiguous ``(B, N, F)`` of ``dtype`` (a view where possible)."""
    x = np.ascontiguousarray(x, dtype=dtype)
    b = int(np.prod(x.shape[:-2], dtype=np.int64))
    return x.reshape((b,) + x.shape[-2:])  # explicit b: (-1) is ambiguous when N or F is 0


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _as_float(name: str, x, what: str) -> float:
    """``float(x)`` of a real number ``x``; ValueError naming ``name`` (``"{name} must be {what}"``) where it
    is too large for a float (``float(10**400)`` raises OverflowError)."""
    try:
        return float(x)
    except OverflowError:
        raise ValueError(f"{name} must be {what}, got a value of type {type(x).__name__} too large "
                         "for a float") from None


def check_scale(scale, d: int) -> float:
    """The softmax temperature: ``1/sqrt(d)`` for None, else a finite real number (ValueError for one
    too large for a float, such as ``10**400``)."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if not _is_real(scale):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    scale = _as_float("scale", scale, "finite")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_eps(eps):
    """The normaliser floor: None (raw division) or a finite number >= 0; the default marker
    (:data:`linattn_nb._defaults.DEFAULT_EPS`) reads ``config.DEFAULT_EPS`` now."""
    if eps is DEFAULT_EPS:
        value = config.DEFAULT_EPS
        if value is not None and not (_is_real(value) and 0.0 <= float(value) < math.inf):
            raise ValueError(f"config.DEFAULT_EPS (set by the environment variable LINATTN_EPS or by assignment) "
                             f"must be a finite non-negative float or None, got {value!r}")
        eps = value
    if eps is None:
        return None
    if not _is_real(eps):
        raise TypeError(f"eps must be a non-negative float or None, got {type(eps).__name__}")
    eps = _as_float("eps", eps, "a finite non-negative float or None")
    if not (eps >= 0.0) or math.isinf(eps):
        raise ValueError(f"eps must be a finite non-negative float or None, got {eps}")
    return eps


def check_state_arrays(S0, z0, position, batch_shape, f: int, m: int) -> int:
    """Dtype, shape and position checks of an initial state (host or device arrays)."""
    check_float_dtype("initial_state.S", S0.dtype)
    check_float_dtype("initial_state.z", z0.dtype)
    want_S = tuple(batch_shape) + (f, m)
    want_z = tuple(batch_shape) + (f,)
    if tuple(S0.shape) != want_S or tuple(z0.shape) != want_z:
        raise ValueError(
            f"initial_state must have S of shape {want_S} and z of shape {want_z} "
            f"(batch shape, feature dimension D_phi={f}, value dimension M={m}), "
            f"got {tuple(S0.shape)} and {tuple(z0.shape)}"
        )
    position = int(position)
    if position < 0:
        raise ValueError(f"initial_state.position must be >= 0, got {position}")
    return position


def check_normalize(normalize, default: bool) -> bool:
    """``normalize`` as a bool (None: ``default``, the rule's convention)."""
    if normalize is None:
        return bool(default)
    if isinstance(normalize, (bool, np.bool_)):
        return bool(normalize)
    raise TypeError(f"normalize must be None, True or False, got {type(normalize).__name__} {normalize!r}")


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _factor_span(x, out, lo, hi, reset):
    """One task of :func:`_factor_pass` (``out`` empty: the counts only)."""
    bad = 0
    resets = 0
    write = out.shape[0] > 0
    ninf = -np.inf
    for i in range(x.shape[0]):
        v = np.float64(x[i])  # exact: every float32 is a float64
        bad += (v != v) | (v < lo) | (v > hi)
        r = v <= reset
        resets += r
        if write:
            out[i] = ninf if r else v
    return bad, resets


#: Elements per task of :func:`factor_counts` and :func:`log_factors_into`.
_FACTOR_SPAN = 1 << 15


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def _factor_pass(x, out, lo, hi, reset):
    n = x.shape[0]
    tasks = (n + _FACTOR_SPAN - 1) // _FACTOR_SPAN
    bad = np.zeros(tasks, np.int64)
    resets = np.zeros(tasks, np.int64)
    write = out.shape[0] > 0
    for t in prange(tasks):
        lo_i = t * _FACTOR_SPAN
        hi_i = min(n, lo_i + _FACTOR_SPAN)
        bad[t], resets[t] = _factor_span(x[lo_i:hi_i], out[lo_i:hi_i] if write else out, lo, hi, reset)
    return bad.sum(), resets.sum()


_NO_OUT = np.empty(0)


def factor_counts(x, lo, hi, reset):
    """``(bad, resets)`` of a 1-D float64 array in one parallel pass: how many elements are NaN or outside
    [lo, hi], and how many are at or below ``reset`` (NumPy took five passes over a per-feature gate,
    as large as q and k; one serial pass 1.1 ms at B*H = 16, N = 4096, F = 64).  The comparisons survive
    the fast-math flags (no ``nnan``)."""
    return _factor_pass(x, _NO_OUT, float(lo), float(hi), float(reset))


def log_factors_into(x, out, reset):
    """``out`` (float64) <- the 1-D float32 log-factors ``x``, ``-inf`` at or below ``reset``, in the same
    parallel pass that counts them as :func:`factor_counts` does: returns ``(bad, resets)`` (NaN or above 0;
    at or below ``reset``).  A per-feature gate is as large as q and k: NumPy's conversion to a fresh
    float64 array, the count and the copy took three passes (12.1 ms at B*H = 16, N = 4096, F = 64,
    Intel Xeon, 2 threads; docs/performance.md, "The gate's log-factors")."""
    return _factor_pass(x, out, -np.inf, 0.0, float(reset))


def _refuse_factors(name: str, x, lo: float, hi: float):
    """ValueError naming ``name`` for the first NaN or out-of-range factor of ``x`` (some element is)."""
    if np.isnan(x).any():
        raise ValueError(f"{name} contains NaN")
    first = x[(x < lo) | (x > hi)].ravel()[0]
    if name == "decay":  # not a rule: the argument decay (linear factors)
        raise ValueError(f"decay factors must lie in [0, 1] (0 resets the state), got {float(first)!r}")
    raise ValueError(f"log_decay must be <= 0 (-inf resets the state), got {float(first)!r}")


def decay_inputs(decay, log_decay, batch_shape, n: int, f: int, *, causal: bool, copy: bool = True,
                 work=None):
    """``(rule, inputs)`` of the ``decay``/``log_decay`` arguments (forms of ``linear_attention``): the
    rule without ``beta`` the form selects and its launcher inputs (``{"log_decay": (B, N)}`` or
    ``{"log_gate": (B, N, F)}`` C-contiguous float64 log-factors, ``-inf`` at or below ``LOG_RESET``;
    None: additive); ``copy=False``: maybe the caller's array.  ``work(role, shape, dtype)``: an empty array
    for float32 log-factors converted to float64, from a caller that keeps none of the inputs after its call
    (its per-thread work arrays); None: a fresh one.  ValueError (naming the argument) for both given,
    ``causal=False``, NaN, out of range or a shape of no form; TypeError for non-real values."""
    from .ops._codes import LOG_RESET

    if decay is None and log_decay is None:
        return rule_for(factor=None, beta=False).name, None
    if decay is not None and log_decay is not None:
        raise ValueError("pass at most one of decay and log_decay (the same factors, linear or as logs)")
    name, x = ("decay", decay) if decay is not None else ("log_decay", log_decay)
    if not causal:
        raise ValueError(f"{name} applies to causal attention (a recurrence); it needs causal=True")
    x = as_host_array(name, x)
    if x.dtype.kind not in "iuf":
        raise TypeError(f"{name} must hold real numbers (floats), got dtype {x.dtype}")
    linear = name == "decay"  # not a rule: the argument decay (linear factors)
    lo, hi = (0.0, 1.0) if linear else (-np.inf, 0.0)
    if not linear and x.dtype == np.float32:
        # float32 log-factors: converted, checked and reset in one compiled pass, into an array of the
        # caller's work arrays (``work``) or a fresh one, which is never the caller's array
        lg = np.empty(x.shape, np.float64) if work is None else work("log_factors", x.shape, np.float64)
        bad, _ = log_factors_into(np.ascontiguousarray(x).reshape(-1), lg.reshape(-1), LOG_RESET)
        if bad:
            _refuse_factors(name, x, lo, hi)
        return _rule_inputs(name, lg, batch_shape, n, f)
    x = np.asarray(x, dtype=np.float64)  # no copy of a float64 array
    # one compiled pass (a per-feature gate is as large as q and k): NaN, out of range, resets
    bad, resets = factor_counts(np.ascontiguousarray(x).reshape(-1), lo, hi, LOG_RESET)
    if bad:
        _refuse_factors(name, x, lo, hi)
    if linear:
        with np.errstate(divide="ignore"):
            lg = np.log(x)
        lg = np.where(lg <= LOG_RESET, -np.inf, lg)
    elif resets:
        lg = np.where(x <= LOG_RESET, -np.inf, x)
    elif copy:
        lg = x.copy()
    else:
        lg = x  # nothing to convert: the caller's array itself (read only by the kernels)
    return _rule_inputs(name, lg, batch_shape, n, f)


def _rule_inputs(name: str, lg, batch_shape, n: int, f: int):
    """``(rule, inputs)`` of :func:`decay_inputs` from its checked float64 log-factors ``lg``."""
    batch_shape = tuple(int(s) for s in batch_shape)
    nb = len(batch_shape)
    forms = (f"a scalar or {nb} dimension(s) broadcastable to the batch shape {batch_shape} (per sequence), "
             f"{nb + 1} with last axis N={n} (per token), or {nb + 2} with last axes (N, D_phi)=({n}, {f}) "
             "(per feature)")
    lg = _kernel_form(name, lg, batch_shape, n, forms, f)
    rule = rule_for(factor="feature" if lg.ndim == 3 else "scalar", beta=False)
    return rule.name, rule.kernel_arguments(lg, None)


def _kernel_form(name, x, batch_shape: tuple, n: int, forms: str, f=None) -> np.ndarray:
    """``x`` per sequence (a scalar or the batch dimensions), per token (one more axis, of length N) or,
    with ``f``, per token and feature (two more, (N, f)) as writeable C-contiguous float64 (B, N) or
    (B, N, f); ValueError naming ``name`` and the ``forms`` for any other shape."""
    nb = len(batch_shape)
    b = int(np.prod(batch_shape, dtype=np.int64))
    if x.ndim == 0 or x.ndim == nb:
        target = batch_shape
    elif x.ndim == nb + 1:
        if x.shape[-1] != n:
            raise ValueError(f"{name} of shape {x.shape} has {x.ndim} dimensions (one per token), so its last "
                             f"axis must be N={n}; expected {forms}")
        target = batch_shape + (n,)
    elif f is not None and x.ndim == nb + 2:
        if x.shape[-2] != n or x.shape[-1] != f:
            raise ValueError(f"{name} of shape {x.shape} has {x.ndim} dimensions (a per-feature gate), so its "
                             f"last axes must be (N, D_phi)=({n}, {f}) (D_phi: the feature map's output "
                             f"dimension); expected {forms}")
        target = batch_shape + (n, f)
    else:
        raise ValueError(f"{name} of shape {x.shape} has {x.ndim} dimensions; expected {forms}")
    if x.shape != target:
        try:
            x = np.broadcast_to(x, target)
        except ValueError:
            raise ValueError(f"{name} of shape {x.shape} does not broadcast to {target}; expected {forms}") \
                from None
    # Writeable arrays, never read-only broadcast views: Numba compiles a kernel once more for a
    # read-only array argument, so a view here would double the causal kernels' compilations.
    if len(target) == nb:  # per sequence: the same value at every token
        x = np.broadcast_to(x.reshape(b, 1), (b, n))
    return np.require(x.reshape((b, n, f) if len(target) == nb + 2 else (b, n)), np.float64, ("C", "W"))


def beta_inputs(beta, batch_shape, n: int):
    """The delta rule's write strengths ``beta`` (a float, one per sequence, or one per token) as
    (B, N) C-contiguous float64 in [0, 2] (docs/theory.md, "Delta rule"); ValueError for NaN, out of
    range or a shape of no form, TypeError for non-real values."""
    x = as_host_array("beta", beta)
    if x.dtype.kind not in "iuf":
        raise TypeError(f"beta must hold real numbers (floats), got dtype {x.dtype}")
    x = x.astype(np.float64)
    if np.isnan(x).any():
        raise ValueError("beta contains NaN")
    if ((x < 0.0) | (x > 2.0)).any():
        bad = x[(x < 0.0) | (x > 2.0)].ravel()[0]
        raise ValueError(f"beta (the write strength) must lie in [0, 2], got {float(bad)!r}")
    batch_shape = tuple(int(s) for s in batch_shape)
    nb = len(batch_shape)
    forms = (f"a scalar or {nb} dimension(s) broadcastable to the batch shape {batch_shape} (per sequence), "
             f"or {nb + 1} with last axis N={n} (per token)")
    return _kernel_form("beta", x, batch_shape, n, forms)
