"""One rule for judging a paper's claim on our runs: paired seeds, a 95 % interval, four outcomes.

A claim "ours beats theirs by at least ``margin``" is judged on runs paired by seed (same data split, same
initialisation apart from the method): the per-seed differences ``d_i = ours_i - theirs_i`` give a mean and a
Student-t interval over the seeds. Each claim also states ``delta``, the smallest difference from ``margin`` that
matters to a reader (for accuracies typically 1 point), chosen before the runs. The claim

* **holds** when the whole 95 % interval lies above ``margin``;
* **does not hold** when the whole 95 % interval lies below it;
* is **equivalent** when neither, and the 90 % interval lies inside ``(margin - delta, margin + delta)``: the two
  one-sided tests at 5 % each (TOST) both reject a difference of ``delta`` or more; the runs show that any
  difference from the margin is smaller than what matters;
* is **inconclusive** otherwise: the runs cannot tell. The verdict then says how far they got: the half-width of
  the interval and the smallest difference these seeds could have detected (80 % power at 5 %, two-sided).

Every must-show slow test asserts the verdict its method page states (see docs/reproduce.md)::

    v = verdict(glvq_acc, rtn_acc, delta=0.01)      # paired over seeds 0-9
    assert v.outcome == "equivalent", v             # the page says: equivalent within 1 point

or, in one call that raises ``AssertionError`` naming the claim and the interval::

    expect_verdict("equivalent", glvq_acc, rtn_acc, delta=0.01, claim="GLVQ >= RTN at 2 bits")

Seeds are decided before the runs (docs/reproduce.md, "How many seeds"): a test judges its claim once, on its
fixed seed budget, so adding seeds until the interval clears the margin cannot inflate "holds".

Unpaired samples (``paired=False``) use Welch's interval. With zero spread the interval is the mean itself.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Verdict", "verdict", "expect_verdict", "OUTCOMES", "POWER"]

#: the four outcomes of :func:`verdict`
OUTCOMES = ("holds", "does not hold", "equivalent", "inconclusive")
#: the power at which :attr:`Verdict.detectable` is stated
POWER = 0.8


@dataclass(frozen=True)
class Verdict:
    """The judgement of one claim.

    Attributes:
        outcome: ``"holds"``, ``"does not hold"``, ``"equivalent"`` or ``"inconclusive"``.
        mean: the mean difference ours - theirs (paired) or of the two means (unpaired).
        low, high: the interval around ``mean`` at ``confidence``.
        n: the number of pairs (paired) or the smaller sample size (unpaired).
        margin: the difference the claim asks for.
        delta: the smallest difference from ``margin`` that matters (the equivalence bound).
        tost_low, tost_high: the interval at ``1 - 2 (1 - confidence) / 2`` (90 % for 95 %) that the equivalence
            test places inside ``margin ± delta``.
        detectable: the smallest true difference from ``margin`` these seeds would detect with 80 % power
            (``(t_{1-alpha/2} + t_{0.8}) * se``); 0 with zero spread.
        confidence: the interval's coverage (0.95).
    """

    outcome: str
    mean: float
    low: float
    high: float
    n: int
    margin: float
    delta: float
    tost_low: float
    tost_high: float
    detectable: float
    confidence: float = 0.95

    @property
    def half_width(self) -> float:
        """Half the width of the ``confidence`` interval."""
        return (self.high - self.low) / 2

    def __str__(self) -> str:
        text = (f"{self.outcome}: mean difference {self.mean:+.4f}, {round(100 * self.confidence)} % interval "
                f"[{self.low:+.4f}, {self.high:+.4f}] over n={self.n}, margin {self.margin:+g}, delta {self.delta:g}")
        if self.outcome == "inconclusive":
            text += f" (half-width {self.half_width:.4f}; these seeds detect a difference of {self.detectable:.4f})"
        return text


def _t_quantile(p: float, df: int | float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (scipy's)."""
    from scipy.stats import t

    return float(t.ppf(p, df))


def verdict(ours: Sequence[float], theirs: Sequence[float] | None = None, paired: bool = True, margin: float = 0.0,
            *, delta: float, confidence: float = 0.95) -> Verdict:
    """Judge "ours exceeds theirs by more than ``margin``" over seeds, with ``delta`` the least difference that matters.

    Args:
        ours: our metric per seed (higher is better; negate a loss or an error).
        theirs: the baseline's metric per seed, in the same seed order when ``paired``; None: ``ours`` are already
            the differences (or the values to compare with ``margin``).
        paired: per-seed differences and a one-sample t interval (the rule); False: Welch's two-sample interval.
        margin: the least difference the claim asks for (0: "at least as good", within the interval).
        delta: the smallest difference from ``margin`` that matters, in the metric's units (> 0); required, so
            that each claim states it.
        confidence: the two-sided coverage of the interval. Default: 0.95.

    Raises:
        ValueError: fewer than two values, paired samples of different lengths, a value that is not finite, a
            ``delta`` that is not a positive number, or a confidence outside (0, 1).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"verdict: confidence={confidence}; allowed: a number in (0, 1)")
    if not (isinstance(delta, int | float) and math.isfinite(delta) and delta > 0):
        raise ValueError(f"verdict: delta={delta!r}; allowed: a finite number > 0 (the smallest difference that matters)")
    ours = [float(x) for x in ours]
    other = None if theirs is None else [float(x) for x in theirs]
    if not all(math.isfinite(x) for x in ours + (other or [])):
        raise ValueError("verdict: every value must be a finite number")
    if other is None or paired:
        if other is not None and len(other) != len(ours):
            raise ValueError(f"verdict: paired samples of {len(ours)} and {len(other)} values; allowed: one value per "
                             "seed in each, in the same seed order")
        diffs = ours if other is None else [a - b for a, b in zip(ours, other, strict=True)]
        n = len(diffs)
        if n < 2:
            raise ValueError(f"verdict: {n} paired value(s); allowed: at least 2 (an interval needs a spread)")
        mean = statistics.fmean(diffs)
        se, df = statistics.stdev(diffs) / math.sqrt(n), float(n - 1)
    else:
        if len(ours) < 2 or len(other) < 2:
            raise ValueError("verdict: unpaired samples need at least 2 values each")
        n = min(len(ours), len(other))
        mean = statistics.fmean(ours) - statistics.fmean(other)
        va, vb = statistics.variance(ours) / len(ours), statistics.variance(other) / len(other)
        se = math.sqrt(va + vb)
        # Welch-Satterthwaite degrees of freedom (any df gives a zero half-width at zero spread)
        df = (va + vb) ** 2 / (va**2 / (len(ours) - 1) + vb**2 / (len(other) - 1)) if se > 0 else 1.0
    alpha = 1.0 - confidence
    half = tost_half = detectable = 0.0  # zero spread: every interval is the mean itself
    if se > 0:
        t_two = _t_quantile(1 - alpha / 2, df)
        half = t_two * se
        tost_half = _t_quantile(1 - alpha, df) * se  # one-sided at alpha: the 1 - 2 alpha interval
        detectable = (t_two + _t_quantile(POWER, df)) * se
    low, high = mean - half, mean + half
    tost_low, tost_high = mean - tost_half, mean + tost_half
    if low > margin:
        outcome = "holds"
    elif high < margin:
        outcome = "does not hold"
    elif margin - delta < tost_low and tost_high < margin + delta:
        outcome = "equivalent"
    else:
        outcome = "inconclusive"
    return Verdict(outcome, mean, low, high, n, margin, float(delta), tost_low, tost_high, detectable, confidence)


def expect_verdict(expected: str | tuple[str, ...], ours: Sequence[float], theirs: Sequence[float] | None = None, *,
                   delta: float, margin: float = 0.0, paired: bool = True, claim: str = "") -> Verdict:
    """:func:`verdict`, raising ``AssertionError`` unless its outcome is ``expected`` (what a slow test asserts).

    A claim that does not hold is asserted as ``expect_verdict("holds", ...)`` under
    ``pytest.mark.xfail(strict=True, raises=AssertionError)``; an equivalence as ``expect_verdict("equivalent",
    ...)``; a claim its seed budget cannot decide as ``expect_verdict("inconclusive", ...)``. Where the CPU kernels
    disagree (inconclusive on one, holds on the other), the page states both and the test accepts either:
    ``expect_verdict(("inconclusive", "holds"), ...)`` (docs/reproduce.md lists these).

    Args:
        expected: one of :data:`OUTCOMES`, or a tuple of them (any one passes).
        ours, theirs, delta, margin, paired: as for :func:`verdict`.
        claim: the claim in words, for the message.

    Raises:
        ValueError: ``expected`` is not an outcome (or :func:`verdict`'s own errors).
        AssertionError: the outcome differs; the message names the claim, both outcomes and the interval.
    """
    allowed = (expected,) if isinstance(expected, str) else tuple(expected)
    if not allowed or any(e not in OUTCOMES for e in allowed):
        raise ValueError(f"expect_verdict: expected={expected!r}; allowed: {', '.join(OUTCOMES)} (or a tuple of them)")
    v = verdict(ours, theirs, paired=paired, margin=margin, delta=delta)
    if v.outcome not in allowed:
        raise AssertionError(f"{claim or 'claim'}: expected {' or '.join(allowed)}, got {v} "
                             f"(ours {[round(float(x), 4) for x in ours]}"
                             + ("" if theirs is None else f", theirs {[round(float(x), 4) for x in theirs]}") + ")")
    return v
