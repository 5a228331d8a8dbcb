"""Draft-model proposer: a small causal LM sharing the target's tokenizer drafts a chain.

Owns: :class:`DraftModelProposer` (the Proposer protocol of ``draft.py``),
finding and loading the draft model beside the target (``MODEL/draft``, or an
explicit folder) once per engine (:func:`load_runtime`), keeping the draft
model's KV cache in step with the accepted tokens, and the adaptive draft
length.

Must not touch: the target model or its cache, verification, the engine's
loop, the runners (the draft model is loaded with the engine's own
:func:`~codespec.daemon.engine.engine.load_runner`: the lean runner when it supports
the architecture, so its cache is static and rolls back by moving a length).

The draft model's cache. ``DraftRuntime.ids`` mirrors it token for token. One
step, with ``context`` = every token so far, the root (sampled, not yet fed
to the target) last:

- ``propose``: *sync* first. The cache keeps its longest prefix shared with
  ``context`` (at most ``len(context) - 1`` tokens, so at least the root is
  fed), the rest of ``context`` is fed in one forward and its last row gives
  the first draft token; each further draft token is one forward of the
  previous one. The last draft token is never fed: after drafting ``k`` tokens
  the cache holds ``context + d_1 .. d_{k-1}``.
- ``observe``: the cache is cut back to ``context + accepted`` (a partial
  accept drops ``d_{a+1} ..``), so between steps it only ever holds accepted
  tokens. The BONUS token is never in it yet.
- The next ``sync`` then feeds what is missing: after a partial accept the
  bonus token alone; after a FULL ACCEPT the last draft token ``d_k`` and the
  bonus (the catch-up: ``d_k`` was accepted but never fed to the draft model);
  after plain steps (backing off) every token generated meanwhile. Because
  ``sync`` matches against ``context`` itself, a skipped or unusual step can
  never leave the cache out of step; it only costs a longer feed. The cache
  also outlives the request, so a new request on the same document reuses its
  prefix, as the engine's own cache does.

The draft model reads at most the last ``window`` tokens of the context (its
prefill of a 1,024-token prompt would cost a sizeable part of a completion;
local context is what a small model uses anyway). The window's start is fixed
per request at its first sync, on a grid of ``window / 4`` tokens, so requests
on a growing document keep the same start for a while and reuse the cache.
Above, ``context`` means the context from that start; positions restart at 0.

Sampling: at temperature 0 the draft is the draft model's greedy chain, with
``probs`` None. At temperature ``T > 0`` each token is sampled from
``q = softmax(logits / T)`` and ``q`` is passed as ``Draft.probs``, so
rejection sampling (``verify.py``) keeps the target's distribution exactly.

Length: as ``eagle.py`` (whose :class:`AcceptanceStats` and :class:`StepCost`
are reused), each step drafts the depth ``d`` with the most expected tokens
per unit of time, ``(1 + sum_{i<=d} prod_{j<=i} a_j) / (t_step(d) + t_own +
(d - 1) * t_token)``: ``a_j`` the measured chance that depth j is accepted
given depth j - 1 was, ``t_step(n)`` the engine's measured time for a step
verifying n draft tokens, ``t_token`` the measured time of one draft-model
forward of one token (plus picking the token), ``t_own`` the proposer's other
measured time in a drafting step (the sync forward, bookkeeping). A plain
step costs ``t_plain``: measured on plain steps once there were some, before
that the engine's measured one-token forward (``engine.costs``) plus the
measured rest of a step; the line ``t_step`` is fitted to drafted steps only,
since on the CPU a forward of 2 tokens costs far more than one of 1 token
(an explicit mask) and a line through both would misjudge either. When even
the best depth yields fewer tokens per unit of time than a plain step, the
proposer backs off: 1, 2, 4 .. 32 plain steps in a row, each run ended by one
probing draft. Accepted counts never include the bonus token.
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
from codespec.speculators.eagle import AcceptanceStats, StepCost

__all__ = [
    "DraftModelProposer",
    "DraftRuntime",
    "NoDraftModel",
    "NoDraftWeights",
    "draft_dir",
    "load_runtime",
    "make",
]

SOURCE = "draft"
MAX_BACKOFF = 32  # the most plain steps in a row before probing with a draft again
STEADY_FEED = 2  # a sync feeding at most this many tokens is a steady-state step (timed)


class NoDraftModel(LookupError):
    """No usable draft model beside the target (missing, or its tokenizer differs)."""


def draft_dir(model_path: str | Path) -> Path:
    """Where a model's draft model lives: ``MODEL/draft`` (a Hugging Face causal LM folder)."""
    return Path(model_path) / "draft"


class NoDraftWeights(NoDraftModel, MissingWeights):
    """Nothing at ``MODEL/draft``: no draft model was made for this model."""


def train_hint(target: str | Path, where: Path) -> str:
    return (
        f"put a small Hugging Face causal LM trained with the tokenizer of {target} there "
        f"(config.json, model.safetensors and {target}'s tokenizer files); "
        "codespec has no trainer for draft models yet"
    )


@dataclass
class DraftRuntime:
    """What outlives one request: the draft model's runner, its cache mirror, measurements."""

    runner: Any  # a Runner (runner.py)
    path: Path
    vocab: int  # draft token ids are < vocab (the smaller of the two models' vocab sizes)
    target_vocab: int
    ids: list[int] = field(default_factory=list)  # mirrors the runner's cache, token for token
    base: int = 0  # the context position of the cache's first token (the window's start)
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    step: StepCost = field(default_factory=StepCost)  # the engine's part of a drafted step
    forward_costs: Any = None  # the engine's ForwardCosts (target forward ms by size), if any
    plain_ms: float = 0.0  # EMA of the engine's part of a plain step
    rest_ms: float = 0.0  # EMA of a drafted step's engine part beyond its target forward
    token_ms: float = 0.0  # EMA of one single-token draft forward + picking the token
    own_ms: float = 0.0  # EMA of the proposer's other time in a drafting step

    def note_token(self, ms: float, forwards: int) -> None:
        per = ms / max(1, forwards)
        self.token_ms = per if not self.token_ms else 0.9 * self.token_ms + 0.1 * per

    def note_own(self, ms: float) -> None:
        self.own_ms = ms if not self.own_ms else 0.9 * self.own_ms + 0.1 * ms

    def note_step(self, drafted: int, ms: float) -> None:
        """The engine's part of a step that verified ``drafted`` draft tokens (0: plain)."""
        if not drafted:
            self.plain_ms = ms if not self.plain_ms else 0.8 * self.plain_ms + 0.2 * ms
            return
        self.step.add(drafted, ms)
        if self._forward_known(1 + drafted):
            rest = max(ms - self.forward_costs.at(1 + drafted), 0.0)
            self.rest_ms = rest if not self.rest_ms else 0.9 * self.rest_ms + 0.1 * rest

    def plain_cost(self) -> float:
        """Expected ms of a plain step (see the module docstring)."""
        if self.plain_ms:
            return self.plain_ms
        if self.rest_ms and self._forward_known(1):
            return min(self.forward_costs.at(1) + self.rest_ms, self.step.at(0))
        return self.step.at(0)

    def _forward_known(self, n: int) -> bool:
        """Whether the engine has measured target forwards of exactly ``n`` tokens."""
        known = getattr(self.forward_costs, "known", None)
        return known is not None and any(size == n for size, _ in known())

    def feed(self, ids: list[int]) -> torch.Tensor:
        """Append ``ids`` to the draft cache; the draft model's logits after the last, ``(V,)``."""
        out = self.runner.forward(ids, last_only=True)
        self.ids.extend(ids)
        return out.logits[-1]

    def cut(self, n: int) -> None:
        """Keep the first ``n`` cached tokens."""
        if n < len(self.ids):
            self.runner.truncate(n)
            del self.ids[n:]


_RUNTIMES: RuntimeCache[DraftRuntime] = RuntimeCache()


def _read_vocab(path: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True).get_vocab()


def load_runtime(engine: Any, path: str | Path | None = None) -> DraftRuntime:
    """The draft model for ``engine``'s model (``MODEL/draft`` unless ``path``), loaded once
    per engine with the engine's runner machinery on its device and dtype."""
    if engine is None:
        raise NoDraftModel("the draft-model proposer needs an engine (its tokenizer and device)")
    target = Path(engine.model_path)
    where = Path(path) if path is not None else draft_dir(target)
    return _RUNTIMES.get(engine, where, lambda: _load_runtime(engine, where))


def _load_runtime(engine: Any, where: Path) -> DraftRuntime:
    """Check the draft model in ``where`` against the target (its tokenizer) and load it."""
    target = Path(engine.model_path)
    if not (where / "config.json").exists():
        raise NoDraftWeights("draft", where, train_hint(target, where))
    if not (where / "tokenizer.json").exists() and not (where / "tokenizer_config.json").exists():
        raise NoDraftModel(
            f"the draft model in {where} has no tokenizer files, so it cannot be checked "
            f"against the target's; copy them from {target} if it was trained with that "
            "tokenizer"
        )
    try:
        draft_vocab = _read_vocab(where)
    except Exception as exc:
        raise NoDraftModel(
            f"cannot read the tokenizer of the draft model in {where}: {exc}"
        ) from None
    target_vocab = engine.tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differ = sum(1 for t, i in target_vocab.items() if draft_vocab.get(t) != i)
        raise NoDraftModel(
            f"the draft model in {where} has another tokenizer than the target in {target} "
            f"({len(draft_vocab)} vs {len(target_vocab)} tokens, {differ} of the target's "
            f"differ); a draft model must share the target's tokenizer: "
            + train_hint(target, where)
        )
    from codespec.daemon.engine.engine import ModelLoadError, load_runner

    runner = engine.runner
    try:
        draft, _config = load_runner(str(where), engine.device, "auto", engine.max_length)
    except ModelLoadError as exc:
        raise NoDraftModel(f"cannot load the draft model in {where}: {exc}") from None
    if draft.vocab_size < len(target_vocab):
        raise NoDraftModel(
            f"the draft model in {where} has {draft.vocab_size} output rows for a tokenizer "
            f"of {len(target_vocab)} tokens"
        )
    rt = DraftRuntime(
        draft, where, min(draft.vocab_size, runner.vocab_size), int(runner.vocab_size)
    )
    rt.forward_costs = getattr(engine, "costs", None)
    return rt


def window_start(n: int, window: int) -> int:
    """Where the draft model's view of an ``n``-token context starts: at most ``window``
    tokens, the start on a grid of ``window // 4``.

    >>> window_start(100, 256), window_start(300, 256), window_start(330, 256)
    (0, 64, 128)
    """
    grid = max(1, window // 4)
    return max(0, -(-(n - window) // grid) * grid)


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``.

    Prefix equality is monotone in the length, so a binary search over slice
    comparisons (C speed) finds it.

    >>> common_prefix([1, 2, 3, 4], [1, 2, 9], 3)
    2
    """
    lo, hi = 0, min(limit, len(a), len(b))
    if list(a[:hi]) == list(b[:hi]):
        return hi
    while lo + 1 < hi:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo


class DraftModelProposer:
    """Drafts a chain from a small causal LM; one instance per request stream.

    ``depth``: the longest draft; ``adaptive``: choose the length per step from
    measured acceptance and costs (otherwise always ``depth``), backing off to
    plain steps when drafting does not pay; ``window``: the most context tokens
    the draft model reads. See the module docstring.
    """

    name = SOURCE

    def __init__(
        self, runtime: DraftRuntime, depth: int = 8, adaptive: bool = True, window: int = 256
    ) -> None:
        if depth < 1 or window < 2:
            raise ValueError("depth must be at least 1 and window at least 2")
        self.rt = runtime
        self.depth = depth
        self.adaptive = adaptive
        self.window = window
        self._base: int | None = None  # this request's window start (set at its first sync)
        self.temperature = 0.0
        self.gen: torch.Generator | None = None
        # per drafted step: (draft length, accepted length; bonus not counted)
        self.history: list[tuple[int, int]] = []
        self._context_len = 0  # the window's length at the last drafting propose
        self._last_depth = 0
        self._fed = 0  # tokens the last sync fed
        self._chain_forwards = 0
        self._returned_at = 0.0  # when propose last returned (timing the engine's part)
        self._propose_ms = self._observe_ms = 0.0
        self._skip = 0  # plain steps left while backing off
        self._backoff = 1
        self._probe = False

    @classmethod
    def for_engine(
        cls, engine: Any, path: str | Path | None = None, **kw: Any
    ) -> DraftModelProposer:
        return cls(load_runtime(engine, path), **kw)

    # -- the Proposer protocol --------------------------------------------------------

    def begin(self, request: RequestInfo) -> None:
        self.temperature = float(request.temperature)
        self.gen = None
        if self.temperature > 0:  # seeded from the prompt: a seeded request stays reproducible
            self.gen = torch.Generator(device="cpu")
            self.gen.manual_seed(hash(tuple(request.prompt_ids)) & 0x7FFF_FFFF_FFFF_FFFF)
        self.history = []
        self._base = None
        self._context_len = self._last_depth = self._fed = self._chain_forwards = 0
        self._returned_at = 0.0
        self._skip, self._backoff, self._probe = 0, 1, False

    def sync(self, context: Sequence[int]) -> torch.Tensor:
        """Bring the draft cache to ``context`` (see the module docstring); return the draft
        model's logits for the token after the root, ``(V,)``."""
        rt = self.rt
        if self._base is None:
            self._base = window_start(len(context), self.window)
        if rt.base != self._base:  # another window: nothing cached is of use
            rt.cut(0)
            rt.base = self._base
        view = context[self._base :]
        common = common_prefix(rt.ids, view, len(view) - 1)
        rt.cut(common)
        self._fed = len(view) - common  # 1 after a partial accept, 2 after a full one
        return rt.feed(list(view[common:]))

    def propose(self, context: Sequence[int], budget: int) -> Draft | None:
        t_in = time.perf_counter()
        if self._returned_at:  # the engine's part of the last step: from there to here
            engine_ms = (t_in - self._returned_at) * 1000 - self._observe_ms
            self.rt.note_step(self._last_depth, engine_ms)
            self._returned_at = 0.0
        self._last_depth = self._chain_forwards = 0
        self._observe_ms = 0.0
        depth = min(self.depth, budget, self.rt.runner.max_length - len(context))
        if depth < 1:
            return self._plain()
        if self.adaptive:
            if self._skip > 0:  # backing off: a plain step, the draft model idle
                self._skip -= 1
                return self._plain()
            depth, rate = self.rt.acceptance.best_depth(depth, self._cost())
            if not self._probe and rate < 1.0 / self.rt.plain_cost():
                # drafting does not pay now: plain steps, twice as many each time in a row,
                # then one probing draft to refresh the acceptance statistics
                self._skip = self._backoff - 1
                self._backoff = min(2 * self._backoff, MAX_BACKOFF)
                self._probe = True
                return self._plain()
            if not self._probe:
                self._backoff = 1
            self._probe = False
        logits = self.sync(context)
        t0 = time.perf_counter()
        tokens: list[int] = []
        probs: list[torch.Tensor | None] = []
        for i in range(depth):
            tok, q = self._pick(logits)
            tokens.append(tok)
            probs.append(q)
            if i + 1 < depth:  # the last draft token is not fed (see the module docstring)
                logits = self.rt.feed([tok])
        now = time.perf_counter()
        if depth > 1:
            self.rt.note_token((now - t0) * 1000, depth - 1)
        self._chain_forwards = depth - 1
        self._context_len = len(context) - (self._base or 0)
        self._last_depth = depth
        self._propose_ms = (now - t_in) * 1000
        self._returned_at = now
        return Draft(
            tokens, probs=probs if self.gen is not None else None, sources=[SOURCE] * depth
        )

    def _plain(self) -> None:
        self._returned_at = time.perf_counter()
        return None

    def _pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The next draft token: argmax at temperature 0, else a sample from q (returned)."""
        logits = logits[: self.rt.vocab]
        if self.gen is None:
            return int(logits.argmax()), None
        q = torch.softmax(logits.float() / self.temperature, -1).cpu()  # (V,)
        if q.shape[0] < self.rt.target_vocab:
            q = torch.nn.functional.pad(q, (0, self.rt.target_vocab - q.shape[0]))
        return int(torch.multinomial(q, 1, generator=self.gen)), q

    def _cost(self) -> Callable[[int], float]:
        """Expected ms of a step drafting ``d`` tokens: the engine's part for ``d`` draft
        tokens, the proposer's own time (the sync forward) and ``d - 1`` chain forwards."""
        step = self.rt.step
        t_tok = self.rt.token_ms or 0.1 * step.at(1)
        own = self.rt.own_ms or 0.1 * step.at(1)

        def cost(d: int) -> float:
            return step.at(d) + own + (d - 1) * t_tok

        return cost

    def follow(self, result: StepResult) -> None:
        """A step whose draft another proposer made: nothing to keep in step here (the next
        ``sync`` matches the cache against the context), and that step's time is not ours."""
        self._returned_at = 0.0
        self._last_depth = 0

    def observe(self, result: StepResult) -> None:
        t_in = time.perf_counter()
        drafted = result.draft is not None and len(result.draft) > 0 and self._last_depth > 0
        if not drafted:
            return
        self.history.append((self._last_depth, result.accepted_len))
        self.rt.acceptance.update(self._last_depth, result.accepted_len)
        # Keep only accepted tokens: a partial accept drops the rejected draft tokens; after a
        # full accept nothing is dropped and the next sync feeds d_k and the bonus (catch-up).
        self.rt.cut(self._context_len + result.accepted_len)
        self._observe_ms = (time.perf_counter() - t_in) * 1000
        if self._fed <= STEADY_FEED:  # not a prefill or a catch-up after backing off
            chain_ms = self._chain_forwards * self.rt.token_ms
            self.rt.note_own(max(self._propose_ms + self._observe_ms - chain_ms, 0.0))


def make(engine: Any, index: Any = None, path: str | Path | None = None) -> DraftModelProposer:
    """The registry's factory: a proposer over ``engine``'s draft model (``MODEL/draft``)."""
    return DraftModelProposer.for_engine(engine, path)
