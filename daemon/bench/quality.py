"""``codespec bench quality WORKLOAD.jsonl...``: are the completions any good?

Runs the daemon's own completion path (the document store, the prompt with its
cross-file context, token healing, the stop rules, the scheduler; no socket) at
real cursor positions of the ``completion`` and ``function`` workloads that
``codespec bench make-workloads`` writes, once per prompt variant
(``--variants none,header,crossfile``, see :data:`codespec.daemon.prompts.completion.CONTEXTS`;
``--middles line,cursor``, where a FIM prompt's middle starts, each variant once per
middle; ``--block-lines 4,8``, a block middle's grid, once per grid):

- ``completion`` items (the cursor at the start of a body line; ``--at``: after its
  indentation, after 4 more characters, or half-way through the rest, as while typing
  it): a single-line request, its line (the rest of it) against the file's real next
  line — exact match (whitespace at the ends aside) and character similarity
  (difflib's ratio); and a multi-line request, checked for looping.
- ``function`` items (the cursor after a ``def`` line): a multi-line request,
  cut where the block ends as the editor clients cut it; whether ``def`` + body
  parses, and whether it loops.

Looping (:func:`loops`): a non-blank line written three times, or a piece of 4+
characters repeated 4+ times in a row, in the completion the daemon returns
(``loops``); the daemon cuts such a loop off where it starts (``cut``: the share of
completions it cut). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import sys
import textwrap
from datetime import date
from typing import TYPE_CHECKING, Any

import msgspec

from codespec.daemon.bench.decoding import add_engine_args, open_engine
from codespec.daemon.bench.workload_items import load_workload
from codespec.daemon.config import Completion, Limits
from codespec.daemon.text.tracker import repeats_a_piece

if TYPE_CHECKING:
    from codespec.daemon.engine.engine import Engine


def loops(text: str) -> bool:
    """Whether ``text`` repeats itself: a non-blank line 3+ times, or a 4+ character
    piece 4+ times in a row."""
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    if any(lines.count(s) >= 3 for s in set(lines)):
        return True
    return any(repeats_a_piece(s) for s in lines)


def first_line(text: str) -> str:
    return text.split("\n", 1)[0].strip()


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def parses(header: str, body: str) -> bool:
    try:
        ast.parse(textwrap.dedent(header + body.rstrip() + "\n"))
    except SyntaxError:
        return False
    return True


class Runner:
    """The daemon's completion path without the socket, over one engine."""

    def __init__(self, engine: Engine, speculation: str, context_tokens: int) -> None:
        from codespec.daemon.config import Speculation
        from codespec.daemon.prompts.crossfile import SnippetCache
        from codespec.daemon.service.scheduler import Scheduler

        self.engine = engine
        self.speculation = speculation
        self.context_tokens = context_tokens
        self.middle = Completion().middle  # where a FIM prompt's middle starts (MIDDLES)
        self.suffix_tokens = Completion().suffix_tokens  # a FIM prompt's most suffix tokens
        self.block_lines = Completion().block_lines  # a block middle's grid
        self.snippets = SnippetCache()
        self.scheduler = Scheduler(engine, None, Speculation(), max_queue=4)
        self.scheduler.start()
        self.last_cut = False  # whether the daemon cut a loop off the last completion

    def complete(self, item: dict[str, Any], variant: str, multiline: bool) -> str:
        from codespec.daemon.engine.engine import GenParams
        from codespec.daemon.prompts import completion
        from codespec.daemon.service.documents import DocumentStore
        from codespec.daemon.service.scheduler import prepared_job

        store = DocumentStore()
        for d in reversed(item.get("documents", [])[1:]):  # the first listed is the newest
            store.open(d["uri"], d["text"], 1, "python")
        doc = store.open(item["uri"], item["prefix"] + item.get("suffix", ""), 1, "python")
        max_tokens = int(item.get("max_tokens", 64)) if multiline else 48
        req = completion.CompleteRequest(
            offset=len(item["prefix"]),
            max_tokens=max_tokens,
            multiline=multiline,
            context_tokens=self.context_tokens,
            context=variant,
            middle=self.middle,
            suffix_tokens=self.suffix_tokens,
            block_lines=self.block_lines,
        )
        prep = completion.prepare_complete(self.engine, store, self.snippets, doc, req)
        job = prepared_job(prep, GenParams(max_tokens=max_tokens), self.speculation,
                           "complete", item["uri"])  # fmt: skip
        result = self.scheduler.submit(job).result()
        self.last_cut = result.finish_reason == "loop"
        return completion.shape(result.text, multiline, result.finish_reason)

    def close(self) -> None:
        self.scheduler.stop()


AT = ("start", "indent", "4", "half")  # where in its line a completion item's cursor stands


def typed_into(item: dict[str, Any], at: str) -> dict[str, Any]:
    """``item`` with its cursor moved into the expected first line as if the user had
    typed part of it (:data:`AT`): ``start`` leaves it; ``indent``: after the line's
    indentation; ``4``: 4 characters after that; ``half``: half-way through the rest.
    The part typed moves from ``expected`` to ``prefix``.

    >>> it = {"prefix": "def f():\\n", "expected": "    return 1\\n", "suffix": ""}
    >>> [typed_into(it, a)["expected"] for a in AT]
    ['    return 1\\n', 'return 1\\n', 'rn 1\\n', 'rn 1\\n']
    """
    line = item["expected"].split("\n", 1)[0]
    indent = len(line) - len(line.lstrip())
    body = len(line) - indent
    k = {"start": 0, "indent": indent, "4": indent + min(4, body - 1),
         "half": indent + body // 2}[at]  # fmt: skip
    k = max(0, min(k, len(line) - 1))
    return {**item, "prefix": item["prefix"] + line[:k], "expected": item["expected"][k:]}


def block(item: dict[str, Any], text: str) -> str:
    """``text`` cut where the block ends, as the editor clients cut it."""
    from codespec.lsp.postprocess import CursorContext, truncate_block

    lines = (item["prefix"] + item.get("suffix", "")).splitlines()
    line = item["prefix"].count("\n")
    return truncate_block(text, CursorContext.from_lines(lines, line, 0))


def main(argv: list[str] | None = None) -> int:
    from codespec.daemon.prompts.completion import CONTEXTS, MIDDLES

    p = argparse.ArgumentParser(prog="codespec bench quality", description=__doc__.split("\n")[0])
    p.add_argument("workload", nargs="+", help="completion / function workloads (JSONL)")
    p.add_argument("--variants", default="none,crossfile", help=f"of {', '.join(CONTEXTS)}")
    p.add_argument("--limit", type=int, default=0, help="use only the first N items of each")
    p.add_argument("--speculation", default="auto", help="decoding method (output is the same)")
    p.add_argument("--context", type=int, default=Limits().context_tokens,
                   help="prompt tokens at most (default: the daemon's)")  # fmt: skip
    p.add_argument("--middles", default=Completion().middle,
                   help="of block, line, cursor (FIM models; default: the daemon's)")  # fmt: skip
    p.add_argument("--block-lines", default=str(Completion().block_lines),
                   help="a block middle's grids, e.g. 4,8 (default: the daemon's)")  # fmt: skip
    p.add_argument("--suffix-tokens", type=int, default=Completion().suffix_tokens,
                   help="a FIM prompt's most suffix tokens (default: the daemon's)")  # fmt: skip
    p.add_argument("--at", default="start", choices=AT,
                   help="where in its line a completion item's cursor stands")  # fmt: skip
    add_engine_args(p, threads=2)
    args = p.parse_args(argv)
    contexts = [v.strip() for v in args.variants.split(",") if v.strip()]
    middles = [m.strip() for m in args.middles.split(",") if m.strip()]
    bad = [v for v in contexts if v not in CONTEXTS] + [m for m in middles if m not in MIDDLES]
    if bad:
        p.error(f"unknown variants {bad}; choose from {', '.join(CONTEXTS + MIDDLES)}")
    try:  # each grid checked as the daemon's config checks it
        grids = [msgspec.convert({"block_lines": int(g)}, Completion).block_lines
                 for g in args.block_lines.split(",") if g.strip()]  # fmt: skip
    except (ValueError, msgspec.ValidationError) as exc:
        p.error(f"--block-lines {args.block_lines!r}: {exc}")
    if not grids:
        p.error("--block-lines: no grid given")
    variants = _variants(contexts, middles, grids)
    items: list[dict[str, Any]] = []
    for path in args.workload:
        wl = [it for it in load_workload(path) if it.get("kind") in ("completion", "function")]
        if any("expected" not in it for it in wl):
            p.error(f"{path}: items lack 'expected'; rebuild with codespec bench make-workloads")
        wl = wl[: args.limit] if args.limit else wl
        items += [typed_into(it, args.at) if it["kind"] == "completion" else it for it in wl]
    if not items:
        p.error("no completion or function items in the workloads")
    engine = open_engine(args)
    runner = Runner(engine, args.speculation, args.context)
    runner.suffix_tokens = args.suffix_tokens
    rows = {v: {"completion": 0, "exact": 0, "similarity": 0.0, "function": 0, "parses": 0,
                "multi": 0, "loops": 0, "cut": 0} for v, _, _, _ in variants}  # fmt: skip
    try:
        for n, item in enumerate(items):
            for v, context, middle, grid in variants:  # alternating per item: drift hits all
                runner.middle, runner.block_lines = middle, grid
                _score(runner, item, context, rows[v])
            print(f"  [{n + 1}/{len(items)}] {item['id']}", flush=True, file=sys.stderr)
    finally:
        runner.close()
    _report(rows, engine, args)
    return 0


def _variants(
    contexts: list[str], middles: list[str], grids: list[int]
) -> list[tuple[str, str, str, int]]:
    """``(label, context, middle, grid)``: a row per context, per middle and per block grid
    where more than one is asked (grids apply to block middles only)."""
    out = []
    for c in contexts:
        for m in middles:
            for g in grids if m == "block" else grids[:1]:
                label = c + (f"/{m}" if len(middles) > 1 else "")
                label += f"/grid{g}" if m == "block" and len(grids) > 1 else ""
                out.append((label, c, m, g))
    return out


def _score(runner: Runner, item: dict[str, Any], variant: str, r: dict[str, Any]) -> None:
    """Complete ``item`` with context ``variant`` and add what the completion scores to
    ``r``: a line item's first line against the expected one, then (both kinds) the
    multi-line completion's loops and cuts; a function item's body, whether it parses."""
    if item["kind"] == "completion":
        got = first_line(runner.complete(item, variant, multiline=False))
        want = first_line(item["expected"])
        r["completion"] += 1
        r["exact"] += int(got == want)
        r["similarity"] += similarity(got, want)
        multi = runner.complete(item, variant, multiline=True)
    else:
        multi = block(item, runner.complete(item, variant, multiline=True))
        r["function"] += 1
        r["parses"] += int(parses(item["header"], multi))
    r["multi"] += 1
    r["loops"] += int(loops(multi))
    r["cut"] += int(runner.last_cut)


def _report(rows: dict[str, dict[str, Any]], engine: Engine, args: argparse.Namespace) -> None:
    """The table, then one JSON line."""
    print(
        f"codespec bench quality ({date.today()}, model {engine.model_name}, "
        f"{engine.runner.name} runner, {args.threads} threads)"
    )
    head = f"{'variant':<16}{'lines':>6}{'exact':>8}{'similar':>9}"
    head += f"{'funcs':>7}{'parse':>8}{'loops':>8}{'cut':>7}"
    print(head)
    print("-" * len(head))
    out = []
    for v, r in rows.items():
        c, f, m = r["completion"], r["function"], r["multi"]
        exact = r["exact"] / c if c else 0.0
        sim = r["similarity"] / c if c else 0.0
        parse = r["parses"] / f if f else 0.0
        loop = r["loops"] / m if m else 0.0
        cut = r["cut"] / m if m else 0.0
        print(f"{v:<16}{c:>6}{exact:>8.1%}{sim:>9.3f}{f:>7}{parse:>8.1%}{loop:>8.1%}{cut:>7.1%}")
        out.append(
            {
                "variant": v,
                "lines": c,
                "first_line_exact": round(exact, 4),
                "first_line_similarity": round(sim, 4),
                "functions": f,
                "parses": round(parse, 4),
                "completions": m,
                "loops": round(loop, 4),
                "loops_cut": round(cut, 4),
            }
        )
    summary = {"bench": "quality", "date": str(date.today()), "model": engine.model_name,
               "at": args.at}  # fmt: skip
    print(json.dumps({**summary, "rows": out}))
