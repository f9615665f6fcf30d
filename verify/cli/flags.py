"""A command's flags, derived from its options dataclass (as torchtitan derives its CLI from
its config dataclasses): the flag, its type, its help line (with unit and default) and its
constraint all come from the field (`verify/options.py: knob`).

Flags are added with `default=argparse.SUPPRESS`: only what the user typed reaches the
options, every other knob keeps the dataclass's own default (written once), and `given(args)`
tells which flags were typed (to refuse conflicting ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

from verify.options import check_value, flag_of


def add_flags(parser: argparse.ArgumentParser, options_cls: type, skip: tuple[str, ...] = ()):
    """Add one flag per command-line field of `options_cls` (module docstring)."""
    hints = typing.get_type_hints(options_cls)
    for f in dataclasses.fields(options_cls):
        if not f.metadata.get("cli", True) or f.name in skip:
            continue
        kind, many = _kind(hints[f.name])
        help_text = describe(f, kind)
        if kind is bool:
            negate = f.metadata.get("negate")
            parser.add_argument(
                negate or flag_of(f),
                dest=f.name,
                action="store_false" if negate else "store_true",
                default=argparse.SUPPRESS,
                help=help_text,
            )
            if negate and f.metadata.get("affirm"):
                parser.add_argument(
                    flag_of(f),
                    dest=f.name,
                    action="store_true",
                    default=argparse.SUPPRESS,
                    help=f.metadata["affirm"],
                )
            continue
        repeat = f.metadata.get("repeat")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        parser.add_argument(
            flag_of(f),
            dest=f.name,
            required=required,
            type=_parser(f, kind, many and not repeat),
            action="append" if repeat else "store",
            default=argparse.SUPPRESS,
            help=help_text,
            metavar=_metavar(f, kind, many and not repeat),
        )


def options_from(args: argparse.Namespace, options_cls: type, **fixed: Any):
    """The options the user asked for: the typed flags, `fixed` values, defaults elsewhere."""
    names = {f.name for f in dataclasses.fields(options_cls)}
    typed = {k: v for k, v in vars(args).items() if k in names}
    for f in dataclasses.fields(options_cls):
        if f.metadata.get("repeat") and f.name in typed:
            typed[f.name] = tuple(typed[f.name])
    return options_cls(**{**typed, **fixed})


def given(args: argparse.Namespace) -> set[str]:
    """The options fields the user typed a flag for."""
    return {k for k in vars(args) if not k.startswith("_")}


def describe(f: dataclasses.Field, kind: type | None = None) -> str:
    """The help line: the field's own, its unit, and its default."""
    meta = f.metadata
    text = meta.get("help", "")
    extras = []
    if meta.get("unit"):
        extras.append(meta["unit"])
    default = _default(f)
    if meta.get("negate"):
        pass  # the help describes the negated flag itself
    elif kind is bool:
        extras.append("off by default" if not default else "on by default")
    elif default not in (None, "", ()):
        shown = ",".join(map(_fmt, default)) if isinstance(default, tuple) else _fmt(default)
        extras.append(f"default {shown}")
    if meta.get("choices") and kind is not bool:
        extras.append("one of " + ", ".join(map(str, meta["choices"])))
    return f"{text} ({'; '.join(extras)})" if extras else text


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _kind(hint: Any) -> tuple[type, bool]:
    """The scalar type a flag parses (a tuple's element type), and whether it is a tuple."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # `X | None`: parsed as X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
        origin = typing.get_origin(hint)
    if origin is tuple:
        return typing.get_args(hint)[0], True
    return hint, False


def _parser(f: dataclasses.Field, kind: type, many: bool) -> Callable[[str], Any]:
    name = flag_of(f)

    def one(text: str) -> Any:
        text = text.strip()
        if kind is int:
            try:
                value = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{name} must be an integer, got {text!r}"
                ) from None
        elif kind is float:
            try:
                value = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        else:
            value = text
        try:
            check_value(f, value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    if many:

        def many(text: str) -> tuple:
            values = tuple(one(t) for t in text.split(",") if t.strip())
            if not values:
                raise argparse.ArgumentTypeError(f"{name} needs at least one value")
            return values

        return many
    return one


def _metavar(f: dataclasses.Field, kind: type, many: bool) -> str:
    if f.metadata.get("choices"):
        return "{" + ",".join(map(str, f.metadata["choices"])) + "}"
    base = {int: "N", float: "X"}.get(kind, "TEXT")
    if f.metadata.get("unit") == "s":
        base = "SECONDS"
    elif f.metadata.get("unit") == "MB":
        base = "MB"
    if many:
        return f"{base},..."
    return base
