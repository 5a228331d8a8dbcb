"""A tokenizer's special tokens that matter to decoding: FIM markers, a repository
layout's name and file separator, and the tokens that end a completion.

Owns: the spellings of each code-model family's specials and finding them in a
vocabulary. The engine reads the stop ids, prompts read the FIM ids; this module knows
nothing of either.
Must not touch: prompts, models, the service.
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
