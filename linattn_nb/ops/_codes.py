"""Integer codes shared by the kernels and the Python side: feature maps, update rules, output modes.

This module imports nothing, so any module can import it without a cycle; Numba
reads these integers as compile-time constants.  :data:`RULES` is the one table of
update rules (registry name, code, per-token inputs); adding a rule here and a
branch to each hook is the kernel side of a new rule (``docs/adding_an_update_rule.md``).
"""

#: The inputs already are features: used as they are.
KERNEL_CODE_NONE = 0
#: ELU(x) + 1.
KERNEL_CODE_ELU = 1
#: max(x, 0).
KERNEL_CODE_RELU = 2
#: max(x, 0) ** 2.
KERNEL_CODE_SQUARED_RELU = 3
#: x / ||x|| per row (exactly, no epsilon in the norm; a zero row maps to
#: zero): DeltaNet's unit keys and queries.
KERNEL_CODE_L2 = 4
#: SiLU(x) = x * sigmoid(x) per element, then x / ||x|| per row (DeltaNet).
KERNEL_CODE_SILU_L2 = 5

#: H += phi(k)^T [v 1]: the additive rule of linear attention.
RULE_ADDITIVE = 0
#: H <- a_t H + phi(k_t)^T [v_t 1]: a scalar decay a_t = exp(log_decay[b, t])
#: per token (Mamba-2/SSD, simple GLA; a constant per sequence is RetNet's
#: per-head gamma).
RULE_DECAY = 1
#: H <- diag(alpha_t) H + phi(k_t)^T [v_t 1]: a per-feature gate
#: alpha_t = exp(log_gate[b, t, :]) (GLA).
RULE_GATE = 2

#: H <- H + beta_t phi(k_t) ([v_t 1] - H^T phi(k_t))^T: the delta rule
#: (Schlag et al. 2021; DeltaNet, Yang et al. 2024).
RULE_DELTA = 3
#: H <- a_t (I - beta_t phi(k_t) phi(k_t)^T) H + beta_t phi(k_t) [v_t 1]^T:
#: the gated delta rule (Yang, Kautz & Hatamizadeh 2025).
RULE_GATED_DELTA = 4

#: Every update rule: registry name -> (code, names of its extra per-token
#: inputs).  Codes are distinct small integers; the kernels branch on them.
#:
#: The inputs as launchers receive them (validated and flattened by the front
#: end, C-contiguous float64): ``log_decay`` (B, N) and ``log_gate`` (B, N, F),
#: log-factors <= 0, ``-inf`` allowed (a reset: the state before the token is
#: wiped exactly).  No NaN, no positive value; ``beta`` (B, N), write
#: strengths in [0, 2].  Kernels must not form a
#: difference of cumulative log-factors across a ``-inf`` (it is NaN): see
#: ``docs/adding_an_update_rule.md``.
RULES = {
    "additive": (RULE_ADDITIVE, ()),
    "decay": (RULE_DECAY, ("log_decay",)),
    "gate": (RULE_GATE, ("log_gate",)),
    "delta": (RULE_DELTA, ("beta",)),
    "gated_delta": (RULE_GATED_DELTA, ("beta", "log_decay")),
}

#: Log-factors at or below this are a reset (-inf): exp() of them is 0 in
#: float64 (the smallest subnormal is exp(-744.4)), so the recurrence is the
#: same, and a cumulative sum never holds a huge finite value whose
#: differences would cancel catastrophically.
LOG_RESET = -746.0


#: How a kernel turns numerators and the normaliser into outputs (its
#: ``norm`` argument): divide by the raw normaliser (``eps=None``) ...
NORM_RAW = 0
#: ... by the normaliser floored at ``eps`` ...
NORM_FLOOR = 1
#: ... or not at all: ``normalize=False`` writes ``phi(q)^T S_t``.
NORM_NONE = 2


def norm_mode(eps, normalize=True) -> int:
    """The kernels' ``norm`` argument for a launcher's ``eps`` and ``normalize``."""
    if not normalize:
        return NORM_NONE
    return NORM_RAW if eps is None else NORM_FLOOR


def rule_name(rule) -> str:
    """The registry name of rule code ``rule``; ValueError when it is no code of :data:`RULES`."""
    for name, (code, _) in RULES.items():
        if rule == code and not isinstance(rule, bool):
            return name
    known = ", ".join(f"{code} ({name})" for name, (code, _) in RULES.items())
    raise ValueError(f"rule must be one of the rule codes {known}, got {rule!r}")


def check_rule_inputs(rule, inputs) -> int:
    """A launcher's ``rule`` code as an int, checked with its ``inputs=`` (name -> array, None or empty for
    none), which must hold exactly the rule's (:data:`RULES`); ValueError otherwise."""
    name = rule_name(rule)
    want = tuple(sorted(RULES[name][1]))
    got = tuple(sorted(inputs)) if inputs else ()
    if got != want:
        takes = f"takes the inputs {list(want)}" if want else "takes no extra inputs"
        raise ValueError(f"inputs: the {name} rule {takes}, got {list(got)}")
    return int(RULES[name][0])


#: The L2 row maps: a row's float64 sum of squares below this, or an infinite one, is summed again with the
#: row scaled by a power of two (exact; :func:`linattn_nb.ops._common.scale_exponent`): above it, a square
#: lost to underflow changes the sum by at most 2^-63 of its last bit; a finite sum had no square overflow.
SS_TINY = 2.0 ** -960
