"""The pieces completion and edit prompts share: the window on a prefix whose start stays
put while the user types, the text read around the cursor, the document's next line, the
prepared request the scheduler takes, and what prompts read of an open document and of
the document store (:class:`OpenDocument`, :class:`RecentDocuments`: protocols the
service's ``documents`` module fits, as prompts import nothing of the service).

Must not touch: the engine's decoding, sockets, the document store's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from codespec.daemon.text.healing import Healing
from codespec.daemon.text.tracker import TextTracker

PREFIX_BLOCK = 256  # the prompt's first prefix token moves in steps of this many tokens
# a completion prefix's most characters per token of room: 90% of 3,000-character
# stretches of the stdlib's Python hold more characters a token with Qwen2.5-Coder's
# tokenizer (median 4.4), so a prefix this long nearly always fits its room
ANCHOR_CHARS_PER_TOKEN = 3.6
SUFFIX_TOKENS = 128  # the most suffix tokens a prompt carries (all re-fed per keystroke)
CHARS_PER_TOKEN_CAP = 12  # text read around the cursor: budget * this many characters


def window_prefix(prefix_ids: list[int], room: int, block: int = PREFIX_BLOCK) -> list[int]:
    """The prefix's last ``room`` tokens at most, its start on a ``block`` grid.

    Cutting at ``len - room`` would move the prompt's start with every keystroke
    and defeat prefix reuse; on a grid the start moves once per ``block`` tokens.
    """
    excess = len(prefix_ids) - room
    if excess <= 0:
        return prefix_ids
    start = -(-excess // block) * block
    return prefix_ids[start:]


def anchors(text: str, end: int, max_chars: int) -> tuple[int, list[int]]:
    """Where a completion prefix ending at ``end`` (a line start) starts, and the line
    starts it may start at: the first line start at or after each multiple of the grid,
    ``2 * max_chars // 3`` characters. The prefix starts at the earliest anchor at most
    ``max_chars`` before ``end``, so it holds between a third of ``max_chars`` and
    ``max_chars`` (less a line). Prompts at any spot between two anchors start alike,
    so a file run (the KV of the text from an anchor on,
    :class:`~codespec.daemon.engine.slots.CacheSlots`) serves every one of them.

    >>> text = "".join(f"line {i:02}\\n" for i in range(40))  # 8 characters a line
    >>> anchors(text, 160, 60)  # grid 40: lines start at 40, 80, 120, ...
    (120, [0, 40, 80, 120])
    """
    grid = max(1, 2 * max_chars // 3)
    points = []
    for k in range(max(0, end - 1) // grid + 1):
        at = text.find("\n", k * grid - 1) + 1 if k else 0
        points.append(at if 0 < at <= end or not k else min(k * grid, end))
    start = next((a for a in points if end - a <= max_chars), end)
    return start, points


def head_text(text: str, end: int, chars: int) -> str:
    """``text[:end]``, cut to about ``chars`` characters at a stable line start."""
    if end <= chars:
        return text[:end]
    cut = ((end - chars) // 4096 + 1) * 4096  # grid, so the cut does not move per keystroke
    nl = text.find("\n", min(cut, end))
    return text[nl + 1 : end] if 0 <= nl < end else text[cut:end]


@dataclass
class Prepared:
    """A request ready for the scheduler: the prompt, the healing constraint for the
    engine, the tracker that reads the output back as text, the draft text's ids. An
    empty ``prompt_ids``: nothing to complete (a blank document); the caller answers
    with an empty completion instead of running the model."""

    prompt_ids: list[int]
    constraint: Healing | None
    tracker: TextTracker
    draft_ids: list[int] | None = None
    mode: str = ""


class OpenDocument(Protocol):
    """An open document as prompts read it: where it is, which version, its text and
    language, and an offset's LSP position (``codespec.daemon.service.documents.Document``)."""

    @property
    def uri(self) -> str: ...

    @property
    def version(self) -> int | None: ...

    @property
    def text(self) -> str: ...

    @property
    def language(self) -> str: ...

    def position(self, offset: int) -> dict[str, int]: ...


class RecentDocuments(Protocol):
    """The open documents, most recently used first (cross-file snippets come from them)."""

    def recent(self, exclude: str = "", limit: int = 8) -> Sequence[OpenDocument]: ...


def next_lines(after: str) -> tuple[str, ...]:
    """The first non-blank line after the cursor's line (what a completion must not
    write again), or nothing."""
    rest = after.split("\n", 1)
    if len(rest) < 2:
        return ()
    for line in rest[1].split("\n", 8)[:8]:
        if line.strip():
            return (line,)
    return ()
