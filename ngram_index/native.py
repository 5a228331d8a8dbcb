"""The index's lookup in C++ (``csrc/lookup.cpp``): the same candidates as
:mod:`.lookup`'s numpy path in one call.

Owns: the library's declaration (built and loaded by :mod:`codespec.native`, once
per machine; none without a compiler) and :class:`NativeLookup`, an index's query and
output buffers with the addresses of the arrays it reads (a segment's once per segment,
a loose document's once per version of its arrays).

Must not touch: the index's state (it reads the arrays it is handed), models, the engine.
``CODESPEC_INDEX_LOOKUP=numpy`` keeps lookups on the numpy path (for comparisons); the
numpy path is also the fallback where the library cannot be built.

Why: in a speculative step a lookup runs right after a forward that streamed the weights
through every cache; there the numpy path's many small calls run cold and cost a
noticeable part of the step, its arithmetic being microseconds. Its glue here is kept as
small: no numpy call and no ``ndarray.ctypes`` conversion per lookup.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from codespec.native import NativeLibrary
from codespec.ngram_index.segment import Doc, Segment

__all__ = ["NativeLookup", "available"]

SOURCE = Path(__file__).parent / "csrc" / "lookup.cpp"
META = 6  # per candidate: length, count, match, tier, reads, doc
_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


class SegView(ctypes.Structure):
    _fields_ = [
        ("skeys", _ptr), ("spos", _ptr), ("nkeys", _i64), ("cat", _ptr), ("ncat", _i64),
        ("doc_start", _ptr), ("alive", _ptr), ("tiers", _ptr), ("seqs", _ptr), ("ndocs", _i64),
    ]  # fmt: skip


class LooseView(ctypes.Structure):
    _fields_ = [("tokens", _ptr), ("keys", _ptr), ("n", _i64), ("tier", _i64), ("seq", _i64)]


class Query(ctypes.Structure):
    _fields_ = [
        ("seg", _ptr), ("loose", _ptr), ("nloose", _i64), ("key", _i64),
        ("suffix", _ptr), ("slen", _i64), ("g", _i64), ("max_n", _i64), ("k", _i64),
        ("b", _i64), ("min_n", _i64), ("current", _i64),
    ]  # fmt: skip


class Out(ctypes.Structure):
    _fields_ = [("tokens", _ptr), ("meta", _ptr)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.cs_ngram_lookup.restype = _i64
    lib.cs_ngram_lookup.argtypes = [ctypes.c_void_p, ctypes.c_void_p]


_LIB = NativeLibrary(
    "ngram_lookup",
    [SOURCE],
    ["-O2", "-std=c++17", "-shared", "-fPIC"],
    _declare,
    label="the index's C++ lookup",
)


def available() -> bool:
    """Whether lookups can run in C++ here: the library builds and loads, and
    ``CODESPEC_INDEX_LOOKUP`` does not say ``numpy``."""
    if os.environ.get("CODESPEC_INDEX_LOOKUP", "").strip().lower() == "numpy":
        return False
    return _LIB.library() is not None


def _at(a: np.ndarray) -> int:
    assert a.flags.c_contiguous
    return int(a.ctypes.data)


class NativeLookup:
    """One index's C++ lookups: a query and output buffers made once (grown with ``b``,
    ``k`` or the loose documents), the arrays' addresses made when they change. One
    lookup at a time, as for the index itself (the daemon holds its index's lock)."""

    def __init__(self) -> None:
        self.lib = _LIB.required()
        self.query = Query()
        self.out = Out()
        self.suffix = (_i64 * 64)()
        self.query.suffix = ctypes.addressof(self.suffix)
        self.cap = (0, 0)
        self.views = (LooseView * 0)()
        self.seg: Segment | None = None
        self.seg_view = SegView()
        self.query.seg = ctypes.addressof(self.seg_view)

    def _segment(self, seg: Segment) -> None:
        """Point at ``seg``'s arrays (``alive`` and ``seqs`` change in place: followed)."""
        if seg is self.seg:
            return
        v = self.seg_view
        v.skeys, v.spos, v.nkeys = _at(seg.skeys), _at(seg.spos), seg.skeys.shape[0]
        v.cat, v.ncat = _at(seg.cat), seg.cat.shape[0]
        v.doc_start, v.alive = _at(seg.doc_start), _at(seg.alive)
        v.tiers, v.seqs, v.ndocs = _at(seg.tiers), _at(seg.seqs), len(seg.docs)
        self.seg = seg

    def _buffers(self, b: int, k: int) -> None:
        if b <= self.cap[0] and k == self.cap[1]:
            return
        self.tokens = (ctypes.c_int32 * (b * k))()
        self.meta = (_i64 * (b * META))()
        self.out.tokens, self.out.meta = ctypes.addressof(self.tokens), ctypes.addressof(self.meta)
        self.cap = (b, k)

    def run(
        self,
        seg: Segment,
        loose: Sequence[tuple[Doc, int]],
        key: int,
        suffix: Sequence[int],
        g: int,
        max_n: int,
        k: int,
        b: int,
        min_n: int,
        current: int,
    ) -> list[tuple[list[int], int, int, int, int, Doc]]:
        """Up to ``b`` candidates: (tokens, count, match, tier, reads, document).

        ``loose``: each loose document (its keys made) with its tier; ``suffix``: the
        context's last ids; ``current``: the current document's slot in the
        segment (-1: not there)."""
        self._segment(seg)
        self._buffers(b, k)
        if len(self.views) < len(loose):
            self.views = (LooseView * len(loose))()
        for i, (d, tier) in enumerate(loose):
            v = self.views[i]
            if d.native is None or d.native[0] is not d.tokens or d.native[1] is not d.keys:
                assert d.keys is not None and d.tokens.dtype == np.int32
                d.native = (d.tokens, d.keys, _at(d.tokens), _at(d.keys))
            v.tokens, v.keys, v.n = d.native[2], d.native[3], d.tokens.shape[0]
            v.tier, v.seq = tier, d.seq
        q = self.query
        q.loose, q.nloose, q.key = ctypes.addressof(self.views), len(loose), key
        n = len(suffix)
        if n > len(self.suffix):
            self.suffix = (_i64 * n)()
            q.suffix = ctypes.addressof(self.suffix)
        self.suffix[:n] = suffix
        q.slen, q.g, q.max_n, q.k, q.b, q.min_n, q.current = n, g, max_n, k, b, min_n, current
        found = self.lib.cs_ngram_lookup(ctypes.addressof(q), ctypes.addressof(self.out))
        out = []
        for i in range(found):
            length, count, match, tier, reads, doc = self.meta[i * META : (i + 1) * META]
            owner = seg.docs[doc] if doc >= 0 else loose[-1 - doc][0]
            out.append((self.tokens[i * k : i * k + length], count, match, tier, reads, owner))
        return out
