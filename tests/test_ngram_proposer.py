"""NgramProposer: tree drafts (context, index, prediction), their shape, None on no match.

The proposer is thin: it offers what the matches say; how much of it is verified is
the policy's (tests/test_policy.py)."""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path
from typing import Any

from codespec.ngram_index import NgramIndex
from codespec.speculators.draft import Draft, RequestInfo, StepResult
from codespec.speculators.ngram import (
    SPREAD,
    NgramProposer,
    SequenceMatcher,
    match_continuations,
)

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
    """Two earlier continuations of the same suffix give a tree with two branches; the
    tree holds at most SPREAD times the budget, its first ``budget`` nodes the best path."""
    A, B, X, Y = 10, 11, 12, 13
    context = [A, B, X, X, X, 99, A, B, Y, Y, Y, 98, A, B]
    prop = NgramProposer()
    prop.begin(RequestInfo(prompt_ids=context))
    draft = prop.propose(context, budget=8)
    assert draft is not None and not draft.is_chain
    # a 2-token match: paths at most reach * 2 deep, latest first; the sibling gets half
    assert paths_of(draft) == [[Y, Y, Y, 98, A, B], [X, X, X, 99]]
    short = NgramProposer(reach=2)
    short.begin(RequestInfo(prompt_ids=context))
    assert paths_of(short.propose(context, budget=8)) == [[Y, Y, Y, 98], [X, X]]
    assert set(draft.sources or []) == {"ngram:context"}
    small = prop.propose(context, budget=3)
    assert small is not None and len(small) <= SPREAD * 3
    assert paths_of(small) == [[Y, Y, Y], [X]] and small.truncated(3).tokens == [Y, Y, Y]


def test_the_longest_match_leads_whatever_its_source() -> None:
    """An edit's old text matches the last 2 tokens, the earlier context the last 5: the
    context's path comes first (so a long path of the old text cannot crowd it out of the
    budget), and every node keeps the match behind it (the policy's acceptance key)."""
    old = [50, 51, 52, 7, 8, 60, 61, 62, 63]  # ... 7 8 -> 60 61 ...
    context = [1, 2, 3, 7, 8, 70, 71, 72, 73, 74, 9, 1, 2, 3, 7, 8]  # 1 2 3 7 8 -> 70 ...
    prop = NgramProposer()
    prop.begin(RequestInfo(prompt_ids=context[:-3], kind="edit", draft_text_ids=old))
    draft = prop.propose(context, budget=8)
    assert draft is not None
    assert paths_of(draft) == [[70, 71, 72, 73, 74, 9, 1, 2], [60, 61, 62, 63]]
    assert draft.matches == [5] * 8 + [2] * 4 and draft.match == 5
    assert draft.sources == ["ngram:context"] * 8 + ["ngram:prediction"] * 4
    assert draft.truncated(8).tokens == [70, 71, 72, 73, 74, 9, 1, 2]


def test_after_a_departure_the_last_token_alone_finds_the_old_text_again() -> None:
    """An edit that replaced a token of its old text: no 2 tokens match anywhere, so the
    last token's latest occurrence is the match (of 1: the policy keys its acceptance
    apart); with ``single`` off the step is plain; a token found nowhere else gives None."""
    old = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    prompt = [1, 2, 3]
    context = [*prompt, 40, 41, 42, 99, 44]  # 43 became 99; 44 follows again
    prop = NgramProposer()
    prop.begin(RequestInfo(prompt_ids=prompt, kind="edit", draft_text_ids=old))
    d = prop.propose(context, budget=8)
    assert d is not None and d.tokens == [45, 46, 47, 48] and d.match == 1
    assert set(d.sources or []) == {"ngram:prediction"}
    plain = NgramProposer(single=False)
    plain.begin(RequestInfo(prompt_ids=prompt, kind="edit", draft_text_ids=old))
    assert plain.propose(context, budget=8) is None
    assert prop.propose([*context, 98], budget=8) is None  # 98 is in no text
    # once 2 tokens match, the usual match takes over (44 45 46: 3 tokens)
    d = prop.propose([*context, 45, 46], budget=8)
    assert d is not None and d.tokens == [47, 48, 49] and d.match == 3


def test_nothing_matches_gives_none() -> None:
    """No earlier occurrence of the suffix: a plain decode step (None), also for budget 0."""
    prop = NgramProposer(index=None)
    context = list(range(100, 140))
    prop.begin(RequestInfo(prompt_ids=context))
    assert prop.propose(context, budget=8) is None
    assert prop.propose([1, 2, 1, 2], budget=0) is None


def test_draft_depth_follows_the_budget_and_the_match_length() -> None:
    """A full-length match drafts as deep as the budget allows; a short one at most
    ``reach`` (4) times its length, whatever the budget; ``match`` says how long the match
    was."""
    cycle = list(range(20, 60))
    context = cycle + cycle[:30]  # the suffix matches at 29 with n = max_n: 40 tokens follow
    prop = NgramProposer(max_n=8)
    prop.begin(RequestInfo(prompt_ids=context))
    for budget in (3, 8, 64):
        d = prop.propose(context, budget=budget)
        assert d is not None and d.is_chain and d.tokens == context[30 : 30 + budget]
        assert d.match == 8
    short = [5, 6, 7, 8, 9, 1, 2, 30, 31, 32, 33, 34, 35, 36, 1, 2]
    prop.begin(RequestInfo(prompt_ids=short))
    d = prop.propose(short, budget=64)
    assert d is not None and d.tokens == [30, 31, 32, 33, 34, 35, 36, 1] and d.match == 2


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
    prop = NgramProposer(idx)
    prop.begin(RequestInfo(prompt_ids=prompt, uri="file:///a.py"))
    draft = prop.propose(prompt, budget=32)
    assert draft is not None and set(draft.sources or []) == {"ngram:index"}
    texts = [tok.decode(p) for p in paths_of(draft)]
    assert texts[0].startswith("_sum") and any(t.startswith("_max") for t in texts)


def test_prediction_drafts_the_old_text_from_the_first_step() -> None:
    """An edit's old region is the draft before anything is generated, then it is matched."""
    old = [40, 41, 42, 43, 44, 45, 46, 47]
    prompt = [1, 2, 3]
    prop = NgramProposer()
    prop.begin(RequestInfo(prompt_ids=prompt, kind="edit", draft_text_ids=old))
    d = prop.propose([*prompt, 40], budget=4)  # the root (first sampled token) is old[0]
    assert d is not None and d.tokens == [41, 42, 43, 44]
    assert set(d.sources or []) == {"ngram:prediction"} and d.match == prop.max_n
    d = prop.propose([*prompt, 40, 41, 42, 43], budget=16)
    assert d is not None and d.tokens[:4] == [44, 45, 46, 47]


def test_recent_outputs_draft_what_was_generated_after_the_same_tokens() -> None:
    """What an earlier request on the document generated (after its prompt's tail) is a
    source: a context that ends where it began plus the typed tokens drafts the rest;
    without it nothing matches."""
    recent = [7, 8, 9, 20, 21, 22, 23, 24, 25, 26]  # prompt tail 7 8 9, then the output
    context = [1, 2, 3, 7, 8, 9, 20, 21]  # typed 20 21
    assert NgramProposer().propose(context, budget=8) is None
    prop = NgramProposer()
    prop.begin(RequestInfo(prompt_ids=context, kind="complete", recent_ids=recent))
    d = prop.propose(context, budget=8)
    assert d is not None and d.tokens[:5] == [22, 23, 24, 25, 26]
    assert set(d.sources or []) == {"ngram:recent"}
    prop.begin(RequestInfo(prompt_ids=context, kind="complete"))  # the next request has none
    assert prop.propose(context, budget=8) is None


def test_a_thin_proposer_has_nothing_to_learn() -> None:
    """Whatever was accepted, the next draft is the same: no adaptive length, no back-off
    (both are the policy's)."""
    context = [1, 2, 3, 4, 5] * 6
    p = NgramProposer(min_n=2, max_n=4)
    p.begin(RequestInfo(prompt_ids=context))
    first = p.propose(context, 8)
    assert first is not None
    for accepted in ([], [0], list(range(len(first)))):
        p.observe(StepResult(draft=first, accepted=accepted, bonus=0))
        p.follow(StepResult(draft=None, accepted=[], bonus=0))
        again = p.propose(context, 8)
        assert again is not None and again.tokens == first.tokens
        assert again.parents == first.parents


def test_prediction_is_followed_in_order_where_a_run_of_it_recurs() -> None:
    """A run the prediction holds twice (a recurring line) continues, first, the way its
    occurrence where the text is now does: after the first one, what follows the first
    one; after the second, the second's (not always the latest occurrence's)."""
    run = list(range(50, 60))  # longer than max_n: both occurrences match as long
    pred = [10, 11, 12, *run, 20, 21, 22, 23, *run, 30, 31, 32, 33]
    prompt = [1, 2, 3]
    prop = NgramProposer()
    prop.begin(RequestInfo(prompt_ids=prompt, kind="edit", draft_text_ids=pred))
    context = [*prompt, 10]
    d = prop.propose(context, budget=12)  # the start of the prediction
    assert d is not None and d.tokens[:3] == [11, 12, 50]
    context += [11, 12, *run]  # the draft accepted: the text is at the first run's end
    d = prop.propose(context, budget=4)
    assert d is not None and paths_of(d)[0] == [20, 21, 22, 23]
    context += [20, 21, 22, 23, *run]
    d = prop.propose(context, budget=4)
    assert d is not None and paths_of(d)[0] == [30, 31, 32, 33]
