"""Warm-ups waiting for an idle engine: per document, the prompt a completion at its last
edit would use, then the document's file runs
(:class:`~codespec.daemon.engine.slots.CacheSlots`).

Owns :class:`WarmQueue` and when a warm-up may start: a prompt once the engine has been
idle :data:`PROMPT_IDLE_S`, a run only after :data:`RUN_IDLE_S`. Not thread-safe: the
scheduler calls it under its own lock. Must not touch: the engine, requests, documents.
"""

from __future__ import annotations

from collections.abc import Sequence

# Tokens a warm-up feeds per forward where a request that arrives waits for the chunk in
# flight, so chunks stay small (a few times larger, and a keystroke's completion waits
# noticeably). The lean stack's forwards stop between layers instead, and feed more
# (``engine.STOPPABLE_CHUNK``).
WARM_CHUNK = 32
RUN_CHUNK = WARM_CHUNK // 2  # a file run's: the user may come back from a pause mid-chunk
# A file run is warmed only after the engine has had no request for this long, so typing
# (a keystroke every ~150 ms, each asking for a completion) never waits for one.
RUN_IDLE_S = 0.5
# A prompt's warm-up waits for this much idle: a pause in one document queues its prompt
# while the user may be typing in another, and a keystroke's completion that came in behind
# one of its chunks waited up to a chunk's forward (60-80 ms on the 0.5B). Typing leaves the
# engine idle ~100 ms between completions; a pause that queues the prompt (``warm_after_s``)
# leaves it idle longer than this.
PROMPT_IDLE_S = 0.25

Warmup = tuple[list[int], bool]  # the ids, whether a file run


class WarmQueue:
    """Per document (newest last), the warm-ups not started yet, each with its rank in
    the document's list: the prompt at the cursor 0, then its runs by distance."""

    def __init__(self) -> None:
        self._jobs: dict[str, list[tuple[int, Warmup]]] = {}

    def put(self, uri: str, prompt_ids: list[int], runs: Sequence[list[int]] = ()) -> None:
        """``uri``'s warm-ups, replacing those not started yet: ``prompt_ids`` (if any),
        then ``runs``; ``uri`` becomes the newest document."""
        jobs: list[Warmup] = [(list(prompt_ids), False)] if prompt_ids else []
        jobs += [(list(r), True) for r in runs]
        self._jobs.pop(uri, None)
        if jobs:
            self._jobs[uri] = list(enumerate(jobs))

    def take(self, idle_s: float) -> tuple[Warmup | None, float]:
        """The next warm-up and 0.0: of the lowest rank over the documents (each open
        document's nearest runs before any one's farther ones), the newest document's
        on a tie; or, where the engine has been idle ``idle_s`` less than that one needs
        (:data:`RUN_IDLE_S` for a run, :data:`PROMPT_IDLE_S` for a prompt), None and the
        seconds left (None and 0.0: nothing queued)."""
        if not self._jobs:
            return None, 0.0
        uri = min(reversed(self._jobs), key=lambda u: self._jobs[u][0][0])
        jobs = self._jobs[uri]
        need = RUN_IDLE_S if jobs[0][1][1] else PROMPT_IDLE_S
        if idle_s < need:
            return None, need - idle_s
        _, job = jobs.pop(0)
        if not jobs:
            del self._jobs[uri]
        return job, 0.0

    def clear(self) -> None:
        self._jobs.clear()

    def __len__(self) -> int:
        return sum(len(jobs) for jobs in self._jobs.values())
