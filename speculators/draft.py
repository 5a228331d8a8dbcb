"""Drafts, step results and the proposer interface.

A draft is a tree of guessed tokens hanging off the *root*: the last token of
the context, which the engine has sampled but not yet fed to the model. A
chain is a tree whose parents are ``i - 1``. Node ``i`` has ``parents[i] == -1``
when it is a child of the root.

Every proposer answers the same four calls, even where one is a no-op:

- ``begin(request)``  a new request starts (prompt ids, document uri, params).
- ``propose(context, budget) -> Draft | None``  ``context`` is every token of
  the request so far (prompt + generated, the root last); ``budget`` is the
  most draft tokens verified this step. A tree may offer more (the policy keeps
  the likeliest nodes, at most ``budget``; a caller without a policy keeps the
  first ``budget``, so the likeliest path goes first). ``None`` or an empty
  draft means "nothing to offer".
- ``observe(result)``  the step that verified (part of) its draft: what the
  target accepted, and the verify forward's rows.
- ``follow(result)``  a step another proposer drafted (or a plain step): keep
  in step with the accepted tokens.

Proposers are thin: they propose from what they see and keep in step with what
was accepted. Whether a draft is worth verifying, how much of it, which
proposer to ask and when to stop asking are the policy's (``policy.py``),
measured in one place.

This module knows nothing about models or tokenizers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

# Draft sources whose proposer reads the verify forward's logits at its nodes after the
# step (lookahead's window: its Jacobi update). A greedy verification of a draft without
# them reads only the accepted path's rows, so the runner may stop its LM head at the
# row where that path ends (``Runner.forward``'s ``greedy``).
ROW_READERS: set[str] = set()


@dataclass
class Draft:
    """Token ids, parent index per token, optional draft probabilities, source per token.

    ``probs[i]`` is the draft distribution q(. | path to node i's parent) the token
    was *sampled* from, shape ``(V,)``; ``None`` marks a deterministic draft
    (q = 1 on the token), which is what n-gram, lookahead and top-k tree drafts
    are.

    ``match``: for a draft copied from earlier text, the length of the longest
    match behind it (the policy keys its acceptance figures on it); 0 otherwise.
    ``matches``: the same per node, where the paths of a tree were copied after
    matches of different lengths (``None``: every node's is ``match``).
    ``chances``: each node's chance of being accepted, where the policy estimated them
    (its cut: :meth:`past`).
    ``origin``: for a draft the policy cut out of a proposer's draft
    (:meth:`select`), that draft and the index there of each node.
    """

    tokens: list[int]
    parents: list[int] | None = None
    probs: list[torch.Tensor | None] | None = None
    sources: list[str] | None = None
    match: int = 0
    matches: list[int] | None = None
    chances: list[float] | None = field(default=None, compare=False)
    origin: tuple[Draft, list[int]] | None = field(default=None, repr=False, compare=False)
    # the policy's key of each node (acceptance.node_keys), made once per draft
    node_keys: list | None = field(default=None, init=False, repr=False, compare=False)

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
        if self.matches is not None and len(self.matches) != n:
            raise ValueError("matches and tokens differ in length")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        assert self.parents is not None
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def reads_rows(self) -> bool:
        """Whether a proposer reads the verify rows of its nodes (see ROW_READERS)."""
        return self.sources is not None and any(s in ROW_READERS for s in self.sources)

    @property
    def levels(self) -> list[int]:
        """Each node's depth (1: a child of the root).

        >>> Draft([5, 6, 7, 8], [-1, 0, 1, 0]).levels
        [1, 2, 3, 2]
        """
        assert self.parents is not None
        levels: list[int] = []
        for p in self.parents:
            levels.append(1 if p < 0 else levels[p] + 1)
        return levels

    @property
    def depth(self) -> int:
        """Nodes on the longest root-to-leaf path (0 for an empty draft)."""
        return max(self.levels, default=0)

    def select(self, keep: Sequence[int]) -> Draft:
        """The nodes ``keep`` (ascending; each one's parent among them or the root) as a
        draft of their own that remembers where they came from (``origin``).

        >>> d = Draft([5, 6, 7, 8], [-1, 0, 1, 0]).select([0, 3])
        >>> d.tokens, d.parents, d.origin[1]
        ([5, 8], [-1, 0], [0, 3])
        """
        assert self.parents is not None
        keep = list(keep)
        new = {old: i for i, old in enumerate(keep)}
        parents = [new[self.parents[k]] if self.parents[k] >= 0 else -1 for k in keep]
        return Draft(
            [self.tokens[k] for k in keep],
            parents,
            [self.probs[k] for k in keep] if self.probs is not None else None,
            [self.sources[k] for k in keep] if self.sources is not None else None,
            match=self.match,
            matches=[self.matches[k] for k in keep] if self.matches is not None else None,
            origin=(self, keep),
        )

    def children(self) -> dict[int, list[int]]:
        """Map node index (-1 = root) to its children, in draft order."""
        out: dict[int, list[int]] = {}
        assert self.parents is not None
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
        return out

    def past(self, nodes: int) -> float | None:
        """The chance that greedy verification accepts a node after the first ``nodes``
        (its walk follows one path: the sum over the first such node of each path); None
        without ``chances``.

        >>> Draft([5, 6, 7, 8], [-1, 0, 1, 0], chances=[0.9, 0.5, 0.4, 0.05]).past(2)
        0.45
        """
        if self.chances is None:
            return None
        assert self.parents is not None
        return sum(c for i, (p, c) in enumerate(zip(self.parents, self.chances, strict=True))
                   if i >= nodes and p < nodes)  # fmt: skip

    def source(self, i: int) -> str:
        return self.sources[i] if self.sources else "draft"

    def match_at(self, i: int) -> int:
        """The match behind node ``i`` (see ``matches``)."""
        return self.matches[i] if self.matches is not None else self.match

    @staticmethod
    def chain(tokens: Sequence[int], source: str = "draft") -> Draft:
        toks = list(tokens)
        return Draft(toks, sources=[source] * len(toks))

    @staticmethod
    def from_paths(
        paths: Sequence[tuple[Sequence[int], str]], matches: Sequence[int] | None = None
    ) -> Draft:
        """A tree from several candidate continuations, sharing common prefixes; with
        ``matches`` (one per path: the match it was copied after), a shared node keeps
        the longest (so ``match`` is the longest of all).

        >>> d = Draft.from_paths([([5, 6, 7], "a"), ([5, 8], "b")], [2, 6])
        >>> d.tokens, d.parents, d.matches, d.match
        ([5, 6, 7, 8], [-1, 0, 1, 0], [6, 2, 2, 6], 6)
        """
        tokens: list[int] = []
        parents: list[int] = []
        sources: list[str] = []
        per_node: list[int] = []
        node_of: dict[tuple[int, int], int] = {}
        for j, (path, source) in enumerate(paths):
            n = matches[j] if matches is not None else 0
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
                    per_node.append(n)
                else:
                    per_node[node] = max(per_node[node], n)
                parent = node
        if matches is None:
            return Draft(tokens, parents, sources=sources)
        return Draft(tokens, parents, sources=sources, match=max(per_node, default=0),
                     matches=per_node)  # fmt: skip

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
            match=self.match,
            matches=self.matches[:budget] if self.matches is not None else None,
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
    # learn from the target (lookahead's Jacobi window, EAGLE's head) read them here; a
    # draft whose logit rows are read must say so (ROW_READERS): for other greedy drafts
    # the logits may end at the row where the accepted path ends.
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    # The verify forward's wall time (ms, the verification included) and the number of
    # tokens it fed: what the policy's cost model learns from.
    forward_ms: float = 0.0
    forward_tokens: int = 0
    # The root was the prompt's last token: the request's first forward, which fed it and
    # verified a draft proposed from the prompt (no prefill gave a first token before it).
    lead: bool = False

    @property
    def accepted_len(self) -> int:
        """Accepted draft tokens, bonus token not counted."""
        return len(self.accepted)

    def rows_of(self, draft: Draft | None) -> dict[int, int]:
        """Node ``i`` of ``draft`` (a proposer's own draft, of which the policy may have
        verified a part) -> its row in ``logits`` / ``hidden``; nodes that were not
        verified are left out."""
        verified = self.draft
        if draft is None or verified is None:
            return {}
        if verified is draft:
            return {i: i + 1 for i in range(len(draft))}
        if verified.origin is not None and verified.origin[0] is draft:
            return {node: row + 1 for row, node in enumerate(verified.origin[1])}
        return {}


@dataclass
class RequestInfo:
    """What a proposer may know about the request it serves."""

    prompt_ids: list[int]
    uri: str | None = None
    temperature: float = 0.0
    max_tokens: int = 0
    kind: str = "generate"  # generate | complete | edit
    draft_text_ids: list[int] | None = None  # edits: the old region or the prediction
    # what earlier requests on this document generated, each after its prompt's last
    # tokens (a typist who types what the ghost text showed asks for it again)
    recent_ids: list[int] | None = None


class Proposer(Protocol):
    """``taps`` (optional attribute): decoder layers whose hidden states the proposer
    wants in :class:`StepResult` (see ``Runner.forward``); absent or empty means none.
    A proposer with taps may also define ``prefilled(hidden)``: called once per
    request after the prefill with the taps of every prompt position,
    ``(P, len(taps), H)``, cached positions included.

    ``prior_acceptance`` (optional attribute): the acceptance its drafts were measured at,
    by depth, each given its parent accepted (a trained head's held-out figures); the
    policy starts its figures for the proposer's first-child nodes there instead of at
    its generic prior.

    A proposer that queues work while it is not asked (EAGLE: the target's states of
    the steps other proposers drafted) may define ``catch_up(context)``: do that work
    now, for ``context``. The policy calls it right before ``propose`` and times it
    apart: a cost of switching to the proposer, paid once however long it then drafts,
    left out of its drafting time and of its measured speed (when it was asked the step
    before too, what it catches up is one step's work: its drafting time).

    The engine drives one proposer per request, the policy (``policy.py``), which
    drives the proposers under it: ``observe`` on the one whose draft a step
    verified, ``follow`` on the others."""

    name: str

    def begin(self, request: RequestInfo) -> None: ...

    def propose(self, context: Sequence[int], budget: int) -> Draft | None: ...

    def observe(self, result: StepResult) -> None: ...

    def follow(self, result: StepResult) -> None: ...


class MissingWeights(LookupError):
    """A model proposer (EAGLE) has no weights for this model: nothing
    at ``where``, the folder beside the model it reads them from. A ``LookupError``, so the
    daemon answers ``bad_params`` and ``auto`` leaves the proposer out.

    Message: ``no <kind> weights for this model (<where>: not found; <how>)``.
    """

    def __init__(self, kind: str, where: str | Path, how: str) -> None:
        self.kind, self.where = kind, Path(where)
        super().__init__(f"no {kind} weights for this model ({where}: not found; {how})")
