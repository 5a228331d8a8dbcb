"""What the last requests on each document generated: a draft source for the next one there.

Owns :class:`RecentOutputs`, the scheduler's memory of recent outputs per document (what
``RequestInfo.recent_ids`` hands the n-gram proposer as ``ngram:recent``), bounded in
documents and outputs. Must not touch: the queue, the engine, the proposers; it is read
and written by the scheduler's worker thread alone (no lock).
"""

from __future__ import annotations

import collections


class RecentOutputs:
    """What the last requests on each document generated: a draft source for the next
    request there (``RequestInfo.recent_ids``, the n-gram proposer's ``ngram:recent``).
    Typing what the ghost text showed asks for that text again, shifted by the keys
    typed; a jump away and back asks for it again unchanged.

    Per document the last ``per_doc`` outputs, each after the last ``tail`` tokens of
    its prompt (the next request's context ends where an output began, plus what was
    typed, so it matches into it), newest last; at most ``docs`` documents, the least
    recently used dropped. The worker thread alone reads and writes it.
    """

    def __init__(self, docs: int = 64, per_doc: int = 4, tail: int = 16) -> None:
        self.docs, self.per_doc, self.tail = docs, per_doc, tail
        self._by_uri: collections.OrderedDict[str, list[list[int]]] = collections.OrderedDict()

    def add(self, uri: str | None, prompt_ids: list[int], out_ids: list[int]) -> None:
        if not uri or not out_ids:
            return
        kept = self._by_uri.pop(uri, [])
        kept = [*kept, [*prompt_ids[-self.tail :], *out_ids]][-self.per_doc :]
        self._by_uri[uri] = kept
        while len(self._by_uri) > self.docs:
            self._by_uri.popitem(last=False)

    def get(self, uri: str | None) -> list[int] | None:
        """The document's recent outputs in one sequence, oldest first; None if none."""
        kept = self._by_uri.get(uri) if uri else None
        if not kept:
            return None
        self._by_uri.move_to_end(uri)  # type: ignore[arg-type]
        return [t for seq in kept for t in seq]

    def __len__(self) -> int:
        return len(self._by_uri)
