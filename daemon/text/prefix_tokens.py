"""A completion prompt's text before the cursor, tokenized again per keystroke only where it
changed.

Owns :class:`PrefixEncoder` (one per tokenizer, :func:`prefix_encoder`): ``encode(text)``
equals the tokenizer's own encoding of ``text``; the part before the cursor's line is
kept from the last keystrokes (a few recent texts), so typing on a line re-tokenizes
only that line. Must not touch: prompts' layout and windows, documents, the model.

Why: a completion reads ~12 characters per prompt token before the cursor (a 1,024-token
window reads 12 KB) and tokenizing it took 3.3-4 ms of every keystroke on this project's
CPU, 33 ms with an 8k window at the end of a 120 KB file.

When splitting is exact: the tokenizer has no normalizer and its only pre-tokenizer is
ByteLevel with its GPT-2 regex (``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+|
?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``; SmolLM2's, GPT-2's). At a position ``q`` whose
character is ASCII whitespace and whose previous one is a printable ASCII character
other than a space, every match ends: none holds a non-space followed by whitespace
(only a match's first character may be a space). The matches before ``q`` end where
they did in ``text[:q]`` (none looks past its end there but ``\\s+(?!\\S)``, which
ends before ``q - 1``), and the regex, with no look-behind, matches ``text[q:]`` as it
matches the rest of ``text``; BPE merges within a match. So ``encode(text) ==
encode(text[:q]) + encode(text[q:])``. Text holding an added token's string (special
tokens are split out before the regex) is encoded whole, as is text of any other
tokenizer.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

from tokenizers import pre_tokenizers

__all__ = ["PrefixEncoder", "prefix_encoder"]

KEPT = 8  # texts before a cursor line kept (several documents, an edit's spots)
MIN_CHARS = 1024  # shorter texts are encoded whole
SEARCH = 4096  # how far back from the cursor's line a split is looked for

_ENCODERS: weakref.WeakKeyDictionary[Any, PrefixEncoder] = weakref.WeakKeyDictionary()


def _splits_exactly(backend: Any) -> bool:
    """Whether ``backend`` (a ``tokenizers.Tokenizer``) tokenizes only by ByteLevel's
    GPT-2 regex (see the module docstring). Read from its pre-tokenizer object: its JSON
    (the whole vocabulary, 1.5 MB for SmolLM2) took ~130 ms to write and parse."""
    pre = backend.pre_tokenizer
    return (
        backend.normalizer is None
        and isinstance(pre, pre_tokenizers.ByteLevel)
        and pre.use_regex
        and not pre.add_prefix_space
    )


def _boundary(c_before: str, c: str) -> bool:
    return c in " \t\n\r" and "!" <= c_before <= "~"


class PrefixEncoder:
    """The tokenizer's encoding of the text before a cursor, reusing what did not change.

    ``encode`` splits the text at the last exact split point before its last line (the
    line being typed), encodes what follows it, and takes the ids of what precedes it from
    the last :data:`KEPT` texts seen, or encodes and keeps them.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.backend = tokenizer.backend_tokenizer
        self.exact = _splits_exactly(self.backend)
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
            if _boundary(text[q - 1], text[q]):
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


def prefix_encoder(tokenizer: Any) -> PrefixEncoder:
    """The encoder for ``tokenizer`` (an engine's), made on first use."""
    enc = _ENCODERS.get(tokenizer)
    if enc is None:
        enc = PrefixEncoder(tokenizer)
        _ENCODERS[tokenizer] = enc
    return enc
