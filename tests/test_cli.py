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
    # a cold kernel cache adds the build's two progress lines (codespec.native)
    err = "\n".join(
        line
        for line in proc.stderr.strip().splitlines()
        if not line.startswith("codespec: compiling ")
    )
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


def test_help_lists_every_command_and_version():
    from codespec.daemon import __version__
    from codespec.daemon.bench import SUBCOMMANDS
    from codespec.daemon.cli import build_parser

    out = codespec("--help", timeout=60)
    assert out.returncode == 0, out.stderr
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name in commands:
        assert f"    {name}" in out.stdout, name
    bench = " ".join(out.stdout.split("    bench", 1)[1].split())
    assert "WORKLOAD.jsonl | " + " | ".join(SUBCOMMANDS) in bench
    version = codespec("--version", timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == f"codespec {__version__}"


def test_every_flag_has_help():
    import argparse

    from codespec.daemon.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    for name, parser in sub.choices.items():
        assert sub._choices_actions, "commands without help"
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help.strip(), f"codespec {name} {action.dest}: no help"
    helps = {a.dest: a.help for a in sub._choices_actions}
    assert all(helps.get(n) for n in sub.choices), helps
    complete = sub.choices["complete"]
    for action in complete._actions:
        if action.dest in ("line", "character"):
            assert "0-based" in action.help


@pytest.fixture
def small_daemon(engine, tmp_path):
    from conftest import ServerThread, daemon_config

    srv = ServerThread(daemon_config(tmp_path), engine)
    yield srv
    srv.stop()


def test_complete_opens_the_file_in_its_language(small_daemon, tmp_path, monkeypatch, capsys):
    from codespec.daemon import cli

    opened: list[tuple[str, str]] = []
    store = small_daemon.server.documents
    real_open = store.open

    def recording_open(uri, text, version=None, language=""):
        opened.append((uri.rsplit("/", 1)[-1], language))
        return real_open(uri, text, version, language)

    monkeypatch.setattr(store, "open", recording_open)
    for name, text in [("lib.rs", "fn main() {\n    \n}\n"), ("app.py", "x = \n"),
                       ("notes.unknown", "x\n")]:  # fmt: skip
        (tmp_path / name).write_text(text)
        rc = cli.main(["complete", "--file", str(tmp_path / name), "--line", "0",
                       "--character", "1", "--max-tokens", "1", "--speculation", "off",
                       "--socket", small_daemon.socket_path])  # fmt: skip
        assert rc == 0, capsys.readouterr().err
    assert opened == [("lib.rs", "rust"), ("app.py", "python"), ("notes.unknown", "")]


def test_complete_past_the_end_of_the_line_is_an_error(small_daemon, tmp_path, capsys):
    from codespec.daemon import cli

    src = tmp_path / "short.py"
    src.write_text("x = 1\n")
    rc = cli.main(["complete", "--file", str(src), "--line", "0", "--character", "999",
                   "--socket", small_daemon.socket_path])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1
    assert "character 999 is past the end of line 0" in err
