"""Post-processing rules of the language server, one scenario per test (cursor shown as |)."""

from __future__ import annotations

import pytest

from codespec.lsp.postprocess import (
    CursorContext,
    Proposal,
    dedupe,
    fit_to_rest_of_line,
    process,
    truncate_block,
    wants_multiline,
)


def ctx_at(doc: str) -> CursorContext:
    """The context of the ``|`` in ``doc``."""
    offset = doc.index("|")
    text = doc.replace("|", "", 1)
    line = text.count("\n", 0, offset)
    column = offset - (text.rfind("\n", 0, offset) + 1)
    return CursorContext.from_lines(text.splitlines(keepends=True), line, column)


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ("def f(x):|\n", True),  # opens a block
        ("    |\n", True),  # blank line
        ("|", True),  # empty document
        ("items = [|\n", True),  # opens a bracket
        ("x = compute(|)\n", False),  # text right of the cursor
        ("    return x +|\n", False),  # mid-statement
    ],
)
def test_multiline_is_decided_by_context(doc: str, expected: bool) -> None:
    assert wants_multiline(ctx_at(doc)) is expected


def test_multiline_modes_override_context() -> None:
    mid = ctx_at("x = compute(|)\n")
    assert wants_multiline(mid, "always") is True
    assert wants_multiline(ctx_at("def f():|\n"), "never") is False


def test_block_ends_where_indentation_returns_to_the_def() -> None:
    ctx = ctx_at("def area(r):|\n")
    raw = "\n    return 3.14 * r * r\n\nprint(area(2))"
    assert truncate_block(raw, ctx) == "\n    return 3.14 * r * r"


def test_block_keeps_nested_blocks_inside_a_function_body() -> None:
    ctx = ctx_at("def f(xs):\n    |\n")
    raw = "for x in xs:\n        print(x)\n    return len(xs)\ndef g():\n    pass"
    assert truncate_block(raw, ctx) == "for x in xs:\n        print(x)\n    return len(xs)"


def test_top_level_stops_after_one_definition() -> None:
    ctx = ctx_at("|\n")
    raw = "def a():\n    return 1\n\ndef b():\n    return 2"
    assert truncate_block(raw, ctx) == "def a():\n    return 1"


def test_bracket_block_keeps_its_closing_line() -> None:
    ctx = ctx_at("CHOICES = [|\n")
    raw = '\n    "a",\n    "b",\n]\nprint(CHOICES)'
    assert truncate_block(raw, ctx) == '\n    "a",\n    "b",\n]'


def test_block_stops_before_repeating_the_next_line_of_the_document() -> None:
    ctx = ctx_at("def f(x):\n    y = x + 1|\n    return y\n")
    raw = "\n    y = y * 2\n    return y\n"
    assert truncate_block(raw, ctx) == "\n    y = y * 2"


def test_completion_that_only_repeats_the_next_line_is_dropped() -> None:
    ctx = ctx_at("def f(x):\n    |\n    return x\n")
    assert process("return x\n", ctx, multiline=True) is None


def test_single_line_cuts_at_the_first_newline() -> None:
    ctx = ctx_at("    total = |\n")
    assert process("a + b\n    return total", ctx, multiline=False) == Proposal("a + b")


def test_closing_text_right_of_the_cursor_is_not_repeated() -> None:
    ctx = ctx_at("print(area(|))\n")
    assert process("2))", ctx, multiline=False) == Proposal("2")


def test_completion_that_retypes_the_rest_of_line_replaces_it() -> None:
    assert fit_to_rest_of_line("a) + b", ")") == Proposal("a) + b", replaces_rest_of_line=True)


def test_completion_unrelated_to_the_rest_of_line_is_inserted_before_it() -> None:
    assert fit_to_rest_of_line("foo(", "x)") == Proposal("foo(")


def test_rest_of_line_with_leading_space_does_not_double_the_space() -> None:
    assert fit_to_rest_of_line("x )", " )") == Proposal("x")


def test_completion_equal_to_the_rest_of_line_is_dropped() -> None:
    ctx = ctx_at("f(|)\n")
    assert process(")", ctx, multiline=False) is None


@pytest.mark.parametrize("raw", ["", "   ", "\n\n", "\t\n  \n"])
def test_empty_and_whitespace_only_completions_are_dropped(raw: str) -> None:
    assert process(raw, ctx_at("def f():|\n"), multiline=True) is None
    assert process(raw, ctx_at("x = |\n"), multiline=False) is None


def test_trailing_whitespace_and_blank_lines_are_trimmed() -> None:
    ctx = ctx_at("def f():|\n")
    assert process("\n    return 1   \n\n\n", ctx, multiline=True) == Proposal("\n    return 1")


def test_max_lines_limits_a_multiline_item() -> None:
    ctx = ctx_at("def f():|\n")
    raw = "".join(f"\n    x{i} = {i}" for i in range(10))
    out = process(raw, ctx, multiline=True, max_lines=3)
    assert out is not None and out.text == "\n    x0 = 0\n    x1 = 1"


def test_dedupe_keeps_first_occurrence_order() -> None:
    a, b = Proposal("a"), Proposal("b")
    assert dedupe([a, None, b, Proposal("a"), Proposal("a", True)]) == [a, b, Proposal("a", True)]


def test_context_columns_are_python_characters_on_non_ascii_lines() -> None:
    ctx = CursorContext.from_lines(['s = "héllo😀" + x\n'], 0, len('s = "héllo😀" + '))
    assert ctx.before == 's = "héllo😀" + ' and ctx.after == "x"
