"""Which proposers have what they need for a target model: weights beside the model.

Owns the table of proposers that read weights from a folder beside the model
(EAGLE: ``MODEL/eagle``), :func:`weights` (where they are, if anywhere) and
:func:`weights_summary` (the same in words, for ``stats``). Must not load
anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from codespec.speculators.eagle import head_dir
from codespec.speculators.target import TargetModel

__all__ = ["MODEL_PROPOSERS", "WEIGHT_DIRS", "weights", "weights_summary"]

# Proposer name -> the folder beside the model its weights live in.
WEIGHT_DIRS: dict[str, Callable[[str | Path], Path]] = {"eagle": head_dir}
# The proposers besides n-gram, each with what it needs (weights or nothing).
MODEL_PROPOSERS = ("eagle", "lookahead")


def weights(target: TargetModel) -> dict[str, Path | None]:
    """Per proposer that needs weights: the folder holding them beside ``target``'s model,
    or None when there is none (nothing trained for this model)."""
    out: dict[str, Path | None] = {}
    for name, where in WEIGHT_DIRS.items():
        folder = where(target.model_path)
        out[name] = folder if (folder / "config.json").exists() else None
    return out


def weights_summary(target: Any, unusable: Mapping[str, str] | None = None) -> dict[str, str]:
    """Per model proposer, in words: ``weights in PATH``, ``no weights for this model``,
    ``needs no weights`` (lookahead), or ``not usable: WHY`` (``unusable[name]``: they did
    not load, e.g. made for another model)."""
    if target is None or not hasattr(target, "model_path"):
        return {}
    found = weights(target)
    unusable = unusable or {}
    out = {}
    for name in MODEL_PROPOSERS:
        if name not in found:
            out[name] = "needs no weights"
        elif found[name] is None:
            out[name] = "no weights for this model"
        elif name in unusable:
            out[name] = f"not usable: {unusable[name]}"
        else:
            out[name] = f"weights in {found[name]}"
    return out
