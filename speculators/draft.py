"""Drafts, step results and the proposer interface.

A draft is a tree of guessed tokens hanging off the *root*: the last token of
the context, which the engine has sampled but not yet fed to the model. A
chain is a tree whose parents are ``i - 1``. Node ``i`` has ``parents[i] == -1``
when it is a child of the root.

Every proposer answers the same three calls, even where one is a no-op:

- ``begin(request)``  a new request starts (prompt ids, document uri, params).
- ``propose(context, budget) -> Draft | None``  ``context`` is every token of
  the request so far (prompt + generated, the root last); ``budget`` is the
  most draft tokens the engine will verify this step. ``None`` or an empty
  draft means "plain decode step".
- ``observe(result)``  what the target accepted, for adaptive lengths and
  acceptance statistics.

This module knows nothing about models or tokenizers.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch


@dataclass
class Draft:
    """Token ids, parent index per token, optional draft probabilities, source per token.

    ``probs[i]`` is the draft distribution q(. | path to node i's parent) the token
    was *sampled* from, shape ``(V,)``; ``None`` marks a deterministic draft
    (q = 1 on the token), which is what n-gram, lookahead and top-k tree drafts
    are.
    """

    tokens: list[int]
    parents: list[int] | None = None
    probs: list[torch.Tensor | None] | None = None
    sources: list[str] | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if self.parents is None:
            self.parents = list(range(-1, n - 1))
        if len(self.parents) != n:
            raise ValueError("parents and tokens differ in length")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"parent {p} of node {i} must be -1 or an earlier node")
        if self.sources is not None and len(self.sources) != n:
            raise ValueError("sources and tokens differ in length")
        if self.probs is not None and len(self.probs) != n:
            raise ValueError("probs and tokens differ in length")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        assert self.parents is not None
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def depth(self) -> int:
        """Nodes on the longest root-to-leaf path (0 for an empty draft).

        >>> Draft([5, 6, 7, 8], [-1, 0, 1, 0]).depth
        3
        """
        assert self.parents is not None
        levels: list[int] = []
        for p in self.parents:
            levels.append(1 if p < 0 else levels[p] + 1)
        return max(levels, default=0)

    def children(self) -> dict[int, list[int]]:
        """Map node index (-1 = root) to its children, in draft order."""
        out: dict[int, list[int]] = {}
        assert self.parents is not None
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
        return out

    def source(self, i: int) -> str:
        return self.sources[i] if self.sources else "draft"

    @staticmethod
    def chain(tokens: Sequence[int], source: str = "draft") -> Draft:
        toks = list(tokens)
        return Draft(toks, sources=[source] * len(toks))

    @staticmethod
    def from_paths(paths: Sequence[tuple[Sequence[int], str]]) -> Draft:
        """A tree from several candidate continuations, sharing common prefixes.

        >>> d = Draft.from_paths([([5, 6, 7], "a"), ([5, 8], "b")])
        >>> d.tokens, d.parents
        ([5, 6, 7, 8], [-1, 0, 1, 0])
        """
        tokens: list[int] = []
        parents: list[int] = []
        sources: list[str] = []
        node_of: dict[tuple[int, int], int] = {}
        for path, source in paths:
            parent = -1
            for tok in path:
                key = (parent, int(tok))
                node = node_of.get(key)
                if node is None:
                    node = len(tokens)
                    node_of[key] = node
                    tokens.append(int(tok))
                    parents.append(parent)
                    sources.append(source)
                parent = node
        return Draft(tokens, parents, sources=sources)

    def truncated(self, budget: int) -> Draft:
        """The first ``budget`` nodes (parents always precede children, so it stays a tree)."""
        if budget >= len(self.tokens):
            return self
        assert self.parents is not None
        return Draft(
            self.tokens[:budget],
            self.parents[:budget],
            self.probs[:budget] if self.probs is not None else None,
            self.sources[:budget] if self.sources is not None else None,
        )


@dataclass
class StepResult:
    """The outcome of verifying one draft.

    ``accepted`` lists the accepted draft nodes, root to leaf; the bonus token is
    the target's own token after them and is *not* counted in ``accepted``.
    """

    draft: Draft | None
    accepted: list[int]
    bonus: int
    tokens: list[int] = field(default_factory=list)  # accepted draft tokens + bonus
    # The verify forward's rows (row 0 = root, row i + 1 = draft node i): logits (R, V) and,
    # when the proposer asked for taps, hidden states (R, len(taps), H). Proposers that
    # learn from the target (lookahead's Jacobi window, EAGLE's head) read them here.
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    # The verify forward's wall time (ms, the verification included) and the number of
    # tokens it fed: what the policy's cost model learns from.
    forward_ms: float = 0.0
    forward_tokens: int = 0

    @property
    def accepted_len(self) -> int:
        """Accepted draft tokens, bonus token not counted."""
        return len(self.accepted)


@dataclass
class RequestInfo:
    """What a proposer may know about the request it serves."""

    prompt_ids: list[int]
    uri: str | None = None
    temperature: float = 0.0
    max_tokens: int = 0
    kind: str = "generate"  # generate | complete | edit
    draft_text_ids: list[int] | None = None  # edits: the old region or the prediction


class Proposer(Protocol):
    """``taps`` (optional attribute): decoder layers whose hidden states the proposer
    wants in :class:`StepResult` (see ``Runner.forward``); absent or empty means none.
    A proposer with taps may also define ``prefilled(hidden)``: called once per
    request after the prefill with the taps of every prompt position,
    ``(P, len(taps), H)``, cached positions included.

    ``follow(result)`` (optional): the speculation policy ("auto") calls it instead of
    ``observe`` on the proposers that were not in charge of a step, whose draft came
    from another proposer; it keeps the proposer's state in step with the accepted
    tokens without touching its acceptance statistics. A proposer without it is
    restarted from the context when the policy next puts it in charge."""

    name: str

    def begin(self, request: RequestInfo) -> None: ...

    def propose(self, context: Sequence[int], budget: int) -> Draft | None: ...

    def observe(self, result: StepResult) -> None: ...


R = TypeVar("R")


class RuntimeCache(Generic[R]):
    """What a proposer loads from a folder beside the model (a head, a draft model),
    loaded once per engine and folder and dropped with the engine."""

    def __init__(self) -> None:
        self._by_engine: weakref.WeakKeyDictionary[Any, dict[str, R]] = weakref.WeakKeyDictionary()

    def get(self, engine: Any, where: Path, load: Callable[[], R]) -> R:
        """The runtime of ``engine`` for folder ``where``; ``load()`` makes it the first time."""
        cache = self._by_engine.setdefault(engine, {})
        key = str(where.resolve())
        if key not in cache:
            cache[key] = load()
        return cache[key]


class MissingWeights(LookupError):
    """A model proposer (EAGLE, Medusa, draft model) has no weights for this model: nothing
    at ``where``, the folder beside the model it reads them from. A ``LookupError``, so the
    daemon answers ``bad_params`` and ``auto`` leaves the proposer out.

    Message: ``no <kind> weights for this model (<where>: not found; <how>)``.
    """

    def __init__(self, kind: str, where: str | Path, how: str) -> None:
        self.kind, self.where = kind, Path(where)
        super().__init__(f"no {kind} weights for this model ({where}: not found; {how})")
