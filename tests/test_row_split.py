"""The row switch timed once per machine and model (``row_split.calibrate_kept``): a
later load sets the kept switch without timing any forward. Tiny random GGUFs written by
the test (tests/ggufs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ggufs import write_gguf

from codespec.daemon.engine import quant_gemm, row_split
from codespec.daemon.engine.lean import LeanRunner


@pytest.fixture
def runner(tmp_path: Path) -> LeanRunner:
    if quant_gemm.library() is None:
        pytest.skip("no quantized kernel")
    return LeanRunner.from_gguf(write_gguf(tmp_path / "t.gguf", "llama", "Q8_0"),
                                max_length=128, int8=True)  # fmt: skip


def test_the_switch_is_timed_once_then_kept(runner, tmp_path, monkeypatch):
    lib = quant_gemm.library()
    monkeypatch.delenv("CODESPEC_ROW_SPLIT", raising=False)
    before, threads = lib.cs_lean_row_split(-1), torch.get_num_threads()
    timed: list[int] = []
    real = row_split.calibrate

    def calibrate(r, *args, **kwargs):
        timed.append(1)
        return real(r, sizes=(4, 8), reps=1, context=16)

    monkeypatch.setattr(row_split, "calibrate", calibrate)
    store = tmp_path / "state" / "row_split.json"
    try:
        torch.set_num_threads(2)
        got = row_split.calibrate_kept(runner, "model-a", store)
        assert got in (4, 8, 16) and timed == [1]
        assert list(json.loads(store.read_text()).values()) == [got]
        lib.cs_lean_row_split(5)
        assert row_split.calibrate_kept(runner, "model-a", store) == got
        assert timed == [1]  # kept: no forward timed
        assert lib.cs_lean_row_split(-1) == got  # and set
        row_split.calibrate_kept(runner, "model-b", store)  # another model: timed
        assert timed == [1, 1] and len(json.loads(store.read_text())) == 2
        store.write_text("not json")  # a damaged store: timed again, then rewritten
        assert row_split.calibrate_kept(runner, "model-a", store) in (4, 8, 16)
        assert timed == [1, 1, 1] and len(json.loads(store.read_text())) == 1
        torch.set_num_threads(1)  # one thread: nothing to choose, nothing kept
        assert row_split.calibrate_kept(runner, "model-c", store) is None
        assert timed == [1, 1, 1]
    finally:
        torch.set_num_threads(threads)
        lib.cs_lean_row_split(before)


def test_an_unwritable_store_still_times_the_switch(runner, tmp_path, monkeypatch):
    monkeypatch.delenv("CODESPEC_ROW_SPLIT", raising=False)
    lib = quant_gemm.library()
    before, threads = lib.cs_lean_row_split(-1), torch.get_num_threads()
    blocker = tmp_path / "file"
    blocker.write_text("")
    real = row_split.calibrate
    monkeypatch.setattr(row_split, "calibrate",
                        lambda r, *a, **k: real(r, sizes=(4, 8), reps=1, context=16))  # fmt: skip
    try:
        torch.set_num_threads(2)
        assert row_split.calibrate_kept(runner, "m", blocker / "row_split.json") in (4, 8, 16)
    finally:
        torch.set_num_threads(threads)
        lib.cs_lean_row_split(before)
