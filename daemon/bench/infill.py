"""``codespec bench infill``: a FIM completion end to end, codespec's daemon beside
``llama-server``'s ``/infill`` (the endpoint llama.vim calls), same GGUF, same spots.

Both servers run at once on the model's GGUF with the same thread count: ``codespec
serve`` (its socket) and ``llama-server`` (built once with the other llama.cpp peers,
:mod:`.llamacpp`, on a loopback port, started the way llama.vim's README starts it:
``--cache-reuse 256``, ``-ub 1024 -b 1024``, one slot). For each completion item of the
workloads, in turn, the order of the two alternating, each server is asked once (the
first request at that spot: nothing replays an earlier identical request):

- codespec: the same text llama-server gets (the ``--n-prefix`` lines before the cursor's
  line, the cursor's line, the ``--n-suffix`` lines after) is opened as the file, then
  ``complete`` at the cursor (``multiline``, greedy, ``--max-tokens``, the daemon's
  default speculation). The daemon runs with ``warm_after_s = 0``: no prefill on open
  that llama-server has no counterpart of. The item's other documents are opened only
  with ``--extra`` (llama-server then gets chunks of them as ``input_extra``);
- llama-server: ``POST /infill`` with ``input_prefix`` (the lines before the cursor's
  line, at most ``--n-prefix`` lines, as llama.vim sends them), ``prompt`` (the cursor's
  line up to the cursor), ``input_suffix`` (the rest, at most ``--n-suffix`` lines),
  ``input_extra`` (``--extra`` chunks of the other documents, llama.vim's ring of
  chunks; none by default, as codespec's default prompt has no cross-file context),
  greedy (``top_k`` 1, temperature 0), ``n_predict`` ``--max-tokens``, ``cache_prompt``.

Time is the wall time of the request, client side, from sending it to the whole reply.
Prints a table (p50 / mean / p90 ms, tokens, first lines that agree) and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from codespec.daemon.bench import llamacpp
from codespec.daemon.bench.llamacpp import PeerUnavailable
from codespec.daemon.bench.served import percentile, start_daemon
from codespec.daemon.client import Client

CODESPEC = "codespec"
LLAMA_SERVER = "llama-server /infill"


@dataclass
class Side:
    """One server's requests: wall ms, tokens and texts, item by item."""

    ms: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def row(self, name: str) -> dict[str, Any]:
        return {
            "method": name,
            "requests": len(self.ms),
            "p50_ms": round(percentile(self.ms, 0.5), 1),
            "p90_ms": round(percentile(self.ms, 0.9), 1),
            "mean_ms": round(statistics.fmean(self.ms), 1) if self.ms else 0.0,
            "mean_tokens": round(statistics.fmean(self.tokens), 1) if self.tokens else 0.0,
        }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="codespec bench infill", description=__doc__.splitlines()[0])
    p.add_argument("workload", nargs="+", help="JSONL workloads (completion items are used)")
    p.add_argument("--model", default=None, help="a named model, a .gguf or a cached folder")
    p.add_argument("--limit", type=int, default=16, help="use only the first N items")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens at most per completion")
    p.add_argument("--threads", type=int, default=2, help="threads of each server")
    p.add_argument("--n-prefix", type=int, default=256, help="llama.vim's lines before")
    p.add_argument("--n-suffix", type=int, default=64, help="llama.vim's lines after")
    p.add_argument("--extra", type=int, default=0, help="input_extra chunks of other files")
    p.add_argument("--ctx", type=int, default=8192, help="llama-server's context (-c)")
    p.add_argument("--speculation", default=None, help="codespec's method (default: auto)")
    return p


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, args: argparse.Namespace) -> Iterator[str]:
    """``llama-server`` on a free loopback port until the block ends; its base URL."""
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "-c", str(args.ctx),
           "-np", "1", "-ub", "1024", "-b", "1024", "--cache-reuse", "256"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read() if proc.stderr else ""
                raise PeerUnavailable(f"llama-server exited: {err.strip().splitlines()[-1:]}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(url + "/health", timeout=2) as r,
            ):
                if r.status == 200:
                    break
            if time.monotonic() > deadline:
                raise PeerUnavailable("llama-server did not come up in 180 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()


def split_cursor(prefix: str, n_prefix: int) -> tuple[str, str]:
    """llama.vim's split of the text before the cursor: (the lines before the cursor's
    line, at most ``n_prefix`` of them; the cursor's line up to the cursor)."""
    head, _, line = prefix.rpartition("\n")
    lines = head.split("\n") if head or prefix.count("\n") else []
    before = "\n".join(lines[-n_prefix:]) + "\n" if lines else ""
    return before, line


def extra_chunks(docs: list[dict[str, Any]], count: int, lines: int = 64) -> list[dict]:
    """``count`` chunks of ``lines`` lines from the other documents, one a document from
    its middle, as llama.vim's ring holds chunks of text the user has seen."""
    out = []
    for d in docs[:count]:
        rows = str(d.get("text", "")).split("\n")
        mid = max(0, len(rows) // 2 - lines // 2)
        out.append({"filename": str(d.get("uri", "")).rpartition("/")[2],
                    "text": "\n".join(rows[mid : mid + lines]) + "\n"})  # fmt: skip
    return out


def ask_infill(url: str, item: dict[str, Any], args: argparse.Namespace) -> tuple[float, str, int]:
    before, line, suffix = window(item, args)
    body = {"input_prefix": before, "prompt": line, "input_suffix": suffix,
            "input_extra": extra_chunks(item.get("documents") or [], args.extra),
            "n_predict": args.max_tokens, "temperature": 0.0, "top_k": 1,
            "samplers": ["top_k"], "cache_prompt": True, "stream": False}  # fmt: skip
    req = urllib.request.Request(url + "/infill", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        reply = json.loads(r.read())
    ms = (time.perf_counter() - t0) * 1000
    return ms, str(reply.get("content", "")), int(reply.get("tokens_predicted", 0))


def window(item: dict[str, Any], args: argparse.Namespace) -> tuple[str, str, str]:
    """The text both servers see: (lines before the cursor's line, the cursor's line up
    to the cursor, the text after it, at most ``--n-suffix`` lines)."""
    before, line = split_cursor(item["prefix"], args.n_prefix)
    suffix = "\n".join(item.get("suffix", "").split("\n")[: args.n_suffix])
    return before, line, suffix


def ask_codespec(c: Client, item: dict[str, Any], n: int, args) -> tuple[float, str, int]:
    uri = f"file:///bench/infill/{n}/" + str(item.get("uri", "x.py")).rpartition("/")[2]
    if args.extra:
        for d in item.get("documents") or []:
            c.request("open", {"uri": f"file:///bench/infill/{n}/d/" + str(
                d["uri"]).rpartition("/")[2], "text": d["text"]})  # fmt: skip
    before, cursor_line, suffix = window(item, args)
    c.request("open", {"uri": uri, "text": before + cursor_line + suffix})
    line = before.count("\n")
    col = len(cursor_line.encode("utf-16-le")) // 2
    params = {"uri": uri, "position": {"line": line, "character": col}, "multiline": True,
              "max_tokens": args.max_tokens, "temperature": 0.0}  # fmt: skip
    if args.speculation:
        params["speculation"] = args.speculation
    t0 = time.perf_counter()
    r = c.request("complete", params)
    ms = (time.perf_counter() - t0) * 1000
    return ms, str(r.get("text", "")), int((r.get("stats") or {}).get("tokens", 0))


def first_line(text: str) -> str:
    return text.lstrip("\n").split("\n", 1)[0].rstrip()


def main(argv: list[str] | None = None) -> int:
    from codespec.daemon.bench.peers import model_gguf
    from codespec.daemon.bench.workload_items import load_workload

    args = build_parser().parse_args(argv)
    items = [it for w in args.workload for it in load_workload(w)
             if it.get("kind") in ("completion", "function")][: args.limit]  # fmt: skip
    if not items:
        print("codespec bench infill: no completion items in the workloads", file=sys.stderr)
        return 2
    gguf = model_gguf(args.model)
    if gguf is None:
        print("codespec bench infill: the model has no GGUF file", file=sys.stderr)
        return 2
    try:
        llama = llamacpp.llama_cpp(server=True)
    except PeerUnavailable as exc:
        print(f"codespec bench infill: llama-server unavailable: {exc}", file=sys.stderr)
        return 1
    if llama.server is None:
        print("codespec bench infill: this llama.cpp build has no llama-server", file=sys.stderr)
        return 1
    conf = Path(tempfile.mkdtemp(prefix="codespec-infill-")) / "config.toml"
    conf.write_text("[completion]\nwarm_after_s = 0\n", encoding="utf-8")
    extra = ["--config", str(conf)] + (["--model", args.model] if args.model else [])
    proc, sock, tmp = start_daemon(args.threads, extra)
    sides = {CODESPEC: Side(), LLAMA_SERVER: Side()}
    try:
        with llama_server(llama.server, gguf, args) as url, Client(sock, timeout=None) as c:
            warm = dict(items[0], prefix="def f():\n    ", suffix="\n", documents=[])
            ask_codespec(c, warm, -1, args)  # both servers' first request out of the count
            ask_infill(url, warm, args)
            for n, item in enumerate(items):
                order = [CODESPEC, LLAMA_SERVER] if n % 2 == 0 else [LLAMA_SERVER, CODESPEC]
                for name in order:
                    ms, text, tokens = (ask_codespec(c, item, n, args) if name == CODESPEC
                                        else ask_infill(url, item, args))  # fmt: skip
                    s = sides[name]
                    s.ms.append(ms)
                    s.texts.append(text)
                    s.tokens.append(tokens)
                print(f"  [{n + 1}/{len(items)}] {item.get('id', n)}: "
                      + "  ".join(f"{k} {v.ms[-1]:.0f} ms" for k, v in sides.items()),
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(conf.parent, ignore_errors=True)
    report(sides, items, args, llama.version, gguf)
    return 0


def report(sides: dict[str, Side], items: list[dict], args, version: str, gguf: Path) -> None:
    rows = [s.row(name) for name, s in sides.items()]
    a, b = sides[CODESPEC], sides[LLAMA_SERVER]
    agree = sum(first_line(x) == first_line(y) for x, y in zip(a.texts, b.texts, strict=True))
    exact = {name: sum(first_line(t) == first_line(it.get("expected", ""))
                       for t, it in zip(s.texts, items, strict=True))
             for name, s in sides.items()}  # fmt: skip
    for r in rows:
        r["first_line_exact"] = exact[r["method"]]
    ratio = b.row("x")["p50_ms"] / a.row("x")["p50_ms"] if a.ms and a.row("x")["p50_ms"] else None
    print(f"codespec bench infill ({len(items)} spots, {args.max_tokens} tokens at most, greedy, "
          f"{args.threads} threads each, {date.today()}, {platform.machine()}, "
          f"{gguf.name}, llama.cpp {version})")  # fmt: skip
    head = f"{'method':<22}{'p50 ms':>9}{'p90 ms':>9}{'mean ms':>9}{'tokens':>8}{'exact':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['method']:<22}{r['p50_ms']:>9.0f}{r['p90_ms']:>9.0f}{r['mean_ms']:>9.0f}"
              f"{r['mean_tokens']:>8.1f}{r['first_line_exact']:>7}")  # fmt: skip
    speed = f"; llama-server p50 / codespec p50: {ratio:.2f}x" if ratio else ""
    print(f"first lines equal between the two: {agree}/{len(items)}{speed}")
    print(json.dumps({"bench": "infill", "spots": len(items), "max_tokens": args.max_tokens,
                      "threads": args.threads, "date": str(date.today()),
                      "machine": platform.machine(), "gguf": gguf.name,
                      "llama_cpp": version, "rows": rows, "first_lines_equal": agree,
                      "speedup_p50": round(ratio, 3) if ratio else None}))  # fmt: skip
