"""A headless Chromium driven over the DevTools protocol (for the view's browser test).

Starts Debian's ``chromium`` with ``--remote-debugging-port=0`` in a fresh profile, reads
the port it chose (``DevToolsActivePort``), and talks to its one page over a WebSocket
(aiohttp's client): navigate, evaluate JavaScript, take a screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium and a DevTools session on its first page."""

    def __init__(self, binary: str, profile: Path, width: int = 1400, height: int = 1800):
        self.profile = profile
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self._ids = itertools.count(1)
        self._session: aiohttp.ClientSession | None = None
        self._ws: Any = None

    def _port(self, timeout: float = 60.0) -> int:
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker.exists():
                lines = marker.read_text().split()
                if len(lines) >= 2:  # the port, then the browser's path: written whole
                    return int(lines[0])
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            time.sleep(0.1)
        raise RuntimeError("chromium did not open its DevTools port")

    async def connect(self) -> None:
        port = self._port()
        self._session = aiohttp.ClientSession()
        pages: list[dict[str, Any]] = []
        for _ in range(300):
            try:
                async with self._session.get(f"http://127.0.0.1:{port}/json/list") as r:
                    pages = [p for p in await r.json() if p.get("type") == "page"]
            except aiohttp.ClientError:  # not answering yet
                pass
            if pages:
                break
            await asyncio.sleep(0.1)
        if not pages:
            raise RuntimeError("chromium opened no page")
        self._ws = await self._session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        n = next(self._ids)
        await self._ws.send_str(json.dumps({"id": n, "method": method, "params": params}))
        while True:
            msg = json.loads((await self._ws.receive()).data)
            if msg.get("id") == n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def navigate(self, url: str) -> None:
        await self.call("Page.enable")
        await self.call("Page.navigate", url=url)

    async def js(self, expression: str) -> Any:
        out = await self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                              awaitPromise=True)  # fmt: skip
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression}: {out['exceptionDetails']}")
        return out["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """``expression``'s value once it is truthy (an error counts as not yet)."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                value = await self.js(expression)
            except RuntimeError as exc:  # the page is still loading: not there yet
                last, value = exc, None
            if value:
                return value
            await asyncio.sleep(0.2)
        raise TimeoutError(f"never true: {expression} (last error: {last})")

    async def screenshot(self, path: Path) -> None:
        out = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(out["data"]))

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
