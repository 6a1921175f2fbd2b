"""``one_line_error`` against the errors jsonargparse itself raises (not hand-written texts).

``lowrank_lit.launch.messages.one_line_error`` reads the wording of jsonargparse's errors (its regular expressions are
the one place that does). Each case here makes a real parser raise a real error and pins the one line it becomes, so
a jsonargparse release that rewords a message fails here: ``.ci/floors`` runs this file at the lowest jsonargparse
``pyproject.toml`` allows, the test command at the newest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser
from jsonargparse.typing import PositiveInt

from lowrank_lit.argtypes import LearningRate
from lowrank_lit.launch.messages import one_line_error


class Block:
    """A base class, configured by ``class_path`` / ``init_args`` as LightningCLI configures a model."""


class Net(Block):
    def __init__(self, width: int = 4, act: Literal["relu", "tanh"] = "relu", lr: LearningRate = 0.1) -> None:
        self.width, self.act, self.lr = width, act, lr


NET = f"{__name__}.Net"


def _parser() -> ArgumentParser:
    """A parser shaped like LightningCLI's: a config file, plain typed options, a class group, a subclass argument."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_argument("--max_epochs", type=int, default=1)
    parser.add_argument("--devices", type=PositiveInt, default=1)
    parser.add_argument("--precision", type=Literal["32-true", "bf16-mixed"], default="32-true")
    parser.add_argument("--seed_everything", type=bool | int, default=True)
    parser.add_class_arguments(Net, "trainer")
    parser.add_subclass_arguments(Block, "model")
    return parser


CASES = {
    "unknown-flag": (["--max_epohcs=3"], "unknown key 'max_epohcs'; did you mean --max_epochs?"),
    "not-an-int": (["--max_epochs=abc"], "max_epochs: expected int, got 'abc'"),
    "restricted": (["--devices=0"], "devices='0'; allowed: an integer > 0"),
    "literal": (["--precision=16"], "precision='16'; allowed: 32-true, bf16-mixed"),
    "seed": (["--seed_everything=abc"], "--seed_everything='abc': allowed: an integer seed, true (a random seed, saved "
             "in the run's config) or false (no seeding)"),
    "unknown-init-arg": ([f"--model={NET}", "--model.init_args.widht=3"],
                         f"unknown key 'model.init_args.widht' (not an argument of {NET}); did you mean "
                         "--model.init_args.width?"),
    "cannot-import": (["--model=nowhere.Nothing"],
                      "cannot import 'nowhere.Nothing' (model.class_path): No module named 'nowhere'"),
    "literal-in-class": ([f"--model={NET}", "--model.init_args.act=gelu"],
                         "model.init_args.act='gelu'; allowed: relu, tanh"),
    "our-type-in-class": ([f"--model={NET}", "--model.init_args.lr=0"],
                          "model.init_args.lr='0'; allowed: a number > 0 (a learning rate)"),
    "missing-config": (["--config=does/not/exist.yaml"], "--config: File does not exist: '{cwd}/does/not/exist.yaml'"),
    "config-group-key": (["--config={tmp}/group.yaml"],
                         "unknown key 'trainer.widht' in a config file; did you mean trainer.width?"),
    "config-init-arg": (["--config={tmp}/init_args.yaml"],
                        f"unknown key 'model.init_args.widht' (not an argument of {NET}); did you mean "
                        "--model.init_args.width?"),
    "config-top-key": (["--config={tmp}/top.yaml"], "unknown key 'bogus'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_line_error_of_a_real_parser_error(case, tmp_path, monkeypatch):
    (tmp_path / "group.yaml").write_text("trainer:\n  widht: 3\n")
    (tmp_path / "init_args.yaml").write_text(f"model:\n  class_path: {NET}\n  init_args:\n    widht: 3\n")
    (tmp_path / "top.yaml").write_text("max_epochs: 2\nbogus: 1\n")
    argv, line = CASES[case]
    argv = [a.format(tmp=tmp_path) for a in argv]
    parser = _parser()
    with pytest.raises(ArgumentError) as info:
        parser.parse_args(argv)
    assert one_line_error(info.value, parser) == line.format(cwd=Path.cwd())
