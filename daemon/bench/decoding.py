"""Timed decodes by our engine: what every benchmark that compares methods runs.

Owns: the engine's benchmark arguments and loading it (:func:`add_engine_args`,
:func:`open_engine`), one timed decode from an empty KV cache (:func:`decode_once`), one
method's run of a prompt (:func:`run_engine`, :class:`Run`) with, on request, every step
the engine verified (:class:`StepLog`, :class:`Step`), and the draft budget a method gets
on a workload item (:func:`draft_budget`).
Must not touch: workloads and their prompts (``workload_items``), the peers' decoders
(``hf_peer``, ``llamacpp``), tables and JSON (each benchmark prints its own).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from codespec.daemon.engine.engine import Engine, GenParams
    from codespec.ngram_index import NgramIndex
    from codespec.speculators.draft import RequestInfo


@dataclass
class Step:
    """One step the engine verified for a speculative run: who drafted it (its first
    node's source; ``plain`` without a draft), how the draft ended (``whole``, ``part``,
    ``bonus``: no draft node accepted; ``plain``), its draft nodes, the tokens it produced
    and its verify forward's ms."""

    source: str
    outcome: str
    nodes: int
    tokens: int
    forward_ms: float


@dataclass
class Run:
    tokens: int
    forwards: int
    ms: float
    ids: list[int]
    first_ms: float = 0.0  # time to the first generated token (the prefill, mostly)
    steps: list[Step] = field(default_factory=list)  # with --steps: every verified step


class StepLog:
    """A proposer that notes each step the engine verifies for it (:class:`Step`);
    otherwise the proposer itself (every other attribute is its own)."""

    def __init__(self, proposer: Any) -> None:
        self._proposer = proposer
        self.steps: list[Step] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._proposer, name)

    def observe(self, result: Any) -> None:
        draft = result.draft
        nodes = len(draft) if draft is not None else 0
        if not nodes:
            source, outcome = "plain", "plain"
        else:
            source = draft.source(0)
            accepted = result.accepted_len
            outcome = "whole" if accepted == nodes else "part" if accepted else "bonus"
        self.steps.append(Step(source, outcome, nodes, len(result.tokens), result.forward_ms))
        self._proposer.observe(result)


def decode_once(
    engine: Engine,
    prompt: list[int],
    params: GenParams,
    proposer: Any = None,
    info: RequestInfo | None = None,
) -> tuple[list[int], Any, float]:
    """One timed decode from an empty KV cache: (output ids, stop tokens left out; the final
    stats; wall ms). Every benchmark that compares methods runs its prompts through this.

    Each run starts cold: no KV cache and no lookahead pools. The pools are kept per
    document across requests (in the daemon, a second request at the same spot may use
    what the first one generated); here every method decodes the same prompts under the
    same uri, so a kept pool would hand a later run the earlier run's output."""
    from codespec.speculators.lookahead import store_for

    engine.reset_cache()
    store_for(engine).clear()
    ids: list[int] = []
    stats = None
    t0 = time.perf_counter()
    for delta in engine.stream(prompt, params, proposer, info):
        ids.extend(delta.token_ids)
        stats = delta.stats
    ms = (time.perf_counter() - t0) * 1000
    assert stats is not None
    return [t for t in ids if t not in engine.stop_ids][: params.max_tokens], stats, ms


def run_engine(
    engine: Engine,
    method: str,
    prompt: list[int],
    max_tokens: int,
    index: NgramIndex | None,
    uri: str | None,
    draft_ids: list[int] | None = None,
    max_draft: int = 16,
    temperature: float = 0.0,
    seed: int = 0,
    heal: str = "",
    steps: bool = False,
) -> Run:
    """One timed decode of ``prompt`` by ``method``; ``steps``: note every verified step
    (:class:`StepLog`)."""
    from codespec.daemon.engine.engine import GenParams
    from codespec.daemon.text.healing import constraint
    from codespec.speculators.draft import RequestInfo
    from codespec.speculators.registry import make_proposer

    proposer = make_proposer(method, engine, index)
    if steps and proposer is not None:
        proposer = StepLog(proposer)
    info = RequestInfo(
        prompt_ids=prompt,
        uri=uri,
        max_tokens=max_tokens,
        kind="edit" if draft_ids else "generate",
        draft_text_ids=draft_ids,
    )
    params = GenParams(
        max_tokens=max_tokens,
        max_draft=max_draft,
        temperature=temperature,
        seed=seed,
        constraint=constraint(engine, heal),
    )
    ids, stats, ms = decode_once(engine, prompt, params, proposer, info)
    noted = proposer.steps if isinstance(proposer, StepLog) else []
    return Run(stats.tokens, stats.target_forwards, ms, ids, stats.ttft_ms, noted)


def add_engine_args(p: argparse.ArgumentParser, threads: int) -> None:
    """The arguments every engine-driven benchmark takes: ``--max-tokens``, the model,
    device and runner, and torch threads (``threads`` by default; 0: torch's own)."""
    p.add_argument("--max-tokens", type=int, default=0, help="override every prompt's max_tokens")
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--runner", default="auto")
    p.add_argument(
        "--threads", type=int, default=threads, help="torch threads (0: torch's default)"
    )


def open_engine(args: argparse.Namespace) -> Any:
    """Set torch's threads from ``args`` and load the engine they name; as the daemon does,
    hand the speculation policy a few timed forwards as its first cost table."""
    import torch

    from codespec.daemon.engine.engine import Engine
    from codespec.speculators.policy import seed_costs

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(args.model, device=args.device, runner=args.runner)
    seed_costs(engine, engine.time_forwards())
    return engine


def draft_budget(method: str, item: dict[str, Any], max_draft: int) -> int:
    """The draft tokens a forward may verify for ``method`` on ``item``: K for ``NAME@K``;
    else ``max_draft``, raised for an edit item to what the daemon's ``edit`` requests get
    (:data:`~codespec.daemon.prompts.completion.EDIT_DRAFT`).

    >>> draft_budget("ngram", {"new": "x"}, 16), draft_budget("ngram", {"prefix": "x"}, 16)
    (64, 16)
    >>> draft_budget("ngram@8", {"new": "x"}, 16)
    8
    """
    from codespec.daemon.prompts.completion import EDIT_DRAFT

    cap = method.partition("@")[2]
    if cap:
        return int(cap)
    return max(max_draft, EDIT_DRAFT) if "new" in item else max_draft
