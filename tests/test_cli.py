"""The command line: it works, and every expected failure is one line and a non-zero exit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# the commands load the default model: fetched (once) before any of them starts
pytestmark = pytest.mark.usefixtures("default_model_dir")


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


def test_generate_from_file(tmp_path: Path, tiny_model: Path):
    """(On the tiny model: the file and the default speculation are what is under test.)"""
    src = tmp_path / "prompt.py"
    src.write_text("import os\n\n\ndef main():\n")
    proc = codespec("generate", "--file", str(src), "--max-tokens", "4", "--model", str(tiny_model))
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
    assert_one_line_error(codespec("train-model"), "invalid choice")  # retired with the toy
    assert_one_line_error(
        codespec("generate", "--prompt", "x", "--speculation", "bogus"), "unknown speculation"
    )


def test_missing_file_and_model(tmp_path: Path):
    assert_one_line_error(codespec("generate", "--file", str(tmp_path / "nope.py")), "cannot read")
    assert_one_line_error(
        codespec("generate", "--prompt", "x", "--model", str(tmp_path / "missing")),
        "does not exist",
    )


def test_no_weights_for_a_model_proposer(tiny_model: Path):
    """A model with no EAGLE head beside it (as the default has none yet): one line saying
    so, not a traceback."""
    assert_one_line_error(
        codespec("generate", "--prompt", "x", "--speculation", "eagle", "--model", str(tiny_model)),
        "no eagle weights for this model",
    )


def test_corrupt_checkpoint(tmp_path: Path, default_model_dir: Path):
    bad = tmp_path / "model"
    bad.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, bad / name)
    (bad / "model.safetensors").write_bytes(b"\x00garbage, not a safetensors file" * 10)
    assert_one_line_error(codespec("generate", "--prompt", "x", "--model", str(bad)), "cannot load")
    (bad / "config.json").write_text("{not json")
    assert_one_line_error(
        codespec("generate", "--prompt", "x", "--model", str(bad)), "codespec: error"
    )
