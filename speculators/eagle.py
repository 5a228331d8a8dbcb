"""EAGLE proposer: drafts from the EAGLE-3 head fed the target's own hidden states.

Owns: :class:`EagleProposer` (the Proposer protocol with ``taps``,
``prefilled`` and ``follow``), the head's cache bookkeeping per request, the
draft-tree growth (:func:`grow_draft`, EAGLE-2's dynamic tree; a chain when
``topk`` is 1), and finding the head shipped beside a model
(:func:`head_dir`: ``MODEL/eagle``, else the head shipped for the model's exact
weights in ``heads/``; :func:`load_runtime`, loaded once per target model and kept
in its ``speculator_state``).

Must not touch: the target model or its cache, verification, the engine's
loop, how deep to draft or whether to draft at all (the policy chooses the
budget it passes and measures what comes of it). The head itself (weights,
forward, files) is ``eagle_head.py``.

The head's cache, in step with the accepted tokens. Entry ``t`` pairs the
target's taps at position ``t`` with token ``t + 1`` (see ``eagle_head``), so
the taps of a position wait until the token after it is known:

- ``prefilled(taps)`` stores the prompt's taps as *pending*.
- ``propose(context)`` first flushes the pending rows into the cache with the
  context's tokens (``fc`` and one head forward over all of them; its last
  row, the entry of the last real position paired with the root token, gives
  the depth-1 candidates), then grows the draft: each deeper level is one
  head forward over that level's nodes, appended after the real entries as
  *speculative* entries. Before returning, they are rolled back.
- ``observe(result)`` / ``follow(result)`` append the taps of the kept rows
  (root + accepted nodes) of the verify forward as pending: the target's real
  states, never the head's guesses, so after every step the cache equals the
  cache built from scratch over the accepted tokens, whoever drafted the step.

The head reads at most the last ``window`` prompt positions (its first-step
cost grows with them); positions keep their absolute values.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from codespec.speculators.draft import Draft, MissingWeights, RequestInfo, StepResult
from codespec.speculators.eagle_head import HeadRunner, load_head, read_config
from codespec.speculators.heads import packaged_head
from codespec.speculators.target import TargetModel

__all__ = [
    "EagleProposer",
    "EagleRuntime",
    "LoadedHeads",
    "NoEagleHead",
    "NoEagleWeights",
    "grow_draft",
    "head_dir",
    "load_runtime",
]

SOURCE = "eagle"


class NoEagleHead(LookupError):
    """The model has no EAGLE head beside it (or the head does not fit the model)."""


class NoEagleWeights(NoEagleHead, MissingWeights):
    """Nothing at ``MODEL/eagle``: no head was trained for this model."""


def head_dir(model_path: str | Path) -> Path:
    """Where a model's head lives: ``MODEL/eagle`` (config.json + model.safetensors) when
    one was put there (a head trained here wins), else the head shipped with codespec for
    this model's exact weights (``heads/``), else ``MODEL/eagle`` (where none is yet)."""
    own = Path(model_path) / "eagle"
    if (own / "config.json").exists():
        return own
    return packaged_head(model_path) or own


@dataclass
class EagleRuntime:
    """What outlives one request: the head runner (and its cache buffer), its folder and
    the acceptance it was measured at (:func:`measured_acceptance`)."""

    runner: HeadRunner
    path: Path
    acceptance: tuple[float, ...] = ()


def measured_acceptance(where: Path) -> tuple[float, ...]:
    """The held-out acceptance by depth (each given its parent accepted) that
    ``codespec train-eagle`` wrote beside a head (``training.json``); () when there is
    none or it does not read as rates in (0, 1]."""
    try:
        figures = json.loads((where / "training.json").read_text())
        rates = tuple(float(r) for r in figures["heldout_teacher_forced_conditional"])
    except (OSError, ValueError, KeyError, TypeError):
        return ()
    return rates if all(0.0 < r <= 1.0 for r in rates) else ()


class LoadedHeads(dict[str, EagleRuntime]):
    """The EAGLE heads loaded for one target model, by folder: its ``speculator_state``'s
    part (:class:`~codespec.speculators.target.SpeculatorState`)."""


def load_runtime(target: TargetModel | None, path: str | Path | None = None) -> EagleRuntime:
    """The head for ``target``'s model (``MODEL/eagle`` unless ``path``), loaded once per
    target model and folder: kept in ``target.speculator_state`` (:class:`LoadedHeads`),
    it goes with the target."""
    if target is None:
        raise NoEagleHead("the eagle proposer needs a target model (its hidden states)")
    where = Path(path) if path is not None else head_dir(target.model_path)
    loaded = target.speculator_state.get(LoadedHeads)
    key = str(where.resolve())
    if key not in loaded:
        loaded[key] = _load_runtime(target, where)
    return loaded[key]


def _load_runtime(target: TargetModel, where: Path) -> EagleRuntime:
    """Check the head in ``where`` against the target model and load it."""
    if not (where / "config.json").exists():
        raise NoEagleWeights(
            "eagle",
            where,
            f"train them with `codespec train-eagle --model {target.model_path} --out {where}`",
        )
    try:
        cfg = read_config(where)
    except ValueError as exc:
        raise NoEagleHead(f"cannot load the EAGLE head in {where}: {exc}") from None
    if cfg.vocab_size != target.vocab_size or cfg.hidden_size != target.hidden_size:
        raise NoEagleHead(
            f"the EAGLE head in {where} was made for a model with vocab {cfg.vocab_size} and "
            f"hidden size {cfg.hidden_size}, not {target.vocab_size} / {target.hidden_size}"
        )
    if max(cfg.taps) > target.num_layers:
        raise NoEagleHead(
            f"the head reads tap {max(cfg.taps)} of a {target.num_layers}-layer model"
        )
    embed = target.embedding()
    try:
        head = load_head(where, embed.float().cpu())
    except ValueError as exc:
        raise NoEagleHead(f"cannot load the EAGLE head in {where}: {exc}") from None
    dtype = target.dtype
    runner = HeadRunner(
        head, embed, target.max_length + 64, target.device, dtype, target.kernels(dtype)
    )
    return EagleRuntime(runner, where, measured_acceptance(where))


@dataclass
class _Tree:
    """A draft tree while it grows: per node its token, cumulative log probability,
    parent (-1: the root) and depth; per expanded node its head-cache entry and output."""

    tokens: list[int] = field(default_factory=list)
    score: list[float] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    level: list[int] = field(default_factory=list)
    slot: dict[int, int] = field(default_factory=dict)
    out_of: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, tokens: list[int], scores: list[float], parent: int, level: int) -> list[int]:
        first = len(self.tokens)
        self.tokens += tokens
        self.score += scores
        self.parent += [parent] * len(tokens)
        self.level += [level] * len(tokens)
        return list(range(first, len(self.tokens)))

    def ancestors_mask(self, runner: HeadRunner, frontier: list[int], n_real: int) -> torch.Tensor:
        """Row r (node ``frontier[r]``) sees the real entries, its ancestors' speculative
        entries and its own new one."""
        past, rows = runner.length, len(frontier)
        allowed = torch.zeros((rows, past + rows), dtype=torch.bool)
        allowed[:, :n_real] = True
        for r, i in enumerate(frontier):
            allowed[r, past + r] = True
            p = self.parent[i]
            while p >= 0:
                allowed[r, self.slot[p]] = True
                p = self.parent[p]
        return allowed

    def best(self, max_nodes: int) -> Draft:
        """The ``max_nodes`` nodes of highest cumulative log probability (a child never
        scores above its parent, so they form a tree), parents before children."""
        chosen: set[int] = set()
        for i in sorted(range(len(self.tokens)), key=lambda i: (-self.score[i], i)):
            if len(chosen) >= max_nodes:
                break
            if self.parent[i] < 0 or self.parent[i] in chosen:
                chosen.add(i)
        keep = sorted(chosen)  # creation order: parents first
        new_index = {old: new for new, old in enumerate(keep)}
        return Draft(
            [self.tokens[i] for i in keep],
            [new_index[self.parent[i]] if self.parent[i] >= 0 else -1 for i in keep],
            sources=[SOURCE] * len(keep),
        )


def _expand(
    runner: HeadRunner,
    tree: _Tree,
    level: list[int],
    root_hidden: torch.Tensor,
    position: int,
    topk: int,
    n_real: int,
) -> list[int]:
    """One head forward over the ``topk`` best nodes of ``level`` (all at RoPE position
    ``position``); their ``topk`` children each become the next level."""
    frontier = sorted(level, key=lambda i: (-tree.score[i], i))[:topk]
    p = tree.parent
    hid = torch.stack([root_hidden if p[i] < 0 else tree.out_of[p[i]] for i in frontier])
    allowed = tree.ancestors_mask(runner, frontier, n_real) if topk > 1 else None
    positions = torch.full((len(frontier),), position, device=runner.device)
    out, logits = runner.forward([tree.tokens[i] for i in frontier], hid, positions, allowed)
    base = runner.length - len(frontier)
    cv, ci = torch.log_softmax(logits, -1).topk(min(topk, logits.shape[-1]), dim=-1)  # (rows, k)
    child_tokens, child_lp = runner.draft_ids[ci].tolist(), cv.tolist()
    nxt: list[int] = []
    for r, i in enumerate(frontier):
        tree.slot[i], tree.out_of[i] = base + r, out[r]
        scores = [tree.score[i] + lp for lp in child_lp[r]]
        nxt += tree.add(child_tokens[r], scores, i, tree.level[i] + 1)
    return nxt


def grow_draft(
    runner: HeadRunner,
    root_hidden: torch.Tensor,
    root_logits: torch.Tensor,
    root_position: int,
    depth: int,
    topk: int,
    max_nodes: int,
) -> tuple[Draft, list[int], int]:
    """EAGLE-2's dynamic tree from the last real entry's output; a chain when ``topk == 1``.

    ``root_position`` is the RoPE position of the last real entry; a node of depth
    ``d`` sits at ``root_position + d``.
    Level 1 is the top ``topk`` tokens of ``root_logits``; each deeper level feeds
    the ``topk`` nodes of the level above with the highest cumulative log
    probability through the head (one forward, at the same position, each node
    seeing the real entries, its ancestors and itself) and takes the top
    ``topk`` children of each. The draft is the ``max_nodes`` nodes of highest
    cumulative log probability, parents before children. The speculative
    entries are rolled back before returning.

    Returns ``(draft, depth of each node, head forwards made)``.
    """
    n_real = runner.length
    lp = root_logits.reshape(-1).float()
    if depth > 1:  # a deeper node's score adds its parent's: log probabilities then
        lp = torch.log_softmax(lp, -1)
    vals, idx = lp.topk(min(topk, lp.numel()))
    tree = _Tree()
    level = tree.add(runner.draft_ids[idx].tolist(), vals.tolist(), -1, 1)
    forwards = 0
    try:
        for d in range(1, depth):
            level = _expand(runner, tree, level, root_hidden, root_position + d, topk, n_real)
            forwards += 1
    finally:
        runner.truncate(n_real)
    draft = tree.best(max_nodes)
    levels: list[int] = []
    for p in draft.parents or []:
        levels.append(1 if p < 0 else levels[p] + 1)
    return draft, levels, forwards


class EagleProposer:
    """Drafts from the EAGLE-3 head; one instance per request stream (module docstring).

    ``depth``: the deepest draft; ``topk``: children per expanded node and nodes
    expanded per level (1 = a chain); ``max_nodes``: the most nodes; each step
    drafts ``min(depth, budget)`` deep and at most ``min(max_nodes, budget)`` nodes.
    ``window``: the most prompt positions the head reads (the last ones; its cost
    at the first step grows with them). ``history`` records, per drafted step, the
    draft's depth, its nodes and the accepted length (bonus not counted).
    """

    name = SOURCE

    def __init__(
        self,
        runtime: EagleRuntime,
        depth: int = 6,
        topk: int = 1,
        max_nodes: int = 16,
        window: int = 256,
    ) -> None:
        if depth < 1 or topk < 1 or max_nodes < 1:
            raise ValueError("depth, topk and max_nodes must be at least 1")
        self.head = runtime.runner
        # where the policy's figures for its drafts start (Proposer.prior_acceptance)
        self.prior_acceptance = runtime.acceptance
        self.taps = tuple(self.head.cfg.taps)
        self.depth = depth
        self.topk = topk
        self.max_nodes = max_nodes
        self.window = window
        self._base = 0  # positions before the head's first cached entry (the window's start)
        self.history: list[tuple[int, int, int]] = []
        self._pending: list[torch.Tensor] = []  # target taps awaiting their next token
        self._root: tuple[torch.Tensor, torch.Tensor] | None = None
        self._broken = False

    @classmethod
    def load(
        cls, target: TargetModel | None, path: str | Path | None = None, **kw: Any
    ) -> EagleProposer:
        """A proposer over the head beside ``target``'s model (or in ``path``)."""
        return cls(load_runtime(target, path), **kw)

    # -- the Proposer protocol --------------------------------------------------------

    def begin(self, request: RequestInfo) -> None:
        self.head.reset()
        self._base = 0
        self._pending = []
        self._root = None
        self._broken = False
        self.history = []

    def prefilled(self, hidden: torch.Tensor) -> None:
        """The taps of every prompt position, ``(P, 3, h)``; the last ``window`` are used."""
        self.head.reset()
        self._base = max(0, int(hidden.shape[0]) - self.window)
        self._pending = [hidden[self._base :].clone()]
        self._root = None
        self._broken = False

    def sync(self, context: Sequence[int]) -> bool:
        """Flush pending taps into the head cache, pairing each with its next context token.

        ``context`` ends with the root (sampled, not yet fed to the target), so the
        taps of positions ``0 .. len(context) - 2`` exist. False when the head's
        bookkeeping and the context disagree (then this request gets no drafts).
        """
        if self._broken:
            return False
        pending = sum(int(p.shape[0]) for p in self._pending)
        start = self._base + self.head.length  # the position of the first pending row
        if start + pending != len(context) - 1:
            self._broken = True
            return False
        if pending:
            taps = torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0]
            fused = self.head.fuse(taps)  # one fc over every pending row
            ids = list(context[start + 1 : start + 1 + pending])
            pos = torch.arange(start + 1, start + 1 + pending, device=self.head.device)
            out, logits = self.head.forward(ids, fused, pos, last_only=True)
            self._root = (out[-1], logits)
            self._pending = []
        return self._root is not None

    def catch_up(self, context: Sequence[int]) -> None:
        """Flush the queued taps into the head cache now (see :meth:`sync`): the policy
        times this apart from drafting."""
        self.sync(context)

    def propose(self, context: Sequence[int], budget: int) -> Draft | None:
        if budget < 1 or not self.sync(context):
            return None
        assert self._root is not None
        draft, _, _ = grow_draft(
            self.head,
            self._root[0],
            self._root[1],
            self._base + self.head.length,  # the last real entry's position
            min(self.depth, budget),
            self.topk,
            min(self.max_nodes, budget),
        )
        return draft if len(draft) else None

    def follow(self, result: StepResult) -> None:
        """A step whose draft another proposer made: queue the kept tokens' hidden states
        so the head stays in step."""
        if result.hidden is None:
            self._broken = True
            return
        kept = [0] + [a + 1 for a in result.accepted]
        self._pending.append(result.hidden[kept])

    def observe(self, result: StepResult) -> None:
        if result.draft is not None and len(result.draft) > 0:
            self.history.append((result.draft.depth, len(result.draft), result.accepted_len))
        self.follow(result)
