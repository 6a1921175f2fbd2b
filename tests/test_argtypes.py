"""Argument types that carry their check: learning rates refused by the parser, files you bring found by their type."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import typing

import pytest
from jsonargparse import ArgumentParser

import lowrank_lit
from lowrank_lit.argtypes import InputPath, LearningRate, input_path_args
from lowrank_lit.launch.messages import one_line_error


class _Step:
    def __init__(self, lr: LearningRate = 1e-3, head_lr: LearningRate | None = None, data: InputPath | None = None,
                 many: list[InputPath] | None = None, named: dict[str, InputPath] | None = None, other: str = "x") -> None:
        self.lr = lr


def _parser() -> ArgumentParser:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(_Step, "step")
    return parser


def test_a_learning_rate_is_parsed_to_a_plain_float():
    cfg = _parser().parse_args(["--step.lr=0.5", "--step.head_lr=2"])
    # a plain float, not a subclass: a checkpoint's hyperparameters load with weights_only=True
    assert type(cfg.step.lr) is float and cfg.step.lr == 0.5
    assert type(cfg.step.head_lr) is float and cfg.step.head_lr == 2.0
    assert _parser().parse_args([]).step.lr == 1e-3


@pytest.mark.parametrize("value", ["0", "-1e-3", "abc", "nan", "true"])
def test_a_learning_rate_not_above_zero_is_refused_in_one_line(value):
    with pytest.raises(Exception) as info:  # noqa: PT011 - jsonargparse's ArgumentError
        _parser().parse_args([f"--step.lr={value}"])
    # a class's own argument (not inside a union) reaches us without its value; the CLI's cases name it (test_bad_inputs)
    assert one_line_error(info.value) == "step.lr; allowed: a number > 0 (a learning rate)"


def test_an_optional_learning_rate_names_its_value_and_what_is_allowed():
    with pytest.raises(Exception) as info:  # noqa: PT011
        _parser().parse_args(["--step.head_lr=-1"])
    assert one_line_error(info.value) == "step.head_lr='-1'; allowed: a number > 0 (a learning rate)"


def test_input_paths_are_found_by_their_type_alone_optional_or_inside_a_container():
    assert input_path_args(_Step) == ["data", "many", "named"]


def _classes(package: str = "lowrank_lit") -> list[type]:
    """Every class defined in the package whose __init__ is its own."""
    found = []
    for info in pkgutil.walk_packages(lowrank_lit.__path__, package + "."):
        if ".launch" in info.name or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and "__init__" in vars(cls):
                found.append(cls)
    return found


#: init arguments whose names say they are a step size, or a file or folder a user brings
_LR_NAME = re.compile(r"^(lr|lr_[a-z]+|[a-z]+_lr)$")
_PATH_NAME = re.compile(r"^(train_path|val_path|test_path|pool_path|jsonl|train_csv|val_csv|test_csvs|data_dir)$")


def test_every_learning_rate_and_data_path_argument_is_typed():
    """A new argument gets its check by its type: a learning rate typed float, or a data module's path typed str, fails
    here (the parser would not check the first, and a run would not check the second before it starts)."""
    untyped = []
    for cls in _classes():
        try:
            hints = typing.get_type_hints(cls.__init__, include_extras=True)
        except Exception:  # noqa: BLE001, S112 - annotations naming TYPE_CHECKING-only types: not an init we parse
            continue
        for name, hint in hints.items():
            text = repr(hint)
            if _LR_NAME.match(name) and "float" in text and "LearningRate" not in text and "Tensor" not in text:
                untyped.append(f"{cls.__module__}.{cls.__qualname__}({name}: {text})")
            if (_PATH_NAME.match(name) and cls.__module__.startswith("lowrank_lit.data.")
                    and name not in input_path_args(cls)):
                untyped.append(f"{cls.__module__}.{cls.__qualname__}({name}: {text})")
    assert not untyped, "type these as lowrank_lit.argtypes.LearningRate / InputPath:\n" + "\n".join(untyped)
