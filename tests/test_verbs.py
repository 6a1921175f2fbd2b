"""Typed verbs (lowrank_lit/launch/verbs.py): a function's signature and docstring are its command line."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Literal

import pytest

from lowrank_lit.argtypes import PassThrough, Typed
from lowrank_lit.launch.verbs import call, options_of, parser_for

ROOT = Path(__file__).resolve().parent.parent
SEEN: dict = {}


def _verb(name: str, *roots: str, mode: Literal["a", "b"] = "a", seeds: list[int] | None = None,
          depths: list[int] = [2, 2], dry_run: bool = False, n_trials: int | None = None,  # noqa: B006
          extra: PassThrough = [], given: Typed = ()) -> int:  # noqa: B006
    """A verb for the tests.

    Args:
        name: a name
        roots: run roots
        mode: a choice
        seeds: seeds
        depths: blocks
        dry_run: a flag
        n_trials: a count
        extra: passed on
        given: as typed
    """
    SEEN.clear()
    SEEN.update(name=name, roots=roots, mode=mode, seeds=seeds, depths=depths, dry_run=dry_run, n_trials=n_trials,
                extra=extra, given=given)
    return 0


def test_signature_to_arguments():
    argv = ["x", "r1", "r2", "--seeds", "1", "2", "--seeds", "3", "--dry-run", "--n_trials", "4", "--mode", "b"]
    assert call(_verb, argv, "lowrank t") == 0
    assert SEEN == dict(name="x", roots=("r1", "r2"), mode="b", seeds=[1, 2, 3], depths=[2, 2], dry_run=True,
                        n_trials=4, extra=[], given=tuple(argv))
    assert call(_verb, ["y", "--depths", "5"], "lowrank t") == 0  # a list option replaces its default
    assert SEEN["depths"] == [5] and SEEN["roots"] == () and SEEN["seeds"] is None and SEEN["dry_run"] is False


def test_unknown_flags_pass_through():
    argv = ["x", "--trainer.max_epochs", "3", "--model.init_args.lr=0.1", "--n-trials", "2", "--", "--seed_everything", "1"]
    assert call(_verb, argv, "lowrank t") == 0
    assert SEEN["extra"] == ["--trainer.max_epochs", "3", "--model.init_args.lr=0.1", "--seed_everything", "1"]
    assert SEEN["n_trials"] == 2 and SEEN["roots"] == ()


@pytest.mark.parametrize("argv,message", [
    (["x", "--mode", "c"], "lowrank t: error: --mode='c'; allowed: a, b"),
    (["x", "--n_trials", "z"], "lowrank t: error: --n_trials: expected int, got 'z'"),
    (["x", "--seeds", "q"], "lowrank t: error: "),
])
def test_a_value_its_type_refuses_is_one_line(argv, message, capsys):
    SEEN.clear()
    assert call(_verb, argv, "lowrank t") == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and not SEEN


def test_help_comes_from_the_docstring(capsys):
    assert call(_verb, ["--help"], "lowrank t") == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lowrank t") and "A verb for the tests." in out
    for text in ("run roots", "a choice", "--dry_run, --dry-run", "a count"):
        assert text in out
    assert "passed on" not in out and "as typed" not in out  # filled by the dispatcher, not options


def test_a_flag_must_default_to_false():
    def bad(*, keep: bool = True) -> int:
        return 0

    with pytest.raises(TypeError, match="keep: a flag defaults to False"):
        parser_for(bad, "lowrank t")


def test_options_from_a_second_function(capsys):
    def summary(roots, out=None, metric: str = "test/acc", top: int = 3) -> str:
        return ""

    def verb(slug: str, roots: list[str], *, out: str | None = None, **options) -> int:
        SEEN.clear()
        SEEN.update(slug=slug, roots=roots, out=out, options=options)
        return 0

    def lookup(slug: str):
        if slug != "m":
            raise KeyError(f"{slug!r} is not a method")
        return summary

    assert call(verb, ["m", "r", "--top", "5"], "lowrank s", options_from=lookup) == 0
    assert SEEN == dict(slug="m", roots=["r"], out=None, options={"metric": "test/acc", "top": 5})
    assert call(verb, ["n", "r"], "lowrank s", options_from=lookup) == 2
    assert "lowrank s: error: 'n' is not a method" in capsys.readouterr().err


def test_every_command_is_a_typed_verb_with_help_for_each_argument():
    """Every verb of the command table builds its parser from its signature, and its docstring documents every
    argument (the help of `lowrank <verb> --help`)."""
    import inspect

    from lowrank_lit.cli import COMMANDS, _resolve
    from lowrank_lit.launch.verbs import _docs

    for name, command in COMMANDS.items():
        fn = _resolve(command.target)
        parser_for(fn, f"lowrank {name}")
        _, helps = _docs(fn)
        params = [p for p in inspect.signature(fn).parameters if p != "options"]
        assert all(helps.get(p) for p in params), (name, [p for p in params if not helps.get(p)])


def test_no_module_of_the_package_builds_its_own_argparse_parser():
    """The verbs' command lines come from their signatures (verbs.py); argparse is imported nowhere else."""
    found = []
    for path in (ROOT / "lowrank_lit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
                found.append(str(path.relative_to(ROOT)))
            if isinstance(node, ast.ImportFrom) and node.module == "argparse":
                found.append(str(path.relative_to(ROOT)))
    assert found == []


def test_every_study_with_a_summary_is_registered():
    """``lowrank summarize`` finds studies through their registration (``@register_study``), not by reading files:
    each study module's ``summary`` is registered, and each registered path is that function."""
    import importlib
    import pkgutil

    from lowrank_lit import registry
    from lowrank_lit import studies as package

    modules = {m.name: importlib.import_module(f"{package.__name__}.{m.name}") for m in pkgutil.iter_modules(package.__path__)}
    summaries = {f"{mod.__name__}.summary" for mod in modules.values() if callable(getattr(mod, "summary", None))}
    assert summaries == set(registry.registered_studies().values()), "register each study's summary: @register_study"
    for path in registry.registered_studies().values():
        assert registry.import_dotted(path).__module__.startswith(package.__name__ + ".")


def test_a_new_study_is_one_call_in_its_own_file(tmp_path, monkeypatch):
    """A study module with one ``@register_study`` line is found by ``lowrank summarize`` once the index is rewritten
    (``python -m lowrank_lit.registry``): nothing else is edited."""
    import importlib

    from lowrank_lit import registry
    from lowrank_lit.launch import summarize

    (tmp_path / "toy_study.py").write_text(
        "from lowrank_lit.registry import register_study\n\n\n"
        "@register_study(\"toy\")\n"
        "def summary(roots, out=None):\n"
        "    \"\"\"Toy runs: one line per root.\"\"\"\n"
        "    return \"\\n\".join(roots)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_STUDIES", dict(registry._STUDIES))  # the toy leaves no registration behind
    monkeypatch.setattr(registry, "INDEX", tmp_path / "index.json")
    importlib.import_module("toy_study")
    registry.write_index()
    assert registry.scan_studies()["toy"] == "toy_study.summary"
    found = summarize.get_summary("toy")
    assert found.help == "Toy runs: one line per root." and found.fn(["a", "b"]) == "a\nb"
    monkeypatch.delitem(sys.modules, "toy_study")


def test_every_summary_options_parse():
    """`lowrank summarize <slug> --help` builds for every method with a summary and every study: the summary's
    keyword arguments become typed options beside the verb's own."""
    from lowrank_lit import registry
    from lowrank_lit.launch.summarize import get_summary, main, studies

    slugs = [m.slug for m in registry.scan_methods() if m.summary] + list(studies())
    assert "strank" in slugs and "peft_suite" in slugs
    for slug in slugs:
        parser = parser_for(main, f"lowrank summarize {slug}", get_summary(slug).fn)
        assert {"out", "include_debug", "roots"} <= set(options_of(parser))
    strank = parser_for(main, "lowrank summarize strank", get_summary("strank").fn)
    assert strank.parse_args(["strank", "r", "--metric", "test/mse"]).metric == "test/mse"
    assert get_summary("strank").help in strank.description  # the summary's own line in its --help
