"""codespec view without a browser: opening and closing the page (127.0.0.1, a token, 403
for any other, nothing listening once closed), the records against the requests' own
stats, the ring's bound, the export, and the ``view`` subcommand's errors."""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request
from urllib.parse import urlparse

import pytest

from codespec.daemon.cli import main as cli_main
from codespec.daemon.client import Client, DaemonError
from codespec.daemon.view.recorder import rejected_path
from codespec.daemon.view.service import current, install
from codespec.speculators.book import forget
from codespec.speculators.draft import Draft
from conftest import ServerThread, daemon_config

install()  # what codespec serve does: the daemons these tests start have the view

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef add("


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return True
    return False


def run_requests(client: Client, n: int, speculation: str = "ngram") -> list[dict]:
    return [
        client.request("generate", {"prompt": PROMPT * (k + 1), "max_tokens": 12 + 4 * k,
                                    "speculation": speculation})
        for k in range(n)
    ]  # fmt: skip


def test_the_view_binds_only_when_asked_and_closes_to_nothing(daemon):
    sched = daemon.server.scheduler
    with Client(daemon.socket_path) as c:
        assert c.request("view", {"action": "status"})["open"] is False
        assert sched.view is None  # closed: nothing records
        url = c.request("view", {"action": "open"})["url"]
        assert c.request("view", {"action": "open"})["url"] == url  # opened once
        assert sched.view is not None
        parts = urlparse(url)
        assert parts.hostname == "127.0.0.1"
        token = parts.path.strip("/")
        assert len(token) >= 24
        status, body = get(url)
        assert status == 200 and b"codespec view" in body
        assert get(url + "static/uPlot.iife.min.js")[0] == 200
        assert get(url + "static/nothing.js")[0] == 404
        base = f"http://127.0.0.1:{parts.port}/"
        wrong = "x" * len(token)
        for path in ("", f"{wrong}/", f"{wrong}/data.json", f"{wrong}/events",
                     f"{wrong}/static/view.js", f"{token[:-1]}/"):  # fmt: skip
            status, body = get(base + path)
            assert status == 403, path
            assert b"codespec" not in body or b"wrong token" in body
        closed = c.request("view", {"action": "close"})
        assert closed["open"] is False and sched.view is None
        assert current(daemon.server) is None
        assert refused(parts.port)


def test_records_show_each_request_as_its_stats_count_it(daemon):
    # the policy drafts by what it measured; the session's engine has learnt from other
    # modules' requests (on a busy machine, that drafting does not pay): start afresh
    forget(daemon.server.engine)
    with Client(daemon.socket_path) as c:
        url = c.request("view", {"action": "open"})["url"]
        try:
            results = run_requests(c, 3)
            data = json.loads(get(url + "data.json")[1])
        finally:
            c.request("view", {"action": "close"})
    records = data["records"][-3:]
    assert len(records) == 3
    assert data["status"]["index"].keys() == {"documents", "tokens", "bytes"}
    for rec, r in zip(records, results, strict=True):
        st = r["stats"]
        shown = [t for t in rec["tokens"] if not t[3]]
        assert len(shown) == st["tokens"]
        assert "".join(t[0] for t in shown) == r["text"]
        assert rec["forwards"] == st["target_forwards"]
        by_source: dict[str, int] = {}
        for t in rec["tokens"]:
            by_source[t[1]] = by_source.get(t[1], 0) + 1
        prefilled = st["turns"] - st["lead_steps"]  # a lead step's turn has no prefill token
        assert by_source.get("prefill", 0) == prefilled
        assert by_source.get("bonus", 0) == st["target_forwards"] - prefilled
        drafted = {k: v for k, v in by_source.items() if k not in ("prefill", "bonus")}
        assert drafted == {k: v for k, v in st["accepted"].items() if v}
        assert rec["prompt_tokens"] == st["prompt_tokens"]
        assert rec["cached_tokens"] == st["cached_tokens"]
        kinds = [b[0] for b in rec["bars"]]
        assert kinds[:2] == ["queue", "prefill"] and kinds.count("verify") == len(rec["steps"])
        t = rec["times"]
        assert 0 <= t["queue_ms"] <= t["first_ms"] <= t["final_ms"]
    # the prompts repeat themselves: context n-grams drafted something
    assert sum(s["nodes"] for rec in records for s in rec["steps"]) > 0


def test_the_ring_keeps_the_last_requests_only(engine, tmp_path):
    config = daemon_config(tmp_path)
    config.view.enabled = True  # [view] enabled: open from the start
    config.view.ring = 2
    srv = ServerThread(config, engine)
    try:
        view = current(srv.server)
        assert view is not None
        url = view.url
        with Client(srv.socket_path) as c:
            assert c.request("view", {"action": "status"})["url"] == url
            run_requests(c, 3, speculation="off")
        data = json.loads(get(url + "data.json")[1])
        assert [r["seq"] for r in data["records"]] == [2, 3]
        assert all(r["turns"][0]["speculation"] == "off" for r in data["records"])
        assert all(t[1] in ("prefill", "bonus") for r in data["records"] for t in r["tokens"])
        port = urlparse(url).port
    finally:
        srv.stop()
    assert port is not None and refused(port)  # the daemon's stop closes the view


def test_export_is_one_self_contained_page(daemon, tmp_path, capsys):
    out = tmp_path / "view.html"
    args = ["view", "--socket", daemon.socket_path, "--export", str(out)]
    assert cli_main(args) == 1  # closed: nothing was recorded
    assert "the view is not open" in capsys.readouterr().err
    with Client(daemon.socket_path) as c:
        c.request("view", {"action": "open"})
        try:
            run_requests(c, 3)
            assert cli_main([*args, "--last", "2"]) == 0
        finally:
            c.request("view", {"action": "close"})
    html = out.read_text()
    assert "src=" not in html and "href=" not in html and "http://" not in html
    assert "uPlot" in html and "Leon Sorokin" in html  # the library and its license
    blob = re.search(r"window\.CODESPEC_VIEW = (.*?);</script>", html, re.S)
    assert blob is not None
    data = json.loads(blob.group(1).replace("<\\/", "</"))
    assert len(data["records"]) == 2
    assert data["records"][1]["seq"] == data["records"][0]["seq"] + 1


def test_view_command_prints_the_url_and_rejects_bad_input(daemon, capsys):
    assert cli_main(["view", "--socket", daemon.socket_path]) == 0
    url = capsys.readouterr().out.strip()
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/[\w-]+/", url)
    assert cli_main(["view", "--socket", daemon.socket_path, "--close"]) == 0
    assert capsys.readouterr().out.strip() == "the view is closed"
    assert cli_main(["view", "--socket", daemon.socket_path, "--last", "0"]) == 1
    with Client(daemon.socket_path) as c, pytest.raises(DaemonError) as err:
        c.request("view", {"action": "explode"})
    assert err.value.code == "bad_params"


def test_rejected_path_follows_the_branch_verification_turned_down():
    d = Draft([5, 6, 7, 8, 9], [-1, 0, 1, 0, 3])
    assert rejected_path(d, [0]) == [6, 7]
    assert rejected_path(d, [0, 1]) == [7]
    assert rejected_path(d, [0, 1, 2]) == []
    assert rejected_path(d, []) == [5, 6, 7]  # nothing accepted: the first branch
    assert rejected_path(Draft.chain([1, 2, 3]), []) == [1, 2, 3]


def test_rejected_drafts_are_noted_beside_their_step(engine):
    """A proposer whose drafts are 2 right tokens then wrong ones, wrapped by the recorder as
    the scheduler wraps a turn's: each step keeps its accepted tokens by source and the rest
    of the draft as rejected, and the record's tokens are the engine's output."""
    from codespec.daemon.engine.engine import GenParams
    from codespec.daemon.service.scheduler import Job
    from codespec.daemon.view.recorder import Recorder
    from codespec.daemon.view.snapshot import record_json
    from helpers import ScriptedProposer

    prompt = engine.encode(PROMPT)
    params = GenParams(max_tokens=24, max_draft=5)
    oracle, _ = engine.generate(prompt, params)
    job = Job(prompt, params, "scripted", uri="file:///s.py")
    recorder = Recorder(4)
    proposer = ScriptedProposer(oracle, "k_then_wrong", engine.runner.vocab_size, k=2)
    wrapped = recorder.wrap(job, proposer, "scripted", 5, 1)
    engine.reset_cache()  # a prefill gives the first token (a cached prompt: a lead step)
    for step in engine.stream(prompt, params, wrapped):
        job.out_ids += [t for t in step.token_ids if t not in engine.stop_ids]
    job.started = job.submitted
    recorder.finish(job, "length")
    tok = engine.tokenizer.backend_tokenizer
    rec = record_json(recorder.since()[0], tok.decode, set(engine.stop_ids))
    assert job.out_ids == oracle
    assert [t[1] for t in rec["tokens"][:4]] == ["prefill", "kwrong", "kwrong", "bonus"]
    drafted = [s for s in rec["steps"] if s["nodes"]]
    assert drafted and all(s["accepted"] == 2 for s in drafted[:-1])
    assert all(s["rejected"] for s in drafted if s["accepted"] < s["nodes"])
    assert all(s["source"] == "kwrong" for s in drafted)
    shown = "".join(t[0] for t in rec["tokens"] if not t[3])
    assert shown == tok.decode(oracle)


def test_a_lead_step_shows_no_prefill_token(engine):
    """A request whose prompt is cached but its last token starts with a verify step
    rooted there (``Stats.lead_steps``): the record's first tokens are that step's draft
    and bonus, none is put down to a prefill, and the text is the engine's output."""
    from codespec.daemon.engine.engine import GenParams
    from codespec.daemon.service.scheduler import Job
    from codespec.daemon.view.recorder import Recorder
    from codespec.daemon.view.snapshot import record_json
    from helpers import ScriptedProposer

    prompt = engine.encode(PROMPT)
    params = GenParams(max_tokens=12, max_draft=3)
    engine.reset_cache()
    oracle, _ = engine.generate(prompt, params)  # the prompt is cached now
    job = Job(prompt, params, "scripted", uri="file:///s.py")
    recorder = Recorder(4)
    proposer = ScriptedProposer(oracle, "k_then_wrong", engine.runner.vocab_size, k=2)
    for step in engine.stream(prompt, params, recorder.wrap(job, proposer, "scripted", 3, 1)):
        job.out_ids += [t for t in step.token_ids if t not in engine.stop_ids]
    job.started = job.submitted
    recorder.finish(job, "length")
    assert step.stats.lead_steps == 1
    tok = engine.tokenizer.backend_tokenizer
    rec = record_json(recorder.since()[0], tok.decode, set(engine.stop_ids))
    assert job.out_ids == oracle
    sources = [t[1] for t in rec["tokens"]]
    assert sources[:3] == ["kwrong", "kwrong", "bonus"] and "prefill" not in sources
    assert "".join(t[0] for t in rec["tokens"] if not t[3]) == tok.decode(oracle)
    assert len(rec["steps"]) == step.stats.target_forwards  # every forward a step


def test_output_that_no_step_noted_is_shown_as_the_targets(engine):
    """An engine that takes no proposer (a remote backend) calls no recorder: its tokens
    are still shown, as the target's."""
    from codespec.daemon.engine.engine import GenParams
    from codespec.daemon.service.scheduler import Job
    from codespec.daemon.view.recorder import Recorder
    from codespec.daemon.view.snapshot import record_json

    prompt = engine.encode(PROMPT)
    params = GenParams(max_tokens=8)
    job = Job(prompt, params, "off")
    recorder = Recorder(4)
    recorder.wrap(job, None, "off", 0, 1)  # the wrapper the engine then ignores
    job.out_ids, _ = engine.generate(prompt, params)
    recorder.finish(job, "length")
    rec = record_json(recorder.since()[0], engine.tokenizer.backend_tokenizer.decode, set())
    assert [t[1] for t in rec["tokens"]] == ["prefill"] + ["target"] * (len(job.out_ids) - 1)


def test_bench_page_reader_reads_an_open_view_only(daemon):
    """What bench latency --configs starts for a daemon with [view] enabled: a page that
    reads the event stream (a message at once, then each finished request)."""
    import time

    from codespec.daemon.view.reader import read_page

    assert read_page(daemon.socket_path) is None  # closed
    with Client(daemon.socket_path) as c:
        c.request("view", {"action": "open"})
        try:
            page = read_page(daemon.socket_path)
            assert page is not None
            deadline = time.monotonic() + 30
            while page.messages < 1:
                assert time.monotonic() < deadline, "the page got no first message"
                time.sleep(0.05)
            run_requests(c, 1)
            while page.records < 1:
                assert time.monotonic() < deadline, "the page heard of no request"
                time.sleep(0.05)
        finally:
            c.request("view", {"action": "close"})
    page.thread.join(10)
    assert not page.thread.is_alive()  # the view's close ended its stream


def test_codespec_serve_with_view_enabled_serves_the_page(tmp_path, tiny_model):
    """The real command: ``[view] enabled`` in the config file opens the page at start,
    ``codespec view`` prints its address, and SIGTERM leaves nothing listening."""
    import os
    import subprocess
    import sys
    import time

    sock = str(tmp_path / "d.sock")
    config = tmp_path / "config.toml"
    config.write_text("[view]\nenabled = true\nring = 3\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "codespec.daemon.cli", "serve", "--model", str(tiny_model),
         "--socket", sock, "--config", str(config)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(sock):
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.1)
        state: dict = {}
        while not state.get("open"):  # opened by the config at start, not by the command
            assert proc.poll() is None and time.monotonic() < deadline, "no view came up"
            with Client(sock) as c:
                state = c.request("view", {"action": "status"})
            time.sleep(0.05)
        assert state["ring"] == 3
        shown = subprocess.run(
            [sys.executable, "-m", "codespec.daemon.cli", "view", "--socket", sock],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert shown.stdout.strip() == state["url"]
        assert get(state["url"])[0] == 200
        proc.terminate()
        assert proc.wait(60) == 0
        assert refused(urlparse(state["url"]).port or 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
