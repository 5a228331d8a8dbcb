"""Token n-gram index over documents: incremental, bounded, saved to disk.

Owns: per document the text (with its LSP line table), the token ids of the
text exactly as ``tokenizer.encode(text)`` gives them, each token's start
offset, and the n-gram keys; a frozen, sorted index shared by every document
that is not being edited; longest-suffix lookup with ranked candidates; LRU
eviction past a token budget; save / load.

Must not touch: models, the engine, sockets. It knows the tokenizer only as
``encode(str) -> ids + offsets``; the daemon decides what is open, what is
workspace and which document is current.

How the state stays equal to a from-scratch build after an edit
--------------------------------------------------------------
The tokenizer is a GPT-2 style byte-level BPE: added (special) tokens split
the text first, the pre-tokenizer regex cuts each piece into pre-tokens, BPE
runs inside each pre-token. No regex alternative lets a non-space character be
followed by a space inside one pre-token, and no special token contains a
space, so an offset ``p`` with an ASCII non-space at ``p - 1`` and one of
``" \\t\\r\\n"`` at ``p`` is a token boundary *whatever the rest of the text is*
(a "cut"). An edit of ``[s, e)`` re-tokenizes the new text between the
nearest cut before ``s`` and the nearest cut after the inserted text (both
cuts lie in unchanged text, so they are cuts of the old text too) and splices
the ids; every later token shifts by the length difference. A tokenizer
outside that construction (a normalizer, another pre-tokenizer, added tokens
that strip spaces) is detected by :func:`supports_cuts` and re-tokenized whole
on every edit: still exact, only slower. The property test
in ``tests/test_ngram_index.py`` checks tokens, offsets and keys against a
fresh build after every random edit.

N-gram keys and lookup
----------------------
``keys[i]`` packs the ``min_n`` tokens ending at ``i`` into one int64 (21 bits
per id, so ``min_n <= 3`` and ids < 2**21; exact, no collisions), ``-1`` where
fewer than ``min_n`` tokens precede. Documents not edited since the last
:meth:`NgramIndex.compact` live in one frozen segment: their ids concatenated
with a ``-1`` separator and the (key, position) pairs sorted, so a lookup
over a million tokens is one binary search. A document being edited is
"loose": its keys are spliced per edit and scanned with numpy at lookup.
A lookup packs the context's last ``min_n`` tokens, finds every occurrence,
extends each match backwards up to ``max_n`` tokens (:func:`extend_matches`)
and reads the up to ``k`` tokens after it.

Ranking (documented choice): candidates from the current document (``uri``)
come first, then other open documents (most recently touched first), then
workspace documents (same). Within one tier only the longest match length is
kept, and occurrences are taken latest position in the file first (the index
does not know the cursor). Up to 64 occurrences per tier are read; ``count``
is how many of them continue with exactly the candidate's tokens and
``score = count / occurrences read`` in that tier.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgpack
import numpy as np

from codespec.ngram_index.positions import TextDocument

__all__ = ["Candidate", "NgramIndex", "TokenizerMismatch", "extend_matches", "tokenizer_hash"]

KEY_BITS = 21  # bits per token id in a packed key
MAX_KEY_N = 3  # 3 * 21 = 63 bits
SEP = -1  # separator between documents in the frozen segment; never equals an id
FORMAT = "codespec-ngram-index/1"
SOURCES = ("document", "open", "workspace")
_OCCURRENCES_READ = 64

_NONSPACE = frozenset(chr(c) for c in range(0x21, 0x7F))
_SPACE = frozenset(" \t\r\n")

Kind = Literal["open", "workspace"]


class TokenizerMismatch(ValueError):
    """A saved index was built with a different tokenizer."""


def supports_cuts(tokenizer: Any) -> bool:
    """Whether the cut argument (module docstring) holds: GPT-2 style byte-level
    pre-tokenizer with its regex, no normalizer, no added token that strips spaces."""
    spec = json.loads(tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    return (
        spec.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", []))
    )


def tokenizer_hash(tokenizer: Any) -> str:
    """SHA-256 of the tokenizer's JSON; two tokenizers that encode alike hash alike."""
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


@dataclass
class Candidate:
    """One continuation: ``tokens`` follow an occurrence of the context's last ``n`` tokens."""

    tokens: list[int]
    score: float
    count: int
    n: int
    source: str  # "document" | "open" | "workspace"
    uri: str


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


def extend_matches(
    seq: np.ndarray, ends: np.ndarray, suffix: np.ndarray, n0: int, max_n: int
) -> np.ndarray:
    """Length of the match ending at each ``ends[i]`` against the end of ``suffix``.

    Invariant: every ``ends[i]`` is already known to match ``suffix[-n0:]``
    (``seq[ends[i] - n0 + 1 : ends[i] + 1] == suffix[-n0:]``); the result
    ``m[i]`` is the largest ``m <= min(max_n, len(suffix))`` with
    ``seq[ends[i] - m + 1 : ends[i] + 1] == suffix[-m:]``. ``SEP`` entries and
    the start of ``seq`` stop a match.
    """
    lens = np.full(ends.shape[0], n0, dtype=np.int64)  # (H,)
    active = np.arange(ends.shape[0])  # (A,) hits still matching
    for j in range(n0, min(max_n, suffix.shape[0])):
        idx = ends[active] - j
        ok = idx >= 0
        ok[ok] = seq[idx[ok]] == suffix[-1 - j]
        active = active[ok]
        if active.shape[0] == 0:
            break
        lens[active] += 1
    return lens


class _Doc:
    __slots__ = ("doc", "keys", "kind", "seq", "slot", "starts", "tokens", "uri")

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


class _Segment:
    """Frozen documents: ids concatenated with ``SEP`` after each, and sorted (key, position)."""

    def __init__(self, docs: list[_Doc], g: int) -> None:
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
        for slot, d in enumerate(docs):
            start = int(self.doc_start[slot])
            d.tokens = self.cat[start : start + d.tokens.shape[0]]
            d.keys = None
            d.slot = slot

    def live_tokens(self) -> int:
        return sum(d.tokens.shape[0] for d, a in zip(self.docs, self.alive, strict=True) if a)

    def nbytes(self) -> int:
        return self.cat.nbytes + self.skeys.nbytes + self.spos.nbytes + self.doc_start.nbytes


class NgramIndex:
    """Token n-gram dictionaries over open and workspace documents.

    >>> idx = NgramIndex(tokenizer, max_n=8, min_n=2, max_tokens=2_000_000)  # doctest: +SKIP
    >>> idx.open("file:///a.py", "def f(x):\\n    return x\\n")  # doctest: +SKIP
    >>> idx.lookup(ids_of_context, uri="file:///a.py", k=16, b=4)  # doctest: +SKIP
    """

    def __init__(
        self,
        tokenizer: Any,
        max_n: int = 8,
        min_n: int = 2,
        max_tokens: int = 4_000_000,
        loose_docs_limit: int = 8,
    ) -> None:
        if not 1 <= min_n <= MAX_KEY_N:
            raise ValueError(f"min_n must be in 1..{MAX_KEY_N}, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"max_n ({max_n}) < min_n ({min_n})")
        if tokenizer.get_vocab_size() >= 1 << KEY_BITS:
            raise ValueError("vocabularies of 2**21 ids or more are not supported")
        self.tokenizer = tokenizer
        self.max_n = max_n
        self.min_n = min_n
        self.max_tokens = max_tokens
        self.loose_docs_limit = loose_docs_limit
        self._docs: dict[str, _Doc] = {}
        self._segment = _Segment([], min_n)
        self._clock = 0
        self._current: str | None = None
        self._tokens = 0
        self._hash: str | None = None
        self.incremental = supports_cuts(tokenizer)

    # ----------------------------------------------------------------- documents

    def _encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int32)  # (N,)
        starts = np.asarray([o[0] for o in enc.offsets], dtype=np.int32)  # (N,)
        return ids, starts

    def _tick(self, d: _Doc) -> None:
        self._clock += 1
        d.seq = self._clock

    def _loosen(self, d: _Doc) -> None:
        """Take ``d`` out of the frozen segment so that it can be edited."""
        if d.slot >= 0:
            self._segment.alive[d.slot] = False
            d.tokens = d.tokens.copy()
            d.slot = -1
        if d.keys is None:
            d.keys = gram_keys(d.tokens, self.min_n)

    def _drop(self, d: _Doc) -> None:
        if d.slot >= 0:
            self._segment.alive[d.slot] = False
        self._tokens -= d.tokens.shape[0]
        del self._docs[d.uri]

    def open(self, uri: str, text: str, kind: Kind = "open") -> None:
        """Index ``text`` as document ``uri`` (replacing any earlier version)."""
        if kind not in ("open", "workspace"):
            raise ValueError(f"kind must be 'open' or 'workspace', got {kind!r}")
        old = self._docs.get(uri)
        if old is not None:
            self._drop(old)
        ids, starts = self._encode(text)
        d = _Doc(uri, kind, TextDocument(text), ids, starts)
        d.keys = gram_keys(ids, self.min_n)
        self._docs[uri] = d
        self._tokens += ids.shape[0]
        self._tick(d)
        self._evict(spare=uri)

    def close(self, uri: str) -> None:
        """Forget ``uri`` (no error when it is not indexed)."""
        d = self._docs.get(uri)
        if d is not None:
            self._drop(d)
        if self._current == uri:
            self._current = None

    def __contains__(self, uri: object) -> bool:
        return uri in self._docs

    def _get(self, uri: str) -> _Doc:
        try:
            return self._docs[uri]
        except KeyError:
            raise KeyError(f"document {uri!r} is not indexed") from None

    def text(self, uri: str) -> str:
        return self._get(uri).doc.text

    def tokens(self, uri: str) -> list[int]:
        return self._get(uri).tokens.tolist()

    def kind(self, uri: str) -> str:
        return self._get(uri).kind

    def touch(self, uri: str) -> None:
        """Mark ``uri`` as the current document (most recently used; never evicted)."""
        d = self._get(uri)
        self._current = uri
        self._tick(d)

    def change(self, uri: str, changes: Iterable[Mapping[str, Any]]) -> None:
        """Apply LSP content changes in order, re-tokenizing only a window around each.

        A change with a bad range raises :class:`PositionError` before touching
        anything; the changes before it in the same list stay applied.
        """
        d = self._get(uri)
        self._current = uri
        self._tick(d)
        for change in changes:
            edit = d.doc.apply_change(change)
            if edit is None:  # full replacement
                self._drop(d)
                self.open(uri, change["text"], d.kind)  # type: ignore[arg-type]
                d = self._docs[uri]
                self._current = uri
                continue
            start, end, new = edit
            self._splice(d, start, end, len(new))
        self._evict()

    def _splice(self, d: _Doc, start: int, old_end: int, new_len: int) -> None:
        """Re-tokenize around ``[start, start + new_len)`` of the new text and splice."""
        self._loosen(d)
        text = d.doc.text
        delta = new_len - (old_end - start)
        n = len(text)
        if self.incremental:
            # Left cut: a < start, so text[a - 1] and text[a] are unchanged.
            a = start - 1
            while a > 0 and not (text[a - 1] in _NONSPACE and text[a] in _SPACE):
                a -= 1
            a = max(a, 0)
            # Right cut (new offsets): b - 1 >= start + new_len, both characters unchanged.
            b = start + new_len + 1
            while b < n and not (text[b - 1] in _NONSPACE and text[b] in _SPACE):
                b += 1
            b = min(b, n)
        else:  # a tokenizer the cut argument does not cover: re-tokenize everything
            a, b = 0, n
        starts = d.starts
        ia = int(np.searchsorted(starts, a, side="left"))
        ib = int(np.searchsorted(starts, b - delta, side="left"))
        ids, wstarts = self._encode(text[a:b])
        tokens = np.concatenate((d.tokens[:ia], ids, d.tokens[ib:]))  # (N',)
        d.starts = np.concatenate((starts[:ia], wstarts + a, starts[ib:] + delta)).astype(
            np.int32, copy=False
        )
        g = self.min_n
        assert d.keys is not None
        # Keys at new positions [ia, hi) read a spliced id; later ones are old keys from ib + g - 1.
        hi = min(ia + ids.shape[0] + g - 1, tokens.shape[0])
        lo = max(ia - g + 1, 0)
        fresh = gram_keys(tokens[lo:hi], g)[ia - lo :]
        d.keys = np.concatenate((d.keys[:ia], fresh, d.keys[ib + g - 1 :]))
        self._tokens += tokens.shape[0] - d.tokens.shape[0]
        d.tokens = tokens

    # ------------------------------------------------------------------ memory

    def _evict(self, spare: str | None = None) -> None:
        """Drop whole documents past ``max_tokens``: LRU, workspace before open.

        Never the current document, nor ``spare`` (the one being opened).
        """
        if self._tokens <= self.max_tokens:
            return
        victims = sorted(
            (d for d in self._docs.values() if d.uri not in (self._current, spare)),
            key=lambda d: (d.kind != "workspace", d.seq),
        )
        for d in victims:
            if self._tokens <= self.max_tokens:
                break
            self._drop(d)
        seg = self._segment
        if seg.docs and seg.live_tokens() * 2 < seg.cat.shape[0]:
            self.compact()

    def compact(self) -> None:
        """Rebuild the frozen segment from every document except the current one.

        Costs a sort of all indexed tokens (~0.1 s per million); lookups call it
        when too many documents are loose, the daemon may call it when idle.
        """
        cur = self._docs.get(self._current) if self._current else None
        if cur is not None:
            self._loosen(cur)  # while its slot still refers to the old segment
        frozen = [d for d in self._docs.values() if d is not cur]
        frozen.sort(key=lambda d: d.uri)
        self._segment = _Segment(frozen, self.min_n)

    def _maybe_compact(self) -> None:
        loose = [d for d in self._docs.values() if d.slot < 0 and d.uri != self._current]
        if not loose:
            return
        loose_tokens = sum(d.tokens.shape[0] for d in loose)
        frozen_tokens = self._segment.cat.shape[0]
        if len(loose) > self.loose_docs_limit or loose_tokens > max(frozen_tokens // 4, 1 << 16):
            self.compact()

    def stats(self) -> dict[str, Any]:
        """Documents, tokens and the bytes the index state takes (arrays + texts + line tables)."""
        nbytes = self._segment.nbytes()
        loose = 0
        for d in self._docs.values():
            nbytes += d.starts.nbytes + sys.getsizeof(d.doc.text) + d.doc.lines.starts.nbytes
            if d.slot < 0:
                loose += 1
                nbytes += d.tokens.nbytes
            if d.keys is not None:
                nbytes += d.keys.nbytes
        return {
            "documents": len(self._docs),
            "loose_documents": loose,
            "tokens": self._tokens,
            "bytes": nbytes,
            "bytes_per_token": nbytes / self._tokens if self._tokens else 0.0,
            "max_tokens": self.max_tokens,
        }

    # ------------------------------------------------------------------ lookup

    def lookup(
        self,
        context: Sequence[int],
        uri: str | None = None,
        k: int = 16,
        b: int = 4,
        min_n: int | None = None,
        max_n: int | None = None,
    ) -> list[Candidate]:
        """Up to ``b`` continuations (``k`` ids at most) of the context's longest suffix match.

        ``uri`` names the current document (its tier ranks first; it also
        becomes the current document for eviction). ``min_n`` may not be below
        the index's key length ``self.min_n``.
        """
        min_n = self.min_n if min_n is None else min_n
        max_n = self.max_n if max_n is None else max_n
        if min_n < self.min_n:
            raise ValueError(f"min_n ({min_n}) below the index's key length ({self.min_n})")
        g = self.min_n
        if len(context) < min_n or k <= 0 or b <= 0:
            return []
        if uri is not None and uri in self._docs:
            self._current = uri
            self._tick(self._docs[uri])
        self._maybe_compact()
        suffix = np.asarray(context[-max(max_n, g) :], dtype=np.int64)  # (S,)
        key = pack_key(suffix[-g:].tolist())

        def tier_of(d: _Doc) -> int:
            return 0 if d.uri == uri else (1 if d.kind == "open" else 2)

        best = [0, 0, 0]  # longest match per tier
        seg = self._segment
        lo = int(np.searchsorted(seg.skeys, key, side="left"))
        hi = int(np.searchsorted(seg.skeys, key, side="right"))
        seg_hits: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        if hi > lo:
            ends = seg.spos[lo:hi].astype(np.int64)  # (H,) positions in seg.cat
            ends = ends[seg.cat[ends + 1] != SEP]  # an occurrence needs a continuation
            slots = np.searchsorted(seg.doc_start, ends, side="right") - 1  # (H,)
            keep = seg.alive[slots]
            ends, slots = ends[keep], slots[keep]
            if ends.shape[0]:
                lens = extend_matches(seg.cat, ends, suffix, g, max_n)  # (H,)
                tiers = np.asarray([tier_of(d) for d in seg.docs], dtype=np.int64)[slots]
                for t in range(3):
                    m = tiers == t
                    if m.any():
                        best[t] = max(best[t], int(lens[m].max()))
                seg_hits = (ends, slots, lens, tiers)
        loose_hits: list[tuple[int, _Doc, np.ndarray, np.ndarray]] = []
        for d in self._docs.values():
            if d.slot >= 0:
                continue
            if d.keys is None:
                d.keys = gram_keys(d.tokens, g)
            ends = np.flatnonzero(d.keys == key)
            ends = ends[ends + 1 < d.tokens.shape[0]]
            if ends.shape[0]:
                lens = extend_matches(d.tokens, ends, suffix, g, max_n)
                t = tier_of(d)
                best[t] = max(best[t], int(lens.max()))
                loose_hits.append((t, d, ends, lens))

        out: list[Candidate] = []
        seen: set[tuple[int, ...]] = set()
        for tier in range(3):
            if best[tier] < min_n or len(out) >= b:
                continue
            n = best[tier]
            # (doc recency, position, doc, ids): most recently used document first,
            # latest position first.
            reads: list[tuple[int, int, _Doc, np.ndarray]] = []
            if seg_hits is not None:
                ends, slots, lens, tiers = seg_hits
                m = (tiers == tier) & (lens == n)
                e, sl = ends[m], slots[m]
                seqs = np.asarray([d.seq for d in seg.docs], dtype=np.int64)[sl]
                order = np.lexsort((-e, -seqs))[:_OCCURRENCES_READ]
                reads += [(int(seqs[i]), int(e[i]), seg.docs[int(sl[i])], seg.cat) for i in order]
            for t, d, ends, lens in loose_hits:
                if t == tier:
                    sel = ends[lens == n][::-1][:_OCCURRENCES_READ]
                    reads += [(d.seq, int(p), d, d.tokens) for p in sel]
            reads.sort(key=lambda r: (-r[0], -r[1]))
            del reads[_OCCURRENCES_READ:]
            counts: dict[tuple[int, ...], int] = {}
            first: dict[tuple[int, ...], _Doc] = {}
            for _, p, d, arr in reads:
                cont = arr[p + 1 : p + 1 + k]
                stop = np.flatnonzero(cont == SEP)
                if stop.shape[0]:
                    cont = cont[: stop[0]]
                tup = tuple(cont.tolist())
                counts[tup] = counts.get(tup, 0) + 1
                first.setdefault(tup, d)
            for cont, count in counts.items():
                if len(out) >= b:
                    break
                if cont in seen:
                    continue
                seen.add(cont)
                out.append(
                    Candidate(
                        tokens=list(cont),
                        score=count / len(reads),
                        count=count,
                        n=n,
                        source=SOURCES[tier],
                        uri=first[cont].uri,
                    )
                )
        return out

    # ------------------------------------------------------------- persistence

    @property
    def tokenizer_hash(self) -> str:
        if self._hash is None:
            self._hash = tokenizer_hash(self.tokenizer)
        return self._hash

    def save(self, path: str | Path) -> None:
        """Write the index as msgpack (texts, ids, offsets; no code, no pickle)."""
        docs = sorted(self._docs.values(), key=lambda d: d.seq)
        payload = {
            "format": FORMAT,
            "tokenizer_sha256": self.tokenizer_hash,
            "max_n": self.max_n,
            "min_n": self.min_n,
            "max_tokens": self.max_tokens,
            "current": self._current,
            "docs": [
                {
                    "uri": d.uri,
                    "kind": d.kind,
                    "text": d.doc.text,
                    "tokens": d.tokens.astype("<i4").tobytes(),
                    "starts": d.starts.astype("<i4").tobytes(),
                }
                for d in docs
            ],
        }
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(msgpack.packb(payload, use_bin_type=True))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path, tokenizer: Any) -> NgramIndex:
        """Read an index written by :meth:`save`; refuse one built with another tokenizer."""
        payload = msgpack.unpackb(Path(path).read_bytes(), raw=False)
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise ValueError(f"{path} is not a {FORMAT} file")
        want = tokenizer_hash(tokenizer)
        if payload["tokenizer_sha256"] != want:
            raise TokenizerMismatch(
                f"{path} was built with tokenizer {payload['tokenizer_sha256'][:12]}, "
                f"this one is {want[:12]}"
            )
        idx = cls(
            tokenizer,
            max_n=int(payload["max_n"]),
            min_n=int(payload["min_n"]),
            max_tokens=int(payload["max_tokens"]),
        )
        idx._hash = want
        for rec in payload["docs"]:
            tokens = np.frombuffer(rec["tokens"], dtype="<i4").astype(np.int32)
            starts = np.frombuffer(rec["starts"], dtype="<i4").astype(np.int32)
            if tokens.shape != starts.shape:
                raise ValueError(f"{path}: document {rec['uri']!r} is corrupt")
            d = _Doc(rec["uri"], rec["kind"], TextDocument(rec["text"]), tokens, starts)
            idx._docs[d.uri] = d
            idx._tokens += tokens.shape[0]
            idx._tick(d)
        current = payload.get("current")
        idx._current = current if current in idx._docs else None
        idx.compact()
        return idx
