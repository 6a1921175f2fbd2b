"""``lowrank summarize <slug> <run-root>...``: a method's (or a study's) result table from its runs.

The summary function is the one a method registers (``register_method(..., summary=...)``) or a study's
``summary`` (``lowrank_lit/studies/<name>.py``); the runs are read with :mod:`lowrank_lit.report`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lowrank_lit.report import (
    NoMethodRuns,
    Run,
    RunFilter,
    find_runs,
    including_debug_runs,
    only_runs_of,
    read_runs,
    unfinished_runs,
)

__all__ = ["Summary", "get_summary", "studies", "summary_options", "main"]


@dataclass(frozen=True)
class Summary:
    """A method's summary: ``fn(roots, out, **options) -> markdown``; its keyword arguments after ``roots`` and
    ``out`` are the extra options of ``lowrank summarize <slug>`` (:func:`summary_options`).

    Attributes:
        slug: the method's registered slug.
        fn: reads the runs under ``roots`` (run directories or folders holding them), returns the
            markdown table, and writes a figure to ``out`` when it is given.
        help: one line for ``lowrank summarize <slug> --help`` (the docstring's first line).
        module: the registered method's module (its runs build its classes); None for a benchmark.
    """

    slug: str
    fn: Callable[..., str]
    help: str = ""
    module: str | None = None


def studies() -> dict[str, str]:
    """The studies that span several methods, from the checked-in index (:func:`lowrank_lit.registry.scan_studies`;
    no study is imported): name -> dotted path of the summary function."""
    from lowrank_lit.registry import scan_studies

    return scan_studies()


#: extra studies by name -> dotted path of their summary (tests add stand-ins here)
EXTRA_STUDIES: dict[str, str] = {}


#: summaries resolved in this process: ``(slug, the extra studies) -> Summary`` (the verb's parser asks for the
#: options of the summary it then runs, and each answer reads the registry)
_RESOLVED: dict[tuple[str, tuple[tuple[str, str], ...]], Summary] = {}


def get_summary(slug: str) -> Summary:
    """The summary the registration of ``slug`` names (or the study ``slug`` of :func:`studies`), with its help (the
    docstring's first line). Resolved once per process.

    Raises:
        KeyError: no method or study ``slug``, or the method names no summary (both name the ones that do).
    """
    key = (slug, tuple(sorted(EXTRA_STUDIES.items())))
    if key not in _RESOLVED:
        _RESOLVED[key] = _resolve_summary(slug)
    return _RESOLVED[key]


def _resolve_summary(slug: str) -> Summary:
    from lowrank_lit import registry
    from lowrank_lit.registry import import_dotted

    methods = {m.slug: m for m in registry.scan_methods()}
    info = methods.get(slug)
    known_studies = {**studies(), **EXTRA_STUDIES}
    path = known_studies.get(slug) or (info.summary if info is not None else None)
    if path is None:
        known = ", ".join(sorted(s for s, m in methods.items() if m.summary)) or "(none)"
        what = "is not a registered method" if info is None else "registers no summary"
        raise KeyError(f"{slug!r} {what}; methods with a summary: {known}; studies: {', '.join(known_studies)}")
    fn = import_dotted(path)
    return Summary(slug, fn, (fn.__doc__ or "").strip().splitlines()[0],
                   info.target.rpartition(".")[0] if info is not None else None)


def summary_options(slug: str) -> Callable[..., str]:
    """The summary function of ``slug``, whose keyword arguments are the options of ``lowrank summarize <slug>``.

    Raises:
        KeyError: as :func:`get_summary`.
    """
    return get_summary(slug).fn


def main(slug: str, roots: list[str], *, out: str | None = None, include_debug: bool = False, list_debug: bool = False,
         **options: Any) -> int:
    """Print a method's (or a study's) result table (markdown) from its runs; --out also writes its figure.

    ``lowrank summarize <slug> --help`` lists the method's own options too.

    Args:
        slug: a method with a summary, or a study with one (peft_suite)
        roots: run directories, or folders holding them
        out: also write the figure to this file (PNG)
        include_debug: also use debug runs (fast_dev_run, overfit_batches, limit_train_batches), left out by default
        list_debug: only list the debug runs and the unfinished runs (killed, crashed, interrupted) under the roots and why
        options: the summary's own options (its keyword arguments)
    """
    summary = get_summary(slug)
    from lowrank_lit.registry import project_root

    run_filter = RunFilter(summary.slug, summary.module, project_root() / "configs" / summary.slug)
    missing = [r for r in roots if not os.path.exists(r)]
    if missing:
        print(f"lowrank summarize {summary.slug}: error: {missing[0]!r} does not exist; give run directories or "
              "folders holding them", file=sys.stderr)
        return 2
    with including_debug_runs():
        debug = [r for r in read_runs(roots, "config.yaml", required=False) if r.debug]
    unfinished = [r for r in unfinished_runs(roots) if run_filter.belongs(r) is None]
    if list_debug:
        for run in debug:
            print(f"{run}  ({run.debug_reason})")
        for run in unfinished:
            print(f"{run}  (unfinished: {run.unfinished})")
        print(f"{len(debug)} debug run(s), {len(unfinished)} unfinished run(s)", file=sys.stderr)
        return 0
    try:
        with including_debug_runs(include_debug), only_runs_of(run_filter):
            text = summary.fn(roots, out, **options)
    except NoMethodRuns as exc:
        print(f"lowrank summarize {summary.slug}: {exc}{_skipped_note(run_filter)}{_unfinished_note(unfinished)}",
              file=sys.stderr)
        return 1
    except (FileNotFoundError, LookupError, ValueError) as exc:
        if not any(run_filter.belongs(Run(d)) is None for d in find_runs(roots, "config.yaml")):
            print(f"lowrank summarize {summary.slug}: {NoMethodRuns(summary.slug, roots)}{_skipped_note(run_filter)}",
                  file=sys.stderr)
            return 1
        what = f"a run lacks {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)
        print(f"lowrank summarize {summary.slug}: error: {what}", file=sys.stderr)
        return 2
    print(text)
    if out:
        print(out)
    if run_filter.skipped:
        print(f"lowrank summarize {summary.slug}: {_skipped_note(run_filter).removeprefix('; ')}", file=sys.stderr)
    if unfinished:
        print(f"lowrank summarize {summary.slug}: {_unfinished_note(unfinished).removeprefix('; ')}", file=sys.stderr)
    if debug and not include_debug:
        print(f"lowrank summarize: left out {len(debug)} debug run(s) (fast_dev_run, overfit_batches, limit_train_batches); "
              "--list-debug names them, --include-debug keeps them", file=sys.stderr)
    return 0


def _unfinished_note(unfinished: list[Run]) -> str:
    """``"; left out 2 unfinished run(s) (1 x crashed: ..., 1 x killed or still running); --list-debug names them"``."""
    if not unfinished:
        return ""
    why: dict[str, int] = {}
    for run in unfinished:
        reason = str(run.unfinished)
        key = reason.split(":", 1)[0] if reason.startswith("crashed") else reason
        why[key] = why.get(key, 0) + 1
    parts = ", ".join(f"{c} x {w}" for w, c in sorted(why.items(), key=lambda t: -t[1]))
    return f"; left out {len(unfinished)} unfinished run(s) ({parts}); --list-debug names them"


def _skipped_note(run_filter: RunFilter) -> str:
    """``"; left out 3 run(s): 2 x runs of another method (q3r), 1 x ..."`` (empty when nothing was left out)."""
    if not run_filter.skipped:
        return ""
    n = sum(run_filter.skipped.values())
    parts = ", ".join(f"{c} x {why}" for why, c in sorted(run_filter.skipped.items(), key=lambda t: -t[1]))
    return f"; left out {n} run(s): {parts}"
