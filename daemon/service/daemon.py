"""``codespec serve``: the asyncio daemon behind the Unix socket.

Owns: the socket's lifecycle (directory 0700, socket 0600, a live daemon on
the same path refuses a second one, a stale socket file is replaced), the
connection loop (frames in, frames out, per-connection in-flight requests,
disconnect cancels them), the method handlers, and shutdown (SIGTERM: stop
accepting, cancel, save the n-gram index, remove the socket file).

Handlers are thin: check params (:class:`~codespec.daemon.service.protocol.Params`),
get the document, call the core (:mod:`.completion`, :mod:`.scheduler`,
:mod:`.documents`, :mod:`.workspace`), convert the result. The request's
state-dependent part (document lookup, version check, prompt) runs when its
frame is read, so frames on one connection act in the order they were sent;
only the wait for the model runs as a task. Model work never runs on the
event loop. Must not touch: the engine's insides, the index's insides.

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
from dataclasses import dataclass, field
from typing import Any

from codespec.daemon.config import Config
from codespec.daemon.engine import cpu_gemm
from codespec.daemon.engine.engine import GenParams
from codespec.daemon.prompts import completion, crossfile
from codespec.daemon.service.documents import DocumentStore
from codespec.daemon.service.protocol import (
    BAD_PARAMS,
    CANCELLED,
    ERROR_CODES,
    HEADER,
    INTERNAL,
    MAX_FRAME_BYTES,
    OVERLOADED,
    PROTOCOL_VERSION,
    UNKNOWN_METHOD,
    FrameTooLarge,
    Params,
    ProtocolError,
    check_request,
    error_frame,
    pack,
    request_id,
    unpack_body,
)
from codespec.daemon.service.scheduler import Job, JobResult, LockedIndex, Scheduler
from codespec.daemon.service.workspace import Workspace
from codespec.ngram_index.positions import PositionError
from codespec.speculators.policy import summary as policy_summary
from codespec.speculators.registry import names as proposer_names

log = logging.getLogger("codespec.daemon")

SERVER_NAME = "codespec/0.1.0"
MAX_INFLIGHT_PER_CONNECTION = 64
MAX_WRITE_BUFFER = 32 * 1024 * 1024  # a client that stops reading is dropped past this
METHODS = (
    "hello",
    "open",
    "change",
    "close",
    "complete",
    "edit",
    "generate",
    "cancel",
    "stats",
    "workspace",
    "shutdown",
)


def _cpu_kernel(engine: Any) -> str:
    """``cpu_gemm`` when the runner's products use the CPU kernel, else why not."""
    if getattr(engine.runner, "kernels", False):
        head = getattr(engine.runner, "lm_head_t", None)
        narrow = {"torch.float16": "fp16", "torch.bfloat16": "bf16"}
        kind = narrow.get(str(head.dtype)) if head is not None and head.dim() == 3 else None
        return f"cpu_gemm, {kind} weights" if kind else "cpu_gemm"
    if engine.device.type != "cpu" or engine.runner.name != "lean":
        return "off"
    return cpu_gemm.unavailable_reason() or "off"


class SocketInUse(RuntimeError):
    """Another daemon answers on the socket path."""


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


@dataclass(eq=False)
class Connection:
    writer: asyncio.StreamWriter
    inflight: dict[int, tuple[asyncio.Task, Job | None]] = field(default_factory=dict)
    closed: bool = False

    def send(self, obj: dict[str, Any]) -> None:
        if self.closed or self.writer.is_closing():
            return
        self.writer.write(pack(obj))
        transport = self.writer.transport
        if transport is not None and transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
            log.warning("dropping a client that does not read its replies")
            self.closed = True
            transport.abort()


Handler = Callable[[Connection, int, Params], "dict[str, Any] | Awaitable[dict[str, Any]]"]


class Server:
    """The daemon: engine, documents, index, scheduler, workspace, socket."""

    def __init__(self, config: Config, engine: Any = None) -> None:
        self.config = config
        self.engine = engine
        self.socket_path = config.socket_path
        self.started = time.time()
        self.index: Any = None
        self.locked: LockedIndex | None = None
        self.documents = DocumentStore(
            config.limits.max_documents, config.limits.max_document_chars, self._feed_index
        )
        self.scheduler: Scheduler | None = None
        self.workspace: Workspace | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[Connection] = set()
        self._stopped = asyncio.Event()
        self._stopping = False
        self._index_lock = threading.Lock()
        self._snippets = crossfile.SnippetCache()
        self._handlers: dict[str, Handler] = {m: getattr(self, f"_h_{m}") for m in METHODS}

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        claim_socket_path(self.socket_path)  # before the model loads: a second serve fails fast
        if self.engine is None:
            from codespec.daemon.engine.engine import Engine

            cfg = self.config
            self.engine = await asyncio.to_thread(Engine, cfg.model, cfg.device, cfg.runner)
        costs = getattr(self.engine, "costs", None)
        if costs is not None and not costs.calibrated:  # the policy's cost table, before
            await asyncio.to_thread(costs.calibrate, self.engine.runner)  # the first request
        self.index = self._load_index()
        self.locked = LockedIndex(self.index, self._index_lock)
        self.scheduler = Scheduler(
            self.engine, self.locked, self.config.speculation, self.config.limits.max_queue
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
        claim_socket_path(self.socket_path)
        old = os.umask(0o177)  # the socket is born 0600
        try:
            self._server = await asyncio.start_unix_server(
                self._on_connect, path=self.socket_path, limit=2**16
            )
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        log.info("codespec daemon serving on %s", self.socket_path)

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            for task, job in conn.inflight.values():
                if job is not None:
                    job.cancel.set()
                task.cancel()
            conn.closed = True
            conn.writer.close()
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)
        if self.workspace is not None:
            await asyncio.to_thread(self.workspace.close)
        self._save_index()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        self._stopped.set()

    # -- the n-gram index ---------------------------------------------------------------
    def _load_index(self) -> Any:
        from codespec.ngram_index import NgramIndex

        tok = self.engine.tokenizer.backend_tokenizer
        path = self.config.index_path
        if path is not None and path.exists():
            try:
                return NgramIndex.load(path, tok)
            except Exception as exc:  # another tokenizer, a corrupt file: start empty
                log.warning("not loading %s: %s", path, exc)
        return NgramIndex(tok)

    def _save_index(self) -> None:
        path = self.config.index_path
        if path is None or self.index is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with self._index_lock:
                self.index.save(path)
        except OSError as exc:
            log.warning("cannot save the index to %s: %s", path, exc)

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

    # -- connections --------------------------------------------------------------------
    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        conn = Connection(writer)
        self._connections.add(conn)
        try:
            await self._serve_connection(reader, conn)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            conn.closed = True
            for task, job in conn.inflight.values():  # disconnect cancels
                if job is not None:
                    job.cancel.set()
                task.cancel()
            conn.inflight.clear()
            self._connections.discard(conn)
            writer.close()

    async def _serve_connection(self, reader: asyncio.StreamReader, conn: Connection) -> None:
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
                await conn.writer.drain()
                continue
            self._dispatch(conn, rid, method, params)
            await conn.writer.drain()

    def _dispatch(self, conn: Connection, rid: int, method: str, params: dict[str, Any]) -> None:
        handler = self._handlers.get(method)
        try:
            if handler is None:
                raise ProtocolError(UNKNOWN_METHOD, f"unknown method {method!r}")
            if rid in conn.inflight:
                raise ProtocolError(BAD_PARAMS, f"request id {rid} is already in flight")
            if len(conn.inflight) >= MAX_INFLIGHT_PER_CONNECTION:
                raise ProtocolError(OVERLOADED, "too many requests in flight on this connection")
            out = handler(conn, rid, Params(params))
        except ProtocolError as exc:
            conn.send(error_frame(rid, exc.code, exc.message))
            return
        except PositionError as exc:  # a position outside the document is the client's
            conn.send(error_frame(rid, BAD_PARAMS, str(exc)))
            return
        except Exception as exc:
            log.exception("%s failed", method)
            conn.send(error_frame(rid, INTERNAL, f"{type(exc).__name__}: {exc}"))
            return
        if isinstance(out, dict):
            conn.send({"id": rid, "result": out})
            return
        job = out.job if isinstance(out, _Waiting) else None
        task = asyncio.ensure_future(self._finish(conn, rid, out))
        conn.inflight[rid] = (task, job)

    async def _finish(self, conn: Connection, rid: int, out: Any) -> None:
        try:
            result = await out
        except asyncio.CancelledError:
            return
        except ProtocolError as exc:
            conn.send(error_frame(rid, exc.code, exc.message))
        except PositionError as exc:
            conn.send(error_frame(rid, BAD_PARAMS, str(exc)))
        except Exception as exc:
            log.exception("request %s failed", rid)
            conn.send(error_frame(rid, INTERNAL, f"{type(exc).__name__}: {exc}"))
        else:
            conn.send({"id": rid, "result": result})
        finally:
            entry = conn.inflight.get(rid)
            if entry is not None and entry[0] is asyncio.current_task():
                del conn.inflight[rid]
        with contextlib.suppress(ConnectionError):
            await conn.writer.drain()

    # -- helpers ------------------------------------------------------------------------
    def _submit(
        self,
        conn: Connection,
        rid: int,
        job: Job,
        stream: bool,
        done: Callable[[JobResult], dict[str, Any]],
    ) -> _Waiting:
        assert self.scheduler is not None
        if stream:
            loop = asyncio.get_running_loop()

            def on_delta(text: str) -> None:
                loop.call_soon_threadsafe(conn.send, {"id": rid, "event": "delta", "text": text})

            job.on_delta = on_delta
        fut = self.scheduler.submit(job)
        return _Waiting(job, asyncio.wrap_future(fut), done)

    def _gen_params(self, p: Params, default_tokens: int) -> tuple[GenParams, str, bool]:
        limits = self.config.limits
        speculation = p.str("speculation", self.config.speculation.default)
        if speculation not in proposer_names():
            raise ProtocolError(
                BAD_PARAMS, f"speculation must be one of {', '.join(proposer_names())}"
            )
        top_p = p.float("top_p", 1.0, lo=0.0, hi=1.0)
        if top_p <= 0:
            raise ProtocolError(BAD_PARAMS, "'top_p' must be in (0, 1]")
        stop = p.str_list("stop", [], max_items=16)
        if any(len(s) > 256 for s in stop):
            raise ProtocolError(BAD_PARAMS, "a stop string is longer than 256 characters")
        params = GenParams(
            max_tokens=p.int("max_tokens", default_tokens, lo=1, hi=limits.max_tokens),
            temperature=p.float("temperature", 0.0, lo=0.0, hi=10.0),
            top_p=top_p,
            seed=p.int("seed", None, lo=0, hi=2**63 - 1),
            stop=list(stop),
            max_draft=self.config.speculation.max_draft,
        )
        return params, speculation, p.bool("stream", False)

    # -- handlers -----------------------------------------------------------------------
    def _h_hello(self, conn: Connection, rid: int, p: Params) -> dict[str, Any]:
        p.str("client", "", max_len=256)
        p.int("protocol", PROTOCOL_VERSION, lo=0, hi=2**31)
        e = self.engine
        return {
            "server": SERVER_NAME,
            "protocol": PROTOCOL_VERSION,
            "model": e.model_name,
            "device": e.device.type,
            "runner": e.runner.name,
            "max_length": e.max_length,
            "capabilities": {
                "methods": list(METHODS),
                "speculation": proposer_names(),
                "streaming": True,
                "edit": "fim" if e.fim is not None else "continue",  # the "auto" mode
                "edit_modes": list(completion.EDIT_MODES),
                "fim": e.fim is not None,
                "max_frame_bytes": MAX_FRAME_BYTES,
                "max_tokens": self.config.limits.max_tokens,
                "error_codes": list(ERROR_CODES),
            },
        }

    def _h_open(self, conn: Connection, rid: int, p: Params) -> dict[str, Any]:
        uri = p.str("uri", max_len=4096)
        d = self.documents.open(
            uri,
            p.str("text"),
            p.int("version", None, lo=-(2**31), hi=2**63 - 1),
            p.str("language", "", max_len=64),
        )
        return {"uri": uri, "version": d.version, "lines": d.doc.lines.line_count}

    def _h_change(self, conn: Connection, rid: int, p: Params) -> dict[str, Any]:
        uri = p.str("uri", max_len=4096)
        version = p.int("version", lo=-(2**31), hi=2**63 - 1)
        changes = p._get("changes", Params._MISSING)
        if not isinstance(changes, list) or not all(isinstance(c, dict) for c in changes):
            raise ProtocolError(BAD_PARAMS, "'changes' must be a list of maps")
        d = self.documents.change(uri, version, changes)
        return {"uri": uri, "version": d.version}

    def _h_close(self, conn: Connection, rid: int, p: Params) -> dict[str, Any]:
        uri = p.str("uri", max_len=4096)
        self.documents.close(uri)
        return {"uri": uri, "closed": True}

    def _h_complete(self, conn: Connection, rid: int, p: Params) -> _Waiting:
        uri = p.str("uri", max_len=4096)
        position = p.position("position")
        multiline = p.bool("multiline", False)
        params, speculation, stream = self._gen_params(p, 64 if multiline else 16)
        doc = self.documents.get(uri, p.int("version", None, lo=-(2**31), hi=2**63 - 1))
        job = completion.complete_job(
            self.engine,
            self.documents,
            self._snippets,
            doc,
            doc.offset(position),
            params,
            multiline,
            self.config.limits.context_tokens,
            self.config.completion.context,
        )
        job.speculation = speculation

        def done(r: JobResult) -> dict[str, Any]:
            text = completion.shape(r.text, multiline, r.finish_reason)
            return {"text": text, "finish_reason": r.finish_reason, "stats": r.stats}

        return self._submit(conn, rid, job, stream, done)

    def _h_edit(self, conn: Connection, rid: int, p: Params) -> _Waiting:
        uri = p.str("uri", max_len=4096)
        rng = p.range("range")
        instruction = p.str("instruction", "", max_len=4000)
        prediction = p.str("prediction", None)
        live = self.documents.get(uri, p.int("version", None, lo=-(2**31), hi=2**63 - 1))
        # The edits refer to the text as it was when the request came in; a change the
        # client sends while the edit streams must not move them.
        doc = live.snapshot()
        start, end = doc.offset(rng["start"]), doc.offset(rng["end"])
        if end < start:
            raise ProtocolError(BAD_PARAMS, "the range's end precedes its start")
        old = doc.text[start:end]
        draft = old if prediction is None else prediction
        default_tokens = min(
            self.config.limits.max_tokens, len(self.engine.encode(draft)) * 3 // 2 + 32
        )
        params, speculation, stream = self._gen_params(p, default_tokens)
        params.max_draft = max(params.max_draft, 64)
        ep = completion.edit_prompt(
            self.engine,
            doc.text,
            start,
            end,
            draft,
            instruction,
            doc.language,
            params.max_tokens,
            p.str("mode", "auto", max_len=16),
            self.config.limits.context_tokens,
        )
        job = completion.edit_job(self.engine, ep, params, uri, old)
        job.speculation = speculation
        span = {"start": doc.position(start), "end": doc.position(end)}

        def done(r: JobResult) -> dict[str, Any]:
            new = completion.clean_edit(r.text, ep.mode)
            return {
                "text": new,
                "range": span,
                "edits": completion.text_edits(doc, start, old, new),
                "version": doc.version,
                "mode": ep.mode,
                "finish_reason": r.finish_reason,
                "stats": r.stats,
            }

        return self._submit(conn, rid, job, stream, done)

    def _h_generate(self, conn: Connection, rid: int, p: Params) -> _Waiting:
        params, speculation, stream = self._gen_params(p, 64)
        ids = p.raw.get("prompt_ids")
        if ids is not None:
            vocab = int(getattr(self.engine.config, "vocab_size", 0) or len(self.engine.tokenizer))
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
            ):
                raise ProtocolError(BAD_PARAMS, f"'prompt_ids' must be a list of ids < {vocab}")
        else:
            ids = self.engine.encode(p.str("prompt"))
        if not ids:
            raise ProtocolError(BAD_PARAMS, "the prompt is empty")
        if len(ids) + 1 >= self.engine.max_length:
            raise ProtocolError(BAD_PARAMS, f"the prompt has {len(ids)} tokens; too long")
        job = Job(list(ids), params, speculation, "generate")
        return self._submit(
            conn,
            rid,
            job,
            stream,
            lambda r: {"text": r.text, "finish_reason": r.finish_reason, "stats": r.stats},
        )

    def _h_cancel(self, conn: Connection, rid: int, p: Params) -> dict[str, Any]:
        target = p.int("id", lo=-(2**63), hi=2**64 - 1)
        entry = conn.inflight.pop(target, None)
        if entry is None:
            return {"id": target, "cancelled": False}
        task, job = entry
        if job is not None:
            job.cancel.set()  # the worker stops within one decode step
        task.cancel()
        conn.send(error_frame(target, CANCELLED, "the request was cancelled"))
        return {"id": target, "cancelled": True}

    def _h_stats(self, conn: Connection, rid: int, p: Params) -> dict[str, Any]:
        assert self.scheduler is not None and self.workspace is not None
        with self._index_lock:
            index = self.index.stats()
        req = self.scheduler.stats()
        e = self.engine
        return {
            "model": e.model_name,
            "device": e.device.type,
            "runner": e.runner.name,
            "cpu_kernel": _cpu_kernel(e),
            "uptime_s": round(time.time() - self.started, 1),
            "connections": len(self._connections),
            "documents": len(self.documents),
            "index": index,
            "workspace": self.workspace.stats(),
            "requests": {k: v for k, v in req.items() if k != "proposers"},
            "proposers": req["proposers"],
            "policy": policy_summary(e),
            "tokens_per_s": req["tokens_per_s"],
        }

    def _h_workspace(self, conn: Connection, rid: int, p: Params) -> Awaitable[dict[str, Any]]:
        add = p.str_list("folders", [], max_items=64)
        remove = p.str_list("remove", [], max_items=64)
        ws = self.workspace
        assert ws is not None

        def work() -> dict[str, Any]:
            files = 0
            for f in remove:
                ws.remove(f)
            for f in add:
                try:
                    files += ws.add(f)
                except ValueError as exc:
                    raise ProtocolError(BAD_PARAMS, str(exc)) from None
            return {**ws.stats(), "indexed": files}

        return asyncio.to_thread(work)

    def _h_shutdown(self, conn: Connection, rid: int, p: Params) -> dict[str, Any]:
        asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(self.stop()))
        return {"ok": True}


class _Waiting:
    """An awaitable request result: the scheduler's future, then ``done`` shapes it."""

    def __init__(self, job: Job, fut: asyncio.Future, done: Callable[[JobResult], dict]) -> None:
        self.job = job
        self.fut = fut
        self.done = done

    def __await__(self):
        result = yield from self.fut.__await__()
        return self.done(result)


def make_server(config: Config, engine: Any = None) -> Server:
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
        print(f"codespec: serving on {server.socket_path}", flush=True)
        await server.serve_forever()

    asyncio.run(main())
    return 0
