"""N-gram proposer: drafts copied from the request's own tokens and from the n-gram index.

Owns: the per-request n-gram table over the context (prompt + generated so
far, extended incrementally as the context grows), the longest-suffix matcher
(:func:`match_continuations`, a pure function), the merge of several
candidates into one tree draft within the step's budget, and the adaptive
draft length.

Must not touch: models, KV caches, verification, the index's contents (it
only calls :meth:`NgramIndex.lookup`). A step where nothing matches returns
``None``: a plain decode step, no extra verify cost.

Sources, in the order their paths enter the tree (so that a tight budget keeps
the best ones): ``ngram:prediction`` (an edit's old region or the client's
prediction, when the request has one), ``ngram:context``, ``ngram:index``.

Draft length: each path is at most ``min(L, 2 * n)`` tokens for a match of
length ``n < max_n`` (short matches predict little) and ``L`` for a full-length
match; siblings after the first get half of that. ``L`` adapts per request in
:meth:`NgramProposer.observe`: it doubles (up to ``max_len``) when the deepest
drafted path was accepted whole, halves (down to ``min_len``) when nothing was
accepted, and stays put otherwise (a partial accept is a divergence, not a sign
that drafts are too long).

Back-off: when the moving average of accepted tokens per drafted step falls
below ``min_gain``, the proposer skips drafting for 1, 2, 4, ... up to
``max_backoff`` steps, probing once after each run, so that a request where
drafts do not pay costs about what plain decoding costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from codespec.ngram_index import NgramIndex
from codespec.speculators.draft import Draft, RequestInfo, StepResult

__all__ = ["NgramProposer", "ProposerStats", "SequenceMatcher", "match_continuations"]

_MAX_OCCURRENCES = 64  # latest occurrences examined per lookup


def match_continuations(
    seq: Sequence[int],
    ends: Sequence[int],
    tail: Sequence[int],
    min_n: int,
    max_n: int,
    k: int,
    b: int,
) -> tuple[int, list[list[int]]]:
    """Longest suffix match of ``tail`` in ``seq``; up to ``b`` continuations of ``k`` tokens.

    Invariant (callers guarantee it, the function relies on it): every ``p`` in
    ``ends`` (ascending) satisfies ``seq[p - min_n + 1 : p + 1] == tail[-min_n:]``
    and ``p + 1 < len(seq)``. Returns ``(n, conts)``: ``n`` is the largest ``m <=
    max_n`` such that ``seq[p - m + 1 : p + 1] == tail[-m:]`` for some ``p`` among
    the last 64 ``ends``, and ``conts`` are the distinct ``seq[p + 1 : p + 1 + k]``
    of those ``p`` that match ``n`` tokens, latest ``p`` first. ``(0, [])`` when
    ``ends`` is empty.

    >>> seq = [5, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]  # tail ...1 2 3: the match at 6 is longer
    >>> match_continuations(seq, [2, 6], seq, 2, 4, 2, 4)
    (3, [[7, 1]])
    """
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
    conts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for p in hits:
        cont = tuple(seq[p + 1 : p + 1 + k])
        if cont and cont not in seen:
            seen.add(cont)
            conts.append(list(cont))
            if len(conts) >= b:
                break
    return best, conts


class SequenceMatcher:
    """An append-only token sequence with a table from ``min_n``-gram to its end positions.

    ``extend`` indexes only the tokens added since the last call, so a request
    pays O(new tokens) per step, not O(context).
    """

    def __init__(self, min_n: int) -> None:
        self.min_n = min_n
        self.seq: list[int] = []
        self.table: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        g = self.min_n
        seq = self.seq
        start = len(seq)
        seq.extend(int(t) for t in tokens)
        table = self.table
        for p in range(max(start, g - 1), len(seq)):
            table.setdefault(tuple(seq[p - g + 1 : p + 1]), []).append(p)

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
        self.seq, self.table = [], {}
        self.extend(context)

    def match(self, tail: Sequence[int], max_n: int, k: int, b: int) -> tuple[int, list[list[int]]]:
        g = self.min_n
        if len(tail) < g:
            return 0, []
        ends = self.table.get(tuple(int(t) for t in tail[-g:]), [])
        last = len(self.seq) - 1
        if ends and ends[-1] >= last:  # an occurrence needs a continuation
            ends = [p for p in ends if p < last]
        return match_continuations(self.seq, ends, tail, g, max_n, k, b)


@dataclass
class ProposerStats:
    """Counts for one proposer over its lifetime.

    ``acceptance = accepted_tokens / drafted_tokens`` (draft nodes verified vs
    accepted; the bonus token is not counted); ``mean_accepted = accepted_tokens
    / steps_with_draft``.
    """

    steps: int = 0
    steps_with_draft: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    drafted_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.accepted_tokens / self.steps_with_draft if self.steps_with_draft else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "steps_with_draft": self.steps_with_draft,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance": self.acceptance,
            "mean_accepted": self.mean_accepted,
            "accepted_by_source": dict(self.accepted_by_source),
            "drafted_by_source": dict(self.drafted_by_source),
        }


class NgramProposer:
    """Tree drafts from longest-suffix n-gram matches (context, prediction, index).

    ``min_n``/``max_n`` bound the match length, ``breadth`` the candidates per
    source, ``init_len``/``min_len``/``max_len`` the adaptive path length.
    """

    name = "ngram"

    def __init__(
        self,
        index: NgramIndex | None = None,
        *,
        min_n: int = 2,
        max_n: int = 8,
        breadth: int = 4,
        init_len: int = 4,
        min_len: int = 1,
        max_len: int = 32,
        use_context: bool = True,
        min_gain: float = 1.0,
        max_backoff: int = 32,
    ) -> None:
        if index is not None and min_n < index.min_n:
            raise ValueError(f"min_n ({min_n}) below the index's key length ({index.min_n})")
        if not 1 <= min_len <= init_len <= max_len:
            raise ValueError("need 1 <= min_len <= init_len <= max_len")
        self.index = index
        self.min_n = min_n
        self.max_n = max_n
        self.breadth = breadth
        self.init_len = init_len
        self.min_len = min_len
        self.max_len = max_len
        self.use_context = use_context
        self.min_gain = min_gain
        self.max_backoff = max_backoff
        self.draft_len = init_len
        self._gain: float | None = None  # moving average of accepted tokens per drafted step
        self._skip = 0  # plain steps left before the next draft
        self._backoff = 1
        self.stats = ProposerStats()
        self._uri: str | None = None
        self._context = SequenceMatcher(min_n)
        self._prediction: SequenceMatcher | None = None
        self._prompt_len = 0
        self.last_match = 0  # the longest match behind the last draft (0: none)

    def begin(self, request: RequestInfo) -> None:
        self._uri = request.uri
        self.draft_len = self.init_len
        self._gain, self._skip, self._backoff = None, 0, 1
        self._context = SequenceMatcher(self.min_n)
        self._prompt_len = len(request.prompt_ids)
        self._prediction = None
        if request.draft_text_ids:
            self._prediction = SequenceMatcher(self.min_n)
            self._prediction.extend(request.draft_text_ids)

    def _depth(self, n: int, rank: int) -> int:
        # A match of max_n tokens may well be longer than we looked: no cap from n then.
        depth = self.draft_len if n >= self.max_n else min(self.draft_len, 2 * n)
        return max(1, depth >> (1 if rank else 0))

    def propose(self, context: Sequence[int], budget: int) -> Draft | None:
        self.stats.steps += 1
        if budget <= 0 or not context:
            return None
        if self.use_context:
            self._context.sync(context)
        if self._skip > 0:  # backing off: drafts have not been paying for their verify cost
            self._skip -= 1
            return None
        tail = context[-self.max_n :]
        paths: list[tuple[list[int], str]] = []
        longest = 0
        pred = self._prediction
        if pred is not None:
            generated = context[self._prompt_len :]
            if len(generated) < self.min_n and list(generated) == pred.seq[: len(generated)]:
                # Too little generated to match on: the old text's start is the draft.
                start = len(generated)
                paths.append((pred.seq[start : start + self.draft_len], "ngram:prediction"))
                longest = self.max_n  # the draft text's own start: as good as a full match
            else:
                n, conts = pred.match(tail, self.max_n, self.draft_len, self.breadth)
                paths += [(c[: self._depth(n, i)], "ngram:prediction") for i, c in enumerate(conts)]
                longest = max(longest, n if conts else 0)
        if self.use_context:
            n, conts = self._context.match(tail, self.max_n, self.draft_len, self.breadth)
            paths += [(c[: self._depth(n, i)], "ngram:context") for i, c in enumerate(conts)]
            longest = max(longest, n if conts else 0)
        if self.index is not None and len(tail) >= self.min_n:
            cands = self.index.lookup(
                tail, uri=self._uri, k=self.draft_len, b=self.breadth, min_n=self.min_n
            )
            paths += [(c.tokens[: self._depth(c.n, i)], "ngram:index") for i, c in enumerate(cands)]
            longest = max([longest, *(c.n for c in cands)])
        paths = [p for p in paths if p[0]]
        self.last_match = longest if paths else 0
        if not paths:
            return None
        draft = Draft.from_paths(paths).truncated(budget)
        self.stats.steps_with_draft += 1
        self.stats.drafted_tokens += len(draft)
        for src in draft.sources or []:
            self.stats.drafted_by_source[src] = self.stats.drafted_by_source.get(src, 0) + 1
        return draft

    def declined(self) -> None:
        """The speculation policy judged the last draft not worth its verify cost: back off
        as after a failed draft (skip 1, 2, 4, ... steps), keeping the draft length."""
        self._skip = self._backoff
        self._backoff = min(self.max_backoff, self._backoff * 2)

    def observe(self, result: StepResult) -> None:
        draft = result.draft
        if draft is None or len(draft) == 0:
            return
        accepted = result.accepted_len
        self.stats.accepted_tokens += accepted
        for node in result.accepted:
            src = draft.source(node)
            self.stats.accepted_by_source[src] = self.stats.accepted_by_source.get(src, 0) + 1
        if accepted >= draft.depth:
            self.draft_len = min(self.max_len, self.draft_len * 2)
        elif accepted == 0:
            self.draft_len = max(self.min_len, self.draft_len // 2)
        # Back-off: a verify forward with a draft costs more than a plain step (on a CPU
        # 1.3-2x for a few tokens), so drafts must average at least min_gain accepted
        # tokens. Below that, skip drafting for 1, 2, 4, ... steps, each run ended by a
        # probing draft; a probe accepted whole resets the back-off.
        self._gain = accepted if self._gain is None else 0.7 * self._gain + 0.3 * accepted
        full = accepted >= draft.depth
        if self._gain < self.min_gain and not full:
            self._skip = self._backoff
            self._backoff = min(self.max_backoff, self._backoff * 2)
        else:
            self._backoff = 1
