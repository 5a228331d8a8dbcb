"""Proposers by name: what ``speculation: "auto" | "off" | NAME`` resolves to.

Owns the table of proposer factories. Each factory takes the engine (for its
tokenizer, model and config) and an optional n-gram index, and returns a fresh
proposer for one request stream. Must not touch decoding itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from codespec.speculators.draft import Proposer

Factory = Callable[[Any, Any], Proposer]


def _ngram(engine: Any, index: Any) -> Proposer:
    from codespec.speculators.ngram import NgramProposer

    return NgramProposer(index=index)


def _eagle(engine: Any, index: Any) -> Proposer:
    from codespec.speculators.eagle import EagleProposer

    return EagleProposer.for_engine(engine)


def _lookahead(engine: Any, index: Any) -> Proposer:
    from codespec.speculators.lookahead import make

    return make(engine, index)


def _draft(engine: Any, index: Any) -> Proposer:
    from codespec.speculators.draft_model import make

    return make(engine, index)


def _medusa(engine: Any, index: Any) -> Proposer:
    from codespec.speculators.medusa import make

    return make(engine, index)


FACTORIES: dict[str, Factory] = {
    "ngram": _ngram,
    "eagle": _eagle,
    "lookahead": _lookahead,
    "draft": _draft,
    "medusa": _medusa,
}

# "auto" is the policy (codespec.speculators.policy): per step, the n-gram proposer,
# a model proposer the engine's model has, or a plain step, by measured value.


class UnknownProposer(ValueError):
    pass


def names() -> list[str]:
    return ["off", "auto", *FACTORIES]


def make_proposer(name: str, engine: Any = None, index: Any = None) -> Proposer | None:
    """A proposer for ``name``; ``None`` for "off" (plain decoding)."""
    if name == "off":
        return None
    if name == "auto":
        from codespec.speculators.policy import make

        return make(engine, index)
    factory = FACTORIES.get(name)
    if factory is None:
        raise UnknownProposer(f"unknown speculation {name!r}; choose one of {', '.join(names())}")
    return factory(engine, index)
