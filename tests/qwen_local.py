"""Where the tests find Qwen2.5-Coder-0.5B-Instruct: the suite's ``qwen_model_dir`` fixture
when tests/conftest.py has one, else a folder already made on this machine from its GGUF
(``codespec model import``, ``--model FILE.gguf``), recognised by the GGUF's sha256 in the
folder's manifest; else the test is skipped, saying how to get the model. Nothing here
fetches or converts anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# sha256 of qwen2.5-coder-0.5b-instruct-q4_k_m.gguf (../shared/FACTS.md)
QWEN_05B_SHA = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
HOW = (
    "Qwen2.5-Coder-0.5B-Instruct is not on this machine "
    "(codespec model import qwen2.5-coder-0.5b-instruct-q4_k_m.gguf gives it)"
)


def qwen_dir(request: pytest.FixtureRequest) -> Path:
    """The model's folder (see the module docstring), or a skip."""
    try:
        return Path(request.getfixturevalue("qwen_model_dir"))
    except pytest.FixtureLookupError:
        pass
    from codespec.daemon.engine import models

    for manifest in sorted(models.models_root().glob("*/codespec-model.json")):
        try:
            sha = json.loads(manifest.read_text(encoding="utf-8")).get("sha256")
        except (OSError, ValueError):
            continue
        folder = manifest.parent
        if sha == QWEN_05B_SHA and (folder / "tokenizer.json").is_file():
            return folder
    pytest.skip(HOW)


def qwen_tokenizer(request: pytest.FixtureRequest):
    """The model's tokenizer (transformers), from its folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_dir(request)), local_files_only=True)
