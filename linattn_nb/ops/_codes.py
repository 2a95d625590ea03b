"""Integer codes shared by the kernels and the Python side.

This module imports nothing, so any module (``feature_maps`` included) can
import it without a cycle; Numba reads these module-level integers as
compile-time constants.

Feature-map codes (``code=`` of every launcher): the elementwise map the
kernels apply to ``q`` and ``k`` themselves.  :mod:`linattn_nb.feature_maps`
re-exports them as ``KERNEL_CODE_*`` and each built-in map names its code.

Update rules: how a token or a chunk changes the state ``H = [S | z]``.
:data:`RULES` is the one table of them: every rule's registry name, its
integer code (``rule=`` of the launchers and of the kernels' per-rule hooks,
:mod:`linattn_nb.ops._rules` on the CPU, :mod:`linattn_nb.ops._cuda_common`
with CUDA) and the names of the extra per-token inputs it takes.
:mod:`linattn_nb.ops.methods` registers every rule of the table with every
rule-generic launcher, and the launchers check their ``inputs=`` against it
(:func:`check_rule_inputs`); adding a rule here and a branch to each hook is
the whole kernel side of a new rule (``docs/adding_an_update_rule.md``).
"""

#: The inputs already are features: used as they are.
KERNEL_CODE_NONE = 0
#: ELU(x) + 1.
KERNEL_CODE_ELU = 1
#: max(x, 0).
KERNEL_CODE_RELU = 2
#: max(x, 0) ** 2.
KERNEL_CODE_SQUARED_RELU = 3

#: H += phi(k)^T [v 1]: the additive rule of linear attention.
RULE_ADDITIVE = 0

#: Every update rule: registry name -> (code, names of its extra per-token
#: inputs).  Codes are distinct small integers; the kernels branch on them.
RULES = {
    "additive": (RULE_ADDITIVE, ()),
}


def rule_name(rule) -> str:
    """The registry name of rule code ``rule``.

    Raises
    ------
    ValueError
        When ``rule`` is not the code of a rule of :data:`RULES`.
    """
    for name, (code, _) in RULES.items():
        if rule == code and not isinstance(rule, bool):
            return name
    known = ", ".join(f"{code} ({name})" for name, (code, _) in RULES.items())
    raise ValueError(f"rule must be one of the rule codes {known}, got {rule!r}")


def check_rule_inputs(rule, inputs) -> int:
    """Check a launcher's ``rule`` code and ``inputs=``; return the code as an int.

    ``inputs`` (a mapping of name to array, or None) must hold exactly the
    per-token inputs the rule takes (:data:`RULES`); None and an empty
    mapping both mean none.

    Raises
    ------
    ValueError
        For an unknown rule code, or inputs other than the rule's.
    """
    name = rule_name(rule)
    want = tuple(sorted(RULES[name][1]))
    got = tuple(sorted(inputs)) if inputs else ()
    if got != want:
        takes = f"takes the inputs {list(want)}" if want else "takes no extra inputs"
        raise ValueError(f"inputs: the {name} rule {takes}, got {list(got)}")
    return int(RULES[name][0])
