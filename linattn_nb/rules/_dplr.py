"""What a diagonal-plus-low-rank (DPLR) rule is: :class:`DPLRRule`, and the argument checks they share.

Every rule of this kind is one recurrence with its own parameterisation.  Per token ``t`` the state
``H = [S | z]`` (F x (M + 1)) moves through ``r`` factors, the first with a diagonal,

    H <- (D_t + b_t1 a_t1^T) H,   H <- (I + b_tj a_tj^T) H  (j = 2 .. r),

with a write ``kw [vw 1]^T`` after the last factor, or after each factor for rules with ``r`` writes
per token (DeltaProduct); the query then reads ``o_t = phi(q_t)^T S_t``.  A rule module maps its
own arguments to ``D``, ``a``, ``b`` and the writes (:meth:`DPLRRule.build`);
:func:`linattn_nb.dplr_attention` checks them, builds the general form and runs it on any method.
The docs page ``docs/dplr.md`` gives every rule's form and its source.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Tuple

import numpy as np

from .._arrays import as_host_array


class GeneralForm(NamedTuple):
    """The general recurrence's arrays for a batch of B sequences (float64 unless stated).

    ``ld`` (B, N, W) log-diagonal (W = 0: none, 1: one value for every feature, F: per feature);
    ``a``, ``b`` (B, N, r, F); ``kw`` (B, N, w, F) and ``vw`` (B, N, w, M) the writes (w = r: one
    after each factor, w = 1: one after the last).
    """

    ld: np.ndarray
    a: np.ndarray
    b: np.ndarray
    kw: np.ndarray
    vw: np.ndarray


class KeyedForm(NamedTuple):
    """A general form whose vectors are per-token multiples of the keys ``k`` (the key features,
    (B, N[, r], F)), one write per sub-step: ``a_tj = D_t^[j = 1] k_tj`` (the token's diagonal in its
    first factor's ``a``, as the delta rules' ``(I - beta k k^T) D``), ``b_tj = cb_tj k_tj``,
    ``kw_tj = cw_tj k_tj``.

    ``ld`` (B, N, W) as in :class:`GeneralForm`; ``cb``, ``cw`` (B, N, r) (r = 1 without sub-steps);
    ``vw`` (B, N, r, M).  The chunked kernel makes the rows from ``k`` as it reads a chunk, so the
    form's (B, N, r, F) vectors are never built.
    """

    ld: np.ndarray
    cb: np.ndarray
    cw: np.ndarray
    vw: np.ndarray


@dataclass(frozen=True)
class DPLRRule:
    """One named rule of the DPLR family.

    Attributes
    ----------
    name : str
        ``dplr_attention(rule=name)``, the name in returned states.
    arguments : tuple of str
        The keyword arguments it takes besides q, k, v (its check says which are required: of a
        ``decay``/``log_decay`` pair, exactly one).
    substeps : bool
        True when k, v (and ``beta``) carry a sub-step axis: ``(..., N, r, D)`` (DeltaProduct's n_h
        keys and values per token).
    formula : str
        The recurrence in the rule's own notation.
    check : callable
        ``check(inputs, lead, N, F, r) -> dict``: the arguments checked (ValueError/TypeError naming
        the argument and the shapes) and flattened to (B, N, ...) float64.
    build : callable
        ``build(fk, v, inputs) -> GeneralForm`` from the key features (B, N[, r], F), the values
        (B, N[, r], M) and the checked arguments.
    step : callable
        ``step(H, fk_t, v_t, inputs_t) -> H``: one token of the rule as its paper writes it, in float64
        NumPy (F x (M + 1) ``H``; ``v_t`` with its column of ones): what the tests hold the general form
        to.
    sample : callable
        ``sample(rng, b, n, f, r) -> dict``: random arguments for a (b, n) batch (tests, studies).
    pullback : callable
        ``pullback(fk, v, inputs, g) -> (dfk, dv, dinputs)``: the gradient of :meth:`build`, ``g`` the
        general form's gradients (``diag``: with respect to the diagonal's values ``exp(ld)``, and
        ``a``, ``b``, ``kw``, ``vw``); ``dinputs`` by argument name, a decay's under ``"decay"`` (with
        respect to the factor, not its log), shaped as :meth:`check` returns them.
    layer : dict
        How :class:`linattn_nb.torch.LinearAttention` makes the rule's arguments from its input ``x``:
        argument name -> form.  Per head, token and feature: ``"feature_gate"`` (``logsigmoid(W x) / 16``,
        a log-decay), ``"feature_unit"`` (``sigmoid(W x)``), ``"unit_key"`` (``W x / ||W x||``).  Per head
        and token: ``"token_unit"`` (``sigmoid(w^T x)``; per sub-step too on a rule with sub-steps),
        ``"token_decay"`` (``-softplus(w^T x + b)``, a log-decay).  Empty: the rule has no layer form
        (the layer refuses it).
    keyed : callable or None
        ``keyed(fk, v, inputs) -> KeyedForm``, for a rule whose :meth:`build` gives ``a = D k``,
        ``b = cb k`` and ``kw = cw k`` with per-token ``cb``, ``cw`` (same arguments as :meth:`build`,
        the same recurrence): the chunked forward runs it without building ``a``, ``b``, ``kw``.
        None: the rule is run from :meth:`build`.
    """

    name: str
    arguments: Tuple[str, ...]
    substeps: bool
    formula: str
    check: Callable = field(repr=False, compare=False)
    build: Callable = field(repr=False, compare=False)
    step: Callable = field(repr=False, compare=False)
    sample: Callable = field(repr=False, compare=False)
    pullback: Callable = field(repr=False, compare=False)
    layer: dict = field(default_factory=dict, repr=False, compare=False)
    keyed: Callable = field(default=None, repr=False, compare=False)


# ---------------------------------------------------------------------------
# Argument checks shared by the rules (and by the general entry)
# ---------------------------------------------------------------------------
def real(name: str, x, copy: bool = True) -> np.ndarray:
    """``x`` as a float64 array (a new array: the caller's is never modified; with ``copy=False`` a
    float32/float64 array as it is); TypeError naming ``name`` for a non-numeric, boolean or complex input."""
    arr = as_host_array(name, x)  # masked, object, ragged and None refused, naming it
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer)
                                 or (np.issubdtype(arr.dtype, np.floating) and arr.dtype.itemsize <= 8)):
        raise TypeError(f"{name} must be a real floating-point array, got dtype {arr.dtype}")
    if not copy and arr.dtype in (np.float32, np.float64):
        return arr
    return np.array(arr, dtype=np.float64)


def shaped(name: str, x, want: tuple, what: str, copy: bool = True) -> np.ndarray:
    """``x`` checked to have shape ``want`` (``what`` names the axes in the message), as float64 (``copy``:
    as :func:`real`)."""
    arr = real(name, x, copy)
    if arr.shape != tuple(want):
        raise ValueError(f"{name} must have shape {what} = {tuple(want)}, got {arr.shape}")
    return arr


def token_or_feature(name: str, x, lead: tuple, N: int, F: int, copy: bool = True) -> np.ndarray:
    """A per-token ``(..., N)`` or per-feature ``(..., N, F)`` array as (B, N, 1) or (B, N, F) (``copy``: as
    :func:`real`)."""
    arr = real(name, x, copy)
    B = int(np.prod(lead, dtype=np.int64))
    if arr.shape == lead + (N,):
        return arr.reshape(B, N, 1)
    if arr.shape == lead + (N, F):
        return arr.reshape(B, N, F)
    raise ValueError(f"{name} must have shape (..., N) = {lead + (N,)} or (..., N, D_phi) = {lead + (N, F)}, "
                     f"got {arr.shape}")


def per_feature(name: str, x, lead: tuple, N: int, F: int, copy: bool = True) -> np.ndarray:
    """A per-token-and-feature ``(..., N, F)`` array as (B, N, F) (``copy``: as :func:`real`)."""
    B = int(np.prod(lead, dtype=np.int64))
    return shaped(name, x, lead + (N, F), "(..., N, D_phi)", copy).reshape(B, N, F)


def per_token(name: str, x, lead: tuple, N: int, r: int = 0) -> np.ndarray:
    """A per-token ``(..., N)`` array (or ``(..., N, r)`` when ``r``) as (B, N) or (B, N, r)."""
    B = int(np.prod(lead, dtype=np.int64))
    if r:
        return shaped(name, x, lead + (N, r), "(..., N, r)").reshape(B, N, r)
    return shaped(name, x, lead + (N,), "(..., N)").reshape(B, N)


def in_range(name: str, x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Raise ValueError naming ``name`` unless every element is in [lo, hi] (NaN fails)."""
    ok = (x >= lo) & (x <= hi)
    if not ok.all():
        bad = x[~ok].ravel()[0].item()  # a Python number: its repr is 2.5, not np.float64(2.5)
        raise ValueError(f"{name} must lie in [{lo:g}, {hi:g}]; got {bad!r} ({int((~ok).sum())} value(s) outside)")
    return x


def log_factors(inputs: dict, lead: tuple, N: int, F: int, *, feature: bool, required: bool = True,
                names=("decay", "log_decay")) -> np.ndarray | None:
    """The log-factors from ``decay`` (in [0, 1]) or ``log_decay`` (<= 0, -inf a reset): (B, N, 1) or
    (B, N, F) (``feature``: per feature only), float64; a float64 ``log_decay`` as given (read, never
    written).  Exactly one of the two unless not ``required``."""
    dn, ln = names
    d, lg = inputs.get(dn), inputs.get(ln)
    if d is not None and lg is not None:
        raise ValueError(f"pass {dn} or {ln}, not both")
    if d is None and lg is None:
        if required:
            raise TypeError(f"missing argument: {dn} or {ln}")
        return None
    pick = per_feature if feature else token_or_feature
    if lg is not None:
        x = pick(ln, lg, lead, N, F, copy=getattr(lg, "dtype", None) != np.float64)
        if not x.max(initial=-np.inf) <= 0:  # a NaN is the max and fails too; no (B, N, F) mask
            raise ValueError(f"{ln} must be <= 0 (-inf allowed: a reset), with no NaN")
        return x
    x = in_range(dn, pick(dn, d, lead, N, F), 0.0, 1.0)
    with np.errstate(divide="ignore"):
        return np.log(x)


def sample_factors(rng, shape):
    """Random factors in [0.5, 1] of ``shape`` (b, n[, f]), with a reset (factor 0) at token n // 2."""
    a = rng.uniform(0.5, 1.0, size=shape)
    if shape[1] >= 2:
        a[:, shape[1] // 2] = 0.0
    return a


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` scaled to unit L2 norm along the last axis (zero rows stay zero)."""
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.divide(x, n, out=np.zeros_like(x), where=n > 0)
