"""Measured acceptance of draft nodes, and the part of a draft worth verifying.

Owns: the key a draft node's acceptance is measured under (:func:`node_keys`:
its source, the match behind its draft, its depth, whether it is a later
sibling), decayed hit / reach counts per key (:class:`Acceptance`), each node's
chance of being accepted (:func:`node_chances`) and the choice of the nodes
with the most expected tokens per unit of measured cost (:func:`best_cut`).

Must not touch: drafting, verification, timing (the caller hands in what a
step of each size is expected to cost, from ``costs.py``).

A node is *reached* when its parent was accepted (the root always is); it is
a *hit* when it was accepted too. Its rate is ``hits / reaches`` for its key,
pulled towards a prior by ``K`` pseudo-observations; the counts decay by
:data:`DECAY` per policy step, so a key nobody drafts drifts back to its prior
and gets tried again. The caller chooses the prior (the policy: the rate one
level shallower, so a proposer whose drafts are accepted deep gets its next
depth tried). A node's chance is the product of the rates on its path.
Accepted counts never include the bonus token.

A draft that was offered but not verified is counted too, against the tokens the
step produced (:func:`walk`, ``learn(..., depth=...)``): those are what the target
writes at depths 1 to their count, whoever drafted them, so a node there would have
been accepted exactly when its token is the produced one (at temperature > 0 the
produced token is a sample of the target's distribution, and ``token == sample`` has
the chance a deterministic node has of being accepted). Deeper nodes are not counted.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from codespec.speculators.draft import Draft

__all__ = [
    "Acceptance",
    "Key",
    "best_cut",
    "depth_bucket",
    "match_bucket",
    "node_chances",
    "node_keys",
    "prior",
    "walk",
]

PRIOR_FIRST = 0.6  # a first child's chance before anything is measured
PRIOR_SIBLING = 0.25  # a later sibling's (its elder sibling was the likelier guess)
K = 2.0  # the prior's weight, in observations
DECAY = 0.98  # per policy step

Key = tuple[str, int, int, bool]  # (source, match bucket, depth bucket, later sibling)


def match_bucket(n: int) -> int:
    """The match behind a draft: 0 (none), 1 (one token), 2 (two), 3 (3-4), 4 (5-7), 5 (8+).

    >>> [match_bucket(n) for n in (0, 1, 2, 3, 4, 5, 7, 8, 30)]
    [0, 1, 2, 3, 3, 4, 4, 5, 5]
    """
    if n <= 2:
        return max(0, n)
    return 3 if n <= 4 else 4 if n < 8 else 5


def depth_bucket(d: int) -> int:
    """Depths 1-4 apart, then 5-8, 9-16 and deeper as 5, 6, 7.

    >>> [depth_bucket(d) for d in (1, 4, 5, 8, 9, 16, 17)]
    [1, 4, 5, 5, 6, 6, 7]
    """
    return d if d <= 4 else 5 if d <= 8 else 6 if d <= 16 else 7


def node_keys(draft: Draft) -> list[Key]:
    """The key of every node of ``draft``.

    >>> node_keys(Draft([5, 6, 7], [-1, 0, -1], sources=["a", "a", "b"], match=3))
    [('a', 3, 1, False), ('a', 3, 2, False), ('b', 3, 1, True)]
    """
    assert draft.parents is not None
    # a step reads one draft's keys up to five times (its chances, then what each book
    # learns from it): made once per draft and kept with it (its nodes never change)
    if draft.node_keys is not None and len(draft.node_keys) == len(draft.parents):
        return draft.node_keys
    levels = draft.levels
    parented: set[int] = set()
    keys: list[Key] = []
    for i, p in enumerate(draft.parents):
        match = match_bucket(draft.match_at(i))
        keys.append((draft.source(i), match, depth_bucket(levels[i]), p in parented))
        parented.add(p)
    draft.node_keys = keys
    return keys


def prior(key: Key) -> float:
    return PRIOR_SIBLING if key[3] else PRIOR_FIRST


@dataclass
class Count:
    """Decayed hits and reaches of one key, decayed lazily to step ``now`` when read."""

    hit: float = 0.0
    reach: float = 0.0
    at: int = 0

    def add(self, hit: bool, now: int) -> None:
        k = DECAY ** max(0, now - self.at)
        self.hit = k * self.hit + float(hit)
        self.reach = k * self.reach + 1.0
        self.at = now

    def weight(self, now: int) -> float:
        return self.reach * DECAY ** max(0, now - self.at)

    def rate(self, prior: float, now: int) -> float:
        k = DECAY ** max(0, now - self.at)
        return (k * self.hit + K * prior) / (k * self.reach + K)


@dataclass
class Acceptance:
    """Hit / reach counts per node key (one book's)."""

    counts: dict[Key, Count] = field(default_factory=dict)

    def learn(
        self,
        draft: Draft,
        accepted: Sequence[int],
        now: int,
        depth: int | None = None,
        counted: Collection[int] = (),
    ) -> None:
        """Count every reached node of a verified ``draft``; ``accepted`` its accepted nodes.
        ``depth``: count only the nodes at most this deep (a draft not verified, weighed
        against the tokens a step produced: see :func:`walk`); ``counted``: nodes left
        out (the part of the draft that was verified, counted already)."""
        assert draft.parents is not None
        hits = set(accepted)
        levels = draft.levels if depth is not None else []
        for i, (key, p) in enumerate(zip(node_keys(draft), draft.parents, strict=True)):
            if (depth is not None and levels[i] > depth) or i in counted:
                continue
            if p < 0 or p in hits:
                self.counts.setdefault(key, Count()).add(i in hits, now)

    def rate(self, key: Key, now: int, prior: float) -> float:
        """The key's rate: its counts pulled towards ``prior`` (``prior`` when none)."""
        c = self.counts.get(key)
        return prior if c is None else c.rate(prior, now)


def walk(draft: Draft, tokens: Sequence[int]) -> list[int]:
    """The nodes of ``draft`` that greedy verification would have accepted had the target
    written ``tokens`` (its tokens at depths 1, 2, ...): root to leaf, at most
    ``len(tokens)`` of them, at each depth the first child holding that depth's token.

    >>> walk(Draft([5, 6, 7, 8], [-1, 0, 0, 2]), [5, 7, 8, 9])
    [0, 2, 3]
    >>> walk(Draft([5, 6, 7]), [5, 6])
    [0, 1]
    """
    assert draft.parents is not None
    path: list[int] = []
    at = -1
    for i, p in enumerate(draft.parents):
        if len(path) == len(tokens):
            break
        if p == at and draft.tokens[i] == tokens[len(path)]:
            path.append(i)
            at = i
    return path


def node_chances(draft: Draft, rate: Callable[[Key], float]) -> list[float]:
    """Each node's chance of being accepted: the product of ``rate`` along its path."""
    assert draft.parents is not None
    out: list[float] = []
    for key, p in zip(node_keys(draft), draft.parents, strict=True):
        out.append(rate(key) * (out[p] if p >= 0 else 1.0))
    return out


def best_cut(
    chances: Sequence[float], budget: int, step_ms: Sequence[float]
) -> tuple[list[int], float]:
    """The nodes worth verifying and the expected tokens per ms of the step.

    ``chances``: each node's chance of acceptance (a child's never above its
    parent's); ``step_ms[k]``: what a step verifying ``k`` nodes is expected to cost
    (``step_ms[0]``: a plain step). The nodes are taken likeliest first (so the
    taken ones always form a tree), at most ``budget`` of them; the count kept is
    the one with the most ``(1 + sum of chances) / step_ms[k]`` (the bonus token is
    the 1). An empty list: a plain step is worth more.

    >>> best_cut([0.9, 0.8, 0.1], 3, [10.0, 11.0, 12.0, 13.0])
    ([0, 1], 0.225)
    """
    order = sorted(range(len(chances)), key=lambda i: (-chances[i], i))[:budget]
    best_k, best_value = 0, 1.0 / step_ms[0]
    tokens = 1.0
    for k, i in enumerate(order, 1):
        if k >= len(step_ms):
            break
        tokens += chances[i]
        value = tokens / step_ms[k]
        if value > best_value:
            best_k, best_value = k, value
    return sorted(order[:best_k]), best_value
