"""docs/tta.md's sentences against its own tables: every number a finding quotes is in the table it reads, and
every order a finding states ("goes from a to b", "loses", "gains", "worse", "best") holds in the table."""

from __future__ import annotations

import re

from tests.helpers import ROOT

PAGE = ROOT / "docs" / "tta.md"


def _section(text: str, title: str) -> str:
    parts = re.split(r"^## ", text, flags=re.M)
    (found,) = [p for p in parts if p.startswith(title)]
    return found


def _table(section: str) -> dict[tuple[str, ...], dict[str, float]]:
    """The first markdown table of ``section``: row key (the non-numeric leading cells) -> column -> mean."""
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        keys = tuple(c for c, h in zip(cells, header, strict=True) if not h.startswith("test/"))
        rows[keys] = {h.split("stream=")[1]: float(c.split()[0]) for c, h in zip(cells, header, strict=True)
                      if h.startswith("test/")}
    return rows


def _prose(section: str) -> str:
    return " ".join(ln for ln in section.splitlines() if not ln.startswith("|"))


def test_the_bn_cnn_findings_match_the_online_error_table():
    text = PAGE.read_text()
    table = _table(_section(text, "Online error"))
    err = {(m, p, s): v for (m, p), cols in table.items() for s, v in cols.items()}
    findings = _prose(_section(text, "What the table shows"))
    # (statement as printed on the page, the cells it reads) -> the order it states must hold in the table
    arrows = {  # "X goes from a (stream 1) to b (stream 2)": both numbers are the table's
        ("bn", "plain", "csc", "correlated"), ("tent", "plain", "csc", "correlated"),
        ("rotta", "plain", "csc", "correlated"), ("lame", "plain", "csc", "correlated"),
    }
    for m, p, s1, s2 in arrows:
        a, b = err[(m, p, s1)], err[(m, p, s2)]
        assert f"{a:.3f}" in findings and f"{b:.3f}" in findings, (m, a, b)
    # batch statistics fail under label correlation: AdaBN, Tent, EATA and SAR lose more than RoTTA and LAME
    drop = {m: err[(m, "plain", "correlated")] - err[(m, "plain", "csc")] for m in ("bn", "tent", "eata", "sar", "rotta", "lame")}
    assert min(drop[m] for m in ("bn", "tent", "eata", "sar")) > max(drop["rotta"], drop["lame"]), drop
    # the source model's error does not depend on the order (within 0.01 across csc, cdc, mixed, correlated)
    src = [err[("source", "plain", s)] for s in ("csc", "cdc", "mixed", "correlated")]
    assert max(src) - min(src) < 0.01, src
    # mixed domains hurt Tent most among the batch-statistics methods, and the reservoir brings it back
    mixed = {m: err[(m, "plain", "mixed")] for m in ("bn", "tent", "eata", "sar", "cotta")}
    assert max(mixed, key=mixed.get) == "tent" and err[("tent", "reservoir", "mixed")] < mixed["tent"], mixed
    # RoTTA is the best plain method on the correlated stream; LAME is worse than the source model on every stream
    plain_corr = {m: err[(m, "plain", "correlated")] for m in ("source", "bn", "tent", "eata", "cotta", "sar", "rotta", "lame")}
    assert min(plain_corr, key=plain_corr.get) == "rotta", plain_corr
    assert all(err[("lame", "plain", s)] > err[("source", "plain", s)] for s in ("csc", "cdc", "mixed", "correlated", "gradual"))
    # the reservoir's gains around RoTTA, as quoted: each one printed, large on csc, cdc and correlated, small elsewhere
    gain = {s: err[("rotta", "plain", s)] - err[("rotta", "reservoir", s)] for s in ("csc", "cdc", "mixed", "correlated", "gradual")}
    assert all(f"{gain[s]:.3f}" in findings for s in ("csc", "cdc", "correlated")), gain
    assert min(gain["csc"], gain["cdc"], gain["correlated"]) > 10 * max(gain["mixed"], gain["gradual"]), gain


def test_the_layernorm_findings_match_their_table():
    text = PAGE.read_text()
    section = _section(text, "TRUST's rows")
    table = _table(section)
    err = {(m[0], s): v for m, cols in table.items() for s, v in cols.items()}
    prose = _prose(section)
    # EATA is the only method below the source model on CSC and CDC
    for s in ("csc", "cdc"):
        below = [m for (m, st), v in err.items() if st == s and m != "source" and v < err[("source", s)]]
        assert below == ["eata"], (s, below)
    # TRUST drifts furthest: the highest error on every stream
    for s in ("csc", "cdc", "mixed", "correlated", "gradual"):
        assert max((v, m) for (m, st), v in err.items() if st == s)[1] == "trust", s
    # LAME gains most from the correlation, Tent gains too
    gain = {m: err[(m, "csc")] - err[(m, "correlated")] for m in ("source", "tent", "eata", "sar", "lame")}
    assert max(gain, key=gain.get) == "lame" and gain["tent"] > 0, gain
    assert f"{err[('lame', 'csc')]:.3f} ->" in prose or f"({err[('lame', 'csc')]:.3f} ->" in prose
    # TRUST with its reset, on its page's 12-batch visits: the lowest accuracy of the three it is compared with
    m = re.search(r"TRUST has the lowest mean accuracy of the\s+three on this LayerNorm model \((\d\.\d+) against "
                  r"Tent's (\d\.\d+) and the source's (\d\.\d+)", prose)
    assert m is not None, "the sentence on TRUST with its reset changed: check its order against docs/methods/trust.md"
    trust, tent, source = map(float, m.groups())
    assert trust < min(tent, source)
    trust_page = (ROOT / "docs" / "methods" / "trust.md").read_text()
    assert all(f"{v:.3f}" in trust_page for v in (trust, tent, source))
