"""The methods benchmark's sums and tables (``codespec bench WORKLOAD.jsonl``).

Owns: adding each prompt's runs to the sums per workload kind and method
(:class:`Agg`, :func:`accumulate`), the ``--steps`` table of where decode time went
(:func:`add_steps`, :func:`print_steps`), and the printed table with its final JSON
line (:func:`print_table`).
Must not touch: running anything (``methods`` runs the prompts, ``decoding`` times them).
"""

from __future__ import annotations

import argparse
import json
import platform
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any

from codespec.daemon.bench.decoding import Run

if TYPE_CHECKING:
    from codespec.daemon.engine.engine import Engine


@dataclass
class Agg:
    prompts: int = 0
    tokens: int = 0
    forwards: int = 0
    ms: float = 0.0
    off_ms: float = 0.0
    decode_ms: float = 0.0
    off_decode_ms: float = 0.0
    equal: int = 0


def accumulate(
    aggs: dict[tuple[str, str], Agg], kinds: set[str], runs: dict[str, list[Run]]
) -> None:
    """Add one prompt's runs to the sums of each of ``kinds`` (``all`` and the item's).

    ``runs``: each method's runs of the prompt (one a round). The time counted is the
    fastest round's (wall time and decode time each on its own: a shared machine's noise
    only ever adds time); tokens and forwards are the first round's, and a method equals
    off only if every round of it wrote off's first round's tokens.
    """
    off = runs["off"]
    off_ms = min(r.ms for r in off)
    off_decode = min(r.ms - r.first_ms for r in off)
    for kind in kinds:
        for m, rs in runs.items():
            a = aggs.setdefault((kind, m), Agg())
            a.prompts += 1
            a.tokens += rs[0].tokens
            a.forwards += rs[0].forwards
            a.ms += min(r.ms for r in rs)
            a.off_ms += off_ms
            a.decode_ms += min(r.ms - r.first_ms for r in rs)
            a.off_decode_ms += off_decode
            a.equal += int(all(r.ids == off[0].ids for r in rs))


def add_steps(table: dict[tuple[str, str, str], list[float]], runs: dict[str, list[Run]]) -> None:
    """Add one prompt's verified steps to ``table`` ((method, source, outcome) -> [steps,
    nodes, tokens, forward ms]): each method's fastest round by decode time, the round
    whose time the figures count."""
    for m, rs in runs.items():
        fastest = min(rs, key=lambda r: r.ms - r.first_ms)
        for st in fastest.steps:
            row = table.setdefault((m, st.source, st.outcome), [0, 0, 0, 0.0])
            row[0] += 1
            row[1] += st.nodes
            row[2] += st.tokens
            row[3] += st.forward_ms


def print_steps(table: dict[tuple[str, str, str], list[float]]) -> list[dict[str, Any]]:
    """The ``--steps`` table (by method, the costliest rows first); its rows for the JSON."""
    head = f"{'method':<11}{'drafted by':<20}{'outcome':<9}{'steps':>7}{'nodes':>8}"
    head += f"{'tokens':>8}{'forward ms':>12}{'ms/token':>10}"
    print("where decode time went (each prompt's fastest round; the verify forwards' ms)")
    print(head)
    print("-" * len(head))
    rows = []
    for (m, source, outcome), (n, nodes, tokens, ms) in sorted(
        table.items(), key=lambda kv: (kv[0][0], -kv[1][3])
    ):
        per = ms / tokens if tokens else 0.0
        print(f"{m:<11}{source:<20}{outcome:<9}{n:>7}{nodes:>8}{tokens:>8}{ms:>12.0f}{per:>10.2f}")
        rows.append({"method": m, "source": source, "outcome": outcome, "steps": n,
                     "nodes": nodes, "tokens": tokens, "forward_ms": round(ms, 1)})  # fmt: skip
    return rows


def print_table(
    aggs: dict[tuple[str, str], Agg],
    engine: Engine,
    args: argparse.Namespace,
    extra: dict[str, Any],
    steps: dict[tuple[str, str, str], list[float]] | None = None,
) -> None:
    """The table, ``steps``' table (:func:`print_steps`) when given, then the JSON line."""
    head = f"{'workload':<11}{'method':<9}{'prompts':>8}{'tokens':>8}{'forwards':>9}"
    head += f"{'tok/fwd':>9}{'wall ms':>10}{'vs off':>8}{'decode ms':>11}{'vs off':>8}{'= off':>8}"
    print(
        f"codespec bench {' '.join(args.workload)}  (temperature {args.temperature}, "
        f"{date.today()}, {platform.machine()}, "
        f"{engine.device.type}, {engine.runner.name} runner, model {engine.model_name})"
    )
    print(head)
    print("-" * len(head))
    rows = []
    for (kind, m), a in aggs.items():
        tpf = a.tokens / a.forwards if a.forwards else 0.0
        speed = a.off_ms / a.ms if a.ms else 0.0
        dspeed = a.off_decode_ms / a.decode_ms if a.decode_ms > 0 else 0.0
        print(
            f"{kind:<11}{m:<9}{a.prompts:>8}{a.tokens:>8}{a.forwards:>9}{tpf:>9.2f}"
            f"{a.ms:>10.0f}{speed:>7.2f}x{a.decode_ms:>11.0f}{dspeed:>7.2f}x"
            f"{a.equal:>5}/{a.prompts:<2}"
        )
        rows.append(
            {
                "workload": kind,
                "method": m,
                "prompts": a.prompts,
                "tokens": a.tokens,
                "target_forwards": a.forwards,
                "tokens_per_forward": round(tpf, 3),
                "wall_ms": round(a.ms, 1),
                "speedup_vs_off": round(speed, 3),
                "decode_ms": round(a.decode_ms, 1),
                "decode_speedup_vs_off": round(dspeed, 3),
                "equal_to_off": a.equal,
            }
        )
    if steps is not None:
        extra = {**extra, "steps": print_steps(steps)}
    print(
        json.dumps(
            {
                "bench": "methods",
                "workload": ",".join(Path(w).name for w in args.workload),
                "temperature": args.temperature,
                "date": str(date.today()),
                "device": engine.device.type,
                "runner": engine.runner.name,
                "prediction": args.prediction,
                "rounds": args.rounds,
                **extra,
                "rows": rows,
            }
        )
    )
