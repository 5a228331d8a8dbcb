"""A completion prompt's text before the cursor, tokenized again per keystroke only where it
changed.

Owns :class:`PrefixEncoder` (one per engine, kept there: ``engine.prefix_encoder``):
``encode(text)`` equals the tokenizer's own encoding of ``text``; the part before the
cursor's line is kept from the last keystrokes (a few recent texts), so typing on a line
re-tokenizes only that line. Must not touch: prompts' layout and windows, documents, the model.

Why: a completion reads ~12 characters per prompt token before the cursor (a 1,024-token
window reads 12 KB), and tokenizing all of it again would be a noticeable part of every
keystroke's latency, growing with the window.

When splitting is exact (a split point ``q``: ``encode(text) == encode(text[:q]) +
encode(text[q:])``), for the two pre-tokenizers known here; text holding an added token's
string (special tokens are split out before the regex) is encoded whole, as is text of
any other tokenizer.

- ByteLevel with its GPT-2 regex, no normalizer (SmolLM2's, GPT-2's: ``'s|'t|'re|'ve|'m|
  'll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``). ``q``: its character is
  ASCII whitespace and the previous one a printable ASCII character other than a space.
  Every match ends there: none holds a non-space followed by whitespace (only a match's
  first character may be a space). The matches before ``q`` end where they did in
  ``text[:q]`` (none looks past its end there but ``\\s+(?!\\S)``, which ends before
  ``q - 1``), and the regex, with no look-behind, matches ``text[q:]`` as it matches the
  rest of ``text``; BPE merges within a match.
- Qwen2's: a Split regex (``(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|
  \\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+``, isolated), then
  ByteLevel without its regex, NFC or no normalizer. Punctuation takes the line breaks
  after it (``):\\n`` is one match) and a letter run the one character before it, so ``q``
  is narrower: its character is ASCII whitespace and the previous one an ASCII letter or
  digit. No alternative holds a letter or digit followed by whitespace (letter runs end
  at the whitespace, a digit is a match alone), so a match ends at ``q``; no scan of an
  earlier match reads past ``q - 1`` (a letter run's end sees whitespace in ``text`` and
  the end in ``text[:q]``: it ends at ``q`` both ways); the regex has no look-behind. NFC
  keeps the split: ASCII whitespace has combining class 0 and is never the second
  character of a composition, and an ASCII letter or digit is never changed by what
  precedes it, so ``NFC(text) == NFC(text[:q]) + NFC(text[q:])`` with the same two
  characters at the seam.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from tokenizers import normalizers, pre_tokenizers

from codespec.daemon.text.protocols import Tokenizer

__all__ = ["PrefixEncoder"]

KEPT = 8  # texts before a cursor line kept (several documents, an edit's spots)
MIN_CHARS = 1024  # shorter texts are encoded whole
SEARCH = 4096  # how far back from the cursor's line a split is looked for

# Qwen2's Split regex (see the module docstring)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")


def _gpt2_boundary(c_before: str, c: str) -> bool:
    return c in " \t\n\r" and "!" <= c_before <= "~"


def _qwen2_boundary(c_before: str, c: str) -> bool:
    return c in " \t\n\r" and c_before in _ALNUM


def _is_qwen2(pre: Any) -> bool:
    """Whether ``pre`` is Qwen2's pre-tokenizer: its Split regex (isolated), then ByteLevel
    without its own regex. Read from the pre-tokenizer's own small JSON state."""
    if not isinstance(pre, pre_tokenizers.Sequence):
        return False
    parts = json.loads(pre.__getstate__()).get("pretokenizers", [])
    if len(parts) != 2:
        return False
    split, level = parts
    return (
        split.get("type") == "Split"
        and split.get("pattern") == {"Regex": QWEN2_REGEX}
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and level.get("type") == "ByteLevel"
        and not level.get("use_regex")
        and not level.get("add_prefix_space")
    )


def split_rule(backend: Any) -> Callable[[str, str], bool] | None:
    """The split-point test for ``backend`` (a ``tokenizers.Tokenizer``): ``(character
    before, character) -> whether a split there is exact``, or None (never split). Read
    from its normalizer and pre-tokenizer objects, not from the whole tokenizer's JSON,
    whose vocabulary makes it slow to write and parse."""
    pre, norm = backend.pre_tokenizer, backend.normalizer
    if (
        norm is None
        and isinstance(pre, pre_tokenizers.ByteLevel)
        and pre.use_regex
        and not pre.add_prefix_space
    ):
        return _gpt2_boundary
    if (norm is None or isinstance(norm, normalizers.NFC)) and _is_qwen2(pre):
        return _qwen2_boundary
    return None


class PrefixEncoder:
    """The tokenizer's encoding of the text before a cursor, reusing what did not change.

    ``encode`` splits the text at the last exact split point before its last line (the
    line being typed), encodes what follows it, and takes the ids of what precedes it from
    the last :data:`KEPT` texts seen, or encodes and keeps them.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.backend = tokenizer.backend_tokenizer
        self.boundary = split_rule(self.backend)
        self.exact = self.boundary is not None
        added = self.backend.get_added_tokens_decoder().values()
        self.added = [a.content for a in added if a.content]
        self._kept: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0  # encodings whose text before the split was kept (for tests, stats)

    def _encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def split(self, text: str) -> int:
        """The last exact split point before ``text``'s last line (0: none; encode whole)."""
        if not self.exact or len(text) < MIN_CHARS or any(a in text for a in self.added):
            return 0
        q = text.rfind("\n")  # the cursor's line starts after it; the "\n" itself may split
        stop = max(0, q - SEARCH)
        while q > stop:
            if self.boundary(text[q - 1], text[q]):
                return q
            q -= 1
        return 0

    def encode(self, text: str) -> list[int]:
        q = self.split(text)
        if q == 0:
            return self._encode(text)
        head = text[:q]
        with self._lock:
            ids = self._kept.get(head)
            if ids is not None:
                self._kept.move_to_end(head)
                self.hits += 1
        if ids is None:
            ids = self._encode(head)
            with self._lock:
                self._kept[head] = ids
                while len(self._kept) > KEPT:
                    self._kept.popitem(last=False)
        return ids + self._encode(text[q:])
