"""``codespec bench runner`` on the default model: every runner it names is built over the
same model, timed, and reported against the bytes it reads (mechanics, not speed)."""

from __future__ import annotations

import json

from codespec.daemon.bench import dispatch


def test_runner_bench_reports_every_runner_against_its_bytes(default_model_dir, capsys):
    argv = ["runner", "--runners", "gguf,fp16,torch-int8", "--contexts", "32",
            "--tokens", "1,4", "--reps", "1", "--threads", "1"]  # fmt: skip
    assert dispatch(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["bench"] == "runner"
    cells = {(r["runner"], r["tokens"]): r for r in result["rows"]}
    assert set(cells) == {(n, t) for n in ("gguf", "fp16", "torch-int8") for t in (1, 4)}
    for (_, t), row in cells.items():
        assert row["context"] == 32 and row["ms"] > 0 and row["floor_ms"] > 0
        assert row["decode_steps"] > 0 and (t > 1 or row["decode_steps"] == 1.0)
    w = result["weight_bytes"]
    # the GGUF's Q4_1 / Q8_0 blocks are about a third of the fp16 panels' bytes
    assert w["gguf"] < 0.45 * w["fp16"] and w["gguf"] < w["torch-int8"] < w["fp16"]
    assert any(line.lstrip().startswith("gguf ") for line in out)  # the table names it
