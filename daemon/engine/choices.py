"""The model's greedy choices beside a KV cache, for recall.

Owns :class:`Choices`: per cached position, the token greedy decoding chose after it
where a forward computed that position's logits — the unconstrained choice (the
argmax), and for a row a constraint masked (token healing) that mask and the choice
under it. A choice depends only on the tokens up to its position, so a later greedy
request whose prompt the cache holds whole can take it without a forward
(:meth:`codespec.daemon.engine.engine.Engine.stream`'s recall):

- the unconstrained choice, where the request's own mask there (if any) allows it: the
  argmax over a set that holds the overall argmax is that argmax;
- a constrained choice, where the request's mask allows it and allows nothing the
  recorded mask did not: the argmax over a subset that holds the larger set's argmax is
  that argmax (typing inside one token: the backed-off text grows, its set shrinks).

Must not touch: the runner, slots' choice of cache, sampling (greedy only), text.
"""

from __future__ import annotations

import torch

# Constrained choices kept per cache (each holds a vocabulary-wide mask, ~150 KB for
# Qwen2.5): the latest positions, where typing asks again.
KEEP_MASKED = 4


class Choices:
    """Greedy choices after each position of one cache (``-1``: not computed)."""

    def __init__(self, free: list[int] | None = None,
                 masked: dict[int, tuple[torch.Tensor, int]] | None = None) -> None:  # fmt: skip
        self.free: list[int] = free if free is not None else []
        self.masked: dict[int, tuple[torch.Tensor, int]] = dict(masked or {})

    def __len__(self) -> int:
        return len(self.free)

    def copy(self, n: int) -> Choices:
        """The choices of the first ``n`` positions."""
        return Choices(self.free[:n], {p: m for p, m in self.masked.items() if p < n})

    def cut(self, n: int, length: int | None = None) -> None:
        """Keep the first ``n`` positions' choices, then none known up to ``length``."""
        del self.free[n:]
        self.free.extend([-1] * ((length or n) - len(self.free)))
        for p in [p for p in self.masked if p >= n]:
            del self.masked[p]

    def extend(self, free: list[int], masked: dict[int, tuple[torch.Tensor, int]]) -> None:
        """Positions appended: their unconstrained choices, and ``masked`` (position ->
        the mask and the choice under it) where a constraint masked them."""
        self.free.extend(free)
        self.note_masked(masked)

    def note(self, pos: int, free: int, mask: torch.Tensor | None = None, chosen: int = -1) -> None:
        """Position ``pos``'s unconstrained choice, and the choice under ``mask``."""
        if 0 <= pos < len(self.free):
            self.free[pos] = free
            if mask is not None and chosen >= 0:
                self.note_masked({pos: (mask, chosen)})

    def note_masked(self, masked: dict[int, tuple[torch.Tensor, int]]) -> None:
        self.masked.update(masked)
        for p in sorted(self.masked)[:-KEEP_MASKED]:
            del self.masked[p]

    def at(self, pos: int, mask: torch.Tensor | None) -> int:
        """The greedy choice after ``pos`` under ``mask`` (None: unconstrained) where it
        is known (see the module), else -1."""
        free = self.free[pos] if pos < len(self.free) else -1
        if free >= 0 and (mask is None or bool(mask[free])):
            return free
        held = self.masked.get(pos)
        if held is None or mask is None:
            return -1
        wider, tok = held
        if bool(mask[tok]) and wider.shape == mask.shape and not bool((mask & ~wider).any()):
            return tok
        return -1
