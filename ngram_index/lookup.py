"""Longest-suffix lookup over the n-gram index's documents, and the ranking of what it finds.

A lookup packs the context's last ``g`` tokens (the index's key length), finds every
occurrence of that key (one binary search in the frozen segment, a numpy scan of each
loose document), extends each match backwards up to ``max_n`` tokens
(:func:`extend_matches`) and reads the up to ``k`` tokens after it.

Ranking (documented choice): candidates from the current document come first, then other
open documents (most recently touched first), then workspace documents (same). Within one
tier only the longest match length is kept, and occurrences are taken latest position in
the file first (the index does not know the cursor). Up to 64 occurrences per tier are
read; ``count`` is how many of them continue with exactly the candidate's tokens and
``score = count / occurrences read`` in that tier.

Pure functions over :mod:`.segment`'s arrays; :meth:`NgramIndex.lookup
<codespec.ngram_index.index.NgramIndex.lookup>` adapts them. Where the C++ lookup builds
(:mod:`.native`, ``csrc/lookup.cpp``) it runs instead, giving the same candidates: these
are its reference (tested equal) and its fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from codespec.ngram_index.segment import SEP, Doc, Segment

SOURCES = ("document", "open", "workspace")  # the tiers, best first
OCCURRENCES_READ = 64  # per tier

# An occurrence to read: (its document's recency, position of the match's last token,
# the document, the array the position indexes).
Read = tuple[int, int, Doc, np.ndarray]


@dataclass
class Candidate:
    """One continuation: ``tokens`` follow an occurrence of the context's last ``n`` tokens."""

    tokens: list[int]
    score: float
    count: int
    n: int
    source: str  # "document" | "open" | "workspace"
    uri: str


def extend_matches(
    seq: np.ndarray, ends: np.ndarray, suffix: np.ndarray, n0: int, max_n: int
) -> np.ndarray:
    """Length of the match ending at each ``ends[i]`` against the end of ``suffix``.

    Invariant: every ``ends[i]`` is already known to match ``suffix[-n0:]``
    (``seq[ends[i] - n0 + 1 : ends[i] + 1] == suffix[-n0:]``); the result
    ``m[i]`` is the largest ``m <= min(max_n, len(suffix))`` with
    ``seq[ends[i] - m + 1 : ends[i] + 1] == suffix[-m:]``. ``SEP`` entries and
    the start of ``seq`` stop a match. All the comparisons at once, a handful of numpy
    calls whatever ``max_n`` (a loop over the lengths would make several a length).

    >>> seq = np.array([7, 1, 2, 3, SEP, 9, 2, 3])
    >>> extend_matches(seq, np.array([3, 7]), np.array([5, 1, 2, 3]), 2, 8).tolist()
    [3, 2]
    """
    top = min(max_n, suffix.shape[0])
    if top <= n0 or not ends.shape[0]:
        return np.full(ends.shape[0], n0, dtype=np.int64)
    back = np.arange(n0, top)  # (J,) how far before its end each compared token lies
    at = ends[:, None] - back  # (H, J)
    same = (seq[np.maximum(at, 0)] == suffix[-1 - back]) & (at >= 0)  # SEP equals no id
    grown = np.where(same.all(axis=1), top - n0, same.argmin(axis=1))  # the leading run
    return (n0 + grown).astype(np.int64)


@dataclass
class Hits:
    """Occurrences of one key with a continuation: match ends, match lengths, tiers, and
    per occurrence its document's slot (segment) or the document itself (loose), and its
    document's recency (``Doc.seq``)."""

    ends: np.ndarray  # (H,) positions of the match's last token
    lens: np.ndarray  # (H,) match lengths
    tiers: np.ndarray  # (H,) 0 current document, 1 open, 2 workspace
    docs: list[Doc]  # one per occurrence's document slot (segment) or [doc] (loose)
    slots: np.ndarray  # (H,) index into ``docs``
    seq: np.ndarray  # (H,) the ids ``ends`` index
    recency: np.ndarray  # (H,) the occurrence's document's ``seq``

    @property
    def one_doc(self) -> Doc | None:
        """The document of every occurrence when there is one (loose hits), else None."""
        return self.docs[0] if len(self.docs) == 1 else None


def segment_hits(
    seg: Segment, key: int, suffix: np.ndarray, g: int, max_n: int, current: int
) -> Hits | None:
    """The live segment documents' occurrences of ``key`` (binary search); ``current``: the
    current document's slot in the segment (-1: not there). Tiers and recency come from
    the segment's per-document arrays, read at the occurrences' slots (asking each
    document hit costs a call per hit over many documents, and asking each document once
    per lookup through ``np.unique`` still costs two more calls)."""
    lo = int(np.searchsorted(seg.skeys, key, side="left"))
    hi = int(np.searchsorted(seg.skeys, key, side="right"))
    if hi <= lo:
        return None
    ends = seg.spos[lo:hi].astype(np.int64)  # (H,) positions in seg.cat
    ends = ends[seg.cat[ends + 1] != SEP]  # an occurrence needs a continuation
    slots = np.searchsorted(seg.doc_start, ends, side="right") - 1  # (H,)
    keep = seg.alive[slots]
    ends, slots = ends[keep], slots[keep]
    if not ends.shape[0]:
        return None
    lens = extend_matches(seg.cat, ends, suffix, g, max_n)  # (H,)
    tiers = seg.tiers[slots]
    if current >= 0:
        tiers = np.where(slots == current, 0, tiers)
    return Hits(ends, lens, tiers, seg.docs, slots, seg.cat, seg.seqs[slots])


def loose_hits(
    docs: Iterable[Doc], key: int, suffix: np.ndarray, g: int, max_n: int, tier_of: Callable
) -> list[Hits]:
    """Each loose document's occurrences of ``key`` (a scan of its keys, which the index
    made)."""
    out = []
    for d in docs:
        assert d.keys is not None
        ends = np.flatnonzero(d.keys == key)
        ends = ends[ends + 1 < d.tokens.shape[0]]
        if ends.shape[0]:
            lens = extend_matches(d.tokens, ends, suffix, g, max_n)
            tiers = np.full(ends.shape, tier_of(d), dtype=np.int64)
            zeros = np.zeros(ends.shape, np.int64)
            out.append(Hits(ends, lens, tiers, [d], zeros, d.tokens, zeros + d.seq))
    return out


def longest(hits: list[Hits]) -> list[int]:
    """The longest match length per tier (0 where a tier has no occurrence)."""
    best = [0, 0, 0]
    for h in hits:
        if h.one_doc is not None:  # one tier
            t = int(h.tiers[0])
            best[t] = max(best[t], int(h.lens.max()))
            continue
        for t in range(3):
            m = h.tiers == t
            if m.any():
                best[t] = max(best[t], int(h.lens[m].max()))
    return best


def reads_of(hits: list[Hits], tier: int, n: int) -> list[Read]:
    """The occurrences of ``tier`` with match length ``n`` to read: most recently used
    document first, latest position first, at most :data:`OCCURRENCES_READ`."""
    reads: list[Read] = []
    for h in hits:
        d = h.one_doc
        if d is not None:  # ends ascend: latest first is the reverse
            if h.tiers[0] == tier:
                sel = h.ends[h.lens == n][::-1][:OCCURRENCES_READ]
                reads += [(d.seq, int(p), d, h.seq) for p in sel]
            continue
        m = (h.tiers == tier) & (h.lens == n)
        e, sl, seqs = h.ends[m], h.slots[m], h.recency[m]
        order = np.lexsort((-e, -seqs))[:OCCURRENCES_READ]
        reads += [(int(seqs[i]), int(e[i]), h.docs[int(sl[i])], h.seq) for i in order]
    reads.sort(key=lambda r: (-r[0], -r[1]))
    return reads[:OCCURRENCES_READ]


def continuations(reads: list[Read], k: int) -> tuple[dict[tuple[int, ...], int], dict]:
    """Each distinct continuation of up to ``k`` ids (cut at a document's end) with how
    many reads give it, and the document of its first read; in first-read order."""
    counts: dict[tuple[int, ...], int] = {}
    first: dict[tuple[int, ...], Doc] = {}
    rows = _windows(reads, k)
    for (_, _, d, _), row in zip(reads, rows, strict=True):
        tup = tuple(row)
        counts[tup] = counts.get(tup, 0) + 1
        first.setdefault(tup, d)
    return counts, first


def _windows(reads: list[Read], k: int) -> list[list[int]]:
    """Each read's ``arr[p + 1 : p + 1 + k]`` cut before its first ``SEP``, as a list: one
    gather per array read from (the segment, a loose document), not a slice and a scan a
    read (64 of them a lookup at most: one slice and scan each would be most of a
    lookup's time)."""
    out: list[list[int]] = [[] for _ in reads]
    by_arr: dict[int, list[int]] = {}
    for i, r in enumerate(reads):
        by_arr.setdefault(id(r[3]), []).append(i)
    steps = np.arange(1, k + 1, dtype=np.int64)  # (k,)
    for which in by_arr.values():
        arr = reads[which[0]][3]
        idx = np.asarray([reads[i][1] for i in which], dtype=np.int64)[:, None] + steps  # (R, k)
        inside = idx < arr.shape[0]
        win = np.where(inside, arr[np.minimum(idx, arr.shape[0] - 1)], SEP)  # (R, k)
        stop = win == SEP
        lens = np.where(stop.any(axis=1), stop.argmax(axis=1), k)  # (R,)
        for i, row, n in zip(which, win.tolist(), lens.tolist(), strict=True):
            out[i] = row[:n]
    return out


def rank(hits: list[Hits], k: int, b: int, min_n: int) -> list[Candidate]:
    """Up to ``b`` candidates, tier by tier (module docstring); a continuation already
    offered by a better tier is not repeated."""
    best = longest(hits)
    out: list[Candidate] = []
    seen: set[tuple[int, ...]] = set()
    for tier in range(3):
        n = best[tier]
        if n < min_n or len(out) >= b:
            continue
        reads = reads_of(hits, tier, n)
        counts, first = continuations(reads, k)
        for cont, count in counts.items():
            if len(out) >= b:
                break
            if cont in seen:
                continue
            seen.add(cont)
            score = count / len(reads)
            out.append(Candidate(list(cont), score, count, n, SOURCES[tier], first[cont].uri))
    return out
