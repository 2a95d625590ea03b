"""The report's conclusions, computed from a study's statistics with their rule stated.

Every sentence of ``report.md`` that draws a conclusion comes from a function here that returns a
:class:`Claim`: the verdict, and the sentence that says it with the rule and the numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ._study import fmt

__all__ = ["Claim", "slope_claim", "compare_claim", "SUPPORTED", "NOT_SUPPORTED", "NOT_APPLICABLE"]

SUPPORTED = "supported"
NOT_SUPPORTED = "not supported"
NOT_APPLICABLE = "not applicable"


@dataclass(frozen=True)
class Claim:
    """A conclusion: its ``verdict`` (``"not applicable"`` when the rule's precondition fails), the
    ``text`` for the report (claim, verdict, numbers) and the ``rule`` that decided it."""

    verdict: str
    text: str
    rule: str = ""

    @property
    def supported(self) -> bool:
        return self.verdict == SUPPORTED

    def __str__(self) -> str:
        return self.text


SLOPE_RULE = ("consistent with a slope of {e} where the 95% interval of the fitted slope contains {e} but not 0 "
              "(a fall is shown) and every mean error of the fit is below {cap}")


def slope_claim(fit, errors, *, expected: float = -0.5, max_error: float = 1.0, what: str = "error") -> Claim:
    """Whether a fitted log-log slope (``fit_slope``'s dict, or None) is consistent with ``expected``.

    ``errors``: the mean errors of the fit.  A Monte-Carlo rate describes a small (variance-dominated)
    error, so an error at or above ``max_error`` (or not finite), or no fit, makes it not applicable;
    supported when the interval contains ``expected`` but not 0.
    """
    rule = SLOPE_RULE.format(e=fmt(expected), cap=fmt(max_error))
    if fit is None:
        return Claim(NOT_APPLICABLE, f"no slope (fewer than two usable seeds): a rate of {fmt(expected)} "
                                     "is not tested", rule)
    errs = [float(e) for e in errors]
    ci = f"{fit['slope']:.2f} [{fit['lo']:.2f}, {fit['hi']:.2f}]"
    worst = max(errs) if errs else float("nan")
    if not errs or not all(math.isfinite(e) for e in errs) or worst >= max_error:
        return Claim(NOT_APPLICABLE, f"slope {ci}, but the {what} reaches {fmt(worst)} (≥ {fmt(max_error)}): not a "
                                     f"variance-dominated estimate, so the {fmt(expected)} rate is not tested", rule)
    if fit["lo"] <= expected <= fit["hi"] and fit["lo"] <= 0.0 <= fit["hi"]:
        return Claim(NOT_SUPPORTED, f"slope {ci} contains {fmt(expected)} and 0 as well: too uncertain to show "
                                    f"a rate (more seeds or a wider range of m would); {what} ∝ m^{fmt(expected)} "
                                    "not supported", rule)
    if fit["lo"] <= expected <= fit["hi"]:
        return Claim(SUPPORTED, f"slope {ci} contains {fmt(expected)}: consistent with {what} ∝ "
                                f"m^{fmt(expected)}", rule)
    side = "shallower" if fit["lo"] > expected else "steeper"
    return Claim(NOT_SUPPORTED, f"slope {ci} excludes {fmt(expected)} ({side} than m^{fmt(expected)}): "
                                f"{what} ∝ m^{fmt(expected)} not supported", rule)


def compare_claim(a: str, a_mean: float, a_half: float, b: str, b_mean: float, b_half: float, *,
                  higher_is_better: bool, measure: str) -> Claim:
    """Whether ``a`` beats ``b``: their 95% intervals (mean ± half-width) do not overlap and ``a``'s mean
    is the better.  Overlapping intervals, or ``b`` winning, are "not supported" (the text says which)."""
    rule = f"one {measure} beats another when their 95% intervals do not overlap"
    vals = [a_mean, a_half, b_mean, b_half]
    if not all(math.isfinite(float(x)) for x in vals):
        return Claim(NOT_APPLICABLE, f"{a} against {b}: {measure} not finite", rule)
    sign = 1.0 if higher_is_better else -1.0
    a_lo, a_hi = a_mean - a_half, a_mean + a_half
    b_lo, b_hi = b_mean - b_half, b_mean + b_half
    nums = f"{fmt(float(a_mean))} ± {fmt(float(a_half), 2)} against {fmt(float(b_mean))} ± {fmt(float(b_half), 2)}"
    if a_lo > b_hi or a_hi < b_lo:
        a_better = sign * (a_mean - b_mean) > 0
        if a_better:
            return Claim(SUPPORTED, f"{a} beats {b} on {measure} ({nums})", rule)
        return Claim(NOT_SUPPORTED, f"{b} beats {a} on {measure} ({nums})", rule)
    return Claim(NOT_SUPPORTED, f"no difference shown between {a} and {b} on {measure} (intervals overlap: "
                                f"{nums})", rule)

