"""``codespec bench peers``: llama.cpp beside codespec, same GGUF, same prompts, one run.

llama.cpp is built once from the ``llama-cpp-python`` sdist on PyPI (it vendors
llama.cpp under ``vendor/llama.cpp``) and its binaries cached under
``<state dir>/peers/llama.cpp-<version>/bin`` (``$CODESPEC_PEERS`` overrides the
``peers`` folder). It is an optional peer: when the download, cmake or the build
fails, one line says why (``llama.cpp peer skipped: ...``) and codespec's methods
still run.

Per prompt (the workloads' items laid out as ``codespec bench`` lays them out), in
turn, the order rotating per prompt so machine noise hits every method alike:

- ``llama.cpp``: plain greedy decoding (``llama-completion``, the prompt text through
  ``-f``, ``--temp 0 -n N -t T``);
- ``llama-lookup``: llama.cpp's n-gram lookup decoding (``--draft K``);
- codespec's methods (``--methods``, default ``off,ngram,auto``) through the engine.

By default every run generates exactly ``--max-tokens`` tokens: llama.cpp with
``--ignore-eos``, codespec with its stop tokens cleared (``--stop-at-eos`` lets both
stop). Decode tokens/s is measured alike for all: tokens after the first over the
time after the first (llama.cpp: its ``eval`` timing; llama-lookup: its ``decoded``
line less the first token; codespec: wall time less the time to the first token);
prefill tokens/s is prompt tokens over the prompt's time. ``llama-bench -p 0 -n 64
-d 0,1000`` adds llama.cpp's plain decode at depth 0 and 1,000.

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

SDIST = "llama-cpp-python"
PLAIN_TARGETS = ("llama-completion", "llama-cli")  # the plain decoder, newest name first
LOOKUP_TARGET = "llama-lookup"
BENCH_TARGET = "llama-bench"
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
        folder, str(info.get("version", "?")), plain, exe(LOOKUP_TARGET), exe(BENCH_TARGET), info
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


def _say(message: str) -> None:
    print(f"codespec: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One build at a time per cache (two benches started together build once)."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def llama_cpp(
    root: Path | None = None, rebuild: bool = False, say: Callable[[str], None] = _say
) -> LlamaCpp:
    """The cached llama.cpp build, built first when there is none (or ``rebuild``).
    Raises :class:`PeerUnavailable` when it cannot be had."""
    root = root or peers_root()
    if not rebuild and (found := cached_build(root)) is not None:
        return found
    if shutil.which("cmake") is None:
        raise PeerUnavailable("cmake is not installed")
    try:
        with _locked(root):
            if not rebuild and (found := cached_build(root)) is not None:
                return found  # another process built it while we waited
            return build(root, say)
    except OSError as exc:
        raise PeerUnavailable(f"cannot build in {root} ({_one_line(exc)})") from None


# -- the build -------------------------------------------------------------------------


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """ggml's x86 options for the features this CPU has. Not ``GGML_NATIVE``: on some VMs
    here the CPU advertises AMX that faults (SIGILL), so AMX stays off and every other
    feature is named explicitly."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    have = set(line.partition(":")[2].split())
    flags = [
        "-DGGML_NATIVE=OFF",
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
    ]
    if not have:  # not x86 Linux (or unreadable): ggml's portable defaults
        return flags
    for opt, feature in (
        ("AVX", "avx"),
        ("AVX2", "avx2"),
        ("FMA", "fma"),
        ("F16C", "f16c"),
        ("BMI2", "bmi2"),
        ("AVX512", "avx512f"),
        ("AVX512_VNNI", "avx512_vnni"),
        ("AVX512_BF16", "avx512_bf16"),
        ("AVX512_VBMI", "avx512vbmi"),
        ("AVX_VNNI", "avx_vnni"),
    ):
        flags.append(f"-DGGML_{opt}={'ON' if feature in have else 'OFF'}")
    return flags


def cmake_targets(src: Path) -> set[str]:
    """Executable targets the llama.cpp tree at ``src`` defines (``set(TARGET name)``)."""
    names: set[str] = set()
    for sub in ("examples", "tools"):
        for lists in (src / sub).rglob("CMakeLists.txt"):
            text = lists.read_text(encoding="utf-8", errors="replace")
            names.update(re.findall(r"set\(\s*TARGET\s+([\w.-]+)\s*\)", text))
    return names


def build(root: Path, say: Callable[[str], None] = _say) -> LlamaCpp:
    """Download the sdist, build the peer's binaries in a temporary folder under ``root``
    and rename it into place when everything is there (a crash leaves nothing trusted)."""
    t0 = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".build-*"):  # a crashed build's leftovers (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        src = _fetch_source(tmp, say)
        version = src.parent.parent.name.rpartition("-")[2]
        llama = src
        targets = cmake_targets(llama)
        plain = next((t for t in PLAIN_TARGETS if t in targets), None)
        wanted = [t for t in (plain, LOOKUP_TARGET, BENCH_TARGET) if t and t in targets]
        if plain is None and LOOKUP_TARGET not in wanted:
            raise PeerUnavailable(f"llama.cpp {version} has none of {PLAIN_TARGETS}")
        flags = cpu_flags()
        out = tmp / "build"
        cmd = [
            "cmake",
            "-S",
            str(llama),
            "-B",
            str(out),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_SERVER=OFF",
            "-DLLAMA_BUILD_APP=OFF",
            "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF",
            *flags,
        ]
        if shutil.which("ninja"):
            cmd[1:1] = ["-G", "Ninja"]
        say(f"llama.cpp {version}: configuring ({' '.join(f for f in flags if 'ON' in f)})")
        _run_logged(cmd, tmp / "configure.log", 900, "cmake configure")
        jobs = str(max(1, min(os.cpu_count() or 1, 16)))
        say(f"llama.cpp {version}: building {', '.join(wanted)} with {jobs} jobs (minutes)")
        cmd = ["cmake", "--build", str(out), "--config", "Release", "-j", jobs, "--target", *wanted]
        _run_logged(cmd, tmp / "build.log", 7200, "the build", progress=say)
        final = tmp / "final"
        (final / "bin").mkdir(parents=True)
        for name in wanted:
            exe = next((p for p in out.rglob(name) if p.is_file() and os.access(p, os.X_OK)), None)
            if exe is None:
                raise PeerUnavailable(f"the build made no {name}")
            shutil.copy2(exe, final / "bin" / name)
        seconds = time.perf_counter() - t0
        info = {
            "version": version,
            "sdist": f"{SDIST}=={version}",
            "targets": wanted,
            "cmake_flags": flags,
            "build_seconds": round(seconds, 1),
            "built": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
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


def _fetch_source(tmp: Path, say: Callable[[str], None]) -> Path:
    """``pip download`` the sdist into ``tmp`` and unpack it; the vendored llama.cpp."""
    say(f"downloading the {SDIST} sdist with pip (it vendors llama.cpp)")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(tmp / "dl"),
        SDIST,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.SubprocessError) as exc:
        raise PeerUnavailable(f"cannot run pip ({_one_line(exc)})") from None
    sdists = sorted((tmp / "dl").glob("*.tar.gz")) if proc.returncode == 0 else []
    if not sdists:
        why = _one_line(RuntimeError(proc.stderr)) if proc.stderr.strip() else "no sdist"
        raise PeerUnavailable(f"pip download {SDIST} failed ({why})")
    say(f"unpacking {sdists[0].name}")
    with tarfile.open(sdists[0]) as tar:
        tar.extractall(tmp / "src", filter="data")
    found = sorted((tmp / "src").glob("*/vendor/llama.cpp/CMakeLists.txt"))
    if not found:
        raise PeerUnavailable(f"{sdists[0].name} holds no vendor/llama.cpp")
    return found[0].parent


def _run_logged(
    cmd: list[str],
    log: Path,
    timeout: float,
    what: str,
    progress: Callable[[str], None] | None = None,
) -> None:
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
        raise PeerUnavailable(f"{what} could not run ({_one_line(exc)})") from None
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


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[-1] if text else type(exc).__name__)[:200]


# -- reading llama.cpp's output ----------------------------------------------------------


def parse_perf(text: str) -> dict[str, float]:
    """libllama's context timings (``llama_perf_context_print``): the prompt's
    ``prompt_ms`` / ``prompt_tokens`` and the decode's ``eval_ms`` / ``eval_runs``; {}
    when the output has none."""
    out: dict[str, float] = {}
    m = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", text)
    if m:
        out["prompt_ms"], out["prompt_tokens"] = float(m.group(1)), int(m.group(2))
    m = re.search(r"(?<!prompt )\beval time =\s*([\d.]+) ms /\s*(\d+) runs", text)
    if m:
        out["eval_ms"], out["eval_runs"] = float(m.group(1)), int(m.group(2))
    return out


def parse_lookup(text: str) -> dict[str, float]:
    """llama-lookup's summary: ``encoded`` (prompt tokens, seconds), ``decoded``
    (generated tokens, seconds) and its draft counts (``n_draft``, ``n_predict``,
    ``n_drafted``, ``n_accept``); {} when the output has none."""
    out: dict[str, float] = {}
    for key in ("encoded", "decoded"):
        m = re.search(rf"{key}\s+(\d+) tokens in\s+([\d.]+) seconds", text)
        if m:
            out[f"{key}_tokens"], out[f"{key}_s"] = int(m.group(1)), float(m.group(2))
    for key in ("n_draft", "n_predict", "n_drafted", "n_accept"):
        m = re.search(rf"\b{key}\s*=\s*(\d+)", text)
        if m:
            out[key] = int(m.group(1))
    return out


def parse_llama_bench(text: str) -> list[dict[str, Any]]:
    """llama-bench's ``-o json`` records: depth, generated tokens, mean and spread of
    tokens/s (the first JSON array in ``text``)."""
    start = text.find("[")
    if start < 0:
        return []
    try:
        records = json.JSONDecoder().raw_decode(text[start:])[0]
    except ValueError:
        return []
    out = []
    for r in records if isinstance(records, list) else []:
        if not isinstance(r, dict) or "avg_ts" not in r:
            continue
        out.append(
            {
                "depth": int(r.get("n_depth", 0)),
                "prompt": int(r.get("n_prompt", 0)),
                "gen": int(r.get("n_gen", 0)),
                "tokens_per_s": float(r["avg_ts"]),
                "stddev": float(r.get("stddev_ts", 0.0)),
            }
        )
    return out


# -- one run of each method ----------------------------------------------------------------


@dataclass
class Timed:
    """One method on one prompt: tokens after the first over the time after the first
    (decode), prompt tokens over the prompt's time (prefill)."""

    decode_tokens: int
    decode_s: float
    prompt_tokens: int
    prefill_s: float
    tokens: int  # generated in all
    text: str = ""  # what it generated
    ids: list[int] | None = None  # codespec's generated ids
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0


class LlamaFailed(Exception):
    """A llama.cpp binary ran but gave no timings (a crash, a refused flag)."""


def _run_binary(cmd: list[str], timeout: float) -> tuple[str, str]:
    """(stdout, stderr) of a llama.cpp binary that exited well."""
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise LlamaFailed(f"{Path(cmd[0]).name} took over {timeout:.0f}s") from None
    except OSError as exc:
        raise LlamaFailed(f"{Path(cmd[0]).name} could not run ({_one_line(exc)})") from None
    if proc.returncode != 0:
        why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:]
        raise LlamaFailed(f"{Path(cmd[0]).name} failed ({why}{': ' + tail[0] if tail else ''})")
    return proc.stdout, proc.stderr


def _common_flags(args: argparse.Namespace, gguf: Path, prompt_file: Path) -> list[str]:
    flags = [
        "-m",
        str(gguf),
        "-f",
        str(prompt_file),
        "-n",
        str(args.max_tokens),
        "--temp",
        "0",
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "-c",
        str(args.ctx),
        "--no-escape",  # the prompt as it is (llama.cpp turns \" into " by default)
    ]
    if not args.stop_at_eos:
        flags.append("--ignore-eos")
    return flags


def run_llama_plain(llama: LlamaCpp, args, gguf: Path, prompt_file: Path, prompt: str) -> Timed:
    assert llama.plain is not None
    cmd = [
        str(llama.plain),
        *_common_flags(args, gguf, prompt_file),
        "-no-cnv",
        "--no-display-prompt",
    ]
    stdout, stderr = _run_binary(cmd, args.timeout)
    perf = parse_perf(stdout + "\n" + stderr)
    if "eval_ms" not in perf or "prompt_ms" not in perf:
        raise LlamaFailed(f"{llama.plain.name} printed no timings")
    runs = int(perf["eval_runs"])
    return Timed(
        runs,
        max(1e-9, perf["eval_ms"] / 1000),
        int(perf["prompt_tokens"]),
        max(1e-9, perf["prompt_ms"] / 1000),
        runs + 1,
        _generated(stdout),
    )


def run_llama_lookup(llama: LlamaCpp, args, gguf: Path, prompt_file: Path, prompt: str) -> Timed:
    assert llama.lookup is not None
    cmd = [
        str(llama.lookup),
        *_common_flags(args, gguf, prompt_file),
        llama.draft_flag(),
        str(args.draft),
    ]
    stdout, stderr = _run_binary(cmd, args.timeout)
    lk = parse_lookup(stdout + "\n" + stderr)
    if "decoded_s" not in lk or "encoded_s" not in lk:
        raise LlamaFailed(f"{llama.lookup.name} printed no timings")
    n = int(lk["decoded_tokens"])
    return Timed(
        max(0, n - 1),
        max(1e-9, lk["decoded_s"]),
        int(lk["encoded_tokens"]),
        max(1e-9, lk["encoded_s"]),
        n,
        _generated(stdout, prompt),
        drafted=int(lk.get("n_drafted", 0)),
        accepted=int(lk.get("n_accept", 0)),
    )


def _generated(stdout: str, prompt: str = "") -> str:
    """The generated text in a llama.cpp binary's stdout: after the echoed prompt when it
    echoes one, without the blank lines it frames it with."""
    text = stdout
    if prompt:
        at = text.find(prompt)
        if at >= 0:
            text = text[at + len(prompt) :]
    return text.removesuffix("\n\n")


def run_codespec(engine, method: str, n: int, ctx: dict[str, Any], args) -> Timed:
    from codespec.daemon.bench.methods import run_engine

    item = ctx["items"][n]
    prompt, max_tokens, draft_ids, heal = ctx["prompts"][n]
    index = ctx["indexes"][ctx["which"][n]]
    if index is not None and item.get("uri") in index:
        index.touch(item["uri"])
    name, _, cap = method.partition("@")
    r = run_engine(
        engine,
        name,
        prompt,
        max_tokens,
        index,
        item.get("uri"),
        draft_ids,
        int(cap) if cap else args.max_draft,
        0.0,
        0,
        heal,
    )
    return Timed(
        max(0, r.tokens - 1),
        max(1e-9, (r.ms - r.first_ms) / 1000),
        len(prompt),
        max(1e-9, r.first_ms / 1000),
        r.tokens,
        engine.decode(r.ids),
        list(r.ids),
        r.forwards,
    )


# -- the bench -----------------------------------------------------------------------------

LLAMA_PLAIN = "llama.cpp"
LLAMA_LOOKUP = "llama-lookup"


@dataclass
class Sum:
    prompts: int = 0
    tokens: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    equal: int = 0  # codespec: ids equal to off's; llama-lookup: text equal to llama.cpp's
    compared: int = 0
    agree_tokens: int = 0  # llama.cpp: leading tokens of its text that equal codespec off's

    def add(self, t: Timed) -> None:
        self.prompts += 1
        self.tokens += t.tokens
        self.decode_tokens += t.decode_tokens
        self.decode_s += t.decode_s
        self.prompt_tokens += t.prompt_tokens
        self.prefill_s += t.prefill_s
        self.forwards += t.forwards
        self.drafted += t.drafted
        self.accepted += t.accepted

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0


def build_parser() -> argparse.ArgumentParser:
    from codespec.daemon.bench.methods import add_engine_args

    p = argparse.ArgumentParser(prog="codespec bench peers", description=__doc__.splitlines()[0])
    p.add_argument(
        "workload",
        nargs="*",
        default=["/tmp/wl/edit.jsonl"],
        help="JSONL workloads (default /tmp/wl/edit.jsonl; see make-workloads)",
    )
    p.add_argument("--methods", default="off,ngram,auto", help="codespec's methods (NAME@K)")
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    add_engine_args(p, threads=2)
    p.set_defaults(max_tokens=200)
    p.add_argument("--draft", type=int, default=10, help="llama-lookup's draft length")
    p.add_argument("--max-draft", type=int, default=16, help="codespec's draft tokens per forward")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens at most")
    p.add_argument("--ctx", type=int, default=4096, help="llama.cpp's context size (-c)")
    p.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="let every method stop at its end-of-text tokens (default: all "
        "generate --max-tokens tokens)",
    )
    p.add_argument("--no-llama", action="store_true", help="codespec's methods only")
    p.add_argument("--rebuild", action="store_true", help="build llama.cpp again")
    p.add_argument("--bench-depths", default="0,1000", help="llama-bench's -d ('' skips it)")
    p.add_argument("--bench-gen", type=int, default=64, help="llama-bench's -n")
    p.add_argument("--timeout", type=float, default=600, help="seconds per llama.cpp run")
    return p


def model_gguf(model: str | None) -> Path | None:
    """The GGUF file behind ``--model`` (a cached model made from one, or a ``.gguf``)."""
    from codespec.daemon.engine import models

    folder = models.resolve(model)
    manifest = models.read_manifest(Path(folder))
    return models.CachedModel(Path(folder), manifest).gguf if manifest else None


def skip_line(why: str) -> str:
    return f"llama.cpp peer skipped: {why}"


def main(argv: list[str] | None = None) -> int:
    from codespec.daemon.bench.methods import _build_index, build_prompt, load_workload, open_engine
    from codespec.speculators.registry import names

    args = build_parser().parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m.partition("@")[0] not in names()]
    if bad:
        print(f"codespec bench peers: unknown methods {bad}", file=sys.stderr)
        return 2
    if "off" not in methods:
        methods.insert(0, "off")
    try:
        loaded = [load_workload(path) for path in args.workload]
    except (OSError, ValueError) as exc:
        print(f"codespec bench peers: {_one_line(exc)}", file=sys.stderr)
        return 2
    items = [item for wl in loaded for item in wl]
    which = [w for w, wl in enumerate(loaded) for _ in wl]
    if args.limit:
        items, which = items[: args.limit], which[: args.limit]

    skipped = ""
    llama: LlamaCpp | None = None
    gguf: Path | None = None
    if args.no_llama:
        skipped = "--no-llama"
    else:
        gguf = model_gguf(args.model)
        if gguf is None:
            skipped = "the model has no GGUF file"
        else:
            try:
                llama = llama_cpp(rebuild=args.rebuild)
            except PeerUnavailable as exc:
                skipped = str(exc)
    if skipped:  # now on stderr (the bench runs for minutes), in the table at the end
        print(skip_line(skipped), file=sys.stderr, flush=True)

    engine = open_engine(args)
    stop_ids = engine.stop_ids
    if not args.stop_at_eos:
        engine.stop_ids = set()  # every method generates exactly --max-tokens tokens
    ctx = {
        "items": items,
        "which": which,
        "indexes": [_build_index(engine, wl) for wl in loaded],
        "prompts": [
            build_prompt(engine, it, args.max_tokens, "none", args.context) for it in items
        ],
    }
    runners: dict[str, Callable[[int], Timed]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="codespec-peers-"))
    texts = [engine.decode(p[0]) for p in ctx["prompts"]]
    files = []
    for n, text in enumerate(texts):
        files.append(tmp / f"prompt-{n}.txt")
        files[-1].write_text(text + "\n", encoding="utf-8")  # -f drops one final newline
    if llama is not None and gguf is not None:
        if llama.plain is not None:
            runners[LLAMA_PLAIN] = lambda n: run_llama_plain(llama, args, gguf, files[n], texts[n])
        if llama.lookup is not None:
            runners[LLAMA_LOOKUP] = lambda n: run_llama_lookup(
                llama, args, gguf, files[n], texts[n]
            )
    for m in methods:
        runners[m] = lambda n, m=m: run_codespec(engine, m, n, ctx, args)

    failed: dict[str, str] = {}

    def one(name: str, n: int) -> Timed | None:
        if name in failed:
            return None
        try:
            return runners[name](n)
        except LlamaFailed as exc:
            failed[name] = str(exc)
            print(skip_line(str(exc)), file=sys.stderr, flush=True)
            return None

    try:
        order = list(runners)
        for name in order:  # warm-up: the first prompt, every method, not timed
            one(name, 0)
        sums = {name: Sum() for name in order}
        for n, item in enumerate(items):
            turn = order[n % len(order) :] + order[: n % len(order)]
            runs = {name: r for name in turn if (r := one(name, n)) is not None}
            off = runs["off"]
            for name, r in runs.items():
                s = sums[name]
                s.add(r)
                if name in methods:
                    s.compared += 1
                    s.equal += int(r.ids == off.ids)
                elif name == LLAMA_LOOKUP and LLAMA_PLAIN in runs:
                    s.compared += 1
                    s.equal += int(r.text[: len(runs[LLAMA_PLAIN].text)] == runs[LLAMA_PLAIN].text)
                if name in (LLAMA_PLAIN, LLAMA_LOOKUP):
                    s.agree_tokens += _agree(engine, r.text, off.ids or [])
            print(
                f"  [{n + 1}/{len(items)}] {item.get('id', n)}: "
                + "  ".join(
                    f"{k} {r.decode_tokens / r.decode_s:.0f} tok/s" for k, r in runs.items()
                ),
                file=sys.stderr,
                flush=True,
            )
        bench = []
        if llama is not None and gguf is not None and llama.bench and args.bench_depths:
            bench = run_llama_bench(llama, args, gguf)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        engine.stop_ids = stop_ids
    for name, why in failed.items():
        sums.pop(name, None)
        skipped = skipped or why
    print_table(sums, methods, engine, args, llama, bench, skipped, len(items))
    return 0


def _agree(engine, text: str, off_ids: list[int]) -> int:
    """Leading tokens of ``text`` (llama.cpp's output, tokenized by codespec) equal to
    codespec off's output."""
    ids = engine.encode(text)
    n = 0
    for a, b in zip(ids, off_ids, strict=False):
        if a != b:
            break
        n += 1
    return n


def run_llama_bench(llama: LlamaCpp, args, gguf: Path) -> list[dict[str, Any]]:
    assert llama.bench is not None
    cmd = [
        str(llama.bench),
        "-m",
        str(gguf),
        "-p",
        "0",
        "-n",
        str(args.bench_gen),
        "-d",
        args.bench_depths,
        "-t",
        str(args.threads),
        "-o",
        "json",
    ]
    _say(" ".join(["llama-bench", *cmd[1:]]))
    try:
        stdout, _ = _run_binary(cmd, args.timeout)
    except LlamaFailed as exc:
        print(f"llama-bench skipped: {exc}", flush=True)
        return []
    return parse_llama_bench(stdout)


def print_table(
    sums: dict[str, Sum],
    methods: list[str],
    engine,
    args: argparse.Namespace,
    llama: LlamaCpp | None,
    bench: list[dict[str, Any]],
    skipped: str,
    prompts: int,
) -> None:
    plain = sums.get(LLAMA_PLAIN)
    lookup = sums.get(LLAMA_LOOKUP)
    version = f"llama.cpp from {SDIST} {llama.version}" if llama else "no llama.cpp"
    print(
        f"codespec bench peers {' '.join(args.workload)}  ({prompts} prompts, "
        f"{args.max_tokens} tokens{'' if args.stop_at_eos else ' each'}, greedy, "
        f"{args.threads} threads, {date.today()}, {platform.machine()}, "
        f"{engine.runner.name} runner, model {engine.model_name}, {version})"
    )
    head = f"{'method':<14}{'tokens':>7}{'decode tok/s':>14}{'prefill tok/s':>15}"
    head += f"{'vs llama.cpp':>14}{'vs lookup':>11}{'tok/fwd':>9}{'accept':>9}{'= off':>8}"
    print(head)
    print("-" * len(head))
    rows = []
    for name, s in sums.items():
        if not s.prompts:
            continue
        vs_plain = s.decode_tps / plain.decode_tps if plain and plain.decode_tps else None
        vs_lookup = s.decode_tps / lookup.decode_tps if lookup and lookup.decode_tps else None
        tpf = s.tokens / s.forwards if s.forwards else None
        accept = s.accepted / s.drafted if s.drafted else None
        if name in methods:
            equal = f"{s.equal}/{s.compared}"
        elif name == LLAMA_LOOKUP and s.compared:
            equal = f"({s.equal}/{s.compared})"  # vs llama.cpp plain's text
        else:
            equal = "-"

        def cell(x: float | None, width: int, fmt: str, unit: str = "") -> str:
            return f"{'-' if x is None else format(x, fmt) + unit:>{width}}"

        print(
            f"{name:<14}{s.tokens:>7}{s.decode_tps:>14.1f}{s.prefill_tps:>15.0f}"
            f"{cell(vs_plain, 14, '.2f', 'x')}{cell(vs_lookup, 11, '.2f', 'x')}"
            f"{cell(tpf, 9, '.2f')}{cell(accept, 9, '.0%')}{equal:>8}"
        )
        row: dict[str, Any] = {
            "method": name,
            "tool": "codespec" if name in methods else "llama.cpp",
            "prompts": s.prompts,
            "tokens": s.tokens,
            "decode_tokens_per_s": round(s.decode_tps, 2),
            "prefill_tokens_per_s": round(s.prefill_tps, 1),
            "decode_vs_llama_cpp": round(vs_plain, 3) if vs_plain else None,
            "decode_vs_llama_lookup": round(vs_lookup, 3) if vs_lookup else None,
            "prompt_tokens": s.prompt_tokens,
        }
        if name in methods:
            row["target_forwards"] = s.forwards
            row["equal_to_off"] = s.equal
        else:
            row["agree_with_off_tokens"] = round(s.agree_tokens / s.prompts, 1)
        if name == LLAMA_LOOKUP:
            row.update(drafted=s.drafted, accepted=s.accepted, equal_to_llama_cpp=s.equal)
        rows.append(row)
    if plain or lookup:
        agree = "  ".join(
            f"{k} {sums[k].agree_tokens / sums[k].prompts:.0f}"
            for k in (LLAMA_PLAIN, LLAMA_LOOKUP)
            if k in sums and sums[k].prompts
        )
        print(f"leading tokens equal to codespec off's output (mean per prompt): {agree}")
        print("(= off for llama-lookup: prompts whose text equals llama.cpp plain's)")
    for b in bench:
        print(
            f"llama-bench decode depth {b['depth']:>5}: {b['tokens_per_s']:.1f} ± "
            f"{b['stddev']:.1f} tok/s ({b['gen']} tokens)"
        )
    if skipped:
        print(skip_line(skipped))
    print(
        json.dumps(
            {
                "bench": "peers",
                "workload": ",".join(Path(w).name for w in args.workload),
                "prompts": prompts,
                "max_tokens": args.max_tokens,
                "ignore_eos": not args.stop_at_eos,
                "threads": args.threads,
                "date": str(date.today()),
                "machine": platform.machine(),
                "runner": engine.runner.name,
                "llama_cpp": (
                    {
                        "version": llama.version,
                        "build_seconds": llama.info.get("build_seconds"),
                        "cmake_flags": llama.info.get("cmake_flags"),
                        "draft": args.draft,
                    }
                    if llama
                    else None
                ),
                "skipped": skipped or None,
                "llama_bench": bench,
                "rows": rows,
            }
        )
    )
