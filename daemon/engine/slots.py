"""KV-cache slots: which cached prefix a prompt reuses, and the taps kept beside it.

Owns the engine's caches as token ids: the active cache (in the runner) mirrored
token for token by :attr:`CacheSlots.cached_ids`, the idle caches parked beside it
(so a request on another document does not evict the active one), the hidden-state
taps recorded per cached position (EAGLE reads the prompt's), and the choice of slot
for a prompt. Must not touch: sampling, proposers, text.

A slot fits a prompt when reusing it drops at most half of what it holds (or it
shares 256 tokens or more). When none fits, the prompt gets a new slot (while there is
room, else in place of the least recently used idle one) holding a copy of the longest
prefix of it any slot holds (``runner.copy_cache``), so the slot it came from stays whole.

Beside each cached position a slot keeps, where a forward computed it, the model's own
greedy choice after it (:attr:`CacheSlots.choices`, :mod:`.choices`): a fact about the
tokens up to that position, so a greedy request whose whole prompt a slot holds
(:meth:`CacheSlots.holds`) can read the tokens the model chose after it back (recall).

Runs: a warm-up may ask for a pinned slot (``pick(prompt, run=True)``), a long stretch
of a file from a fixed start that many prompts begin with (the prompts' prefixes start
on a grid: :mod:`codespec.daemon.prompts.parts`). A request never writes into a run:
when a run shares the most with its prompt, the shared positions are copied into a
slot of the request's own (``runner.copy_cache``, a few ms), so the next request at
another spot of the file starts from the run again. Runs hold ``max_run_tokens`` tokens
in all (the least recently used dropped past it) beside the ``max_slots`` slots requests
write into; a run's first warm-up copies what any slot already holds of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from codespec.daemon.engine.choices import Choices
from codespec.daemon.engine.runner import Runner


@dataclass(eq=False)
class _Slot:
    """An idle KV cache and the token ids (and taps) it holds."""

    state: object
    cached_ids: list[int]
    taps: tuple[int, ...]
    tap_buf: torch.Tensor | None
    tap_valid: int
    used: int
    pinned: bool = False
    choices: Choices = field(default_factory=Choices)


# A slot requests write into that shares at most this many tokens fewer with a prompt
# than a run does is taken over copying the run (a copy adds a slot and evicts another).
RUN_SLACK = 64


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Leading tokens ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _fits(ids: list[int], shared: int) -> bool:
    """Reusing a cache of ``ids`` that shares ``shared`` tokens loses at most half of it."""
    return shared >= min(256, len(ids) // 2)


class CacheSlots:
    """The runner's active cache plus idle ones: up to ``max_slots`` that requests write
    into, and runs (pinned; see the module) holding ``max_run_tokens`` tokens in all."""

    def __init__(self, runner: Runner, max_slots: int, max_run_tokens: int = 0) -> None:
        self.runner = runner
        self.max_slots = max(1, int(max_slots))
        # runs need a runner that copies a cache's prefix, and more than one slot
        can_copy = hasattr(runner, "copy_cache") and self.max_slots > 1
        self.max_run_tokens = max(0, int(max_run_tokens)) if can_copy else 0
        self.cached_ids: list[int] = []  # mirrors the runner's cache, token for token
        # per cached position, the model's greedy choices after it (recall)
        self.choices = Choices()
        self.taps: tuple[int, ...] = ()
        self.tap_buf: torch.Tensor | None = None  # (max_length, len(taps), H)
        self.tap_valid = 0  # positions [0, tap_valid) of the buffer are filled
        self.idle: list[_Slot] = []
        self.pinned = False  # whether the active cache is a run (requests copy from it)
        self.forks = 0  # requests that started from a copy of a run's prefix
        self._clock = 0

    def reset(self) -> None:
        """Forget every cached prefix, in every slot."""
        self.runner.reset()
        self.cached_ids = []
        self.choices = Choices()
        self.tap_valid = 0
        self.pinned = False
        self.idle.clear()

    @property
    def run_tokens(self) -> int:
        """Tokens the runs hold, the active one included."""
        idle = sum(len(sl.cached_ids) for sl in self.idle if sl.pinned)
        return idle + (len(self.cached_ids) if self.pinned else 0)

    def pick(self, prompt: list[int], run: bool = False) -> None:
        """Make the slot sharing the longest prefix with ``prompt`` the active one (a copy
        of its shared prefix where that slot is a run); with ``run``, the run ``prompt``
        belongs to (see the module). Without room for runs, ``run`` is ignored."""
        self._clock += 1
        if run and self.max_run_tokens:
            self._pick_run(prompt)
            return
        if self.max_slots == 1:
            return
        # (score, slot or None for the active one, shared): a run is copied from, never
        # cut, so any prefix of it counts, less RUN_SLACK (a copy adds a slot and evicts
        # another); a slot requests write into counts where reusing it loses little
        n = shared_prefix(self.cached_ids, prompt)
        options: list[tuple[int, _Slot | None, int]] = []
        if self.pinned or _fits(self.cached_ids, n):
            options.append((n - RUN_SLACK if self.pinned else n, None, n))
        for slot in self.idle:
            n = shared_prefix(slot.cached_ids, prompt)
            if slot.pinned or _fits(slot.cached_ids, n):
                options.append((n - RUN_SLACK if slot.pinned else n, slot, n))
        if not options:  # none worth cutting: a new slot from a copy of the longest prefix
            self._fork(*self._donor(prompt), pinned=False)  # (the active one is parked)
            return
        _, slot, n = max(options, key=lambda o: o[0])  # the first of equals: the active
        if self.pinned if slot is None else slot.pinned:
            self._fork(slot, n, pinned=False)
        elif slot is not None:
            self._swap(slot)

    def _pick_run(self, prompt: list[int]) -> None:
        """Activate the run sharing the most with ``prompt`` (at least half of it); else
        a new run, starting from a copy of the longest prefix of it any slot holds, the
        least recently used runs dropped to keep ``max_run_tokens``."""
        active = shared_prefix(self.cached_ids, prompt) if self.pinned else -1
        best, best_n = None, -1
        for slot in self.idle:
            n = shared_prefix(slot.cached_ids, prompt)
            if slot.pinned and _fits(slot.cached_ids, n) and n > best_n:
                best, best_n = slot, n
        if self.pinned and not _fits(self.cached_ids, active):
            active = -1
        if max(active, best_n) > 0:
            if best_n > active:
                self._swap(best)  # type: ignore[arg-type]
            return
        runs = sorted((sl for sl in self.idle if sl.pinned), key=lambda sl: sl.used)
        while runs and self.run_tokens + len(prompt) > self.max_run_tokens:
            self.idle.remove(runs.pop(0))
        self._fork(*self._donor(prompt), pinned=True)

    def _donor(self, prompt: list[int]) -> tuple[_Slot | None, int]:
        """The slot holding the longest prefix of ``prompt`` (None: the active one) and
        that prefix's length, for a new slot to start from a copy of it."""
        donor, n = None, min(shared_prefix(self.cached_ids, prompt), self.runner.length)
        for slot in self.idle:
            m = shared_prefix(slot.cached_ids, prompt)
            if m > n:
                donor, n = slot, m
        return donor, n

    def _fork(self, src: _Slot | None, n: int, pinned: bool) -> None:
        """Park the active cache and activate a new one (a run where ``pinned``) holding
        the first ``n`` positions of ``src`` (None: the active cache), taps included; a new
        slot for requests drops the least recently used idle one past ``max_slots``."""
        if src is None:
            src = _Slot(self.runner.cache_state(), self.cached_ids, self.taps, self.tap_buf,
                        self.tap_valid, self._clock, self.pinned, self.choices)  # fmt: skip
        plain = sorted((sl for sl in self.idle if not sl.pinned), key=lambda sl: sl.used)
        writers = len(plain) + (0 if self.pinned else 1)  # the active one is parked, kept
        if not pinned and writers >= self.max_slots and plain:
            self.idle.remove(plain[0])
        if n == 0:
            dst = _Slot(self.runner.new_cache_state(), [], (), None, 0, 0, pinned)
        else:
            state = self.runner.copy_cache(src.state, n)  # type: ignore[attr-defined]
            dst = _Slot(state, src.cached_ids[:n], (), None, 0, 0, pinned, src.choices.copy(n))
            if src.tap_buf is not None and src.tap_valid > 0:
                dst.taps, dst.tap_valid = src.taps, min(n, src.tap_valid)
                dst.tap_buf = torch.empty_like(src.tap_buf)
                dst.tap_buf[: dst.tap_valid] = src.tap_buf[: dst.tap_valid]
            self.forks += not pinned
        self._swap(dst)

    def _swap(self, slot: _Slot) -> None:
        """Park the active cache in an idle slot and activate ``slot``."""
        if slot in self.idle:
            self.idle.remove(slot)
        parked = _Slot(
            self.runner.cache_state(),
            self.cached_ids,
            self.taps,
            self.tap_buf,
            self.tap_valid,
            self._clock,
            self.pinned,
            self.choices,
        )
        self.idle.append(parked)
        self.runner.set_cache_state(slot.state)
        self.cached_ids, self.choices = slot.cached_ids, slot.choices
        self.taps, self.tap_buf, self.tap_valid = slot.taps, slot.tap_buf, slot.tap_valid
        self.pinned = slot.pinned

    def cached(self, prompt: list[int]) -> int:
        """Leading ``prompt`` tokens some slot (the active one or an idle one) holds: what
        a request with it would not prefill (at most all but its last token)."""
        active = min(len(self.cached_ids), self.runner.length)
        best = shared_prefix(self.cached_ids[:active], prompt)
        for slot in self.idle:
            best = max(best, shared_prefix(slot.cached_ids, prompt))
        return min(best, max(0, len(prompt) - 1))

    def reusable(self, prompt: list[int], taps: tuple[int, ...]) -> int:
        """Leading prompt tokens whose KV (and, with ``taps``, hidden states) are cached;
        never the whole prompt (its last token must be fed to get logits), never past what
        the runner's cache holds (a prefill or warm-up stopped after its truncate)."""
        limit = min(len(self.cached_ids), self.runner.length, len(prompt) - 1)
        if taps:
            if taps != self.taps or self.tap_buf is None:
                self.taps, self.tap_buf, self.tap_valid = taps, None, 0
            limit = min(limit, self.tap_valid)
        return shared_prefix(self.cached_ids[:limit], prompt)

    def record_prompt(self, prompt: list[int], common: int, hidden: torch.Tensor | None) -> None:
        """The prompt is now cached; ``hidden``: the taps of ``prompt[common:]``."""
        self.cached_ids = list(prompt)
        self.choices.cut(min(common, len(prompt)), len(prompt))
        if hidden is None:
            self.tap_valid = min(self.tap_valid, common)
            return
        if self.tap_buf is None:
            shape = (self.runner.max_length, len(self.taps), hidden.shape[-1])
            self.tap_buf = torch.empty(shape, dtype=hidden.dtype, device=hidden.device)
        self.tap_buf[common : len(prompt)] = hidden
        self.tap_valid = len(prompt)

    def record_step(self, base: int, tokens: list[int], hidden: torch.Tensor | None,
                    rows: list[int], choices: Choices | None = None) -> None:  # fmt: skip
        """A verify step kept ``tokens`` after position ``base``; ``rows`` of ``hidden``
        (the forward's taps) are theirs; ``choices``: the greedy choices after them
        (their positions counted from ``base``), where known."""
        self.cached_ids.extend(tokens)
        self.choices.cut(base, base)
        if choices is None:
            choices = Choices([-1] * len(tokens))
        masked = {base + p: m for p, m in choices.masked.items()}
        self.choices.extend(choices.free, masked)
        if hidden is None or self.tap_buf is None or self.tap_valid != base:
            self.tap_valid = min(self.tap_valid, base)
            return
        n = len(rows)  # rows ascend from 0 (a path): all of the first n when the last is n - 1
        self.tap_buf[base : base + n] = hidden[:n] if rows[-1] == n - 1 else hidden[rows]
        self.tap_valid = base + n

    def holds(self, prompt: list[int]) -> int:
        """The positions the active cache holds with their KV where it holds the whole
        ``prompt`` (the choices after them are :attr:`choices`); else 0."""
        held = min(len(self.cached_ids), len(self.choices), self.runner.length)
        n = len(prompt)
        if not 0 < n <= held or self.cached_ids[n - 1] != prompt[-1]:
            return 0
        return held if shared_prefix(self.cached_ids[:n], prompt) == n else 0

    def keep(self, n: int) -> None:
        """Cut the active cache to its first ``n`` positions (a recall's tokens but the
        last stay cached; the last is the next forward's root)."""
        self.runner.truncate(n)
        del self.cached_ids[n:]
        self.choices.cut(n)
        self.tap_valid = min(self.tap_valid, n)

    def prompt_hidden(self, n: int) -> torch.Tensor:
        """Tapped hidden states of the first ``n`` cached positions, ``(n, len(taps), H)``."""
        if self.tap_buf is None or n > self.tap_valid:
            raise RuntimeError("no tapped hidden states for those positions")
        return self.tap_buf[:n]
