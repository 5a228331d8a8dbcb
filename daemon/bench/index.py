"""`codespec bench index`: micro-benchmark of the n-gram index.

Owns: three measurements on real Python code (the running interpreter's
standard library), printed as a table and one final JSON line:

- keystroke: one-character LSP edits (inserts and deletes at random places
  inside lines) on a file of N lines, swept over ``--lines`` (5,000 is the
  target case): p50 / p99 wall-clock and thread-CPU time per ``change``;
- indexing: tokens per second to open ``--tokens`` tokens of stdlib files as
  workspace documents and build the frozen segment, and the index's bytes per
  token (``stats()["bytes_per_token"]``: arrays + texts + line tables);
- lookup: p50 / p99 of ``lookup`` over that index for contexts cut from the
  indexed files.

Must not touch: the model, the engine, the daemon's state. Wall-clock
percentiles include preemption by whatever else runs on the machine; the
thread-CPU column is the index's own work.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

from codespec.daemon.engine import models
from codespec.ngram_index import NgramIndex

KEYS = "abcdefghijklmnopqrstuvwxyz_(). :,=0123456789"


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def load_tokenizer(path: str | None) -> tuple[Any, str]:
    """``path`` (a tokenizer.json, or a model folder holding one), else the default
    model's tokenizer (the model is fetched once if it is not cached yet)."""
    from tokenizers import Tokenizer

    if path:
        chosen = Path(path)
        if chosen.is_dir():
            chosen = chosen / "tokenizer.json"
        if not chosen.is_file():
            raise SystemExit(f"codespec bench index: error: no tokenizer at {path}")
    else:
        try:
            chosen = models.default_model() / "tokenizer.json"
        except models.ModelError as exc:
            raise SystemExit(f"codespec bench index: error: {exc}") from None
    return Tokenizer.from_file(str(chosen)), str(chosen)


def file_of_lines(files: list[Path], n_lines: int) -> str:
    lines: list[str] = []
    for p in files:
        lines += p.read_text(errors="replace").splitlines(keepends=True)
        if len(lines) >= n_lines:
            break
    return "".join(lines[:n_lines])


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def bench_keystrokes(tok: Any, text: str, n: int, rng: random.Random) -> dict[str, float]:
    """Single-character inserts (2/3) and deletes (1/3) at random places inside lines."""
    idx = NgramIndex(tok)
    uri = "file:///bench/keystroke.py"
    idx.open(uri, text)
    idx.touch(uri)
    doc = idx._docs[uri].doc  # the index's own text + line table, to pick valid positions
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(n):
        line = rng.randrange(doc.lines.line_count)
        start, end = doc.lines.line_span(doc.text, line)
        col = rng.randrange(end - start + 1)
        utf16 = doc.position_at(start + col)["character"]
        if col > 0 and rng.random() < 1 / 3:
            prev = doc.position_at(start + col - 1)["character"]
            rng_ = {
                "start": {"line": line, "character": prev},
                "end": {"line": line, "character": utf16},
            }
            change = {"range": rng_, "text": ""}
        else:
            pos = {"line": line, "character": utf16}
            change = {"range": {"start": pos, "end": pos}, "text": rng.choice(KEYS)}
        w0, c0 = time.perf_counter(), time.thread_time()
        idx.change(uri, [change])
        c1, w1 = time.thread_time(), time.perf_counter()
        wall.append((w1 - w0) * 1e6)
        cpu.append((c1 - c0) * 1e6)
    return {
        "tokens": float(len(idx.tokens(uri))),
        "p50_us": pct(wall, 50),
        "p99_us": pct(wall, 99),
        "cpu_p50_us": pct(cpu, 50),
        "cpu_p99_us": pct(cpu, 99),
    }


def bench_indexing(tok: Any, files: list[Path], target: int) -> tuple[NgramIndex, dict[str, float]]:
    """Open stdlib files as workspace documents until ``target`` tokens, then compact."""
    idx = NgramIndex(tok, max_tokens=max(target * 2, 1))
    t0 = time.perf_counter()
    for i, p in enumerate(files):
        idx.open(f"file:///stdlib/{i}.py", p.read_text(errors="replace"), kind="workspace")
        if idx.stats()["tokens"] >= target:
            break
    t1 = time.perf_counter()
    idx.compact()
    t2 = time.perf_counter()
    st = idx.stats()
    return idx, {
        "documents": float(st["documents"]),
        "tokens": float(st["tokens"]),
        "tokenize_s": t1 - t0,
        "compact_s": t2 - t1,
        "tokens_per_s": st["tokens"] / (t2 - t0),
        "bytes_per_token": st["bytes_per_token"],
        "mb": st["bytes"] / 2**20,
    }


def bench_lookup(idx: NgramIndex, n: int, rng: random.Random) -> dict[str, float]:
    uris = [u for u in idx._docs if idx._docs[u].tokens.shape[0] > 80]
    times: list[float] = []
    cpu: list[float] = []
    found = 0
    for _ in range(n):
        uri = rng.choice(uris)
        toks = idx.tokens(uri)
        cut = rng.randrange(16, len(toks))
        ctx = toks[max(0, cut - 64) : cut]
        t0, c0 = time.perf_counter(), time.thread_time()
        cands = idx.lookup(ctx, uri=uri, k=16, b=4)
        c1, t1 = time.thread_time(), time.perf_counter()
        times.append((t1 - t0) * 1e6)
        cpu.append((c1 - c0) * 1e6)
        found += bool(cands)
    return {
        "p50_us": pct(times, 50),
        "p99_us": pct(times, 99),
        "cpu_p50_us": pct(cpu, 50),
        "cpu_p99_us": pct(cpu, 99),
        "hit_rate": found / n,
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="codespec bench index", description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", help="tokenizer.json (default: the default model's)")
    ap.add_argument("--lines", default="1000,5000,20000", help="file sizes for the keystroke sweep")
    ap.add_argument("--keystrokes", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=1_000_000, help="tokens to index")
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def sweep_keystrokes(
    tok: Any, files: list[Path], sweep: list[int], n: int, rng: random.Random
) -> dict[str, dict[str, float]]:
    """:func:`bench_keystrokes` on a file of each size in ``sweep`` (lines cut from
    ``files``), printed as a table; the results by size."""
    keystroke: dict[str, dict[str, float]] = {}
    print(
        f"{'keystroke, lines':<18}{'tokens':>9}{'p50 us':>10}{'p99 us':>10}"
        f"{'cpu p50':>10}{'cpu p99':>10}"
    )
    for n_lines in sweep:
        r = bench_keystrokes(tok, file_of_lines(files, n_lines), n, rng)
        keystroke[str(n_lines)] = r
        print(
            f"{n_lines:<18}{int(r['tokens']):>9}{r['p50_us']:>10.0f}{r['p99_us']:>10.0f}"
            f"{r['cpu_p50_us']:>10.0f}{r['cpu_p99_us']:>10.0f}"
        )
    return keystroke


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    rng = random.Random(args.seed)
    tok, tok_name = load_tokenizer(args.tokenizer)
    files = stdlib_files()
    shuffled = files[:]
    random.Random(args.seed).shuffle(shuffled)
    sweep = [int(x) for x in args.lines.split(",") if x]

    print(f"tokenizer: {tok_name}", file=sys.stderr)
    keystroke = sweep_keystrokes(tok, shuffled, sweep, args.keystrokes, rng)

    idx, ind = bench_indexing(tok, shuffled, args.tokens)
    print(
        f"\nindexing: {int(ind['tokens'])} tokens in {int(ind['documents'])} files, "
        f"{ind['tokens_per_s']:.0f} tokens/s (tokenize {ind['tokenize_s']:.2f} s, "
        f"compact {ind['compact_s']:.2f} s), {ind['bytes_per_token']:.1f} bytes/token "
        f"({ind['mb']:.1f} MiB)"
    )
    look = bench_lookup(idx, args.lookups, rng)
    print(
        f"lookup over {int(ind['tokens'])} tokens: p50 {look['p50_us']:.0f} us, "
        f"p99 {look['p99_us']:.0f} us (cpu p50 {look['cpu_p50_us']:.0f} us, "
        f"p99 {look['cpu_p99_us']:.0f} us), contexts with a candidate {look['hit_rate']:.0%}"
    )

    target = keystroke.get("5000")
    print(
        json.dumps(
            {
                "bench": "index",
                "tokenizer": tok_name,
                "vocab": tok.get_vocab_size(),
                "keystroke": keystroke,
                "keystroke_5000_p99_ms": target["p99_us"] / 1000 if target else None,
                "keystroke_5000_cpu_p99_ms": target["cpu_p99_us"] / 1000 if target else None,
                "indexing": ind,
                "lookup": look,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
