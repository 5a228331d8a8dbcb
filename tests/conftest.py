"""Shared fixtures: the embedded engine (loaded once), tiny random models, held-out prompts."""

from __future__ import annotations

import os
import random
import sysconfig
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one build of the CPU kernel for every daemon the tests start under its own cache dir
os.environ.setdefault(
    "CODESPEC_KERNEL_DIR", os.path.join(tempfile.gettempdir(), f"codespec-kernels-{os.getuid()}")
)
torch.set_num_threads(int(os.environ.get("CODESPEC_TEST_THREADS", min(2, os.cpu_count() or 1))))

HELDOUT = Path(sysconfig.get_paths()["stdlib"]) / "test"


@pytest.fixture
def one_thread():
    """One intra-op thread: on a busy 2-core machine, 2 threads wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def engine():
    from codespec.daemon.engine import Engine

    return Engine(runner=os.environ.get("CODESPEC_TEST_RUNNER", "auto"))


@pytest.fixture(scope="session")
def hf_engine():
    from codespec.daemon.engine import Engine

    return Engine(runner="hf")


def heldout_prompts(engine, count: int, tokens: int = 160, seed: int = 7) -> list[list[int]]:
    """Prompts cut from the held-out stdlib ``test/`` folder at line starts inside the file."""
    rng = random.Random(seed)
    files = sorted(p for p in HELDOUT.glob("test_*.py") if p.stat().st_size < 200_000)
    rng.shuffle(files)
    prompts: list[list[int]] = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines(keepends=True)
        if len(lines) < 40:
            continue
        cut = rng.randrange(20, len(lines))
        ids = engine.encode("".join(lines[:cut]))
        prompts.append(ids[-tokens:])
        if len(prompts) == count:
            break
    assert len(prompts) == count, "not enough held-out files"
    return prompts


def tiny_llama(vocab: int = 96, layers: int = 2, seed: int = 0, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=kw.pop("hidden_size", 32),
        intermediate_size=kw.pop("intermediate_size", 64),
        num_hidden_layers=layers,
        num_attention_heads=kw.pop("num_attention_heads", 4),
        num_key_value_heads=kw.pop("num_key_value_heads", 2),
        max_position_embeddings=kw.pop("max_position_embeddings", 512),
        **kw,
    )
    return LlamaForCausalLM(cfg).eval()


class ServerThread:
    """A real daemon (``make_server``) on its own event loop in a background thread."""

    def __init__(self, config, engine) -> None:
        import asyncio
        import threading

        from codespec.daemon.server import make_server

        self.loop = asyncio.new_event_loop()
        self.server = make_server(config, engine)
        self.socket_path = self.server.socket_path
        started = threading.Event()
        self.error: BaseException | None = None

        async def main() -> None:
            try:
                await self.server.start()
            except BaseException as exc:
                self.error = exc
                started.set()
                return
            started.set()
            await self.server.serve_forever()

        self.thread = threading.Thread(
            target=self.loop.run_until_complete, args=(main(),), daemon=True
        )
        self.thread.start()
        started.wait(60)
        if self.error is not None:
            raise self.error

    def call(self, fn):
        """Run ``fn()`` on the server's loop and return its result."""
        import asyncio

        async def run():
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def stop(self) -> None:
        import asyncio

        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
            self.thread.join(10)


def daemon_config(tmp_path, **limits):
    from codespec.daemon.config import Config

    config = Config(socket=str(tmp_path / "d.sock"), state_dir="")
    config.workspace.debounce_s = 0.05
    for key, value in limits.items():
        setattr(config.limits, key, value)
    return config


@pytest.fixture(scope="module")
def daemon(engine, tmp_path_factory):
    """One in-process daemon per test module, sharing the session's engine."""
    srv = ServerThread(daemon_config(tmp_path_factory.mktemp("daemon")), engine)
    yield srv
    srv.stop()
