"""Shared fixtures: the embedded engine (loaded once), tiny random models, held-out prompts."""

from __future__ import annotations

import os
import random
import sysconfig
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(int(os.environ.get("CODESPEC_TEST_THREADS", min(2, os.cpu_count() or 1))))

HELDOUT = Path(sysconfig.get_paths()["stdlib"]) / "test"


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
