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
from codespec.speculators.target import TargetModel

__all__ = ["FACTORIES", "UnknownProposer", "build", "choices", "known", "make_proposer", "names"]

Factory = Callable[[TargetModel | None, Any], Proposer]


def _ngram(target: TargetModel | None, index: Any) -> Proposer:
    from codespec.speculators.ngram import NgramProposer

    return NgramProposer(index=index)


def _lookahead(target: TargetModel | None, index: Any) -> Proposer:
    from codespec.speculators.lookahead import make

    return make(target, index)


def _eagle(target: TargetModel | None, index: Any) -> Proposer:
    from codespec.speculators.eagle import EagleProposer

    return EagleProposer.load(target)


# In the order auto asks them: the cheapest first.
FACTORIES: dict[str, Factory] = {"ngram": _ngram, "lookahead": _lookahead, "eagle": _eagle}


class UnknownProposer(ValueError):
    pass


def names() -> list[str]:
    return ["off", "auto", *FACTORIES]


def _left_out(name: str) -> tuple[str, ...] | None:
    """``auto-A-B``: auto without proposers A and B (for side-by-side measurements, e.g.
    ``auto-eagle``); None for any other name or one naming no proposer."""
    if not name.startswith("auto-"):
        return None
    parts = tuple(name.split("-")[1:])
    return parts if parts and all(p in FACTORIES and p != "ngram" for p in parts) else None


def known(name: str) -> bool:
    """Whether ``make_proposer`` takes ``name``: one of :func:`names`, or ``auto-A-B``
    (auto leaving out proposers A and B; n-gram always stays)."""
    return name in names() or _left_out(name) is not None


def choices() -> str:
    """What :func:`known` takes, in words for an error message."""
    return ", ".join([*names(), "auto-NAME"])


def build(name: str, target: TargetModel | None = None, index: Any = None) -> Proposer:
    """The bare proposer ``name`` (no policy: it drafts every step, all it can).

    A model proposer without weights for ``target``'s model raises
    :class:`~codespec.speculators.draft.MissingWeights` (``no eagle weights for this model
    (MODEL/eagle: not found; train them with ...)``), one whose weights do not fit the
    model another ``LookupError``."""
    factory = FACTORIES.get(name)
    if factory is None:
        raise UnknownProposer(f"unknown speculation {name!r}; choose one of {', '.join(names())}")
    return factory(target, index)


def make_proposer(
    name: str, target: TargetModel | None = None, index: Any = None
) -> Controller | None:
    """The policy's controller for ``name``; ``None`` for "off" (plain decoding)."""
    if name == "off":
        return None
    if name == "auto":
        return _auto(target, index)
    left_out = _left_out(name)
    if left_out is not None:
        return _auto(target, index, left_out)
    return Controller(target, {name: build(name, target, index)}, store_for(target), name=name)


def _auto(target: TargetModel | None, index: Any, left_out: tuple[str, ...] = ()) -> Controller:
    """The controller over the n-gram proposer and every other proposer ``target``'s model
    has (one without weights is left out and the store says why; a retired one is not
    built; ``left_out`` ones are not built). Without a target (nothing to measure or read
    states from): n-gram only."""
    store = store_for(target)
    children: dict[str, Proposer] = {"ngram": build("ngram", target, index)}
    for name in FACTORIES:
        if target is None or name in children or name in left_out:
            continue
        if store.available.get(name) is False or not store.usable(name):
            continue
        try:
            children[name] = build(name, target, index)
            store.available[name] = True
        except (LookupError, ValueError, ImportError) as exc:  # no weights for this model
            store.available[name] = False
            store.why[name] = str(exc)
    return Controller(target, children, store, name="-".join(("auto", *left_out)))
