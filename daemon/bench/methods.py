"""``codespec bench WORKLOAD.jsonl --methods off,NAME,...``: decoding methods side by side.

Each workload line is a JSON object: ``{"id", "prompt" | "prompt_ids",
"max_tokens"?, "kind"?, "documents"?: [{"uri", "text"}], "uri"?}``. Documents
are opened in an n-gram index shared by the proposers (files of the same
package, the old version of an edited file, ...).

Methods: ``off`` (plain greedy decoding in our engine), any proposer name
(``ngram``, ``auto``, ...), and the peers a user reaches for first: ``hf``
(transformers ``generate()``) and ``hf-pld`` (``generate(prompt_lookup_num_tokens=...)``),
on the same model and the same prompt tokens. Methods alternate per prompt so
machine noise hits them alike; the KV cache is emptied before every run. With
``--rounds N`` each prompt runs N times per method (each round starting with the
next method) and each method's fastest round counts. An edit item's drafts get
the budget the daemon's ``edit`` requests get (``NAME@K`` sets it).

Reported per method (and per workload kind): tokens, target forwards, tokens
per forward (prefill counted as a forward), wall ms, speedup vs ``off``
(sum of off's wall time over the method's, same prompts), and whether the
output token ids equal off's. With ``--steps``, also where each method's decode
time went: its verified steps by who drafted and how the draft ended (accepted
whole, in part, only the bonus token; plain steps), with their tokens and forward ms.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from codespec.daemon.bench.decoding import (
    Run,
    add_engine_args,
    draft_budget,
    open_engine,
    run_engine,
)
from codespec.daemon.bench.hf_peer import HFPeer
from codespec.daemon.bench.methods_report import Agg, accumulate, add_steps, print_table
from codespec.daemon.bench.workload_items import build_index, build_prompt, load_workload

if TYPE_CHECKING:
    from codespec.daemon.engine.engine import Engine
    from codespec.ngram_index import NgramIndex

PEERS = ("hf", "hf-pld")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="codespec bench", description=__doc__.splitlines()[0])
    p.add_argument(
        "workload", nargs="+", help="JSONL workloads (see `codespec bench make-workloads`)"
    )
    p.add_argument("--methods", default="off,ngram,hf,hf-pld", help="NAME@K caps drafts at K")
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    p.add_argument("--lookup", type=int, default=10, help="hf-pld's prompt_lookup_num_tokens")
    add_engine_args(p, threads=0)
    p.add_argument("--max-draft", type=int, default=16, help="draft tokens verified per forward")
    p.add_argument(
        "--context", type=int, default=1024, help="prompt tokens at most (the daemon's default)"
    )
    p.add_argument(
        "--prediction",
        choices=["none", "old", "new", "output"],
        default="none",
        help="edit items: what the request carries as its draft text (see build_prompt); "
        "output: the prompt of none, drafts from off's greedy output (an exact prediction)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample at this temperature (seeded per prompt; outputs then differ from off's "
        "by design, and the HF peers, greedy only, are left out)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (prompt n uses seed + n)")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="run every prompt this many times per method, each round starting with the "
        "next method; each method's fastest round counts (a shared machine's noise only "
        "ever adds time)",
    )
    p.add_argument(
        "--steps",
        action="store_true",
        help="also print where each method's decode time went: its verified steps by who "
        "drafted and how the draft ended (each prompt's fastest round)",
    )
    return p


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_methods(text: str, peers: tuple[str, ...] = PEERS) -> tuple[list[str], list[str]]:
    """The methods a comma-separated list names, ``off`` first (added when absent), and the
    names that are neither a proposer (``NAME@K``: at most K draft tokens a forward) nor
    one of ``peers``."""
    from codespec.speculators.registry import known

    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if not known(m.partition("@")[0]) and m not in peers]
    if "off" not in methods:
        methods.insert(0, "off")
    return methods, bad


def run_method(
    engine: Engine,
    method: str,
    item: dict[str, Any],
    prepared: tuple,
    index: NgramIndex | None,
    args: argparse.Namespace,
    seed: int,
) -> Run:
    """One of our methods (``NAME@K``) on one workload item, prepared by
    :func:`build_prompt`; the item's document becomes the index's current one."""
    prompt, max_tokens, draft_ids, heal = prepared
    if index is not None and item.get("uri") in index:
        index.touch(item["uri"])
    name = method.partition("@")[0]
    return run_engine(
        engine, name, prompt, max_tokens, index, item.get("uri"), draft_ids,
        draft_budget(method, item, args.max_draft), args.temperature, seed, heal, args.steps,
    )  # fmt: skip


@dataclass
class _Setup:
    """What every run of the benchmark reads: the engine, the workload items (the first
    ``--limit``), each item's workload's index and its prepared prompt
    (:func:`build_prompt`), and the HF peer when a method needs it."""

    args: argparse.Namespace
    engine: Engine
    items: list[dict[str, Any]]
    indexes: list[
        NgramIndex | None
    ]  # each item's workload's n-gram index (None: no open documents)
    prompts: list[tuple]
    peer: HFPeer | None

    def one(self, method: str, n: int) -> Run:
        """Item ``n`` decoded once by ``method`` (one of ours or a peer)."""
        args = self.args
        if method not in PEERS:
            index, item, prepared = self.indexes[n], self.items[n], self.prompts[n]
            return run_method(self.engine, method, item, prepared, index, args, args.seed + n)
        assert self.peer is not None
        prompt, max_tokens = self.prompts[n][:2]
        return self.peer.run(prompt, max_tokens, args.lookup if method == "hf-pld" else None)


def _setup(args: argparse.Namespace, methods: list[str]) -> _Setup:
    """Load the workloads, the engine (and the HF peer when ``methods`` name one), each
    workload's index and every item's prompt."""
    loaded = [load_workload(path) for path in args.workload]
    items = [item for wl in loaded for item in wl]
    which = [w for w, wl in enumerate(loaded) for _ in wl]  # each item's workload
    if args.limit:
        items, which = items[: args.limit], which[: args.limit]
    engine = open_engine(args)
    peer = HFPeer(engine) if any(m in PEERS for m in methods) else None
    # one index per workload: a workload's open documents are not another one's
    indexes = [build_index(engine, wl) for wl in loaded]
    prompts = [
        build_prompt(engine, item, args.max_tokens, args.prediction, args.context) for item in items
    ]

    if args.prediction == "output":
        prompts = [_exact_prediction(engine, item, p, args, n) for n, (item, p) in
                   enumerate(zip(items, prompts, strict=True))]  # fmt: skip
    return _Setup(args, engine, items, [indexes[w] for w in which], prompts, peer)


def _rounds(setup: _Setup, methods: list[str], n: int) -> dict[str, list[Run]]:
    """Item ``n`` run ``--rounds`` times by every method, each round starting with the next
    method; each method's runs, one a round, and a progress line on stderr."""
    runs: dict[str, list[Run]] = {m: [] for m in methods}
    for k in range(setup.args.rounds):  # each round starts with the next method
        at = (n + k) % len(methods)
        for m in methods[at:] + methods[:at]:
            runs[m].append(setup.one(m, n))
    print(
        f"  [{n + 1}/{len(setup.items)}] {setup.items[n].get('id', n)}: "
        + "  ".join(
            f"{m} {'/'.join(f'{r.ms:.0f}' for r in rs)}ms/{rs[0].forwards}f"
            for m, rs in runs.items()
        ),
        file=sys.stderr,
    )
    return runs


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    methods, bad = parse_methods(args.methods)
    if bad:
        print(f"codespec bench: unknown methods {bad}", file=sys.stderr)
        return 2
    if args.temperature > 0:
        methods = [m for m in methods if m not in PEERS]
    setup = _setup(args, methods)
    items = setup.items
    for m in methods:  # warm-up: first prompt, every method, not timed
        setup.one(m, 0)
    aggs: dict[tuple[str, str], Agg] = {}
    steps: dict[tuple[str, str, str], list[float]] = {}
    items_kinds = {item.get("kind", "prompt") for item in items}
    matches_new = edits = 0  # edit items whose plain output is the new version
    for n, item in enumerate(items):
        runs = _rounds(setup, methods, n)
        if "new" in item:
            produced = setup.engine.decode(runs["off"][0].ids)
            matches_new += int(produced.rstrip() == item["new"].rstrip())
            edits += 1
        kinds = {"all", item.get("kind", "prompt")} if len(items_kinds) > 1 else {"all"}
        accumulate(aggs, kinds, runs)
        add_steps(steps, runs)
    if edits:
        print(f"edits whose output equals the new version: {matches_new}/{edits}", file=sys.stderr)
    extra: dict[str, Any] = {"edits": edits, "output_equals_new": matches_new}
    print_table(aggs, setup.engine, args, extra, steps if args.steps else None)
    return 0


def _exact_prediction(
    engine: Engine, item: dict[str, Any], prepared: tuple, args: argparse.Namespace, n: int
) -> tuple:
    """An edit item's prepared prompt with its draft replaced by what plain greedy decoding
    of that same prompt writes: a prediction that is exactly the output (the model here
    rarely writes the workload's new version, so ``new`` drafts a text it does not
    write). The prompt itself is unchanged (a prediction in the prompt would change the
    output it predicts)."""
    if "new" not in item:
        return prepared
    prompt, max_tokens, draft, heal = prepared
    run = run_engine(engine, "off", prompt, max_tokens, None, item.get("uri"), draft,
                     args.max_draft, 0.0, args.seed + n, heal)  # fmt: skip
    return prompt, max_tokens, run.ids, heal
