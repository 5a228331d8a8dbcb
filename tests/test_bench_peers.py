"""``codespec bench peers``: llama.cpp's output parsers (on output captured from the real
binaries, tests/data/peers/), the skip line when llama.cpp cannot be built, the arguments.
No llama.cpp is built here."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from codespec.daemon.bench import SUBCOMMANDS, dispatch, llamacpp, llamacpp_run, peers

DATA = Path(__file__).parent / "data" / "peers"


def test_parse_perf_reads_llama_completion_timings():
    perf = llamacpp_run.parse_perf((DATA / "llama-completion.stderr").read_text())
    assert perf["prompt_tokens"] > 100 and perf["prompt_ms"] > 0
    assert perf["eval_runs"] > 0 and perf["eval_ms"] > 0
    assert llamacpp_run.parse_perf("nothing here") == {}


def test_parse_lookup_reads_the_summary():
    out = llamacpp_run.parse_lookup((DATA / "llama-lookup.stderr").read_text())
    assert out["encoded_tokens"] > 100 and out["encoded_s"] > 0
    assert out["decoded_tokens"] > 0 and out["decoded_s"] > 0
    assert out["n_draft"] == 10
    assert 0 <= out["n_accept"] <= out["n_drafted"]
    assert llamacpp_run.parse_lookup("") == {}


def test_parse_llama_bench_reads_its_json():
    records = llamacpp_run.parse_llama_bench((DATA / "llama-bench.json").read_text())
    assert [r["depth"] for r in records] == [0, 1000]
    assert all(r["gen"] == 64 and r["tokens_per_s"] > 0 for r in records)
    assert llamacpp_run.parse_llama_bench("no json") == []


def test_generated_text_follows_the_echoed_prompt():
    assert llamacpp_run.generated("\n\nPROMPT and more\n\n", "PROMPT") == " and more"
    assert llamacpp_run.generated("just output") == "just output"


def _fake(path: Path, script: str) -> Path:
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


def test_runs_time_decode_after_the_first_token(tmp_path):
    """The runners on stand-in binaries that print the real binaries' captured output."""
    err = DATA / "llama-completion.stderr"
    plain = _fake(tmp_path / "llama-completion", f"printf 'x = 1'; cat {err} >&2\n")
    err = DATA / "llama-lookup.stderr"
    lookup = _fake(tmp_path / "llama-lookup", f"printf '\\n\\nPROMPTy = 2\\n\\n'; cat {err} >&2\n")
    llama = llamacpp.LlamaCpp(tmp_path, "0.3.36", plain, lookup, None)
    opts = llamacpp_run.Options(max_tokens=40)
    t = llamacpp_run.run_plain(llama, opts, tmp_path / "m.gguf", tmp_path / "p.txt")
    perf = llamacpp_run.parse_perf((DATA / "llama-completion.stderr").read_text())
    assert t.text == "x = 1" and t.decode_tokens == perf["eval_runs"] == 39 and t.tokens == 40
    assert t.decode_s == pytest.approx(perf["eval_ms"] / 1000)
    assert t.prompt_tokens == perf["prompt_tokens"]
    t = llamacpp_run.run_lookup(llama, opts, tmp_path / "m.gguf", tmp_path / "p.txt", "PROMPT")
    assert t.text == "y = 2" and t.tokens == 41 and t.decode_tokens == 40
    assert (t.drafted, t.accepted) == (44, 16)


def test_a_crashing_binary_is_a_reason(tmp_path):
    exe = _fake(tmp_path / "llama-completion", "kill -ILL $$\n")
    llama = llamacpp.LlamaCpp(tmp_path, "0.3.36", exe, None, None)
    with pytest.raises(llamacpp_run.LlamaFailed, match="signal 4"):
        llamacpp_run.run_plain(
            llama, llamacpp_run.Options(), tmp_path / "m.gguf", tmp_path / "p.txt"
        )


def test_the_peers_run_without_the_wait_policy_codespec_set(tmp_path, monkeypatch):
    """codespec sets OMP_WAIT_POLICY=PASSIVE for itself (unless the user chose one);
    llama.cpp's OpenMP threads inherited it and slept at every barrier (3.5x slower than
    the same binary from a shell). A policy the user chose is theirs and stays."""
    import codespec.daemon as daemon_pkg

    exe = _fake(tmp_path / "llama-bench", 'printf "%s" "${OMP_WAIT_POLICY-unset}"\n')
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(daemon_pkg, "OMP_WAIT_POLICY_OURS", True)
    assert llamacpp_run.run_binary([str(exe)], 30)[0] == "unset"
    monkeypatch.setattr(daemon_pkg, "OMP_WAIT_POLICY_OURS", False)  # the user's own
    assert llamacpp_run.run_binary([str(exe)], 30)[0] == "PASSIVE"


def test_cpu_flags_name_each_feature_and_never_native_or_amx():
    info = "processor : 0\nflags : fpu sse avx avx2 fma f16c bmi2 avx512f amx_tile\n"
    flags = llamacpp.cpu_flags(info)
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AMX_TILE=OFF" in flags
    assert "-DGGML_AVX2=ON" in flags and "-DGGML_AVX512=ON" in flags
    assert "-DGGML_AVX512_VNNI=OFF" in flags
    assert "-DGGML_AVX512=OFF" in llamacpp.cpu_flags("flags : avx avx2 fma f16c\n")
    assert not any("AVX" in f for f in llamacpp.cpu_flags(""))  # not x86: ggml's defaults


def test_cmake_targets(tmp_path):
    (tmp_path / "examples" / "lookup").mkdir(parents=True)
    (tmp_path / "examples" / "lookup" / "CMakeLists.txt").write_text(
        "set(TARGET llama-lookup)\nadd_executable(${TARGET} lookup.cpp)\n"
    )
    (tmp_path / "tools" / "completion").mkdir(parents=True)
    (tmp_path / "tools" / "completion" / "CMakeLists.txt").write_text(
        "set(TARGET llama-completion)\n"
    )
    assert llamacpp.cmake_targets(tmp_path) == {"llama-lookup", "llama-completion"}


def test_a_failed_download_is_a_reason_and_leaves_nothing(tmp_path, monkeypatch):
    def pip_fails(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution\n")

    monkeypatch.setattr(llamacpp.subprocess, "run", pip_fails)
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: "/usr/bin/" + name)
    with pytest.raises(llamacpp.PeerUnavailable, match="pip download llama-cpp-python failed"):
        llamacpp.llama_cpp(root=tmp_path, say=lambda m: None)
    assert llamacpp.cached_build(tmp_path) is None
    assert not list(tmp_path.glob(".build-*"))  # the temporary folder is gone


def test_no_cmake_is_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: None)
    with pytest.raises(llamacpp.PeerUnavailable, match="cmake is not installed"):
        llamacpp.llama_cpp(root=tmp_path)


def test_a_cached_build_is_found_and_a_partial_one_is_not(tmp_path):
    assert llamacpp.cached_build(tmp_path) is None
    for version in ("0.3.9", "0.3.36"):
        (tmp_path / f"llama.cpp-{version}" / "bin").mkdir(parents=True)
        exe = tmp_path / f"llama.cpp-{version}" / "bin" / "llama-lookup"
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    (tmp_path / "llama.cpp-0.3.9" / llamacpp.BUILD_INFO).write_text('{"version": "0.3.9"}')
    assert llamacpp.cached_build(tmp_path).version == "0.3.9"  # 0.3.36 has no build.json
    (tmp_path / "llama.cpp-0.3.36" / llamacpp.BUILD_INFO).write_text('{"version": "0.3.36"}')
    found = llamacpp.cached_build(tmp_path)
    assert found.version == "0.3.36" and found.plain is None and found.lookup is not None


def test_the_draft_flag_follows_the_version(tmp_path):
    exe = tmp_path / "llama-lookup"
    exe.write_text("#!/bin/sh\necho '--spec-draft-n-max N   number of tokens to draft'\n")
    exe.chmod(0o755)
    llama = llamacpp.LlamaCpp(tmp_path, "0.3.36", None, exe, None)
    assert llama.draft_flag() == "--spec-draft-n-max"
    exe.write_text("#!/bin/sh\necho '--draft N   number of tokens to draft'\n")
    assert llamacpp.LlamaCpp(tmp_path, "0.3.1", None, exe, None).draft_flag() == "--draft"


def test_arguments_and_defaults():
    assert SUBCOMMANDS["peers"] == "codespec.daemon.bench.peers"
    args = peers.build_parser().parse_args([])
    assert args.workload == ["/tmp/wl/edit.jsonl"]
    assert (args.max_tokens, args.threads, args.draft) == (200, 2, 10)
    assert args.methods == "off,ngram,auto" and not args.stop_at_eos
    args = peers.build_parser().parse_args(
        ["a.jsonl", "b.jsonl", "--limit", "3", "--max-tokens", "50", "--draft", "6"]
    )
    assert args.workload == ["a.jsonl", "b.jsonl"] and (args.limit, args.max_tokens) == (3, 50)
    assert args.draft == 6


def test_llama_cpp_gets_the_prompt_unescaped_and_the_same_budget(tmp_path):
    args = peers.build_parser().parse_args(["--max-tokens", "50", "--threads", "3"])
    flags = llamacpp_run.common_flags(peers.options(args), tmp_path / "m.gguf", tmp_path / "p.txt")
    assert flags[flags.index("-f") + 1] == str(tmp_path / "p.txt")
    assert flags[flags.index("-n") + 1] == "50" and flags[flags.index("-t") + 1] == "3"
    assert flags[flags.index("--temp") + 1] == "0"
    assert "--no-escape" in flags and "--ignore-eos" in flags
    args = peers.build_parser().parse_args(["--stop-at-eos"])
    assert "--ignore-eos" not in llamacpp_run.common_flags(peers.options(args), tmp_path, tmp_path)


def test_unknown_method_is_refused(capsys):
    assert dispatch(["peers", "x.jsonl", "--methods", "off,nope"]) == 2
    assert "unknown methods" in capsys.readouterr().err


def test_skipped_peer_still_runs_codespec(tmp_path, capsys, monkeypatch, tiny_model):
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "a", "prompt": "def add(a, b):\n    return a + b\n"}))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")

    def no_build(**kw):
        raise llamacpp.PeerUnavailable("cmake configure failed: boom")

    monkeypatch.setattr(peers, "model_gguf", lambda model: gguf)
    monkeypatch.setattr(llamacpp, "llama_cpp", no_build)
    args = ["peers", str(wl), "--model", str(tiny_model), "--max-tokens", "6"]
    assert dispatch([*args, "--methods", "ngram"]) == 0
    captured = capsys.readouterr()
    out = captured.out.strip().splitlines()
    assert out.count("llama.cpp peer skipped: cmake configure failed: boom") == 1
    assert "llama.cpp peer skipped: cmake configure failed: boom" in captured.err
    result = json.loads(out[-1])
    assert result["bench"] == "peers" and result["skipped"] == "cmake configure failed: boom"
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"off", "ngram"}
    assert rows["off"]["tokens"] == 6 and rows["ngram"]["equal_to_off"] == 1
    assert rows["off"]["decode_vs_llama_cpp"] is None
