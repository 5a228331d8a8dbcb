"""What a request hands the engine and gets back: :class:`GenParams` in; per target forward a
:class:`Step` with the running :class:`Stats`; :class:`Verified`, one verify step's outcome.

Owns these records and their sums (:meth:`Stats.add` over a request's turns). Must not
touch: models, caches, proposers, text (the healing constraint arrives as a mask over ids).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from codespec.speculators.draft import Draft

__all__ = ["Constraint", "GenParams", "Stats", "Step", "Verified", "possible", "row_masks"]

Constraint = Callable[[list[int]], torch.Tensor | None]


@dataclass
class GenParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    max_draft: int = 16  # the most draft tokens verified in one forward
    # Allowed next tokens given the ids generated so far (a bool mask over the
    # vocabulary), or None when free: token healing (codespec.daemon.text.healing). A
    # verify step masks each row as the ids on its path allow (row_masks), so plain and
    # speculative decoding agree.
    constraint: Constraint | None = None
    # A prompt cached but its last token: the first forward feeds that token and verifies a
    # draft proposed from the prompt (Engine.stream's lead step); False: a prefill first.
    lead_step: bool = True
    # Greedy and the whole prompt cached with the model's own choices after it (typing
    # along the last completion): those choices are taken from the cache slot, with no
    # forward (Engine.stream; they are what the model chose there before, so the output
    # is the same). False: every token comes from a forward of this request.
    recall: bool = False

    def generator(self) -> torch.Generator | None:
        """Sampling's random stream, seeded by ``seed`` (None when greedy)."""
        if self.temperature <= 0:
            return None
        gen = torch.Generator(device="cpu")
        gen.manual_seed(self.seed if self.seed is not None else torch.seed())
        return gen


@dataclass
class Stats:
    """Statistics of one request (of one turn; :meth:`add` sums turns).

    - ``tokens``: tokens generated (the stop token that ended the request counted).
    - ``target_forwards``: every target forward, the prefill included; plain decoding
      of N tokens takes N forwards, so ``tokens_per_forward`` is 1.0 there.
    - ``accepted``/``drafted`` per source: draft tokens accepted / proposed; the BONUS
      token is never counted as accepted.
    - ``mean_accepted``: accepted draft tokens per decode step, bonus not counted.
    - ``lead_steps``: turns whose first forward was a verify step rooted at the prompt's
      last token (all the rest of the prompt cached): no prefill forward gave their first
      token, so ``target_forwards`` is ``decode_steps`` there.
    - ``recalled``: tokens taken from the cache slot, where the model had chosen them
      after this prompt before (``GenParams.recall``), with no forward.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    tokens: int = 0
    target_forwards: int = 0
    decode_steps: int = 0
    lead_steps: int = 0
    recalled: int = 0
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    finish_reason: str = ""

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tokens / self.total_ms if self.total_ms > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted.values()) / self.decode_steps if self.decode_steps else 0.0

    def count_draft(self, draft: Draft, accepted: list[int]) -> None:
        for i in range(len(draft)):
            src = draft.source(i)
            self.drafted[src] = self.drafted.get(src, 0) + 1
        for a in accepted:
            src = draft.source(a)
            self.accepted[src] = self.accepted.get(src, 0) + 1

    def add(self, turn: Stats) -> None:
        """Sum another turn of the same request into this one (the first turn's prompt
        figures are kept)."""
        if not self.target_forwards:
            self.prompt_tokens, self.cached_tokens = turn.prompt_tokens, turn.cached_tokens
        self.tokens += turn.tokens
        self.target_forwards += turn.target_forwards
        self.decode_steps += turn.decode_steps
        self.lead_steps += turn.lead_steps
        self.recalled += turn.recalled
        self.prefill_ms += turn.prefill_ms
        for mine, theirs in ((self.drafted, turn.drafted), (self.accepted, turn.accepted)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "tokens": self.tokens,
            "target_forwards": self.target_forwards,
            "lead_steps": self.lead_steps,
            "recalled": self.recalled,
            "tokens_per_forward": round(self.tokens_per_forward, 3),
            "mean_accepted_no_bonus": round(self.mean_accepted, 3),
            "drafted": dict(self.drafted),
            "accepted": dict(self.accepted),
            "prefill_ms": round(self.prefill_ms, 2),
            "ttft_ms": round(self.ttft_ms, 2),
            "total_ms": round(self.total_ms, 2),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "finish_reason": self.finish_reason,
        }


@dataclass
class Step:
    """One target forward's outcome: the new token ids (through the stop token, if one
    ended the request), what the step drafted and accepted, the running stats."""

    token_ids: list[int]
    accepted: int
    drafted: int
    stats: Stats
    done: bool = False


@dataclass
class Verified:
    """What :meth:`Engine.verify_step` returns: accepted draft nodes, the BONUS token, and
    the forward's rows (logits, taps) and wall time for the proposer to observe. For a
    greedy draft whose rows no proposer reads (``Draft.reads_rows``), ``logits`` may stop
    at the row where verification's walk ended (``Runner.forward``'s ``greedy``)."""

    accepted: list[int]
    bonus: int
    logits: torch.Tensor
    hidden: torch.Tensor | None
    forward_ms: float
    forward_tokens: int


def cut(
    new: list[int], out: list[int], max_tokens: int, stop_ids: Collection[int]
) -> tuple[list[int], str]:
    """Append a step's tokens to ``out`` in order until a stop token (``stop``) or
    ``max_tokens`` (``length``) ends the request; the step's tokens through that one."""
    for used, tok in enumerate(new, 1):
        if tok in stop_ids:
            return new[:used], "stop"
        out.append(tok)
        if len(out) >= max_tokens:
            return new[:used], "length"
    return new, ""


def row_masks(
    constraint: Constraint | None, done: list[int], draft: Draft | None
) -> dict[int, torch.Tensor]:
    """The masks a verify step over ``[root] + draft`` applies: row -> the tokens
    ``constraint`` allows after the ids on that row's path (row 0: the root's, after
    ``done``; row ``i + 1``: node ``i``'s, after ``done`` and the nodes from the root to
    it); rows it leaves free are absent. A node under a free row is free too (a
    constraint, once it gives None, stays free)."""
    if constraint is None:
        return {}
    first = constraint(done)
    if first is None:
        return {}
    masks = {0: first}
    if draft is None or not len(draft):
        return masks
    assert draft.parents is not None
    paths: list[list[int]] = []
    for i, p in enumerate(draft.parents):
        paths.append([*(paths[p] if p >= 0 else done), draft.tokens[i]])
        if p < 0 or p + 1 in masks:
            mask = constraint(paths[i])
            if mask is not None:
                masks[i + 1] = mask
    return masks


def possible(draft: Draft | None, constraint: Constraint | None, done: list[int]) -> Draft | None:
    """``draft`` without the nodes no verify step could accept: a node whose row's mask
    (:func:`row_masks`, after ``done``) forbids its token, and every node under it. The
    token a masked row gives is an allowed one, so verification would turn them down:
    dropping them changes no output, only the forward's size (a keystroke the ghost text
    did not predict: the last output, drafted again, cannot regrow the typed text). None
    when no node is left. The cut keeps the draft's ``origin`` (the proposer's draft and
    each node's index there) and ``chances``."""
    if draft is None or not len(draft) or constraint is None:
        return draft
    masks = row_masks(constraint, done, draft)
    if not masks:
        return draft
    assert draft.parents is not None
    keep: list[int] = []
    kept: set[int] = set()
    for i, (p, tok) in enumerate(zip(draft.parents, draft.tokens, strict=True)):
        row = 0 if p < 0 else p + 1
        if (p < 0 or p in kept) and (row not in masks or bool(masks[row][tok])):
            keep.append(i)
            kept.add(i)
    if len(keep) == len(draft):
        return draft
    if not keep:
        return None
    out = draft.select(keep)
    if draft.origin is not None:
        full, index = draft.origin
        out.origin = (full, [index[k] for k in keep])
    if draft.chances is not None:
        out.chances = [draft.chances[k] for k in keep]
    return out
