"""N-gram proposer: drafts copied from the request's own tokens and from the n-gram index.

Owns: the per-request n-gram table over the context (prompt + generated so
far, extended incrementally as the context grows), the longest-suffix matcher
(:func:`match_continuations`, a pure function) and the merge of several
candidates into one tree draft (up to ``SPREAD`` times the step's budget).

Must not touch: models, KV caches, verification, the index's contents (it
only calls :meth:`NgramIndex.lookup`), how much of a draft is worth verifying
(the policy keeps the part that pays, from acceptance it measured per match
length and depth). A step where nothing matches returns ``None``.

Sources: ``ngram:prediction`` (an edit's old region or the client's
prediction, when the request has one), ``ngram:recent`` (what earlier requests on
the document generated, when the caller keeps it: typing along the ghost text asks
for the same tokens again), ``ngram:context``, ``ngram:index``.
Their candidates enter the tree longest match first (on a tie in that order),
so a caller that keeps only the first ``budget`` nodes keeps the best path.

Shape: each path is at most ``min(budget, reach * n)`` tokens for a match of length
``n < max_n`` (a short match says little about what follows far after it) and
``budget`` for a full-length match; a source's later candidates get half of
that. Each node keeps the match behind it (``Draft.matches``; a node two paths
share, the longer), ``match`` the longest.
"""

from __future__ import annotations

from collections.abc import Sequence

from codespec.ngram_index import NgramIndex
from codespec.speculators.draft import Draft, RequestInfo, StepResult

__all__ = ["NgramProposer", "SequenceMatcher", "match_continuations"]

_MAX_OCCURRENCES = 64  # latest occurrences examined per lookup
# A draft may hold up to this many times the step's budget: the policy keeps the likeliest
# nodes (at most the budget), so that a long first path does not crowd out the others.
SPREAD = 2


def match_continuations(
    seq: Sequence[int],
    ends: Sequence[int],
    tail: Sequence[int],
    min_n: int,
    max_n: int,
    k: int,
    b: int,
    near: int | None = None,
) -> tuple[int, list[list[int]]]:
    """Longest suffix match of ``tail`` in ``seq``; up to ``b`` continuations of ``k`` tokens.

    Invariant (callers guarantee it, the function relies on it): every ``p`` in
    ``ends`` (ascending) satisfies ``seq[p - min_n + 1 : p + 1] == tail[-min_n:]``
    and ``p + 1 < len(seq)``. Returns ``(n, conts)``: ``n`` is the largest ``m <=
    max_n`` such that ``seq[p - m + 1 : p + 1] == tail[-m:]`` for some ``p`` among
    the last 64 ``ends``, and ``conts`` are the distinct ``seq[p + 1 : p + 1 + k]``
    of those ``p`` that match ``n`` tokens, latest ``p`` first (with ``near``: the
    ``p`` nearest it first). ``(0, [])`` when ``ends`` is empty.

    >>> seq = [5, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]  # tail ...1 2 3: the match at 6 is longer
    >>> match_continuations(seq, [2, 6], seq, 2, 4, 2, 4)
    (3, [[7, 1]])
    >>> seq = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]  # tail 1 2: three equal matches
    >>> match_continuations(seq, [1, 5], seq, 2, 4, 2, 4, near=1)
    (2, [[3, 4], [3, 5]])
    """
    best, hits = _hits(seq, ends, tail, min_n, max_n, near)
    return best, _continuations(seq, hits, k, b)


def _hits(
    seq: Sequence[int],
    ends: Sequence[int],
    tail: Sequence[int],
    min_n: int,
    max_n: int,
    near: int | None,
) -> tuple[int, list[int]]:
    """The longest match of ``tail`` at the last 64 ``ends`` (see
    :func:`match_continuations`) and the ends that match it, latest first (with ``near``:
    nearest it first, the later on a tie)."""
    best = 0
    hits: list[int] = []
    limit = min(max_n, len(tail))
    for p in reversed(ends[-_MAX_OCCURRENCES:]):
        m = min_n
        while m < limit and p - m >= 0 and seq[p - m] == tail[-1 - m]:
            m += 1
        if m > best:
            best, hits = m, [p]
        elif m == best:
            hits.append(p)
    if near is not None:
        hits.sort(key=lambda p: abs(p - near))  # stable
    return best, hits


def _continuations(seq: Sequence[int], hits: Sequence[int], k: int, b: int) -> list[list[int]]:
    """The distinct ``seq[p + 1 : p + 1 + k]`` of ``hits`` in their order, at most ``b``."""
    conts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for p in hits:
        cont = tuple(seq[p + 1 : p + 1 + k])
        if cont and cont not in seen:
            seen.add(cont)
            conts.append(list(cont))
            if len(conts) >= b:
                break
    return conts


class SequenceMatcher:
    """An append-only token sequence with a table from ``min_n``-gram to its end positions
    (and, for :meth:`match`'s ``single``, one from each token to its positions).

    ``extend`` indexes only the tokens added since the last call, so a request
    pays O(new tokens) per step, not O(context).
    """

    def __init__(self, min_n: int) -> None:
        self.min_n = min_n
        self.seq: list[int] = []
        self.table: dict[tuple[int, ...], list[int]] = {}
        self.singles: dict[int, list[int]] = {}
        self.first_end: int | None = None

    def extend(self, tokens: Sequence[int]) -> None:
        g = self.min_n
        seq = self.seq
        start = len(seq)
        seq.extend(int(t) for t in tokens)
        table = self.table
        for p in range(max(start, g - 1), len(seq)):
            table.setdefault(tuple(seq[p - g + 1 : p + 1]), []).append(p)
        singles = self.singles
        for p in range(start, len(seq)):
            singles.setdefault(seq[p], []).append(p)

    def sync(self, context: Sequence[int]) -> None:
        """Make ``seq`` equal ``context``, extending when it only grew (the usual case)."""
        n = len(self.seq)
        if (
            n
            and len(context) >= n
            and context[n - 1] == self.seq[-1]
            and context[0] == self.seq[0]
            and context[n // 2] == self.seq[n // 2]
        ):
            self.extend(context[n:])
            return
        self.seq, self.table, self.singles = [], {}, {}
        self.extend(context)

    def match(
        self,
        tail: Sequence[int],
        max_n: int,
        k: int,
        b: int,
        single: bool = False,
        near: int | None = None,
    ) -> tuple[int, list[list[int]]]:
        """:func:`match_continuations` over the occurrences of ``tail``'s last ``min_n``
        tokens; with ``single``, over those of its last token alone (a match of 1, for a
        caller that found no ``min_n`` tokens anywhere: after the text departed from what
        it copies, the first token it shares again). ``first_end`` becomes the end of the
        occurrence the first continuation follows (None: no match)."""
        self.first_end = None
        if len(tail) < self.min_n:
            return 0, []
        if single:
            g, ends = 1, self.singles.get(int(tail[-1]), [])
        else:
            g, ends = self.min_n, self.table.get(tuple(int(t) for t in tail[-self.min_n :]), [])
        last = len(self.seq) - 1
        if ends and ends[-1] >= last:  # an occurrence needs a continuation
            ends = [p for p in ends if p < last]
        best, hits = _hits(self.seq, ends, tail, g, max_n, near)
        conts = _continuations(self.seq, hits, k, b)
        if conts:
            self.first_end = hits[0]
        return best, conts


class NgramProposer:
    """Tree drafts from longest-suffix n-gram matches (context, prediction, index).

    ``min_n``/``max_n`` bound the match length, ``breadth`` the candidates per
    source; ``use_context`` off leaves only the prediction and the index; ``single``:
    where no source matches ``min_n`` tokens, the request's own texts are matched on the
    last token alone (the policy keys acceptance on the match, so it learns what such a
    draft is worth); ``reach``: how many tokens past a match of ``n`` a path may run, per
    matched token.
    """

    name = "ngram"

    def __init__(
        self,
        index: NgramIndex | None = None,
        *,
        min_n: int = 2,
        max_n: int = 8,
        breadth: int = 4,
        use_context: bool = True,
        single: bool = True,
        reach: int = 4,
    ) -> None:
        if index is not None and min_n < index.min_n:
            raise ValueError(f"min_n ({min_n}) below the index's key length ({index.min_n})")
        self.index = index
        self.min_n = min_n
        self.max_n = max_n
        self.breadth = breadth
        self.use_context = use_context
        self.single = single
        self.reach = reach
        self._uri: str | None = None
        self._context = SequenceMatcher(min_n)
        self._prediction: SequenceMatcher | None = None
        self._recent: SequenceMatcher | None = None
        self._prompt_len = 0
        # where the text last met the prediction: (prediction index, context length)
        self._anchor: tuple[int, int] | None = None

    def begin(self, request: RequestInfo) -> None:
        self._uri = request.uri
        self._context = SequenceMatcher(self.min_n)
        if self.use_context:  # the prompt's table now, so each propose only extends it
            self._context.extend(request.prompt_ids)
        self._prompt_len = len(request.prompt_ids)
        self._prediction = self._matcher(request.draft_text_ids)
        self._anchor = None
        self._recent = self._matcher(request.recent_ids)

    def _matcher(self, ids: Sequence[int] | None) -> SequenceMatcher | None:
        """A table over a request's side text (prediction, recent outputs); None if none."""
        if not ids:
            return None
        matcher = SequenceMatcher(self.min_n)
        matcher.extend(ids)
        return matcher

    def _depth(self, n: int, rank: int, budget: int) -> int:
        # A match of max_n tokens may well be longer than we looked: no cap from n then.
        depth = budget if n >= self.max_n else min(budget, self.reach * n)
        return max(1, depth >> (1 if rank else 0))

    def _from_prediction(
        self, context: Sequence[int], tail: Sequence[int], budget: int, single: bool
    ) -> tuple[int, list[list[int]]]:
        pred = self._prediction
        if pred is None:
            return 0, []
        generated = context[self._prompt_len :]
        if len(generated) < self.min_n and list(generated) == pred.seq[: len(generated)]:
            # Too little generated to match on: the old text's start is the draft, as good
            # as a full-length match.
            start = len(generated)
            self._anchor = (start - 1, len(context))
            return self.max_n, [pred.seq[start : start + budget]]
        # The text follows the prediction in order: where the tail's occurrence should end
        # now is where the last one used ended, moved on by what was written since. Of the
        # occurrences that match as long, the nearest to it is drafted first (else a line
        # that recurs in the prediction would send the draft to its last occurrence, and a
        # long draft would be rejected at its first token, even on an exact prediction).
        near = None
        if self._anchor is not None:
            near = self._anchor[0] + len(context) - self._anchor[1]
        n, conts = pred.match(tail, self.max_n, budget, self.breadth, single, near)
        if pred.first_end is not None:
            self._anchor = (pred.first_end, len(context))
        return n, conts

    def _found(
        self, context: Sequence[int], tail: Sequence[int], budget: int, single: bool
    ) -> list[tuple[int, str, list[list[int]]]]:
        """Each source's (match, source, continuations); with ``single`` (no source matched
        ``min_n`` tokens), the request's own texts matched on the last token alone (the
        index keys on ``min_n`` tokens)."""
        k, b = budget, self.breadth
        found = [(*self._from_prediction(context, tail, k, single), "ngram:prediction")]
        if self._recent is not None:
            found.append((*self._recent.match(tail, self.max_n, k, b, single), "ngram:recent"))
        if self.use_context:
            self._context.sync(context)
            found.append((*self._context.match(tail, self.max_n, k, b, single), "ngram:context"))
        if self.index is not None and len(tail) >= self.min_n and not single:
            cands = self.index.lookup(tail, uri=self._uri, k=k, b=b, min_n=self.min_n)
            found += [(c.n, [list(c.tokens)], "ngram:index") for c in cands]
        return [(n, source, conts) for n, conts, source in found]

    def propose(self, context: Sequence[int], budget: int) -> Draft | None:
        if budget <= 0 or not context:
            return None
        tail = context[-self.max_n :]
        found = self._found(context, tail, budget, False)
        if self.single and not any(conts for _, _, conts in found):
            found = self._found(context, tail, budget, True)
        # every source's candidates, the longest match first (a stable sort: on a tie the
        # order above); a later sibling of the same source gets half the depth
        paths: list[tuple[list[int], str]] = []
        matches: list[int] = []
        ranks: dict[str, int] = {}
        for n, source, conts in sorted(found, key=lambda f: -f[0]):
            for cont in conts:
                rank = ranks.get(source, 0)
                ranks[source] = rank + 1
                path = list(cont[: self._depth(n, rank, budget)])
                if path:
                    paths.append((path, source))
                    matches.append(n)
        if not paths:
            return None
        return Draft.from_paths(paths, matches).truncated(SPREAD * budget)

    def observe(self, result: StepResult) -> None:
        """Nothing to learn: the next ``propose`` reads the context as it is."""

    def follow(self, result: StepResult) -> None:
        """Nothing to keep in step: the next ``propose`` reads the context as it is."""
