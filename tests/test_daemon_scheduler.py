"""The scheduler: cancellation within one step, fair preemption, back-off under load,
the typing simulation and disconnects, all on the tiny engine (the default model's tokenizer,
random weights)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from codespec.daemon.client import AsyncClient, Client, DaemonError
from codespec.daemon.config import Speculation
from codespec.daemon.engine.engine import GenParams
from codespec.daemon.service.protocol import pack
from codespec.daemon.service.recent import RecentOutputs
from codespec.daemon.service.scheduler import Job, Scheduler, speculation_policy
from helpers import wait_warmed

PROMPT = "import os\n\n\ndef walk(root):\n    for name in os.listdir(root):\n"


@pytest.fixture
def scheduler(engine):
    s = Scheduler(engine, None, Speculation(quantum_steps=2), max_queue=8)
    s.start()
    yield s
    s.stop()


def wait_idle(s: Scheduler, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while not s.idle:
        assert time.monotonic() - t0 < timeout, "the scheduler did not go idle"
        time.sleep(0.005)
    return time.monotonic() - t0


def test_cancel_stops_within_one_decode_step(engine, scheduler):
    """Cancelling while delta k is handled: exactly one more target forward, then stop."""
    ids = engine.encode(PROMPT)
    seen: list[str] = []
    job = Job(ids, GenParams(max_tokens=200), "off")

    def on_delta(text: str) -> None:
        seen.append(text)
        if len(seen) == 3:
            job.cancel.set()

    job.on_delta = on_delta
    fut = scheduler.submit(job)
    with pytest.raises(Exception) as err:
        fut.result(30)
    assert getattr(err.value, "code", "") == "cancelled"
    wait_idle(scheduler)
    # Deltas 1..3 came from the prefill and 2 decode steps; the cancel costs one more.
    assert job.totals.decode_steps <= len(seen) - 1 + 1
    assert len(job.out_ids) < 200


def test_preempted_request_equals_uninterrupted_greedy(engine, scheduler, monkeypatch):
    """A long request preempted every 2 steps by a short one gives plain greedy's output,
    and the short one, submitted later, finishes first (round-robin).

    The switch-cost rule (a turn lasts until decode time reaches a multiple of its
    prefill time) depends on timings; it is off here so turns end by the quantum alone.
    """
    monkeypatch.setattr("codespec.daemon.service.scheduler.SWITCH_COST_RATIO", 0.0)
    long_ids = engine.encode(PROMPT)
    short_ids = engine.encode("class Stack:\n    def push(self, x):\n")
    engine.reset_cache()
    ref, _ = engine.generate(long_ids, GenParams(max_tokens=24))
    ref_short, _ = engine.generate(short_ids, GenParams(max_tokens=4))
    order: list[str] = []
    a = Job(long_ids, GenParams(max_tokens=24), "off")
    b = Job(short_ids, GenParams(max_tokens=4), "off")
    fa = scheduler.submit(a)
    fb = scheduler.submit(b)
    fa.add_done_callback(lambda _: order.append("long"))
    fb.add_done_callback(lambda _: order.append("short"))
    ra, rb = fa.result(60), fb.result(60)
    assert order == ["short", "long"]
    assert a.turns >= 2
    assert ra.text == engine.decode(ref) and rb.text == engine.decode(ref_short)
    assert ra.stats["tokens"] == 24


@pytest.mark.parametrize(("ratio", "preempted"), [(0.0, True), (1e9, False)])
def test_the_switch_cost_rule_keeps_a_turn_until_decoding_pays_for_it(
    engine, scheduler, monkeypatch, ratio, preempted
):
    """A turn ends at the quantum only once its decode time reaches SWITCH_COST_RATIO x
    its prefill time: with the ratio at 0 the long request is preempted by the waiting
    one; with a ratio no decode time reaches, it runs to its end in one turn although
    another request waits the whole time."""
    monkeypatch.setattr("codespec.daemon.service.scheduler.SWITCH_COST_RATIO", ratio)
    engine.reset_cache()
    a = Job(engine.encode(PROMPT * 8), GenParams(max_tokens=24), "off")
    b = Job(engine.encode("class Stack:\n"), GenParams(max_tokens=4), "off")
    order: list[str] = []
    fa, fb = scheduler.submit(a), scheduler.submit(b)
    fa.add_done_callback(lambda _: order.append("long"))
    fb.add_done_callback(lambda _: order.append("short"))
    fa.result(60), fb.result(60)
    assert (a.turns > 1) == preempted
    assert order == (["short", "long"] if preempted else ["long", "short"])


def test_speculation_backs_off_then_switches_off():
    cfg = SimpleNamespace(shorten_at=2, off_at=4)
    assert speculation_policy("auto", 16, 1, cfg) == ("auto", 16)
    assert speculation_policy("auto", 16, 2, cfg) == ("auto", 8)
    assert speculation_policy("auto", 16, 3, cfg) == ("auto", 4)
    assert speculation_policy("auto", 16, 4, cfg) == ("off", 0)
    assert speculation_policy("off", 16, 1, cfg) == ("off", 0)


def test_busy_daemon_decodes_plainly(engine):
    s = Scheduler(engine, None, Speculation(shorten_at=2, off_at=3, quantum_steps=1), 16)
    s.start()
    try:
        ids = engine.encode(PROMPT)
        jobs = [Job(ids, GenParams(max_tokens=6), "auto") for _ in range(4)]
        results = [s.submit(j) for j in jobs]
        stats = [f.result(60).stats for f in results]
        assert stats[0]["speculation"] == "off (busy)"  # 4 active at its first turn
        assert all(st["tokens"] == 6 for st in stats)
    finally:
        s.stop()


def test_typing_simulation_each_complete_cancelled_by_the_next(daemon):
    """300 keystrokes: change + complete, each complete cancelled by the next one.
    The last is answered, the others are cancelled, nothing is left running."""
    line = "    total = x + y * 2 "

    async def run() -> tuple[dict, int, int]:
        c = await AsyncClient.connect(daemon.socket_path)
        uri = "file:///typing.py"
        text = "def f(x, y):\n" + "\n" * 3
        await c.request("open", {"uri": uri, "text": text, "version": 0})
        prev = None
        pendings = []
        row, col = 1, 0  # the cursor
        for i in range(300):
            ch = "\n" if i and i % len(line) == 0 else line[i % len(line)]
            pos = {"line": row, "character": col}
            change = {"range": {"start": pos, "end": pos}, "text": ch}
            await c.request("change", {"uri": uri, "version": i + 1, "changes": [change]})
            row, col = (row + 1, 0) if ch == "\n" else (row, col + 1)
            if prev is not None:
                await prev.cancel()
            prev = c.start(
                "complete",
                {"uri": uri, "position": {"line": row, "character": col}, "max_tokens": 4},
            )
            pendings.append(prev)
        last = await prev.result()
        await c.request("close", {"uri": uri})  # no warm-up of it left for the next test
        cancelled = answered = 0
        for p in pendings[:-1]:
            try:
                await p.result()
                answered += 1
            except DaemonError as exc:
                assert exc.code == "cancelled"
                cancelled += 1
        await c.close()
        return last, cancelled, answered

    last, cancelled, answered = asyncio.run(asyncio.wait_for(run(), 60))
    assert isinstance(last["text"], str) and last["stats"]["tokens"] <= 4
    assert cancelled + answered == 299 and cancelled > 0
    wait_idle(daemon.server.scheduler)
    t0 = time.monotonic()  # the daemon notices the client's close on its own loop
    while daemon.call(lambda: any(conn.inflight for conn in daemon.server._connections)):
        assert time.monotonic() - t0 < 5, "a request task outlived its connection"
        time.sleep(0.01)


def test_disconnect_cancels_the_request(daemon, monkeypatch):
    s = daemon.server.scheduler
    before = s.cancelled
    finished: list[int] = []  # tokens each finished job made
    real_finish = s._finish

    def finish(job, *args, **kwargs):
        finished.append(len(job.out_ids))
        return real_finish(job, *args, **kwargs)

    monkeypatch.setattr(s, "_finish", finish)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(daemon.socket_path)
    params = {"prompt": PROMPT, "max_tokens": 1000, "stream": True}
    sock.sendall(pack({"id": 1, "method": "generate", "params": params}))
    sock.recv(4)  # the first delta is on its way: the request runs
    sock.close()
    wait_idle(s)
    assert s.cancelled == before + 1
    # stopped at the close, far short of the 1,000 tokens asked for
    assert len(finished) == 1 and 0 < finished[0] < 500


def test_cancel_over_the_socket(daemon):
    with Client(daemon.socket_path) as c:
        got = threading.Event()
        rid = c.send("generate", {"prompt": PROMPT, "max_tokens": 1000, "stream": True})
        frame = c.read_frame()
        assert frame["id"] == rid and frame["event"] == "delta"
        got.set()
        assert c.request("cancel", {"id": rid})["cancelled"] is True
        with pytest.raises(DaemonError) as err:
            c.wait(rid)
        assert err.value.code == "cancelled"
    wait_idle(daemon.server.scheduler, timeout=2.0)


def test_a_model_proposer_without_weights_is_bad_params(engine):
    """Asking for a model proposer the model has no weights for (the tiny engine's model has
    none beside it) fails the request with bad_params saying so, not the daemon; "auto"
    leaves it out and decodes."""
    from codespec.daemon.service.protocol import ProtocolError

    name = "eagle"
    s = Scheduler(engine, None, Speculation(), 8)
    s.start()
    try:
        ids = engine.encode(PROMPT)
        with pytest.raises(ProtocolError) as err:
            s.submit(Job(ids, GenParams(max_tokens=4), name)).result(60)
        assert err.value.code == "bad_params"
        assert err.value.message.startswith(f"no {name} weights for this model (")
        assert f"{engine.model_path}/{name}" in err.value.message
        for spec in ("off", "auto"):
            ok = s.submit(Job(ids, GenParams(max_tokens=4), spec)).result(60)
            assert ok.stats["tokens"] >= 1
    finally:
        s.stop()


def test_warming_prefills_while_idle_and_yields_to_requests(engine, scheduler):
    """A warmed prompt is cached when the request comes (the prefill re-feeds only the
    last token); a warm-up queued while a request runs waits for it, and a request that
    arrives mid-warm-up takes the engine between chunks."""
    engine.reset_cache()
    prompt = engine.encode(PROMPT * 12)
    scheduler.warm("file:///w.py", prompt)
    wait_idle(scheduler)
    deadline = time.monotonic() + 30
    while scheduler.warmed < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.warmed == 1 and scheduler.warmed_tokens == len(prompt) - 1
    r = scheduler.submit(Job(prompt, GenParams(max_tokens=2), "off")).result(60)
    assert r.stats["cached_tokens"] == len(prompt) - 1
    # a request waiting when the warm-up gets the engine stops it before its first chunk
    engine.reset_cache()
    long = engine.encode(PROMPT * 60)
    before = scheduler.warmed_tokens
    with engine.lock:  # the worker takes the warm-up, then waits for the engine
        scheduler.warm("file:///long.py", long)
        deadline = time.monotonic() + 30
        while scheduler._warm and time.monotonic() < deadline:
            time.sleep(0.001)
        fut = scheduler.submit(Job(engine.encode("x = 1\n"), GenParams(max_tokens=2), "off"))
    r = fut.result(60)
    while scheduler.warmed < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.finish_reason == "length" and scheduler.warmed == 2
    assert scheduler.warmed_tokens == before  # nothing fed: the request went first


def test_a_request_interrupts_the_warm_up_in_flight(engine):
    """A request's submit sets the engine's interrupt: a warm-up's forward in flight stops
    after its layer (test_engine: what that leaves cached), so the request waits for one
    layer, not the warm-up's whole chunk."""
    s = Scheduler(engine, None, Speculation(), 8)  # not started: no warm-up clears the flag
    flag = engine.runner.interrupt
    flag.clear()
    s.submit(Job(engine.encode("x = 1\n"), GenParams(max_tokens=2), "off"))
    assert flag.is_set()
    flag.clear()


def test_the_daemon_warms_the_prompt_after_open_and_after_a_pause(engine, tmp_path):
    """After an open (at the document's end) and after a typing pause (at the last edit),
    the daemon pre-fills the completion's prompt, so the completion re-feeds ~1 token."""
    from conftest import ServerThread, daemon_config

    text = "import os\n\n\ndef walk(root):\n" + "    x = os.path.join(root, 'a')\n" * 20
    srv = ServerThread(daemon_config(tmp_path), engine)  # its own: no earlier warm-ups
    try:
        with Client(srv.socket_path) as c:
            c.request("open", {"uri": "file:///warm.py", "text": text, "version": 1})
            wait_warmed(c, 1, "the open", 30)
            end = {"line": 24, "character": 0}
            r = c.request("complete", {"uri": "file:///warm.py", "position": end, "max_tokens": 2})
            assert r["stats"]["prompt_tokens"] - r["stats"]["cached_tokens"] <= 1
            pos = {"line": 5, "character": 0}  # an edit far above: then a pause
            change = {"range": {"start": pos, "end": pos}, "text": "    y = 2\n"}
            c.request("change", {"uri": "file:///warm.py", "version": 2, "changes": [change]})
            wait_warmed(c, 2, "the change", 30)
            at = {"line": 6, "character": 0}
            r = c.request("complete", {"uri": "file:///warm.py", "position": at, "max_tokens": 2})
            assert r["stats"]["prompt_tokens"] - r["stats"]["cached_tokens"] <= 1
    finally:
        srv.stop()


def test_a_prompt_depends_on_neither_the_cache_nor_the_timing(engine, tmp_path, monkeypatch):
    """The same completion asked cold (no cache holds its prompt: a jump far into a long
    document), warm (after a pause pre-filled it there) and right after the document is
    opened again gets the same prompt ids and the same text: a prompt is a function of the
    document, the cursor and the configuration."""
    from conftest import ServerThread, daemon_config

    prompts: list[list[int]] = []
    real_stream = engine.stream

    def recording_stream(prompt_ids, *args, **kwargs):  # the real decoding, prompts noted
        prompts.append(list(prompt_ids))
        return real_stream(prompt_ids, *args, **kwargs)

    monkeypatch.setattr(engine, "stream", recording_stream)
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(200))
    uri = "file:///same.py"  # ~4,000 tokens; the prompt holds limits.context_tokens of them
    spot = {"line": 3 * 80 + 1, "character": 4}  # the middle: far from the end an open warms
    ask = {"uri": uri, "position": spot, "max_tokens": 6, "speculation": "off"}
    engine.reset_cache()
    srv = ServerThread(daemon_config(tmp_path), engine)  # its own: no earlier warm-ups
    seen: list[tuple[str, dict, list[int]]] = []
    try:
        with Client(srv.socket_path) as c:

            def complete(label: str) -> None:
                prompts.clear()
                seen.append((label, c.request("complete", ask), prompts[0]))

            c.request("open", {"uri": uri, "text": text, "version": 1})
            wait_warmed(c, 1, "the open")  # the document's end, not the spot
            complete("cold")
            nothing = {"range": {"start": spot, "end": spot}, "text": ""}  # then a pause
            c.request("change", {"uri": uri, "version": 2, "changes": [nothing]})
            wait_warmed(c, 2, "the pause at the spot")
            complete("warm")
            c.request("close", {"uri": uri})
            c.request("open", {"uri": uri, "text": text, "version": 1})
            complete("right after open")
    finally:
        srv.stop()
    (_, cold, cold_ids), (_, warm, warm_ids), (_, opened, opened_ids) = seen
    assert cold["stats"]["cached_tokens"] < cold["stats"]["prompt_tokens"] // 2  # it was cold
    assert warm["stats"]["prompt_tokens"] - warm["stats"]["cached_tokens"] <= 1  # it was warm
    assert cold_ids == warm_ids == opened_ids
    assert cold["stats"]["prompt_tokens"] == len(cold_ids)
    assert cold["text"] == warm["text"] == opened["text"]


def test_recent_outputs_keep_the_last_few_per_document_and_few_documents():
    r = RecentOutputs(docs=2, per_doc=2, tail=2)
    assert r.get("a") is None
    r.add("a", [1, 2, 3], [10, 11])
    r.add("a", [4, 5, 6], [])  # nothing generated: nothing kept
    r.add(None, [1], [2])
    assert r.get("a") == [2, 3, 10, 11]
    r.add("a", [7], [12])
    r.add("a", [8, 9], [13])
    assert r.get("a") == [7, 12, 8, 9, 13]  # the last two, oldest first
    r.add("b", [1], [2])
    r.get("a")  # a used after b
    r.add("c", [1], [3])
    assert r.get("b") is None and r.get("a") is not None and len(r) == 2


def test_a_request_gets_what_the_last_ones_on_its_document_generated(engine, scheduler):
    """After a request on a document, the next one there is planned with its prompt's tail
    and output as ``recent_ids`` (the n-gram proposer's ``ngram:recent``; another
    document's request is not; nor with ``recent_outputs`` off), and typing the first
    tokens of that output then asking again gives what plain decoding gives."""
    ids = engine.encode(PROMPT)
    uri = "file:///recent.py"
    first = Job(ids, GenParams(max_tokens=24), "ngram", uri=uri)
    scheduler.submit(first).result(60)
    out = first.out_ids
    assert len(out) == 24
    typed = ids + out[:3]
    _, _, info = scheduler._plan(Job(typed, GenParams(max_tokens=16), "ngram", uri=uri))
    assert info.recent_ids == ids[-scheduler.recent.tail :] + out
    _, _, info = scheduler._plan(Job(typed, GenParams(max_tokens=16), "ngram", uri="file:///b"))
    assert info.recent_ids is None
    engine.reset_cache()
    ref, _ = engine.generate(typed, GenParams(max_tokens=16))
    job = Job(typed, GenParams(max_tokens=16), "ngram", uri=uri)
    assert scheduler.submit(job).result(60).text == engine.decode(ref)
    assert scheduler.recent.get(uri)[-len(job.out_ids) :] == job.out_ids  # kept in turn
    off = Scheduler(engine, None, Speculation(recent_outputs=False), max_queue=2)
    off.recent.add(uri, ids, out)
    _, _, info = off._plan(Job(typed, GenParams(max_tokens=16), "ngram", uri=uri))
    assert info.recent_ids is None
