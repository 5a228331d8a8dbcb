"""A daemon served for a benchmark: ``codespec serve`` started as a subprocess with a fresh
state folder (the cached model and kernels, nothing fetched or compiled again), its memory
read from /proc, and the percentiles the benches report.

Owns nothing of the daemon: it only starts the process and waits for its socket. Must not
touch the daemon's insides (requests go through :class:`codespec.daemon.client.Client`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from codespec.daemon.client import Client
from codespec.daemon.engine.models import models_root
from codespec.native import kernel_dir


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return 0.0
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


def start_daemon(threads: int, extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    tmp = tempfile.mkdtemp(prefix="codespec-bench-")
    sock = os.path.join(tmp, "d.sock")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), XDG_CACHE_HOME=tmp, CODESPEC_SOCKET=sock)
    env.setdefault("CODESPEC_MODELS", str(models_root()))  # the cached model, not a new fetch
    # the kernels built here, not compiled again into the fresh state dir (a first lookup
    # compiling the index's library would slow the first completion)
    env.setdefault("CODESPEC_KERNEL_DIR", str(kernel_dir()))
    proc = subprocess.Popen(
        [sys.executable, "-m", "codespec.daemon.cli", "serve", "--socket", sock, *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        if proc.poll() is not None:
            raise SystemExit(f"codespec serve exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            Client(sock, timeout=1).close()
            return proc, sock, tmp
        except Exception:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("codespec serve did not come up")


def daemon_memory(pid: int) -> dict[str, float]:
    """A process's resident memory now and at its peak (``VmRSS``, ``VmHWM``), MiB; {} where
    /proc cannot tell."""
    out = {}
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out["rss_mib" if key == "VmRSS" else "peak_mib"] = round(int(rest.split()[0]) / 1024, 1)
    return out
