"""The lead step: a request whose prompt is cached but its last token (a keystroke) verifies
its first draft in the forward that feeds that token, losslessly, healing included."""

from __future__ import annotations

import pytest
import torch

from codespec.daemon.engine.engine import GenParams
from codespec.daemon.engine.request import row_masks
from codespec.daemon.text.healing import constraint, heal_prompt
from codespec.speculators.draft import Draft
from codespec.speculators.registry import make_proposer
from helpers import ScriptedProposer

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul("


def stream(engine, prompt, params, proposer):
    """(output ids without stop tokens, each step's token count, the final stats)."""
    out, sizes, stats = [], [], None
    for step in engine.stream(prompt, params, proposer):
        out += [t for t in step.token_ids if t not in engine.stop_ids]
        sizes.append(len(step.token_ids))
        stats = step.stats
    assert stats is not None
    return out, sizes, stats


@pytest.mark.parametrize("mode", ["correct", "k_then_wrong", "tree", "random"])
def test_a_cached_prompt_verifies_its_first_draft_in_its_first_forward(engine, mode):
    prompt = engine.encode(PROMPT)
    params = GenParams(max_tokens=16, max_draft=6)
    engine.reset_cache()
    oracle, _, cold = stream(engine, prompt, params, None)
    assert cold.lead_steps == 0 and cold.target_forwards == cold.decode_steps + 1
    # the cache now holds the prompt: only its last token is fed again
    proposer = ScriptedProposer(oracle, mode, engine.runner.vocab_size, k=2)
    got, sizes, warm = stream(engine, prompt, params, proposer)
    assert got == oracle
    assert warm.cached_tokens == len(prompt) - 1
    assert warm.lead_steps == 1 and warm.target_forwards == warm.decode_steps
    if mode == "correct":  # the first forward gave the draft and the bonus
        assert sizes[0] == params.max_draft + 1
        assert warm.target_forwards < cold.target_forwards


def test_no_lead_step_without_a_proposer_or_with_more_than_one_token_to_feed(engine):
    prompt = engine.encode(PROMPT)
    params = GenParams(max_tokens=8)
    engine.reset_cache()
    oracle, _, _ = stream(engine, prompt, params, None)
    _, _, plain = stream(engine, prompt, params, None)  # off: a one-token prefill
    assert plain.lead_steps == 0 and plain.cached_tokens == len(prompt) - 1
    longer = prompt + engine.encode("x, y):\n")
    proposer = ScriptedProposer(oracle, "random", engine.runner.vocab_size)
    _, _, fed = stream(engine, longer, params, proposer)
    assert fed.lead_steps == 0 and fed.target_forwards == fed.decode_steps + 1


@pytest.mark.parametrize("mode", ["correct", "k_then_wrong", "random", "auto"])
def test_a_healed_lead_step_is_lossless(engine, mode):
    """The backed-off text constrains the lead step's rows: drafts whose first token does
    not regrow it are turned down, and every method gives constrained plain decoding's ids."""
    text = "for i in range(10):\n    print(i)\nfor j in range(3):\n    print(j)\nfrom "
    ids, heal = heal_prompt(engine, engine.encode(text))
    assert heal
    params = GenParams(max_tokens=12, max_draft=5, constraint=constraint(engine, heal))
    engine.reset_cache()
    plain, _, _ = stream(engine, ids, params, None)
    assert (engine.token_texts.text[plain[0]] or "").startswith(heal)
    proposer = (
        make_proposer("auto", engine)
        if mode == "auto"
        else ScriptedProposer(plain, mode, engine.runner.vocab_size, k=0)
    )
    got, sizes, warm = stream(engine, ids, params, proposer)
    assert got == plain
    assert warm.lead_steps == 1
    if mode == "correct":
        assert sizes[0] > 1  # the constrained first token and the draft after it


def test_row_masks_follow_each_path_until_the_constraint_frees_it():
    """Rows are masked by the ids on their path: a constraint covered after two tokens
    masks the root's row and the first node's, not the rows past them nor another
    branch's once its own path covered it."""
    vocab = 8

    def need_two(done: list[int]) -> torch.Tensor | None:
        if len(done) >= 2 or (done and done[0] == 7):  # token 7 covers it alone
            return None
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[len(done) + 1] = True
        return mask

    # nodes: 0 (root child) -> 1 -> 2; 3 (root child, token 7) -> 4
    draft = Draft([1, 2, 3, 7, 5], parents=[-1, 0, 1, -1, 3])
    masks = row_masks(need_two, [], draft)
    assert sorted(masks) == [0, 1]
    assert masks[0].nonzero().flatten().tolist() == [1]
    assert masks[1].nonzero().flatten().tolist() == [2]
    assert row_masks(need_two, [3, 4], draft) == {}
    assert row_masks(None, [], draft) == {}
    assert sorted(row_masks(need_two, [], None)) == [0]


def test_a_draft_the_constraint_forbids_is_not_verified():
    """``possible``: nodes whose row's mask forbids their token go, with everything under
    them; the cut remembers the proposer's draft (``origin``) and the chances; a draft
    all allowed is kept as it is, one all forbidden is None."""
    from codespec.daemon.engine.request import possible

    vocab = 8

    def first_even(done: list[int]) -> torch.Tensor | None:  # the first token must be even
        if done:
            return None
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[::2] = True
        return mask

    full = Draft([5, 6, 7, 2, 3, 4, 1], parents=[-1, 0, 1, -1, 3, 4, -1])
    draft = full.select([0, 1, 2, 3, 4, 5, 6])
    draft.chances = [0.9, 0.8, 0.7, 0.5, 0.4, 0.3, 0.1]
    got = possible(draft, first_even, [])
    assert got is not None and got.tokens == [2, 3, 4] and got.parents == [-1, 0, 1]
    assert got.origin is not None and got.origin[0] is full and got.origin[1] == [3, 4, 5]
    assert got.chances == [0.5, 0.4, 0.3]
    assert possible(draft, first_even, [2]) is draft  # the constraint is covered: free
    assert possible(Draft([5, 7]), first_even, []) is None
    assert possible(Draft([4, 7]), first_even, []).tokens == [4, 7]  # type: ignore[union-attr]
    assert possible(draft, None, []) is draft and possible(None, first_even, []) is None


def test_a_keystroke_the_draft_did_not_predict_verifies_no_draft(engine):
    """Under healing, a draft whose first token cannot regrow the typed text is dropped
    before the forward (a one-row step instead of a verify of them all); drafts after the
    text is regrown are verified; the output is constrained plain decoding's."""
    text = "for i in range(10):\n    print(i)\nfor j in range(3):\n    print(j)\nfrom "
    ids, heal = heal_prompt(engine, engine.encode(text))
    params = GenParams(max_tokens=6, max_draft=5, constraint=constraint(engine, heal))
    engine.reset_cache()
    plain, _, _ = stream(engine, ids, params, None)
    texts = engine.token_texts.text
    wrong = [t for t in range(engine.runner.vocab_size) if (texts[t] or " ")[0] == "q"][:5]
    assert not heal.startswith("q") and len(wrong) == 5
    verified: list[int] = []

    class Wrong(ScriptedProposer):  # always the 'q' tokens, which never regrow the text
        def propose(self, context, budget):
            return Draft.chain(wrong[:budget], "q")

        def observe(self, result):
            verified.append(len(result.draft) if result.draft is not None else 0)

    got, sizes, warm = stream(engine, ids, params, Wrong([], "correct", 1))
    assert got == plain
    assert warm.lead_steps == 1 and verified[0] == 0 and sizes[0] == 1
    assert any(verified[1:]) and warm.drafted["q"] == sum(verified)
