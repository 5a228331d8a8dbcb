"""``codespec bench infill``: the request llama-server gets is llama.vim's split of the
same text codespec completes (the servers themselves run in the benchmark, not here)."""

from __future__ import annotations

from codespec.daemon.bench.infill import extra_chunks, first_line, split_cursor


def test_the_text_before_the_cursor_splits_into_lines_before_and_the_cursor_line():
    """input_prefix holds whole lines (each ending in a newline), prompt the cursor's
    line up to the cursor; together they are the text before the cursor."""
    prefix = "import os\n\ndef f(x):\n    return x"
    before, line = split_cursor(prefix, 256)
    assert (before, line) == ("import os\n\ndef f(x):\n", "    return x")
    assert before + line == prefix


def test_only_the_last_n_prefix_lines_go_to_llama_server():
    prefix = "".join(f"line{i}\n" for i in range(10)) + "x = "
    before, line = split_cursor(prefix, 3)
    assert before == "line7\nline8\nline9\n"
    assert line == "x = "


def test_a_cursor_on_the_first_line_has_no_lines_before_it():
    assert split_cursor("impo", 256) == ("", "impo")
    assert split_cursor("", 256) == ("", "")
    assert split_cursor("a\n", 256) == ("a\n", "")


def test_extra_chunks_are_the_middle_lines_of_the_first_documents():
    docs = [{"uri": f"file:///p/m{i}.py", "text": "\n".join(f"{i}:{k}" for k in range(100))}
            for i in range(3)]  # fmt: skip
    chunks = extra_chunks(docs, 2, lines=4)
    assert [c["filename"] for c in chunks] == ["m0.py", "m1.py"]
    assert chunks[0]["text"] == "0:48\n0:49\n0:50\n0:51\n"
    assert extra_chunks(docs, 0) == []


def test_first_line_skips_leading_newlines_and_trailing_space():
    assert first_line("\n  return x  \n    y") == "  return x"


def test_both_servers_see_the_same_window_of_the_file():
    """codespec opens exactly the text llama-server gets: n_prefix lines before the
    cursor's line, that line up to the cursor, then at most n_suffix lines after."""
    import argparse

    from codespec.daemon.bench.infill import window

    item = {
        "prefix": "".join(f"a{i}\n" for i in range(10)) + "x = ",
        "suffix": "1\n" + "".join(f"b{i}\n" for i in range(10)),
    }
    before, line, suffix = window(item, argparse.Namespace(n_prefix=2, n_suffix=3))
    assert (before, line, suffix) == ("a8\na9\n", "x = ", "1\nb0\nb1")
