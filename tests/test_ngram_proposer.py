"""NgramProposer: tree drafts (context, index, prediction), adaptive length, None on no match."""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path
from typing import Any

from codespec.ngram_index import NgramIndex
from codespec.speculators.draft import Draft, RequestInfo, StepResult
from codespec.speculators.ngram import NgramProposer, SequenceMatcher, match_continuations

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@functools.cache
def make_tokenizer(vocab_size: int = 700) -> Any:
    from codespec.daemon.training.train_data import train_tokenizer

    return train_tokenizer([(STDLIB / "textwrap.py").read_text()[:40_000]], vocab_size)


def paths_of(draft: Draft) -> list[list[int]]:
    """Root-to-leaf token paths of a tree draft."""
    assert draft.parents is not None
    kids = draft.children()
    out = []
    for i in range(len(draft)):
        if i not in kids:
            path, node = [], i
            while node >= 0:
                path.append(draft.tokens[node])
                node = draft.parents[node]
            out.append(path[::-1])
    return out


def accept(draft: Draft, n: int) -> StepResult:
    """The first ``n`` nodes of the first path accepted (a chain prefix)."""
    return StepResult(draft=draft, accepted=list(range(n)), bonus=0)


def test_match_continuations_prefers_the_longest_then_the_latest() -> None:
    """Longest suffix match wins; ties come latest first; continuations are distinct."""
    #      0  1  2  3  4  5  6  7  8  9 10 11 12 13 14
    seq = [1, 2, 3, 9, 7, 2, 3, 8, 7, 2, 3, 5, 0, 7, 2]
    tail = [*seq, 3]  # ... 7 2 3
    n, conts = match_continuations(tail, [2, 6, 10], tail, 2, 8, 2, 4)
    assert n == 3 and conts == [[5, 0], [8, 7]]
    n, conts = match_continuations(tail, [2], tail, 2, 8, 3, 4)
    assert n == 2 and conts == [[9, 7, 2]]
    assert match_continuations(tail, [], tail, 2, 8, 3, 4) == (0, [])


def test_context_candidates_become_one_tree_within_budget() -> None:
    """Two earlier continuations of the same suffix give a tree with two branches."""
    A, B, X, Y = 10, 11, 12, 13
    context = [A, B, X, X, X, 99, A, B, Y, Y, Y, 98, A, B]
    prop = NgramProposer(init_len=8)
    prop.begin(RequestInfo(prompt_ids=context))
    draft = prop.propose(context, budget=16)
    assert draft is not None and not draft.is_chain
    assert paths_of(draft) == [[Y, Y, Y, 98], [X, X]]  # latest first; sibling gets half depth
    assert set(draft.sources or []) == {"ngram:context"}
    small = prop.propose(context, budget=3)
    assert small is not None and len(small) == 3


def test_nothing_matches_gives_none() -> None:
    """No earlier occurrence of the suffix: a plain decode step (None), also for budget 0."""
    prop = NgramProposer(index=None)
    context = list(range(100, 140))
    prop.begin(RequestInfo(prompt_ids=context))
    assert prop.propose(context, budget=8) is None
    assert prop.propose([1, 2, 1, 2], budget=0) is None
    assert prop.stats.steps_with_draft == 0


def test_draft_length_adapts_to_acceptance_and_match_length() -> None:
    """Full accepts double the length, zero accepts halve it; short matches cap the depth."""
    cycle = list(range(20, 60))
    context = cycle + cycle[:30]  # the suffix matched with n = max_n, 10 tokens left to copy
    prop = NgramProposer(init_len=4, max_len=16, max_n=8)
    prop.begin(RequestInfo(prompt_ids=context))
    d = prop.propose(context, budget=64)
    assert d is not None and d.tokens == cycle[30:34]
    prop.observe(accept(d, 4))
    assert prop.draft_len == 8
    d = prop.propose(context, budget=64)
    assert d is not None and len(d) == 8
    prop.observe(accept(d, 3))  # a partial accept keeps the length
    assert prop.draft_len == 8
    prop.observe(accept(d, 0))
    assert prop.draft_len == 4
    # A match of only 2 tokens drafts at most 2 * 2 tokens however long L is.
    prop.draft_len = 16
    short = [5, 6, 7, 8, 9, 1, 2, 30, 31, 32, 33, 34, 35, 36, 1, 2]
    prop.begin(RequestInfo(prompt_ids=short))
    prop.draft_len = 16
    d = prop.propose(short, budget=64)
    assert d is not None and d.tokens == [30, 31, 32, 33]
    assert prop.stats.accepted_tokens == 7


def test_context_is_indexed_incrementally() -> None:
    """A growing context only adds its new tokens; an unrelated context resets the table."""
    m = SequenceMatcher(2)
    m.sync([1, 2, 3, 1, 2])
    table = m.table
    m.sync([1, 2, 3, 1, 2, 3])
    assert m.table is table and m.table[(2, 3)] == [2, 5]
    m.sync([9, 9, 9])
    assert m.seq == [9, 9, 9] and (2, 3) not in m.table


def test_index_candidates_join_the_tree() -> None:
    """Continuations from the index (current document first) become ngram:index branches."""
    tok = make_tokenizer()
    idx = NgramIndex(tok, max_n=8, min_n=2)
    idx.open("file:///a.py", "total = compute_sum(values)\n")
    idx.open("file:///b.py", "total = compute_max(values)\n", kind="workspace")
    prompt = tok.encode("x = 1\ntotal = compute").ids
    prop = NgramProposer(idx, init_len=8)
    prop.begin(RequestInfo(prompt_ids=prompt, uri="file:///a.py"))
    draft = prop.propose(prompt, budget=32)
    assert draft is not None and set(draft.sources or []) == {"ngram:index"}
    texts = [tok.decode(p) for p in paths_of(draft)]
    assert texts[0].startswith("_sum") and any(t.startswith("_max") for t in texts)


def test_prediction_drafts_the_old_text_from_the_first_step() -> None:
    """An edit's old region is the draft before anything is generated, then it is matched."""
    old = [40, 41, 42, 43, 44, 45, 46, 47]
    prompt = [1, 2, 3]
    prop = NgramProposer(init_len=4)
    prop.begin(RequestInfo(prompt_ids=prompt, kind="edit", draft_text_ids=old))
    d = prop.propose([*prompt, 40], budget=16)  # the root (first sampled token) is old[0]
    assert d is not None and d.tokens == [41, 42, 43, 44]
    assert set(d.sources or []) == {"ngram:prediction"}
    d = prop.propose([*prompt, 40, 41, 42, 43], budget=16)
    assert d is not None and d.tokens[:4] == [44, 45, 46, 47]


def test_backs_off_when_drafts_do_not_pay_then_recovers() -> None:
    """Rejected drafts: plain steps for 1, 2, 4 ... steps between probes; a paying probe resets."""
    context = [1, 2, 3, 4, 5] * 6
    p = NgramProposer(min_n=2, max_n=4, min_gain=1.0)
    p.begin(RequestInfo(prompt_ids=context))
    pattern = []
    for _ in range(12):  # every draft rejected
        d = p.propose(context, 8)
        pattern.append(d is not None)
        if d is not None:
            p.observe(StepResult(draft=d, accepted=[], bonus=0))
    # draft, skip 1, draft, skip 2, draft, skip 4, draft ...
    assert pattern[:10] == [True, False, True, False, False, True, False, False, False, False]
    while (d := p.propose(context, 8)) is None:
        pass
    p.observe(accept(d, len(d.tokens)))  # the probe is accepted whole: drafting resumes
    assert p._backoff == 1
    assert p.propose(context, 8) is not None


def test_last_match_reports_the_longest_match_behind_the_draft():
    from codespec.speculators.draft import RequestInfo
    from codespec.speculators.ngram import NgramProposer

    p = NgramProposer(max_n=8)
    seq = list(range(100, 120))
    p.begin(RequestInfo(prompt_ids=seq + seq[:10]))
    assert p.propose(seq + seq[:10], 8) is not None
    assert p.last_match == 8  # a full-length match
    p.begin(RequestInfo(prompt_ids=[1, 2, 3, 9, 2, 3]))
    assert p.propose([1, 2, 3, 9, 2, 3], 8) is not None
    assert p.last_match == 2
    assert p.propose([50, 51, 52], 8) is None and p.last_match == 0


def test_a_declined_draft_backs_the_proposer_off():
    from codespec.speculators.draft import RequestInfo
    from codespec.speculators.ngram import NgramProposer

    seq = list(range(100, 120))
    ctx = seq + seq[:10]
    p = NgramProposer(max_n=8)
    p.begin(RequestInfo(prompt_ids=ctx))
    assert p.propose(ctx, 8) is not None
    p.declined()  # the policy did not verify it
    assert p.propose(ctx, 8) is None  # one step without drafting (no lookups)
    assert p.propose(ctx, 8) is not None
    p.declined()
    p.declined()  # declined again: the pause doubles
    assert [p.propose(ctx, 8) for _ in range(4)][:4].count(None) == 4
