"""Clients of the socket API: a blocking :class:`Client` and an asyncio :class:`AsyncClient`.

Owns: connecting, request ids, matching responses and ``delta`` events to
their requests, turning ``error`` frames into :class:`DaemonError`, and stopping a
daemon (:func:`stop_daemon`: ``shutdown``, then waiting until its process is gone).
Must not touch: the daemon's state; the wire format lives in :mod:`.protocol`.

>>> with Client() as c:  # doctest: +SKIP
...     c.request("open", {"uri": "file:///a.py", "text": "def f(x):\\n    return "})
...     c.request("complete", {"uri": "file:///a.py", "position": {"line": 1, "character": 11}})
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from codespec.daemon.config import default_socket_path
from codespec.daemon.service.protocol import HEADER, MAX_FRAME_BYTES, pack, unpack_body

__all__ = ["AsyncClient", "Client", "DaemonError", "Pending", "default_socket_path", "stop_daemon"]

DeltaCallback = Callable[[dict], None]


class DaemonError(Exception):
    """An ``error`` reply (``code`` is one of the protocol's stable codes), or a lost
    connection (``code`` "disconnected") / no daemon (``code`` "unavailable")."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _result_of(frame: dict[str, Any]) -> dict:
    if "error" in frame:
        err = frame["error"] if isinstance(frame["error"], dict) else {}
        raise DaemonError(str(err.get("code", "internal")), str(err.get("message", "")))
    return frame.get("result") or {}


class Client:
    """A blocking client (scripts, the CLI). Not thread-safe: one request at a time."""

    def __init__(self, socket_path: str | None = None, timeout: float | None = 5.0) -> None:
        self.socket_path = socket_path or default_socket_path()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(self.socket_path)
        except OSError as exc:
            self.sock.close()
            raise DaemonError(
                "unavailable", f"no codespec daemon on {self.socket_path} ({exc.strerror or exc})"
            ) from None
        self.sock.settimeout(None)
        self._ids = itertools.count(1)
        self._stash: dict[int, dict] = {}

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, method: str, params: dict | None = None) -> int:
        rid = next(self._ids)
        self.sock.sendall(pack({"id": rid, "method": method, "params": params or {}}))
        return rid

    def read_frame(self) -> dict:
        header = self._recv(HEADER.size)
        (n,) = HEADER.unpack(header)
        if n > MAX_FRAME_BYTES:
            raise DaemonError("bad_frame", f"reply of {n} bytes exceeds the maximum")
        return unpack_body(self._recv(n))

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise DaemonError("disconnected", "the daemon closed the connection")
            buf += chunk
        return bytes(buf)

    def wait(self, rid: int, on_delta: DeltaCallback | None = None) -> dict:
        """The result of request ``rid`` (deltas to ``on_delta``); raises DaemonError."""
        while rid not in self._stash:
            frame = self.read_frame()
            fid = frame.get("id")
            if frame.get("event") == "delta":
                if fid == rid and on_delta is not None:
                    on_delta(frame)
                continue
            if isinstance(fid, int):
                self._stash[fid] = frame
            elif "error" in frame:  # an error about a frame without an id
                _result_of(frame)
        return _result_of(self._stash.pop(rid))

    def request(
        self, method: str, params: dict | None = None, on_delta: DeltaCallback | None = None
    ) -> dict:
        return self.wait(self.send(method, params), on_delta)


class Pending:
    """A request started with :meth:`AsyncClient.start`."""

    def __init__(self, client: AsyncClient, rid: int, fut: asyncio.Future) -> None:
        self.client = client
        self.id = rid
        self._fut = fut

    async def result(self) -> dict:
        return await asyncio.shield(self._fut)

    async def cancel(self) -> None:
        """Ask the daemon to stop it; ``result()`` then raises DaemonError("cancelled")."""
        if self._fut.done() or self.client.closed:
            return
        with contextlib.suppress(DaemonError):
            await self.client.request("cancel", {"id": self.id})


class AsyncClient:
    """An asyncio client: many requests in flight on one connection (the language server)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._futures: dict[int, asyncio.Future] = {}
        self._deltas: dict[int, DeltaCallback] = {}
        self.closed = False
        self._task = asyncio.ensure_future(self._read_loop())

    @classmethod
    async def connect(cls, socket_path: str | None = None, timeout: float = 5.0) -> AsyncClient:
        path = socket_path or default_socket_path()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(path, limit=2**16), timeout
            )
        except (TimeoutError, OSError) as exc:
            raise DaemonError("unavailable", f"no codespec daemon on {path} ({exc})") from None
        return cls(reader, writer)

    async def _read_loop(self) -> None:
        try:
            while True:
                (n,) = HEADER.unpack(await self._reader.readexactly(HEADER.size))
                if n > MAX_FRAME_BYTES:
                    break
                frame = unpack_body(await self._reader.readexactly(n))
                rid = frame.get("id")
                if frame.get("event") == "delta":
                    cb = self._deltas.get(rid) if isinstance(rid, int) else None
                    if cb is not None:
                        cb(frame)
                    continue
                fut = self._futures.pop(rid, None) if isinstance(rid, int) else None
                self._deltas.pop(rid, None)
                if fut is None or fut.done():
                    continue
                try:
                    fut.set_result(_result_of(frame))
                except DaemonError as exc:
                    fut.set_exception(exc)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, Exception):
            pass
        finally:
            self._lost()

    def _lost(self) -> None:
        self.closed = True
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(DaemonError("disconnected", "the daemon connection was lost"))
        self._futures.clear()
        self._deltas.clear()

    def start(
        self, method: str, params: dict | None = None, on_delta: DeltaCallback | None = None
    ) -> Pending:
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "unretrieved"
        if self.closed:
            fut.set_exception(DaemonError("disconnected", "the daemon connection was lost"))
            return Pending(self, rid, fut)
        self._futures[rid] = fut
        if on_delta is not None:
            self._deltas[rid] = on_delta
        self._writer.write(pack({"id": rid, "method": method, "params": params or {}}))
        return Pending(self, rid, fut)

    async def request(
        self, method: str, params: dict | None = None, on_delta: DeltaCallback | None = None
    ) -> dict:
        pending = self.start(method, params, on_delta)
        with contextlib.suppress(ConnectionError):
            await self._writer.drain()
        return await pending.result()

    async def close(self) -> None:
        if not self._writer.is_closing():
            self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        self._lost()


def stop_daemon(socket_path: str | None = None, timeout: float = 30.0) -> int | None:
    """Ask the daemon on ``socket_path`` to shut down and wait until its socket file and
    its process are gone: its pid, or None when no daemon answers there. A daemon that
    refuses or outlives ``timeout`` seconds is a :class:`DaemonError`."""
    path = socket_path or default_socket_path()
    try:
        client = Client(path)
    except DaemonError:
        return None
    with client:
        pid = client.request("stats").get("pid")
        if not isinstance(pid, int):
            raise DaemonError("internal", f"the daemon on {path} did not say its pid")
        client.request("shutdown")
    deadline = time.monotonic() + timeout
    while os.path.exists(path) or not _exited(pid):
        if time.monotonic() > deadline:
            raise DaemonError("unavailable", f"pid {pid} is still running after {timeout} s")
        time.sleep(0.05)
    return pid


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie its parent has not reaped)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # PermissionError: the pid went to another user
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
