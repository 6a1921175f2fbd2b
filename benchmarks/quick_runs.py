"""Run the quick run at the top of each method page ("## Try it") and check it prints what the page says.

    python benchmarks/quick_runs.py                 # all 19 pages, one after another
    python benchmarks/quick_runs.py q3r trust       # some
    python benchmarks/quick_runs.py --check         # exit 1 when a printed number falls outside its page's band

Each page's block is a ``bash`` code block of one or more ``lowrank`` commands (a prerequisite first), followed by
a sentence "About N s (or min) on a 2-core laptop CPU; it ends with `KEY VALUE` (LOW-HIGH across CPU kernels and
threads; ...)" -- or "(the same across CPU kernels and threads; ...)" for a number that does not move. The band is
the range the number took under ``ATEN_CPU_CAPABILITY=default``, ``avx2`` and the native kernels at 1 and 2 threads
(``OMP_NUM_THREADS``; docs/reproduce.md has the table). The commands run in a fresh folder (``configs/`` linked in,
runs under its ``runs/``), as a user would from a clone; the table gives the kernel setting, the thread count, the
wall time and the last value of KEY the output printed, beside the page's value and band.

To measure the band again, run the script under each setting, then tabulate the range of the printed values::

    for k in default avx2; do for t in 1 2; do
      ATEN_CPU_CAPABILITY=$k OMP_NUM_THREADS=$t python benchmarks/quick_runs.py --measure > quick_${k}_$t.md
    done; done
    python benchmarks/quick_runs.py --bands quick_*.md
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import recorded  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "methods"
_NUMBER = r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?"


@dataclass(frozen=True)
class QuickRun:
    """The quick run of a method page: its shell commands, the stated time and the value the page says it prints."""

    slug: str
    commands: list[list[str]]
    seconds: float
    key: str
    value: float
    decimals: int
    low: float
    high: float


def quick_run(page: Path, require_band: bool = True) -> QuickRun:
    """Parse the "## Try it" section of ``page`` (the first ``##`` section of the page).

    ``require_band=False`` (``--measure``) reads a page that states no band yet: the band is the value itself.

    Raises:
        ValueError: no such section first, no bash block, or no "About N s|min ... ends with `KEY VALUE`" sentence.
    """
    text = page.read_text()
    sections = re.split(r"^## ", text, flags=re.M)
    if len(sections) < 2 or not sections[1].startswith("Try it"):
        raise ValueError(f"{page.name}: the first section must be '## Try it' (the page's quick run)")
    body = sections[1]
    block = re.search(r"```bash\n(.*?)```", body, re.S)
    if block is None:
        raise ValueError(f"{page.name}: '## Try it' has no ```bash block")
    lines = block.group(1).replace("\\\n", " ").splitlines()
    commands = [shlex.split(part) for line in lines if line.strip() and not line.lstrip().startswith("#")
                for part in line.split("#")[0].split("&&") if part.strip()]
    if not commands or any(c[0] != "lowrank" for c in commands):
        raise ValueError(f"{page.name}: the quick run must be `lowrank ...` commands, got {commands}")
    prose = body[block.end():]
    took = re.search(r"About\s+(\d+(?:\.\d+)?)\s+(s|min)\s+on\s+a\s+2-core\s+laptop\s+CPU", prose)
    ends = re.search(rf"ends\s+with\s+`([\w/.-]+) ({_NUMBER})`", prose)
    if took is None or ends is None:
        raise ValueError(f"{page.name}: after the block, say 'About N s|min on a 2-core laptop CPU' and "
                         "'ends with `KEY VALUE`'")
    value = ends.group(2)
    decimals = len(value.split(".")[1].split("e")[0]) if "." in value else 0
    seconds = float(took.group(1)) * (60 if took.group(2) == "min" else 1)
    after = prose[ends.end():]
    band = re.match(rf"\s+\(({_NUMBER})-({_NUMBER})\s+across\s+CPU\s+kernels\s+and\s+threads", after)
    same = re.match(r"\s+\(the\s+same\s+across\s+CPU\s+kernels\s+and\s+threads", after)
    if band is None and same is None and require_band:
        raise ValueError(f"{page.name}: after `{ends.group(1)} {value}` give its band, '(LOW-HIGH across CPU kernels "
                         "and threads' or '(the same across CPU kernels and threads'")
    low, high = (float(band.group(1)), float(band.group(2))) if band else (float(value), float(value))
    if not low <= float(value) <= high:
        raise ValueError(f"{page.name}: the band {low:g}-{high:g} does not contain the page's value {value}")
    return QuickRun(page.stem, commands, seconds, ends.group(1), float(value), decimals, low, high)


def printed_value(output: str, key: str) -> float | None:
    """The last ``KEY VALUE`` the output printed (progress and result lines), or None."""
    found = re.findall(rf"(?<![\w/]){re.escape(key)}[\s│|]+({_NUMBER})", output)  # a line or a table row
    return float(found[-1]) if found else None


def agrees(run: QuickRun, got: float | None) -> bool:
    """The printed value lies in the page's band across CPU kernels and threads, to the page's printed decimals."""
    half = 0.5 * 10 ** -run.decimals
    return got is not None and run.low - half <= got <= run.high + half


def execute(run: QuickRun, folder: Path) -> tuple[float, float | None, int, str]:
    """Run the commands in ``folder`` (``configs`` linked to the repository's); wall time, value, exit code, log."""
    folder.mkdir(parents=True)
    (folder / "configs").symlink_to(ROOT / "configs")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    start, log, rc = time.perf_counter(), "", 0
    for command in run.commands:
        proc = subprocess.run([sys.executable, "-m", "lowrank_lit", *command[1:]], cwd=folder, env=env,
                              capture_output=True, text=True)
        log += proc.stdout + proc.stderr
        rc = proc.returncode
        if rc:
            break
    return time.perf_counter() - start, printed_value(log, run.key), rc, log


def read_measured(path: Path) -> tuple[str, dict[str, float]]:
    """The setting line and ``slug -> printed value`` of one output of this script."""
    text = path.read_text()
    setting = re.search(r"CPU kernels and threads: (.+)", text)
    if setting is None:
        raise ValueError(f"{path}: not an output of benchmarks/quick_runs.py (no 'CPU kernels and threads' line)")
    values = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] not in ("method", "---") and cells[5] not in ("-", "printed"):
            values[cells[0]] = float(cells[5])
    return setting.group(1), values


def bands_table(paths: list[Path]) -> str:
    """One row per page: each setting's printed value and their range (the band a page prints)."""
    measured = [read_measured(p) for p in paths]
    runs = {p.stem: quick_run(p, require_band=False) for p in sorted(PAGES.glob("*.md"))}
    header = "| method | key | " + " | ".join(s for s, _ in measured) + " | band |"
    lines = [header, "|" + "---|" * (3 + len(measured))]
    for slug, run in runs.items():
        got = [v.get(slug) for _, v in measured]
        seen = [g for g in got if g is not None]
        band = f"{min(seen):.{run.decimals}f}-{max(seen):.{run.decimals}f}" if seen else "-"
        lines.append(f"| {slug} | `{run.key}` | " + " | ".join("-" if g is None else f"{g:.{run.decimals}f}" for g in got)
                     + f" | {band} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("slugs", nargs="*", help="method pages to run (default: all)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a printed value falls outside its page's band")
    parser.add_argument("--measure", action="store_true",
                        help="only print the values (to measure a band): a page need not state one yet")
    parser.add_argument("--bands", nargs="+", type=Path, metavar="OUTPUT",
                        help="tabulate the printed values of these outputs of the script (one per setting) and their range")
    args = parser.parse_args()
    if args.bands:
        print(bands_table(args.bands))
        return 0
    if args.check and args.measure:
        parser.error("--check and --measure exclude each other")
    pages = [PAGES / f"{s}.md" for s in args.slugs] or sorted(PAGES.glob("*.md"))
    runs = [quick_run(p, require_band=not args.measure) for p in pages]
    import torch

    kernel = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    setting = f"{kernel} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} thread(s)"
    print(f"CPU kernels and threads: {setting}\n")
    print("| method | command | page: time | wall time (s) | page: value (band) | printed | in the band |")
    print("|---|---|---|---|---|---|---|")
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            wall, got, rc, log = execute(run, Path(tmp) / run.slug)
            ok = rc == 0 and agrees(run, got)
            bad += not ok
            shown = " && ".join(shlex.join(c) for c in run.commands)
            print(f"| {run.slug} | `{shown}` | {run.seconds:.0f} s | {wall:.0f} | {run.key} {run.value:g} "
                  f"({run.low:g}-{run.high:g}) | "
                  f"{'-' if got is None else f'{got:g}'} | {'yes' if ok else f'NO (exit {rc})'} |", flush=True)
            if rc:
                print(log[-3000:], file=sys.stderr)
    return 1 if (bad and args.check) else 0


if __name__ == "__main__":
    with recorded(__file__):
        code = main()
    sys.exit(code)
