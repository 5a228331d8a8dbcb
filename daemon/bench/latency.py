"""``codespec bench latency``: completion latency and throughput over the socket.

Owns the daemon benchmark: it starts ``codespec serve`` as a subprocess (or
uses ``--socket`` of a running one), opens a source file of 300+ lines and

- latency: simulates typing (one character inserted per keystroke, a
  single-line ``complete`` of up to 16 tokens after each, streamed) and reports
  p50 / p99 of the time to the first delta and to the final result;
- throughput: 1, 4 and 8 concurrent clients, each on its own copy of the file,
  each asking multi-line completions, speculation auto vs off; tokens/s over
  the wall-clock time of the whole round.

Prints a table and ends with one JSON line. Must not touch the daemon's insides:
everything goes through :class:`codespec.daemon.client.Client`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from codespec.daemon.client import Client

DEFAULT_FILE = Path(os.__file__).parent / "textwrap.py"
TYPED = "    result = self.wrap(text, width=width)\n"


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return 0.0
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


def start_daemon(threads: int, extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    tmp = tempfile.mkdtemp(prefix="codespec-bench-")
    sock = os.path.join(tmp, "d.sock")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), XDG_CACHE_HOME=tmp, CODESPEC_SOCKET=sock)
    proc = subprocess.Popen(
        [sys.executable, "-m", "codespec.daemon.cli", "serve", "--socket", sock, *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        if proc.poll() is not None:
            raise SystemExit(f"codespec serve exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            Client(sock, timeout=1).close()
            return proc, sock, tmp
        except Exception:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("codespec serve did not come up")


def typing_latency(sock: str, text: str, samples: int, speculation: str) -> dict[str, float]:
    """Type TYPED at a few lines of the file; one completion per keystroke.

    Each method runs in a daemon of its own (see ``main``), so none reuses the KV
    cache another left behind: every method pays the same cold prefills.
    """
    lines = text.splitlines(keepends=True)
    uri = "file:///bench/latency.py"
    first: list[float] = []
    final: list[float] = []
    with Client(sock) as c:
        c.request("open", {"uri": uri, "text": text, "version": 0})
        version = 0
        c.request("complete", {"uri": uri, "position": {"line": 0, "character": 0}})  # warm
        spots = [len(lines) // 3, len(lines) // 2, 2 * len(lines) // 3]
        done = 0
        for s_i, spot in enumerate(spots):
            line = spot + s_i  # earlier spots inserted one line each
            pos = {"line": line, "character": 0}
            version += 1
            change = {"range": {"start": pos, "end": pos}, "text": "\n"}
            c.request("change", {"uri": uri, "version": version, "changes": [change]})
            for col, ch in enumerate(TYPED.rstrip("\n")):
                if done >= samples * (s_i + 1) // len(spots):
                    break
                pos = {"line": line, "character": col}
                version += 1
                change = {"range": {"start": pos, "end": pos}, "text": ch}
                c.request("change", {"uri": uri, "version": version, "changes": [change]})
                t0 = time.perf_counter()
                got: list[float] = []
                c.request(
                    "complete",
                    {
                        "uri": uri,
                        "position": {"line": line, "character": col + 1},
                        "max_tokens": 16,
                        "stream": True,
                        "speculation": speculation,
                    },
                    lambda _f, got=got: got.append(time.perf_counter()) if not got else None,
                )
                t1 = time.perf_counter()
                final.append((t1 - t0) * 1000)
                first.append(((got[0] if got else t1) - t0) * 1000)
                done += 1
        c.request("close", {"uri": uri})
    return {
        "n": len(final),
        "first_p50_ms": percentile(first, 0.5),
        "first_p99_ms": percentile(first, 0.99),
        "final_p50_ms": percentile(final, 0.5),
        "final_p99_ms": percentile(final, 0.99),
        "final_mean_ms": statistics.fmean(final) if final else 0.0,
    }


def throughput(sock: str, text: str, clients: int, per_client: int, speculation: str) -> dict:
    lines = text.splitlines(keepends=True)
    tokens = [0] * clients
    errors: list[str] = []
    barrier = threading.Barrier(clients)

    def run(k: int) -> None:
        uri = f"file:///bench/tp{k}.py"
        try:
            with Client(sock) as c:
                c.request("open", {"uri": uri, "text": text})
                barrier.wait()
                for j in range(per_client):
                    line = (len(lines) * (j + 1)) // (per_client + 1) + k
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="codespec bench latency", description=__doc__.split("\n")[0])
    p.add_argument("--socket", default=None, help="use a running daemon instead of starting one")
    p.add_argument("--file", default=str(DEFAULT_FILE), help="a source file of 300+ lines")
    p.add_argument("--samples", type=int, default=60, help="completions in the latency run")
    p.add_argument("--clients", default="1,4,8", help="concurrent clients for throughput")
    p.add_argument("--per-client", type=int, default=3, help="completions per client")
    p.add_argument("--threads", type=int, default=1, help="torch threads of a started daemon")
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--model", default=None)
    args = p.parse_args(argv)
    text = Path(args.file).read_text(encoding="utf-8")
    if len(text.splitlines()) < 300:
        print(f"note: {args.file} has fewer than 300 lines", file=sys.stderr)
    proc = None
    sock = args.socket
    if sock is None:
        extra = ["--device", args.device] + (["--model", args.model] if args.model else [])
        proc, sock, _ = start_daemon(args.threads, extra)
    try:
        lat = {}
        for spec in ("auto", "off"):
            if args.socket is None:  # a fresh daemon per method: equal, cold caches
                proc.terminate()
                proc.wait(30)
                proc, sock, _ = start_daemon(args.threads, extra)
            lat[spec] = typing_latency(sock, text, args.samples, spec)
        tp: dict[str, dict[int, dict]] = {"auto": {}, "off": {}}
        for n in [int(x) for x in args.clients.split(",") if x]:
            for spec in ("off", "auto"):
                tp[spec][n] = throughput(sock, text, n, args.per_client, spec)
        with Client(sock) as c:
            status = c.request("stats")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    lines = len(text.splitlines())
    print(f"file {args.file} ({lines} lines), model {status['model']}, {status['device']}")
    print("latency of single-line complete (<= 16 tokens, typing, streamed), ms")
    print(f"{'speculation':<12}{'n':>5}{'first p50':>11}{'first p99':>11}{'final p50':>11}"
          f"{'final p99':>11}")  # fmt: skip
    for spec, r in lat.items():
        print(
            f"{spec:<12}{r['n']:>5}{r['first_p50_ms']:>11.1f}{r['first_p99_ms']:>11.1f}"
            f"{r['final_p50_ms']:>11.1f}{r['final_p99_ms']:>11.1f}"
        )
    print("throughput of multi-line complete (64 tokens), tokens/s")
    print(f"{'clients':<10}{'off':>10}{'auto':>10}{'auto/off':>10}")
    for n in tp["off"]:
        off, auto = tp["off"][n]["tokens_per_s"], tp["auto"][n]["tokens_per_s"]
        print(f"{n:<10}{off:>10.1f}{auto:>10.1f}{auto / off if off else 0:>10.2f}")
    print(
        json.dumps(
            {
                "bench": "latency",
                "file": args.file,
                "lines": lines,
                "latency": lat,
                "throughput": {s: {str(n): v for n, v in d.items()} for s, d in tp.items()},
                "proposers": status["proposers"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
