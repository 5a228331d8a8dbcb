"""The text tracker's rules about the code around the cursor: the suffix stop (the rest of
the cursor's line, the next line), the first line's indentation cap, and Markdown fences.

The suffix stop, precisely: with ``rest`` the text right of the cursor on its line
(whitespace at its ends aside), the completion's first line, once complete (a line break
or the end of the output), that ends with ``rest`` ends the completion before it (a space
before ``rest`` in the document is left to it); with ``stop_lines`` (the document's first
non-blank line after the cursor's line), a completed line equal to it (whitespace aside)
ends the completion before that line and the line break before it — the first line only
when the cursor's line is blank left of the cursor (``first_line_counts``).
"""

from __future__ import annotations

from codespec.daemon.text.tracker import TextTracker


def feed_text(tracker: TextTracker, engine, text: str, step: int = 2) -> tuple[str, bool]:
    """Feed ``text``'s tokens ``step`` at a time, then finish; what was sent, and whether
    a rule ended it."""
    ids = engine.encode(text)
    sent = ""
    for i in range(0, len(ids), step):
        piece, hit = tracker.feed(ids[i : i + step])
        sent += piece
        if hit:
            return sent, True
    piece, hit = tracker.feed([], final=True)
    return sent + piece, hit


def tracker(engine, **kw) -> TextTracker:
    return TextTracker(engine.tokenizer.backend_tokenizer, **kw)


def test_a_first_line_ending_with_the_rest_of_the_line_stops_before_it(engine):
    """``print(|)``: ``x)`` gives ``x``, whether a line break or the end closes the line;
    the tokens used reach through the rest."""
    t = tracker(engine, stop=["\n"], rest=")")
    sent, hit = feed_text(t, engine, "x)\nfoo()\n")
    assert hit and sent == t.text == "x"
    t = tracker(engine, rest=")")
    sent, hit = feed_text(t, engine, "a + b)")
    assert hit and sent == t.text == "a + b"
    t = tracker(engine, stop=["\n"], rest=")  ")  # trailing whitespace of the rest aside
    sent, hit = feed_text(t, engine, "f(y))\n")
    assert hit and sent == t.text == "f(y)"


def test_the_space_before_the_rest_is_left_to_it(engine):
    """``foo(a,| b)``: ``c, b)`` gives ``c,`` (the document's `` b)`` stays)."""
    t = tracker(engine, stop=["\n"], rest=" b)")
    sent, hit = feed_text(t, engine, "c, b)\n")
    assert hit and sent == t.text == "c,"


def test_a_first_line_not_ending_with_the_rest_is_kept_whole(engine):
    """The rest inside the line (not at its end) is no stop; nor is a later line ending
    with it."""
    t = tracker(engine, stop=["\n"], rest=")")
    sent, hit = feed_text(t, engine, "f(x) + 1\n")
    assert hit and sent == t.text == "f(x) + 1"
    t = tracker(engine, rest=")")
    sent, _ = feed_text(t, engine, "a = [\n    g(1)\n")
    assert sent == t.text == "a = [\n    g(1)\n"


def test_a_later_line_equal_to_the_next_line_stops_before_it(engine):
    """Multi-line: the completion reaches the document's next line and ends before it;
    on a blank cursor line the first line counts too (an empty completion)."""
    t = tracker(engine, stop_lines=["return x"], first_line_counts=True)
    sent, hit = feed_text(t, engine, "x = 1\n    return x\n    y = 2\n")
    assert hit and sent == t.text == "x = 1"
    t = tracker(engine, stop_lines=["return x"], first_line_counts=True)
    sent, hit = feed_text(t, engine, "    return x\n")
    assert hit and sent == t.text == ""
    t = tracker(engine, stop_lines=["return x"], first_line_counts=False)
    sent, _ = feed_text(t, engine, "return x\n")
    assert sent == t.text == "return x\n"


def test_the_first_line_keeps_at_most_max_indent_of_leading_whitespace(engine):
    """``def add(a, b):`` then 4 spaces and the cursor: ``    if a == b:`` gives
    ``if a == b:``; the next lines keep their indentation; nothing is sent while the
    first line is only whitespace; tokens used count the cut whitespace."""
    t = tracker(engine, max_indent=0)
    first = t.feed(engine.encode("    "))
    assert first == ("", False)
    sent, _ = feed_text(t, engine, "if a == b:\n        return a\n")
    assert t.text == "if a == b:\n        return a\n" and sent == t.text
    t = tracker(engine, max_indent=4)
    sent, _ = feed_text(t, engine, "        x = 1\n")
    assert sent == t.text == "    x = 1\n"
    t = tracker(engine, max_indent=0, stop=["\n"])
    sent, hit = feed_text(t, engine, "    return 1\nfoo\n")
    assert hit and sent == t.text == "return 1"
    assert t.tokens_used == len(engine.encode("    return 1\n"))


def test_a_markdown_fence_ends_the_text_before_it(engine):
    """A completion that starts with ```` ``` ```` is empty; a fence on a later line cuts
    there (what follows an instruct model's fence is prose)."""
    t = tracker(engine, stop=["\n"], fences=True)
    sent, hit = feed_text(t, engine, "```\n")
    assert hit and sent == t.text == ""
    t = tracker(engine, fences=True)
    sent, hit = feed_text(t, engine, "```python")
    assert hit and sent == t.text == ""
    t = tracker(engine, fences=True)
    sent, hit = feed_text(t, engine, "    return 1\n```\n\nThis function returns one.")
    assert hit and sent == t.text == "    return 1"
    t = tracker(engine, fences=False)  # Markdown documents: a fence is text
    sent, _ = feed_text(t, engine, "```\n")
    assert sent == "```\n"


def test_complete_help_states_the_default_token_caps():
    """``codespec complete --help`` says how many tokens a completion gets by default."""
    import argparse

    from codespec.daemon.cli import build_parser
    from codespec.daemon.prompts import limits

    sub = build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    complete = sub.choices["complete"]
    (action,) = [a for a in complete._actions if a.dest == "max_tokens"]
    assert not isinstance(action, argparse._HelpAction)
    assert f"default: {limits.LINE_TOKENS} for one line" in action.help
    assert f"{limits.BLOCK_TOKENS} with --multiline" in action.help
    assert limits.default_tokens(False) == limits.LINE_TOKENS > 16


def test_unwrap_drops_a_reply_s_opening_fence_and_ends_at_the_closing_one(engine):
    """A chat edit's reply: ```` ```python ```` on its first line is dropped, the closing
    fence and the prose after it are cut; a reply without a fence is kept."""
    t = tracker(engine, unwrap=True)
    sent, hit = feed_text(t, engine, "```python\nx = 1\ny = 2\n```\nThis sets x and y.")
    assert hit and sent == t.text == "x = 1\ny = 2"
    t = tracker(engine, unwrap=True)
    sent, _ = feed_text(t, engine, "x = 1\ny = 2\n")
    assert sent == t.text == "x = 1\ny = 2\n"
