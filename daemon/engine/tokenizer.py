"""A model folder's tokenizer without importing ``transformers`` (a faster daemon start).

Owns :func:`load` and :class:`FastTokenizer`, a small adapter over the ``tokenizers``
library's :class:`tokenizers.Tokenizer` read from ``tokenizer.json``, answering what the
daemon asks of a tokenizer: ``backend_tokenizer``, ``get_vocab``,
``convert_tokens_to_ids``, ``decode``, ``eos_token_id``, ``all_special_ids``,
``added_tokens_decoder``, ``chat_template`` / ``apply_chat_template`` (rendered with
jinja2 the way transformers 5 renders it: sandboxed, ``trim_blocks``, ``lstrip_blocks``,
``raise_exception``, ``tojson``, the special tokens as variables) and ``len``.

Why: ``AutoTokenizer.from_pretrained`` and the ``transformers`` import under it are
about half of a daemon's start on a cached model; ``Tokenizer.from_file`` is a small
fraction of that. A folder whose ``tokenizer_config.json`` asks for
anything else than the plain ``tokenizers`` backend (a Python tokenizer class, extra
normalisation) gets ``AutoTokenizer``. It knows nothing about models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from codespec.daemon.text.protocols import Tokenizer

# tokenizer_config.json keys that change nothing the adapter answers
_PLAIN_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast", "GPT2TokenizerFast"}
_PLAIN_CLASSES |= {"Qwen2TokenizerFast", "LlamaTokenizerFast", "CodeGenTokenizerFast"}
# transformers 5's Qwen2 class (no "Fast"): a tokenizers backend whose pipeline the folder's
# tokenizer.json holds as written; the default model's folder names it. The tests check
# the adapter against it on a qwen2 GGUF's folder, as on a llama one's.
_PLAIN_CLASSES |= {"Qwen2Tokenizer"}


class FastTokenizer:
    """The ``tokenizers`` backend with the few ``transformers`` tokenizer calls used here."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        folder = Path(folder)
        self.backend_tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = (
            json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        )
        template = folder / "chat_template.jinja"
        self.chat_template: str | None = (
            template.read_text(encoding="utf-8")
            if template.is_file()
            else self.config.get("chat_template")
        )
        self._vocab = self.backend_tokenizer.get_vocab(with_added_tokens=True)
        self.added_tokens_decoder = {
            i: t for i, t in self.backend_tokenizer.get_added_tokens_decoder().items()
        }
        self.all_special_ids = sorted(
            {
                i
                for i in (self._special_id(k) for k in ("bos_token", "eos_token", "unk_token"))
                if i is not None
            }
        )

    def _token(self, key: str) -> str | None:
        v = self.config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return v if isinstance(v, str) else None

    def _special_id(self, key: str) -> int | None:
        tok = self._token(key)
        return None if tok is None else self._vocab.get(tok)

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def eos_token(self) -> str | None:
        return self._token("eos_token")

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def __len__(self) -> int:
        return len(self._vocab)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int] | None:
        unk = self._special_id("unk_token")
        if isinstance(tokens, str):
            return self._vocab.get(tokens, unk)
        return [self._vocab.get(t, unk) for t in tokens]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        specials = {k: self._token(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        text = _compiled(self.chat_template).render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in specials.items() if v is not None},
            **kwargs,
        )
        return self.encode(text) if tokenize else text


_TEMPLATES: dict[str, Any] = {}


def _compiled(template: str) -> Any:
    """The template compiled as transformers compiles chat templates (sandboxed)."""
    if template not in _TEMPLATES:
        from datetime import datetime

        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, **kw: Any) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, **kw)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[template] = env.from_string(template)
    return _TEMPLATES[template]


def fast_enough(folder: str | Path) -> bool:
    """Whether :class:`FastTokenizer` answers for this folder as ``AutoTokenizer`` would:
    a ``tokenizer.json`` and a config naming the plain ``tokenizers`` backend."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        return False
    cfg_path = folder / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    except (OSError, ValueError):
        return False
    if cfg.get("auto_map") or cfg.get("clean_up_tokenization_spaces"):
        return False
    return cfg.get("tokenizer_class", "TokenizersBackend") in _PLAIN_CLASSES


def load(folder: str | Path) -> Tokenizer:
    """The folder's tokenizer: :class:`FastTokenizer` where it answers as ``AutoTokenizer``
    would (:func:`fast_enough`), else ``AutoTokenizer`` (local files only)."""
    if fast_enough(folder):
        return FastTokenizer(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


__all__ = ["FastTokenizer", "fast_enough", "load"]
