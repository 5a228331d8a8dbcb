"""EAGLE proposer: drafts from the EAGLE-3 head fed the target's own hidden states.

Owns: :class:`EagleProposer` (the Proposer protocol with ``taps`` and
``prefilled``), the head's cache bookkeeping per request, the draft-tree
growth (:func:`grow_draft`, EAGLE-2's dynamic tree; a chain when ``topk`` is
1), the adaptive draft depth, and finding the head shipped beside a model
(:func:`load_runtime`, cached per engine).

Must not touch: the target model or its cache, verification, the engine's
loop. The head itself (weights, forward, files) is ``eagle_head.py``.

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
- ``observe(result)`` appends the taps of the kept rows (root + accepted
  nodes) of the verify forward as pending: the target's real states, never
  the head's guesses, so after every step the cache equals the cache built
  from scratch over the accepted tokens.

The head reads at most the last ``window`` prompt positions (its first-step
cost grows with them); positions keep their absolute values.

Depth: the expected tokens per unit of time of a draft of depth ``d`` is
``(1 + sum_{i<=d} prod_{j<=i} a_j) / (t_step(n_d) + t_own + (d - 1) * t_head)``
where ``a_j`` is the measured chance that depth j is accepted given depth j - 1
was, ``n_d`` the draft's size at depth d, ``t_step(n)`` the measured time the
engine spends on a step with n draft tokens (from ``propose`` returning to the
next ``propose``, less ``observe``: the verify forward, verification, stop rules,
detokenization; a line fitted to the steps seen), ``t_head`` the measured time
of one head forward growing the draft and ``t_own`` the proposer's other
measured time per drafting step (the flush, ``fc``, bookkeeping); each step
drafts the best ``d``. When even the best draft yields fewer tokens per unit of
time than a plain step (``1 / t_step(0)``), the proposer backs off: plain
steps (the head idle, its pending rows batched for later), 1, 2, 4 .. 32 in a
row, each run ended by one probing draft. Accepted counts never include the
bonus token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from codespec.speculators.draft import (
    Draft,
    MissingWeights,
    RequestInfo,
    RuntimeCache,
    StepResult,
)
from codespec.speculators.eagle_head import HeadRunner, load_head

__all__ = [
    "AcceptanceStats",
    "EagleProposer",
    "EagleRuntime",
    "NoEagleHead",
    "NoEagleWeights",
    "StepCost",
    "grow_draft",
    "head_dir",
    "load_runtime",
]

SOURCE = "eagle"
MAX_BACKOFF = 32  # the most plain steps in a row before probing with a draft again


class NoEagleHead(LookupError):
    """The model has no EAGLE head beside it (or the head does not fit the model)."""


class NoEagleWeights(NoEagleHead, MissingWeights):
    """Nothing at ``MODEL/eagle``: no head was trained for this model."""


def head_dir(model_path: str | Path) -> Path:
    """Where a model's head lives: ``MODEL/eagle`` (config.json + model.safetensors)."""
    return Path(model_path) / "eagle"


def target_embedding(runner: Any) -> torch.Tensor:
    """The target's token embedding ``(V, h)`` from a lean or a Hugging Face runner."""
    embed = getattr(runner, "embed", None)
    if isinstance(embed, torch.Tensor):
        return embed
    model = getattr(runner, "model", None)
    if model is not None:
        return model.get_input_embeddings().weight
    raise NoEagleHead(f"cannot reach the token embedding of a {type(runner).__name__}")


@dataclass
class AcceptanceStats:
    """Per-depth acceptance, decayed so that it follows the code being written.

    ``reach[i]``: steps whose draft had depth ``> i`` and whose first ``i`` levels
    were accepted; ``hit[i]``: of those, steps that accepted depth ``i + 1`` too.
    ``rate(i) = (hit[i] + prior * a0) / (reach[i] + prior)``.
    """

    max_depth: int = 8
    decay: float = 0.98
    prior: float = 2.0
    a0: float = 0.6
    reach: list[float] = field(default_factory=list)
    hit: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reach = self.reach or [0.0] * self.max_depth
        self.hit = self.hit or [0.0] * self.max_depth

    def update(self, depth: int, accepted: int) -> None:
        for i in range(self.max_depth):
            self.reach[i] *= self.decay
            self.hit[i] *= self.decay
        for i in range(min(depth, self.max_depth)):
            if accepted < i:
                break
            self.reach[i] += 1.0
            self.hit[i] += float(accepted > i)

    def rate(self, i: int) -> float:
        return (self.hit[i] + self.prior * self.a0) / (self.reach[i] + self.prior)

    def best_depth(self, limit: int, cost: Callable[[int], float]) -> tuple[int, float]:
        """The depth in ``1..limit`` with the most expected tokens per unit of time, and
        that rate. ``cost(d)`` is the expected time of a step that drafts to depth ``d``;
        the bonus token is part of every step's tokens.
        """
        best, best_value = 1, 0.0
        tokens, chance = 1.0, 1.0
        for d in range(1, min(limit, self.max_depth) + 1):
            chance *= self.rate(d - 1)
            tokens += chance
            value = tokens / cost(d)
            if value > best_value:
                best, best_value = d, value
        return best, best_value


@dataclass
class StepCost:
    """Time of the rest of a decode step (target verify + verification) against draft size.

    A line ``t(n) = a + b * n`` fitted by decayed least squares over observed
    ``(n, ms)``; until the sizes seen vary, the slope is ``prior_slope`` of the mean.
    """

    decay: float = 0.95
    prior_slope: float = 0.05
    w: float = 0.0
    s_n: float = 0.0
    s_nn: float = 0.0
    s_t: float = 0.0
    s_nt: float = 0.0

    def add(self, n: int, ms: float) -> None:
        k = self.decay
        self.w, self.s_n, self.s_nn = k * self.w + 1, k * self.s_n + n, k * self.s_nn + n * n
        self.s_t, self.s_nt = k * self.s_t + ms, k * self.s_nt + n * ms

    def at(self, n: float) -> float:
        if not self.w:
            return 1.0
        mean_n, mean_t = self.s_n / self.w, self.s_t / self.w
        var = self.s_nn / self.w - mean_n * mean_n
        if var > 0.5:
            slope = (self.s_nt / self.w - mean_n * mean_t) / var
        else:
            slope = self.prior_slope * mean_t
        return max(mean_t + max(slope, 0.0) * (n - mean_n), 0.05 * mean_t, 1e-3)


@dataclass
class EagleRuntime:
    """What outlives one request: the head runner (and its cache buffer) and measurements."""

    runner: HeadRunner
    path: Path
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    step: StepCost = field(default_factory=StepCost)  # the engine's part of a step, by size
    head_ms: float = 0.0  # EMA of one head forward while growing a draft
    own_ms: float = 0.0  # EMA of the proposer's other time in a drafting step (flush, fuse, ...)

    def note_head(self, ms: float, forwards: int) -> None:
        per = ms / max(1, forwards)
        self.head_ms = per if not self.head_ms else 0.9 * self.head_ms + 0.1 * per

    def note_own(self, ms: float) -> None:
        self.own_ms = ms if not self.own_ms else 0.9 * self.own_ms + 0.1 * ms


_RUNTIMES: RuntimeCache[EagleRuntime] = RuntimeCache()


def load_runtime(engine: Any, path: str | Path | None = None) -> EagleRuntime:
    """The head for ``engine``'s model (``MODEL/eagle`` unless ``path``), loaded once per engine."""
    if engine is None:
        raise NoEagleHead("the eagle proposer needs an engine (its model's hidden states)")
    where = Path(path) if path is not None else head_dir(engine.model_path)
    return _RUNTIMES.get(engine, where, lambda: _load_runtime(engine, where))


def _load_runtime(engine: Any, where: Path) -> EagleRuntime:
    """Check the head in ``where`` against the engine's model and load it."""
    if not (where / "config.json").exists():
        raise NoEagleWeights(
            "eagle",
            where,
            f"train them with `codespec train-eagle --model {engine.model_path} --out {where}`",
        )
    runner = engine.runner
    try:
        head = load_head(where, target_embedding(runner).float().cpu())
    except ValueError as exc:
        raise NoEagleHead(f"cannot load the EAGLE head in {where}: {exc}") from None
    cfg = head.cfg
    if cfg.vocab_size != runner.vocab_size or cfg.hidden_size != runner.hidden_size:
        raise NoEagleHead(
            f"the EAGLE head in {where} was made for a model with vocab {cfg.vocab_size} and "
            f"hidden size {cfg.hidden_size}, not {runner.vocab_size} / {runner.hidden_size}"
        )
    if max(cfg.taps) > runner.num_layers:
        raise NoEagleHead(
            f"the head reads tap {max(cfg.taps)} of a {runner.num_layers}-layer model"
        )
    dtype = getattr(runner, "dtype", torch.float32)
    hr = HeadRunner(head, target_embedding(runner), runner.max_length + 64, runner.device, dtype)
    rt = EagleRuntime(hr, where)
    return rt


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
    cumulative log probability (a child never scores above its parent, so
    they form a tree), parents before children. The speculative entries are
    rolled back before returning.

    Returns ``(draft, depth of each node, head forwards made)``.
    """
    n_real = runner.length
    ids_map = runner.draft_ids
    lp = torch.log_softmax(root_logits.reshape(-1).float(), -1)
    vals, idx = lp.topk(min(topk, lp.numel()))
    tokens: list[int] = ids_map[idx].tolist()
    score: list[float] = vals.tolist()
    parent: list[int] = [-1] * len(tokens)
    level_of: list[int] = [1] * len(tokens)
    slot: dict[int, int] = {}  # node -> its speculative entry in the head cache
    out_of: dict[int, torch.Tensor] = {}  # node -> the head's pre-norm output at its entry
    level = list(range(len(tokens)))
    forwards = 0
    try:
        for d in range(1, depth):
            frontier = sorted(level, key=lambda i: (-score[i], i))[:topk]
            rows = len(frontier)
            hid = torch.stack(
                [root_hidden if parent[i] < 0 else out_of[parent[i]] for i in frontier]
            )
            allowed = None
            if topk > 1:
                past = runner.length
                allowed = torch.zeros((rows, past + rows), dtype=torch.bool)
                allowed[:, :n_real] = True
                for r, i in enumerate(frontier):
                    allowed[r, past + r] = True
                    p = parent[i]
                    while p >= 0:
                        allowed[r, slot[p]] = True
                        p = parent[p]
            positions = torch.full((rows,), root_position + d, device=runner.device)
            out, logits = runner.forward([tokens[i] for i in frontier], hid, positions, allowed)
            forwards += 1
            base = runner.length - rows
            lps = torch.log_softmax(logits, -1)
            cv, ci = lps.topk(min(topk, lps.shape[-1]), dim=-1)  # (rows, k)
            child_tokens = ids_map[ci].tolist()
            cv_list = cv.tolist()
            level = []
            for r, i in enumerate(frontier):
                slot[i] = base + r
                out_of[i] = out[r]
                for c in range(len(child_tokens[r])):
                    tokens.append(child_tokens[r][c])
                    score.append(score[i] + cv_list[r][c])
                    parent.append(i)
                    level_of.append(d + 1)
                    level.append(len(tokens) - 1)
    finally:
        runner.truncate(n_real)
    chosen: set[int] = set()
    for i in sorted(range(len(tokens)), key=lambda i: (-score[i], i)):
        if len(chosen) >= max_nodes:
            break
        if parent[i] < 0 or parent[i] in chosen:
            chosen.add(i)
    keep = sorted(chosen)  # creation order: parents first
    new_index = {old: new for new, old in enumerate(keep)}
    draft = Draft(
        [tokens[i] for i in keep],
        [new_index[parent[i]] if parent[i] >= 0 else -1 for i in keep],
        sources=[SOURCE] * len(keep),
    )
    return draft, [level_of[i] for i in keep], forwards


class EagleProposer:
    """Drafts from the EAGLE-3 head; one instance per request stream (see the module docstring).

    ``depth``: the deepest draft; ``topk``: children per expanded node and nodes
    expanded per level (1 = a chain); ``max_nodes``: the most nodes verified;
    ``adaptive``: choose the depth per step from measured acceptance and costs
    (otherwise always ``depth``); ``window``: the most prompt positions the head
    reads (the last ones; its cost at the first step grows with them).
    """

    name = SOURCE

    def __init__(
        self,
        runtime: EagleRuntime,
        depth: int = 6,
        topk: int = 1,
        max_nodes: int = 16,
        adaptive: bool = True,
        window: int = 256,
    ) -> None:
        if depth < 1 or topk < 1 or max_nodes < 1:
            raise ValueError("depth, topk and max_nodes must be at least 1")
        self.rt = runtime
        self.head = runtime.runner
        self.taps = tuple(self.head.cfg.taps)
        self.depth = depth
        self.topk = topk
        self.max_nodes = max_nodes
        self.adaptive = adaptive
        self.window = window
        self._base = 0  # positions before the head's first cached entry (the window's start)
        # per drafted step: (draft depth, draft nodes, accepted length; bonus not counted)
        self.history: list[tuple[int, int, int]] = []
        self._pending: list[torch.Tensor] = []  # target taps awaiting their next token
        self._root: tuple[torch.Tensor, torch.Tensor] | None = None
        self._broken = False
        self._last_depth = self._last_nodes = self._forwards = 0
        self._returned_at = 0.0  # when propose last returned (timing the engine's part)
        self._flushed = 0  # rows the last sync() flushed
        self._propose_ms = self._observe_ms = 0.0
        self._skip = 0  # plain steps left while backing off
        self._backoff = 1
        self._probe = False

    @classmethod
    def for_engine(cls, engine: Any, path: str | Path | None = None, **kw: Any) -> EagleProposer:
        return cls(load_runtime(engine, path), **kw)

    # -- the Proposer protocol --------------------------------------------------------

    def begin(self, request: RequestInfo) -> None:
        self.head.reset()
        self._base = 0
        self._pending = []
        self._root = None
        self._broken = False
        self._last_depth = self._last_nodes = self._forwards = 0
        self._returned_at = 0.0
        self._skip, self._backoff, self._probe = 0, 1, False
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
        self._flushed = pending
        return self._root is not None

    def propose(self, context: Sequence[int], budget: int) -> Draft | None:
        t_in = time.perf_counter()
        if self._returned_at:  # the engine's part of the last step: from there to here
            engine_ms = (t_in - self._returned_at) * 1000 - self._observe_ms
            self.rt.step.add(self._last_nodes, engine_ms)
            self._returned_at = 0.0
        if budget < 1:
            return None
        self._last_depth = self._last_nodes = self._forwards = 0
        self._propose_ms = 0.0
        if self.adaptive and self._skip > 0:  # backing off: a plain step, the head idle
            self._skip -= 1
            self._returned_at = time.perf_counter()
            return None
        depth = min(self.depth, budget)
        nodes = min(self.max_nodes, budget)
        if self.adaptive:  # decided before the flush: a plain step leaves the head idle
            depth, rate = self.rt.acceptance.best_depth(depth, self._cost(nodes))
            if not self._probe and rate < 1.0 / self.rt.step.at(0):
                # drafting does not pay now: plain steps, twice as many each time in a row,
                # then one probing draft to refresh the acceptance statistics
                self._skip = self._backoff - 1
                self._backoff = min(2 * self._backoff, MAX_BACKOFF)
                self._probe = True
                self._returned_at = time.perf_counter()
                return None
            if not self._probe:
                self._backoff = 1
            self._probe = False
        if not self.sync(context):
            return None
        assert self._root is not None
        t0 = time.perf_counter()
        draft, levels, forwards = grow_draft(
            self.head,
            self._root[0],
            self._root[1],
            self._base + self.head.length,  # the last real entry's position
            depth,
            self.topk,
            nodes,
        )
        now = time.perf_counter()
        if forwards:
            self.rt.note_head((now - t0) * 1000, forwards)
        self._last_depth = max(levels, default=0)
        self._last_nodes, self._forwards = len(draft), forwards
        self._propose_ms = (now - t_in) * 1000
        self._returned_at = now
        return draft if len(draft) else None

    def _cost(self, max_nodes: int) -> Callable[[int], float]:
        """Expected ms of a step drafting to depth d: the engine's part for the draft's size,
        the proposer's own time and d - 1 head forwards growing the draft."""
        step = self.rt.step
        t_head = self.rt.head_ms or 0.25 * step.at(1)
        own = self.rt.own_ms or 0.25 * step.at(1)
        k = self.topk

        def cost(d: int) -> float:
            nodes = min(max_nodes, k + (d - 1) * k * k)
            return step.at(nodes) + own + (d - 1) * t_head

        return cost

    def follow(self, result: StepResult) -> None:
        """A step whose draft another proposer made (the policy's choice): queue the kept
        tokens' hidden states so the head stays in step, leaving the statistics alone."""
        self._returned_at = 0.0  # that step's time is not the engine's part of ours
        if result.hidden is None:
            self._broken = True
            return
        kept = [0] + [a + 1 for a in result.accepted]
        self._pending.append(result.hidden[kept])

    def observe(self, result: StepResult) -> None:
        t_in = time.perf_counter()
        drafted = result.draft is not None and len(result.draft) > 0
        if drafted:
            self.history.append((self._last_depth, len(result.draft), result.accepted_len))
            self.rt.acceptance.update(self._last_depth, result.accepted_len)
        if result.hidden is None:
            self._broken = True
            return
        kept = [0] + [a + 1 for a in result.accepted]
        self._pending.append(result.hidden[kept])
        self._observe_ms = (time.perf_counter() - t_in) * 1000
        if drafted and self._flushed <= MAX_BACKOFF + 1:  # not a prompt's flush
            own = self._propose_ms + self._observe_ms - self._forwards * self.rt.head_ms
            self.rt.note_own(max(own, 0.0))
