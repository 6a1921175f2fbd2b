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


def test_a_t_interval_over_five_paired_seeds_by_hand():
    # differences 1..5: mean 3, sd sqrt(2.5), half width t * sd / sqrt(5)
    v = verdict([2, 4, 6, 8, 10], [1, 2, 3, 4, 5])
    half = T4 * math.sqrt(2.5) / math.sqrt(5)
    assert v.outcome == "holds" and v.n == 5 and v.mean == 3.0
    assert math.isclose(v.low, 3 - half, rel_tol=1e-12) and math.isclose(v.high, 3 + half, rel_tol=1e-12)
    assert math.isclose(v.low, 1.0367568, abs_tol=1e-6)


def test_does_not_hold_when_the_interval_lies_below_the_margin():
    v = verdict([0.80, 0.82, 0.81, 0.79, 0.83], [0.90, 0.91, 0.93, 0.90, 0.92])
    # differences -0.10 -0.09 -0.12 -0.11 -0.09: mean -0.102, variance 1.7e-4
    half = T4 * math.sqrt(1.7e-4 / 5)
    assert v.outcome == "does not hold"
    assert math.isclose(v.mean, -0.102, abs_tol=1e-12) and math.isclose(v.high, -0.102 + half, abs_tol=1e-12)


def test_a_tie_when_the_interval_contains_the_margin():
    v = verdict([0.01, -0.02, 0.015, 0.0, -0.01])  # already differences: mean -0.001, variance 2.05e-4
    half = T4 * math.sqrt(2.05e-4 / 5)
    assert v.outcome == "tie" and math.isclose(v.low, -0.001 - half, abs_tol=1e-12)
    assert "tie: mean difference -0.0010, 95 % interval [-0.0188, +0.0168] over n=5" in str(v)


def test_the_margin_moves_the_verdict():
    assert verdict([1, 2, 3, 4, 5], margin=2.0).outcome == "tie"  # 1.04 < 2 < 4.96
    assert verdict([1, 2, 3, 4, 5], margin=6.0).outcome == "does not hold"
    assert verdict([1, 2, 3, 4, 5], margin=-1.0).outcome == "holds"


def test_zero_variance_is_the_mean_itself():
    v = verdict([0.5, 0.5, 0.5], [0.25, 0.25, 0.25])
    assert (v.outcome, v.low, v.high) == ("holds", 0.25, 0.25)
    assert verdict([0.5, 0.5], [0.5, 0.5]).outcome == "tie"  # exactly the margin
    assert verdict([0.5, 0.5], [0.5, 0.5], paired=False).outcome == "tie"


def test_welch_interval_for_unpaired_samples():
    a, b = [1.0, 2.0, 3.0], [0.0, 0.5, 1.0, 1.5]
    v = verdict(a, b, paired=False)
    va, vb = 1.0 / 3, (5 / 12) / 4  # sample variances 1 and 5/12 over the sizes
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    from scipy.stats import t

    assert math.isclose(v.high - v.mean, t.ppf(0.975, df) * math.sqrt(va + vb), rel_tol=1e-12)
    assert math.isclose(v.mean, 2.0 - 0.75)


@pytest.mark.parametrize(("ours", "theirs", "message"), [
    ([0.9], [0.8], "at least 2"),
    ([0.9, 0.8], [0.8], "paired samples of 2 and 1 values"),
    ([0.9, float("nan")], None, "finite"),
])
def test_bad_input_is_refused(ours, theirs, message):
    with pytest.raises(ValueError, match=message):
        verdict(ours, theirs)


def test_expect_verdict_raises_naming_the_claim():
    from lowrank_lit.stats import expect_verdict

    v = expect_verdict("holds", [0.9, 0.91, 0.92], [0.8, 0.8, 0.8], claim="A >= B")
    assert v.outcome == "holds"
    with pytest.raises(AssertionError, match=r"A >= B: expected tie, got holds: mean difference \+0\.1100"):
        expect_verdict("tie", [0.9, 0.91, 0.92], [0.8, 0.8, 0.8], claim="A >= B")
    with pytest.raises(ValueError, match="expected='hold'; allowed: holds, does not hold, tie"):
        expect_verdict("hold", [1.0, 2.0])
    # where the kernels disagree: either outcome passes, the third does not
    assert expect_verdict(("tie", "holds"), [0.9, 0.91, 0.92], [0.8, 0.8, 0.8]).outcome == "holds"
    with pytest.raises(AssertionError, match="expected tie or holds, got does not hold"):
        expect_verdict(("tie", "holds"), [0.7, 0.71, 0.72], [0.8, 0.8, 0.8])


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
