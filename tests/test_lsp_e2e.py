"""End to end: ``codespec lsp`` as a subprocess speaking LSP over stdio, against a real daemon.

The language server starts the daemon itself (``codespec serve --socket <tmp>``,
detached) the way it does for an editor; the tests talk to it with a small
JSON-RPC driver, as an editor would. The daemon loads the real default model
(SmolLM2-135M-Instruct, from the model cache the session fetched it into); the
tests check the protocol and the invariants of the items, never the quality of
the text.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from codespec.daemon.client import Client, DaemonError
from helpers import alive, daemon_pids

REQUEST_CANCELLED = -32800
INVOKED, AUTOMATIC = 1, 2


class LspDriver:
    """Content-Length framed JSON-RPC over a subprocess's stdin/stdout."""

    def __init__(self, cmd: list[str], env: dict[str, str], stderr_path: Path) -> None:
        self._stderr = open(stderr_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env
        )
        self._next_id = 0
        self._responses: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self.notes: list[dict[str, Any]] = []  # notifications from the server, in order
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        while True:
            length = None
            while True:
                line = out.readline()
                if not line:
                    with self._cond:
                        self._cond.notify_all()
                    return
                if line in (b"\r\n", b"\n"):
                    break
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            assert length is not None
            msg = json.loads(out.read(length))
            if "id" in msg and "method" in msg:  # a request from the server
                self._write({"jsonrpc": "2.0", "id": msg["id"], "result": None})
            elif "id" in msg:
                with self._cond:
                    self._responses[msg["id"]] = msg
                    self._cond.notify_all()
            else:
                with self._cond:
                    self.notes.append(msg)
                    self._cond.notify_all()

    def _write(self, msg: dict[str, Any]) -> None:
        body = json.dumps(msg).encode()
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        self.proc.stdin.flush()

    def send(self, method: str, params: Any) -> int:
        self._next_id += 1
        self._write({"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params})
        return self._next_id

    def notify(self, method: str, params: Any) -> None:
        self._write({"jsonrpc": "2.0", "method": method, "params": params})

    def response(self, rid: int, timeout: float = 30.0) -> dict[str, Any]:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: rid in self._responses or self.proc.poll() is not None, timeout
            )
            assert ok and rid in self._responses, f"no response to request {rid}"
            return self._responses.pop(rid)

    def notification(self, method: str, contains: str, timeout: float = 10.0) -> dict[str, Any]:
        """The first notification ``method`` whose params mention ``contains``."""

        def find() -> dict[str, Any] | None:
            return next(
                (n for n in self.notes if n["method"] == method and contains in json.dumps(n)),
                None,
            )

        with self._cond:
            assert self._cond.wait_for(find, timeout), f"no {method} mentioning {contains!r}"
            return find()  # type: ignore[return-value]

    def request(self, method: str, params: Any, timeout: float = 30.0) -> Any:
        msg = self.response(self.send(method, params), timeout)
        assert "error" not in msg, msg["error"]
        return msg["result"]

    def close(self) -> None:
        try:
            self.request("shutdown", None, timeout=10)
            self.notify("exit", None)
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        finally:
            self._stderr.close()


def wait_until(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def utf16_len(s: str) -> int:
    return len(s.encode("utf-16-le")) // 2


def offset_of(text: str, position: dict[str, int]) -> int:
    """Python offset of an LSP (UTF-16) position in ``text``."""
    lines = text.split("\n")
    start = sum(len(line) + 1 for line in lines[: position["line"]])
    return start + py_index(lines[position["line"]], position["character"])


def py_index(line: str, units: int) -> int:
    """Python index of a UTF-16 column in ``line``."""
    count = 0
    for i, ch in enumerate(line):
        if count >= units:
            return i
        count += 2 if ord(ch) > 0xFFFF else 1
    return len(line)


DOC = """import os


def total(values):
    result = 0
    for v in values:
        result += v
    return result


def greet(name):
    """


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lsp")
    (root / "ws").mkdir()
    (root / "ws" / "util.py").write_text("def helper(x):\n    return x * 2\n")
    e = dict(os.environ)
    e.update(
        OMP_NUM_THREADS="1",
        CODESPEC_TEST_THREADS="1",
        XDG_CONFIG_HOME=str(root / "config"),
        XDG_CACHE_HOME=str(root / "cache"),
        XDG_RUNTIME_DIR=str(root / "run"),
    )
    return {"root": root, "env": e, "socket": str(root / "run" / "d.sock")}


@pytest.fixture(scope="module")
def lsp(env: dict[str, Any]) -> Iterator[LspDriver]:
    cmd = [sys.executable, "-m", "codespec.daemon.cli", "lsp", "--socket", env["socket"]]
    driver = LspDriver(cmd, env["env"], env["root"] / "lsp.log")
    root = env["root"]
    driver.initialize = driver.request(  # type: ignore[attr-defined]
        "initialize",
        {
            "processId": os.getpid(),
            "rootUri": (root / "ws").as_uri(),
            "workspaceFolders": [{"uri": (root / "ws").as_uri(), "name": "ws"}],
            "capabilities": {
                "general": {"positionEncodings": ["utf-8", "utf-16"]},
                "textDocument": {"inlineCompletion": {}},
            },
            "initializationOptions": {
                "debounceMs": 0,
                "maxTokens": 24,
                "invokedItems": 3,
                "startTimeout": 60,
                "serveArgs": ["--device", "cpu"],
                "maxLines": 0,  # bad: reported, and the default used
            },
        },
    )
    driver.notify("initialized", {})
    yield driver
    driver.close()
    try:
        with Client(env["socket"], timeout=5) as c:
            c.request("shutdown", {})
    except (DaemonError, OSError):
        pass
    for pid in daemon_pids(env["socket"]):
        try:
            wait_until(lambda p=pid: not alive(p), 5, "daemon exit")
        except AssertionError:
            os.kill(pid, signal.SIGKILL)


def open_doc(lsp: LspDriver, env: dict[str, Any], name: str, text: str) -> str:
    uri = (env["root"] / "ws" / name).as_uri()
    lsp.notify(
        "textDocument/didOpen",
        {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": text}},
    )
    return uri


def inline(lsp: LspDriver, uri: str, line: int, character: int, kind: int = INVOKED) -> list:
    result = lsp.request(
        "textDocument/inlineCompletion",
        {
            "textDocument": {"uri": uri},
            "position": {"line": line, "character": character},
            "context": {"triggerKind": kind},
        },
        timeout=60,
    )
    return result["items"]


def status(lsp: LspDriver) -> dict[str, Any]:
    return lsp.request("codespec/status", {}, timeout=30)


def requests_stats(lsp: LspDriver) -> dict[str, Any]:
    """The daemon's request counters (waits for the language server to be connected)."""
    st = wait_until(lambda: (s := status(lsp))["daemonStats"] and s, 60, "the daemon connection")
    return st["daemonStats"]["requests"]


def test_initialize_advertises_inline_completion_and_utf16(lsp: LspDriver) -> None:
    caps = lsp.initialize["capabilities"]  # type: ignore[attr-defined]
    assert caps["positionEncoding"] == "utf-16"  # even though the client preferred utf-8
    assert caps["inlineCompletionProvider"] is not None
    assert caps["completionProvider"] is not None
    assert caps["textDocumentSync"]["change"] == 2  # incremental
    assert "codespec.acceptCompletion" in caps["executeCommandProvider"]["commands"]


def test_bad_initialization_option_is_shown_and_defaulted(lsp: LspDriver) -> None:
    note = lsp.notification("window/showMessage", "maxLines")
    assert note["params"]["type"] == 2  # warning
    assert status(lsp)["options"]["maxLines"] == 16


def test_workspace_folders_are_indexed_by_the_daemon(lsp: LspDriver, env: dict[str, Any]) -> None:
    requests_stats(lsp)  # connected
    ws = str((env["root"] / "ws").resolve())
    folders = wait_until(
        lambda: status(lsp)["daemonStats"]["workspace"]["folders"], 10, "workspace folders"
    )
    assert ws in folders
    extra = env["root"] / "extra"
    extra.mkdir()
    (extra / "more.py").write_text("VALUE = 1\n")
    lsp.notify(
        "workspace/didChangeWorkspaceFolders",
        {"event": {"added": [{"uri": extra.as_uri(), "name": "extra"}], "removed": []}},
    )
    wait_until(
        lambda: str(extra.resolve()) in status(lsp)["daemonStats"]["workspace"]["folders"],
        10,
        "the added folder",
    )


def test_completion_fallback_returns_text_edits_at_the_cursor(
    lsp: LspDriver, env: dict[str, Any]
) -> None:
    uri = open_doc(lsp, env, "fallback.py", DOC)
    result = lsp.request(
        "textDocument/completion",
        {"textDocument": {"uri": uri}, "position": {"line": 11, "character": 4}},
        timeout=60,
    )
    assert result["isIncomplete"] is True
    assert result["items"], "the model proposed nothing at the start of a function body"
    for item in result["items"]:
        assert item["textEdit"]["range"]["start"] == {"line": 11, "character": 4}
        assert item["textEdit"]["newText"].strip()


def test_inline_completion_items_for_several_cursor_positions(
    lsp: LspDriver, env: dict[str, Any]
) -> None:
    uri = open_doc(lsp, env, "several.py", DOC)
    lines = DOC.split("\n")
    positions = [
        (11, 4),  # blank body line of greet(): multi-line
        (3, len(lines[3])),  # end of "def total(values):": opens a block
        (5, len("    for v in ")),  # mid-line, text to the right: single line
        (7, len("    return ")),  # end of a statement being typed
    ]
    produced = 0
    for line, character in positions:
        after = lines[line][character:]
        for kind, most in ((INVOKED, 3), (AUTOMATIC, 1)):
            items = inline(lsp, uri, line, character, kind)
            assert len(items) <= most
            texts = [item["insertText"] for item in items]
            assert len(set(texts)) == len(texts), "duplicates"
            for item in items:
                text = item["insertText"]
                assert text.strip(), "empty or whitespace-only item"
                assert text == text.rstrip(), "trailing whitespace"
                if after.strip():
                    assert "\n" not in text, "multi-line item with text right of the cursor"
                    assert not text.endswith(after.strip()), "repeats the rest of the line"
                if "range" in item:
                    assert item["range"]["start"] == {"line": line, "character": character}
                    assert item["range"]["end"] == {"line": line, "character": len(lines[line])}
                assert item["command"]["command"] == "codespec.acceptCompletion"
            produced += len(items)
    assert produced > 0, "no position produced any item"
    st = status(lsp)
    assert st["connected"] and st["daemon"]["model"] == "SmolLM2-135M-Instruct"
    assert st["daemon"]["capabilities"]["fim"] is False  # its tokenizer has no FIM tokens


def test_accepting_an_item_is_counted(lsp: LspDriver, env: dict[str, Any]) -> None:
    uri = open_doc(lsp, env, "accept.py", DOC)
    items = inline(lsp, uri, 11, 4)
    assert items, "the model proposed nothing at the start of a function body"
    before = status(lsp)["completions"]
    command = items[0]["command"]
    lsp.notify("codespec/didShowCompletion", {"id": command["arguments"][0]})
    lsp.request(
        "workspace/executeCommand",
        {"command": command["command"], "arguments": command["arguments"]},
    )
    after = status(lsp)["completions"]
    assert after["shown"] == before["shown"] + 1
    assert after["accepted"] == before["accepted"] + 1
    assert after["accepted_chars"] == before["accepted_chars"] + len(items[0]["insertText"])


def test_cancelled_request_returns_quickly_and_cancels_the_daemon_request(
    lsp: LspDriver, env: dict[str, Any]
) -> None:
    uri = open_doc(lsp, env, "cancel.py", DOC)
    before = requests_stats(lsp)
    # Invoked at a multi-line position: three 24-token generations, seconds on a CPU.
    rid = lsp.send(
        "textDocument/inlineCompletion",
        {
            "textDocument": {"uri": uri},
            "position": {"line": 11, "character": 4},
            "context": {"triggerKind": INVOKED},
        },
    )
    wait_until(lambda: requests_stats(lsp)["in_flight"] > 0, 20, "the daemon to start")
    lsp.notify("$/cancelRequest", {"id": rid})
    msg = lsp.response(rid, timeout=10)
    assert "error" in msg and msg["error"]["code"] == REQUEST_CANCELLED, msg
    after = wait_until(
        lambda: (r := requests_stats(lsp))["in_flight"] + r["queued"] == 0 and r,
        10,
        "an idle daemon",
    )
    assert after["cancelled"] > before["cancelled"], (before, after)
    # the reply did not wait for the generations: they were cut, not run to their end
    assert after["served"] - before["served"] < 3, (before, after)


def test_utf16_positions_on_lines_with_non_ascii_characters(
    lsp: LspDriver, env: dict[str, Any]
) -> None:
    text = 'name = "héllo😀"\nprint(f(name))\n'
    uri = open_doc(lsp, env, "utf16.py", text)
    # Insert after the emoji: UTF-16 column 15 (the emoji is two units), Python index 14.
    col = utf16_len('name = "héllo😀')
    lsp.notify(
        "textDocument/didChange",
        {
            "textDocument": {"uri": uri, "version": 2},
            "contentChanges": [
                {
                    "range": {
                        "start": {"line": 0, "character": col},
                        "end": {"line": 0, "character": col},
                    },
                    "text": "ü😀",
                }
            ],
        },
    )
    text = 'name = "héllo😀ü😀"\nprint(f(name))\n'
    line0 = text.split("\n")[0]
    # (Where a range item ends on such a line: test_lsp_server.py, in-process.)
    # Rewrite the tail of line 0 from a UTF-16 column after both emoji: the daemon's
    # edits apply to our copy of the text only if it applied the change where we did.
    start_units = utf16_len('name = "héllo😀ü😀')
    rng = {
        "start": {"line": 0, "character": start_units},
        "end": {"line": 0, "character": utf16_len(line0)},
    }
    result = lsp.request(
        "codespec/edit",
        {"textDocument": {"uri": uri, "version": 2}, "range": rng, "token": "t-utf16"},
        timeout=60,
    )
    assert result["range"] == rng
    assert result["token"] == "t-utf16"
    deltas = [
        n["params"]["text"]
        for n in list(lsp.notes)
        if n["method"] == "codespec/editDelta" and n["params"]["token"] == "t-utf16"
    ]
    assert "".join(deltas) == result["text"]
    applied = text
    for edit in sorted(result["edits"], key=lambda e: offset_of(text, e["range"]["start"]))[::-1]:
        a, b = offset_of(text, edit["range"]["start"]), offset_of(text, edit["range"]["end"])
        applied = applied[:a] + edit["newText"] + applied[b:]
    a, b = offset_of(text, rng["start"]), offset_of(text, rng["end"])
    assert applied == text[:a] + result["text"] + text[b:]


def test_daemon_killed_next_request_restarts_and_resyncs(
    lsp: LspDriver, env: dict[str, Any]
) -> None:
    uri = open_doc(lsp, env, "restart.py", DOC)
    inline(lsp, uri, 11, 4, AUTOMATIC)  # the document is open in the daemon
    starts = status(lsp)["daemonStarts"]
    pids = daemon_pids(env["socket"])
    assert pids, "no daemon process found"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not any(alive(p) for p in pids), 10, "daemon death")
    # Edit while the daemon is down: the restart must carry this version.
    lsp.notify(
        "textDocument/didChange",
        {
            "textDocument": {"uri": uri, "version": 7},
            "contentChanges": [
                {
                    "range": {
                        "start": {"line": 11, "character": 4},
                        "end": {"line": 11, "character": 4},
                    },
                    "text": "message = ",
                }
            ],
        },
    )
    items = inline(lsp, uri, 11, 4 + len("message = "), AUTOMATIC)
    assert isinstance(items, list)  # an answer, not an error: the restart happened inside it
    st = status(lsp)
    assert st["connected"] and st["daemonStarts"] == starts + 1, {
        k: st[k] for k in ("connected", "daemonStarts", "connects", "socket")
    }
    # The new daemon holds the document at the editor's latest version.
    with Client(env["socket"], timeout=10) as c:
        r = c.request(
            "complete",
            {
                "uri": uri,
                "version": 7,
                "position": {"line": 11, "character": 14},
                "max_tokens": 2,
            },
        )
    assert "text" in r


def test_edit_reopens_a_document_the_daemon_lost(lsp: LspDriver, env: dict[str, Any]) -> None:
    """``codespec/edit`` for a document the daemon no longer has (another client closed
    it, or the daemon restarted between the sync and the edit): the language server
    re-opens it with its text and retries, as it does for completions."""
    text = "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n"
    uri = open_doc(lsp, env, "lost.py", text)
    requests_stats(lsp)  # connected: the document reaches the daemon

    def close_in_daemon(c: Client) -> bool:
        try:
            c.request("close", {"uri": uri})
            return True
        except DaemonError as exc:
            if exc.code != "unknown_document":
                raise
            return False  # not synced yet

    with Client(env["socket"], timeout=10) as c:
        wait_until(lambda: close_in_daemon(c), 10, "the document in the daemon")
    rng = {"start": {"line": 1, "character": 0}, "end": {"line": 2, "character": 0}}
    msg = lsp.response(
        lsp.send(
            "codespec/edit",
            {"textDocument": {"uri": uri, "version": 1}, "range": rng, "token": "t-lost"},
        ),
        timeout=60,
    )
    assert "error" not in msg, msg["error"]
    result = msg["result"]
    assert result["range"] == rng and result["version"] == 1 and result["token"] == "t-lost"
    with Client(env["socket"], timeout=10) as c:  # re-opened at the editor's version
        r = c.request("complete", {"uri": uri, "version": 1, "max_tokens": 1,
                                   "position": {"line": 4, "character": 0}})  # fmt: skip
    assert "text" in r
