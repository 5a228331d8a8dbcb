"""The scheduler: one worker thread owns the engine and serves requests fairly.

Owns: the request queue, the worker thread, fairness, cancellation, the speculation back-off
under load, the text of each request across its turns (incremental detokenization and stop
strings), the daemon-wide decoding statistics, and when to run on after a completion
(:mod:`.run_on`). What the last requests on each document generated (a draft source) is
:mod:`.recent`'s. Must not touch: sockets, documents, prompts; the engine's insides (it only
calls ``Engine.stream`` under ``Engine.lock``).

Fairness: round-robin with a quantum. The engine has one KV cache, so two requests cannot
interleave inside one ``Engine.stream``. A request runs for ``quantum_steps`` decode steps;
if another one is waiting, it is preempted (its generator closed) and queued at the back,
and it resumes later as a new ``stream`` over ``prompt + generated tokens``: the engine
reuses the longest cached prefix, so a resume re-feeds only what the other request
displaced. Greedy output is the same token for token as an uninterrupted run; with
temperature > 0 the distribution is unchanged but the random stream restarts on each turn
(a ``seed`` fixes only a request that is never preempted). Most single-line completions
finish inside one quantum. Switching costs a re-prefill of what the other request
displaced, so a turn also lasts until its decode time is at least ``SWITCH_COST_RATIO``
times its own prefill time: round-robin's re-prefill stays under 1 / (1 + ratio) of the work.

Speculation under load (``active``: requests running or waiting, not cancelled): from
``shorten_at`` the draft length halves per extra request, from ``off_at`` decoding is
plain; requests run one at a time, so a verify forward takes nothing from the others
(the defaults keep full drafts up to 8 active requests, where they still pay).

Cancellation: ``Job.cancel`` is checked by the engine after every target forward, and by
the worker before each turn, so a cancelled request stops within one decode step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from codespec.daemon.config import Speculation
from codespec.daemon.engine.engine import Constraint, GenParams, Stats
from codespec.daemon.engine.protocols import DecodingEngine
from codespec.daemon.prompts.parts import Prepared
from codespec.daemon.service.protocol import (
    BAD_PARAMS,
    CANCELLED,
    INTERNAL,
    OVERLOADED,
    ProtocolError,
)
from codespec.daemon.service.recent import RecentOutputs
from codespec.daemon.service.run_on import after_completion
from codespec.daemon.service.warmups import RUN_CHUNK, WARM_CHUNK, WarmQueue, Warmup
from codespec.daemon.text.tracker import TextTracker
from codespec.speculators.draft import Proposer, RequestInfo
from codespec.speculators.registry import make_proposer

if TYPE_CHECKING:
    from codespec.ngram_index import NgramIndex
    from codespec.speculators.target import TargetModel

log = logging.getLogger("codespec.daemon")

SWITCH_COST_RATIO = 4.0


class LockedIndex:
    """The n-gram index behind a lock: proposers look up on the worker thread while the
    event loop and the workspace watcher mutate it."""

    def __init__(self, index: NgramIndex, lock: threading.Lock) -> None:
        self._index = index
        self.lock = lock

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
    """One request for the worker. ``on_delta`` runs on the worker thread.

    ``tracker`` reads the output back as text (stop strings, healing's skipped text,
    stop lines...); whoever builds the job and knows the prompt sets it up
    (:mod:`codespec.daemon.prompts.completion`), else the worker makes a plain one
    with ``stop``.
    """

    prompt_ids: list[int]
    params: GenParams
    speculation: str = "auto"
    kind: str = "generate"
    uri: str | None = None
    draft_text_ids: list[int] | None = None
    stop: list[str] = field(default_factory=list)
    tracker: TextTracker | None = None
    on_delta: Callable[[str], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    # progress, owned by the worker
    out_ids: list[int] = field(default_factory=list)
    submitted: float = field(default_factory=time.perf_counter)
    started: float = 0.0
    first_delta: float = 0.0
    turns: int = 0
    speculation_used: str = ""
    totals: Stats = field(default_factory=Stats)


def prepared_job(prep: Prepared, params: GenParams, speculation: str, kind: str, uri: str) -> Job:
    """A job for a request :mod:`codespec.daemon.prompts.completion` prepared."""
    params.constraint = prep.constraint
    return Job(prep.prompt_ids, params, speculation, kind, uri, prep.draft_ids,
               tracker=prep.tracker)  # fmt: skip


def speculation_policy(
    requested: str, max_draft: int, active: int, cfg: Speculation
) -> tuple[str, int]:
    """(proposer name, max draft) for a request when ``active`` requests compete."""
    if requested == "off" or active >= cfg.off_at:
        return "off", 0
    if active >= cfg.shorten_at:
        return requested, max(1, max_draft >> (active - cfg.shorten_at + 1))
    return requested, max_draft


def _resumed(constraint: Constraint | None, done: list[int]) -> Constraint | None:
    """A constraint over a request's whole output, for a turn that starts after ``done``."""
    if constraint is None:
        return None
    return lambda ids: constraint(done + ids)


class TurnRecorder(Protocol):
    """What the scheduler tells an open live view (``codespec.daemon.view``'s Recorder, which
    the service imports nothing of): each turn's proposer, wrapped to note its steps, and
    each request's end."""

    def wrap(
        self, job: Job, proposer: Proposer | None, name: str, max_draft: int, active: int
    ) -> Proposer | None: ...

    def finish(self, job: Job, finish: str) -> None: ...


class Scheduler:
    def __init__(
        self,
        engine: DecodingEngine,
        index: LockedIndex | None,
        spec_cfg: Speculation,
        max_queue: int,
    ) -> None:
        self.engine = engine
        self.index = index
        self.cfg = spec_cfg
        self.max_queue = max_queue
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._running: Job | None = None
        self._last_busy = 0.0  # time.monotonic() of the last submit or finish
        self._thread = threading.Thread(target=self._run, name="codespec-engine", daemon=True)
        # daemon-wide statistics
        self.served = 0
        self.cancelled = 0
        self.failed = 0
        self.tokens = 0
        self.busy_s = 0.0
        self.drafted: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self._warm = WarmQueue()  # what to prefill when idle
        self.recent = RecentOutputs()  # what requests generated, per document: drafts
        self.warmed = 0
        self.warmed_tokens = 0
        self.view: TurnRecorder | None = None  # the open live view's recorder, else None

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
            if job.tracker is None:
                tok = self.engine.tokenizer.backend_tokenizer
                job.tracker = TextTracker(tok, job.prompt_ids, job.stop)
            self._queue.append(job)
            self._last_busy = time.monotonic()
            self._cond.notify_all()
        self.engine.interrupt()  # a warm-up's forward in flight stops after its layer
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
            "warmed": self.warmed,
            "warmed_tokens": self.warmed_tokens,
            "warm_queued": len(self._warm),
            "proposers": sources,
        }

    # -- worker -------------------------------------------------------------------------
    def warm(self, uri: str, prompt_ids: list[int], runs: Sequence[list[int]] = ()) -> None:
        """Prefill ``prompt_ids`` (a completion's in ``uri``; may be empty), then ``uri``'s
        file ``runs``, while idle (:class:`~codespec.daemon.service.warmups.WarmQueue`:
        they replace ``uri``'s not started); requests go first, between chunks."""
        with self._cond:
            self._warm.put(uri, prompt_ids, runs)
            self._cond.notify_all()

    def _next(self) -> Job | Warmup | None:
        """The next request, else the next warm-up (a file run once the engine has been
        idle a while: :meth:`WarmQueue.take`), else wait (None: stopping)."""
        with self._cond:
            while True:
                if self._queue:
                    job = self._queue.popleft()
                    self._running = job
                    return job
                if self._stopping:
                    return None
                warm, later = self._warm.take(time.monotonic() - self._last_busy)
                if warm is not None:
                    return warm
                self._cond.wait(later or None)

    def _run(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            if not isinstance(job, Job):
                self._warm_up(*job)
                continue
            try:
                self._turn(job)
            except ProtocolError as exc:  # an outcome with its code (a backend's failure)
                self._finish(job, error=exc)
            except Exception as exc:  # a bug: fail this request, keep serving
                log.exception("request failed")
                self.engine.reset_cache()
                self._finish(job, error=ProtocolError(INTERNAL, f"{type(exc).__name__}: {exc}"))
            finally:
                with self._cond:
                    if self._running is job:
                        self._running = None

    def _warm_up(self, prompt: list[int], run: bool) -> None:
        try:
            with self.engine.lock:
                cached = self.engine.warm(prompt, lambda: bool(self._queue) or self._stopping,
                                          RUN_CHUNK if run else WARM_CHUNK, run=run)  # fmt: skip
        except Exception:  # a warm-up is a guess: never let it take the worker down
            log.exception("warming a prompt failed")
            self.engine.reset_cache()
            return
        self.warmed += 1
        self.warmed_tokens += cached

    def _others_waiting(self) -> bool:
        with self._cond:
            return any(not j.cancel.is_set() for j in self._queue)

    def _turn(self, job: Job) -> None:
        """Run ``job`` until it finishes or its quantum ends with others waiting."""
        if job.cancel.is_set():
            self._finish(job, "cancelled")
            return
        if job.params.max_tokens - len(job.out_ids) <= 0:
            self._finish(job, "length")
            return
        try:
            proposer, params, info = self._plan(job)
        except (ValueError, LookupError) as exc:  # "eagle" with no head: the request's fault
            self._finish(job, error=ProtocolError(BAD_PARAMS, str(exc)))
            return
        job.started = job.started or time.perf_counter()
        job.turns += 1
        t0 = time.perf_counter()
        with self.engine.lock:
            try:
                finish, stats = self._decode(job, proposer, params, info)
            except ValueError as exc:  # the prompt does not fit, or the context is full
                if not job.out_ids:
                    self._finish(job, error=ProtocolError(BAD_PARAMS, str(exc)))
                    return
                finish, stats = "length", None
        self._account(job, stats, time.perf_counter() - t0)
        if finish or job.cancel.is_set():
            self._finish(job, finish or "cancelled")
            if finish == "stop" and job.kind == "complete" and job.params.temperature <= 0:
                after_completion(self.engine, self.cfg.run_on_tokens, job.prompt_ids + job.out_ids,
                                 lambda: self._stopping or self._others_waiting())  # fmt: skip
            return
        with self._cond:  # preempted: back of the queue
            self._queue.append(job)
            self._cond.notify_all()

    def _plan(self, job: Job) -> tuple[Proposer | None, GenParams, RequestInfo]:
        """This turn's proposer (speculation backs off under load), parameters and info:
        the request resumes after what it generated in earlier turns."""
        with self._cond:
            active = self._active_locked()
        name, max_draft = speculation_policy(
            job.speculation, job.params.max_draft, active, self.cfg
        )
        # a remote engine (codespec.daemon.backends) speculates on its server: no proposer
        remote = getattr(self.engine, "remote", False)
        proposer: Proposer | None = None
        if not remote:  # the daemon's own engine: the target model proposers read
            proposer = make_proposer(name, cast("TargetModel", self.engine), self.index)
        if (view := self.view) is not None:  # the view notes this turn's steps
            proposer = view.wrap(job, proposer, name, max_draft, active)
        job.speculation_used = job.speculation_used or name
        if name == "off" and job.speculation != "off":
            job.speculation_used = "off (busy)"
        p = job.params
        remaining = p.max_tokens - len(job.out_ids)
        params = GenParams(
            max_tokens=remaining,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed,
            max_draft=max(1, max_draft),
            constraint=_resumed(p.constraint, list(job.out_ids)),
            lead_step=self.cfg.lead_step,
            recall=self.cfg.recall,
        )
        info = RequestInfo(
            prompt_ids=job.prompt_ids + job.out_ids,
            uri=job.uri,
            temperature=p.temperature,
            max_tokens=remaining,
            kind=job.kind,
            draft_text_ids=job.draft_text_ids,
            recent_ids=self.recent.get(job.uri) if self.cfg.recent_outputs else None,
        )
        return proposer, params, info

    def _decode(
        self, job: Job, proposer: Proposer | None, params: GenParams, info: RequestInfo
    ) -> tuple[str, Stats | None]:
        """One turn of decoding under the engine lock: ``(finish reason or "" when
        preempted, the turn's stats)``. Text goes out as it is read back."""
        assert job.tracker is not None
        steps, stats = 0, None
        gen = self.engine.stream(info.prompt_ids, params, proposer, info, job.cancel)
        try:
            for step in gen:
                stats = step.stats
                ids = [t for t in step.token_ids if t not in self.engine.stop_ids]
                job.out_ids.extend(ids)
                text, hit = job.tracker.feed(ids, final=step.done)
                self._send(job, text)
                if hit:
                    return ("loop" if job.tracker.looped else "stop"), stats
                if step.done:
                    return step.stats.finish_reason, stats
                steps += 1
                decode_ms = stats.total_ms - stats.prefill_ms
                if (
                    steps >= self.cfg.quantum_steps
                    and decode_ms >= SWITCH_COST_RATIO * stats.prefill_ms
                    and self._others_waiting()
                ):
                    return "", stats
        finally:
            gen.close()
        return "", stats

    def _send(self, job: Job, text: str) -> None:
        if not text:
            return
        job.first_delta = job.first_delta or time.perf_counter()
        if job.on_delta is not None and not job.cancel.is_set():
            job.on_delta(text)

    def _account(self, job: Job, stats: Stats | None, seconds: float) -> None:
        self.busy_s += seconds
        if stats is None:
            return
        job.totals.add(stats)
        for mine, theirs in ((self.drafted, stats.drafted), (self.accepted, stats.accepted)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v

    def _finish(self, job: Job, finish: str = "", error: ProtocolError | None = None) -> None:
        with self._cond:
            if self._running is job:
                self._running = None
            self._last_busy = time.monotonic()
        if (view := self.view) is not None:
            view.finish(job, error.code if error is not None else finish)
        self.recent.add(job.uri, job.prompt_ids, job.out_ids)  # cancelled ones too
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
        rest, _ = job.tracker.feed([], final=True)
        self._send(job, rest)
        self.served += 1
        self.tokens += len(job.out_ids)
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            job.future.set_result(JobResult(job.tracker.text, self._stats(job, finish), finish))

    def _stats(self, job: Job, finish: str) -> dict[str, Any]:
        """The request's stats as the client gets them (the engine's, summed over turns,
        with the times seen from the queue)."""
        now = time.perf_counter()
        t = job.totals
        t.tokens = len(job.out_ids)
        t.total_ms = (now - job.submitted) * 1000
        t.ttft_ms = ((job.first_delta or now) - job.submitted) * 1000
        t.finish_reason = finish
        return {
            **t.as_dict(),
            "queue_ms": round(((job.started or now) - job.submitted) * 1000, 2),
            "turns": job.turns,
            "speculation": job.speculation_used or job.speculation,
        }
