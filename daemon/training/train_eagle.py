"""`codespec train-eagle`: train an EAGLE-3 draft head on a model's own hidden states.

Owns: the draft vocabulary (the most frequent tokens of the training code), the head
built for the target, its loss (the target runs in fp32 without gradients over each
batch to give the taps and its distribution on the fly; training-time test unrolls
several draft steps feeding the head its own predictions, step losses decayed), the
held-out report (teacher-forced per-step accuracy on stdlib ``test/`` windows, then real
per-position acceptance when decoding held-out prompts through the engine) and the
export in vLLM's ``speculators`` EAGLE-3 layout. The data, the frozen target and the
optimizer loop (seeded, resumable, a progress bar and a wall-clock budget) are
:mod:`.trainer`'s.

Must not touch: the target model's weights (frozen, never written), the
engine's decode loop, the daemon.

The loss at step ``k`` and position ``t`` is KL(target || head): the target's
distribution for token ``t + 2 + k`` restricted to the draft vocabulary
(renormalised) against the head's, weighted by ``decay ** k``; 0 is a perfect
head.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from codespec.daemon.engine.loading import ModelLoadError
from codespec.daemon.engine.models import display_name
from codespec.daemon.training.train_data import SPECIAL_TOKENS
from codespec.daemon.training.trainer import (
    Target,
    heldout_eval_windows,
    prepare,
    run_figures,
    run_training,
)
from codespec.speculators.eagle_head import EagleConfig, EagleHead, head_size, save_head


@dataclass
class EagleTrainConfig:
    """Everything that decides a head's training run; saved beside its checkpoint."""

    out: str = "runs/eagle"
    steps: int = 400
    minutes: float = 0.0  # wall-clock budget (0: none); the LR decays by whichever ends first
    batch_size: int = 4
    seq_len: int = 512
    ttt_steps: int = 4
    decay: float = 0.8
    lr: float = 1e-2
    warmup: int = 20
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    draft_vocab: int = 2048
    taps: str = ""  # "a,b,c"; empty: eagle_head.default_taps
    intermediate_size: int = 0  # 0: the target's
    fim_rate: float = 0.5
    target_runner: str = "auto"  # auto: the GGUF blocks the daemon runs, when there are any
    device: str = "cpu"  # cpu, cuda or auto: where the target and the head train
    seed: int = 0
    threads: int = 1
    checkpoint_every: int = 25
    eval_windows: int = 12
    eval_prompts: int = 16
    eval_tokens: int = 48
    eval_depth: int = 6


# -- the draft vocabulary --------------------------------------------------------------


def draft_vocabulary(
    tok: Any, texts: list[str], size: int, vocab: int, seed: int, chars: int = 6_000_000
) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent tokens of (a seeded sample of) the code, special tokens
    included; returns (sorted ids, the share of the sample's tokens they cover)."""
    rng = random.Random(seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    counts: Counter[int] = Counter()
    used = 0
    for i in order:
        counts.update(tok.encode(texts[i]).ids)
        used += len(texts[i])
        if used >= chars:
            break
    special = [t for s in SPECIAL_TOKENS if (t := tok.token_to_id(s)) is not None and t < vocab]
    chosen = list(dict.fromkeys(special))
    for t, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if t < vocab and t not in chosen:
            chosen.append(t)
    for t in range(vocab):  # a tiny corpus may not fill the vocabulary
        if len(chosen) >= size:
            break
        if t not in chosen:
            chosen.append(t)
    total = sum(counts.values())
    covered = sum(counts[t] for t in chosen)
    return torch.tensor(sorted(chosen)), covered / max(1, total)


# -- loss and metrics ------------------------------------------------------------------


def ttt_loss(
    head: EagleHead,
    taps: torch.Tensor,
    logits: torch.Tensor,
    x: torch.Tensor,
    cfg: EagleTrainConfig,
) -> tuple[torch.Tensor, list[float]]:
    """Decayed training-time-test loss over a batch and the per-step cumulative accuracy.

    ``x`` ``(B, T+1)`` tokens, ``taps`` / ``logits`` the target's over them. Head
    entry ``t`` (``t < T``) pairs taps ``t`` with token ``t + 1``; step ``k`` at ``t``
    is scored against the target's row ``t + 1 + k``. Accuracy of step ``k``: the
    share of positions whose steps ``0..k`` all equal the target's argmax.
    """
    t = x.shape[1] - 1
    fused = head.fuse(taps[:, :t])  # (B, T, h)
    outs = head.ttt_forward(fused, x[:, 1:], cfg.ttt_steps)
    d2t = head.draft_to_target()
    target_logp = torch.log_softmax(logits[..., d2t], dim=-1)  # (B, T+1, Vd)
    target_best = logits.argmax(-1)  # (B, T+1) in target ids
    loss = logits.new_zeros(())
    weight_sum = 0.0
    accs: list[float] = []
    correct = torch.ones((x.shape[0], t), dtype=torch.bool, device=x.device)
    for k, out in enumerate(outs):
        n = t - k  # positions whose target row t + 1 + k exists
        logp = target_logp[:, 1 + k : 1 + k + n]
        step = (logp.exp() * (logp - torch.log_softmax(out[:, :n], -1))).sum(-1).mean()  # KL
        loss = loss + (cfg.decay**k) * step
        weight_sum += cfg.decay**k
        with torch.no_grad():
            hit = d2t[out[:, :n].argmax(-1)] == target_best[:, 1 + k : 1 + k + n]
            correct = correct[:, :n] & hit
            accs.append(float(correct.float().mean()))
    return loss / weight_sum, accs


@torch.no_grad()
def heldout_accuracy(
    head: EagleHead, target: Target, windows: list[list[int]], cfg: EagleTrainConfig
) -> list[float]:
    """Teacher-forced cumulative accuracy per draft step on held-out windows."""
    head.eval()
    sums = [0.0] * cfg.ttt_steps
    for w in windows:
        x = torch.tensor([w], device=target.device)
        taps, logits = target.run(x, head.cfg.taps)
        _, accs = ttt_loss(head, taps, logits, x, cfg)
        sums = [a + b for a, b in zip(sums, accs, strict=True)]
    head.train()
    return [s / max(1, len(windows)) for s in sums]


def heldout_acceptance(
    model_path: str, head_path: Path, prompts: int, tokens: int, depth: int, seed: int
) -> dict[str, Any]:
    """Real acceptance: greedy decoding of held-out prompts with a fixed-depth EAGLE chain.

    Per position i: P(draft token i accepted | the draft reached depth i and tokens
    1..i-1 were accepted) and P(accepted length >= i); the bonus token is not counted.
    """
    from codespec.daemon.engine.engine import Engine, GenParams
    from codespec.daemon.training.train_data import collect_sources as sources
    from codespec.speculators.eagle import EagleProposer

    engine = Engine(model_path, device="cpu")
    _, heldout = sources()
    rng = random.Random(seed)
    files = [p for p in heldout if p.name.startswith("test_") and p.stat().st_size < 200_000]
    rng.shuffle(files)
    steps, forwards, produced = 0, 0, 0
    reach = [0] * depth
    hit = [0] * depth
    used = 0
    for path in files:
        if used >= prompts:
            break
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        if len(lines) < 40:
            continue
        cut = rng.randrange(20, len(lines))
        ids = engine.encode("".join(lines[:cut]))[-min(384, engine.max_length - tokens - 1) :]
        used += 1
        prop = EagleProposer.load(engine, head_path, depth=depth, topk=1)  # every step
        engine.reset_cache()
        _, stats = engine.generate(ids, GenParams(max_tokens=tokens, max_draft=depth), prop)
        forwards += stats.target_forwards - 1
        produced += stats.tokens - 1
        for d, _, m in prop.history:
            steps += 1
            for i in range(d):
                if m < i:
                    break
                reach[i] += 1
                hit[i] += int(m > i)
    cond = [h / r if r else 0.0 for h, r in zip(hit, reach, strict=True)]
    at_least = [h / steps if steps else 0.0 for h in hit]
    return {
        "prompts": used,
        "decode_steps": steps,
        "per_position_acceptance": [round(c, 4) for c in cond],
        "p_accepted_at_least": [round(a, 4) for a in at_least],
        "mean_accepted_no_bonus": round(sum(hit) / steps, 3) if steps else 0.0,
        "tokens_per_target_forward": round(produced / forwards, 3) if forwards else 0.0,
    }


# -- the run ---------------------------------------------------------------------------


def build_head(target: Target, cfg: EagleTrainConfig, tok: Any, texts: list[str], name: str):
    taps = tuple(int(t) for t in cfg.taps.split(",")) if cfg.taps else None
    vocab = int(target.config.vocab_size)
    size = min(cfg.draft_vocab or vocab, vocab)
    ecfg = EagleConfig.for_target(
        target.config,
        draft_vocab_size=size,
        taps=taps,
        intermediate_size=cfg.intermediate_size or None,
        name_or_path=name,
    )
    ecfg.speculative_tokens = cfg.ttt_steps
    if max(ecfg.taps) > target.num_layers:
        raise ValueError(f"taps {ecfg.taps} outside 0..{target.num_layers}")
    torch.manual_seed(cfg.seed)
    head = EagleHead(ecfg, target.embed)
    ids, coverage = draft_vocabulary(tok, texts, size, vocab, cfg.seed)
    head.set_draft_vocab(ids)
    head.init_lm_head_from(target.lm_head)
    return head.to(target.device), coverage


def _eagle_step(
    head: EagleHead, target: Target, x: torch.Tensor, cfg: EagleTrainConfig
) -> tuple[torch.Tensor, list[float]]:
    x = x.to(target.device)
    taps, logits = target.run(x, head.cfg.taps)
    loss, accs = ttt_loss(head, taps, logits, x, cfg)
    return loss, accs[:4]


def train(
    cfg: EagleTrainConfig,
    model: str | None,
    data: str | None,
    resume: bool,
    name: str | None = None,
) -> int:
    model_path, out, tok, texts, target = prepare(cfg, model, data)
    head, coverage = build_head(target, cfg, tok, texts, name or model or display_name(model_path))
    print(
        f"target {model_path}: {target.num_layers} layers, states from {target.kind}; "
        f"head taps {head.cfg.taps}, "
        f"draft vocab {head.cfg.draft_vocab_size} (covers {coverage:.1%} of corpus tokens), "
        f"{sum(p.numel() for p in head.parameters()) / 1e6:.2f}M trainable parameters; "
        f"{len(texts)} training files",
        flush=True,
    )
    step, losses, minutes = run_training(
        head,
        cfg,
        out,
        resume,
        "head",
        "eagle",
        tok,
        texts,
        lambda x: _eagle_step(head, target, x, cfg),
    )
    save_head(head, out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.name != "checkpoint.pt")
    print(f"saved the head to {out} ({size / 1e6:.1f} MB, speculators EAGLE-3 layout)", flush=True)
    metrics = {
        **run_figures(step, minutes, losses, cfg, coverage),
        **heldout_report(head, target, tok, model_path, out, cfg),
        "head": head_size(head),
        "train_config": asdict(cfg),
    }
    (out / "training.json").write_text(json.dumps(metrics, indent=2))
    print(json.dumps({k: metrics[k] for k in metrics if k not in ("head", "train_config")}))
    return 0


def heldout_report(
    head: EagleHead, target: Target, tok: Any, model_path: str, out: Path, cfg: EagleTrainConfig
) -> dict[str, Any]:
    """The held-out figures of a trained head (printed as they come): teacher-forced
    accuracy per draft step, cumulative and conditional, then real decoding
    (``cfg.eval_prompts`` prompts; none when 0)."""
    tf_acc = heldout_accuracy(head, target, heldout_eval_windows(tok, cfg), cfg)
    cond = [tf_acc[0]] + [b / a if a else 0.0 for a, b in itertools.pairwise(tf_acc)]
    print(
        "held-out (stdlib test/) teacher-forced, per draft step: cumulative "
        + " ".join(f"{a:.3f}" for a in tf_acc)
        + "  conditional "
        + " ".join(f"{a:.3f}" for a in cond),
        flush=True,
    )
    real: dict[str, Any] = {}
    if cfg.eval_prompts:
        real = heldout_acceptance(
            model_path, out, cfg.eval_prompts, cfg.eval_tokens, cfg.eval_depth, cfg.seed
        )
        print(
            f"held-out decoding ({real['prompts']} prompts, chain depth {cfg.eval_depth}, "
            f"greedy): per-position acceptance "
            + " ".join(f"{a:.3f}" for a in real["per_position_acceptance"])
            + f"; mean accepted {real['mean_accepted_no_bonus']} per step (bonus not counted), "
            f"{real['tokens_per_target_forward']} tokens per target forward",
            flush=True,
        )
    return {
        "heldout_teacher_forced_cumulative": [round(a, 4) for a in tf_acc],
        "heldout_teacher_forced_conditional": [round(a, 4) for a in cond],
        "heldout_decoding": real,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="codespec train-eagle", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="target model (default: $CODESPEC_MODEL, else qwen2.5-coder-0.5b; "
                   "the shipped head is smollm2-135m's)")  # fmt: skip
    p.add_argument("--data", default=None, help="a folder of .py files (default: stdlib sources)")
    defaults = EagleTrainConfig()
    for name, value in asdict(defaults).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--name", default=None, help="the verifier's name in the head's config")
    args = p.parse_args(argv)
    cfg = EagleTrainConfig(**{k: getattr(args, k) for k in asdict(defaults)})
    try:
        return train(cfg, args.model, args.data, args.resume, args.name)
    except (ValueError, ModelLoadError) as exc:  # bad flags, data, model or device
        print(f"codespec train-eagle: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
