"""Qwen2.5-Coder's prompt layouts, token for token, with its real tokenizer (skipped where
the model is not on the machine) over a tiny random Qwen2: the file-level FIM prompt
(``context = "none"``), the repository-level one with the current file's path
(``header``) and with the other open files' snippets (``crossfile``), the stop tokens,
and edits through the chat template with the old text as the draft."""

from __future__ import annotations

import itertools

import pytest
import torch
from qwen_local import qwen_dir

from codespec.daemon.prompts import completion
from codespec.daemon.prompts.crossfile import SnippetCache
from codespec.daemon.service.documents import DocumentStore
from conftest import copy_tokenizer

FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD = 151659, 151660, 151661, 151662
REPO_NAME, FILE_SEP, ENDOFTEXT, IM_END = 151663, 151664, 151643, 151645

OTHER = "".join(f"def helper_{i}(value):\n    return value * {i}\n\n" for i in range(6))
TEXT = (
    "from util import helper_2\n\n\ndef total(values):\n    result = 0\n"
    "    for value in values:\n        result += helper_2(value)\n    return result\n"
)
CURSOR = TEXT.index("    return result")


@pytest.fixture(scope="module")
def qwen_tiny(request, tmp_path_factory):
    """A tiny random Qwen2 with Qwen2.5-Coder's tokenizer files and chat template."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from codespec.daemon.engine.engine import Engine

    folder = copy_tokenizer(qwen_dir(request), tmp_path_factory.mktemp("qwen_tiny"))
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip
    Qwen2ForCausalLM(cfg).eval().save_pretrained(folder)
    return Engine(folder, device="cpu")


def ids_of(engine, layout: str) -> list[int]:
    """The tokenizer's own ids of a layout written out (special tokens as their text)."""
    return engine.tokenizer.encode(layout, add_special_tokens=False)


def prepared(engine, context: str, others=(), text=TEXT, cursor=CURSOR, middle="line", **kw):
    store = DocumentStore()
    for uri, other in others:
        store.open(uri, other, 1, "python")
    doc = store.open("file:///home/u/shop/cart.py", text, 1, "python")
    req = completion.CompleteRequest(
        offset=cursor,
        max_tokens=16,
        multiline=False,
        context_tokens=1024,
        context=context,
        middle=middle,
        **kw,
    )
    return completion.prepare_complete(engine, store, SnippetCache(), doc, req)


def prompt(engine, context: str, others=()) -> list[int]:
    return prepared(engine, context, others).prompt_ids


def test_the_fim_tokens_and_the_stops_are_qwens(qwen_tiny):
    fim = qwen_tiny.fim
    assert (fim.prefix, fim.suffix, fim.middle) == (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)
    assert (fim.repo, fim.file_sep) == (REPO_NAME, FILE_SEP)
    assert {ENDOFTEXT, FIM_PAD, FILE_SEP, IM_END} <= qwen_tiny.stop_ids


def test_file_level_fim_prompt(qwen_tiny):
    ids = prompt(qwen_tiny, "none")
    layout = f"<|fim_prefix|>{TEXT[:CURSOR]}<|fim_suffix|>{TEXT[CURSOR:]}<|fim_middle|>"
    assert ids == ids_of(qwen_tiny, layout)
    assert ids[0] == FIM_PREFIX and ids[-1] == FIM_MIDDLE and FIM_SUFFIX in ids


def test_repository_level_prompt_with_the_current_path(qwen_tiny):
    ids = prompt(qwen_tiny, "header")
    layout = (
        "<|repo_name|>shop\n<|file_sep|>cart.py\n"
        f"<|fim_prefix|>{TEXT[:CURSOR]}<|fim_suffix|>{TEXT[CURSOR:]}<|fim_middle|>"
    )
    assert ids == ids_of(qwen_tiny, layout)
    assert ids[:1] == [REPO_NAME] and ids.count(FILE_SEP) == 1


def test_repository_level_prompt_with_other_files(qwen_tiny):
    """The other open file's chunk under its path (relative to the repository, the
    current file's folder; another folder's file by its last two parts), then the
    current file's path and the FIM prompt."""
    others = [("file:///home/u/shop/util.py", OTHER), ("file:///home/u/lib/x/far.py", OTHER)]
    ids = prompt(qwen_tiny, "crossfile", others)
    assert ids[0] == REPO_NAME and ids.count(FILE_SEP) >= 2
    text = qwen_tiny.tokenizer.decode(ids)
    head, fim_part = text.split("<|fim_prefix|>")
    assert head.startswith("<|repo_name|>shop\n<|file_sep|>")
    assert head.endswith("<|file_sep|>cart.py\n")
    files = head.split("<|file_sep|>")[1:-1]
    assert files and all(f.split("\n", 1)[0] in ("util.py", "x/far.py") for f in files)
    assert all(f.split("\n", 1)[1] in OTHER.rstrip() + "\n" for f in files)
    assert ids == ids_of(qwen_tiny, text)  # the tokenizer's own ids of that layout
    assert fim_part == f"{TEXT[:CURSOR]}<|fim_suffix|>{TEXT[CURSOR:]}<|fim_middle|>"


def test_inside_a_line_the_middle_starts_at_the_line(qwen_tiny):
    """The cursor after ``    return res``: the prefix ends at the line's start, the
    line's text left of the cursor follows ``<|fim_middle|>``, its last token backed off
    for healing (the output starts with it); ``middle = "cursor"``: the prefix ends at the
    cursor, nothing healed."""
    line_start = TEXT.index("    return result")
    cursor = line_start + len("    return res")
    prep = prepared(qwen_tiny, "none", cursor=cursor)
    layout = f"<|fim_prefix|>{TEXT[:line_start]}<|fim_suffix|>{TEXT[cursor:]}<|fim_middle|>"
    head = qwen_tiny.tokenizer.encode(TEXT[line_start:cursor], add_special_tokens=False)
    assert prep.prompt_ids == ids_of(qwen_tiny, layout) + head[:-1]
    healed = qwen_tiny.tokenizer.decode(head[-1:])
    assert TEXT[line_start:cursor].endswith(healed) and prep.constraint is not None
    out = prep.tracker.feed(qwen_tiny.encode(healed + "ult_total\n"), final=True)[0]
    assert out == "ult_total"  # the healed text is not part of the completion
    old = prepared(qwen_tiny, "none", cursor=cursor, middle="cursor")
    layout = f"<|fim_prefix|>{TEXT[:cursor]}<|fim_suffix|>{TEXT[cursor:]}<|fim_middle|>"
    assert old.prompt_ids == ids_of(qwen_tiny, layout) and old.constraint is None


def test_typing_on_a_line_only_appends_to_the_prompt(qwen_tiny):
    """Each keystroke of ``    return result`` keeps the prompt through
    ``<|fim_middle|>`` and the middle's tokens but the last two: the prefix cache
    re-feeds a token or two, not the suffix. The first line of a file has no prefix to
    end at its start: the cursor layout there (an empty prefix leaves Qwen guessing the
    language)."""
    line_start = TEXT.index("    return result")
    typed = "    return result"
    prompts = []
    for n in range(5, len(typed) + 1):
        text = TEXT[:line_start] + typed[:n] + "\n"
        prompts.append(prepared(qwen_tiny, "none", text=text, cursor=line_start + n).prompt_ids)
    for before, after in itertools.pairwise(prompts):
        mid = before.index(FIM_MIDDLE)
        assert after[: mid + 1] == before[: mid + 1]
        pairs = enumerate(zip(before, after, strict=False))
        common = next((i for i, (a, b) in pairs if a != b), len(before))
        assert len(after) - common <= 2, (before[mid:], after[mid:])
    first = prepared(qwen_tiny, "none", text="import \n", cursor=7).prompt_ids
    assert first == ids_of(qwen_tiny, "<|fim_prefix|>import <|fim_suffix|>\n<|fim_middle|>")


def test_the_repo_paths_of_uris():
    repo, here, paths = completion.repo_paths(
        "file:///w/proj/pkg/a.py", ["file:///w/proj/pkg/sub/b.py", "file:///elsewhere/x/c.py"]
    )
    assert (repo, here, paths) == ("pkg", "a.py", ["sub/b.py", "x/c.py"])


def test_an_edit_goes_through_the_chat_template_with_the_old_text_as_draft(qwen_tiny):
    """``auto`` picks ``chat`` for a code model with FIM tokens and a chat template: one
    user turn holding the instruction and the old region, which is also the draft the
    proposers copy; the reply begins inside a fence whose closing ends it, and it ends
    with the old region's line break."""
    start = TEXT.index("def total")
    old = TEXT[start:]
    ep = completion.edit_prompt(qwen_tiny, TEXT, start, len(TEXT), old, "rename result",
                                "python", 64)  # fmt: skip
    assert ep.mode == "chat" and ep.draft_ids == qwen_tiny.encode(old)
    rendered = qwen_tiny.tokenizer.decode(ep.prompt_ids)
    assert rendered.startswith("<|im_start|>system\n")
    user = f"<|im_start|>user\nrename result\n\n```python\n{old}```<|im_end|>\n"
    assert rendered.endswith(f"{user}<|im_start|>assistant\n```python\n")
    assert ep.prompt_ids == ids_of(qwen_tiny, rendered)
    prep = completion.prepare_edit(qwen_tiny, ep, old)
    reply = "def total(values):\n    return sum(values)\n```\nThis sums them."
    piece, hit = prep.tracker.feed(qwen_tiny.encode(reply), final=True)
    assert hit and piece == prep.tracker.text == "def total(values):\n    return sum(values)\n"


def test_the_suffix_holds_at_most_suffix_tokens_from_its_start(qwen_tiny):
    """``suffix_tokens`` caps the text after the cursor a FIM prompt carries (its first
    tokens; the prefix and the middle as they were), and the daemon's config sets it."""
    from codespec.daemon.config import load_config

    text = TEXT + "".join(f"\n\ndef after_{i}(x):\n    return x + {i}\n" for i in range(40))
    fim = qwen_tiny.fim
    for n in (8, 32):
        ids = prepared(qwen_tiny, "none", text=text, suffix_tokens=n).prompt_ids
        suffix = ids[ids.index(fim.suffix) + 1 : ids.index(fim.middle)]
        assert len(suffix) == n
        assert qwen_tiny.decode(suffix) == qwen_tiny.decode(
            qwen_tiny.encode(text[CURSOR : CURSOR + 40 * n])[:n]
        )
    longer = prepared(qwen_tiny, "none", text=text, suffix_tokens=64).prompt_ids
    assert len(longer) > len(ids)
    assert load_config(None, {"completion": {"suffix_tokens": 256}}).completion.suffix_tokens == 256


BODY = "def run(items):\n" + "".join(f"    step_{i} = items[{i}] + {i}\n" for i in range(14))


def test_a_block_middle_starts_on_the_grid_and_holds_four_to_seven_lines(qwen_tiny):
    """``middle = "block"`` (the default): the prefix ends at the start of the line 4 to
    7 lines above the cursor's (on a grid of 4; the second line near the top), and those
    lines and the cursor line's head follow ``<|fim_middle|>``, the last token healed."""
    assert completion.CompleteRequest(offset=0, max_tokens=1, multiline=False,
                                      context_tokens=64).middle == "block"  # fmt: skip
    lines = BODY.splitlines(keepends=True)
    for n, first in [(2, 1), (5, 1), (8, 4), (11, 4), (12, 8)]:
        line_start = sum(map(len, lines[:n]))
        cursor = line_start + len("    step_")
        start = sum(map(len, lines[:first]))
        prep = prepared(qwen_tiny, "none", text=BODY, cursor=cursor, middle="block",
                        block_lines=4, suffix_tokens=512)  # all the text after it  # fmt: skip
        layout = f"<|fim_prefix|>{BODY[:start]}<|fim_suffix|>{BODY[cursor:]}<|fim_middle|>"
        head = ids_of(qwen_tiny, BODY[start:cursor])
        assert prep.prompt_ids == ids_of(qwen_tiny, layout) + head[:-1], n
        assert BODY[start:cursor].endswith(qwen_tiny.tokenizer.decode(head[-1:]))


@pytest.mark.parametrize("grid", [4, 8])
def test_enter_at_a_line_end_appends_to_a_block_prompt_but_once_a_block(qwen_tiny, grid):
    """Enter at the end of line ``n`` (the text after the cursor does not change): with a
    ``block`` middle the new prompt keeps the old one but its last token or two, unless
    the new line starts a block (every ``block_lines``-th, from the second block on);
    with a ``line`` middle the prefix grows by the line and everything after it is fed
    again."""
    body = "def run(items):\n" + "".join(f"    s_{i} = items[{i}] + {i}\n" for i in range(30))
    lines = body.splitlines(keepends=True)
    appended = []
    for n in range(4, 29):
        end = sum(map(len, lines[: n + 1])) - 1  # the end of line n, before its break
        entered = body[:end] + "\n    " + body[end:]
        for middle in ("block", "line"):
            kw = {"middle": middle, "block_lines": grid}
            before = prepared(qwen_tiny, "none", text=body, cursor=end, **kw)
            after = prepared(qwen_tiny, "none", text=entered, cursor=end + 5, **kw)
            b, a = before.prompt_ids, after.prompt_ids
            pairs = enumerate(zip(b, a, strict=False))
            common = next((i for i, (x, y) in pairs if x != y), len(b))
            if middle == "block":
                appended.append((n + 1, len(b) - common <= 2))
            else:
                assert common <= b.index(FIM_SUFFIX), n  # the suffix is fed again
    assert appended == [(m, m % grid != 0 or m < 2 * grid) for m in range(5, 30)]


def test_the_config_sets_the_block_grid_and_refuses_a_bad_one():
    """``[completion] block_lines``: the grid the daemon's requests use; 0 or a word is a
    clear error naming the setting."""
    from codespec.daemon.config import ConfigError, load_config

    assert load_config(None, {"completion": {"block_lines": 8}}).completion.block_lines == 8
    for bad in (0, "eight"):
        with pytest.raises(ConfigError, match="block_lines"):
            load_config(None, {"completion": {"block_lines": bad}})


def test_at_a_small_budget_typing_and_enter_keep_the_suffix(qwen_tiny):
    """At a 512-token budget the suffix's most tokens (a quarter of it) do not follow the
    block middle, which grows with every keystroke: each keystroke of a line, and Enter at
    its end, keeps the prompt but its last token or two (the suffix was cut by one token
    every few keystrokes, and the suffix and middle fed again)."""
    body = "".join(f"def f_{i}(values):\n    return [v * {i} for v in values]\n\n"
                   for i in range(60))  # fmt: skip
    at = body.index("def f_30")
    typed = "def fresh(values, scale):"
    texts = [(body[:at] + typed[:n] + "\n" + body[at:], at + n) for n in range(len(typed) + 1)]
    end = at + len(typed)
    texts.append((body[:at] + typed + "\n    " + "\n" + body[at:], end + 5))  # Enter
    store = DocumentStore()
    prompts = []
    for text, cursor in texts:
        doc = store.open("file:///home/u/long.py", text, 1, "python")
        req = completion.CompleteRequest(offset=cursor, max_tokens=16, multiline=False,
                                         context_tokens=512)  # fmt: skip
        ids = completion.prepare_complete(qwen_tiny, store, SnippetCache(), doc, req).prompt_ids
        assert len(ids) <= 512 and ids.count(FIM_SUFFIX) == 1
        prompts.append(ids)
    suffixes = {len(p[p.index(FIM_SUFFIX) : p.index(FIM_MIDDLE)]) for p in prompts}
    assert len(suffixes) == 1 and 64 < suffixes.pop() <= 128
    for before, after in itertools.pairwise(prompts):
        pairs = enumerate(zip(before, after, strict=False))
        common = next((i for i, (a, b) in pairs if a != b), len(before))
        assert len(before) - common <= 2, (before[common - 3 :], after[common - 3 :])
