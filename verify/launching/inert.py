"""Typed values as inert data: JSON, checked against the type on read.

What a rank or a node watchdog reads from a place another process can write (the job's
key-value store under torchrun) is data, never code: it is never unpickled. A value is
written as JSON (`dumps`) and read back as the type it must be (`loads`), every field checked
against the type's annotations: a frozen dataclass of numbers, strings, bools, `X | None`,
`tuple[X, ...]`, `dict[int | str, X]`, `bytes` (as base64) and other such dataclasses. Whatever
does not fit is `Malformed` (a ValueError naming the field), never a half-read value.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import json
import types
import typing
from typing import Any


class Malformed(ValueError):
    """Data that is not a value of the type asked for."""


def dumps(value: Any) -> bytes:
    """`value` (a dataclass, or the plain types above) as JSON."""
    return json.dumps(_plain(value), separators=(",", ":")).encode()


def loads(kind: Any, raw: bytes) -> Any:
    """The value of type `kind` that `raw` holds; Malformed where it holds none."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Malformed(f"not JSON: {exc}") from None
    return _read(kind, data, "value")


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _read(kind: Any, data: Any, where: str) -> Any:
    """`data` (parsed JSON) as a value of `kind`, checked; `where` names it in an error."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return data
    if kind is type(None):
        if data is not None:
            raise Malformed(f"{where}: expected null")
        return None
    if origin in (typing.Union, types.UnionType):
        for arm in args:
            try:
                return _read(arm, data, where)
            except Malformed:
                continue
        raise Malformed(f"{where}: {type(data).__name__} is none of {kind}")
    if dataclasses.is_dataclass(kind):
        return _record(kind, data, where)
    if origin is tuple or kind is tuple:
        if not isinstance(data, list) or (args and args[-1] is not Ellipsis):
            raise Malformed(f"{where}: expected a list")
        arm = args[0] if args else Any
        return tuple(_read(arm, v, f"{where}[{i}]") for i, v in enumerate(data))
    if origin is dict or kind is dict:
        if not isinstance(data, dict):
            raise Malformed(f"{where}: expected an object")
        key_kind, value_kind = args or (str, Any)
        return {_key(key_kind, k, where): _read(value_kind, v, f"{where}.{k}")
                for k, v in data.items()}  # fmt: skip
    return _scalar(kind, data, where)


def _record(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise Malformed(f"{where}: expected an object")
    hints, fields = _hints(cls), {f.name: f for f in dataclasses.fields(cls)}
    if set(data) - set(fields):
        raise Malformed(f"{where}: unknown fields {sorted(set(data) - set(fields))}")
    values = {}
    for name, f in fields.items():
        if name in data:
            values[name] = _read(hints[name], data[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise Malformed(f"{where}: missing {name}")
    return cls(**values)


def _key(kind: Any, key: str, where: str) -> Any:
    if kind is int:
        if not (key.isdigit() or (key[:1] == "-" and key[1:].isdigit())):
            raise Malformed(f"{where}: key {key!r} is not an integer")
        return int(key)
    return key


def _scalar(kind: Any, data: Any, where: str) -> Any:
    if kind is bytes:
        try:
            return base64.b64decode(data, validate=True)
        except (TypeError, binascii.Error):
            raise Malformed(f"{where}: expected base64") from None
    if kind is float and isinstance(data, int) and not isinstance(data, bool):
        return float(data)
    if kind is int and isinstance(data, bool):
        raise Malformed(f"{where}: expected int, got bool")
    if kind in (int, float, str, bool) and isinstance(data, kind):
        return data
    raise Malformed(
        f"{where}: expected {getattr(kind, '__name__', kind)}, got {type(data).__name__}"
    )
