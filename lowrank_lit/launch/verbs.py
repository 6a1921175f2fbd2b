"""Typed verbs: a ``lowrank`` verb is a function whose signature and docstring are its command line.

:func:`call` builds a ``jsonargparse.ArgumentParser`` from the function (the one place that makes a parser for our
verbs; LightningCLI makes ``fit``'s), parses the words after the verb and calls the function with typed values. The
types check the values and write the error, as they do for ``fit``: ``Literal`` choices, ``PositiveInt``,
``Path_fr``, ``int | None``. The mapping from signature to command line:

* a parameter without a default is a positional argument; a list-typed one takes one or more words
  (``roots: list[str]``); ``*slugs: str`` takes any number;
* a keyword-only parameter is an option ``--name`` (spelled ``--name-with-dashes`` too); a ``bool`` is a flag
  (default False); a list-typed one takes one or more words and may be repeated (``--config a.yaml --config b.yaml``);
* the Args section of the docstring is the help of each argument, its first paragraph the verb's description;
* :data:`~lowrank_lit.argtypes.PassThrough`: the words the verb does not know (``--trainer.max_epochs=3``, or
  everything after ``--``), passed on to ``lowrank fit``; an unknown option without ``=`` takes the next word as its
  value;
* :data:`~lowrank_lit.argtypes.Typed`: the words after the verb, as given (for a "continue with" hint or a page's
  command line);
* ``**options`` with ``options_from`` (a callable of the first positional value, returning a function): that
  function's keyword arguments with defaults become options too (``lowrank summarize <slug>``: the summary's).
"""

from __future__ import annotations

import inspect
import re
import sys
import types
import typing
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lowrank_lit.argtypes import PassThrough, Typed
from lowrank_lit.launch.messages import one_line_error

__all__ = ["call", "parser_for", "options_of"]


#: the marks of the two argument types that are not values (``Annotated`` metadata)
_PassThrough, _Typed = typing.get_args(PassThrough)[1], typing.get_args(Typed)[1]

_LISTS = (list, tuple, Sequence, typing.Sequence)


def _marker(hint: Any) -> type | None:
    meta = getattr(hint, "__metadata__", ())
    return next((m for m in meta if m in (_PassThrough, _Typed)), None)


def _element(hint: Any) -> tuple[Any, bool]:
    """``(element type, True)`` for ``list[T]``, ``Sequence[T]``, ``tuple[T, ...]`` (optionally ``| None``);
    ``(hint, False)`` otherwise."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and _element(rest[0])[1]:
            return _element(rest[0])
    origin = typing.get_origin(hint)
    if origin in _LISTS or (isinstance(origin, type) and origin is not str and issubclass(origin, Sequence)):
        return (args[0] if args else str), True
    return hint, False


def _docs(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """The function's description (the docstring above its Args section) and the help of each argument."""
    import docstring_parser

    text = inspect.getdoc(fn) or ""
    doc = docstring_parser.parse(text)
    description = text.split("\nArgs:", 1)[0].strip()
    return description, {p.arg_name.lstrip("*"): (p.description or "").replace("\n", " ")
                                         for p in doc.params}


def _add(parser: Any, param: inspect.Parameter, hint: Any, help_text: str) -> Any:
    """Add one parameter as an argument; returns the action ``add_argument`` made."""
    element, is_list = _element(hint)
    empty = inspect.Parameter.empty
    if param.kind is inspect.Parameter.VAR_POSITIONAL:
        return parser.add_argument(param.name, type=hint, nargs="*", default=[], help=help_text)  # not "required"
    if param.kind is not inspect.Parameter.KEYWORD_ONLY:
        if param.default is empty:
            return parser.add_argument(param.name, type=element, nargs="+" if is_list else None, help=help_text)
        return parser.add_argument(param.name, type=hint, nargs="?", default=param.default, help=help_text)
    else:
        flags = [f"--{param.name}"] + ([f"--{param.name.replace('_', '-')}"] if "_" in param.name else [])
        if hint is bool:
            if param.default is not False:
                raise TypeError(f"{param.name}: a flag defaults to False (name it for what the flag turns on)")
            return parser.add_argument(*flags, dest=param.name, action="store_true", help=help_text)
        if is_list:  # repeatable; the default is filled in after parsing (argparse would extend it)
            return parser.add_argument(*flags, dest=param.name, type=element, nargs="+", action="extend",
                                       default=None, required=param.default is empty, help=help_text)
        return parser.add_argument(*flags, dest=param.name, type=hint, required=param.default is empty,
                                   default=None if param.default is empty else param.default, help=help_text)


@dataclass(frozen=True)
class _Option:
    """What the verbs need to know of one argument, kept when it is added (not read back from the parser)."""

    flags: tuple[str, ...]
    takes_value: bool

    @classmethod
    def of(cls, action: Any) -> _Option:
        return cls(tuple(action.option_strings), action.nargs != 0)


#: each verb parser's arguments by name, recorded by :func:`parser_for` as it adds them
_OPTIONS: weakref.WeakKeyDictionary[Any, dict[str, _Option]] = weakref.WeakKeyDictionary()


def options_of(parser: Any) -> dict[str, tuple[str, ...]]:
    """The arguments of a parser :func:`parser_for` made: name -> its option strings (empty for a positional)."""
    return {name: o.flags for name, o in _OPTIONS.get(parser, {}).items()}


def parser_for(fn: Callable[..., Any], prog: str, options_from: Callable[..., Any] | None = None) -> Any:
    """The verb's ``jsonargparse.ArgumentParser`` (``exit_on_error=False``: :func:`call` writes the error line).

    Args:
        fn: the verb.
        prog: ``"lowrank <verb>"``, the name in its usage and errors.
        options_from: a second function whose keyword arguments with defaults are options too (for ``**options``).
    """
    from jsonargparse import ArgumentParser

    description, helps = _docs(fn)
    parser = ArgumentParser(prog=prog, description=description, exit_on_error=False)
    options = _OPTIONS.setdefault(parser, {})
    hints = typing.get_type_hints(fn, include_extras=True)
    for param in inspect.signature(fn).parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD or _marker(hints.get(param.name)) is not None:
            continue
        options[param.name] = _Option.of(_add(parser, param, hints.get(param.name, str), helps.get(param.name, "")))
    if options_from is not None:
        extra_hints = typing.get_type_hints(options_from)
        extra_description, extra_helps = _docs(options_from)
        if extra_description:  # what this particular function does (a summary's first line)
            parser.description = f"{description}\n\n{extra_description.splitlines()[0]}"
        for param in inspect.signature(options_from).parameters.values():
            if param.default is inspect.Parameter.empty or param.kind is inspect.Parameter.VAR_KEYWORD \
                    or param.name in options:  # the verb's own arguments (a summary's ``roots`` and ``out``)
                continue
            hint = extra_hints.get(param.name, type(param.default) if param.default is not None else str)
            options[param.name] = _Option.of(_add(parser, param.replace(kind=inspect.Parameter.KEYWORD_ONLY), hint,
                                                  extra_helps.get(param.name, "") or f"default: {param.default}"))
    return parser


def _split(parser: Any, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(the verb's words, the rest)``: the rest is every option the parser does not know (with the next word as
    its value when it has no ``=``) and everything after ``--``."""
    known = {f for o in _OPTIONS.get(parser, {}).values() for f in o.flags} | {"-h", "--help"}
    own: list[str] = []
    rest: list[str] = []
    words = list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            rest += words[i + 1 :]
            break
        if word.startswith("-") and len(word) > 1 and word.split("=", 1)[0] not in known:
            rest.append(word)
            if "=" not in word and i + 1 < len(words) and not words[i + 1].startswith("-"):
                rest.append(words[i + 1])
                i += 1
        else:
            own.append(word)
        i += 1
    return own, rest


_NUMBER_RE = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf$", re.IGNORECASE)


def _join_negative_numbers(parser: Any, argv: list[str]) -> list[str]:
    """``--gpu-memory -8`` as ``--gpu-memory=-8``: argparse takes a word that starts with ``-`` for an option, so a
    negative value after a space would be "expected one argument" instead of the value's own one-line refusal."""
    takes_value = {f for o in _OPTIONS.get(parser, {}).values() if o.takes_value for f in o.flags}
    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word in takes_value and i + 1 < len(argv) and _NUMBER_RE.match(argv[i + 1]):
            out.append(f"{word}={argv[i + 1]}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


def call(fn: Callable[..., int], argv: Sequence[str], prog: str,
         options_from: Callable[[Any], Callable[..., Any]] | None = None) -> int:
    """Parse ``argv`` into ``fn``'s typed arguments and call it; returns its exit status.

    A value its type refuses is one line on stderr naming the argument and what is allowed (status 2); ``--help``
    prints the usage and every argument with its type and default (status 0).

    Args:
        fn: the verb; returns the exit status.
        argv: the words after the verb.
        prog: ``"lowrank <verb>"``.
        options_from: for a verb with ``**options``: called with the first positional word, returns the function whose
            keyword arguments become options; a ``KeyError`` or ``ValueError`` it raises is the error line.
    """
    from jsonargparse import ArgumentError

    argv = list(argv)
    more = None
    if options_from is not None and argv and not argv[0].startswith("-"):
        try:
            more = options_from(argv[0])
        except (KeyError, ValueError) as exc:
            print(f"{prog}: error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
            return 2
    parser = parser_for(fn, prog, more)
    argv = _join_negative_numbers(parser, argv)
    hints = typing.get_type_hints(fn, include_extras=True)
    markers = {name: m for name, h in hints.items() if (m := _marker(h)) is not None}
    own, rest = _split(parser, argv) if _PassThrough in markers.values() else (argv, [])
    if any(w in ("-h", "--help") for w in own):
        parser.print_help()
        return 0
    try:
        parsed = {k: _plain(v) for k, v in parser.parse_args(own).as_dict().items()}
    except ArgumentError as exc:
        print(f"{prog}: error: {_one_line(exc, parser)}", file=sys.stderr)
        return 2
    params = inspect.signature(fn).parameters
    positional: list[Any] = []
    keywords: dict[str, Any] = {}
    for name, param in params.items():
        if name in markers:
            keywords[name] = rest if markers[name] is _PassThrough else tuple(argv)
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            positional += list(parsed.pop(name, None) or [])
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            keywords.update(parsed)
        elif param.kind is inspect.Parameter.KEYWORD_ONLY:
            value = parsed.pop(name, None)
            keywords[name] = param.default if value is None and param.default is not inspect.Parameter.empty else value
        else:
            positional.append(parsed.pop(name, param.default))
    return fn(*positional, **keywords)


def _plain(value: Any) -> Any:
    """A restricted number type's value (``PositiveInt``, ``Seed``: subclasses of int and float) as a plain number, in
    lists too: what the verb gets is what it would get from Python (and what YAML and JSON can write)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _one_line(exc: BaseException, parser: Any) -> str:
    """jsonargparse's error in one line, with the option spelled as typed (``--n_trials=0; ...``)."""
    line = one_line_error(exc, parser)
    options = {name: flags[0] for name, flags in options_of(parser).items() if flags}
    head = line.split("=", 1)[0].split(":", 1)[0].split(";", 1)[0]
    return (options[head] + line[len(head):]) if head in options else line
