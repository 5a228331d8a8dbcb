"""Test helpers: proposers that draft from a known answer (the plain-decoding output),
and finding the daemon processes a test started."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

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
