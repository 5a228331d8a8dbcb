"""``codespec lsp``: the pygls language server an editor starts over stdio.

Owns: the LSP surface — capabilities, document sync forwarded to the daemon,
``textDocument/inlineCompletion`` (main path) and ``textDocument/completion``
(fallback), ``$/cancelRequest`` (pygls cancels the handler's task; the link
cancels the daemon request), workspace folders, and the custom methods
``codespec/edit`` (+ ``codespec/editDelta`` notifications),
``codespec/didShowCompletion``, ``codespec/didAcceptCompletion`` and
``codespec/status``. Handlers are module-level functions ``handler(ls, params)``
registered by :func:`make_server`, and thin: read the document, call the core
(:mod:`.completion`, :mod:`.link`), convert the result to LSP types. What the
server keeps between requests is one :class:`State`.
Must not touch: models, prompts, sockets' wire format, post-processing rules.

Positions: the daemon counts UTF-16 code units (LSP's default), so this server
always negotiates ``utf-16`` even when the client prefers UTF-8 (Neovim does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

from lsprotocol import types
from pygls.exceptions import JsonRpcException, JsonRpcInternalError
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol, lsp_method
from pygls.uris import to_fs_path
from pygls.workspace import TextDocument

from codespec.daemon import __version__
from codespec.daemon.client import DaemonError
from codespec.lsp.acceptance import AcceptanceStats
from codespec.lsp.completion import Completer, Completion, CompletionQuery
from codespec.lsp.debounce import Debouncer
from codespec.lsp.link import DaemonLink, DaemonUnavailable, DocumentState, LinkHooks
from codespec.lsp.options import Options, parse_options, to_wire, with_socket
from codespec.lsp.postprocess import CursorContext

EDIT = "codespec/edit"
EDIT_DELTA = "codespec/editDelta"
DID_SHOW = "codespec/didShowCompletion"
DID_ACCEPT = "codespec/didAcceptCompletion"
STATUS = "codespec/status"
ACCEPT_COMMAND = "codespec.acceptCompletion"  # runs after an editor inserts a whole item

log = logging.getLogger("codespec.lsp")


class CodespecProtocol(LanguageServerProtocol):
    @lsp_method(types.INITIALIZE)
    def lsp_initialize(self, params: types.InitializeParams) -> Any:
        general = params.capabilities.general
        if general is not None:
            general.position_encodings = None  # the daemon speaks UTF-16: keep pygls' default
        return (yield from super().lsp_initialize(params))


@dataclass
class State:
    """What the server keeps between requests: the options and what they built."""

    options: Options
    link: DaemonLink
    completer: Completer
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    problems: list[str] = field(default_factory=list)  # option problems, shown once initialized
    last_error: str = ""  # the last error shown, not shown again on every keystroke
    tokens: itertools.count = field(default_factory=lambda: itertools.count(1))


class CodespecServer(LanguageServer):
    """pygls' server plus :class:`State` and the views of pygls' workspace the link reads."""

    def __init__(self, socket: str | None = None) -> None:
        super().__init__("codespec", __version__, protocol_cls=CodespecProtocol)
        self.default_socket = socket
        self.state = self._build(Options(socket=socket), AcceptanceStats())

    def configure(self, options: Options, problems: list[str]) -> None:
        """New options (from ``initialize``): a new link and completer, the same counters."""
        self.state = self._build(with_socket(options, self.default_socket), self.state.acceptance)
        self.state.problems = problems

    def _build(self, options: Options, acceptance: AcceptanceStats) -> State:
        hooks = LinkHooks(
            documents=self.document_states,
            document=self.document_state,
            folders=self.folder_paths,
            log=self.log_message,
        )
        link = DaemonLink(options, hooks)
        completer = Completer(link, options, Debouncer(options.debounce_ms / 1000))
        return State(options, link, completer, acceptance)

    def document_state(self, uri: str) -> DocumentState | None:
        doc = self.workspace.text_documents.get(uri)
        if doc is None:
            return None
        return DocumentState(uri, doc.source, doc.version, doc.language_id or "")

    def document_states(self) -> list[DocumentState]:
        return [s for uri in list(self.workspace.text_documents) if (s := self.document_state(uri))]

    def folder_paths(self) -> list[str]:
        return _paths(self.workspace.folders.values())

    def log_message(self, message: str, kind: types.MessageType = types.MessageType.Log) -> None:
        log.info(message)
        with contextlib.suppress(Exception):  # no client yet (tests) or the pipe closed
            self.window_log_message(types.LogMessageParams(type=kind, message=message))

    def show_message(self, message: str, kind: types.MessageType) -> None:
        log.warning(message)
        with contextlib.suppress(Exception):
            self.window_show_message(types.ShowMessageParams(type=kind, message=message))

    def show_error_once(self, message: str) -> None:
        """An error the user sees once, not on every keystroke that hits it again."""
        if message != self.state.last_error:
            self.state.last_error = message
            self.show_message(message, types.MessageType.Error)


# -- conversions ---------------------------------------------------------------------------


def _paths(folders: Any) -> list[str]:
    return [p for f in folders if (p := to_fs_path(f.uri))]


def _query(doc: TextDocument, position: types.Position, invoked: bool) -> CompletionQuery:
    server_pos = doc.position_codec.position_from_client_units(doc.lines, position)
    ctx = CursorContext.from_lines(doc.lines, server_pos.line, server_pos.character)
    return CompletionQuery(
        uri=doc.uri,
        version=doc.version,
        position={"line": position.line, "character": position.character},
        context=ctx,
        invoked=invoked,
    )


def _rest_of_line(doc: TextDocument, position: types.Position) -> types.Range:
    line = doc.lines[position.line].rstrip("\r\n") if position.line < len(doc.lines) else ""
    end = types.Position(position.line, doc.position_codec.client_num_units(line))
    return types.Range(position, end)


def _daemon_failure(exc: Exception) -> JsonRpcException:
    if isinstance(exc, DaemonError):
        return JsonRpcInternalError(f"codespec daemon: {exc.code}: {exc.message}")
    return JsonRpcInternalError(f"codespec: {exc}")


def _plain(value: Any) -> Any:
    """pygls hands custom methods' params over as namedtuples; make them dicts again."""
    if hasattr(value, "_asdict"):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _accept_command(ls: CodespecServer, c: Completion) -> types.Command:
    item_id = ls.state.acceptance.record(c.proposal.text, c.stats)
    return types.Command(
        title="codespec: accepted",
        command=ACCEPT_COMMAND,
        arguments=[item_id, len(c.proposal.text)],
    )


def _completion_item(
    ls: CodespecServer, doc: TextDocument, position: types.Position, rank: int, c: Completion
) -> types.CompletionItem:
    text = c.proposal.text
    rng = (
        _rest_of_line(doc, position)
        if c.proposal.replaces_rest_of_line
        else types.Range(position, position)
    )
    first = next((s for s in text.split("\n") if s.strip()), "").strip()
    return types.CompletionItem(
        label=first[:80] + ("…" if "\n" in text.strip() else ""),
        kind=types.CompletionItemKind.Text,
        detail="codespec",
        sort_text=f"{rank:04d}",
        filter_text="",
        insert_text_format=types.InsertTextFormat.PlainText,
        text_edit=types.TextEdit(rng, text),
        command=_accept_command(ls, c),
    )


def _change_map(c: types.TextDocumentContentChangeEvent) -> dict[str, Any]:
    if not isinstance(c, types.TextDocumentContentChangePartial):
        return {"text": c.text}
    start, end = c.range.start, c.range.end
    return {
        "range": {
            "start": {"line": start.line, "character": start.character},
            "end": {"line": end.line, "character": end.character},
        },
        "text": c.text,
    }


# -- lifecycle and document sync -----------------------------------------------------------


def initialize(ls: CodespecServer, params: types.InitializeParams) -> None:
    ls.configure(*parse_options(params.initialization_options))


def initialized(ls: CodespecServer, params: types.InitializedParams) -> None:
    for problem in ls.state.problems:
        ls.show_message(problem, types.MessageType.Warning)
    ls.state.link.kick()  # connect (or start the daemon) before the first keystroke


async def shutdown(ls: CodespecServer, params: Any) -> None:
    await ls.state.link.close()


def did_open(ls: CodespecServer, params: types.DidOpenTextDocumentParams) -> None:
    state = ls.document_state(params.text_document.uri)
    if state is not None:
        ls.state.link.sync("open", state.open_params())


def did_change(ls: CodespecServer, params: types.DidChangeTextDocumentParams) -> None:
    doc = params.text_document
    changes = [_change_map(c) for c in params.content_changes]
    ls.state.link.sync("change", {"uri": doc.uri, "version": doc.version, "changes": changes})


def did_close(ls: CodespecServer, params: types.DidCloseTextDocumentParams) -> None:
    ls.state.completer.forget(params.text_document.uri)
    ls.state.link.sync("close", {"uri": params.text_document.uri})


def did_change_folders(ls: CodespecServer, params: types.DidChangeWorkspaceFoldersParams) -> None:
    ls.state.link.set_folders(_paths(params.event.added), _paths(params.event.removed))


# -- completions ---------------------------------------------------------------------------


async def _run_query(ls: CodespecServer, query: CompletionQuery) -> list[Completion]:
    try:
        return await ls.state.completer.complete(query)
    except DaemonUnavailable as exc:
        ls.show_error_once(f"codespec: {exc}")
        return []
    except DaemonError as exc:
        if exc.code == "cancelled":  # superseded inside the daemon
            return []
        raise _daemon_failure(exc) from None


async def inline_completion(
    ls: CodespecServer, params: types.InlineCompletionParams
) -> types.InlineCompletionList:
    doc = ls.workspace.get_text_document(params.text_document.uri)
    invoked = params.context.trigger_kind == types.InlineCompletionTriggerKind.Invoked
    completions = await _run_query(ls, _query(doc, params.position, invoked))
    items = [
        types.InlineCompletionItem(
            insert_text=c.proposal.text,
            range=_rest_of_line(doc, params.position) if c.proposal.replaces_rest_of_line else None,
            command=_accept_command(ls, c),
        )
        for c in completions
    ]
    return types.InlineCompletionList(items=items)


async def completion(ls: CodespecServer, params: types.CompletionParams) -> types.CompletionList:
    doc = ls.workspace.get_text_document(params.text_document.uri)
    context = params.context
    invoked = context is None or context.trigger_kind == types.CompletionTriggerKind.Invoked
    completions = await _run_query(ls, _query(doc, params.position, invoked))
    items = [
        _completion_item(ls, doc, params.position, rank, c) for rank, c in enumerate(completions)
    ]
    return types.CompletionList(is_incomplete=True, items=items)


def accept_completion(ls: CodespecServer, *args: Any) -> None:
    if args:
        ls.state.acceptance.did_accept(str(args[0]), int(args[1]) if len(args) > 1 else None)


def did_show(ls: CodespecServer, params: Any) -> None:
    ls.state.acceptance.did_show(str(_plain(params).get("id", "")))


def did_accept(ls: CodespecServer, params: Any) -> None:
    p = _plain(params)
    length = p.get("acceptedLength")
    ls.state.acceptance.did_accept(
        str(p.get("id", "")), int(length) if length is not None else None
    )


# -- edits and status ----------------------------------------------------------------------


def _edit_request(options: Options, p: dict[str, Any], version: int | None) -> dict[str, Any]:
    """The daemon's ``edit`` params for a ``codespec/edit`` request."""
    request: dict[str, Any] = {
        "uri": p["textDocument"]["uri"],
        "range": p["range"],
        "stream": True,
        "speculation": options.speculation,
    }
    if options.edit_max_tokens is not None:
        request["max_tokens"] = options.edit_max_tokens
    for key in ("instruction", "prediction"):
        if p.get(key):
            request[key] = p[key]
    if version is not None:
        request["version"] = version
    return request


async def edit(ls: CodespecServer, params: Any) -> dict[str, Any]:
    """Rewrite a range; deltas stream as ``codespec/editDelta`` notifications. A document
    the daemon lost (or holds at another version) is re-opened and the edit retried."""
    p = _plain(params)
    uri = p["textDocument"]["uri"]
    version = p["textDocument"].get("version", ls.workspace.get_text_document(uri).version)
    token = p.get("token") or f"edit-{next(ls.state.tokens)}"

    def on_delta(frame: dict[str, Any]) -> None:
        ls.protocol.notify(EDIT_DELTA, {"token": token, "uri": uri, "text": frame["text"]})

    link = ls.state.link
    try:
        async with link.holding(uri):
            request = _edit_request(ls.state.options, p, version)
            result = await link.request("edit", request, on_delta=on_delta, uri=uri)
    except DaemonUnavailable as exc:
        raise JsonRpcInternalError(f"codespec: {exc}") from None
    except DaemonError as exc:
        raise _daemon_failure(exc) from None
    rng = result.get("range", p["range"])
    edits = result.get("edits")
    if edits is None:
        edits = [{"range": rng, "newText": result["text"]}]
    return {
        "token": token,
        "text": result["text"],
        "range": rng,
        "edits": edits,
        "version": version,
        "stats": result.get("stats", {}),
    }


async def status(ls: CodespecServer, params: Any) -> dict[str, Any]:
    link = ls.state.link
    daemon_stats: dict[str, Any] | None = None
    if link.connected:
        with contextlib.suppress(Exception):
            daemon_stats = await asyncio.wait_for(link.request("stats", {}), 5.0)
    return {
        "connected": link.connected,
        "socket": link.socket_path,
        "daemonStarts": link.starts,
        "connects": link.connects,
        "daemon": link.hello,
        "daemonStats": daemon_stats,
        "completions": ls.state.acceptance.snapshot(),
        "options": to_wire(ls.state.options),
    }


FEATURES: tuple[tuple[str, Any, Any], ...] = (
    (types.INITIALIZE, initialize, None),
    (types.INITIALIZED, initialized, None),
    (types.SHUTDOWN, shutdown, None),
    (types.TEXT_DOCUMENT_DID_OPEN, did_open, None),
    (types.TEXT_DOCUMENT_DID_CHANGE, did_change, None),
    (types.TEXT_DOCUMENT_DID_CLOSE, did_close, None),
    (types.WORKSPACE_DID_CHANGE_WORKSPACE_FOLDERS, did_change_folders, None),
    (types.TEXT_DOCUMENT_INLINE_COMPLETION, inline_completion, types.InlineCompletionOptions()),
    (types.TEXT_DOCUMENT_COMPLETION, completion, None),
    (DID_SHOW, did_show, None),
    (DID_ACCEPT, did_accept, None),
    (EDIT, edit, None),
    (STATUS, status, None),
)


def make_server(socket: str | None = None) -> CodespecServer:
    """The language server with every feature registered (tests build it in-process)."""
    server = CodespecServer(socket)
    for name, handler, options in FEATURES:
        server.feature(name, options)(handler)
    server.command(ACCEPT_COMMAND)(accept_completion)
    return server


def run(args: argparse.Namespace) -> int:
    """``codespec lsp``: serve one editor over stdin/stdout until it exits."""
    target: dict[str, Any] = (
        {"filename": args.log_file} if args.log_file else {"stream": sys.stderr}
    )
    logging.basicConfig(
        level=str(args.log_level).upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        **target,
    )
    make_server(args.socket).start_io()
    return 0
