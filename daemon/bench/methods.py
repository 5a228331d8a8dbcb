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
import json
import platform
import sys
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

PEERS = ("hf", "hf-pld")


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


@dataclass
class Agg:
    prompts: int = 0
    tokens: int = 0
    forwards: int = 0
    ms: float = 0.0
    off_ms: float = 0.0
    decode_ms: float = 0.0
    off_decode_ms: float = 0.0
    equal: int = 0


def load_workload(path: str) -> list[dict[str, Any]]:
    items = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
            if not isinstance(item, dict) or not {"prompt", "prompt_ids", "prefix"} & set(item):
                raise ValueError(f"{path}:{n}: needs a 'prompt', 'prompt_ids' or 'prefix'")
            items.append(item)
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


class HFPeer:
    """transformers' own generate() on the engine's checkpoint, with a forward counter."""

    def __init__(self, engine) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from codespec.daemon.engine.runner import HFRunner

        if isinstance(engine.runner, HFRunner):
            self.model = engine.runner.model
        else:
            dtype = torch.bfloat16 if engine.device.type == "cuda" else torch.float32
            from codespec.daemon.engine.models import hf_checkpoint

            self.model = AutoModelForCausalLM.from_pretrained(
                hf_checkpoint(engine.model_path), local_files_only=True, dtype=dtype
            ).to(engine.device)
        self.model.eval()
        self.engine = engine
        self.calls = 0
        self.model.register_forward_pre_hook(self._count)

    def _count(self, *_: object) -> None:
        self.calls += 1

    def run(self, prompt: list[int], max_tokens: int, lookup: int | None) -> Run:
        import torch

        stop = sorted(self.engine.stop_ids)
        x = torch.tensor([prompt], device=self.engine.device)
        kwargs: dict[str, Any] = {}
        if lookup:
            kwargs["prompt_lookup_num_tokens"] = lookup
        self.calls = 0
        timer = _FirstTokenTimer()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=stop,
                pad_token_id=stop[0],
                streamer=timer,
                **kwargs,
            )
        ms = (time.perf_counter() - t0) * 1000
        ids = out[0, len(prompt) :].tolist()
        for i, t in enumerate(ids):
            if t in self.engine.stop_ids:
                ids = ids[:i]
                break
        return Run(len(ids), self.calls, ms, ids, (timer.first - t0) * 1000 if timer.first else ms)


class _FirstTokenTimer:
    """A generate() streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first = 0.0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first put is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def decode_once(
    engine, prompt: list[int], params, proposer=None, info=None
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
    engine,
    method: str,
    prompt: list[int],
    max_tokens: int,
    index,
    uri,
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
    engine, method: str, item: dict[str, Any], prepared: tuple, index, args, seed: int
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


def _accumulate(
    aggs: dict[tuple[str, str], Agg], kinds: set[str], runs: dict[str, list[Run]]
) -> None:
    """Add one prompt's runs to the sums of each of ``kinds`` (``all`` and the item's).

    ``runs``: each method's runs of the prompt (one a round). The time counted is the
    fastest round's (wall time and decode time each on its own: a shared machine's noise
    only ever adds time); tokens and forwards are the first round's, and a method equals
    off only if every round of it wrote off's first round's tokens.
    """
    off = runs["off"]
    off_ms = min(r.ms for r in off)
    off_decode = min(r.ms - r.first_ms for r in off)
    for kind in kinds:
        for m, rs in runs.items():
            a = aggs.setdefault((kind, m), Agg())
            a.prompts += 1
            a.tokens += rs[0].tokens
            a.forwards += rs[0].forwards
            a.ms += min(r.ms for r in rs)
            a.off_ms += off_ms
            a.decode_ms += min(r.ms - r.first_ms for r in rs)
            a.off_decode_ms += off_decode
            a.equal += int(all(r.ids == off[0].ids for r in rs))


def add_steps(table: dict[tuple[str, str, str], list[float]], runs: dict[str, list[Run]]) -> None:
    """Add one prompt's verified steps to ``table`` ((method, source, outcome) -> [steps,
    nodes, tokens, forward ms]): each method's fastest round by decode time, the round
    whose time the figures count."""
    for m, rs in runs.items():
        fastest = min(rs, key=lambda r: r.ms - r.first_ms)
        for st in fastest.steps:
            row = table.setdefault((m, st.source, st.outcome), [0, 0, 0, 0.0])
            row[0] += 1
            row[1] += st.nodes
            row[2] += st.tokens
            row[3] += st.forward_ms


def print_steps(table: dict[tuple[str, str, str], list[float]]) -> list[dict[str, Any]]:
    """The ``--steps`` table (by method, the costliest rows first); its rows for the JSON."""
    head = f"{'method':<11}{'drafted by':<20}{'outcome':<9}{'steps':>7}{'nodes':>8}"
    head += f"{'tokens':>8}{'forward ms':>12}{'ms/token':>10}"
    print("where decode time went (each prompt's fastest round; the verify forwards' ms)")
    print(head)
    print("-" * len(head))
    rows = []
    for (m, source, outcome), (n, nodes, tokens, ms) in sorted(
        table.items(), key=lambda kv: (kv[0][0], -kv[1][3])
    ):
        per = ms / tokens if tokens else 0.0
        print(f"{m:<11}{source:<20}{outcome:<9}{n:>7}{nodes:>8}{tokens:>8}{ms:>12.0f}{per:>10.2f}")
        rows.append({"method": m, "source": source, "outcome": outcome, "steps": n,
                     "nodes": nodes, "tokens": tokens, "forward_ms": round(ms, 1)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    methods, bad = parse_methods(args.methods)
    if bad:
        print(f"codespec bench: unknown methods {bad}", file=sys.stderr)
        return 2
    if args.temperature > 0:
        methods = [m for m in methods if m not in PEERS]
    loaded = [load_workload(path) for path in args.workload]
    items = [item for wl in loaded for item in wl]
    which = [w for w, wl in enumerate(loaded) for _ in wl]  # each item's workload
    if args.limit:
        items, which = items[: args.limit], which[: args.limit]
    engine = open_engine(args)
    peer = HFPeer(engine) if any(m in PEERS for m in methods) else None
    # one index per workload: a workload's open documents are not another one's
    indexes = [_build_index(engine, wl) for wl in loaded]
    prompts = [
        build_prompt(engine, item, args.max_tokens, args.prediction, args.context) for item in items
    ]

    if args.prediction == "output":
        prompts = [_exact_prediction(engine, item, p, args, n) for n, (item, p) in
                   enumerate(zip(items, prompts, strict=True))]  # fmt: skip

    def one(method: str, n: int) -> Run:
        if method not in PEERS:
            index = indexes[which[n]]
            return run_method(engine, method, items[n], prompts[n], index, args, args.seed + n)
        assert peer is not None
        prompt, max_tokens = prompts[n][:2]
        return peer.run(prompt, max_tokens, args.lookup if method == "hf-pld" else None)

    for m in methods:  # warm-up: first prompt, every method, not timed
        one(m, 0)
    aggs: dict[tuple[str, str], Agg] = {}
    steps: dict[tuple[str, str, str], list[float]] = {}
    items_kinds = {item.get("kind", "prompt") for item in items}
    matches_new = edits = 0  # edit items whose plain output is the new version
    for n, item in enumerate(items):
        runs: dict[str, list[Run]] = {m: [] for m in methods}
        for k in range(args.rounds):  # each round starts with the next method
            at = (n + k) % len(methods)
            for m in methods[at:] + methods[:at]:
                runs[m].append(one(m, n))
        if "new" in item:
            produced = engine.decode(runs["off"][0].ids)
            matches_new += int(produced.rstrip() == item["new"].rstrip())
            edits += 1
        kinds = {"all", item.get("kind", "prompt")} if len(items_kinds) > 1 else {"all"}
        _accumulate(aggs, kinds, runs)
        add_steps(steps, runs)
        print(
            f"  [{n + 1}/{len(items)}] {item.get('id', n)}: "
            + "  ".join(
                f"{m} {'/'.join(f'{r.ms:.0f}' for r in rs)}ms/{rs[0].forwards}f"
                for m, rs in runs.items()
            ),
            file=sys.stderr,
        )
    if edits:
        print(f"edits whose output equals the new version: {matches_new}/{edits}", file=sys.stderr)
    extra: dict[str, Any] = {"edits": edits, "output_equals_new": matches_new}
    print_table(aggs, engine, args, extra, steps if args.steps else None)
    return 0


def _exact_prediction(engine, item: dict[str, Any], prepared: tuple, args, n: int) -> tuple:
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


def build_prompt(
    engine,
    item: dict[str, Any],
    max_override: int,
    prediction: str = "none",
    context: int = 1024,
) -> tuple[list[int], int, list[int] | None, str]:
    """Token ids, max_tokens, draft ids and healed text of one workload item, laid out as
    the daemon lays out its prompts (:mod:`codespec.daemon.prompts.completion`).

    Edit items are ``edit`` requests on the old file with the old function as the range:
    ``prediction`` ``none``, ``old`` or ``output`` — the old region is the draft (the
    request carries no prediction; for ``output`` main() then swaps in the exact output
    as the draft, see :func:`_exact_prediction`); ``new`` — the request's prediction is
    the new version (predicted
    outputs / fast apply: the client already knows the new code). Completion-like items
    (a ``prefix``) are ``complete`` requests at the end of the prefix. The healed text is
    what the first generated tokens must spell out (a constraint, as in the daemon).
    """
    from codespec.daemon.prompts import completion

    max_tokens = max_override or int(item.get("max_tokens", 64))
    if "new" in item:  # an edit: room for the new text and a little more
        if not max_override:
            max_tokens = min(max_tokens, len(engine.encode(item["new"])) + 16)
        before = item["prefix"][: len(item["prefix"]) - len(item["old"]) - 1]
        text = before + item["old"] + item.get("suffix", "")
        draft = item["new"] if prediction == "new" else item["old"]
        ep = completion.edit_prompt(
            engine, text, len(before), len(before) + len(item["old"]), draft, "", "python",
            max_tokens, context_tokens=context,
        )  # fmt: skip
        return ep.prompt_ids, max_tokens, ep.draft_ids, ep.heal
    if "prefix" in item:
        text = item["prefix"] + item.get("suffix", "")
        cp = completion.complete_prompt(
            engine, text, len(item["prefix"]), max_tokens, context, uri=item.get("uri", "")
        )
        return cp.prompt_ids, max_tokens, None, cp.heal
    budget = min(context, engine.max_length - 1 - max_tokens)
    ids = item.get("prompt_ids") or engine.encode(item["prompt"])
    return ids[-budget:], max_tokens, None, ""


def _build_index(engine, items: list[dict[str, Any]]):
    docs = {d["uri"]: d["text"] for it in items for d in it.get("documents", [])}
    if not docs:
        return None
    try:
        from codespec.ngram_index import NgramIndex
    except ImportError:
        return None
    index = NgramIndex(engine.tokenizer.backend_tokenizer)
    for uri, text in docs.items():
        index.open(uri, text)
    return index


def print_table(
    aggs: dict[tuple[str, str], Agg],
    engine,
    args: argparse.Namespace,
    extra: dict[str, Any],
    steps: dict[tuple[str, str, str], list[float]] | None = None,
) -> None:
    """The table, ``steps``' table (:func:`print_steps`) when given, then the JSON line."""
    head = f"{'workload':<11}{'method':<9}{'prompts':>8}{'tokens':>8}{'forwards':>9}"
    head += f"{'tok/fwd':>9}{'wall ms':>10}{'vs off':>8}{'decode ms':>11}{'vs off':>8}{'= off':>8}"
    print(
        f"codespec bench {' '.join(args.workload)}  (temperature {args.temperature}, "
        f"{date.today()}, {platform.machine()}, "
        f"{engine.device.type}, {engine.runner.name} runner, model {engine.model_name})"
    )
    print(head)
    print("-" * len(head))
    rows = []
    for (kind, m), a in aggs.items():
        tpf = a.tokens / a.forwards if a.forwards else 0.0
        speed = a.off_ms / a.ms if a.ms else 0.0
        dspeed = a.off_decode_ms / a.decode_ms if a.decode_ms > 0 else 0.0
        print(
            f"{kind:<11}{m:<9}{a.prompts:>8}{a.tokens:>8}{a.forwards:>9}{tpf:>9.2f}"
            f"{a.ms:>10.0f}{speed:>7.2f}x{a.decode_ms:>11.0f}{dspeed:>7.2f}x"
            f"{a.equal:>5}/{a.prompts:<2}"
        )
        rows.append(
            {
                "workload": kind,
                "method": m,
                "prompts": a.prompts,
                "tokens": a.tokens,
                "target_forwards": a.forwards,
                "tokens_per_forward": round(tpf, 3),
                "wall_ms": round(a.ms, 1),
                "speedup_vs_off": round(speed, 3),
                "decode_ms": round(a.decode_ms, 1),
                "decode_speedup_vs_off": round(dspeed, 3),
                "equal_to_off": a.equal,
            }
        )
    if steps is not None:
        extra = {**extra, "steps": print_steps(steps)}
    print(
        json.dumps(
            {
                "bench": "methods",
                "workload": ",".join(Path(w).name for w in args.workload),
                "temperature": args.temperature,
                "date": str(date.today()),
                "device": engine.device.type,
                "runner": engine.runner.name,
                "prediction": args.prediction,
                "rounds": args.rounds,
                **extra,
                "rows": rows,
            }
        )
    )
