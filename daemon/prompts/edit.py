"""Prompts and read-back for ``edit``: a document + range (+ instruction / prediction) into an
edit prompt (FIM middle with the old region copied right before it, the text before the
region continued, or the model's chat template), the new region cleaned, and the minimal
LSP ``TextEdit`` list between the old and the new region.

Must not touch: the engine's decoding, sockets, the document store's state.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any

from codespec.daemon.errors import BAD_PARAMS, ProtocolError
from codespec.daemon.prompts.fim import fim_prompt
from codespec.daemon.prompts.parts import (
    CHARS_PER_TOKEN_CAP,
    SUFFIX_TOKENS,
    OpenDocument,
    Prepared,
    head_text,
    next_lines,
    window_prefix,
)
from codespec.daemon.text import healing
from codespec.daemon.text.healing import heal_prompt
from codespec.daemon.text.protocols import TextModel
from codespec.daemon.text.tracker import TextTracker, region_shape

# An edit's drafts may run this long at least (a longer config max_draft stands): its old
# region or prediction is copied in long runs, and the policy cuts each draft to the part
# that pays, so edits decode faster with drafts this long than with 16 (`codespec bench
# edit.jsonl` on SmolLM2-135M: BENCHMARKS.md, the 2026-12-04 12:45 block).
EDIT_DRAFT = 64

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
    "You edit source code. Follow the instruction and reply with the rewritten code "
    "only, in one code block, with no explanation."
)


EDIT_MODES = ("auto", "fim", "continue", "chat")


@dataclass
class EditPrompt:
    """What ``edit`` feeds the engine and how the new region is read back.

    ``lead``: the region's first line, put at the end of the prompt (``continue``
    mode) and so the start of the answer; ``heal`` as for completions; the answer
    ends at ``stop_lines`` (the code after the region) or when it has written as
    many lines at the region's indentation as the draft has (``region``).
    """

    prompt_ids: list[int]
    mode: str  # "fim" | "continue" | "chat"
    draft_ids: list[int]
    lead: str = ""
    heal: str = ""
    stop_lines: tuple[str, ...] = ()
    region: tuple[int, int] | None = None


def prepare_edit(
    engine: TextModel, ep: EditPrompt, old: str, stop: list[str] | None = None
) -> Prepared:
    """An edit prompt's request. A ``continue`` or ``chat`` rewrite ends with the line
    breaks ``old`` ended with (a ``continue`` one is cut where the next code starts, so
    blank lines before that are not the region's; a chat reply ends where it likes); a
    chat reply's code fence is unwrapped as it streams."""
    tracker = TextTracker(
        engine.tokenizer.backend_tokenizer,
        ep.prompt_ids,
        stop or [],
        skip=ep.heal,
        lead=ep.lead,
        stop_lines=ep.stop_lines,
        region=ep.region,
        trailing=old[len(old.rstrip("\r\n")) :] if ep.mode in ("continue", "chat") else None,
        unwrap=ep.mode == "chat",
    )
    constraint = healing.constraint(engine, ep.heal)
    return Prepared(ep.prompt_ids, constraint, tracker, ep.draft_ids, ep.mode)


def comment_line(language: str, instruction: str) -> str:
    mark = COMMENT.get(language, "#" if not language else "//")
    return "".join(f"{mark} {line}\n" for line in instruction.splitlines() or [""])


def has_chat_template(engine: TextModel) -> bool:
    return bool(getattr(engine.tokenizer, "chat_template", None))


def auto_mode(engine: TextModel) -> str:
    """The mode ``auto`` picks: ``chat`` for a code model with FIM tokens and a chat
    template (Qwen2.5-Coder-Instruct), ``fim`` for one without a template, ``continue``
    for a model without FIM tokens (SmolLM2 answers with prose through its template)."""
    if engine.fim is None:
        return "continue"
    return "chat" if has_chat_template(engine) else "fim"


def edit_prompt(
    engine: TextModel,
    text: str,
    start: int,
    end: int,
    draft: str,
    instruction: str,
    language: str,
    max_tokens: int,
    mode: str = "auto",
    context_tokens: int | None = None,
) -> EditPrompt:
    """The prompt that regenerates ``text[start:end]``; ``draft`` is the old region or
    the caller's prediction, read by the model right before it writes the region (a
    copy is one n-gram lookup away). At most ``context_tokens`` tokens of surrounding
    code besides the draft (default: as much as the model's context holds).

    - ``fim`` (``auto`` for models with FIM tokens and no chat template): prefix = text
      before the region + the draft + a line break (+ the instruction as a comment),
      middle = the new region, suffix = the text after it.
    - ``continue`` (``auto`` for the rest): the text before the region, the draft, the
      instruction as a comment, then the draft's first line again, healed; the model
      continues the rewrite. Ends at the code after the region or when the rewrite
      has as many lines at the region's indentation as the draft. A small instruct
      model (SmolLM2-135M) copies the draft this way and answers with prose through
      its chat template.
    - ``chat`` (``auto`` for models with FIM tokens and a chat template: instruct code
      models): the instruction and the draft in one user turn of the model's chat
      template, the reply begun inside a code fence whose closing ends it.
    """
    if mode not in EDIT_MODES:
        raise ProtocolError(BAD_PARAMS, f"mode must be one of {', '.join(EDIT_MODES)}")
    if mode == "auto":
        mode = auto_mode(engine)
    budget = engine.max_length - max_tokens - 1
    draft_ids = engine.encode(draft)
    if context_tokens:
        budget = min(budget, context_tokens + 2 * len(draft_ids) + 64)
    if len(draft_ids) + 16 > budget:
        raise ProtocolError(BAD_PARAMS, "the region is too long for the model's context")
    if mode == "chat":
        return _chat_edit(engine, draft, draft_ids, instruction, budget, language)
    chars = budget * CHARS_PER_TOKEN_CAP
    before, after = head_text(text, start, chars), text[end : end + chars]
    if mode == "fim" and engine.fim is None:
        raise ProtocolError(BAD_PARAMS, "the model has no FIM tokens")
    copy = draft if draft.endswith("\n") or not draft else draft + "\n"
    if before and not before.endswith("\n") and copy:
        copy = "\n" + copy
    note = comment_line(language, instruction) if instruction else ""
    if mode == "fim":
        return _fim_edit(engine, before + copy + note, after, draft_ids, budget)
    first, nl, _ = draft.partition("\n")
    lead = first + nl if nl else first[: len(first) - len(first.lstrip())]
    ids = window_prefix(engine.encode(before + copy + note + lead), budget)
    ids, heal = heal_prompt(engine, ids)
    region = region_shape(draft) if draft.strip() else None
    # the answer is lead + what the model writes after the healed text
    return EditPrompt(ids, "continue", draft_ids, lead, heal, next_lines("\n" + after), region)


def _fim_edit(
    engine: TextModel, prefix: str, after: str, draft_ids: list[int], budget: int
) -> EditPrompt:
    """A FIM edit prompt: ``prefix`` (the text before the region, the draft, the
    instruction) and the text after the region, within ``budget`` tokens."""
    prefix_ids = engine.encode(prefix)
    suffix_ids = engine.encode(after)
    room = budget - 3
    suf_room = min(len(suffix_ids), SUFFIX_TOKENS, room // 4)
    pre = window_prefix(prefix_ids, room - suf_room)
    ids = fim_prompt(engine.fim, pre, suffix_ids[:suf_room], budget)
    return EditPrompt(ids, "fim", draft_ids)


def _chat_edit(
    engine: TextModel,
    draft: str,
    draft_ids: list[int],
    instruction: str,
    budget: int,
    language: str = "",
) -> EditPrompt:
    """The ``chat`` edit prompt: one user turn with the instruction and the region (the
    draft), fenced; the reply is begun with the region's fence, so its closing fence ends
    it. The code around the region stays out: given it, Qwen2.5-Coder-0.5B-Instruct
    rewrites that code instead of the region."""
    if not has_chat_template(engine):
        raise ProtocolError(BAD_PARAMS, "the model has no chat template")
    fence = f"```{language}\n"
    code = draft if draft.endswith("\n") or not draft else draft + "\n"
    user = f"{instruction or 'Rewrite this code, fixing any mistakes.'}\n\n{fence}{code}```"
    messages = [{"role": "system", "content": EDIT_SYSTEM}, {"role": "user", "content": user}]
    rendered = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    ids = engine.encode(rendered + fence)
    if len(ids) > budget:
        raise ProtocolError(BAD_PARAMS, "the region is too long for the model's context")
    return EditPrompt(ids, "chat", draft_ids)


_FENCE = re.compile(r"^\s*```[\w+-]*\n(.*?)\n?```\s*$", re.S)


def clean_edit(text: str, mode: str) -> str:
    """The new region as the client gets it: chat replies may wrap the code in a fence.
    (A ``continue`` rewrite already ends with the old region's line breaks: the
    scheduler's text tracker sees to it, see :func:`edit_job`.)"""
    if mode == "chat":
        m = _FENCE.match(text)
        if m:
            return m.group(1)
    return text


def text_edits(doc: OpenDocument, start: int, old: str, new: str) -> list[dict[str, Any]]:
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
