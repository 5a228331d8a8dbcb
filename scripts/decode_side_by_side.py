"""Decode steps of several GGUF models side by side in one process (not part of the product).

For each model: the lean runner over the GGUF's own blocks with the products the engine
picks (``lean_config.gguf_products``: int8 where the CPU has integer dot products), the weight
bytes one decode step streams (every block matrix and the LM head: the embedding is read
a row at a time), then for each cached depth the median time of a decode step on top of
that many tokens, the models alternating step by step (the order flipping each round) so
that a busy machine slows them alike. Prints the median ms per step and GB/s of blocks::

    python scripts/decode_side_by_side.py A.gguf B.gguf [--depths 256,1000] [--reps 40]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from codespec.daemon.engine import gguf_weights
from codespec.daemon.engine.lean import LeanRunner
from codespec.daemon.engine.lean_config import gguf_products


def streamed_bytes(runner: LeanRunner) -> int:
    """Bytes of blocks a decode step reads: every layer matrix and the LM head."""
    mats = [runner.lm_head_t]
    for layer in runner.layers:
        mats += [m for m, _ in layer["qkv"]] + [m for m, _ in layer["gu"]]
        mats += [layer["o"][0], layer["down"][0]]
    return sum(m.nbytes for m in mats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", nargs="+", type=Path)
    ap.add_argument("--depths", default="256,1000", help="cached tokens, comma-separated")
    ap.add_argument("--reps", type=int, default=40, help="timed steps per model and depth")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    depths = [int(d) for d in args.depths.split(",")]
    int8 = gguf_products() == "int8"
    runners: dict[str, tuple[LeanRunner, int]] = {}
    for path in args.gguf:
        g = gguf_weights.read(path)
        config = gguf_weights.config_from_meta(g)
        runner = LeanRunner.from_gguf(g, config, max_length=max(depths) + 64, int8=int8)
        name = path.parent.name if path.name == "model.gguf" else path.name
        runners[name] = (runner, streamed_bytes(runner))
        print(f"{name}: {'int8' if runner.int8 else 'exact'} products, {runner.attention}"
              f" attention, {runners[name][1] / 1e6:.1f} MB of blocks a step")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for depth in depths:
        times: dict[str, list[float]] = {name: [] for name in runners}
        for runner, _ in runners.values():
            runner.reset()
            prompt = torch.randint(100, 20000, (depth,), generator=gen).tolist()
            runner.forward(prompt, last_only=True)
            for _ in range(3):  # warm-up steps
                runner.forward([5])
                runner.truncate(depth)
        order = list(runners)
        for i in range(args.reps):
            for name in order if i % 2 == 0 else order[::-1]:
                runner = runners[name][0]
                t0 = time.perf_counter()
                runner.forward([1000 + i])
                times[name].append(time.perf_counter() - t0)
                runner.truncate(depth)
        for name, (_, nbytes) in runners.items():
            ms = statistics.median(times[name]) * 1e3
            rate = nbytes / 1e6 / ms
            print(f"{depth:5d} cached  {name:40s} {ms:7.2f} ms/step  {rate:5.2f} GB/s of blocks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
