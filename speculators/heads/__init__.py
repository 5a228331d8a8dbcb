"""The EAGLE-3 heads shipped with codespec, and which model each one fits.

Owns ``index.json`` (per shipped head: its folder here, the model it was trained
for, the sha256 of the GGUF file that model was made from, and the figures it was
trained to) and :func:`packaged_head`, which answers "is a head shipped for the model
in this folder?" from the folder's manifest (``codespec-model.json``, written by
``codespec.daemon.engine.models``: the GGUF's sha256). A head is trained on the states
of one model's exact weights, so a shipped head is matched by that sha256 and by
nothing looser (a model of the same shape with other weights gets none).

Must not touch: loading or running a head (``eagle.py`` / ``eagle_head.py``), the model
cache itself (it only reads a manifest), the policy (whether a head is worth using on
this machine is measured there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["HEADS_DIR", "MANIFEST", "index", "packaged_head"]

HEADS_DIR = Path(__file__).resolve().parent
MANIFEST = "codespec-model.json"  # codespec.daemon.engine.models.MANIFEST


def index(root: Path = HEADS_DIR) -> list[dict[str, Any]]:
    """The shipped heads (``index.json``'s ``heads``); empty when it cannot be read."""
    try:
        heads = json.loads((root / "index.json").read_text(encoding="utf-8"))["heads"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [h for h in heads if isinstance(h, dict)]


def _model_sha(model_path: str | Path) -> str | None:
    try:
        manifest = json.loads((Path(model_path) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    sha = manifest.get("sha256") if isinstance(manifest, dict) else None
    return sha if isinstance(sha, str) else None


def packaged_head(model_path: str | Path, root: Path = HEADS_DIR) -> Path | None:
    """The shipped head folder for the model in ``model_path`` (matched by the sha256 of
    the GGUF the model folder was made from), or None."""
    sha = _model_sha(model_path)
    if sha is None:
        return None
    for head in index(root):
        shas = head.get("gguf_sha256")
        if isinstance(shas, list) and sha in shas:
            folder = root / str(head.get("folder", ""))
            if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
                return folder
    return None
