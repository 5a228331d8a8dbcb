"""Token n-gram index over documents: incremental, bounded, saved to disk.

Owns: per document the text (with its LSP line table), the token ids of the
text exactly as ``tokenizer.encode(text)`` gives them, each token's start
offset, and the n-gram keys; a frozen, sorted index shared by every document
that is not being edited; lookups (ranked by :mod:`.lookup`); LRU eviction past
a token budget; save / load.

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

Where the arrays live and how a lookup reads them
-------------------------------------------------
``keys[i]`` packs the ``min_n`` tokens ending at ``i`` into one int64
(:mod:`.segment`). Documents not edited since the last :meth:`NgramIndex.compact`
live in one frozen segment (a sorted key table); a document being edited is "loose":
its keys are spliced per edit and scanned at lookup. Lookup and ranking (the current
document, then open documents, then workspace ones) are :mod:`.lookup`'s.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import msgpack
import numpy as np

import codespec.ngram_index.native as native
from codespec.ngram_index.lookup import SOURCES, Candidate, loose_hits, rank, segment_hits
from codespec.ngram_index.positions import TextDocument
from codespec.ngram_index.segment import (
    KEY_BITS,
    MAX_KEY_N,
    Doc,
    Segment,
    gram_keys,
    kind_tier,
    pack_key,
)

__all__ = ["NgramIndex", "TokenizerMismatch", "supports_cuts", "tokenizer_hash"]

FORMAT = "codespec-ngram-index/1"

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
        self._docs: dict[str, Doc] = {}
        self._segment = Segment([], min_n)
        self._clock = 0
        self._current: str | None = None
        self._tokens = 0
        self._hash: str | None = None
        self._native: native.NativeLookup | None = None  # made at the first lookup
        self.incremental = supports_cuts(tokenizer)

    # ----------------------------------------------------------------- documents

    def _encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int32)  # (N,)
        starts = np.asarray([o[0] for o in enc.offsets], dtype=np.int32)  # (N,)
        return ids, starts

    def _tick(self, d: Doc) -> None:
        self._clock += 1
        d.seq = self._clock
        if d.slot >= 0:  # the segment's copy, read by lookups
            self._segment.seqs[d.slot] = d.seq

    def _loosen(self, d: Doc) -> None:
        """Take ``d`` out of the frozen segment so that it can be edited."""
        if d.slot >= 0:
            self._segment.alive[d.slot] = False
            d.tokens = d.tokens.copy()
            d.slot = -1
        if d.keys is None:
            d.keys = gram_keys(d.tokens, self.min_n)

    def _drop(self, d: Doc) -> None:
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
        d = Doc(uri, kind, TextDocument(text), ids, starts)
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

    def _get(self, uri: str) -> Doc:
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

    def _splice(self, d: Doc, start: int, old_end: int, new_len: int) -> None:
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

        Costs a sort of all indexed tokens (too slow for every edit); lookups call it
        when too many documents are loose, the daemon may call it when idle.
        """
        cur = self._docs.get(self._current) if self._current else None
        if cur is not None:
            self._loosen(cur)  # while its slot still refers to the old segment
        frozen = [d for d in self._docs.values() if d is not cur]
        frozen.sort(key=lambda d: d.uri)
        self._segment = Segment(frozen, self.min_n)

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
        tail = [int(t) for t in context[-max(max_n, g) :]]  # (S,)
        key = pack_key(tail[-g:])

        def tier_of(d: Doc) -> int:
            return 0 if d.uri == uri else kind_tier(d.kind)

        loose = [d for d in self._docs.values() if d.slot < 0]
        for d in loose:  # both lookups scan a loose document's keys
            if d.keys is None:
                d.keys = gram_keys(d.tokens, g)
        cur = self._docs.get(uri) if uri is not None else None
        current = cur.slot if cur is not None else -1
        if native.available():  # one C++ call, the same candidates
            if self._native is None:
                self._native = native.NativeLookup()
            found = self._native.run(self._segment, [(d, tier_of(d)) for d in loose], key,
                                     tail, g, max_n, k, b, min_n, current)  # fmt: skip
            return [Candidate(tokens, count / reads, count, n, SOURCES[tier], d.uri)
                    for tokens, count, n, tier, reads, d in found]  # fmt: skip
        suffix = np.asarray(tail, dtype=np.int64)
        hits = loose_hits(loose, key, suffix, g, max_n, tier_of)
        seg_hits = segment_hits(self._segment, key, suffix, g, max_n, current)
        return rank([seg_hits, *hits] if seg_hits is not None else hits, k, b, min_n)

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
            d = Doc(rec["uri"], rec["kind"], TextDocument(rec["text"]), tokens, starts)
            idx._docs[d.uri] = d
            idx._tokens += tokens.shape[0]
            idx._tick(d)
        current = payload.get("current")
        idx._current = current if current in idx._docs else None
        idx.compact()
        return idx
