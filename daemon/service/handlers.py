"""The socket methods, one thin handler each.

Owns: what each method of the socket API does, as four steps: check the params
(:func:`~codespec.daemon.service.protocol.parse` into the method's struct), get
the document, call the core (:mod:`codespec.daemon.prompts.completion`, the
scheduler, the document store, the workspace), convert the result. A handler
returns a result map, or an awaitable one for work that waits for the model.
Must not touch: frames and connections (:mod:`.connection`), the engine's and
the index's insides, prompt building.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from codespec.daemon.engine import cpu_gemm, quant_gemm
from codespec.daemon.engine.engine import GenParams, Stats
from codespec.daemon.engine.footprint import flat_weights
from codespec.daemon.engine.protocols import DecodingEngine
from codespec.daemon.prompts import completion, limits
from codespec.daemon.service import protocol as proto
from codespec.daemon.service.connection import Connection, Handler, Waiting, cancelled_frame
from codespec.daemon.service.protocol import BAD_PARAMS, ProtocolError, parse
from codespec.daemon.service.scheduler import Job, JobResult, prepared_job
from codespec.speculators.policy import summary as policy_summary
from codespec.speculators.registry import choices as proposer_choices
from codespec.speculators.registry import known as known_proposer
from codespec.speculators.registry import names as proposer_names

if TYPE_CHECKING:
    from codespec.daemon.service.daemon import Server

SERVER_NAME = "codespec/0.1.0"
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
Params = Mapping[str, Any]
# Socket methods of parts above the service (codespec.daemon.view adds "view"), which the
# service imports nothing of: name -> fn(server, params), a result map or an awaitable one.
ADDED_METHODS: dict[str, Callable[[Server, Params], Any]] = {}


def cpu_kernel(engine: DecodingEngine) -> str:
    """``cpu_gemm`` when the runner's products use the CPU kernel, else why not."""
    runner: Any = engine.runner  # a local runner's weights and kernels, where it has them
    if getattr(runner, "gguf", False):  # the GGUF's own blocks, by type
        mats = flat_weights([runner.lm_head_t, runner.layers])
        kinds = sorted({w.qtype for w in mats if isinstance(w, quant_gemm.QuantMatrix)})
        products = "int8 activations" if getattr(runner, "int8", False) else "exact"
        stack = getattr(runner, "stack", None)
        att = f", {stack.attention} attention" if stack is not None else ""
        return f"qgemm, GGUF blocks {'/'.join(kinds)}, {products} products{att}"
    if getattr(runner, "kernels", False):
        head = getattr(runner, "lm_head_t", None)
        narrow = {"torch.float16": "fp16", "torch.bfloat16": "bf16"}
        is_panel = isinstance(head, torch.Tensor) and head.dim() == 3
        kind = narrow.get(str(head.dtype)) if is_panel else None
        return f"cpu_gemm, {kind} weights" if kind else "cpu_gemm"
    if engine.device.type != "cpu" or engine.runner.name != "lean":
        return "off"
    return cpu_gemm.unavailable_reason() or "off"


class HeldDeltas:
    """The deltas of a request whose result is its text shaped: only text that ``stable``
    says the shaping keeps whatever comes next goes out as it is generated, and
    :meth:`close` sends the rest of the result's text, so that the deltas add up to exactly
    the text the result returns. Runs on the event loop."""

    def __init__(self, send: Callable[[str], None], stable: Callable[[str], str]) -> None:
        self.send, self.stable = send, stable
        self.raw = ""
        self.sent = ""

    def feed(self, text: str) -> None:
        self.raw += text
        self._up_to(self.stable(self.raw))

    def close(self, result: dict[str, Any]) -> dict[str, Any]:
        self._up_to(result["text"])
        return result

    def _up_to(self, target: str) -> None:
        if len(target) > len(self.sent) and target.startswith(self.sent):
            self.send(target[len(self.sent) :])
            self.sent = target


class Methods:
    """The handlers of one daemon, by socket method name (:meth:`table`)."""

    def __init__(self, server: Server) -> None:
        self.srv = server
        self._warm_timers: dict[str, asyncio.TimerHandle] = {}

    def table(self) -> dict[str, Handler]:
        table: dict[str, Handler] = {m: getattr(self, m) for m in METHODS}
        for name, fn in ADDED_METHODS.items():
            table[name] = lambda conn, rid, raw, fn=fn: fn(self.srv, raw)
        return table

    # -- helpers --------------------------------------------------------------------------
    def _sampling(self, p: proto.Sampling, default_tokens: int) -> tuple[GenParams, str]:
        """The request's generation parameters and speculation, checked against the config."""
        cfg = self.srv.config
        speculation = p.speculation or cfg.speculation.default
        if not known_proposer(speculation):
            raise ProtocolError(BAD_PARAMS, f"speculation must be one of {proposer_choices()}")
        max_tokens = default_tokens if p.max_tokens is None else p.max_tokens
        if max_tokens > cfg.limits.max_tokens:
            raise ProtocolError(
                BAD_PARAMS,
                f"'max_tokens' must be in [1, {cfg.limits.max_tokens}], got {max_tokens}",
            )
        params = GenParams(
            max_tokens=max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed,
            max_draft=cfg.speculation.max_draft,
        )
        return params, speculation

    def _submit(
        self,
        conn: Connection,
        rid: int,
        job: Job,
        stream: bool,
        done: Callable[[JobResult], dict],
        stable: Callable[[str], str] | None = None,
    ) -> Waiting:
        """Queue ``job``; with ``stream``, its text goes out as deltas (with ``stable``,
        through :class:`HeldDeltas`: the result's text shaped by ``done`` is what streams)."""
        scheduler = self.srv.scheduler
        assert scheduler is not None
        if stream:
            loop = asyncio.get_running_loop()

            def send(text: str) -> None:
                conn.send({"id": rid, "event": "delta", "text": text})

            sink = send
            if stable is not None:
                held = HeldDeltas(send, stable)
                sink, shaped = held.feed, done
                done = lambda r: held.close(shaped(r))  # noqa: E731

            def on_delta(text: str) -> None:
                loop.call_soon_threadsafe(sink, text)

            job.on_delta = on_delta
        return Waiting(job, asyncio.wrap_future(scheduler.submit(job)), done)

    # -- documents ------------------------------------------------------------------------
    def hello(self, conn: Connection, rid: int, raw: Params) -> dict[str, Any]:
        parse(raw, proto.Hello)
        e = self.srv.engine
        return {
            "server": SERVER_NAME,
            "protocol": proto.PROTOCOL_VERSION,
            "model": e.model_name,
            "device": e.device.type,
            "runner": e.runner.name,
            "max_length": e.max_length,
            "capabilities": {
                "methods": [*METHODS, *ADDED_METHODS],
                "speculation": proposer_names(),
                "streaming": True,
                "edit": completion.auto_mode(e),  # the "auto" mode
                "edit_modes": list(completion.EDIT_MODES),
                "fim": e.fim is not None,
                "max_frame_bytes": proto.MAX_FRAME_BYTES,
                "max_tokens": self.srv.config.limits.max_tokens,
                "error_codes": list(proto.ERROR_CODES),
            },
        }

    def open(self, conn: Connection, rid: int, raw: Params) -> dict[str, Any]:
        p = parse(raw, proto.Open)
        d = self.srv.documents.open(p.uri, p.text, p.version, p.language)
        conn.documents.add(p.uri)
        self._warm_later(p.uri, len(p.text), 0.0, runs_at=0)  # its runs from the top
        return {"uri": p.uri, "version": d.version, "lines": d.doc.lines.line_count}

    def change(self, conn: Connection, rid: int, raw: Params) -> dict[str, Any]:
        p = parse(raw, proto.Change)
        d = self.srv.documents.change(p.uri, p.version, p.changes)
        last = p.changes[-1] if p.changes else None
        if last is not None and last.get("range") is not None:  # the cursor: after the edit
            start = d.offset(last["range"]["start"])
            self._warm_later(p.uri, start + len(last.get("text", "")))
        return {"uri": p.uri, "version": d.version}

    def _warm_later(
        self, uri: str, offset: int, delay: float | None = None, runs_at: int | None = None
    ) -> None:
        """After a pause (``completion.warm_after_s``) with no newer change to ``uri``,
        hand the scheduler the prompt a completion at ``offset`` would use, then the file's
        runs nearest ``runs_at`` (default: ``offset``) first: it pre-fills them while no
        request runs (:meth:`Scheduler.warm`)."""
        pause = self.srv.config.completion.warm_after_s
        if not pause or self.srv.scheduler is None:
            return
        old = self._warm_timers.pop(uri, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self._warm_timers[uri] = loop.call_later(
            pause if delay is None else delay, self._warm, uri, offset, runs_at
        )

    def _complete_request(
        self, offset: int, max_tokens: int, multiline: bool, stop: tuple[str, ...] = ()
    ) -> completion.CompleteRequest:
        """A completion at ``offset`` with the config's prompt settings: the same for a
        request and for the warm-up that pre-fills its prompt."""
        cfg = self.srv.config
        return completion.CompleteRequest(
            offset=offset,
            max_tokens=max_tokens,
            multiline=multiline,
            context_tokens=cfg.limits.context_tokens,
            context=cfg.completion.context,
            stop=stop,
            middle=cfg.completion.middle,
            suffix_tokens=cfg.completion.suffix_tokens,
            block_lines=cfg.completion.block_lines,
        )

    def _warm(self, uri: str, offset: int, runs_at: int | None = None) -> None:
        self._warm_timers.pop(uri, None)
        srv = self.srv
        if uri not in srv.documents or srv.scheduler is None:
            return
        doc = srv.documents.get(uri)
        req = self._complete_request(min(offset, len(doc.text)), limits.LINE_TOKENS, False)
        try:
            prep = completion.prepare_complete(srv.engine, srv.documents, srv.snippets, doc, req)
            runs = []
            if most := getattr(srv.engine, "max_run_tokens", 0):  # the engine keeps runs
                at = req.offset if runs_at is None else min(runs_at, len(doc.text))
                # the nearest, within half the runs' budget: two documents' neighbourhoods fit
                at_req = dataclasses.replace(req, offset=at)
                runs = completion.file_runs(srv.engine, doc, at_req, most // 2)
        except ProtocolError:  # no room for a prompt
            return
        srv.scheduler.warm(uri, prep.prompt_ids, runs)  # an empty prompt: nothing before it

    def close(self, conn: Connection, rid: int, raw: Params) -> dict[str, Any]:
        p = parse(raw, proto.Close)
        self.srv.documents.close(p.uri)
        conn.documents.discard(p.uri)
        return {"uri": p.uri, "closed": True}

    def workspace(self, conn: Connection, rid: int, raw: Params) -> Any:
        p = parse(raw, proto.WorkspaceFolders)
        ws = self.srv.workspace
        assert ws is not None

        def work() -> dict[str, Any]:
            for f in p.remove:
                ws.remove(f)
            try:
                files = sum(ws.add(f) for f in p.folders)
            except ValueError as exc:
                raise ProtocolError(BAD_PARAMS, str(exc)) from None
            return {**ws.stats(), "indexed": files}

        return asyncio.to_thread(work)

    # -- model work -----------------------------------------------------------------------
    def complete(self, conn: Connection, rid: int, raw: Params) -> Waiting | dict[str, Any]:
        p = parse(raw, proto.Complete)
        params, speculation = self._sampling(p, limits.default_tokens(p.multiline))
        srv = self.srv
        doc = srv.documents.get(p.uri, p.version)
        req = self._complete_request(
            doc.offset(p.position.as_dict()), params.max_tokens, p.multiline, tuple(p.stop)
        )
        prep = completion.prepare_complete(srv.engine, srv.documents, srv.snippets, doc, req)
        if not prep.prompt_ids:  # a blank document: nothing to complete, not an error
            stats = Stats(finish_reason="stop").as_dict()
            return {"text": "", "finish_reason": "stop", "stats": stats}
        job = prepared_job(prep, params, speculation, "complete", p.uri)

        def done(r: JobResult) -> dict[str, Any]:
            text = completion.shape(r.text, p.multiline, r.finish_reason)
            return {"text": text, "finish_reason": r.finish_reason, "stats": r.stats}

        # what shaping keeps of the text so far whatever comes next: what a "length"
        # finish keeps (the shaping cuts only whole lines at the end, most at "length")
        def stable(text: str) -> str:
            return completion.shape(text, p.multiline, "length")

        return self._submit(conn, rid, job, p.stream, done, stable)

    def edit(self, conn: Connection, rid: int, raw: Params) -> Waiting:
        p = parse(raw, proto.Edit)
        srv = self.srv
        # The edits refer to the text as it was when the request came in; a change the
        # client sends while the edit streams must not move them.
        doc = srv.documents.get(p.uri, p.version).snapshot()
        start, end = doc.offset(p.range.start.as_dict()), doc.offset(p.range.end.as_dict())
        if end < start:
            raise ProtocolError(BAD_PARAMS, "the range's end precedes its start")
        old = doc.text[start:end]
        draft = old if p.prediction is None else p.prediction
        limit = srv.config.limits.max_tokens
        params, speculation = self._sampling(
            p, min(limit, len(srv.engine.encode(draft)) * 3 // 2 + 32)
        )
        params.max_draft = max(params.max_draft, completion.EDIT_DRAFT)
        ep = completion.edit_prompt(
            srv.engine, doc.text, start, end, draft, p.instruction, doc.language,
            params.max_tokens, p.mode, srv.config.limits.context_tokens,
        )  # fmt: skip
        prep = completion.prepare_edit(srv.engine, ep, old, list(p.stop))
        job = prepared_job(prep, params, speculation, "edit", p.uri)
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

        return self._submit(conn, rid, job, p.stream, done)

    def generate(self, conn: Connection, rid: int, raw: Params) -> Waiting:
        p = parse(raw, proto.Generate)
        params, speculation = self._sampling(p, 64)
        engine = self.srv.engine
        if p.prompt_ids is not None:
            ids = p.prompt_ids
            vocab = int(getattr(engine.config, "vocab_size", 0) or len(engine.tokenizer))
            if any(t >= vocab for t in ids):
                raise ProtocolError(BAD_PARAMS, f"'prompt_ids' must be a list of ids < {vocab}")
        elif p.prompt is not None:
            ids = engine.encode(p.prompt)
        else:
            raise ProtocolError(BAD_PARAMS, "'prompt' or 'prompt_ids': missing")
        if not ids:
            raise ProtocolError(BAD_PARAMS, "the prompt is empty")
        if len(ids) + 1 >= engine.max_length:
            raise ProtocolError(BAD_PARAMS, f"the prompt has {len(ids)} tokens; too long")
        job = Job(list(ids), params, speculation, "generate", stop=list(p.stop))

        def done(r: JobResult) -> dict[str, Any]:
            return {"text": r.text, "finish_reason": r.finish_reason, "stats": r.stats}

        return self._submit(conn, rid, job, p.stream, done)

    # -- the daemon -----------------------------------------------------------------------
    def cancel(self, conn: Connection, rid: int, raw: Params) -> dict[str, Any]:
        target = parse(raw, proto.Cancel).id
        if not conn.cancel(target):
            return {"id": target, "cancelled": False}
        conn.send(cancelled_frame(target))
        return {"id": target, "cancelled": True}

    def stats(self, conn: Connection, rid: int, raw: Params) -> dict[str, Any]:
        srv = self.srv
        assert srv.scheduler is not None and srv.workspace is not None
        req = srv.scheduler.stats()
        e = srv.engine
        return {
            "model": e.model_name,
            "device": e.device.type,
            "runner": e.runner.name,
            "cpu_kernel": cpu_kernel(e),
            "kv_slots": e.max_slots,
            "runs": e.runs_stats() if hasattr(e, "runs_stats") else {},
            "pid": os.getpid(),
            "uptime_s": round(time.time() - srv.started, 1),
            "connections": srv.connection_count,
            "documents": len(srv.documents),
            "index": srv.index_stats(),
            "workspace": srv.workspace.stats(),
            "requests": {k: v for k, v in req.items() if k != "proposers"},
            "proposers": req["proposers"],
            "policy": policy_summary(e),
            "tokens_per_s": req["tokens_per_s"],
            "backend": e.status() if hasattr(e, "status") else {"kind": "local"},
        }

    def shutdown(self, conn: Connection, rid: int, raw: Params) -> dict[str, Any]:
        srv = self.srv
        asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(srv.stop()))
        return {"ok": True}
