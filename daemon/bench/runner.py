"""``codespec bench runner``: per-forward time of the lean runner vs the HF runner.

Runners over the same weights: ``lean`` (the lean runner as the engine builds it:
on an x86-64 CPU with AVX2 its products go through the ``cpu_gemm`` kernel, an fp16 or
bf16 checkpoint's weights held as 16-bit panels), ``fp32`` (the same on fp32 panels;
shown when lean holds 16-bit ones), ``torch`` (the same runner with torch's products, i.e.
``kernels=False``; shown when the kernel is in use) and ``hf`` (fp32).

This module owns the runner micro-benchmark only; it builds runners through their
public constructors and must not reach into the engine, the CLI or the proposers.

For each context length (default 256, 1300, 4000 cached tokens) it times one
forward of T appended tokens (T = 1 is a decode step, T = 8 .. 64 a chain
verification), rolling the cache back to the context after every forward. Lean
and HF forwards are interleaved (the order alternates per repetition) and
medians are reported, because the machine is noisy and shared.

The floor is the time to read the bytes one forward must read at the measured
bandwidth::

    floor = (weight bytes + KV bytes over context + T) / bandwidth

where the weight bytes are every matrix and norm of the decoder plus the LM head
(a tied embedding counted once; the embedding lookup reads only T rows) and the
bandwidth is measured by the same script as the best of two large fp32
matrix-vector products (128 MiB of weights, ``W @ x`` and ``x @ W^T`` layouts).
For T > 1 the floor is still the bytes floor; verification can be compute-bound.

The model: ``--model`` (what ``codespec serve --model`` takes: an HF checkpoint
folder, a name in the local HF cache or a ``.gguf`` file), else the default model
(SmolLM2-135M-Instruct, fetched once, see ``codespec.daemon.engine.models``), else, when
that cannot be had (offline, nothing cached) or with ``--random``, a
random-initialised 4-layer, 384-wide Llama (vocab 8192, 6 heads, 2 kv heads,
intermediate 1024). Contexts beyond the model's ``max_position_embeddings`` are
fine: both runners get a larger ``max_length`` (HF through a config copy);
default RoPE extrapolates.

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from codespec.daemon.engine import models
from codespec.daemon.engine.lean import LeanRunner, kv_bytes, param_bytes
from codespec.daemon.engine.runner import HFRunner


def _model_dir(model: str | None, random_weights: bool) -> Path | None:
    """The folder to benchmark: ``--model`` resolved, else the default model; None for the
    random Llama (asked for, or the default cannot be had)."""
    if random_weights:
        return None
    try:
        return models.resolve(model)
    except models.ModelError as exc:
        if model is not None:
            raise SystemExit(f"codespec bench runner: error: {exc}") from None
        print(f"no default model ({exc}); timing a random Llama instead", file=sys.stderr)
        return None


def _random_llama(max_length: int, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=max_length,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


def build_runners(
    model_dir: Path | None, max_length: int, compile: bool, seed: int, kernels: bool | None = None
) -> tuple[LeanRunner, HFRunner, str]:
    """(lean, hf, description) over the same fp32 weights on the CPU."""
    if model_dir is None:
        model = _random_llama(max_length, seed)
        lean = LeanRunner.from_hf_model(
            model, max_length=max_length, compile=compile, kernels=kernels
        )
        return lean, HFRunner(model, max_length=max_length), "random 4x384 llama"
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = copy.deepcopy(AutoConfig.from_pretrained(str(model_dir)))
    cfg.max_position_embeddings = max(max_length, int(cfg.max_position_embeddings))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), config=cfg, dtype=torch.float32)
    lean = LeanRunner.from_pretrained(
        model_dir, max_length=max_length, compile=compile, kernels=kernels
    )
    lean.half_panels()  # as the engine loads it: an fp16 / bf16 checkpoint as 16-bit panels
    return lean, HFRunner(model.eval(), max_length=max_length), str(model_dir)


def measure_bandwidth(reps: int = 15) -> dict[str, float]:
    """GB/s of two fp32 matrix-vector products over a 128 MiB matrix (medians)."""
    rows, cols = 4096, 8192
    w = torch.randn(rows, cols)  # (out, in)
    wt = w.t().contiguous()  # (in, out)
    x = torch.randn(cols)
    xr = torch.randn(1, rows)
    nbytes = rows * cols * 4
    times: dict[str, list[float]] = {"mv": [], "vm": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mv(w, x)
        t1 = time.perf_counter()
        torch.mm(xr, wt.t())  # (1, cols): x @ W with W stored (in, out) row-major
        t2 = time.perf_counter()
        times["mv"].append(t1 - t0)
        times["vm"].append(t2 - t1)
    out = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    out["best"] = max(out.values())
    return out


def _timed(runner: Any, ids: list[int], back_to: int) -> float:
    t0 = time.perf_counter()
    runner.forward(ids)
    dt = time.perf_counter() - t0
    runner.truncate(back_to)
    return dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="codespec bench runner", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--random", action="store_true", help="time a random 4x384 Llama instead")
    ap.add_argument("--contexts", default="256,1300,4000", help="cached tokens, comma-separated")
    ap.add_argument("--tokens", default="1,8,16,32,64", help="tokens per forward")
    ap.add_argument("--reps", type=int, default=15, help="timed forwards per cell and runner")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--compile", action="store_true", help="torch.compile the lean layers")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    sizes = [int(t) for t in args.tokens.split(",")]
    max_length = max(contexts) + max(sizes)
    model_dir = _model_dir(args.model, args.random)
    lean, hf, desc = build_runners(model_dir, max_length, args.compile, args.seed)
    named: list[tuple[str, Any]] = [("lean", lean), ("hf", hf)]
    if lean.kernels:  # the same runner on torch's products, side by side
        plain = LeanRunner.from_hf_model(
            hf.model, max_length=max_length, compile=args.compile, kernels=False
        )
        named.insert(1, ("torch", plain))
    narrow = lean.kernels and lean.lm_head_t.dtype != torch.float32
    if narrow:  # and on fp32 panels
        wide = LeanRunner.from_hf_model(hf.model, max_length=max_length, kernels=True)
        named.insert(1, ("fp32", wide))
    bw = measure_bandwidth()
    wbytes = param_bytes(lean)
    gen = torch.Generator().manual_seed(args.seed)

    rows = []
    for ctx in contexts:
        prefix = torch.randint(0, lean.vocab_size, (ctx,), generator=gen).tolist()
        draft = torch.randint(0, lean.vocab_size, (max(sizes),), generator=gen).tolist()
        for _, r in named:
            r.reset()
            r.forward(prefix)
            for t in sizes:  # warm-up: allocator, kernels, compilation
                _timed(r, draft[:t], ctx)
        times: dict[tuple[str, int], list[float]] = {}
        for rep in range(args.reps):
            for t in sizes:
                k = rep % len(named)
                for label, r in named[k:] + named[:k]:  # rotate the order per repetition
                    times.setdefault((label, t), []).append(_timed(r, draft[:t], ctx))
        for t in sizes:
            nbytes = wbytes + kv_bytes(lean, ctx + t)
            row: dict[str, Any] = {"context": ctx, "tokens": t}
            for label, _ in named:
                row[f"{label}_ms"] = statistics.median(times[(label, t)]) * 1e3
            row["floor_ms"] = nbytes / (bw["best"] * 1e9) * 1e3
            row["bytes"] = nbytes
            rows.append(row)

    decode = {r["context"]: r["lean_ms"] for r in rows if r["tokens"] == 1}
    others = [label for label, _ in named if label not in ("lean", "hf")]
    kernel_note = "cpu_gemm kernel" if lean.kernels else "torch products"
    if narrow:
        width = "fp16" if lean.lm_head_t.dtype == torch.float16 else "bf16"
        kernel_note += f" with {width} weight panels (fp32: the same on fp32 panels)"
    print(f"model: {desc}   weights {wbytes / 1e6:.1f} MB   threads {args.threads}")
    print(
        f"bandwidth: {bw['best']:.1f} GB/s (W@x {bw['mv']:.1f}, x@W {bw['vm']:.1f}); "
        f"medians of {args.reps}, runners interleaved; lean uses the {kernel_note}"
    )
    head = f"{'ctx':>5} {'T':>3} {'lean ms':>8} "
    head += "".join(f"{label + ' ms':>8} {label + '/lean':>10} " for label in others)
    head += f"{'hf ms':>8} {'hf/lean':>7} {'floor ms':>8} {'lean/floor':>10} {'lean/decode':>11}"
    print(head)
    for r in rows:
        line = f"{r['context']:>5} {r['tokens']:>3} {r['lean_ms']:>8.2f} "
        for label in others:
            line += f"{r[label + '_ms']:>8.2f} {r[label + '_ms'] / r['lean_ms']:>10.2f} "
        line += (
            f"{r['hf_ms']:>8.2f} {r['hf_ms'] / r['lean_ms']:>7.2f} {r['floor_ms']:>8.2f} "
            f"{r['lean_ms'] / r['floor_ms']:>10.2f} {r['lean_ms'] / decode[r['context']]:>11.2f}"
        )
        print(line)
    summary = {
        "bench": "runner",
        "model": desc,
        "weight_bytes": wbytes,
        "threads": args.threads,
        "compile": args.compile,
        "kernels": lean.kernels,
        "reps": args.reps,
        "bandwidth_gbs": round(bw["best"], 2),
        "rows": [
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows
        ],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
