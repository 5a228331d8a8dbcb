"""The text before a completion's cursor tokenized in two parts: exactly the tokenizer's
own encoding (random text, real files, typing on a line), and only where that is exact."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
from qwen_local import qwen_tokenizer

from codespec.daemon.text.prefix_tokens import MIN_CHARS, PrefixEncoder

PIECES = ["a", "Z", "é", "ß", "1", "23", "٣", "'", "'s", "'ll", "s", " ", "  ", "\t", "\n",
          "\r\n", "\n    ", "\u00a0", "\u2003", ".", "(", ")", "_", "-", "#", "<", "|", ">",
          "😀", "中文", "x = 1", "  # c", '"', "''"]  # fmt: skip


def test_split_encodings_equal_the_tokenizers_own(engine):
    """Random text from letters, digits, contractions, punctuation, emoji and every kind of
    space, and stdlib files cut at random cursors: the same ids as one encoding."""
    enc = PrefixEncoder(engine.tokenizer)
    assert enc.exact  # SmolLM2's tokenizer: ByteLevel with the GPT-2 regex only
    rng = random.Random(3)
    texts = ["".join(rng.choice(PIECES) for _ in range(rng.randint(400, 900))) for _ in range(300)]
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    for f in rng.sample(files, 40):
        t = f.read_text(encoding="utf-8", errors="replace")
        texts += [t[: rng.randrange(len(t) + 1)] for _ in range(3)]
    split = 0
    for t in texts:
        split += enc.split(t) > 0
        assert enc.encode(t) == engine.encode(t)
    assert split > len(texts) // 3  # the split path really ran


def test_typing_on_a_line_reencodes_only_that_line(engine):
    """While the cursor's line grows, the text before it is one kept encoding."""
    import textwrap

    text = Path(textwrap.__file__).read_text(encoding="utf-8")
    end = text.index("\n", len(text) // 2) + 1
    enc = PrefixEncoder(engine.tokenizer)
    line = "        width = len(text) + 1"
    for k in range(1, len(line) + 1):
        head = text[:end] + line[:k]
        assert enc.encode(head) == engine.encode(head)
    assert enc.hits == len(line) - 1  # every keystroke after the first


def test_other_tokenizers_and_special_strings_are_encoded_whole(engine):
    """A tokenizer with another pre-tokenizer, a short text, or text holding an added
    token's string (split out before the regex): no split."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    other = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    long = "x = 1\n" * (MIN_CHARS // 3)
    assert PrefixEncoder(SimpleNamespace(backend_tokenizer=other)).split(long) == 0
    enc = engine.prefix_encoder
    assert enc.split(long) > 0
    assert enc.split(long[: MIN_CHARS // 2]) == 0
    assert enc.split(long + "<file_sep>\n" + long) == 0


@pytest.fixture(scope="module")
def qwen_tok(request):
    return qwen_tokenizer(request)


def test_qwen2_split_encodings_equal_the_tokenizers_own(qwen_tok):
    """Qwen2's pre-tokenizer (its Split regex, NFC): random text with decomposed accents
    and punctuation before line breaks, and stdlib files cut at random cursors, split
    where the rule allows: the same ids as one encoding."""
    enc = PrefixEncoder(qwen_tok)
    assert enc.exact
    rng = random.Random(5)
    pieces = [*PIECES, "e\u0301", "\u0301", "):\n", ",\n", "A\u030a", "\r", "x\n\n", "9 "]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(400, 900))) for _ in range(300)]
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    for f in rng.sample(files, 40):
        t = f.read_text(encoding="utf-8", errors="replace")
        texts += [t[: rng.randrange(len(t) + 1)] for _ in range(3)]
    split = 0
    for t in texts:
        split += enc.split(t) > 0
        assert enc.encode(t) == qwen_tok.encode(t, add_special_tokens=False)
    assert split > len(texts) // 3  # the split path really ran


def test_qwen2_splits_only_after_a_letter_or_digit(qwen_tok):
    """Punctuation takes the line breaks after it in Qwen2's regex (``):\\n`` is one
    piece), so the GPT-2 rule's split after ``:`` would not be exact there: the split
    is at the last whitespace after a letter or digit."""
    enc = PrefixEncoder(qwen_tok)
    text = "x = 1\n" * (MIN_CHARS // 6) + "def f(a):\n    return g(a)\n" + "    y"
    q = enc.split(text)
    assert text[q - 6 : q + 1] == "return "
    assert enc.encode(text) == qwen_tok.encode(text, add_special_tokens=False)
    ids = lambda s: qwen_tok.encode(s, add_special_tokens=False)  # noqa: E731
    whole, parts = ids("f(a):\n    "), ids("f(a):") + ids("\n    ")
    assert whole != parts  # why the GPT-2 rule does not carry over
