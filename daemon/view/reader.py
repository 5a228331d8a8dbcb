"""A page reading a daemon's open view, for benchmarks: the view's cost with a page open.

Owns: :func:`read_page`, which asks a daemon over its socket whether its view is open and,
if so, reads the page's event stream on a daemon thread, as a browser tab would, until
the daemon goes away. ``codespec bench latency --configs`` starts one per daemon whose
config has ``[view] enabled = true``. Must not touch: the daemon's state.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from typing import Any

from codespec.daemon.client import Client, DaemonError


class PageReader:
    """Reads ``url``'s event stream on a daemon thread, as the page does (each message
    parsed); ``messages``: events read, ``records``: requests they carried."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.messages = 0
        self.records = 0
        self.thread = threading.Thread(target=self._read, name="codespec-view-page", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with urllib.request.urlopen(self.url + "events") as stream:
                for line in stream:
                    if line.startswith(b"data: "):
                        self.records += len(json.loads(line[6:])["records"])
                        self.messages += 1
        except OSError:  # the daemon stopped
            return


def read_page(socket_path: str) -> PageReader | None:
    """A page on the daemon's view when it is open; None when closed (or no view there)."""
    try:
        with Client(socket_path) as c:
            state: dict[str, Any] = c.request("view", {"action": "status"})
    except DaemonError:
        return None
    return PageReader(state["url"]) if state.get("open") else None
