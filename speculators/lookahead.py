"""Lookahead (Jacobi) decoding: a window iterated in parallel and an n-gram pool it fills.

Owns: :class:`LookaheadProposer` (the Proposer protocol), the Jacobi window and
its update (:func:`jacobi_step`, a pure function), the n-gram pool
(:class:`NgramPool`) and the bounded per-engine store of pools, one per
document (:class:`PoolStore`, kept in the target's ``speculator_state``:
:func:`store_for`). Must not touch: models,
KV caches, verification, the engine's loop, the index's contents (it only
calls :meth:`NgramIndex.lookup`).

One step builds one draft, verified in the same target forward as every other
draft (the engine derives the 2D attention mask and the positions from the
parent array, position = depth):

- Verification branch, first in draft order so that a tight budget keeps it:
  the pool's continuations of the root token (at most ``G``, each ``N - 1``
  tokens, most recent first), merged into a tree where they share a prefix.
  Source ``lookahead:pool``.
- Lookahead branch (source ``lookahead:window``): ``L <= N - 1`` levels of
  guesses over ``W`` columns; column ``j`` is depth ``j + 1``, i.e. the
  ``j + 1``-th token after the root. Level 0 is a chain hanging off the root
  (``parent(lev0[0]) = root``, ``parent(lev0[j]) = lev0[j - 1]``); a level
  ``l >= 1`` token exists for columns ``j >= l`` and hangs off the diagonal,
  ``parent(lev_l[j]) = lev_{l-1}[j - 1]``. Its ancestors are its diagonal
  trajectory and the level-0 guesses before it, and its depth is its offset
  from the root: LookaheadDecoding's 2D mask, with one parent per node. Every
  window node is also a candidate for the greedy tree verify, which is lossless.

Worked example, ``W = 3``, ``N = 3`` (nodes after a one-candidate pool branch
``P0 P1``)::

    depth:      1      2      3
    pool:       P0  -  P1
    level 0:    a0  -  a1  -  a2        parents: a0 -> root, a1 -> a0, a2 -> a1
    level 1:           b1     b2        parents: b1 -> a0,   b2 -> a1

After the forward (:meth:`LookaheadProposer.observe`), the argmax at each top
level node ``lev_top[j]`` is the next level's guess for column ``j + 1`` (the
Jacobi update; at temperature > 0 too). With all ``N - 1`` levels present, the
diagonal trajectory ``lev_0[j-N+2] .. lev_{N-2}[j]`` plus that new token is an
``N``-gram: it enters the pool under its first token and level 0 is dropped.
While fewer levels exist (a request's first ``N - 2`` steps) the new level is
only stacked on top. Then the window slides by the ``m`` tokens the step
emitted (accepted + the BONUS token): column ``j + m`` becomes column ``j``.
Columns that slide in empty are filled: level 0 with random tokens of the
context (as LookaheadDecoding starts its window), higher levels with the guess
below them in the same column.

The pool (``G`` continuations per first token at most, the most recent wins,
re-adding moves one to the front) is kept per document (``RequestInfo.uri``;
``None`` shares one anonymous pool per engine) across requests, in a store that
lives with the engine and keeps the 64 most recently used documents. It is
seeded from the prompt's own n-grams, grows with every token generated, and,
when an index is given, takes the index's continuations of the root's suffix.

Level 0's empty columns are filled by chaining the pool from the left
neighbour (the root for column 0): its most recent continuation's first token,
else a random context token.

Size: the window has ``sum_{l < L} (W - l)`` nodes, the pool branch at most
``G * (N - 1)``. A budget too small for the whole window narrows it for the
step (fewer columns); columns left out are not updated. Which nodes are worth
verifying is the policy's call (it keeps the part of the draft that pays, from
acceptance it measured per source and depth): window nodes it leaves out are
not updated either, the levels only slide. On a CPU, where every verified row
adds a noticeable part of a plain step's cost and the window's own acceptance is near
zero, that leaves mostly the pool.

Defaults (W = 2, N = 4, G = 2) from ``codespec bench lookahead
/tmp/wl/novel.jsonl --threads 1 --grid ...`` on a small model (2-core CPU) with the
cpu_gemm kernels, empty pools for every decode: a narrow window decodes faster than a
wide one such as 4,6,2 (fewer forwards, but each verify larger), and one window column,
or the pool alone (W = 0), does about as well as 2,4,2.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from codespec.speculators.draft import ROW_READERS, Draft, RequestInfo, StepResult
from codespec.speculators.target import StateHolder

__all__ = [
    "LookaheadProposer",
    "NgramPool",
    "PoolStore",
    "jacobi_step",
    "make",
    "store_for",
    "window_nodes",
]

POOL = "lookahead:pool"
WINDOW = "lookahead:window"
ROW_READERS.add(WINDOW)  # _iterate reads the logits of the window's rows
MAX_DOCUMENTS = 64  # pools kept per engine (least recently used dropped first)

# Defaults: chosen with `codespec bench lookahead /tmp/wl/novel.jsonl --threads 1`.
DEFAULT_W = 2
DEFAULT_N = 4
DEFAULT_G = 2


class NgramPool:
    """Continuations keyed by their first token: at most ``g`` tuples of ``n - 1`` tokens each.

    ``add`` puts a continuation first (the most recent wins; one already there
    moves to the front) and drops the oldest past ``g``.

    >>> pool = NgramPool(n=3, g=2)
    >>> for gram in ([1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 6, 7]):
    ...     pool.add(gram)
    >>> pool.get(1)
    [(6, 7), (2, 3)]
    """

    def __init__(self, n: int, g: int) -> None:
        if n < 2 or g < 0:
            raise ValueError("need n >= 2 and g >= 0")
        self.n = n
        self.g = g
        self.table: dict[int, list[tuple[int, ...]]] = {}

    def add(self, gram: Sequence[int]) -> None:
        """Add an ``n``-gram (``gram[0]`` the key); shorter grams are ignored."""
        if len(gram) < self.n or self.g == 0:
            return
        key = int(gram[0])
        cont = tuple(int(t) for t in gram[1 : self.n])
        conts = self.table.setdefault(key, [])
        if cont in conts:
            conts.remove(cont)
        conts.insert(0, cont)
        del conts[self.g :]

    def add_continuation(self, key: int, cont: Sequence[int]) -> None:
        self.add([key, *cont])

    def extend(self, tokens: Sequence[int], start: int = 0) -> None:
        """Add the ``n``-grams of ``tokens`` starting at ``start ..``, in order (latest wins)."""
        n = self.n
        for p in range(max(0, start), len(tokens) - n + 1):
            self.add(tokens[p : p + n])

    def get(self, key: int) -> list[tuple[int, ...]]:
        return list(self.table.get(int(key), ()))

    def __len__(self) -> int:
        return sum(len(v) for v in self.table.values())


class PoolStore:
    """Pools by ``(document uri, n, g)``, the ``max_documents`` most recently used kept."""

    def __init__(self, max_documents: int = MAX_DOCUMENTS) -> None:
        self.max_documents = max_documents
        self._pools: OrderedDict[tuple[str | None, int, int], NgramPool] = OrderedDict()

    def pool(self, uri: str | None, n: int, g: int) -> NgramPool:
        key = (uri, n, g)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = NgramPool(n, g)
        self._pools.move_to_end(key)
        while len(self._pools) > self.max_documents:
            self._pools.popitem(last=False)
        return pool

    def __len__(self) -> int:
        return len(self._pools)

    def clear(self) -> None:
        """Forget every pool (benchmarks: a timed decode must not reuse an earlier run's)."""
        self._pools.clear()


_NO_ENGINE = PoolStore()  # the pools of proposers made without an engine (tests, benches)


def store_for(engine: StateHolder | None) -> PoolStore:
    """The pool store kept on ``engine`` (its ``speculator_state``), made on first use; one
    shared store when there is no engine."""
    if engine is None:
        return _NO_ENGINE
    return engine.speculator_state.get(PoolStore)


def window_nodes(columns: int, levels: int) -> int:
    """Nodes of a window of ``columns`` columns and ``levels`` levels (level l has columns l..)."""
    return sum(max(0, columns - lev) for lev in range(levels))


Level = list[int | None]  # one token per column (None: unknown, filled before use)


def jacobi_step(
    levels: list[Level], new: Level, n: int, emitted: int
) -> tuple[list[Level], list[list[int]]]:
    """One Jacobi update of the window: stack ``new``, harvest the ``n``-grams, slide.

    ``levels[l][j]`` is level ``l``'s guess at column ``j`` (meaningful for
    ``j >= l``); ``new[j]`` is the target's argmax at the top level's node of
    column ``j - 1``, ``None`` where that node was not verified. When the stack
    reaches ``n`` levels, every complete diagonal ``levels[0][j-n+1], ...,
    new[j]`` is an ``n``-gram and level 0 is dropped. Every level then slides
    ``emitted`` columns to the left (column ``j + emitted`` becomes ``j``);
    columns that slide in are ``None``. Returns ``(levels, grams)``.

    >>> lv, grams = jacobi_step([[1, 2, 3], [None, 4, 5]], [None, None, 6, 7], n=3, emitted=1)
    >>> grams
    [[1, 4, 6], [2, 5, 7]]
    >>> lv
    [[4, 5, None], [None, 6, 7]]
    """
    width = len(levels[0]) if levels else len(new) - 1
    stack = [list(lv) for lv in levels] + [list(new)]
    grams: list[list[int]] = []
    if len(stack) >= n:
        top = n - 1
        for j in range(top, len(new)):
            diag = [stack[lev][j - top + lev] for lev in range(top)] + [new[j]]
            if all(t is not None for t in diag):
                grams.append([int(t) for t in diag if t is not None])
        stack = stack[len(stack) - n + 1 :]
    out: list[Level] = []
    for lev in stack:
        shifted = lev[emitted : width + emitted]
        out.append(shifted + [None] * (width - len(shifted)))
    return out, grams


class LookaheadProposer:
    """Jacobi window + n-gram pool drafts (module docstring).

    ``window`` (W): columns of level 0 (0: pool only); ``ngram`` (N): n-gram
    length, the window holds up to N - 1 levels; ``guesses`` (G): pool
    continuations per key, all offered each step; ``store``: where pools live
    across requests; ``index``: an :class:`NgramIndex` whose continuations of the
    root's suffix join the pool; ``seed``: the random fill's seed (drafts are
    deterministic per request).
    """

    name = "lookahead"

    def __init__(
        self,
        window: int = DEFAULT_W,
        ngram: int = DEFAULT_N,
        guesses: int = DEFAULT_G,
        *,
        store: PoolStore | None = None,
        index: Any = None,
        seed: int = 0,
    ) -> None:
        if window < 0 or ngram < 2 or guesses < 0:
            raise ValueError("need window >= 0, ngram >= 2 and guesses >= 0")
        self.W, self.N, self.G = window, ngram, guesses
        self.store = store if store is not None else PoolStore()
        self.index = index
        self.seed = seed
        self.pool = self.store.pool(None, ngram, guesses)
        self._uri: str | None = None
        self._rng = random.Random(seed)
        self._levels: list[Level] = []
        self._context: list[int] = []  # the context the pool has absorbed (prompt + generated)
        self._pooled = 0  # n-grams of _context starting before this index are in the pool
        # the last draft, its window nodes by (level, column) and how many columns it had
        self._draft: Draft | None = None
        self._nodes: dict[tuple[int, int], int] = {}
        self._columns = 0

    # -- the Proposer protocol --------------------------------------------------------

    def begin(self, request: RequestInfo) -> None:
        self._uri = request.uri
        self.pool = self.store.pool(request.uri, self.N, self.G)
        self._rng = random.Random(self.seed)
        self._context = []
        self._pooled = 0
        self._sync([int(t) for t in request.prompt_ids])  # the prompt's own n-grams
        self._levels = [[None] * self.W] if self.W else []
        self._forget_draft()

    def propose(self, context: Sequence[int], budget: int) -> Draft | None:
        self._forget_draft()
        if budget <= 0 or not context:
            return None
        self._sync(context)
        if self.index is not None:
            self._from_index(context)
        conts = self.pool.get(int(context[-1]))[: self.G]
        branch = Draft.from_paths([(list(c), POOL) for c in conts]).truncated(budget)
        tokens, parents = list(branch.tokens), list(branch.parents or [])
        sources = list(branch.sources or [])
        self._add_window(context, budget - len(tokens), tokens, parents, sources)
        if not tokens:
            return None
        self._draft = Draft(tokens, parents, sources=sources)
        return self._draft

    def observe(self, result: StepResult) -> None:
        emitted = max(1, len(result.tokens) or result.accepted_len + 1)
        if self._levels:
            self._iterate(result, emitted, result.rows_of(self._draft))
        self._forget_draft()

    def follow(self, result: StepResult) -> None:
        """A step another proposer drafted: slide the window by the tokens it emitted; the
        pool absorbs them at the next ``propose``."""
        self._slide(max(1, len(result.tokens)))
        self._forget_draft()

    # -- helpers --------------------------------------------------------------------

    def _add_window(
        self,
        context: Sequence[int],
        room: int,
        tokens: list[int],
        parents: list[int],
        sources: list[str],
    ) -> None:
        """The lookahead branch after the pool's, as wide as ``room`` allows."""
        if not self._levels:
            return
        levels = len(self._levels)
        columns = self.W
        while columns > 0 and window_nodes(columns, min(levels, columns)) > room:
            columns -= 1
        self._fill(context)
        for lev in range(min(levels, columns)):
            for j in range(lev, columns):
                if lev == 0:
                    parent = self._nodes[(0, j - 1)] if j else -1
                else:
                    parent = self._nodes[(lev - 1, j - 1)]
                tok = self._levels[lev][j]
                assert tok is not None
                self._nodes[(lev, j)] = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                sources.append(WINDOW)
        self._columns = columns

    def _slide(self, emitted: int) -> None:
        """Every level moves ``emitted`` columns left; the columns that slide in are empty."""
        self._levels = [(lev[emitted:] + [None] * emitted)[: self.W] for lev in self._levels]

    def _iterate(self, result: StepResult, emitted: int, rows: dict[int, int]) -> None:
        """The Jacobi update from the verified top-level nodes' rows, the harvest, the slide."""
        new: Level = [None] * (self.W + 1)
        top = len(self._levels) - 1
        if result.logits is not None and self._columns > top:
            cols = [j for j in range(top, self._columns) if self._nodes[(top, j)] in rows]
            if cols:
                picked = [rows[self._nodes[(top, j)]] for j in cols]
                best = result.logits[picked].argmax(dim=-1).tolist()  # (len(cols),)
                for j, tok in zip(cols, best, strict=True):
                    new[j + 1] = int(tok)
        if all(t is None for t in new):  # nothing learned: only slide
            self._slide(emitted)
            return
        self._levels, grams = jacobi_step(self._levels, new, self.N, emitted)
        for gram in grams:
            self.pool.add(gram)

    def _forget_draft(self) -> None:
        self._draft, self._nodes, self._columns = None, {}, 0

    def _sync(self, context: Sequence[int]) -> None:
        """Add the n-grams of the context's new tokens to the pool (all of it when it changed)."""
        n = len(self._context)
        if n and len(context) >= n and context[n - 1] == self._context[-1]:
            self._context.extend(int(t) for t in context[n:])
        else:
            self._context = [int(t) for t in context]
            self._pooled = 0
        self.pool.extend(self._context, self._pooled)
        self._pooled = max(self._pooled, len(self._context) - self.N + 1)

    def _from_index(self, context: Sequence[int]) -> None:
        """The index's continuations of the root's suffix join the pool under the root."""
        g = int(getattr(self.index, "min_n", 2))
        if len(context) < g:
            return
        cands = self.index.lookup(context, uri=self._uri, k=self.N - 1, b=self.G, min_n=g)
        for c in reversed(cands):  # the best ends up first
            if len(c.tokens) == self.N - 1:
                self.pool.add_continuation(int(context[-1]), c.tokens)

    def _fill(self, context: Sequence[int]) -> None:
        """Fill unknown guesses: level 0 by chaining the pool from its left neighbour (the
        root for column 0), else a random context token; higher levels from the level below."""
        for lev, row in enumerate(self._levels):
            for j in range(lev, self.W):
                if row[j] is not None:
                    continue
                if lev == 0:
                    left = row[j - 1] if j else int(context[-1])
                    conts = self.pool.get(left) if left is not None else []
                    if conts:
                        row[j] = conts[0][0]
                    else:
                        row[j] = int(context[self._rng.randrange(len(context))])
                else:
                    row[j] = self._levels[lev - 1][j]


def make(engine: StateHolder | None, index: Any = None, **kw: Any) -> LookaheadProposer:
    """The registry's factory: a proposer whose pools live with ``engine``."""
    return LookaheadProposer(store=store_for(engine), index=index, **kw)
