"""Prompt formats: fill-in-the-middle tokens of the code-model families we know.

Owns: which special tokens a tokenizer uses for FIM, for a repository's layout and for
"stop", and how a prefix / suffix pair (and other files) becomes a token-id prompt that
fits a context budget, in the layout the model was trained on:

- file level: ``<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>`` (PSM);
- repository level (Qwen2.5-Coder: ``<|repo_name|>``, ``<|file_sep|>``)::

    <|repo_name|>{repo}\n<|file_sep|>{path}\n{content}\n ... <|file_sep|>{current path}\n
    <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>

Must not touch: models, caches, sampling, documents (callers pass text and ids).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# (prefix, suffix, middle) special-token spellings, most specific first.
FIM_FAMILIES: list[tuple[str, str, str]] = [
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # codespec, Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder / StarCoder2
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),  # CodeLlama
]

STOP_TOKEN_SPELLINGS = [
    "<|endoftext|>",
    "<|file_sep|>",
    "<|repo_name|>",
    "<file_sep>",
    "<|fim_pad|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
    "<EOT>",
]


# (repository name, file separator) special tokens of a repository-level layout
REPO_FAMILIES: list[tuple[str, str]] = [("<|repo_name|>", "<|file_sep|>")]  # Qwen2.5-Coder


@dataclass(frozen=True)
class FimTokens:
    """A tokenizer's FIM tokens; ``repo`` / ``file_sep`` where it has the repository-level
    layout's (None where not)."""

    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    file_sep: int | None = None


def find_fim(vocab: dict[str, int]) -> FimTokens | None:
    for pre, suf, mid in FIM_FAMILIES:
        if pre in vocab and suf in vocab and mid in vocab:
            repo = next(((vocab[r], vocab[f]) for r, f in REPO_FAMILIES
                         if r in vocab and f in vocab), (None, None))  # fmt: skip
            return FimTokens(vocab[pre], vocab[suf], vocab[mid], *repo)
    return None


def stop_token_ids(vocab: dict[str, int], eos_id: int | None, fim: FimTokens | None) -> set[int]:
    """Tokens that end a completion: end of text, file separators, and FIM markers."""
    ids = {vocab[s] for s in STOP_TOKEN_SPELLINGS if s in vocab}
    if eos_id is not None:
        ids.add(int(eos_id))
    if fim is not None:
        ids.update((fim.prefix, fim.suffix, fim.middle))
    return ids


def fim_prompt(
    fim: FimTokens,
    prefix_ids: list[int],
    suffix_ids: list[int],
    budget: int,
    suffix_share: float = 0.25,
) -> list[int]:
    """``<prefix> P <suffix> S <middle>`` (PSM), cut to at most ``budget`` tokens.

    The prefix keeps its end (the text right before the cursor) and the suffix
    keeps its start; the suffix gets at most ``suffix_share`` of the budget when
    the prefix needs the room.
    """
    room = max(0, budget - 3)
    suf_room = min(len(suffix_ids), max(int(room * suffix_share), room - len(prefix_ids)))
    pre_room = room - suf_room
    pre = prefix_ids[-pre_room:] if pre_room > 0 else []
    suf = suffix_ids[:suf_room]
    return [fim.prefix, *pre, fim.suffix, *suf, fim.middle]


def repo_head(
    fim: FimTokens,
    encode: Callable[[str], list[int]],
    repo: str,
    files: Sequence[tuple[str, str]],
    path: str,
    budget: int,
) -> tuple[list[int], int]:
    """The repository-level layout's ids before ``<|fim_prefix|>``: ``<|repo_name|>repo``,
    then ``<|file_sep|>path`` and the content of as many of ``files`` (``(path, text)``, in
    order) as fit ``budget`` tokens, then the current file's ``<|file_sep|>path``; and how
    many of ``files`` it holds. ``fim`` must have the layout's tokens."""
    if fim.repo is None or fim.file_sep is None:
        raise ValueError("the tokenizer has no repository-level layout")
    head = [fim.repo, *encode(f"{repo}\n")]
    tail = [fim.file_sep, *encode(f"{path}\n")]
    used = 0
    for other, text in files:
        piece = [fim.file_sep, *encode(f"{other}\n{text.rstrip()}\n")]
        if len(head) + len(piece) + len(tail) > budget:
            break
        head += piece
        used += 1
    return head + tail, used
