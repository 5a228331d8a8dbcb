"""Initialization options of ``codespec lsp``: typed, defaulted, checked.

Owns: :class:`Options` (a msgspec struct: what an editor may set in
``initializationOptions``, camelCase on the wire, snake_case here; both are
accepted) and :func:`parse_options`, which never raises: each bad or unknown
key yields one message for the user and that key keeps its default. Types,
ranges and choices are the struct's annotations, checked by
:func:`codespec.daemon.typed.convert`.
Must not touch: the daemon connection, documents, LSP handlers.

Example (VS Code settings and the Neovim plugin send the same map)::

    {"maxTokens": 48, "multiline": "never", "debounceMs": 50, "socket": "/tmp/cs.sock"}
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from codespec.daemon.typed import TypedError, convert

MULTILINE_MODES = ("auto", "always", "never")


class Options(msgspec.Struct, frozen=True, rename="camel", forbid_unknown_fields=True):
    """What the language server does; every field has a default that works."""

    # daemon socket; None: CODESPEC_SOCKET or the default path
    socket: Annotated[str, Meta(min_length=1)] | None = None
    autostart_daemon: bool = True  # start `codespec serve` (detached) when none answers
    serve_args: tuple[str, ...] = ()  # extra arguments for `codespec serve`, e.g. --model
    # how long to wait for a started daemon's socket
    start_timeout_s: Annotated[float, Meta(ge=1.0, le=3600.0)] = msgspec.field(
        default=120.0, name="startTimeout"
    )
    max_tokens: Annotated[int, Meta(ge=1, le=4096)] = 64  # per completion item
    max_lines: Annotated[int, Meta(ge=1, le=1000)] = 16  # of a multi-line item, after truncation
    # automatic completions (invoked alternatives add sampling)
    temperature: Annotated[float, Meta(ge=0.0, le=5.0)] = 0.0
    multiline: Literal["auto", "always", "never"] = "auto"  # by context | always | never
    invoked_items: Annotated[int, Meta(ge=1, le=10)] = 3  # alternatives when invoked explicitly
    debounce_ms: Annotated[int, Meta(ge=0, le=5000)] = 75  # per document, automatic requests
    # auto | off | a proposer's name (forwarded to the daemon)
    speculation: Annotated[str, Meta(min_length=1)] = "auto"
    # cap of one `codespec/edit` (None: the daemon's)
    edit_max_tokens: Annotated[int, Meta(ge=1, le=8192)] | None = None


_WIRE = {f.name: f.encode_name for f in msgspec.structs.fields(Options)}  # snake -> camel
_DEFAULTS = msgspec.structs.asdict(Options())


def _check(key: str, value: Any) -> tuple[Any, str | None]:
    """``(value, None)`` when ``key: value`` is a valid option, else ``(None, why)``. A
    whole-number float is taken for an integer (JSON from a JavaScript client does not
    tell them apart)."""
    why = None
    for candidate in (value, int(value)) if _whole_float(value) else (value,):
        try:
            convert({key: candidate}, Options)
            return candidate, None
        except TypedError as exc:
            why = why or exc.reason
    return None, why


def _whole_float(value: Any) -> bool:
    return isinstance(value, float) and value.is_integer()


def parse_options(raw: Any) -> tuple[Options, list[str]]:
    """Options from an ``initializationOptions`` value, plus one message per problem.

    ``None``, ``{}`` and ``[]`` give the defaults silently (an empty Lua table, as
    ``setup({})`` in Neovim sends it, encodes as ``[]``). Any other value that is not
    a map gives the defaults and one message; a bad key keeps its default.
    """
    if raw is None or raw == []:
        return Options(), []
    if not isinstance(raw, dict):
        return Options(), [
            f"codespec: initializationOptions must be an object, got {type(raw).__name__}; "
            "using the defaults"
        ]
    good: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in raw.items():
        wire = _WIRE.get(key, key)  # snake_case accepted too
        checked, why = _check(wire, value)
        if why == "unknown key":
            problems.append(f"codespec: unknown option {key!r} ignored")
        elif why is not None:
            name = next(n for n, w in _WIRE.items() if w == wire)
            problems.append(
                f"codespec: option {wire}={value!r}: {why}; using the default {_DEFAULTS[name]!r}"
            )
        else:
            good[wire] = checked
    return convert(good, Options), problems


def with_socket(options: Options, socket: str | None) -> Options:
    """``options`` with ``socket`` where they name none (``codespec lsp --socket``)."""
    if options.socket is None and socket is not None:
        return msgspec.structs.replace(options, socket=socket)
    return options


def to_wire(options: Options) -> dict[str, Any]:
    """The camelCase map an editor would send (what ``codespec/status`` reports)."""
    return {
        k: list(v) if isinstance(v, tuple) else v for k, v in msgspec.to_builtins(options).items()
    }
