"""Config files as YAML, read without Lightning or torch.

Strict loading (one line naming the argument, the file and the line for each problem), the one merge of config
layers (``--config`` stacks, the sweep's check, the matrix's cells), a config's ``run:`` block (:class:`RunSpec`, read
by the CLI; :class:`ConfigHeader`, read from the file by ``lowrank list`` and the tests), the ``--config`` files of a
command line and the experiment name they give.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from lowrank_lit.launch.messages import first_line

__all__ = ["FIT_KEYS_FILE", "fit_keys", "LIGHTNING_COMMANDS", "NEEDS", "RunSpec", "ConfigHeader", "config_header",
           "wrong_command", "yaml_syntax_error", "YamlFileError", "load_yaml", "merge_config_layers",
           "appends_applied", "config_file_error", "config_files", "experiment_from_configs"]


#: the subcommands LightningCLI provides (a config's ``run.verb`` is one of them)
Verb = Literal["fit", "validate", "test", "predict"]
LIGHTNING_COMMANDS: tuple[str, ...] = get_args(Verb)


#: what a user may need beyond this checkout (a config's ``run.needs``)
Need = Literal["gpu", "your_files"]
NEEDS: tuple[str, ...] = get_args(Need)


@dataclass
class RunSpec:
    """How a config is run: its ``run:`` block, which the CLI parses like ``experiment`` and ``run_root``, and which
    ``lowrank fit`` (is this a training config?), its hints (what must run first), ``lowrank list`` and the tests read.

    Args:
        verb: the ``lowrank`` command that runs the config: ``fit`` trains; ``test`` evaluates (a test-time method, a
            bound, a quantized model); ``predict``; ``validate``.
        first: the command that makes what the config starts from (a source model, a pretrained encoder), e.g.
            ``lowrank fit --config configs/tta/source_bn_cnn_digits.yaml``; None: nothing.
        needs: what a user must have beyond this checkout: ``gpu``, ``your_files`` (data, weights or checkpoints you
            bring; CI rehearses such a config with fixtures).
        tested_by: the test that runs the config end to end when it cannot run as it is (it needs a checkpoint that
            test makes, or your files): ``tests/<file>.py`` or ``tests/rehearsal/test_rehearsal.py::test_x``; None:
            CI runs it as it is.
        args: what the command needs beyond ``--config`` (where your files are, a checkpoint), as you would type
            it, e.g. ``[--data.init_args.data_dir=/data/cifar10]``; ``lowrank list <slug>`` prints the whole command
            and the rehearsal replaces each path with a fixture's.
    """

    verb: Verb = "fit"
    first: str | None = None
    needs: list[Need] = field(default_factory=list)
    tested_by: str | None = None
    args: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ConfigHeader:
    """What a config's ``run:`` block (and its trainer's accelerator) says about running it.

    Attributes:
        command: ``run.verb`` (``fit``, ``test``, ...), or None when the file declares none (a fragment).
        first: ``run.first``, the command that makes what it starts from, or None.
        your_data: it reads files you bring (``your_files`` in ``run.needs``).
        gpu: it asks for a GPU (``gpu`` in ``run.needs``, or ``trainer.accelerator`` gpu / cuda).
        tested_by: ``run.tested_by``, the test that runs it end to end when it cannot run as it is, or None.
        args: ``run.args``, what its command needs beyond ``--config``.
    """

    command: str | None
    first: str | None
    your_data: bool
    gpu: bool
    tested_by: str | None = None
    args: tuple[str, ...] = ()

    def command_line(self, path: str | Path) -> list[str]:
        """The command that runs the config at ``path``, after ``lowrank``: ``[verb, --config, path, *args]``."""
        return [self.command or "fit", "--config", str(path), *self.args]

    def needs(self) -> str:
        """``"GPU, your files"``, ``"your files"``, ... or ``"-"``."""
        return ", ".join([*(["GPU"] if self.gpu else []), *(["your files"] if self.your_data else [])]) or "-"


def _top_level_block(text: str, key: str) -> str:
    """The lines of the top-level mapping ``key:`` of a YAML text (its key line and the indented lines after it)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith(f"{key}:")), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if lines[i][:1] not in ("", " ", "#")), len(lines))
    return "\n".join(lines[start:end])


def config_header(path: str | Path) -> ConfigHeader:
    """Read :class:`ConfigHeader` from a config file's ``run:`` block and ``trainer.accelerator`` (only those two
    blocks are parsed, with PyYAML: ``lowrank list`` reads every config; no torch, no Lightning)."""
    import yaml

    text = Path(path).read_text()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    run = (yaml.load(_top_level_block(text, "run"), Loader=loader) or {}).get("run") or {}
    trainer = (yaml.load(_top_level_block(text, "trainer"), Loader=loader) or {}).get("trainer") or {}
    needs = run.get("needs") or []
    gpu = "gpu" in needs or str(trainer.get("accelerator")) in ("gpu", "cuda")
    return ConfigHeader(run.get("verb"), run.get("first"), "your_files" in needs, gpu, run.get("tested_by"),
                        tuple(run.get("args") or ()))


def wrong_command(command: str, files: Sequence[str]) -> str | None:
    """The one-line error for ``lowrank fit`` on a config that evaluates (its ``run.verb`` is ``test`` or
    ``predict``: a test-time method, a detector, a bound), else None. ``validate``/``test``/``predict`` on a training
    config are fine (they evaluate its checkpoint)."""
    for f in files:
        try:
            header = config_header(f)
        except OSError:
            continue
        if header.command is None:
            continue
        if command == "fit" and header.command in ("test", "predict"):
            what = "evaluates" if header.command == "test" else "predicts"
            return f"{f} {what} (it does not train); run: lowrank {header.command} --config {f}"
        return None
    return None


def yaml_syntax_error(path: str | os.PathLike, exc: Exception) -> str:
    """``"<path>: line L, column C: YAML syntax error: <problem>"`` for a YAML parse error of the file ``path``."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or first_line(exc)
    return f"{os.fspath(path)}:{where}: YAML syntax error: {problem}"


class YamlFileError(ValueError):
    """A YAML file a command reads that cannot be used as it is; the message is one line naming the file (and line)."""


@functools.cache
def _strict_loader() -> type:
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the later one without a word)."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class StrictLoader(base):  # type: ignore[misc, valid-type]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                self.flatten_mapping(node)
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.get(key)
                    except TypeError:  # an unhashable key: PyYAML's own error follows
                        continue
                    line = key_node.start_mark.line + 1
                    if first is not None:
                        raise YamlFileError(f"line {line}: key {key!r} is given twice in one mapping (first at line "
                                            f"{first}); YAML would keep only the later value: remove one")
                    seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def load_yaml(path: str | os.PathLike, what: str, mapping: bool = True) -> Any:
    """Read a YAML file a command was given: one line naming ``what`` (the argument, e.g. ``--config``) and the file
    for a missing file, a folder, a syntax error (line and column), a key given twice in one mapping (both lines), and,
    with ``mapping``, an empty file or one that holds a list or a scalar instead of a mapping.

    Raises:
        YamlFileError: the one line.
    """
    import yaml

    p = Path(path)
    name = os.fspath(path)
    if p.is_dir():
        example = next(iter(sorted(p.glob("*.yaml"))), None)
        hint = f", e.g. {what} {example}" if example else ""
        raise YamlFileError(f"{what}: {name!r} is a folder; allowed: a YAML file{hint}")
    if not p.is_file():
        raise YamlFileError(f"{what}: file {name!r} does not exist")
    try:
        data = yaml.load(p.read_text(), Loader=_strict_loader())  # noqa: S506 - a safe loader
    except YamlFileError as exc:
        raise YamlFileError(f"{what}: {name}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        raise YamlFileError(f"{what}: {yaml_syntax_error(name, exc)}") from None
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as exc:
        raise YamlFileError(f"{what}: {name}: not a readable YAML file ({first_line(exc)})") from None
    if mapping and data is None:
        raise YamlFileError(f"{what}: {name} is empty; allowed: a YAML mapping of keys (e.g. trainer:, model:, data:)")
    if mapping and not isinstance(data, dict):
        kind = "list" if isinstance(data, list) else f"{type(data).__name__} ({str(data)[:40]!r})"
        raise YamlFileError(f"{what}: {name}: line 1: the file holds a YAML {kind}; allowed: a mapping of keys "
                            "(e.g. trainer:, model:, data:)")
    return data


def merge_config_layers(layers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Compose config layers in order, by the rule ``lowrank`` applies to a ``--config`` stack; the one merge of
    ``--config`` files (the sweep's check), grid fragments (``lowrank matrix``) and anything else that layers configs.

    A later scalar or list replaces an earlier one; mappings merge key by key; ``key+: [a, b]`` (or ``key+: a``)
    appends to ``key`` when an earlier layer set it, and otherwise stays ``key+`` (concatenated with an earlier
    ``key+``) so that the parser appends it to what it holds when the merged layer is given to it; a later plain
    ``key`` drops an earlier ``key+``. The layers are not changed.
    """
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(key, str) and key.endswith("+"):
                items = list(value) if isinstance(value, list) else [value]
                plain = key[:-1]
                if plain in out:
                    old = out[plain]
                    out[plain] = [*(old if isinstance(old, list) else [] if old is None else [old]), *items]
                else:
                    out[key] = [*out.get(key, []), *items]
            elif isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge_config_layers([out[key], value])
            else:
                out[key] = merge_config_layers([value]) if isinstance(value, dict) else value
                out.pop(f"{key}+", None)
    return out


def appends_applied(config: dict[str, Any]) -> dict[str, Any]:
    """A merged config as the parser holds it once every remaining ``key+`` is appended to the parser's default (an
    empty list): ``key+`` becomes ``key``. For checks of key names against what a stack of configs sets."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = key[:-1] if isinstance(key, str) and key.endswith("+") else key
        out[name] = appends_applied(value) if isinstance(value, dict) else value
    return out


def config_file_error(files: Sequence[str]) -> str | None:
    """One line for the first ``--config`` that is not a readable YAML mapping (missing, a folder, a syntax error with
    its file, line and column, a duplicated key, empty, a list), else None. Reads the files as text only: no
    Lightning, no torch."""
    for f in files:
        try:
            load_yaml(f, "--config")
        except YamlFileError as exc:
            return str(exc)
    return None


def config_files(argv: Sequence[str]) -> list[str]:
    """The values of ``--config``/``-c`` in a command line (both ``--config x`` and ``--config=x``)."""
    files = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def experiment_from_configs(config_paths: Sequence[Any] | None) -> str:
    """Experiment name from the ``--config`` files: ``configs/baseline/mlp_digits.yaml`` -> ``baseline/mlp_digits``.

    The first file under a ``configs/`` folder that is not a ``base/`` or ``debug/`` fragment wins;
    otherwise the stem of the first file; with no file at all, ``default``.
    """
    paths = [Path(str(getattr(p, "relative", p))) for p in (config_paths or [])]
    for p in paths:
        parts = p.with_suffix("").parts
        if "configs" in parts:
            rel = parts[len(parts) - 1 - parts[::-1].index("configs") + 1 :]
            if rel and rel[0] not in ("base", "debug"):
                return "/".join(rel)
    return paths[0].stem if paths else "default"


#: the top-level keys of ``lowrank fit``, as its parser has them, for the checks that run without Lightning (a
#: sweep's keys): written by ``python -m lowrank_lit.launch.lightning_cli`` from the real parser (a unit test fails
#: while it is stale)
FIT_KEYS_FILE = Path(__file__).resolve().parent / "fit_keys.json"


@functools.cache
def fit_keys() -> tuple[str, ...]:
    """The top-level keys of ``lowrank fit`` (``trainer``, ``model``, ``experiment``, ...), read from
    :data:`FIT_KEYS_FILE` without importing Lightning."""
    return tuple(json.loads(FIT_KEYS_FILE.read_text()))
