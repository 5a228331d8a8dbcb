"""What the text and prompt layers read of an engine, as protocols: they import no engine.

Owns :class:`Tokenizer` (the calls the daemon makes on a model's tokenizer: the engine's
``FastTokenizer`` or ``transformers``' own) and :class:`TextModel` (an engine's tokenizer
side: encode and decode, its FIM tokens, its context length, and the tables built from
its tokenizer that the engine keeps: :class:`~.healing.TokenTexts`,
:class:`~.prefix_tokens.PrefixEncoder`). ``codespec.daemon.engine.engine.Engine`` and the
remote engine (``codespec.daemon.backends.remote``) both fit; :mod:`codespec.daemon.prompts`
and :mod:`.healing` take a :class:`TextModel`, so they stay below the engine in the
layering (``tests/test_layering.py``). Must not touch: anything at run time (only types).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tokenizers import Tokenizer as BackendTokenizer

    from codespec.daemon.text.healing import TokenTexts
    from codespec.daemon.text.prefix_tokens import PrefixEncoder
    from codespec.daemon.text.specials import FimTokens

__all__ = ["TextModel", "Tokenizer"]


class Tokenizer(Protocol):
    """A model's tokenizer as the daemon uses it (``codespec.daemon.engine.tokenizer``)."""

    @property
    def backend_tokenizer(self) -> BackendTokenizer: ...

    @property
    def chat_template(self) -> str | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def get_vocab(self) -> dict[str, int]: ...

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int] | None: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str | list[int]: ...

    def __len__(self) -> int: ...


class TextModel(Protocol):
    """An engine's tokenizer side, what prompts and token healing read of it.

    - ``tokenizer``: the model's :class:`Tokenizer`; ``encode`` / ``decode``: text to ids
      (no special tokens added) and back.
    - ``fim``: the tokenizer's FIM tokens, None for a model without them.
    - ``max_length``: the most positions the model takes (prompt and output).
    - ``token_texts``, ``prefix_encoder``: tables built once per engine from its
      tokenizer and kept by it (made on first use).
    """

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def fim(self) -> FimTokens | None: ...

    @property
    def max_length(self) -> int: ...

    @property
    def token_texts(self) -> TokenTexts: ...

    @property
    def prefix_encoder(self) -> PrefixEncoder: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...
