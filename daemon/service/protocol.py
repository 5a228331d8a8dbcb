"""The socket protocol: frames, error codes and parameter checking.

Owns: the wire format (a 4-byte big-endian length, then one msgpack map),
the maximum frame size, the stable error codes, and one typed struct per
method's ``params`` (:func:`parse` turns the map into it, or into a
``bad_params`` error that names the parameter).

Must not touch: sockets' lifetimes, the engine, documents. The server and
both clients import from here, so the wire format lives in one place.

Frames
------
- request  ``{"id": int, "method": str, "params": {...}}``
- response ``{"id": int, "result": {...}}`` or
  ``{"id": int | None, "error": {"code": str, "message": str}}``
- stream   ``{"id": int, "event": "delta", "text": str, ...}`` before the
  response of a request made with ``"stream": true``.

A frame longer than :data:`MAX_FRAME_BYTES` is refused with ``bad_frame`` and
the connection is closed: its payload is not read, so the stream cannot be
resynchronised. Any other bad frame (empty, not msgpack, not a map, no
integer ``id``, no string ``method``) gets ``bad_frame`` and the connection
lives on, because its length told us where the next frame starts.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

import msgpack
import msgspec
from msgspec import Meta

from codespec.daemon.errors import (  # noqa: F401 (the codes are the contract clients read here)
    BACKEND,
    BAD_FRAME,
    BAD_PARAMS,
    CANCELLED,
    ERROR_CODES,
    INTERNAL,
    OVERLOADED,
    STALE_VERSION,
    UNKNOWN_DOCUMENT,
    UNKNOWN_METHOD,
    ProtocolError,
)
from codespec.daemon.typed import TypedError, convert

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 8 * 1024 * 1024  # 8 MiB: a 300k-line file still fits in one `open`
HEADER = struct.Struct(">I")


class FrameTooLarge(ProtocolError):
    """The announced length exceeds the maximum: answer, then close the connection."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(BAD_FRAME, f"frame of {length} bytes exceeds the maximum of {limit}")


def pack(obj: Mapping[str, Any]) -> bytes:
    """One frame: length header + msgpack body."""
    body = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def unpack_body(body: bytes) -> dict[str, Any]:
    """Decode a frame body into a map, or raise ``bad_frame``."""
    if not body:
        raise ProtocolError(BAD_FRAME, "empty frame")
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # ExtraData, FormatError, StackError, UnicodeDecodeError, ...
        raise ProtocolError(BAD_FRAME, f"not one msgpack object: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(BAD_FRAME, f"a frame must be a map, got {type(obj).__name__}")
    return obj


def request_id(frame: Mapping[str, Any]) -> int | None:
    """The frame's id when it is an integer (what an error reply may echo), else None."""
    rid = frame.get("id")
    return rid if _is_int(rid) else None


def check_request(frame: Mapping[str, Any]) -> tuple[int, str, dict[str, Any]]:
    """``(id, method, params)`` of a request frame, or ``bad_frame``."""
    rid = frame.get("id")
    if not _is_int(rid):
        raise ProtocolError(BAD_FRAME, "a request needs an integer 'id'")
    method = frame.get("method")
    if not isinstance(method, str):
        raise ProtocolError(BAD_FRAME, "a request needs a string 'method'")
    params = frame.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ProtocolError(BAD_PARAMS, "'params' must be a map")
    return rid, method, params


def error_frame(rid: int | None, code: str, message: str) -> dict[str, Any]:
    return {"id": rid, "error": {"code": code, "message": message[:2000]}}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**64


# -- params: one struct per method ------------------------------------------------------
# Unknown keys are ignored (a newer client may send more); a None value counts as absent.

Uri = Annotated[str, Meta(max_length=4096)]
Version = Annotated[int, Meta(ge=-(2**31), le=2**63 - 1)]
Count = Annotated[int, Meta(ge=0)]


class _Params(msgspec.Struct, kw_only=True):
    pass


class Position(_Params):
    line: Count
    character: Count

    def as_dict(self) -> dict[str, int]:
        return {"line": self.line, "character": self.character}


class Range(_Params):
    start: Position
    end: Position


class Hello(_Params):
    client: Annotated[str, Meta(max_length=256)] = ""
    protocol: Annotated[int, Meta(ge=0, le=2**31)] = PROTOCOL_VERSION


class Open(_Params):
    uri: Uri
    text: str
    version: Version | None = None
    language: Annotated[str, Meta(max_length=64)] = ""


class Change(_Params):
    uri: Uri
    version: Version
    changes: list[dict[str, Any]]  # LSP content changes, checked by the document store


class Close(_Params):
    uri: Uri


class Sampling(_Params):
    """What every model request may set; ``max_tokens``' ceiling is the config's."""

    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=10.0)] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: Annotated[list[Annotated[str, Meta(max_length=256)]], Meta(max_length=16)] = []
    stream: bool = False
    speculation: Annotated[str, Meta(max_length=64)] | None = None  # None: the config's


class Complete(Sampling, kw_only=True):
    uri: Uri
    position: Position
    version: Version | None = None
    multiline: bool = False


class Edit(Sampling, kw_only=True):
    uri: Uri
    range: Range
    version: Version | None = None
    instruction: Annotated[str, Meta(max_length=4000)] = ""
    prediction: str | None = None
    mode: Annotated[str, Meta(max_length=16)] = "auto"


class Generate(Sampling, kw_only=True):
    prompt: str | None = None
    prompt_ids: list[Count] | None = None


class Cancel(_Params):
    id: int


class WorkspaceFolders(_Params):
    folders: Annotated[list[str], Meta(max_length=64)] = []
    remove: Annotated[list[str], Meta(max_length=64)] = []


class Empty(_Params):
    pass


P = TypeVar("P", bound=_Params)


def parse(params: Mapping[str, Any], kind: type[P]) -> P:
    """A request's ``params`` as ``kind``, or ``bad_params`` naming the parameter."""
    present = {k: v for k, v in params.items() if v is not None}
    try:
        return convert(present, kind)
    except TypedError as exc:
        reason = exc.reason.replace(" | null", "")  # null is taken for absent here
        why = f"{exc.key!r}: {reason}" if exc.key else reason
        raise ProtocolError(BAD_PARAMS, why) from None
