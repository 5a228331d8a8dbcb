"""Resident memory of a process that loads a model folder as the daemon does and decodes
(not part of the product): the lean runner ``lean.from_model_folder`` picks (the GGUF's
own blocks where it can), a prefill of ``--prompt`` random tokens and ``--steps`` greedy
decode steps; prints VmRSS after loading and at the end, and the peak (VmHWM)::

    python scripts/load_and_decode_rss.py MODEL_FOLDER [--prompt 1000] [--steps 64]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from codespec.daemon.engine.lean import from_model_folder


def _status_mb() -> dict[str, float]:
    """VmRSS and VmHWM of this process, in MB."""
    with open("/proc/self/status", encoding="utf-8") as f:
        return {
            line.split(":")[0]: int(line.split()[1]) / 1024
            for line in f
            if line.startswith(("VmRSS", "VmHWM"))
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"after imports: {_status_mb()}")
    t0 = time.perf_counter()
    got = from_model_folder(args.folder)
    if got is None:
        print("the folder does not run from its GGUF's blocks")
        return 1
    runner, _ = got
    print(f"loaded in {time.perf_counter() - t0:.1f} s (int8 {runner.int8}, max_length"
          f" {runner.max_length}): {_status_mb()}")  # fmt: skip
    ids = torch.randint(100, 20000, (args.prompt,), generator=torch.Generator().manual_seed(0))
    runner.forward(ids.tolist(), last_only=True)
    tok = 5
    for _ in range(args.steps):
        tok = int(runner.forward([tok]).logits[-1].argmax())
    print(f"after {args.prompt} + {args.steps} tokens: {_status_mb()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
