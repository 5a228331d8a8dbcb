"""The speculation policy: ``speculation: "auto"`` picks a proposer, or none, every step.

Owns :class:`AutoProposer` (a proposer that delegates each step to one of its
children) and the per-engine :class:`PolicyStore` of what it has measured:
per-source acceptance and realised speed, per document and engine-wide, per
temperature class. It must not touch decoding, verification or the children's
internals beyond the proposer protocol (``begin`` / ``propose`` / ``observe``,
plus the optional ``taps`` / ``prefilled`` / ``follow``).

Each step:

1. The n-gram proposer is asked first (it is cheap; it keeps its own adaptive
   lengths and back-off). Its draft is worth
   ``(1 + depth * share) / (cost(1 + nodes) + overhead + its own time)`` tokens
   per ms, where ``share`` is the accepted share of the draft depth measured
   for drafts behind a match of that length (a decayed mean per match-length
   bucket, pulled towards an even chance), ``cost(n)`` the engine's measured
   forward time for ``n`` tokens (:class:`~codespec.speculators.costs.ForwardCosts`)
   and ``overhead`` the measured rest of a plain step. A plain step is worth
   ``1 / (cost(1) + overhead)``. The draft is taken unless it is worth less
   than :data:`NGRAM_TRUST` of a plain step; then the n-gram proposer is told
   (``declined``) and backs off for 1, 2, 4, ... steps, sparing its lookups.
   A model proposer whose measured rate beats the draft's worth by :data:`MARGIN`
   takes the step instead (a short match's draft is often worth less than what
   a draft model makes of the step).
2. Otherwise each model proposer the engine's model has (EAGLE when a head is
   loaded, Medusa heads, a draft model, and lookahead, which needs nothing; one
   without weights for the model is left out, and ``stats`` says so) is
   valued at its realised tokens per ms over the steps it was in charge (mean
   tokens over mean ms: its own time, the verify forward and the rest of the
   step). The best one takes the step if it beats a plain step by
   :data:`MARGIN`. A model proposer that finds drafting does not pay proposes
   nothing itself, and its realised rate then is a plain step's minus its cost.
3. Otherwise, a plain step, except that a model proposer nobody has measured
   yet, or whose gap is up, is tried for :data:`TRIAL_STEPS` steps. A close
   loser (within :data:`CLOSE` of the best) is tried again after a gap that
   doubles (up to :data:`MAX_GAP` steps); one far behind retires: it is not
   built, nor kept in step (which costs time every step), for a pause that
   doubles from :data:`FIRST_PAUSE` steps, then gets one fresh trial. So a
   change in the code being written is still noticed.

Temperature: statistics are kept apart for greedy, low (<= 0.5) and high
temperatures. Rejection sampling accepts less than greedy matching, so a class
with no measurements yet starts from the greedy figures discounted by
:data:`TEMPERATURE_PRIOR` and is measured from there on.

Under load the daemon's scheduler (``speculation_policy``) halves the draft budget
and then switches speculation off as more requests compete; the policy sees the
smaller budget.

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

__all__ = [
    "AutoProposer",
    "PolicyStore",
    "make",
    "summary",
    "temperature_class",
    "weights_summary",
]

MODELS = ("eagle", "medusa", "draft", "lookahead")  # tried in this order when unmeasured
TEMPERATURE_PRIOR = 0.75  # a sampled class's first estimate: greedy's, times this
TRIAL_STEPS = 4  # steps a model proposer stays in charge when tried
FIRST_GAP, MAX_GAP = 32, 512  # steps before a losing model proposer is tried again
NGRAM_TRUST = 0.8  # an n-gram draft worth this share of a plain step is still taken
MARGIN = 0.05  # a model proposer takes over from a cheaper choice when this much faster
FIRST_PAUSE, MAX_PAUSE = 2048, 65536  # steps a far loser is retired, doubling
CLOSE = 0.9  # a loser within this share of the best is re-tried from FIRST_GAP on
MAX_DOCS = 256
ALPHA = 0.1  # weight of the newest observation in every moving average
MIN_SAMPLES = 3  # a document's own figure is used from this many observations on
ACCEPT_PRIOR = 0.5  # the accepted share of an n-gram draft before any is measured


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
class Mean:
    """A decayed mean that starts from a prior: ``(sum + K * prior) / (weight + K)``, so one
    unlucky observation does not condemn a source it never gets to try again."""

    total: float = 0.0
    weight: float = 0.0

    def add(self, x: float, decay: float = 0.95) -> None:
        self.total = decay * self.total + x
        self.weight = decay * self.weight + 1.0

    def estimate(self, prior: float, k: float = 2.0) -> float:
        return (self.total + k * prior) / (self.weight + k)


@dataclass
class Book:
    """The figures of one document (or of the whole engine) for one temperature class."""

    accepted: dict[tuple[str, int], Mean] = field(default_factory=dict)  # (source, depth)
    tokens: dict[str, Avg] = field(default_factory=dict)  # a model proposer's tokens per step
    ms: dict[str, Avg] = field(default_factory=dict)  # ... and its ms per step, all included
    own_ms: dict[str, Avg] = field(default_factory=dict)  # a proposer's own time per step
    plain_ms: Avg = field(default_factory=Avg)  # a plain step, everything included
    # exploration (used in the engine-wide book): steps since a model proposer was last
    # in charge, and its current gap
    idle: dict[str, int] = field(default_factory=dict)
    gap: dict[str, int] = field(default_factory=dict)


def depth_bucket(depth: int) -> int:
    """1, 2, 3-4, 5-8, 9-16, ... as 1, 2, 3, 4, 5, ..."""
    return max(1, depth - 1).bit_length() + (1 if depth > 1 else 0)


def match_bucket(n: int) -> int:
    """An n-gram match length as 1 (up to 2 tokens), 2 (3-4), 3 (5-7) or 4 (8 and more)."""
    return 1 if n <= 2 else 2 if n <= 4 else 3 if n < 8 else 4


class PolicyStore:
    """What the policy has learnt for one engine: per document (LRU) and engine-wide."""

    def __init__(self, costs: ForwardCosts) -> None:
        self.costs = costs
        self.docs: OrderedDict[tuple[str, str], Book] = OrderedDict()
        self.engine_wide: dict[str, Book] = {}
        self.available: dict[str, bool] = {}  # model proposer name -> can be built
        self.why: dict[str, str] = {}  # model proposer name -> why it cannot be built
        self.steps = 0  # steps the policy has taken on this engine
        # a model proposer far behind after a trial is not built (nor kept in step, which
        # costs time every step) until this step, then tried once more; the pause doubles
        self.retired: dict[str, int] = {}
        self.pause: dict[str, int] = {}
        self.returning: set[str] = set()

    def usable(self, name: str) -> bool:
        """Not retired; one whose retirement just ended is marked for a trial."""
        until = self.retired.get(name)
        if until is None:
            return True
        if self.steps < until:
            return False
        del self.retired[name]
        self.returning.add(name)
        return True

    def retire(self, name: str) -> None:
        pause = self.pause[name] = min(MAX_PAUSE, 2 * self.pause.get(name, FIRST_PAUSE // 2))
        self.retired[name] = self.steps + pause

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


def weights_summary(engine: Any, store: PolicyStore | None = None) -> dict[str, str]:
    """Per model proposer, whether it has what it needs for ``engine``'s model, in words:
    ``weights in PATH``, ``no weights for this model``, ``needs no weights`` (lookahead),
    or ``not usable: WHY`` when loading them failed (they do not fit the model)."""
    from codespec.speculators.registry import weights

    if engine is None or not hasattr(engine, "model_path"):
        return {}
    found = weights(engine)
    out = {}
    for name in MODELS:
        if name not in found:
            out[name] = "needs no weights"
        elif found[name] is None:
            out[name] = "no weights for this model"
        elif store is not None and store.available.get(name) is False:
            out[name] = f"not usable: {store.why.get(name, 'it failed to load')}"
        else:
            out[name] = f"weights in {found[name]}"
    return out


def summary(engine: Any) -> dict[str, Any]:
    """What the policy has measured on ``engine`` (engine-wide), for ``stats``: forward ms by
    size, per model proposer whether it has weights for the model (:func:`weights_summary`),
    and per temperature class the plain step's ms, each model proposer's tokens per ms
    against plain decoding's, the n-gram accepted share per match bucket, and the retired."""
    store = _STORES.get(engine)
    costs = getattr(engine, "costs", None)
    out: dict[str, Any] = {
        "forward_ms": costs.as_dict() if costs is not None else {},
        "weights": weights_summary(engine, store),
    }
    if store is None:
        return out
    classes: dict[str, Any] = {}
    for tclass, book in store.engine_wide.items():
        # plain decoding's speed as the policy sees it: measured steps, else the forward alone
        plain_ms = book.plain_ms.value if book.plain_ms.n else (costs.at(1) if costs else 0.0)
        plain = 1.0 / plain_ms if plain_ms else None
        rates = {n: _rate(book, n, 1) for n in book.tokens}
        classes[tclass] = {
            "plain_step_ms": round(book.plain_ms.value, 3) if book.plain_ms.n else None,
            "vs_plain": {
                n: round(r / plain, 3) for n, r in rates.items() if r is not None and plain
            },
            "ngram_share": {
                str(m): round(mean.estimate(ACCEPT_PRIOR), 3)
                for (src, m), mean in sorted(book.accepted.items())
                if src == "ngram"
            },
        }
    out["classes"] = classes
    out["retired"] = sorted(n for n, until in store.retired.items() if until > store.steps)
    out["steps"] = store.steps
    return out


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
        rows = [taps.index(t) for t in self.taps]  # its taps within the policy's
        # consecutive rows are a view (no copy per step), others an index
        self.rows: slice | list[int] = rows
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):
            self.rows = slice(rows[0], rows[0] + len(rows))
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
        self._match = 0  # the n-gram draft's match bucket
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
        self.store.steps += 1
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
            self._match = match_bucket(int(getattr(self.ngram.p, "last_match", 0)))
            self._draft_depth = ng.depth
            exp = self._expected("ngram", self._draft_depth, self._match)
            value = (1.0 + exp) / (self.costs.at(1 + len(ng)) + overhead + self._own_ms("ngram"))
            # the n-gram proposer's own lengths and back-off have the last word, unless the
            # measured figures say the draft is clearly a loss
            if value >= NGRAM_TRUST * best_value:
                best, best_value = "ngram", max(value, best_value)
            elif hasattr(self.ngram.p, "declined"):  # it backs off: no lookups for a while
                self.ngram.p.declined()
        if best == "plain":
            model = self._pick_model(best_value)
        else:  # a measured model proposer still takes a step this n-gram draft is worth less
            model = self._measured_rival(best_value)
        if model is not None:
            best = model
        self.choice = best
        self.choices[best] = self.choices.get(best, 0) + 1
        for name in self.models:
            idle = self.glob.idle
            idle[name] = 0 if name == best else idle.get(name, 0) + 1
        if best == "ngram":
            self._own = ng_ms
            assert ng is not None
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
                key = ("ngram", self._match)
                ratio = result.accepted_len / max(1, self._draft_depth)
                for book in _both(self.doc, self.glob):
                    book.accepted.setdefault(key, Mean()).add(ratio)
        for name, child in self.models.items():
            if name != self.choice and (child.stale or not child.can_follow):
                child.stale = True
                continue
            mine = replace(result, hidden=child.hidden(result.hidden)) if child.taps else result
            if name == self.choice:
                child.p.observe(mine)
            else:
                child.p.follow(mine)  # type: ignore[attr-defined]
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
            self._note(self.doc, self.glob, "tokens", self.choice, self._tokens)
            self._note(self.doc, self.glob, "ms", self.choice, ms)
            self._note(self.doc, self.glob, "own_ms", self.choice, self._own)
        self._tokens = 0

    def _note(self, doc: Book, glob: Book, what: str, name: str, x: float) -> None:
        for book in _both(doc, glob):
            getattr(book, what).setdefault(name, Avg()).add(x)

    def _figure(self, what: str, name: str) -> float | None:
        """A measured figure: the document's own, else the engine's, else None. ``rate``
        is a model proposer's tokens per ms (mean tokens over mean ms per step); a sampled
        temperature class without its own rate starts from greedy's, discounted."""
        if what == "rate":
            for book in (self.doc, self.glob):
                rate = _rate(book, name, MIN_SAMPLES if book is self.doc else 1)
                if rate is not None:
                    return rate
            greedy = self.store.engine_wide.get("greedy")
            if self.tclass != "greedy" and greedy is not None:
                rate = _rate(greedy, name, 1)
                if rate is not None:
                    return rate * TEMPERATURE_PRIOR
            return None
        for book in (self.doc, self.glob):
            avg = getattr(book, what).get(name)
            if avg is not None and avg.n >= (MIN_SAMPLES if book is self.doc else 1):
                return avg.value
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

    def _expected(self, source: str, depth: int, match: int) -> float:
        """Expected accepted tokens (bonus not counted) of a draft ``depth`` deep behind a
        match in bucket ``match``: ``depth`` times the accepted share of the draft depth
        measured for that match bucket (the document's decayed mean, else the engine's),
        pulled towards an even chance (a source that is never chosen never learns; the
        n-gram proposer's own back-off catches the drafts that keep failing). A sampled
        temperature class expects less: its prior is discounted by TEMPERATURE_PRIOR, and
        with nothing measured it starts from greedy's figure, discounted."""
        key = (source, match)
        sampled = self.tclass != "greedy"
        prior = ACCEPT_PRIOR * (TEMPERATURE_PRIOR if sampled else 1.0)
        for book in (self.doc, self.glob):
            mean = book.accepted.get(key)
            if mean is not None and mean.weight >= (MIN_SAMPLES if book is self.doc else 1):
                return depth * mean.estimate(prior)
        greedy = self.store.engine_wide.get("greedy")
        if sampled and greedy is not None and key in greedy.accepted:
            return depth * greedy.accepted[key].estimate(ACCEPT_PRIOR) * TEMPERATURE_PRIOR
        return depth * prior

    def _pick_model(self, best_value: float) -> str | None:
        """The model proposer to put in charge this step, or None (best_value stands)."""
        if not self.models:
            return None
        if self.trial is not None:
            name, left = self.trial
            self.trial = (name, left - 1) if left > 1 else None
            return name
        best = self._measured_rival(best_value)
        if best is not None:
            self.glob.gap[best] = FIRST_GAP
            return best
        # nobody beats the incumbent: try one that has not been measured, is back from
        # retirement, or whose gap is up; one far behind after its trial retires
        for name in MODELS:
            if name not in self.models:
                continue
            rate = self._figure("rate", name)
            if name in self.store.returning:
                self.store.returning.discard(name)
                rate = None  # a fresh trial
            elif rate is not None and rate < CLOSE * best_value:
                self.store.retire(name)
                del self.models[name]  # no longer kept in step this request either
                continue
            gap = self.glob.gap.get(name, FIRST_GAP)
            if rate is None or self.glob.idle.get(name, 0) >= gap:
                if rate is not None:
                    self.glob.gap[name] = min(MAX_GAP, gap * 2)
                self.trial = (name, TRIAL_STEPS - 1)
                return name
        return None

    def _measured_rival(self, value: float) -> str | None:
        """The model proposer whose measured rate beats ``value`` by :data:`MARGIN`, if any
        (no trials here: an n-gram draft stands unless a measured figure says otherwise)."""
        best, best_rate = None, value * (1 + MARGIN)
        for name in self.models:
            rate = self._figure("rate", name)
            if rate is not None and rate > best_rate:
                best, best_rate = name, rate
        return best

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


def _rate(book: Book, name: str, min_n: int) -> float | None:
    tokens, ms = book.tokens.get(name), book.ms.get(name)
    if tokens is None or ms is None or tokens.n < min_n:
        return None
    return tokens.value / max(ms.value, 1e-3)


def _both(doc: Book, glob: Book) -> tuple[Book, ...]:
    return (doc,) if doc is glob else (doc, glob)


def make(
    engine: Any,
    index: Any,
    factories: dict[str, Callable[[Any, Any], Proposer]] | None = None,
) -> AutoProposer:
    """The policy over the n-gram proposer and every model proposer the engine's model has."""
    from codespec.speculators.ngram import NgramProposer
    from codespec.speculators.registry import FACTORIES

    factories = factories if factories is not None else FACTORIES
    # the n-gram proposer keeps its own back-off (drafts that keep failing stop for a
    # while); the policy weighs the drafts it does make against their measured cost
    ngram = NgramProposer(index=index)
    if engine is None:  # no model to measure or to read hidden states from: n-gram only
        return AutoProposer(None, ngram, {}, PolicyStore(ForwardCosts()), calibrate=False)
    store = store_for(engine)
    models: dict[str, Proposer] = {}
    for name in MODELS:
        factory = factories.get(name)
        if factory is None or store.available.get(name) is False or not store.usable(name):
            continue
        try:
            models[name] = factory(engine, index)
            store.available[name] = True
        except (LookupError, ValueError, ImportError) as exc:  # no weights for this model
            store.available[name] = False
            store.why[name] = str(exc)
    return AutoProposer(engine, ngram, models, store)
