"""The methods benchmark runs our engine and the HF peers side by side and reports equality.

The benchmarks run on the tiny model (``--model``): their mechanics are under test here,
not the default model's speed.
"""

from __future__ import annotations

import json
import re

import pytest

from codespec.daemon.bench import dispatch
from codespec.daemon.engine.engine import GenParams


@pytest.fixture(scope="module")
def model(tiny_model) -> list[str]:
    return ["--model", str(tiny_model)]


def test_methods_bench_prints_table_and_json(tmp_path, capsys, model, engine):
    """Every method gives off's tokens, and speculation shows in the figures: the first
    prompt's continuation lies in an open document, so the n-gram method drafts it and
    needs fewer forwards than tokens (off needs one per token, the prefill counted)."""
    first = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
    engine.reset_cache()
    plain, _ = engine.generate(engine.encode(first), GenParams(max_tokens=24))
    doc = {"uri": "file:///pkg/ops.py", "text": first + engine.decode(plain)}
    lines = [
        {"id": "a", "prompt": first, "max_tokens": 24, "kind": "completion", "documents": [doc]},
        {"id": "b", "prompt": "import os\nimport sys\n", "max_tokens": 8, "kind": "novel"},
    ]
    wl = tmp_path / "w.jsonl"
    wl.write_text("\n".join(json.dumps(x) for x in lines))
    assert dispatch([str(wl), "--methods", "off,ngram,hf,hf-pld", *model]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    rows = {(r["workload"], r["method"]): r for r in result["rows"]}
    off = rows[("all", "off")]
    assert off["tokens_per_forward"] == 1.0 and off["tokens"] == off["target_forwards"] > 0
    for method in ("ngram", "hf", "hf-pld"):
        assert rows[("all", method)]["prompts"] == 2
        assert rows[("all", method)]["equal_to_off"] == 2, method
        assert rows[("all", method)]["tokens"] == off["tokens"]
    ngram = rows[("completion", "ngram")]
    assert ngram["target_forwards"] < rows[("completion", "off")]["target_forwards"]
    assert ngram["tokens_per_forward"] > 1.0
    assert ("completion", "hf") in rows and ("novel", "off") in rows


def test_steps_tell_where_each_methods_decode_time_went(tmp_path, capsys, model, engine):
    """``--steps``: every step the engine verified, by who drafted it and how it ended.
    The prompt's continuation lies in an open document, so n-gram drafts are accepted;
    the steps' tokens are every token but the one the prefill wrote, and off (no
    proposer) has none. Without ``--steps`` the JSON line has no such rows."""
    first = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
    engine.reset_cache()
    plain, _ = engine.generate(engine.encode(first), GenParams(max_tokens=24))
    doc = {"uri": "file:///pkg/ops.py", "text": first + engine.decode(plain)}
    item = {"id": "a", "prompt": first, "max_tokens": 24, "documents": [doc]}
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps(item))
    assert dispatch([str(wl), "--methods", "off,ngram", "--steps", *model]) == 0
    out = capsys.readouterr().out
    assert "where decode time went" in out
    result = json.loads(out.strip().splitlines()[-1])
    steps = result["steps"]
    assert {s["method"] for s in steps} == {"ngram"}
    ngram = next(r for r in result["rows"] if r["method"] == "ngram")
    assert sum(s["tokens"] for s in steps) == ngram["tokens"] - 1
    assert sum(s["steps"] for s in steps) == ngram["target_forwards"] - 1  # the prefill
    assert all(s["forward_ms"] > 0 for s in steps)
    accepted = [s for s in steps if s["outcome"] in ("whole", "part")]
    assert accepted and all(s["source"].startswith("ngram:") for s in accepted)
    assert all(s["nodes"] == 0 for s in steps if s["outcome"] == "plain")
    assert dispatch([str(wl), "--methods", "off,ngram", *model]) == 0
    assert "steps" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_steps_count_each_prompts_fastest_round():
    """The steps counted are those of the round whose decode time counts (the fastest)."""
    from codespec.daemon.bench.decoding import Run, Step
    from codespec.daemon.bench.methods_report import add_steps

    slow = Run(3, 2, 90.0, [1, 2, 3], 10.0, [Step("ngram:context", "bonus", 4, 1, 30.0)])
    fast = Run(3, 2, 70.0, [1, 2, 3], 5.0, [Step("ngram:context", "whole", 2, 3, 20.0)])
    table: dict = {}
    add_steps(table, {"ngram": [slow, fast]})
    assert table == {("ngram", "ngram:context", "whole"): [1, 2, 3, 20.0]}


def test_methods_bench_takes_several_workloads_and_a_temperature(tmp_path, capsys, model):
    paths = []
    for kind, prompt in (("completion", "def add(a, b):\n"), ("novel", "import os\n")):
        path = tmp_path / f"{kind}.jsonl"
        path.write_text(json.dumps({"id": kind, "prompt": prompt, "max_tokens": 6, "kind": kind}))
        paths.append(str(path))
    args = [*paths, "--methods", "off,auto,hf", "--temperature", "0.8", "--seed", "5", *model]
    assert dispatch(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["temperature"] == 0.8
    assert result["workload"] == "completion.jsonl,novel.jsonl"
    methods = {r["method"] for r in result["rows"]}
    assert methods == {"off", "auto"}  # the greedy-only HF peer is left out when sampling
    kinds = {r["workload"] for r in result["rows"]}
    assert kinds == {"all", "completion", "novel"}


def test_each_workload_keeps_its_own_index(tmp_path, capsys, monkeypatch, model):
    """A workload's open documents feed only its own prompts: combining workloads in one
    run must not hand the novel prompts another workload's index."""
    from codespec.daemon.bench import methods

    docs = [{"uri": "file:///pkg/a.py", "text": "def helper(x):\n    return x + 1\n"}]
    with_docs = {"id": "c", "prompt": "import os\n", "max_tokens": 4, "documents": docs}
    paths = []
    for kind, item in (("completion", with_docs), ("novel", {"id": "n", "prompt": "x = 1\n"})):
        path = tmp_path / f"{kind}.jsonl"
        path.write_text(json.dumps(dict(item, kind=kind, max_tokens=4)))
        paths.append(str(path))
    seen: dict[str, object] = {}
    real = methods.run_engine

    def spy(engine, method, prompt, max_tokens, index, uri, *rest):
        seen[engine.decode(prompt)] = index
        return real(engine, method, prompt, max_tokens, index, uri, *rest)

    monkeypatch.setattr(methods, "run_engine", spy)
    assert dispatch([*paths, "--methods", "off,ngram", *model]) == 0
    capsys.readouterr()
    assert seen["import os\n"] is not None and "file:///pkg/a.py" in seen["import os\n"]
    assert seen["x = 1\n"] is None


def test_a_timed_decode_does_not_inherit_lookahead_pools(engine):
    """Running the same prompt twice under one uri costs the same forwards both times: the
    second run must not draft from the pool the first run harvested from its own output.

    The bare proposer drafts every step: the policy's controller (what ``run_engine``'s
    methods get) sizes drafts by measured time, so its forwards vary with the machine's load."""
    from codespec.daemon.bench.decoding import decode_once
    from codespec.daemon.engine.engine import GenParams
    from codespec.speculators.draft import RequestInfo
    from codespec.speculators.registry import build

    prompt = engine.encode("class Stack:\n    def __init__(self):\n")
    info = RequestInfo(prompt_ids=prompt, uri="file:///same.py", max_tokens=48)
    runs = [
        decode_once(engine, prompt, GenParams(max_tokens=48), build("lookahead", engine), info)
        for _ in range(2)
    ]
    assert runs[0][0] == runs[1][0]
    assert runs[0][1].target_forwards == runs[1][1].target_forwards
    assert sum(runs[0][1].accepted.values()) > 0  # the pools do draft: the check has teeth


def test_lookahead_grid_decodes_each_prompt_with_empty_pools(tmp_path, capsys, model):
    """The same prompt twice, without a uri, costs twice one decode's forwards: the
    second decode must not draft from a pool the first one filled with its output. The
    policy-free configuration (``,all``): the controller's draft sizes follow measured time."""
    item = {"id": "p", "prompt": "class Stack:\n    def __init__(self):\n", "max_tokens": 40}

    def forwards(copies: int) -> int:
        wl = tmp_path / f"w{copies}.jsonl"
        wl.write_text("\n".join(json.dumps(item) for _ in range(copies)))
        assert dispatch(["lookahead", str(wl), "--grid", "2,4,2,all", *model]) == 0
        rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
        (row,) = [r for r in rows if r["config"] == "2,4,2,all"]
        assert row["equal_to_off"] == copies
        return row["target_forwards"]

    assert forwards(2) == 2 * forwards(1)


def test_latency_throughput_rounds_add_up_tokens_and_time():
    """``bench latency`` runs each method's throughput in rounds (alternating which goes
    first); a method's figure is its tokens over its time in all rounds, each round kept."""
    from codespec.daemon.bench.latency import mean_rounds

    r = mean_rounds([{"tokens": 100, "wall_s": 2.0, "tokens_per_s": 50.0},
                     {"tokens": 100, "wall_s": 3.0, "tokens_per_s": 100 / 3}])  # fmt: skip
    assert (r["tokens"], r["wall_s"], r["tokens_per_s"]) == (200, 5.0, 40.0)
    assert r["rounds"] == [50.0, 33.3]


def test_latency_configs_alternate_and_their_runs_average():
    """``bench latency --configs a,b``: rounds alternate the order (a b b a ...), and a
    config's figures are the mean of its runs per kind of keystroke, counts summed."""
    from codespec.daemon.bench.latency import ab_order, mean_latency

    assert ab_order(["a", "b"], 3) == ["a", "b", "b", "a", "a", "b"]
    assert ab_order(["a", "b", "c"], 2) == ["a", "b", "c", "c", "b", "a"]
    run = {"n": 3, "first_p50_ms": 80.0, "final_p99_ms": 300.0}
    other = {"n": 2, "first_p50_ms": 100.0, "final_p99_ms": 500.0}
    r = mean_latency([{"all": run, "typing": run}, {"all": other, "typing": run}])
    assert r["all"] == {"n": 5, "first_p50_ms": 90.0, "final_p99_ms": 400.0,
                        "runs_first_p50_ms": [80.0, 100.0]}  # fmt: skip
    assert r["typing"]["first_p50_ms"] == 80.0 and r["typing"]["n"] == 6


def test_latency_configs_must_exist(tmp_path, capsys):
    """A config file that is not there is a clear error before any daemon starts."""
    import pytest

    from codespec.daemon.bench.latency import main

    with pytest.raises(SystemExit, match="no config file"):
        main(["--configs", f"{tmp_path / 'a.toml'},{tmp_path / 'b.toml'}"])


def test_latency_typist_leaves_speculation_to_the_daemon_when_told():
    """``--configs`` compares daemons by their config files, ``[speculation] default``
    included: its requests name no speculation; the plain bench's name theirs."""
    from codespec.daemon.bench.latency import Typist

    class Recorder:
        def __init__(self):
            self.sent = []

        def request(self, method, params, on_delta=None):
            self.sent.append((method, params))
            return {}

    for speculation, want in [(None, None), ("off", "off")]:
        c = Recorder()
        t = Typist(c, ["x = 1\n"], speculation, 0.0)
        t.complete(0, 0, 1, "typing")
        (params,) = [p for m, p in c.sent if m == "complete"]
        assert params.get("speculation") == want
        assert ("speculation" in params) == (want is not None)


def test_an_exact_prediction_drafts_the_whole_output(tmp_path, capsys, model):
    """``--prediction output``: the edit's prompt as with no prediction, its draft what
    plain greedy decoding of that prompt writes. The n-gram method then drafts the output
    whole (a few long forwards), and every method still equals off token for token."""
    old = "def area(w, h):\n    return w * h\n"
    item = {
        "id": "e", "kind": "edit", "prefix": "import math\n\n\n" + old.splitlines()[0] + "\n",
        "old": old, "new": "def area(w, h):\n    return abs(w * h)\n", "suffix": "\n",
        "max_tokens": 40, "uri": "file:///pkg/geo.py",
    }  # fmt: skip
    wl = tmp_path / "edit.jsonl"
    wl.write_text(json.dumps(item))

    def rows(prediction: str) -> dict[str, dict]:
        args = [str(wl), "--methods", "off,ngram@64", "--prediction", prediction, *model]
        assert dispatch(args) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["prediction"] == prediction
        return {r["method"]: r for r in result["rows"]}

    exact, old_draft = rows("output"), rows("none")
    for r in (exact, old_draft):
        assert r["ngram@64"]["equal_to_off"] == 1
        assert r["ngram@64"]["tokens"] == r["off"]["tokens"] > 8
    # alone, 2 forwards (the prefill's token, then the draft whole); after other tests the
    # process's barrier policy can make this tiny model's 7+-token forwards cost 2-3 plain
    # steps, and the policy then verifies the draft in cuts of 2-5 tokens
    fewer = exact["ngram@64"]["target_forwards"]
    assert 2 * fewer <= old_draft["ngram@64"]["target_forwards"]
    assert exact["ngram@64"]["tokens"] >= 2 * fewer


def test_rounds_count_each_methods_fastest_run_and_every_rounds_output():
    """``--rounds``: a prompt's time is each method's fastest round (wall and decode time
    each), its tokens the first round's; it equals off only if every round did."""
    from codespec.daemon.bench.decoding import Run
    from codespec.daemon.bench.methods_report import accumulate

    off = [Run(4, 4, 90.0, [1, 2, 3, 4], 30.0), Run(4, 4, 80.0, [1, 2, 3, 4], 25.0)]
    ngram = [Run(4, 2, 50.0, [1, 2, 3, 4], 35.0), Run(4, 2, 60.0, [1, 2, 3, 9], 10.0)]
    aggs: dict = {}
    accumulate(aggs, {"all"}, {"off": off, "ngram": ngram})
    a, o = aggs[("all", "ngram")], aggs[("all", "off")]
    assert (a.prompts, a.tokens, a.forwards) == (1, 4, 2)
    assert (a.ms, a.off_ms) == (50.0, 80.0)
    assert (a.decode_ms, a.off_decode_ms) == (15.0, 55.0)  # 50 - 35 vs 60 - 10: the 2nd
    assert a.equal == 0 and o.equal == 1  # ngram's second round wrote another token


def test_methods_bench_runs_rounds(tmp_path, capsys, model):
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "a", "prompt": "def add(a, b):\n", "max_tokens": 6}))
    assert dispatch([str(wl), "--methods", "off,ngram", "--rounds", "3", *model]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["rounds"] == 3
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["ngram"]["prompts"] == 1 and rows["ngram"]["equal_to_off"] == 1
    assert rows["off"]["tokens"] == rows["ngram"]["tokens"] > 0
    line = next(ln for ln in captured.err.splitlines() if "[1/1]" in ln)
    assert re.search(r"off \d+/\d+/\d+ms/\d+f", line), line  # each round's time
    with pytest.raises(SystemExit):
        dispatch([str(wl), "--rounds", "0", *model])


def test_an_edit_items_drafts_get_the_daemons_edit_budget():
    """The bench verifies what the daemon would: an ``edit`` request's drafts may run to
    EDIT_DRAFT tokens (handlers raise max_draft to it), others the configured budget;
    ``NAME@K`` sets it either way."""
    from codespec.daemon.bench.decoding import draft_budget
    from codespec.daemon.prompts.completion import EDIT_DRAFT

    edit, completion = {"new": "x", "old": "y"}, {"prefix": "def f"}
    assert EDIT_DRAFT > 16
    assert draft_budget("ngram", edit, 16) == EDIT_DRAFT
    assert draft_budget("auto", edit, 2 * EDIT_DRAFT) == 2 * EDIT_DRAFT
    assert draft_budget("ngram", completion, 16) == 16
    assert draft_budget("ngram@8", edit, 16) == 8


def test_latency_typist_retypes_a_line_presses_enter_and_leaves_the_text_as_it_was():
    """A retyped spot: the line emptied (its arrival's kind), typed back a character per
    keystroke, then Enter at its end (``newline``: a completion on the fresh line, indented
    like it) and the new line taken away; the document ends as it began. The spots go two
    at a time file by file, so a run has jumps and file switches alike."""
    from codespec.daemon.bench.latency import Spot, Typist, spots

    text = "def f(x):\n    total = x + 1\n    return total\n"

    class Editor:
        def __init__(self):
            self.doc, self.asked = text, []

        def request(self, method, params, on_delta=None):
            if method == "change":
                lines = self.doc.splitlines(keepends=True)
                (ch,) = params["changes"]
                a, b = ch["range"]["start"], ch["range"]["end"]
                off = lambda p: sum(map(len, lines[: p["line"]])) + p["character"]  # noqa: E731
                self.doc = self.doc[: off(a)] + ch["text"] + self.doc[off(b) :]
            elif method == "complete":
                line = self.doc.splitlines()[params["position"]["line"]]
                self.asked.append((line, params["position"]["character"]))
            return {}

    ed = Editor()
    t = Typist(ed, [text], "auto", 0.0)
    t.retype(Spot(0, 1, "    total = x + 1"), "jump")
    assert ed.doc == text
    assert len(t.final["jump"]) == 1 and len(t.final["newline"]) == 1
    assert len(t.final["typing"]) == 13  # the line's 13 characters after its indent
    assert ed.asked[0] == ("    ", 4) and ed.asked[-1] == ("    ", 4)  # emptied; Enter
    assert ed.asked[-2] == ("    total = x + 1", 17)

    fa = "\n".join(f"def a{i}(x):\n    '''doc'''\n    value = x * {i} + 100\n" for i in range(8))
    order = [(s.file, s.line) for s in spots([fa, fa.replace("value", "other")], 4)]
    files = [f for f, _ in order]
    assert files == [0, 0, 1, 1, 0, 0, 1, 1, 0] and order[0] == order[-1]
    assert len(set(order)) == 8


def test_quality_bench_moves_the_cursor_into_the_line_and_compares_middles(tmp_path, capsys, model):
    """``--at half``: the cursor half-way through the expected line (the typed half
    joins the prefix, the rest is what is scored); ``--middles line,cursor``: a row per
    context and middle."""
    from codespec.daemon.bench.quality import typed_into

    item = {"id": "a", "kind": "completion", "uri": "file:///pkg/ops.py", "max_tokens": 16}
    item |= {"prefix": "def add(a, b):\n", "expected": "    return a + b\n", "suffix": "\n"}
    half = typed_into(item, "half")
    assert half["prefix"] + half["expected"] == item["prefix"] + item["expected"]
    assert half["prefix"].endswith("    return") and half["expected"] == " a + b\n"
    assert typed_into(item, "start") == item
    wl = tmp_path / "q.jsonl"
    wl.write_text(json.dumps(item))
    args = ["quality", str(wl), "--variants", "none", "--middles", "line,cursor", "--at", "half"]
    assert dispatch([*args, *model]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["at"] == "half"
    assert [r["variant"] for r in result["rows"]] == ["none/line", "none/cursor"]
    assert all(r["lines"] == 1 for r in result["rows"])


def test_quality_bench_rows_per_block_grid(capsys):
    """``--block-lines 4,8``: a row per grid for block middles (one for any other middle);
    a grid that is not a whole number from 1 to 64 is refused before any model loads."""
    from codespec.daemon.bench.quality import _variants

    rows = _variants(["none"], ["block", "line"], [4, 8])
    assert rows == [("none/block/grid4", "none", "block", 4),
                    ("none/block/grid8", "none", "block", 8),
                    ("none/line", "none", "line", 4)]  # fmt: skip
    assert [r[0] for r in _variants(["none"], ["block"], [8])] == ["none"]
    with pytest.raises(SystemExit):
        dispatch(["quality", "x.jsonl", "--block-lines", "4,zero"])
    assert "--block-lines" in capsys.readouterr().err


def test_latency_throughput_gives_each_client_a_file_of_its_own(daemon, monkeypatch):
    """``bench latency``'s throughput: client k opens ``texts[k]`` (no two clients share a
    prompt's start) and asks at spots spread over its own file; the tokens add up."""
    from codespec.daemon.bench import latency
    from codespec.daemon.client import Client

    sent: list[tuple[str, dict]] = []
    real = Client.request

    def recording(self, method, params=None, on_delta=None):
        sent.append((method, params))
        return real(self, method, params, on_delta)

    monkeypatch.setattr(Client, "request", recording)
    texts = [
        "".join(f"a{i} = {i}\n" for i in range(30)),
        "".join(f"b{i} = {i}\n" for i in range(12)),
    ]
    r = latency.throughput(daemon.socket_path, texts, 2, 2, "off")
    opened = {p["uri"]: p["text"] for m, p in sent if m == "open"}
    assert sorted(opened.values()) == sorted(texts)
    asked = {(p["uri"], p["position"]["line"]) for m, p in sent if m == "complete"}
    for uri, text in opened.items():
        n = len(text.splitlines())
        assert {line for u, line in asked if u == uri} == {n // 3, 2 * n // 3}
    assert r["tokens"] > 0


def test_latency_typist_pauses_after_each_spot_when_told(daemon, monkeypatch):
    """``bench latency --gap-ms``: the typist pauses that long after each spot before
    moving on (a programmer reading; the daemon's idle time fills file runs)."""
    from codespec.daemon.bench import latency

    slept: list[float] = []
    monkeypatch.setattr(latency.time, "sleep", slept.append)
    text = "\n".join(f"def a{i}(x):\n    '''doc'''\n    value = x * {i} + 100\n" for i in range(6))
    out = latency.typing_latency(daemon.socket_path, [text], "off", 0.0, per_file=2, gap_s=0.25)
    n = len(latency.spots([text], 2))
    assert slept.count(0.25) == n and out["jump"]["n"] >= 1


def test_latency_traces_each_request_and_counts_the_recalled(daemon):
    """``bench latency --trace``: a record per typing request with its kind and the
    daemon's stats; each kind's ``recalled`` counts the requests whose stats recalled."""
    from codespec.daemon.bench import latency

    text = "\n".join(f"def a{i}(x):\n    '''doc'''\n    value = x * {i} + 100\n" for i in range(6))
    trace: list[dict] = []
    out = latency.typing_latency(daemon.socket_path, [text], "off", 0.0, per_file=2, trace=trace)
    assert len(trace) == out["all"]["n"] > 0
    assert {r["kind"] for r in trace} == set(out) - {"all"}
    assert all("recalled" in r["stats"] and r["final_ms"] >= r["first_ms"] for r in trace)
    for kind in out:
        rows = [r for r in trace if kind in ("all", r["kind"])]
        assert out[kind]["recalled"] == sum(r["stats"]["recalled"] > 0 for r in rows)


def test_latency_reads_a_daemons_memory_and_prints_it(capsys):
    """``bench latency`` reports each daemon's resident memory after typing (VmRSS, and
    its peak VmHWM), from /proc; a process that is gone gives nothing."""
    import os
    import subprocess
    import sys

    from codespec.daemon.bench import latency, served

    mem = served.daemon_memory(os.getpid())
    assert 0 < mem["rss_mib"] <= mem["peak_mib"]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert served.daemon_memory(gone.pid) == {}
    status = {"memory": {"auto": {"rss_mib": 1000.5, "peak_mib": 1100.25}, "off": {}}}
    latency.report([], {}, {"auto": {}, "off": {}}, status)
    out = capsys.readouterr().out
    assert "daemon memory after typing, auto: resident 1000.5 MiB, peak 1100.2 MiB" in out
    assert '"memory": {"auto": {"rss_mib": 1000.5' in out and "typing, off" not in out
