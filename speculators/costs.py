"""The policy's one cost model: what a verify forward of n tokens costs, what a proposer
costs to ask.

Owns :class:`ForwardCosts`, one per target model: a decayed mean of the wall
time of every target forward (``StepResult.forward_ms``, the verification
included), bucketed by its token count (the root plus the draft), optionally
seeded with a table of timed forwards (:meth:`ForwardCosts.seed`; the engine
times them, see ``policy.seed_costs``); and :class:`Line`, a decayed
least-squares line of a time against a size (a proposer's own time against the
draft it offers). The speculation policy divides expected tokens by these costs.

Must not touch: decoding, verification, the target model (nothing here runs a
forward: the engine measures, the policy records).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

# Forward sizes (root + draft tokens) that have their own measurement; a size between
# two of them is interpolated, one past the last is extrapolated linearly.
SIZES = (*range(1, 17), 20, 24, 32, 48, 64, 96, 128)
# The forward sizes worth timing before the first request (``policy.seed_costs``).
SEED_SIZES = (1, 2, 3, 4, 6, 8, 16, 32)


def _bucket(n: int) -> int:
    """Index of the nearest measured size at or below ``n``."""
    return max(0, bisect.bisect_right(SIZES, n) - 1)


@dataclass
class ForwardCosts:
    """Milliseconds of one target forward by size, decayed so it follows the context length."""

    decay: float = 0.9
    ms: list[float] = field(default_factory=lambda: [0.0] * len(SIZES))
    weight: list[float] = field(default_factory=lambda: [0.0] * len(SIZES))
    seeded: bool = False

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

    def table(self, most: int) -> list[float]:
        """``[at(0), at(1), ..., at(most)]`` (``at(0)`` is ``at(1)``): one lookup per size
        for a caller that weighs many sizes in one step."""
        return [self.at(max(1, n)) for n in range(most + 1)]

    def relative(self, n: int) -> float:
        """Cost of an ``n``-token forward in plain decode steps."""
        return self.at(n) / self.at(1)

    def seed(self, table: Mapping[int, float]) -> None:
        """Record timed forwards ``{tokens: ms}`` (a prior before any step is measured)."""
        for n, ms in table.items():
            self.add(int(n), float(ms))
        self.seeded = True

    def as_dict(self) -> dict[str, float]:
        return {str(s): round(ms, 3) for s, ms in self.known()}


@dataclass
class Line:
    """``t(n) = a + b * n`` fitted by decayed least squares over observed ``(n, ms)``; until
    the sizes seen vary, the slope is 0 (the mean). Never negative in slope.

    >>> line = Line()
    >>> for n, ms in [(1, 3.0), (5, 7.0)] * 4:
    ...     line.add(n, ms)
    >>> round(line.at(3), 3), round(line.at(9), 3)
    (5.0, 11.0)
    """

    decay: float = 0.9
    w: float = 0.0
    s_n: float = 0.0
    s_nn: float = 0.0
    s_t: float = 0.0
    s_nt: float = 0.0

    def add(self, n: float, ms: float) -> None:
        k = self.decay
        self.w, self.s_n, self.s_nn = k * self.w + 1, k * self.s_n + n, k * self.s_nn + n * n
        self.s_t, self.s_nt = k * self.s_t + ms, k * self.s_nt + n * ms

    @property
    def measured(self) -> bool:
        return self.w > 0

    def at(self, n: float) -> float:
        """Expected ms at size ``n`` (0 before anything was measured)."""
        if not self.w:
            return 0.0
        mean_n, mean_t = self.s_n / self.w, self.s_t / self.w
        var = self.s_nn / self.w - mean_n * mean_n
        slope = (self.s_nt / self.w - mean_n * mean_t) / var if var > 0.25 else 0.0
        return max(mean_t + max(slope, 0.0) * (n - mean_n), 0.0)
