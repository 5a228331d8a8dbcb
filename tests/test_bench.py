"""The methods benchmark runs our engine and the HF peers side by side and reports equality."""

from __future__ import annotations

import json

from codespec.daemon.bench import dispatch


def test_methods_bench_prints_table_and_json(tmp_path, capsys):
    wl = tmp_path / "w.jsonl"
    lines = [
        {
            "id": "a",
            "prompt": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
            "max_tokens": 8,
            "kind": "completion",
        },
        {"id": "b", "prompt": "import os\nimport sys\n", "max_tokens": 8, "kind": "novel"},
    ]
    wl.write_text("\n".join(json.dumps(x) for x in lines))
    assert dispatch([str(wl), "--methods", "off,hf,hf-pld"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    rows = {(r["workload"], r["method"]): r for r in result["rows"]}
    assert rows[("all", "off")]["tokens_per_forward"] == 1.0
    assert rows[("all", "off")]["equal_to_off"] == 2
    for method in ("hf", "hf-pld"):
        assert rows[("all", method)]["prompts"] == 2
        assert rows[("all", method)]["equal_to_off"] == 2
    assert ("completion", "hf") in rows and ("novel", "off") in rows


def test_methods_bench_takes_several_workloads_and_a_temperature(tmp_path, capsys):
    paths = []
    for kind, prompt in (("completion", "def add(a, b):\n"), ("novel", "import os\n")):
        path = tmp_path / f"{kind}.jsonl"
        path.write_text(json.dumps({"id": kind, "prompt": prompt, "max_tokens": 6, "kind": kind}))
        paths.append(str(path))
    args = [*paths, "--methods", "off,auto,hf", "--temperature", "0.8", "--seed", "5"]
    assert dispatch(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["temperature"] == 0.8
    assert result["workload"] == "completion.jsonl,novel.jsonl"
    methods = {r["method"] for r in result["rows"]}
    assert methods == {"off", "auto"}  # the greedy-only HF peer is left out when sampling
    kinds = {r["workload"] for r in result["rows"]}
    assert kinds == {"all", "completion", "novel"}
