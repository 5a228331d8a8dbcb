"""What the service reads of an engine, as a protocol: the local one or a remote one.

Owns :class:`DecodingEngine` (the members the scheduler, the handlers and the daemon use:
decoding, warming, the caches' figures, the lock, what it is and where it runs, and its
tokenizer side, :class:`~codespec.daemon.text.protocols.TextModel`), with the
:class:`RunnerInfo` and :class:`Device` it shows. :class:`~.engine.Engine` fits it, and
so does ``codespec.daemon.backends.remote.RemoteEngine`` (decoding on a server). What only
the local engine has (its forwards to time, the taps a warm-up keeps) is read off
:class:`~.engine.Engine` itself. Must not touch: anything at run time (only types).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from codespec.daemon.text.protocols import TextModel
from codespec.speculators.target import StateHolder

if TYPE_CHECKING:
    from codespec.daemon.engine.engine import GenParams, Step
    from codespec.speculators.draft import Proposer, RequestInfo

__all__ = ["DecodingEngine", "Device", "RunnerInfo"]


class Device(Protocol):
    """Where decoding runs (a ``torch.device``; a remote engine's backend kind)."""

    @property
    def type(self) -> str: ...


class RunnerInfo(Protocol):
    """``engine.runner`` as the service shows it: its name (``lean``, ``hf``, a backend's
    kind), its vocabulary size and its context length."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_length(self) -> int: ...


class DecodingEngine(TextModel, StateHolder, Protocol):
    """An engine as the service drives it (see the module docstring).

    - ``stream``: one turn of a request, a :class:`~.engine.Step` per target forward
      (:meth:`.engine.Engine.stream`), closed when the caller stops reading;
      ``stop_ids``: the tokens that end a request.
    - ``warm``, ``cached_tokens``, ``reset_cache``, ``max_slots``: the prompt caches
      (a remote engine has none: 0 and no-ops).
    - ``lock``: held around decoding (the local engine serves one request at a time).
    - ``model_path``, ``model_name``, ``device``, ``runner``, ``config`` (the model's
      config, read for its vocabulary size where it has one): what ``hello`` and
      ``stats`` show.
    - ``speculator_state``: what speculation keeps on this model
      (:class:`~codespec.speculators.target.SpeculatorState`).
    """

    @property
    def model_path(self) -> str | Path: ...

    @property
    def model_name(self) -> str: ...

    @property
    def device(self) -> Device: ...

    @property
    def runner(self) -> RunnerInfo: ...

    @property
    def config(self) -> object: ...

    @property
    def stop_ids(self) -> set[int]: ...

    @property
    def lock(self) -> AbstractContextManager[Any]: ...

    @property
    def max_slots(self) -> int: ...

    def stream(
        self,
        prompt_ids: list[int],
        params: GenParams,
        proposer: Proposer | None = None,
        info: RequestInfo | None = None,
        cancel: threading.Event | None = None,
    ) -> Generator[Step, None, None]: ...

    def warm(
        self, prompt: list[int], yield_to: Callable[[], bool], chunk: int = 128, run: bool = False
    ) -> int: ...

    def interrupt(self) -> None: ...

    def cached_tokens(self, prompt: list[int]) -> int: ...

    def reset_cache(self) -> None: ...
