"""The ``codespec`` subcommands' work: what each command does once its arguments parse.

Owns: ``cmd_*`` (one a subcommand; each delegates to the module that owns the work and
turns that module's expected failures into :class:`CliError`), the daemon client the
client commands share, and the LSP language of a file (``complete`` opens it in it).
Must not touch: argument parsing and the exit status (``cli``: it builds the parser,
points each subcommand at its ``cmd_*`` and prints :class:`CliError` as one line).
Heavy modules (torch, the engine, the daemon) are imported inside the commands that
need them, so a client command never loads a model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from codespec.daemon.client import Client
    from codespec.daemon.engine.engine import Engine


class CliError(Exception):
    """An expected failure: printed as ``codespec: error: ...`` with exit status 1."""


def cmd_generate(args: argparse.Namespace) -> int:
    from codespec.daemon.engine.engine import Engine, GenParams
    from codespec.daemon.text.tracker import TextTracker
    from codespec.speculators.registry import UnknownProposer, choices, known, make_proposer

    if not known(args.speculation):
        raise CliError(f"unknown speculation {args.speculation!r}; choose one of {choices()}")
    prompt = _read_prompt(args)
    if not 0 < args.top_p <= 1:
        raise CliError(f"--top-p must be in (0, 1], got {args.top_p}")
    engine = Engine(args.model, device=args.device, runner=args.runner)
    try:
        proposer = make_proposer(args.speculation, engine)
    except (UnknownProposer, LookupError) as exc:  # LookupError: no weights for this model
        raise CliError(str(exc)) from None
    ids = engine.encode(prompt)
    params = GenParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    tracker = TextTracker(engine.tokenizer.backend_tokenizer, ids, args.stop or [])
    stats = None
    try:
        for step in engine.stream(ids, params, proposer):
            new = [t for t in step.token_ids if t not in engine.stop_ids]
            text, hit = tracker.feed(new, final=step.done)
            sys.stdout.write(text)
            sys.stdout.flush()
            stats = step.stats
            if hit:
                stats.tokens = tracker.tokens_used
                stats.finish_reason = "stop"
                break
    except ValueError as exc:
        raise CliError(str(exc)) from None
    sys.stdout.write("\n")
    assert stats is not None
    _report(engine, args, stats.as_dict())
    return 0


def _read_prompt(args: argparse.Namespace) -> str:
    """``--prompt``, or the text of ``--file``; never empty."""
    prompt = args.prompt
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as fh:
                prompt = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"cannot read {args.file}: {exc}") from None
    if not prompt:
        raise CliError("the prompt is empty")
    return prompt


def _report(engine: Engine, args: argparse.Namespace, s: dict) -> None:
    """One stats line on stderr (and the stats as JSON with ``--json``)."""
    print(
        f"[{engine.runner.name} runner, {engine.device.type}, speculation {args.speculation}] "
        f"{s['tokens']} tokens in {s['total_ms']:.0f} ms ({s['tokens_per_s']} tok/s), "
        f"{s['target_forwards']} target forwards ({s['tokens_per_forward']} tokens/forward), "
        f"ttft {s['ttft_ms']:.0f} ms, accepted {s['accepted']} of drafted {s['drafted']}",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(s), file=sys.stderr)


def cmd_model(args: argparse.Namespace) -> int:
    from codespec.daemon.engine import models

    root = models.models_root(args.state_dir)
    try:
        if args.action == "fetch":
            name = args.target or models.DEFAULT_NAME
            print(models.fetch(root, name, force=args.force, wheels=args.wheels))
        elif args.action == "import":
            if not args.target:
                raise CliError("codespec model import needs a .gguf file")
            print(models.import_gguf(args.target, root))
        else:
            _list_models(models, root, args.json)
    except models.ModelError as exc:
        raise CliError(str(exc)) from None
    return 0


def _list_models(models: Any, root: os.PathLike[str], as_json: bool) -> None:
    """The known names (size, whether fetched) and every cached folder."""
    known = models.known_models(root)
    cached = models.list_models(root)
    if as_json:
        names = [
            {"name": m.name, "title": m.title, "bytes": m.gguf_bytes, "sha256": m.gguf_sha256,
             "default": m.name == models.DEFAULT_NAME, "path": str(f) if f else None}
            for m, f in known
        ]  # fmt: skip
        folders = [{"path": str(m.path), **m.manifest} for m in cached]
        print(json.dumps({"known": names, "cached": folders}))
        return
    print("named models (codespec model fetch NAME; --model NAME):")
    for m, folder in known:
        mark = " (default)" if m.name == models.DEFAULT_NAME else ""
        state = f"fetched: {folder}" if folder else "not fetched"
        print(f"  {m.name + mark:30} {m.gguf_bytes / 1e6:8.1f} MB  {state}\n  {'':30} {m.about}")
    print(f"cached in {root}:" if cached else f"no models cached in {root}")
    for c in cached:
        print(f"  {c.name:30} {c.bytes / 1e6:8.1f} MB  {c.source}\n  {'':30} {c.path}")


def cmd_train_eagle(args: argparse.Namespace, rest: list[str]) -> int:
    from codespec.daemon.training import train_eagle

    return train_eagle.main(rest)


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    from codespec.daemon.bench import dispatch

    return dispatch(rest)


def cmd_lsp(args: argparse.Namespace) -> int:
    from codespec.lsp.server import run

    return run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from codespec.daemon.config import ConfigError, load_config
    from codespec.daemon.service.daemon import SocketInUse, serve

    flags = {key: getattr(args, key) for key in ("model", "device", "runner", "socket")}
    try:
        config = load_config(args.config, overrides=flags)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    if args.backend:  # a vLLM server decodes (codespec.daemon.backends)
        config.backend.kind = args.backend
    if args.backend_url:
        config.backend.url = args.backend_url
    from codespec.daemon.view.service import install

    install()  # the `view` socket method; the page at start with [view] enabled
    try:
        return serve(config)
    except SocketInUse as exc:
        raise CliError(f"{exc}; stop it first with `codespec stop`") from None


def _daemon_client(socket_path: str | None) -> Client:
    from codespec.daemon.client import Client, DaemonError

    try:
        return Client(socket_path)
    except DaemonError as exc:
        raise CliError(f"{exc.message}; start it with `codespec serve`") from None


def cmd_status(args: argparse.Namespace) -> int:
    from codespec.daemon.client import DaemonError

    with _daemon_client(args.socket) as client:
        try:
            s = client.request("stats")
        except DaemonError as exc:
            raise CliError(str(exc)) from None
    if args.json:
        print(json.dumps(s))
        return 0
    req = s["requests"]
    print(f"model      {s['model']} ({s['runner']} runner, {s['device']})")
    print(f"cpu kernel {s.get('cpu_kernel', 'off')}")
    print(f"kv slots   {s.get('kv_slots', '?')} (limits.kv_slots)")
    print(f"pid        {s.get('pid', '?')} (codespec stop ends it)")
    print(f"uptime     {s['uptime_s']} s, {s['connections']} connection(s)")
    print(f"documents  {s['documents']} open")
    idx = s["index"]
    print(f"index      {idx['documents']} documents, {idx['tokens']} tokens, {idx['bytes']} bytes")
    print(f"workspace  {s['workspace']['files']} files in {len(s['workspace']['folders'])} folders")
    print(
        f"requests   {req['in_flight']} in flight, {req['served']} served, "
        f"{req['cancelled']} cancelled, {req['failed']} failed"
    )
    print(f"tokens/s   {s['tokens_per_s']}")
    back = s.get("backend") or {}
    if back.get("kind", "local") != "local":
        print(f"backend    {back['kind']} at {back['url']}: {back['model']}, {back['health']}")
    for src, a in s["proposers"].items():
        print(f"proposer   {src}: {a['accepted']}/{a['drafted']} accepted ({a['acceptance']:.0%})")
    pol = s.get("policy") or {}
    for tclass, c in (pol.get("classes") or {}).items():
        rates = ", ".join(f"{n} {r:.2f}x" for n, r in c["vs_plain"].items()) or "none measured"
        step = c["plain_step_ms"]
        plain = f"plain step {step} ms" if step else "plain steps not measured yet"
        print(f"policy     {tclass}: {plain}; speed vs plain: {rates}")
    if pol.get("retired"):
        print(f"policy     retired for now: {', '.join(pol['retired'])}")
    for name, state in (pol.get("weights") or {}).items():
        print(f"weights    {name}: {state}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from codespec.daemon.client import DaemonError, default_socket_path, stop_daemon

    path = args.socket or default_socket_path()
    try:
        pid = stop_daemon(path, args.timeout)
    except DaemonError as exc:
        raise CliError(f"stopping the daemon on {path}: {exc.message}") from None
    print(f"codespec: stopped the daemon (pid {pid}) on {path}" if pid is not None
          else f"codespec: no daemon is running on {path}")  # fmt: skip
    return 0


# LSP language identifiers by file extension (the daemon picks comment syntax by them)
LANGUAGES = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".mjs": "javascript",
    ".jsx": "javascriptreact", ".ts": "typescript", ".tsx": "typescriptreact",
    ".rs": "rust", ".go": "go", ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp",
    ".hpp": "cpp", ".java": "java", ".kt": "kotlin", ".cs": "csharp", ".rb": "ruby",
    ".php": "php", ".swift": "swift", ".lua": "lua", ".sh": "shellscript",
    ".bash": "shellscript", ".sql": "sql", ".hs": "haskell", ".r": "r", ".pl": "perl",
    ".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json", ".md": "markdown",
    ".html": "html", ".css": "css",
}  # fmt: skip


def language_of(path: os.PathLike | str) -> str:
    """The LSP language id of a file by its extension; '' when unknown."""
    return LANGUAGES.get(os.path.splitext(str(path))[1].lower(), "")


def cmd_complete(args: argparse.Namespace) -> int:
    from pathlib import Path

    from codespec.daemon.client import DaemonError

    path = Path(args.file).resolve()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {args.file}: {exc}") from None
    uri = path.as_uri()
    params = {
        "uri": uri,
        "position": {"line": args.line, "character": args.character},
        "multiline": args.multiline,
        "stream": args.stream,
        "speculation": args.speculation,
    }
    if args.max_tokens is not None:
        params["max_tokens"] = args.max_tokens

    def on_delta(frame: dict) -> None:
        sys.stdout.write(frame.get("text", ""))
        sys.stdout.flush()

    with _daemon_client(args.socket) as client:
        try:
            client.request("open", {"uri": uri, "text": text, "language": language_of(path)})
            result = client.request("complete", params, on_delta if args.stream else None)
        except DaemonError as exc:
            raise CliError(exc.message if exc.code != "bad_params" else str(exc)) from None
        finally:
            with contextlib.suppress(DaemonError, OSError):
                client.request("close", {"uri": uri})
    if not args.stream:
        sys.stdout.write(result["text"])
    sys.stdout.write("\n")
    if args.json:
        print(json.dumps(result["stats"]), file=sys.stderr)
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    from codespec.daemon.view.command import run

    return run(args, _daemon_client, CliError)
