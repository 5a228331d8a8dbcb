"""``codespec bench runner``: a forward's time per runner, against the bytes it must read.

Runners over the same model (``--runners``, those that apply):

- ``gguf``: the lean runner on the GGUF's own blocks, exact products
  (``CODESPEC_GGUF_PRODUCTS=exact``);
- ``gguf-i8``: the same with x rounded to int8 for the block products (llama.cpp's way;
  not bit-equal to ``gguf``) and the attention ``lean_config.attention_for`` picks (bf16 where
  the CPU has AVX512-BF16): what the engine loads on a CPU with AVX2 or AVX-512 VNNI for a
  model made from a GGUF;
- ``gguf-i8-fp32att``: ``gguf-i8`` with fp32 attention over an fp16 cache (the attention
  of a CPU without AVX512-BF16), for comparisons;
- ``gguf-i8-panels``: ``gguf-i8`` with every forward's layers shared out between the
  threads by each product's panels (``CODESPEC_ROW_SPLIT=0``; by default forwards of 8
  tokens or more are shared out by tokens), for comparisons;
- ``fp16``: the lean runner on the folder's safetensors as 16-bit ``cpu_gemm`` panels
  (the runner of a safetensors checkpoint; an fp32 checkpoint keeps fp32 panels);
- ``torch-int8`` / ``torch-int4``: the lean runner's torch path with every matrix through
  torch's weight-only CPU kernels (``aten._weight_int8pack_mm``, int8 per output channel;
  ``aten._weight_int4pack_mm_for_cpu``, int4 in groups of 32), fp32 cache, SDPA.

For each context (default 256, 1,300, 4,000 cached tokens) it times forwards of T tokens
(T = 1 a decode step, 8 and 16 a verification) on top of the context, rolling back after
each; runners are interleaved (the order rotates per repetition) and medians reported,
because the machine is shared. ``verify/decode`` is a forward's time in decode steps of
the same runner.

The floor is the time to read the bytes a forward reads at the measured bandwidth::

    floor = (weight bytes + KV bytes over context + T) / bandwidth

weight bytes as the runner holds them (blocks, panels or torch's packs; the tied
embedding once, as the LM head), KV bytes as its cache stores them (fp16 in the C++
stack, fp32 on the torch path); the bandwidth is the best of two fp32 matrix-vector
products over 128 MiB. For T > 1 the floor is still the bytes floor (verification can be
compute-bound).

For the runners whose products are int8 dot products (``gguf-i8``, ``gguf-i8-fp32att``)
a second floor, the products' compute::

    compute floor = T * multiply-adds of a token's products / the dot products' rate

the rate measured here before the runs (``quant_gemm.i8_peak_gmacs``: the instruction the
products use, vpdpbusd or vpmaddubsw, in independent chains on every thread and nothing
else). ``/compute`` is a forward's time over it: what the products' own float steps (a
scale and an offset per 32 weights), attention, norms and the threads' meeting points
add. A verification of T tokens cannot take fewer decode steps than its compute floor
in decode steps; on a machine whose dot products are slow against its memory, no kernel
reaches a target below that.

The model: ``--model`` (a model name, an HF folder, a cached name or a ``.gguf``), else
the default (``$CODESPEC_MODEL``, else qwen2.5-coder-0.5b, fetched once). Prints a table
and ends with one JSON line. It builds runners through their public constructors only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from codespec.daemon.engine import gguf_weights, models, quant_gemm
from codespec.daemon.engine.footprint import kv_bytes, param_bytes, product_macs
from codespec.daemon.engine.lean import LeanRunner

RUNNERS = (
    "gguf",
    "gguf-i8",
    "gguf-i8-fp32att",
    "gguf-i8-panels",
    "fp16",
    "torch-int8",
    "torch-int4",
)
BY_PANELS = ("gguf-i8-panels",)  # timed with the stack's row split off


class WeightOnly:
    """An ``(in, out)`` matrix through torch's int8 / int4 weight-only CPU kernels (what
    ``cpu_gemm.linear`` calls for a matrix that is not a tensor)."""

    def __init__(self, w: torch.Tensor, bits: int) -> None:
        w = w.detach().float().t().contiguous()  # (n, k)
        n, k = w.shape
        self.n, self.k, self.bits = n, k, bits
        if bits == 8:
            self.scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127  # (n,)
            self.q = torch.round(w / self.scale[:, None]).clamp(-127, 127).to(torch.int8)
            self.nbytes = n * k + 4 * n
            return
        g = 32  # int4 in groups of 32 along k: w = (q - 8) * scale + zero
        wg = w.reshape(n, k // g, g)
        lo, hi = wg.amin(dim=2), wg.amax(dim=2)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        q4 = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        self.q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.reshape(n, k), 2)
        self.sz = torch.stack([scale.T, (lo + 8 * scale).T], dim=-1).contiguous()
        self.nbytes = self.q.numel() * self.q.element_size() + self.sz.numel() * 4

    def linear(self, x: torch.Tensor, bias=None, res=None) -> torch.Tensor:
        if self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.q, 32, self.sz)
        if bias is not None:
            y = y + bias
        return y if res is None else y + res


def _weight_only(runner: LeanRunner, bits: int) -> LeanRunner:
    """``runner`` (torch path) with every matrix in torch's weight-only kernels."""

    def q(w: torch.Tensor) -> WeightOnly:
        return WeightOnly(w, bits)

    runner.lm_head_t = q(runner.lm_head_t)
    runner.layers = [
        (ln1, q(wqkv), bqkv, q(wo), bo, ln2, q(wgu), bgu, q(wd), bd)
        for (ln1, wqkv, bqkv, wo, bo, ln2, wgu, bgu, wd, bd) in runner.layers
    ]
    return runner


def build(name: str, folder: Path, max_length: int) -> LeanRunner:
    """Runner ``name`` (one of :data:`RUNNERS`) over the model folder."""
    if name.startswith("gguf"):
        manifest = models.read_manifest(folder)
        path = models.CachedModel(folder, manifest).gguf if manifest else None
        if path is None:
            raise LookupError("the model folder names no GGUF")
        config = gguf_weights.config_from_json(folder / "config.json")
        int8 = name.startswith("gguf-i8")
        attention = "fp32" if name.endswith("fp32att") else None
        return LeanRunner.from_gguf(path, config, max_length, int8=int8, attention=attention)
    if name == "fp16":
        runner = LeanRunner.from_pretrained(
            models.hf_checkpoint(folder), max_length=max_length, kernels=True
        )
        runner.half_panels()
        return runner
    if name.startswith("torch-int") and not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        raise LookupError("this torch has no weight-only CPU kernels")
    runner = LeanRunner.from_pretrained(
        models.hf_checkpoint(folder), max_length=max_length, kernels=False
    )
    return _weight_only(runner, 8 if name == "torch-int8" else 4)


def measure_bandwidth(reps: int = 15) -> dict[str, float]:
    """GB/s of two fp32 matrix-vector products over a 128 MiB matrix (medians)."""
    rows, cols = 4096, 8192
    w = torch.randn(rows, cols)  # (out, in)
    wt = w.t().contiguous()  # (in, out)
    x, xr = torch.randn(cols), torch.randn(1, rows)
    times: dict[str, list[float]] = {"mv": [], "vm": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mv(w, x)
        t1 = time.perf_counter()
        torch.mm(xr, wt.t())
        t2 = time.perf_counter()
        times["mv"].append(t1 - t0)
        times["vm"].append(t2 - t1)
    out = {k: rows * cols * 4 / statistics.median(v) / 1e9 for k, v in times.items()}
    out["best"] = max(out.values())
    return out


@contextlib.contextmanager
def _sharing(label: str) -> Iterator[None]:
    """The stack's row split off (its token count 0) while ``label`` is timed, if it is one
    of :data:`BY_PANELS`: a process-wide setting, so set around each of its forwards."""
    lib = quant_gemm.library() if label in BY_PANELS else None
    if lib is None:
        yield
        return
    old = lib.cs_lean_row_split(0)
    try:
        yield
    finally:
        lib.cs_lean_row_split(old)


def _timed(runner: LeanRunner, ids: list[int], back_to: int, label: str = "") -> float:
    with _sharing(label):
        t0 = time.perf_counter()
        runner.forward(ids)
        dt = time.perf_counter() - t0
    runner.truncate(back_to)
    return dt


def time_context(
    named: dict[str, LeanRunner], ctx: int, sizes: list[int], reps: int, budget_s: float, gen
) -> dict[tuple[str, int], float]:
    """Median seconds of each runner's T-token forward after ``ctx`` cached tokens.
    Slow runners get fewer repetitions (``budget_s`` per runner and size, at least 3)."""
    vocab = next(iter(named.values())).vocab_size
    prefix = torch.randint(0, vocab, (ctx,), generator=gen).tolist()
    draft = torch.randint(0, vocab, (max(sizes),), generator=gen).tolist()
    first: dict[tuple[str, int], float] = {}
    for label, r in named.items():
        r.reset()
        with _sharing(label):
            r.forward(prefix, last_only=True)
        for t in sizes:  # warm-up, and a first time for the budget
            _timed(r, draft[:t], ctx, label)
            first[(label, t)] = _timed(r, draft[:t], ctx, label)
    times: dict[tuple[str, int], list[float]] = {k: [] for k in first}
    labels = list(named)
    for rep in range(reps):
        for t in sizes:
            k = rep % len(labels)
            for label in labels[k:] + labels[:k]:
                if rep >= max(3, int(budget_s / max(first[(label, t)], 1e-6))):
                    continue
                times[(label, t)].append(_timed(named[label], draft[:t], ctx, label))
    return {k: statistics.median(v or [first[k]]) for k, v in times.items()}


I8_RUNNERS = ("gguf-i8", "gguf-i8-fp32att", "gguf-i8-panels")  # products by int8 dot products


def _rows(named, contexts, sizes, args, bw, gmacs: float) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for ctx in contexts:
        med = time_context(named, ctx, sizes, args.reps, args.budget_s, gen)
        for label, r in named.items():
            decode = med[(label, 1)] if 1 in sizes else None
            for t in sizes:
                nbytes = param_bytes(r) + kv_bytes(r, ctx + t)
                ms = med[(label, t)] * 1e3
                floor = nbytes / (bw * 1e9) * 1e3
                row = {
                    "runner": label,
                    "context": ctx,
                    "tokens": t,
                    "ms": round(ms, 3),
                    "decode_steps": round(med[(label, t)] / decode, 2) if decode else None,
                    "bytes": nbytes,
                    "floor_ms": round(floor, 3),
                    "vs_floor": round(ms / floor, 2),
                    "compute_floor_ms": None,
                    "vs_compute_floor": None,
                }
                if label in I8_RUNNERS and gmacs > 0:
                    compute = t * product_macs(r) / (gmacs * 1e9) * 1e3
                    row["compute_floor_ms"] = round(compute, 3)
                    row["vs_compute_floor"] = round(ms / compute, 2)
                rows.append(row)
    return rows


def _print(
    rows: list[dict[str, Any]], named: dict[str, LeanRunner], desc: str, args, bw, gmacs: float
) -> None:
    print(f"model: {desc}   threads {args.threads}   medians of up to {args.reps}, interleaved")
    print(f"bandwidth: {bw['best']:.1f} GB/s (W@x {bw['mv']:.1f}, x@W {bw['vm']:.1f})")
    if gmacs > 0:
        isa = quant_gemm.i8_isa()
        print(f"int8 dot products: {gmacs:.1f} G multiply-adds/s ({isa}, {args.threads} threads)")
    w = max(11, *(len(label) for label in named))  # the runner column's width
    for label, r in named.items():
        kv = kv_bytes(r, 1)
        macs = product_macs(r) / 1e6
        print(f"  {label:<{w}} weights {param_bytes(r) / 1e6:7.1f} MB   KV {kv} B/token   "
              f"products {macs:.1f}M multiply-adds/token")  # fmt: skip
    head = f"{'ctx':>5} {'T':>3} {'runner':<{w}} {'ms':>8} {'/decode':>8}"
    print(head + f" {'floor ms':>9} {'/floor':>7} {'compute ms':>11} {'/compute':>9}")
    for r in rows:
        steps = f"{r['decode_steps']:>8.2f}" if r["decode_steps"] is not None else f"{'':>8}"
        compute = f"{'':>11} {'':>9}"
        if r["compute_floor_ms"] is not None:
            compute = f"{r['compute_floor_ms']:>11.2f} {r['vs_compute_floor']:>9.2f}"
        print(
            f"{r['context']:>5} {r['tokens']:>3} {r['runner']:<{w}} {r['ms']:>8.2f} {steps} "
            f"{r['floor_ms']:>9.2f} {r['vs_floor']:>7.2f} {compute}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="codespec bench runner", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None,
                    help="model (default: $CODESPEC_MODEL, else qwen2.5-coder-0.5b)")  # fmt: skip
    ap.add_argument("--runners", default=",".join(RUNNERS), help="runners to time")
    ap.add_argument("--contexts", default="256,1300,4000", help="cached tokens, comma-separated")
    ap.add_argument("--tokens", default="1,8,16", help="tokens per forward (1 = decode)")
    ap.add_argument("--reps", type=int, default=15, help="timed forwards per cell and runner")
    ap.add_argument("--budget-s", type=float, default=3.0, help="seconds per cell at most")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    sizes = sorted({int(t) for t in args.tokens.split(",")} | {1})
    try:
        folder = models.resolve(args.model)
    except models.ModelError as exc:
        raise SystemExit(f"codespec bench runner: error: {exc}") from None
    max_length = max(contexts) + max(sizes)
    named: dict[str, LeanRunner] = {}
    for name in [n.strip() for n in args.runners.split(",") if n.strip()]:
        if name not in RUNNERS:
            raise SystemExit(f"codespec bench runner: unknown runner {name!r} ({RUNNERS})")
        try:
            named[name] = build(name, folder, max_length)
        except (LookupError, RuntimeError, ValueError) as exc:
            print(f"skipping {name}: {exc}", file=sys.stderr)
    if not named:
        raise SystemExit("codespec bench runner: no runner could be built")
    bw = measure_bandwidth()
    i8 = any(n in I8_RUNNERS for n in named) and quant_gemm.i8_available()
    gmacs = quant_gemm.i8_peak_gmacs(args.threads) if i8 else 0.0
    rows = _rows(named, contexts, sizes, args, bw["best"], gmacs)
    _print(rows, named, str(folder), args, bw, gmacs)
    summary = {
        "bench": "runner",
        "model": str(folder),
        "threads": args.threads,
        "reps": args.reps,
        "bandwidth_gbs": round(bw["best"], 2),
        "int8_gmacs": round(gmacs, 1) if gmacs else None,
        "weight_bytes": {k: param_bytes(r) for k, r in named.items()},
        "rows": rows,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
