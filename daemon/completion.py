"""Prompts and post-processing for ``complete`` and ``edit``.

Owns: turning a document + cursor into a FIM prompt whose start stays put
while the user types (so the engine's prefix cache is reused), turning a
document + range (+ instruction / prediction) into an edit prompt (FIM middle
with the old region copied right before it, or the model's chat template),
cleaning the generated text, and the minimal LSP ``TextEdit`` list between the
old and the new region.

Must not touch: the engine's decoding, sockets, the document store's state.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any

from codespec.daemon.prompts import fim_prompt
from codespec.daemon.protocol import BAD_PARAMS, ProtocolError

PREFIX_BLOCK = 256  # the prompt's first prefix token moves in steps of this many tokens
SUFFIX_TOKENS = 128  # the most suffix tokens a prompt carries (all re-fed per keystroke)
CHARS_PER_TOKEN_CAP = 12  # text read around the cursor: budget * this many characters

COMMENT = {
    "python": "#",
    "shellscript": "#",
    "ruby": "#",
    "perl": "#",
    "r": "#",
    "toml": "#",
    "yaml": "#",
    "lua": "--",
    "sql": "--",
    "haskell": "--",
}

EDIT_SYSTEM = (
    "You rewrite one region of a source file. Reply with the new code of the region "
    "only, no explanations and no code fences."
)


@dataclass
class EditPrompt:
    prompt_ids: list[int]
    mode: str  # "fim" | "chat"
    draft_ids: list[int]


def _window_prefix(prefix_ids: list[int], room: int) -> list[int]:
    """The prefix's last ``room`` tokens at most, its start on a PREFIX_BLOCK grid.

    Cutting at ``len - room`` would move the prompt's start with every keystroke
    and defeat prefix reuse; on a grid the start moves once per PREFIX_BLOCK tokens.
    """
    excess = len(prefix_ids) - room
    if excess <= 0:
        return prefix_ids
    start = -(-excess // PREFIX_BLOCK) * PREFIX_BLOCK
    return prefix_ids[start:]


def _head_text(text: str, end: int, chars: int) -> str:
    """``text[:end]``, cut to about ``chars`` characters at a stable line start."""
    if end <= chars:
        return text[:end]
    cut = ((end - chars) // 4096 + 1) * 4096  # grid, so the cut does not move per keystroke
    nl = text.find("\n", min(cut, end))
    return text[nl + 1 : end] if 0 <= nl < end else text[cut:end]


def complete_prompt(
    engine: Any, text: str, offset: int, max_tokens: int, context_tokens: int | None = None
) -> list[int]:
    """A FIM prompt for a completion at ``offset`` (a plain prefix without FIM tokens).

    The prompt holds at most ``context_tokens`` tokens (default: the model's whole
    context), leaving room for ``max_tokens``.
    """
    window = min(engine.max_length, context_tokens or engine.max_length)
    budget = min(window, engine.max_length - max_tokens - 1)
    if budget < 8:
        raise ProtocolError(BAD_PARAMS, f"max_tokens {max_tokens} leaves no room for a prompt")
    chars = budget * CHARS_PER_TOKEN_CAP
    prefix_ids = engine.encode(_head_text(text, offset, chars))
    if engine.fim is None:
        if not prefix_ids:
            raise ProtocolError(BAD_PARAMS, "nothing before the cursor to complete from")
        return _window_prefix(prefix_ids, budget)
    suffix_ids = engine.encode(text[offset : offset + chars])
    suf_room = min(len(suffix_ids), SUFFIX_TOKENS, (budget - 3) // 4)
    pre = _window_prefix(prefix_ids, budget - 3 - suf_room)
    return fim_prompt(engine.fim, pre, suffix_ids[:suf_room], budget)


def single_line(text: str) -> str:
    """A single-line completion ends before its first line break."""
    return re.split(r"\r\n|\r|\n", text, maxsplit=1)[0]


def comment_line(language: str, instruction: str) -> str:
    mark = COMMENT.get(language, "#" if not language else "//")
    return "".join(f"{mark} {line}\n" for line in instruction.splitlines() or [""])


def has_chat_template(engine: Any) -> bool:
    return bool(getattr(engine.tokenizer, "chat_template", None))


def edit_prompt(
    engine: Any,
    text: str,
    start: int,
    end: int,
    draft: str,
    instruction: str,
    language: str,
    max_tokens: int,
) -> EditPrompt:
    """The prompt that regenerates ``text[start:end]``; ``draft`` is the old region or prediction.

    FIM (the embedded model): prefix = text before the region + the draft + a line
    break (+ the instruction as a comment), middle = the new region, suffix = the
    text after it. The model reads the draft right before it has to write the
    region, so copying it is one n-gram lookup away. Chat (a tokenizer with a chat
    template): the instruction, the surrounding code and the draft in one user turn.
    """
    budget = engine.max_length - max_tokens - 1
    draft_ids = engine.encode(draft)
    if len(draft_ids) + 16 > budget:
        raise ProtocolError(BAD_PARAMS, "the region is too long for the model's context")
    chars = budget * CHARS_PER_TOKEN_CAP
    before = _head_text(text, start, chars)
    after = text[end : end + chars]
    if has_chat_template(engine):
        room = (budget - len(draft_ids) - 128) // 2
        before_ids = _window_prefix(engine.encode(before), max(0, room))
        after_ids = engine.encode(after)[: max(0, room)]
        user = (
            f"Instruction: {instruction or 'Rewrite the region, fixing any mistakes.'}\n\n"
            f"Code before the region:\n{engine.decode(before_ids)}\n"
            f"<region>\n{draft}</region>\n\n"
            f"Code after the region:\n{engine.decode(after_ids)}"
        )
        messages = [{"role": "system", "content": EDIT_SYSTEM}, {"role": "user", "content": user}]
        rendered = engine.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        ids = engine.encode(rendered)
        if len(ids) > budget:
            raise ProtocolError(BAD_PARAMS, "the region is too long for the model's context")
        return EditPrompt(ids, "chat", draft_ids)
    if engine.fim is None:
        raise ProtocolError(BAD_PARAMS, "the model has neither FIM tokens nor a chat template")
    copy = draft if draft.endswith("\n") or not draft else draft + "\n"
    if before and not before.endswith("\n") and copy:
        copy = "\n" + copy
    note = comment_line(language, instruction) if instruction else ""
    prefix_ids = engine.encode(before + copy + note)
    suffix_ids = engine.encode(after)
    room = budget - 3
    suf_room = min(len(suffix_ids), SUFFIX_TOKENS, room // 4)
    pre = _window_prefix(prefix_ids, room - suf_room)
    return EditPrompt(fim_prompt(engine.fim, pre, suffix_ids[:suf_room], budget), "fim", draft_ids)


_FENCE = re.compile(r"^\s*```[\w+-]*\n(.*?)\n?```\s*$", re.S)


def clean_edit(text: str, mode: str) -> str:
    """Chat replies may wrap the code in a fence; FIM middles are taken as they are."""
    if mode == "chat":
        m = _FENCE.match(text)
        if m:
            return m.group(1)
    return text


def text_edits(doc: Any, start: int, old: str, new: str) -> list[dict[str, Any]]:
    """Minimal LSP TextEdits turning ``old`` (at ``start`` in ``doc``) into ``new``.

    A line diff finds the changed hunks; each hunk is narrowed to the characters
    that differ (common prefix and suffix trimmed). Ranges refer to the document
    before any edit is applied, as LSP requires; they do not overlap.
    """
    a = old.splitlines(keepends=True)
    b = new.splitlines(keepends=True)
    a_off = [0]
    for line in a:
        a_off.append(a_off[-1] + len(line))
    b_off = [0]
    for line in b:
        b_off.append(b_off[-1] + len(line))
    edits: list[dict[str, Any]] = []
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            continue
        o0, o1 = a_off[i1], a_off[i2]
        n0, n1 = b_off[j1], b_off[j2]
        while o0 < o1 and n0 < n1 and old[o0] == new[n0]:
            o0, n0 = o0 + 1, n0 + 1
        while o1 > o0 and n1 > n0 and old[o1 - 1] == new[n1 - 1]:
            o1, n1 = o1 - 1, n1 - 1
        if 0 < o0 < len(old) and old[o0 - 1 : o0 + 1] == "\r\n":  # never split a CRLF
            o0, n0 = o0 - 1, n0 - 1
        if 0 < o1 < len(old) and old[o1 - 1 : o1 + 1] == "\r\n":
            o1, n1 = o1 + 1, n1 + 1
        edits.append(
            {
                "range": {"start": doc.position(start + o0), "end": doc.position(start + o1)},
                "newText": new[n0:n1],
            }
        )
    return edits
