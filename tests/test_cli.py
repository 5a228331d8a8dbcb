"""The command line: it works, and every expected failure is one line and a non-zero exit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from codespec.daemon.engine import EMBEDDED_MODEL


def codespec(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "codespec.daemon.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert fragment in err


def test_generate_prints_text_and_stats():
    proc = codespec(
        "generate",
        "--prompt",
        "def add(a, b):\n",
        "--max-tokens",
        "6",
        "--speculation",
        "off",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    assert 1 <= stats["tokens"] <= 6
    assert stats["target_forwards"] == stats["tokens"] or stats["finish_reason"] == "stop"


def test_generate_from_file(tmp_path: Path):
    src = tmp_path / "prompt.py"
    src.write_text("import os\n\n\ndef main():\n")
    proc = codespec("generate", "--file", str(src), "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr


def test_bad_arguments():
    assert_one_line_error(
        codespec("generate", "--prompt", "x", "--max-tokens", "-3"), "--max-tokens"
    )
    assert_one_line_error(
        codespec("generate", "--prompt", "x", "--temperature", "hot"), "--temperature"
    )
    assert_one_line_error(codespec("generate"), "required")
    assert_one_line_error(codespec("frobnicate"), "invalid choice")
    assert_one_line_error(
        codespec("generate", "--prompt", "x", "--speculation", "bogus"), "unknown speculation"
    )


def test_missing_file_and_model(tmp_path: Path):
    assert_one_line_error(codespec("generate", "--file", str(tmp_path / "nope.py")), "cannot read")
    assert_one_line_error(
        codespec("generate", "--prompt", "x", "--model", str(tmp_path / "missing")),
        "does not exist",
    )


def test_corrupt_checkpoint(tmp_path: Path):
    bad = tmp_path / "model"
    bad.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODEL / name, bad / name)
    (bad / "model.safetensors").write_bytes(b"\x00garbage, not a safetensors file" * 10)
    assert_one_line_error(codespec("generate", "--prompt", "x", "--model", str(bad)), "cannot load")
    (bad / "config.json").write_text("{not json")
    assert_one_line_error(
        codespec("generate", "--prompt", "x", "--model", str(bad)), "codespec: error"
    )
