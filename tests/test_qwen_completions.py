"""Issue 47's completion cases and an edit on the real Qwen2.5-Coder-0.5B-Instruct, the
product's default model, through a daemon (skipped where the model is not on the machine):
FIM prompts, the suffix stop, the indentation cap, fences, the default token cap, an
empty file, and an edit through the chat template."""

from __future__ import annotations

import ast

import pytest
from qwen_local import qwen_dir

from codespec.daemon.client import Client
from conftest import ServerThread, daemon_config


@pytest.fixture(scope="module")
def qwen_engine(request):
    from codespec.daemon.engine.engine import Engine

    return Engine(qwen_dir(request))


def _serve(engine, folder, recall: bool):
    config = daemon_config(folder)
    config.completion.warm_after_s = 0  # no warm-ups: the prefix cache holds what requests fed
    config.speculation.recall = recall
    srv = ServerThread(config, engine)
    try:
        with Client(srv.socket_path) as c:
            yield c
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(qwen_engine, tmp_path_factory):
    """A daemon with recall off: every request's tokens come from its own forwards, so
    ``auto`` against ``off`` at one spot compares two decodings."""
    yield from _serve(qwen_engine, tmp_path_factory.mktemp("qwen"), recall=False)


@pytest.fixture(scope="module")
def recall_client(qwen_engine, tmp_path_factory):
    """The same engine served with the defaults (recall on)."""
    yield from _serve(qwen_engine, tmp_path_factory.mktemp("qwen_recall"), recall=True)


def _open(client, text: str) -> str:
    uri = f"file:///newcomer/{abs(hash(text))}/s3.py"
    client.request("open", {"uri": uri, "text": text, "language": "python"})
    return uri


def _complete(client, text: str, line: int, character: int, **params) -> dict:
    uri = _open(client, text)
    try:
        pos = {"line": line, "character": character}
        return client.request("complete", {"uri": uri, "position": pos, **params})
    finally:
        client.request("close", {"uri": uri})


def test_issue_47_cases_on_qwen(client):
    """A fresh indented line gets no second indentation; ``import `` completes to an
    import; ``import|json`` writes nothing the rest of the line already has; an empty file
    gives nothing; no completion carries a Markdown fence (Qwen closed a fence after
    ``print(f())`` and explained the code)."""
    got = _complete(client, "def add(a, b):\n    \n", 1, 4)["text"]
    assert got.strip() and not got[0].isspace(), got
    got = _complete(client, "import \n", 0, 7)["text"]
    ast.parse("import " + got)
    got = _complete(client, "import json\n", 0, 6)["text"]
    assert "json" not in got and len(got.split()) <= 2, got
    assert _complete(client, "", 0, 0)["text"] == ""
    text = "def f():\n    return 1\n"
    multi = _complete(client, text, 2, 0, multiline=True)["text"]
    assert "```" not in multi, multi


def test_a_long_line_is_completed_whole_on_qwen(client):
    """No max_tokens: the copied line (over 16 tokens) ends at the line's end."""
    line = '    "the quick brown fox jumps over the lazy dog, then runs far into the forest",'
    text = "WORDS = [\n" + (line + "\n") * 3 + '    "\n]\n'
    r = _complete(client, text, 4, 5)
    assert r["text"] == line[5:], r
    assert r["finish_reason"] == "stop" and r["stats"]["tokens"] > 16


def test_an_edit_on_qwen_goes_through_its_chat_template(client):
    """``auto`` is ``chat`` for Qwen2.5-Coder-Instruct: the new region is the region's
    code (not the file around it, no fence, no prose), ending with the old region's line
    break."""
    text = "import math\n\n\ndef area(r):\n    return 3.14 * r * r\n\n\nprint(area(2))\n"
    uri = _open(client, text)
    try:
        rng = {"start": {"line": 3, "character": 0}, "end": {"line": 5, "character": 0}}
        r = client.request("edit", {"uri": uri, "range": rng,
                                    "instruction": "rename r to radius"})  # fmt: skip
    finally:
        client.request("close", {"uri": uri})
    assert r["mode"] == "chat"
    new = r["text"]
    assert "```" not in new and new.endswith("\n"), new
    assert new.startswith("def area(") and "import" not in new and "print" not in new, new
    ast.parse(new)


def test_a_keystroke_on_a_line_re_feeds_a_token_or_two_on_qwen(client):
    """Typing at the end of a line with code after it: each keystroke's completion finds
    its prompt cached up to the line's last token or two (the FIM middle starts at the
    line's start), not re-feeding the suffix after the cursor."""
    head = "def total(values):\n    result = 0\n    for value in values:\n        res"
    tail = "\n    return result\n\n\nprint(total([1, 2, 3]))\n"
    uri = _open(client, head + tail)
    try:
        line, col = 3, len("        res")
        client.request("complete", {"uri": uri, "position": {"line": line, "character": col}})
        for version, ch in enumerate("ult +", start=1):
            pos = {"line": line, "character": col}
            client.request("change", {"uri": uri, "version": version, "changes": [
                {"range": {"start": pos, "end": pos}, "text": ch}]})  # fmt: skip
            col += 1
            pos = {"line": line, "character": col}
            r = client.request("complete", {"uri": uri, "position": pos})
            fed = r["stats"]["prompt_tokens"] - r["stats"]["cached_tokens"]
            assert fed <= 2, (ch, r["stats"])
    finally:
        client.request("close", {"uri": uri})


def test_typing_along_the_ghost_text_gives_plain_decodings_lines_on_qwen(client):
    """Each keystroke that types the ghost text's next character: ``auto`` (its first
    forward a lead step where the prompt is cached but its last token, the draft the last
    completion there, verified under token healing) gives the line ``off`` gives at the
    same spot, on the real model's int8 products."""
    head = "import os\n\n\ndef list_python_files(folder):\n    names = []\n    for name in os.l"
    tail = "\n    return names\n"
    uri = _open(client, head + tail)
    leads, texts = 0, []
    try:
        line, col = 5, len("    for name in os.l")
        for version in range(1, 7):
            pos = {"line": line, "character": col}
            auto = client.request("complete", {"uri": uri, "position": pos,
                                               "speculation": "auto"})  # fmt: skip
            off = client.request("complete", {"uri": uri, "position": pos, "speculation": "off"})
            assert auto["text"] == off["text"], (version, auto["stats"], off["stats"])
            leads += auto["stats"]["lead_steps"]
            texts.append(auto["text"])
            ch = auto["text"][:1] or "x"
            client.request("change", {"uri": uri, "version": version, "changes": [
                {"range": {"start": pos, "end": pos}, "text": ch}]})  # fmt: skip
            col += 1
    finally:
        client.request("close", {"uri": uri})
    assert leads >= 3  # most keystrokes found their prompt cached but its last token
    assert sum(len(t) > 3 for t in texts) >= 3, texts  # lines, not empty answers


def test_typing_along_the_ghost_text_recalls_plain_decodings_lines_on_qwen(client, recall_client):
    """With recall (the default), each keystroke that types the ghost text's next
    character is served from the choices the last completion left beside the cache, under
    Qwen's token healing, and gives the line plain decoding gives at the same spot (``off``
    on the daemon without recall, over the same engine)."""
    head = "import os\n\n\ndef list_python_files(folder):\n    names = []\n    for name in os.l"
    tail = "\n    return names\n"
    text = head + tail
    uris = [_open(c, text) for c in (recall_client, client)]
    recalled, texts = 0, []
    try:
        line, col = 5, len("    for name in os.l")
        for version in range(1, 7):
            pos = {"line": line, "character": col}
            r = recall_client.request("complete", {"uri": uris[0], "position": pos})
            off = client.request("complete", {"uri": uris[1], "position": pos,
                                              "speculation": "off"})  # fmt: skip
            assert r["text"] == off["text"], (version, r["stats"], off["stats"])
            assert off["stats"]["recalled"] == 0
            recalled += r["stats"]["recalled"] > 0
            texts.append(r["text"])
            ch = r["text"][:1] or "x"
            for c, uri in zip((recall_client, client), uris, strict=True):
                c.request("change", {"uri": uri, "version": version, "changes": [
                    {"range": {"start": pos, "end": pos}, "text": ch}]})  # fmt: skip
            col += 1
    finally:
        for c, uri in zip((recall_client, client), uris, strict=True):
            c.request("close", {"uri": uri})
    assert recalled >= 4, texts  # every keystroke typed what the ghost text showed
    assert sum(len(t) > 3 for t in texts) >= 3, texts
