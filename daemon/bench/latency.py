"""``codespec bench latency``: completion latency and throughput over the socket.

Owns the daemon benchmark: it starts ``codespec serve`` as a subprocess (or
uses ``--socket`` of a running one), opens real source files and

- latency: replays typing at real spots of them (a body line emptied, typed
  back one character per keystroke at the typist's pace, then Enter at its end
  for a new line; the spots jump to another function and to another file), a
  single-line ``complete`` of up to 16 tokens after each keystroke, streamed;
  p50 / p99 of the time to the first streamed piece (the first ghost-text line)
  and to the final result, per kind of keystroke;
- throughput: 1, 4 and 8 concurrent clients, each on a stdlib file of its own
  (:data:`THROUGHPUT_FILES`), each asking multi-line completions, speculation auto vs
  off; each run on a fresh daemon, so every request is the first at its spot (no
  prompt cached by an earlier run or another client); tokens/s over the wall-clock
  time of each run, runs alternating which method goes first (``--rounds``; a shared
  machine's noise then hits both alike), the mean of the rounds reported.

Prints a table and ends with one JSON line. Must not touch the daemon's insides:
everything goes through :class:`codespec.daemon.client.Client`.
"""

from __future__ import annotations

import argparse
import ast
import collections
import itertools
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codespec.daemon.bench.served import daemon_memory, percentile, start_daemon
from codespec.daemon.client import Client

_LIB = Path(os.__file__).parent
DEFAULT_FILES = [_LIB / "textwrap.py", _LIB / "json" / "decoder.py"]
# one file per throughput client (8 at most), the first being the typing files' first
THROUGHPUT_FILES = [_LIB / f for f in ("textwrap.py", "json/decoder.py", "json/encoder.py",
                                        "csv.py", "shlex.py", "fractions.py", "heapq.py",
                                        "calendar.py")]  # fmt: skip
KEYSTROKES_PER_LINE = 14  # characters typed (one completion each) on every retyped line


@dataclass
class Spot:
    """A body line to retype: file index, 0-based line, the line's text (no newline)."""

    file: int
    line: int
    text: str


def spots(texts: list[str], per_file: int = 4) -> list[Spot]:
    """Body lines of ``per_file`` functions far apart in each file, visited two at a
    time file by file: A1, A2 (another function: a jump), B1 (another file), B2, A3, A4,
    B3, B4 ..., then A1 again (back to the first spot)."""
    out: list[list[Spot]] = []
    for f, text in enumerate(texts):
        lines = text.splitlines()
        tree = ast.parse(text)
        funcs = sorted(
            (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
            key=lambda n: n.lineno,
        )
        body = []
        for fn in funcs:
            for stmt in fn.body[1:]:  # skip a docstring / the first statement
                line = lines[stmt.lineno - 1]
                if stmt.lineno == stmt.end_lineno and len(line.strip()) >= KEYSTROKES_PER_LINE:
                    body.append(Spot(f, stmt.lineno - 1, line))
                    break
        step = max(1, len(body) // per_file)
        out.append(body[step // 2 :: step][:per_file])
    pairs = [[group[i : i + 2] for i in range(0, len(group), 2)] for group in out]
    order = [s for turn in itertools.zip_longest(*pairs, fillvalue=[]) for two in turn
             for s in two]  # fmt: skip
    return [*order, order[0]] if order else order


class Typist:
    """One editor's document state over the socket: open files, retype a line at a
    spot with a completion after every keystroke, timing each one."""

    def __init__(
        self, c: Client, texts: list[str], speculation: str | None, pause_s: float
    ) -> None:
        self.c, self.speculation, self.pause_s = c, speculation, pause_s
        self.lines = [t.splitlines(keepends=True) for t in texts]
        self.versions = [0] * len(texts)
        self.first: dict[str, list[float]] = {}
        self.final: dict[str, list[float]] = {}
        self.trace: list[dict] = []  # per request: kind, times, the daemon's stats
        for f, text in enumerate(texts):
            c.request("open", {"uri": self.uri(f), "text": text, "version": 0})

    @staticmethod
    def uri(f: int) -> str:
        return f"file:///bench/latency/file{f}.py"

    def change(self, f: int, start: dict, end: dict, text: str) -> None:
        self.versions[f] += 1
        change = {"range": {"start": start, "end": end}, "text": text}
        self.c.request("change", {"uri": self.uri(f), "version": self.versions[f],
                                  "changes": [change]})  # fmt: skip

    def complete(self, f: int, line: int, col: int, kind: str) -> None:
        t0 = time.perf_counter()
        got: list[float] = []
        params = {"uri": self.uri(f), "position": {"line": line, "character": col},
                  "max_tokens": 16, "stream": True}  # fmt: skip
        if self.speculation is not None:  # else the daemon's default
            params["speculation"] = self.speculation
        r = self.c.request(
            "complete", params, lambda _f: got.append(time.perf_counter()) if not got else None
        )
        t1 = time.perf_counter()
        self.final.setdefault(kind, []).append((t1 - t0) * 1000)
        self.first.setdefault(kind, []).append(((got[0] if got else t1) - t0) * 1000)
        stats = r.get("stats", {}) if isinstance(r, dict) else {}
        self.trace.append({"kind": kind, "first_ms": round(self.first[kind][-1], 1),
                           "final_ms": round(self.final[kind][-1], 1), "stats": stats})  # fmt: skip
        time.sleep(max(0.0, self.pause_s - (t1 - t0)))  # the typist's own pace

    def retype(self, spot: Spot, kind: str) -> None:
        """Empty the line (``kind``: how the cursor got there), type it back, then press
        Enter at its end (a ``newline``, the fresh line indented like it) and take the
        new line away again."""
        f, n, text = spot.file, spot.line, spot.text
        indent = len(text) - len(text.lstrip())
        self.change(f, {"line": n, "character": 0}, {"line": n, "character": len(text)},
                    text[:indent])  # fmt: skip
        self.complete(f, n, indent, kind)
        for col in range(indent, min(len(text), indent + KEYSTROKES_PER_LINE)):
            pos = {"line": n, "character": col}
            self.change(f, pos, pos, text[col])
            self.complete(f, n, col + 1, "typing")
        rest = {"line": n, "character": min(len(text), indent + KEYSTROKES_PER_LINE)}
        self.change(f, rest, rest, text[rest["character"] :])  # the line as it was
        end = {"line": n, "character": len(text)}
        self.change(f, end, end, "\n" + text[:indent])
        self.complete(f, n + 1, indent, "newline")
        self.change(f, end, {"line": n + 1, "character": indent}, "")


def typing_latency(
    sock: str,
    texts: list[str],
    speculation: str | None,
    pause_s: float,
    per_file: int = 4,
    gap_s: float = 0.0,
    trace: list[dict] | None = None,
) -> dict[str, dict[str, float]]:
    """Replay typing at real spots (see :func:`spots`), pausing ``gap_s`` after each spot
    before the next (a programmer reading): per kind of keystroke —
    ``open`` (the first spot, right after the files are opened), ``jump`` (another
    function of the same file), ``file`` (another file), ``typing`` (characters),
    ``newline`` (Enter at the end of a line) — and ``all``, the time to the first
    streamed piece (the first ghost-text line) and to the final result, and how many
    requests began with tokens the daemon recalled (``[speculation] recall``). ``trace``
    gets a record per request."""
    with Client(sock) as c:
        t = Typist(c, texts, speculation, pause_s)
        prev = None
        for spot in spots(texts, per_file):
            kind = ("open" if prev is None else
                    "file" if spot.file != prev.file else "jump")  # fmt: skip
            t.retype(spot, kind)
            prev = spot
            time.sleep(gap_s)
        for f in range(len(texts)):
            c.request("close", {"uri": t.uri(f)})
    if trace is not None:
        trace.extend(t.trace)
    recalled = collections.Counter(r["kind"] for r in t.trace if r["stats"].get("recalled"))
    out = {}
    every_first = [x for xs in t.first.values() for x in xs]
    every_final = [x for xs in t.final.values() for x in xs]
    for kind, first, final in [*((k, t.first[k], t.final[k]) for k in t.first),
                               ("all", every_first, every_final)]:  # fmt: skip
        out[kind] = {
            "n": len(final),
            "recalled": recalled.total() if kind == "all" else recalled[kind],
            "first_p50_ms": percentile(first, 0.5),
            "first_p99_ms": percentile(first, 0.99),
            "final_p50_ms": percentile(final, 0.5),
            "final_p99_ms": percentile(final, 0.99),
            "final_mean_ms": statistics.fmean(final) if final else 0.0,
        }
    return out


_RUNS = itertools.count()


def throughput(
    sock: str, texts: list[str], clients: int, per_client: int, speculation: str
) -> dict:
    """``clients`` clients at once, client k on ``texts[k]`` (cycled), under a name no
    earlier run used (the daemon keeps what requests on a document generated as drafts
    for the next ones there: ``ngram:recent``); ``per_client`` spots spread over the
    file. On a fresh daemon with a file per client, every request is the first at its
    spot: no other request's prompt shares its start."""
    tokens = [0] * clients
    errors: list[str] = []
    barrier = threading.Barrier(clients)
    run_id = next(_RUNS)

    def run(k: int) -> None:
        uri = f"file:///bench/tp{run_id}-{k}.py"
        text = texts[k % len(texts)]
        lines = text.splitlines(keepends=True)
        try:
            with Client(sock) as c:
                c.request("open", {"uri": uri, "text": text})
                barrier.wait()
                for j in range(per_client):
                    line = (len(lines) * (j + 1)) // (per_client + 1)
                    r = c.request(
                        "complete",
                        {
                            "uri": uri,
                            "position": {"line": min(line, len(lines) - 1), "character": 0},
                            "multiline": True,
                            "max_tokens": 64,
                            "speculation": speculation,
                        },
                    )
                    tokens[k] += r["stats"]["tokens"]
                c.request("close", {"uri": uri})
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"throughput run failed: {errors[0]}")
    return {"tokens": sum(tokens), "wall_s": round(wall, 2), "tokens_per_s": sum(tokens) / wall}


def mean_rounds(runs: list[dict]) -> dict:
    """One method's throughput rounds as one: summed tokens and wall time (the mean rate
    over the rounds), each round's rate kept.

    >>> mean_rounds([{"tokens": 100, "wall_s": 2.0, "tokens_per_s": 50.0},
    ...              {"tokens": 100, "wall_s": 3.0, "tokens_per_s": 100 / 3}])["tokens_per_s"]
    40.0
    """
    tokens = sum(r["tokens"] for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    rate = tokens / wall if wall else 0.0
    return {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": rate,
            "rounds": [round(r["tokens_per_s"], 1) for r in runs]}  # fmt: skip


def ab_order(names: list[str], rounds: int) -> list[str]:
    """Every name once a round, odd rounds in reverse (A B, B A, ...): a shared machine's
    drift then hits each alike.

    >>> ab_order(["a", "b"], 2)
    ['a', 'b', 'b', 'a']
    """
    return [n for r in range(rounds) for n in (names if r % 2 == 0 else names[::-1])]


def mean_latency(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Several typing replays as one: per kind of keystroke the mean of each run's figure
    (``n`` summed), each run's first-line p50 kept.

    >>> r = mean_latency([{"all": {"n": 2, "first_p50_ms": 80.0}},
    ...                   {"all": {"n": 2, "first_p50_ms": 100.0}}])["all"]
    >>> r["n"], r["first_p50_ms"], r["runs_first_p50_ms"]
    (4, 90.0, [80.0, 100.0])
    """
    out: dict[str, dict[str, float]] = {}
    for kind in runs[0] if runs else {}:
        rows = [run[kind] for run in runs if kind in run]
        merged: dict[str, Any] = {k: sum(r.get(k, 0) for r in rows)
                                  for k in ("n", "recalled") if k in rows[0]}  # fmt: skip
        for key in rows[0]:
            if key not in merged:
                merged[key] = statistics.fmean(r[key] for r in rows)
        merged["runs_first_p50_ms"] = [round(r["first_p50_ms"], 1) for r in rows]
        out[kind] = merged
    return out


def compare_configs(
    args: argparse.Namespace, texts: list[str], extra: list[str]
) -> tuple[dict, dict]:
    """``--configs``: a daemon per config file and run, each request with that daemon's
    default speculation (``[speculation] default``, auto unless the file says), typing
    replayed on each in :func:`ab_order` (``--rounds`` rounds), each run on a fresh daemon
    (so every spot's first request is the first there); per config the mean of its runs,
    and the first config's first daemon's ``stats``."""
    from codespec.daemon.view.reader import read_page

    paths = [Path(c) for c in args.configs.split(",") if c]
    missing = [str(c) for c in paths if not c.is_file()]
    if missing:
        raise SystemExit(f"codespec bench latency: no config file {', '.join(missing)}")
    names = [c.stem for c in paths]
    if len(set(names)) != len(names):
        raise SystemExit("codespec bench latency: the config files need distinct names")
    runs: dict[str, list] = {n: [] for n in names}
    status: dict = {}
    traces: dict[str, list[dict]] = {}
    for name in ab_order(names, args.rounds):  # a fresh daemon per run: nothing cached
        path = paths[names.index(name)]
        proc, sock, _ = start_daemon(args.threads, [*extra, "--config", str(path)])
        try:
            read_page(sock)  # [view] enabled: a page reads it, as a browser tab
            trace = traces.setdefault(name, [])
            runs[name].append(typing_latency(sock, texts, None, args.pause_ms / 1000, args.spots,
                                             args.gap_ms / 1000, trace))  # fmt: skip
            if name == names[0] and not status:
                with Client(sock) as c:
                    status = c.request("stats")
            status.setdefault("memory", {})[name] = daemon_memory(proc.pid)
        finally:
            proc.terminate()
            proc.wait(30)
    write_trace(args.trace, traces)
    return {name: mean_latency(r) for name, r in runs.items()}, status


def write_trace(path: str | None, traces: dict[str, list[dict]]) -> None:
    """``--trace``: a JSON line per request (the config or method, the kind of keystroke,
    the times, the daemon's stats), to see what the slow ones had to do."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            for name, records in traces.items():
                f.writelines(json.dumps({"run": name, **r}) + "\n" for r in records)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="codespec bench latency", description=__doc__.split("\n")[0])
    p.add_argument("--socket", default=None, help="use a running daemon instead of starting one")
    p.add_argument(
        "--files",
        default=",".join(map(str, DEFAULT_FILES)),
        help="comma-separated Python files to type in (default: two stdlib files)",
    )
    p.add_argument("--pause-ms", type=float, default=150.0,
                   help="the typist's pace: time from one keystroke to the next")  # fmt: skip
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="the typist's pause after each spot, before moving on")  # fmt: skip
    p.add_argument("--spots", type=int, default=4,
                   help="lines retyped in each file (functions far apart)")  # fmt: skip
    p.add_argument("--clients", default="1,4,8", help="concurrent clients for throughput")
    p.add_argument("--per-client", type=int, default=3, help="completions per client")
    p.add_argument(
        "--rounds", type=int, default=2, help="throughput rounds, alternating which method is first"
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads of a started daemon")
    p.add_argument("--trace", default=None, help="write a JSON line per typing request here")
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"], help="device")
    p.add_argument("--model", default=None, help="model of a started daemon (default: default)")
    p.add_argument(
        "--configs",
        default=None,
        help="comma-separated daemon config files to compare: typing latency only, one "
        "daemon each, its default speculation, --rounds rounds alternating their order",
    )
    args = p.parse_args(argv)
    files = [Path(f) for f in args.files.split(",") if f]
    texts = [f.read_text(encoding="utf-8") for f in files]
    extra = ["--device", args.device] + (["--model", args.model] if args.model else [])
    if args.configs:
        lat, status = compare_configs(args, texts, extra)
        report(files, lat, {"auto": {}, "off": {}}, status, "config")
        return 0
    lat, status = compare_methods(args, texts, extra)
    tp = throughput_runs(args, extra)
    report(files, lat, tp, status)
    return 0


def compare_methods(
    args: argparse.Namespace, texts: list[str], extra: list[str]
) -> tuple[dict, dict]:
    """Typing replayed with ``auto`` then ``off``, each on a fresh daemon (unless
    ``--socket``): per method its latency; the auto daemon's ``stats`` with each
    daemon's memory after typing (``--trace``: each request's record)."""
    lat: dict[str, Any] = {}
    status: dict[str, Any] = {}
    traces: dict[str, list[dict]] = {}
    proc = None
    try:
        for spec in ("auto", "off"):  # a fresh daemon per method: equal, cold caches
            if proc is not None:
                proc.terminate()
                proc.wait(30)
            proc, sock, _ = (None, args.socket, "") if args.socket else start_daemon(
                args.threads, extra)  # fmt: skip
            lat[spec] = typing_latency(sock, texts, spec, args.pause_ms / 1000, args.spots,
                                       args.gap_ms / 1000, traces.setdefault(spec, []))  # fmt: skip
            if spec == "auto":  # the proposers' figures of the auto daemon
                with Client(sock) as c:
                    status.update(c.request("stats"))
            if proc is not None:
                status.setdefault("memory", {})[spec] = daemon_memory(proc.pid)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    write_trace(args.trace, traces)
    return lat, status


def throughput_runs(args: argparse.Namespace, extra: list[str]) -> dict[str, dict[int, Any]]:
    """Per method and client count, the mean of ``--rounds`` throughput runs, rounds
    alternating which method goes first; each run on a fresh daemon (unless ``--socket``)."""
    tp: dict[str, dict[int, Any]] = {"auto": {}, "off": {}}
    texts = [f.read_text(encoding="utf-8") for f in THROUGHPUT_FILES]
    for n in [int(x) for x in args.clients.split(",") if x]:
        rounds: dict[str, list[dict]] = {"off": [], "auto": []}
        for r in range(args.rounds):
            for spec in ("off", "auto") if r % 2 == 0 else ("auto", "off"):
                if args.socket:
                    rounds[spec].append(throughput(args.socket, texts, n, args.per_client, spec))
                    continue
                proc, sock, _ = start_daemon(args.threads, extra)  # no prompt cached yet
                try:
                    rounds[spec].append(throughput(sock, texts, n, args.per_client, spec))
                finally:
                    proc.terminate()
                    proc.wait(30)
        for spec, runs in rounds.items():
            tp[spec][n] = mean_rounds(runs)
    return tp


def report(
    files: list[Path], lat: dict, tp: dict, status: dict, label: str = "speculation"
) -> None:
    print(f"files {', '.join(f.name for f in files)}, model {status.get('model')}, "
          f"{status.get('device')}, {time.strftime('%Y-%m-%d')}")  # fmt: skip
    print("latency of single-line complete (<= 16 tokens, streamed) while typing, ms")
    head = f"{label:<12}{'keystroke':<10}{'n':>5}{'first p50':>11}{'first p99':>11}"
    print(head + f"{'final p50':>11}{'final p99':>11}{'recalled':>10}")
    for spec, kinds in lat.items():
        for kind, r in kinds.items():
            print(
                f"{spec:<12}{kind:<10}{r['n']:>5}{r['first_p50_ms']:>11.1f}"
                f"{r['first_p99_ms']:>11.1f}{r['final_p50_ms']:>11.1f}{r['final_p99_ms']:>11.1f}"
                f"{r.get('recalled', 0):>10}"
            )
    for name, mem in (status.get("memory") or {}).items():
        if mem:
            print(f"daemon memory after typing, {name}: resident {mem.get('rss_mib', 0):.1f} "
                  f"MiB, peak {mem.get('peak_mib', 0):.1f} MiB")  # fmt: skip
    if tp["off"]:
        print("throughput of multi-line complete (64 tokens), tokens/s")
        print(f"{'clients':<10}{'off':>10}{'auto':>10}{'auto/off':>10}")
    for n in tp["off"]:
        off, auto = tp["off"][n]["tokens_per_s"], tp["auto"][n]["tokens_per_s"]
        print(f"{n:<10}{off:>10.1f}{auto:>10.1f}{auto / off if off else 0:>10.2f}")
    summary = {"bench": "latency", "files": [str(f) for f in files], "latency": lat}
    summary["throughput"] = {s: {str(n): v for n, v in d.items()} for s, d in tp.items()}
    print(json.dumps({**summary, "proposers": status.get("proposers"),
                      "memory": status.get("memory")}))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
