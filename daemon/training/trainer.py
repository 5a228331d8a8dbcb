"""The training loop a draft head's trainer runs on (``codespec train-eagle`` is one).

Owns: the training texts (a folder of ``.py`` files, by default the standard-library
training sources of :mod:`.train_data`; ``Lib/test`` held out) and the rows cut from
them (FIM samples, or plain windows for a tokenizer without codespec's FIM tokens), the
frozen target in fp32 (taps and logits of a batch, no gradients), the optimizer loop
(seeded, resumable from a checkpoint, a wall-clock budget, warm-up then cosine
learning rate, a progress bar) and the figures every trainer reports.

Must not touch: the target model's weights (frozen, never written), the engine's decode
loop, the daemon. What a head is and what its loss is belong to its trainer.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from codespec.daemon.training.train_data import (
    SPECIAL_TOKENS,
    SampleBuilder,
    SampleConfig,
    collect_sources,
    heldout_windows,
    read_texts,
)

# -- data ------------------------------------------------------------------------------


def load_texts(data: str | None) -> list[str]:
    """``.py`` files under ``data``; by default the stdlib training sources (``test/`` held out)."""
    if data:
        root = Path(data)
        if not root.is_dir():
            raise ValueError(f"--data {data} is not a folder")
        paths = sorted(root.rglob("*.py"))
    else:
        paths, _ = collect_sources()
    texts = [t for t in read_texts(paths) if t.strip()]
    if not texts:
        raise ValueError(f"no readable .py files in {data or 'the standard library'}")
    return texts


class WindowBuilder:
    """Left-to-right windows of ``seq_len + 1`` tokens, for tokenizers without codespec's FIM
    tokens. Row ``i`` of step ``s`` depends only on (seed, s, i)."""

    def __init__(self, tok: Any, texts: list[str], cfg: SampleConfig) -> None:
        self.tok, self.texts, self.cfg = tok, texts, cfg
        self.weights = [len(t) for t in texts]

    def row(self, step: int, index: int) -> list[int]:
        rng = random.Random(f"{self.cfg.seed}/{step}/{index}")
        out: list[int] = []
        while len(out) < self.cfg.seq_len + 1:
            text = rng.choices(self.texts, weights=self.weights)[0]
            start = rng.randrange(0, max(1, len(text) - 4000))
            out.extend(self.tok.encode(text[start : start + 6000]).ids)
        return out[: self.cfg.seq_len + 1]


def load_tokenizer(model_path: str) -> Any:
    from tokenizers import Tokenizer

    path = Path(model_path) / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"no tokenizer.json in {model_path}")
    return Tokenizer.from_file(str(path))


def sample_builder(tok: Any, texts: list[str], cfg: Any) -> Any:
    """Training rows: FIM / left-to-right samples when the tokenizer has the FIM tokens,
    plain windows otherwise (``cfg`` gives ``seq_len``, ``seed``, ``fim_rate``)."""
    tcfg = SampleConfig(seq_len=cfg.seq_len, seed=cfg.seed, fim_rate=cfg.fim_rate)
    has_fim = all(tok.token_to_id(s) is not None for s in SPECIAL_TOKENS)
    return SampleBuilder(tok, texts, tcfg) if has_fim else WindowBuilder(tok, texts, tcfg)


# -- the target ------------------------------------------------------------------------


class Target:
    """The frozen target: taps and logits of a batch, no gradients.

    ``runner``: ``auto`` runs the batch through the GGUF blocks the daemon itself runs on
    the CPU when the folder was made from a GGUF (the states the head will be fed when it
    drafts; one row at a time through the lean stack, which on the CPU keeps up with
    transformers' batched forward), else transformers in fp32;
    ``hf`` always transformers. The embedding and LM head the head starts from are
    transformers' fp32 weights either way.

    ``device``: ``cpu``, ``cuda`` (an error where torch sees no CUDA device) or ``auto``
    (cuda where there is one), as the engine's ``--device``. Off the CPU the target is
    transformers' (the lean stack is the CPU's), and the batches, the taps and the logits
    live on that device.
    """

    def __init__(
        self, model_path: str, runner: str = "auto", max_length: int = 0, device: str = "cpu"
    ) -> None:
        from transformers import AutoModelForCausalLM

        if runner not in ("auto", "hf"):
            raise ValueError(f"unknown target runner {runner!r} (auto or hf)")
        from codespec.daemon.engine.loading import pick_device

        self.device = pick_device(device)
        if self.device.type == "cuda":  # the head learns from states within TF32's rounding
            torch.backends.cuda.matmul.allow_tf32 = True
        from codespec.daemon.engine.models import hf_checkpoint

        self.model = AutoModelForCausalLM.from_pretrained(
            hf_checkpoint(model_path), local_files_only=True, dtype=torch.float32
        ).eval()
        self.model.to(self.device)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.config = self.model.config
        self.num_layers = int(self.config.num_hidden_layers)
        self.runner: Any = None
        if runner == "auto" and self.device.type == "cpu":
            from codespec.daemon.engine import lean

            got = lean.from_model_folder(model_path, max_length or None)
            self.runner = got[0] if got is not None else None

    @property
    def kind(self) -> str:
        """What computes the states, in words."""
        if self.runner is not None:
            return "the GGUF blocks (lean stack)"
        return "transformers fp32" + ("" if self.device.type == "cpu" else f" on {self.device}")

    @property
    def embed(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @torch.no_grad()
    def run(self, x: torch.Tensor, taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``(B, T)`` → taps ``(B, T, 3, h)`` and logits ``(B, T, V)``.

        Tap ``l < L`` is ``hidden_states[l]``; tap ``L`` (the last layer's output
        before the final norm) is hooked, as ``HFRunner`` does.
        """
        if self.runner is not None:
            states, logits = [], []
            for row in x.tolist():
                self.runner.reset()
                out = self.runner.forward(row, taps=taps)
                states.append(out.hidden)
                logits.append(out.logits)
            self.runner.reset()
            return torch.stack(states).float(), torch.stack(logits).float()
        x = x.to(self.device)
        last: list[torch.Tensor] = []
        hook = None
        if self.num_layers in taps:
            hook = self.model.model.layers[-1].register_forward_hook(
                lambda _m, _i, o: last.append(o[0] if isinstance(o, tuple) else o)
            )
        try:
            out = self.model(input_ids=x, output_hidden_states=True, use_cache=False)
        finally:
            if hook is not None:
                hook.remove()
        states = [last[0] if t == self.num_layers else out.hidden_states[t] for t in taps]
        return torch.stack(states, dim=2).float(), out.logits.float()


# -- the loop --------------------------------------------------------------------------


def lr_at(progress: float, step: int, cfg: Any) -> float:
    """Linear warm-up over ``cfg.warmup`` steps, then cosine down to ``cfg.min_lr_ratio``
    of ``cfg.lr`` as ``progress`` (steps or wall-clock budget, whichever is further) reaches 1."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


class Checkpoint:
    """``out/checkpoint.pt``: the module's state under ``key``, the optimizer's, the step,
    the minutes trained and the config; written whole or not at all."""

    def __init__(self, path: Path, module: torch.nn.Module, opt: Any, key: str, cfg: Any):
        self.path, self.module, self.opt, self.key, self.cfg = path, module, opt, key, cfg

    def load(self) -> tuple[int, float]:
        """Restore the module and optimizer; (step, seconds trained), (0, 0.0) if none."""
        if not self.path.exists():
            return 0, 0.0
        state = torch.load(self.path, map_location="cpu", weights_only=False)
        if state.get("config") != asdict(self.cfg):
            print("note: resuming with a different configuration", flush=True)
        self.module.load_state_dict(state[self.key])
        self.opt.load_state_dict(state["optim"])
        start, elapsed = int(state["step"]), float(state["elapsed"])
        print(f"resumed at step {start} ({elapsed / 60:.1f} min trained)", flush=True)
        return start, elapsed

    def save(self, step: int, elapsed: float) -> None:
        tmp = self.path.with_suffix(".tmp")
        state = {
            self.key: self.module.state_dict(),
            "optim": self.opt.state_dict(),
            "step": step,
            "elapsed": elapsed,
            "config": asdict(self.cfg),
        }
        torch.save(state, tmp)
        os.replace(tmp, self.path)


def run_training(
    module: torch.nn.Module,
    cfg: Any,
    out: Path,
    resume: bool,
    key: str,
    desc: str,
    tok: Any,
    texts: list[str],
    step_fn: Callable[[torch.Tensor], tuple[torch.Tensor, list[float]]],
) -> tuple[int, list[float], float]:
    """The loop of a draft-head trainer: AdamW over ``module``'s trainable parameters,
    resume from ``out/checkpoint.pt`` (:class:`Checkpoint`), the config written beside it,
    seeded rows, the wall-clock budget ``cfg.minutes``, the learning-rate schedule, clipped
    steps, a progress bar and checkpoints. ``step_fn(rows)`` returns the loss and
    accuracies to show. Returns (steps done, losses, minutes trained)."""
    from tqdm import tqdm

    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    ckpt = Checkpoint(out / "checkpoint.pt", module, opt, key, cfg)
    start, elapsed = ckpt.load() if resume else (0, 0.0)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    builder = sample_builder(tok, texts, cfg)
    module.train()
    budget_s = cfg.minutes * 60
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=desc, unit="step")
    t0 = time.time() - elapsed
    step = start
    losses: list[float] = []
    for step in bar:
        elapsed = time.time() - t0
        if budget_s and elapsed >= budget_s:
            print(f"\nwall-clock budget reached after {step} steps", flush=True)
            break
        progress = max(step / cfg.steps, elapsed / budget_s if budget_s else 0.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, step, cfg)
        loss, accs = step_fn(torch.tensor([builder.row(step, i) for i in range(cfg.batch_size)]))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", acc=" ".join(f"{a:.2f}" for a in accs))
        if (step + 1) % cfg.checkpoint_every == 0:
            ckpt.save(step + 1, time.time() - t0)
    else:
        step = cfg.steps
    bar.close()
    minutes = (time.time() - t0) / 60
    ckpt.save(step, time.time() - t0)
    return step, losses, minutes


def prepare(
    cfg: Any, model: str | None, data: str | None
) -> tuple[str, Path, Any, list[str], Target]:
    """What every head trainer starts from: torch threads set, the target's folder, the
    output folder (created), the target's tokenizer, the training texts, the target."""
    from codespec.daemon.engine.loading import resolve_model_path

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model_path = resolve_model_path(model)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    runner = getattr(cfg, "target_runner", "auto")
    target = Target(model_path, runner, cfg.seq_len + 1, getattr(cfg, "device", "cpu"))
    return model_path, out, load_tokenizer(model_path), load_texts(data), target


def heldout_eval_windows(tok: Any, cfg: Any) -> list[list[int]]:
    """The held-out (stdlib ``test/``) windows a trainer reports its accuracies on."""
    _, heldout_files = collect_sources()
    return heldout_windows(tok, read_texts(heldout_files), cfg.seq_len, cfg.eval_windows, cfg.seed)


def run_figures(
    step: int, minutes: float, losses: list[float], cfg: Any, coverage: float
) -> dict[str, Any]:
    """The training figures every head trainer's training.json starts with."""

    def mean(xs: list[float]) -> float | None:
        return round(sum(xs) / len(xs), 4) if xs else None

    return {
        "steps": step,
        "minutes": round(minutes, 2),
        "train_tokens": step * cfg.batch_size * cfg.seq_len,
        "final_loss": mean(losses[-20:]),
        "first_loss": mean(losses[:5]),
        "draft_vocab_coverage": round(coverage, 4),
    }
