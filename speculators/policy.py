"""The speculation policy: ``speculation: "auto"`` picks a proposer, or none, every step.

Owns :class:`AutoProposer` (a proposer that delegates each step to one of its
children) and the per-engine :class:`PolicyStore` of what it has measured:
per-source acceptance and realised speed, per document and engine-wide, per
temperature class. It must not touch decoding, verification or the children's
internals beyond the proposer protocol (``begin`` / ``propose`` / ``observe``,
plus the optional ``taps`` / ``prefilled`` / ``follow``).

Each step the candidates are:

- plain decoding, worth ``1 / (cost(1) + overhead)`` tokens per ms, where
  ``cost(n)`` is the engine's measured forward time for ``n`` tokens
  (:class:`~codespec.speculators.costs.ForwardCosts`) and ``overhead`` the
  measured rest of a plain step;
- the n-gram proposer's draft, when it has one (it is cheap to ask every step):
  ``(1 + E[accepted | source, draft depth]) / (cost(1 + nodes) + overhead +
  its own time)``, with the expectation a moving average per draft depth;
- each model proposer that is available for the engine's model (EAGLE when a
  head is loaded, Medusa heads, a draft model, and lookahead, which needs
  nothing): its realised tokens per ms over the steps it was in charge
  (its own time, the verify forward and the rest of the step). A model
  proposer that finds drafting does not pay proposes nothing, and its
  realised rate then is a plain step's minus its own cost.

The highest value wins. A model proposer nobody has measured yet, or one that
lost, is tried again for a few steps after a gap that doubles each time it
loses (up to 256 steps), so a change in the code being written is noticed.

Temperature: statistics are kept apart for greedy, low (<= 0.5) and high
temperatures. Rejection sampling accepts less than greedy matching, so a class
with no measurements yet starts from the greedy figures discounted by
:data:`TEMPERATURE_PRIOR` and is measured from there on.

Children that were not in charge of a step stay in step through ``follow(result)``
when they have it (EAGLE queues the accepted tokens' hidden states); those that
do not are restarted from the context (``begin`` + ``prefilled`` from the
engine's tap buffer) the next time they are put in charge.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from codespec.speculators.costs import ForwardCosts
from codespec.speculators.draft import Draft, Proposer, RequestInfo, StepResult

__all__ = ["AutoProposer", "PolicyStore", "make", "temperature_class"]

MODELS = ("eagle", "medusa", "draft", "lookahead")  # tried in this order when unmeasured
TEMPERATURE_PRIOR = 0.75  # a sampled class's first estimate: greedy's, times this
TRIAL_STEPS = 4  # steps a model proposer stays in charge when tried
FIRST_GAP, MAX_GAP = 16, 256  # steps before a losing model proposer is tried again
MAX_DOCS = 256
ALPHA = 0.2  # weight of the newest observation in every moving average
MIN_SAMPLES = 3  # a document's own figure is used from this many observations on


def temperature_class(t: float) -> str:
    if t <= 0:
        return "greedy"
    return "low" if t <= 0.5 else "high"


@dataclass
class Avg:
    """An exponential moving average that knows how many observations it has seen."""

    value: float = 0.0
    n: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.n == 0 else (1 - ALPHA) * self.value + ALPHA * x
        self.n += 1


@dataclass
class Book:
    """The figures of one document (or of the whole engine) for one temperature class."""

    accepted: dict[tuple[str, int], Avg] = field(default_factory=dict)  # (source, depth)
    rate: dict[str, Avg] = field(default_factory=dict)  # realised tokens per ms
    own_ms: dict[str, Avg] = field(default_factory=dict)  # a proposer's own time per step
    plain_ms: Avg = field(default_factory=Avg)  # a plain step, everything included
    # exploration: steps since a model proposer was last in charge, and its current gap
    idle: dict[str, int] = field(default_factory=dict)
    gap: dict[str, int] = field(default_factory=dict)


def depth_bucket(depth: int) -> int:
    """1, 2, 3-4, 5-8, 9-16, ... as 1, 2, 3, 4, 5, ..."""
    return max(1, depth - 1).bit_length() + (1 if depth > 1 else 0)


class PolicyStore:
    """What the policy has learnt for one engine: per document (LRU) and engine-wide."""

    def __init__(self, costs: ForwardCosts) -> None:
        self.costs = costs
        self.docs: OrderedDict[tuple[str, str], Book] = OrderedDict()
        self.engine_wide: dict[str, Book] = {}
        self.available: dict[str, bool] = {}  # model proposer name -> can be built

    def books(self, uri: str | None, tclass: str) -> tuple[Book, Book]:
        """(the document's book, the engine-wide book) for a temperature class."""
        glob = self.engine_wide.setdefault(tclass, Book())
        if uri is None:
            return glob, glob
        key = (uri, tclass)
        book = self.docs.get(key)
        if book is None:
            book = self.docs[key] = Book()
            while len(self.docs) > MAX_DOCS:
                self.docs.popitem(last=False)
        else:
            self.docs.move_to_end(key)
        return book, glob


_STORES: weakref.WeakKeyDictionary[Any, PolicyStore] = weakref.WeakKeyDictionary()


def store_for(engine: Any) -> PolicyStore:
    store = _STORES.get(engine)
    if store is None:
        costs = getattr(engine, "costs", None) or ForwardCosts()
        store = _STORES[engine] = PolicyStore(costs)
    return store


class _Child:
    """A proposer under the policy, with the bookkeeping to keep it in step."""

    def __init__(self, name: str, proposer: Proposer, taps: tuple[int, ...]) -> None:
        self.name = name
        self.p = proposer
        self.taps = tuple(getattr(proposer, "taps", ()) or ())
        self.rows = [taps.index(t) for t in self.taps]  # its taps within the policy's
        self.stale = False
        self.can_follow = hasattr(proposer, "follow")

    def hidden(self, h: Any) -> Any:
        if h is None or not self.taps:
            return None
        return h[..., self.rows, :]


class AutoProposer:
    """Picks, per step, the proposer with the most expected tokens per ms (see module doc)."""

    name = "auto"

    def __init__(
        self,
        engine: Any,
        ngram: Proposer,
        models: dict[str, Proposer],
        store: PolicyStore | None = None,
        calibrate: bool = True,
    ) -> None:
        self.engine = engine
        self.store = store or store_for(engine)
        self.costs = self.store.costs
        taps: list[int] = []
        for p in models.values():
            for t in getattr(p, "taps", ()) or ():
                if t not in taps:
                    taps.append(t)
        self.taps = tuple(taps)
        self.ngram = _Child("ngram", ngram, self.taps)
        self.models = {name: _Child(name, p, self.taps) for name, p in models.items()}
        self.calibrate = calibrate and engine is not None
        self.info: RequestInfo | None = None
        self.tclass = "greedy"
        self.doc: Book = Book()
        self.glob: Book = self.doc
        self.choice = "plain"  # who is in charge of the current step
        self.trial: tuple[str, int] | None = None  # (model, steps left) while trying one
        self._t_step = 0.0  # when the current step's propose started
        self._own = 0.0  # the chosen proposer's own ms in the current step
        self._tokens = 0  # tokens the current step produced (from observe)
        self._draft_depth = 0
        self.choices: dict[str, int] = {}  # steps in charge, per candidate

    # -- the proposer protocol -----------------------------------------------------------

    def begin(self, request: RequestInfo) -> None:
        if self.calibrate and not self.costs.calibrated:  # once per engine, under its lock
            self.costs.calibrate(self.engine.runner)
        self.info = request
        self.tclass = temperature_class(request.temperature)
        self.doc, self.glob = self.store.books(request.uri, self.tclass)
        self.choice, self.trial, self._t_step = "plain", None, 0.0
        for child in [self.ngram, *self.models.values()]:
            child.p.begin(request)
            child.stale = False

    def prefilled(self, hidden: Any) -> None:
        for child in self.models.values():
            if child.taps and hasattr(child.p, "prefilled"):
                child.p.prefilled(child.hidden(hidden))

    def propose(self, context: Sequence[int], budget: int) -> Draft | None:
        now = time.perf_counter()
        self._close_step(now)
        self._t_step = now
        self._own = 0.0
        self._draft_depth = 0
        if budget < 1:
            self.choice = "plain"
            return None
        t0 = time.perf_counter()
        ng = self.ngram.p.propose(context, budget)
        ng_ms = (time.perf_counter() - t0) * 1000
        self._note(self.doc, self.glob, "own_ms", "ngram", ng_ms)
        overhead = self._overhead()
        best, best_value = "plain", 1.0 / (self.costs.at(1) + overhead)
        if ng is not None and len(ng):
            exp = self._expected("ngram", _depth(ng))
            value = (1.0 + exp) / (self.costs.at(1 + len(ng)) + overhead + self._own_ms("ngram"))
            if value > best_value:
                best, best_value = "ngram", value
        model = self._pick_model(best_value)
        if model is not None:
            best = model
        self.choice = best
        self.choices[best] = self.choices.get(best, 0) + 1
        for name in self.models:
            idle = self.doc.idle
            idle[name] = 0 if name == best else idle.get(name, 0) + 1
        if best == "ngram":
            self._own = ng_ms
            assert ng is not None
            self._draft_depth = _depth(ng)
            return ng
        if best == "plain":
            return None
        child = self.models[best]
        t0 = time.perf_counter()
        if child.stale:
            self._restart(child, context)
        draft = child.p.propose(context, budget)
        self._own = (time.perf_counter() - t0) * 1000
        if draft is not None and len(draft) > budget:
            draft = draft.truncated(budget)
        return draft if draft is not None and len(draft) else None

    def observe(self, result: StepResult) -> None:
        t0 = time.perf_counter()
        self._tokens = len(result.tokens)
        if self.choice == "ngram":
            self.ngram.p.observe(result)
            if result.draft is not None and len(result.draft):
                key = ("ngram", depth_bucket(self._draft_depth))
                for book in _both(self.doc, self.glob):
                    book.accepted.setdefault(key, Avg()).add(result.accepted_len)
        for name, child in self.models.items():
            if name == self.choice:
                child.p.observe(replace(result, hidden=child.hidden(result.hidden)))
            elif child.can_follow and not child.stale:
                child.p.follow(replace(result, hidden=child.hidden(result.hidden)))  # type: ignore[attr-defined]
            else:
                child.stale = True
        if self.choice in self.models:
            self._own += (time.perf_counter() - t0) * 1000

    # -- internals -----------------------------------------------------------------------

    def _close_step(self, now: float) -> None:
        """Credit the step that just ended (propose to propose) to whoever was in charge."""
        if not self._t_step or not self._tokens:
            return
        ms = (now - self._t_step) * 1000
        if self.choice == "plain":
            for book in _both(self.doc, self.glob):
                book.plain_ms.add(ms)
        elif self.choice in self.models:
            self._note(self.doc, self.glob, "rate", self.choice, self._tokens / max(ms, 1e-3))
            self._note(self.doc, self.glob, "own_ms", self.choice, self._own)
        self._tokens = 0

    def _note(self, doc: Book, glob: Book, what: str, name: str, x: float) -> None:
        for book in _both(doc, glob):
            getattr(book, what).setdefault(name, Avg()).add(x)

    def _figure(self, what: str, name: str) -> float | None:
        """A measured figure: the document's own, else the engine's, else the greedy class's
        discounted (for rates and acceptance), else None."""
        for book in (self.doc, self.glob):
            avg = getattr(book, what).get(name)
            if avg is not None and avg.n >= (MIN_SAMPLES if book is self.doc else 1):
                return avg.value
        if self.tclass != "greedy" and what in ("rate", "accepted"):
            greedy = self.store.engine_wide.get("greedy")
            avg = getattr(greedy, what).get(name) if greedy is not None else None
            if avg is not None and avg.n:
                return avg.value * TEMPERATURE_PRIOR
        return None

    def _overhead(self) -> float:
        """The measured part of a plain step that is not the forward (detokenising, ...)."""
        for book in (self.doc, self.glob):
            if book.plain_ms.n >= (MIN_SAMPLES if book is self.doc else 1):
                return max(0.0, book.plain_ms.value - self.costs.at(1))
        return 0.0

    def _own_ms(self, name: str) -> float:
        v = self._figure("own_ms", name)
        return v if v is not None else 0.0

    def _expected(self, source: str, depth: int) -> float:
        """Expected accepted tokens (bonus not counted) of a draft of this depth."""
        b = depth_bucket(depth)
        v = self._figure("accepted", (source, b))  # type: ignore[arg-type]
        if v is not None:
            return v
        # unmeasured depth: the nearest measured shallower one, else an even chance
        for lower in range(b - 1, 0, -1):
            v = self._figure("accepted", (source, lower))  # type: ignore[arg-type]
            if v is not None:
                return v
        return 0.5 * min(depth, 2)

    def _pick_model(self, best_value: float) -> str | None:
        """The model proposer to put in charge this step, or None (best_value stands)."""
        if not self.models:
            return None
        if self.trial is not None:
            name, left = self.trial
            self.trial = (name, left - 1) if left > 1 else None
            return name
        best, value = None, best_value
        for name in self.models:
            rate = self._figure("rate", name)
            if rate is not None and rate > value:
                best, value = name, rate
        if best is not None:
            self.doc.gap[best] = FIRST_GAP
            return best
        # nobody beats the incumbent: try one that has not been measured or whose gap is up
        for name in MODELS:
            if name not in self.models:
                continue
            measured = self._figure("rate", name) is not None
            gap = self.doc.gap.get(name, FIRST_GAP)
            if not measured or self.doc.idle.get(name, 0) >= gap:
                if measured:
                    self.doc.gap[name] = min(MAX_GAP, gap * 2)
                self.trial = (name, TRIAL_STEPS - 1)
                return name
        return None

    def _restart(self, child: _Child, context: Sequence[int]) -> None:
        """Bring a child that missed steps back in step with the context."""
        assert self.info is not None
        info = replace(self.info, prompt_ids=list(context))
        child.p.begin(info)
        if child.taps and hasattr(child.p, "prefilled") and self.engine is not None:
            fed = len(context) - 1  # the root is not fed yet
            # no taps kept (RuntimeError): the child proposes nothing until it re-syncs
            with contextlib.suppress(RuntimeError):
                child.p.prefilled(child.hidden(self.engine.prompt_hidden(fed)))
        child.stale = False


def _both(doc: Book, glob: Book) -> tuple[Book, ...]:
    return (doc,) if doc is glob else (doc, glob)


def _depth(draft: Draft) -> int:
    assert draft.parents is not None
    depth: list[int] = []
    for p in draft.parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


def make(
    engine: Any,
    index: Any,
    factories: dict[str, Callable[[Any, Any], Proposer]] | None = None,
) -> AutoProposer:
    """The policy over the n-gram proposer and every model proposer the engine's model has."""
    from codespec.speculators.ngram import NgramProposer
    from codespec.speculators.registry import FACTORIES

    factories = factories if factories is not None else FACTORIES
    # back-off is the policy's job here: the n-gram proposer reports every match
    ngram = NgramProposer(index=index, min_gain=0.0)
    if engine is None:  # no model to measure or to read hidden states from: n-gram only
        return AutoProposer(None, ngram, {}, PolicyStore(ForwardCosts()), calibrate=False)
    store = store_for(engine)
    models: dict[str, Proposer] = {}
    for name in MODELS:
        factory = factories.get(name)
        if factory is None or store.available.get(name) is False:
            continue
        try:
            models[name] = factory(engine, index)
            store.available[name] = True
        except (LookupError, ValueError, ImportError):  # no head / heads / draft model here
            store.available[name] = False
    return AutoProposer(engine, ngram, models, store)
