"""Measured target-forward costs by forward size: what a draft of n tokens costs to verify.

Owns :class:`ForwardCosts`, one per engine: a decayed mean of the wall time of
every target forward, bucketed by its token count (the root plus the draft),
seeded by a short calibration (a few timed forwards of 1..64 tokens appended to
the runner's cache and truncated away again, so the cache is left as it was).
The speculation policy divides expected tokens by these costs.

Must not touch: decoding, verification, the cache's contents (calibration only
appends and truncates back), proposers' own statistics.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

# Forward sizes (root + draft tokens) that have their own measurement; a size between
# two of them is interpolated, one past the last is extrapolated linearly.
SIZES = (*range(1, 17), 20, 24, 32, 48, 64, 96, 128)
CALIBRATE = (1, 2, 3, 4, 6, 8, 16, 32)


def _bucket(n: int) -> int:
    """Index of the nearest measured size at or below ``n``."""
    return max(0, bisect.bisect_right(SIZES, n) - 1)


@dataclass
class ForwardCosts:
    """Milliseconds of one target forward by size, decayed so it follows the context length."""

    decay: float = 0.9
    ms: list[float] = field(default_factory=lambda: [0.0] * len(SIZES))
    weight: list[float] = field(default_factory=lambda: [0.0] * len(SIZES))
    calibrated: bool = False

    def add(self, n: int, ms: float) -> None:
        """Record one forward of ``n`` tokens, in the bucket of the nearest measured size
        (every size up to 16 has its own; past the last, scaled down to it)."""
        if n < 1 or ms <= 0:
            return
        if n >= SIZES[-1]:
            self._update(len(SIZES) - 1, ms * SIZES[-1] / n, 1.0)
            return
        i = _bucket(n)
        if SIZES[i] != n and n - SIZES[i] > SIZES[i + 1] - n:
            i += 1
        self._update(i, ms, 1.0)

    def _update(self, i: int, ms: float, w: float) -> None:
        if w <= 0:
            return
        k = self.decay**w
        if self.weight[i] == 0:
            self.ms[i], self.weight[i] = ms, w
            return
        self.ms[i] = k * self.ms[i] + (1 - k) * ms
        self.weight[i] = min(1e6, self.weight[i] + w)

    def known(self) -> list[tuple[int, float]]:
        return [(SIZES[i], self.ms[i]) for i in range(len(SIZES)) if self.weight[i] > 0]

    def at(self, n: int) -> float:
        """Expected ms of a forward of ``n`` tokens; monotone in ``n``. Before anything is
        measured: 1 ms per forward plus 0.1 ms per token (callers only compare ratios)."""
        pts = self.known()
        if not pts:
            return 1.0 + 0.1 * (n - 1)
        if len(pts) == 1:
            size, ms = pts[0]
            return ms * (1.0 + 0.1 * (n - size)) if n >= size else ms
        best = 0.0
        for (s0, m0), (s1, m1) in itertools.pairwise(pts):
            if n <= s1:
                if n <= s0:
                    best = m0
                else:
                    best = m0 + (m1 - m0) * (n - s0) / (s1 - s0)
                break
        else:
            (s0, m0), (s1, m1) = pts[-2], pts[-1]
            best = m1 + max(0.0, (m1 - m0) / (s1 - s0)) * (n - s1)
        # a larger forward never costs less than a smaller one
        floor = max((m for s, m in pts if s <= n), default=0.0)
        return max(best, floor, 1e-3)

    def relative(self, n: int) -> float:
        """Cost of an ``n``-token forward in plain decode steps."""
        return self.at(n) / self.at(1)

    def calibrate(self, runner: Any, sizes: tuple[int, ...] = CALIBRATE, reps: int = 1) -> None:
        """Time forwards of ``sizes`` tokens on top of the runner's cache and cut them off
        again. Uses token id 0 everywhere (only the time matters)."""
        base = runner.length
        room = runner.max_length - base - 1
        for n in sizes:
            if n > room:
                break
            samples = []
            for _ in range(reps + 1):  # the first of each size warms up and is dropped
                t0 = time.perf_counter()
                runner.forward([0] * n)
                samples.append((time.perf_counter() - t0) * 1000)
                runner.truncate(base)
            samples = sorted(samples[1:])
            self.add(n, samples[len(samples) // 2])
        self.calibrated = True

    def as_dict(self) -> dict[str, float]:
        return {str(s): round(ms, 3) for s, ms in self.known()}
