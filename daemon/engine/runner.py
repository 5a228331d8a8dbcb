"""Model runners: one forward for prefill, decode and draft-tree verification.

A runner owns a model and the KV cache of one sequence. It knows nothing about
tokenizers, sampling or proposers: token ids in, logits (and tapped hidden
states) out.

The cache verbs, the contract every runner keeps:

- ``length``            tokens whose keys/values are in the cache.
- ``forward(ids, parents=None, taps=(), last_only=False)``
                        append ``len(ids)`` tokens after the cached ones and
                        return their logits ``(T, V)`` in fp32. ``parents[i]`` is
                        the index (within ``ids``) of token i's parent, or -1
                        when its parent is the last cached token; ``None`` means
                        a chain (``parents[i] == i - 1``). Token i sits at
                        position ``length + depth(i)`` and attends to the cached
                        prefix and to its own ancestors (itself included).
                        ``taps`` asks for the hidden states after those decoder
                        layers (0 = embeddings, L = last layer before the final
                        norm), returned in ``hidden`` as ``(T, len(taps), H)``.
                        ``last_only`` returns the last token's logits only
                        (a prefill needs no more; saves a (T, V) matrix).
                        ``greedy`` (a chain or tree verified at temperature
                        0): the runner may return only rows ``0..k``, k the
                        row where greedy verification's walk ends (from row 0,
                        the first largest logit names the child it moves to;
                        it ends at a row with no such child), or more; greedy
                        verification reads no row after k. The lean stack
                        stops its LM head there.
- ``keep(indices)``     after a forward of T tokens, keep only the appended
                        tokens at ``indices`` (increasing, a root-to-leaf path),
                        compacted in that order; the rest are dropped.
- ``truncate(n)``       roll the cache back to its first n tokens.
- ``reset()``           empty the cache.
- ``cache_state()`` / ``set_cache_state(state)`` / ``new_cache_state()``
                        the current cache as an opaque object, switching to
                        another one, and a fresh empty one: the engine keeps
                        several caches (slots) and swaps them in, so requests
                        on different documents do not evict each other.
- ``copy_cache(state, n)`` a new cache state holding the first n positions of
                        ``state`` (which is left as it was): a request starts
                        from a file run's prefix without writing into the run.

Optional, where a forward can stop part-way (the lean stack): ``interrupt``, a flag
(``qstack.Interrupt``) any thread may set, and ``forward_unless_interrupted(ids, taps)``,
a chain's ``forward(..., last_only=True)`` that returns None, the cache as it was, when
the flag is set before its last layer. A warm-up's prefill runs so, and a request that
comes in behind it waits for one layer instead of the whole chunk.

Tree positions and masks are derived from the parent array by
:func:`tree_layout`, shared by every runner so they agree by construction.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

NEG_INF = float("-inf")


def tree_layout(parents: list[int] | None, n: int) -> tuple[list[int], torch.Tensor | None]:
    """Depths and the ancestor mask of a draft tree.

    Returns ``(depth, ancestors)`` where ``depth[i]`` is 0 for children of the
    cached prefix and ``ancestors`` is a bool ``(n, n)`` matrix with
    ``ancestors[i, j]`` true when j is i or an ancestor of i; ``None`` for a
    chain, where the causal mask is the ancestor mask.

    >>> tree_layout([-1, 0, 0], 3)[0]
    [0, 1, 1]
    """
    if parents is None or all(p == i - 1 for i, p in enumerate(parents)):
        return list(range(n)), None
    if len(parents) != n:
        raise ValueError(f"parents has {len(parents)} entries for {n} tokens")
    depth = [0] * n
    anc = torch.zeros((n, n), dtype=torch.bool)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parent {p} of token {i} must be -1 or an earlier index")
        anc[i, i] = True
        if p >= 0:
            depth[i] = depth[p] + 1
            anc[i] |= anc[p]
    return depth, anc


def check_forward(n: int, length: int, max_length: int) -> None:
    """The cache-verb preconditions of ``forward`` every runner enforces."""
    if n == 0:
        raise ValueError("forward needs at least one token")
    if length + n > max_length:
        raise ValueError(f"context of {length + n} tokens exceeds {max_length}")


def check_keep(indices: list[int], appended: int) -> None:
    """``keep`` takes increasing indices into the tokens the last forward appended."""
    if any(not 0 <= i < appended for i in indices) or any(
        b <= a for a, b in itertools.pairwise(indices)
    ):
        raise ValueError(f"keep({indices}) after a forward of {appended} tokens")


@dataclass
class ForwardOut:
    logits: torch.Tensor  # (T, V) fp32
    hidden: torch.Tensor | None = None  # (T, len(taps), H) when taps were asked for
    # each logit row's argmax (torch's choice), when the runner's kernel gives it
    best: list[int] | None = None


class Runner(Protocol):
    """What the engine needs from a model runner (see the module docstring). Optional:
    ``argmax_rows(logits) -> list[int] | None``, each row's ``argmax`` (torch's choice) by
    a faster kernel of the runner's; greedy verification uses it where it is there."""

    name: str
    vocab_size: int
    max_length: int
    num_layers: int
    hidden_size: int
    device: torch.device

    @property
    def length(self) -> int: ...

    def forward(
        self,
        ids: list[int],
        parents: list[int] | None = None,
        taps: tuple[int, ...] = (),
        last_only: bool = False,
        greedy: bool = False,
    ) -> ForwardOut: ...

    def keep(self, indices: list[int]) -> None: ...

    def truncate(self, n: int) -> None: ...

    def reset(self) -> None: ...

    def cache_state(self) -> object: ...

    def set_cache_state(self, state: object) -> None: ...

    def new_cache_state(self) -> object: ...

    def copy_cache(self, state: object, n: int) -> object: ...


class HFRunner:
    """Runner over any ``AutoModelForCausalLM`` with a ``DynamicCache``.

    The reference and the fallback for architectures the lean runner does not
    know. Trees use a 4D float mask (0 / -inf) and explicit position ids.
    """

    name = "hf"

    def __init__(self, model, max_length: int | None = None) -> None:
        from transformers import DynamicCache

        self.model = model.eval()
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.max_length = int(max_length or getattr(cfg, "max_position_embeddings", 2048))
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._cache_cls = DynamicCache
        self.cache = DynamicCache(config=cfg)
        self._len = 0
        self._pending = 0  # tokens appended by the last forward, for keep()

    @property
    def length(self) -> int:
        return self._len

    def reset(self) -> None:
        self.cache = self._cache_cls(config=self.model.config)
        self._len = 0
        self._pending = 0

    def cache_state(self) -> object:
        return (self.cache, self._len)

    def set_cache_state(self, state: object) -> None:
        self.cache, self._len = state  # type: ignore[misc]
        self._pending = 0

    def new_cache_state(self) -> object:
        return (self._cache_cls(config=self.model.config), 0)

    def copy_cache(self, state: object, n: int) -> object:
        cache, length = state  # type: ignore[misc]
        n = min(n, length)
        if n == 0:
            return self.new_cache_state()
        new = copy.deepcopy(cache)
        if n < length:
            new.crop(n - length)
        return (new, n)

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self._len:
            raise ValueError(f"cannot truncate a cache of {self._len} tokens to {n}")
        if n == 0:
            self.reset()
            return
        if n < self._len:
            self.cache.crop(n - self._len)  # transformers 5.x: negative = tokens to remove
        self._len = n
        self._pending = 0

    def keep(self, indices: list[int]) -> None:
        t = self._pending
        base = self._len - t
        check_keep(list(indices), t)
        if list(indices) == list(range(len(indices))):
            self.truncate(base + len(indices))
            return
        idx = torch.tensor([base + i for i in indices], device=self.device)
        for layer in self.cache.layers:
            layer.keys = torch.cat([layer.keys[:, :, :base], layer.keys.index_select(2, idx)], 2)
            layer.values = torch.cat(
                [layer.values[:, :, :base], layer.values.index_select(2, idx)], 2
            )
        self._len = base + len(indices)
        self._pending = 0

    @torch.inference_mode()
    def forward(
        self,
        ids: list[int],
        parents: list[int] | None = None,
        taps: tuple[int, ...] = (),
        last_only: bool = False,
        greedy: bool = False,  # every row is returned
    ) -> ForwardOut:
        n = len(ids)
        check_forward(n, self._len, self.max_length)
        depth, anc = tree_layout(parents, n)
        past = self._len
        x = torch.tensor([ids], device=self.device)
        pos = torch.tensor([[past + d for d in depth]], device=self.device)
        mask = None
        if anc is not None:
            m = torch.zeros((n, past + n), dtype=self.dtype, device=self.device)
            m[:, past:] = torch.where(anc.to(self.device), 0.0, NEG_INF)
            mask = m[None, None]  # (1, 1, T, past + T)
        last_layer: list[torch.Tensor] = []
        hook = None
        if self.num_layers in taps:  # HF's last hidden state is after the final norm: hook it
            layer = self.model.model.layers[-1]
            hook = layer.register_forward_hook(
                lambda _m, _i, o: last_layer.append(o[0] if isinstance(o, tuple) else o)
            )
        try:
            out = self.model(
                input_ids=x,
                position_ids=pos,
                attention_mask=mask,
                cache=self.cache,
                use_cache=True,
                output_hidden_states=bool(taps),
                logits_to_keep=1 if last_only else 0,
            )
        finally:
            if hook is not None:
                hook.remove()
        self._len += n
        self._pending = n
        hidden = None
        if taps:
            states = [
                last_layer[0][0] if t == self.num_layers else out.hidden_states[t][0] for t in taps
            ]
            hidden = torch.stack(states, dim=1).float()
        return ForwardOut(logits=out.logits[0].float(), hidden=hidden)
