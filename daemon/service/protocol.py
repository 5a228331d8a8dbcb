"""The socket protocol: frames, error codes and parameter checking.

Owns: the wire format (a 4-byte big-endian length, then one msgpack map),
the maximum frame size, the stable error codes, and the typed accessors that
turn a request's ``params`` map into Python values or a ``bad_params`` error.

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

import math
import struct
from collections.abc import Mapping
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 8 * 1024 * 1024  # 8 MiB: a 300k-line file still fits in one `open`
HEADER = struct.Struct(">I")

# Stable error codes (the contract; clients switch on these strings).
BAD_FRAME = "bad_frame"  # the frame itself is malformed (size, msgpack, envelope)
BAD_PARAMS = "bad_params"  # a parameter is missing, of the wrong type or out of range
UNKNOWN_METHOD = "unknown_method"
UNKNOWN_DOCUMENT = "unknown_document"  # the uri is not open (open it first)
STALE_VERSION = "stale_version"  # the version does not follow the daemon's; re-open
CANCELLED = "cancelled"  # cancelled by `cancel`, a newer request, disconnect or shutdown
OVERLOADED = "overloaded"  # the queue is full; retry later
INTERNAL = "internal"  # a bug; the message says what
ERROR_CODES = (
    BAD_FRAME,
    BAD_PARAMS,
    UNKNOWN_METHOD,
    UNKNOWN_DOCUMENT,
    STALE_VERSION,
    CANCELLED,
    OVERLOADED,
    INTERNAL,
)


class ProtocolError(Exception):
    """A domain outcome with a stable code; the server turns it into an ``error`` frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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


class Params:
    """Typed, defaulted access to a request's params; every failure is ``bad_params``."""

    _MISSING = object()

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.raw = params

    def _get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key, self._MISSING)
        if value is self._MISSING or value is None:
            if default is self._MISSING:
                raise ProtocolError(BAD_PARAMS, f"missing parameter {key!r}")
            return default
        return value

    def str(self, key: str, default: Any = _MISSING, *, max_len: int | None = None) -> Any:
        value = self._get(key, default)
        if value is default and default is not self._MISSING:
            return value
        if not isinstance(value, str):
            raise ProtocolError(BAD_PARAMS, f"{key!r} must be a string")
        if max_len is not None and len(value) > max_len:
            raise ProtocolError(BAD_PARAMS, f"{key!r} is longer than {max_len} characters")
        return value

    def int(self, key: str, default: Any = _MISSING, *, lo: Any = None, hi: Any = None) -> Any:
        value = self._get(key, default)
        if value is default and default is not self._MISSING:
            return value
        if not _is_int(value):
            raise ProtocolError(BAD_PARAMS, f"{key!r} must be an integer")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ProtocolError(BAD_PARAMS, f"{key!r} must be in [{lo}, {hi}], got {value}")
        return value

    def float(self, key: str, default: Any = _MISSING, *, lo: float, hi: float) -> Any:
        value = self._get(key, default)
        if value is default and default is not self._MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(BAD_PARAMS, f"{key!r} must be a number")
        value = float(value)
        if not math.isfinite(value) or not lo <= value <= hi:
            raise ProtocolError(BAD_PARAMS, f"{key!r} must be in [{lo}, {hi}], got {value}")
        return value

    def bool(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ProtocolError(BAD_PARAMS, f"{key!r} must be true or false")
        return value

    def map(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is default and default is not self._MISSING:
            return value
        if not isinstance(value, dict):
            raise ProtocolError(BAD_PARAMS, f"{key!r} must be a map")
        return value

    def str_list(self, key: str, default: Any = _MISSING, *, max_items: int = 64) -> Any:
        value = self._get(key, default)
        if value is default and default is not self._MISSING:
            return value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ProtocolError(BAD_PARAMS, f"{key!r} must be a list of strings")
        if len(value) > max_items:
            raise ProtocolError(BAD_PARAMS, f"{key!r} has more than {max_items} items")
        return value

    def position(self, key: str) -> dict[str, int]:
        pos = self.map(key)
        for k in ("line", "character"):
            v = pos.get(k)
            if not _is_int(v) or v < 0:
                raise ProtocolError(BAD_PARAMS, f"{key}.{k} must be an integer >= 0")
        return {"line": pos["line"], "character": pos["character"]}

    def range(self, key: str) -> dict[str, dict[str, int]]:
        rng = Params(self.map(key))
        return {"start": rng.position("start"), "end": rng.position("end")}
