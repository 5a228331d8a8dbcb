"""The daemon's domain outcomes: the stable error codes of the socket API and the
exception that carries one.

A leaf every layer may import: prompts and documents raise :class:`ProtocolError` with
a code, the service turns it into an ``error`` frame. Knows nothing of frames, sockets
or the engine (the wire format is :mod:`codespec.daemon.service.protocol`'s).
"""

from __future__ import annotations

# Stable error codes (the contract; clients switch on these strings).
BAD_FRAME = "bad_frame"  # the frame itself is malformed (size, msgpack, envelope)
BAD_PARAMS = "bad_params"  # a parameter is missing, of the wrong type or out of range
UNKNOWN_METHOD = "unknown_method"
UNKNOWN_DOCUMENT = "unknown_document"  # the uri is not open (open it first)
STALE_VERSION = "stale_version"  # the version does not follow the daemon's; re-open
CANCELLED = "cancelled"  # cancelled by `cancel`, a newer request, disconnect or shutdown
OVERLOADED = "overloaded"  # the queue is full; retry later
INTERNAL = "internal"  # a bug; the message says what
BACKEND = "backend"  # the inference server (serve --backend vllm) is down, slow or wrong
ERROR_CODES = (
    BAD_FRAME,
    BAD_PARAMS,
    UNKNOWN_METHOD,
    UNKNOWN_DOCUMENT,
    STALE_VERSION,
    CANCELLED,
    OVERLOADED,
    INTERNAL,
    BACKEND,
)


class ProtocolError(Exception):
    """A domain outcome with a stable code; the server turns it into an ``error`` frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
