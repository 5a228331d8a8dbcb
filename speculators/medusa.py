"""Medusa proposer: k extra heads on the target's last hidden state draft a small tree.

Owns: :class:`MedusaConfig` / :class:`MedusaHeads` (the heads' shape, weights,
training forward and files), :func:`build_tree` (the sparse tree from each
head's top-k, a pure function), :class:`MedusaProposer` (the Proposer protocol
with ``taps`` and ``prefilled``, adaptive depth and size, back-off), finding the
heads beside a model (:func:`load_runtime`, cached per engine) and :func:`make`
(the registry's factory).

Must not touch: the target model or its cache, verification, the engine's loop,
the EAGLE head. Training lives in ``daemon/train_medusa.py``.

Heads (Medusa-1): the input is the target's hidden state after its last decoder
layer (tap ``L``: before the final norm, see ``Runner.forward``), normalised by
the heads' own RMSNorm (initialised from the target's final norm). Head ``i``
(``i = 1..k``) is a residual SiLU block ``z = x + silu(W_i x + b_i)`` (``W_i``
starts at zero) and a projection ``lm_i`` to a reduced draft vocabulary (the
most frequent tokens of the training code, ``train_eagle.draft_vocabulary``;
draft id ``j`` is target id ``j + d2t[j]``, as in ``eagle_head``), started from
the target's LM head rows. Per head ``h * h + h + h * V_draft`` weights.

Offsets. The verify forward's row of the last *kept* token (the root when no
draft token was accepted, else the last accepted node) holds the hidden state
of the last token fed to the target at position ``p``; its logits gave the
bonus token, position ``p + 1``, which becomes the next step's root (sampled,
not yet fed). Head ``i`` reads that hidden state and predicts position
``p + 1 + i``: the draft node at depth ``i`` below the root. After the prefill
the same holds with the last prompt position (``prefilled``). The bonus token
itself is never an input (Medusa-1): siblings from each head's top-k make up
for it.

Tree: every depth-``d`` node's children are the top-``topk`` tokens of head
``d + 1`` (the heads do not see the path, so every node at one depth has the
same candidates); a node's score is the sum of its path's log probabilities,
and the draft is the ``n`` best nodes (a child never outscores its parent, so
they form a tree; Medusa's sparse trees, EAGLE-2's selection), deterministic
(``probs`` None).

Adaptivity, per step: the tree's nodes come out of :func:`build_tree` best
first, and the first ``n`` always form a tree. Were the heads calibrated, the
expected accepted length of the first ``n`` would be ``sum_{i<n} exp(score_i)``
(node i is on the accepted path with its path probability); a measured
calibration factor ``c = (accepted + 1) / (predicted + 1)`` (decayed sums over
drafted steps) corrects it. ``StepCost`` (from ``eagle.py``) gives the engine's
measured time for a step with ``n`` draft tokens. Each step drafts the ``n``
with the most expected tokens per unit of time,
``(1 + c * sum_{i<n} exp(score_i)) / (t_step(n) + t_heads)``; when even that is
below a plain step's ``1 / t_step(0)`` the proposer backs off (1, 2, 4 .. 32
plain steps, the heads idle, each run ended by one probing draft; the run length
carries over to the next request).
``AcceptanceStats`` (from ``eagle.py``) keeps per-depth acceptance for reports.
Accepted counts never include the bonus token.
"""

from __future__ import annotations

import heapq
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from codespec.speculators.draft import (
    Draft,
    MissingWeights,
    RequestInfo,
    RuntimeCache,
    StepResult,
)
from codespec.speculators.eagle import AcceptanceStats, StepCost
from codespec.speculators.eagle_head import DraftVocab

__all__ = [
    "MedusaConfig",
    "MedusaHeads",
    "MedusaProposer",
    "MedusaRuntime",
    "NoMedusaHeads",
    "NoMedusaWeights",
    "build_tree",
    "heads_dir",
    "load_heads",
    "load_runtime",
    "make",
    "save_heads",
]

SOURCE = "medusa"
MODEL_TYPE = "codespec-medusa"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
MAX_BACKOFF = 32  # the most plain steps in a row before probing with a draft again


class NoMedusaHeads(LookupError):
    """The model has no Medusa heads beside it (or they do not fit the model)."""


class NoMedusaWeights(NoMedusaHeads, MissingWeights):
    """Nothing at ``MODEL/medusa``: no heads were trained for this model."""


def heads_dir(model_path: str | Path) -> Path:
    """Where a model's heads live: ``MODEL/medusa`` (config.json + model.safetensors)."""
    return Path(model_path) / "medusa"


# -- the heads -------------------------------------------------------------------------


@dataclass
class MedusaConfig:
    """The heads' shape and what they read from the target."""

    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_heads: int
    tap: int  # the target layer whose output the heads read (= the target's layer count)
    rms_norm_eps: float = 1e-5
    verifier_name_or_path: str | None = None

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ValueError("Medusa needs at least one head")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft vocabulary {self.draft_vocab_size} of {self.vocab_size}")

    def to_json(self) -> dict[str, Any]:
        return {"model_type": MODEL_TYPE, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MedusaConfig:
        if data.get("model_type") != MODEL_TYPE:
            raise ValueError(f"not codespec Medusa heads (model_type {data.get('model_type')!r})")
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**fields)


class MedusaHeads(DraftVocab):
    """The trainable heads. State-dict names: ``norm.weight``, ``blocks.{i}.{weight,bias}``,
    ``lm_heads`` ``(k, V_draft, h)``, ``d2t`` (int64) and ``t2d`` (bool)."""

    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, k = cfg.hidden_size, cfg.num_heads
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.blocks = nn.ModuleList([nn.Linear(h, h) for _ in range(k)])
        for b in self.blocks:  # each head starts as "x": the LM head's own guess
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)
        self.lm_heads = nn.Parameter(torch.randn(k, cfg.draft_vocab_size, h) * h**-0.5)
        self.init_draft_vocab()

    def init_from_target(self, norm: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Start the norm from the target's final norm and every ``lm_i`` from its LM head."""
        with torch.no_grad():
            self.norm.weight.copy_(norm.detach().float())
            rows = lm_head.detach().float()[self.draft_to_target()]  # (V_draft, h)
            self.lm_heads.copy_(rows.expand_as(self.lm_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., h)`` last-layer states → draft logits ``(..., k, V_draft)``."""
        x = self.norm(hidden)
        z = torch.stack([x + F.silu(b(x)) for b in self.blocks], dim=-2)  # (..., k, h)
        return torch.einsum("...kh,kvh->...kv", z, self.lm_heads)


def save_heads(heads: MedusaHeads, out: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (float tensors in ``dtype``)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in heads.state_dict().items():
        t = t.detach().cpu()
        state[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    (out / CONFIG).write_text(json.dumps(heads.cfg.to_json(), indent=2) + "\n")
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    return out


def load_heads(path: str | Path) -> MedusaHeads:
    """Heads from a folder written by :func:`save_heads` (fp32 in memory)."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        cfg = MedusaConfig.from_json(json.loads((path / CONFIG).read_text()))
    except (OSError, json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"cannot read {path / CONFIG}: {exc}") from None
    if not (path / WEIGHTS).exists():
        raise ValueError(f"no {WEIGHTS} in {path}")
    heads = MedusaHeads(cfg)
    raw = load_file(str(path / WEIGHTS))
    own = heads.state_dict()
    missing, extra = sorted(set(own) - set(raw)), sorted(set(raw) - set(own))
    if missing or extra:
        raise ValueError(f"weights do not match the config: missing {missing}, extra {extra}")
    bad = [k for k in own if tuple(raw[k].shape) != tuple(own[k].shape)]
    if bad:
        raise ValueError(f"weights of the wrong shape: {bad}")
    heads.load_state_dict({k: v.to(own[k].dtype) for k, v in raw.items()})
    return heads.eval()


class HeadsRunner:
    """The heads at inference: weights transposed for ``x @ W``, one call for all heads."""

    def __init__(self, heads: MedusaHeads, dtype: torch.dtype = torch.float32) -> None:
        cfg = heads.cfg
        self.cfg = cfg
        self.eps = cfg.rms_norm_eps
        self.norm = heads.norm.weight.detach().to(dtype).clone()
        self.w_blocks = torch.stack([b.weight.detach().t() for b in heads.blocks]).to(dtype)
        self.b_blocks = torch.stack([b.bias.detach() for b in heads.blocks]).to(dtype)  # (k, h)
        self.w_lm = heads.lm_heads.detach().transpose(1, 2).to(dtype).contiguous()  # (k, h, V)
        self.draft_ids = heads.draft_to_target()  # (V_draft,)
        self.dtype = dtype

    @property
    def param_bytes(self) -> int:
        ws = [self.norm, self.w_blocks, self.b_blocks, self.w_lm]
        return sum(w.numel() * w.element_size() for w in ws)

    @torch.inference_mode()
    def log_probs(self, hidden: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """One hidden state ``(h,)`` → log probabilities ``(depth, V_draft)`` of heads 1..depth."""
        k = self.cfg.num_heads if depth is None else min(depth, self.cfg.num_heads)
        h = self.cfg.hidden_size
        x = F.rms_norm(hidden.reshape(1, h).to(self.dtype), (h,), self.norm, self.eps)
        z = torch.baddbmm(self.b_blocks[:k, None], x.expand(k, 1, h), self.w_blocks[:k])
        z = x + F.silu(z)  # (k, 1, h)
        logits = torch.bmm(z, self.w_lm[:k])[:, 0]  # (k, V_draft)
        return torch.log_softmax(logits.float(), dim=-1)


# -- the tree --------------------------------------------------------------------------


def build_tree(
    log_probs: torch.Tensor, draft_ids: torch.Tensor, topk: int, max_nodes: int
) -> tuple[Draft, list[int], list[float]]:
    """The ``max_nodes`` best nodes of the tree whose depth-``d`` nodes each have the top
    ``topk`` tokens of head ``d + 1`` as children, scored by path log probability.

    ``log_probs`` ``(depth, V_draft)``: head ``i + 1``'s log probabilities over draft
    ids; ``draft_ids`` maps them to target ids. Returns ``(draft, depth of each node,
    score of each node)``, parents before children, ties broken by creation order.

    >>> lp = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1]]))
    >>> d, depths, _ = build_tree(lp, torch.tensor([10, 11, 12]), topk=2, max_nodes=3)
    >>> d.tokens, d.parents, depths
    ([10, 11, 11], [-1, -1, 0], [1, 1, 2])
    """
    depth = int(log_probs.shape[0])
    if depth == 0 or max_nodes < 1:
        return Draft([], []), [], []
    vals, idx = log_probs.topk(min(topk, int(log_probs.shape[-1])), dim=-1)  # (depth, k)
    vals_l, toks_l = vals.tolist(), draft_ids[idx].tolist()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    counter = 0
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, order, parent, level, choice)
    for c in range(len(vals_l[0])):
        heap.append((-vals_l[0][c], counter, -1, 0, c))
        counter += 1
    heapq.heapify(heap)
    while heap and len(tokens) < max_nodes:
        neg, _, parent, level, c = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(toks_l[level][c])
        parents.append(parent)
        depths.append(level + 1)
        scores.append(-neg)
        if level + 1 < depth:
            for cc in range(len(vals_l[level + 1])):
                heapq.heappush(heap, (neg - vals_l[level + 1][cc], counter, node, level + 1, cc))
                counter += 1
    return Draft(tokens, parents, sources=[SOURCE] * len(tokens)), depths, scores


# -- runtime and proposer --------------------------------------------------------------


@dataclass
class MedusaRuntime:
    """What outlives one request: the heads and the measurements."""

    runner: HeadsRunner
    path: Path
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    step: StepCost = field(default_factory=StepCost)  # the engine's part of a step, by size
    own_ms: float = 0.0  # EMA of the proposer's time in a drafting step (heads + tree)
    accepted_sum: float = 0.0  # decayed accepted draft tokens (bonus not counted) ...
    predicted_sum: float = 0.0  # ... and the heads' own expectation for the same steps
    backoff: int = 1  # the next back-off run's length, carried from request to request

    def calibration(self) -> float:
        """Measured accepted tokens per token the heads' probabilities expected."""
        return (self.accepted_sum + 1.0) / (self.predicted_sum + 1.0)

    def note_accepted(self, accepted: int, predicted: float, decay: float = 0.97) -> None:
        self.accepted_sum = decay * self.accepted_sum + accepted
        self.predicted_sum = decay * self.predicted_sum + predicted

    def note_own(self, ms: float) -> None:
        self.own_ms = ms if not self.own_ms else 0.9 * self.own_ms + 0.1 * ms


_RUNTIMES: RuntimeCache[MedusaRuntime] = RuntimeCache()


def load_runtime(engine: Any, path: str | Path | None = None) -> MedusaRuntime:
    """The heads for ``engine``'s model (``MODEL/medusa`` unless ``path``), loaded once per
    engine."""
    if engine is None:
        raise NoMedusaHeads("the medusa proposer needs an engine (its model's hidden states)")
    where = Path(path) if path is not None else heads_dir(engine.model_path)
    return _RUNTIMES.get(engine, where, lambda: _load_runtime(engine, where))


def _load_runtime(engine: Any, where: Path) -> MedusaRuntime:
    """Check the heads in ``where`` against the engine's model and load them."""
    if not (where / CONFIG).exists():
        raise NoMedusaWeights(
            "medusa",
            where,
            f"train them with `codespec train-medusa --model {engine.model_path} --out {where}`",
        )
    try:
        heads = load_heads(where)
    except ValueError as exc:
        raise NoMedusaHeads(f"cannot load the Medusa heads in {where}: {exc}") from None
    runner, cfg = engine.runner, heads.cfg
    if cfg.vocab_size != runner.vocab_size or cfg.hidden_size != runner.hidden_size:
        raise NoMedusaHeads(
            f"the Medusa heads in {where} were made for a model with vocab {cfg.vocab_size} "
            f"and hidden size {cfg.hidden_size}, not {runner.vocab_size} / {runner.hidden_size}"
        )
    if cfg.tap != runner.num_layers:
        raise NoMedusaHeads(
            f"the Medusa heads in {where} read layer {cfg.tap} of a {runner.num_layers}-layer "
            f"model (they need its last layer)"
        )
    rt = MedusaRuntime(HeadsRunner(heads), where)
    rt.acceptance = AcceptanceStats(max_depth=cfg.num_heads)
    return rt


class MedusaProposer:
    """Drafts a tree from the Medusa heads; one instance per request stream.

    ``depth``: the most heads used (the deepest draft); ``topk``: candidates per head;
    ``max_nodes``: the most nodes; ``adaptive``: choose the number of nodes per step
    from the heads' probabilities, the measured calibration and costs, and back off
    when drafting does not pay (otherwise always the ``max_nodes`` best nodes).
    """

    name = SOURCE

    def __init__(
        self,
        runtime: MedusaRuntime,
        depth: int | None = None,
        topk: int = 4,
        max_nodes: int = 12,
        adaptive: bool = True,
    ) -> None:
        k = runtime.runner.cfg.num_heads
        depth = k if depth is None else depth
        if depth < 1 or topk < 1 or max_nodes < 1:
            raise ValueError("depth, topk and max_nodes must be at least 1")
        self.rt = runtime
        self.heads = runtime.runner
        self.taps = (runtime.runner.cfg.tap,)
        self.depth = min(depth, k)
        self.topk = topk
        self.max_nodes = max_nodes
        self.adaptive = adaptive
        # per drafted step: (draft depth, draft nodes, accepted length; bonus not counted)
        self.history: list[tuple[int, int, int]] = []
        self._hidden: torch.Tensor | None = None  # the last fed token's state, (h,)
        self._expect = -1  # the context length the next propose must see
        self._last_depth = self._last_nodes = 0
        self._predicted = 0.0  # the heads' expected accepted length of the last draft
        self._returned_at = 0.0
        self._propose_ms = self._observe_ms = 0.0
        self._skip, self._backoff, self._probe = 0, 1, False

    @classmethod
    def for_engine(cls, engine: Any, path: str | Path | None = None, **kw: Any) -> MedusaProposer:
        return cls(load_runtime(engine, path), **kw)

    # -- the Proposer protocol --------------------------------------------------------

    def begin(self, request: RequestInfo) -> None:
        self._hidden = None
        self._expect = -1
        self._last_depth = self._last_nodes = 0
        self._returned_at = 0.0
        # a new request starts where the last left off: when drafting did not pay there,
        # the first plain run is already long
        self._skip, self._backoff, self._probe = 0, self.rt.backoff, False
        self.history = []

    def prefilled(self, hidden: torch.Tensor) -> None:
        """Taps of every prompt position ``(P, 1, h)``: the last gave the first sampled token."""
        self._hidden = hidden[-1, 0].clone()
        self._expect = int(hidden.shape[0]) + 1  # the prompt and the root

    def propose(self, context: Sequence[int], budget: int) -> Draft | None:
        t_in = time.perf_counter()
        if self._returned_at:  # the engine's part of the last step: from there to here
            engine_ms = (t_in - self._returned_at) * 1000 - self._observe_ms
            self.rt.step.add(self._last_nodes, engine_ms)
            self._returned_at = 0.0
        self._last_depth = self._last_nodes = 0
        if budget < 1 or self._hidden is None or len(context) != self._expect:
            return None  # no state for this context (no taps, or bookkeeping lost)
        if self.adaptive and self._skip > 0:  # backing off: a plain step, the heads idle
            self._skip -= 1
            self._returned_at = time.perf_counter()
            return None
        lp = self.heads.log_probs(self._hidden, min(self.depth, budget))
        draft, depths, scores = build_tree(
            lp, self.heads.draft_ids, self.topk, min(self.max_nodes, budget)
        )
        n = len(draft)
        if self.adaptive:
            n, value = self.best_size(scores)
            if not self._probe and value < 1.0 / self.rt.step.at(0):
                # drafting does not pay now: plain steps, twice as many each time in a row,
                # then one probing draft to refresh the calibration
                self._skip = self._backoff - 1
                self._backoff = min(2 * self._backoff, MAX_BACKOFF)
                self.rt.backoff = self._backoff
                self._probe = True
                self._returned_at = time.perf_counter()
                return None
            if not self._probe:
                self._backoff = self.rt.backoff = 1
            self._probe = False
            draft = draft.truncated(n)
        now = time.perf_counter()
        self._predicted = sum(math.exp(x) for x in scores[:n])
        self._last_depth, self._last_nodes = max(depths[:n], default=0), n
        self._propose_ms = (now - t_in) * 1000
        self._returned_at = now
        return draft if n else None

    def best_size(self, scores: Sequence[float]) -> tuple[int, float]:
        """The number of best-first nodes with the most expected tokens per ms, and that
        rate: ``(1 + c * sum_{i<n} exp(score_i)) / (t_step(n) + t_heads)``; at least 1."""
        step, c = self.rt.step, self.rt.calibration()
        own = self.rt.own_ms or 0.1 * step.at(1)
        best, best_value, expected = 1, 0.0, 1.0
        for i, score in enumerate(scores):
            expected += c * math.exp(score)
            value = expected / (step.at(i + 1) + own)
            if value > best_value:
                best, best_value = i + 1, value
        return best, best_value

    def observe(self, result: StepResult) -> None:
        t_in = time.perf_counter()
        drafted = result.draft is not None and len(result.draft) > 0
        if drafted:
            self.history.append((self._last_depth, len(result.draft), result.accepted_len))
            self.rt.acceptance.update(self._last_depth, result.accepted_len)
            self.rt.note_accepted(result.accepted_len, self._predicted)
            self.rt.note_own(self._propose_ms)
        self._advance(result)
        self._observe_ms = (time.perf_counter() - t_in) * 1000

    def follow(self, result: StepResult) -> None:
        """A step whose draft another proposer made (a policy's choice): keep the last fed
        token's state, leaving the statistics and timings alone."""
        self._returned_at = 0.0
        self._last_nodes = 0
        self._advance(result)

    def _advance(self, result: StepResult) -> None:
        """The state of the last token fed and kept: the root (row 0) when nothing was
        accepted, else the last accepted node; its logits gave the bonus."""
        if result.hidden is None:
            self._hidden = None
            return
        row = result.accepted[-1] + 1 if result.accepted else 0
        self._hidden = result.hidden[row, 0].clone()
        self._expect += 1 + result.accepted_len


def make(engine: Any, index: Any = None) -> MedusaProposer:
    """The registry's factory: the heads at ``MODEL/medusa``, loaded once per engine."""
    return MedusaProposer.for_engine(engine)
