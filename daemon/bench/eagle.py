"""``codespec bench eagle``: the EAGLE head's acceptance, costs and speed against plain decoding.

Owns this benchmark only; it drives the engine and the EAGLE proposer through
their public calls and must not reach into the runner's or the head's internals.

For each workload (default ``/tmp/wl/novel.jsonl`` and ``/tmp/wl/completion.jsonl``,
built by ``codespec bench make-workloads``), every prompt is decoded greedily by
``off`` and by each EAGLE variant (``chain``: under the policy's controller,
as ``speculation: "eagle"`` runs it; ``deep``: a chain of fixed depth every step;
``tree``: EAGLE-2 dynamic tree under the controller; ``dtree``: the tree at fixed
depth every step), the order alternating per
prompt, the KV cache emptied before every run. Reported per workload and variant:

- ``acc/step``: accepted draft tokens per decode step, the bonus token NOT counted.
- ``tok/fwd``: tokens per target forward, the bonus token counted and the prefill
  counted as a forward (plain decoding scores 1.00).
- per-position acceptance: P(draft token i accepted | the draft reached depth i
  and tokens 1..i-1 were accepted).
- wall ms and ``vs off`` (off's summed wall time over the variant's, same
  prompts), and how many outputs equal off's token for token.

Costs, measured on this machine after the runs: the target's verify forward by
draft size ``V(n)`` (n draft tokens + the root, over a cached context of the
workloads' median prompt length, with the head's taps) and one head forward
``H`` (one row). Projections from the measured acceptance:

- ``cpu model``: per decode step ``V(n_s) + f_s * H`` (``f_s`` head forwards in step s,
  the draft depth), against ``V(0)`` per token for plain decoding; a check of
  the cost model against the wall clock.
- ``head = 1/30``: the same with ``H = V(0) / 30`` (a 1.5B target on a GPU).
- ``head = 1/30, flat verify``: also ``V(n) = V(0)``, a GPU's verify of a few
  tokens costing what one token costs.

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from codespec.daemon.bench.decoding import add_engine_args, open_engine

if TYPE_CHECKING:
    from codespec.daemon.engine.engine import Engine

DEFAULT_WORKLOADS = ("/tmp/wl/novel.jsonl", "/tmp/wl/completion.jsonl")
VARIANTS: dict[str, dict[str, Any]] = {
    "chain": {"topk": 1, "policy": True},  # what `speculation: "eagle"` uses
    "deep": {"topk": 1, "policy": False},  # always --depth: the most tokens per forward
    "tree": {"topk": 4, "policy": True},
    "dtree": {"topk": 4, "policy": False},  # a tree always grown to --depth, --nodes nodes
}


@dataclass
class Acc:
    """Sums over the prompts of one workload and one method."""

    prompts: int = 0
    tokens: int = 0
    forwards: int = 0
    decode_steps: int = 0
    accepted: int = 0
    ms: float = 0.0
    off_ms: float = 0.0
    equal: int = 0
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # (depth, nodes, accepted)
    plain_steps: int = 0  # decode steps without a draft

    def add(self, run: tuple[list[int], Any, float, Any], off: tuple) -> None:
        """One prompt's run (ids, stats, wall ms, the EAGLE proposer or None) against off's."""
        ids, stats, ms, prop = run
        off_ids, _, off_ms, _ = off
        self.prompts += 1
        self.tokens += stats.tokens
        self.forwards += stats.target_forwards
        self.decode_steps += stats.decode_steps
        self.accepted += sum(stats.accepted.values())
        self.ms += ms
        self.off_ms += off_ms
        self.equal += int(ids == off_ids)
        if prop is not None:
            self.steps += prop.history
            self.plain_steps += stats.decode_steps - len(prop.history)
        else:
            self.plain_steps += stats.decode_steps

    def per_position(self, depth: int) -> list[float]:
        reach, hit = [0] * depth, [0] * depth
        for d, _, m in self.steps:
            for i in range(min(d, depth)):
                if m < i:
                    break
                reach[i] += 1
                hit[i] += int(m > i)
        return [h / r if r else float("nan") for h, r in zip(hit, reach, strict=True)]


def run_one(engine, prompt: list[int], max_tokens: int, proposer) -> tuple[list[int], Any, float]:
    from codespec.daemon.bench.decoding import decode_once
    from codespec.daemon.engine.engine import GenParams

    return decode_once(engine, prompt, GenParams(max_tokens=max_tokens), proposer)


def measure_costs(engine, runtime, context: int, sizes: list[int], reps: int) -> dict[str, Any]:
    """Median ms of a verify forward by draft size (with taps) and of one head forward.

    Each repetition times every size once, in a rotating order, and one head
    forward, so that load from other processes hits all of them alike.
    """
    runner, head = engine.runner, runtime.runner
    taps = tuple(head.cfg.taps)
    vocab = runner.vocab_size
    engine.reset_cache()
    runner.forward([(7 * i + 11) % vocab for i in range(context)], last_only=True)
    hid = torch.zeros((context, head.cfg.hidden_size))
    head.reset()
    head.forward(list(range(context)), hid, torch.arange(1, context + 1))
    verify: dict[int, list[float]] = {n: [] for n in sizes}
    head_ms: list[float] = []
    for r in range(reps):
        order = sizes[r % len(sizes) :] + sizes[: r % len(sizes)]
        for n in order:
            ids = [(13 * r + 5 * j + 3) % vocab for j in range(n + 1)]
            t0 = time.perf_counter()
            runner.forward(ids, taps=taps)
            verify[n].append((time.perf_counter() - t0) * 1000)
            runner.truncate(context)
        t0 = time.perf_counter()
        head.forward([r % vocab], hid[:1], torch.tensor([context + 1]))
        head_ms.append((time.perf_counter() - t0) * 1000)
        head.truncate(context)
    head.reset()
    engine.reset_cache()
    return {
        "verify_ms": {n: statistics.median(v) for n, v in verify.items()},
        "head_ms": statistics.median(head_ms),
    }


def project(acc: Acc, verify: dict[int, float], head_ms: float) -> dict[str, float]:
    """Speedups over plain decoding of the measured steps under three cost models."""
    sizes = sorted(verify)

    def v(n: int) -> float:
        for s in sizes:
            if s >= n:
                return verify[s]
        return verify[sizes[-1]]

    tokens = sum(m + 1 for _, _, m in acc.steps) + acc.plain_steps
    v0 = verify[0]
    out = {}
    for name, h, flat in (
        ("cpu_model", head_ms, False),
        ("head_1_30", v0 / 30, False),
        ("head_1_30_flat_verify", v0 / 30, True),
    ):
        cost = acc.plain_steps * v0
        cost += sum((v0 if flat else v(n)) + d * h for d, n, _ in acc.steps)
        out[name] = round(tokens * v0 / cost, 3) if cost else 0.0
    return out


def _run_workload(
    engine: Engine,
    path: str,
    methods: list[str],
    proposer: Callable[[str], tuple[Any, Any]],
    aggs: dict[tuple[str, str], Acc],
    args: argparse.Namespace,
) -> list[int]:
    """Every method on the workload's prompts (alternating order, a warm-up first), summed
    into ``aggs`` under the workload's name; the prompts' lengths."""
    from codespec.daemon.bench.workload_items import build_prompt, load_workload

    items = load_workload(path)
    if args.limit:
        items = items[: args.limit]
    kind = Path(path).stem
    # build_prompt's first two values: the prompt ids and max_tokens
    prompts = [tuple(build_prompt(engine, it, args.max_tokens)[:2]) for it in items]
    for m in methods:  # warm-up, not timed
        run_one(engine, prompts[0][0], 8, None if m == "off" else proposer(m)[0])
    for n, (prompt, max_tokens) in enumerate(prompts):
        order = methods[n % len(methods) :] + methods[: n % len(methods)]
        runs = {}
        for m in order:
            drive, prop = (None, None) if m == "off" else proposer(m)
            ids, stats, ms = run_one(engine, prompt, max_tokens, drive)
            runs[m] = (ids, stats, ms, prop)
        for m in methods:
            aggs.setdefault((kind, m), Acc()).add(runs[m], runs["off"])
        print(
            f"  [{kind} {n + 1}/{len(prompts)}] "
            + "  ".join(f"{m} {r[2]:.0f}ms/{r[1].target_forwards}f" for m, r in runs.items()),
            file=sys.stderr,
        )
    return [len(pr) for pr, _ in prompts]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="codespec bench eagle", description=__doc__.splitlines()[0])
    p.add_argument("workloads", nargs="*", default=list(DEFAULT_WORKLOADS))
    p.add_argument("--variants", default="chain,deep", help=f"any of {', '.join(VARIANTS)}")
    p.add_argument("--depth", type=int, default=6, help="the deepest draft")
    p.add_argument("--topk", type=int, default=0, help="override the tree's top-k")
    p.add_argument("--nodes", type=int, default=12, help="the most draft nodes per step")
    p.add_argument(
        "--head",
        default=None,
        help="head folder (default: MODEL/eagle, else the one shipped for the model)",
    )
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts of each")
    p.add_argument("--reps", type=int, default=30, help="repetitions of each cost measurement")
    add_engine_args(p, threads=1)
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        print(f"codespec bench eagle: unknown variants {bad}", file=sys.stderr)
        return 2

    from codespec.speculators.eagle import EagleProposer, NoEagleHead, load_runtime
    from codespec.speculators.policy import Controller

    engine = open_engine(args)
    try:
        runtime = load_runtime(engine, args.head)
    except NoEagleHead as exc:
        print(f"codespec bench eagle: error: {exc}", file=sys.stderr)
        return 1

    def proposer(variant: str) -> tuple[Any, EagleProposer]:
        """(what the engine drives, the EAGLE proposer): policy variants run under the
        policy's controller, as ``speculation: "eagle"`` does; the others draft every step."""
        spec = VARIANTS[variant]
        topk = args.topk if args.topk and spec["topk"] > 1 else spec["topk"]
        nodes = args.depth if topk == 1 else args.nodes
        eagle = EagleProposer(runtime, depth=args.depth, topk=topk, max_nodes=nodes)
        if not spec["policy"]:
            return eagle, eagle
        return Controller(engine, {"eagle": eagle}, name="eagle"), eagle

    methods = ["off", *variants]
    aggs: dict[tuple[str, str], Acc] = {}
    lengths: list[int] = []
    for path in args.workloads:
        lengths += _run_workload(engine, path, methods, proposer, aggs, args)

    context = int(statistics.median(lengths)) if lengths else 256
    sizes = sorted({0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16} | {args.depth, args.nodes})
    sizes = [s for s in sizes if s <= max(args.depth, args.nodes, 1)]
    costs = measure_costs(engine, runtime, context, sizes, args.reps)
    print_report(aggs, costs, engine, runtime, args, context)
    return 0


def print_report(aggs, costs, engine, runtime, args, context: int) -> None:
    depth = args.depth
    head = (
        f"{'workload':<11}{'method':<7}{'prompts':>8}{'tokens':>7}{'steps':>6}"
        f"{'acc/step':>9}{'tok/fwd':>8}{'wall ms':>9}{'vs off':>8}{'= off':>7}"
        f"  per-position acceptance 1..{depth}"
    )
    print(
        f"codespec bench eagle ({date.today()}, {platform.machine()}, {engine.device.type}, "
        f"{engine.runner.name} runner, {torch.get_num_threads()} thread(s), model "
        f"{engine.model_name}, head {runtime.path}); greedy; acc/step excludes the bonus token, "
        f"tok/fwd counts it (and the prefill as a forward)"
    )
    print(head)
    print("-" * len(head))
    rows = []
    for (kind, m), a in aggs.items():
        acc_step = a.accepted / a.decode_steps if a.decode_steps else 0.0
        tpf = a.tokens / a.forwards if a.forwards else 0.0
        speed = a.off_ms / a.ms if a.ms else 0.0
        pos = a.per_position(depth) if m != "off" else []
        pos_text = " ".join("  -  " if p != p else f"{p:.2f}" for p in pos)
        print(
            f"{kind:<11}{m:<7}{a.prompts:>8}{a.tokens:>7}{a.decode_steps:>6}{acc_step:>9.2f}"
            f"{tpf:>8.2f}{a.ms:>9.0f}{speed:>7.2f}x{a.equal:>4}/{a.prompts:<2}  {pos_text}"
        )
        row: dict[str, Any] = {
            "workload": kind,
            "method": m,
            "prompts": a.prompts,
            "tokens": a.tokens,
            "decode_steps": a.decode_steps,
            "mean_accepted_no_bonus": round(acc_step, 3),
            "tokens_per_target_forward": round(tpf, 3),
            "wall_ms": round(a.ms, 1),
            "speedup_vs_off": round(speed, 3),
            "equal_to_off": a.equal,
        }
        if m != "off":
            row["per_position_acceptance"] = [None if p != p else round(p, 4) for p in pos]
            row["projected_speedup"] = project(a, costs["verify_ms"], costs["head_ms"])
        rows.append(row)
    _print_costs(costs, rows, args.reps, context)
    verify = costs["verify_ms"]
    print(
        json.dumps(
            {
                "bench": "eagle",
                "date": str(date.today()),
                "device": engine.device.type,
                "runner": engine.runner.name,
                "threads": torch.get_num_threads(),
                "depth": depth,
                "context": context,
                "head_ms": round(costs["head_ms"], 3),
                "verify_ms": {str(k): round(v, 3) for k, v in verify.items()},
                "rows": rows,
            }
        )
    )


def _print_costs(costs: dict[str, Any], rows: list[dict], reps: int, context: int) -> None:
    """The measured costs and, per EAGLE row, the speedup they project."""
    verify = costs["verify_ms"]
    print(
        f"\ncosts at {context} cached tokens (median of {reps}): head forward "
        f"{costs['head_ms']:.2f} ms = {costs['head_ms'] / verify[0]:.3f} of a target decode "
        f"forward; target verify ms by draft size: "
        + "  ".join(f"{n}:{ms:.2f}" for n, ms in verify.items())
    )
    print("projected speedup vs off from the measured acceptance:")
    print(f"  {'workload':<11}{'method':<7}{'cpu model':>10}{'head=1/30':>11}{'+flat verify':>14}")
    for row in rows:
        if "projected_speedup" in row:
            pr = row["projected_speedup"]
            print(
                f"  {row['workload']:<11}{row['method']:<7}{pr['cpu_model']:>9.2f}x"
                f"{pr['head_1_30']:>10.2f}x{pr['head_1_30_flat_verify']:>13.2f}x"
            )


if __name__ == "__main__":
    sys.exit(main())
