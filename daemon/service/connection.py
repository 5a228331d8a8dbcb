"""One client's connection to the daemon: frames in, frames out, requests in flight.

Owns: reading frames off the socket (a frame over the maximum closes the
connection, any other bad frame is answered and the connection lives on),
dispatching each request to its method's handler, keeping the connection's
in-flight requests (a handler's awaitable runs as a task; ``cancel`` and a
disconnect cancel it, and its job, within one decode step), and turning a
handler's outcome into a ``result`` or an ``error`` frame with a stable code.

A handler's synchronous part runs when its frame is read, so frames on one
connection act in the order they were sent; only the wait for the model runs as
a task. Must not touch: what a method means (:mod:`.handlers`), the engine,
documents.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from codespec.daemon.service.protocol import (
    BAD_PARAMS,
    CANCELLED,
    HEADER,
    INTERNAL,
    MAX_FRAME_BYTES,
    OVERLOADED,
    UNKNOWN_METHOD,
    FrameTooLarge,
    ProtocolError,
    check_request,
    error_frame,
    pack,
    request_id,
    unpack_body,
)
from codespec.daemon.service.scheduler import Job, JobResult
from codespec.ngram_index.positions import PositionError

log = logging.getLogger("codespec.daemon")

MAX_INFLIGHT_PER_CONNECTION = 64
MAX_WRITE_BUFFER = 32 * 1024 * 1024  # a client that stops reading is dropped past this


class Waiting:
    """An awaitable request result: the scheduler's future, then ``done`` shapes it."""

    def __init__(self, job: Job, fut: asyncio.Future, done: Callable[[JobResult], dict]) -> None:
        self.job = job
        self.fut = fut
        self.done = done

    def __await__(self):
        result = yield from self.fut.__await__()
        return self.done(result)


@dataclass(eq=False)
class Connection:
    writer: asyncio.StreamWriter
    inflight: dict[int, tuple[asyncio.Task, Job | None]] = field(default_factory=dict)
    closed: bool = False
    # the documents this client opened and has not closed: closed when it leaves, unless
    # another connection holds them too (Server.release)
    documents: set[str] = field(default_factory=set)

    def send(self, obj: dict[str, Any]) -> None:
        if self.closed or self.writer.is_closing():
            return
        self.writer.write(pack(obj))
        transport = self.writer.transport
        if transport is not None and transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
            log.warning("dropping a client that does not read its replies")
            self.closed = True
            transport.abort()

    def cancel(self, rid: int) -> bool:
        """Stop request ``rid`` (its job within one decode step); False if none is in flight."""
        entry = self.inflight.pop(rid, None)
        if entry is None:
            return False
        task, job = entry
        if job is not None:
            job.cancel.set()
        task.cancel()
        return True

    def close(self) -> None:
        """Cancel everything in flight and close the socket."""
        self.closed = True
        for rid in list(self.inflight):
            self.cancel(rid)
        self.writer.close()


# (connection, request id, params) -> a result map, or an awaitable of one
Handler = Callable[[Connection, int, Mapping[str, Any]], Any]


async def serve_connection(
    reader: asyncio.StreamReader, conn: Connection, handlers: Mapping[str, Handler]
) -> None:
    """Read and dispatch frames until the client leaves; then cancel what it left running."""
    try:
        while not conn.closed:
            header = await reader.readexactly(HEADER.size)
            (length,) = HEADER.unpack(header)
            if length > MAX_FRAME_BYTES:
                exc = FrameTooLarge(length, MAX_FRAME_BYTES)
                conn.send(error_frame(None, exc.code, exc.message))
                await conn.writer.drain()
                return  # its payload is unread: the stream cannot be resynchronised
            body = await reader.readexactly(length)
            frame: dict[str, Any] = {}
            try:
                frame = unpack_body(body)
                rid, method, params = check_request(frame)
            except ProtocolError as exc:
                conn.send(error_frame(request_id(frame), exc.code, exc.message))
            else:
                dispatch(conn, rid, handlers.get(method), method, params)
            await conn.writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        conn.close()  # disconnect cancels


def dispatch(
    conn: Connection, rid: int, handler: Handler | None, method: str, params: dict[str, Any]
) -> None:
    """Run ``handler``'s synchronous part now; an awaitable result finishes as a task."""
    try:
        if handler is None:
            raise ProtocolError(UNKNOWN_METHOD, f"unknown method {method!r}")
        if rid in conn.inflight:
            raise ProtocolError(BAD_PARAMS, f"request id {rid} is already in flight")
        if len(conn.inflight) >= MAX_INFLIGHT_PER_CONNECTION:
            raise ProtocolError(OVERLOADED, "too many requests in flight on this connection")
        out = handler(conn, rid, params)
    except Exception as exc:
        conn.send(_error(rid, exc, method))
        return
    if isinstance(out, dict):
        conn.send({"id": rid, "result": out})
        return
    job = out.job if isinstance(out, Waiting) else None
    task = asyncio.ensure_future(_finish(conn, rid, out, method))
    conn.inflight[rid] = (task, job)


async def _finish(conn: Connection, rid: int, out: Awaitable[dict], method: str) -> None:
    try:
        result = await out
    except asyncio.CancelledError:
        return
    except Exception as exc:
        conn.send(_error(rid, exc, method))
    else:
        conn.send({"id": rid, "result": result})
    finally:
        entry = conn.inflight.get(rid)
        if entry is not None and entry[0] is asyncio.current_task():
            del conn.inflight[rid]
    with contextlib.suppress(ConnectionError):
        await conn.writer.drain()


def _error(rid: int, exc: Exception, method: str) -> dict[str, Any]:
    """The error frame for a handler's exception: a domain outcome's code, else ``internal``."""
    if isinstance(exc, ProtocolError):
        return error_frame(rid, exc.code, exc.message)
    if isinstance(exc, PositionError):  # a position outside the document is the client's
        return error_frame(rid, BAD_PARAMS, str(exc))
    log.exception("%s (request %s) failed", method, rid)
    return error_frame(rid, INTERNAL, f"{type(exc).__name__}: {exc}")


def cancelled_frame(rid: int) -> dict[str, Any]:
    return error_frame(rid, CANCELLED, "the request was cancelled")
