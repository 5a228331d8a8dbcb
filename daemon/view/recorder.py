"""The view's data: a bounded ring of per-request records, filled on the worker thread.

Owns: :class:`Recorder` (the ring of finished requests and the few in flight) and
:class:`RecordingProposer`, the proposer wrapper the scheduler puts around a turn's
proposer while the view is open. It notes what ``codespec bench --steps`` notes
(:class:`codespec.daemon.bench.decoding.StepLog`: each verified step, who drafted it,
its accepted nodes and forward ms) plus the draft's rejected path and the step's times.
Must not touch: the engine, the scheduler's queue, sockets; text is decoded later, on
the event loop (:mod:`.snapshot`), never on the worker thread.

Bounds: ``ring`` finished records (oldest dropped), ``MAX_LIVE`` in flight, ``MAX_STEPS``
steps per record and ``MAX_REJECTED`` rejected tokens per step. With the view closed the
scheduler holds no recorder and nothing here runs.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from codespec.speculators.draft import Draft, Proposer, RequestInfo, StepResult

if TYPE_CHECKING:
    from codespec.daemon.service.scheduler import Job

MAX_LIVE = 256  # records of requests not finished yet (a leak guard: the queue is smaller)
MAX_STEPS = 1024  # steps kept per record (limits.max_tokens' default)
MAX_REJECTED = 16  # tokens of a step's rejected path kept
PROMPT_TAIL = 160  # prompt tokens kept (shown before the ghost text)


@dataclass
class StepRecord:
    """One verified step: who drafted it (its first node's source; ``plain`` without a
    draft), the draft's nodes, the produced tokens with their sources (the last is the
    target's ``bonus`` token), the rejected path's tokens, and its times (perf_counter
    seconds: propose start / end, observe) with the verify forward's ms."""

    source: str
    nodes: int
    tokens: list[int]
    sources: list[str]
    rejected: list[int]
    t_propose: float
    t_drafted: float
    t_observed: float
    forward_ms: float
    choice: str = ""  # the policy's proposer in charge (Controller.choice), when it has one


@dataclass
class Turn:
    """One ``Engine.stream`` of a request (a request preempted runs several): when its
    prefill began, its proposer and draft length under the load at that moment; ``lead``:
    its first step was rooted at the prompt's last token (``StepResult.lead``), so no
    prefill gave it a first token."""

    t_begin: float
    speculation: str
    max_draft: int
    active: int
    steps: list[StepRecord] = field(default_factory=list)
    lead: bool = False


@dataclass
class Record:
    """One request, as the page shows it (ids, not text: :mod:`.snapshot` decodes; the
    prompt's last ``PROMPT_TAIL`` ids only)."""

    seq: int
    kind: str
    uri: str | None
    requested: str
    prompt_ids: list[int]
    submitted: float
    turns: list[Turn] = field(default_factory=list)
    out_ids: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    started: float = 0.0
    first_delta: float = 0.0
    finished: float = 0.0
    finish: str = ""
    dropped_steps: int = 0
    cache: Any = None  # the snapshot's JSON form, made once by :mod:`.snapshot`


def rejected_path(
    draft: Draft | None, accepted: Sequence[int], limit: int = MAX_REJECTED
) -> list[int]:
    """The draft's tokens after the accepted path that verification turned down: the first
    child of the accepted path's last node that was not accepted, then its first children.

    >>> from codespec.speculators.draft import Draft
    >>> rejected_path(Draft([5, 6, 7, 8], [-1, 0, 1, 0]), [0])
    [6, 7]
    """
    if draft is None or not len(draft):
        return []
    parents = draft.parents if draft.parents is not None else list(range(-1, len(draft) - 1))
    taken = set(accepted)
    end = accepted[-1] if accepted else -1
    node = next((i for i, p in enumerate(parents) if p == end and i not in taken), None)
    out: list[int] = []
    while node is not None and len(out) < limit:
        out.append(int(draft.tokens[node]))
        node = next((i for i, p in enumerate(parents) if p == node), None)
    return out


class RecordingProposer:
    """A turn's proposer (or none: plain decoding) that notes each step into ``turn``;
    otherwise the proposer itself (every other attribute is its own)."""

    def __init__(self, proposer: Proposer | None, turn: Turn) -> None:
        self._proposer = proposer
        self._turn = turn
        self._t_propose = 0.0
        self._t_drafted = 0.0
        self._choice = ""

    def __getattr__(self, name: str) -> Any:
        if self._proposer is None:
            raise AttributeError(name)
        return getattr(self._proposer, name)

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(getattr(self._proposer, "taps", ()) or ())

    def begin(self, request: RequestInfo) -> None:
        self._turn.t_begin = time.perf_counter()
        if self._proposer is not None:
            self._proposer.begin(request)

    def propose(self, context: Sequence[int], budget: int) -> Draft | None:
        self._t_propose = time.perf_counter()
        draft = self._proposer.propose(context, budget) if self._proposer is not None else None
        self._t_drafted = time.perf_counter()
        self._choice = str(getattr(self._proposer, "choice", "") or "")
        return draft

    def observe(self, result: StepResult) -> None:
        t = time.perf_counter()
        if self._proposer is not None:
            self._proposer.observe(result)
        if result.lead and not self._turn.steps:
            self._turn.lead = True
        if len(self._turn.steps) >= MAX_STEPS:
            return
        draft = result.draft
        nodes = len(draft) if draft is not None else 0
        sources = [draft.source(a) for a in result.accepted] if nodes else []
        self._turn.steps.append(
            StepRecord(
                source=draft.source(0) if nodes else "plain",
                nodes=nodes,
                tokens=[int(x) for x in result.tokens],
                sources=[*sources, "bonus"],
                rejected=rejected_path(draft, result.accepted) if nodes else [],
                t_propose=self._t_propose,
                t_drafted=self._t_drafted,
                t_observed=t,
                forward_ms=float(result.forward_ms),
                choice=self._choice,
            )
        )

    def follow(self, result: StepResult) -> None:
        if self._proposer is not None:
            self._proposer.follow(result)


class Recorder:
    """The ring of the last ``ring`` requests. ``wrap`` and ``finish`` run on the worker
    thread; ``since`` on any. ``on_record`` (set by the page's server) hears of each
    finished record, from the worker thread."""

    def __init__(self, ring: int = 200) -> None:
        self.ring = max(1, int(ring))
        self._done: collections.deque[Record] = collections.deque(maxlen=self.ring)
        self._live: dict[int, Record] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self.on_record: Callable[[Record], None] | None = None

    def __len__(self) -> int:
        return len(self._done)

    def wrap(
        self, job: Job, proposer: Proposer | None, name: str, max_draft: int, active: int
    ) -> Proposer | None:
        """``proposer`` for this turn of ``job``, noting its steps into ``job``'s record."""
        rec = self._live.get(id(job))
        if rec is None:
            if len(self._live) >= MAX_LIVE:
                return proposer
            rec = Record(next(self._seq), job.kind, job.uri, job.speculation,
                         job.prompt_ids[-PROMPT_TAIL:], job.submitted)  # fmt: skip
            self._live[id(job)] = rec
        turn = Turn(time.perf_counter(), name, max_draft if name != "off" else 0, active)
        rec.turns.append(turn)
        return RecordingProposer(proposer, turn)

    def finish(self, job: Job, finish: str) -> None:
        """``job`` ended (``finish``: its reason, or the error's code): its record, with the
        engine's figures summed over its turns (``job.totals``), joins the ring. A job that
        never ran a turn (cancelled in the queue) has none."""
        rec = self._live.pop(id(job), None)
        if rec is None:
            return
        rec.finished = time.perf_counter()
        rec.prompt_ids = job.prompt_ids[-PROMPT_TAIL:]  # the prompt the job ran, its tail
        rec.out_ids = list(job.out_ids)
        rec.started, rec.first_delta = job.started, job.first_delta
        rec.finish = finish
        t = job.totals
        rec.stats = {
            "prompt_tokens": t.prompt_tokens,
            "cached_tokens": t.cached_tokens,
            "target_forwards": t.target_forwards,
            "decode_steps": t.decode_steps,
            "drafted": dict(t.drafted),
            "accepted": dict(t.accepted),
            "prefill_ms": t.prefill_ms,
        }
        with self._lock:
            self._done.append(rec)
        callback = self.on_record
        if callback is not None:
            callback(rec)

    def since(self, seq: int = 0, last: int | None = None) -> list[Record]:
        """Finished records newer than ``seq``, oldest first (at most the ``last`` ones)."""
        with self._lock:
            out = [r for r in self._done if r.seq > seq]
        return out[-last:] if last else out
