"""Config, document store, edit diffs, the workspace watcher, and the chat-template edit path."""

from __future__ import annotations

import json
import random
import threading

import pytest

from codespec.daemon.client import Client
from codespec.daemon.config import ConfigError, load_config
from codespec.daemon.prompts import completion
from codespec.daemon.service.documents import DocumentStore
from codespec.daemon.service.protocol import ProtocolError
from codespec.daemon.service.workspace import IgnoreRules, Workspace
from codespec.ngram_index.positions import TextDocument, apply_changes
from conftest import ServerThread, daemon_config, tiny_model_dir


def test_config_file_and_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert load_config().limits.max_queue == 32  # no file: defaults
    assert load_config().limits.kv_slots == 8
    (tmp_path / "codespec").mkdir()
    cfg = tmp_path / "codespec" / "config.toml"
    cfg.write_text('device = "cpu"\n[speculation]\ndefault = "off"\nmax_draft = 4\n')
    c = load_config()
    assert c.device == "cpu" and c.speculation.default == "off" and c.speculation.max_draft == 4
    for text, fragment in [
        ("device = 'tpu'\n", "device: must be one of auto, cpu, cuda, got 'tpu'"),
        ("[limits]\nmax_queue = 0\n", "limits.max_queue: expected `int` >= 1"),
        ("[limits]\nmax_queue = true\n", "limits.max_queue: expected `int`, got `bool`"),
        ("[workspace]\ndebounce_s = 'soon'\n", "workspace.debounce_s: expected `float`"),
        ("colour = 1\n", "colour: unknown key"),
        ("[limits]\ncolour = 1\n", "limits.colour: unknown key"),
        ("[speculation]\ndefault = 'magic'\n", "speculation: default must be one of"),
        ("[speculation]\ndefault = 'auto-ngram'\n", "speculation: default must be one of"),
        ("[speculation]\nshorten_at = 33\n", "speculation: off_at must be >= shorten_at"),
        ("[limits]\ncontext_tokens = 10\n", "limits.context_tokens: expected `int` >= 64"),
        ("[limits]\nkv_slots = 0\n", "limits.kv_slots: expected `int` >= 1"),
        ("[completion]\ncontext = 'all'\n", "completion.context: must be one of none, header"),
        ("limits = 3\n", "limits: expected `object`, got `int`"),
        ("model = \n", "not valid TOML"),
    ]:
        cfg.write_text(text)
        with pytest.raises(ConfigError) as err:
            load_config()
        assert fragment in str(err.value) and str(err.value).startswith(str(cfg))
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    cfg.write_text("[speculation]\ndefault = 'auto-eagle'\n")  # auto without EAGLE
    assert load_config().speculation.default == "auto-eagle"
    cfg.write_text("[workspace]\ndebounce_s = 1\n")  # an integer for a float is fine
    assert load_config().workspace.debounce_s == 1.0


def test_command_line_overrides_win_over_the_file_and_are_checked(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('device = "cuda"\nsocket = "/from/file.sock"\n')
    c = load_config(cfg, overrides={"device": "cpu", "socket": None, "model": "m"})
    assert (c.device, c.socket, c.model) == ("cpu", "/from/file.sock", "m")
    with pytest.raises(ConfigError, match="runner: must be one of auto, lean, hf"):
        load_config(cfg, overrides={"runner": "fast"})


def test_document_store_versions_and_index_feed():
    fed: list[tuple[str, str]] = []
    store = DocumentStore(max_documents=2, on_index=lambda op, uri, _: fed.append((op, uri)))
    store.open("a", "x\ny\n", version=1)
    change = {"range": {"start": {"line": 1, "character": 0},
                        "end": {"line": 1, "character": 1}}, "text": "Z"}  # fmt: skip
    store.change("a", 2, [change])
    assert store.get("a").text == "x\nZ\n"
    for version in (2, 1):
        with pytest.raises(ProtocolError) as err:
            store.change("a", version, [change])
        assert err.value.code == "stale_version"
    with pytest.raises(ProtocolError) as err:
        store.get("a", version=1)
    assert err.value.code == "stale_version"
    store.open("b", "")
    with pytest.raises(ProtocolError) as err:
        store.open("c", "")
    assert err.value.code == "overloaded"
    store.close("a")
    assert fed == [("open", "a"), ("change", "a"), ("open", "b"), ("close", "a")]


def test_text_edits_turn_old_into_new_randomly():
    rng = random.Random(3)
    words = ["a", "bc", "\n", "  ", "def", "\r\n", "é", "😀", "x = 1\n"]
    for _ in range(300):
        before = "".join(rng.choice(words) for _ in range(rng.randrange(0, 6)))
        old = "".join(rng.choice(words) for _ in range(rng.randrange(0, 12)))
        after = "".join(rng.choice(words) for _ in range(rng.randrange(0, 6)))
        new = list(old)
        for _ in range(rng.randrange(0, 4)):
            at = rng.randrange(len(new) + 1)
            new[at:at + rng.randrange(3)] = rng.choice(words)  # fmt: skip
        new = "".join(new)
        text = before + old + after
        from codespec.daemon.service.documents import Document

        doc = Document("u", TextDocument(text))
        edits = completion.text_edits(doc, len(before), old, new)
        changes = [{"range": e["range"], "text": e["newText"]} for e in reversed(edits)]
        assert apply_changes(text, changes) == before + new + after
        if old == new:
            assert edits == []


def test_gitignore_rules(tmp_path):
    (tmp_path / ".gitignore").write_text("*.log\nbuild/\n/top.py\n!keep.log\n# c\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / ".gitignore").write_text("local_*.py\n")
    rules = IgnoreRules(tmp_path)
    assert rules.ignored(tmp_path / "x.log", False)
    assert not rules.ignored(tmp_path / "keep.log", False)
    assert rules.ignored(tmp_path / "build" / "a.py", False)
    assert rules.ignored(tmp_path / "top.py", False)
    assert not rules.ignored(tmp_path / "sub" / "top.py", False)
    assert rules.ignored(tmp_path / "sub" / "local_x.py", False)
    assert not rules.ignored(tmp_path / "local_x.py", False)
    assert rules.ignored(tmp_path / ".git" / "config", False)


def test_workspace_indexes_filters_and_debounces(tmp_path):
    root = tmp_path / "proj"
    (root / "ignored").mkdir(parents=True)
    (root / ".gitignore").write_text("ignored/\n*.log\n")
    (root / "a.py").write_text("def a():\n    return 1\n")
    (root / "ignored" / "b.py").write_text("x = 1\n")
    (root / "c.log").write_text("log\n")
    (root / "bin.dat").write_bytes(b"\x00\x01\x02")
    (root / "big.py").write_text("x = 1\n" * 1000)
    calls: list[tuple[str, bool]] = []
    lock = threading.Lock()

    def index_file(uri: str, text: str | None) -> None:
        with lock:
            calls.append((uri.rsplit("/", 1)[-1], text is not None))

    ws = Workspace(index_file, lambda uri: False, max_file_bytes=1000, debounce_s=0.1)
    try:
        assert ws.add(str(root)) == 2  # .gitignore and a.py
        assert sorted(calls) == [(".gitignore", True), ("a.py", True)]
        calls.clear()
        target = root / "d.py"
        flushes = ws.flushes
        for i in range(20):  # a burst of events for one path
            target.write_text(f"y = {i}\n")
            ws.touch(target)
        with ws.flushed:
            assert ws.flushed.wait_for(lambda: ("d.py", True) in calls, timeout=10)
        # The watcher reports one folder's events in order: once a later file's write has
        # flushed, every straggling event of the burst has been noted and flushed too.
        (root / "later.py").write_text("z = 1\n")
        with ws.flushed:
            assert ws.flushed.wait_for(lambda: ("later.py", True) in calls, timeout=10)
        assert calls.count(("d.py", True)) <= 2 and ws.flushes - flushes <= 4
        target.unlink()
        with ws.flushed:
            assert ws.flushed.wait_for(lambda: ("d.py", False) in calls, timeout=10)
    finally:
        ws.close()


def test_workspace_method_feeds_the_index(daemon, tmp_path):
    (tmp_path / "w.py").write_text("def work():\n    return 42\n")
    (tmp_path / "skip.log").write_text("x\n")
    (tmp_path / ".gitignore").write_text("*.log\n")
    with Client(daemon.socket_path) as c:
        r = c.request("workspace", {"folders": [tmp_path.as_uri()]})
        assert r["indexed"] == 2 and str(tmp_path.resolve()) in r["folders"]
    index = daemon.server.index
    uri = (tmp_path / "w.py").resolve().as_uri()
    assert uri in index and index.kind(uri) == "workspace"
    assert (tmp_path / "skip.log").resolve().as_uri() not in index


@pytest.fixture(scope="module")
def chat_engine(default_model_dir, tmp_path_factory):
    """A tiny random Llama with the default tokenizer and a chat template of our own (easy
    to read in the prompt) in place of SmolLM2's."""
    from codespec.daemon.engine.engine import Engine

    folder = tiny_model_dir(tmp_path_factory.mktemp("chat_model"), default_model_dir)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}### {{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}### assistant\n{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Engine(str(folder), device="cpu")


def test_edit_uses_the_chat_template(chat_engine, tmp_path):
    text = "def f(x):\n    return x + 1\n\n\ndef g():\n    pass\n"
    ep = completion.edit_prompt(
        chat_engine, text, 10, 27, text[10:27], "add a docstring", "python", 32, mode="chat"
    )
    assert ep.mode == "chat" and ep.draft_ids == chat_engine.encode(text[10:27])
    prompt = chat_engine.decode(ep.prompt_ids)
    assert "### system" in prompt and "add a docstring" in prompt
    assert "### user\nadd a docstring\n\n```python\n    return x + 1\n```\n" in prompt
    assert prompt.endswith("### assistant\n```python\n")  # the reply begins inside a fence
    srv = ServerThread(daemon_config(tmp_path), chat_engine)
    try:
        with Client(srv.socket_path) as c:
            caps = c.request("hello")["capabilities"]
            assert caps["edit"] == "continue" and "chat" in caps["edit_modes"]
            c.request("open", {"uri": "file:///c.py", "text": text, "version": 1})
            rng = {"start": {"line": 1, "character": 0}, "end": {"line": 2, "character": 0}}
            r = c.request("edit", {"uri": "file:///c.py", "range": rng, "version": 1,
                                   "instruction": "add a docstring", "max_tokens": 6,
                                   "mode": "chat"})  # fmt: skip
            assert r["mode"] == "chat" and r["stats"]["tokens"] <= 6
            changes = [{"range": e["range"], "text": e["newText"]} for e in reversed(r["edits"])]
            lines = text.splitlines(keepends=True)
            assert apply_changes(text, changes) == lines[0] + r["text"] + "".join(lines[2:])
    finally:
        srv.stop()


def test_fim_edit_prompt_carries_the_old_region_before_the_middle(fim_engine):
    """A model with FIM tokens and no chat template (as Qwen / StarCoder base models)."""
    engine = fim_engine
    text = "import os\n\n\ndef f(x):\n    return x + 1\n\n\ndef g():\n    pass\n"
    start, end = text.index("def f"), text.index("\n\n\ndef g") + 1
    ep = completion.edit_prompt(engine, text, start, end, text[start:end], "", "python", 32)
    assert ep.mode == "fim" and ep.draft_ids == engine.encode(text[start:end])
    fim = engine.fim
    ids = ep.prompt_ids
    assert ids[0] == fim.prefix and ids[-1] == fim.middle
    prefix = engine.decode(ids[1 : ids.index(fim.suffix)])
    assert prefix == text[:end] + ""  # before + the old region (ending in a line break)
    suffix = engine.decode(ids[ids.index(fim.suffix) + 1 : -1])
    assert suffix == text[end:]


def test_complete_prompt_start_is_stable_while_typing(engine):
    text = "".join(f"value_{i} = compute({i}, 'abc')\n" for i in range(400))  # > 2048 tokens
    starts = set()
    offset = len(text) // 2
    for k in range(20):  # typing 20 characters at the same spot
        typed = text[:offset] + "x" * k + text[offset:]
        ids = completion.complete_prompt(engine, typed, offset + k, 16).prompt_ids
        assert len(ids) <= engine.max_length - 16 - 1
        starts.add(tuple(ids[:50]))
    assert len(starts) <= 2  # the window start moves at most once in 20 keystrokes


def test_complete_prompt_respects_the_context_budget(fim_engine):
    """limits.context_tokens caps the prompt; the text right before the cursor is kept."""
    engine = fim_engine
    text = "".join(f"value_{i} = compute({i}, 'abc')\n" for i in range(400))
    offset = len(text) // 2
    full = completion.complete_prompt(engine, text, offset, 16).prompt_ids
    capped = completion.complete_prompt(engine, text, offset, 16, context_tokens=512).prompt_ids
    assert len(full) > 512 >= len(capped) > 512 // 3
    fim = engine.fim
    before_suffix = capped[: capped.index(fim.suffix)]
    assert engine.decode(before_suffix[-20:]) == engine.decode(full[: full.index(fim.suffix)][-20:])


def test_the_saved_index_is_loaded_at_start_and_a_corrupt_one_is_left_out(engine, tmp_path):
    """Stop saves the index to the state directory; the next start loads it. A file that
    is not an index (a crash mid-write, another format) starts an empty index."""
    config = daemon_config(tmp_path)
    config.state_dir = str(tmp_path / "state")
    uri = "file:///kept.py"
    srv = ServerThread(config, engine)
    try:
        # the editor is still connected when the daemon stops: a connection that closed
        # first would have released (closed and unindexed) the document it opened
        with Client(srv.socket_path) as c:
            c.request("open", {"uri": uri, "text": "def kept(a, b):\n    return a + b\n"})
            srv.stop()
    finally:
        srv.stop()
    saved = tmp_path / "state" / "index.msgpack"
    assert saved.stat().st_size > 0
    srv = ServerThread(config, engine)
    try:
        assert uri in srv.server.index and srv.server.index.stats()["documents"] == 1
    finally:
        srv.stop()
    saved.write_bytes(b"\x93not an index")
    srv = ServerThread(config, engine)
    try:
        assert uri not in srv.server.index and srv.server.index.stats()["documents"] == 0
        with Client(srv.socket_path) as c:  # and the daemon serves
            assert c.request("stats")["index"]["documents"] == 0
    finally:
        srv.stop()


def test_gitignore_rules_follow_git(tmp_path):
    """Patterns the hand-written subset did not know: escapes, ``**`` in the middle,
    a negation under an ignored folder (git does not look inside it)."""
    (tmp_path / ".gitignore").write_text(
        "\\#notes\ndocs/**/*.md\nout/\n!out/keep.py\nname[0-9].py\n"
    )
    rules = IgnoreRules(tmp_path)
    assert rules.ignored(tmp_path / "#notes", False)
    assert rules.ignored(tmp_path / "docs" / "a" / "b" / "x.md", False)
    assert rules.ignored(tmp_path / "docs" / "x.md", False)
    assert not rules.ignored(tmp_path / "docs" / "x.py", False)
    assert rules.ignored(tmp_path / "out" / "keep.py", False)
    assert rules.ignored(tmp_path / "name3.py", False)
    assert not rules.ignored(tmp_path / "nameX.py", False)


def test_workspace_changes_wait_for_each_other(tmp_path):
    """``add`` (a worker thread) and a re-index (the flusher thread) change the same
    roots and files: while ``add`` runs, a flush that is due waits for it."""
    root = tmp_path / "proj"
    root.mkdir()
    (root / "a.py").write_text("a = 1\n")
    (root / "b.py").write_text("b = 1\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "c.py").write_text("c = 1\n")
    seen: dict[str, bool] = {}

    def index_file(uri: str, text: str | None) -> None:
        if uri.endswith("/a.py") and "flushed" not in seen:
            flushes = ws.flushes
            ws.touch(other / "c.py")  # due at once: the flusher wants the workspace now
            with ws.flushed:
                seen["flushed"] = ws.flushed.wait_for(lambda: ws.flushes > flushes, 1.0)

    ws = Workspace(index_file, lambda uri: False, debounce_s=0.0)
    try:
        ws.add(str(other))
        assert ws.add(str(root)) == 2
        assert seen == {"flushed": False}, "a flush ran while add was changing the files"
        with ws.flushed:
            assert ws.flushed.wait_for(lambda: ws.flushes >= 1, 10)
    finally:
        ws.close()


def test_the_daemon_builds_the_index_lookup_library_before_the_first_request(
    engine, tmp_path, monkeypatch
):
    """With a fresh kernel cache the index's C++ lookup is compiled while the daemon
    starts, not inside the first completion (it added ~0.5 s to it)."""
    from codespec.ngram_index import native
    from conftest import ServerThread, daemon_config

    if native._LIB.library() is None:
        pytest.skip("no C++ compiler here: the index looks up with numpy")
    kernels = tmp_path / "kernels"
    monkeypatch.setenv("CODESPEC_KERNEL_DIR", str(kernels))
    monkeypatch.setattr(native._LIB, "_loaded", False)  # as in a new process: built on use
    server = ServerThread(daemon_config(tmp_path), engine)
    try:
        assert [p.name.split("-")[0] for p in kernels.glob("*.so")] == ["ngram_lookup"]
    finally:
        server.stop()


def test_the_daemon_builds_the_healing_table_before_the_first_request(engine, tmp_path):
    """Token healing's table of token texts is made while the daemon starts, not inside the
    first healed completion (~0.2 s)."""
    from conftest import ServerThread, daemon_config

    vars(engine).pop("token_texts", None)  # a cached_property: dropped, built on next use
    server = ServerThread(daemon_config(tmp_path), engine)
    try:
        assert "token_texts" in vars(engine)  # built: the first healed completion reuses it
    finally:
        server.stop()
