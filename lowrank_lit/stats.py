"""One rule for judging a paper's claim on our runs: paired seeds, a 95 % interval, three outcomes.

A claim "ours beats theirs by at least ``margin``" is judged on runs paired by seed (same data split, same
initialisation apart from the method): the per-seed differences ``d_i = ours_i - theirs_i`` give a mean and a
Student-t interval over the seeds. The claim

* **holds** when the whole interval lies above ``margin``,
* **does not hold** when the whole interval lies below it,
* is a **tie** when the interval contains it: the runs cannot tell the two apart at this number of seeds (more
  seeds, or a number that moves less across CPU kernels and threads, may separate them).

Every must-show slow test asserts the verdict its method page states (see docs/reproduce.md)::

    v = verdict(glvq_acc, rtn_acc)            # paired over seeds 0-4
    assert v.outcome == "tie", v              # the page says: a tie within noise

or, in one call that raises ``AssertionError`` naming the claim and the interval::

    expect_verdict("tie", glvq_acc, rtn_acc, claim="GLVQ >= RTN at 2 bits")

Unpaired samples (``paired=False``) use Welch's interval. With zero spread the interval is the mean itself.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Verdict", "verdict", "expect_verdict", "OUTCOMES"]

#: the three outcomes of :func:`verdict`
OUTCOMES = ("holds", "does not hold", "tie")


@dataclass(frozen=True)
class Verdict:
    """The judgement of one claim.

    Attributes:
        outcome: ``"holds"``, ``"does not hold"`` or ``"tie"``.
        mean: the mean difference ours - theirs (paired) or of the two means (unpaired).
        low, high: the interval around ``mean`` at ``confidence``.
        n: the number of pairs (paired) or the smaller sample size (unpaired).
        margin: the difference the claim asks for.
        confidence: the interval's coverage (0.95).
    """

    outcome: str
    mean: float
    low: float
    high: float
    n: int
    margin: float
    confidence: float = 0.95

    def __str__(self) -> str:
        return (f"{self.outcome}: mean difference {self.mean:+.4f}, {round(100 * self.confidence)} % interval "
                f"[{self.low:+.4f}, {self.high:+.4f}] over n={self.n}, margin {self.margin:+g}")


def _t_quantile(p: float, df: int | float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (scipy's)."""
    from scipy.stats import t

    return float(t.ppf(p, df))


def verdict(ours: Sequence[float], theirs: Sequence[float] | None = None, paired: bool = True, margin: float = 0.0,
            confidence: float = 0.95) -> Verdict:
    """Judge "ours exceeds theirs by more than ``margin``" over seeds.

    Args:
        ours: our metric per seed (higher is better; negate a loss or an error).
        theirs: the baseline's metric per seed, in the same seed order when ``paired``; None: ``ours`` are already
            the differences (or the values to compare with ``margin``).
        paired: per-seed differences and a one-sample t interval (the rule); False: Welch's two-sample interval.
        margin: the least difference the claim asks for (0: "at least as good", within the interval).
        confidence: the two-sided coverage of the interval. Default: 0.95.

    Raises:
        ValueError: fewer than two values, paired samples of different lengths, a value that is not finite, or a
            confidence outside (0, 1).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence}; allowed: a number in (0, 1)")
    ours = [float(x) for x in ours]
    other = None if theirs is None else [float(x) for x in theirs]
    if not all(math.isfinite(x) for x in ours + (other or [])):
        raise ValueError("verdict: every value must be a finite number")
    q = 0.5 + confidence / 2
    if other is None or paired:
        if other is not None and len(other) != len(ours):
            raise ValueError(f"verdict: paired samples of {len(ours)} and {len(other)} values; allowed: one value per "
                             "seed in each, in the same seed order")
        diffs = ours if other is None else [a - b for a, b in zip(ours, other, strict=True)]
        n = len(diffs)
        if n < 2:
            raise ValueError(f"verdict: {n} paired value(s); allowed: at least 2 (an interval needs a spread)")
        mean = statistics.fmean(diffs)
        half = _t_quantile(q, n - 1) * statistics.stdev(diffs) / math.sqrt(n)
    else:
        if len(ours) < 2 or len(other) < 2:
            raise ValueError("verdict: unpaired samples need at least 2 values each")
        n = min(len(ours), len(other))
        mean = statistics.fmean(ours) - statistics.fmean(other)
        va, vb = statistics.variance(ours) / len(ours), statistics.variance(other) / len(other)
        se = math.sqrt(va + vb)
        if se == 0.0:
            half = 0.0
        else:  # Welch-Satterthwaite degrees of freedom
            df = (va + vb) ** 2 / (va**2 / (len(ours) - 1) + vb**2 / (len(other) - 1))
            half = _t_quantile(q, df) * se
    low, high = mean - half, mean + half
    outcome = "holds" if low > margin else "does not hold" if high < margin else "tie"
    return Verdict(outcome, mean, low, high, n, margin, confidence)


def expect_verdict(expected: str | tuple[str, ...], ours: Sequence[float], theirs: Sequence[float] | None = None, *,
                   margin: float = 0.0, paired: bool = True, claim: str = "") -> Verdict:
    """:func:`verdict`, raising ``AssertionError`` unless its outcome is ``expected`` (what a slow test asserts).

    A claim that does not hold is asserted as ``expect_verdict("holds", ...)`` under
    ``pytest.mark.xfail(strict=True, raises=AssertionError)``; a tie as ``expect_verdict("tie", ...)``. Where the
    CPU kernels disagree (a tie on one, holds on the other), the page states a tie and the test accepts either:
    ``expect_verdict(("tie", "holds"), ...)`` (docs/reproduce.md lists these).

    Args:
        expected: ``"holds"``, ``"does not hold"`` or ``"tie"``, or a tuple of them (any one passes).
        ours, theirs, margin, paired: as for :func:`verdict`.
        claim: the claim in words, for the message.

    Raises:
        ValueError: ``expected`` is not an outcome (or :func:`verdict`'s own errors).
        AssertionError: the outcome differs; the message names the claim, both outcomes and the interval.
    """
    allowed = (expected,) if isinstance(expected, str) else tuple(expected)
    if not allowed or any(e not in OUTCOMES for e in allowed):
        raise ValueError(f"expected={expected!r}; allowed: {', '.join(OUTCOMES)} (or a tuple of them)")
    v = verdict(ours, theirs, paired=paired, margin=margin)
    if v.outcome not in allowed:
        raise AssertionError(f"{claim or 'claim'}: expected {' or '.join(allowed)}, got {v} "
                             f"(ours {[round(float(x), 4) for x in ours]}"
                             + ("" if theirs is None else f", theirs {[round(float(x), 4) for x in theirs]}") + ")")
    return v
