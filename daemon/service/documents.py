"""The daemon's document store: what each client has open, at which version.

Owns: per open document its text (a :class:`~codespec.ngram_index.TextDocument`
with its LSP line table), its language, its version, and the rules:

- ``open`` always (re)places the document: it is how a client recovers from
  ``stale_version``.
- ``change`` carries the document's new version, which must be greater than
  the stored one (LSP versions only grow); otherwise ``stale_version`` and
  nothing is applied. The changes are checked on a copy first, so a bad range
  in the middle of a list applies nothing either (``bad_params``).
- ``complete`` / ``edit`` may carry ``version``; it must equal the stored one.
- A request's position must lie in the document: a line past the last one or a
  character past its line's end is ``bad_params`` (:meth:`Document.offset`).
  Content changes keep LSP's rule instead: a character past the end of a line
  means the line's end.

It reports every accepted mutation to ``on_index`` (the n-gram index feed);
positions use :mod:`codespec.ngram_index.positions`, never a second converter.
Must not touch: the engine, sockets, the index itself.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from codespec.daemon.service.protocol import (
    BAD_PARAMS,
    OVERLOADED,
    STALE_VERSION,
    UNKNOWN_DOCUMENT,
    ProtocolError,
)
from codespec.ngram_index.positions import PositionError, TextDocument

IndexFeed = Callable[[str, str, Any], None]  # (op: open|change|close, uri, payload)


@dataclass
class Document:
    uri: str
    doc: TextDocument
    version: int | None = None
    language: str = ""
    touched: float = field(default_factory=time.monotonic)  # last open or change

    @property
    def text(self) -> str:
        return self.doc.text

    def offset(self, position: Mapping[str, Any]) -> int:
        """The offset of a request's position; ``bad_params`` when it is not in the text."""
        try:
            offset = self.doc.offset_at(position)
            line_end = self.doc.lines.line_span(self.doc.text, position["line"])[1]
        except PositionError as exc:
            raise ProtocolError(BAD_PARAMS, f"{self.uri}: {exc}") from None
        width = self.doc.position_at(line_end)["character"]
        if position["character"] > width:
            raise ProtocolError(
                BAD_PARAMS,
                f"{self.uri}: character {position['character']} is past the end of line "
                f"{position['line']} ({width} UTF-16 units long)",
            )
        return offset

    def position(self, offset: int) -> dict[str, int]:
        return self.doc.position_at(offset)

    def snapshot(self) -> Document:
        """A frozen copy: later changes to this document do not reach it."""
        return Document(self.uri, TextDocument(self.doc.text), self.version, self.language)


class DocumentStore:
    def __init__(
        self,
        max_documents: int = 512,
        max_chars: int = 4_000_000,
        on_index: IndexFeed | None = None,
    ) -> None:
        self.max_documents = max_documents
        self.max_chars = max_chars
        self.on_index = on_index
        self._docs: dict[str, Document] = {}

    def __len__(self) -> int:
        return len(self._docs)

    def __contains__(self, uri: object) -> bool:
        return uri in self._docs

    def uris(self) -> list[str]:
        return list(self._docs)

    def recent(self, exclude: str = "", limit: int = 8) -> list[Document]:
        """The most recently opened or changed documents, newest first, but ``exclude``."""
        docs = sorted(self._docs.values(), key=lambda d: d.touched, reverse=True)
        return [d for d in docs if d.uri != exclude][:limit]

    def get(self, uri: str, version: int | None = None) -> Document:
        d = self._docs.get(uri)
        if d is None:
            raise ProtocolError(UNKNOWN_DOCUMENT, f"document {uri!r} is not open")
        if version is not None and d.version is not None and version != d.version:
            raise ProtocolError(
                STALE_VERSION,
                f"{uri}: the request is for version {version}, the daemon has {d.version}",
            )
        return d

    def open(self, uri: str, text: str, version: int | None = None, language: str = "") -> Document:
        if len(text) > self.max_chars:
            raise ProtocolError(BAD_PARAMS, f"{uri}: text longer than {self.max_chars} characters")
        if uri not in self._docs and len(self._docs) >= self.max_documents:
            raise ProtocolError(OVERLOADED, f"{self.max_documents} documents are open already")
        d = Document(uri, TextDocument(text), version, language)
        self._docs[uri] = d
        if self.on_index:
            self.on_index("open", uri, text)
        return d

    def change(self, uri: str, version: int, changes: list[Mapping[str, Any]]) -> Document:
        d = self.get(uri)
        if d.version is not None and version <= d.version:
            raise ProtocolError(
                STALE_VERSION,
                f"{uri}: change to version {version} does not follow version {d.version}; "
                "re-open the document",
            )
        # A trial copy: LineIndex.update rebinds its array, so shallow copies suffice.
        trial = copy.copy(d.doc)
        trial.lines = copy.copy(d.doc.lines)
        try:
            for change in changes:
                trial.apply_change(change)
        except PositionError as exc:
            raise ProtocolError(BAD_PARAMS, f"{uri}: {exc}") from None
        if len(trial.text) > self.max_chars:
            raise ProtocolError(BAD_PARAMS, f"{uri}: text longer than {self.max_chars} characters")
        d.doc = trial
        d.version = version
        d.touched = time.monotonic()
        if self.on_index:
            self.on_index("change", uri, [dict(c) for c in changes])
        return d

    def close(self, uri: str) -> None:
        self.get(uri)
        del self._docs[uri]
        if self.on_index:
            self.on_index("close", uri, None)
