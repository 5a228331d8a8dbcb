"""Test helpers: proposers that draft from a known answer (the plain-decoding output),
finding the daemon processes a test started, and x as the int8 products round it."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from codespec.speculators.draft import Draft, RequestInfo, StepResult


class ScriptedProposer:
    """Drafts built from ``oracle``, the tokens plain greedy decoding produced.

    Modes: ``random`` (random tokens), ``correct`` (the next oracle tokens),
    ``k_then_wrong`` (k correct tokens, then wrong ones), ``tree`` (several
    branches: a wrong one, a correct one that forks into a correct and a wrong
    child, and a random one).
    """

    name = "scripted"

    def __init__(self, oracle: Sequence[int], mode: str, vocab: int, k: int = 2, seed: int = 0):
        self.oracle = list(oracle)
        self.mode = mode
        self.vocab = vocab
        self.k = k
        self.rng = random.Random(seed)
        self.prompt_len = 0
        self.steps = 0

    def begin(self, request: RequestInfo) -> None:
        self.prompt_len = len(request.prompt_ids)

    def _wrong(self, tok: int) -> int:
        return (tok + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab

    def _truth(self, pos: int, n: int) -> list[int]:
        truth = self.oracle[pos : pos + n]
        while len(truth) < n:  # past the oracle's end: anything
            truth.append(self.rng.randrange(self.vocab))
        return truth

    def propose(self, context: Sequence[int], budget: int) -> Draft | None:
        self.steps += 1
        pos = len(context) - self.prompt_len  # oracle index of the token after the root
        n = budget
        if self.mode == "random":
            return Draft.chain([self.rng.randrange(self.vocab) for _ in range(n)], "random")
        truth = self._truth(pos, n)
        if self.mode == "correct":
            return Draft.chain(truth, "correct")
        if self.mode == "k_then_wrong":
            k = min(self.k, n)
            return Draft.chain(truth[:k] + [self._wrong(t) for t in truth[k:]], "kwrong")
        if self.mode == "tree":
            j = self.rng.randrange(0, max(1, n // 2))
            paths = [
                ([self._wrong(truth[0]), *truth[1:3]], "wrong"),
                ([*truth[: j + 1], self._wrong(truth[j + 1])], "fork-wrong") if n > j + 1 else None,
                (truth[: min(n, j + 3)], "fork-right"),
                ([self.rng.randrange(self.vocab) for _ in range(3)], "random"),
            ]
            draft = Draft.from_paths([p for p in paths if p is not None])
            return draft.truncated(budget)
        raise ValueError(self.mode)

    def observe(self, result: StepResult) -> None:
        pass

    def follow(self, result: StepResult) -> None:
        pass


def alive(pid: int) -> bool:
    """Running (a killed child nobody has reaped yet is a zombie: dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def daemon_pids(socket_path: str) -> list[int]:
    """Live ``codespec serve`` processes serving ``socket_path`` (a test's own tmp path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmd and socket_path.encode() in cmd and alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


# -- speculator weights for a (tiny) model, made on the fly ------------------------------


def _target(model_dir: Path):
    """The model in ``model_dir`` as the trainers see it (fp32, frozen)."""
    from codespec.daemon.training.trainer import Target

    return Target(str(model_dir))


def _draft_vocab(vocab: int, size: int, first: Sequence[int], seed: int):
    """``size`` distinct ids, sorted: the ids of ``first`` (what the heads are trained on),
    then seeded random ones."""
    import torch

    chosen = list(dict.fromkeys(int(t) for t in first))[:size]
    taken = set(chosen)
    for t in torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).tolist():
        if len(chosen) >= size:
            break
        if t not in taken:
            chosen.append(t)
            taken.add(t)
    return torch.tensor(sorted(chosen))


def eagle_head_for(
    model_dir: Path,
    out: Path,
    train_on: Sequence[Sequence[int]] = (),
    steps: int = 0,
    draft_vocab: int = 1024,
    seed: int = 0,
) -> Path:
    """An EAGLE-3 head for the model in ``model_dir``, saved at ``out`` (e.g. MODEL/eagle):
    random (``steps`` 0: drafts rejected but lossless), or trained for ``steps`` steps
    (training-time test, as ``codespec train-eagle`` does) on the token sequences
    ``train_on``, so its drafts of those sequences get accepted."""
    import torch

    from codespec.daemon.training.train_eagle import EagleTrainConfig, ttt_loss
    from codespec.speculators.eagle_head import EagleConfig, EagleHead, save_head

    target = _target(model_dir)
    cfg = EagleConfig.for_target(target.config, draft_vocab_size=draft_vocab)
    torch.manual_seed(seed)
    head = EagleHead(cfg, target.embed)
    tokens = [t for seq in train_on for t in seq]
    head.set_draft_vocab(_draft_vocab(cfg.vocab_size, draft_vocab, tokens, seed))
    head.init_lm_head_from(target.lm_head)
    if steps:
        tcfg = EagleTrainConfig(ttt_steps=3, decay=0.8)
        opt = torch.optim.AdamW(head.parameters(), lr=1e-2, weight_decay=0.0)
        batches = [torch.tensor([list(seq)]) for seq in train_on]
        runs = [(x, *target.run(x, head.cfg.taps)) for x in batches]
        head.train()
        for step in range(steps):
            x, taps, logits = runs[step % len(runs)]
            loss, _ = ttt_loss(head, taps, logits, x, tcfg)
            loss.backward()
            opt.step()
            opt.zero_grad()
    save_head(head.eval(), out)
    return out


def wait_warmed(client, at_least: int, what: str, timeout: float = 60.0) -> None:
    """Poll a daemon's stats until it has warmed ``at_least`` prompts (``what``: the event
    that should have started one, for the failure message)."""
    deadline = time.monotonic() + timeout
    while client.request("stats")["requests"]["warmed"] < at_least:
        assert time.monotonic() < deadline, f"{what} was never warmed"
        time.sleep(0.02)


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """x as ``quant_gemm.linear_i8`` sees it: per 32 inputs, step d = max|x| / 127 (fp32),
    q = x * (1 / d) rounded half to even, clamped to +-127; returns q * d (float64)."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(xb).max(axis=2, keepdims=True) / np.float32(127)  # (M, K / 32, 1)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv), -127, 127)
    return torch.from_numpy((q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape))
