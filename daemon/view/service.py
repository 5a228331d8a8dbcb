"""The live view inside a running daemon: installing it, opening and closing it, its method.

Owns: :func:`install` (what ``codespec serve`` calls: the ``view`` socket method, the page
at start when ``[view] enabled``, the page closed when the daemon stops; through the
service's ``ADDED_METHODS`` / ``ON_START`` / ``ON_STOP``, as the service imports nothing
of the view), :func:`open_view` / :func:`close_view` (a :class:`~.recorder.Recorder`
handed to the scheduler and the page's server bound, kept as the server's ``view``; then
both taken away, so a closed view records nothing and listens nowhere), and
:func:`handle`, the ``view`` method:
``{"action": "open" | "close" | "status" | "export", "last"?: N}``.
Must not touch: the scheduler's queue, the engine, frames.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal, cast

import msgspec

from codespec.daemon.service import daemon, handlers
from codespec.daemon.service.daemon import Server
from codespec.daemon.service.protocol import BAD_PARAMS, ProtocolError, parse
from codespec.daemon.view.recorder import Recorder

if TYPE_CHECKING:
    from codespec.daemon.view.server import ViewServer

log = logging.getLogger("codespec.daemon")


class ViewParams(msgspec.Struct, forbid_unknown_fields=True):
    action: Literal["open", "close", "status", "export"] = "status"
    last: int | None = None  # export: the last N requests (default: every one kept)


def current(srv: Server) -> ViewServer | None:
    """The daemon's open view, or None (only this module sets ``srv.view``)."""
    return cast("ViewServer | None", srv.view)


def _state(srv: Server) -> dict[str, Any]:
    view = current(srv)
    if view is None:
        return {"open": False, "url": None, "recorded": 0}
    return {"open": True, "url": view.url, "recorded": len(view.recorder),
            "ring": view.recorder.ring}  # fmt: skip


async def open_view(srv: Server) -> dict[str, Any]:
    """Start recording and serving the page (once; a second open returns the same URL)."""
    if current(srv) is None:
        from codespec.daemon.view.server import ViewServer  # aiohttp: once a view is asked

        view = ViewServer(srv, Recorder(srv.config.view.ring))
        await view.start()
        srv.view = view
        srv.scheduler.view = view.recorder
    return _state(srv)


async def close_view(srv: Server) -> dict[str, Any]:
    """Stop recording, drop the records and stop listening."""
    view = current(srv)
    srv.view = None
    if view is not None:
        if srv.scheduler is not None:
            srv.scheduler.view = None
        await view.close()
    return _state(srv)


async def _start(srv: Server) -> None:
    if srv.config.view.enabled:  # [view] enabled: the page from the start
        log.info("view on %s", (await open_view(srv))["url"])


def install() -> None:
    """Give every daemon this process starts the view (idempotent)."""
    handlers.ADDED_METHODS["view"] = handle
    if _start not in daemon.ON_START:
        daemon.ON_START.append(_start)
    if close_view not in daemon.ON_STOP:
        daemon.ON_STOP.append(close_view)


def handle(srv: Server, raw: Any) -> Any:
    """The ``view`` socket method: a result map, or an awaitable one (open / close)."""
    p = parse(raw, ViewParams)
    if p.action == "open":
        return open_view(srv)
    if p.action == "close":
        return close_view(srv)
    if p.action == "status":
        return _state(srv)
    view = current(srv)
    if view is None:
        raise ProtocolError(
            BAD_PARAMS, "the view is not open, so nothing was recorded (codespec view opens it)"
        )
    if p.last is not None and p.last < 1:
        raise ProtocolError(BAD_PARAMS, f"'last' must be >= 1, got {p.last}")
    data, _ = view.payload(0, p.last)
    return data
