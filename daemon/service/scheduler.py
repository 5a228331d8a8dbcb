"""The scheduler: one worker thread owns the engine and serves requests fairly.

Owns: the request queue, the worker thread, fairness, cancellation, the
speculation back-off under load, the text of each request across its turns
(incremental detokenization and stop strings), and the daemon-wide decoding
statistics. Must not touch: sockets, documents, prompts; the engine's insides
(it only calls ``Engine.stream`` under ``Engine.lock``).

Fairness: round-robin with a quantum. The engine has one KV cache, so two
requests cannot interleave inside one ``Engine.stream``. A request runs for
``quantum_steps`` decode steps; if another one is waiting, it is preempted
(its generator closed) and queued at the back, and it resumes later as a new
``stream`` over ``prompt + generated tokens``: the engine reuses the longest
cached prefix, so a resume re-feeds only what the other request displaced.
Greedy output is the same token for token as an uninterrupted run; with
temperature > 0 the distribution is unchanged but the random stream restarts
on each turn (a ``seed`` fixes only a request that is never preempted).
Most single-line completions finish inside one quantum. Switching costs a
re-prefill of what the other request displaced, so a turn also lasts until its
decode time is at least ``SWITCH_COST_RATIO`` times its own prefill time: the
re-prefill overhead of round-robin stays under 1 / (1 + ratio) of the work.

Speculation under load (``active`` = requests running or waiting, cancelled
ones not counted): below ``shorten_at`` the request's full draft length;
from ``shorten_at`` the draft length halves per extra request; from
``off_at`` speculation is off (plain decoding), so that verification work
never crowds out other requests' plain decode steps.

Cancellation: ``Job.cancel`` is checked by the engine after every target
forward, and by the worker before each turn, so a cancelled request stops
within one decode step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from codespec.daemon.engine.engine import GenParams, TextTracker
from codespec.daemon.service.protocol import (
    BAD_PARAMS,
    CANCELLED,
    INTERNAL,
    OVERLOADED,
    ProtocolError,
)
from codespec.speculators.draft import RequestInfo
from codespec.speculators.registry import make_proposer

log = logging.getLogger("codespec.daemon")

SWITCH_COST_RATIO = 4.0


class LockedIndex:
    """The n-gram index behind a lock: proposers look up on the worker thread while the
    event loop and the workspace watcher mutate it."""

    def __init__(self, index: Any, lock: threading.Lock) -> None:
        self._index = index
        self.lock = lock

    @property
    def index(self) -> Any:
        return self._index

    def replace(self, index: Any) -> None:
        with self.lock:
            self._index = index

    def lookup(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return self._index.lookup(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._index, name)


@dataclass
class JobResult:
    text: str
    stats: dict[str, Any]
    finish_reason: str


@dataclass
class Job:
    """One request for the worker. ``on_delta`` runs on the worker thread."""

    prompt_ids: list[int]
    params: GenParams
    speculation: str = "auto"
    kind: str = "generate"
    uri: str | None = None
    draft_text_ids: list[int] | None = None
    # How the output is read back (see completion.CompletionPrompt): healed text the
    # output starts with, and the lines that end a completion.
    heal: str = ""
    lead: str = ""
    stop_lines: tuple[str, ...] = ()
    first_line_counts: bool = False
    region: tuple[int, int] | None = None
    trailing: str | None = None
    on_delta: Callable[[str], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    # progress, owned by the worker
    out_ids: list[int] = field(default_factory=list)
    tracker: TextTracker | None = None
    submitted: float = field(default_factory=time.perf_counter)
    started: float = 0.0
    first_delta: float = 0.0
    turns: int = 0
    totals: dict[str, Any] = field(default_factory=dict)


def speculation_policy(requested: str, max_draft: int, active: int, cfg: Any) -> tuple[str, int]:
    """(proposer name, max draft) for a request when ``active`` requests compete."""
    if requested == "off" or active >= cfg.off_at:
        return "off", 0
    if active >= cfg.shorten_at:
        return requested, max(1, max_draft >> (active - cfg.shorten_at + 1))
    return requested, max_draft


def _resumed(constraint: Any, done: list[int]) -> Any:
    """A constraint over a request's whole output, for a turn that starts after ``done``."""
    if constraint is None:
        return None
    return lambda ids: constraint(done + ids)


class Scheduler:
    def __init__(self, engine: Any, index: LockedIndex | None, spec_cfg: Any, max_queue: int):
        self.engine = engine
        self.index = index
        self.cfg = spec_cfg
        self.max_queue = max_queue
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._running: Job | None = None
        self._thread = threading.Thread(target=self._run, name="codespec-engine", daemon=True)
        # daemon-wide statistics
        self.served = 0
        self.cancelled = 0
        self.failed = 0
        self.tokens = 0
        self.busy_s = 0.0
        self.drafted: dict[str, int] = {}
        self.accepted: dict[str, int] = {}

    # -- API (any thread) ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything, let the worker finish its step and exit."""
        with self._cond:
            self._stopping = True
            for job in self._queue:
                job.cancel.set()
            if self._running is not None:
                self._running.cancel.set()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, job: Job) -> concurrent.futures.Future:
        with self._cond:
            if self._stopping:
                raise ProtocolError(CANCELLED, "the daemon is shutting down")
            if self._active_locked() >= self.max_queue:
                raise ProtocolError(OVERLOADED, f"{self.max_queue} requests are in flight already")
            job.tracker = TextTracker(
                self.engine.decode,
                job.params.stop,
                skip=job.heal,
                stop_lines=job.stop_lines,
                first_line_counts=job.first_line_counts,
                cut_loops=job.kind == "complete",
                lead=job.lead,
                region=job.region,
                trailing=job.trailing,
            )
            self._queue.append(job)
            self._cond.notify_all()
        return job.future

    def _active_locked(self) -> int:
        n = sum(1 for j in self._queue if not j.cancel.is_set())
        running = self._running
        return n + (1 if running is not None and not running.cancel.is_set() else 0)

    @property
    def active(self) -> int:
        with self._cond:
            return self._active_locked()

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    @property
    def idle(self) -> bool:
        """No request running or queued (cancelled ones included)."""
        with self._cond:
            return self._running is None and not self._queue

    def stats(self) -> dict[str, Any]:
        with self._cond:
            active = self._active_locked()
            queued = len(self._queue)
        sources = {
            src: {
                "drafted": n,
                "accepted": self.accepted.get(src, 0),
                "acceptance": round(self.accepted.get(src, 0) / n, 3) if n else 0.0,
            }
            for src, n in sorted(self.drafted.items())
        }
        return {
            "in_flight": active,
            "queued": queued,
            "served": self.served,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens / self.busy_s, 1) if self.busy_s else 0.0,
            "proposers": sources,
        }

    # -- worker -------------------------------------------------------------------------
    def _next(self) -> Job | None:
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping and not self._queue:
                return None
            job = self._queue.popleft()
            self._running = job
            return job

    def _run(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            try:
                self._turn(job)
            except Exception as exc:  # a bug: fail this request, keep serving
                log.exception("request failed")
                self.engine.reset_cache()
                self._finish(job, error=ProtocolError(INTERNAL, f"{type(exc).__name__}: {exc}"))
            finally:
                with self._cond:
                    if self._running is job:
                        self._running = None

    def _others_waiting(self) -> bool:
        with self._cond:
            return any(not j.cancel.is_set() for j in self._queue)

    def _turn(self, job: Job) -> None:
        """Run ``job`` until it finishes or its quantum ends with others waiting."""
        if job.cancel.is_set():
            self._finish(job, "cancelled")
            return
        remaining = job.params.max_tokens - len(job.out_ids)
        if remaining <= 0:
            self._finish(job, "length")
            return
        with self._cond:
            active = self._active_locked()
        name, max_draft = speculation_policy(
            job.speculation, job.params.max_draft, active, self.cfg
        )
        try:
            proposer = make_proposer(name, self.engine, self.index)
        except (ValueError, LookupError) as exc:  # "eagle" with no head: the request's fault
            self._finish(job, error=ProtocolError(BAD_PARAMS, str(exc)))
            return
        prompt = job.prompt_ids + job.out_ids
        params = GenParams(
            max_tokens=remaining,
            temperature=job.params.temperature,
            top_p=job.params.top_p,
            seed=job.params.seed,
            stop=job.params.stop,
            max_draft=max(1, max_draft),
            constraint=_resumed(job.params.constraint, list(job.out_ids)),
            heal="" if job.out_ids else job.heal,
        )
        info = RequestInfo(
            prompt_ids=prompt,
            uri=job.uri,
            temperature=params.temperature,
            max_tokens=remaining,
            kind=job.kind,
            draft_text_ids=job.draft_text_ids,
        )
        if not job.started:
            job.started = time.perf_counter()
        job.turns += 1
        job.totals.setdefault("speculation", name)
        if name == "off" and job.speculation != "off":
            job.totals["speculation"] = "off (busy)"
        assert job.tracker is not None
        stop_ids = self.engine.stop_ids
        finish = ""
        stats = None
        t0 = time.perf_counter()
        steps = 0
        with self.engine.lock:
            try:
                gen = self.engine.stream(prompt, params, proposer, info, job.cancel)
            except ValueError as exc:
                self._finish(job, error=ProtocolError(BAD_PARAMS, str(exc)))
                return
            try:
                for delta in gen:
                    stats = delta.stats
                    for tok in delta.token_ids:
                        if tok in stop_ids or len(job.out_ids) >= job.params.max_tokens:
                            break
                        job.out_ids.append(tok)
                    text, hit = job.tracker.update(job.out_ids, final=delta.done)
                    if hit:
                        finish = "loop" if job.tracker.looped else "stop"
                    elif delta.done:
                        finish = delta.stats.finish_reason
                    if text and not job.first_delta:
                        job.first_delta = time.perf_counter()
                    if text and job.on_delta is not None and not job.cancel.is_set():
                        job.on_delta(text)
                    if finish:
                        break
                    steps += 1
                    decode_ms = (time.perf_counter() - t0) * 1000 - delta.stats.prefill_ms
                    if (
                        steps >= self.cfg.quantum_steps
                        and decode_ms >= SWITCH_COST_RATIO * delta.stats.prefill_ms
                        and job.tracker.clean_cut
                        and self._others_waiting()
                    ):
                        break
            except ValueError as exc:  # the context is full
                if not job.out_ids:
                    self._finish(job, error=ProtocolError(BAD_PARAMS, str(exc)))
                    return
                finish = "length"
            finally:
                gen.close()
        self._account(job, stats, time.perf_counter() - t0)
        if finish:
            self._finish(job, finish)
            return
        if job.cancel.is_set():
            self._finish(job, "cancelled")
            return
        with self._cond:  # preempted: back of the queue
            self._queue.append(job)
            self._cond.notify_all()

    def _account(self, job: Job, stats: Any, seconds: float) -> None:
        self.busy_s += seconds
        if stats is None:
            return
        t = job.totals
        if "prompt_tokens" not in t:
            t["prompt_tokens"] = stats.prompt_tokens
            t["cached_tokens"] = stats.cached_tokens
        for key in ("target_forwards", "decode_steps"):
            t[key] = t.get(key, 0) + getattr(stats, key)
        t["prefill_ms"] = t.get("prefill_ms", 0.0) + stats.prefill_ms
        for name, src in (("drafted", stats.drafted), ("accepted", stats.accepted)):
            mine = t.setdefault(name, {})
            total = self.drafted if name == "drafted" else self.accepted
            for k, v in src.items():
                mine[k] = mine.get(k, 0) + v
                total[k] = total.get(k, 0) + v

    def _finish(self, job: Job, finish: str = "", error: ProtocolError | None = None) -> None:
        with self._cond:
            if self._running is job:
                self._running = None
        if error is None and (finish == "cancelled" or job.future.done()):
            error = ProtocolError(CANCELLED, "the request was cancelled")
        if error is not None:
            if error.code == CANCELLED:
                self.cancelled += 1
            else:
                self.failed += 1
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                job.future.set_exception(error)  # the waiter may have gone (cancelled)
            return
        assert job.tracker is not None
        rest, _ = job.tracker.update(job.out_ids, final=True)
        if rest and job.on_delta is not None:
            job.on_delta(rest)
        now = time.perf_counter()
        t = job.totals
        tokens = len(job.out_ids)
        forwards = t.get("target_forwards", 0)
        steps = t.get("decode_steps", 0)
        total_ms = (now - job.submitted) * 1000
        stats = {
            "prompt_tokens": t.get("prompt_tokens", len(job.prompt_ids)),
            "cached_tokens": t.get("cached_tokens", 0),
            "tokens": tokens,
            "target_forwards": forwards,
            "tokens_per_forward": round(tokens / forwards, 3) if forwards else 0.0,
            "mean_accepted_no_bonus": round(sum(t.get("accepted", {}).values()) / steps, 3)
            if steps
            else 0.0,
            "drafted": t.get("drafted", {}),
            "accepted": t.get("accepted", {}),
            "prefill_ms": round(t.get("prefill_ms", 0.0), 2),
            "queue_ms": round(((job.started or now) - job.submitted) * 1000, 2),
            "ttft_ms": round(((job.first_delta or now) - job.submitted) * 1000, 2),
            "total_ms": round(total_ms, 2),
            "tokens_per_s": round(1000 * tokens / total_ms, 1) if total_ms > 0 else 0.0,
            "turns": job.turns,
            "speculation": t.get("speculation", job.speculation),
            "finish_reason": finish,
        }
        self.served += 1
        self.tokens += tokens
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            job.future.set_result(JobResult(job.tracker.text, stats, finish))
