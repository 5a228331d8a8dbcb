"""Prompts and read-back for ``complete``; the ``edit`` side is :mod:`.edit` (its names are
importable from here too).

Owns: turning a document + cursor into a completion prompt whose start stays put while
the user types (so the engine's prefix cache is reused) — for a FIM model the file-level
or repository-level FIM layout (:mod:`.fim`), else the prefix left to right, healed —,
the rules that read the output back (the suffix stop, the first line's indentation,
fences: :class:`TextTracker`), and shaping the generated text.

Must not touch: the engine's decoding, sockets, the document store's state.
"""

from __future__ import annotations

import posixpath
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from codespec.daemon.errors import BAD_PARAMS, ProtocolError
from codespec.daemon.prompts import crossfile, fim
from codespec.daemon.prompts.edit import (  # noqa: F401 (the edit side, importable from here)
    EDIT_DRAFT,
    EDIT_MODES,
    EditPrompt,
    auto_mode,
    clean_edit,
    edit_prompt,
    prepare_edit,
    text_edits,
)
from codespec.daemon.prompts.parts import (
    ANCHOR_CHARS_PER_TOKEN,
    CHARS_PER_TOKEN_CAP,
    SUFFIX_TOKENS,
    OpenDocument,
    Prepared,
    RecentDocuments,
    anchors,
    next_lines,
    window_prefix,
)
from codespec.daemon.text import healing
from codespec.daemon.text.healing import heal_prompt
from codespec.daemon.text.protocols import TextModel
from codespec.daemon.text.tracker import TextTracker

LINE_HEAD_CHARS = 512  # the most line text a FIM middle starts with (more: it starts at the cursor)
# a "block" middle's lines before the cursor's, at least; and its grid (block_start)
BLOCK_LINES = 4
TOP_TOKENS = 32  # fewer prefix tokens: the top of a file (complete_prompt's top_uri)
FILE_SEP = "<file_sep>"  # StarCoder-style repository layout (SmolLM2's tokenizer has it)
MARKDOWN = ("markdown", "mdx", "quarto", "rmd")


@dataclass
class CompletionPrompt:
    """What ``complete`` feeds the engine, and how its output is read back.

    ``heal``: the text backed off the prompt's end (:mod:`.healing`); the output
    starts with it and it is not part of the completion. ``stop_lines``: the
    document's next non-blank line after the cursor; a completed line equal to it
    ends the completion (it reached the code after the cursor). ``first_line_counts``:
    whether the completion's first line may be such a line (the cursor's line is
    blank left of the cursor). ``snippets``: the cross-file context used. ``rest``: the
    text right of the cursor on its line (a first line ending with it stops before it);
    ``max_indent``: the most leading whitespace the first line keeps
    (:func:`indent_cap`). Both: :class:`TextTracker`. ``prefix_at`` / ``prefix_end``:
    where the prefix's ids start (after the head, which a file run begins with:
    :func:`file_runs`) and end.
    """

    prompt_ids: list[int]
    heal: str = ""
    stop_lines: tuple[str, ...] = ()
    first_line_counts: bool = False
    snippets: list[crossfile.Snippet] = field(default_factory=list)
    rest: str = ""
    max_indent: int | None = None
    prefix_at: int = 0
    prefix_end: int = 0


def file_label(uri: str) -> str:
    """A short path for a ``<file_sep>`` header: the last two parts of the URI's path."""
    path = urllib.parse.unquote(urllib.parse.urlparse(uri).path) if "://" in uri else uri
    parts = [p for p in path.replace("\\", "/").split("/") if p]
    return "/".join(parts[-2:]) or "untitled"


def _repo_layout(engine: TextModel) -> bool:
    """Whether the tokenizer has StarCoder-style ``<file_sep>`` (repository-level data).
    (One lookup: ``get_vocab()`` would copy the whole vocabulary on every keystroke.)"""
    return engine.tokenizer.backend_tokenizer.token_to_id(FILE_SEP) is not None


def complete_prompt(
    engine: TextModel,
    text: str,
    offset: int,
    max_tokens: int,
    context_tokens: int | None = None,
    uri: str = "",
    snippets: list[crossfile.Snippet] | None = None,
    heal: bool = True,
    top_uri: str = "",
    middle: str = "block",
    suffix_tokens: int = SUFFIX_TOKENS,
    block_lines: int = BLOCK_LINES,
) -> CompletionPrompt:
    """The prompt for a completion at ``offset`` of ``text``; a blank ``text`` gives an empty
    prompt (nothing to complete: the caller answers with an empty completion), as does an empty
    one below. FIM models get ``<prefix> P <suffix> S <middle> M`` (``M``: the middle's start,
    ``middle`` of :data:`MIDDLES`; ``block_lines``: a block middle's grid, :func:`block_start`).
    Models without FIM tokens get a left-to-right prompt: with ``<file_sep>`` in the vocabulary,
    the ``snippets`` of other files and then the current file, each under a ``<file_sep>path``
    header as repository-level training data is laid out; then the prefix, its last token backed
    off for healing (``heal``). The prefix starts at an anchor (:func:`_anchored_prefix`). The
    prompt holds at most ``context_tokens`` tokens (default: the model's whole context), leaving
    room for ``max_tokens``; snippets get at most a third of it. The suffix the model cannot see
    still ends the completion (``stop_lines``). ``top_uri``: the file, for a model without FIM
    tokens at the top of a file (under :data:`TOP_TOKENS` tokens before the cursor): it gets the
    ``<file_sep>path`` header (without it SmolLM2 answers ``import `` with prose).
    ``suffix_tokens``: the most a FIM prompt's suffix holds."""
    window = min(engine.max_length, context_tokens or engine.max_length)
    budget = min(window, engine.max_length - max_tokens - 1)
    if budget < 8:
        raise ProtocolError(BAD_PARAMS, f"max_tokens {max_tokens} leaves no room for a prompt")
    if not text.strip():
        return CompletionPrompt([])
    line_start = text.rfind("\n", 0, offset) + 1
    head_line = _middle_head(engine, text, line_start, offset, middle, block_lines)
    most = prefix_chars(engine, budget, bool(snippets), suffix_tokens)  # ends where M starts
    prefix_ids, fit = _anchored_prefix(engine, text, offset - len(head_line), most)
    after = text[offset : offset + budget * CHARS_PER_TOKEN_CAP]
    stops = next_lines(after)
    first_counts = not text[line_start:offset].strip()
    rules = {"rest": after.split("\n", 1)[0].rstrip("\r"),
             "max_indent": indent_cap(text, line_start, offset)}  # fmt: skip
    if engine.fim is not None:
        fim_args = (fit, after, budget, uri, snippets or [], engine.encode(head_line))
        ids, used, at, n = _fim_complete(engine, *fim_args, suffix_tokens)
        ids, healed = heal_prompt(engine, ids) if heal and head_line else (ids, "")
        return CompletionPrompt(ids, healed, stops, first_counts, used, **rules, prefix_at=at,
                                prefix_end=at + n)  # fmt: skip
    if not uri and top_uri and len(prefix_ids) < TOP_TOKENS:
        uri = top_uri
    head, used = _file_sep_head(engine, uri, snippets or [], budget)
    if not prefix_ids and not head:
        return CompletionPrompt([])  # nothing before the cursor to complete from
    pre = fit(budget - len(head))
    ids, healed = head + pre, ""
    if heal and prefix_ids:
        ids, healed = heal_prompt(engine, ids)
    return CompletionPrompt(ids, healed, stops, first_counts, used, **rules,
                            prefix_at=len(head), prefix_end=len(head) + len(pre))  # fmt: skip


def _anchored_prefix(
    engine: TextModel, text: str, end: int, most: int
) -> tuple[list[int], Callable[[int], list[int]]]:
    """The ids of the prefix ending at ``end`` from its anchor (:func:`~.parts.anchors`,
    ``most`` characters at most), and ``fit(room)``: those ids where they fit ``room``
    tokens, else the prefix from the first later anchor whose ids fit while filling a
    third of it (dense text), else the last ``room`` ids on the window grid (no run
    serves those)."""
    start, points = anchors(text, end, most)
    prefix_ids = engine.prefix_encoder.encode(text[start:end])

    def fit(room: int) -> list[int]:
        if len(prefix_ids) <= room:
            return prefix_ids
        for a in (p for p in points if start < p < end):
            ids = engine.encode(text[a:end])
            if len(ids) <= room:
                return ids if 3 * len(ids) >= room else window_prefix(prefix_ids, room)
        return window_prefix(prefix_ids, room)

    return prefix_ids, fit


def _middle_head(
    engine: TextModel, text: str, line_start: int, offset: int, middle: str, lines: int
) -> str:
    """The text a FIM prompt's middle starts with: with ``middle = "line"``, the cursor
    line's text left of the cursor (the prefix then stops at the line's start, so the
    prompt only grows while the user types on the line); with ``"block"``, that and the
    lines before it from :func:`block_start`'s. Nothing for a model without FIM tokens,
    with ``middle = "cursor"``, on a file's first line (an empty prefix would leave the
    model no cue to the language) or after more than :data:`LINE_HEAD_CHARS`.
    """
    if engine.fim is None or middle == "cursor" or line_start == 0:
        return ""
    if middle == "block":
        return text[block_start(text, line_start, offset, lines) : offset]
    return text[line_start:offset] if offset - line_start <= LINE_HEAD_CHARS else ""


def block_start(text: str, line_start: int, offset: int, lines: int = BLOCK_LINES) -> int:
    """Where a ``block`` middle starts for a cursor at ``offset`` on the line starting at
    ``line_start``: at least ``lines`` lines above the cursor's (fewer near the top of the
    file: never on the first line, which would leave the prefix empty), on a grid of
    ``lines`` lines, so Enter at a line's end appends to the prompt but one time in
    ``lines`` (the text after the cursor stays the same; with a ``line`` middle the prefix
    grows by the line and the whole suffix is fed again). Later line starts where the
    block's text holds more than :data:`LINE_HEAD_CHARS` characters; ``offset`` itself
    where even the cursor's line does.

    >>> text = "".join(f"l{i}\\n" for i in range(12))
    >>> [text[block_start(text, text.index(f"l{n}"), text.index(f"l{n}"), 4):].split()[0]
    ...  for n in (1, 4, 7, 8, 11)]
    ['l1', 'l1', 'l1', 'l4', 'l4']
    """
    n = text.count("\n", 0, line_start)
    first = max(1, (n - lines) // lines * lines) if n else 0
    start = line_start
    for _ in range(n - first):
        above = text.rfind("\n", 0, start - 1) + 1
        if offset - above > LINE_HEAD_CHARS:
            break
        start = above
    return start if offset - start <= LINE_HEAD_CHARS else offset


def prefix_chars(
    engine: TextModel, budget: int, snippets: bool, suffix_tokens: int = SUFFIX_TOKENS
) -> int:
    """A completion prefix's most characters (:func:`~.parts.anchors`): its room in
    tokens (the budget less the suffix's and, with snippets, their third) at
    :data:`~.parts.ANCHOR_CHARS_PER_TOKEN`. Set by the budget alone, so it does not move
    while the user types."""
    room = budget - (budget // 3 if snippets else 0)
    if engine.fim is not None:
        room -= suffix_tokens + 3
    return int(max(room, 16) * ANCHOR_CHARS_PER_TOKEN)


def file_runs(
    engine: TextModel, doc: OpenDocument, req: CompleteRequest, max_tokens: int = 0
) -> list[list[int]]:
    """The file runs of ``doc`` for completions like ``req`` (``context`` none or header;
    with crossfile snippets, whose choice follows the cursor, none): per anchor
    (:func:`~.parts.anchors`), the ids a prompt at the last line start it serves begins
    with, up to its prefix's end, so every prompt between that anchor and the next one's
    spots begins with the run's ids (but the last token or two of its prefix); the run
    at ``req.offset`` first, then the others by distance, while their tokens stay within
    ``max_tokens`` (0: all; the first always). Runs shorter than a third of a prefix's
    room are left out (a prompt's own warm-up covers them)."""
    if req.context == "crossfile" or not doc.text.strip():
        return []
    window = min(engine.max_length, req.context_tokens or engine.max_length)
    budget = min(window, engine.max_length - req.max_tokens - 1)
    if budget < 8:
        return []
    text, most = doc.text, prefix_chars(engine, budget, False, req.suffix_tokens)
    spans: list[tuple[int, int, int]] = []  # (distance from the cursor, anchor, end)
    for a in anchors(text, len(text), most)[1]:
        end = text.rfind("\n", a, min(len(text), a + most)) + 1  # the last line start
        if end - a >= most // 3 and anchors(text, end, most)[0] == a:
            spot = min(max(req.offset, a + most // 3), end)  # where its spots are nearest
            spans.append((abs(spot - req.offset), a, end))
    if not spans:
        return []
    # the head (and <|fim_prefix|>) every run begins with: it does not depend on the prefix
    uri = doc.uri if req.context != "none" else ""
    cp = complete_prompt(engine, text, spans[0][2], req.max_tokens, req.context_tokens,
                         uri=uri, heal=False, middle=req.middle,
                         suffix_tokens=req.suffix_tokens, block_lines=req.block_lines)  # fmt: skip
    head = cp.prompt_ids[: cp.prefix_at]
    # a prompt's prefix from an anchor holds at most this many tokens (a longer one
    # starts at a later anchor: complete_prompt's fit)
    room = budget - len(head) - (req.suffix_tokens + 3 if engine.fim is not None else 0)
    runs: list[list[int]] = []
    for _, a, end in sorted(spans):
        run = head + engine.encode(text[a:end])[:room]
        if runs and max_tokens and sum(map(len, runs)) + len(run) > max_tokens:
            break
        runs.append(run)
    return runs


def _file_sep_head(
    engine: TextModel, uri: str, snippets: list[crossfile.Snippet], budget: int
) -> tuple[list[int], list[crossfile.Snippet]]:
    """A left-to-right prompt's head where the tokenizer has ``<file_sep>`` and there is a
    file or snippets: each snippet (a third of ``budget`` at most) and then the current
    file under a ``<file_sep>path`` line; and the snippets used."""
    head: list[int] = []
    used: list[crossfile.Snippet] = []
    if not _repo_layout(engine) or not (uri or snippets):
        return head, used
    sep = engine.tokenizer.convert_tokens_to_ids(FILE_SEP)
    for snip in snippets:
        piece = engine.encode(f"{file_label(snip.uri)}\n{snip.text.rstrip()}\n")
        if len(head) + len(piece) + 1 > budget // 3:
            break
        head += [sep, *piece]
        used.append(snip)
    return [*head, sep, *engine.encode(f"{file_label(uri)}\n")], used


def _fim_complete(
    engine: TextModel,
    fit: Callable[[int], list[int]],
    after: str,
    budget: int,
    uri: str,
    snippets: list[crossfile.Snippet],
    middle_ids: list[int],
    suffix_tokens: int = SUFFIX_TOKENS,
) -> tuple[list[int], list[crossfile.Snippet], int, int]:
    """A FIM model's completion prompt (:func:`complete_prompt`): ``(ids, the snippets
    used, where the prefix's ids start, how many they are)``; ``fit(room)``: the
    prefix's ids in at most ``room`` tokens. ``middle_ids``: the middle's start, already
    written (the cursor line's text left of the cursor), after ``<|fim_middle|>``. With
    ``uri`` or ``snippets`` and a tokenizer that has the repository-level layout, the
    snippets (at most a third of the budget) and the current file's path come first
    (:func:`fim.repo_head`)."""
    head: list[int] = []
    used: list[crossfile.Snippet] = []
    if engine.fim.file_sep is not None and (uri or snippets):
        repo, path, paths = repo_paths(uri, [s.uri for s in snippets])
        files = [(p, s.text) for p, s in zip(paths, snippets, strict=True)]
        head, n = fim.repo_head(engine.fim, engine.encode, repo, files, path, budget // 3)
        used = snippets[:n]
    room = budget - len(head) - len(middle_ids)
    # the kept suffix tokens (at most suffix_tokens) come from its first characters; their
    # most, a quarter of the budget, does not follow the middle, which grows as the user
    # types (it did: at 512 tokens each few keystrokes cut the suffix by one, and the
    # suffix and middle were fed again), unless the prefix from its anchor would not fit
    # then (dense text): a quarter of the room the middle leaves, as before
    suffix_ids = engine.encode(after[: suffix_tokens * CHARS_PER_TOKEN_CAP])
    suf_room = min(len(suffix_ids), suffix_tokens, (budget - len(head) - 3) // 4)
    if len(fit(budget)) > room - 3 - suf_room:
        suf_room = min(len(suffix_ids), suffix_tokens, (room - 3) // 4)
    pre = fit(room - 3 - suf_room)
    ids = head + fim.fim_prompt(engine.fim, pre, suffix_ids[:suf_room], room) + middle_ids
    return ids, used, len(head) + 1, len(pre)


def _uri_path(uri: str) -> str:
    path = urllib.parse.unquote(urllib.parse.urlparse(uri).path) if "://" in uri else uri
    return path.replace("\\", "/")


def repo_paths(uri: str, others: list[str]) -> tuple[str, str, list[str]]:
    """``(repository name, the current file's path, the other files' paths)`` for the
    repository-level layout: the repository is the current file's folder; a path is
    relative to it where the file lies inside it, else its last two parts."""
    here = posixpath.dirname(_uri_path(uri))
    repo = posixpath.basename(here) or "project"

    def rel(u: str) -> str:
        path = _uri_path(u)
        if here and path.startswith(here.rstrip("/") + "/"):
            return path[len(here.rstrip("/")) + 1 :]
        return file_label(u)

    return repo, rel(uri) if uri else "untitled", [rel(u) for u in others]


CONTEXTS = ("none", "header", "crossfile")
# where a FIM prompt's middle starts: "block", lines above the cursor's on a grid
# (block_start); "line", the cursor line's start (the prompt grows as the user types on
# it); "cursor" (the prefix ends at the cursor; every keystroke re-feeds the suffix)
MIDDLES = ("block", "line", "cursor")


@dataclass(frozen=True, kw_only=True)
class CompleteRequest:
    """What a completion asks for besides its document (:func:`prepare_complete`).

    ``offset``: the cursor in the document's text; ``max_tokens``: the output the prompt
    leaves room for; ``multiline``: else the completion stops at a line break;
    ``context_tokens``: the prompt's most tokens (snippets get a third of it);
    ``context``: the layout, one of :data:`CONTEXTS` (``none``: the prefix alone,
    ``header``: under a ``<file_sep>path`` line, ``crossfile``: after snippets of the
    other recent documents); ``stop``: stop strings besides the line break; ``middle``:
    where a FIM prompt's middle starts, one of :data:`MIDDLES`; ``suffix_tokens``: the
    most suffix tokens a FIM prompt carries; ``block_lines``: a block middle's grid.
    """

    offset: int
    max_tokens: int
    multiline: bool
    context_tokens: int
    context: str = "none"
    stop: tuple[str, ...] = ()
    middle: str = "block"
    suffix_tokens: int = SUFFIX_TOKENS
    block_lines: int = BLOCK_LINES


def prepare_complete(
    engine: TextModel,
    documents: RecentDocuments,
    snippets: crossfile.SnippetCache,
    doc: OpenDocument,
    req: CompleteRequest,
) -> Prepared:
    """A completion ``req`` in the open document ``doc``: the prompt, the healing
    constraint, the stop rules (single-line completions stop at a line break).
    ``documents``: the open documents crossfile snippets come from.
    """
    context = req.context
    if context not in CONTEXTS:
        raise ValueError(f"context must be one of {', '.join(CONTEXTS)}")
    if req.middle not in MIDDLES:
        raise ValueError(f"middle must be one of {', '.join(MIDDLES)}")
    picked: list[crossfile.Snippet] = []
    if context == "crossfile":
        others = [(d.uri, d.version, d.text) for d in documents.recent(exclude=doc.uri)]
        # characters: about a third of the prompt's token budget
        picked = snippets.snippets(doc.uri, doc.text, req.offset, others, req.context_tokens)
    cp = complete_prompt(
        engine,
        doc.text,
        req.offset,
        req.max_tokens,
        req.context_tokens,
        uri=doc.uri if context != "none" else "",
        snippets=picked,
        top_uri=doc.uri,
        middle=req.middle,
        suffix_tokens=req.suffix_tokens,
        block_lines=req.block_lines,
    )
    stops = list(req.stop) if req.multiline else ["\n", "\r", *req.stop]
    tracker = TextTracker(
        engine.tokenizer.backend_tokenizer,
        cp.prompt_ids,
        stops,
        skip=cp.heal,
        stop_lines=cp.stop_lines,
        first_line_counts=cp.first_line_counts,
        cut_loops=True,
        rest=cp.rest,
        max_indent=cp.max_indent,
        fences=not _markdown(doc),
    )
    return Prepared(cp.prompt_ids, healing.constraint(engine, cp.heal), tracker)


def _markdown(doc: OpenDocument) -> bool:
    """Whether ``doc`` is Markdown, where a code fence is text, not the end of an answer."""
    language = (getattr(doc, "language", "") or "").lower()
    return language in MARKDOWN or doc.uri.lower().endswith((".md", ".markdown", ".mdx"))


def indent_cap(text: str, line_start: int, offset: int) -> int | None:
    """The most leading whitespace a completion's first line may add when the cursor
    stands after indentation only (else None): the line's indentation stays within the
    previous non-blank line's, one level deeper where that line opens a block or a
    bracket (a level: the indentation before the cursor beyond that line's, else a tab
    where it indents with tabs, else 4 spaces). ``def f():`` then a line holding 4
    spaces: 0 (a model writing ``    return`` there would give 8)."""
    before = text[line_start:offset]
    if not before or before.strip():
        return None
    prev, end = "", line_start - 1  # end: the line break before a line
    for _ in range(64):
        if end < 0:
            break
        start = text.rfind("\n", 0, end) + 1
        if text[start:end].strip():
            prev = text[start:end].rstrip("\r")
            break
        end = start - 1
    width = len(prev) - len(prev.lstrip(" \t"))
    if prev.rstrip().endswith((":", "(", "[", "{")):
        width += len(before) - width if len(before) > width else (1 if "\t" in prev else 4)
    return max(0, width - len(before))


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
