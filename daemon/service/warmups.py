"""Warm-ups waiting for an idle engine: per document, the prompt a completion at its last
edit would use, then the document's file runs
(:class:`~codespec.daemon.engine.slots.CacheSlots`).

Owns :class:`WarmQueue` and when a warm-up may start: a prompt at once, a run only after
the engine has been idle :data:`RUN_IDLE_S`. Not thread-safe: the scheduler calls it
under its own lock. Must not touch: the engine, requests, documents.
"""

from __future__ import annotations

from collections.abc import Sequence

# Tokens a warm-up feeds per forward: a request that arrives waits for the chunk in flight,
# so chunks stay small (a few times larger, and a keystroke's completion waits noticeably).
WARM_CHUNK = 32
RUN_CHUNK = WARM_CHUNK // 2  # a file run's: the user may come back from a pause mid-chunk
# A file run is warmed only after the engine has had no request for this long, so typing
# (a keystroke every ~150 ms, each asking for a completion) never waits for one.
RUN_IDLE_S = 0.5

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
        on a tie; or, where that is a run and the engine has been idle ``idle_s`` <
        :data:`RUN_IDLE_S`, None and the seconds left (None and 0.0: nothing queued)."""
        if not self._jobs:
            return None, 0.0
        uri = min(reversed(self._jobs), key=lambda u: self._jobs[u][0][0])
        jobs = self._jobs[uri]
        if jobs[0][1][1] and idle_s < RUN_IDLE_S:
            return None, RUN_IDLE_S - idle_s
        _, job = jobs.pop(0)
        if not jobs:
            del self._jobs[uri]
        return job, 0.0

    def clear(self) -> None:
        self._jobs.clear()

    def __len__(self) -> int:
        return sum(len(jobs) for jobs in self._jobs.values())
