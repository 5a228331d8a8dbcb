"""How many tokens a completion generates at most when its request names no
``max_tokens``: the defaults of ``complete`` (one line, or a block with ``multiline``).

A single-line completion ends at the end of its line (a line-break stop); its cap only
bounds a line that runs on, and is high enough for a long line of code (~4 characters a
token: a 200-character line). No imports: the CLI's help reads these without loading
the daemon. Must not touch: prompts, the engine.
"""

from __future__ import annotations

LINE_TOKENS = 64  # one line (it stops at the line's end first)
BLOCK_TOKENS = 64  # a multi-line completion


def default_tokens(multiline: bool) -> int:
    """The cap of a completion whose request names no ``max_tokens``."""
    return BLOCK_TOKENS if multiline else LINE_TOKENS
