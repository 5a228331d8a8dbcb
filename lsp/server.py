"""``codespec lsp``: the pygls language server an editor starts over stdio.

Owns: the LSP surface — capabilities, document sync forwarded to the daemon,
``textDocument/inlineCompletion`` (main path) and ``textDocument/completion``
(fallback), ``$/cancelRequest`` (pygls cancels the handler's task; the link
cancels the daemon request), workspace folders, and the custom methods
``codespec/edit`` (+ ``codespec/editDelta`` notifications),
``codespec/didShowCompletion``, ``codespec/didAcceptCompletion`` and
``codespec/status``. Handlers are thin: read the document, call the core
(:mod:`.completion`, :mod:`.link`), convert the result to LSP types.
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
from dataclasses import replace
from typing import Any

from lsprotocol import types
from pygls.exceptions import JsonRpcException, JsonRpcInternalError
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol, lsp_method
from pygls.uris import to_fs_path
from pygls.workspace import TextDocument

from codespec.daemon.client import DaemonError
from codespec.lsp.acceptance import AcceptanceStats
from codespec.lsp.completion import Completer, Completion, CompletionQuery
from codespec.lsp.debounce import Debouncer
from codespec.lsp.link import DaemonLink, DaemonUnavailable, DocumentState, LinkHooks
from codespec.lsp.options import Options, parse_options, to_wire
from codespec.lsp.postprocess import CursorContext

VERSION = "0.1.0"
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


class CodespecServer(LanguageServer):
    def __init__(self, socket: str | None = None) -> None:
        super().__init__("codespec", VERSION, protocol_cls=CodespecProtocol)
        self.default_socket = socket
        self.acceptance = AcceptanceStats()
        self.pending_problems: list[str] = []
        self._last_error = ""
        self.configure(Options(socket=socket))
        self._tokens = itertools.count(1)

    def configure(self, options: Options) -> None:
        self.options = options
        self.link = DaemonLink(
            options,
            LinkHooks(
                documents=self.document_states,
                document=self.document_state,
                folders=self.folder_paths,
                log=self.log_message,
            ),
        )
        self.completer = Completer(self.link, options, Debouncer(options.debounce_ms / 1000))

    # -- views of pygls' workspace, for the link ---------------------------------

    def document_state(self, uri: str) -> DocumentState | None:
        doc = self.workspace.text_documents.get(uri)
        if doc is None:
            return None
        return DocumentState(uri, doc.source, doc.version, doc.language_id or "")

    def document_states(self) -> list[DocumentState]:
        return [s for uri in list(self.workspace.text_documents) if (s := self.document_state(uri))]

    def folder_paths(self) -> list[str]:
        paths = [to_fs_path(f.uri) for f in self.workspace.folders.values()]
        return [p for p in paths if p]

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
        if message != self._last_error:
            self._last_error = message
            self.show_message(message, types.MessageType.Error)

    def next_token(self) -> str:
        return f"edit-{next(self._tokens)}"


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


def make_server(socket: str | None = None) -> CodespecServer:
    """The language server with every feature registered (tests build it in-process)."""
    server = CodespecServer(socket)

    @server.feature(types.INITIALIZE)
    def initialize(ls: CodespecServer, params: types.InitializeParams) -> None:
        options, problems = parse_options(params.initialization_options)
        if options.socket is None and ls.default_socket is not None:
            options = replace(options, socket=ls.default_socket)
        ls.configure(options)
        ls.pending_problems = problems

    @server.feature(types.INITIALIZED)
    def initialized(ls: CodespecServer, params: types.InitializedParams) -> None:
        for problem in ls.pending_problems:
            ls.show_message(problem, types.MessageType.Warning)
        ls.link.kick()  # connect (or start the daemon) before the first keystroke

    @server.feature(types.SHUTDOWN)
    async def shutdown(ls: CodespecServer, params: Any) -> None:
        await ls.link.close()

    # -- document sync ----------------------------------------------------------

    @server.feature(types.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: CodespecServer, params: types.DidOpenTextDocumentParams) -> None:
        state = ls.document_state(params.text_document.uri)
        if state is not None:
            ls.link.sync("open", state.open_params())

    @server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: CodespecServer, params: types.DidChangeTextDocumentParams) -> None:
        changes: list[dict[str, Any]] = []
        for c in params.content_changes:
            if isinstance(c, types.TextDocumentContentChangePartial):
                start, end = c.range.start, c.range.end
                changes.append(
                    {
                        "range": {
                            "start": {"line": start.line, "character": start.character},
                            "end": {"line": end.line, "character": end.character},
                        },
                        "text": c.text,
                    }
                )
            else:
                changes.append({"text": c.text})
        ls.link.sync(
            "change",
            {
                "uri": params.text_document.uri,
                "version": params.text_document.version,
                "changes": changes,
            },
        )

    @server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: CodespecServer, params: types.DidCloseTextDocumentParams) -> None:
        ls.completer.forget(params.text_document.uri)
        ls.link.sync("close", {"uri": params.text_document.uri})

    @server.feature(types.WORKSPACE_DID_CHANGE_WORKSPACE_FOLDERS)
    def did_change_folders(
        ls: CodespecServer, params: types.DidChangeWorkspaceFoldersParams
    ) -> None:
        def paths(folders: list[types.WorkspaceFolder]) -> list[str]:
            return [p for f in folders if (p := to_fs_path(f.uri))]

        ls.link.set_folders(paths(params.event.added), paths(params.event.removed))

    # -- completions ------------------------------------------------------------

    async def run_query(ls: CodespecServer, query: CompletionQuery) -> list[Completion]:
        try:
            return await ls.completer.complete(query)
        except DaemonUnavailable as exc:
            ls.show_error_once(f"codespec: {exc}")
            return []
        except DaemonError as exc:
            if exc.code == "cancelled":  # superseded inside the daemon
                return []
            raise _daemon_failure(exc) from None

    def accept_command(ls: CodespecServer, item_id: str, length: int) -> types.Command:
        return types.Command(
            title="codespec: accepted", command=ACCEPT_COMMAND, arguments=[item_id, length]
        )

    @server.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())
    async def inline_completion(
        ls: CodespecServer, params: types.InlineCompletionParams
    ) -> types.InlineCompletionList:
        doc = ls.workspace.get_text_document(params.text_document.uri)
        invoked = params.context.trigger_kind == types.InlineCompletionTriggerKind.Invoked
        completions = await run_query(ls, _query(doc, params.position, invoked))
        items = []
        for c in completions:
            item_id = ls.acceptance.record(c.proposal.text, c.stats)
            rng = _rest_of_line(doc, params.position) if c.proposal.replaces_rest_of_line else None
            items.append(
                types.InlineCompletionItem(
                    insert_text=c.proposal.text,
                    range=rng,
                    command=accept_command(ls, item_id, len(c.proposal.text)),
                )
            )
        return types.InlineCompletionList(items=items)

    @server.feature(types.TEXT_DOCUMENT_COMPLETION)
    async def completion(
        ls: CodespecServer, params: types.CompletionParams
    ) -> types.CompletionList:
        doc = ls.workspace.get_text_document(params.text_document.uri)
        invoked = (
            params.context is None
            or params.context.trigger_kind == types.CompletionTriggerKind.Invoked
        )
        completions = await run_query(ls, _query(doc, params.position, invoked))
        items = []
        for rank, c in enumerate(completions):
            item_id = ls.acceptance.record(c.proposal.text, c.stats)
            rng = (
                _rest_of_line(doc, params.position)
                if c.proposal.replaces_rest_of_line
                else types.Range(params.position, params.position)
            )
            first = next((s for s in c.proposal.text.split("\n") if s.strip()), "").strip()
            items.append(
                types.CompletionItem(
                    label=first[:80] + ("…" if "\n" in c.proposal.text.strip() else ""),
                    kind=types.CompletionItemKind.Text,
                    detail="codespec",
                    sort_text=f"{rank:04d}",
                    filter_text="",
                    insert_text_format=types.InsertTextFormat.PlainText,
                    text_edit=types.TextEdit(rng, c.proposal.text),
                    command=accept_command(ls, item_id, len(c.proposal.text)),
                )
            )
        return types.CompletionList(is_incomplete=True, items=items)

    @server.command(ACCEPT_COMMAND)
    def accept_completion(ls: CodespecServer, *args: Any) -> None:
        if args:
            ls.acceptance.did_accept(str(args[0]), int(args[1]) if len(args) > 1 else None)

    @server.feature(DID_SHOW)
    def did_show(ls: CodespecServer, params: Any) -> None:
        ls.acceptance.did_show(str(_plain(params).get("id", "")))

    @server.feature(DID_ACCEPT)
    def did_accept(ls: CodespecServer, params: Any) -> None:
        p = _plain(params)
        length = p.get("acceptedLength")
        ls.acceptance.did_accept(str(p.get("id", "")), int(length) if length is not None else None)

    # -- edits and status -------------------------------------------------------

    @server.feature(EDIT)
    async def edit(ls: CodespecServer, params: Any) -> dict[str, Any]:
        p = _plain(params)
        uri = p["textDocument"]["uri"]
        doc = ls.workspace.get_text_document(uri)
        version = p["textDocument"].get("version", doc.version)
        token = p.get("token") or ls.next_token()
        request: dict[str, Any] = {
            "uri": uri,
            "range": p["range"],
            "stream": True,
            "speculation": ls.options.speculation,
        }
        if ls.options.edit_max_tokens is not None:
            request["max_tokens"] = ls.options.edit_max_tokens
        for key in ("instruction", "prediction"):
            if p.get(key):
                request[key] = p[key]
        if version is not None:
            request["version"] = version

        def on_delta(frame: dict[str, Any]) -> None:
            ls.protocol.notify(EDIT_DELTA, {"token": token, "uri": uri, "text": frame["text"]})

        try:
            async with ls.link.holding(uri):
                result = await ls.link.request("edit", request, on_delta=on_delta)
        except DaemonUnavailable as exc:
            raise JsonRpcInternalError(f"codespec: {exc}") from None
        except DaemonError as exc:
            raise _daemon_failure(exc) from None
        edits = result.get("edits")
        if edits is None:
            edits = [{"range": result.get("range", p["range"]), "newText": result["text"]}]
        return {
            "token": token,
            "text": result["text"],
            "range": result.get("range", p["range"]),
            "edits": edits,
            "version": version,
            "stats": result.get("stats", {}),
        }

    @server.feature(STATUS)
    async def status(ls: CodespecServer, params: Any) -> dict[str, Any]:
        daemon_stats: dict[str, Any] | None = None
        if ls.link.connected:
            with contextlib.suppress(Exception):
                daemon_stats = await asyncio.wait_for(ls.link.request("stats", {}), 5.0)
        return {
            "connected": ls.link.connected,
            "socket": ls.link.socket_path,
            "daemonStarts": ls.link.starts,
            "connects": ls.link.connects,
            "daemon": ls.link.hello,
            "daemonStats": daemon_stats,
            "completions": ls.acceptance.snapshot(),
            "options": to_wire(ls.options),
        }

    return server


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", default=None, help="daemon socket (default: CODESPEC_SOCKET)")
    parser.add_argument("--log-file", default=None, help="write the server's log to this file")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")


def run(args: argparse.Namespace) -> int:
    """Serve one editor over stdin/stdout until it exits."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="codespec lsp", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
