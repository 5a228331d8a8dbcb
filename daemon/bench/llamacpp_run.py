"""Running a built llama.cpp and reading what it prints: the peer's side of a benchmark.

Owns: one run of a llama.cpp binary (:func:`run_binary`: its exit status and timeout as
:class:`LlamaFailed`), the flags every run shares (:class:`Options`,
:func:`common_flags`), plain decoding (:func:`run_plain`), ``llama-lookup``
(:func:`run_lookup`) and ``llama-bench`` (:func:`run_bench`) timed as :class:`Timed`,
and the parsers of their output: libllama's timings (:func:`parse_perf`),
llama-lookup's summary (:func:`parse_lookup`), llama-bench's JSON
(:func:`parse_llama_bench`) and the generated text (:func:`generated`).
The runners feed the prompt through a file, unescaped (``--no-escape``), greedy.
Must not touch: getting llama.cpp (``llamacpp``: the download, the build and its
cache), our engine, the benchmarks' tables (``peers``).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codespec.daemon import child_env
from codespec.daemon.bench.llamacpp import LlamaCpp, one_line, say_stderr

# -- reading llama.cpp's output ----------------------------------------------------------


def parse_perf(text: str) -> dict[str, float]:
    """libllama's context timings (``llama_perf_context_print``): the prompt's
    ``prompt_ms`` / ``prompt_tokens`` and the decode's ``eval_ms`` / ``eval_runs``; {}
    when the output has none."""
    out: dict[str, float] = {}
    m = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", text)
    if m:
        out["prompt_ms"], out["prompt_tokens"] = float(m.group(1)), int(m.group(2))
    m = re.search(r"(?<!prompt )\beval time =\s*([\d.]+) ms /\s*(\d+) runs", text)
    if m:
        out["eval_ms"], out["eval_runs"] = float(m.group(1)), int(m.group(2))
    return out


def parse_lookup(text: str) -> dict[str, float]:
    """llama-lookup's summary: ``encoded`` (prompt tokens, seconds), ``decoded``
    (generated tokens, seconds) and its draft counts (``n_draft``, ``n_predict``,
    ``n_drafted``, ``n_accept``); {} when the output has none."""
    out: dict[str, float] = {}
    for key in ("encoded", "decoded"):
        m = re.search(rf"{key}\s+(\d+) tokens in\s+([\d.]+) seconds", text)
        if m:
            out[f"{key}_tokens"], out[f"{key}_s"] = int(m.group(1)), float(m.group(2))
    for key in ("n_draft", "n_predict", "n_drafted", "n_accept"):
        m = re.search(rf"\b{key}\s*=\s*(\d+)", text)
        if m:
            out[key] = int(m.group(1))
    return out


def parse_llama_bench(text: str) -> list[dict[str, Any]]:
    """llama-bench's ``-o json`` records: depth, generated tokens, mean and spread of
    tokens/s (the first JSON array in ``text``)."""
    start = text.find("[")
    if start < 0:
        return []
    try:
        records = json.JSONDecoder().raw_decode(text[start:])[0]
    except ValueError:
        return []
    out = []
    for r in records if isinstance(records, list) else []:
        if not isinstance(r, dict) or "avg_ts" not in r:
            continue
        out.append(
            {
                "depth": int(r.get("n_depth", 0)),
                "prompt": int(r.get("n_prompt", 0)),
                "gen": int(r.get("n_gen", 0)),
                "tokens_per_s": float(r["avg_ts"]),
                "stddev": float(r.get("stddev_ts", 0.0)),
            }
        )
    return out


# -- running it ----------------------------------------------------------------------------


@dataclass
class Options:
    """What every llama.cpp run of a benchmark shares."""

    max_tokens: int = 200
    threads: int = 2
    ctx: int = 4096  # -c
    ignore_eos: bool = True  # generate exactly max_tokens tokens
    draft: int = 10  # llama-lookup's draft length
    timeout: float = 600  # seconds per run


@dataclass
class Timed:
    """One method on one prompt: tokens after the first over the time after the first
    (decode), prompt tokens over the prompt's time (prefill)."""

    decode_tokens: int
    decode_s: float
    prompt_tokens: int
    prefill_s: float
    tokens: int  # generated in all
    text: str = ""  # what it generated
    ids: list[int] | None = None  # codespec's generated ids
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0


class LlamaFailed(Exception):
    """A llama.cpp binary ran but gave no timings (a crash, a refused flag)."""


def run_binary(cmd: list[str], timeout: float) -> tuple[str, str]:
    """(stdout, stderr) of a llama.cpp binary that exited well."""
    name = Path(cmd[0]).name
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                              timeout=timeout, stdin=subprocess.DEVNULL,
                              env=child_env())  # fmt: skip
    except subprocess.TimeoutExpired:
        raise LlamaFailed(f"{name} took over {timeout:.0f}s") from None
    except OSError as exc:
        raise LlamaFailed(f"{name} could not run ({one_line(exc)})") from None
    if proc.returncode != 0:
        why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:]
        raise LlamaFailed(f"{name} failed ({why}{': ' + tail[0] if tail else ''})")
    return proc.stdout, proc.stderr


def common_flags(opts: Options, gguf: Path, prompt_file: Path) -> list[str]:
    """The model, the prompt file (as it is: llama.cpp turns \\" into " unless
    ``--no-escape``), the budget, greedy, the threads."""
    t = str(opts.threads)
    flags = ["-m", str(gguf), "-f", str(prompt_file), "-n", str(opts.max_tokens),
             "--temp", "0", "-t", t, "-tb", t, "-c", str(opts.ctx), "--no-escape"]  # fmt: skip
    return [*flags, "--ignore-eos"] if opts.ignore_eos else flags


def run_plain(llama: LlamaCpp, opts: Options, gguf: Path, prompt_file: Path) -> Timed:
    """Plain greedy decoding; decode = libllama's ``eval`` (one run per token after the
    first), prefill = its ``prompt eval``."""
    assert llama.plain is not None
    cmd = [str(llama.plain), *common_flags(opts, gguf, prompt_file), "-no-cnv",
           "--no-display-prompt"]  # fmt: skip
    stdout, stderr = run_binary(cmd, opts.timeout)
    perf = parse_perf(stdout + "\n" + stderr)
    if "eval_ms" not in perf or "prompt_ms" not in perf:
        raise LlamaFailed(f"{llama.plain.name} printed no timings")
    runs = int(perf["eval_runs"])
    return Timed(runs, max(1e-9, perf["eval_ms"] / 1000), int(perf["prompt_tokens"]),
                 max(1e-9, perf["prompt_ms"] / 1000), runs + 1, generated(stdout))  # fmt: skip


def run_lookup(llama: LlamaCpp, opts: Options, gguf: Path, prompt_file: Path, prompt: str) -> Timed:
    """llama-lookup; decode = its ``decoded`` line less the first token (sampled from the
    prompt's logits), prefill = its ``encoded`` line."""
    assert llama.lookup is not None
    cmd = [str(llama.lookup), *common_flags(opts, gguf, prompt_file), llama.draft_flag(),
           str(opts.draft)]  # fmt: skip
    stdout, stderr = run_binary(cmd, opts.timeout)
    lk = parse_lookup(stdout + "\n" + stderr)
    if "decoded_s" not in lk or "encoded_s" not in lk:
        raise LlamaFailed(f"{llama.lookup.name} printed no timings")
    n = int(lk["decoded_tokens"])
    return Timed(max(0, n - 1), max(1e-9, lk["decoded_s"]), int(lk["encoded_tokens"]),
                 max(1e-9, lk["encoded_s"]), n, generated(stdout, prompt),
                 drafted=int(lk.get("n_drafted", 0)),
                 accepted=int(lk.get("n_accept", 0)))  # fmt: skip


def generated(stdout: str, prompt: str = "") -> str:
    """The generated text in a llama.cpp binary's stdout: after the echoed prompt when it
    echoes one, without the blank lines it frames it with."""
    text = stdout
    if prompt:
        at = text.find(prompt)
        if at >= 0:
            text = text[at + len(prompt) :]
    return text.removesuffix("\n\n")


def run_bench(
    llama: LlamaCpp, gguf: Path, depths: str, gen: int, opts: Options, prompt: int = 0
) -> list[dict]:
    """``llama-bench -p prompt -n gen -d depths``: plain decode speed at each depth (and
    prefill speed of ``prompt`` tokens, a record of its own, when it is not 0)."""
    assert llama.bench is not None
    cmd = [str(llama.bench), "-m", str(gguf), "-p", str(prompt), "-n", str(gen), "-d", depths,
           "-t", str(opts.threads), "-o", "json"]  # fmt: skip
    say_stderr(" ".join(["llama-bench", *cmd[1:]]))
    stdout, _ = run_binary(cmd, opts.timeout)
    return parse_llama_bench(stdout)
