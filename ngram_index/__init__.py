"""Token n-gram dictionaries over the user's documents (``codespec.ngram_index``).

Owns: LSP positions and text edits (:mod:`.positions`), the incremental n-gram
index with eviction and persistence (:mod:`.index`), the arrays it keeps
(:mod:`.segment`) and the longest-suffix lookup with its ranking (:mod:`.lookup`; in
C++, :mod:`.native`).
Must not touch models, the engine or sockets.
"""

from codespec.ngram_index.index import NgramIndex, TokenizerMismatch, tokenizer_hash
from codespec.ngram_index.lookup import Candidate, extend_matches
from codespec.ngram_index.positions import (
    LineIndex,
    PositionError,
    TextDocument,
    apply_changes,
    line_starts,
    offset_at,
    position_at,
)

__all__ = [
    "Candidate",
    "LineIndex",
    "NgramIndex",
    "PositionError",
    "TextDocument",
    "TokenizerMismatch",
    "apply_changes",
    "extend_matches",
    "line_starts",
    "offset_at",
    "position_at",
    "tokenizer_hash",
]
