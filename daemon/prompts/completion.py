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
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from codespec.daemon.prompts import crossfile
from codespec.daemon.prompts.fim import fim_prompt
from codespec.daemon.service.protocol import BAD_PARAMS, ProtocolError
from codespec.daemon.text import healing
from codespec.daemon.text.healing import heal_prompt
from codespec.daemon.text.prefix_tokens import prefix_encoder
from codespec.daemon.text.tracker import TextTracker, region_shape

PREFIX_BLOCK = 256  # the prompt's first prefix token moves in steps of this many tokens
COLD_BLOCK = 64  # the same for a cold spot's short window (see CompletionPrompt.cold_ids)
SUFFIX_TOKENS = 128  # the most suffix tokens a prompt carries (all re-fed per keystroke)
CHARS_PER_TOKEN_CAP = 12  # text read around the cursor: budget * this many characters
FILE_SEP = "<file_sep>"  # StarCoder-style repository layout (SmolLM2's tokenizer has it)
# An edit's drafts may run this long at least (a longer config max_draft stands): its old
# region or prediction is copied in long runs, and the policy cuts each draft to the part
# that pays. Measured on the default model (`codespec bench edit.jsonl`, the 2026-12-04
# 12:45 block of BENCHMARKS.md): ngram 2.77x of off with 16 draft tokens, 3.03x with 64.
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
    "You rewrite one region of a source file. Reply with the new code of the region "
    "only, no explanations and no code fences."
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


def _window_prefix(prefix_ids: list[int], room: int, block: int = PREFIX_BLOCK) -> list[int]:
    """The prefix's last ``room`` tokens at most, its start on a ``block`` grid.

    Cutting at ``len - room`` would move the prompt's start with every keystroke
    and defeat prefix reuse; on a grid the start moves once per ``block`` tokens.
    """
    excess = len(prefix_ids) - room
    if excess <= 0:
        return prefix_ids
    start = -(-excess // block) * block
    return prefix_ids[start:]


def _head_text(text: str, end: int, chars: int) -> str:
    """``text[:end]``, cut to about ``chars`` characters at a stable line start."""
    if end <= chars:
        return text[:end]
    cut = ((end - chars) // 4096 + 1) * 4096  # grid, so the cut does not move per keystroke
    nl = text.find("\n", min(cut, end))
    return text[nl + 1 : end] if 0 <= nl < end else text[cut:end]


@dataclass
class CompletionPrompt:
    """What ``complete`` feeds the engine, and how its output is read back.

    ``heal``: the text backed off the prompt's end (:mod:`.healing`); the output
    starts with it and it is not part of the completion. ``stop_lines``: the
    document's next non-blank line after the cursor; a completed line equal to it
    ends the completion (it reached the code after the cursor). ``first_line_counts``:
    whether the completion's first line may be such a line (the cursor's line is
    blank left of the cursor). ``snippets``: the cross-file context used.
    """

    prompt_ids: list[int]
    heal: str = ""
    stop_lines: tuple[str, ...] = ()
    first_line_counts: bool = False
    snippets: list[crossfile.Snippet] = field(default_factory=list)
    # The same prompt with at most ``cold_tokens`` of the prefix (its start on a
    # COLD_BLOCK grid), or None (no shorter one): what a completion at a spot with
    # nothing cached uses, so that its prefill stays short (scheduler.Job.cold_ids)
    cold_ids: list[int] | None = None


def file_label(uri: str) -> str:
    """A short path for a ``<file_sep>`` header: the last two parts of the URI's path."""
    path = urllib.parse.unquote(urllib.parse.urlparse(uri).path) if "://" in uri else uri
    parts = [p for p in path.replace("\\", "/").split("/") if p]
    return "/".join(parts[-2:]) or "untitled"


def _repo_layout(engine: Any) -> bool:
    """Whether the tokenizer has StarCoder-style ``<file_sep>`` (repository-level data).
    (One lookup: ``get_vocab()`` copied the 49k-entry vocabulary, ~1 ms a keystroke.)"""
    return engine.tokenizer.backend_tokenizer.token_to_id(FILE_SEP) is not None


def complete_prompt(
    engine: Any,
    text: str,
    offset: int,
    max_tokens: int,
    context_tokens: int | None = None,
    uri: str = "",
    snippets: list[crossfile.Snippet] | None = None,
    heal: bool = True,
    cold_tokens: int = 0,
) -> CompletionPrompt:
    """The prompt for a completion at ``offset`` of ``text``.

    FIM models get ``<prefix> P <suffix> S <middle>``. Models without FIM tokens get a
    left-to-right prompt: with ``<file_sep>`` in the vocabulary, the ``snippets`` of
    other files and then the current file, each under a ``<file_sep>path`` header as
    repository-level training data is laid out; then the prefix, its last token backed
    off for healing (``heal``). The prompt holds at most ``context_tokens`` tokens
    (default: the model's whole context), leaving room for ``max_tokens``; snippets get
    at most a third of it. The suffix the model cannot see still ends the completion
    (``stop_lines``). ``cold_tokens`` > 0: also the prompt with at most that many prefix
    tokens (``cold_ids``), when it is shorter.
    """
    window = min(engine.max_length, context_tokens or engine.max_length)
    budget = min(window, engine.max_length - max_tokens - 1)
    if budget < 8:
        raise ProtocolError(BAD_PARAMS, f"max_tokens {max_tokens} leaves no room for a prompt")
    chars = budget * CHARS_PER_TOKEN_CAP
    prefix_ids = prefix_encoder(engine.tokenizer).encode(_head_text(text, offset, chars))
    after = text[offset : offset + chars]
    line_start = text.rfind("\n", 0, offset) + 1
    stops = _next_lines(after)
    first_counts = not text[line_start:offset].strip()
    if engine.fim is not None:
        suffix_ids = engine.encode(after)
        suf_room = min(len(suffix_ids), SUFFIX_TOKENS, (budget - 3) // 4)
        pre = _window_prefix(prefix_ids, budget - 3 - suf_room)
        ids = fim_prompt(engine.fim, pre, suffix_ids[:suf_room], budget)
        cold = None
        if 0 < cold_tokens < len(pre):
            short = _window_prefix(pre, cold_tokens, COLD_BLOCK)
            cold = fim_prompt(engine.fim, short, suffix_ids[:suf_room], budget)
        return CompletionPrompt(ids, "", stops, first_counts, cold_ids=cold)
    head: list[int] = []
    used: list[crossfile.Snippet] = []
    if _repo_layout(engine) and (uri or snippets):
        for snip in snippets or []:
            piece = engine.encode(f"{file_label(snip.uri)}\n{snip.text.rstrip()}\n")
            if len(head) + len(piece) + 1 > budget // 3:
                break
            head += [engine.tokenizer.convert_tokens_to_ids(FILE_SEP), *piece]
            used.append(snip)
        head += [engine.tokenizer.convert_tokens_to_ids(FILE_SEP)]
        head += engine.encode(f"{file_label(uri)}\n")
    if not prefix_ids and not head:
        raise ProtocolError(BAD_PARAMS, "nothing before the cursor to complete from")
    pre = _window_prefix(prefix_ids, budget - len(head))
    ids = head + pre
    cold = None
    if 0 < cold_tokens < len(pre):
        cold = head + _window_prefix(pre, cold_tokens, COLD_BLOCK)
    healed = ""
    if heal and prefix_ids:
        ids, healed = heal_prompt(engine, ids)
        if cold is not None:
            cold, cold_healed = heal_prompt(engine, cold)
            cold = cold if cold_healed == healed else None  # the same text to skip, else none
    return CompletionPrompt(ids, healed, stops, first_counts, used, cold)


CONTEXTS = ("none", "header", "crossfile")


@dataclass
class Prepared:
    """A request ready for the scheduler: the prompt, the healing constraint for the
    engine, the tracker that reads the output back as text, the draft text's ids."""

    prompt_ids: list[int]
    constraint: Any
    tracker: TextTracker
    draft_ids: list[int] | None = None
    mode: str = ""
    cold_ids: list[int] | None = None  # a shorter prompt for a cold spot (completions)


def prepare_complete(
    engine: Any,
    documents: Any,
    snippets: crossfile.SnippetCache,
    doc: Any,
    offset: int,
    max_tokens: int,
    multiline: bool,
    context_tokens: int,
    context: str = "none",
    stop: list[str] | None = None,
    cold_tokens: int = 0,
) -> Prepared:
    """A completion at ``offset`` of the open document ``doc``: the prompt, the healing
    constraint, the stop rules (single-line completions stop at a line break).
    ``context``: ``none`` (the prefix alone), ``header`` (under a ``<file_sep>path``
    line) or ``crossfile`` (after snippets of the other recent ``documents``).
    ``cold_tokens``: see :func:`complete_prompt` (``Prepared.cold_ids``)."""
    if context not in CONTEXTS:
        raise ValueError(f"context must be one of {', '.join(CONTEXTS)}")
    picked: list[crossfile.Snippet] = []
    if context == "crossfile":
        others = [(d.uri, d.version, d.text) for d in documents.recent(exclude=doc.uri)]
        # characters: about a third of the prompt's token budget
        picked = snippets.snippets(doc.uri, doc.text, offset, others, context_tokens)
    cp = complete_prompt(
        engine,
        doc.text,
        offset,
        max_tokens,
        context_tokens,
        uri=doc.uri if context != "none" else "",
        snippets=picked,
        cold_tokens=cold_tokens,
    )
    stops = list(stop or []) if multiline else ["\n", "\r", *(stop or [])]
    tracker = TextTracker(
        engine.tokenizer.backend_tokenizer,
        cp.prompt_ids,
        stops,
        skip=cp.heal,
        stop_lines=cp.stop_lines,
        first_line_counts=cp.first_line_counts,
        cut_loops=True,
    )
    return Prepared(
        cp.prompt_ids, healing.constraint(engine, cp.heal), tracker, cold_ids=cp.cold_ids
    )


def prepare_edit(engine: Any, ep: EditPrompt, old: str, stop: list[str] | None = None) -> Prepared:
    """An edit prompt's request. A ``continue`` rewrite ends with the line breaks ``old``
    ended with (it is cut where the next code starts, so blank lines before that are
    not the region's)."""
    tracker = TextTracker(
        engine.tokenizer.backend_tokenizer,
        ep.prompt_ids,
        stop or [],
        skip=ep.heal,
        lead=ep.lead,
        stop_lines=ep.stop_lines,
        region=ep.region,
        trailing=old[len(old.rstrip("\r\n")) :] if ep.mode == "continue" else None,
    )
    constraint = healing.constraint(engine, ep.heal)
    return Prepared(ep.prompt_ids, constraint, tracker, ep.draft_ids, ep.mode)


def _next_lines(after: str) -> tuple[str, ...]:
    """The first non-blank line after the cursor's line (what a completion must not
    write again), or nothing."""
    rest = after.split("\n", 1)
    if len(rest) < 2:
        return ()
    for line in rest[1].split("\n", 8)[:8]:
        if line.strip():
            return (line,)
    return ()


def single_line(text: str) -> str:
    """A single-line completion ends before its first line break."""
    return re.split(r"\r\n|\r|\n", text, maxsplit=1)[0]


def shape(text: str, multiline: bool, finish_reason: str) -> str:
    """The completion a client gets: one line, or whole lines.

    A multi-line completion cut short (``length``, or ``loop``: the daemon cut a
    repetition off) loses its unfinished last line and then any trailing lines that
    open a block (``:``, ``{``, ``(``, ``[``) with nothing inside it.
    """
    if not multiline:
        return single_line(text)
    if finish_reason not in ("length", "loop") or "\n" not in text:
        return text
    lines = text.split("\n")
    if finish_reason == "length":
        lines.pop()  # unfinished
    while len(lines) > 1 and (
        not lines[-1].strip() or lines[-1].rstrip().endswith((":", "{", "(", "["))
    ):
        lines.pop()
    return "\n".join(lines)


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
    mode: str = "auto",
    context_tokens: int | None = None,
) -> EditPrompt:
    """The prompt that regenerates ``text[start:end]``; ``draft`` is the old region or
    the caller's prediction. In every mode the model reads the draft right before it
    writes the region, so copying it is one n-gram lookup away. The prompt carries at
    most ``context_tokens`` tokens of surrounding code besides the draft (default: as
    much as the model's context holds).

    - ``fim`` (models with FIM tokens; ``auto`` picks it for them): prefix = text before
      the region + the draft + a line break (+ the instruction as a comment), middle =
      the new region, suffix = the text after it.
    - ``continue`` (``auto`` for the rest): the text before the region, the draft, the
      instruction as a comment, then the draft's first line again, healed; the model
      continues the rewrite. Ends at the code after the region or when the rewrite
      has as many lines at the region's indentation as the draft. A small instruct
      model (SmolLM2-135M) copies the draft this way and answers with prose through
      its chat template (measured: README, "Edits").
    - ``chat`` (asked for explicitly): the instruction, the surrounding code and the
      draft in one user turn of the model's chat template.
    """
    if mode not in EDIT_MODES:
        raise ProtocolError(BAD_PARAMS, f"mode must be one of {', '.join(EDIT_MODES)}")
    if mode == "auto":
        mode = "fim" if engine.fim is not None else "continue"
    budget = engine.max_length - max_tokens - 1
    draft_ids = engine.encode(draft)
    if context_tokens:
        budget = min(budget, context_tokens + 2 * len(draft_ids) + 64)
    if len(draft_ids) + 16 > budget:
        raise ProtocolError(BAD_PARAMS, "the region is too long for the model's context")
    chars = budget * CHARS_PER_TOKEN_CAP
    before = _head_text(text, start, chars)
    after = text[end : end + chars]
    if mode == "chat":
        return _chat_edit(engine, before, after, draft, draft_ids, instruction, budget)
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
    ids = _window_prefix(engine.encode(before + copy + note + lead), budget)
    ids, heal = heal_prompt(engine, ids)
    region = region_shape(draft) if draft.strip() else None
    # the answer is lead + what the model writes after the healed text
    return EditPrompt(ids, "continue", draft_ids, lead, heal, _next_lines("\n" + after), region)


def _fim_edit(
    engine: Any, prefix: str, after: str, draft_ids: list[int], budget: int
) -> EditPrompt:
    """A FIM edit prompt: ``prefix`` (the text before the region, the draft, the
    instruction) and the text after the region, within ``budget`` tokens."""
    prefix_ids = engine.encode(prefix)
    suffix_ids = engine.encode(after)
    room = budget - 3
    suf_room = min(len(suffix_ids), SUFFIX_TOKENS, room // 4)
    pre = _window_prefix(prefix_ids, room - suf_room)
    ids = fim_prompt(engine.fim, pre, suffix_ids[:suf_room], budget)
    return EditPrompt(ids, "fim", draft_ids)


def _chat_edit(
    engine: Any,
    before: str,
    after: str,
    draft: str,
    draft_ids: list[int],
    instruction: str,
    budget: int,
) -> EditPrompt:
    """The ``chat`` edit prompt: one user turn (see :func:`edit_prompt`)."""
    if not has_chat_template(engine):
        raise ProtocolError(BAD_PARAMS, "the model has no chat template")
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
