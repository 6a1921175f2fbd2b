"""What the command line says, without importing Lightning or torch.

One-line errors from the parser's errors (the full config key, the allowed values, the closest valid key), the
lines and the resume command of an interrupted run, and the known-harmless messages every run is spared.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import re
import shlex
import warnings
from collections.abc import Sequence
from typing import Any

from lowrank_lit.registry import import_dotted

__all__ = ["ConfigError", "first_line", "KNOWN_NOISE", "quiet_known_noise", "closest", "one_line_error",
           "resume_command", "interrupted_message"]


class ConfigError(Exception):
    """A config value was accepted by the parser but rejected by the class it configures."""


def first_line(exc: BaseException) -> str:
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)


#: messages every run printed that say nothing about the run (matched at the start of the text)
KNOWN_NOISE = (
    "💡 Tip: For seamless",  # Lightning's advertisement for litlogger / litmodels
    "`weights_only` was not set",  # Lightning, at every checkpoint save; lowrank checkpoints hold full state
    r".*isinstance\(treespec, LeafSpec\)",  # Lightning's use of a deprecated torch pytree API
    # the run directory already holds config.yaml (and wandb/); metrics.csv of an earlier attempt is kept as
    # metrics.<n>.csv by the run directory before the CSV logger starts, so nothing is deleted
    "Experiment logs directory .* exists and is not empty",
    # Lightning's device summary on stderr at every Trainer: the run's start lines on stdout say what it runs on
    # (``devices: ...``), so a command refused at setup prints its one error line only
    "GPU available: ", "TPU available: ", "HPU available: ",
    # Lightning's lines around loading a resumed checkpoint: the run prints "resumed at step N" itself, and a checkpoint
    # refused while loading prints its one error line only
    "Restoring states from the checkpoint path at ", "Restored all states from the checkpoint at ",
)


class _DropKnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(re.match(pattern, text) for pattern in KNOWN_NOISE)


def quiet_known_noise() -> None:
    """Silence the messages in :data:`KNOWN_NOISE` (warnings and Lightning's log lines); idempotent."""
    for pattern in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _DropKnownNoise) for f in handler.filters):
                handler.addFilter(_DropKnownNoise())


#: the wording of jsonargparse's errors, the one library text read here: tests/test_messages.py pins each pattern
#: against the errors a real parser raises (at the lowest jsonargparse allowed, by .ci/floors, and at the newest)
_KEY_RE = re.compile(r'Parser key "([^"]+)"')
_CLASS_RE = re.compile(r"Problem with given class_path '([^']+)'")
_OPTION_RE = re.compile(r"Option '([^']+)' is not accepted")
_EXPECTED_RE = re.compile(r"Expected an? <class '([^']+)'>")
_GOT_RE = re.compile(r"(?:Given|Got) value: (.*)$")
_LITERAL_RE = re.compile(r"Expected an? typing\.Literal\[(.*?)\]")
_UNRECOGNIZED_RE = re.compile(r"unrecognized arguments: (\S+)", re.IGNORECASE)  # 4.47.0 writes "Unrecognized"
_NOT_ACCEPTED_RE = re.compile(r"(?:Group '([^']+)' )?does not accept option '([^']+)'")
_RESTRICTED_RE = re.compile(r"Not of type (\w+): (.+)$")
_NESTED_RE = re.compile(r"NestedArg\(key='[^']*', val='(.*)'\)")
#: what jsonargparse's restricted types allow, in words
_RESTRICTED = {"PositiveInt": "an integer > 0", "NonNegativeInt": "an integer >= 0", "PositiveFloat": "a number > 0",
               "NonNegativeFloat": "a number >= 0", "ClosedUnitInterval": "a number in [0, 1]",
               "OpenUnitInterval": "a number in (0, 1)"}
_IMPORT_FAIL_RE = re.compile(r"No module named|has no attribute|cannot import|Import path|not a (class|subclass)|does not exist")


def _option_names(parser: Any) -> list[str]:
    """Every ``--dotted.key`` a (sub)command parser accepts, from its defaults (jsonargparse's public API)."""
    try:
        keys = parser.get_defaults().keys()
    except Exception:  # a parser whose defaults cannot be built names no keys: no "did you mean" hint
        return []
    return [f"--{k}" for k in keys]


def closest(name: str, candidates: Sequence[str], cutoff: float = 0.6) -> str | None:
    """The candidate most similar to ``name`` (difflib ratio >= ``cutoff``), else None: for "did you mean" hints."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=cutoff)
    return match[0] if match else None


def _init_arg_names(class_path: str) -> list[str]:
    """Argument names of a class's ``__init__`` (empty when it cannot be imported)."""
    try:
        cls = import_dotted(class_path)
        return [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "args", "kwargs")]
    except Exception:  # noqa: BLE001 - only a hint
        return []


def one_line_error(exc: BaseException, parser: Any = None) -> str:
    """Condense a nested jsonargparse error into one line naming the full config key.

    ``Parser key "model": ... class_path 'X': Option 'bogus' is not accepted`` becomes
    ``unknown key 'model.init_args.bogus' (not an argument of X)`` plus the closest argument of X;
    ``unrecognized arguments: --trainer.max_epoch=3`` becomes ``unknown key 'trainer.max_epoch'; did you
    mean --trainer.max_epochs?`` (candidates from ``parser``, the subcommand's parser); a class_path that
    cannot be imported becomes ``cannot import 'x.y.Z': ...``; a type error becomes
    ``trainer.max_epochs: expected int, got 'abc'``. Anything else keeps its first line.
    """
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    if m := _NOT_ACCEPTED_RE.search(lines[0]):  # a key in a config file that no argument has
        name = f"{m.group(1)}.{m.group(2)}" if m.group(1) else m.group(2)
        match = closest(f"--{name}", _option_names(parser)) if parser is not None else None
        hint = f"; did you mean {match.lstrip('-')}?" if match else "; `--help` lists the keys"
        return f"unknown key {name!r} in a config file{hint}"
    if m := _UNRECOGNIZED_RE.search(lines[0]):
        name = m.group(1).split("=", 1)[0]
        match = closest(name, _option_names(parser)) if parser is not None else None
        return f"unknown key {name.lstrip('-')!r}" + (f"; did you mean {match}?" if match else "; `--help` lists the keys")
    if lines[0].startswith('Parser key "config"'):  # the problem on the next line, or after the colon
        return f"--config: {lines[1] if len(lines) > 1 else lines[0].split(':', 1)[1].strip()}"
    literal = next(((i, lit) for i, ln in enumerate(lines) if (lit := _LITERAL_RE.search(ln))), None)
    if literal is not None:  # a typed choice (in any branch of a union): the library checked it, we name the choices
        at, lit = literal
        parts = [m.group(1) for ln in lines[:at] if (m := _KEY_RE.search(ln))]
        choices = ", ".join(c.strip().strip("'\"") for c in lit.group(1).split(","))
        value = _GOT_RE.search(lines[at])
        return f"{'.init_args.'.join(parts)}{f'={value.group(1)!r}' if value else ''}; allowed: {choices}"
    key_parts: list[str] = []
    cls = None
    for i, ln in enumerate(lines):
        if m := _KEY_RE.search(ln):
            key_parts.append(m.group(1))
        if m := _CLASS_RE.search(ln):
            cls = m.group(1)
            detail = lines[i + 1] if i + 1 < len(lines) else ""
            if _IMPORT_FAIL_RE.search(detail) and not _KEY_RE.search(detail):
                where = ".init_args.".join(key_parts)
                return f"cannot import {cls!r} ({where}.class_path): {detail}"
        if m := _OPTION_RE.search(ln):
            key = ".init_args.".join([*key_parts, m.group(1)])
            owner = f" (not an argument of {cls})" if cls else ""
            match = closest(m.group(1), _init_arg_names(cls)) if cls else None
            hint = f"; did you mean --{key.rsplit('.', 1)[0]}.{match}?" if match else ""
            if key.startswith("trainer.callbacks.init_args.") and not match:
                hint = (f"; --trainer.callbacks.init_args.* sets the last callback given so far ({cls}): give the flag "
                        "before the --config that adds that callback")
            return f"unknown key {key!r}{owner}{hint}"
    if key_parts == ["seed_everything"] or (not key_parts and "seed_everything" in lines[0]):
        got = next((g.group(1) for ln in lines if (g := _GOT_RE.search(ln))), None)
        seed = f"={got!r}" if got is not None else ""
        return (f"--seed_everything{seed}: allowed: an integer seed, true (a random seed, saved in the run's config) "
                "or false (no seeding)")
    got = next((g.group(1) for ln in lines if (g := _GOT_RE.search(ln))), None)
    if got is not None and (nested := _NESTED_RE.fullmatch(got)):  # a value given to a class's argument
        got = nested.group(1)
    if key_parts and (m := next((r for ln in lines if (r := _RESTRICTED_RE.search(ln))), None)):  # PositiveInt, ...
        said = m.group(2)  # a type of ours (lowrank_lit.argtypes) says what it allows itself
        if got is None and (conform := re.match(r"(.+) does not conform to restriction", said)):
            got = conform.group(1)
        allowed = said.removeprefix("allowed: ") if said.startswith("allowed: ") else _RESTRICTED.get(
            m.group(1), f"{m.group(1)} ({said})")
        given = f"={got!r}" if got is not None else ""
        return f"{'.init_args.'.join(key_parts)}{given}; allowed: {allowed}"
    expected = [m for ln in lines if (m := _EXPECTED_RE.search(ln)) and m.group(1) != "NoneType"]
    if key_parts and expected:
        m = expected[0]
        got_text = f", got {got!r}" if got is not None else ""
        return f"{'.init_args.'.join(key_parts)}: expected {m.group(1)}{got_text}"
    return lines[0]


def resume_command(argv: Sequence[str], run_id: str) -> str:
    """The command that resumes a run: ``argv`` without ``--run_id``/``--ckpt_path``, plus both for this run."""
    keep: list[str] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
            continue
        if arg in ("--run_id", "--ckpt_path"):
            skip_next = True
            continue
        if arg.startswith(("--run_id=", "--ckpt_path=")):
            continue
        keep.append(arg)
    return shlex.join(["lowrank", *keep, "--run_id", run_id, "--ckpt_path", "last"])


def interrupted_message(argv: Sequence[str], run_dir: Any, exc: BaseException) -> str:
    """What an interrupted run prints: where it stopped, what was saved, and the exact resume command."""
    what = str(exc) if str(exc) and not str(exc).isdigit() else "interrupted"
    if run_dir is None:
        return f"lowrank {argv[0]}: {what}"
    ckpt = run_dir.path / "checkpoints" / "last.ckpt"
    lines = [f"lowrank {argv[0]}: {what}; run directory {run_dir.path}"]
    if ckpt.is_file():
        lines.append(f"  checkpoint: {ckpt}")
        lines.append(f"  resume with: {resume_command(argv, run_dir.run_id)}")
    else:
        lines.append("  no checkpoint was written (interrupted before the first training batch ended)")
    return "\n".join(lines)
