"""Where the n-gram index keeps documents: token ids, start offsets, packed n-gram keys.

Owns: the key packing (``min_n`` ids of at most ``KEY_BITS`` bits in one int64, exact),
one document's arrays (:class:`Doc`) and the frozen segment (:class:`Segment`): the
documents not being edited, their ids concatenated with ``SEP`` after each and their
(key, position) pairs sorted, so that finding a key over a million tokens is one binary
search. :mod:`.index` keeps these arrays equal to a fresh build; :mod:`.lookup` reads
them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from codespec.ngram_index.positions import TextDocument

KEY_BITS = 21  # bits per token id in a packed key
MAX_KEY_N = 3  # 3 * 21 = 63 bits
SEP = -1  # separator between documents in the frozen segment; never equals an id


def gram_keys(tokens: np.ndarray, g: int) -> np.ndarray:
    """``keys[i]``: the ``g`` ids ending at ``i`` packed into an int64, ``-1`` if ``i < g - 1``."""
    t = tokens.astype(np.int64)  # (N,)
    keys = np.full(t.shape, -1, dtype=np.int64)  # (N,)
    if t.shape[0] >= g:
        k = t[g - 1 :].copy()
        for j in range(1, g):
            k |= t[g - 1 - j : t.shape[0] - j] << (KEY_BITS * j)
        keys[g - 1 :] = k
    return keys


def pack_key(tail: Sequence[int]) -> int:
    """The key of a ``g``-gram given as its ids, oldest first."""
    key = 0
    for j, tok in enumerate(reversed(tail)):
        key |= int(tok) << (KEY_BITS * j)
    return key


def kind_tier(kind: str) -> int:
    """A document's tier in a lookup's ranking when it is not the current one (which is
    tier 0): 1 open, 2 workspace."""
    return 1 if kind == "open" else 2


class Doc:
    __slots__ = ("doc", "keys", "kind", "native", "seq", "slot", "starts", "tokens", "uri")

    def __init__(
        self, uri: str, kind: str, doc: TextDocument, tokens: np.ndarray, starts: np.ndarray
    ) -> None:
        self.uri = uri
        self.kind = kind
        self.doc = doc
        self.tokens = tokens  # (N,) int32, a view into the frozen segment when frozen
        self.starts = starts  # (N,) int32 start offset (code points) of each token
        self.keys: np.ndarray | None = None  # (N,) int64, kept while loose
        self.seq = 0  # LRU clock value of the last use
        self.slot = -1  # index in the frozen segment, -1 when loose
        # (tokens, keys, their addresses) as the C++ lookup last read them (.native)
        self.native: tuple | None = None


class Segment:
    """Frozen documents: ids concatenated with ``SEP`` after each, and sorted (key, position)."""

    def __init__(self, docs: list[Doc], g: int) -> None:
        self.docs = docs
        parts: list[np.ndarray] = []
        kparts: list[np.ndarray] = []
        sep = np.full(1, SEP, dtype=np.int32)
        nosep = np.full(1, -1, dtype=np.int64)
        for d in docs:
            parts += [d.tokens.astype(np.int32, copy=False), sep]
            kparts += [d.keys if d.keys is not None else gram_keys(d.tokens, g), nosep]
        self.cat = np.concatenate(parts) if parts else np.zeros(0, np.int32)  # (T,)
        keys = np.concatenate(kparts) if kparts else np.zeros(0, np.int64)  # (T,)
        lengths = np.asarray([d.tokens.shape[0] + 1 for d in docs], dtype=np.int64)
        self.doc_start = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)  # (D,)
        order = np.argsort(keys, kind="stable")  # positions ascending within a key
        order = order[keys[order] >= 0]
        self.skeys = keys[order]  # (K,) sorted keys
        self.spos = order.astype(np.int32)  # (K,) their positions in cat
        self.alive = np.ones(len(docs), dtype=bool)  # (D,)
        # each document's tier were it not the current one
        self.tiers = np.asarray([kind_tier(d.kind) for d in docs], dtype=np.int64)  # (D,)
        self.seqs = np.asarray([d.seq for d in docs], dtype=np.int64)  # (D,) Doc.seq, kept
        for slot, d in enumerate(docs):
            start = int(self.doc_start[slot])
            d.tokens = self.cat[start : start + d.tokens.shape[0]]
            d.keys = None
            d.native = None  # its loose arrays: not read from here on (nor kept alive)
            d.slot = slot

    def live_tokens(self) -> int:
        return sum(d.tokens.shape[0] for d, a in zip(self.docs, self.alive, strict=True) if a)

    def nbytes(self) -> int:
        return self.cat.nbytes + self.skeys.nbytes + self.spos.nbytes + self.doc_start.nbytes
