"""The speculation policy: one controller decides every step who drafts and what is verified.

Owns :class:`Controller`, the one proposer the engine drives for a request: it
drives the proposers under it (``speculation: "auto"``: every proposer the
model has; a named one, ``"eagle"``, alone), and is the only place that
measures, chooses and backs off. Proposers only propose and keep in step.
What it has measured lives in the target's :class:`~codespec.speculators.book.PolicyStore`.
Must not touch: decoding, verification, the proposers' internals beyond the
protocol (``begin`` / ``propose`` / ``observe`` / ``follow``, plus the optional
``taps`` / ``prefilled``).

Measured (each step, from the engine's :class:`~codespec.speculators.draft.StepResult`
and the controller's own clock): the verify forward's ms by size
(:class:`~codespec.speculators.costs.ForwardCosts`), the rest of a step (what is
neither the forward nor a proposer: stop rules, detokenizing, streaming), each
proposer's own time against the nodes it offers (not its first ask in a request, which
may catch up on the prompt), per-node acceptance
(``acceptance.py``: per source, match length, depth, first or later sibling) and
each proposer's realised tokens per ms over the steps it was in charge of.

Each step:

1. *Cheap* proposers (own time, at the draft size they offer, at most :data:`CHEAP` of
   a plain step, or not measured yet: the n-gram proposer, lookahead) are asked in
   order, unless backing off, until one offers :data:`ENOUGH` expected tokens (asking
   lookahead too on a step the n-gram draft already fills costs auto decode time for
   nothing; with ENOUGH at 1 auto keeps about ngram's decode speed on edit and novel
   code, at 2 it falls behind). Drafts asked for and not verified are counted against the
   tokens the step produced (see ``_shadow``).
   Each draft is cut to the nodes worth verifying: likeliest first, as many as
   give the most ``(1 + expected accepted) / (forward(1 + nodes) + rest)``
   (:func:`~codespec.speculators.acceptance.best_cut`); a plain step is worth
   ``1 / (forward(1) + rest)``. The best cut draft is the cheap offer.
2. A *costly* proposer (EAGLE on a CPU) takes the step instead when its realised
   rate beats the cheap offer by :data:`MARGIN`; or, when there is no cheap
   offer, when it has not been measured yet, is back from retirement, or its
   gap is over: a trial of :data:`TRIAL_STEPS` steps. Its budget is the chain
   length with the most expected tokens per ms, its own time included. A loser
   close to the best (within :data:`CLOSE`) is tried again after a gap that
   doubles from :data:`FIRST_GAP` to :data:`MAX_GAP` steps; one far behind
   retires: not built, nor kept in step, for a pause doubling from
   :data:`FIRST_PAUSE` steps (then one fresh trial).
3. Back-off: a cheap proposer whose draft was not worth verifying is not asked
   for 1, 2, 4 ... :data:`MOST_SKIPPED` steps; one accepted token resets it. A
   draft verified and rejected does not back its proposer off: its acceptance
   figures fall and the next cut prices them (skipping the steps after a miss
   would slow edits down: a copy resynchronises right after one).

Temperature: figures are kept per temperature class (``book.py``); a sampled
class with nothing measured yet starts from greedy's figures (or the prior)
times :data:`TEMPERATURE_PRIOR`. Under heavy load (9 and 32 active requests by
default) the scheduler halves the budget and then switches speculation off; the
controller sees the smaller budget.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from codespec.speculators.acceptance import (
    Key,
    best_cut,
    depth_bucket,
    node_chances,
    prior,
    walk,
)
from codespec.speculators.book import (
    Backoff,
    Book,
    PolicyStore,
    measured,
    store_for,
    temperature_class,
)
from codespec.speculators.costs import Line
from codespec.speculators.draft import Draft, Proposer, RequestInfo, StepResult
from codespec.speculators.target import StateHolder
from codespec.speculators.weights import weights_summary

__all__ = ["Controller", "seed_costs", "summary"]

CHEAP = 0.25  # own time, as a share of a plain step, of a proposer asked every step
MARGIN = 0.05  # a costly proposer takes over from a cheaper choice when this much faster
TRIAL_STEPS = 4  # steps a costly proposer stays in charge when tried
FIRST_GAP, MAX_GAP = 32, 512  # steps before a losing costly proposer is tried again
FIRST_PAUSE, MAX_PAUSE = 2048, 65536  # steps a far loser is retired, doubling
CLOSE = 0.9  # a loser within this share of the best is re-tried after its gap
MOST_SKIPPED = 32  # the longest back-off of a cheap proposer, in steps
ENOUGH = 1.0  # expected tokens of a cheap offer after which later cheap ones are not asked
TEMPERATURE_PRIOR = 0.75  # a sampled class's first estimate: greedy's, times this


def seed_costs(target: StateHolder, table: Mapping[int, float]) -> None:
    """Hand the policy timed target forwards, ``{tokens: ms}``, as its prior for
    ``target``'s costs before any step is measured (the daemon calls it once, at start,
    with the engine's timings)."""
    store_for(target).costs.seed(table)


def summary(target: StateHolder | None) -> dict[str, Any]:
    """The policy section of ``stats``: what it measured on ``target`` (forward ms by size;
    per temperature class the plain step's ms and each proposer's speed against plain
    decoding's; the retired; steps) and per model proposer whether the model has weights
    for it (``weights_summary``)."""
    store = store_for(target) if target is not None else None
    unusable = {n: store.why.get(n, "it failed to load") for n, ok in store.available.items()
                if not ok} if store is not None else {}  # fmt: skip
    return {**measured(target), "weights": weights_summary(target, unusable)}


class _Child:
    """A proposer under the controller, with its taps among the controller's and its
    back-off."""

    def __init__(self, name: str, proposer: Proposer, taps: tuple[int, ...]) -> None:
        self.name = name
        self.p = proposer
        self.taps = tuple(getattr(proposer, "taps", ()) or ())
        rows = [taps.index(t) for t in self.taps]  # its taps within the controller's
        # consecutive rows are a view (no copy per step), others an index
        self.rows: slice | list[int] = rows
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):
            self.rows = slice(rows[0], rows[0] + len(rows))
        self.backoff = Backoff(1, MOST_SKIPPED)
        self.source = name  # the source of its last draft's first node
        self.asked = False  # asked in this request (its first ask may catch up on the prompt)
        self.asked_at = -1  # the request's step (Controller._step) of its last ask

    def hidden(self, h: Any) -> Any:
        if h is None or not self.taps:
            return None
        return h[..., self.rows, :]

    def result(self, result: StepResult) -> StepResult:
        return replace(result, hidden=self.hidden(result.hidden)) if self.taps else result


@dataclass
class _Offer:
    """What asking a proposer gave: its draft cut to the part worth verifying (None:
    nothing worth it) and the expected tokens per ms of the step."""

    child: _Child | None
    draft: Draft | None
    value: float
    full: Draft | None = None  # the draft as the proposer offered it, before the cut

    @property
    def offered(self) -> bool:
        """It had a draft, worth verifying or not."""
        return self.full is not None


class Controller:
    """The per-request controller over ``children`` (see the module docstring)."""

    def __init__(
        self,
        target: StateHolder | None,
        children: Mapping[str, Proposer],
        store: PolicyStore | None = None,
        name: str = "auto",
    ) -> None:
        self.name = name
        self.target = target
        self.store = store if store is not None else store_for(target)
        taps: list[int] = []
        for p in children.values():
            taps += [t for t in getattr(p, "taps", ()) or () if t not in taps]
        self.taps = tuple(taps)
        self.children = {n: _Child(n, p, self.taps) for n, p in children.items()}
        # the acceptance proposers declare for their drafts (Proposer.prior_acceptance)
        self.declared = {
            n: tuple(getattr(p, "prior_acceptance", ()) or ()) for n, p in children.items()
        }
        self.info: RequestInfo | None = None
        self.tclass = "greedy"
        self.doc: Book = Book()
        self.glob: Book = self.doc
        self.choice = "plain"  # who is in charge of the current step
        self.choices: dict[str, int] = {}  # steps in charge, per proposer (and "plain")
        self.trial: tuple[str, int] | None = None  # (costly proposer, steps left)
        self._cheap_offers: list[_Offer] = []
        self._rates: dict[Key, float] = {}  # this step's acceptance rates, by node key
        self._costly = False  # the proposer in charge is a costly one
        self._t_step = 0.0  # when the current step's propose started
        self._own = 0.0  # proposers' ms in the current step
        self._switch = 0.0  # proposers catching up this step (Proposer.catch_up): in no figure
        self._step = 0  # this request's steps (the store's count is every request's)
        self._fwd = 0.0  # the current step's verify forward, ms
        self._tokens = 0  # tokens the current step produced

    # -- the proposer protocol -----------------------------------------------------------

    def begin(self, request: RequestInfo) -> None:
        self.info = request
        self.tclass = temperature_class(request.temperature)
        self.doc, self.glob = self.store.books(request.uri, self.tclass)
        self.choice, self.trial, self._t_step, self._tokens = "plain", None, 0.0, 0
        self._rates = {}
        for child in self.children.values():
            child.asked, child.asked_at = False, -1
            child.p.begin(request)

    def prefilled(self, hidden: Any) -> None:
        for child in self.children.values():
            if child.taps and hasattr(child.p, "prefilled"):
                child.p.prefilled(child.hidden(hidden))

    def propose(self, context: Sequence[int], budget: int) -> Draft | None:
        """The step's draft, at most ``budget`` nodes (a child may offer a larger tree:
        the cut keeps its likeliest nodes); None for a plain step."""
        now = time.perf_counter()
        self._close_step(now)
        self.store.steps += 1
        self._step += 1
        self._t_step, self._own, self._fwd, self._switch = now, 0.0, 0.0, 0.0
        self._rates = {}
        self._cheap_offers = []
        if budget < 1:
            return self._charge(_Offer(None, None, 0.0), costly=False)
        step_ms = self._step_ms(budget)
        cheap, pool = self._split(step_ms[0], budget)
        best = _Offer(None, None, 1.0 / step_ms[0])
        for child in cheap:
            if not child.backoff.due(self.store.steps):
                continue
            offer = self._ask(child, context, budget, step_ms)
            self._cheap_offers.append(offer)
            if offer.draft is not None and offer.value > best.value:
                best = offer
            if offer.draft is not None and offer.value * step_ms[len(offer.draft)] >= ENOUGH:
                break  # the later (costlier) ones would cost more time than they could add
        costly = self._pick_costly(best, pool)
        if costly is None:
            return self._charge(best, costly=False)
        chain = self._chain_budget(costly, budget, step_ms)
        return self._charge(self._ask(costly, context, chain, step_ms), costly=True)

    def observe(self, result: StepResult) -> None:
        if result.forward_ms > 0:
            self.store.costs.add(result.forward_tokens, result.forward_ms)
            self._fwd = result.forward_ms
        self._tokens = len(result.tokens)
        verified = result.draft is not None and len(result.draft) > 0
        if verified:
            assert result.draft is not None
            for book in _both(self.doc, self.glob):
                book.accept.learn(result.draft, result.accepted, self.store.steps)
        chosen = self.children.get(self.choice)
        if chosen is not None and verified and not self._costly and result.accepted_len:
            chosen.backoff.win()
        self._shadow(result, chosen if verified else None)
        t0 = time.perf_counter()
        for child in self.children.values():
            if child is chosen:
                child.p.observe(child.result(result))
            else:
                child.p.follow(child.result(result))
        self._own += (time.perf_counter() - t0) * 1000

    def _shadow(self, result: StepResult, verified: _Child | None) -> None:
        """Count the cheap drafts asked for this step against the tokens it produced
        (``acceptance.walk``), where they were not verified: a proposer that lost the step
        to another (or whose draft was cut away) learns what its draft would have got, and
        the one verified learns the nodes past its cut that the bonus token decides. So a
        source whose first drafts of a request were rejected (an edit's first changed
        line) wins its steps back once the text follows it again, and a chain that is
        accepted whole is tried one node deeper the next step (else short drafts of the
        old region, accepted whole, would stay short for many steps of an edit that long
        drafts finish in a few). One that would have had a token accepted ends its
        back-off."""
        if not result.tokens:
            return
        for offer in self._cheap_offers:
            child, full = offer.child, offer.full
            if child is None or full is None:
                continue
            counted: Collection[int] = ()
            if child is verified:
                cut = result.draft
                if cut is None or cut.origin is None or cut.origin[0] is not full:
                    continue  # verified whole (or not this offer's): counted already
                counted = set(cut.origin[1])
            hits = walk(full, result.tokens)
            for book in _both(self.doc, self.glob):
                book.accept.learn(full, hits, self.store.steps, len(result.tokens), counted)
            if hits and child is not verified:
                child.backoff.win()

    # -- a step ----------------------------------------------------------------------

    def _step_ms(self, budget: int) -> list[float]:
        """``[k]``: expected ms of a step verifying ``k`` draft nodes (0: a plain step)."""
        table = self.store.costs.table(budget + 1)
        rest = self.store.rest.value
        return [table[1 + k] + rest for k in range(budget + 1)]

    def _split(self, plain_ms: float, budget: int) -> tuple[list[_Child], list[str]]:
        """(the cheap proposers: own time for a draft of the size they offer (at most
        ``budget`` nodes) at most :data:`CHEAP` of a plain step, or not measured yet; the
        names of the costly)."""
        cheap, costly = [], []
        for child in self.children.values():
            own = self.store.own.get(child.name)
            # at the size it offers, not the line's extrapolation to the whole budget: an
            # n-gram draft's time grows with its nodes, and one slow ask early in a
            # request would price a 64-node budget over CHEAP; costly, the proposer would
            # be judged by its first steps' speed and retired for the whole edit
            if (
                own is None
                or not own.measured
                or own.at(min(budget, max(1.0, own.mean_n))) <= CHEAP * plain_ms
            ):
                cheap.append(child)
            else:
                costly.append(child.name)
        return cheap, costly

    def _ask(
        self, child: _Child, context: Sequence[int], budget: int, step_ms: list[float]
    ) -> _Offer:
        """Ask ``child`` for a draft (timed) and cut it to the part worth verifying. Its
        catching up is its own time when it was asked the step before too (a step's worth
        of queued work), else a switching cost, timed apart."""
        caught = 0.0
        catch_up = getattr(child.p, "catch_up", None)
        if catch_up is not None:
            t0 = time.perf_counter()
            catch_up(context)
            caught = (time.perf_counter() - t0) * 1000
            if child.asked_at != self._step - 1:
                self._switch += caught
                caught = 0.0
        child.asked_at = self._step
        t0 = time.perf_counter()
        draft = child.p.propose(context, budget)
        ms = (time.perf_counter() - t0) * 1000 + caught
        self._own += ms
        nodes = len(draft) if draft is not None else 0
        if child.asked:  # a first ask's catching up on the prompt is not a step's cost
            self.store.own.setdefault(child.name, Line()).add(nodes, ms)
        child.asked = True
        if draft is None or not nodes:
            return _Offer(child, None, 1.0 / step_ms[0])
        child.source = draft.source(0)
        chances = node_chances(draft, self._rate)
        keep, value = best_cut(chances, budget, step_ms)
        if not keep:
            return _Offer(child, None, value, full=draft)
        cut = draft if len(keep) == len(draft) else draft.select(keep)
        cut.chances = [chances[k] for k in keep]
        return _Offer(child, cut, value, full=draft)

    def _charge(self, offer: _Offer, costly: bool) -> Draft | None:
        """Put the offer's proposer (or a plain step) in charge; back off the cheap
        proposers whose drafts were not worth verifying."""
        self.choice = offer.child.name if offer.child is not None else "plain"
        self.choices[self.choice] = self.choices.get(self.choice, 0) + 1
        self._costly = costly
        for o in self._cheap_offers:
            if o.offered and o.draft is None and o.child is not None:
                o.child.backoff.lose(self.store.steps)
        if costly and offer.child is not None:  # its gap counts from here
            gap = self._gap(offer.child.name)
            gap.until = max(gap.until, self.store.steps + (gap.pause or gap.first))
        return offer.draft

    def _close_step(self, now: float) -> None:
        """Credit the step that just ended (propose to propose): the rest of a step, and
        the tokens and ms to whoever was in charge; a proposer's catching up after steps
        it was not asked counts for neither (a switching cost: counted in a trial's few
        steps, it would price EAGLE, which drafts a little faster than plain decoding, far
        below it, and retire it)."""
        if not self._t_step or not self._tokens:
            return
        ms = (now - self._t_step) * 1000 - self._switch
        self.store.rest.add(max(0.0, ms - self._fwd - self._own))
        if self.choice != "plain":
            for book in _both(self.doc, self.glob):
                book.note(self.choice, self._tokens, ms)
        self._tokens = 0

    # -- figures ---------------------------------------------------------------------

    def _rate(self, key: Key) -> float:
        """A node key's acceptance rate (cached for the step): the document's counts pulled
        towards the engine's, pulled towards the prior: the rate the proposer declares for
        that depth where it does (``prior_acceptance``), else for depth 1 the fixed one,
        deeper the rate of the same key one level shallower (for a sampled class, a
        declared or depth-1 prior through greedy's rate, times :data:`TEMPERATURE_PRIOR`)."""
        r = self._rates.get(key)
        if r is None:
            r = self._rates[key] = self._estimate(key)
        return r

    def _estimate(self, key: Key) -> float:
        now = self.store.steps
        source, match, depth, later = key
        declared = self._declared(source, depth, later)
        if depth > 1 and declared is None:
            base = self._rate((source, match, depth - 1, later))
        else:
            first = declared if declared is not None else prior(key)
            if self.tclass == "greedy":
                base = first
            else:
                greedy = self.store.engine_wide.get("greedy")
                base = first if greedy is None else greedy.accept.rate(key, now, first)
                base *= TEMPERATURE_PRIOR
        r = self.glob.accept.rate(key, now, base)
        return r if self.doc is self.glob else self.doc.accept.rate(key, now, r)

    def _declared(self, source: str, depth: int, later: bool) -> float | None:
        """The rate the proposer behind ``source`` declares for a first child at depth
        bucket ``depth`` (buckets 1-4 are depths 1-4); None where it declares none."""
        rates = self.declared.get(source.partition(":")[0], ())
        return rates[depth - 1] if not later and depth <= min(4, len(rates)) else None

    def _speed(self, name: str) -> float | None:
        """A proposer's realised tokens per ms: the document's, else the engine's, else
        (sampled) greedy's discounted; None when measured over fewer than a trial's steps
        (its first steps pay for a warm-up, a prompt's worth of catching up)."""
        for book in (self.doc, self.glob):
            rate = book.rate(name, TRIAL_STEPS)
            if rate is not None:
                return rate
        greedy = self.store.engine_wide.get("greedy")
        if self.tclass != "greedy" and greedy is not None:
            rate = greedy.rate(name, TRIAL_STEPS)
            if rate is not None:
                return rate * TEMPERATURE_PRIOR
        return None

    # -- costly proposers ------------------------------------------------------------

    def _pick_costly(self, best: _Offer, pool: list[str]) -> _Child | None:
        """The costly proposer (of ``pool``) to put in charge this step, or None (``best``
        stands)."""
        if self.trial is not None:
            name, left = self.trial
            self.trial = (name, left - 1) if left > 1 else None
            if name in self.children:
                return self.children[name]
        rival, rival_speed = None, best.value * (1 + MARGIN)
        for name in pool:
            speed = self._speed(name)
            if speed is not None and speed > rival_speed and name not in self.store.returning:
                rival, rival_speed = name, speed
        if rival is not None:
            self._gap(rival).win()
            return self.children[rival]
        if best.child is not None:
            return None
        return self._trial(pool, best.value)

    def _trial(self, pool: list[str], best_value: float) -> _Child | None:
        """With no offer worth taking: try a costly proposer that is unmeasured, back
        from retirement or whose gap is over; retire one far behind."""
        steps = self.store.steps
        for name in pool:
            speed = None if name in self.store.returning else self._speed(name)
            if speed is not None and speed < CLOSE * best_value:
                self.store.retire(name, FIRST_PAUSE, MAX_PAUSE)
                del self.children[name]  # not kept in step for the rest of this request either
                continue
            gap = self._gap(name)
            if speed is None or gap.due(steps):
                self.store.returning.discard(name)
                if speed is not None:
                    gap.lose(steps)
                self.trial = (name, TRIAL_STEPS - 1)
                return self.children[name]
        return None

    def _gap(self, name: str) -> Backoff:
        return self.store.gaps.setdefault(name, Backoff(FIRST_GAP, MAX_GAP))

    def _chain_budget(self, child: _Child, budget: int, step_ms: list[float]) -> int:
        """The chain length with the most expected tokens per ms, ``child``'s own time
        (by the nodes it offers) included; at least 1."""
        own = self.store.own.get(child.name) or Line()
        costs = [ms + own.at(k) for k, ms in enumerate(step_ms)]
        chances: list[float] = []
        for d in range(1, budget + 1):
            key = (child.source, 0, depth_bucket(d), False)
            chances.append(self._rate(key) * (chances[-1] if chances else 1.0))
        keep, _ = best_cut(chances, budget, costs)
        return max(1, len(keep))


def _both(doc: Book, glob: Book) -> tuple[Book, ...]:
    return (doc,) if doc is glob else (doc, glob)
