"""`codespec train-medusa`: train Medusa heads on a model's own last hidden states.

Owns: the heads' loss and training step (the frozen target runs in fp32
without gradients over each batch to give its last-layer states and its
distribution on the fly), the
held-out report (teacher-forced per-head top-1 accuracy on stdlib ``test/``
windows, then real tree acceptance when decoding held-out prompts through the
engine) and the export (``medusa.save_heads``).

Reuses by import from ``train_eagle``: ``Target``, ``load_texts``,
``load_tokenizer``, ``draft_vocabulary`` and ``run_training`` (the shared loop:
seeded rows, resume, wall-clock budget, learning-rate schedule, progress bar,
checkpoints); from ``train_data`` the held-out sources.

Must not touch: the target model's weights (frozen, never written), the
engine's decode loop, the daemon, the EAGLE trainer.

The loss of head ``i`` (``i = 1..k``) at position ``t`` is KL(target || head): the
target's distribution at row ``t + i`` (its prediction of token ``t + 1 + i``)
restricted to the draft vocabulary and renormalised, against head ``i``'s
distribution from the state at ``t``, weighted by ``decay ** (i - 1)``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from codespec.daemon.engine.models import display_name
from codespec.daemon.training.train_data import collect_sources
from codespec.daemon.training.train_eagle import (
    Target,
    draft_vocabulary,
    heldout_eval_windows,
    prepare,
    run_figures,
    run_training,
)
from codespec.speculators.medusa import MedusaConfig, MedusaHeads, save_heads


@dataclass
class MedusaTrainConfig:
    """Everything that decides a heads' training run; saved beside its checkpoint."""

    out: str = "runs/medusa"
    heads: int = 4
    steps: int = 1000
    minutes: float = 0.0  # wall-clock budget (0: none); the LR decays by whichever ends first
    batch_size: int = 4
    seq_len: int = 512
    decay: float = 0.8
    lr: float = 3e-3
    warmup: int = 20
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    draft_vocab: int = 2048
    fim_rate: float = 0.5
    seed: int = 0
    threads: int = 1
    checkpoint_every: int = 25
    eval_windows: int = 12
    eval_prompts: int = 16
    eval_tokens: int = 48
    eval_topk: int = 4
    eval_nodes: int = 12


def medusa_loss(
    heads: MedusaHeads, last: torch.Tensor, logits: torch.Tensor, decay: float
) -> tuple[torch.Tensor, list[float]]:
    """Decayed distillation loss over a batch and each head's top-1 accuracy.

    ``last`` ``(B, T, h)``: the target's last-layer states; ``logits`` ``(B, T, V)``
    its logits. Head ``i`` at ``t`` is scored against the target's row ``t + i``.
    """
    t = last.shape[1]
    out = heads(last)  # (B, T, k, Vd)
    d2t = heads.draft_to_target()
    target_logp = torch.log_softmax(logits[..., d2t], dim=-1)  # (B, T, Vd)
    target_best = logits.argmax(-1)  # (B, T) target ids
    loss = logits.new_zeros(())
    weight_sum = 0.0
    accs: list[float] = []
    for i in range(1, heads.cfg.num_heads + 1):
        n = t - i  # positions whose row t + i exists
        if n <= 0:
            accs.append(0.0)
            continue
        logp = target_logp[:, i : i + n]
        pred = out[:, :n, i - 1]
        step = (logp.exp() * (logp - torch.log_softmax(pred, -1))).sum(-1).mean()
        loss = loss + decay ** (i - 1) * step
        weight_sum += decay ** (i - 1)
        with torch.no_grad():
            accs.append(float((d2t[pred.argmax(-1)] == target_best[:, i : i + n]).float().mean()))
    return loss / max(weight_sum, 1e-9), accs


@torch.no_grad()
def heldout_accuracy(
    heads: MedusaHeads, target: Target, windows: list[list[int]], decay: float
) -> list[float]:
    """Teacher-forced top-1 accuracy per head on held-out windows."""
    heads.eval()
    sums = [0.0] * heads.cfg.num_heads
    for w in windows:
        taps, logits = target.run(torch.tensor([w]), (heads.cfg.tap,))
        _, accs = medusa_loss(heads, taps[:, :, 0], logits, decay)
        sums = [a + b for a, b in zip(sums, accs, strict=True)]
    heads.train()
    return [s / max(1, len(windows)) for s in sums]


def heldout_acceptance(model_path: str, heads_path: Path, cfg: MedusaTrainConfig) -> dict[str, Any]:
    """Real acceptance: greedy decoding of held-out prompts with a fixed Medusa tree.

    Per depth i: P(depth i accepted | depth i - 1 was, the draft reaching depth i);
    the bonus token is not counted.
    """
    from codespec.daemon.engine.engine import Engine, GenParams
    from codespec.speculators.medusa import MedusaProposer

    engine = Engine(model_path, device="cpu")
    _, heldout = collect_sources()
    rng = random.Random(cfg.seed)
    files = [p for p in heldout if p.name.startswith("test_") and p.stat().st_size < 200_000]
    rng.shuffle(files)
    depth = cfg.heads
    steps, forwards, produced, used = 0, 0, 0, 0
    reach, hit = [0] * depth, [0] * depth
    for path in files:
        if used >= cfg.eval_prompts:
            break
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        if len(lines) < 40:
            continue
        cut = rng.randrange(20, len(lines))
        keep = min(384, engine.max_length - cfg.eval_tokens - 1)
        ids = engine.encode("".join(lines[:cut]))[-keep:]
        used += 1
        prop = MedusaProposer.for_engine(
            engine, heads_path, topk=cfg.eval_topk, max_nodes=cfg.eval_nodes, adaptive=False
        )
        engine.reset_cache()
        params = GenParams(max_tokens=cfg.eval_tokens, max_draft=cfg.eval_nodes)
        _, stats = engine.generate(ids, params, prop)
        forwards += stats.target_forwards - 1
        produced += stats.tokens - 1
        for d, _, m in prop.history:
            steps += 1
            for i in range(d):
                if m < i:
                    break
                reach[i] += 1
                hit[i] += int(m > i)
    return {
        "prompts": used,
        "decode_steps": steps,
        "tree": {"topk": cfg.eval_topk, "max_nodes": cfg.eval_nodes, "depth": depth},
        "per_depth_acceptance": [
            round(h / r, 4) if r else 0.0 for h, r in zip(hit, reach, strict=True)
        ],
        "mean_accepted_no_bonus": round(sum(hit) / steps, 3) if steps else 0.0,
        "tokens_per_target_forward": round(produced / forwards, 3) if forwards else 0.0,
    }


def build_heads(
    target: Target, cfg: MedusaTrainConfig, tok: Any, texts: list[str], name: str
) -> tuple[MedusaHeads, float]:
    vocab = int(target.config.vocab_size)
    size = min(cfg.draft_vocab or vocab, vocab)
    mcfg = MedusaConfig(
        hidden_size=int(target.config.hidden_size),
        vocab_size=vocab,
        draft_vocab_size=size,
        num_heads=cfg.heads,
        tap=target.num_layers,
        rms_norm_eps=float(getattr(target.config, "rms_norm_eps", 1e-5)),
        verifier_name_or_path=name,
    )
    torch.manual_seed(cfg.seed)
    heads = MedusaHeads(mcfg)
    ids, coverage = draft_vocabulary(tok, texts, size, vocab, cfg.seed)
    heads.set_draft_vocab(ids)
    heads.init_from_target(target.model.model.norm.weight, target.lm_head)
    return heads, coverage


def train(
    cfg: MedusaTrainConfig,
    model: str | None,
    data: str | None,
    resume: bool,
    name: str | None = None,
) -> int:
    model_path, out, tok, texts, target = prepare(cfg, model, data)
    heads, coverage = build_heads(
        target, cfg, tok, texts, name or model or display_name(model_path)
    )
    n_params = sum(p.numel() for p in heads.parameters())
    print(
        f"target {model_path}: {target.num_layers} layers; {cfg.heads} heads on tap "
        f"{heads.cfg.tap}, draft vocab {heads.cfg.draft_vocab_size} (covers {coverage:.1%} "
        f"of corpus tokens), {n_params / 1e6:.2f}M trainable parameters; "
        f"{len(texts)} training files",
        flush=True,
    )
    step, losses, train_minutes = run_training(
        heads,
        cfg,
        out,
        resume,
        "heads",
        "medusa",
        tok,
        texts,
        lambda x: _medusa_step(heads, target, x, cfg),
    )
    save_heads(heads, out)
    size = sum(
        f.stat().st_size for f in out.iterdir() if f.name in ("config.json", "model.safetensors")
    )
    print(f"saved the heads to {out} ({size / 1e6:.1f} MB)", flush=True)

    windows = heldout_eval_windows(tok, cfg)
    tf_acc = heldout_accuracy(heads, target, windows, cfg.decay) if windows else []
    print(
        "held-out (stdlib test/) teacher-forced top-1 accuracy per head (offset 2, 3, ...): "
        + " ".join(f"{a:.3f}" for a in tf_acc),
        flush=True,
    )
    real: dict[str, Any] = {}
    if cfg.eval_prompts:
        real = heldout_acceptance(model_path, out, cfg)
        print(
            f"held-out decoding ({real['prompts']} prompts, tree top-{cfg.eval_topk} "
            f"<= {cfg.eval_nodes} nodes, greedy): per-depth acceptance "
            + " ".join(f"{a:.3f}" for a in real["per_depth_acceptance"])
            + f"; mean accepted {real['mean_accepted_no_bonus']} per step (bonus not counted), "
            f"{real['tokens_per_target_forward']} tokens per target forward",
            flush=True,
        )
    metrics = {
        **run_figures(step, train_minutes, losses, cfg, coverage),
        "parameters": n_params,
        "heldout_teacher_forced_top1_per_head": [round(a, 4) for a in tf_acc],
        "heldout_decoding": real,
        "train_config": asdict(cfg),
    }
    (out / "training.json").write_text(json.dumps(metrics, indent=2))
    print(json.dumps({k: metrics[k] for k in metrics if k != "train_config"}))
    return 0


def _medusa_step(
    heads: MedusaHeads, target: Target, x: torch.Tensor, cfg: MedusaTrainConfig
) -> tuple[torch.Tensor, list[float]]:
    taps, logits = target.run(x, (heads.cfg.tap,))
    return medusa_loss(heads, taps[:, :, 0], logits, cfg.decay)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="codespec train-medusa", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--data", default=None, help="a folder of .py files (default: stdlib sources)")
    defaults = MedusaTrainConfig()
    for name, value in asdict(defaults).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--name", default=None, help="the verifier's name in the heads' config")
    args = p.parse_args(argv)
    cfg = MedusaTrainConfig(**{k: getattr(args, k) for k in asdict(defaults)})
    try:
        return train(cfg, args.model, args.data, args.resume, args.name)
    except ValueError as exc:
        print(f"codespec train-medusa: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
