"""`codespec train-model`: train the embedded code model from scratch (or fine-tune it).

Owns: the training corpus (the running interpreter's standard-library sources,
with every ``test`` / ``tests`` folder held out, ``Lib/test`` being the
evaluation set), the byte-level BPE tokenizer with FIM special tokens, the
sample builder (a mix of prefix-suffix-middle FIM and left-to-right samples),
the training loop (seeded, resumable checkpoints, progress bar) and the export
of the shipped model (config + fp16 safetensors + tokenizer.json).

``--init-from MODEL_DIR --copy-rate R`` fine-tunes an exported model, a share R
of the samples in the layout of an edit prompt (``completion.edit_prompt``: the
region's old text or a prediction ends the prefix, the region is the middle),
and reports the held-out top-1 accuracy of those middles before and after (and at
every checkpoint). ``--repeat-rate R`` mixes in a share R of left-to-right samples
that repeat a piece of code 2-4 times, the densest signal for learning to copy.

``--tokenizer MODEL_DIR`` reuses that model's tokenizer files verbatim instead of
training a BPE, so a model trained that way (a draft model for speculative
decoding) has exactly the target's vocabulary.

Must not touch: the engine, the daemon or anything that serves requests; the
exported folder is a plain Hugging Face checkpoint that the engine loads like
any other.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

EOT = "<|endoftext|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_SUFFIX = "<|fim_suffix|>"
FIM_MIDDLE = "<|fim_middle|>"
FILE_SEP = "<|file_sep|>"
SPECIAL_TOKENS = [EOT, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, FILE_SEP]

HELDOUT_DIRS = {"test", "tests"}
SUFFIX_TOKENS = 128  # completion.SUFFIX_TOKENS: the most suffix an edit prompt carries


@dataclass
class TrainConfig:
    """Everything that decides a training run; saved beside each checkpoint."""

    out: str = "runs/model"
    vocab_size: int = 8192
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_layers: int = 4
    num_heads: int = 6
    num_kv_heads: int = 2
    max_positions: int = 2048
    seq_len: int = 1024
    batch_size: int = 8
    steps: int = 900
    warmup: int = 40
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    fim_rate: float = 0.5
    seed: int = 1234
    checkpoint_every: int = 25
    eval_windows: int = 48
    threads: int = 0
    tokenizer: str = ""  # a model folder whose tokenizer files to reuse; "" trains a BPE
    init_from: str = ""  # fine-tune: start from this HF checkpoint folder (and its tokenizer)
    copy_rate: float = 0.0  # share of samples in the edit-prompt layout (SampleBuilder._copy)
    repeat_rate: float = 0.0  # share of samples that repeat a piece of code (SampleBuilder._repeat)


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


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with the FIM special tokens at ids 0..4."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer_files(src: Path, out: Path) -> None:
    """Copy a model folder's tokenizer files (byte for byte) into ``out``."""
    import shutil

    if not (src / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer.json in {src}")
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists() and (src / name).resolve() != (out / name).resolve():
            shutil.copyfile(src / name, out / name)


def load_tokenizer(cfg: TrainConfig, out: Path, texts: list[str]):
    """The run's tokenizer: ``cfg.tokenizer``'s files, the run's own, or a newly trained BPE."""
    from tokenizers import Tokenizer

    if cfg.tokenizer:
        copy_tokenizer_files(Path(cfg.tokenizer), out)
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        if tok.get_vocab_size() != cfg.vocab_size:
            raise ValueError(
                f"the tokenizer in {cfg.tokenizer} has {tok.get_vocab_size()} tokens; "
                f"pass --vocab-size {tok.get_vocab_size()}"
            )
        return tok
    if (out / "tokenizer.json").exists():
        return Tokenizer.from_file(str(out / "tokenizer.json"))
    tok = train_tokenizer(texts, cfg.vocab_size)
    write_tokenizer_files(tok, out)
    return tok


def write_tokenizer_files(tok, out: Path) -> None:
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
    """Builds packed training rows of ``seq_len + 1`` token ids.

    Row ``i`` of step ``s`` depends only on (seed, s, i), so a resumed run sees
    exactly the samples the uninterrupted run would have seen.
    """

    def __init__(self, tok, texts: list[str], cfg: TrainConfig) -> None:
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
        return self._psm_ids(self._enc(pre), self._enc(suf), self._enc(mid))

    def _psm_ids(self, pre: list[int], suf: list[int], mid: list[int]) -> list[int]:
        """:meth:`_psm` of pieces already tokenized."""
        ids = self.ids
        return [ids[FIM_PREFIX], *pre, ids[FIM_SUFFIX], *suf, ids[FIM_MIDDLE], *mid, ids[EOT]]

    def _copy(self, rng: random.Random, text: str, edited: bool | None = None) -> list[int]:
        """A sample in the layout of ``completion.edit_prompt``: the region's draft ends
        the prefix, the middle is the region. The draft is the region itself or, with
        ``edited`` (60% when None), the region after 1-3 line edits (what an old version
        or a sketch of the new code looks like), so the model learns to follow the draft
        where it agrees with the code and to leave it where it does not.

        Sized as the daemon sizes it: at most ``SUFFIX_TOKENS`` of suffix and the
        prefix windowed from the left (to a random length, so rows hold several
        samples), so the whole sample fits in ``seq_len`` and the middle, the only
        part that teaches copying, is never cut off by packing."""
        lines = text.splitlines(keepends=True)
        if len(lines) < 8:
            return self._fim(rng, text)
        n = rng.randint(3, min(40, len(lines) - 2))
        a = rng.randrange(0, len(lines) - n + 1)
        region = lines[a : a + n]
        if edited is None:
            edited = rng.random() < 0.6
        draft = "".join(self._edit_lines(rng, region, lines) if edited else region)
        before, mid, after = "".join(lines[:a]), "".join(region), "".join(lines[a + n :])
        copy = draft if draft.endswith("\n") or not draft else draft + "\n"
        pre_ids = self._enc(before + copy)
        mid_ids = self._enc(mid)
        suf_ids = self._enc(after)[: rng.randint(0, SUFFIX_TOKENS)]
        room = self.cfg.seq_len - 4 - len(mid_ids) - len(suf_ids)
        draft_len = len(self._enc(copy))
        if room < draft_len + 1:
            return self._fim(rng, text)
        keep = rng.randint(draft_len + 1, max(draft_len + 1, min(room, draft_len + 700)))
        return self._psm_ids(pre_ids[-keep:], suf_ids, mid_ids)

    def _repeat(self, rng: random.Random, text: str) -> list[int]:
        """A left-to-right sample that repeats a piece of code (16-160 tokens) 2-4 times.

        Every repeat after the first is predictable only by finding the earlier copy and
        reading on from it (an induction head), the mechanism that copying a draft,
        an old version or a repeated line needs: the densest signal for it. (175 steps
        of it did not form one in the embedded model; see the README.)"""
        lead, piece, times = self._repeat_parts(rng, text)
        return [*lead, *piece * times, self.ids[EOT]]

    def _repeat_parts(self, rng: random.Random, text: str) -> tuple[list[int], list[int], int]:
        """(the code before the piece, the piece, how many times it is written)."""
        ids = self._enc(text)
        n = min(rng.randint(16, 160), len(ids))
        start = rng.randrange(0, len(ids) - n + 1)
        lead = ids[max(0, start - rng.randint(0, 200)) : start]
        return lead, ids[start : start + n], rng.randint(2, 4)

    @staticmethod
    def _edit_lines(rng: random.Random, region: list[str], pool: list[str]) -> list[str]:
        out = list(region)
        for _ in range(rng.randint(1, 3)):
            kind = rng.randrange(4)
            i = rng.randrange(len(out))
            if kind == 0 and len(out) > 1:
                del out[i]  # a line the new version added
            elif kind == 1:
                out.insert(i, rng.choice(pool))  # a line the new version removed
            elif kind == 2:
                words = out[i].split(" ")
                j = rng.randrange(len(words))
                words[j] = rng.choice(rng.choice(pool).split(" ") or [""])
                out[i] = " ".join(words)  # a changed line
                if not out[i].endswith("\n"):
                    out[i] += "\n"
            elif i + 1 < len(out):
                out[i], out[i + 1] = out[i + 1], out[i]
        return out

    def row(self, step: int, index: int) -> list[int]:
        rng = random.Random(f"{self.cfg.seed}/{step}/{index}")
        need = self.cfg.seq_len + 1
        out: list[int] = []
        while len(out) < need:
            text = self._window(rng)
            if self.cfg.copy_rate and rng.random() < self.cfg.copy_rate:
                piece = self._copy(rng, text)
            elif self.cfg.repeat_rate and rng.random() < self.cfg.repeat_rate:
                piece = self._repeat(rng, text)
            elif rng.random() < self.cfg.fim_rate:
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


def evaluate(model, windows: list[list[int]], batch: int = 4) -> tuple[float, float]:
    """Mean next-token cross-entropy and top-1 accuracy over the windows."""
    import torch

    model.eval()
    total_loss, total_correct, total = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.tensor(windows[i : i + batch])
            logits = model(x[:, :-1]).logits.float()  # (B, T, V)
            target = x[:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"
            )
            total_loss += loss.item()
            total_correct += (logits.argmax(-1) == target).sum().item()
            total += target.numel()
    model.train()
    return total_loss / max(total, 1), total_correct / max(total, 1)


def copy_samples(builder: SampleBuilder, texts: list[str], count: int, seed: int, edited: bool):
    """Held-out samples in the edit layout, each with the index where its middle starts."""
    rng = random.Random(seed)
    mid_id = builder.ids[FIM_MIDDLE]
    samples = []
    for _ in range(count * 4):
        text = texts[rng.randrange(len(texts))][:2500]
        if text.count("\n") < 8:
            continue
        ids = builder._copy(rng, text, edited=edited)
        if mid_id in ids and len(ids) <= builder.cfg.seq_len + 1:
            samples.append((ids, ids.index(mid_id)))
        if len(samples) == count:
            break
    return samples


def repeat_samples(builder: SampleBuilder, texts: list[str], count: int, seed: int):
    """Held-out repeat samples (``SampleBuilder._repeat``), each with the index where
    the second copy of its piece starts: what follows is predictable by copying."""
    rng = random.Random(seed)
    samples = []
    for _ in range(count * 4):
        lead, piece, times = builder._repeat_parts(rng, texts[rng.randrange(len(texts))][:2500])
        if len(piece) >= 16:
            samples.append(([*lead, *piece * times], len(lead) + len(piece) - 1))
        if len(samples) == count:
            break
    return samples


def copy_accuracy(model, samples: list[tuple[list[int], int]]) -> float:
    """Teacher-forced top-1 accuracy of the middle tokens (the region the model rewrites)."""
    import torch

    model.eval()
    correct = total = 0
    with torch.no_grad():
        for ids, start in samples:
            x = torch.tensor([ids])
            pred = model(x[:, :-1]).logits[0].argmax(-1)  # (T,)
            target = x[0, 1:]
            correct += (pred[start:] == target[start:]).sum().item()
            total += len(ids) - 1 - start
    model.train()
    return correct / max(total, 1)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def build_model(cfg: TrainConfig, tok):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    eot = tok.token_to_id(EOT)
    mcfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    return LlamaForCausalLM(mcfg)


def export(model, tok, out: Path, metrics: dict, tokenizer_from: Path | None = None) -> None:
    """Write the shippable checkpoint: config, fp16 safetensors, tokenizer.

    ``tokenizer_from``: copy that folder's tokenizer files instead of writing ``tok``'s.
    """
    import copy

    import torch

    out.mkdir(parents=True, exist_ok=True)
    half = copy.deepcopy(model).to(torch.float16)
    half.config.torch_dtype = "float16"
    half.save_pretrained(out, safe_serialization=True)
    if tokenizer_from is not None:
        copy_tokenizer_files(tokenizer_from, out)
    else:
        write_tokenizer_files(tok, out)
    (out / "training.json").write_text(json.dumps(metrics, indent=2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="codespec train-model", description=__doc__.splitlines()[0])
    defaults = TrainConfig()
    for name, value in asdict(defaults).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--export", default=None, help="write the final fp16 model here")
    args = p.parse_args(argv)
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(defaults)})
    return train(cfg, resume=args.resume, export_dir=args.export)


def train(cfg: TrainConfig, resume: bool = False, export_dir: str | None = None) -> int:
    import torch
    from tqdm import tqdm

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    train_files, heldout_files = collect_sources()
    train_texts = read_texts(train_files)
    heldout_texts = read_texts(heldout_files)
    print(
        f"corpus: {len(train_texts)} training files ({sum(map(len, train_texts)) / 1e6:.1f} MB), "
        f"{len(heldout_texts)} held-out files from {stdlib_root() / 'test'}",
        flush=True,
    )
    if cfg.init_from and not cfg.tokenizer:
        cfg.tokenizer = cfg.init_from  # a fine-tune keeps the model's vocabulary
    tok = load_tokenizer(cfg, out, train_texts)
    model = build_model(cfg, tok)
    before: dict[str, float] = {}
    copy_sets: dict[str, list[tuple[list[int], int]]] = {}
    if cfg.copy_rate or cfg.repeat_rate:
        probe = SampleBuilder(tok, heldout_texts, cfg)
        for kind, edited in (("exact", False), ("edited", True)):
            copy_sets[kind] = copy_samples(probe, heldout_texts, 24, cfg.seed + 1, edited)
        copy_sets["repeat"] = repeat_samples(probe, heldout_texts, 24, cfg.seed + 1)
    if cfg.init_from:
        from transformers import AutoModelForCausalLM

        src = AutoModelForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
        model.load_state_dict(src.state_dict())
        for kind, samples in copy_sets.items():
            before[kind] = copy_accuracy(model, samples)
        if before:
            print(f"copy top-1 before fine-tuning: {before}", flush=True)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    start = 0
    ckpt = out / "checkpoint.pt"
    if resume and ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
        print(f"resumed at step {start}", flush=True)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    builder = SampleBuilder(tok, train_texts, cfg)
    model.train()
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train", unit="step")
    t0 = time.time()
    tokens = 0
    for step in bar:
        rows = torch.tensor([builder.row(step, i) for i in range(cfg.batch_size)])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        logits = model(rows[:, :-1]).logits  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += rows.shape[0] * cfg.seq_len
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens / (time.time() - t0):.0f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            tmp = out / "checkpoint.pt.tmp"
            torch.save(
                {"model": model.state_dict(), "optim": opt.state_dict(), "step": step + 1}, tmp
            )
            os.replace(tmp, ckpt)
            if copy_sets:
                now = {k: round(copy_accuracy(model, v), 4) for k, v in copy_sets.items()}
                bar.write(f"step {step + 1}: held-out copy probes, top-1 {now}")
    bar.close()
    windows = heldout_windows(tok, heldout_texts, cfg.seq_len, cfg.eval_windows, cfg.seed)
    loss, acc = evaluate(model, windows)
    params = sum(p.numel() for p in model.parameters())
    metrics = {
        "heldout_loss": round(loss, 4),
        "heldout_top1": round(acc, 4),
        "heldout_tokens": len(windows) * cfg.seq_len,
        "steps": cfg.steps,
        "train_tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
        "parameters": params,
        "config": asdict(cfg),
    }
    print(
        f"held-out (stdlib test/): loss {loss:.4f}  top-1 accuracy {acc:.4f}  "
        f"({metrics['heldout_tokens']} tokens); {params / 1e6:.1f}M parameters",
        flush=True,
    )
    if copy_sets:
        after = {kind: round(copy_accuracy(model, s), 4) for kind, s in copy_sets.items()}
        metrics["heldout_copy_top1"] = after
        if before:
            metrics["heldout_copy_top1_before"] = {k: round(v, 4) for k, v in before.items()}
        print(f"held-out edit-layout middles, top-1: {after} (before: {before})", flush=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if export_dir:
        export(model, tok, Path(export_dir), metrics, out if cfg.tokenizer else None)
        size = sum(f.stat().st_size for f in Path(export_dir).iterdir() if f.is_file())
        print(f"exported to {export_dir} ({size / 1e6:.1f} MB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
