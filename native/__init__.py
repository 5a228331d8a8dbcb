"""``codespec.native``: building and loading codespec's C++ libraries (the engine's CPU
kernels, :mod:`codespec.daemon.engine.cpu_gemm` and
:mod:`codespec.daemon.engine.quant_gemm`; the n-gram index's lookup,
:mod:`codespec.ngram_index.native`): compiled once per machine with the system C++
compiler, loaded with ``ctypes``, or a one-line reason why not. A package of its own so
that the index, which must not import the daemon, builds its lookup the same way.

Owns: codespec's state directory (:func:`state_dir`: the daemon's saved index, models,
peers and these builds live under it; here because the index may not import the daemon's
config), where builds live (:func:`kernel_dir`; one file per library, named by a hash of its
sources and flags, so an edited source is built anew and an old build is never loaded),
finding a compiler, the build (written whole or not at all: concurrent builders both end
with a whole file; one stderr line as it starts and one as it ends, none for a cached build)
and the lazy, thread-safe first load. What a library declares (its
functions' ctypes signatures) and when it should not be built at all are its module's.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def compiler() -> str | None:
    """``$CXX``, else the first of g++, c++, clang++ on the PATH; None when there is none."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None


def state_dir() -> Path:
    """``$XDG_CACHE_HOME/codespec``, by default ``~/.cache/codespec``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "codespec"


def kernel_dir() -> Path:
    """``$CODESPEC_KERNEL_DIR``, else ``kernels`` in the daemon's state dir
    (``$XDG_CACHE_HOME/codespec``, by default ``~/.cache/codespec``)."""
    env = os.environ.get("CODESPEC_KERNEL_DIR")
    if env:
        return Path(env)
    return state_dir() / "kernels"


def _compile(commands: list[list[str]], deadline: float) -> None:
    """Run the compiler ``commands`` at once and wait for all of them; RuntimeError with
    the first failure's last stderr, ``subprocess.TimeoutExpired`` past ``deadline``
    (``time.monotonic``; every one still running is killed)."""
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for c in commands]  # fmt: skip
    try:
        errors = [p.communicate(timeout=max(0.0, deadline - time.monotonic()))[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for c, p, err in zip(commands, procs, errors, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"{c[0]} failed: {err.strip()[-400:]}")


class NativeLibrary:
    """One C++ library: ``sources`` (plus ``headers`` they include) compiled with ``flags``
    into ``<kernel_dir>/<stem>-<hash>.so`` on first use.

    ``precheck()`` may give a reason not to build here at all (a switch, the wrong CPU);
    ``declare(lib)`` sets the loaded library's signatures.
    """

    def __init__(
        self,
        stem: str,
        sources: Sequence[Path],
        flags: Sequence[str],
        declare: Callable[[ctypes.CDLL], None],
        *,
        headers: Sequence[Path] = (),
        timeout: float = 120,
        precheck: Callable[[], str | None] = lambda: None,
        label: str = "the kernel",
    ) -> None:
        self.label = label  # what an error calls it ("the CPU kernel")
        self.stem, self.sources, self.headers = stem, tuple(sources), tuple(headers)
        self.flags, self.declare, self.timeout, self.precheck = (
            list(flags),
            declare,
            timeout,
            precheck,
        )
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._reason: str | None = None
        self._loaded = False

    def target(self, out_dir: Path) -> Path:
        """Where the build of these sources with these flags lives (one file per version)."""
        text = b"".join(p.read_bytes() for p in (*self.sources, *self.headers))
        key = hashlib.sha256(text + " ".join(self.flags).encode()).hexdigest()[:16]
        return out_dir / f"{self.stem}-{key}.so"

    def build(self, cxx: str, target: Path) -> None:
        """Compile the library to ``target`` (written whole or not at all). Several
        sources compile at once, each to an object of its own, then link: one compiler
        process uses one core, and the quantized kernel's sources (then two) took 110 s
        in one on a 2-core VM."""
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        objects = [f"{tmp}.{i}.o" for i in range(len(self.sources))]
        deadline = time.monotonic() + self.timeout
        try:
            if len(self.sources) == 1:
                _compile([[cxx, *self.flags, str(self.sources[0]), "-o", tmp]], deadline)
            else:
                pairs = zip(self.sources, objects, strict=True)
                _compile([[cxx, *self.flags, "-c", str(s), "-o", o] for s, o in pairs], deadline)
                _compile([[cxx, *self.flags, *objects, "-o", tmp]], deadline)
            os.replace(tmp, target)  # atomic: concurrent builders both end with a whole file
        finally:
            for path in (tmp, *objects):
                if os.path.exists(path):
                    os.unlink(path)

    def _load(self) -> str | None:
        """Build if needed and load; the reason it cannot be used, or None."""
        reason = self.precheck()
        if reason:
            return reason
        target = self.target(kernel_dir())
        try:
            if not target.exists():
                cxx = compiler()
                if cxx is None:
                    return "no C++ compiler to build it with (g++, c++ or clang++; or set CXX)"
                self._build_telling(cxx, target)
            lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            return f"building or loading the kernel failed: {e}"
        self.declare(lib)
        self._lib = lib
        return None

    def _build_telling(self, cxx: str, target: Path) -> None:
        """:meth:`build`, with one line on stderr as it starts and one as it ends: the
        first use on a machine compiles for a while (a cached build loads silently)."""
        print(
            f"codespec: compiling {self.label} ({target.name}) with {cxx}, once per machine...",
            file=sys.stderr,
            flush=True,
        )
        t0 = time.monotonic()
        outcome = "failed"
        try:
            self.build(cxx, target)
            outcome = "done"
        finally:
            took = time.monotonic() - t0
            print(f"codespec: compiling {self.label}: {outcome} in {took:.1f} s", file=sys.stderr)

    def library(self) -> ctypes.CDLL | None:
        """The loaded library, built on first use; ``None`` when it cannot be used."""
        if not self._loaded:
            with self._lock:
                if not self._loaded:
                    self._reason = self._load()
                    self._loaded = True
        return self._lib

    def unavailable_reason(self) -> str | None:
        """Why :meth:`library` is ``None`` (``None`` when the library is loaded)."""
        self.library()
        return self._reason

    def required(self) -> ctypes.CDLL:
        """The loaded library; RuntimeError saying why when it cannot be used."""
        lib = self.library()
        if lib is None:
            raise RuntimeError(f"{self.label} is unavailable: {self._reason}")
        return lib
