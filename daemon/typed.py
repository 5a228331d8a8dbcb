"""Typed structs from plain maps: :func:`convert` over msgspec, with one-line errors.

Owns: turning a map read from TOML, JSON or msgpack into a ``msgspec.Struct``
(strictly: no string-to-number or number-to-bool coercion) and, when that
fails, a :class:`TypedError` that names the key (``limits.max_queue``,
``position.line``) and says why in one line. The config file
(:mod:`codespec.daemon.config`), the socket params
(:mod:`codespec.daemon.service.protocol`) and the language server's
initialization options (:mod:`codespec.lsp.options`) all go through here.
Must not touch: what any of those keys mean.
"""

from __future__ import annotations

import re
from types import UnionType
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import msgspec

T = TypeVar("T")

_AT = re.compile(r"^(?P<reason>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_FIELD = re.compile(r"^Object (?P<what>missing required|contains unknown) field `(?P<name>[^`]*)`$")


class TypedError(ValueError):
    """A value that does not fit its struct: ``key`` (dotted, '' for the whole map) and why."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}" if key else reason)
        self.key = key
        self.reason = reason


def convert(value: Any, type_: type[T]) -> T:
    """``value`` as a ``type_`` (a Struct), or :class:`TypedError`."""
    try:
        return msgspec.convert(value, type_, strict=True)
    except msgspec.ValidationError as exc:
        raise explain(exc, type_) from None


def explain(exc: msgspec.ValidationError, type_: Any = None) -> TypedError:
    """msgspec's "Expected `int`, got `str` - at `$.limits.max_queue`" as key and reason."""
    m = _AT.match(str(exc))
    assert m is not None  # the pattern matches any text
    reason, path = m["reason"], m["path"] or ""
    parts = [p for p in re.split(r"\.|\[[^\]]*\]", path) if p]
    field = _FIELD.match(reason)
    if field is not None:
        parts.append(field["name"])
        reason = "missing" if field["what"] == "missing required" else "unknown key"
    key = ".".join(parts)
    reason = reason[:1].lower() + reason[1:]
    choices = _choices(type_, parts) if reason.startswith("invalid enum value") else None
    if choices:
        reason = f"must be one of {', '.join(map(str, choices))}, got {reason.split(' ', 3)[3]}"
    return TypedError(key, reason)


def _choices(type_: Any, parts: list[str]) -> tuple[Any, ...] | None:
    """The values of the Literal at ``parts`` inside ``type_``, when that is one."""
    for name in parts:
        type_ = _unwrap(type_)
        if not (isinstance(type_, type) and issubclass(type_, msgspec.Struct)):
            return None
        fields = msgspec.structs.fields(type_)
        type_ = next((f.type for f in fields if f.encode_name == name), None)
    type_ = _unwrap(type_)
    return get_args(type_) if get_origin(type_) is Literal else None


def _unwrap(type_: Any) -> Any:
    """Past constraints (``Annotated``) and ``| None`` to the type underneath."""
    while True:
        origin = get_origin(type_)
        if origin is Annotated:
            type_ = get_args(type_)[0]
        elif origin in (Union, UnionType):
            rest = [t for t in get_args(type_) if t is not type(None)]
            if len(rest) != 1:
                return type_
            type_ = rest[0]
        else:
            return type_
