"""Token healing: a prompt that ends inside what would be one token is backed off.

Owns: the text of every vocabulary entry (:class:`TokenTexts`, built once per
engine and kept there: ``engine.token_texts``) and :class:`Healing`, the constraint
that makes the first generated tokens spell out the text that was backed off.

Why: a cursor rarely sits on a token boundary of the text the model would
write. With SmolLM2's tokenizer ``"\\n        if"`` is ``["\\n       ", " if"]``:
a prompt ending at ``"...):\\n"`` ends with a lone ``"\\n"`` token the model
almost never saw followed by indentation, so it writes the next line at column
0 (or noise); a prompt ending in ``"from "`` ends with a lone ``" "``. Backing
off the prompt's last token and requiring the output to start with that
token's text lets the model pick its own split (``"\\n       "`` then
``" if"``), as guidance's token healing does.

The constraint: while the backed-off text ``R`` is not yet covered, the next
token must either start with the rest of ``R`` or be a proper prefix of it;
once covered, decoding is free. The engine applies it as a mask on the logits
of those steps; a verify step masks each row as the ids on its path allow, so plain
and speculative decoding see the same masked distribution (losslessness is kept).

Must not touch: the engine's loop, prompts, documents.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence

import torch

from codespec.daemon.text.protocols import TextModel, Tokenizer


class TokenTexts:
    """The text each token id adds when decoded after other text.

    ``text[i]`` is ``None`` for special tokens and for byte pieces that are not
    whole UTF-8 characters (they never take part in healing). The texts are also kept
    sorted (with their ids), so the ids whose text starts with some text are one range
    found by bisection: a loop over the tokens starting with a space (most of SmolLM2's
    vocabulary) would cost each completion whose cursor follows a word.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        backend = tokenizer.backend_tokenizer
        specials = set(getattr(tokenizer, "all_special_ids", []) or [])
        for tid, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(tok, "special", False):
                specials.add(int(tid))
        anchor = backend.encode("a", add_special_tokens=False).ids[:1] or [0]
        base = backend.decode(anchor, skip_special_tokens=False)
        n = min(vocab_size, backend.get_vocab_size(with_added_tokens=True))
        decoded = backend.decode_batch([[*anchor, i] for i in range(n)], skip_special_tokens=False)
        self.text: list[str | None] = [None] * vocab_size
        for i, s in enumerate(decoded):
            if i in specials or not s.startswith(base):
                continue
            piece = s[len(base) :]
            if not piece or "\ufffd" in piece:
                continue
            self.text[i] = piece
        order = sorted((t, i) for i, t in enumerate(self.text) if t is not None)
        self._sorted = [t for t, _ in order]
        self._sorted_ids = torch.tensor([i for _, i in order], dtype=torch.long)
        self._ids_of: dict[str, list[int]] = defaultdict(list)
        for t, i in order:
            self._ids_of[t].append(i)

    def allowed(self, rest: str) -> torch.Tensor:
        """Ids whose text starts with ``rest`` or is a proper prefix of it (in no order).

        Cutting sorted texts to ``len(rest)`` characters keeps them sorted, so the texts
        that start with ``rest`` are the range where the cut text equals it."""
        if not rest:
            return torch.empty(0, dtype=torch.long)
        n = len(rest)
        lo = bisect.bisect_left(self._sorted, rest, key=lambda t: t[:n])
        hi = bisect.bisect_right(self._sorted, rest, key=lambda t: t[:n])
        prefixes = [i for k in range(1, n) for i in self._ids_of.get(rest[:k], ())]
        return torch.cat([self._sorted_ids[lo:hi], torch.tensor(prefixes, dtype=torch.long)])


class Healing:
    """The constraint that the output starts with ``text`` (see the module docstring).

    Called with the ids generated so far, it returns a bool mask ``(V,)`` of the
    tokens allowed next, or ``None`` once ``text`` is covered. Stateless: a
    request resumed after preemption asks again with every id it generated.
    """

    def __init__(self, texts: TokenTexts, text: str) -> None:
        self.texts = texts
        self.text = text

    def __call__(self, generated: Sequence[int]) -> torch.Tensor | None:
        covered = 0
        for tok in generated:
            if covered >= len(self.text):
                return None
            piece = self.texts.text[tok] or ""
            covered += len(piece)
        if covered >= len(self.text):
            return None
        ids = self.texts.allowed(self.text[covered:])
        mask = torch.zeros(len(self.texts.text), dtype=torch.bool)
        mask[ids] = True
        return mask


def constraint(engine: TextModel, text: str) -> Healing | None:
    """The healing constraint for ``text`` backed off a prompt (None for nothing)."""
    if not text:
        return None
    return Healing(engine.token_texts, text)


def heal_prompt(engine: TextModel, ids: list[int]) -> tuple[list[int], str]:
    """Back off the prompt's last token when healing can regrow it: ``(ids, text)``.

    The last token stays when it is special or not a whole piece of text, or when
    it is the only token.
    """
    if len(ids) < 2:
        return ids, ""
    texts = engine.token_texts
    last = texts.text[ids[-1]] if ids[-1] < len(texts.text) else None
    if not last:
        return ids, ""
    return ids[:-1], last
