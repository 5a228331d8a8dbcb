"""``codespec bench peers``: llama.cpp beside codespec, same GGUF, same prompts, one run.

llama.cpp is built once from the ``llama-cpp-python`` sdist on PyPI and its binaries
cached under ``<state dir>/peers/llama.cpp-<version>/bin`` (:mod:`.llamacpp`;
``$CODESPEC_PEERS`` overrides the ``peers`` folder). It is an optional peer: when the
download, cmake or the build fails, one line says why (``llama.cpp peer skipped: ...``)
and codespec's methods still run.

Per prompt (the workloads' items laid out as ``codespec bench`` lays them out), in
turn, the order rotating per prompt so machine noise hits every method alike:

- ``llama.cpp``: plain greedy decoding (``llama-completion``, the prompt text through
  ``-f``, ``--temp 0 -n N -t T``);
- ``llama-lookup``: llama.cpp's n-gram lookup decoding (``--draft K`` drafts at most);
- codespec's methods (``--methods``, default ``off,ngram,auto``) through the engine.

By default every run generates exactly ``--max-tokens`` tokens: llama.cpp with
``--ignore-eos``, codespec with its stop tokens cleared (``--stop-at-eos`` lets both
stop). Decode tokens/s is measured alike for all: tokens after the first over the
time after the first (llama.cpp: its ``eval`` timing; llama-lookup: its ``decoded``
line less the first token; codespec: wall time less the time to the first token);
prefill tokens/s is prompt tokens over the prompt's time. ``llama-bench -p 0 -n 64
-d 0,1000`` adds llama.cpp's plain decode at depth 0 and 1,000.

The prompt is the token ids codespec decodes, given to llama.cpp as their text
(unescaped); the table's ``= off`` says whether a codespec method's ids equal ``off``'s,
and for llama-lookup whether its text equals llama.cpp plain's. Prints a table and ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

from codespec.daemon.bench import llamacpp, llamacpp_run
from codespec.daemon.bench.llamacpp import LlamaCpp, PeerUnavailable
from codespec.daemon.bench.llamacpp_run import LlamaFailed, Options, Timed

LLAMA_PLAIN = "llama.cpp"
LLAMA_LOOKUP = "llama-lookup"


@dataclass
class Sum:
    """One method's runs added up."""

    prompts: int = 0
    tokens: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    equal: int = 0  # codespec: ids equal to off's; llama-lookup: text equal to llama.cpp's
    compared: int = 0
    agree_tokens: int = 0  # llama.cpp: leading tokens of its text equal to codespec off's

    def add(self, t: Timed) -> None:
        self.prompts += 1
        self.tokens += t.tokens
        self.decode_tokens += t.decode_tokens
        self.decode_s += t.decode_s
        self.prompt_tokens += t.prompt_tokens
        self.prefill_s += t.prefill_s
        self.forwards += t.forwards
        self.drafted += t.drafted
        self.accepted += t.accepted

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0


def build_parser() -> argparse.ArgumentParser:
    from codespec.daemon.bench.decoding import add_engine_args

    p = argparse.ArgumentParser(prog="codespec bench peers", description=__doc__.splitlines()[0])
    p.add_argument("workload", nargs="*", default=["/tmp/wl/edit.jsonl"],
                   help="JSONL workloads (see make-workloads)")  # fmt: skip
    p.add_argument("--methods", default="off,ngram,auto", help="codespec's methods (NAME@K)")
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    add_engine_args(p, threads=2)
    p.set_defaults(max_tokens=200)
    p.add_argument("--draft", type=int, default=10, help="llama-lookup's draft length")
    p.add_argument("--max-draft", type=int, default=16, help="codespec's draft tokens per forward")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens at most")
    p.add_argument("--ctx", type=int, default=4096, help="llama.cpp's context size (-c)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="let every method stop at its end-of-text tokens (default: all "
                   "generate --max-tokens tokens)")  # fmt: skip
    p.add_argument("--no-llama", action="store_true", help="codespec's methods only")
    p.add_argument("--rebuild", action="store_true", help="build llama.cpp again")
    p.add_argument("--bench-depths", default="0,1000", help="llama-bench's -d ('' skips it)")
    p.add_argument("--bench-gen", type=int, default=64, help="llama-bench's -n")
    p.add_argument("--bench-prompt", type=int, default=512,
                   help="llama-bench's -p: prefill of that many tokens (0: none)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600, help="seconds per llama.cpp run")
    return p


def options(args: argparse.Namespace) -> Options:
    return Options(args.max_tokens, args.threads, args.ctx, not args.stop_at_eos, args.draft,
                   args.timeout)  # fmt: skip


def model_gguf(model: str | None) -> Path | None:
    """The GGUF file behind ``--model`` (a cached model made from one, or a ``.gguf``)."""
    from codespec.daemon.engine import models

    folder = Path(models.resolve(model))
    manifest = models.read_manifest(folder)
    return models.CachedModel(folder, manifest).gguf if manifest else None


def skip_line(why: str) -> str:
    return f"llama.cpp peer skipped: {why}"


def find_llama(args: argparse.Namespace) -> tuple[LlamaCpp | None, Path | None, str]:
    """(the built llama.cpp, the model's GGUF, "") or (None, None, why not)."""
    if args.no_llama:
        return None, None, "--no-llama"
    gguf = model_gguf(args.model)
    if gguf is None:
        return None, None, "the model has no GGUF file"
    try:
        return llamacpp.llama_cpp(rebuild=args.rebuild), gguf, ""
    except PeerUnavailable as exc:
        return None, None, str(exc)


def main(argv: list[str] | None = None) -> int:
    from codespec.daemon.bench.decoding import open_engine
    from codespec.daemon.bench.workload_items import load_workload
    from codespec.speculators.registry import known

    args = build_parser().parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if not known(m.partition("@")[0])]
    if bad:
        print(f"codespec bench peers: unknown methods {bad}", file=sys.stderr)
        return 2
    if "off" not in methods:
        methods.insert(0, "off")
    try:
        loaded = [load_workload(path) for path in args.workload]
    except (OSError, ValueError) as exc:
        print(f"codespec bench peers: {llamacpp.one_line(exc)}", file=sys.stderr)
        return 2
    llama, gguf, skipped = find_llama(args)
    if skipped:  # at once on stderr (the bench runs for minutes), in the table at the end
        print(skip_line(skipped), file=sys.stderr, flush=True)
    engine = open_engine(args)
    stop_ids = engine.stop_ids
    if not args.stop_at_eos:
        engine.stop_ids = set()  # every method generates exactly --max-tokens tokens
    tmp = Path(tempfile.mkdtemp(prefix="codespec-peers-"))
    try:
        work = Workload(engine, loaded, args, tmp)
        runners = work.runners(methods, llama, gguf)
        sums, failed = run_all(work, runners, methods)
        bench = _llama_bench(llama, gguf, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        engine.stop_ids = stop_ids
    skipped = skipped or next(iter(failed.values()), "")
    rows = report_rows(sums, methods)
    print_table(rows, engine, args, llama, bench, skipped, len(work.items))
    return 0


class Workload:
    """The prompts laid out as ``codespec bench`` lays them out, with their text in files
    for llama.cpp, and the runner of each method on prompt n."""

    def __init__(self, engine, loaded: list[list[dict[str, Any]]], args, tmp: Path) -> None:
        from codespec.daemon.bench.workload_items import build_index, build_prompt

        items = [item for wl in loaded for item in wl]
        which = [w for w, wl in enumerate(loaded) for _ in wl]  # each item's workload
        if args.limit:
            items, which = items[: args.limit], which[: args.limit]
        self.engine, self.args, self.items, self.which = engine, args, items, which
        self.indexes = [build_index(engine, wl) for wl in loaded]
        self.prompts = [build_prompt(engine, it, args.max_tokens, "none", args.context)
                        for it in items]  # fmt: skip
        self.texts = [engine.decode(p[0]) for p in self.prompts]
        self.files = [tmp / f"prompt-{n}.txt" for n in range(len(items))]
        for path, text in zip(self.files, self.texts, strict=True):
            path.write_text(text + "\n", encoding="utf-8")  # -f drops one final newline

    def runners(self, methods: list[str], llama: LlamaCpp | None, gguf: Path | None):
        opts = options(self.args)
        runners: dict[str, Callable[[int], Timed]] = {}
        if llama is not None and gguf is not None:
            if llama.plain is not None:
                runners[LLAMA_PLAIN] = lambda n: llamacpp_run.run_plain(llama, opts, gguf,
                                                                    self.files[n])  # fmt: skip
            if llama.lookup is not None:
                runners[LLAMA_LOOKUP] = lambda n: llamacpp_run.run_lookup(
                    llama, opts, gguf, self.files[n], self.texts[n]
                )
        for m in methods:
            runners[m] = lambda n, m=m: self.codespec(m, n)
        return runners

    def codespec(self, method: str, n: int) -> Timed:
        """codespec's ``method`` on prompt n, timed as ``codespec bench`` times it."""
        from codespec.daemon.bench.decoding import draft_budget, run_engine

        item = self.items[n]
        prompt, max_tokens, draft_ids, heal = self.prompts[n]
        index = self.indexes[self.which[n]]
        if index is not None and item.get("uri") in index:
            index.touch(item["uri"])
        budget = draft_budget(method, item, self.args.max_draft)
        r = run_engine(self.engine, method.partition("@")[0], prompt, max_tokens, index,
                       item.get("uri"), draft_ids, budget, 0.0, 0, heal)  # fmt: skip
        return Timed(max(0, r.tokens - 1), max(1e-9, (r.ms - r.first_ms) / 1000), len(prompt),
                     max(1e-9, r.first_ms / 1000), r.tokens, self.engine.decode(r.ids),
                     list(r.ids), r.forwards)  # fmt: skip


def run_all(work: Workload, runners: dict[str, Callable[[int], Timed]], methods: list[str]):
    """Every method on every prompt, the order rotating per prompt (after a warm-up on the
    first prompt); a llama.cpp binary that fails is left out from then on."""
    failed: dict[str, str] = {}

    def one(name: str, n: int) -> Timed | None:
        if name in failed:
            return None
        try:
            return runners[name](n)
        except LlamaFailed as exc:
            failed[name] = str(exc)
            print(skip_line(str(exc)), file=sys.stderr, flush=True)
            return None

    order = list(runners)
    for name in order:  # warm-up: the first prompt, every method, not timed
        one(name, 0)
    sums = {name: Sum() for name in order}
    for n, item in enumerate(work.items):
        turn = order[n % len(order) :] + order[: n % len(order)]
        runs = {name: r for name in turn if (r := one(name, n)) is not None}
        _accumulate(sums, runs, methods, work.engine)
        line = "  ".join(f"{k} {r.decode_tokens / r.decode_s:.0f} tok/s" for k, r in runs.items())
        print(f"  [{n + 1}/{len(work.items)}] {item.get('id', n)}: {line}", file=sys.stderr)
    for name in failed:
        sums.pop(name, None)
    return sums, failed


def _accumulate(sums: dict[str, Sum], runs: dict[str, Timed], methods: list[str], engine) -> None:
    off = runs["off"]
    plain = runs.get(LLAMA_PLAIN)
    for name, r in runs.items():
        s = sums[name]
        s.add(r)
        if name in methods:
            s.compared += 1
            s.equal += int(r.ids == off.ids)
        elif name == LLAMA_LOOKUP and plain is not None:
            s.compared += 1
            s.equal += int(r.text[: len(plain.text)] == plain.text)  # lookup may overshoot
        if name in (LLAMA_PLAIN, LLAMA_LOOKUP):
            s.agree_tokens += _agree(engine.encode(r.text), off.ids or [])


def _agree(ids: list[int], off_ids: list[int]) -> int:
    """Leading tokens of ``ids`` equal to ``off_ids``."""
    n = 0
    for a, b in zip(ids, off_ids, strict=False):
        if a != b:
            break
        n += 1
    return n


def _llama_bench(llama: LlamaCpp | None, gguf: Path | None, args) -> list[dict[str, Any]]:
    if llama is None or gguf is None or llama.bench is None or not args.bench_depths:
        return []
    try:
        return llamacpp_run.run_bench(llama, gguf, args.bench_depths, args.bench_gen, options(args),
                                  args.bench_prompt)  # fmt: skip
    except LlamaFailed as exc:
        print(f"llama-bench skipped: {exc}", file=sys.stderr, flush=True)
        return []


def report_rows(sums: dict[str, Sum], methods: list[str]) -> list[dict[str, Any]]:
    """One row per method: speeds, ratios to llama.cpp plain and llama-lookup, equality."""
    plain, lookup = sums.get(LLAMA_PLAIN), sums.get(LLAMA_LOOKUP)
    rows = []
    for name, s in sums.items():
        if not s.prompts:
            continue
        vs_plain = s.decode_tps / plain.decode_tps if plain and plain.decode_tps else None
        vs_lookup = s.decode_tps / lookup.decode_tps if lookup and lookup.decode_tps else None
        row: dict[str, Any] = {
            "method": name,
            "tool": "codespec" if name in methods else "llama.cpp",
            "prompts": s.prompts,
            "tokens": s.tokens,
            "prompt_tokens": s.prompt_tokens,
            "decode_tokens_per_s": round(s.decode_tps, 2),
            "prefill_tokens_per_s": round(s.prefill_tps, 1),
            "decode_vs_llama_cpp": round(vs_plain, 3) if vs_plain else None,
            "decode_vs_llama_lookup": round(vs_lookup, 3) if vs_lookup else None,
        }
        if name in methods:
            row.update(target_forwards=s.forwards, equal_to_off=s.equal)
        else:
            row["agree_with_off_tokens"] = round(s.agree_tokens / s.prompts, 1)
        if name == LLAMA_LOOKUP:
            row.update(drafted=s.drafted, accepted=s.accepted, equal_to_llama_cpp=s.equal)
        rows.append(row)
    return rows


def _cell(x: float | None, width: int, fmt: str, unit: str = "") -> str:
    return f"{'-' if x is None else format(x, fmt) + unit:>{width}}"


def print_table(rows: list[dict[str, Any]], engine, args: argparse.Namespace,
                llama: LlamaCpp | None, bench: list[dict[str, Any]], skipped: str,
                prompts: int) -> None:  # fmt: skip
    version = f"llama.cpp from {llamacpp.SDIST} {llama.version}" if llama else "no llama.cpp"
    print(
        f"codespec bench peers {' '.join(args.workload)}  ({prompts} prompts, "
        f"{args.max_tokens} tokens{'' if args.stop_at_eos else ' each'}, greedy, "
        f"{args.threads} threads, {date.today()}, {platform.machine()}, "
        f"{engine.runner.name} runner, model {engine.model_name}, {version})"
    )
    head = f"{'method':<14}{'tokens':>7}{'decode tok/s':>14}{'prefill tok/s':>15}"
    head += f"{'vs llama.cpp':>14}{'vs lookup':>11}{'tok/fwd':>9}{'accept':>9}{'= off':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        fwd, drafted = r.get("target_forwards"), r.get("drafted")
        if "equal_to_off" in r:
            equal = f"{r['equal_to_off']}/{r['prompts']}"
        elif "equal_to_llama_cpp" in r:
            equal = f"({r['equal_to_llama_cpp']}/{r['prompts']})"
        else:
            equal = "-"
        print(
            f"{r['method']:<14}{r['tokens']:>7}{r['decode_tokens_per_s']:>14.1f}"
            f"{r['prefill_tokens_per_s']:>15.0f}"
            f"{_cell(r['decode_vs_llama_cpp'], 14, '.2f', 'x')}"
            f"{_cell(r['decode_vs_llama_lookup'], 11, '.2f', 'x')}"
            f"{_cell(r['tokens'] / fwd if fwd else None, 9, '.2f')}"
            f"{_cell(r['accepted'] / drafted if drafted else None, 9, '.0%')}{equal:>8}"
        )
    agree = [f"{r['method']} {r['agree_with_off_tokens']:.0f}" for r in rows
             if "agree_with_off_tokens" in r]  # fmt: skip
    if agree:
        print("leading tokens equal to codespec off's output (mean a prompt): " + "  ".join(agree))
        print("(= off for llama-lookup: prompts whose text equals llama.cpp plain's)")
    for b in bench:
        what = f"prefill pp{b['prompt']}" if b["prompt"] else f"decode tg{b['gen']}"
        print(f"llama-bench {what} depth {b['depth']:>5}: {b['tokens_per_s']:.1f} ± "
              f"{b['stddev']:.1f} tok/s")  # fmt: skip
    if skipped:
        print(skip_line(skipped))
    info = None
    if llama:
        info = {"version": llama.version, "build_seconds": llama.info.get("build_seconds"),
                "cmake_flags": llama.info.get("cmake_flags"), "draft": args.draft}  # fmt: skip
    print(json.dumps({
        "bench": "peers", "workload": ",".join(Path(w).name for w in args.workload),
        "prompts": prompts, "max_tokens": args.max_tokens, "ignore_eos": not args.stop_at_eos,
        "threads": args.threads, "date": str(date.today()), "machine": platform.machine(),
        "runner": engine.runner.name, "llama_cpp": info, "skipped": skipped or None,
        "llama_bench": bench, "rows": rows,
    }))  # fmt: skip
