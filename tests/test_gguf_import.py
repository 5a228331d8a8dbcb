"""Reading a GGUF's config and tokenizer fast (``gguf_import``): the ``gguf`` library's
reader parses every tokenizer string (~600,000 in Qwen2.5's file: 13 s for the header
check, 35 s for the config and tokenizer on a 2-core VM), so the import reads the
metadata with codespec's own reader and names the tokenizer's class. What it writes must
be exactly what transformers writes reading the file its own way.

GGUF files are written by the tests (tests/ggufs.py)."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest
from ggufs import write_gguf

from codespec.daemon.engine import gguf_import


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def _transformers_own(path: Path, out: Path) -> None:
    """The config and tokenizer as transformers writes them reading the GGUF itself."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config._name_or_path = ""
    config.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(out))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("head", ["tied", "output"])
def test_config_and_tokenizer_equal_transformers_own(gguf_dir, tmp_path, arch, head):
    mix = {"output": "Q8_0"} if head == "output" else None
    path = write_gguf(gguf_dir / f"{arch}-{head}.gguf", arch, "Q8_0", mix=mix)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    gguf_import.write_config(path, ours)
    _transformers_own(path, theirs)
    names = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == names
    for name in names:
        assert filecmp.cmp(ours / name, theirs / name, shallow=False), name
    tied = gguf_import.config_dict(path)["tie_word_embeddings"]  # type: ignore[index]
    assert tied == (head == "tied")


def test_qwen2_is_read_without_the_gguf_librarys_reader(gguf_dir, tmp_path, monkeypatch):
    """The check, the config and the tokenizer of a qwen2 file never construct
    ``gguf.GGUFReader`` (the slow one); transformers still builds the tokenizer."""
    import gguf

    path = write_gguf(gguf_dir / "qwen2-fast.gguf", "qwen2", "Q8_0")

    class Refused:
        def __init__(self, *args, **kwargs) -> None:
            raise AssertionError("gguf.GGUFReader was used")

    monkeypatch.setattr(gguf, "GGUFReader", Refused)
    assert gguf_import.check_gguf(path)["architecture"] == "qwen2"
    gguf_import.write_config(path, tmp_path)
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "config.json").is_file()


@pytest.mark.parametrize("arch", ["gpt2", "mistral"])
def test_only_the_checked_architectures_are_read_fast(gguf_dir, arch):
    """A mistral file (imported, but its fast reading unchecked) and one codespec does
    not import are left to transformers' own reading."""
    path = write_gguf(gguf_dir / f"{arch}.gguf", arch, "F16")
    assert gguf_import.config_dict(path) is None
