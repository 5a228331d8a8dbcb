"""codespec.native's build: a first build says so on stderr as it starts and ends; a cached
build loads silently; a failed build says so and gives the reason."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from codespec.native import NativeLibrary, compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler")


def _declare(lib: ctypes.CDLL) -> None:
    lib.answer.restype = ctypes.c_int


def library(tmp_path: Path, body: str) -> NativeLibrary:
    src = tmp_path / "answer.cpp"
    src.write_text(body)
    return NativeLibrary("answer", [src], ["-O0", "-shared", "-fPIC"], _declare, label="the test")


def test_a_build_is_announced_and_a_cached_one_is_silent(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CODESPEC_KERNEL_DIR", str(tmp_path / "kernels"))
    body = 'extern "C" int answer() { return 42; }\n'
    assert library(tmp_path, body).required().answer() == 42
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("codespec: compiling the test (answer-") and "once per" in lines[0]
    assert lines[1].startswith("codespec: compiling the test: done in ")

    assert library(tmp_path, body).required().answer() == 42  # a new process would do this
    assert capsys.readouterr().err == ""


def test_a_failed_build_ends_its_announcement_and_gives_the_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CODESPEC_KERNEL_DIR", str(tmp_path / "kernels"))
    broken = library(tmp_path, "this is not C++\n")
    assert broken.library() is None
    assert "failed" in (broken.unavailable_reason() or "")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[1].startswith("codespec: compiling the test: failed in ")
