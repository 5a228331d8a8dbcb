"""Cross-file context for completions: snippets of the user's other files.

Owns choosing, for a cursor in one document, a few chunks of the other open (and
recently edited) documents that share the most identifiers with the code around
the cursor, and keeping that choice stable while the user types, so the
prompt's start (and with it the engine's cached KV prefix) does not move with
every keystroke: the choice is keyed by the document, the cursor's line rounded
down to :data:`LINE_GRID` lines and the other documents' versions.

Pure text in, text out: no tokenizer, no engine, no document store (callers pass
``(uri, version, text)`` triples). Used by :mod:`.completion`.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

CHUNK_LINES = 24  # lines per candidate chunk
CHUNK_STRIDE = 12  # chunks overlap by half
QUERY_LINES = 40  # lines above the cursor that make the query
LINE_GRID = 16  # the query (and the choice) only moves every this many lines
MIN_SCORE = 0.05  # a chunk sharing less than this (Jaccard) is not worth its tokens
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}")


@dataclass(frozen=True)
class Snippet:
    uri: str
    first_line: int  # 0-based line of the chunk in its document
    text: str
    score: float


def identifiers(text: str) -> set[str]:
    return set(_IDENT.findall(text))


def chunks(text: str) -> list[tuple[int, str]]:
    """Overlapping chunks of :data:`CHUNK_LINES` lines: ``(first line, text)``."""
    lines = text.splitlines(keepends=True)
    if len(lines) <= CHUNK_LINES:
        return [(0, text)] if text.strip() else []
    out = []
    for start in range(0, len(lines) - CHUNK_STRIDE, CHUNK_STRIDE):
        piece = "".join(lines[start : start + CHUNK_LINES])
        if piece.strip():
            out.append((start, piece))
    return out


def query_text(text: str, offset: int) -> tuple[int, str]:
    """``(grid line, query)``: the :data:`QUERY_LINES` lines that end with the cursor's
    block of :data:`LINE_GRID` lines (the cursor's line rounded down to the grid, so the
    query moves once per block; the block's lines count, so a cursor in a file's first
    lines has a query too)."""
    line = text.count("\n", 0, offset)
    grid = line - line % LINE_GRID
    lines = text.splitlines(keepends=True)
    end = grid + LINE_GRID
    return grid, "".join(lines[max(0, end - QUERY_LINES) : end])


def select(
    query: str, others: Sequence[tuple[str, str]], max_chars: int, limit: int = 4
) -> list[Snippet]:
    """The best chunks of ``others`` (``(uri, text)``) for ``query``, at most
    ``limit`` of them and ``max_chars`` characters in all, highest score first."""
    want = identifiers(query)
    if not want:
        return []
    scored: list[Snippet] = []
    for uri, text in others:
        for first, piece in chunks(text):
            have = identifiers(piece)
            if not have:
                continue
            score = len(want & have) / len(want | have)
            if score >= MIN_SCORE:
                scored.append(Snippet(uri, first, piece, score))
    scored.sort(key=lambda s: (-s.score, s.uri, s.first_line))
    picked: list[Snippet] = []
    used = 0
    for s in scored:
        if len(picked) >= limit:
            break
        if any(p.uri == s.uri and abs(p.first_line - s.first_line) < CHUNK_LINES for p in picked):
            continue  # overlaps a chunk already taken
        if used + len(s.text) > max_chars:
            continue
        picked.append(s)
        used += len(s.text)
    return picked


class SnippetCache:
    """The last choices, keyed by ``(uri, grid line, other documents' versions)``."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._cache: OrderedDict[tuple, list[Snippet]] = OrderedDict()

    def snippets(
        self,
        uri: str,
        text: str,
        offset: int,
        others: Sequence[tuple[str, int | None, str]],
        max_chars: int,
    ) -> list[Snippet]:
        """Snippets for a cursor at ``offset`` of ``uri`` from ``others``
        (``(uri, version, text)``), the same list while the key does not change."""
        grid, query = query_text(text, offset)
        versions = tuple((u, v if v is not None else hash(t)) for u, v, t in others)
        key = (uri, grid, max_chars, versions)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        picked = select(query, [(u, t) for u, _, t in others], max_chars)
        self._cache[key] = picked
        while len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return picked
