"""Acceptance statistics of completions shown in the editor, per proposer.

Owns: remembering the items this server handed out (a bounded table keyed by
item id), and counting what the editor reports through
``codespec/didShowCompletion`` / ``codespec/didAcceptCompletion``.
Must not touch: LSP types, the daemon, documents.

Formulas (all over the items the editor reported as shown):

- ``acceptance_rate`` = accepted items / shown items
- ``accepted_chars_rate`` = accepted characters / characters shown
- per proposer P: ``shown``/``accepted`` count the items whose generation had at
  least one draft token of P accepted by the model, and ``draft_tokens`` sums
  P's accepted draft tokens over those items (the bonus token is never counted,
  as in the daemon's stats).
- ``tokens_per_s``: mean of the daemon's tokens/s over the last 32 completions.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Item:
    text: str
    accepted_by_source: dict[str, int]
    shown: bool = False
    accepted: bool = False


@dataclass
class _Counter:
    shown: int = 0
    accepted: int = 0
    draft_tokens: int = 0


@dataclass
class AcceptanceStats:
    capacity: int = 512
    _items: OrderedDict[str, _Item] = field(default_factory=OrderedDict)
    _next: int = 0
    shown: int = 0
    accepted: int = 0
    shown_chars: int = 0
    accepted_chars: int = 0
    per_proposer: dict[str, _Counter] = field(default_factory=dict)
    _speeds: deque[float] = field(default_factory=lambda: deque(maxlen=32))

    def record(self, text: str, stats: dict[str, Any] | None) -> str:
        """Remember an item handed to the editor; returns its id."""
        self._next += 1
        item_id = f"c{self._next}"
        accepted = dict((stats or {}).get("accepted") or {})
        self._items[item_id] = _Item(text, {k: int(v) for k, v in accepted.items() if v})
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        speed = (stats or {}).get("tokens_per_s")
        if isinstance(speed, (int, float)) and speed > 0:
            self._speeds.append(float(speed))
        return item_id

    def did_show(self, item_id: str) -> bool:
        item = self._items.get(item_id)
        if item is None or item.shown:
            return False
        item.shown = True
        self.shown += 1
        self.shown_chars += len(item.text)
        for source in item.accepted_by_source:
            self.per_proposer.setdefault(source, _Counter()).shown += 1
        return True

    def did_accept(self, item_id: str, accepted_length: int | None = None) -> bool:
        """The editor accepted ``accepted_length`` characters of the item (all when None)."""
        item = self._items.get(item_id)
        if item is None or item.accepted:
            return False
        self.did_show(item_id)  # an accepted item was shown, whether or not it was reported
        item.accepted = True
        length = len(item.text) if accepted_length is None else accepted_length
        self.accepted += 1
        self.accepted_chars += max(0, min(length, len(item.text)))
        for source, tokens in item.accepted_by_source.items():
            counter = self.per_proposer.setdefault(source, _Counter())
            counter.accepted += 1
            counter.draft_tokens += tokens
        return True

    def snapshot(self) -> dict[str, Any]:
        return {
            "shown": self.shown,
            "accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.shown, 3) if self.shown else 0.0,
            "shown_chars": self.shown_chars,
            "accepted_chars": self.accepted_chars,
            "accepted_chars_rate": (
                round(self.accepted_chars / self.shown_chars, 3) if self.shown_chars else 0.0
            ),
            "tokens_per_s": (
                round(sum(self._speeds) / len(self._speeds), 1) if self._speeds else 0.0
            ),
            "per_proposer": {
                name: {"shown": c.shown, "accepted": c.accepted, "draft_tokens": c.draft_tokens}
                for name, c in sorted(self.per_proposer.items())
            },
        }
