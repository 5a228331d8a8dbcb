"""`codespec serve` as a real process: stale socket replaced, a second serve refused,
SIGTERM removes the socket and saves the index; `status` and `complete` talk to it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from codespec.daemon.client import Client
from codespec.daemon.engine.lean_config import attention_for, gguf_products
from codespec.speculators.heads import HEADS_DIR

# `serve` loads the default model: fetched (once) before a daemon starts; the daemons find it
# through CODESPEC_MODELS (conftest), whatever XDG_CACHE_HOME they get
pytestmark = pytest.mark.usefixtures("default_model_dir")


def env_for(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        XDG_CACHE_HOME=str(tmp / "cache"),
        XDG_CONFIG_HOME=str(tmp / "config"),
        CODESPEC_SOCKET=str(tmp / "run" / "d.sock"),
    )
    return env


def cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "codespec.daemon.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_for_daemon(path: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            Client(path, timeout=1).close()
            return
        except Exception:
            time.sleep(0.1)
    raise AssertionError("the daemon did not come up")


def test_serve_lifecycle(tmp_path):
    env = env_for(tmp_path)
    (tmp_path / "config" / "codespec").mkdir(parents=True)
    (tmp_path / "config" / "codespec" / "config.toml").write_text("[limits]\nkv_slots = 2\n")
    sock_path = env["CODESPEC_SOCKET"]
    # A stale socket file: bound, never unlinked, nobody listening.
    os.makedirs(os.path.dirname(sock_path), mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock_path)
    stale.close()
    assert os.path.exists(sock_path)

    proc = subprocess.Popen(
        [sys.executable, "-m", "codespec.daemon.cli", "serve", "--device", "cpu"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_daemon(sock_path, proc)
        assert os.stat(sock_path).st_mode & 0o777 == 0o600
        assert os.stat(os.path.dirname(sock_path)).st_mode & 0o777 == 0o700

        second = cli(env, "serve", "--device", "cpu", timeout=60)
        assert second.returncode == 1
        assert second.stderr.count("\n") == 1 and "already serving" in second.stderr

        src = tmp_path / "mod.py"
        src.write_text("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return \n")
        done = cli(env, "complete", "--file", str(src), "--line", "5", "--character", "11",
                   "--max-tokens", "3", "--json")  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stderr.strip().splitlines()[-1])["tokens"] <= 3
        with Client(sock_path) as c:  # keep one document indexed for the save
            c.request("open", {"uri": "file:///kept.py", "text": "x = 1\n"})
            status = cli(env, "status", "--json", timeout=60)
            assert status.returncode == 0, status.stderr
            s = json.loads(status.stdout)
            assert s["model"] == "SmolLM2-135M-Instruct" and s["documents"] == 1
            assert s["kv_slots"] == 2  # the config file's limits.kv_slots reached the engine
            shipped = f"weights in {HEADS_DIR / 'smollm2-135m-instruct'}"  # loaded with it
            assert s["policy"]["weights"]["eagle"] == shipped
            if s["runner"] == "lean":  # the default model runs from its GGUF's own blocks
                int8 = gguf_products() == "int8"
                products = "int8 activations" if int8 else "exact"
                kernel = f"qgemm, GGUF blocks Q4_1/Q8_0, {products} products"
                assert s["cpu_kernel"] == f"{kernel}, {attention_for(int8)} attention"
            text = cli(env, "status", timeout=60)
            assert f"weights    eagle: {shipped}" in text.stdout, text.stdout
            assert s["requests"]["served"] >= 1

            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
        assert not os.path.exists(sock_path)
        index = tmp_path / "cache" / "codespec" / "index.msgpack"
        assert index.exists() and index.stat().st_size > 0
        out, err = proc.communicate(timeout=10)
        log = out + err
        assert log.count("serving on") == 1, log  # said once, by the log
        assert f"codespec: serving on {sock_path}" in err
        assert f"codespec: stopped; {sock_path} removed, index saved to {index}" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_client_commands_without_daemon(tmp_path):
    env = env_for(tmp_path)
    r = cli(env, "status", timeout=60)
    assert r.returncode == 1 and "codespec serve" in r.stderr and "Traceback" not in r.stderr


def test_stop_ends_the_daemon_and_status_shows_its_pid(tmp_path, tiny_model):
    env = env_for(tmp_path)
    sock_path = env["CODESPEC_SOCKET"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "codespec.daemon.cli", "serve", "--model", str(tiny_model)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_daemon(sock_path, proc)
        status = cli(env, "status", "--json", timeout=60)
        assert json.loads(status.stdout)["pid"] == proc.pid
        assert f"pid        {proc.pid}" in cli(env, "status", timeout=60).stdout
        stop = cli(env, "stop", timeout=60)
        assert stop.returncode == 0, stop.stderr
        assert f"stopped the daemon (pid {proc.pid}) on {sock_path}" in stop.stdout
        assert proc.poll() is not None  # gone before `stop` returned (reaped now)
        assert proc.returncode == 0 and not os.path.exists(sock_path)
        again = cli(env, "stop", timeout=60)
        assert again.returncode == 0 and f"no daemon is running on {sock_path}" in again.stdout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_socket_and_the_help_follow_xdg_cache_home(tmp_path):
    env = {k: v for k, v in env_for(tmp_path).items() if k not in ("CODESPEC_SOCKET",
                                                                   "XDG_RUNTIME_DIR")}  # fmt: skip
    env["COLUMNS"] = "1000"  # argparse wraps long paths at their hyphens otherwise
    cache = tmp_path / "cache" / "codespec"
    assert f"(default: {cache})" in " ".join(cli(env, "model", "--help").stdout.split())
    assert f"default here: {cache / 'daemon.sock'}" in " ".join(
        cli(env, "status", "--help").stdout.split()
    )
    r = cli(env, "status")
    assert r.returncode == 1 and f"no codespec daemon on {cache / 'daemon.sock'}" in r.stderr


def test_client_errors_import_no_torch(tmp_path):
    """`status` and `complete` are clients: their errors cost no torch import (~1 s)."""
    env = env_for(tmp_path)
    src = tmp_path / "a.py"
    src.write_text("x = 1\n")
    script = (
        "import sys\n"
        "from codespec.daemon.cli import main\n"
        f"assert main(['status']) == 1\n"
        f"assert main(['complete', '--file', {str(src)!r}, '--line', '0', '--character', '1'])"
        " == 1\n"
        f"assert main(['complete', '--file', {str(tmp_path / 'none.py')!r}, '--line', '0',"
        " '--character', '0']) == 1\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
    assert r.stderr.count("codespec: error:") == 3 and "Traceback" not in r.stderr


def test_bad_config_is_one_line(tmp_path):
    env = env_for(tmp_path)
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[limits]\nmax_queue = 'many'\n")
    r = cli(env, "serve", "--config", str(cfg), timeout=60)
    assert r.returncode == 1
    assert "limits.max_queue" in r.stderr and len(r.stderr.strip().splitlines()) == 1
