"""The socket API over a real in-process daemon: every method's shape and the error codes."""

from __future__ import annotations

import time

import pytest

from codespec.daemon.client import Client, DaemonError
from codespec.daemon.engine import cpu_gemm
from codespec.daemon.service.protocol import ERROR_CODES
from codespec.ngram_index.positions import apply_changes
from conftest import daemon_config

SOURCE = "".join(
    f"def f{i}(x, y):\n    total = x + y * {i}\n    return total\n\n" for i in range(80)
)  # 320 lines


@pytest.fixture
def client(daemon):
    with Client(daemon.socket_path) as c:
        yield c


def code_of(call) -> str:
    with pytest.raises(DaemonError) as err:
        call()
    assert err.value.code in ERROR_CODES
    return err.value.code


def test_hello_shape(client, engine):
    r = client.request("hello", {"client": "test", "protocol": 1})
    assert r["protocol"] == 1 and r["server"].startswith("codespec")
    assert r["model"] == engine.model_path and r["device"] == "cpu"  # a folder: its path
    caps = r["capabilities"]
    assert {"complete", "edit", "generate", "cancel", "workspace"} <= set(caps["methods"])
    assert caps["max_frame_bytes"] == 8 * 1024 * 1024
    assert set(caps["error_codes"]) == set(ERROR_CODES)


def test_open_change_close_shapes(client):
    uri = "file:///shapes.py"
    assert client.request("open", {"uri": uri, "text": "a = 1\n", "version": 1}) == {
        "uri": uri,
        "version": 1,
        "lines": 2,
    }
    change = {
        "range": {"start": {"line": 0, "character": 4}, "end": {"line": 0, "character": 5}},
        "text": "2",
    }
    r = client.request("change", {"uri": uri, "version": 2, "changes": [change]})
    assert r == {"uri": uri, "version": 2}
    assert client.request("close", {"uri": uri}) == {"uri": uri, "closed": True}
    assert code_of(lambda: client.request("close", {"uri": uri})) == "unknown_document"


def test_complete_single_line_shape_and_stream(client):
    uri = "file:///complete.py"
    client.request("open", {"uri": uri, "text": SOURCE, "version": 1, "language": "python"})
    deltas: list[dict] = []
    r = client.request(
        "complete",
        {"uri": uri, "position": {"line": 41, "character": 4}, "stream": True, "max_tokens": 8},
        deltas.append,
    )
    assert set(r) == {"text", "finish_reason", "stats"}
    assert "\n" not in r["text"]  # single-line: stops at the first line break
    assert r["stats"]["tokens"] <= 8
    assert r["finish_reason"] in ("stop", "length")
    assert all(d["event"] == "delta" and isinstance(d["text"], str) for d in deltas)
    assert "".join(d["text"] for d in deltas) == r["text"]  # what streamed is what returns
    assert r["stats"]["prompt_tokens"] <= 2048 - 8 - 1  # the FIM budget
    # The same request again reuses the cached prompt.
    r2 = client.request("complete", {"uri": uri, "position": {"line": 41, "character": 4}})
    assert r2["stats"]["cached_tokens"] >= r2["stats"]["prompt_tokens"] - 1


def test_complete_multiline_and_speculation_off(client):
    uri = "file:///multi.py"
    client.request("open", {"uri": uri, "text": SOURCE})
    r = client.request(
        "complete",
        {
            "uri": uri,
            "position": {"line": 2, "character": 16},
            "multiline": True,
            "max_tokens": 12,
            "speculation": "off",
        },
    )
    assert r["stats"]["tokens"] <= 12
    assert r["stats"]["drafted"] == {}
    assert r["stats"]["target_forwards"] == r["stats"]["tokens"] or r["finish_reason"] == "stop"


def test_streamed_deltas_add_up_to_the_returned_text(real_engine, tmp_path):
    """A multi-line completion cut at its token cap loses its unfinished last line (and
    the block openers before it): that text never streams (``codespec complete --stream``).
    On the real model, which writes lines."""
    from conftest import ServerThread

    srv = ServerThread(daemon_config(tmp_path), real_engine)
    try:
        with Client(srv.socket_path) as c:
            uri = "file:///streamed.py"
            c.request("open", {"uri": uri, "text": SOURCE + "class Stack:\n    "})
            cut = 0
            for multiline in (True, False):
                for max_tokens in (7, 12, 19, 27):
                    deltas: list[dict] = []
                    params = {"uri": uri, "position": {"line": 321, "character": 4},
                              "stream": True, "multiline": multiline, "max_tokens": max_tokens,
                              "speculation": "off"}  # fmt: skip
                    r = c.request("complete", params, deltas.append)
                    streamed = "".join(d["text"] for d in deltas)
                    assert streamed == r["text"], (multiline, max_tokens)
                    cut += multiline and r["finish_reason"] == "length" and "\n" in r["text"]
            assert cut, "no multi-line completion was cut at its cap"
    finally:
        srv.stop()


def test_generate_shape(client):
    r = client.request("generate", {"prompt": "def add(a, b):\n", "max_tokens": 5})
    assert set(r) == {"text", "finish_reason", "stats"} and r["stats"]["tokens"] <= 5
    r = client.request("generate", {"prompt_ids": [10, 11, 12], "max_tokens": 3, "stop": ["x"]})
    assert r["stats"]["tokens"] <= 3


def until(predicate, timeout: float = 10.0) -> bool:
    """Whether ``predicate`` came true within ``timeout`` s (checked every 10 ms)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_client_that_leaves_closes_the_documents_only_it_held(daemon):
    """An editor that quits leaves no open documents behind (``codespec status``)."""
    docs = daemon.server.documents
    with Client(daemon.socket_path) as keeper:
        keeper.request("open", {"uri": "file:///kept.py", "text": "a = 1\n"})
        with Client(daemon.socket_path) as leaver:
            for name in ("mine.py", "other.py", "kept.py"):
                leaver.request("open", {"uri": f"file:///{name}", "text": "b = 2\n"})
            leaver.request("close", {"uri": "file:///other.py"})
            assert {"file:///mine.py", "file:///kept.py"} <= set(docs.uris())
        assert until(lambda: "file:///mine.py" not in docs), "the leaver's document stayed open"
        assert "file:///kept.py" in docs  # the keeper still holds it
        assert keeper.request("stats")["documents"] == len(docs)
    assert until(lambda: "file:///kept.py" not in docs)


def test_stats_shape(client):
    s = client.request("stats")
    for key in ("model", "device", "documents", "index", "requests", "proposers", "tokens_per_s"):
        assert key in s
    assert {"in_flight", "served", "cancelled"} <= set(s["requests"])
    # the lean runner on this CPU multiplies through the cpu_gemm kernel, or says why not
    if s["runner"] == "lean" and s["device"] == "cpu" and cpu_gemm.library() is not None:
        assert s["cpu_kernel"] == "cpu_gemm, fp16 weights"  # the tiny model is saved in fp16
    else:
        assert isinstance(s["cpu_kernel"], str) and s["cpu_kernel"]


def test_stats_report_what_the_policy_measured(client):
    client.request(
        "generate", {"prompt": "def area(w, h):\n    return w * h\n\n\ndef area(", "max_tokens": 24}
    )
    pol = client.request("stats")["policy"]
    assert pol["forward_ms"]["1"] > 0  # the cost table, calibrated and updated per forward
    greedy = pol["classes"]["greedy"]
    assert greedy["plain_step_ms"] > 0  # the 24 steps above measured it
    assert set(greedy["vs_plain"]) <= {"ngram", "lookahead"}  # what auto has on this model
    assert isinstance(pol["retired"], list) and pol["steps"] > 0
    assert pol["weights"] == {
        "eagle": "no weights for this model",
        "lookahead": "needs no weights",
    }


def test_stats_say_which_proposer_weights_the_model_has(spec_engine, tmp_path):
    """Beside ``spec_engine``'s model: weights for every model proposer, and where."""
    from pathlib import Path

    from conftest import ServerThread

    srv = ServerThread(daemon_config(tmp_path), spec_engine)
    try:
        with Client(srv.socket_path) as c:
            w = c.request("stats")["policy"]["weights"]
    finally:
        srv.stop()
    model = Path(spec_engine.model_path)
    assert w == {
        "eagle": f"weights in {model / 'eagle'}",
        "lookahead": "needs no weights",
    }


def test_cancel_unknown_id(client):
    assert client.request("cancel", {"id": 987654}) == {"id": 987654, "cancelled": False}


def test_a_position_past_the_line_end_is_refused_by_name(client):
    client.request("open", {"uri": "file:///col.py", "text": "x = 1\n", "version": 1})
    with pytest.raises(DaemonError) as err:
        client.request("complete", {"uri": "file:///col.py",
                                    "position": {"line": 0, "character": 999}})  # fmt: skip
    assert err.value.code == "bad_params"
    assert "character 999 is past the end of line 0 (5 UTF-16 units long)" in err.value.message
    # the line's end itself is a fine cursor
    at_end = {"line": 0, "character": 5}
    r = client.request("complete", {"uri": "file:///col.py", "position": at_end, "max_tokens": 1})
    assert r["stats"]["tokens"] <= 1


def test_bad_params_name_the_parameter(client):
    client.request("open", {"uri": "file:///names.py", "text": "x = 1\n"})
    for params, message in [
        ({"uri": 3, "text": ""}, "'uri': expected `str`, got `int`"),
        ({"uri": "file:///names.py"}, "'text': missing"),
        ({"uri": "file:///n.py", "text": "", "version": 1.5}, "'version': expected `int`"),
    ]:
        with pytest.raises(DaemonError) as err:
            client.request("open", params)
        assert err.value.code == "bad_params" and err.value.message.startswith(message)
    pos = {"line": 0, "character": 0}
    for extra, message in [
        ({"position": {"line": -1, "character": 0}}, "'position.line': expected `int` >= 0"),
        ({"position": pos, "top_p": 0}, "'top_p': expected `float` > 0.0"),
        ({"position": pos, "stop": ["x" * 300]}, "'stop': expected `str` of length <= 256"),
        ({"position": pos, "stream": 1}, "'stream': expected `bool`, got `int`"),
        ({"position": pos, "max_tokens": 10**6}, "'max_tokens' must be in [1, 1024]"),
    ]:
        with pytest.raises(DaemonError) as err:
            client.request("complete", {"uri": "file:///names.py", **extra})
        assert err.value.code == "bad_params" and err.value.message.startswith(message)


@pytest.mark.parametrize(
    "method,params,code",
    [
        ("nope", {}, "unknown_method"),
        ("open", {"uri": 5, "text": ""}, "bad_params"),
        ("open", {"uri": "file:///a"}, "bad_params"),
        ("change", {"uri": "file:///missing", "version": 3, "changes": []}, "unknown_document"),
        ("complete", {"uri": "file:///missing", "position": {"line": 0, "character": 0}}, None),
        ("complete", {"uri": "file:///e.py", "position": {"line": -1, "character": 0}}, None),
        ("complete", {"uri": "file:///e.py", "position": {"line": 99, "character": 0}}, None),
        ("complete", {"uri": "file:///e.py", "position": [0, 0]}, "bad_params"),
        ("complete", {"uri": "file:///e.py", "position": {"line": 0, "character": 999}},
         "bad_params"),  # past the end of the line: an error, not the line's end
        ("complete", {"uri": "file:///e.py", "position": {"line": 1, "character": 1}},
         "bad_params"),  # the last (empty) line has no column 1
        ("edit", {"uri": "file:///e.py", "range": {"start": {"line": 0, "character": 0},
                                                   "end": {"line": 0, "character": 6}}},
         "bad_params"),
        ("complete", {"uri": "file:///e.py", "position": {"line": 0, "character": 0},
                      "max_tokens": 0}, "bad_params"),
        ("complete", {"uri": "file:///e.py", "position": {"line": 0, "character": 0},
                      "speculation": "magic"}, "bad_params"),
        ("complete", {"uri": "file:///e.py", "position": {"line": 0, "character": 0},
                      "temperature": float("nan")}, "bad_params"),
        ("generate", {"prompt": ""}, "bad_params"),
        ("generate", {"prompt_ids": [1, 2, 10**9]}, "bad_params"),
        ("generate", {"prompt": "x", "max_tokens": 10**9}, "bad_params"),
        ("edit", {"uri": "file:///e.py", "range": {"start": {"line": 1, "character": 0},
                                                   "end": {"line": 0, "character": 0}}},
         "bad_params"),
        ("cancel", {"id": "x"}, "bad_params"),
        ("workspace", {"folders": ["/definitely/not/here"]}, "bad_params"),
    ],
)  # fmt: skip
def test_error_codes(client, method, params, code):
    client.request("open", {"uri": "file:///e.py", "text": "x = 1\n", "version": 1})
    got = code_of(lambda: client.request(method, params))
    if code is None:
        assert got in ("unknown_document", "bad_params")
        if params["uri"] == "file:///missing":
            assert got == "unknown_document"
        else:
            assert got == "bad_params"
    else:
        assert got == code


def test_stale_version_is_refused_and_reopen_recovers(client):
    uri = "file:///stale.py"
    client.request("open", {"uri": uri, "text": "a\nb\n", "version": 5})
    ins = {
        "range": {"start": {"line": 0, "character": 1}, "end": {"line": 0, "character": 1}},
        "text": "X",
    }
    assert code_of(
        lambda: client.request("change", {"uri": uri, "version": 5, "changes": [ins]})
    ) == ("stale_version")
    # A bad range in the middle applies nothing either.
    bad = {"range": {"start": {"line": 9, "character": 0}, "end": {"line": 9, "character": 0}},
           "text": "Y"}  # fmt: skip
    assert code_of(
        lambda: client.request("change", {"uri": uri, "version": 6, "changes": [ins, bad]})
    ) == ("bad_params")
    rng = {"start": {"line": 0, "character": 0}, "end": {"line": 1, "character": 0}}
    assert (
        code_of(lambda: client.request("edit", {"uri": uri, "range": rng, "version": 4}))
        == "stale_version"
    )
    client.request("open", {"uri": uri, "text": "a\nb\n", "version": 9})  # re-open
    client.request("change", {"uri": uri, "version": 10, "changes": [ins]})
    r = client.request("edit", {"uri": uri, "range": rng, "version": 10, "max_tokens": 3})
    assert r["version"] == 10


def test_edit_returns_text_edits_that_turn_old_into_new(client):
    uri = "file:///edit.py"
    client.request("open", {"uri": uri, "text": SOURCE, "version": 1})
    rng = {"start": {"line": 8, "character": 0}, "end": {"line": 12, "character": 0}}
    deltas: list[dict] = []
    r = client.request(
        "edit",
        {"uri": uri, "range": rng, "max_tokens": 24, "stream": True, "instruction": "rename"},
        deltas.append,
    )
    assert r["range"] == rng and r["mode"] == "continue"  # SmolLM2 has no FIM tokens
    assert "".join(d["text"] for d in deltas) == r["text"]
    lines = SOURCE.splitlines(keepends=True)
    expected = "".join(lines[:8]) + r["text"] + "".join(lines[12:])
    changes = [{"range": e["range"], "text": e["newText"]} for e in reversed(r["edits"])]
    assert apply_changes(SOURCE, changes) == expected
    # With the prediction equal to the old text: the edits are empty exactly when the
    # result is the old text, and otherwise still turn old into new.
    old = "".join(lines[8:12])
    same = client.request("edit", {"uri": uri, "range": rng, "max_tokens": 48, "prediction": old})
    assert same["range"] == rng
    assert (same["edits"] == []) == (same["text"] == old)
    changes = [{"range": e["range"], "text": e["newText"]} for e in reversed(same["edits"])]
    assert apply_changes(SOURCE, changes) == "".join(lines[:8]) + same["text"] + "".join(lines[12:])


def test_fim_edit_over_the_socket(fim_engine, tmp_path):
    """A model with FIM tokens and no chat template edits in the FIM layout; its TextEdits
    turn the old text into the new."""
    from conftest import ServerThread

    srv = ServerThread(daemon_config(tmp_path), fim_engine)
    try:
        with Client(srv.socket_path) as c:
            assert c.request("hello")["capabilities"]["edit"] == "fim"
            c.request("open", {"uri": "file:///fim.py", "text": SOURCE, "version": 1})
            rng = {"start": {"line": 8, "character": 0}, "end": {"line": 12, "character": 0}}
            r = c.request("edit", {"uri": "file:///fim.py", "range": rng, "max_tokens": 12})
    finally:
        srv.stop()
    assert r["mode"] == "fim" and r["stats"]["tokens"] <= 12
    lines = SOURCE.splitlines(keepends=True)
    changes = [{"range": e["range"], "text": e["newText"]} for e in reversed(r["edits"])]
    assert apply_changes(SOURCE, changes) == "".join(lines[:8]) + r["text"] + "".join(lines[12:])


def test_edit_refers_to_the_text_it_started_from(client):
    """A change sent while an edit runs does not move the edit's TextEdits."""
    uri = "file:///edit-during-change.py"
    client.request("open", {"uri": uri, "text": SOURCE, "version": 1})
    rng = {"start": {"line": 8, "character": 0}, "end": {"line": 12, "character": 0}}
    rid = client.send("edit", {"uri": uri, "range": rng, "max_tokens": 24, "version": 1})
    client.request("change", {"uri": uri, "version": 2, "changes": [{"text": "x = 1\n"}]})
    r = client.wait(rid)
    assert r["version"] == 1
    lines = SOURCE.splitlines(keepends=True)
    expected = "".join(lines[:8]) + r["text"] + "".join(lines[12:])
    changes = [{"range": e["range"], "text": e["newText"]} for e in reversed(r["edits"])]
    assert apply_changes(SOURCE, changes) == expected


def test_overloaded_past_the_queue_limit(engine, tmp_path):
    from conftest import ServerThread

    srv = ServerThread(daemon_config(tmp_path, max_queue=2), engine)
    try:
        with Client(srv.socket_path) as c:
            ids = [
                c.send("generate", {"prompt": "def f():\n", "max_tokens": 200}) for _ in range(4)
            ]
            codes = []
            for rid in ids[2:]:
                codes.append(code_of(lambda rid=rid: c.wait(rid)))
            assert codes == ["overloaded", "overloaded"]
            for rid in ids[:2]:
                c.request("cancel", {"id": rid})
    finally:
        srv.stop()
