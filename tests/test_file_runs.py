"""File runs: the KV of a stretch of a file from a prompt anchor, kept apart from the slots
requests write into (``CacheSlots``), the anchors completion prompts start at and the
runs ``file_runs`` lists, and a daemon that warms them while idle so the first completion
at a far spot of an opened file re-feeds only the end of its prompt."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

from codespec.daemon.client import Client
from codespec.daemon.engine.engine import GenParams
from codespec.daemon.engine.slots import shared_prefix
from codespec.daemon.prompts import completion
from codespec.daemon.prompts.parts import anchors
from codespec.daemon.service.documents import DocumentStore

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(160))
CODE = (Path(os.__file__).parent / "textwrap.py").read_text(encoding="utf-8")  # real code


def text_of(engine, prompt: list[int], **kw) -> tuple[str, object]:
    ids, stats = engine.generate(prompt, GenParams(**kw))
    return engine.decode(ids), stats


@contextlib.contextmanager
def run_budget(engine, tokens: int):
    """The engine keeps ``tokens`` of runs for the block (the session's engine keeps none)."""
    saved = engine.slots.max_run_tokens
    engine.slots.max_run_tokens = tokens
    engine.reset_cache()
    try:
        yield
    finally:
        engine.slots.max_run_tokens = saved
        engine.reset_cache()


def test_requests_start_from_a_copy_of_a_run_which_stays_whole(engine):
    """Prompts that share 2/3, then 1/3, then 2/3 + 5 of a warmed run each reuse exactly
    what they share and give the cold output; the run stays whole. (Warmed into an
    ordinary slot, the first request cuts it at 2/3 and the third reuses only that.)"""
    run = engine.encode(TEXT[:3000])
    tail = engine.encode("value = compute(")
    cuts = [2 * len(run) // 3, len(run) // 3, 2 * len(run) // 3 + 5]
    prompts = [run[:k] + tail for k in cuts]
    cold = []
    for p in prompts:
        engine.reset_cache()
        cold.append(text_of(engine, p, max_tokens=6)[0])
    with run_budget(engine, 4 * len(run)):
        assert engine.warm(run, lambda: False, 64, run=True) == len(run) - 1
        forks = engine.slots.forks
        for p, want, k in zip(prompts, cold, cuts, strict=True):
            got, stats = text_of(engine, p, max_tokens=6)
            assert got == want
            assert stats.cached_tokens == k
        assert engine.slots.forks > forks  # (the second reuses the first one's slot)
        assert engine.cached_tokens(run) == len(run) - 1  # still whole


def test_runs_past_the_budget_go_least_recently_used_first(engine):
    """Three runs where two fit: the third drops the first; a request's own slot does not
    count against the runs' budget."""
    runs = [engine.encode(f"# part {k}\n" + TEXT[k * 500 : k * 500 + 1200]) for k in range(3)]
    with run_budget(engine, max(map(len, runs)) * 2 + 8):
        for r in runs:
            engine.warm(r, lambda: False, 64, run=True)
            text_of(engine, r[:50] + engine.encode("x = ("), max_tokens=2)
        assert engine.slots.run_tokens <= engine.slots.max_run_tokens
        assert engine.cached_tokens(runs[0]) < len(runs[0]) // 2
        assert engine.cached_tokens(runs[1]) == len(runs[1]) - 1
        assert engine.cached_tokens(runs[2]) == len(runs[2]) - 1


def test_spots_between_two_anchors_start_with_the_same_run(engine):
    """Completion prompts anywhere in a long file (a line's start, or typed into a line)
    begin with one of the file's runs, up to the last token or two of their prefix; the
    run nearest the cursor comes first."""
    store = DocumentStore()
    doc = store.open("file:///runs.py", CODE, 1, "python")

    def request(offset: int) -> completion.CompleteRequest:
        return completion.CompleteRequest(offset=offset, max_tokens=16, multiline=False,
                                          context_tokens=512, context="none")  # fmt: skip

    runs = completion.file_runs(engine, doc, request(len(CODE) // 2))
    assert len(runs) >= 8
    lines = [i for i, ch in enumerate(CODE) if ch == "\n"][::37]
    for offset in [*(n + 1 for n in lines), *(n + 7 for n in lines)]:
        cp = completion.complete_prompt(engine, CODE, offset, 16, 512)
        best = max(shared_prefix(r, cp.prompt_ids) for r in runs)
        assert best >= cp.prefix_end - 2, offset
    far = lines[-2] + 1
    first = completion.file_runs(engine, doc, request(far))[0]
    there = completion.complete_prompt(engine, CODE, far, 16, 512)
    assert shared_prefix(first, there.prompt_ids) >= there.prefix_end - 2


def test_a_prefix_starts_at_an_anchor_and_stays_put_while_typing():
    """The prefix's start is one of the anchors, at most ``max_chars`` before its end, and
    does not move while the end moves within a grid step."""
    start, points = anchors(TEXT, 5000, 900)
    assert start in points and 5000 - start <= 900
    assert all(TEXT[a - 1] == "\n" for a in points if a)
    assert {anchors(TEXT, end, 900)[0] for end in range(5000, 5100)} == {start}
    assert len({anchors(TEXT, end, 900)[0] for end in range(5000, 5600)}) == 2  # a step


@pytest.mark.parametrize("runs", [True, False])
def test_the_daemon_warms_a_files_runs_and_a_far_spot_refeeds_little(engine, tmp_path, runs):
    """After an open and an idle moment, the first completion at spots far apart in the
    file re-feeds only the end of its prompt (a FIM prompt's suffix and middle, else a
    token or two); with ``run_tokens = 0`` (the control) each re-feeds most of it."""
    from conftest import ServerThread, daemon_config

    budget = 16384 if runs else 0
    with run_budget(engine, budget):
        srv = ServerThread(daemon_config(tmp_path, context_tokens=512), engine)
        try:
            with Client(srv.socket_path) as c:
                c.request("open", {"uri": "file:///far.py", "text": CODE, "version": 1})
                deadline = time.monotonic() + 60
                while c.request("stats")["requests"]["warm_queued"]:  # every run warmed
                    assert time.monotonic() < deadline, "the runs were never warmed"
                    time.sleep(0.2)
                refed = []
                for line in (60, 250, 420, 150):
                    at = {"line": line, "character": 0}
                    r = c.request("complete", {"uri": "file:///far.py", "position": at,
                                               "max_tokens": 2, "speculation": "off"})  # fmt: skip
                    refed.append(r["stats"]["prompt_tokens"] - r["stats"]["cached_tokens"])
        finally:
            srv.stop()
    end = completion.SUFFIX_TOKENS + 8 if engine.fim is not None else 8  # after the prefix
    if runs:
        assert max(refed) <= end, refed
    else:
        assert min(refed) > end + 100, refed


def test_warm_ups_go_by_rank_over_the_documents_and_runs_wait_for_idleness():
    """Each document's prompt, then each one's nearest run, before any farther run (the
    newest document first on a tie); a prompt waits until the engine has been idle
    ``PROMPT_IDLE_S`` (a keystroke's completion in another document must not queue
    behind it), a run ``RUN_IDLE_S``; a newer put replaces a document's queue."""
    from codespec.daemon.service.warmups import PROMPT_IDLE_S, RUN_IDLE_S, WarmQueue

    assert 0.15 < PROMPT_IDLE_S < RUN_IDLE_S  # typing leaves ~0.1 s between completions
    q = WarmQueue()
    q.put("a", [1], [[11], [12], [13]])
    q.put("b", [2], [[21]])
    assert len(q) == 6
    job, wait = q.take(0.1)  # a prompt, the engine busy 0.1 s ago: typing elsewhere
    assert job is None and wait == pytest.approx(PROMPT_IDLE_S - 0.1)
    assert q.take(PROMPT_IDLE_S) == (([2], False), 0.0)  # b is newer
    assert q.take(PROMPT_IDLE_S) == (([1], False), 0.0)
    job, wait = q.take(0.1)  # a run, the engine busy 0.1 s ago
    assert job is None and wait == pytest.approx(RUN_IDLE_S - 0.1)
    order = [q.take(RUN_IDLE_S)[0][0] for _ in range(4)]
    assert order == [[21], [11], [12], [13]] and q.take(RUN_IDLE_S) == (None, 0.0)
    q.put("a", [1], [[11]])
    q.put("a", [], [[14]])
    assert len(q) == 1 and q.take(RUN_IDLE_S) == (([14], True), 0.0)
