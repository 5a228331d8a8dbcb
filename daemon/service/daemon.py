"""``codespec serve``: the daemon's lifecycle behind the Unix socket.

Owns: the socket's lifecycle (directory 0700, socket 0600, a live daemon on
the same path refuses a second one, a stale socket file is replaced), starting
the parts (engine, n-gram index loaded from the state directory, scheduler,
workspace) and stopping them (SIGTERM: stop accepting, cancel, save the index,
remove the socket file), and the index's feed from documents and workspace.
:func:`make_server` is the app factory tests build the real daemon with.

The connection loop is :mod:`.connection`; the methods are :mod:`.handlers`.
Model work never runs on the event loop. Must not touch: the engine's insides,
the index's insides, what a method means.

The protocol as built is in the module docstring of :mod:`.protocol` and in
the ``hello`` result's ``capabilities``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from codespec.daemon.config import Config
from codespec.daemon.engine.protocols import DecodingEngine
from codespec.daemon.prompts import crossfile
from codespec.daemon.service.connection import Connection, serve_connection
from codespec.daemon.service.documents import DocumentStore
from codespec.daemon.service.handlers import Methods
from codespec.daemon.service.scheduler import LockedIndex, Scheduler
from codespec.daemon.service.workspace import Workspace
from codespec.speculators.policy import seed_costs

if TYPE_CHECKING:
    from codespec.daemon.engine.engine import Engine
    from codespec.ngram_index import NgramIndex

log = logging.getLogger("codespec.daemon")


# Parts above the service that start and stop with the daemon (codespec.daemon.view, which
# the service imports nothing of): awaited with the server once it listens, and as it stops.
ON_START: list[Callable[[Server], Awaitable[Any]]] = []
ON_STOP: list[Callable[[Server], Awaitable[Any]]] = []


class SocketInUse(RuntimeError):
    """Another daemon answers on the socket path."""


def _preload(engine: Engine, speculation: str) -> None:
    """Build ``speculation``'s proposers once (what they load is kept per model: the
    EAGLE head's runner), and warm prompts with the taps they read, as their requests
    will. Whatever fails is logged and left for a request to report: the daemon starts
    without it."""
    from codespec.speculators.registry import make_proposer

    try:
        proposer = make_proposer(speculation, engine)
        engine.warm_taps = tuple(getattr(proposer, "taps", ()) or ())
    except (LookupError, ValueError, ImportError) as exc:  # no weights, weights that do not fit
        log.info("speculation %s: %s", speculation, exc)
    except Exception as exc:  # anything else a proposer's loading raises
        log.warning("speculation %s could not be prepared: %s", speculation, exc)


def socket_is_live(path: str, timeout: float = 1.0) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def claim_socket_path(path: str) -> None:
    """Make the socket's folder (0700 when we create it); refuse a live socket; drop a stale one."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        os.makedirs(folder, mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)
    if os.path.exists(path) or os.path.islink(path):
        if socket_is_live(path):
            raise SocketInUse(f"another codespec daemon is already serving on {path}")
        log.warning("removing the stale socket %s (its daemon is gone)", path)
        os.unlink(path)


class Server:
    """The daemon: engine, documents, index, scheduler, workspace, socket."""

    def __init__(self, config: Config, engine: DecodingEngine | None = None) -> None:
        self.config = config
        self.engine = engine
        self.socket_path = config.socket_path
        self.started = time.time()
        self.index: NgramIndex | None = None
        self.documents = DocumentStore(
            config.limits.max_documents, config.limits.max_document_chars, self._feed_index
        )
        self.scheduler: Scheduler | None = None
        self.workspace: Workspace | None = None
        self.snippets = crossfile.SnippetCache()
        # the open live view (codespec.daemon.view sets and reads it; the service does not)
        self.view: object | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[Connection] = set()
        self._stopped = asyncio.Event()
        self._stopping = False
        self._index_lock = threading.Lock()
        self._handlers = Methods(self).table()

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        claim_socket_path(self.socket_path)  # before the model loads: a second serve fails fast
        if self.engine is None and self.config.backend.kind != "local":
            from codespec.daemon.backends.remote import RemoteEngine  # a server decodes

            self.engine = await asyncio.to_thread(
                RemoteEngine, self.config.model, self.config.backend
            )
        remote = getattr(self.engine, "remote", False)
        if self.engine is None:
            from codespec.daemon.engine.engine import Engine

            cfg = self.config
            self.engine = await asyncio.to_thread(
                Engine,
                cfg.model,
                cfg.device,
                cfg.runner,
                max_slots=cfg.limits.kv_slots,
                max_run_tokens=cfg.limits.run_tokens,
            )
        if not remote:
            local = cast("Engine", self.engine)  # not remote: the daemon's own engine
            # the policy's first cost table: a few timed forwards, before the first request
            seed_costs(local, await asyncio.to_thread(local.time_forwards))
            # the default method's proposers built once, so that a head (the EAGLE head
            # shipped for SmolLM2-135M) loads now and not inside the first completion
            await asyncio.to_thread(_preload, local, self.config.speculation.default)
        self.index = self._load_index()
        from codespec.ngram_index import native as index_native

        # the index's C++ lookup built (or loaded) now: compiling it into a fresh kernel
        # cache inside the first completion would stall that completion
        await asyncio.to_thread(index_native.available)
        # token healing's table of every token's text, built now, not inside the
        # first completion whose prompt is healed
        await asyncio.to_thread(lambda: self.engine.token_texts)
        make = Scheduler
        if remote:  # requests side by side, batched by the server
            from codespec.daemon.backends.concurrent import RemoteScheduler as make
        self.scheduler = make(
            self.engine,
            LockedIndex(self.index, self._index_lock),
            self.config.speculation,
            self.config.limits.max_queue,
        )
        self.scheduler.start()
        ws = self.config.workspace
        self.workspace = Workspace(
            self._index_workspace_file,
            lambda uri: uri in self.documents,
            ws.max_file_bytes,
            ws.max_files,
            ws.debounce_s,
        )
        await self._listen()
        log.info("serving on %s", self.socket_path)
        for hook in ON_START:
            await hook(self)

    async def _listen(self) -> None:
        claim_socket_path(self.socket_path)
        old = os.umask(0o177)  # the socket is born 0600
        try:
            self._server = await asyncio.start_unix_server(
                self._on_connect, path=self.socket_path, limit=2**16
            )
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for hook in ON_STOP:
            await hook(self)
        for conn in list(self._connections):
            conn.close()
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)
        if self.workspace is not None:
            await asyncio.to_thread(self.workspace.close)
        saved = self._save_index()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        log.info(
            "stopped; %s removed%s", self.socket_path, f", index saved to {saved}" if saved else ""
        )
        self._stopped.set()

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        conn = Connection(writer)
        self._connections.add(conn)
        try:
            await serve_connection(reader, conn, self._handlers)
        finally:
            self._connections.discard(conn)
            if not self._stopping:  # stopping: the open documents go into the saved index
                self.release(conn)

    def release(self, conn: Connection) -> None:
        """Close the documents ``conn`` opened that no other connection holds: an editor
        that quits (its language server's connection closes) leaves none open."""
        held = set().union(*(c.documents for c in self._connections if c is not conn))
        for uri in sorted(conn.documents - held):
            if uri in self.documents:
                self.documents.close(uri)
        conn.documents.clear()

    # -- the n-gram index ---------------------------------------------------------------
    def _load_index(self) -> NgramIndex:
        """The index saved by the last daemon, or an empty one (none saved, or unreadable)."""
        from codespec.ngram_index import NgramIndex

        tok = self.engine.tokenizer.backend_tokenizer
        path = self.config.index_path
        if path is not None and path.exists():
            try:
                index = NgramIndex.load(path, tok)
                log.info("loaded the index from %s", path)
                return index
            except Exception as exc:  # another tokenizer, a corrupt file: start empty
                log.warning("not loading %s: %s", path, exc)
        return NgramIndex(tok)

    def _save_index(self) -> Path | None:
        """Save the index to the state directory; its path, or None when not saved."""
        path = self.config.index_path
        if path is None or self.index is None:
            return None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with self._index_lock:
                self.index.save(path)
        except OSError as exc:
            log.warning("cannot save the index to %s: %s", path, exc)
            return None
        return path

    def index_stats(self) -> dict[str, Any]:
        with self._index_lock:
            return self.index.stats()

    def _feed_index(self, op: str, uri: str, payload: Any) -> None:
        with self._index_lock:
            if op == "open":
                self.index.open(uri, payload, kind="open")
            elif op == "close":
                self.index.close(uri)
            elif uri in self.index:
                self.index.change(uri, payload)
            else:  # evicted meanwhile: index the store's text
                self.index.open(uri, self.documents.get(uri).text, kind="open")

    def _index_workspace_file(self, uri: str, text: str | None) -> None:
        with self._index_lock:
            if text is None:
                if uri in self.index and self.index.kind(uri) == "workspace":
                    self.index.close(uri)
            elif uri not in self.documents:
                self.index.open(uri, text, kind="workspace")


def make_server(config: Config, engine: DecodingEngine | None = None) -> Server:
    """The app factory: the real daemon, not yet listening (``await server.start()``)."""
    return Server(config, engine)


def serve(config: Config) -> int:
    """Run the daemon until SIGTERM / SIGINT / ``shutdown``; 0 on a clean exit."""
    logging.basicConfig(level=logging.INFO, format="codespec: %(message)s")

    async def main() -> None:
        server = make_server(config)
        await server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.stop()))
        await server.serve_forever()

    asyncio.run(main())
    return 0
