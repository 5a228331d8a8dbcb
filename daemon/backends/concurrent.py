"""The scheduler for a remote engine: requests run side by side, the server batches them.

Owns :class:`RemoteScheduler`, the :class:`~codespec.daemon.service.scheduler.Scheduler`
with ``workers`` worker threads instead of one: the local engine has one KV cache and
serves one request at a time (hence the base class's turns and preemption), while an
inference server batches every request it is sent, so each worker streams one request
from start to end (no quantum, no preemption) and up to ``workers`` stream at once.
Admission (``max_queue``), cancellation, text read-back, stop strings and statistics are
the base class's. Must not touch: the engine's or the server's insides, sockets.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from codespec.daemon.config import Speculation
from codespec.daemon.engine.engine import Stats
from codespec.daemon.service.protocol import ProtocolError
from codespec.daemon.service.scheduler import Job, LockedIndex, Scheduler
from codespec.daemon.service.warmups import Warmup

if TYPE_CHECKING:
    from codespec.daemon.backends.remote import RemoteEngine


class RemoteScheduler(Scheduler):
    def __init__(
        self,
        engine: RemoteEngine,
        index: LockedIndex | None,
        spec_cfg: Speculation,
        max_queue: int,
        workers: int = 16,
    ) -> None:
        super().__init__(engine, index, spec_cfg, max_queue)
        self.backend_kind = engine.kind  # the server's (vllm): what speculated
        self._inflight: dict[int, Job] = {}  # by id(): jobs compare by value
        self._tally = threading.Lock()  # the statistics, written by every worker
        self._workers = [
            threading.Thread(target=self._run, name=f"codespec-remote-{i}", daemon=True)
            for i in range(workers)
        ]

    def start(self) -> None:
        for t in self._workers:
            t.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            for job in self._inflight.values():
                job.cancel.set()
        super().stop(timeout)
        for t in self._workers:
            if t.is_alive():
                t.join(timeout)

    def _active_locked(self) -> int:
        running = sum(1 for j in self._inflight.values() if not j.cancel.is_set())
        return running + sum(1 for j in self._queue if not j.cancel.is_set())

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._inflight and not self._queue

    def _next(self) -> Job | Warmup | None:
        """The next request (warm-ups are dropped: the server has no idle time to fill)."""
        with self._cond:
            while not self._queue and not self._stopping:
                self._warm.clear()
                self._cond.wait()
            if not self._queue:
                return None
            job = self._queue.popleft()
            self._inflight[id(job)] = job
            return job

    def _others_waiting(self) -> bool:
        return False  # no turns: the server interleaves requests itself

    def _account(self, job: Job, stats: Stats | None, seconds: float) -> None:
        with self._tally:
            super()._account(job, stats, seconds)

    def _finish(self, job: Job, finish: str = "", error: ProtocolError | None = None) -> None:
        with self._cond:
            self._inflight.pop(id(job), None)
        with self._tally:
            super()._finish(job, finish, error)

    def _stats(self, job: Job, finish: str) -> dict[str, Any]:
        out = super()._stats(job, finish)
        out["speculation"] = f"server ({self.backend_kind})"
        return out
