"""What an update rule is: :class:`UpdateRule`, the one record every part of the package asks.

The front ends, the state, the analyses, the studies and the torch adapter ask the record; the
kernels switch on its :attr:`UpdateRule.code`.  How a rule runs through the package:
docs/adding_an_update_rule.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import numpy as np

#: The forms of a rule's per-token factor: none, one per sequence or token, one per token and feature.
FACTOR_KINDS = (None, "scalar", "feature")


@dataclass(frozen=True)
class UpdateRule:
    """One state-update rule and everything about it that is not a kernel.

    Attributes
    ----------
    name : str
        The rule's name (``LinearState.rule``, state files).
    code : int
        The integer the kernels' per-rule hooks branch on (:data:`linattn_nb.ops._codes.RULES`).
    kernel_inputs : tuple of str
        The per-token arrays the launchers take as ``inputs=`` (``log_decay`` (B, N),
        ``log_gate`` (B, N, D_phi), ``beta`` (B, N)).
    factor : {None, "scalar", "feature"}
        The form of ``decay``/``log_decay``: none, one per sequence or token, one per token and feature.
    beta : bool
        Whether the rule takes write strengths ``beta`` (in [0, 2]).
    normalize : bool
        Whether outputs are divided by the normaliser when ``normalize=None``.
    reads_state : bool
        Whether a token's update reads the state (the delta rules): its sequences are never split
        into pieces, and the analyses take its closed-form weights.
    formula : str
        The recurrence, in one line.
    hint : str
        How to pass the arguments that select the rule (for error messages).
    reference_step : callable
        ``reference_step(H, k, v1, log_factor, beta) -> H``: one token in float64 NumPy, ``H``
        (F, M + 1), ``k = phi(k_t)``, ``v1 = [v_t, 1]``, ``log_factor`` a float, an (F,) array or
        None; the definition the kernels are tested against.
    sample : callable
        ``sample(rng, b, n, f) -> dict``: random inputs for a (b, n) batch as
        :func:`linattn_nb.linear_attention` keywords (factors in [0.5, 1] with a reset at n // 2).
    study_map : str
        The feature map a study checks the rule with (``"l2"`` for the delta rules).
    """

    name: str
    code: int
    kernel_inputs: Tuple[str, ...]
    factor: Optional[str]
    beta: bool
    normalize: bool
    reads_state: bool
    formula: str
    hint: str
    reference_step: Callable = field(repr=False, compare=False)
    sample: Callable = field(repr=False, compare=False)
    study_map: str = "elu"

    def __post_init__(self):
        if self.factor not in FACTOR_KINDS:
            raise ValueError(f"factor must be one of {FACTOR_KINDS}, got {self.factor!r}")

    @property
    def has_inputs(self) -> bool:
        """Whether the rule takes per-token inputs besides q, k, v (every rule but the additive one)."""
        return bool(self.kernel_inputs)

    @property
    def forgets(self) -> bool:
        """Whether the rule scales the state before a token's write (it takes a decay or a gate)."""
        return self.factor is not None

    def kernel_arguments(self, log_factor, beta) -> Optional[dict]:
        """The launchers' ``inputs=``: the validated (B, N[, F]) ``log_factor`` and (B, N) ``beta`` by name.

        None for a rule without inputs.
        """
        if not self.kernel_inputs:
            return None
        out = {}
        for name in self.kernel_inputs:
            out[name] = beta if name == "beta" else log_factor
        return out

    def log_factor_of(self, inputs) -> Optional[np.ndarray]:
        """The log-factor array of a rule's ``inputs=`` (None when the rule has none)."""
        if self.factor is None or not inputs:
            return None
        return inputs[next(nm for nm in self.kernel_inputs if nm != "beta")]


def draw_factors(rng, shape):
    """Random factors in [0.5, 1] of ``shape`` (b, n[, f]), with a reset (factor 0) at token n // 2."""
    a = rng.uniform(0.5, 1.0, size=shape)
    if shape[1] >= 2:
        a[:, shape[1] // 2] = 0.0
    return a


def reference(rule: UpdateRule, fq, fk, v, *, inputs=None, H0=None, normalize=None, eps=None):
    """The float64 reference of ``rule`` on one batch: a token-by-token loop of :attr:`UpdateRule.reference_step`.

    Parameters
    ----------
    rule : UpdateRule or str
        The rule, or its registered name (as :func:`linattn_nb.rules.get_rule` takes).
    fq, fk : array_like, shape (B, N, F)
        Features of the queries and keys.
    v : array_like, shape (B, N, M)
    inputs : dict or None
        The rule's kernel inputs (:meth:`UpdateRule.kernel_arguments`).
    H0 : array_like, shape (B, F, M + 1), optional
        The initial state ``[S | z]`` (zeros by default).
    normalize : bool, optional
        Divide by ``phi(q_t) . z_t`` (floored at ``eps`` unless None); default the rule's.
    eps : float or None

    Returns
    -------
    out : ndarray, shape (B, N, M)
    H : ndarray, shape (B, F, M + 1)
        The final state.
    """
    fq, fk, v = (np.asarray(x, dtype=np.float64) for x in (fq, fk, v))
    B, N, F = fk.shape
    M = v.shape[2]
    H = np.zeros((B, F, M + 1)) if H0 is None else np.array(H0, dtype=np.float64)
    norm = rule.normalize if normalize is None else bool(normalize)
    lf = rule.log_factor_of(inputs)
    bt = None if not rule.beta else np.asarray(inputs["beta"], dtype=np.float64)
    out = np.empty((B, N, M))
    for b in range(B):
        for t in range(N):
            g = None if lf is None else lf[b, t]
            H[b] = rule.reference_step(H[b], fk[b, t], np.append(v[b, t], 1.0), g,
                                       None if bt is None else float(bt[b, t]))
            r = fq[b, t] @ H[b]
            num, den = r[:M], r[M]
            if norm:
                den = den if eps is None else max(den, eps)
                with np.errstate(divide="ignore", invalid="ignore"):
                    out[b, t] = num / den
            else:
                out[b, t] = num
    return out, H
