"""Workload items: a benchmark workload read from JSONL and laid out as the daemon's prompts.

Owns: reading a workload (:func:`load_workload`: one JSON object a line, each with a
``prompt``, ``prompt_ids`` or ``prefix``), an item's prompt ids, token budget, draft ids
and healed text as the daemon lays them out (:func:`build_prompt`), and the n-gram index
over a workload's open documents (:func:`build_index`).
Must not touch: decoding (``decoding``), timing, tables; making workloads from real code
is ``workloads`` (``codespec bench make-workloads``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from codespec.daemon.engine.engine import Engine
    from codespec.ngram_index import NgramIndex


def load_workload(path: str) -> list[dict[str, Any]]:
    items = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
            if not isinstance(item, dict) or not {"prompt", "prompt_ids", "prefix"} & set(item):
                raise ValueError(f"{path}:{n}: needs a 'prompt', 'prompt_ids' or 'prefix'")
            items.append(item)
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


def build_prompt(
    engine: Engine,
    item: dict[str, Any],
    max_override: int,
    prediction: str = "none",
    context: int = 1024,
) -> tuple[list[int], int, list[int] | None, str]:
    """Token ids, max_tokens, draft ids and healed text of one workload item, laid out as
    the daemon lays out its prompts (:mod:`codespec.daemon.prompts.completion`).

    Edit items are ``edit`` requests on the old file with the old function as the range:
    ``prediction`` ``none``, ``old`` or ``output`` — the old region is the draft (the
    request carries no prediction; for ``output`` the methods benchmark then swaps in the
    exact output as the draft, see ``methods._exact_prediction``); ``new`` — the
    request's prediction is the new version (predicted outputs / fast apply: the client
    already knows the new code). Completion-like items
    (a ``prefix``) are ``complete`` requests at the end of the prefix. The healed text is
    what the first generated tokens must spell out (a constraint, as in the daemon).
    """
    from codespec.daemon.prompts import completion

    max_tokens = max_override or int(item.get("max_tokens", 64))
    if "new" in item:  # an edit: room for the new text and a little more
        if not max_override:
            max_tokens = min(max_tokens, len(engine.encode(item["new"])) + 16)
        before = item["prefix"][: len(item["prefix"]) - len(item["old"]) - 1]
        text = before + item["old"] + item.get("suffix", "")
        draft = item["new"] if prediction == "new" else item["old"]
        ep = completion.edit_prompt(
            engine, text, len(before), len(before) + len(item["old"]), draft, "", "python",
            max_tokens, context_tokens=context,
        )  # fmt: skip
        return ep.prompt_ids, max_tokens, ep.draft_ids, ep.heal
    if "prefix" in item:
        text = item["prefix"] + item.get("suffix", "")
        cp = completion.complete_prompt(
            engine, text, len(item["prefix"]), max_tokens, context, uri=item.get("uri", "")
        )
        return cp.prompt_ids, max_tokens, None, cp.heal
    budget = min(context, engine.max_length - 1 - max_tokens)
    ids = item.get("prompt_ids") or engine.encode(item["prompt"])
    return ids[-budget:], max_tokens, None, ""


def build_index(engine: Engine, items: list[dict[str, Any]]) -> NgramIndex | None:
    docs = {d["uri"]: d["text"] for it in items for d in it.get("documents", [])}
    if not docs:
        return None
    try:
        from codespec.ngram_index import NgramIndex
    except ImportError:
        return None
    index = NgramIndex(engine.tokenizer.backend_tokenizer)
    for uri, text in docs.items():
        index.open(uri, text)
    return index
