"""The user-facing docs: every markdown table is well formed, and pages speak of claims, not of our process."""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers import ROOT

DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
_FENCE = re.compile(r"^\s*(```|~~~)")
_DELIM_CELL = re.compile(r"^\s*:?-{3,}:?\s*$")


def _cells(line: str) -> list[str]:
    """Cells of a table row (a `|` inside backticks or escaped as `\\|` does not split)."""
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    cells, cur, in_code = [], "", False
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            cur += body[i : i + 2]
            i += 2
            continue
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code:
            cells.append(cur)
            cur = ""
        else:
            cur += ch
        i += 1
    cells.append(cur)
    return [c.strip() for c in cells]


def table_problems(text: str) -> list[str]:
    """Problems of the markdown tables in ``text``: a header without a delimiter row, rows whose cell
    count differs from the header's, or a table interrupted by a blank line and continued."""
    problems = []
    lines = text.splitlines()
    in_fence = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line):
            in_fence = not in_fence
            i += 1
            continue
        if in_fence or not line.lstrip().startswith("|"):
            i += 1
            continue
        start = i
        block = []
        while i < len(lines) and lines[i].lstrip().startswith("|"):
            block.append(lines[i])
            i += 1
        header = _cells(block[0])
        if len(block) < 2 or not all(_DELIM_CELL.match(c) for c in _cells(block[1])):
            problems.append(f"line {start + 1}: table row without a header/delimiter row above it")
            continue
        if len(_cells(block[1])) != len(header):
            problems.append(f"line {start + 2}: delimiter row has {len(_cells(block[1]))} cells, header {len(header)}")
        for k, row in enumerate(block[2:], start=start + 3):
            if len(_cells(row)) != len(header):
                problems.append(f"line {k}: {len(_cells(row))} cells, header has {len(header)}")
    return problems


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_tables_are_well_formed(page):
    assert table_problems(page.read_text()) == []


def test_table_checker_catches_broken_tables():
    good = "| a | b |\n|---|---|\n| 1 | `x|y` |\n"
    assert table_problems(good) == []
    assert table_problems("| a | b |\n|---|---|\n| 1 | 2 | 3 |\n") == ["line 3: 3 cells, header has 2"]
    assert table_problems("text\n| 1 | 2 |\n") == ["line 2: table row without a header/delimiter row above it"]
    assert table_problems("| a | b |\n|---|---|\n\n| 1 | 2 |\n")[0].startswith("line 4")


# words from how the project is organised, not from what a user reads
_IN_HOUSE = re.compile(r"\b(cards?|cards'|paper \d\d|the issue|issue's|issue \d+)\b", re.I)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_speak_of_claims_and_criteria(page):
    text = page.read_text()
    hits = [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in _IN_HOUSE.finditer(text)]
    assert hits == [], "say 'the paper's claim' or 'our acceptance criterion' instead"


def _yaml_blocks() -> list[tuple[str, int, str]]:
    """Every fenced ```yaml block of the docs: (page, first line number, text)."""
    blocks = []
    for page in DOCS:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if re.match(r"^\s*```ya?ml\s*$", lines[i]):
                j = i + 1
                while j < len(lines) and not _FENCE.match(lines[j]):
                    j += 1
                blocks.append((str(page.relative_to(ROOT)), i + 1, "\n".join(lines[i + 1 : j])))
                i = j
            i += 1
    return blocks


@pytest.mark.parametrize("page,line,text", _yaml_blocks(), ids=lambda v: v if isinstance(v, str) and "\n" not in v else None)
def test_every_yaml_block_parses(page, line, text, tmp_path, monkeypatch):
    """A user copies a YAML example into a file: it must be valid YAML (a sweep's ``command: [${env}, ...]`` is not),
    and a whole sweep file (one with ``program:``) passes ``lowrank sweep --check``."""
    import yaml

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        pytest.fail(f"{page}:{line}: the yaml block does not parse: {exc}")
    if isinstance(doc, dict) and "program" in doc:
        from lowrank_lit.launch.sweep_spec import load_sweep, static_check

        monkeypatch.chdir(ROOT)
        (tmp_path / "example.yaml").write_text(text)
        static_check(load_sweep(tmp_path / "example.yaml"))


def _quick_runs():
    import importlib.util

    spec = importlib.util.spec_from_file_location("quick_runs", ROOT / "benchmarks" / "quick_runs.py")
    if spec.name not in sys.modules:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[spec.name]


def _paper_slugs() -> list[str]:
    from lowrank_lit.registry import scan_methods

    return sorted(m.slug for m in scan_methods() if m.slug != "baseline")


@pytest.mark.parametrize("slug", _paper_slugs())
def test_method_page_starts_with_a_quick_run(slug):
    """The first section of every method page is one run a user can start now: `lowrank` commands of configs that
    exist, each with the verb its config asks for, its time on a laptop CPU and the number it prints."""
    from lowrank_lit.launch.config_yaml import config_header

    run = _quick_runs().quick_run(ROOT / "docs" / "methods" / f"{slug}.md")
    assert run.seconds > 0 and run.key
    done: list[str] = []
    for command in run.commands:
        verb, config = command[1], command[command.index("--config") + 1]
        assert (ROOT / config).is_file(), config
        assert config.startswith(f"configs/{slug}/"), f"{slug}: the quick run uses another method's config {config}"
        header = config_header(ROOT / config)
        assert header.command in (None, verb), f"{config} runs with `lowrank {header.command}`, the page says {verb}"
        assert not (header.gpu or header.your_data), f"{config} needs {header.needs()}: not a quick run"
        if header.first:  # what it starts from runs before it, in the same block
            assert header.first.split("--config")[1].split()[0] in done, f"{config}: run `{header.first}` first"
        done.append(config)


def test_quick_run_parser_refuses_a_page_without_one(tmp_path):
    quick = _quick_runs()
    page = tmp_path / "m.md"
    page.write_text("# M\n\nIntro.\n\n## Results\n\n```bash\nlowrank fit --config configs/m/a.yaml\n```\n")
    with pytest.raises(ValueError, match="first section must be '## Try it'"):
        quick.quick_run(page)
    page.write_text("# M\n\n## Try it\n\n```bash\nlowrank fit --config configs/m/a.yaml\n```\n\nIt is quick.\n")
    with pytest.raises(ValueError, match="ends with `KEY VALUE`"):
        quick.quick_run(page)
    block = ("# M\n\n## Try it\n\n```bash\nlowrank fit --config configs/m/a.yaml && \\\n  lowrank test "
             "--config configs/m/b.yaml\n```\n\nAbout 2 min on a 2-core laptop CPU; it ends with `test/acc 0.97`")
    page.write_text(block + " (seed 0).\n")
    with pytest.raises(ValueError, match="give its band, '\\(LOW-HIGH across CPU kernels and threads'"):
        quick.quick_run(page)
    page.write_text(block + " (0.98-0.99 across CPU kernels and threads; seed 0).\n")
    with pytest.raises(ValueError, match="the band 0.98-0.99 does not contain the page's value 0.97"):
        quick.quick_run(page)
    page.write_text(block + " (0.95-0.97 across CPU kernels and\nthreads; seed 0).\n")
    run = quick.quick_run(page)
    assert run.seconds == 120 and (run.key, run.value, run.decimals, run.low, run.high) == ("test/acc", 0.97, 2, 0.95, 0.97)
    assert [c[:2] for c in run.commands] == [["lowrank", "fit"], ["lowrank", "test"]]
    log = "test: test/acc 0.9711  test/loss 0.12\n│ test/acc │ 0.9711111 │\nval/test/acc 0.1"
    assert quick.printed_value(log, "test/acc") == 0.9711111 and quick.printed_value(log, "test/f1") is None
    # inside the band to the page's two decimals; 1 % off the page's value is no longer enough
    assert quick.agrees(run, 0.9711) and quick.agrees(run, 0.946) and not quick.agrees(run, 0.944)
    assert not quick.agrees(run, 0.9751) and not quick.agrees(run, None)
    page.write_text(block.replace("0.97`", "0`") + " (the same across CPU kernels and threads; seed 0).\n")
    run = quick.quick_run(page)
    assert (run.low, run.high) == (0.0, 0.0) and quick.agrees(run, 0.4) and not quick.agrees(run, 1.0)


def test_quick_run_bands_tabulate_each_setting_and_the_range(tmp_path):
    quick = _quick_runs()
    outputs = []
    for setting, value in (("default (DEFAULT), 1 thread(s)", 0.9533), ("avx2 (AVX2), 2 thread(s)", 0.9711)):
        path = tmp_path / f"{len(outputs)}.md"
        path.write_text(f"CPU kernels and threads: {setting}\n\n| method | command | page: time | wall time (s) | "
                        "page: value (band) | printed | in the band |\n|---|---|---|---|---|---|---|\n"
                        f"| glvq | `lowrank ...` | 27 s | 60 | test/acc 0.9622 (0.9533-0.9711) | {value} | yes |\n")
        outputs.append(path)
    table = quick.bands_table(outputs)
    (row,) = [ln for ln in table.splitlines() if ln.startswith("| glvq |")]
    assert row == "| glvq | `test/acc` | 0.9533 | 0.9711 | 0.9533-0.9711 |"
    assert "| default (DEFAULT), 1 thread(s) | avx2 (AVX2), 2 thread(s) | band |" in table
    (tmp_path / "bad.md").write_text("| method |\n")
    with pytest.raises(ValueError, match="not an output of benchmarks/quick_runs.py"):
        quick.bands_table([tmp_path / "bad.md"])


@pytest.mark.slow
def test_every_quick_run_prints_what_its_page_says(tmp_path):
    """Runs the 19 quick runs (about 40 min on 2 cores) and checks each printed number lies in its page's band."""
    import subprocess
    import sys

    env = {**__import__("os").environ, "LOWRANK_RUN_ROOT": str(tmp_path / "runs")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quick_runs.py"), "--check"], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
