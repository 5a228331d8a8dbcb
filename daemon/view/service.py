"""Opening and closing the live view inside a running daemon, and its socket method.

Owns: :func:`open_view` / :func:`close_view` (a :class:`~.recorder.Recorder` handed to the
scheduler and the page's :class:`~.server.ViewServer` bound; then both taken away, so a
closed view records nothing and listens nowhere) and :func:`handle`, the ``view`` socket
method: ``{"action": "open" | "close" | "status" | "export", "last"?: N}``.
Must not touch: the scheduler's queue, the engine, frames.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from codespec.daemon.service.protocol import BAD_PARAMS, ProtocolError, parse
from codespec.daemon.view.recorder import Recorder
from codespec.daemon.view.server import ViewServer


class ViewParams(msgspec.Struct, forbid_unknown_fields=True):
    action: Literal["open", "close", "status", "export"] = "status"
    last: int | None = None  # export: the last N requests (default: every one kept)


def _state(srv: Any) -> dict[str, Any]:
    view: ViewServer | None = getattr(srv, "view", None)
    if view is None:
        return {"open": False, "url": None, "recorded": 0}
    return {"open": True, "url": view.url, "recorded": len(view.recorder),
            "ring": view.recorder.ring}  # fmt: skip


async def open_view(srv: Any) -> dict[str, Any]:
    """Start recording and serving the page (once; a second open returns the same URL)."""
    if getattr(srv, "view", None) is None:
        recorder = Recorder(srv.config.view.ring)
        view = ViewServer(srv, recorder)
        await view.start()
        srv.view = view
        srv.scheduler.view = recorder
    return _state(srv)


async def close_view(srv: Any) -> dict[str, Any]:
    """Stop recording, drop the records and stop listening."""
    view: ViewServer | None = getattr(srv, "view", None)
    if view is not None:
        if srv.scheduler is not None:
            srv.scheduler.view = None
        srv.view = None
        await view.close()
    return _state(srv)


def handle(srv: Any, raw: Any) -> Any:
    """The ``view`` socket method: a result map, or an awaitable one (open / close)."""
    p = parse(raw, ViewParams)
    if p.action == "open":
        return open_view(srv)
    if p.action == "close":
        return close_view(srv)
    if p.action == "status":
        return _state(srv)
    view: ViewServer | None = getattr(srv, "view", None)
    if view is None:
        raise ProtocolError(
            BAD_PARAMS, "the view is not open, so nothing was recorded (codespec view opens it)"
        )
    if p.last is not None and p.last < 1:
        raise ProtocolError(BAD_PARAMS, f"'last' must be >= 1, got {p.last}")
    data, _ = view.payload(0, p.last)
    return data
