"""From how many tokens a forward is shared out by rows: chosen on this machine, at load.

Owns: :func:`calibrate` (times a loaded lean runner's small forwards both ways and sets
the stack's process-wide switch, ``cs_lean_row_split``) and :func:`row_switch` (the
choice from those times). By rows, each thread runs its own tokens through every
product (each reads all the weights; the second read comes from a shared cache where
there is one); by panels, the threads split each product and meet at ~11 barriers a
layer. Which way wins depends on the machine: on a Zen 4 VM with SmolLM2 rows won from
8 tokens; on a Xeon VM with the 0.5B panels won up to 32 (16 tokens 49 against 56 ms).
Must not touch: the numbers (which thread computes a row changes none), the runner's
weights, or its cache past the forwards it times (it leaves the cache empty).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from codespec.daemon.engine import quant_gemm

SIZES = (8, 16, 32)  # tokens of the forwards timed (verifications' sizes)
CONTEXT = 256  # cached tokens before them


def row_switch(best: dict[tuple[int, bool], float]) -> int:
    """From ``best`` (seconds of a forward of T tokens shared out by rows, ``(T, True)``,
    or by panels, ``(T, False)``, for the same sizes both ways), the smallest size from
    which rows were never slower; none: twice the largest size."""
    sizes = sorted({t for t, _ in best})
    switch = 2 * sizes[-1]
    for t in reversed(sizes):
        if best[(t, True)] > best[(t, False)]:
            break
        switch = t
    return switch


def calibrate(
    runner: Any, sizes: tuple[int, ...] = SIZES, reps: int = 3, context: int = CONTEXT
) -> int | None:
    """Time ``runner``'s (a :class:`~codespec.daemon.engine.lean.LeanRunner`) forwards of
    ``sizes`` tokens after ``context`` cached, by rows and by panels, alternating which
    goes first, ``reps`` times each (the fastest counts), and set the stack's switch to
    :func:`row_switch` of them (~1.5 s on the 0.5B, ~0.5 s on SmolLM2). Sizes and context
    shrink to the runner's ``max_length``. Returns the switch, or None where nothing was
    chosen: no stack, exact products (a forward shared out by rows needs the int8 ones),
    one thread, ``CODESPEC_ROW_SPLIT`` set, or too short a context.
    Leaves the cache empty."""
    lib = quant_gemm.library()
    if (
        getattr(runner, "stack", None) is None
        or not getattr(runner, "int8", False)  # exact products: never shared out by rows
        or lib is None
        or torch.get_num_threads() < 2
        or os.environ.get("CODESPEC_ROW_SPLIT") is not None
    ):
        return None
    sizes = tuple(t for t in sizes if 2 * t <= runner.max_length)
    if not sizes:
        return None
    context = min(context, runner.max_length - max(sizes))
    ids = [(i * 7919 + 11) % runner.vocab_size for i in range(context + max(sizes))]
    best: dict[tuple[int, bool], float] = {}
    old = lib.cs_lean_row_split(-1)
    try:
        runner.reset()
        runner.forward(ids[:context], last_only=True)
        for rep in range(reps):
            for t in sizes:
                for rows in (rep % 2 == 0, rep % 2 == 1):
                    lib.cs_lean_row_split(1 if rows else 0)
                    t0 = time.perf_counter()
                    runner.forward(ids[context : context + t], greedy=True)
                    dt = time.perf_counter() - t0
                    runner.truncate(context)
                    best[(t, rows)] = min(dt, best.get((t, rows), dt))
    finally:
        lib.cs_lean_row_split(old)
        runner.reset()
    switch = row_switch(best)
    lib.cs_lean_row_split(switch)
    return switch
