"""Lossless verification of a draft tree against the target's logits.

Row layout of ``logits`` (``(1 + len(draft), V)``): row 0 is the root (the
last context token, fed this step), row ``i + 1`` is draft node ``i``. Row r
holds the target's distribution for the token *after* that row's token.

- Greedy: walk from the root; at each node take the target's argmax and move
  to the child carrying that token (ACCEPT) until no child does (REJECT); the
  argmax there is the BONUS token. The output is token-for-token what plain
  greedy decoding produces.
- Sampling: recursive rejection sampling over the children of each node
  (SpecInfer's multi-candidate form). A child x drawn from q is accepted with
  probability min(1, p(x) / q(x)); on rejection the target distribution
  becomes the residual norm(max(p - q, 0)) and the next sibling is tried;
  when every child is rejected the BONUS token is sampled from the residual.
  Deterministic drafts (n-gram, lookahead, top-k tree nodes) have q = 1 on
  their token, so acceptance is p(x) and the residual is p with x removed.
  Either way the emitted tokens follow the target distribution exactly.

This module knows nothing about models, caches or tokenizers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from codespec.speculators.draft import Draft

# The nucleus is looked for among the likeliest tokens first (partial sorts of these
# many); only rows whose likeliest NUCLEUS_FIRST[-1] tokens hold less than ``top_p`` are
# sorted whole. A full sort of a vocabulary's row costs many times the first partial
# one, and at temperature 0.8 the likeliest 1,024 tokens hold nearly all of a code
# model's mass (at 1.5 clearly less).
NUCLEUS_FIRST = (1024, 8192)


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution per row: softmax(logits / T), restricted to the top-p nucleus.

    ``logits`` is ``(R, V)``; the result is ``(R, V)`` fp32 and each row sums to 1.
    The nucleus keeps the smallest set of most likely tokens whose mass reaches
    ``top_p`` (the most likely token is always kept).
    """
    probs = torch.softmax(logits.float() / max(temperature, 1e-6), dim=-1)
    if top_p < 1.0:
        sorted_p, order = _likeliest(probs, top_p)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _likeliest(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's likeliest tokens, most likely first (values, indices): the first
    NUCLEUS_FIRST that hold ``top_p`` of every row's mass, else every token."""
    for k in NUCLEUS_FIRST:
        if k < probs.shape[-1]:
            sorted_p, order = probs.topk(k, dim=-1)
            if bool((sorted_p.sum(-1) >= top_p).all()):
                return sorted_p, order
    return probs.sort(dim=-1, descending=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from ``probs`` (``(V,)``, non-negative, not all zero): inverse
    transform sampling, one uniform draw against the float64 running sum. A token of
    probability 0 is never drawn. (``torch.multinomial`` costs many times as much a draw
    over a large vocabulary, where it would be a sampled step's largest cost after the
    forward.)"""
    cdf = probs.double().cumsum(0)
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    i = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64),
                               right=True))  # fmt: skip
    if i >= probs.shape[0]:  # u * total rounded up to the total: the last token drawable
        i = int(torch.nonzero(probs > 0)[-1])
    return i


def verify_greedy(
    draft: Draft | None, logits: torch.Tensor, best: Sequence[int] | None = None
) -> tuple[list[int], int]:
    """Return (accepted draft nodes root→leaf, bonus token) under greedy decoding.
    ``best``: each row's ``argmax`` when the caller has it already (a faster kernel's)."""
    if best is None:
        best = logits.argmax(dim=-1).tolist()
    if draft is None or len(draft) == 0:
        return [], best[0]
    children = draft.children()
    accepted: list[int] = []
    node = -1
    while True:
        want = best[node + 1]
        nxt = next((c for c in children.get(node, ()) if draft.tokens[c] == want), None)
        if nxt is None:
            return accepted, want
        accepted.append(nxt)
        node = nxt


def verify_sampling(
    draft: Draft | None,
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Return (accepted draft nodes root→leaf, bonus token) by rejection sampling."""
    if draft is None or len(draft) == 0:
        return [], sample(target_probs(logits[:1], temperature, top_p)[0], generator)
    rows: dict[int, torch.Tensor] = {}

    def row(r: int) -> torch.Tensor:  # the walk reads only the rows of the path it takes
        if r not in rows:
            rows[r] = target_probs(logits[r : r + 1], temperature, top_p)[0]
        return rows[r]

    children = draft.children()
    accepted: list[int] = []
    node = -1
    while True:
        p = row(node + 1).clone()
        moved = False
        for c in children.get(node, ()):
            x = draft.tokens[c]
            q = draft.probs[c] if draft.probs is not None else None
            px = float(p[x])
            qx = 1.0 if q is None else float(q[x])
            u = float(torch.rand((), generator=generator))
            if qx > 0 and u < min(1.0, px / qx):
                accepted.append(c)
                node = c
                moved = True
                break
            # REJECT: move to the residual distribution and try the next sibling.
            if q is None:
                p[x] = 0.0
            else:
                p = torch.clamp(p - q.to(p), min=0.0)
            total = float(p.sum())
            if total <= 0.0:  # only reachable through rounding: fall back to the target row
                p = row(node + 1).clone()
            else:
                p = p / total
        if not moved:
            return accepted, sample(p, generator)


def verify(
    draft: Draft | None,
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    best: Sequence[int] | None = None,
) -> tuple[list[int], int]:
    """Greedy at temperature 0 (``best``: the rows' argmax, when the caller has it),
    rejection sampling otherwise."""
    if temperature <= 0.0:
        return verify_greedy(draft, logits, best)
    return verify_sampling(draft, logits, temperature, top_p, generator)
