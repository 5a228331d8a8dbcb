"""Losslessness on held-out code: greedy output with any draft equals plain greedy decoding.

On the tiny engine (``engine``; ``spec_engine`` for EAGLE, the same weights with an
EAGLE head beside them): 50 prompts from the stdlib ``test/`` folder, each decoded
plainly, then with random drafts, all-correct drafts, drafts correct for k tokens
then wrong, trees with several branches, and with every proposer the registry
builds, under the policy and bare (drafting every step). The first
``SPEC_PROMPTS["count"]`` prompts are the ones the tiny head was trained on, so its
drafts really get accepted.

On the real default model (``real_engine``): 20 code prompts, 32 tokens each, decoded
with every proposer that model has (off, ngram, lookahead, auto; eagle only where
its weights exist) give plain decoding's tokens.
"""

from __future__ import annotations

import pytest
import torch

from codespec.daemon.engine.engine import GenParams
from codespec.speculators.book import forget
from codespec.speculators.registry import build, make_proposer
from codespec.speculators.weights import weights
from conftest import SPEC_PROMPTS, heldout_prompts
from helpers import ScriptedProposer

PROMPTS = 50
MAX_TOKENS = 16
MODES = [("random", 0), ("correct", 0), ("k_then_wrong", 1), ("k_then_wrong", 3), ("tree", 0)]


def decode(engine, prompt, proposer=None, max_draft=8, max_tokens=MAX_TOKENS):
    """The ids of every step (the stop token included) and the final stats."""
    ids, stats = [], None
    for step in engine.stream(
        prompt, GenParams(max_tokens=max_tokens, max_draft=max_draft), proposer
    ):
        ids.extend(step.token_ids)
        stats = step.stats
    assert stats is not None
    return ids, stats


def decode_ids(engine, prompt, proposer=None, max_draft=8, max_tokens=MAX_TOKENS):
    return decode(engine, prompt, proposer, max_draft, max_tokens)[0]


@pytest.fixture(scope="module")
def cases(engine):
    prompts = heldout_prompts(
        engine, PROMPTS, tokens=SPEC_PROMPTS["tokens"], seed=SPEC_PROMPTS["seed"]
    )
    return [(p, decode_ids(engine, p)) for p in prompts]


@pytest.mark.parametrize(("mode", "k"), MODES)
def test_greedy_with_drafts_equals_plain(engine, cases, mode, k):
    """Scripted drafts on 50 prompts give plain decoding's tokens, and the engine's own
    count of accepted draft tokens (bonus not counted) is what the drafts allow: ``correct``
    drafts are accepted whole, ``k_then_wrong`` ones for at most ``k`` tokens a step,
    ``tree`` ones along their correct branch; so a verifier that rejected every draft
    (output still equal to plain) fails here."""
    vocab = engine.runner.vocab_size
    accepted = drafted = steps = 0
    for n, (prompt, plain) in enumerate(cases):
        prop = ScriptedProposer(plain, mode, vocab, k=k, seed=n)
        got, stats = decode(engine, prompt, prop)
        assert got == plain, f"prompt {n}: {mode} draft changed the output"
        accepted += sum(stats.accepted.values())
        drafted += sum(stats.drafted.values())
        steps += stats.decode_steps
    if mode == "random":
        return
    assert accepted > 0, "drafts were never accepted: the test would prove nothing"
    if mode == "correct":
        assert accepted == drafted, "a correct draft token was rejected"
    if mode == "k_then_wrong":
        assert accepted <= k * steps, "a wrong draft token was accepted"
        assert accepted >= k * steps // 2, "correct draft tokens were rejected"


def test_ngram_proposer_with_index_equals_plain(engine, cases):
    """The real n-gram proposer, drafting from the context and an index of held-out files."""
    from codespec.ngram_index import NgramIndex
    from codespec.speculators.ngram import NgramProposer
    from conftest import HELDOUT

    index = NgramIndex(engine.tokenizer.backend_tokenizer)
    for path in sorted(HELDOUT.glob("test_[a-c]*.py"))[:12]:
        index.open(path.as_uri(), path.read_text(encoding="utf-8", errors="replace"))
    drafted = accepted = 0
    for n, (prompt, plain) in enumerate(cases):
        got, stats = decode(engine, prompt, NgramProposer(index), max_draft=16)
        assert got == plain, f"prompt {n}"
        drafted += sum(stats.drafted.values())
        accepted += sum(stats.accepted.values())
    assert drafted > 0 and accepted > 0, (drafted, accepted)


@pytest.mark.parametrize(
    ("name", "bare"),
    [("lookahead", False), ("eagle", False), ("auto", False),
     ("lookahead", True), ("eagle", True)],
)  # fmt: skip
def test_every_proposer_equals_plain(spec_engine, cases, name, bare, one_thread):
    """Each proposer as the daemon builds it (``make_proposer``: under the policy) and bare
    (``build``: every node it offers verified every step), on the tiny model with an EAGLE
    head beside it: plain decoding's tokens on all 50 prompts, with drafts verified. Bare,
    both get draft tokens accepted (the engine's count, bonus not counted): the EAGLE head
    was trained on these prompts, and lookahead's n-gram pool catches the tiny model's
    greedy output repeating itself. The policy starts from nothing measured, as a fresh
    daemon does (what earlier tests taught it could have retired the proposer)."""
    forget(spec_engine)
    drafted = accepted = 0
    for n, (prompt, plain) in enumerate(cases):
        spec_engine.reset_cache()
        prop = build(name, spec_engine, None) if bare else make_proposer(name, spec_engine, None)
        got, stats = decode(spec_engine, prompt, prop, max_draft=16)
        assert got == plain, f"prompt {n}: {name} changed the output"
        drafted += sum(stats.drafted.values())
        accepted += sum(stats.accepted.values())
    assert drafted > 0, f"{name} never drafted"
    if bare:
        assert accepted > 0, f"no {name} draft token was ever accepted"


# -- the real default model ------------------------------------------------------------

REAL_PROMPTS = 20
REAL_TOKENS = 32


@pytest.fixture(scope="module")
def real_cases(real_engine):
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as one_thread (function-scoped) does for the tests
    try:
        prompts = heldout_prompts(real_engine, REAL_PROMPTS, tokens=160, seed=5)
        out = []
        for p in prompts:
            real_engine.reset_cache()
            out.append((p, decode_ids(real_engine, p, max_tokens=REAL_TOKENS)))
    finally:
        torch.set_num_threads(before)
    return out


@pytest.mark.parametrize("name", ["off", "ngram", "lookahead", "auto", "eagle"])
def test_real_model_every_proposer_equals_plain(real_engine, real_cases, name, one_thread):
    """SmolLM2-135M on 20 held-out code prompts: greedy output with each proposer it has is
    plain decoding's, token for token (``off``: with most of the prompt cached by an earlier
    request).
    The n-gram proposer's drafts from the context get accepted (a real model copies): the
    bare proposer, which drafts every step (the policy's controller drafts as measured
    time says, which on a loaded machine may be never)."""
    if name in ("eagle",) and weights(real_engine)[name] is None:
        pytest.skip(f"no {name} weights for {real_engine.model_name}")
    accepted = 0
    for n, (prompt, plain) in enumerate(real_cases):
        real_engine.reset_cache()
        if name == "off":  # most of the prompt cached by an earlier request
            decode_ids(real_engine, prompt[:-8], max_tokens=1)
        prop = build(name, real_engine) if name == "ngram" else make_proposer(name, real_engine)
        got, stats = decode(real_engine, prompt, prop, max_tokens=REAL_TOKENS)
        assert got == plain, f"prompt {n}: {name} changed the output"
        accepted += sum(stats.accepted.values())
        if name == "off":
            assert stats.cached_tokens >= len(prompt) - 8 and not stats.drafted
    if name == "ngram":
        assert accepted > 0, "the real model never repeated its context"
