"""Post-processing of raw model completions into what an editor shows as ghost text.

Owns: deciding single- vs multi-line from the cursor's context, cutting a
multi-line completion at the end of the current block (by indentation), never
repeating the text right of the cursor or the document's next line, dropping
empty and whitespace-only items, and deduplicating alternatives.
Must not touch: LSP types, the daemon, documents. Everything here is a pure
function of strings, so the rules are tested without a server.

Worked example (cursor ``|``)::

    def area(r):|            completion "\\n    return 3.14 * r * r\\n\\nprint(area(2))"
    -> multi-line (the line opens a block); the block ends where the indentation
       returns to the ``def``'s column, so the item is "\\n    return 3.14 * r * r".

    print(area(|))           completion "2))"
    -> single-line (text right of the cursor); "2))" ends with the "))" already
       there, so the item inserts "2" and leaves "))" alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BLOCK_OPENERS = (":", "(", "[", "{")
CLOSERS = (")", "]", "}")


@dataclass(frozen=True)
class CursorContext:
    """The text around the cursor, in Python characters (not UTF-16 units)."""

    before: str  # the current line left of the cursor
    after: str  # the current line right of the cursor (no newline)
    next_lines: tuple[str, ...] = ()  # the document's following lines (a few suffice)

    @classmethod
    def from_lines(
        cls, lines: Sequence[str], line: int, column: int, lookahead: int = 8
    ) -> CursorContext:
        """Context of ``(line, column)`` in a document split into lines (ends kept or not)."""
        current = lines[line].rstrip("\r\n") if line < len(lines) else ""
        column = min(column, len(current))
        nxt = tuple(s.rstrip("\r\n") for s in lines[line + 1 : line + 1 + lookahead])
        return cls(before=current[:column], after=current[column:], next_lines=nxt)


@dataclass(frozen=True)
class Proposal:
    """One item: insert ``text`` at the cursor, or replace the rest of the line with it."""

    text: str
    replaces_rest_of_line: bool = False


def indent_width(line: str) -> int:
    """Columns of leading whitespace (a tab counts 4)."""
    expanded = line.expandtabs(4)
    return len(expanded) - len(expanded.lstrip(" "))


def wants_multiline(ctx: CursorContext, mode: str = "auto") -> bool:
    """Multi-line when the line right of the cursor is empty and the cursor starts something.

    ``auto``: the cursor is on a blank line, or at the end of a line that opens a
    block (``:``) or a bracket; text right of the cursor always means one line.
    """
    if mode == "always":
        return True
    if mode == "never" or ctx.after.strip():
        return False
    before = ctx.before.rstrip()
    return not before or before.endswith(BLOCK_OPENERS)


def truncate_block(text: str, ctx: CursorContext) -> str:
    """Cut a multi-line completion where the current block ends.

    - The line opens a block (``... :``/``(``): keep lines indented deeper than the
      current line; a closing-bracket line at the current indentation is kept as
      the block's last line.
    - Otherwise the block's indentation is the current line's (or the cursor's
      column on a blank line): stop at the first line indented less. At the top
      level (indentation 0) stop when a line returns to column 0 after an
      indented body, so one definition is proposed at a time.
    - Stop before a line that repeats the document's next non-blank line.
    """
    lines = text.split("\n")
    before = ctx.before
    opener = before.rstrip().endswith(BLOCK_OPENERS)
    current = indent_width(before) if before.strip() else len(before.expandtabs(4))
    next_doc = next((s.strip() for s in ctx.next_lines if s.strip()), None)

    kept = [lines[0]]
    if not before.strip() and next_doc is not None and lines[0].strip() == next_doc:
        return ""
    seen_deeper = False
    for raw in lines[1:]:
        if not raw.strip():
            kept.append(raw)
            continue
        width = indent_width(raw)
        if next_doc is not None and raw.strip() == next_doc:
            break
        if opener:
            if width <= current:
                if width == current and raw.strip().startswith(CLOSERS):
                    kept.append(raw)
                break
        else:
            if width < current:
                break
            if current == 0 and width == 0 and seen_deeper:
                break
        seen_deeper = seen_deeper or width > current
        kept.append(raw)
    while len(kept) > 1 and not kept[-1].strip():
        kept.pop()
    return "\n".join(kept)


def _is_subsequence(needle: str, haystack: str) -> bool:
    it = iter(haystack)
    return all(ch in it for ch in needle)


def fit_to_rest_of_line(text: str, after: str) -> Proposal:
    """Never repeat the text right of the cursor.

    - The completion ends with that text: insert only what comes before it.
    - The completion re-types it with more in between (its characters are a
      subsequence of the completion's last line): replace the rest of the line.
    - Otherwise insert the completion before it.
    """
    rest = after.strip()
    if not rest:
        return Proposal(text)
    body = text.rstrip()
    if body.endswith(rest):
        head = body[: len(body) - len(rest)]
        return Proposal(head.rstrip(" \t") if after[:1].isspace() else head)
    last = body.rsplit("\n", 1)[-1]
    if "\n" not in body and _is_subsequence(rest.replace(" ", ""), last):
        return Proposal(body, replaces_rest_of_line=True)
    return Proposal(body)


def process(raw: str, ctx: CursorContext, multiline: bool, max_lines: int = 16) -> Proposal | None:
    """A raw model completion → the item to show, or None when nothing is worth showing."""
    text = raw.replace("\r\n", "\n")
    if multiline:
        text = truncate_block(text, ctx)
        text = "\n".join(text.split("\n")[:max_lines])
    else:
        text = text.split("\n", 1)[0]
    text = "\n".join(line.rstrip() for line in text.split("\n")).rstrip()
    if not text.strip():
        return None
    proposal = fit_to_rest_of_line(text, ctx.after)
    if not proposal.text.strip():
        return None
    return proposal


def dedupe(proposals: Sequence[Proposal | None]) -> list[Proposal]:
    """Drop Nones and repeats, keeping the first occurrence's order."""
    seen: set[tuple[str, bool]] = set()
    out: list[Proposal] = []
    for p in proposals:
        if p is None or (p.text, p.replaces_rest_of_line) in seen:
            continue
        seen.add((p.text, p.replaces_rest_of_line))
        out.append(p)
    return out
