"""Types of init arguments that carry their own check, so a new argument gets the check by its annotation.

LightningCLI (jsonargparse) reads these from a class's signature:

* :class:`LearningRate` is a type registered with jsonargparse (``register_type``): the parser converts the value and
  refuses one <= 0 while it parses, so ``--model.init_args.lr=0`` is refused before anything is built. The value
  it gives the class is a plain ``float``, so a checkpoint's hyperparameters still load with ``weights_only=True``
  (jsonargparse's own ``PositiveFloat`` stores its class there, and such a load refuses it). An ``Annotated[float,
  Gt(0)]`` is not used because jsonargparse drops ``Annotated`` metadata from postponed annotations (``from
  __future__ import annotations``, which every module here has). For a type checker it is ``float``.
* :data:`InputPath` is ``Annotated[str, YOU_BRING]``: a file or folder the user brings. Its existence is checked when
  a run starts (:func:`lowrank_lit.launch.checks.check_values` finds the arguments by this mark in the class's
  signature), not while parsing, so ``--print_config`` of a config that reads your data still works where the data
  is not.

* :class:`Seed` (an integer in 0..2**32 - 1) and :class:`Fraction` (a number in (0, 1]) are registered the same way,
  for the numeric options of ``lowrank``'s own verbs as well as for init arguments.

* :data:`PassThrough` and :data:`Typed` are the two argument types of a ``lowrank`` verb (a typed function, see
  :mod:`lowrank_lit.launch.verbs`) that are not values: the words it hands on to ``lowrank fit``, and the words it was
  given. A verb's module needs only these types, not the parser that reads them.

Python callers that build a class directly keep the class's own check (``ValueError`` naming the argument).
"""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING, Annotated, Any

from jsonargparse.typing import register_type

__all__ = ["LearningRate", "Seed", "Fraction", "SEED_MAX", "InputPath", "YOU_BRING", "YouBring", "input_path_args",
           "PassThrough", "Typed"]


class YouBring:
    """The mark of an argument that names a file or folder the user brings (checked to exist before a run)."""

    def __repr__(self) -> str:
        return "a file or folder you bring"


YOU_BRING = YouBring()

if TYPE_CHECKING:
    LearningRate = float
else:

    class LearningRate(float):
        """A step size: a float > 0 (the parser gives the class a plain float)."""


def _learning_rate(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not number > 0:  # nan too
        raise ValueError("allowed: a number > 0 (a learning rate)")
    return number


register_type(LearningRate, serializer=float, deserializer=_learning_rate,
              type_check=lambda v, t: isinstance(v, int | float) and not isinstance(v, bool) and v > 0)
#: the largest seed (NumPy's and Lightning's seeds are unsigned 32-bit integers)
SEED_MAX = 2**32 - 1


def _register_number(cls: type, base: type, ok: Any, allowed: str) -> None:
    """Register ``cls`` (a subclass of ``int`` or ``float``) as a parser type that refuses a value failing ``ok`` with
    "allowed: ..." (the one-line errors name the argument and repeat this); the class receives a plain number."""

    def parse(value: Any) -> Any:
        number: Any = None
        if not isinstance(value, bool):
            try:
                number = base(value) if base is float or isinstance(value, int) else int(str(value), 10)
            except (TypeError, ValueError):
                number = None
        if number is None or number != number or not ok(number):
            raise ValueError(f"allowed: {allowed}")
        return number

    register_type(cls, serializer=base, deserializer=parse,
                  type_check=lambda v, t: isinstance(v, int | float) and not isinstance(v, bool) and ok(v))


if TYPE_CHECKING:
    Seed = int
    Fraction = float
else:
    class Seed(int):
        """A random seed: an integer in 0..2**32 - 1 (the parser gives a plain int)."""

    class Fraction(float):
        """A share of something kept: a number in (0, 1] (the parser gives a plain float)."""

_register_number(Seed, int, lambda v: 0 <= v <= SEED_MAX, f"an integer in 0..{SEED_MAX} (a seed)")
_register_number(Fraction, float, lambda v: 0 < v <= 1, "a number in (0, 1] (a fraction)")


#: a path to a file or folder the user brings
InputPath = Annotated[str, YOU_BRING]


def _marked(hint: Any) -> bool:
    """Whether a type (or any type inside it: ``list[InputPath] | None``) carries :data:`YOU_BRING`."""
    if typing.get_origin(hint) is Annotated and any(isinstance(m, YouBring) for m in hint.__metadata__):
        return True
    return any(_marked(a) for a in typing.get_args(hint))


def input_path_args(cls: type) -> list[str]:
    """The init arguments of ``cls`` annotated as :data:`InputPath` (alone, optional, or in a list or dict)."""
    try:
        hints = typing.get_type_hints(cls.__init__, include_extras=True)  # type: ignore[misc]
    except Exception:  # noqa: BLE001 - a class whose annotations do not resolve has none of ours
        return []
    return [name for name, hint in hints.items() if name != "return" and _marked(hint)]


class _PassThrough:
    """Marker: the flags a verb hands on to ``lowrank fit`` (see :data:`PassThrough`)."""


class _Typed:
    """Marker: the words after the verb, as given (see :data:`Typed`)."""


#: the words a verb does not parse itself, for ``lowrank fit`` (``--trainer.max_epochs=3``; everything after ``--``)
PassThrough = Annotated[list[str], _PassThrough]
#: the words after the verb exactly as given, for a command line to print
Typed = Annotated[tuple[str, ...], _Typed]
