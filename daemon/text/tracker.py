"""Generated token ids to the text a client gets: detokenized once, incrementally, and
ended by the stop rules.

Owns :class:`TextTracker` — fed each step's new token ids, it returns the new text
to send and whether a rule ended the text — and the rules themselves: stop
strings, the suffix stop (the code after the cursor: the rest of its line, the next
line), loops, the end of an edit's region, the first line's indentation.
Detokenization is the tokenizers library's ``DecodeStream`` (it holds back incomplete
UTF-8), primed with the prompt's last tokens so the first token decodes as a
continuation (a SentencePiece tokenizer would otherwise drop its leading space). Each
token is decoded once: the text is never rebuilt from all the ids.

Must not touch: the model, sampling, documents. The engine gives ids; this gives text.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

_REPEAT = re.compile(r"(.{4,}?)\1{3,}")
PRIME_TOKENS = 4  # prompt tokens the decoder is primed with


def indent_width(line: str) -> int:
    """Columns of leading whitespace (a tab counts 4)."""
    expanded = line.expandtabs(4)
    return len(expanded) - len(expanded.lstrip(" "))


def region_shape(text: str) -> tuple[int, int]:
    """``(indent, k)`` of a region for :class:`TextTracker`: its first line's indentation
    and how many non-blank lines are indented that much or less."""
    lines = text.split("\n")
    indent = indent_width(lines[0])
    return indent, sum(1 for s in lines if s.strip() and indent_width(s) <= indent)


def repeats_a_piece(line: str) -> bool:
    """Whether ``line`` repeats a piece of 4+ characters 4+ times in a row, the piece
    holding two different non-space characters (so indentation, ``----`` rules and
    ``====`` underlines are not loops; ``strict_strict_strict_strict_`` is)."""
    return any(len(set(m.group(1)) - {" ", "\t"}) >= 2 for m in _REPEAT.finditer(line))


class TextTracker:
    """The text of a request's output, step by step (see the module docstring).

    - ``stop``: strings that end the text (they are not part of it).
    - ``skip``: text the output starts with that is not the caller's (token healing
      regrows the end of the prompt); never emitted, rules apply after it.
    - ``lead``: text that belongs to the output but was put at the end of the prompt
      (an edit's first line); emitted first, the rules see it.
    - ``stop_lines``: a completed line equal to one of them (whitespace aside) ends
      the text before that line; the first line counts when ``first_line_counts``.
    - ``rest``: the text right of the cursor on its line. When the first line, once
      complete (a line break or the end), ends with it (whitespace at its ends aside),
      the text ends there, before it: the completion reached the code after the cursor
      and does not write it again (``x)`` with ``)`` right of the cursor gives ``x``; a
      space before the rest is left to the rest).
    - ``max_indent``: the first line's leading spaces and tabs are cut to at most this
      many (the cursor stands after indentation the model may write again).
    - ``fences``: a line starting with a Markdown fence (```` ``` ````) ends the text
      before that line, the first line too (an instruct model closing a chat answer's
      code block; what follows it is prose).
    - ``unwrap``: a first line opening a fence (```` ```python ````) is dropped, and a
      later fence line ends the text (a chat reply's code block, without the fence).
    - ``cut_loops``: a completed line written the third time, or one that
      :func:`repeats_a_piece`, ends the text before that line (``looped``).
    - ``region = (indent, k)``: the text ends before the ``k+1``-th non-blank line
      indented at most ``indent`` (an edit moving past its region).
    - ``trailing``: the finished text ends with exactly these line breaks.

    Whatever a rule may still take away is held back, so the pieces returned always
    add up to the finished :attr:`text`. ``tokens_used``: the fewest leading tokens
    whose text reaches the end of what stopped it.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        *,
        skip: str = "",
        lead: str = "",
        stop_lines: Sequence[str] = (),
        first_line_counts: bool = False,
        cut_loops: bool = False,
        region: tuple[int, int] | None = None,
        trailing: str | None = None,
        rest: str = "",
        max_indent: int | None = None,
        fences: bool = False,
        unwrap: bool = False,
    ) -> None:
        self._tok = tokenizer
        self._stream = DecodeStream(ids=list(prompt_ids[-PRIME_TOKENS:]) or None)
        self.stop = [s for s in stop if s]
        self.skip, self.lead, self.trailing = skip, lead, trailing
        self.stop_lines = {s.strip() for s in stop_lines if s.strip()}
        self.first_line_counts = first_line_counts
        self.cut_loops = cut_loops
        self.region = region
        self.rest, self.rest_space = rest.strip(), rest[:1].isspace()
        self.max_indent, self.fences, self.unwrap = max_indent, fences, unwrap
        self.trimmed = 0  # leading whitespace cut off the first line (max_indent)
        self.raw = ""  # the decoded continuation, skip included
        self.ends: list[int] = []  # len(raw) after each token
        self.text = ""  # lead + raw after skip, cut by the rules
        self.emitted = 0
        self.looped = False
        self.stopped = False
        self.tokens_used = 0
        # incremental line scan of self.text
        self._scan, self._line_no, self._top = 0, 0, 0
        self._seen: dict[str, int] = {}

    @property
    def holds_lines(self) -> bool:
        """Whether a rule may still cut the last line (so it is held back)."""
        return bool(
            self.stop_lines or self.cut_loops or self.region or self.rest or self.fences
            or self.unwrap or self.trailing is not None
        )  # fmt: skip

    def feed(self, ids: Sequence[int], final: bool = False) -> tuple[str, bool]:
        """Take a step's new token ids; the new text to send, and whether a rule ended it."""
        if self.stopped:
            return "", True
        for tok in ids:
            piece = self._stream.step(self._tok, tok)
            self.raw += piece or ""
            self.ends.append(len(self.raw))
        if len(self.raw) < len(self.skip):
            return "", False
        self.text = self._indented(self.lead + self.raw[len(self.skip) :])
        cut = self._rules()
        if cut is not None:
            at, through = cut
            self.text = self._ending(self.text[:at])
            self.stopped = True
            raw_end = len(self.skip) + through + self.trimmed - len(self.lead)
            self.tokens_used = self._tokens_for(raw_end)
            return self._take(len(self.text)), True
        if final:
            return self._finish()
        return self._take(max(self._safe_end(), self.emitted)), False

    def _indented(self, text: str) -> str:
        """``text`` with its first line's leading whitespace cut to ``max_indent``, or
        its first line dropped where it opens a fence (``unwrap``)."""
        if self.unwrap:
            nl = text.find("\n")
            self.trimmed = nl + 1 if nl >= 0 and text[:nl].strip().startswith("```") else 0
            return text[self.trimmed :]
        if self.max_indent is None:
            return text
        ws = len(text) - len(text.lstrip(" \t"))
        self.trimmed = max(0, ws - self.max_indent)
        return text[: self.max_indent] + text[ws:] if self.trimmed else text

    def _safe_end(self) -> int:
        """How much of the text no rule can take back any more."""
        end = len(self.text)
        if self.max_indent is not None and not self.text.strip(" \t"):
            return 0  # the first line's indentation may still grow past max_indent
        if self.unwrap and not self.trimmed and "\n" not in self.text:
            return 0  # the first line may still be a fence to drop
        for s in self.stop:  # a trailing piece may be the start of a stop string
            for k in range(min(len(s) - 1, end), 0, -1):
                if self.text[:end].endswith(s[:k]):
                    end -= k
                    break
        if self.holds_lines:  # the last line may be cut, and the line breaks before it
            end = min(end, max(self.text.rfind("\n"), 0))
            end = len(self.text[:end].rstrip("\r\n"))
        return end

    def _rules(self) -> tuple[int, int] | None:
        """``(end of the text, end of what stopped it)`` for the earliest rule that fires."""
        best: tuple[int, int] | None = None
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, at + len(s))
        line = self._line_rules()
        if line is not None and (best is None or line[0] < best[0]):
            best = line
        return best

    def _line_rules(self) -> tuple[int, int] | None:
        """Scan the lines completed since the last call (stop lines, loops, region)."""
        while True:
            nl = self.text.find("\n", self._scan)
            if nl < 0:
                return None
            start, line, n = self._scan, self.text[self._scan : nl], self._line_no
            self._scan, self._line_no = nl + 1, n + 1
            if n == 0 and (at := self._before_rest(line)) is not None:
                return start + at, nl + 1
            key = line.strip()
            stop_line = (n > 0 or self.first_line_counts) and key in self.stop_lines
            self._seen[key] = self._seen.get(key, 0) + 1
            if self.region is not None and key and indent_width(line) <= self.region[0]:
                self._top += 1
                stop_line = stop_line or self._top > self.region[1]
            stop_line = stop_line or ((self.fences or self.unwrap) and key.startswith("```"))
            looping = bool(self.cut_loops and key and
                           (self._seen[key] >= 3 or repeats_a_piece(line)))  # fmt: skip
            if stop_line or looping:
                self.looped = not stop_line
                return max(0, start - 1), nl + 1  # the line break before it goes too

    def _before_rest(self, line: str) -> int | None:
        """Where the first line ``line`` stops before the rest of the cursor's line it
        ends with (``rest``), or None."""
        body = line.rstrip()
        if not self.rest or not body.endswith(self.rest):
            return None
        head = body[: len(body) - len(self.rest)]
        return len(head.rstrip(" \t") if self.rest_space else head)

    def _finish(self) -> tuple[str, bool]:
        """The text ended without a rule firing: the unfinished last line gets the line
        rules too, as if it were complete."""
        start = self._scan
        line = self.text[start:]
        at = self._before_rest(line) if self._line_no == 0 else None
        if at is None and (self.fences or self.unwrap) and line.strip().startswith("```"):
            at = max(0, start - 1)
        elif at is not None:
            at += start
        if at is not None:
            self.stopped = True
            self.text = self._ending(self.text[:at])
            return self._take(len(self.text)), True
        key = line.strip()
        looped = bool(self.cut_loops and key and
                      (self._seen.get(key, 0) >= 2 or repeats_a_piece(line)))  # fmt: skip
        if looped:
            self.looped = self.stopped = True
            self.text = self.text[: max(0, start - 1)]
        self.text = self._ending(self.text)
        return self._take(len(self.text)), looped

    def _ending(self, text: str) -> str:
        return text if self.trailing is None else text.rstrip("\r\n") + self.trailing

    def _take(self, end: int) -> str:
        piece = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return piece

    def _tokens_for(self, chars: int) -> int:
        """The fewest leading tokens whose text covers ``chars`` characters of ``raw``."""
        return min(bisect.bisect_left(self.ends, chars) + 1, len(self.ends))
