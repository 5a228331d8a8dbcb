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
# Every size's weight fades by this much with each forward recorded (of any size): a size
# not chosen for a few hundred forwards counts for little against the sizes measured since.
AGE = 0.995
FRESH = 0.5  # the weight below which a size between two fresher ones is interpolated
# A timing above this many times what a figure already standing on a forward's worth of
# weight says counts as this many times it: a step that lost the CPU to another process
# (a VM's steal, an editor's burst) is not what the next step will cost. A lasting rise
# (a growing context, a busier machine) is still followed, by up to (CLIP - 1) * (1 - decay)
# a step (~5%), or at once when the figure has faded.
CLIP = 1.5


def _between(p0: tuple[int, float], p1: tuple[int, float], n: int) -> float:
    """The ms of size ``n`` on the line from ``p0`` to ``p1`` (sizes, ms), read between them."""
    (s0, m0), (s1, m1) = p0, p1
    return max(m0 + (m1 - m0) * (n - s0) / (s1 - s0), 1e-3)


def _past(p0: tuple[int, float], p1: tuple[int, float], n: int) -> float:
    """The same line read past ``p1``, the last measured size."""
    (s0, m0), (s1, m1) = p0, p1
    return max(m1 + (m1 - m0) / (s1 - s0) * (n - s1), 1e-3)


def _bucket(n: int) -> int:
    """Index of the nearest measured size at or below ``n``."""
    return max(0, bisect.bisect_right(SIZES, n) - 1)


@dataclass
class ForwardCosts:
    """Milliseconds of one target forward by size, decayed so it follows the context length.

    Each size's figure is a decayed mean of its forwards; its weight (how many forwards
    stand behind it) fades by :data:`AGE` with every forward recorded, whatever its size.
    :meth:`at` reads a non-decreasing fit of the figures (weighted isotonic regression):
    a figure out of order with its neighbours is pooled with them by weight, so one
    slow forward of a size the policy then stops choosing (and so never re-measures)
    cannot price every larger size at its spike for the rest of the session.
    """

    decay: float = 0.9
    clip: float = CLIP  # 0: every timing as it is
    ms: list[float] = field(default_factory=lambda: [0.0] * len(SIZES))
    weight: list[float] = field(default_factory=lambda: [0.0] * len(SIZES))
    seeded: bool = False
    _fit: list[tuple[int, float]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def add(self, n: int, ms: float) -> None:
        """Record one forward of ``n`` tokens, in the bucket of the nearest measured size
        (every size up to 16 has its own; past the last, scaled down to it)."""
        if n < 1 or ms <= 0:
            return
        self.weight = [w * AGE for w in self.weight]
        self._record(n, ms, self.clip)

    def _record(self, n: int, ms: float, clip: float = 0.0) -> None:
        if n >= SIZES[-1]:
            self._update(len(SIZES) - 1, ms * SIZES[-1] / n, 1.0, clip)
            return
        i = _bucket(n)
        if SIZES[i] != n and n - SIZES[i] > SIZES[i + 1] - n:
            i += 1
        self._update(i, ms, 1.0, clip)

    def _update(self, i: int, ms: float, w: float, clip: float = 0.0) -> None:
        if w <= 0:
            return
        self._fit = None
        if clip and self.weight[i] >= 1.0:
            ms = min(ms, clip * self.ms[i])
        # the figure so far weighs what stands behind it, at most what a mean decayed by
        # ``decay`` keeps (so a size measured all along moves by 1 - decay a forward, and
        # one measured long ago takes the new forward nearly as it is)
        old = min(self.weight[i], self.decay / (1 - self.decay))
        self.ms[i] = (old * self.ms[i] + w * ms) / (old + w)
        self.weight[i] = min(1e6, self.weight[i] + w)

    def known(self) -> list[tuple[int, float]]:
        """The measured sizes and their figures, as measured (not yet made monotone)."""
        return [(SIZES[i], self.ms[i]) for i in range(len(SIZES)) if self.weight[i] > 0]

    def fitted(self) -> list[tuple[int, float]]:
        """The sizes the estimate reads and a non-decreasing fit of their figures.

        A size whose weight has faded below :data:`FRESH` and that lies between two
        fresh sizes is left out (read by interpolation between them instead: a figure
        measured long ago, maybe at another context length, against ones measured
        lately). The rest are fitted by weighted least squares under the constraint
        that a larger forward never costs less (pool adjacent violators)."""
        if self._fit is None:
            seen = [i for i in range(len(SIZES)) if self.weight[i] > 0]
            fresh = [i for i in seen if self.weight[i] >= FRESH]
            if len(fresh) >= 2:
                seen = [i for i in seen if not fresh[0] < i < fresh[-1] or i in fresh]
            blocks: list[list[float]] = []  # [mean, weight, count] of pooled runs
            for i in seen:
                blocks.append([self.ms[i], self.weight[i], 1])
                while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                    m1, w1, c1 = blocks.pop()
                    m0, w0, c0 = blocks[-1]
                    blocks[-1] = [(m0 * w0 + m1 * w1) / (w0 + w1), w0 + w1, c0 + c1]
            values = [m for m, _, c in blocks for _ in range(int(c))]
            self._fit = [(SIZES[i], v) for i, v in zip(seen, values, strict=True)]
        return self._fit

    def at(self, n: int) -> float:
        """Expected ms of a forward of ``n`` tokens, from :meth:`fitted`: interpolated
        between measured sizes, extrapolated past the last; monotone in ``n``. Before
        anything is measured: 1 ms per forward plus 0.1 ms per token (callers only
        compare ratios)."""
        pts = self.fitted()
        if not pts:
            return 1.0 + 0.1 * (n - 1)
        if len(pts) == 1:
            size, ms = pts[0]
            return ms * (1.0 + 0.1 * (n - size)) if n >= size else ms
        if n <= pts[0][0]:
            return max(pts[0][1], 1e-3)
        for p0, p1 in itertools.pairwise(pts):
            if n <= p1[0]:
                return _between(p0, p1, n)
        return _past(pts[-2], pts[-1], n)

    def table(self, most: int) -> list[float]:
        """``[at(0), at(1), ..., at(most)]`` (``at(0)`` is ``at(1)``), for a caller that
        weighs many sizes in one step (the policy, every step): the same figures as
        :meth:`at`, in one walk along the fit instead of a search per size."""
        pts = self.fitted()
        if len(pts) < 2:
            return [self.at(max(1, n)) for n in range(most + 1)]
        out = [max(pts[0][1], 1e-3)] * min(most + 1, pts[0][0] + 1)
        seg = 0
        for n in range(len(out), most + 1):
            while seg < len(pts) - 1 and n > pts[seg + 1][0]:
                seg += 1
            if seg < len(pts) - 1:  # between two measured sizes
                out.append(_between(pts[seg], pts[seg + 1], n))
            else:  # past the last
                out.append(_past(pts[-2], pts[-1], n))
        return out

    def relative(self, n: int) -> float:
        """Cost of an ``n``-token forward in plain decode steps."""
        return self.at(n) / self.at(1)

    def seed(self, table: Mapping[int, float]) -> None:
        """Record timed forwards ``{tokens: ms}`` (a prior before any step is measured)."""
        for n, ms in table.items():  # one table: its sizes do not fade one another
            if int(n) >= 1 and float(ms) > 0:
                self._record(int(n), float(ms))
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
    clip: float = CLIP  # as ForwardCosts' (0: every timing as it is)
    w: float = 0.0
    s_n: float = 0.0
    s_nn: float = 0.0
    s_t: float = 0.0
    s_nt: float = 0.0

    def add(self, n: float, ms: float) -> None:
        if self.clip and self.w >= 3.0:  # a line stands on a few points, not one
            ms = min(ms, self.clip * max(self.at(n), 1e-3))
        k = self.decay
        self.w, self.s_n, self.s_nn = k * self.w + 1, k * self.s_n + n, k * self.s_nn + n * n
        self.s_t, self.s_nt = k * self.s_t + ms, k * self.s_nt + n * ms

    @property
    def measured(self) -> bool:
        return self.w > 0

    @property
    def mean_n(self) -> float:
        """The decayed mean of the sizes seen (0 before anything was measured)."""
        return self.s_n / self.w if self.w else 0.0

    def at(self, n: float) -> float:
        """Expected ms at size ``n`` (0 before anything was measured)."""
        if not self.w:
            return 0.0
        mean_n, mean_t = self.s_n / self.w, self.s_t / self.w
        var = self.s_nn / self.w - mean_n * mean_n
        slope = (self.s_nt / self.w - mean_n * mean_t) / var if var > 0.25 else 0.0
        return max(mean_t + max(slope, 0.0) * (n - mean_n), 0.0)
