"""``codespec bench lookahead``: lookahead (Jacobi) decoding configurations against plain decoding.

Owns this benchmark only; it drives the engine and the lookahead proposer
through their public calls and must not reach into the runner's internals.

``codespec bench lookahead WORKLOAD.jsonl [--grid "W,N,G;W,N,G"] [--limit N] [--threads 1]``
decodes every prompt greedily with ``off`` and with each configuration (window
W, n-gram N, guesses G; under the policy's controller, as ``speculation:
"lookahead"`` runs it, or with ``,all`` every node verified every step), the order
rotating per prompt so machine noise hits
them alike, the KV cache emptied before every run. Each configuration has its
own pool store, emptied after the untimed warm-up run of the first prompt, so
one configuration never learns from another's runs; within a configuration the
pools carry across prompts as they do in the daemon (per document, one shared
pool for prompts without a uri). Reported per configuration:

- ``tok/fwd``: tokens per target forward, the bonus token counted and the prefill
  counted as a forward (plain decoding scores 1.00).
- ``acc/step``: accepted draft tokens per decode step with a draft, bonus NOT counted,
  and the share of them from the pool (``lookahead:pool``) vs the window.
- ``nodes``: mean draft nodes verified per drafted step.
- wall ms and ``vs off`` (off's summed wall time over the configuration's, same
  prompts), and how many outputs equal off's token for token.

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass, field
from datetime import date
from typing import TYPE_CHECKING, Any

import torch

from codespec.daemon.bench.decoding import add_engine_args, open_engine

if TYPE_CHECKING:
    from codespec.daemon.engine.engine import Engine

DEFAULT_GRID = "0,6,2;4,3,4;4,5,2;4,6,2;4,6,2,all;4,7,2;6,6,2"


@dataclass
class Acc:
    """Sums over the prompts for one method."""

    prompts: int = 0
    tokens: int = 0
    forwards: int = 0
    ms: float = 0.0
    off_ms: float = 0.0
    equal: int = 0
    drafted_steps: int = 0
    nodes: int = 0
    accepted: dict[str, int] = field(default_factory=dict)


def parse_grid(text: str) -> list[str]:
    """``"W,N,G;W,N,G,all"`` -> the configuration names, checked (``all``: every node
    verified every step, no policy).

    >>> parse_grid("4,3,4; 0,5,2,all")
    ['4,3,4', '0,5,2,all']
    """
    out = []
    for part in text.split(";"):
        part = part.strip().replace(" ", "")
        if not part:
            continue
        fields = part.split(",")
        if len(fields) not in (3, 4) or fields[3:] not in ([], ["all"]):
            raise ValueError(f"{part!r} is not W,N,G or W,N,G,all")
        [int(x) for x in fields[:3]]
        out.append(part)
    if not out:
        raise ValueError("an empty grid")
    return out


def config(name: str) -> dict[str, Any]:
    """Proposer keyword arguments of a configuration name ``W,N,G[,all]``."""
    fields = name.split(",")
    kw: dict[str, Any] = {
        "window": int(fields[0]),
        "ngram": int(fields[1]),
        "guesses": int(fields[2]),
    }
    return kw


def run_one(
    engine, prompt: list[int], max_tokens: int, proposer, uri
) -> tuple[list[int], Any, float]:
    from codespec.daemon.bench.decoding import decode_once
    from codespec.daemon.engine.engine import GenParams
    from codespec.speculators.draft import RequestInfo

    info = RequestInfo(prompt_ids=list(prompt), uri=uri, max_tokens=max_tokens)
    return decode_once(engine, prompt, GenParams(max_tokens=max_tokens), proposer, info)


def _accumulate(accs: dict[str, Acc], runs: dict[str, tuple[list[int], Any, float]]) -> None:
    """Add one prompt's runs (ids, stats, wall ms per configuration) to the sums."""
    off_ids, _, off_ms = runs["off"]
    for name, (ids, stats, ms) in runs.items():
        a = accs[name]
        a.prompts += 1
        a.tokens += stats.tokens
        a.forwards += stats.target_forwards
        a.ms += ms
        a.off_ms += off_ms
        a.equal += int(ids == off_ids)
        drafted = sum(stats.drafted.values())
        a.nodes += drafted
        for src, c in stats.accepted.items():
            a.accepted[src] = a.accepted.get(src, 0) + c
        a.drafted_steps += stats.decode_steps if drafted else 0


def _report(
    accs: dict[str, Acc], names: list[str], engine: Engine, args: argparse.Namespace
) -> None:
    """The table, then one JSON line."""
    head = f"{'W,N,G[,all]':<12}{'prompts':>8}{'tokens':>8}{'forwards':>9}{'tok/fwd':>9}"
    head += f"{'acc/step':>9}{'pool %':>8}{'nodes':>7}{'wall ms':>10}{'vs off':>8}{'= off':>8}"
    print(
        f"codespec bench lookahead {args.workload}  ({date.today()}, {platform.machine()}, "
        f"{engine.device.type}, {engine.runner.name} runner, {torch.get_num_threads()} threads, "
        f"model {engine.model_name})"
    )
    print(head)
    print("-" * len(head))
    rows = []
    for name in names:
        a = accs[name]
        tpf = a.tokens / a.forwards if a.forwards else 0.0
        speed = a.off_ms / a.ms if a.ms else 0.0
        acc = sum(a.accepted.values())
        per_step = acc / a.drafted_steps if a.drafted_steps else 0.0
        pool_share = a.accepted.get("lookahead:pool", 0) / acc if acc else 0.0
        nodes = a.nodes / a.drafted_steps if a.drafted_steps else 0.0
        print(
            f"{name:<12}{a.prompts:>8}{a.tokens:>8}{a.forwards:>9}{tpf:>9.2f}{per_step:>9.2f}"
            f"{100 * pool_share:>7.0f}%{nodes:>7.1f}{a.ms:>10.0f}{speed:>7.2f}x"
            f"{a.equal:>5}/{a.prompts:<2}"
        )
        rows.append(
            {
                "config": name,
                "prompts": a.prompts,
                "tokens": a.tokens,
                "target_forwards": a.forwards,
                "tokens_per_forward": round(tpf, 3),
                "accepted_per_drafted_step": round(per_step, 3),
                "accepted_by_source": dict(a.accepted),
                "mean_nodes": round(nodes, 2),
                "wall_ms": round(a.ms, 1),
                "speedup_vs_off": round(speed, 3),
                "equal_to_off": a.equal,
            }
        )
    print(
        json.dumps(
            {
                "bench": "lookahead",
                "workload": args.workload,
                "date": str(date.today()),
                "device": engine.device.type,
                "runner": engine.runner.name,
                "threads": torch.get_num_threads(),
                "rows": rows,
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="codespec bench lookahead", description=__doc__.splitlines()[0]
    )
    p.add_argument("workload", nargs="?", default="/tmp/wl/novel.jsonl")
    p.add_argument(
        "--grid",
        default=DEFAULT_GRID,
        help='configurations "W,N,G;W,N,G,all;...": window, n-gram, guesses (all: no policy)',
    )
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    p.add_argument("--max-draft", type=int, default=16, help="draft tokens verified per forward")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens at most")
    add_engine_args(p, threads=1)
    args = p.parse_args(argv)
    try:
        grid = parse_grid(args.grid)
    except ValueError as exc:
        print(f"codespec bench lookahead: bad --grid: {exc}", file=sys.stderr)
        return 2

    from codespec.daemon.bench.workload_items import build_prompt, load_workload
    from codespec.speculators.lookahead import LookaheadProposer, store_for
    from codespec.speculators.policy import Controller

    engine = open_engine(args)
    items = load_workload(args.workload)
    if args.limit:
        items = items[: args.limit]
    prompts = [build_prompt(engine, it, args.max_tokens, "none", args.context) for it in items]
    names = ["off", *grid]

    def proposer(name: str) -> Any:
        if name == "off":
            return None
        # the engine's pools, which decode_once empties before every timed decode
        prop = LookaheadProposer(store=store_for(engine), **config(name))
        return prop if name.endswith(",all") else Controller(engine, {"lookahead": prop})

    def one(name: str, k: int) -> tuple[list[int], Any, float]:
        prompt, max_tokens, _, _ = prompts[k]
        return run_one(engine, prompt, max_tokens, proposer(name), items[k].get("uri"))

    for name in names:  # warm-up, not timed
        one(name, 0)
    accs = {name: Acc() for name in names}
    for k, item in enumerate(items):
        order = names[k % len(names) :] + names[: k % len(names)]
        runs = {name: one(name, k) for name in order}
        _accumulate(accs, runs)
        print(
            f"  [{k + 1}/{len(items)}] {item.get('id', k)}: "
            + "  ".join(f"{m} {r[2]:.0f}ms/{r[1].target_forwards}f" for m, r in runs.items()),
            file=sys.stderr,
        )

    _report(accs, names, engine, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
