"""Draft trees: construction from candidate paths, truncation, validation."""

from __future__ import annotations

import pytest

from codespec.daemon.engine.runner import tree_layout
from codespec.speculators.draft import Draft


def test_from_paths_shares_prefixes():
    d = Draft.from_paths([([5, 6, 7], "a"), ([5, 8], "b"), ([9], "c")])
    assert d.tokens == [5, 6, 7, 8, 9]
    assert d.parents == [-1, 0, 1, 0, -1]
    assert d.sources == ["a", "a", "a", "b", "c"]
    assert d.children() == {-1: [0, 4], 0: [1, 3], 1: [2]}


def test_per_path_matches_follow_nodes_through_cuts_and_keys():
    """Paths copied after matches of different lengths: a shared node keeps the longest,
    truncation and selection carry them, and each node's acceptance key uses its own."""
    from codespec.speculators.acceptance import match_bucket, node_keys

    d = Draft.from_paths([([5, 6, 7], "a"), ([5, 8], "b")], [2, 9])
    assert d.matches == [9, 2, 2, 9] and d.match == 9
    assert d.truncated(2).matches == [9, 2] and d.select([0, 3]).matches == [9, 9]
    assert [k[1] for k in node_keys(d)] == [match_bucket(m) for m in (9, 2, 2, 9)]
    with pytest.raises(ValueError):
        Draft([1, 2], matches=[3])


def test_truncated_keeps_a_tree():
    d = Draft.from_paths([([1, 2, 3], "a"), ([4, 5], "b")]).truncated(4)
    assert d.tokens == [1, 2, 3, 4]
    assert d.parents == [-1, 0, 1, -1]


def test_parent_must_precede_child():
    with pytest.raises(ValueError):
        Draft([1, 2], [1, -1])


def test_tree_layout_depths_and_ancestors():
    depth, anc = tree_layout([-1, 0, 0, 2], 4)
    assert depth == [0, 1, 1, 2]
    assert anc is not None
    assert anc[3].tolist() == [True, False, True, True]
    assert tree_layout(None, 3) == ([0, 1, 2], None)
