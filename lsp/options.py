"""Initialization options of ``codespec lsp``: typed, defaulted, checked.

Owns: :class:`Options` (what an editor may set in ``initializationOptions``,
camelCase on the wire, snake_case here) and :func:`parse_options`, which never
raises: each bad or unknown key yields one message for the user and that key
keeps its default.
Must not touch: the daemon connection, documents, LSP handlers.

Example (VS Code settings and the Neovim plugin send the same map)::

    {"maxTokens": 48, "multiline": "never", "debounceMs": 50, "socket": "/tmp/cs.sock"}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

MULTILINE_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class Options:
    """What the language server does; every field has a default that works."""

    socket: str | None = None  # daemon socket; None: CODESPEC_SOCKET or the default path
    autostart_daemon: bool = True  # start `codespec serve` (detached) when none answers
    serve_args: tuple[str, ...] = ()  # extra arguments for `codespec serve`, e.g. --model
    start_timeout_s: float = 120.0  # how long to wait for a started daemon's socket
    max_tokens: int = 64  # per completion item
    max_lines: int = 16  # of a multi-line item, after block truncation
    temperature: float = 0.0  # automatic completions (invoked alternatives add sampling)
    multiline: str = "auto"  # auto (by context) | always | never
    invoked_items: int = 3  # alternatives when completion is invoked explicitly
    debounce_ms: int = 75  # per-document debounce of automatic requests
    speculation: str = "auto"  # auto | off | a proposer's name (forwarded to the daemon)
    edit_max_tokens: int | None = None  # cap of one `codespec/edit` (None: the daemon's)


@dataclass(frozen=True)
class _Field:
    name: str  # snake_case attribute
    key: str  # camelCase wire name
    kind: str  # "str?", "str", "bool", "int", "int?", "float", "choice", "strs"
    lo: float = 0.0
    hi: float = math.inf
    choices: tuple[str, ...] = field(default_factory=tuple)


_FIELDS = (
    _Field("socket", "socket", "str?"),
    _Field("autostart_daemon", "autostartDaemon", "bool"),
    _Field("serve_args", "serveArgs", "strs"),
    _Field("start_timeout_s", "startTimeout", "float", lo=1.0, hi=3600.0),
    _Field("max_tokens", "maxTokens", "int", lo=1, hi=4096),
    _Field("max_lines", "maxLines", "int", lo=1, hi=1000),
    _Field("temperature", "temperature", "float", lo=0.0, hi=5.0),
    _Field("multiline", "multiline", "choice", choices=MULTILINE_MODES),
    _Field("invoked_items", "invokedItems", "int", lo=1, hi=10),
    _Field("debounce_ms", "debounceMs", "int", lo=0, hi=5000),
    _Field("speculation", "speculation", "str"),
    _Field("edit_max_tokens", "editMaxTokens", "int?", lo=1, hi=8192),
)
assert {f.name for f in _FIELDS} == {f.name for f in fields(Options)}


def _check(spec: _Field, value: Any) -> tuple[Any, str | None]:
    """``(converted value, None)`` or ``(None, why it is bad)``."""
    if spec.kind == "str?":
        if value is None or (isinstance(value, str) and value):
            return value, None
        return None, "expected a non-empty string or null"
    if spec.kind == "str":
        return (value, None) if isinstance(value, str) and value else (None, "expected a string")
    if spec.kind == "bool":
        return (value, None) if isinstance(value, bool) else (None, "expected true or false")
    if spec.kind == "strs":
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value), None
        return None, "expected a list of strings"
    if spec.kind == "choice":
        if value in spec.choices:
            return value, None
        return None, f"expected one of {', '.join(spec.choices)}"
    if spec.kind == "int?" and value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, "expected a number"
    if spec.kind in ("int", "int?"):
        if isinstance(value, float) and not value.is_integer():
            return None, "expected a whole number"
        value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            return None, "expected a finite number"
    if not spec.lo <= value <= spec.hi:
        hi = "" if spec.hi == math.inf else f"{spec.hi:g}"
        return None, f"expected a number in [{spec.lo:g}, {hi}]"
    return value, None


def parse_options(raw: Any) -> tuple[Options, list[str]]:
    """Options from an ``initializationOptions`` value, plus one message per problem.

    ``None`` and ``{}`` give the defaults silently. A value that is not a map
    gives the defaults and one message; a bad key keeps its default.
    """
    if raw is None:
        return Options(), []
    if not isinstance(raw, dict):
        return Options(), [
            f"codespec: initializationOptions must be an object, got {type(raw).__name__}; "
            "using the defaults"
        ]
    by_key = {f.key: f for f in _FIELDS}
    by_key.update({f.name: f for f in _FIELDS})  # snake_case accepted too
    changes: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in raw.items():
        spec = by_key.get(key)
        if spec is None:
            problems.append(f"codespec: unknown option {key!r} ignored")
            continue
        converted, why = _check(spec, value)
        if why is not None:
            default = getattr(Options(), spec.name)
            problems.append(
                f"codespec: option {spec.key}={value!r}: {why}; using the default {default!r}"
            )
            continue
        changes[spec.name] = converted
    return replace(Options(), **changes), problems


def to_wire(options: Options) -> dict[str, Any]:
    """The camelCase map an editor would send (what ``codespec/status`` reports)."""
    out: dict[str, Any] = {}
    for spec in _FIELDS:
        value = getattr(options, spec.name)
        out[spec.key] = list(value) if isinstance(value, tuple) else value
    return out
