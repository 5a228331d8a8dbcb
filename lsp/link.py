"""The language server's connection to the daemon (``codespec serve``).

Owns: connecting over the daemon's Unix socket, starting the daemon when none
answers (detached, in its own session, so it outlives this editor), waiting for
its socket, noticing when it died and reconnecting — restarting it and
re-sending every open document and the workspace folders — and forwarding
document sync in the order the editor sent it.
Must not touch: LSP types, post-processing, the socket wire format (that is
:mod:`codespec.daemon.client`'s).

Ordering: document notifications are written with ``AsyncClient.start`` from
the handler's synchronous part, so they reach the socket in the order the editor
sent them; a document whose sync failed (``unknown_document`` /
``stale_version``) is re-opened with its full text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from codespec.daemon.client import AsyncClient, DaemonError, default_socket_path
from codespec.lsp.options import Options

RESYNC_CODES = ("unknown_document", "stale_version")
log = logging.getLogger("codespec.lsp.link")
PROTOCOL_VERSION = 1


class DaemonUnavailable(Exception):
    """No daemon answers and none could be started; the message says why, in one line."""


@dataclass(frozen=True)
class DocumentState:
    """What the daemon needs to (re)open one document."""

    uri: str
    text: str
    version: int | None
    language: str = ""

    def open_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"uri": self.uri, "text": self.text}
        if self.version is not None:
            params["version"] = self.version
        if self.language:
            params["language"] = self.language
        return params


@dataclass
class LinkHooks:
    """What the link reads from the server when it (re)connects."""

    documents: Callable[[], list[DocumentState]]  # every open document, current text
    document: Callable[[str], DocumentState | None]  # one, for a resync
    folders: Callable[[], list[str]]  # workspace folder paths
    log: Callable[[str], None] = field(default=lambda message: None)


class DaemonLink:
    def __init__(self, options: Options, hooks: LinkHooks) -> None:
        self.options = options
        self.hooks = hooks
        self.socket_path = options.socket or default_socket_path()
        self.hello: dict[str, Any] = {}
        self.connects = 0  # successful (re)connections
        self.starts = 0  # daemons this process started
        self.workspace_method: str | None = None  # learnt from hello's capabilities
        self._client: AsyncClient | None = None
        self._lock = asyncio.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._background: set[asyncio.Future[Any]] = set()
        self._held: dict[str, list[tuple[str, dict[str, Any]]]] = {}  # uri -> deferred sync

    # -- connection -------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._client is not None and not self._client.closed

    async def ensure(self) -> AsyncClient:
        """The live client, connecting (and starting the daemon) when there is none."""
        client = self._client
        if client is not None and not client.closed:
            return client
        async with self._lock:
            client = self._client
            if client is not None and not client.closed:
                return client
            client, self.hello = await self._connect_or_start()
            self.workspace_method = _workspace_method(self.hello)
            pendings = self._replay(client)  # synchronous: no document change slips between
            self._client = client
            self.connects += 1
        for method, pending in pendings:
            try:
                await pending.result()
            except DaemonError as exc:
                self.hooks.log(f"codespec: re-sending {method} failed: {exc.message}")
        return client

    def _replay(self, client: AsyncClient) -> list[tuple[str, Any]]:
        docs = self.hooks.documents()
        log.debug("replay: %s", [(d.uri, d.version, len(d.text)) for d in docs])
        pendings = [("open", client.start("open", d.open_params())) for d in docs]
        folders = self.hooks.folders()
        if folders and self.workspace_method:
            pendings.append(
                (self.workspace_method, client.start(self.workspace_method, {"folders": folders}))
            )
        return pendings

    async def _handshake(self) -> tuple[AsyncClient, dict[str, Any]]:
        """Connect and say hello; a daemon counts as up only once it answered."""
        client = await AsyncClient.connect(self.socket_path, timeout=2.0)
        try:
            hello = await asyncio.wait_for(
                client.request("hello", {"client": "codespec-lsp", "protocol": PROTOCOL_VERSION}),
                30.0,
            )
        except BaseException:
            await client.close()
            raise
        return client, hello

    async def _connect_or_start(self) -> tuple[AsyncClient, dict[str, Any]]:
        try:
            return await self._handshake()
        except Exception as exc:  # refused, missing, timed out, dropped during hello
            if not self.options.autostart_daemon:
                raise DaemonUnavailable(
                    f"no daemon at {self.socket_path} ({exc}); start `codespec serve`"
                ) from None
        log_path = self._spawn()
        deadline = time.monotonic() + self.options.start_timeout_s
        last: BaseException | None = None
        while time.monotonic() < deadline:
            proc = self._proc
            if proc is not None and proc.poll() is not None:
                # It exited: maybe another daemon won the race for the socket; try once more.
                with contextlib.suppress(Exception):
                    return await self._handshake()
                raise DaemonUnavailable(
                    f"`codespec serve` exited with status {proc.returncode}: {_tail(log_path)}"
                )
            if os.path.exists(self.socket_path):
                try:
                    return await self._handshake()
                except Exception as exc:  # a stale socket file, or the daemon still starting
                    last = exc
            await asyncio.sleep(0.05)
        raise DaemonUnavailable(
            f"the daemon did not answer on {self.socket_path} within "
            f"{self.options.start_timeout_s:g} s ({last}); see {log_path}"
        )

    def _spawn(self) -> str:
        """Start ``codespec serve`` detached; its stderr goes to ``<socket>.log``."""
        if self._proc is not None:
            self._proc.poll()  # reap a dead one
        folder = os.path.dirname(self.socket_path) or "."
        os.makedirs(folder, mode=0o700, exist_ok=True)
        log_path = self.socket_path + ".log"
        cmd = [
            sys.executable,
            "-m",
            "codespec.daemon.cli",
            "serve",
            "--socket",
            self.socket_path,
            *self.options.serve_args,
        ]
        self.hooks.log(f"codespec: starting the daemon: {' '.join(cmd)}")
        with open(log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # detached: it outlives this language server
                close_fds=True,
            )
        self.starts += 1
        return log_path

    def kick(self) -> None:
        """Reconnect in the background (the replay re-sends every document)."""
        if self.connected or self._lock.locked():
            return
        self._spawn_task(self._reconnect_quietly())

    async def _reconnect_quietly(self) -> None:
        try:
            await self.ensure()
        except DaemonUnavailable as exc:
            self.hooks.log(f"codespec: {exc}")

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None and not client.closed:
            await client.close()

    # -- document sync ----------------------------------------------------------

    @contextlib.asynccontextmanager
    async def holding(self, uri: str) -> Any:
        """Defer ``uri``'s sync while an edit of it runs, then send it in order.

        An editor that streams the edit into its buffer changes the document while
        the daemon still computes TextEdits against the text the edit started from.
        """
        self._held.setdefault(uri, [])
        try:
            yield
        finally:
            for method, params in self._held.pop(uri, []):
                self.sync(method, params)

    def sync(self, method: str, params: dict[str, Any]) -> None:
        """Forward ``open``/``change``/``close`` now, in order; repair failures later."""
        held = self._held.get(params.get("uri", ""))
        if held is not None:
            held.append((method, params))
            return
        client = self._client
        if client is None or client.closed:
            log.debug("%s %s deferred to the replay", method, params.get("uri"))
            self.kick()  # the replay after connecting carries this change too
            return
        log.debug("%s %s", method, _brief(params))
        try:
            pending = client.start(method, params)
        except Exception as exc:  # the socket broke between the check and the write
            self.hooks.log(f"codespec: {method} not sent ({exc}); reconnecting")
            self.kick()
            return
        self._spawn_task(self._finish_sync(client, method, params, pending))

    async def _finish_sync(
        self, client: AsyncClient, method: str, params: dict[str, Any], pending: Any
    ) -> None:
        try:
            await pending.result()
        except DaemonError as exc:
            if client.closed:
                self.kick()
            elif exc.code in RESYNC_CODES and method != "close":
                self.resync(params["uri"])
            else:
                self.hooks.log(f"codespec: {method} failed: {exc.code}: {exc.message}")
                if method == "change":  # the daemon applied nothing: give it the full text
                    self.resync(params["uri"])
        except (OSError, EOFError, asyncio.IncompleteReadError):
            self.kick()

    def resync(self, uri: str) -> None:
        """Re-open one document with its full current text."""
        doc = self.hooks.document(uri)
        if doc is not None:
            self.sync("open", doc.open_params())

    def set_folders(self, added: list[str], removed: list[str]) -> None:
        """Workspace folders changed: the daemon indexes the added, forgets the removed."""
        if self.workspace_method and self.connected and (added or removed):
            self.sync(self.workspace_method, {"folders": added, "remove": removed})

    # -- requests ---------------------------------------------------------------

    async def request(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        on_delta: Callable[[dict[str, Any]], Any] | None = None,
        uri: str | None = None,
    ) -> dict[str, Any]:
        """One request that survives a daemon restart and a document the daemon lost.

        Cancelling the awaiting task cancels the daemon's request too. On a
        connection loss the daemon is reconnected (restarted when needed, documents
        re-sent) and the request is retried once; on ``unknown_document`` /
        ``stale_version`` the document ``uri`` is re-opened and the request retried.
        """
        for attempt in (0, 1):
            client = await self.ensure()
            pending = client.start(method, params, on_delta=on_delta)
            try:
                return await pending.result()
            except asyncio.CancelledError:
                if not client.closed:
                    self._spawn_task(_cancel_quietly(pending))
                raise
            except DaemonError as exc:
                if attempt == 0 and client.closed:
                    continue
                if attempt == 0 and uri is not None and exc.code in RESYNC_CODES:
                    doc = self.hooks.document(uri)
                    if doc is not None:
                        await client.request("open", doc.open_params())
                        continue
                raise
            except (OSError, EOFError, asyncio.IncompleteReadError):
                if attempt == 0:
                    continue
                raise
        raise AssertionError("unreachable")

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _cancel_quietly(pending: Any) -> None:
    with contextlib.suppress(Exception):
        await pending.cancel()


def _workspace_method(hello: dict[str, Any]) -> str | None:
    """``workspace`` ({folders, remove}) when the daemon's hello lists it."""
    caps = hello.get("capabilities") or {}
    methods = caps.get("methods", []) if isinstance(caps, dict) else []
    return "workspace" if "workspace" in methods else None


def _brief(params: dict[str, Any]) -> str:
    """A log line's worth of a sync request (texts replaced by their lengths)."""
    out = {k: (f"<{len(v)} chars>" if k == "text" else v) for k, v in params.items()}
    if "changes" in out:
        out["changes"] = [
            {**c, "text": f"<{len(c.get('text', ''))} chars>"} for c in params["changes"]
        ]
    return str(out)


def _tail(path: str, chars: int = 400) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()[-chars:]
    except OSError:
        return "(no log)"
    lines = [s for s in text.splitlines() if s.strip()]
    return lines[-1] if lines else "(empty log)"
