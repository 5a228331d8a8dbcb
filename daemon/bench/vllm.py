"""``codespec bench vllm --url URL``: the daemon on a vLLM server against the bare API.

A running vLLM server (``codespec vllm-args MODEL`` prints its command line) and a
``codespec serve --backend vllm`` daemon started here. Prompts: held-out completion
points (the code before a cursor inside a function body of stdlib files) and edit
prompts (a function, then the same function again up to a point: the region being
rewritten is in the prompt, as in an edit), the same ids on both sides.

- ``overhead``: per prompt, the daemon's ``generate`` (``prompt_ids``, streamed over its
  socket) against one streamed ``/v1/completions`` request with the same ids, max_tokens
  and stop tokens, alternating which goes first, both after an untimed call has put the
  prompt in the server's prefix cache; the p50 of the per-prompt differences.
- ``tokens/s``: the same requests' tokens over their time, beside a local daemon's
  (``--local``: a second daemon with the local engine and its own speculation).
- ``clients``: ``--clients`` concurrent clients send ``--requests`` requests in all,
  every ``--cancel-every``-th cancelled after its first delta; failures, p50/p99, and
  whether anything leaked: the daemon's requests in flight, its RSS, the server's
  running and waiting requests.

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from codespec.daemon.backends.openai_http import OpenAIClient
from codespec.daemon.bench.latency import DEFAULT_FILES
from codespec.daemon.bench.served import daemon_memory, percentile, start_daemon
from codespec.daemon.client import Client, DaemonError

PREFIX_TOKENS = 384  # the prompt's window of code before the cursor


def held_out_prompts(encode: Any, files: list[Path], per_file: int) -> list[tuple[str, list[int]]]:
    """(kind, ids): completion points inside function bodies, and edit prompts (the
    function whole, then again up to the point)."""
    out: list[tuple[str, list[int]]] = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        funcs = [
            n
            for n in ast.walk(ast.parse(text))
            if isinstance(n, ast.FunctionDef) and n.end_lineno and n.end_lineno - n.lineno >= 4
        ]
        funcs.sort(key=lambda n: n.lineno)
        step = max(1, len(funcs) // per_file)
        for fn in funcs[step // 2 :: step][:per_file]:
            head = "".join(lines[: fn.lineno + 1])
            cut = head + lines[fn.lineno + 1][: len(lines[fn.lineno + 1]) // 2]
            out.append(("complete", encode(cut)[-PREFIX_TOKENS:]))
            body = "".join(lines[fn.lineno - 1 : fn.end_lineno])
            out.append(("edit", encode(head + "\n# the same, rewritten:\n" + body[:200])[-512:]))
    return out


def bare_call(
    api: OpenAIClient, model: str, ids: list[int], n: int, stops: list[int]
) -> tuple[float, int]:
    """One streamed completion read to its end: (seconds, tokens)."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": n,
        "temperature": 0.0,
        "stream": True,
        "return_token_ids": True,
        "stop_token_ids": stops,
        "add_special_tokens": False,
    }
    t0 = time.perf_counter()
    tokens = sum(
        len(e["choices"][0].get("token_ids") or [])
        for e in api.stream("/v1/completions", body)
        if e.get("choices")
    )
    return time.perf_counter() - t0, tokens


def daemon_call(c: Client, ids: list[int], n: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = c.request("generate", {"prompt_ids": ids, "max_tokens": n, "stream": True}, lambda f: None)
    return time.perf_counter() - t0, int(r["stats"]["tokens"])


def overhead(
    sock: str, api: OpenAIClient, model: str, prompts: list, n: int, stops: list[int]
) -> dict:
    rows = []
    with Client(sock, timeout=300) as c:
        daemon_call(c, prompts[0][1], 4)  # the first request's one-time costs
        for i, (kind, ids) in enumerate(prompts):
            bare_call(api, model, ids, 1, stops)  # the prompt in the server's prefix cache
            if i % 2:
                d, dt = daemon_call(c, ids, n)
                b, bt = bare_call(api, model, ids, n, stops)
            else:
                b, bt = bare_call(api, model, ids, n, stops)
                d, dt = daemon_call(c, ids, n)
            rows.append(
                {"kind": kind, "daemon_s": d, "bare_s": b, "daemon_tokens": dt, "bare_tokens": bt}
            )
    diffs = [(r["daemon_s"] - r["bare_s"]) * 1000 for r in rows]
    tok = sum(r["daemon_tokens"] for r in rows)
    return {
        "prompts": len(rows),
        "same_token_counts": sum(r["daemon_tokens"] == r["bare_tokens"] for r in rows),
        "overhead_ms_p50": round(percentile(diffs, 0.5), 2),
        "overhead_ms_p90": round(percentile(diffs, 0.9), 2),
        "daemon_ms_p50": round(percentile([r["daemon_s"] * 1000 for r in rows], 0.5), 1),
        "bare_ms_p50": round(percentile([r["bare_s"] * 1000 for r in rows], 0.5), 1),
        "tokens_per_s": round(tok / sum(r["daemon_s"] for r in rows), 1),
        "bare_tokens_per_s": round(
            sum(r["bare_tokens"] for r in rows) / sum(r["bare_s"] for r in rows), 1
        ),
    }


def local_rate(prompts: list, n: int, model: str | None) -> dict:
    """The same requests on a local daemon (its own engine and speculation)."""
    proc, sock, tmp = start_daemon(2, ["--device", "cpu", *(["--model", model] if model else [])])
    try:
        with Client(sock, timeout=600) as c:
            daemon_call(c, prompts[0][1], 4)
            runs = [daemon_call(c, ids, n) for _, ids in prompts]
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "tokens_per_s": round(sum(t for _, t in runs) / sum(s for s, _ in runs), 1),
        "ms_p50": round(percentile([s * 1000 for s, _ in runs], 0.5), 1),
    }


def _client_loop(
    sock: str, jobs: list[tuple[int, list[int]]], n: int, cancel_every: int, out: dict[str, list]
) -> None:
    with Client(sock, timeout=600) as c:
        for k, ids in jobs:
            t0 = time.perf_counter()
            try:
                if cancel_every and k % cancel_every == 0:
                    rid = c.send("generate", {"prompt_ids": ids, "max_tokens": n, "stream": True})
                    while True:
                        f = c.read_frame()
                        if f.get("id") == rid and (f.get("event") == "delta" or "event" not in f):
                            break
                    c.request("cancel", {"id": rid})
                    try:
                        c.wait(rid)
                    except DaemonError as exc:
                        if exc.code != "cancelled":
                            raise
                    out["cancelled"].append(time.perf_counter() - t0)
                    continue
                daemon_call(c, ids, n)
                out["latency"].append(time.perf_counter() - t0)
            except DaemonError as exc:
                out["failed"].append(f"{exc.code}: {exc.message}")


def clients(
    sock: str, pid: int, api: OpenAIClient, prompts: list, args: argparse.Namespace
) -> dict:
    all_jobs = [(k, prompts[k % len(prompts)][1]) for k in range(args.requests)]
    out: dict[str, list] = {"latency": [], "cancelled": [], "failed": []}
    warm = [(1, ids) for _, ids in prompts[: args.clients]]
    _client_loop(sock, warm, args.max_tokens, 0, {"latency": [], "cancelled": [], "failed": []})
    rss0 = daemon_memory(pid).get("rss_mib", 0.0)
    t0 = time.perf_counter()
    threads = [
        threading.Thread(
            target=_client_loop,
            args=(sock, all_jobs[i :: args.clients], args.max_tokens, args.cancel_every, out),
        )
        for i in range(args.clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    time.sleep(2.0)  # longer than the server takes to free a closed stream
    with Client(sock) as c:
        s = c.request("stats")
    metrics = api.get_text("/metrics")
    gauges = {
        name: sum(
            float(ln.rsplit(" ", 1)[1])
            for ln in metrics.splitlines()
            if ln.startswith(f"vllm:{name}")
        )
        for name in ("num_requests_running", "num_requests_waiting")
    }
    lat = [x * 1000 for x in out["latency"]]
    return {
        "clients": args.clients,
        "requests": args.requests,
        "wall_s": round(wall, 1),
        "completed": len(lat),
        "cancelled": len(out["cancelled"]),
        "failed": len(out["failed"]),
        "failures": out["failed"][:3],
        "ms_p50": round(percentile(lat, 0.5), 1),
        "ms_p99": round(percentile(lat, 0.99), 1),
        "daemon_in_flight_after": s["requests"]["in_flight"],
        "daemon_queued_after": s["requests"]["queued"],
        "daemon_rss_mb_before": rss0,
        "daemon_rss_mb_after": daemon_memory(pid).get("rss_mib", 0.0),
        "server_running_after": gauges["num_requests_running"],
        "server_waiting_after": gauges["num_requests_waiting"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="codespec bench vllm", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="the running vLLM server")
    p.add_argument("--model", default=None, help="the daemon's model (as the server's)")
    p.add_argument("--files", default=",".join(map(str, DEFAULT_FILES)), help="held-out files")
    p.add_argument("--per-file", type=int, default=8, help="functions per file (2 prompts each)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--requests", type=int, default=500, help="requests of the clients, in all")
    p.add_argument("--cancel-every", type=int, default=5, help="every k-th one is cancelled")
    p.add_argument("--local", action="store_true", help="also the local engine's tokens/s")
    p.add_argument("--no-clients", action="store_true", help="skip the concurrent clients")
    args = p.parse_args(argv)
    extra = ["--backend", "vllm", "--backend-url", args.url]
    proc, sock, tmp = start_daemon(2, extra + (["--model", args.model] if args.model else []))
    try:
        from codespec.daemon.backends.remote import RemoteEngine
        from codespec.daemon.config import Backend

        engine = RemoteEngine(args.model, Backend(kind="vllm", url=args.url))
        files = [Path(f) for f in args.files.split(",")]
        prompts = held_out_prompts(engine.encode, files, args.per_file)
        stops = sorted(engine.stop_ids)
        result: dict[str, Any] = {
            "overhead": overhead(
                sock, engine.client, engine.served, prompts, args.max_tokens, stops
            )
        }
        if not args.no_clients:
            result["clients"] = clients(sock, proc.pid, engine.client, prompts, args)
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    if args.local:
        result["local"] = local_rate(prompts, args.max_tokens, args.model)
    for section, figures in result.items():
        print(f"{section:9} " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    print(json.dumps(result))
    return 0
