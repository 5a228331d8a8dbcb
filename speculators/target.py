"""What proposers may read from the target model: a small interface the engine implements.

Owns :class:`TargetModel` (the model's shape, its token embedding, where its
files live and the matrix kernels its runner uses), :class:`Kernels` with
its plain-torch implementation :class:`TorchKernels`, and
:class:`SpeculatorState`, what speculation keeps on a target model across
requests (the target holds it: :class:`StateHolder`). Nothing in
``codespec.speculators`` imports the daemon: the engine hands proposers an
object with these members (``codespec.daemon.engine.target``), and tests hand
them stand-ins.

Must not touch: the target's KV cache or its forward (proposers see the
target only through :class:`~codespec.speculators.draft.StepResult`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.nn.functional as F

__all__ = ["Kernels", "SpeculatorState", "StateHolder", "TargetModel", "TorchKernels"]


class Kernels(Protocol):
    """The matrix products a draft head runs through, as the target's runner does.

    ``pack(w)`` turns an ``(in, out)`` weight into the form ``linear`` takes (panels
    or quantized blocks for a CPU kernel; the matrix itself for torch: opaque to the
    caller); ``linear(x, w, res)`` is ``x @ w (+ res)``; ``norm`` is Llama's RMSNorm of
    the rows of ``x``.
    """

    def pack(self, w: torch.Tensor) -> Any: ...

    def linear(self, x: torch.Tensor, w: Any, res: torch.Tensor | None = None) -> torch.Tensor: ...

    def norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor: ...

    def chain_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, t: int = 1
    ) -> torch.Tensor | None:
        """Grouped-query attention of ``t`` new tokens in a chain after ``past`` cached ones:
        ``q`` (KV, t * G, D), rows token-major (``i * G + g``), over ``k``, ``v`` (KV, S_max,
        D) whose rows ``0 .. past + t`` are written; token ``i`` sees rows ``0 .. past + i``.
        Returns (KV, t * G, D); ``None`` when there is no kernel for it (callers use SDPA
        then)."""
        ...


class TorchKernels:
    """:class:`Kernels` by torch alone: ``x @ w`` over ``(in, out)`` matrices, RMSNorm,
    no attention kernel. Any device, any dtype."""

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def linear(
        self, x: torch.Tensor, w: torch.Tensor, res: torch.Tensor | None = None
    ) -> torch.Tensor:
        return x @ w if res is None else torch.addmm(res, x, w)

    def norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def chain_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, t: int = 1
    ) -> torch.Tensor | None:
        return None


Part = TypeVar("Part")


class SpeculatorState:
    """What speculation keeps on one target model across requests; the target holds it
    (``target.speculator_state``) and it goes with the target. One part per class, each
    made (its class called with no arguments) on first use by the module that owns it:

    - :class:`~codespec.speculators.book.PolicyStore`, the policy's memory
      (:func:`codespec.speculators.book.store_for`; :func:`~codespec.speculators.book.forget`
      drops it);
    - :class:`~codespec.speculators.lookahead.PoolStore`, lookahead's n-gram pools per
      document (:func:`codespec.speculators.lookahead.store_for`);
    - :class:`~codespec.speculators.eagle.LoadedHeads`, the EAGLE heads loaded for this
      model, by folder (:func:`codespec.speculators.eagle.load_runtime`).

    Keyed by the part's class, so that this module imports none of their modules (they
    import it: ``tests/test_speculators_layout.py`` allows no import cycle).
    """

    def __init__(self) -> None:
        self._parts: dict[type, object] = {}

    def get(self, kind: type[Part]) -> Part:
        """The part of class ``kind``, made on first use."""
        part = self._parts.get(kind)
        if not isinstance(part, kind):
            part = kind()
            self._parts[kind] = part
        return part

    def find(self, kind: type[Part]) -> Part | None:
        """The part of class ``kind``, or None when none was made (or it was dropped)."""
        part = self._parts.get(kind)
        return part if isinstance(part, kind) else None

    def drop(self, kind: type) -> None:
        """Forget the part of class ``kind``: the next :meth:`get` makes a fresh one."""
        self._parts.pop(kind, None)


class StateHolder(Protocol):
    """An object speculation keeps its state on: a target model, or what stands for one
    where nothing is drafted locally (a remote engine, whose ``stats`` still report the
    policy's section)."""

    speculator_state: SpeculatorState


class TargetModel(StateHolder, Protocol):
    """The target model as proposers see it.

    - ``model_path``: the model's folder; model proposers read their weights beside
      it (``MODEL/eagle``).
    - ``vocab_size``, ``hidden_size``, ``num_layers``, ``max_length``: its shape and
      the most positions it takes.
    - ``device``, ``dtype``: where and in which type its runner computes.
    - ``embedding()``: the token embedding ``(vocab_size, hidden_size)``.
    - ``kernels(dtype)``: the products for weights of ``dtype`` on ``device``.
    - ``speculator_state``: one per loaded model: the policy's measurements, lookahead's
      pools and the loaded heads live in it (:class:`SpeculatorState`).
    """

    @property
    def model_path(self) -> str | Path: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def max_length(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def embedding(self) -> torch.Tensor: ...

    def kernels(self, dtype: torch.dtype) -> Kernels: ...
