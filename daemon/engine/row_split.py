"""From how many tokens a forward is shared out by rows: chosen on this machine, at load.

Owns: :func:`calibrate` (times a loaded lean runner's small forwards both ways and sets
the stack's process-wide switch, ``cs_lean_row_split``), :func:`row_switch` (the
choice from those times) and :func:`calibrate_kept` (the choice kept per machine and
model in ``row_split.json``, so that only the first load times it). By rows, each
thread runs its own tokens through every product (each reads all the weights; the
second read comes from a shared cache where there is one); by panels, the threads split
each product and meet at ~11 barriers a layer. Which way wins depends on the machine: on
a Zen 4 VM with SmolLM2 rows won from 8 tokens; on a Xeon VM with the 0.5B panels won up
to 32 (16 tokens 49 against 56 ms). Must not touch: the numbers (which thread computes
a row changes none), the runner's weights, or its cache past the forwards it times (it
leaves the cache empty); of the state directory, anything but its ``row_split.json``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from codespec.daemon.engine import quant_gemm
from codespec.daemon.engine.cpu_gemm import cpu_flags, cpu_name
from codespec.native import state_dir

SIZES = (8, 16, 32)  # tokens of the forwards timed (verifications' sizes)
CONTEXT = 256  # cached tokens before them
KEEP = 32  # switches calibrate_kept keeps (machine, threads, kernel, model, context)


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
    lib = _usable(runner)
    if lib is None:
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


def _usable(runner: Any) -> Any:
    """The kernel whose switch :func:`calibrate` would set for ``runner``; None where it
    would choose nothing (see there)."""
    lib = quant_gemm.library()
    if (
        getattr(runner, "stack", None) is None
        or not getattr(runner, "int8", False)  # exact products: never shared out by rows
        or lib is None
        or torch.get_num_threads() < 2
        or os.environ.get("CODESPEC_ROW_SPLIT") is not None
    ):
        return None
    return lib


def calibrate_kept(runner: Any, model: str, store: Path | None = None) -> int | None:
    """:func:`calibrate`, timed once per machine and model: the switch is kept in
    ``store`` (default ``row_split.json`` in codespec's state directory) under this
    CPU's name and feature flags (a VM's name may be only its vendor's: "AMD EPYC"), the
    thread count, the kernel's build, ``model`` (a model folder, whose name holds its
    hash) and the runner's context; a later load sets the kept switch without timing
    (2.9 s of each start of the 0.5B on a 2-core VM). A store that cannot be read or
    written is passed over: the switch is timed, as before."""
    lib = _usable(runner)
    if lib is None:
        return None
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    key = " | ".join((cpu_name(), flags, str(torch.get_num_threads()), Path(lib._name).name,
                      str(model), str(runner.max_length)))  # fmt: skip
    store = store or state_dir() / "row_split.json"
    try:
        kept = json.loads(store.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        kept = {}
    kept = kept if isinstance(kept, dict) else {}
    if isinstance(kept.get(key), int):
        lib.cs_lean_row_split(kept[key])
        return kept[key]
    switch = calibrate(runner)
    if switch is not None:
        kept[key] = switch
        for old in list(kept)[:-KEEP]:  # the oldest past KEEP (models come and go)
            del kept[old]
        with contextlib.suppress(OSError):
            store.parent.mkdir(parents=True, exist_ok=True)
            tmp = store.with_name(f".{store.name}.{os.getpid()}")
            tmp.write_text(json.dumps(kept, indent=1), encoding="utf-8")
            os.replace(tmp, store)  # whole or not at all
    return switch
