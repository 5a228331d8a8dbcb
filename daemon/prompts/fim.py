"""Prompt formats: fill-in-the-middle tokens of the code-model families we know.

Owns: how a prefix / suffix pair (and other files) becomes a token-id prompt that
fits a context budget, in the layout the model was trained on:

- file level: ``<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>`` (PSM);
- repository level (Qwen2.5-Coder: ``<|repo_name|>``, ``<|file_sep|>``)::

    <|repo_name|>{repo}\n<|file_sep|>{path}\n{content}\n ... <|file_sep|>{current path}\n
    <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>

Must not touch: models, caches, sampling, documents (callers pass text and ids).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from codespec.daemon.text.specials import FimTokens


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
