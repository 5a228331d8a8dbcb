"""Proposers by name: what ``speculation: "auto" | "off" | NAME`` resolves to.

Owns the table of proposer factories. Each factory takes the engine (for its
tokenizer, model and config) and an optional n-gram index, and returns a fresh
proposer for one request stream. Must not touch decoding itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
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


# The model proposers that read weights from a folder beside the model: name -> the
# function giving that folder (MODEL/eagle, MODEL/medusa, MODEL/draft). Without them,
# ``make_proposer`` raises MissingWeights (a LookupError: the daemon's bad_params) and
# ``auto`` leaves the proposer out.
def _weights_dirs() -> dict[str, Callable[[Any], Path]]:
    from codespec.speculators.draft_model import draft_dir
    from codespec.speculators.eagle import head_dir
    from codespec.speculators.medusa import heads_dir

    return {"eagle": head_dir, "medusa": heads_dir, "draft": draft_dir}


def weights(engine: Any) -> dict[str, Path | None]:
    """Per model proposer that needs weights: the folder holding them beside ``engine``'s
    model, or None when there is none (nothing trained for this model)."""
    out: dict[str, Path | None] = {}
    for name, where in _weights_dirs().items():
        folder = where(engine.model_path)
        out[name] = folder if (folder / "config.json").exists() else None
    return out


class UnknownProposer(ValueError):
    pass


def names() -> list[str]:
    return ["off", "auto", *FACTORIES]


def make_proposer(name: str, engine: Any = None, index: Any = None) -> Proposer | None:
    """A proposer for ``name``; ``None`` for "off" (plain decoding).

    A model proposer without weights for ``engine``'s model raises
    :class:`~codespec.speculators.draft.MissingWeights` (``no eagle weights for this model
    (MODEL/eagle: not found; train them with ...)``), one whose weights do not fit the
    model another ``LookupError``."""
    if name == "off":
        return None
    if name == "auto":
        from codespec.speculators.policy import make

        return make(engine, index)
    factory = FACTORIES.get(name)
    if factory is None:
        raise UnknownProposer(f"unknown speculation {name!r}; choose one of {', '.join(names())}")
    return factory(engine, index)
