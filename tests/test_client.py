"""The Python clients: the AsyncClient interface the language server uses, and the sync Client."""

from __future__ import annotations

import asyncio

import pytest

from codespec.daemon.client import AsyncClient, Client, DaemonError, default_socket_path


def test_default_socket_path_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("CODESPEC_SOCKET", str(tmp_path / "s.sock"))
    assert default_socket_path() == str(tmp_path / "s.sock")
    monkeypatch.delenv("CODESPEC_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_path() == str(tmp_path / "codespec" / "daemon.sock")
    monkeypatch.delenv("XDG_RUNTIME_DIR")  # none: the state directory, as models and kernels
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_socket_path() == str(tmp_path / "cache" / "codespec" / "daemon.sock")


def test_no_daemon_is_unavailable(tmp_path):
    with pytest.raises(DaemonError) as err:
        Client(str(tmp_path / "none.sock"))
    assert err.value.code == "unavailable"

    async def go():
        await AsyncClient.connect(str(tmp_path / "none.sock"), timeout=1)

    with pytest.raises(DaemonError):
        asyncio.run(go())


def test_async_client_interface(daemon):
    async def go() -> None:
        c = await AsyncClient.connect(daemon.socket_path, timeout=5.0)
        assert not c.closed
        hello = await c.request("hello", {"client": "test"})
        assert hello["protocol"] == 1
        deltas: list[dict] = []
        p = c.start("generate", {"prompt": "def f(x):\n", "max_tokens": 4, "stream": True},
                    on_delta=deltas.append)  # fmt: skip
        assert isinstance(p.id, int)
        r = await p.result()
        assert "".join(d["text"] for d in deltas) == r["text"]
        # Two requests in flight; cancelling the first leaves the second intact.
        long = c.start("generate", {"prompt": "import os\n", "max_tokens": 500})
        short = c.start("generate", {"prompt": "x = ", "max_tokens": 2})
        await long.cancel()
        with pytest.raises(DaemonError) as err:
            await long.result()
        assert err.value.code == "cancelled"
        assert (await short.result())["stats"]["tokens"] <= 2
        with pytest.raises(DaemonError) as err:
            await c.request("open", {"uri": 1})
        assert err.value.code == "bad_params"
        await c.close()
        assert c.closed
        with pytest.raises(DaemonError) as err:
            await c.request("hello")
        assert err.value.code == "disconnected"

    asyncio.run(asyncio.wait_for(go(), 60))
