"""Prompt formats: fill-in-the-middle tokens of the code-model families we know.

Owns: which special tokens a tokenizer uses for FIM and for "stop", and how a
prefix / suffix pair becomes a token-id prompt that fits a context budget.
Must not touch: models, caches, sampling.
"""

from __future__ import annotations

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
    "<file_sep>",
    "<|fim_pad|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
    "<EOT>",
]


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int


def find_fim(vocab: dict[str, int]) -> FimTokens | None:
    for pre, suf, mid in FIM_FAMILIES:
        if pre in vocab and suf in vocab and mid in vocab:
            return FimTokens(vocab[pre], vocab[suf], vocab[mid])
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
