"""``codespec bench``: benchmarks a user can run too.

``codespec bench WORKLOAD.jsonl --methods off,ngram,hf,hf-pld`` runs the
decoding methods side by side on a workload; ``codespec bench runner`` times
the model runners; ``codespec bench index`` times the n-gram index;
``codespec bench make-workloads`` builds the standard workloads from real code;
``codespec bench latency`` times ``complete`` over the daemon's socket;
``codespec bench quality`` scores completions at real cursor positions;
``codespec bench kernels`` times the quantized CPU products;
``codespec bench peers`` runs llama.cpp (plain and ``llama-lookup``) beside them;
``codespec bench infill`` times a FIM completion through the daemon beside
``llama-server``'s ``/infill``.
Each prints a table and ends with one JSON line.
"""

from __future__ import annotations

import importlib

SUBCOMMANDS = {
    "runner": "codespec.daemon.bench.runner",
    "index": "codespec.daemon.bench.index",
    "make-workloads": "codespec.daemon.bench.workloads",
    "latency": "codespec.daemon.bench.latency",
    "eagle": "codespec.daemon.bench.eagle",
    "lookahead": "codespec.daemon.bench.lookahead",
    "quality": "codespec.daemon.bench.quality",
    "kernels": "codespec.daemon.bench.kernels",
    "peers": "codespec.daemon.bench.peers",
    "vllm": "codespec.daemon.bench.vllm",
    "infill": "codespec.daemon.bench.infill",
}


def dispatch(argv: list[str]) -> int:
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[argv[0]])
        return int(module.main(argv[1:]) or 0)
    from codespec.daemon.bench.methods import main

    return main(argv)
