"""``lowrank``: the command line of lowrank_lit, the top of the package (nothing imports it).

Training subcommands are Lightning's own (:class:`~lowrank_lit.launch.lightning_cli.LowrankCLI` is a
``LightningCLI`` in subclass mode for both model and data)::

    lowrank fit --config configs/baseline/mlp_digits.yaml [--config callbacks/wandb.yaml] [--model.init_args.lr=...]
    lowrank validate|test|predict --config ... [--ckpt_path ...]
    lowrank fit --config configs/baseline/mlp_digits.yaml --print_config

and ours (:data:`COMMANDS`, the one table of verbs: it drives the dispatch, ``lowrank --help`` and the
command list of docs/cli.md); none imports Lightning until it needs it, and each imports only its own module.

Every run writes to ``<run_root>/<experiment>/<run_id>/`` (see :mod:`lowrank_lit.launch.run_dir`):
the resolved ``config.yaml``, CSV metrics, checkpoints and, with ``callbacks/wandb.yaml``, the
W&B files (offline unless an API key is configured or ``WANDB_MODE=online``).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lowrank_lit.launch.checks import is_rank_zero
from lowrank_lit.launch.config_yaml import LIGHTNING_COMMANDS, config_file_error, config_files, wrong_command
from lowrank_lit.launch.messages import ConfigError, interrupted_message, one_line_error

__all__ = ["main", "methods_markdown", "method_pages_markdown", "Command", "COMMANDS", "top_help", "commands_markdown", "LIGHTNING_COMMANDS"]


_LIGHTNING_HELP = {
    "fit": "train a model: lowrank fit --config configs/baseline/mlp_digits.yaml",
    "validate": "run the validation loop on a checkpoint (--ckpt_path)",
    "test": "run the test loop (--ckpt_path)",
    "predict": "run prediction (--ckpt_path)",
}

_HELP_FOOTER = """
Compose configs with repeated --config (later files win), e.g. a preset from callbacks/:
  lowrank fit --config configs/baseline/mlp_digits.yaml --config callbacks/wandb.yaml
Override single keys with dotted flags: --trainer.max_epochs=5 --model.init_args.num_classes=10
Runs are written to runs/<experiment>/<run_id>/ (--run_root, --experiment, --run_id).
"""


@dataclass(frozen=True)
class Command:
    """One ``lowrank`` verb of ours.

    Args:
        target: ``"module:function"``, a typed verb (:mod:`lowrank_lit.launch.verbs`): its signature and docstring
            are the verb's arguments and help, and it returns the exit status. Only this module is imported when
            the verb runs (``lowrank --help`` imports none).
        help: what the verb does, with an example; the line of ``lowrank --help`` and of docs/cli.md.
        options_from: ``"module:function"`` for a verb with ``**options``: called with the first positional word,
            it returns the function whose keyword arguments are options too.
    """

    target: str
    help: str
    options_from: str | None = None

    def __call__(self, argv: Sequence[str], name: str = "") -> int:
        from lowrank_lit.launch.verbs import call

        more = _resolve(self.options_from) if self.options_from else None
        return call(_resolve(self.target), argv, f"lowrank {name}".rstrip(), options_from=more)


def _resolve(target: str) -> Any:
    """The object ``"module:name"`` names (the module imported now)."""
    import importlib

    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


#: every verb of ours, in the order ``lowrank --help`` lists them
COMMANDS: dict[str, Command] = {
    "list": Command("lowrank_lit.cli:cmd_list",
                    "the registered methods, their kind, paper and configs (--markdown: README table); "
                    "lowrank list <slug>: each config's command, what it needs and what must run first"),
    "sweep": Command("lowrank_lit.launch.sweep:main",
                     "run a W&B sweep file offline with optuna: lowrank sweep sweeps/<slug>.yaml [--n-trials N]"),
    "submit": Command("lowrank_lit.launch.slurm:main",
                      "write and submit an sbatch script: lowrank submit --config C.yaml --nodes 2 --gpus-per-node 4"),
    "summarize": Command("lowrank_lit.launch.summarize:main",
                         "a method's result table from its runs: lowrank summarize <slug> <run-root>... [--out plot.png]",
                         options_from="lowrank_lit.launch.summarize:summary_options"),
    "bench": Command("lowrank_lit.launch.bench:main",
                     "every method's cost as a ratio to its baseline: lowrank bench [<slug>...] [--quick] [--device cuda]"),
    "matrix": Command("lowrank_lit.launch.matrix:main",
                      "a grid of config fragments x seeds, one table: lowrank matrix --config BASE.yaml --grid GRID.yaml"),
    "export": Command("lowrank_lit.launch.export:main_export",
                      "only what a run trained: lowrank export --ckpt_path RUN/checkpoints/last.ckpt --out DIR "
                      "[--format FORMAT] (docs/artifacts.md lists the formats)"),
    "load": Command("lowrank_lit.launch.export:main_load",
                    "an exported artifact onto its checked base: lowrank load DIR [--out FILE.ckpt]"),
    "convert": Command("lowrank_lit.cli:cmd_convert",
                       "released weights to this project's names: lowrank convert vmamba --src S.pth --out O.pth"),
    "estimate": Command("lowrank_lit.launch.estimate:main",
                        "memory per GPU at full size, on the meta device: lowrank estimate --config C.yaml"),
}


def top_help(width: int = 110) -> str:
    """``lowrank --help``: the Lightning verbs and every verb of :data:`COMMANDS`, wrapped to ``width``."""
    import textwrap

    def block(title: str, rows: dict[str, str]) -> list[str]:
        lines = [title]
        for name, text in rows.items():
            lines += textwrap.wrap(text, width, initial_indent=f"  {name:<10} ", subsequent_indent=" " * 13)
        return lines

    lines = ["usage: lowrank <command> [options]", ""]
    lines += block("Lightning commands (LightningCLI; `lowrank <command> --help` lists every option):", _LIGHTNING_HELP)
    lines += [""] + block("lowrank_lit commands:", {n: c.help for n, c in COMMANDS.items()})
    return "\n".join(lines) + "\n" + _HELP_FOOTER


def commands_markdown() -> str:
    """The command list of docs/cli.md, from :data:`COMMANDS` (a test compares the page with it)."""
    rows = ["| command | what it does |", "|---|---|"]
    rows += [f"| `lowrank {name}` | {text} |" for name, text in _LIGHTNING_HELP.items()]
    rows += [f"| `lowrank {name}` | {c.help} |" for name, c in COMMANDS.items()]
    return "\n".join(rows) + "\n"


# --------------------------------------------------------------------------- our commands
def methods_markdown() -> str:
    """The README's method table, generated from the registry."""
    from lowrank_lit import registry

    rows = ["| slug | kind | paper | configs |", "|---|---|---|---|"]
    for m in registry.scan_methods():
        configs = "<br>".join(f"`{c}`" for c in m.configs()) or "-"
        rows.append(f"| `{m.slug}` | {m.kind} | {m.paper} | {configs} |")
    return "\n".join(rows) + "\n"


def method_pages_markdown() -> str:
    """The README's list of method pages, from the registry: one line per method with a ``docs/`` page."""
    from lowrank_lit import registry

    root = registry.project_root()
    lines = []
    for m in registry.scan_methods():
        page = next((p for p in (root / "docs" / "methods" / f"{m.slug}.md", root / "docs" / f"{m.slug}.md") if p.is_file()), None)
        if page is None:
            continue
        title = next((ln[2:].strip() for ln in page.read_text().splitlines() if ln.startswith("# ")), m.slug)
        lines.append(f"- [{title}]({page.relative_to(root).as_posix()}) (`{m.slug}`)")
    return "\n".join(lines) + "\n"


def cmd_list(slug: str | None = None, *, markdown: bool = False, pages: bool = False) -> int:
    """List the registered methods: one row per method, or one per config of method SLUG.

    Args:
        slug: a method: list its configs, the command each runs with, what each needs (GPU, your files) and what
            must run first
        markdown: print the README's markdown table
        pages: print the README's list of method pages
    """
    from lowrank_lit import registry
    from lowrank_lit.launch.config_yaml import config_header

    if pages:
        print(method_pages_markdown(), end="")
        return 0
    if markdown:
        print(methods_markdown(), end="")
        return 0
    methods = registry.scan_methods()  # from the source files: no torch, no Lightning
    if slug is not None:
        info = next((m for m in methods if m.slug == slug), None)
        if info is None:
            print(f"lowrank list: error: slug={slug!r} is not a registered method; choose from "
                  f"{', '.join(m.slug for m in methods)}", file=sys.stderr)
            return 2
        rows = [("config", "command", "needs", "first")]
        for cfg in info.configs():
            h = config_header(registry.project_root() / cfg)
            rows.append((cfg, shlex.join(["lowrank", *h.command_line(cfg)]), h.needs(), h.first or "-"))
        _print_columns(rows)
        return 0
    if not methods:
        print("no methods registered")
        return 0
    rows = [("slug", "kind", "commands", "paper", "configs")]
    for m in methods:
        configs = m.configs()
        commands = sorted({config_header(registry.project_root() / c).command or "fit" for c in configs})
        rows.append((m.slug, m.kind, ", ".join(commands) or "-", m.paper, ", ".join(configs) or "-"))
    _print_columns(rows)
    print("\n`lowrank list <slug>`: each config's command, what it needs (GPU, your files) and what must run first")
    return 0


def _print_columns(rows: list[tuple[str, ...]]) -> None:
    """Left-aligned columns; the last one is not padded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1])


def cmd_convert(model: Literal["vmamba"], *, src: str, out: str, depths: list[int] = [2, 2, 8, 2]) -> int:  # noqa: B006
    """Convert released weights to this project's names.

    Args:
        model: the architecture of the weights
        src: the official checkpoint (e.g. vssm1_tiny_0230s_ckpt_epoch_264.pth)
        out: where to write the converted state dict (refused if it exists)
        depths: blocks per stage (VMamba-T: 2 2 8 2)
    """
    if not depths or any(d < 1 for d in depths):
        print(f"lowrank convert: error: --depths={' '.join(map(str, depths))}; allowed: one integer >= 1 per stage "
              "(VMamba-T: 2 2 8 2)", file=sys.stderr)
        return 2
    if not Path(src).is_file():
        print(f"lowrank convert: error: --src: file {src!r} does not exist", file=sys.stderr)
        return 2
    if Path(out).exists():
        print(f"lowrank convert: error: --out: {out!r} exists; choose a new file", file=sys.stderr)
        return 2
    import torch

    from lowrank_lit.models.vmamba import convert_official_vmamba

    state = torch.load(src, map_location="cpu", weights_only=True)
    try:
        converted = convert_official_vmamba(state, depths)
    except ValueError as exc:
        print(f"lowrank convert: error: {exc}", file=sys.stderr)
        return 2
    torch.save(converted, out)
    print(f"{len(converted)} tensors -> {out} (TinyVMamba names; give it as source_ckpt)")
    return 0


def main(args: Sequence[str] | None = None) -> int:
    """Entry point of ``lowrank`` and ``python -m lowrank_lit``; returns the exit status.

    Output piped into a reader that stops early (``lowrank list | head -1``) ends the command quietly with the
    shell's status for a closed pipe (141), not a ``BrokenPipeError`` traceback.
    """
    try:
        code = _main(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # the reader is gone: point stdout at /dev/null so the interpreter's own flush at exit cannot fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + int(signal.SIGPIPE)


def _main(args: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if args is None else args)
    if not argv or argv[0] in ("-h", "--help"):
        print(top_help(), end="")
        return 0
    if argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:], argv[0])
    if argv[0] not in LIGHTNING_COMMANDS:
        print(
            f"lowrank: error: unknown command {argv[0]!r}; choose from {', '.join((*LIGHTNING_COMMANDS, *COMMANDS))}",
            file=sys.stderr,
        )
        return 2
    rest = argv[1:]
    configs = config_files(rest)
    wants_help = any(a in ("-h", "--help") or a.split("=", 1)[0].endswith(".help") for a in rest)
    if not wants_help and not configs and not any(a.startswith(("--model", "--data")) for a in rest):
        print(f"lowrank {argv[0]}: error: no --config given; run e.g. lowrank {argv[0]} --config "
              "configs/baseline/mlp_digits.yaml (`lowrank list` shows every method's configs, "
              f"`lowrank {argv[0]} --help` every option)", file=sys.stderr)
        return 2
    if rest in (["--help"], ["-h"]):
        print(_cached_help(argv[0]), end="")
        return 0
    if wants_help:  # every registered class is imported, so the help lists every subclass an argument accepts
        from lowrank_lit import registry

        registry.load_all()
    bad = config_file_error(configs)
    if bad:  # answered before Lightning is imported
        print(f"lowrank {argv[0]}: error: {bad}", file=sys.stderr)
        return 2
    wrong = wrong_command(argv[0], configs)
    if wrong:  # a test-only config given to fit: before Lightning is imported, so no run directory is made
        print(f"lowrank {argv[0]}: error: {wrong}", file=sys.stderr)
        return 2
    from jsonargparse import ArgumentError

    from lowrank_lit.launch.lightning_cli import AlreadyFinished, RunStopped, run_command
    try:
        # args=None lets LightningCLI read sys.argv itself (it warns when both are given)
        run_dir = run_command(None if args is None else argv)
    except ArgumentError as exc:
        print(f"lowrank {argv[0]}: error: {one_line_error(exc)}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"lowrank {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
    except AlreadyFinished as done:
        if is_rank_zero():
            print(str(done), flush=True)
        return 0
    except RunStopped as stop:
        if is_rank_zero():
            print(interrupted_message(argv, stop.run_dir, stop.cause), file=sys.stderr, flush=True)
        code = stop.cause.code
        return code if isinstance(code, int) and code else 128 + int(signal.SIGTERM)
    _finish_wandb()
    _close_process_group()
    if run_dir is not None and is_rank_zero():
        print(f"run {run_dir.experiment}/{run_dir.run_id} finished: {run_dir.path}", flush=True)
    return 0


def _help_cache_path(command: str) -> Path:
    """Where ``lowrank <command> --help`` is cached: keyed on the versions of lowrank_lit, Lightning and jsonargparse,
    the newest source file of the package, the Python version and the terminal width (stale text is never shown)."""
    import hashlib
    import importlib.metadata as md
    import shutil

    package = Path(__file__).resolve().parent
    newest = max(p.stat().st_mtime_ns for p in package.rglob("*.py"))
    versions = []
    for dist in ("lowrank_lit", "lightning", "jsonargparse"):
        try:
            versions.append(md.version(dist))
        except md.PackageNotFoundError:
            versions.append("-")
    key = "|".join(map(str, (*versions, newest, sys.version, shutil.get_terminal_size().columns, package)))
    root = os.environ.get("LOWRANK_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lowrank_lit"
    return Path(root) / "help" / f"{command}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.txt"


def _cached_help(command: str) -> str:
    """``lowrank <command> --help``: LightningCLI's full help (every option, every registered subclass), built once
    (importing Lightning and every method, several seconds) and then read from the cache (a fraction of a second)."""
    import contextlib
    import io

    path = _help_cache_path(command)
    if path.is_file():
        return path.read_text()
    from lowrank_lit import registry
    from lowrank_lit.launch.lightning_cli import run_command

    registry.load_all()
    buf = io.StringIO()
    argv, sys.argv = sys.argv, [sys.argv[0], command, "--help"]  # LightningCLI reads sys.argv itself
    try:
        with contextlib.redirect_stdout(buf):
            run_command(None)
    except SystemExit:
        pass
    finally:
        sys.argv = argv
    text = buf.getvalue()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError:  # a read-only home: the help is still printed
        pass
    return text


def _finish_wandb() -> None:
    """Finish a W&B run the command started, while the command still runs.

    Left to W&B's exit hook, its closing lines ("wandb sync ...", "Find logs at ...") go to stdout with colour
    codes even when stdout is a log file; ``wandb.finish()`` prints them through its logger (stderr, plain off a
    terminal).
    """
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()


def _close_process_group() -> None:
    """Destroy the default process group after a finished multi-process run.

    Left to interpreter shutdown, gloo's worker threads can be torn down while still joinable and the
    process aborts ("terminate called without an active exception", exit -6) after a successful run.
    Called only on success: after a failure another rank may still wait in a collective.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
