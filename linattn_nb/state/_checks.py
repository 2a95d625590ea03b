"""Argument checks shared by the state objects (:mod:`~linattn_nb.state.linear`,
:mod:`~linattn_nb.state.kvcache`) and the state file format (:mod:`~linattn_nb.state.fileformat`).
"""
from __future__ import annotations

import numpy as np

from .. import _frontend as FE
from .. import _validate as V

#: The dtypes a state (or a KV cache) can hold.
STATE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)


def check_dim(name, x) -> int:
    """A dimension: an integer >= 1 (TypeError for non-integers, ValueError below 1)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an integer >= 1, got {type(x).__name__}")
    if x < 1:
        raise ValueError(f"{name} must be >= 1, got {x}")
    return int(x)


def check_batch_shape(batch_shape) -> tuple:
    """``batch_shape`` as a tuple of non-negative ints (an int is a 1-tuple)."""
    if isinstance(batch_shape, (int, np.integer)) and not isinstance(batch_shape, (bool, np.bool_)):
        batch_shape = (batch_shape,)
    try:
        bs = tuple(batch_shape)
    except TypeError:
        raise TypeError(f"batch_shape must be a tuple of integers, got {type(batch_shape).__name__}") from None
    for x in bs:
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 0:
            raise ValueError(f"batch_shape must hold non-negative integers, got {bs}")
    return tuple(int(x) for x in bs)


def check_state_dtype(dtype, what: str = "the state's accumulation precision") -> np.dtype:
    """float32 or float64 (``what``: what the dtype is, for the message)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32 or float64, got {dtype!r}") from None
    if dt not in STATE_DTYPES:
        raise TypeError(f"dtype must be float32 or float64 ({what}), got {dt}")
    return dt


def shape_text(shape) -> str:
    """A shape with symbolic axes, unquoted: ``(2, T, 8)``."""
    items = [str(x) for x in shape]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def check_shapes(batch_shape, pairs) -> int:
    """pairs: [(name, array, last_dim)]: batch shape, last dims and equal T (axis -2). Returns T."""
    nb = len(batch_shape)
    T = None
    for name, x, last in pairs:
        shp = tuple(x.shape)
        if len(shp) != nb + 2 or shp[:nb] != batch_shape or shp[-1] != last:
            label = "value_dim" if name == "v" else "key_dim"
            raise ValueError(
                f"{name} must have shape {shape_text(batch_shape + ('T', last))} (batch_shape {batch_shape}, "
                f"T tokens, {label} {last}), got {shp}"
            )
        if T is None:
            T = shp[-2]
        elif shp[-2] != T:
            raise ValueError(
                f"{', '.join(n for n, _, _ in pairs)} must have the same number of tokens T (axis -2), "
                f"got shapes {', '.join(str(tuple(a.shape)) for _, a, _ in pairs)}"
            )
    return int(T)


def host_tokens(batch_shape, pairs):
    """Host arrays of ``pairs`` [(name, array_like, last_dim)], checked: float dtypes, shapes
    ``(*batch_shape, T, last_dim)`` with one T.  Returns ``(arrays, T, promoted dtype)``."""
    arrs = []
    for n, x, last in pairs:
        x = V.as_host_array(n, x)
        V.check_float_dtype(n, x.dtype)
        arrs.append((n, x, last))
    T = check_shapes(batch_shape, arrs)
    return arrs, T, np.dtype(np.result_type(*[a.dtype for _, a, _ in arrs]))


def raise_nonfinite(name):
    """The error of a decode call whose input ``name`` holds NaN or inf (nothing was changed)."""
    raise ValueError(f"{name} contains non-finite values (NaN or inf); nothing was changed. "
                     "Pass check_finite=False to skip this check")


def _step_decay_form(name, x, batch_shape, t: int, f: int):
    """A step's ``decay``/``log_decay`` array ``x`` in the form of :func:`linattn_nb.linear_attention`
    with N = T (see :func:`call_forms`); errors name ``name``."""
    bs = tuple(batch_shape)
    nb = len(bs)
    forms = (f"a scalar or {nb} dimension(s) broadcastable to the batch shape {bs} (per sequence), "
             f"{nb + 1} with last axis D_phi={f} (a per-feature gate), or {nb + 2} with last axes (T, 1)=({t}, 1) "
             f"(per token) or (T, D_phi)=({t}, {f}) (a per-feature gate per token)")
    if x.ndim == 0 or x.ndim == nb:
        pass  # per sequence: decay_inputs broadcasts it over the batch and the tokens
    elif x.ndim == nb + 1:
        if x.shape[-1] != f:
            raise ValueError(f"{name} of shape {x.shape} has {x.ndim} dimensions (a per-feature gate of a step), "
                             f"so its last axis must be D_phi={f}; expected {forms}")
        if t == f and t > 1:  # linear_attention and prefill read (..., N) as one factor per token
            raise ValueError(f"{name} of shape {x.shape} is ambiguous in a step of T = D_phi = {t} tokens: a step "
                             "reads (*batch_shape, D_phi) as a per-feature gate for every token, linear_attention "
                             "and prefill read (*batch_shape, N) as one factor per token; pass (*batch_shape, T, 1) "
                             "for one factor per token, or (*batch_shape, T, D_phi) for a gate")
        try:
            x = np.broadcast_to(x[..., None, :], bs + (t, f))
        except ValueError:
            raise ValueError(f"{name} of shape {x.shape} does not broadcast to {bs + (f,)}; "
                             f"expected {forms}") from None
    elif x.ndim == nb + 2:
        if x.shape[-2] != t or x.shape[-1] not in (1, f):
            raise ValueError(f"{name} of shape {x.shape} has {x.ndim} dimensions (one factor per token), so its "
                             f"last axes must be (T, 1)=({t}, 1) or (T, D_phi)=({t}, {f}); expected {forms}")
        if x.shape[-1] == 1:
            x = x[..., 0]
    else:
        raise ValueError(f"{name} of shape {x.shape} has {x.ndim} dimensions; expected {forms}")
    return x


def _step_beta_form(x, batch_shape, t: int):
    """A step's ``beta`` (a host array) in the form of :func:`linattn_nb._validate.beta_inputs` with N = T
    (``(*batch, T, 1)``, the step form of a per-token value, loses its last axis)."""
    nb = len(tuple(batch_shape))
    if x.ndim == nb + 2:
        if x.shape[-2:] != (t, 1):
            raise ValueError(f"beta of shape {x.shape} has {x.ndim} dimensions (one per token), so its last axes "
                             f"must be (T, 1)=({t}, 1); expected a scalar or {nb} dimension(s) broadcastable to the "
                             f"batch shape {tuple(batch_shape)} (per sequence), or {nb + 1} with last axis T={t} or "
                             f"{nb + 2} with last axes (T, 1) (per token)")
        x = x[..., 0]
    return x


def call_forms(decay, log_decay, beta, batch_shape, t: int, f: int, *, step: bool) -> dict:
    """A step's (``step=True``) or a prefill's ``decay``/``log_decay`` and ``beta`` in the forms of
    :func:`linattn_nb.linear_attention` with N = T: the keywords ``decay``, ``log_decay``, ``beta``.

    A prefill takes those forms, a step those of :meth:`LinearAttentionState.step` (mapped onto them by
    :func:`_step_decay_form` and :func:`_step_beta_form`).  GPU arrays are copied to the host; the front
    end parses the result (:func:`linattn_nb._frontend.rule_arguments`; it refuses decay with log_decay).
    """
    forms = {"decay": decay, "log_decay": log_decay, "beta": None}  # not a rule: the argument names
    for name in ("decay", "log_decay"):
        if forms[name] is not None:
            x = FE.host_array(name, forms[name])
            forms[name] = _step_decay_form(name, x, batch_shape, t, f) if step else x
    if beta is not None:
        beta = FE.host_array("beta", beta)
        forms["beta"] = _step_beta_form(beta, batch_shape, t) if step else beta
    return forms
