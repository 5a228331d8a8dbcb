"""Losslessness on held-out code: greedy output with any draft equals plain greedy decoding.

50 prompts from the stdlib ``test/`` folder (which the embedded model never saw),
each decoded plainly, then with random drafts, all-correct drafts, drafts
correct for k tokens then wrong, and trees with several branches.
"""

from __future__ import annotations

import pytest

from codespec.daemon.engine import GenParams
from conftest import heldout_prompts
from helpers import ScriptedProposer

PROMPTS = 50
MAX_TOKENS = 16
MODES = [("random", 0), ("correct", 0), ("k_then_wrong", 1), ("k_then_wrong", 3), ("tree", 0)]


def decode_ids(engine, prompt, proposer=None, max_draft=8):
    ids = []
    for delta in engine.stream(
        prompt, GenParams(max_tokens=MAX_TOKENS, max_draft=max_draft), proposer
    ):
        ids.extend(delta.token_ids)
    return ids


@pytest.fixture(scope="module")
def cases(engine):
    prompts = heldout_prompts(engine, PROMPTS)
    return [(p, decode_ids(engine, p)) for p in prompts]


@pytest.mark.parametrize(("mode", "k"), MODES)
def test_greedy_with_drafts_equals_plain(engine, cases, mode, k):
    vocab = engine.runner.vocab_size
    accepted_any = 0
    for n, (prompt, plain) in enumerate(cases):
        prop = ScriptedProposer(plain, mode, vocab, k=k, seed=n)
        got = decode_ids(engine, prompt, prop)
        assert got == plain, f"prompt {n}: {mode} draft changed the output"
        accepted_any += int(prop.steps < len(plain))
    if mode in ("correct", "k_then_wrong", "tree"):
        assert accepted_any > 0, "drafts were never accepted: the test would prove nothing"


def test_ngram_proposer_with_index_equals_plain(engine, cases):
    """The real n-gram proposer, drafting from the context and an index of held-out files."""
    from codespec.ngram_index import NgramIndex
    from codespec.speculators.ngram import NgramProposer
    from conftest import HELDOUT

    index = NgramIndex(engine.tokenizer.backend_tokenizer)
    for path in sorted(HELDOUT.glob("test_[a-c]*.py"))[:12]:
        index.open(path.as_uri(), path.read_text(encoding="utf-8", errors="replace"))
    drafted = 0
    for n, (prompt, plain) in enumerate(cases):
        prop = NgramProposer(index)
        assert decode_ids(engine, prompt, prop, max_draft=16) == plain, f"prompt {n}"
        drafted += prop.stats.drafted_tokens
    assert drafted > 0
