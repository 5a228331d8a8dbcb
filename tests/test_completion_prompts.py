"""Completions and edits of the real default model at real positions, through the daemon.

The file is the interpreter's ``json/decoder.py``. Each position empties one body line
and puts the cursor on it (a new, empty line inside a function, the way a programmer
starts a line), or stands mid-line right after ``self.`` / ``from `` /
``import ``. Checked: the completion is not empty, its indentation is the real line's
(the old default's every completion started with 4 extra spaces; a prompt ending in a
lone ``"\\n"`` token made SmolLM2 write at column 0), nothing starts with a space a
mid-line cursor already has, and a multi-line completion stops before the code that
follows the cursor. (Where the model's best guess for the emptied line is the line that
follows it, the right answer is an empty completion; the positions here are lines where
it guesses something else.)
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

import pytest

from codespec.daemon.client import Client
from codespec.daemon.prompts.completion import file_label, shape
from conftest import ServerThread, daemon_config

SOURCE = Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py"
# 1-based lines of body statements inside functions (removed; the cursor stands there)
BODY_LINES = [37, 62, 111, 118, 139, 145, 222, 293, 337, 352]
MID_LINE = [(320, "        self."), (5, "from "), (7, "    from ")]


@pytest.fixture(scope="module")
def real_daemon(real_engine, tmp_path_factory):
    srv = ServerThread(daemon_config(tmp_path_factory.mktemp("real")), real_engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(real_daemon):
    with Client(real_daemon.socket_path) as c:
        yield c


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _next_code_line(lines: list[str], after: int) -> str:
    return next(s for s in lines[after:] if s.strip())


@pytest.mark.parametrize("line_no", BODY_LINES)
def test_a_new_line_in_a_body_is_indented_right(client, line_no):
    lines = SOURCE.read_text(encoding="utf-8").splitlines(keepends=True)
    real = lines[line_no - 1]
    assert real.strip(), "the fixture line must be code"
    text = "".join([*lines[: line_no - 1], "\n", *lines[line_no:]])  # the line emptied
    uri = f"file:///heldout/{line_no}/decoder.py"
    client.request("open", {"uri": uri, "text": text, "language": "python"})
    try:
        pos = {"line": line_no - 1, "character": 0}
        one = client.request("complete", {"uri": uri, "position": pos})
        multi = client.request("complete", {"uri": uri, "position": pos, "multiline": True})
    finally:
        client.request("close", {"uri": uri})
    first = one["text"]
    assert first.strip(), f"empty completion at line {line_no}"
    assert _indent(first) == _indent(real), (line_no, first, real)
    assert multi["text"].startswith(first.rstrip())
    following = _next_code_line(lines, line_no).strip()  # the code after the cursor
    written = [s.strip() for s in multi["text"].split("\n")[1:]]
    assert following not in written, (line_no, multi["text"])


@pytest.mark.parametrize(("line_no", "typed"), MID_LINE)
def test_mid_line_completions_do_not_repeat_the_space(client, line_no, typed):
    lines = SOURCE.read_text(encoding="utf-8").splitlines(keepends=True)
    assert lines[line_no - 1].startswith(typed)
    text = "".join(lines[: line_no - 1]) + typed + "\n" + "".join(lines[line_no:])
    uri = f"file:///heldout/mid{line_no}/decoder.py"
    client.request("open", {"uri": uri, "text": text})
    try:
        pos = {"line": line_no - 1, "character": len(typed)}
        got = client.request("complete", {"uri": uri, "position": pos})["text"]
    finally:
        client.request("close", {"uri": uri})
    assert got.strip() and not got[0].isspace(), (typed, got)


def test_an_edit_copies_its_draft_and_answers_with_the_region_only(client):
    """``continue`` mode (SmolLM2 has no FIM tokens): the new region is code that
    starts with the old region's first line, ends before the code after the region,
    and carries no fence or prose; with the old region as an exact prediction, the
    answer is that prediction."""
    lines = SOURCE.read_text(encoding="utf-8").splitlines(keepends=True)
    text = "".join(lines)
    start = sum(len(s) for s in lines[:331])  # `def decode` (line 332) ...
    end = sum(len(s) for s in lines[:341])  # ... through line 341
    old = text[start:end]
    uri = "file:///heldout/edit/decoder.py"
    client.request("open", {"uri": uri, "text": text})
    try:
        doc_start = {"line": 331, "character": 0}
        rng = {"start": doc_start, "end": {"line": 341, "character": 0}}
        # the exact prediction first: the plain request after it, over the same prompt, may
        # be served from the model's choices it left beside the cache (recall)
        exact = client.request("edit", {"uri": uri, "range": rng, "prediction": old})
        plain = client.request("edit", {"uri": uri, "range": rng})
    finally:
        client.request("close", {"uri": uri})
    assert plain["mode"] == "continue"
    new = plain["text"]
    assert new.startswith(old.split("\n", 1)[0] + "\n")
    assert "```" not in new and not new.lstrip().startswith(("Here", "The "))
    assert "def raw_decode" not in new  # the code after the region is not written
    assert new.endswith("\n") and old.endswith("\n")
    assert exact["text"].startswith(old.split("\n", 1)[0])
    assert exact["stats"]["tokens_per_forward"] >= 2.0  # the prediction's drafts accepted
    assert plain["text"] == exact["text"]  # greedy over the same prompt, however served


def test_shape_keeps_whole_lines_when_cut():
    assert shape("a = 1\nb = 2\nfor x in", True, "length") == "a = 1\nb = 2"
    assert shape("a = 1\nif x:\n", True, "loop") == "a = 1"
    assert shape("a = 1\nb", True, "stop") == "a = 1\nb"
    assert shape("a = 1\nb = 2", False, "length") == "a = 1"


def test_file_label_is_the_last_two_path_parts():
    assert file_label("file:///home/u/pkg/mod/a%20b.py") == "mod/a b.py"
    assert file_label("untitled") == "untitled"


def _complete(client, text: str, line: int, character: int, **params) -> dict:
    """One completion of ``text`` opened as a new document; the result."""
    uri = f"file:///newcomer/{abs(hash((text, line, character)))}/s3.py"
    client.request("open", {"uri": uri, "text": text, "language": "python"})
    try:
        pos = {"line": line, "character": character}
        return client.request("complete", {"uri": uri, "position": pos, **params})
    finally:
        client.request("close", {"uri": uri})


def test_a_fresh_indented_line_gets_no_second_indentation(client):
    """Issue 47: ``def add(a, b):`` then a line of 4 spaces, the cursor after them: the
    completion does not write the indentation again (it gave ``    if a == b:``)."""
    for text in ("def add(a, b):\n    \n", "def f():\n    "):
        got = _complete(client, text, 1, 4)["text"]
        assert got.strip() and not got[0].isspace(), (text, got)


def test_the_top_of_a_file_completes_code_not_prose(client):
    """Issue 47: ``import `` at the top of a file gave ``and remove the last n elements of
    a list.``: the line completed is a Python statement."""
    got = _complete(client, "import \n", 0, 7)["text"]
    assert got.strip()
    ast.parse("import " + got)


def test_a_word_before_the_rest_of_its_line_gets_no_prose(client):
    """Issue 47: ``import json`` with the cursor after ``import`` gave
    ``-to-be-used-in-the-making-of-a``."""
    got = _complete(client, "import json\n", 0, 6)["text"]
    assert "-" not in got and len(got.split()) <= 2, got


def test_an_empty_file_completes_to_nothing(client):
    """Issue 47: an empty (or blank) document gives an empty result, not an error."""
    for text in ("", "\n\n  \n"):
        r = _complete(client, text, 0, 0)
        assert r["text"] == "" and r["finish_reason"] == "stop"


def test_a_completion_never_starts_with_a_markdown_fence(client):
    """Issue 47: after ``def f():\\n    return 1\\n`` SmolLM2 closes a chat answer's code
    block (```` ``` ````), then writes prose."""
    text = "def f():\n    return 1\n"
    one = _complete(client, text, 2, 0)
    multi = _complete(client, text, 2, 0, multiline=True)
    assert "```" not in one["text"] and "```" not in multi["text"], (one, multi)


def test_a_single_line_completion_ends_at_the_line_end_not_at_a_small_cap(client):
    """Issue 47: a single-line completion with no max_tokens stopped at 16 tokens, mid
    string. A list of a long string copied: the copy is the whole line (over 16 tokens),
    ended by the line's end."""
    line = '    "the quick brown fox jumps over the lazy dog, then runs far into the forest",'
    text = "WORDS = [\n" + (line + "\n") * 3 + '    "\n]\n'
    r = _complete(client, text, 4, 5)
    assert r["text"] == line[5:], r
    assert r["finish_reason"] == "stop" and r["stats"]["tokens"] > 16
