"""The vLLM backend's parts that need no vLLM: failures named clearly (a server down, one
that never answers), the API key's sources (and that it stays out of logs), the
``[backend]`` config section, and ``codespec vllm-args``' server command line.
(tests/test_vllm.py runs the daemon against a real vLLM server.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from codespec.daemon.backends.openai_http import BackendError, OpenAIClient, read_api_key
from codespec.daemon.backends.vllm_args import NGRAM, eagle_head, server_command
from codespec.daemon.backends.vllm_args import speculative_config as spec_for
from codespec.daemon.config import ConfigError, load_config
from codespec.daemon.service.protocol import BACKEND


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_server_that_is_down_is_named(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(BackendError) as err:
        OpenAIClient(url).get_json("/v1/models")
    assert err.value.code == BACKEND and err.value.retryable
    assert err.value.message.startswith(f"the backend at {url} is down")


def test_a_server_that_never_answers_times_out():
    """A listener that accepts and says nothing: the request ends with 'slow or stuck'."""
    with socket.socket() as lsn:
        lsn.bind(("127.0.0.1", 0))
        lsn.listen(1)
        url = f"http://127.0.0.1:{lsn.getsockname()[1]}"
        held: list[socket.socket] = []
        threading.Thread(target=lambda: held.append(lsn.accept()[0]), daemon=True).start()
        with pytest.raises(BackendError) as err:
            list(OpenAIClient(url, timeout_s=0.3).stream("/v1/completions", {"prompt": [1]}))
        for conn in held:
            conn.close()
    assert "sent nothing for 0.3 s (slow or stuck)" in err.value.message


def test_serve_refuses_to_start_without_its_server(tmp_path, default_model_dir):
    url = f"http://127.0.0.1:{_closed_port()}"
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), CODESPEC_SOCKET=str(tmp_path / "d.sock"))
    argv = [sys.executable, "-m", "codespec.daemon.cli", "serve", "--backend", "vllm",
            "--backend-url", url]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"the backend at {url} is down" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_api_key_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KEY_FOR_TEST", " sk-env ")
    assert read_api_key("KEY_FOR_TEST", "") == "sk-env"
    monkeypatch.delenv("KEY_FOR_TEST")
    (tmp_path / "key").write_text("sk-file\n")
    assert read_api_key("KEY_FOR_TEST", str(tmp_path / "key")) == "sk-file"
    assert read_api_key("KEY_FOR_TEST", "") is None
    (tmp_path / "empty").write_text("")
    with pytest.raises(BackendError, match="is empty"):
        read_api_key("KEY_FOR_TEST", str(tmp_path / "empty"))
    client = OpenAIClient("http://127.0.0.1:1", "sk-secret")
    assert "sk-secret" not in repr(client) and client.authenticated


def test_backend_config_section(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[backend]\nkind = "vllm"\nurl = "http://gpu:8000/v1"\ntimeout_s = 5\n')
    b = load_config(cfg).backend
    assert (b.kind, b.url, b.timeout_s, b.retries) == ("vllm", "http://gpu:8000/v1", 5.0, 2)
    assert OpenAIClient(b.url)._base == ""  # a URL ending in /v1 names the same API
    cfg.write_text('[backend]\nkind = "tgi"\n')
    with pytest.raises(ConfigError, match="kind"):
        load_config(cfg)
    with pytest.raises(BackendError, match="not an http"):
        OpenAIClient("gpu:8000")


def test_vllm_args_speculation(default_model_dir, tmp_path):
    head = eagle_head(default_model_dir)  # SmolLM2 ships with a head (speculators layout)
    assert head is not None and (head / "config.json").exists()
    assert spec_for("auto", head)["method"] == "eagle3"
    assert spec_for("auto", None) == NGRAM and spec_for("off", head) is None
    with pytest.raises(ValueError, match="no EAGLE-3 head"):
        spec_for("eagle", None)
    argv = server_command(default_model_dir, "m", spec_for("ngram", head), port=9, cpu=True)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "ngram" and "--enforce-eager" in argv


def test_vllm_args_command(default_model_dir):
    done = subprocess.run(
        [sys.executable, "-m", "codespec.daemon.cli", "vllm-args", str(default_model_dir),
         "--speculation", "ngram", "--port", "8123", "--cpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, then = done.stdout.splitlines()[:2]
    assert "VLLM_CPU_KVCACHE_SPACE=2" in first and "--port 8123" in first
    assert '"method":"ngram"' in first
    assert "--backend vllm --backend-url http://127.0.0.1:8123" in then
