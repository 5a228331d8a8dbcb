"""Running on after a one-line completion: the model's next tokens decoded while idle, so
the next request recalls them; it stops for a waiting request, and the scheduler runs on
only after a completion that stopped at its line's end, as ``[speculation]`` says."""

from __future__ import annotations

import threading

from codespec.daemon.config import Speculation
from codespec.daemon.engine.engine import GenParams
from codespec.daemon.service import scheduler as scheduler_module
from codespec.daemon.service.run_on import after_completion, run_on
from codespec.daemon.service.scheduler import Job, Scheduler

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul("


def test_run_on_leaves_the_next_tokens_for_the_next_request_to_recall(engine):
    prompt = engine.encode(PROMPT)
    engine.reset_cache()
    want, _ = engine.generate(prompt, GenParams(max_tokens=14))
    engine.reset_cache()
    first, _ = engine.generate(prompt, GenParams(max_tokens=4))  # the finished completion
    assert first == want[:4]
    assert run_on(engine, prompt + first, 8, lambda: False) == 8
    got, stats = engine.generate(prompt + want[:6], GenParams(max_tokens=8, recall=True))
    assert got == want[6:14] and stats.recalled == 6  # through the run's last token


def test_run_on_stops_for_a_waiting_request(engine):
    prompt = engine.encode(PROMPT)
    engine.reset_cache()
    engine.generate(prompt, GenParams(max_tokens=4))
    assert run_on(engine, prompt, 8, lambda: True) == 0
    calls = []

    def after_two() -> bool:
        calls.append(1)
        return len(calls) >= 3  # asked before the run and after each step

    engine.reset_cache()  # nothing to recall: a token a step
    assert run_on(engine, prompt, 8, after_two) == 2
    assert run_on(engine, prompt, 0, lambda: False) == 0


def test_after_completion_runs_on_the_local_engine_only_when_asked(engine):
    prompt = engine.encode(PROMPT)
    engine.reset_cache()
    first, _ = engine.generate(prompt, GenParams(max_tokens=4))
    after_completion(engine, 0, prompt + first, lambda: False)
    _, stats = engine.generate(prompt + first, GenParams(max_tokens=2, recall=True))
    assert stats.recalled == 0  # no run: the choice after the output was never computed
    engine.reset_cache()
    first, _ = engine.generate(prompt, GenParams(max_tokens=4))
    after_completion(engine, 4, prompt + first, lambda: False)
    _, stats = engine.generate(prompt + first, GenParams(max_tokens=2, recall=True))
    assert stats.recalled == 2


def test_the_scheduler_runs_on_after_a_completion_stopped_at_its_line(engine, monkeypatch):
    """A ``complete`` job that a stop string ended runs on with its prompt and output and
    ``run_on_tokens``; one that ran out of tokens, or another kind of job, does not."""
    calls: list[tuple[int, list[int]]] = []
    done = threading.Event()

    def record(eng, tokens, ids, waiting):
        calls.append((tokens, list(ids)))
        done.set()

    monkeypatch.setattr(scheduler_module, "after_completion", record)
    prompt = engine.encode(PROMPT)
    engine.reset_cache()
    ref, _ = engine.generate(prompt, GenParams(max_tokens=12))
    stop = engine.decode(ref[5:6])
    assert stop and stop not in engine.decode(ref[:5])
    s = Scheduler(engine, None, Speculation(run_on_tokens=6), max_queue=4)
    s.start()
    try:
        job = Job(prompt, GenParams(max_tokens=12), "off", kind="complete", stop=[stop])
        assert s.submit(job).result(60).finish_reason == "stop"
        assert done.wait(10)
        assert calls == [(6, prompt + job.out_ids)]
        for other in (Job(prompt, GenParams(max_tokens=3), "off", kind="complete"),
                      Job(prompt, GenParams(max_tokens=12), "off", stop=[stop])):  # fmt: skip
            s.submit(other).result(60)
    finally:
        s.stop()
    assert len(calls) == 1
