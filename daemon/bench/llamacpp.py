"""llama.cpp as a peer of the benchmarks: where its build lives, built once and cached.

Built from the ``llama-cpp-python`` sdist on PyPI (it vendors llama.cpp under
``vendor/llama.cpp``) with cmake, only the targets the benchmarks run
(``llama-completion`` or, in older versions, ``llama-cli``; ``llama-lookup``;
``llama-bench``), into a temporary folder renamed into place when whole:
``<state dir>/peers/llama.cpp-<version>/bin`` (``$CODESPEC_PEERS`` overrides the
``peers`` folder), with ``build.json`` saying how. CPU features are named one by one,
never ``GGML_NATIVE``: on some VMs here the CPU advertises AMX that faults (SIGILL).
Anything that keeps llama.cpp from being had raises :class:`PeerUnavailable` with the
reason in one line.

Owns: :func:`llama_cpp` (the cached build, else a new one under a file lock),
:class:`LlamaCpp` (a build's binaries), the build itself and its cache folder.
Must not touch: running the binaries and reading their output (``llamacpp_run``), the
benchmarks' tables (``peers``, ``infill``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codespec.daemon.engine import cpu_gemm
from codespec.daemon.engine.models import file_lock

SDIST = "llama-cpp-python"
PLAIN_TARGETS = ("llama-completion", "llama-cli")  # the plain decoder, newest name first
LOOKUP_TARGET = "llama-lookup"
BENCH_TARGET = "llama-bench"
SERVER_TARGET = "llama-server"  # the /infill endpoint llama.vim calls
BUILD_INFO = "build.json"


class PeerUnavailable(Exception):
    """llama.cpp cannot be had here (no download, no cmake, a failed build); the message
    says why in one line."""


# -- where the build lives -------------------------------------------------------------


def peers_root() -> Path:
    """``$CODESPEC_PEERS``, else ``<state dir>/peers`` (beside the model cache)."""
    env = os.environ.get("CODESPEC_PEERS")
    if env:
        return Path(env).expanduser()
    from codespec.daemon.config import default_state_dir

    return default_state_dir() / "peers"


@dataclass
class LlamaCpp:
    """A built llama.cpp: its binaries (a missing one is None) and how it was built."""

    folder: Path
    version: str
    plain: Path | None
    lookup: Path | None
    bench: Path | None
    info: dict[str, Any] = field(default_factory=dict)
    server: Path | None = None
    _draft_flag: str = ""

    def draft_flag(self) -> str:
        """llama-lookup's flag for the draft length: ``--spec-draft-n-max`` in newer
        versions (they refuse the old ``--draft``), ``--draft`` before."""
        if not self._draft_flag and self.lookup is not None:
            try:
                proc = subprocess.run([str(self.lookup), "--help"], capture_output=True,
                                      text=True, errors="replace", timeout=60,
                                      stdin=subprocess.DEVNULL)  # fmt: skip
                help_text = proc.stdout + proc.stderr
            except (OSError, subprocess.SubprocessError):
                help_text = ""
            self._draft_flag = (
                "--spec-draft-n-max" if "--spec-draft-n-max" in help_text else "--draft"
            )
        return self._draft_flag or "--draft"


def _from_folder(folder: Path) -> LlamaCpp | None:
    try:
        info = json.loads((folder / BUILD_INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    bin_dir = folder / "bin"

    def exe(name: str | None) -> Path | None:
        p = bin_dir / name if name else None
        return p if p is not None and p.is_file() and os.access(p, os.X_OK) else None

    plain = next((p for p in map(exe, PLAIN_TARGETS) if p is not None), None)
    found = LlamaCpp(
        folder,
        str(info.get("version", "?")),
        plain,
        exe(LOOKUP_TARGET),
        exe(BENCH_TARGET),
        info,
        server=exe(SERVER_TARGET),
    )
    return found if found.plain is not None or found.lookup is not None else None


def cached_build(root: Path | None = None) -> LlamaCpp | None:
    """The newest complete build in the cache, if any (partial builds never get there)."""
    root = root or peers_root()
    builds = []
    for folder in root.glob("llama.cpp-*"):
        found = _from_folder(folder)
        if found is not None:
            builds.append((_version_key(found.version), found))
    return max(builds, key=lambda b: b[0])[1] if builds else None


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version))


def say_stderr(message: str) -> None:
    print(f"codespec: {message}", file=sys.stderr, flush=True)


def llama_cpp(
    root: Path | None = None,
    rebuild: bool = False,
    say: Callable[[str], None] = say_stderr,
    server: bool = False,
) -> LlamaCpp:
    """The cached llama.cpp build, built first when there is none (or ``rebuild``, or
    ``server`` is asked for and the cached build has no ``llama-server``).
    Raises :class:`PeerUnavailable` when it cannot be had."""
    root = root or peers_root()
    found = cached_build(root)
    if found is not None and server and found.server is None:
        rebuild = True
    if not rebuild and found is not None:
        return found
    if shutil.which("cmake") is None:
        raise PeerUnavailable("cmake is not installed")
    try:
        with file_lock(root):  # one build per cache: two benches started together build once
            if not rebuild and (found := cached_build(root)) is not None:
                return found  # another process built it while we waited
            return build(root, say)
    except OSError as exc:
        raise PeerUnavailable(f"cannot build in {root} ({one_line(exc)})") from None


# -- the build -------------------------------------------------------------------------

# x86 features named one by one (ggml option, /proc/cpuinfo flag)
FEATURES = (("AVX", "avx"), ("AVX2", "avx2"), ("FMA", "fma"), ("F16C", "f16c"),
            ("BMI2", "bmi2"), ("AVX512", "avx512f"), ("AVX512_VNNI", "avx512_vnni"),
            ("AVX512_BF16", "avx512_bf16"), ("AVX512_VBMI", "avx512vbmi"),
            ("AVX_VNNI", "avx_vnni"))  # fmt: skip
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON",
                 "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF")  # fmt: skip


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """ggml's x86 options for the features this CPU has. Not ``GGML_NATIVE``: on some VMs
    here the CPU advertises AMX that faults (SIGILL), so AMX stays off and every other
    feature is named explicitly."""
    have = cpu_gemm.cpu_flags() if cpuinfo is None else cpu_gemm.parse_flags(cpuinfo)
    flags = ["-DGGML_NATIVE=OFF", *(f"-DGGML_AMX_{x}=OFF" for x in ("TILE", "INT8", "BF16"))]
    if not have:  # not x86 Linux (or unreadable): ggml's portable defaults
        return flags
    return flags + [f"-DGGML_{opt}={'ON' if cpu in have else 'OFF'}" for opt, cpu in FEATURES]


def cmake_targets(src: Path) -> set[str]:
    """Executable targets the llama.cpp tree at ``src`` defines (``set(TARGET name)``)."""
    names: set[str] = set()
    for sub in ("examples", "tools"):
        for lists in (src / sub).rglob("CMakeLists.txt"):
            text = lists.read_text(encoding="utf-8", errors="replace")
            names.update(re.findall(r"set\(\s*TARGET\s+([\w.-]+)\s*\)", text))
    return names


def build(root: Path, say: Callable[[str], None] = say_stderr) -> LlamaCpp:
    """Download the sdist, build the peer's binaries in a temporary folder under ``root``
    and rename it into place when everything is there (a crash leaves nothing trusted)."""
    t0 = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".build-*"):  # a crashed build's leftovers (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        src = _fetch_source(tmp, say)
        version = src.parent.parent.name.rpartition("-")[2]  # <sdist>-<version>/vendor/...
        targets = cmake_targets(src)
        plain = next((t for t in PLAIN_TARGETS if t in targets), None)
        wanted = [
            t for t in (plain, LOOKUP_TARGET, BENCH_TARGET, SERVER_TARGET) if t and t in targets
        ]
        if plain is None and LOOKUP_TARGET not in wanted:
            raise PeerUnavailable(f"llama.cpp {version} has none of {PLAIN_TARGETS}")
        flags = cpu_flags()
        out = _cmake(src, tmp, version, flags, wanted, say)
        final = tmp / "final"
        (final / "bin").mkdir(parents=True)
        for name in wanted:
            exe = next((p for p in out.rglob(name) if p.is_file() and os.access(p, os.X_OK)), None)
            if exe is None:
                raise PeerUnavailable(f"the build made no {name}")
            shutil.copy2(exe, final / "bin" / name)
        seconds = time.perf_counter() - t0
        info = {"version": version, "sdist": f"{SDIST}=={version}", "targets": wanted,
                "cmake_flags": flags, "build_seconds": round(seconds, 1),
                "built": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
        (final / BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
        dest = root / f"llama.cpp-{version}"
        if dest.exists():  # a rebuild: the old one goes only once the new one is whole
            old = root / f".build-old-{os.getpid()}"
            dest.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        final.rename(dest)
        say(f"llama.cpp {version}: built in {seconds / 60:.1f} min into {dest}")
        found = _from_folder(dest)
        assert found is not None
        return found
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cmake(src: Path, tmp: Path, version: str, flags: list[str], targets: list[str],
           say: Callable[[str], None]) -> Path:  # fmt: skip
    """Configure and build ``targets`` under ``tmp/build``; the build folder."""
    out = tmp / "build"
    cmd = ["cmake", "-S", str(src), "-B", str(out), *CMAKE_OPTIONS, *flags]
    if shutil.which("ninja"):
        cmd[1:1] = ["-G", "Ninja"]
    say(f"llama.cpp {version}: configuring ({' '.join(f for f in flags if 'ON' in f)})")
    _run_logged(cmd, tmp / "configure.log", 900, "cmake configure")
    jobs = str(max(1, min(os.cpu_count() or 1, 16)))
    say(f"llama.cpp {version}: building {', '.join(targets)} with {jobs} jobs (minutes)")
    cmd = ["cmake", "--build", str(out), "--config", "Release", "-j", jobs, "--target", *targets]
    _run_logged(cmd, tmp / "build.log", 7200, "the build", progress=say)
    return out


def _fetch_source(tmp: Path, say: Callable[[str], None]) -> Path:
    """``pip download`` the sdist into ``tmp`` and unpack it; the vendored llama.cpp."""
    say(f"downloading the {SDIST} sdist with pip (it vendors llama.cpp)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", str(tmp / "dl"), SDIST]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.SubprocessError) as exc:
        raise PeerUnavailable(f"cannot run pip ({one_line(exc)})") from None
    sdists = sorted((tmp / "dl").glob("*.tar.gz")) if proc.returncode == 0 else []
    if not sdists:
        why = one_line(RuntimeError(proc.stderr)) if proc.stderr.strip() else "no sdist"
        raise PeerUnavailable(f"pip download {SDIST} failed ({why})")
    say(f"unpacking {sdists[0].name}")
    with tarfile.open(sdists[0]) as tar:
        tar.extractall(tmp / "src", filter="data")
    found = sorted((tmp / "src").glob("*/vendor/llama.cpp/CMakeLists.txt"))
    if not found:
        raise PeerUnavailable(f"{sdists[0].name} holds no vendor/llama.cpp")
    return found[0].parent


def _run_logged(cmd: list[str], log: Path, timeout: float, what: str,
                progress: Callable[[str], None] | None = None) -> None:  # fmt: skip
    """Run ``cmd`` with its output in ``log``; a progress line every 5% of the build's
    steps (``[n/N]`` from ninja, ``[ p%]`` from make). A failure raises
    :class:`PeerUnavailable` with the first error line of the log."""
    t0 = time.monotonic()
    last = -1
    try:
        with open(log, "w", encoding="utf-8") as fh:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
            )
            assert proc.stdout is not None
            for line in proc.stdout:
                fh.write(line)
                if time.monotonic() - t0 > timeout:
                    proc.kill()
                    proc.wait()
                    raise PeerUnavailable(f"{what} took over {timeout / 60:.0f} min")
                pct = _progress_pct(line)
                if progress is not None and pct is not None and pct // 5 > last // 5:
                    last = pct
                    progress(f"llama.cpp build {pct:3d}%  {time.monotonic() - t0:5.0f}s")
            rc = proc.wait()
    except OSError as exc:
        raise PeerUnavailable(f"{what} could not run ({one_line(exc)})") from None
    if rc != 0:
        text = log.read_text(encoding="utf-8", errors="replace")
        errors = [ln for ln in text.splitlines() if re.search(r"error|Error|ERROR", ln)]
        why = errors[0].strip() if errors else f"exit status {rc}"
        raise PeerUnavailable(f"{what} failed: {why[:200]}")


def _progress_pct(line: str) -> int | None:
    m = re.match(r"\[(\d+)/(\d+)\]", line)
    if m and int(m.group(2)):
        return int(100 * int(m.group(1)) / int(m.group(2)))
    m = re.match(r"\[\s*(\d+)%\]", line)
    return int(m.group(1)) if m else None


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[-1] if text else type(exc).__name__)[:200]
