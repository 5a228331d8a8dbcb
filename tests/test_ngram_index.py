"""NgramIndex: incremental edits equal a fresh build, ranked lookup, eviction, save/load."""

from __future__ import annotations

import functools
import random
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from codespec.ngram_index import NgramIndex, PositionError, TextDocument, TokenizerMismatch
from codespec.ngram_index.index import gram_keys

STDLIB = Path(sysconfig.get_paths()["stdlib"])
EXTRA = "x = 'é中😀'\r\nprint('é中😀')\r\n# naïve 中文 😀😀\n"


@functools.cache
def make_tokenizer(vocab_size: int = 700) -> Any:
    """A tiny byte-level BPE (train_data.train_tokenizer: FIM specials at 0..4)."""
    from codespec.daemon.training.train_data import train_tokenizer

    texts = [(STDLIB / name).read_text()[:40_000] for name in ("ast.py", "textwrap.py")]
    return train_tokenizer([*texts, EXTRA * 20], vocab_size)


@pytest.fixture(scope="module")
def tok() -> Any:
    return make_tokenizer()


def ids(tok: Any, text: str) -> list[int]:
    return tok.encode(text).ids


def assert_fresh(idx: NgramIndex, uri: str) -> None:
    """The incremental state of ``uri`` equals a from-scratch build of its text."""
    d = idx._docs[uri]
    enc = idx.tokenizer.encode(d.doc.text)
    assert d.tokens.tolist() == enc.ids
    assert d.starts.tolist() == [o[0] for o in enc.offsets]
    keys = d.keys if d.keys is not None else gram_keys(d.tokens, idx.min_n)
    assert keys.tolist() == gram_keys(np.asarray(enc.ids), idx.min_n).tolist()
    assert d.doc.lines.starts.tolist() == TextDocument(d.doc.text).lines.starts.tolist()


def edit(line: int, char: int, end_line: int, end_char: int, text: str) -> dict[str, Any]:
    start = {"line": line, "character": char}
    end = {"line": end_line, "character": end_char}
    return {"range": {"start": start, "end": end}, "text": text}


def utf16_position(text: str, offset: int) -> dict[str, int]:
    """Independent reference: LSP position of a code-point offset."""
    line = 0
    line_start = 0
    i = 0
    while i < offset:
        ch = text[i]
        if ch == "\n" or (ch == "\r" and (i + 1 >= len(text) or text[i + 1] != "\n")):
            line += 1
            line_start = i + 1
        i += 1
    units = sum(2 if ord(c) > 0xFFFF else 1 for c in text[line_start:offset])
    return {"line": line, "character": units}


PIECES = [
    "é", "中", "😀", "\r\n", "\r", "\n", " ", "  ", "    ", "\t", "x", "def ", "(", ")",
    "'s", "1", "0.5", "return ", "<|endoftext|>", "\u00a0", "ab", ":", ",", "self.", "#",
]  # fmt: skip


def random_insert(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.choice([0, 1, 1, 1, 2, 3, 6])))


def random_changes(rng: random.Random, text: str) -> tuple[list[dict], str]:
    """One to three random LSP range changes of ``text`` and the text after them."""
    changes, expected = [], text
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        s = rng.randrange(len(expected) + 1)
        e = min(len(expected), s + rng.choice([0, 0, 1, 1, 2, 4, 12]))
        new = random_insert(rng) if len(expected) > 400 else random_insert(rng) * 8
        start, end = utf16_position(expected, s), utf16_position(expected, e)
        changes.append({"range": {"start": start, "end": end}, "text": new})
        # An offset inside "\r\n" maps to the line's end, before the "\r".
        s2 = TextDocument(expected).offset_at(start)
        e2 = TextDocument(expected).offset_at(end)
        expected = expected[:s2] + new + expected[e2:]
    return changes, expected


def test_random_edits_equal_a_fresh_build(tok: Any) -> None:
    """Seeded random LSP edits (multi-byte, surrogate pairs, CRLF, lone CR, specials):
    after every edit tokens, offsets, n-gram keys and lookups equal a fresh build."""
    rng = random.Random(1234)
    base = (STDLIB / "textwrap.py").read_text()[:1500]
    idx = NgramIndex(tok, max_n=6, min_n=2)
    idx.open("file:///a.py", base.replace("\n", "\r\n", 5) + EXTRA)
    idx.open("file:///b.py", base[200:900], kind="workspace")
    idx.compact()  # the first edit must take a frozen document out of the segment
    for step in range(1500):
        text = idx.text("file:///a.py")
        if step % 250 == 249:
            changes: list[dict] = [{"text": text[: len(text) // 2] + random_insert(rng)}]
            expected = changes[0]["text"]
        else:
            changes, expected = random_changes(rng, text)
        idx.change("file:///a.py", changes)
        assert idx.text("file:///a.py") == expected
        assert_fresh(idx, "file:///a.py")
        if step % 100 == 0:
            fresh = NgramIndex(tok, max_n=6, min_n=2)
            fresh.open("file:///a.py", expected)
            fresh.open("file:///b.py", base[200:900], kind="workspace")
            toks = ids(tok, expected)
            for cut in rng.sample(range(2, len(toks)), min(10, len(toks) - 2)):
                got = idx.lookup(toks[:cut], uri="file:///a.py")
                want = fresh.lookup(toks[:cut], uri="file:///a.py")
                assert got == want


def test_change_on_a_frozen_document_updates_lookup(tok: Any) -> None:
    """After compaction, an edited document's old text is no longer found, its new text is."""
    idx = NgramIndex(tok, max_n=4, min_n=2)
    idx.open("file:///a.py", "alpha = beta_gamma()\nx = 1\n")
    idx.open("file:///c.py", "unrelated = 2\n")
    idx.compact()
    ctx = ids(tok, "alpha =")
    assert idx.lookup(ctx, uri="file:///c.py")[0].tokens[:2] == ids(tok, " beta_gamma")[:2]
    idx.change("file:///a.py", [edit(0, 8, 0, 18, "delta_omega")])
    assert idx.text("file:///a.py") == "alpha = delta_omega()\nx = 1\n"
    cands = idx.lookup(ctx, uri="file:///c.py")
    assert [c.tokens[:2] for c in cands] == [ids(tok, " delta_omega")[:2]]
    assert_fresh(idx, "file:///a.py")


def test_compaction_keeps_every_document_findable(tok: Any) -> None:
    """Compacting while the current document sits in the old segment loses no other document."""
    idx = NgramIndex(tok, max_n=4, min_n=2)
    for name in ("a", "b", "c"):
        idx.open(f"file:///{name}.py", f"value_{name} = compute_{name}()\n", kind="workspace")
    idx.compact()
    idx.touch("file:///a.py")
    idx.compact()  # a.py leaves the segment, b.py and c.py are rebuilt into a new one
    assert idx.incremental
    for name in ("a", "b", "c"):
        cands = idx.lookup(ids(tok, f"value_{name} ="), uri="file:///a.py")
        assert tok.decode(cands[0].tokens).startswith(f" compute_{name}")


@pytest.mark.parametrize("frozen", [False, True], ids=["loose", "frozen"])
def test_lookup_ranks_document_then_open_then_workspace(tok: Any, frozen: bool) -> None:
    """The current document first (latest occurrence first), then open, then workspace;
    alike whether the documents are loose (being edited) or in the frozen segment."""
    idx = NgramIndex(tok, max_n=6, min_n=2)
    idx.open("file:///cur.py", "result = compute(first)\nresult = compute(second)\n")
    idx.open("file:///other.py", "result = compute(third)\n")
    idx.open("file:///ws.py", "result = compute(fourth)\n", kind="workspace")
    if frozen:
        idx.compact()
        assert idx.stats()["loose_documents"] == 0
    ctx = ids(tok, "\nresult = compute(")
    cands = idx.lookup(ctx, uri="file:///cur.py", k=6, b=8)
    text = [tok.decode(c.tokens) for c in cands]
    assert [c.source for c in cands] == ["document", "document", "open", "workspace"]
    assert [t.split(")")[0] for t in text] == ["second", "first", "third", "fourth"]
    assert [c.uri for c in cands][2:] == ["file:///other.py", "file:///ws.py"]
    assert all(c.n >= 2 and c.count == 1 for c in cands)
    assert cands[0].score == pytest.approx(0.5)
    # b caps the number of candidates; k caps their length.
    assert len(idx.lookup(ctx, uri="file:///cur.py", k=2, b=2)) == 2
    assert all(len(c.tokens) <= 2 for c in idx.lookup(ctx, uri="file:///cur.py", k=2, b=8))
    # Another document as current: ranking follows.
    assert idx.lookup(ctx, uri="file:///ws.py", k=3)[0].source == "document"


def test_the_cpp_lookup_gives_the_numpy_lookups_candidates(tok: Any, monkeypatch) -> None:
    """Seeded random documents (open and workspace, frozen and loose, edited, touched,
    closed) and contexts (from the documents and random ids, several ``k``, ``b``,
    ``min_n``, current documents): every lookup in C++ equals the numpy path's."""
    from codespec.ngram_index import native

    if not native.available():
        pytest.skip("no C++ compiler")
    rng = random.Random(11)
    source = (STDLIB / "textwrap.py").read_text()[:6000]
    idx = NgramIndex(tok, max_n=8, min_n=2, loose_docs_limit=3)
    names = [f"file:///d{i}.py" for i in range(7)]
    for i, name in enumerate(names):
        a = rng.randrange(0, 4000)
        idx.open(name, source[a : a + 1500], kind="open" if i % 3 else "workspace")
    toks = ids(tok, source)
    checked = 0
    for step in range(120):
        name = rng.choice(names)
        if step % 10 == 3 and name in idx:
            idx.compact()
        elif step % 10 == 6 and name in idx:
            text = idx.text(name)
            idx.change(name, [{"text": text[: len(text) // 2] + random_insert(rng)}])
        elif step % 29 == 28:
            idx.close(name)
        else:
            idx.touch(name) if name in idx else idx.open(name, source[:900])
        for _ in range(6):
            if rng.random() < 0.8:
                cut = rng.randrange(3, len(toks))
                ctx = toks[max(0, cut - 12) : cut]
            else:
                ctx = [rng.randrange(0, 700) for _ in range(rng.randrange(2, 10))]
            args = dict(uri=rng.choice([*names, None]), k=rng.choice([1, 4, 16]),
                        b=rng.choice([1, 4, 8]), min_n=rng.choice([2, 3]))  # fmt: skip
            monkeypatch.setenv("CODESPEC_INDEX_LOOKUP", "numpy")
            want = idx.lookup(ctx, **args)
            monkeypatch.delenv("CODESPEC_INDEX_LOOKUP")
            assert idx.lookup(ctx, **args) == want
            checked += bool(want)
    assert checked > 200  # most contexts found something


def test_lookups_read_the_most_recently_used_documents_first_frozen_or_loose(tok: Any) -> None:
    """Seeded random touches of documents sharing a line: within a tier the latest used
    document's continuation comes first, and an index whose documents sit in the frozen
    segment (tiers and recency read from its per-document arrays) answers every lookup as
    one whose documents are all loose (each document asked)."""
    rng = random.Random(7)
    names = [f"file:///m{i}.py" for i in range(6)]
    kinds = ["open", "workspace", "open", "open", "workspace", "open"]
    texts = [
        f"total = compute(arg{i})\nvalue_{i} = {i}\ntotal = compute(more{i})\n" for i in range(6)
    ]
    loose = NgramIndex(tok, max_n=6, min_n=2, loose_docs_limit=100)
    frozen = NgramIndex(tok, max_n=6, min_n=2)
    for idx in (loose, frozen):
        for name, kind, text in zip(names, kinds, texts, strict=True):
            idx.open(name, text, kind=kind)  # type: ignore[arg-type]
    frozen.compact()
    assert loose.stats()["loose_documents"] == 6 and frozen.stats()["loose_documents"] == 0
    ctx = ids(tok, "\ntotal = compute(")
    for _ in range(60):
        touched = rng.sample(names, rng.randrange(1, 4))
        current = rng.choice(names)
        for idx in (loose, frozen):
            for name in touched:
                idx.touch(name)
        got = frozen.lookup(ctx, uri=current, k=3, b=12)
        assert got == loose.lookup(ctx, uri=current, k=3, b=12)
        assert got[0].uri == current and got[0].source == "document"
        # the open tier: the last touched open document first (the current one aside)
        opened = [n for n in reversed(touched) if kinds[names.index(n)] == "open" and n != current]
        tier = [c.uri for c in got if c.source == "open"]
        if opened:
            assert tier[0] == opened[0]


@pytest.mark.parametrize("frozen", [False, True], ids=["loose", "frozen"])
def test_longest_match_wins_and_nothing_matches_gives_nothing(tok: Any, frozen: bool) -> None:
    """Within a tier only the longest suffix match is kept; an unseen context returns [];
    of more than 64 occurrences the latest ones are read."""
    idx = NgramIndex(tok, max_n=8, min_n=2)
    idx.open("file:///a.py", "a.b.c = one\nq.b.c = two\n")
    many = "".join(f"item = value{i}\n" for i in range(100))
    idx.open("file:///many.py", many, kind="workspace")
    if frozen:
        idx.compact()
    latest = idx.lookup(ids(tok, "\nitem = value"), uri="file:///a.py", k=3, b=1)
    assert tok.decode(latest[0].tokens).startswith("99\n")
    cands = idx.lookup(ids(tok, "\nq.b.c ="), uri="file:///a.py", k=4)
    assert len(cands) == 1 and tok.decode(cands[0].tokens).strip() == "two"
    assert cands[0].n > 2
    assert idx.lookup(ids(tok, "zzzz_never_seen_qqq"), uri="file:///a.py") == []
    with pytest.raises(ValueError):
        idx.lookup([1, 2, 3], min_n=1)


def test_continuations_stop_at_a_documents_end_frozen_or_loose(tok: Any) -> None:
    """A continuation is read up to ``k`` ids and never past its document's end: in the
    frozen segment (documents side by side) it stops at the next document, in a loose one
    at the array's end; one lookup reading both kinds (segment hits and loose hits) gets
    each its own cut, and counts occurrences that continue alike."""
    idx = NgramIndex(tok, max_n=8, min_n=2)
    idx.open("file:///a.py", "run(alpha)\nrun(alpha)\nrun(beta", kind="workspace")
    idx.open("file:///b.py", "zzz = 1\n", kind="workspace")
    idx.compact()  # a.py is followed by b.py in the segment
    idx.open("file:///c.py", "run(gamma", kind="workspace")  # loose, after compaction
    got = idx.lookup(ids(tok, "x = run("), k=50, b=8)
    texts = sorted(tok.decode(c.tokens) for c in got)
    assert texts == ["alpha)\nrun(alpha)\nrun(beta", "alpha)\nrun(beta", "beta", "gamma"]
    assert all("zzz" not in t for t in texts)
    short = idx.lookup(ids(tok, "x = run("), k=1, b=8)
    assert len(short) == 3 and {len(c.tokens) for c in short} == {1}
    assert max(c.count for c in short) == 2  # two occurrences continue with "alpha"


def test_eviction_is_lru_and_spares_the_current_document(tok: Any) -> None:
    """Past max_tokens whole documents go, least recently used first, never the current one."""
    text = (STDLIB / "textwrap.py").read_text()[:2000]
    n = len(ids(tok, text))
    idx = NgramIndex(tok, max_tokens=3 * n + 10)
    idx.open("file:///cur.py", text)
    idx.touch("file:///cur.py")
    for name in ("w1", "w2"):
        idx.open(f"file:///{name}.py", text, kind="workspace")
    idx.touch("file:///w1.py")  # w1 is now used more recently than w2
    idx.touch("file:///cur.py")
    idx.open("file:///w3.py", text, kind="workspace")
    assert "file:///w2.py" not in idx
    assert all(f"file:///{u}.py" in idx for u in ("cur", "w1", "w3"))
    stats = idx.stats()
    assert stats["documents"] == 3 and stats["tokens"] == 3 * n
    assert stats["tokens"] <= idx.max_tokens
    assert 8 < stats["bytes_per_token"] < 200
    # A budget smaller than one document: the current one and the one being opened stay.
    small = NgramIndex(tok, max_tokens=10)
    small.open("file:///big.py", text)
    small.touch("file:///big.py")
    small.open("file:///other.py", text, kind="workspace")
    assert "file:///big.py" in small and "file:///other.py" in small
    small.open("file:///third.py", text, kind="workspace")
    assert "file:///big.py" in small and "file:///other.py" not in small


def test_save_load_round_trip_and_tokenizer_mismatch(tok: Any, tmp_path: Path) -> None:
    """A loaded index answers like the saved one without re-tokenizing; another tokenizer:
    refused."""
    idx = NgramIndex(tok, max_n=6, min_n=2)
    idx.open("file:///a.py", "value = compute(x)\nvalue = compute(y)\n😀\r\n")
    idx.open("file:///w.py", "value = compute(z)\n", kind="workspace")
    idx.change("file:///a.py", [edit(2, 0, 2, 2, "中")])
    path = tmp_path / "index.msgpack"
    idx.save(path)
    calls = 0
    real_encode = tok.encode

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(tok, name)

        def encode(self, *a: Any, **kw: Any) -> Any:
            nonlocal calls
            calls += 1
            return real_encode(*a, **kw)

    loaded = NgramIndex.load(path, Counting())
    assert calls == 0
    ctx = ids(tok, "\nvalue = compute(")
    assert loaded.lookup(ctx, uri="file:///a.py") == idx.lookup(ctx, uri="file:///a.py")
    for uri in ("file:///a.py", "file:///w.py"):
        assert loaded.text(uri) == idx.text(uri)
        assert loaded.tokens(uri) == idx.tokens(uri)
    assert loaded.kind("file:///w.py") == "workspace"
    # Edits keep working on the loaded state.
    loaded.change("file:///a.py", [edit(0, 0, 0, 5, "v")])
    assert_fresh(loaded, "file:///a.py")
    with pytest.raises(TokenizerMismatch):
        NgramIndex.load(path, make_tokenizer(650))


def test_change_with_a_bad_position_raises_position_error(tok: Any) -> None:
    idx = NgramIndex(tok)
    idx.open("file:///a.py", "x = 1\n")
    with pytest.raises(PositionError):
        idx.change("file:///a.py", [edit(5, 0, 5, 0, "y")])
    assert idx.text("file:///a.py") == "x = 1\n"
    with pytest.raises(KeyError):
        idx.change("file:///nope.py", [{"text": ""}])


# -- the whole-document paths ----------------------------------------------------------


def assert_same_index(idx: NgramIndex, fresh: NgramIndex, uri: str, rng: random.Random) -> None:
    """``idx`` answers like ``fresh``: the same token count and, for contexts cut from
    ``uri``'s text, the same candidates."""
    assert idx.stats()["tokens"] == fresh.stats()["tokens"]
    toks = ids(idx.tokenizer, idx.text(uri))
    for cut in rng.sample(range(2, len(toks)), min(12, len(toks) - 2)):
        assert idx.lookup(toks[:cut], uri=uri) == fresh.lookup(toks[:cut], uri=uri)


def test_a_full_replacement_reindexes_the_whole_document(tok: Any) -> None:
    """A change without a range (the client sent the whole text), between two range edits
    of the same list, on a frozen document: the index equals a fresh one of the final
    text, and nothing of the old text is found any more."""
    old = "class Old:\n    def stale_method(self):\n        return stale_value\n"
    new = (STDLIB / "textwrap.py").read_text()[:900]
    idx = NgramIndex(tok, max_n=6, min_n=2)
    idx.open("file:///a.py", old)
    idx.open("file:///b.py", "other = 1\n", kind="workspace")
    idx.compact()
    changes = [edit(0, 6, 0, 9, "Older"), {"text": new}, edit(0, 0, 0, 0, "# top\n")]
    idx.change("file:///a.py", changes)
    final = "# top\n" + new
    assert idx.text("file:///a.py") == final
    assert_fresh(idx, "file:///a.py")
    fresh = NgramIndex(tok, max_n=6, min_n=2)
    fresh.open("file:///a.py", final)
    fresh.open("file:///b.py", "other = 1\n", kind="workspace")
    assert_same_index(idx, fresh, "file:///a.py", random.Random(3))
    assert idx.lookup(ids(tok, "    def stale_method(self):\n"), uri="file:///a.py") == []


@functools.cache
def tokenizer_without_cuts() -> Any:
    """A byte-level BPE without the pre-tokenizer's regex: its merges cross spaces and
    line ends, so no offset is a token boundary whatever the text around it."""
    from codespec.daemon.training.train_data import train_tokenizer

    text = (STDLIB / "textwrap.py").read_text()[:40_000]
    return train_tokenizer([text], 600, specials=(), use_regex=False)


def _edit_without_cuts(incremental: bool, steps: int = 120) -> list[bool]:
    """Random edits on an index over :func:`tokenizer_without_cuts` (``incremental`` forced
    as given); per edit, whether the state equals a fresh build."""
    tok = tokenizer_without_cuts()
    rng = random.Random(77)
    idx = NgramIndex(tok, max_n=6, min_n=2)
    assert not idx.incremental  # supports_cuts: no regex, no cut argument
    idx.incremental = incremental
    idx.open("file:///a.py", (STDLIB / "textwrap.py").read_text()[2000:3500])
    idx.compact()
    equal = []
    for step in range(steps):
        changes, expected = random_changes(rng, idx.text("file:///a.py"))
        idx.change("file:///a.py", changes)
        assert idx.text("file:///a.py") == expected
        try:
            assert_fresh(idx, "file:///a.py")
        except AssertionError:
            equal.append(False)
            continue
        equal.append(True)
        if step % 30 == 0:
            fresh = NgramIndex(tok, max_n=6, min_n=2)
            fresh.open("file:///a.py", expected)
            assert_same_index(idx, fresh, "file:///a.py", rng)
    return equal


def test_a_tokenizer_without_cuts_retokenizes_the_whole_document() -> None:
    """For a tokenizer the cut argument does not cover, every edit re-tokenizes the whole
    document: after each random edit, tokens, offsets and keys equal a fresh build, and
    lookups a fresh index's. The same edits re-tokenized only around the edit (the cut
    window forced on) leave states a fresh build does not give: the check has power."""
    assert all(_edit_without_cuts(incremental=False))
    assert not all(_edit_without_cuts(incremental=True))
