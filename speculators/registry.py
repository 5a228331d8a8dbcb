"""Proposers by name: what ``speculation: "auto" | "off" | NAME`` resolves to.

Owns the table of proposer factories and :func:`make_proposer`. A factory takes
the target model (:class:`~codespec.speculators.target.TargetModel`, the
engine) and an optional n-gram index and returns a fresh proposer for one
request stream. Every name but ``off`` resolves to the policy's
:class:`~codespec.speculators.policy.Controller`: over every proposer the model
has (``auto``) or over the one named, so a proposer used alone is measured,
cut and backed off the same way. Must not touch: decoding itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from codespec.speculators.book import store_for
from codespec.speculators.draft import Proposer
from codespec.speculators.policy import Controller

__all__ = ["FACTORIES", "UnknownProposer", "build", "make_proposer", "names"]

Factory = Callable[[Any, Any], Proposer]


def _ngram(target: Any, index: Any) -> Proposer:
    from codespec.speculators.ngram import NgramProposer

    return NgramProposer(index=index)


def _lookahead(target: Any, index: Any) -> Proposer:
    from codespec.speculators.lookahead import make

    return make(target, index)


def _eagle(target: Any, index: Any) -> Proposer:
    from codespec.speculators.eagle import EagleProposer

    return EagleProposer.load(target)


# In the order auto asks them: the cheapest first.
FACTORIES: dict[str, Factory] = {"ngram": _ngram, "lookahead": _lookahead, "eagle": _eagle}


class UnknownProposer(ValueError):
    pass


def names() -> list[str]:
    return ["off", "auto", *FACTORIES]


def build(name: str, target: Any = None, index: Any = None) -> Proposer:
    """The bare proposer ``name`` (no policy: it drafts every step, all it can).

    A model proposer without weights for ``target``'s model raises
    :class:`~codespec.speculators.draft.MissingWeights` (``no eagle weights for this model
    (MODEL/eagle: not found; train them with ...)``), one whose weights do not fit the
    model another ``LookupError``."""
    factory = FACTORIES.get(name)
    if factory is None:
        raise UnknownProposer(f"unknown speculation {name!r}; choose one of {', '.join(names())}")
    return factory(target, index)


def make_proposer(name: str, target: Any = None, index: Any = None) -> Controller | None:
    """The policy's controller for ``name``; ``None`` for "off" (plain decoding)."""
    if name == "off":
        return None
    if name == "auto":
        return _auto(target, index)
    return Controller(target, {name: build(name, target, index)}, store_for(target), name=name)


def _auto(target: Any, index: Any) -> Controller:
    """The controller over the n-gram proposer and every other proposer ``target``'s model
    has (one without weights is left out and the store says why; a retired one is not
    built). Without a target (nothing to measure or read states from): n-gram only."""
    store = store_for(target)
    children: dict[str, Proposer] = {"ngram": build("ngram", target, index)}
    for name in FACTORIES:
        if target is None or name in children:
            continue
        if store.available.get(name) is False or not store.usable(name):
            continue
        try:
            children[name] = build(name, target, index)
            store.available[name] = True
        except (LookupError, ValueError, ImportError) as exc:  # no weights for this model
            store.available[name] = False
            store.why[name] = str(exc)
    return Controller(target, children, store, name="auto")
