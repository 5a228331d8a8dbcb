"""The language server's handlers in-process: registration, LSP <-> daemon conversions,
and the one State object (no editor, no daemon)."""

from __future__ import annotations

from lsprotocol import types
from pygls.workspace import TextDocument

from codespec.lsp import server
from codespec.lsp.completion import Completion
from codespec.lsp.options import Options
from codespec.lsp.postprocess import Proposal

LINE = 'name = "héllo😀"; f(name)'  # the emoji is two UTF-16 units


def test_every_feature_is_registered_by_make_server() -> None:
    ls = server.make_server("/tmp/codespec-test.sock")
    features = ls.protocol.fm.features
    for name, _, _ in server.FEATURES:
        assert name in features, name
    assert server.ACCEPT_COMMAND in ls.protocol.fm.commands
    inline = ls.protocol.fm.feature_options[types.TEXT_DOCUMENT_INLINE_COMPLETION]
    # pygls advertises inlineCompletionProvider only for a feature registered with
    # InlineCompletionOptions (without them, editors never ask for inline completions)
    assert isinstance(inline, types.InlineCompletionOptions)
    assert ls.state.options.socket == "/tmp/codespec-test.sock"


def test_initialize_options_keep_the_command_line_socket_and_the_counters() -> None:
    ls = server.make_server("/tmp/cli.sock")
    item = ls.state.acceptance.record("x", None)
    params = types.InitializeParams(
        capabilities=types.ClientCapabilities(), initialization_options={"maxTokens": 0}
    )
    server.initialize(ls, params)
    assert ls.state.options.socket == "/tmp/cli.sock"
    assert ls.state.options.max_tokens == Options().max_tokens
    assert len(ls.state.problems) == 1 and "maxTokens" in ls.state.problems[0]
    assert ls.state.acceptance.did_show(item)  # the same counters after re-configuring
    server.initialize(
        ls,
        types.InitializeParams(
            capabilities=types.ClientCapabilities(), initialization_options={"socket": "/s"}
        ),
    )
    assert ls.state.options.socket == "/s" and ls.state.link.socket_path == "/s"


def test_rest_of_line_ends_at_the_utf16_end() -> None:
    doc = TextDocument("file:///u.py", LINE + "\n")
    rng = server._rest_of_line(doc, types.Position(0, 18))
    assert rng.start == types.Position(0, 18)
    assert rng.end == types.Position(0, len(LINE.encode("utf-16-le")) // 2)
    assert rng.end.character == len(LINE) + 1


def test_query_keeps_utf16_positions_and_reads_the_cursor_context() -> None:
    doc = TextDocument("file:///u.py", LINE + "\n", version=3)
    col = len('name = "héllo😀"; f('.encode("utf-16-le")) // 2
    q = server._query(doc, types.Position(0, col), invoked=True)
    assert q.position == {"line": 0, "character": col} and q.version == 3 and q.invoked
    assert q.context.before.endswith("; f(") and q.context.after == "name)"


def test_content_changes_become_daemon_changes() -> None:
    partial = types.TextDocumentContentChangePartial(
        range=types.Range(types.Position(1, 2), types.Position(1, 4)), text="xy"
    )
    whole = types.TextDocumentContentChangeWholeDocument(text="all")
    assert server._change_map(partial) == {
        "range": {"start": {"line": 1, "character": 2}, "end": {"line": 1, "character": 4}},
        "text": "xy",
    }
    assert server._change_map(whole) == {"text": "all"}


def test_edit_request_carries_the_uri_version_and_options() -> None:
    rng = {"start": {"line": 0, "character": 0}, "end": {"line": 1, "character": 0}}
    p = {"textDocument": {"uri": "file:///e.py"}, "range": rng, "instruction": "rename",
         "prediction": ""}  # fmt: skip
    req = server._edit_request(Options(edit_max_tokens=40, speculation="off"), p, 7)
    assert req == {
        "uri": "file:///e.py",
        "range": rng,
        "stream": True,
        "speculation": "off",
        "max_tokens": 40,
        "instruction": "rename",
        "version": 7,
    }


def test_completion_items_replace_the_rest_of_the_line_or_insert() -> None:
    ls = server.make_server()
    doc = TextDocument("file:///u.py", LINE + "\n")
    at = types.Position(0, 18)
    plain = Completion(Proposal("a(b)\n    return c"), {})
    ranged = Completion(Proposal("name, 2)", replaces_rest_of_line=True), {})
    first = server._completion_item(ls, doc, at, 0, plain)
    assert first.label == "a(b)…" and first.text_edit.range == types.Range(at, at)
    assert first.sort_text == "0000" and first.command.arguments[1] == len(plain.proposal.text)
    second = server._completion_item(ls, doc, at, 1, ranged)
    assert second.text_edit.range == server._rest_of_line(doc, at)
    assert ls.state.acceptance.snapshot()["shown"] == 0  # recorded, not yet shown
