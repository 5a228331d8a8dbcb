"""``codespec bench runner`` on the default model: every runner it names is built over the
same model, timed, and reported against the bytes it reads (mechanics, not speed)."""

from __future__ import annotations

import json

import pytest

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


def test_int8_runners_are_set_against_the_dot_products_rate(default_model_dir, capsys):
    """``gguf-i8`` rows carry the products' compute floor: T tokens times a token's
    multiply-adds (every matrix once: SmolLM2-135M's 30 layers and its tied LM head) over
    the int8 dot product rate measured in the run; runners without int8 products carry
    none."""
    from codespec.daemon.engine import quant_gemm

    if not quant_gemm.i8_available():
        pytest.skip(f"no int8 product path here ({quant_gemm.unavailable_reason()})")
    argv = ["runner", "--runners", "gguf-i8,fp16", "--contexts", "32",
            "--tokens", "1,4", "--reps", "1", "--threads", "1"]  # fmt: skip
    assert dispatch(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    gmacs = result["int8_gmacs"]
    assert gmacs > 1.0
    h, inter, layers, vocab, q, kv = 576, 1536, 30, 49152, 9 * 64, 3 * 64
    macs = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter) + vocab * h
    for row in result["rows"]:
        if row["runner"] == "fp16":
            assert row["compute_floor_ms"] is None and row["vs_compute_floor"] is None
            continue
        want = row["tokens"] * macs / (gmacs * 1e9) * 1e3
        assert row["compute_floor_ms"] == pytest.approx(want, rel=2e-3, abs=1e-3)
        assert row["vs_compute_floor"] == pytest.approx(
            row["ms"] / row["compute_floor_ms"], rel=0.02
        )


def test_the_panels_runner_times_the_stack_without_its_row_split(default_model_dir, capsys):
    """``gguf-i8-panels`` is ``gguf-i8`` with every forward shared out by panels: timed on
    two threads, none of its forwards (16 tokens, the 32-token prefill) goes by rows, where
    ``gguf-i8``'s do, and the stack's setting is left as it was."""
    from codespec.daemon.engine import quant_gemm

    if not quant_gemm.i8_available():
        pytest.skip(f"no int8 product path here ({quant_gemm.unavailable_reason()})")
    lib = quant_gemm.library()
    setting = lib.cs_lean_row_split(8)  # an engine loaded before may have calibrated it
    by_rows = []
    try:
        for runner in ("gguf-i8-panels", "gguf-i8"):
            before = lib.cs_lean_row_forwards()
            argv = ["runner", "--runners", runner, "--contexts", "32",
                    "--tokens", "1,16", "--reps", "1", "--threads", "2"]  # fmt: skip
            assert dispatch(argv) == 0
            rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
            assert {(r["runner"], r["tokens"]) for r in rows} == {(runner, 1), (runner, 16)}
            by_rows.append(lib.cs_lean_row_forwards() - before)
            assert lib.cs_lean_row_split(-1) == 8
    finally:
        lib.cs_lean_row_split(setting)
    assert by_rows[0] == 0 and by_rows[1] > 0


def test_the_dot_product_rate_is_measured_per_path_and_zero_without_one():
    from codespec.daemon.engine import quant_gemm

    if quant_gemm.library() is None:
        pytest.skip(f"no kernel here ({quant_gemm.unavailable_reason()})")
    assert quant_gemm.i8_peak_gmacs(1, isa="scalar") == 0.0
    for isa in ("avx2", "avx512-vnni"):
        rate = quant_gemm.i8_peak_gmacs(1, isa=isa, iters=20_000, rounds=2)
        best = quant_gemm.i8_isa()  # an AVX-512 VNNI CPU has AVX2 too
        ok = isa == best or (isa == "avx2" and best == "avx512-vnni")
        assert (rate > 1.0) if ok else rate == 0.0
