"""Training data for the speculator trainer (`codespec train-eagle`).

Owns: the corpus (the running interpreter's standard-library sources, with every
``test`` / ``tests`` folder held out, ``Lib/test`` being the evaluation set),
the sample builder for tokenizers with codespec's FIM tokens (a mix of
prefix-suffix-middle FIM and left-to-right samples), deterministic held-out
windows, and a byte-level BPE with the FIM special tokens at ids 0..4 (for
benchmarks and tests that need a small tokenizer of their own).

Must not touch: models, the engine, the daemon.
"""

from __future__ import annotations

import json
import random
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

EOT = "<|endoftext|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_SUFFIX = "<|fim_suffix|>"
FIM_MIDDLE = "<|fim_middle|>"
FILE_SEP = "<|file_sep|>"
SPECIAL_TOKENS = [EOT, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, FILE_SEP]

HELDOUT_DIRS = {"test", "tests"}


@dataclass
class SampleConfig:
    """What decides the rows a :class:`SampleBuilder` makes."""

    seq_len: int = 1024
    seed: int = 1234
    fim_rate: float = 0.5  # share of samples in the prefix-suffix-middle layout


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def collect_sources(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """Return (training files, held-out files) from the standard library.

    Training files are every ``.py`` under the stdlib except site-packages and
    any folder named ``test``/``tests``; the held-out files are ``Lib/test``.
    """
    root = root or stdlib_root()
    train: list[Path] = []
    heldout: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        if rel[0] == "test":
            heldout.append(path)
        elif HELDOUT_DIRS.intersection(rel[:-1]):
            continue
        else:
            train.append(path)
    return train, heldout


def read_texts(paths: list[Path], max_bytes: int = 400_000) -> list[str]:
    texts = []
    for p in paths:
        try:
            data = p.read_bytes()
        except OSError:
            continue
        if len(data) > max_bytes or b"\0" in data:
            continue
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return texts


def train_tokenizer(
    texts: list[str],
    vocab_size: int,
    specials: Sequence[str] = SPECIAL_TOKENS,
    use_regex: bool = True,
):
    """Byte-level BPE with ``specials`` first (by default the FIM special tokens at ids
    0..4). ``use_regex=False`` drops the GPT-2 pre-tokenizer regex: merges then cross
    spaces and line ends."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_tokenizer_files(tok, out: Path) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` for a :func:`train_tokenizer` BPE."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


class SampleBuilder:
    """Builds packed training rows of ``seq_len + 1`` token ids (FIM and left-to-right).

    Row ``i`` of step ``s`` depends only on (seed, s, i), so a resumed run sees
    exactly the samples the uninterrupted run would have seen.
    """

    def __init__(self, tok, texts: list[str], cfg: SampleConfig) -> None:
        self.tok = tok
        self.texts = texts
        self.cfg = cfg
        self.weights = [len(t) for t in texts]
        self.ids = {s: tok.token_to_id(s) for s in SPECIAL_TOKENS}

    def _enc(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def _window(self, rng: random.Random) -> str:
        text = rng.choices(self.texts, weights=self.weights)[0]
        length = rng.randint(800, 6000)
        if len(text) <= length:
            return text
        start = rng.randrange(0, len(text) - length)
        nl = text.rfind("\n", 0, start)
        start = nl + 1 if nl >= 0 else 0
        return text[start : start + length]

    def _fim(self, rng: random.Random, text: str) -> list[int]:
        if rng.random() < 0.5:
            # Middle = a span of whole lines (what a multi-line completion writes).
            lines = text.splitlines(keepends=True)
            a = rng.randrange(0, len(lines))
            b = min(len(lines), a + rng.randint(1, 12))
            pre = "".join(lines[:a])
            mid = "".join(lines[a:b])
            suf = "".join(lines[b:])
            # Often the cursor stands inside the line, after its indentation or more.
            if mid and rng.random() < 0.6:
                cut = rng.randint(0, len(lines[a].rstrip("\n")))
                pre, mid = pre + mid[:cut], mid[cut:]
        else:
            i, j = sorted(rng.randrange(0, len(text) + 1) for _ in range(2))
            pre, mid, suf = text[:i], text[i:j], text[j:]
        return self._psm(pre, suf, mid)

    def _psm(self, pre: str, suf: str, mid: str) -> list[int]:
        """One prefix-suffix-middle sample, ended by the end-of-text token."""
        ids = self.ids
        return [
            ids[FIM_PREFIX], *self._enc(pre), ids[FIM_SUFFIX], *self._enc(suf),
            ids[FIM_MIDDLE], *self._enc(mid), ids[EOT],
        ]  # fmt: skip

    def row(self, step: int, index: int) -> list[int]:
        rng = random.Random(f"{self.cfg.seed}/{step}/{index}")
        need = self.cfg.seq_len + 1
        out: list[int] = []
        while len(out) < need:
            text = self._window(rng)
            if rng.random() < self.cfg.fim_rate:
                piece = self._fim(rng, text)
            else:
                piece = [*self._enc(text), self.ids[EOT]]
            out.extend(piece)
        return out[:need]


def heldout_windows(tok, texts: list[str], seq_len: int, count: int, seed: int) -> list[list[int]]:
    """Deterministic left-to-right windows of ``seq_len + 1`` tokens from held-out code."""
    rng = random.Random(seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    windows = []
    for i in order:
        ids = tok.encode(texts[i]).ids
        if len(ids) < seq_len + 1:
            continue
        start = rng.randrange(0, len(ids) - seq_len)
        windows.append(ids[start : start + seq_len + 1])
        if len(windows) >= count:
            break
    return windows
