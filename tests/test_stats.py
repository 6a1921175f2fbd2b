"""The verdict rule (lowrank_lit.stats.verdict) on hand-computed cases, and the contract that every must-show test
uses it."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from lowrank_lit.stats import verdict

TESTS = Path(__file__).resolve().parent
T4 = 2.7764451051977987  # Student t, 0.975 quantile, 4 degrees of freedom (tables: 2.776)
T4_95 = 2.1318467863266495  # 0.95 quantile, 4 degrees of freedom (tables: 2.132)
T4_80 = 0.9409645772351816  # 0.80 quantile, 4 degrees of freedom (tables: 0.941)


def test_a_t_interval_over_five_paired_seeds_by_hand():
    # differences 1..5: mean 3, sd sqrt(2.5), half width t * sd / sqrt(5)
    v = verdict([2, 4, 6, 8, 10], [1, 2, 3, 4, 5], delta=1.0)
    half = T4 * math.sqrt(2.5) / math.sqrt(5)
    assert v.outcome == "holds" and v.n == 5 and v.mean == 3.0 and v.delta == 1.0
    assert math.isclose(v.low, 3 - half, rel_tol=1e-12) and math.isclose(v.high, 3 + half, rel_tol=1e-12)
    assert math.isclose(v.low, 1.0367568, abs_tol=1e-6) and math.isclose(v.half_width, half, rel_tol=1e-12)


def test_does_not_hold_when_the_interval_lies_below_the_margin():
    v = verdict([0.80, 0.82, 0.81, 0.79, 0.83], [0.90, 0.91, 0.93, 0.90, 0.92], delta=0.01)
    # differences -0.10 -0.09 -0.12 -0.11 -0.09: mean -0.102, variance 1.7e-4
    half = T4 * math.sqrt(1.7e-4 / 5)
    assert v.outcome == "does not hold"
    assert math.isclose(v.mean, -0.102, abs_tol=1e-12) and math.isclose(v.high, -0.102 + half, abs_tol=1e-12)


# differences with mean -0.001 and variance 2.05e-4 over 5 seeds: se = sqrt(2.05e-4 / 5)
NEAR_ZERO = [0.01, -0.02, 0.015, 0.0, -0.01]
SE = math.sqrt(2.05e-4 / 5)


def test_equivalent_when_the_90_percent_interval_lies_inside_margin_plus_minus_delta():
    v = verdict(NEAR_ZERO, delta=0.02)
    # TOST at 5 %: the 90 % interval -0.001 +- t(0.95, 4) * se = [-0.01465, +0.01265] inside (-0.02, +0.02)
    assert v.outcome == "equivalent"
    assert math.isclose(v.tost_low, -0.001 - T4_95 * SE, abs_tol=1e-12)
    assert math.isclose(v.tost_high, -0.001 + T4_95 * SE, abs_tol=1e-12)
    assert math.isclose(v.tost_low, -0.0146506, abs_tol=1e-6)
    assert v.low < 0.0 < v.high  # the 95 % interval contains the margin: neither holds nor does not hold


def test_inconclusive_when_neither_and_it_says_what_the_seeds_could_detect():
    v = verdict(NEAR_ZERO, delta=0.01)  # the 90 % interval [-0.0147, +0.0127] reaches beyond +-0.01
    half = T4 * SE
    assert v.outcome == "inconclusive"
    assert math.isclose(v.low, -0.001 - half, abs_tol=1e-12) and math.isclose(v.half_width, half, abs_tol=1e-12)
    # 80 % power at 5 % two-sided: (t(0.975, 4) + t(0.8, 4)) * se
    assert math.isclose(v.detectable, (T4 + T4_80) * SE, rel_tol=1e-12)
    assert math.isclose(v.detectable, 0.0238030, abs_tol=1e-6)
    assert str(v) == ("inconclusive: mean difference -0.0010, 95 % interval [-0.0188, +0.0168] over n=5, margin +0, "
                      "delta 0.01 (half-width 0.0178; these seeds detect a difference of 0.0238)")


def test_each_boundary_is_strict():
    v = verdict(NEAR_ZERO, delta=0.02)
    # the 95 % interval touching the margin is not "holds" / "does not hold"
    assert verdict(NEAR_ZERO, margin=v.low, delta=1e-9).outcome == "inconclusive"
    assert verdict(NEAR_ZERO, margin=v.low - 1e-12, delta=1e-9).outcome == "holds"
    assert verdict(NEAR_ZERO, margin=v.high, delta=1e-9).outcome == "inconclusive"
    assert verdict(NEAR_ZERO, margin=v.high + 1e-12, delta=1e-9).outcome == "does not hold"
    # the 90 % interval touching margin - delta is not "equivalent"
    edge = -v.tost_low  # the larger of the two distances from the margin 0
    assert verdict(NEAR_ZERO, delta=edge).outcome == "inconclusive"
    assert verdict(NEAR_ZERO, delta=edge * (1 + 1e-9)).outcome == "equivalent"


def test_holds_wins_over_equivalent_when_both_apply():
    # the 95 % interval [+0.0016, +0.0044] is above 0 and inside +-0.01: the claim holds (a small, sure difference)
    v = verdict([0.002, 0.003, 0.004, 0.003, 0.003], delta=0.01)
    assert v.outcome == "holds" and v.margin - v.delta < v.tost_low and v.tost_high < v.margin + v.delta


def test_the_margin_moves_the_verdict():
    assert verdict([1, 2, 3, 4, 5], margin=2.0, delta=0.5).outcome == "inconclusive"  # 1.04 < 2 < 4.96
    assert verdict([1, 2, 3, 4, 5], margin=3.0, delta=5.0).outcome == "equivalent"  # 90 %: [1.49, 4.51] in (-2, 8)
    assert verdict([1, 2, 3, 4, 5], margin=6.0, delta=0.5).outcome == "does not hold"
    assert verdict([1, 2, 3, 4, 5], margin=-1.0, delta=0.5).outcome == "holds"


def test_zero_variance_is_the_mean_itself():
    v = verdict([0.5, 0.5, 0.5], [0.25, 0.25, 0.25], delta=0.01)
    assert (v.outcome, v.low, v.high, v.detectable) == ("holds", 0.25, 0.25, 0.0)
    assert verdict([0.5, 0.5], [0.5, 0.5], delta=0.01).outcome == "equivalent"  # exactly the margin
    assert verdict([0.5, 0.5], [0.5, 0.5], paired=False, delta=0.01).outcome == "equivalent"


def test_welch_interval_for_unpaired_samples():
    a, b = [1.0, 2.0, 3.0], [0.0, 0.5, 1.0, 1.5]
    v = verdict(a, b, paired=False, delta=0.1)
    va, vb = 1.0 / 3, (5 / 12) / 4  # sample variances 1 and 5/12 over the sizes
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    from scipy.stats import t

    assert math.isclose(v.high - v.mean, t.ppf(0.975, df) * math.sqrt(va + vb), rel_tol=1e-12)
    assert math.isclose(v.tost_high - v.mean, t.ppf(0.95, df) * math.sqrt(va + vb), rel_tol=1e-12)
    assert math.isclose(v.mean, 2.0 - 0.75)


@pytest.mark.parametrize(("ours", "theirs", "delta", "message"), [
    ([0.9], [0.8], 0.01, "at least 2"),
    ([0.9, 0.8], [0.8], 0.01, "paired samples of 2 and 1 values"),
    ([0.9, float("nan")], None, 0.01, "finite"),
    ([0.9, 0.8], None, 0.0, r"^verdict: delta=0.0; allowed: a finite number > 0 \(the smallest difference that matters\)$"),
    ([0.9, 0.8], None, -0.01, r"^verdict: delta=-0.01; allowed: a finite number > 0"),
    ([0.9, 0.8], None, float("inf"), r"^verdict: delta=inf; allowed"),
    ([0.9, 0.8], None, "0.01", r"^verdict: delta='0.01'; allowed"),
])
def test_bad_input_is_refused(ours, theirs, delta, message):
    with pytest.raises(ValueError, match=message):
        verdict(ours, theirs, delta=delta)


def test_delta_is_required():
    with pytest.raises(TypeError, match="delta"):
        verdict([0.9, 0.8])  # type: ignore[call-arg]


def test_expect_verdict_raises_naming_the_claim():
    from lowrank_lit.stats import expect_verdict

    v = expect_verdict("holds", [0.9, 0.91, 0.92], [0.8, 0.8, 0.8], delta=0.01, claim="A >= B")
    assert v.outcome == "holds"
    with pytest.raises(AssertionError, match=r"A >= B: expected equivalent, got holds: mean difference \+0\.1100"):
        expect_verdict("equivalent", [0.9, 0.91, 0.92], [0.8, 0.8, 0.8], delta=0.01, claim="A >= B")
    with pytest.raises(ValueError, match="^expect_verdict: expected='tie'; allowed: holds, does not hold, equivalent, "
                                         "inconclusive"):
        expect_verdict("tie", [1.0, 2.0], delta=0.01)
    # where the kernels disagree: either outcome passes, the others do not
    assert expect_verdict(("inconclusive", "holds"), [0.9, 0.91, 0.92], [0.8, 0.8, 0.8], delta=0.01).outcome == "holds"
    with pytest.raises(AssertionError, match="expected inconclusive or holds, got does not hold"):
        expect_verdict(("inconclusive", "holds"), [0.7, 0.71, 0.72], [0.8, 0.8, 0.8], delta=0.01)


def _must_show_tests() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        found += [(f"{path.relative_to(TESTS.parent)}::{node.name}", node) for node in tree.body
                  if isinstance(node, ast.FunctionDef) and node.name.startswith("test_must_show_")]
    return found


def _calls(node: ast.AST) -> set[str]:
    return {c.func.id if isinstance(c.func, ast.Name) else c.func.attr for c in ast.walk(node)
            if isinstance(c, ast.Call) and isinstance(c.func, ast.Name | ast.Attribute)}


def _no_verdict_reason(fn: ast.FunctionDef) -> str | None:
    for dec in fn.decorator_list:
        if isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr == "no_verdict":
            args = [a.value for a in dec.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            return args[0] if args else ""
    return None


def test_every_must_show_test_judges_its_claim_by_the_rule_or_says_why_not():
    """A test_must_show_* calls verdict (or expect_verdict) in its body, or carries
    ``@pytest.mark.no_verdict("<one line: why this claim is not a comparison over seeds>")``."""
    tests = _must_show_tests()
    assert len(tests) >= 30, [name for name, _ in tests]
    problems = []
    for name, fn in tests:
        reason = _no_verdict_reason(fn)
        judged = bool(_calls(fn) & {"verdict", "expect_verdict"})
        if reason is None and not judged:
            problems.append(f"{name}: calls neither verdict nor expect_verdict and has no no_verdict reason")
        elif reason is not None and (judged or not reason.strip() or "\n" in reason):
            problems.append(f"{name}: a no_verdict reason must be one non-empty line, on a test that calls no verdict")
    assert not problems, "\n".join(problems)


def test_every_judged_claim_states_its_delta():
    """Each call of verdict / expect_verdict in the suite and in benchmarks/ names ``delta=``, the smallest difference
    that matters to that claim (the rule's own tests above excepted)."""
    root = TESTS.parent
    missing = []
    for path in sorted([*TESTS.rglob("*.py"), *(root / "benchmarks").rglob("*.py")]):
        if path.name == "test_stats.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and (
                    (isinstance(node.func, ast.Name) and node.func.id in {"verdict", "expect_verdict"})
                    or (isinstance(node.func, ast.Attribute) and node.func.attr in {"verdict", "expect_verdict"})):
                if not any(kw.arg == "delta" or kw.arg is None for kw in node.keywords):
                    missing.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not missing, f"verdict calls without delta=: {missing}"


TOLERANCE_KEYWORDS = {"atol", "rtol", "abs", "rel"}


def untraced_tolerances(source: str, name: str = "<test>") -> list[str]:
    """``name:line`` of every tolerance keyword whose value is a number literal (other than 0) with neither a name
    from tests/tolerances.py in it nor a ``# tol:`` comment on its lines."""
    from tests import tolerances

    names = {n for n in vars(tolerances) if n.isupper() or n == "f32"}
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        for kw in getattr(node, "keywords", []) if isinstance(node, ast.Call) else []:
            if kw.arg not in TOLERANCE_KEYWORDS:
                continue
            parts = list(ast.walk(kw.value))
            literal = any(isinstance(p, ast.Constant) and isinstance(p.value, float | int) and p.value != 0
                          for p in parts)
            named = any(isinstance(p, ast.Name) and p.id in names for p in parts)
            commented = any("# tol:" in lines[i - 1] for i in range(kw.value.lineno, kw.value.end_lineno + 1))
            if literal and not named and not commented:
                found.append(f"{name}:{kw.value.lineno}")
    return found


def test_untraced_tolerances_are_found():
    assert untraced_tolerances("torch.testing.assert_close(a, b, atol=1e-5, rtol=0)") == ["<test>:1"]
    assert untraced_tolerances("x == pytest.approx(y, rel=2 * 1e-6)") == ["<test>:1"]
    assert untraced_tolerances("torch.testing.assert_close(a, b, atol=F32_LAYERS, rtol=0)") == []
    assert untraced_tolerances("torch.testing.assert_close(a, b, atol=F32 * s, rtol=0)") == []
    assert untraced_tolerances("x == pytest.approx(y, abs=0.05)  # tol: read off a figure") == []
    assert untraced_tolerances("x == pytest.approx(y, rel=spread)\nf(atol=0)") == []


def test_every_float_tolerance_in_the_suite_is_traced():
    """Each tolerance is a named bound of tests/tolerances.py (with its error analysis) or says where it comes from."""
    root = Path(__file__).parent
    found = [hit for path in sorted(root.rglob("*.py")) if path.name != "tolerances.py"
             for hit in untraced_tolerances(path.read_text(), str(path.relative_to(root)))]
    assert not found, f"tolerances without a name from tests/tolerances.py or a '# tol:' comment: {found}"
