"""Diagonal-plus-low-rank (DPLR) linear attention: :func:`dplr_attention` and its gradients.

The recurrence, the named rules (:class:`linattn_nb.rules._dplr.DPLRRule`) and the stability
caveat: docs/dplr.md.
"""
from __future__ import annotations

import threading
from typing import Any, NamedTuple

import numpy as np

from . import config
from .feature_maps import resolve as _resolve_map
from .feature_maps._base import features_or_float64
from .ops._codes import (KERNEL_CODE_ELU, KERNEL_CODE_L2, KERNEL_CODE_RELU, KERNEL_CODE_SILU_L2, NORM_FLOOR, NORM_NONE,
                         NORM_RAW)
from .ops._finite import NonFiniteResult, check_finite_values
from .ops.grad import _rowmaps
from .rules import _dplr as D
from .rules import BUILTIN_DPLR_RULES, get_dplr_rule
from ._blas import parallel_entry
from ._workarrays import thread_array
from ._defaults import DEFAULT_EPS
from ._validate import as_host_array, check_bool, check_eps, check_float_dtype, check_out

__all__ = ["dplr_attention", "dplr_attention_vjp", "DPLRVJP", "DPLR_METHODS"]

#: The methods of :func:`dplr_attention` ("auto" picks "chunked" on the CPU from
#: :data:`linattn_nb.config.DPLR_AUTO_CHUNKED_MIN` steps on, else "scan").
DPLR_METHODS = ("auto", "quadratic", "scan", "chunked")

_GENERAL = "dplr"


def _floating(name, x):
    """``x`` read as every entry point reads an input (:func:`~linattn_nb._arrays.as_host_array`: masked,
    object, ragged and None refused, naming ``name``), of dtype float16, float32 or float64 (TypeError)."""
    arr = as_host_array(name, x)
    check_float_dtype(name, arr.dtype)
    return arr


def _general_check(inputs, lead, N, F, r, fast=False):
    """Check and reshape the general form's ``a``, ``b``, ``log_diag``, ``beta``; ``fast``: no float64
    copies, values checked only when the kernel reports a non-finite result."""
    B = int(np.prod(lead, dtype=np.int64))
    out = {}
    for name in ("a", "b"):
        x = inputs.get(name)
        if x is None:
            raise TypeError(f"missing argument: {name} (shape (..., N, D_phi) or (..., N, r, D_phi)); "
                            "or pass rule= a named rule")
        x = D.real(name, x, copy=not fast)
        if x.shape == lead + (N, F) and not r:
            x = x.reshape(B, N, 1, F)
        elif (x.ndim == len(lead) + 3 and x.shape[:-2] == lead + (N,) and x.shape[-1] == F
              and (not r or x.shape[-2] == r)):
            if not x.shape[-2]:  # no rank-one term: the scan would drop every write, the chunked form divide by 0
                raise ValueError(f"{name}'s factor axis (r, the second to last) must be >= 1, got shape {x.shape}")
            x = x.reshape(B, N, x.shape[-2], F)
        else:
            want = f"(..., N, r, D_phi) = {lead + (N, r, F)}" if r else \
                f"(..., N, D_phi) = {lead + (N, F)} or (..., N, r, D_phi)"
            raise ValueError(f"{name} must have shape {want}, got {x.shape}")
        out[name] = x
    if not fast:
        _finite_ab(out)
    if out["a"].shape != out["b"].shape:
        raise ValueError(f"a and b must have the same shape, got {inputs['a'].shape} and {inputs['b'].shape}")
    ld = inputs.get("log_diag")
    if ld is None:
        out["log_diag"] = None
    else:
        ld = D.token_or_feature("log_diag", ld, lead, N, F, copy=not fast)
        if not fast:
            _log_diag_range(ld)
        out["log_diag"] = ld
    beta = inputs.get("beta")
    if beta is None:
        out["beta"] = None
    else:
        beta = D.per_token("beta", beta, lead, N, r)
        if not np.isfinite(beta).all():
            raise ValueError("beta contains non-finite values (NaN or inf)")
        out["beta"] = beta
    return out


def _finite_ab(checked):
    """ValueError unless the general form's ``a`` and ``b`` are finite (the chunked forward checks them
    only when its kernel reports a non-finite row or result)."""
    for name in ("a", "b"):
        if not np.isfinite(checked[name]).all():
            raise ValueError(f"{name} contains non-finite values (NaN or inf)")


def _log_diag_range(ld):
    if ld is not None and not (ld <= 0).all():  # NaN fails too
        raise ValueError("log_diag must be <= 0 (-inf allowed: a reset), with no NaN")


def _general_build(fk, v, inp):
    Bn, N = fk.shape[:2]
    a, b = inp["a"], inp["b"]
    ld = np.zeros((Bn, N, 0)) if inp["log_diag"] is None else inp["log_diag"]
    if fk.ndim == 3:  # one write per token, after the last factor
        kw, vw = fk[:, :, None, :], v[:, :, None, :]
    else:
        kw, vw = fk, v
    if inp["beta"] is not None:
        beta = inp["beta"]
        kw = kw * (beta[:, :, None, None] if beta.ndim == 2 else beta[:, :, :, None])
    return D.GeneralForm(ld, a, b, kw, vw)


def _norm(normalize, eps):
    """``(norm code, eps)``; ``eps`` checked as linear_attention checks it (:func:`~linattn_nb._validate.check_eps`,
    with normalize off too): TypeError for a non-number (a bool too), ValueError for a negative or non-finite one."""
    if not isinstance(normalize, (bool, np.bool_)):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    eps = check_eps(eps)
    if not normalize:
        return NORM_NONE, 0.0
    if eps is None:
        return NORM_RAW, 0.0
    return NORM_FLOOR, eps


def _initial(initial_state, name, lead, F, M, check_finite):
    """(H0 (B, F, M + 1) float64, position) from ``initial_state`` (a LinearState of this rule or of no recorded
    rule, as linear_attention takes one, or None); the
    position checked as linear_attention checks it (:func:`~linattn_nb._frontend.check_position`), and with
    ``check_finite`` its ``S`` and ``z`` refused when they hold NaN or inf (ValueError naming each, with the
    count), as linear_attention refuses them; without, they are taken as they are."""
    from ._frontend import check_position

    B = int(np.prod(lead, dtype=np.int64))
    if initial_state is None:
        return np.zeros((B, F, M + 1)), 0
    S = getattr(initial_state, "S", None)
    z = getattr(initial_state, "z", None)
    if S is None or z is None:
        raise TypeError(f"initial_state must be a LinearState (from return_state=True), got "
                        f"{type(initial_state).__name__}")
    rule = getattr(initial_state, "rule", None)
    if rule is not None and rule != name:  # no rule recorded (a state made by hand): this call's own
        raise ValueError(f"initial_state was made by rule {rule!r}; this call runs {name!r}")
    position = check_position(getattr(initial_state, "position", 0))
    S = D.shaped("initial_state.S", S, lead + (F, M), "(..., D_phi, M)")
    z = D.shaped("initial_state.z", z, lead + (F,), "(..., D_phi)")
    if check_finite:
        check_finite_values("initial_state.S", S)
        check_finite_values("initial_state.z", z)
    H = np.empty((B, F, M + 1))
    H[:, :, :M] = S.reshape(B, F, M)
    H[:, :, M] = z.reshape(B, F)
    return H, position


class _Request(NamedTuple):
    """A checked DPLR call: everything the forward and the gradient share."""

    name: str
    spec: Any
    fmap: Any
    q: np.ndarray
    k: np.ndarray
    lead: tuple
    N: int
    M: int
    F: int
    r: int
    sub: bool
    dtype: np.dtype
    fq: np.ndarray
    fk: np.ndarray
    v64: np.ndarray
    checked: dict
    given: dict
    form: tuple
    H0: np.ndarray
    position: int
    norm: int
    eps: float
    keyed: bool = False


def _row_map(fmap, x) -> bool:
    """Whether ``x``'s features under ``fmap`` come from the parallel row-map kernels (``l2``, ``silu_l2``
    on float32/float64 inputs: the same values as the map's NumPy form, in one pass)."""
    return getattr(fmap, "kernel_code", None) in _rowmaps.ROW_CODES and x.dtype in (np.float32, np.float64)


_WORK = threading.local()


def _work_array(role, shape, dtype):
    """A work array of this thread for the chunked path's features (read by the kernel, never returned),
    reused by the next call of the same shape up to :data:`linattn_nb.config.DPLR_WORK_BYTES`."""
    return thread_array(_WORK, role, shape, dtype, config.DPLR_WORK_BYTES)


def _features(fmap, x, role, position, work=np.float64):
    """The features of ``x`` as a ``work`` array (float32 only on the chunked path: compiled maps, into
    this thread's work arrays)."""
    code = getattr(fmap, "kernel_code", None)
    if work == np.float32 and code is not None and x.dtype in (np.float32, np.float64):
        from .ops.dplr.chunked import elementwise_features, row_features

        out = _work_array(role, x.shape, work)
        x2, o2 = np.ascontiguousarray(x).reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1])
        if _row_map(fmap, x):
            row_features(x2.reshape(x2.shape[0], 1, x2.shape[1]), o2, code)  # -1 is ambiguous for 0 rows
        else:
            elementwise_features(x2, o2, code)
        return out
    if _row_map(fmap, x):
        return np.asarray(_rowmaps.features(x, fmap.kernel_code, x.dtype)[0], work)
    return np.asarray(fmap.apply(x, role=role, causal=True, offset=position), dtype=work)


#: Compiled maps whose features of finite inputs are finite in any dtype (ELU+1 and ReLU: at most ``x + 1``;
#: the L2 maps: unit rows), so that their features need no scan; the squared ReLU overflows float32 from
#: about 1.8e19.
_BOUNDED_MAPS = (KERNEL_CODE_ELU, KERNEL_CODE_RELU, KERNEL_CODE_L2, KERNEL_CODE_SILU_L2)


def _query_key_features(fmap, q, k, position, work, check_finite):
    """``(fq, fk, work)``: the features of q and k as :func:`_features` makes them, or in float64 from float64
    inputs where those of the finite q or k overflow (a map computed in float32, or float32 features;
    :func:`~linattn_nb.feature_maps._base.features_or_float64`).  The call then runs in float64: its state is
    float64 anyway, and its outputs are checked as they are cast to the inputs' dtype."""
    if getattr(fmap, "kernel_code", None) in _BOUNDED_MAPS:
        return _features(fmap, q, "query", position, work), _features(fmap, k, "key", position, work), work

    def make(w):
        xq, xk = (q, k) if w is work else (np.asarray(q, w), np.asarray(k, w))  # the retry: float64 inputs
        return _features(fmap, xq, "query", position, w), _features(fmap, xk, "key", position, w)

    (fq, fk), work = features_or_float64(fmap, make, work, check_finite)
    return fq, fk, work


def _features_vjp(fmap, x, g, role, position, dtype):
    """The gradient with respect to ``x`` of the features' gradient ``g`` (and the map's parameters'); a
    row map's is computed in float64 and rounded once to ``dtype`` (float32 or float64) as it is stored,
    which spares a float64 array the size of ``x`` (fresh pages on every call) and its copy."""
    if _row_map(fmap, x):
        out = dtype if dtype in (np.float32, np.float64) else np.float64
        return _rowmaps.vjp(x, g, fmap.kernel_code, out), None  # x read in float64
    return fmap.vjp(x, g, role=role, causal=True, offset=position)


def _prepare(q, k, v, rule, a, b, log_diag, beta, feature_map, method, normalize, eps, check_finite,
             initial_state, rule_arguments, fast=False) -> _Request:
    """Check a call's arguments and build the general form (shared by the forward and the VJP).

    ``fast`` (a CPU forward that may run ``chunked``): arrays stay in the working dtype, and a rule
    with a keyed form (:class:`~linattn_nb.rules._dplr.KeyedForm`) gives that instead (``keyed``)."""
    if rule is None:
        name = _GENERAL
        inputs = {"a": a, "b": b, "log_diag": log_diag, "beta": beta}
        if rule_arguments:
            raise TypeError(f"unexpected argument(s) {sorted(rule_arguments)}: the general form takes a, b, "
                            "log_diag, beta; a named rule's arguments need rule=")
        spec = None
    else:
        spec = get_dplr_rule(rule)
        name = spec.name
        given = {"a": a, "b": b, "log_diag": log_diag}
        extra = [n for n, x in given.items() if x is not None]
        if extra:
            raise TypeError(f"rule {name!r} builds its own {', '.join(extra)}: pass its arguments "
                            f"({', '.join(spec.arguments)}) instead")
        inputs = dict(rule_arguments)
        if beta is not None:
            inputs["beta"] = beta
        unknown = sorted(set(inputs) - set(spec.arguments))
        if unknown:
            raise TypeError(f"rule {name!r} takes {', '.join(spec.arguments)}; got unexpected {unknown}")
    if not isinstance(method, str):
        raise TypeError(f"method must be a string, got {type(method).__name__}")
    if method not in DPLR_METHODS:
        raise ValueError(f"method must be one of {DPLR_METHODS} for dplr_attention, got {method!r}")
    norm, eps_v = _norm(normalize, eps)

    q = _floating("q", q)
    k = _floating("k", k)
    v = _floating("v", v)
    if q.ndim < 2:
        raise ValueError(f"q must have shape (..., N, D), got {q.shape}")
    lead, (N, Dq) = q.shape[:-2], q.shape[-2:]
    sub = spec.substeps if spec is not None else k.ndim == q.ndim + 1
    kd = q.ndim + (1 if sub else 0)
    if k.ndim != kd or k.shape[:len(lead) + 1] != lead + (N,) or k.shape[-1] != Dq:
        want = "(..., N, r, D)" if sub else "(..., N, D)"
        raise ValueError(f"k must have shape {want} with q's (..., N) = {lead + (N,)} and D = {Dq}, got {k.shape}")
    r = k.shape[-2] if sub else 0
    if sub and r < 1:
        raise ValueError(f"k's sub-step axis must be >= 1, got {k.shape}")
    if v.ndim != kd or v.shape[:-1] != k.shape[:-1]:
        want = "(..., N, r, M)" if sub else "(..., N, M)"
        raise ValueError(f"v must have shape {want} with k's leading {k.shape[:-1]}, got {v.shape}")
    M = v.shape[-1]
    if check_finite:
        for nm, x in (("q", q), ("k", k), ("v", v)):
            check_finite_values(nm, x)
    dtype = np.result_type(q.dtype, k.dtype, v.dtype)

    fmap = _resolve_map(feature_map)
    if not normalize and getattr(fmap, "needs_normalizer", False):
        raise ValueError(f"feature map {fmap.name!r} needs the normaliser (its features carry per-row "
                         "factors that cancel only in the ratio): pass normalize=True")
    B = int(np.prod(lead, dtype=np.int64))
    F = int(fmap.output_dim(Dq))
    H0, position = _initial(initial_state, name, lead, F, M, check_finite)
    if sub and getattr(fmap, "position_dependent", False):
        raise ValueError(f"feature map {fmap.name!r} depends on the position: it is not defined for keys "
                         "with a sub-step axis")
    work = np.float32 if fast and dtype.itemsize <= 4 else np.float64
    fq, fk, work = _query_key_features(fmap, q, k, position, work, check_finite)
    fq = fq.reshape(B, N, F)
    fk = fk.reshape((B, N, r, F) if sub else (B, N, F))
    v64 = np.asarray(v, dtype=work if fast else np.float64).reshape((B, N, r, M) if sub else (B, N, M))

    keyed = False
    if spec is None:
        checked = _general_check(inputs, lead, N, F, r, fast)
        form = _general_build(fk, v64, checked)
    elif fast and spec.keyed is not None:  # the chunked kernel makes a, b, kw from the keys
        checked = _rule_checked(spec, inputs, lead, N, F, r)
        form, keyed = _rule_form(spec, spec.keyed(fk, v64, checked), B, N, F, M, keyed=True,
                                  steps=r if sub else 1), True
    else:
        checked = _rule_checked(spec, inputs, lead, N, F, r)
        if work == np.float32:  # the rule's map to the general form in float32 too
            checked = {n: x.astype(work) if getattr(x, "dtype", None) == np.float64 else x for n, x in checked.items()}
        form = _rule_form(spec, spec.build(fk, v64, checked), B, N, F, M)
    form = tuple(np.ascontiguousarray(x, dtype=x.dtype if fast and x.dtype in (np.float32, np.float64) else np.float64)
                 for x in form)

    return _Request(name, spec, fmap, q, k, lead, N, M, F, r, sub, dtype, fq, fk, v64, checked, inputs,
                    form, H0, position, norm, eps_v, keyed)


def check_pullback(spec) -> None:
    """ValueError naming the rule when it has no ``pullback``: its gradients cannot be computed."""
    if not callable(spec.pullback):
        raise ValueError(f"rule {spec.name!r} has no pullback (the gradient of its build, docs/dplr.md, \"A rule "
                         "of your own\"): dplr_attention_vjp and the torch adapter's backward need one; its "
                         "forward runs without")


def _user_rule(spec) -> bool:
    """Whether ``spec`` is a rule from outside this package (its check and build are then checked)."""
    return not any(spec is rule for rule in BUILTIN_DPLR_RULES)


def _rule_checked(spec, inputs, lead, N, F, r) -> dict:
    """A named rule's :meth:`check`; TypeError naming the rule when a researcher's check returns no dict."""
    checked = spec.check(inputs, lead, N, F, r)
    if not isinstance(checked, dict):
        raise TypeError(f"rule {spec.name!r}: check must return a dict of the checked arguments, got "
                        f"{type(checked).__name__}")
    return checked


def _rule_pullback(spec, R, g):
    """A named rule's :meth:`pullback` of the request ``R``; for a researcher's rule its result checked:
    ValueError naming the rule and what is wrong (not a ``(dfk, dv, dinputs)`` triple, a shape other than
    ``fk``'s or ``v``'s, an unknown argument, no gradient for an argument the call passed, or one whose size
    is not that argument's)."""
    out = spec.pullback(R.fk, R.v64, R.checked, g)
    if not _user_rule(spec):
        return out
    where = f"rule {spec.name!r}: pullback(fk, v, inputs, g) must return (dfk, dv, dinputs)"
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise ValueError(f"{where}, got {type(out).__name__}"
                         + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    dfk, dv, dinp = out
    for name, x, ref in (("dfk", dfk, R.fk), ("dv", dv, R.v64)):
        if np.shape(x) != np.shape(ref):
            raise ValueError(f"{where}: {name} has shape {np.shape(x)}, expected {np.shape(ref)} (that of "
                             f"{'fk' if name == 'dfk' else 'v'})")
    if not isinstance(dinp, dict):
        raise ValueError(f"{where}: dinputs must be a dict by argument name, got {type(dinp).__name__}")
    known = set(spec.arguments) | {"decay"}
    unknown = sorted(set(dinp) - known)
    if unknown:
        raise ValueError(f"{where}: dinputs names {unknown}, which the rule does not take ({sorted(spec.arguments)})")
    for key, given in R.given.items():
        want = "decay" if key in ("decay", "log_decay") else key  # not a rule: the arguments decay, log_decay
        if given is not None and key in spec.arguments and want not in dinp:
            raise ValueError(f"{where}: dinputs has no gradient for {want!r}, which the call passed")
        if given is not None and want in dinp and np.size(dinp[want]) != np.size(given):
            ref = R.checked.get(want)
            shape = np.shape(ref) if ref is not None and np.size(ref) == np.size(given) else np.shape(given)
            raise ValueError(f"{where}: dinputs[{want!r}] has shape {np.shape(dinp[want])}, expected {shape} "
                             f"(that of {want!r} as check returns it; the call passed {key} of shape "
                             f"{np.shape(given)})")
    return out


def _rule_form(spec, form, B, N, F, M, keyed=False, steps=1):
    """A researcher's rule's general (or keyed) form, checked: ValueError naming the rule, the field and the
    shape it must have, or the values it holds (a log-diagonal above 0 or NaN, non-finite vectors), before a
    kernel reads it.  ``steps``: the keys' sub-steps (1 without), which a keyed form's r must equal (the
    chunked kernel reads one ``cb``, ``cw``, ``vw`` per key).  The package's own rules are returned as they
    are."""
    if not _user_rule(spec):
        return form
    kind = D.KeyedForm if keyed else D.GeneralForm
    what = f"rule {spec.name!r}: {'keyed' if keyed else 'build'}"
    if not isinstance(form, tuple) or len(form) != len(kind._fields):
        raise TypeError(f"{what} must return a {kind.__name__} ({', '.join(kind._fields)}), got "
                        f"{type(form).__name__}")
    form = kind(*(np.asarray(x) for x in form))
    for name, x in zip(kind._fields, form):
        if x.dtype.kind != "f":
            raise TypeError(f"{what}: {name} must be a floating-point array, got dtype {x.dtype}")
    ld = form.ld
    if ld.ndim != 3 or ld.shape[:2] != (B, N) or ld.shape[2] not in (0, 1, F):
        raise ValueError(f"{what}: ld must have shape (B, N, W) = ({B}, {N}, W) with W = 0, 1 or D_phi = {F}, "
                         f"got {ld.shape}")
    if keyed:
        r = steps
        want = {"cb": (B, N, r), "cw": (B, N, r), "vw": (B, N, r, M)}
    else:
        r = form.a.shape[2] if form.a.ndim == 4 else -1
        w = form.kw.shape[2] if form.kw.ndim == 4 and form.kw.shape[2] in (1, r) else r
        want = {"a": (B, N, r, F), "b": (B, N, r, F), "kw": (B, N, w, F), "vw": (B, N, w, M)}
    axes = "(B, N, r)" if keyed else "(B, N, r, D_phi)"
    for name, shape in want.items():
        x = getattr(form, name)
        if r < 1 or x.shape != shape:
            how = "r: the keys' sub-steps, 1 without" if keyed else "the writes kw, vw: r of them or one"
            raise ValueError(f"{what}: {name} must have shape {shape if r >= 1 else axes} (B = {B}, N = {N}, "
                             f"D_phi = {F}, M = {M}; {how}), got {x.shape}")
    if np.isnan(ld).any() or (ld > 0).any():
        raise ValueError(f"{what}: ld, the log-diagonal, must be <= 0 (-inf resets), got values "
                         f"{'NaN' if np.isnan(ld).any() else 'above 0'}")
    for name in want:
        if not np.isfinite(getattr(form, name)).all():
            raise ValueError(f"{what}: {name} holds non-finite values (NaN or inf) although the inputs are finite")
    return form


def _general_arrays(R: _Request, chunked: bool):
    """``(ld, A, Bv, KW, VW, scales)`` for the kernels; ``scales = (cb, cw)`` only for a keyed request
    run ``chunked`` (its keys as ``A``, ``Bv``, ``KW``), else None."""
    if not R.keyed:
        return R.form + (None,)
    if not chunked:
        form = _rule_form(R.spec, R.spec.build(R.fk, R.v64, R.checked), *R.fk.shape[:2], R.F, R.M)
        return tuple(np.ascontiguousarray(x, dtype=np.float64) for x in form) + (None,)
    ld, cb, cw, VW = R.form
    K = np.ascontiguousarray(R.fk if R.sub else R.fk[:, :, None])
    return ld, K, K, K, VW, (cb, cw)


@parallel_entry
def dplr_attention(q, k, v, *, rule=None, a=None, b=None, log_diag=None, beta=None, feature_map="elu",
                   method="auto", normalize=False, eps=DEFAULT_EPS, check_finite=True, out=None,
                   initial_state=None, return_state=False, device="auto", **rule_arguments):
    r"""Causal linear attention with a diagonal-plus-low-rank state transition.

    .. math:: S_t = (D_t + b_t a_t^\top) S_{t-1} + \beta_t \phi(k_t) v_t^\top, \qquad
              o_t = \phi(q_t)^\top S_t \; (/\ \phi(q_t)^\top z_t \text{ with } normalize)

    Give the general form's arrays (``a``, ``b``, ``log_diag``, ``beta``) or a named rule
    (:func:`linattn_nb.rules.dplr_rule_names`) with its own arguments as keywords (docs/dplr.md).

    Parameters
    ----------
    q : array_like, shape (..., N, D)
    k : array_like, shape (..., N, D), or (..., N, r, D) for ``r`` writes per token
    v : array_like, shape (..., N, M), or (..., N, r, M) with k
        Equal leading batch dimensions; float16, float32 or float64 (outputs in the widest).
        With a sub-step axis each of the ``r`` factors has its own write (docs/dplr.md).
    rule : str, optional
        A named rule of the family; its arguments are passed as keywords.
    a, b : array_like, shape (..., N, D_phi) or (..., N, r, D_phi)
        The low-rank vectors in feature space: the feature map applies to ``q`` and ``k`` only,
        never to ``a`` and ``b``.
    log_diag : array_like, shape (..., N) or (..., N, D_phi), optional
        ``log`` of the diagonal (<= 0; ``-inf`` a reset); the identity when omitted.
    beta : array_like, shape (..., N) (or (..., N, r) with sub-steps), optional
        Write strengths (1 when omitted).
    feature_map : str, FeatureMap or None, default "elu"
    method : {"auto", "quadratic", "scan", "chunked"}
        ``quadratic``: the float64 reference loop; ``scan``: the compiled scan; ``chunked``: the
        chunkwise-parallel form (the scan with ``device="cuda"``); ``auto``: ``chunked`` on the CPU
        from ``N * r >=`` :data:`linattn_nb.config.DPLR_AUTO_CHUNKED_MIN`, else ``scan``
        (docs/dplr.md, "Methods").
    normalize : bool, default False
        Divide by ``phi(q_t)^T z_t`` (floored at ``eps`` unless None).  Off by default: a transition
        with a low-rank part moves ``z`` through the same factors, and it need not stay positive.
    eps : float or None
        The floor of the normaliser (a finite number >= 0; None: raw division), checked as
        :func:`linattn_nb.linear_attention` checks it, with ``normalize=False`` too.
    check_finite : bool, default True
        Refuse NaN/inf in q, k, v and ``initial_state`` (ValueError naming the argument and counting the
        values, as :func:`linattn_nb.linear_attention`); raise
        :class:`~linattn_nb.ops._finite.NonFiniteResult` when the outputs or the state overflow.  False
        takes them as they are (NaN outputs, no error).
    out : ndarray, shape (..., N, M), optional
        Written in place (its dtype must be the outputs').
    initial_state : LinearState, optional
        The state a previous call of the same rule returned (its ``position`` a non-negative integer, at
        most ``2**63 - 1``; its ``S`` and ``z`` finite with ``check_finite``), or one whose ``rule`` is None
        (made by hand), taken as this rule's; a state of another rule raises ValueError.
    return_state : bool, default False
        Also return the final state (a :class:`~linattn_nb.LinearState` whose ``rule`` is the rule's
        name, ``"dplr"`` for the general form).
    device : {"auto", "cpu", "cuda"}, default "auto"
        Where ``scan`` runs: ``auto`` follows ``q``.  GPU inputs give device outputs and a host
        state; ``cuda`` without a usable GPU or the simulator raises ``RuntimeError``
        (docs/dplr.md, "Methods").

    Returns
    -------
    out : ndarray, shape (..., N, M)
    state : LinearState
        With ``return_state``.

    Raises
    ------
    TypeError
        Non-floating inputs, a missing or unknown argument; ``return_state`` or ``check_finite`` not a
        bool, ``eps`` not a number or None (a bool too), ``initial_state.position`` not an integer (a bool,
        a string), as :func:`linattn_nb.linear_attention`.
    ValueError
        Shapes that do not match (the message names the argument and the shape it expects), values
        out of range (``log_diag``/``log_decay`` > 0, ``decay`` outside [0, 1]), an unknown method; a
        negative or non-finite ``eps``; an ``initial_state.position`` below 0, above ``2**63 - 1`` or
        not integral (2.7); with ``check_finite``, NaN or inf in q, k, v, ``initial_state.S`` or
        ``initial_state.z`` (the message names it and counts them).
    NonFiniteResult
        The outputs or the state hold NaN or inf although the inputs are finite: a transition with
        ``||D_t + b_t a_t^T|| > 1`` grew the (float64) state, or an output its dtype's range
        (docs/dplr.md, "Stability").

    Examples
    --------
    The delta rule as a DPLR transition (``a = phi(k)``, ``b = -beta phi(k)``):

    >>> import numpy as np
    >>> from linattn_nb import dplr_attention, linear_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 16, 8))
    >>> beta = rng.uniform(0, 1, size=(2, 16))
    >>> fk = k / np.linalg.norm(k, axis=-1, keepdims=True)
    >>> o = dplr_attention(q, k, v, a=fk, b=-beta[..., None] * fk, beta=beta, feature_map="l2")
    >>> ref = linear_attention(q, k, v, causal=True, beta=beta, feature_map="l2")
    >>> bool(np.allclose(o, ref, atol=1e-12))
    True
    """
    check_finite, return_state = check_bool("check_finite", check_finite), check_bool("return_state", return_state)
    dev, q_dev, (q, k, v, a, b, log_diag, beta), rule_arguments = _route(
        device, (q, k, v, a, b, log_diag, beta), ("q", "k", "v", "a", "b", "log_diag", "beta"), rule_arguments, out)
    fast = dev != "cuda" and method in ("auto", "chunked")
    R = _prepare(q, k, v, rule, a, b, log_diag, beta, feature_map, method, normalize, eps, check_finite,
                 initial_state, rule_arguments, fast)
    name, lead, N, M, F, dtype, position = R.name, R.lead, R.N, R.M, R.F, R.dtype, R.position
    B = int(np.prod(lead, dtype=np.int64))
    fq, H0, norm, eps_v = R.fq, R.H0, R.norm, R.eps
    steps = R.form[1].shape[2]  # sub-steps per token: a's (B, N, r, F), or a keyed form's cb (B, N, r)
    chunked = fast and (method == "chunked" or N * steps >= config.DPLR_AUTO_CHUNKED_MIN)
    ld, A, Bv, KW, VW, scales = _general_arrays(R, chunked)
    if fast and not chunked:  # the scan reads float64
        fq, ld, A, Bv, KW, VW = (np.ascontiguousarray(x, dtype=np.float64) for x in (fq, ld, A, Bv, KW, VW))
        if R.spec is None:
            _finite_ab(R.checked)
            _log_diag_range(R.checked["log_diag"])
    dev_out = None
    if out is not None and dev == "cuda" and _on_device(out):
        dev_out, out = out, None
        # as every entry point: a wrong shape is a ValueError, a wrong dtype a TypeError
        if tuple(dev_out.shape) != lead + (N, M):
            raise ValueError(f"out must have shape {lead + (N, M)}, got {tuple(dev_out.shape)}")
        if np.dtype(dev_out.dtype) != dtype:
            raise TypeError(f"out must have dtype {dtype}, got {np.dtype(dev_out.dtype)}")
    if out is not None:
        check_out(out, lead + (N, M), dtype)  # read-only refused too, before the call's work
    if method == "quadratic":
        from .ops.dplr.naive import dplr_reference

        o64, H = dplr_reference(fq, ld, A, Bv, KW, VW, H0, norm=norm, eps=eps_v)
        bad = not (np.isfinite(H).all() and np.isfinite(o64).all())
    elif dev == "cuda":
        from .ops.dplr.cuda import dplr_scan_cuda

        H, o64 = H0, np.empty((B, N, M))
        bad = bool(dplr_scan_cuda(fq, ld, A, Bv, KW, VW, H, o64, norm, eps_v).any())
    elif chunked:
        from .ops.dplr.chunked import dplr_chunked

        H, o64 = H0, np.empty((B, N, M), fq.dtype)  # the working dtype: float32 for float32 calls
        bad = bool(dplr_chunked(fq, ld, A, Bv, KW, VW, H, o64, norm, eps_v, *(scales or ())).any())
    else:
        from .ops.dplr.cpu import dplr_scan

        H, o64 = H0, np.empty((B, N, M))
        bad = bool(dplr_scan(np.ascontiguousarray(fq), ld, A, Bv, KW, VW, H, o64, norm, eps_v).any())
    with np.errstate(over="ignore"):
        res = o64.astype(dtype, copy=False)
    if check_finite and not bad and dtype.itemsize < o64.dtype.itemsize:
        bad = not np.isfinite(res).all()
    if bad and fast and R.spec is None:  # the general form's a, b, log_diag: checked as the kernel read them
        _finite_ab(R.checked)
        _log_diag_range(R.checked["log_diag"])
    if bad and check_finite:
        raise NonFiniteResult(
            f"dplr_attention ({name}): the outputs or the state hold NaN or inf although the inputs are finite: "
            "the transition D + b a^T grew the state past the float64 range (its norm exceeds 1 over many "
            f"tokens), or an output exceeds {np.dtype(dtype).name}'s range")
    res = res.reshape(lead + (N, M))
    if out is not None:
        out[...] = res
        res = out
    elif dev_out is not None or q_dev:
        res = _to_device(res, dev_out)
    if not return_state:
        return res
    from ._frontend import LinearState

    return res, LinearState(S=H[:, :, :M].reshape(lead + (F, M)).copy(), z=H[:, :, M].reshape(lead + (F,)).copy(),
                            position=position + N, rule=name)


def _on_device(x):
    from .device import on_device

    return on_device(x)


def _route(device, arrays, names, rule_arguments, out):
    """``(device, q on the device, host arrays, host rule arguments)``: where the scan runs (``auto``
    follows the inputs, as :func:`linattn_nb.device.resolve_device`), the arrays read to the host
    (the form is built there)."""
    from .device import resolve_device

    extra = tuple(rule_arguments.items())
    every = arrays + tuple(x for _, x in extra) + (out,)
    dev = resolve_device(device, *every, names=names + tuple(n for n, _ in extra) + ("out",))
    if not any(_on_device(x) for x in every):
        return dev, False, arrays, rule_arguments
    from . import _cuda_dispatch as CD

    def host(name, x):
        return CD.to_host(name, x) if _on_device(x) else x

    return (dev, dev == "cuda" and _on_device(arrays[0]), tuple(host(n, x) for n, x in zip(names, arrays)),
            {n: host(n, x) for n, x in extra})


def _to_device(res, dev_out):
    """The outputs on the device: copied into the caller's device ``out``, or a new device array."""
    from numba import cuda

    if dev_out is None:
        return cuda.to_device(np.ascontiguousarray(res))
    from . import _cuda_dispatch as CD

    dout = CD.wrap("out", dev_out)
    if dout.is_c_contiguous():
        dout.copy_to_device(np.ascontiguousarray(res))
    else:  # a strided view: one copy can fill contiguous memory only, so Numba's element-wise assignment
        dout[...] = cuda.to_device(np.ascontiguousarray(res))
    return dev_out


class DPLRVJP(NamedTuple):
    """Gradients returned by :func:`dplr_attention_vjp`.

    Attributes
    ----------
    dq, dk, dv : ndarray
        With respect to q, k, v, in their shapes and the outputs' dtype.
    d_inputs : dict
        With respect to every array argument the call was given, by its name and in its shape
        (``a``, ``b``, ``log_diag``, ``beta``; a named rule's ``decay`` or ``log_decay``, ``beta``,
        ``kappa``, ``iclr``), float64.  With respect to ``decay`` it is finite at ``decay = 0``;
        with respect to a log it is the factor times that (0 at a reset).
    d_initial_state : LinearState or None
        With respect to ``initial_state.S`` and ``.z`` (float64), when one was given.
    d_params : dict or None
        The feature map's parameter gradients (query and key roles summed), for maps with parameters.
    """

    dq: Any
    dk: Any
    dv: Any
    d_inputs: dict
    d_initial_state: Any = None
    d_params: Any = None


def _general_pullback(R: _Request, g):
    """The general entry's :meth:`~linattn_nb.rules._dplr.DPLRRule.pullback`."""
    fk, beta = R.fk, R.checked["beta"]
    dK = g["kw"] if R.sub else g["kw"][:, :, 0]
    dfk = dK if beta is None else dK * beta[..., None]
    out = {"a": g["a"], "b": g["b"]}
    if beta is not None:
        out["beta"] = (dK * fk).sum(-1)
    if R.checked["log_diag"] is not None:
        out["log_diag"] = g["diag"] * np.exp(R.checked["log_diag"])
    return dfk, (g["vw"] if R.sub else g["vw"][:, :, 0]), out


def _state_grad(grad_state, lead, F, M, check_finite):
    """``dL/d`` of the final state as (B, F, M + 1) float64 (zeros for None), read as linear_attention_vjp reads
    it (:func:`~linattn_nb._frontend.parse_state`): a LinearState or a tuple ``(S, z[, position])``, both
    arrays required (TypeError naming ``grad_state.z`` for a None, as there: the state's ``z`` is part of it
    with ``normalize=False`` too), its ``position`` a non-negative integer (not compared with the call's, as
    there); with ``check_finite`` its ``S`` and ``z`` refused when they hold NaN or inf."""
    from ._frontend import host_array, parse_state

    B = int(np.prod(lead, dtype=np.int64))
    dH = np.zeros((B, F, M + 1))
    if grad_state is None:
        return dH
    S, z, _ = parse_state(grad_state, "grad_state")
    checked = []
    for name, x, want, what in (("grad_state.S", S, lead + (F, M), "(..., D_phi, M)"),
                                ("grad_state.z", z, lead + (F,), "(..., D_phi)")):
        x = host_array(name, x)
        check_float_dtype(name, x.dtype)  # a gradient, as linear_attention_vjp reads it (not a rule's argument)
        x = D.shaped(name, x, want, what)
        if check_finite:
            check_finite_values(name, x)
        checked.append(x)
    S, z = checked
    dH[:, :, :M] = S.reshape(B, F, M)
    dH[:, :, M] = z.reshape(B, F)
    return dH


@parallel_entry
def dplr_attention_vjp(q, k, v, grad_out, *, rule=None, a=None, b=None, log_diag=None, beta=None,
                       feature_map="elu", method="auto", normalize=False, eps=DEFAULT_EPS,
                       check_finite=True, initial_state=None, grad_state=None, **rule_arguments):
    """Gradients of :func:`dplr_attention` (arguments as there) for the output adjoint ``grad_out``.

    Parameters
    ----------
    grad_out : array_like, shape (..., N, M)
        ``dL/d out``.
    grad_state : LinearState or tuple (S, z[, position]), optional
        ``dL/d`` of the final state, ``S`` (..., D_phi, M) and ``z`` (..., D_phi), for a loss that reads
        it; taken as :func:`linattn_nb.linear_attention_vjp` takes it: both arrays are required (zeros
        for a part the loss does not read; ``z`` is part of the state with ``normalize=False`` too), and
        ``position`` is checked as ``initial_state.position`` is, not compared with the call's.

    Returns
    -------
    DPLRVJP

    Raises
    ------
    TypeError, ValueError
        As :func:`dplr_attention` for its arguments; a ``grad_out`` or ``grad_state`` of the wrong shape
        (ValueError); a ``grad_state`` that is no state, whose ``z`` is None or whose ``S`` or ``z`` is not
        floating point (TypeError), or whose ``position`` is not a non-negative integer (as
        ``initial_state.position``).  With ``check_finite``,
        a ``grad_out``, ``grad_state.S`` or ``grad_state.z`` holding NaN or inf (ValueError naming it and
        counting the values, as :func:`linattn_nb.linear_attention_vjp`).  A rule of one's own without a
        ``pullback``, or one whose result is not what it must be (the rule named, the field and the shape
        expected).

    Notes
    -----
    The gradients are computed on the CPU in float64.  ``method="chunked"``, and ``"auto"`` where the
    forward would run ``chunked`` and ``D_phi >=``
    :data:`linattn_nb.config.DPLR_BACKWARD_CHUNKED_MIN_FEATURES`, runs the chunk form in reverse (GEMMs
    per chunk of :data:`linattn_nb.config.DPLR_BACKWARD_CHUNK` steps; tokens with a strong decay or a
    reset by the scan); ``"scan"`` and ``"quadratic"`` run the checkpointed scan backward (docs/dplr.md,
    "Gradients").

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb.dplr import dplr_attention_vjp
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 8, 4))
    >>> g = dplr_attention_vjp(q, k, v, np.ones((8, 4)), rule="kda", decay=np.full((8, 4), 0.9),
    ...                        beta=np.full(8, 0.5), feature_map="l2")
    >>> g.dq.shape, sorted(g.d_inputs)
    ((8, 4), ['beta', 'decay'])
    """
    check_finite = check_bool("check_finite", check_finite)
    if rule is not None:
        check_pullback(get_dplr_rule(rule))
    R = _prepare(q, k, v, rule, a, b, log_diag, beta, feature_map, method, normalize, eps, check_finite,
                 initial_state, rule_arguments)
    lead, N, M, F = R.lead, R.N, R.M, R.F
    B = int(np.prod(lead, dtype=np.int64))
    dout = D.shaped("grad_out", grad_out, lead + (N, M), "(..., N, M)").reshape(B, N, M)
    if check_finite:
        check_finite_values("grad_out", dout)  # the count in the message, as linear_attention_vjp's
    dH = _state_grad(grad_state, lead, F, M, check_finite)
    ld, A, Bv, KW, VW = R.form
    fq = np.ascontiguousarray(R.fq)
    if method == "chunked" or (method == "auto" and N * A.shape[2] >= config.DPLR_AUTO_CHUNKED_MIN
                               and F >= config.DPLR_BACKWARD_CHUNKED_MIN_FEATURES):
        from .ops.dplr.chunked_grad import dplr_chunked_backward

        grads = dplr_chunked_backward(fq, ld, A, Bv, KW, VW, R.H0.copy(), dout, dH, R.norm, R.eps)
    else:
        from .ops.dplr.cpu import dplr_scan_backward

        C = max(N, 1) if method == "quadratic" else config.cpu_backward_checkpoint(N, F, M + 1, 8)
        grads = dplr_scan_backward(fq, ld, A, Bv, KW, VW, R.H0.copy(), dout, dH, R.norm, R.eps, C)
    dfq, ddiag, dA, dBv, dKW, dVW, dH0 = grads
    g = {"diag": ddiag, "a": dA, "b": dBv, "kw": dKW, "vw": dVW}
    if R.spec is None:
        dfk, dv, dinp = _general_pullback(R, g)
    else:
        dfk, dv, dinp = _rule_pullback(R.spec, R, g)
    d_inputs = {}
    for key, val in dinp.items():
        if key == "decay" and R.given.get("log_decay") is not None:  # not a rule: the argument given
            given = np.asarray(R.given["log_decay"], dtype=np.float64)
            d_inputs["log_decay"] = np.reshape(val, given.shape) * np.exp(given)
        elif R.given.get(key) is not None:  # a gradient for an optional argument the call did not pass: dropped
            d_inputs[key] = np.reshape(val, np.shape(R.given[key]))
    fmap = R.fmap
    dq, pq = _features_vjp(fmap, R.q, dfq.reshape(lead + (N, F)), "query", R.position, R.dtype)
    dk, pk = _features_vjp(fmap, R.k, dfk.reshape(R.k.shape[:-1] + (F,)), "key", R.position, R.dtype)
    params = None
    if pq or pk:
        params = {n: (pq or {}).get(n, 0.0) + (pk or {}).get(n, 0.0) for n in set(pq or {}) | set(pk or {})}
    d_init = None
    if initial_state is not None:
        from ._frontend import LinearState

        d_init = LinearState(S=dH0[:, :, :M].reshape(lead + (F, M)), z=dH0[:, :, M].reshape(lead + (F,)),
                             position=R.position, rule=R.name)
    dt = R.dtype
    return DPLRVJP(np.asarray(dq).astype(dt, copy=False), np.asarray(dk).astype(dt, copy=False),
                   np.reshape(dv, np.shape(v)).astype(dt), d_inputs, d_init, params)
