"""What the speculation policy has measured, per target model: the policy's memory.

Owns :class:`PolicyStore` (one per target model, kept in its
``speculator_state``: the forward costs, the rest of
a step, each proposer's own time, which proposers can be built and which are
retired for now, and :class:`Book` s of acceptance and realised speed per
document and engine-wide, per temperature class), the back-off schedule every
pause in the policy follows (:class:`Backoff`) and :func:`measured`, what
``stats`` reports of it. Must not touch: proposers, drafts, decoding.

Temperature: figures are kept apart for greedy, low (<= 0.5) and high
temperatures (rejection sampling accepts less than greedy matching).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from codespec.speculators.acceptance import Acceptance
from codespec.speculators.costs import ForwardCosts, Line
from codespec.speculators.target import StateHolder

__all__ = [
    "Avg",
    "Backoff",
    "Book",
    "PolicyStore",
    "forget",
    "measured",
    "store_for",
    "temperature_class",
]

ALPHA = 0.1  # weight of the newest observation in every moving average
MAX_DOCS = 256  # documents with a book of their own (least recently used dropped)


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
class Backoff:
    """A pause of ``pause`` steps that doubles each time it is lost, from ``first`` to
    ``most``, and starts over once won: ``due(now)`` is false for the ``pause`` steps
    after the one that lost.

    >>> b = Backoff(2, 8)
    >>> b.lose(10); [b.due(t) for t in (11, 12, 13)]
    [False, False, True]
    >>> b.lose(13); b.until, b.pause
    (18, 4)
    """

    first: int
    most: int
    until: int = 0  # the step from which it is due again
    pause: int = 0  # the last pause (0: none since the last win)

    def due(self, now: int) -> bool:
        return now >= self.until

    def lose(self, now: int) -> None:
        self.pause = min(self.most, 2 * self.pause) if self.pause else self.first
        self.until = now + self.pause + 1

    def win(self) -> None:
        self.pause = 0


@dataclass
class Book:
    """The figures of one document (or of the whole engine) for one temperature class:
    per-node acceptance, and per proposer the tokens and ms of the steps it was in charge
    of (its realised speed: mean tokens over mean ms)."""

    accept: Acceptance = field(default_factory=Acceptance)
    tokens: dict[str, Avg] = field(default_factory=dict)
    ms: dict[str, Avg] = field(default_factory=dict)

    def note(self, name: str, tokens: int, ms: float) -> None:
        self.tokens.setdefault(name, Avg()).add(tokens)
        self.ms.setdefault(name, Avg()).add(ms)

    def rate(self, name: str, min_n: int) -> float | None:
        """Tokens per ms of the steps ``name`` was in charge of (None: too few)."""
        tokens, ms = self.tokens.get(name), self.ms.get(name)
        if tokens is None or ms is None or tokens.n < min_n:
            return None
        return tokens.value / max(ms.value, 1e-3)


class PolicyStore:
    """What the policy has learnt on one target model: costs, books, retirements."""

    def __init__(self, costs: ForwardCosts | None = None) -> None:
        self.costs = costs if costs is not None else ForwardCosts()
        self.rest = Avg()  # ms of a step that are neither the forward nor a proposer's
        self.own: dict[str, Line] = {}  # a proposer's time to propose, by nodes offered
        self.docs: OrderedDict[tuple[str, str], Book] = OrderedDict()
        self.engine_wide: dict[str, Book] = {}
        self.available: dict[str, bool] = {}  # proposer name -> could be built
        self.why: dict[str, str] = {}  # proposer name -> why it could not be built
        self.steps = 0  # steps the policy has taken on this target model
        # far losers are not built (nor kept in step) until their pause is over, then get
        # a fresh trial ("returning"); the pause doubles each time
        self.retired: dict[str, Backoff] = {}
        self.pauses: dict[str, int] = {}
        self.returning: set[str] = set()
        self.gaps: dict[str, Backoff] = {}  # costly losers: not tried until due

    def plain_ms(self) -> float:
        """What a plain step costs: a one-token forward and the rest of a step."""
        return self.costs.at(1) + self.rest.value

    def usable(self, name: str) -> bool:
        """Not retired; one whose retirement just ended is marked for a fresh trial."""
        r = self.retired.get(name)
        if r is None:
            return True
        if not r.due(self.steps):
            return False
        del self.retired[name]
        self.returning.add(name)
        return True

    def retire(self, name: str, first: int, most: int) -> None:
        r = self.retired[name] = Backoff(first, most, pause=self.pauses.get(name, 0))
        r.lose(self.steps)
        self.pauses[name] = r.pause

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


def store_for(target: StateHolder | None) -> PolicyStore:
    """The store kept on ``target`` (its ``speculator_state``), made on first use; a fresh
    one each time when there is no target."""
    if target is None:
        return PolicyStore()
    return target.speculator_state.get(PolicyStore)


def forget(target: StateHolder) -> None:
    """Drop what the policy has learnt on ``target`` (its next request starts afresh)."""
    target.speculator_state.drop(PolicyStore)


def measured(target: StateHolder | None) -> dict[str, Any]:
    """What the policy measured on ``target``, for ``stats``: forward ms by size, and per
    temperature class the plain step's ms, each proposer's speed against plain decoding's
    (tokens per ms of the steps it was in charge of, over a plain step's), the retired."""
    store = target.speculator_state.find(PolicyStore) if target is not None else None
    if store is None:
        return {"forward_ms": {}}
    measured_plain = bool(store.costs.known()) and store.rest.n > 0
    plain = store.plain_ms()
    classes: dict[str, Any] = {}
    for tclass, book in store.engine_wide.items():
        rates = {n: book.rate(n, 1) for n in book.tokens}
        classes[tclass] = {
            "plain_step_ms": round(plain, 3) if measured_plain else None,
            "vs_plain": {n: round(r * plain, 3) for n, r in rates.items() if r is not None},
        }
    return {
        "forward_ms": store.costs.as_dict(),
        "classes": classes,
        "retired": sorted(n for n, r in store.retired.items() if not r.due(store.steps)),
        "steps": store.steps,
    }
