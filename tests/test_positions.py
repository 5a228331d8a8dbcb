"""LSP positions (UTF-16) <-> offsets, line endings, and incremental text changes."""

from __future__ import annotations

import random

import pytest

from codespec.ngram_index.positions import (
    LineIndex,
    PositionError,
    TextDocument,
    apply_changes,
    line_starts,
    offset_at,
    position_at,
)


def _pos(line: int, character: int) -> dict[str, int]:
    return {"line": line, "character": character}


def _change(s: dict[str, int], e: dict[str, int], text: str) -> dict:
    return {"range": {"start": s, "end": e}, "text": text}


def test_line_starts_treat_crlf_cr_and_lf_as_one_break_each() -> None:
    """\\r\\n is one line break, a lone \\r is one, \\n is one."""
    assert line_starts("a\r\nb\rc\nd") == [0, 3, 5, 7]
    assert line_starts("\r\n\r\n") == [0, 2, 4]
    assert line_starts("") == [0]


def test_utf16_surrogate_pairs_count_two() -> None:
    """An emoji is two UTF-16 code units: the character after it is at 3, offset 2."""
    text = "a😀b\nx"
    assert offset_at(text, _pos(0, 3)) == 2
    assert position_at(text, 2) == _pos(0, 3)
    assert offset_at(text, _pos(0, 1)) == 1
    # BMP multi-byte characters count one unit.
    assert offset_at("é中z", _pos(0, 2)) == 2


def test_character_past_line_end_is_clamped_before_the_terminator() -> None:
    """LSP: a character past the line's length defaults back to the line length."""
    text = "ab\r\ncd"
    assert offset_at(text, _pos(0, 99)) == 2
    assert offset_at(text, _pos(1, 99)) == 6


def test_positions_outside_the_document_raise_position_error() -> None:
    text = "ab\ncd"
    with pytest.raises(PositionError):
        offset_at(text, _pos(2, 0))
    with pytest.raises(PositionError):
        offset_at(text, _pos(-1, 0))
    with pytest.raises(PositionError):
        offset_at(text, {"line": 0})
    with pytest.raises(PositionError):
        offset_at("😀", _pos(0, 1))  # between the halves of a surrogate pair
    with pytest.raises(PositionError):
        apply_changes(text, [_change(_pos(1, 1), _pos(0, 1), "x")])  # end before start
    with pytest.raises(PositionError):
        position_at(text, 6)
    assert issubclass(PositionError, ValueError)


def test_apply_changes_in_order_and_full_replacement() -> None:
    """Each change applies to the result of the previous; a change without range replaces all."""
    text = "def f():\r\n    return 1\r\n"
    out = apply_changes(
        text,
        [
            _change(_pos(1, 11), _pos(1, 12), "2"),
            _change(_pos(0, 4), _pos(0, 5), "g😀"),
            _change(_pos(0, 7), _pos(0, 7), "x"),  # after "g😀" (3 units) + "(": 4+3=7
        ],
    )
    assert out == "def g😀x():\r\n    return 2\r\n"
    assert apply_changes(text, [{"text": "new"}]) == "new"


def test_line_index_updates_equal_a_fresh_table_across_random_edits() -> None:
    """Random edits, including ones that split or join \\r\\n pairs, keep the line table exact."""
    rng = random.Random(7)
    pieces = ["\r", "\n", "\r\n", "a", "é", "😀", " ", "bc"]
    doc = TextDocument("x\r\ny\rz\n")
    for _ in range(2000):
        text = doc.text
        s = rng.randrange(len(text) + 1)
        e = min(len(text), s + rng.choice([0, 0, 1, 2, 3]))
        new = "".join(rng.choice(pieces) for _ in range(rng.choice([0, 1, 2, 3])))
        doc.replace(s, e, new)
        assert doc.text == text[:s] + new + text[e:]
        assert doc.lines.starts.tolist() == line_starts(doc.text)
    fresh = LineIndex(doc.text)
    for off in range(len(doc.text) + 1):
        pos = fresh.position(doc.text, off)
        back = fresh.offset(doc.text, pos)
        # Offsets inside a line terminator map to the end of their line.
        assert back == off or doc.text[back:off].strip("\r\n") == ""
