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


def _two_sources(tmp_path: Path, second: str, timeout: float = 120) -> NativeLibrary:
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text('int half(); extern "C" int answer() { return 2 * half(); }\n')
    b.write_text(second)
    return NativeLibrary("two", [a, b], ["-O0", "-shared", "-fPIC"], _declare, timeout=timeout,
                         label="the test")  # fmt: skip


def test_several_sources_compile_at_once_then_link(tmp_path, monkeypatch, capsys):
    """Each source is compiled by a compiler process of its own, all started before any
    ends (a wrapper logs each start and end around the real compiler), then linked; the
    kernel folder keeps the library alone (no objects, no partial file)."""
    log, wrapper = tmp_path / "log", tmp_path / "cxx"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo "start $*" >> {log}\n'
        'case "$*" in *" -c "*) sleep 1 ;; esac\n'
        f'{compiler()} "$@"; rc=$?\n'
        f'echo "end $*" >> {log}\n'
        "exit $rc\n"
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("CODESPEC_KERNEL_DIR", str(tmp_path / "kernels"))
    lib = _two_sources(tmp_path, "int half() { return 21; }\n")
    assert lib.required().answer() == 42
    events = [
        line.split()[0] + (" -c" if " -c " in line else "") for line in log.read_text().splitlines()
    ]
    assert events[:2] == ["start -c", "start -c"], events  # both compiles before either ends
    assert sorted(events[2:4]) == ["end -c", "end -c"] and events[4:] == ["start", "end"], events
    assert [p.suffix for p in (tmp_path / "kernels").iterdir()] == [".so"]


def test_a_failed_or_slow_source_fails_the_build_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CODESPEC_KERNEL_DIR", str(tmp_path / "kernels"))
    broken = _two_sources(tmp_path, "this is not C++\n")
    assert broken.library() is None
    assert "failed" in (broken.unavailable_reason() or "")
    assert not list((tmp_path / "kernels").iterdir())
    slow = _two_sources(tmp_path, "int half() { return 21; }\n", timeout=0.001)
    assert slow.library() is None and "timed out" in (slow.unavailable_reason() or "")
    assert not list((tmp_path / "kernels").iterdir())
