"""The report's conclusions, computed from a study's statistics with their rule stated.

Every sentence of ``report.md`` that draws a conclusion comes from a function here that returns a
:class:`Claim`: the verdict, and the sentence that says it with the rule and the numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ._study import fmt

__all__ = ["Claim", "slope_claim", "compare_claim", "capacity_claim", "state_full", "SUPPORTED", "NOT_SUPPORTED",
           "NOT_APPLICABLE"]

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

    ``errors``: the mean errors of the fit.  The rule: docs/guide/studies.md, "Approximation error".
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


#: What a claim says where one seed gives a mean but no interval (``mean_ci``'s half-width is NaN).
ONE_SEED = "one seed gives no 95% interval"


def _with_ci(mean, half) -> str:
    """``"0.5 ± 0.02"``, or ``"0.5 (one seed gives no 95% interval)"`` where the half-width is NaN."""
    mean, half = float(mean), float(half)
    if math.isfinite(mean) and math.isnan(half):
        return f"{fmt(mean)} ({ONE_SEED})"
    return f"{fmt(mean)} ± {fmt(half, 2)}"


def compare_claim(a: str, a_mean: float, a_half: float, b: str, b_mean: float, b_half: float, *,
                  higher_is_better: bool, measure: str) -> Claim:
    """Whether ``a`` beats ``b``: their 95% intervals (mean ± half-width) do not overlap and ``a``'s mean
    is the better.  Overlapping intervals, or ``b`` winning, are "not supported" (the text says which); a NaN
    half-width (one seed) is "not applicable": no interval, so no difference is tested."""
    rule = f"one {measure} beats another when their 95% intervals do not overlap"
    if (math.isfinite(float(a_mean)) and math.isfinite(float(b_mean))
            and (math.isnan(float(a_half)) or math.isnan(float(b_half)))):
        return Claim(NOT_APPLICABLE, f"{a} against {b} on {measure}: {ONE_SEED}, so no difference is tested "
                                     f"({_with_ci(a_mean, a_half)} against {_with_ci(b_mean, b_half)}; "
                                     "run two or more seeds)", rule)
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


CAPACITY_RULE = ("a fall of the mean accuracy below {a} is the state's capacity only where the state is full: at "
                 "n > D_φ, or where the least-squares floor is above 0 (the map's features of the n keys then "
                 "have rank below n); where the floor is 0 it is the estimator's variance when softmax, the "
                 "kernel a random map estimates, reads ≥ {a} there, else the kernel")

#: A mean least-squares floor above this is a state that cannot store the n pairs exactly (full-rank
#: features give a floor of rounding size, about 1e-30 relative).
FLOOR_ZERO = 1e-9


def state_full(n, floor, dphi) -> bool:
    """Whether a state of D_φ = ``dphi`` features is full at ``n`` pairs: n > D_φ, or a least-squares floor
    above 0 (features of rank below n, as DPFP's of few random keys can be)."""
    return n > dphi or floor > FLOOR_ZERO


def capacity_claim(n, acc, half, floor, dphi, *, reference=None, estimator: str = "", threshold: float = 0.9) -> Claim:
    """Whether the first fall of a map's accuracy below ``threshold`` is its state's capacity.

    ``n``, ``acc``, ``half``, ``floor``: per number of pairs, the mean accuracy, its 95% half-width (NaN for one
    seed: the text then says there is no interval; the verdict reads the means only) and the mean least-squares
    floor; ``dphi``: the state's D_φ.  ``reference``: softmax's mean accuracy per n;
    ``estimator``: "random" for a map whose features estimate softmax at random, "deterministic" for one
    that approximates it, "" for neither.  The rule: docs/guide/studies.md, "Recall capacity".
    """
    a = fmt(threshold)
    rule = CAPACITY_RULE.format(a=a)
    below = [j for j, x in enumerate(acc) if x < threshold]
    if not below:
        j = len(n) - 1
        if n[j] <= dphi:
            return Claim(NOT_APPLICABLE, f"accuracy ≥ {a} up to n = {int(n[j])} ≤ D_φ = {dphi}: no n past D_φ "
                                         "measured", rule)
        return Claim(NOT_SUPPORTED, f"accuracy {_with_ci(acc[j], half[j])} (≥ {a}) at "
                                    f"n = {int(n[j])} > D_φ = {dphi}, where the floor is {fmt(float(floor[j]))}: "
                                    "argmax accuracy passes the capacity limit, so it does not measure it", rule)
    j = below[0]
    where = (f"accuracy {_with_ci(acc[j], half[j])} at n = {int(n[j])}, first below {a}, "
             f"D_φ = {dphi}, floor {fmt(float(floor[j]))}")
    if n[j] > dphi:
        return Claim(SUPPORTED, f"{where}: ≥ {a} while the state had room, below once it is full: consistent with "
                                "the state's capacity", rule)
    if floor[j] > FLOOR_ZERO:
        return Claim(SUPPORTED, f"{where}: n ≤ D_φ, but the floor is above 0 (the map's features of the keys "
                                "have rank below n in some draws), so the state is full: consistent with the state's "
                                "capacity", rule)
    ref = None if reference is None else float(reference[j])
    if ref is not None and ref >= threshold and estimator == "random":
        cause = f"the estimator's variance (softmax, the kernel it estimates, reads {fmt(ref)} there)"
    elif ref is not None and ref >= threshold and estimator:
        cause = f"its approximation of softmax (which reads {fmt(ref)} there)"
    elif ref is not None and estimator:
        cause = f"the kernel it estimates (softmax too reads only {fmt(ref)})"
    else:
        cause = "the map's kernel (its weights do not single out the queried key)"
    return Claim(NOT_SUPPORTED, f"{where}: the state has room, so not capacity but {cause}", rule)
