"""LSP positions and text edits: (line, UTF-16 character) <-> ``str`` offsets.

Owns: the line table of a document (where each line starts, with ``\\n``,
``\\r\\n`` and a lone ``\\r`` all ending a line, as LSP says), the conversion
between LSP positions and Python string offsets (code points), and applying
LSP ``TextDocumentContentChangeEvent`` lists to a text, incrementally.

Must not touch: tokens, the n-gram index, sockets. The daemon's document
store and :class:`codespec.ngram_index.NgramIndex` both use these.

Conventions (LSP 3.17):

- ``character`` counts UTF-16 code units, so a character outside the BMP
  (an emoji) counts 2.
- A ``character`` past the end of its line is clamped to the line's end
  (the spec's "defaults back to the line length"); the line terminator is
  not part of the line.
- A ``line`` past the last line, a negative value, a ``character`` that
  points between the two halves of a surrogate pair, or a range whose end
  precedes its start raises :class:`PositionError`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = [
    "LineIndex",
    "PositionError",
    "TextDocument",
    "apply_changes",
    "line_starts",
    "offset_at",
    "position_at",
]

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


class PositionError(ValueError):
    """A position or range that lies outside the document (maps to ``bad_params``)."""


def line_starts(text: str) -> list[int]:
    """Offsets where each line starts; ``[0]`` for a text without line breaks.

    >>> line_starts("a\\r\\nb\\rc\\nd")
    [0, 3, 5, 7]
    """
    return [0, *(m.end() for m in _LINE_BREAK.finditer(text))]


def _utf16_len(s: str) -> int:
    if s.isascii():
        return len(s)
    return len(s) + sum(1 for ch in s if ord(ch) > 0xFFFF)


def _utf16_to_cp(line: str, character: int) -> int:
    """Code-point offset of UTF-16 ``character`` within ``line`` (clamped to its end)."""
    if line.isascii():
        return min(character, len(line))
    units = 0
    for i, ch in enumerate(line):
        if units >= character:
            if units > character:
                raise PositionError(f"character {character} splits a surrogate pair")
            return i
        units += 2 if ord(ch) > 0xFFFF else 1
    if units > character:
        raise PositionError(f"character {character} splits a surrogate pair")
    return len(line)


def _get_int(pos: Mapping[str, Any], key: str) -> int:
    try:
        value = pos[key]
    except (KeyError, TypeError) as e:
        raise PositionError(f"position lacks {key!r}: {pos!r}") from e
    if not isinstance(value, int) or isinstance(value, bool):
        raise PositionError(f"position {key} must be an integer, got {value!r}")
    if value < 0:
        raise PositionError(f"position {key} must be >= 0, got {value}")
    return value


class LineIndex:
    """Line starts of one text, kept up to date across edits in O(edit + lines) numpy work."""

    def __init__(self, text: str) -> None:
        self.starts = np.asarray(line_starts(text), dtype=np.int64)  # (L,)

    @property
    def line_count(self) -> int:
        return int(self.starts.shape[0])

    def line_span(self, text: str, line: int) -> tuple[int, int]:
        """``(start, end)`` offsets of ``line`` without its terminator."""
        if line < 0 or line >= self.line_count:
            raise PositionError(f"line {line} is outside the document (0..{self.line_count - 1})")
        start = int(self.starts[line])
        if line + 1 < self.line_count:
            end = int(self.starts[line + 1])
            if text[end - 1] == "\n":
                end -= 2 if end - 2 >= start and text[end - 2] == "\r" else 1
            else:  # lone "\r"
                end -= 1
        else:
            end = len(text)
        return start, end

    def offset(self, text: str, position: Mapping[str, Any]) -> int:
        """Code-point offset of an LSP ``{"line", "character"}`` position."""
        line = _get_int(position, "line")
        character = _get_int(position, "character")
        start, end = self.line_span(text, line)
        return start + _utf16_to_cp(text[start:end], character)

    def position(self, text: str, offset: int) -> dict[str, int]:
        """LSP position of a code-point offset (``0 <= offset <= len(text)``)."""
        if offset < 0 or offset > len(text):
            raise PositionError(f"offset {offset} is outside the document (0..{len(text)})")
        line = int(np.searchsorted(self.starts, offset, side="right")) - 1
        start, end = self.line_span(text, line)
        # An offset inside a line terminator ("\r|\n") maps to the end of its line.
        return {"line": line, "character": _utf16_len(text[start : min(offset, end)])}

    def update(self, new_text: str, start: int, old_end: int, new_len: int) -> None:
        """Account for ``old_text[start:old_end]`` having become ``new_text[start:start+new_len]``.

        Whether offset ``p`` starts a line depends on ``text[p-1]`` and ``text[p]``
        only, so the starts in ``[start, old_end]`` (old) are replaced by those in
        ``[start, start + new_len]`` (new) and the later ones shift.
        """
        delta = new_len - (old_end - start)
        s = self.starts
        lo = int(np.searchsorted(s, start, side="left"))
        hi = int(np.searchsorted(s, old_end, side="right"))
        if lo == 0:  # offset 0 always starts line 0
            lo = 1
        hi = max(hi, lo)
        fresh: list[int] = []
        stop = min(start + new_len, len(new_text))
        for p in range(max(start, 1), stop + 1):
            prev = new_text[p - 1]
            if prev == "\n" or (prev == "\r" and (p >= len(new_text) or new_text[p] != "\n")):
                fresh.append(p)
        self.starts = np.concatenate(
            (s[:lo], np.asarray(fresh, dtype=np.int64), s[hi:] + delta)
        )  # (L',)


def _change_range(change: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    rng = change["range"]
    try:
        return rng["start"], rng["end"]
    except (KeyError, TypeError) as e:
        raise PositionError(f"bad range {rng!r}") from e


class TextDocument:
    """A text plus its line table, edited by LSP content changes."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = LineIndex(text)

    def offset_at(self, position: Mapping[str, Any]) -> int:
        return self.lines.offset(self.text, position)

    def position_at(self, offset: int) -> dict[str, int]:
        return self.lines.position(self.text, offset)

    def replace(self, start: int, end: int, new: str) -> None:
        """Replace ``text[start:end]`` with ``new`` (code-point offsets)."""
        if not 0 <= start <= end <= len(self.text):
            raise PositionError(f"range {start}..{end} is outside the document")
        self.text = self.text[:start] + new + self.text[end:]
        self.lines.update(self.text, start, end, len(new))

    def apply_change(self, change: Mapping[str, Any]) -> tuple[int, int, str] | None:
        """Apply one change: ``(start, old_end, new_text)``, or ``None`` for a full replacement."""
        if not isinstance(change, Mapping) or not isinstance(change.get("text"), str):
            raise PositionError(f"a change needs a 'text' string: {change!r}")
        new = change["text"]
        if change.get("range") is None:
            self.text = new
            self.lines = LineIndex(new)
            return None
        start_pos, end_pos = _change_range(change)
        start = self.offset_at(start_pos)
        end = self.offset_at(end_pos)
        if end < start:
            raise PositionError(f"range end {dict(end_pos)} precedes its start {dict(start_pos)}")
        self.replace(start, end, new)
        return start, end, new


def offset_at(text: str, position: Mapping[str, Any]) -> int:
    """Code-point offset of an LSP position in ``text`` (builds a line table: O(len))."""
    return LineIndex(text).offset(text, position)


def position_at(text: str, offset: int) -> dict[str, int]:
    """LSP position of a code-point offset in ``text`` (builds a line table: O(len))."""
    return LineIndex(text).position(text, offset)


def apply_changes(text: str, changes: Iterable[Mapping[str, Any]]) -> str:
    """Apply LSP ``TextDocumentContentChangeEvent`` dicts in order; return the new text.

    >>> apply_changes("ab\\ncd", [{"range": {"start": {"line": 1, "character": 0},
    ...   "end": {"line": 1, "character": 1}}, "text": "X"}])
    'ab\\nXd'
    """
    doc = TextDocument(text)
    for change in changes:
        doc.apply_change(change)
    return doc.text
