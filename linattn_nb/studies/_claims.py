"""The report's conclusions, computed from a study's statistics with their rule stated.

Every sentence of ``report.md`` that draws a conclusion ("falls as 1/√m",
"recalls n ≤ D_φ", "the delta rule beats the additive rule here") comes from
one of these functions, which return a :class:`Claim`: whether the data
support it, and the sentence that says so with the rule and the numbers.  A
claim the data do not support is printed as not supported, with the numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ._study import fmt

__all__ = ["Claim", "slope_claim", "compare_claim", "threshold_claim", "SUPPORTED", "NOT_SUPPORTED",
           "NOT_APPLICABLE"]

SUPPORTED = "supported"
NOT_SUPPORTED = "not supported"
NOT_APPLICABLE = "not applicable"


@dataclass(frozen=True)
class Claim:
    """A conclusion and its verdict.

    Attributes
    ----------
    verdict : {"supported", "not supported", "not applicable"}
        "not applicable": the rule's precondition fails (e.g. the errors are
        not small enough for the error to be variance-dominated).
    text : str
        The sentence for the report: the claim, the verdict, the numbers.
    rule : str
        The rule that decided it.
    """

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
    """Whether a fitted log-log slope is consistent with ``expected``.

    Parameters
    ----------
    fit : dict or None
        :func:`~linattn_nb.studies._study.fit_slope`'s result (``slope``, ``lo``, ``hi``).
    errors : sequence of float
        The mean errors the slope was fitted to.  A Monte-Carlo rate describes
        an error that is small (variance-dominated); at or above
        ``max_error`` the precondition fails and the claim is not applicable.
    expected : float
    max_error : float

    Returns
    -------
    Claim
        supported: the interval contains ``expected`` but not 0 and every
        error is below ``max_error``; not supported: the interval excludes
        ``expected``, or contains 0 as well (errors small); not applicable: some error is ``>= max_error`` or not finite,
        or there is no fit.
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
    """Which of two series is better, decided by their 95% intervals.

    ``a`` beats ``b`` when their intervals (mean ± half-width) do not overlap
    and ``a``'s mean is the better; "no difference shown" (not supported)
    when they overlap.  The verdict is "supported" when ``a`` beats ``b``;
    when ``b`` beats ``a`` the text says so and the verdict is "not supported".
    """
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


def threshold_claim(xs, means, halves, threshold: float, *, what: str, x_name: str = "n",
                    above: bool = True) -> Claim:
    """Whether ``means`` stay on the right side of ``threshold`` at every x, counting the interval.

    With ``above`` the claim "what ≥ threshold at every x" is supported when
    every lower interval end is at or above it; otherwise the first x where
    it fails is named with its value.
    """
    rule = (f"{what} {'≥' if above else '≤'} {fmt(threshold)} at every {x_name}, the 95% interval included")
    for x, m, h in zip(xs, means, halves):
        m, h = float(m), float(h) if math.isfinite(float(h)) else 0.0
        ok = (m - h >= threshold) if above else (m + h <= threshold)
        if not ok:
            return Claim(NOT_SUPPORTED, f"{what} {'≥' if above else '≤'} {fmt(threshold)} not supported: at "
                                        f"{x_name} = {fmt(x)} it is {fmt(m)} ± {fmt(h, 2)}", rule)
    return Claim(SUPPORTED, f"{what} {'≥' if above else '≤'} {fmt(threshold)} at every {x_name} up to "
                            f"{fmt(xs[-1])}", rule)
