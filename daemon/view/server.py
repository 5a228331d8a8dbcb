"""The live page's HTTP server: aiohttp on the daemon's event loop, 127.0.0.1 only.

Owns: binding the page (a random port, a random token as the first path segment; any
other path is 403), serving it and its vendored assets, the server-sent events that
carry new records and the daemon's status, and closing it all (nothing left listening).
Must not touch: the scheduler's queue or the engine; the data is the recorder's
(:mod:`.recorder`) turned into JSON by :mod:`.snapshot`.

Routes under ``/<token>/``: the page, ``static/<asset>``, ``events`` (SSE: one message
with every record kept, then one per new record and a status every ``STATUS_S``), and
``data.json`` (the same as one document).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import secrets
from typing import Any

from aiohttp import web

from codespec.daemon.service.daemon import Server
from codespec.daemon.view import page
from codespec.daemon.view.recorder import Record, Recorder
from codespec.daemon.view.snapshot import record_json, status_json

STATUS_S = 2.0  # a status message at least this often while a page listens
CONTENT_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}


class ViewServer:
    """The page of one daemon (``srv``: its :class:`~codespec.daemon.service.daemon.Server`)."""

    def __init__(self, srv: Server, recorder: Recorder) -> None:
        self.srv = srv
        self.recorder = recorder
        self.token = secrets.token_urlsafe(24)
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: set[asyncio.Future[None]] = set()
        self._closing = False
        tok = srv.engine.tokenizer.backend_tokenizer
        self._decode = lambda ids: tok.decode(list(ids), skip_special_tokens=False)
        self._stop_ids = set(getattr(srv.engine, "stop_ids", ()) or ())
        self._status: dict[str, Any] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/{self.token}/"

    async def start(self) -> str:
        """Bind 127.0.0.1 on a free port; the page's URL."""
        self._loop = asyncio.get_running_loop()
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/{token}/", self._page)
        app.router.add_get("/{token}/static/{name}", self._static)
        app.router.add_get("/{token}/events", self._events)
        app.router.add_get("/{token}/data.json", self._data)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=1.0)  # fmt: skip
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = int(self._runner.addresses[0][1])
        self.recorder.on_record = self._heard
        return self.url

    async def close(self) -> None:
        """Stop listening and end every open page's stream."""
        self._closing = True
        self.recorder.on_record = None
        self._wake()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- live updates ---------------------------------------------------------------------
    def _heard(self, _rec: Record) -> None:
        """From the worker thread: a record finished; wake the pages (if any listen)."""
        loop = self._loop
        if self._waiters and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    async def _wait(self, timeout: float) -> None:
        assert self._loop is not None
        fut = self._loop.create_future()
        self._waiters.add(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(fut)

    def payload(self, seq: int = 0, last: int | None = None) -> tuple[dict[str, Any], int]:
        """New records after ``seq`` (the ``last`` ones) and the status; the newest seq.
        From ``seq`` 0 it is every record kept: ``reset`` tells a page to drop its own."""
        recs = self.recorder.since(seq, last)
        # a table the worker resized while it was read: the last status stands
        with contextlib.suppress(RuntimeError):
            self._status = status_json(self.srv)
        data = {
            "records": [record_json(r, self._decode, self._stop_ids) for r in recs],
            "status": self._status,
            "ring": self.recorder.ring,
            "reset": seq == 0,
        }
        return data, recs[-1].seq if recs else seq

    # -- routes ---------------------------------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        first = request.path.lstrip("/").split("/", 1)[0]
        if not hmac.compare_digest(first.encode(), self.token.encode()):
            raise web.HTTPForbidden(text="codespec view: wrong token\n")
        return await handler(request)

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(text=page.render(), content_type="text/html",
                            headers={"Cache-Control": "no-store"})  # fmt: skip

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = page.asset(name)
        if body is None:
            raise web.HTTPNotFound()
        kind = CONTENT_TYPES.get(name[name.rfind(".") :], "text/plain")
        return web.Response(body=body, content_type=kind)

    async def _data(self, request: web.Request) -> web.Response:
        data, _ = self.payload()
        return web.json_response(data, headers={"Cache-Control": "no-store"})

    async def _events(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-store"})  # fmt: skip
        await resp.prepare(request)
        seq = 0
        with contextlib.suppress(ConnectionError):
            while not self._closing:
                data, seq = self.payload(seq)
                await resp.write(f"data: {json.dumps(data)}\n\n".encode())
                await self._wait(STATUS_S)
        return resp
