"""Per-document debounce of automatic completion requests.

Owns: :class:`Debouncer`, which lets only the newest of overlapping waits for
the same key (a document URI) go on; older ones learn they were superseded.
Must not touch: LSP types, the daemon. The sleep is injectable so tests drive
it with an event instead of real time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable


class Debouncer:
    """``await wait(key)`` is True only for the newest call per key once the delay has passed.

    Example: requests A1, A2 (same document) and B1 overlap; after the delay A1 → False
    (superseded by A2), A2 → True, B1 → True (another document is never affected).
    """

    def __init__(
        self,
        delay_s: float,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.delay_s = delay_s
        self._sleep = sleep
        self._latest: dict[Hashable, int] = {}
        self._counter = 0

    def supersede(self, key: Hashable) -> int:
        """Mark a new request for ``key``; every older wait for it will return False."""
        self._counter += 1
        self._latest[key] = self._counter
        return self._counter

    def is_latest(self, key: Hashable, ticket: int) -> bool:
        return self._latest.get(key) == ticket

    async def wait(self, key: Hashable) -> bool:
        ticket = self.supersede(key)
        if self.delay_s > 0:
            await self._sleep(self.delay_s)
        return self.is_latest(key, ticket)

    def forget(self, key: Hashable) -> None:
        """The document closed: pending waits for it return False."""
        self._latest.pop(key, None)
