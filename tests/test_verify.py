"""Verification: greedy tree walks (ACCEPT / REJECT / BONUS) and exact rejection sampling,
checked on the real verifier's output (first and second emitted token, the nucleus), with a
case that shows the statistical check catches a biased one."""

from __future__ import annotations

import pytest
import torch

from codespec.speculators import verify as verify_mod
from codespec.speculators.draft import Draft
from codespec.speculators.verify import sample, target_probs, verify_greedy, verify_sampling

V = 6

# Thousands of tiny tensor ops: a second intra-op thread only adds waits (6x slower here).
pytestmark = pytest.mark.usefixtures("one_thread")


def logits_for(argmaxes: list[int]) -> torch.Tensor:
    """One row per (root + node), each peaked at the given token."""
    out = torch.full((len(argmaxes), V), -5.0)
    for r, t in enumerate(argmaxes):
        out[r, t] = 5.0
    return out


def test_greedy_chain_accepts_prefix_then_bonus():
    """Draft [1, 2, 3]; target wants 1, 2, 4: ACCEPT 1, ACCEPT 2, REJECT 3, BONUS 4."""
    draft = Draft.chain([1, 2, 3])
    accepted, bonus = verify_greedy(draft, logits_for([1, 2, 4, 0]))
    assert accepted == [0, 1]
    assert bonus == 4


def test_greedy_full_accept_takes_bonus_from_last_node():
    """Every draft token matches: the bonus comes from the last node's row."""
    draft = Draft.chain([1, 2])
    accepted, bonus = verify_greedy(draft, logits_for([1, 2, 5]))
    assert accepted == [0, 1]
    assert bonus == 5


def test_greedy_first_token_wrong_gives_plain_step():
    accepted, bonus = verify_greedy(Draft.chain([3, 3]), logits_for([2, 0, 0]))
    assert accepted == []
    assert bonus == 2


def test_greedy_tree_follows_the_matching_branch():
    """Root children 1 (node 0) and 2 (node 1); node 1 has children 3 (node 2) and 4 (node 3).

    Target wants 2 then 4 then 5: the walk takes node 1, then node 3, BONUS 5.
    """
    draft = Draft([1, 2, 3, 4], [-1, -1, 1, 1])
    rows = [2, 0, 4, 0, 5]  # root, node0, node1, node2, node3
    accepted, bonus = verify_greedy(draft, logits_for(rows))
    assert accepted == [1, 3]
    assert bonus == 5


def test_empty_draft_is_a_plain_step():
    assert verify_greedy(None, logits_for([3])) == ([], 3)


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 1e-9, 1e-9]]))
    p = target_probs(logits, 1.0, top_p=0.8)[0]
    assert p[0] > 0 and p[1] > 0 and p[2] == 0 and p[3] == 0
    assert torch.isclose(p.sum(), torch.tensor(1.0))


def _nucleus_by_full_sort(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The nucleus as its definition reads: every row sorted whole."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p
    sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
    out = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return out / out.sum(-1, keepdim=True)


@pytest.mark.parametrize("spread", [8.0, 3.0, 0.5])  # peaked (first partial sort), wider, flat
def test_the_nucleus_from_partial_sorts_is_the_full_sorts(spread):
    """The nucleus is looked for among the likeliest 1,024 then 8,192 tokens, and a row is
    sorted whole only when neither holds ``top_p``: the same distribution either way, on
    rows whose nucleus falls in each tier (a real vocabulary's width)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 49152, generator=gen) * spread
    for top_p in (0.5, 0.9, 0.95, 0.999):
        got = target_probs(logits, 0.8, top_p)
        want = _nucleus_by_full_sort(logits, 0.8, top_p)
        assert torch.allclose(got, want, atol=1e-6), (spread, top_p)
        assert torch.equal(got > 0, want > 0), (spread, top_p)


def test_sample_follows_the_distribution_and_never_draws_a_zero(monkeypatch):
    """Inverse transform sampling: a seeded generator repeats its draws, the draws fit the
    distribution (chi-square over 6 tokens at p = 1e-4, fixed seed), a token of
    probability 0 is never drawn, not even when the uniform lands on the running sum's
    very end (where a plain search would return the last, zero, token)."""
    p = torch.tensor([0.1, 0.0, 0.35, 0.05, 0.5, 0.0])
    gen = torch.Generator().manual_seed(11)
    draws = [sample(p, gen) for _ in range(20000)]
    assert draws[:50] == [
        sample(p, g) for g in [torch.Generator().manual_seed(11)] for _ in range(50)
    ]
    counts = torch.bincount(torch.tensor(draws), minlength=V).float()
    assert counts[1] == 0 and counts[5] == 0
    assert _chi_square(counts, p * len(draws)) < CHI2_5DF_P1E4
    monkeypatch.setattr(
        verify_mod.torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64)
    )
    assert sample(p, None) == 4


def _chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    mask = expected > 0
    return float((((counts - expected) ** 2)[mask] / expected[mask]).sum())


# Critical value of chi-square with 5 degrees of freedom at p = 1e-4.
CHI2_5DF_P1E4 = 25.74


def _first_token_counts(make_draft, n: int, temperature: float, seed: int) -> torch.Tensor:
    """Sample the first emitted token n times: the accepted first node, else the bonus."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.tensor([1.2, -0.3, 0.5, 2.0, -1.0, 0.1])
    counts = torch.zeros(V)
    for _ in range(n):
        draft = make_draft(gen)
        logits = base.repeat(1 + len(draft), 1)
        accepted, bonus = verify_sampling(draft, logits, temperature, 1.0, gen)
        first = draft.tokens[accepted[0]] if accepted else bonus
        counts[first] += 1
    return counts


def test_rejection_sampling_keeps_target_distribution_deterministic_tree():
    """Deterministic tree drafts (q = 1): the first emitted token follows p exactly.

    Chi-square goodness of fit over 6 tokens at p = 1e-4: with a fair verifier a
    fixed seed fails with probability 1e-4 (the seed is fixed, so the test is
    repeatable; a different seed would keep that false-failure chance).
    """
    n = 20000
    temperature = 0.9
    p = target_probs(torch.tensor([[1.2, -0.3, 0.5, 2.0, -1.0, 0.1]]), temperature)[0]

    def make(gen):
        a, b = torch.randperm(V, generator=gen)[:2].tolist()
        return Draft([a, b, 2], [-1, -1, 0])

    counts = _first_token_counts(make, n, temperature, seed=1)
    assert _chi_square(counts, p * n) < CHI2_5DF_P1E4


def test_rejection_sampling_keeps_target_distribution_model_draft():
    """Drafts sampled from a real q (draft-model style) with q's probabilities attached.

    Same chi-square criterion and false-failure chance (1e-4) as above.
    """
    n = 20000
    temperature = 1.0
    p = target_probs(torch.tensor([[1.2, -0.3, 0.5, 2.0, -1.0, 0.1]]), temperature)[0]
    q = torch.tensor([0.05, 0.4, 0.1, 0.1, 0.3, 0.05])

    def make(gen):
        x = int(torch.multinomial(q, 1, generator=gen))
        y = int(torch.multinomial(q, 1, generator=gen))
        return Draft([x, y], [-1, 0], probs=[q, q])

    counts = _first_token_counts(make, n, temperature, seed=2)
    assert _chi_square(counts, p * n) < CHI2_5DF_P1E4


def test_rejection_sampling_keeps_the_next_positions_distribution():
    """The second emitted token: a chain [3, y] whose rows differ (row 0 for the first
    token, row 1 for the one after 3). Whenever 3 is emitted first it was accepted (the
    residual after rejecting it has no mass on 3), and the token after it must follow
    row 1's distribution, whether node y is accepted or the bonus is drawn there.

    Chi-square over 6 tokens at p = 1e-4 on the ~40% of 20,000 runs that emit 3 first:
    a fair verifier fails with probability 1e-4 for a random seed (this one is fixed).
    """
    n = 20000
    temperature = 0.8
    rows = torch.tensor([[1.2, -0.3, 0.5, 2.0, -1.0, 0.1], [0.3, 1.5, -0.7, 0.0, 1.1, -2.0]])
    p1 = target_probs(rows[1:], temperature)[0]
    gen = torch.Generator().manual_seed(4)
    counts = torch.zeros(V)
    for _ in range(n):
        y = int(torch.randint(V, (1,), generator=gen))
        draft = Draft.chain([3, y])
        logits = torch.cat([rows, rows[1:]])  # root, node 0 (token 3), node 1 (token y)
        accepted, bonus = verify_sampling(draft, logits, temperature, 1.0, gen)
        if not accepted:
            continue
        second = draft.tokens[accepted[1]] if len(accepted) > 1 else bonus
        counts[second] += 1
    total = float(counts.sum())
    assert total > 0.3 * n
    assert _chi_square(counts, p1 * total) < CHI2_5DF_P1E4


def test_top_p_sampling_emits_only_nucleus_tokens():
    """At top_p 0.9 the verifier never emits a token outside the nucleus {0, 1, 2}, even when
    every draft offers one (an accepted draft token or the bonus after rejections)."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05, 1e-9, 1e-9])).repeat(3, 1)
    gen = torch.Generator().manual_seed(5)
    seen = set()
    for _ in range(2000):
        a, b = torch.randperm(V, generator=gen)[:2].tolist()
        draft = Draft([a, b], [-1, -1])
        accepted, bonus = verify_sampling(draft, logits, 1.0, 0.9, gen)
        seen.add(draft.tokens[accepted[0]] if accepted else bonus)
    assert seen == {0, 1, 2}


def test_the_check_catches_a_draft_that_states_the_wrong_q():
    """The chi-square check has power on the real verifier's output: drafts that always
    offer token 4 (p = 0.02) but state a uniform q get it accepted with probability
    min(1, p / q) instead of p, and the first-token counts fail the test (the same
    criterion the fair cases pass)."""
    n = 20000
    temperature = 0.9
    p = target_probs(torch.tensor([[1.2, -0.3, 0.5, 2.0, -1.0, 0.1]]), temperature)[0]
    uniform = torch.full((V,), 1.0 / V)

    def make(gen):
        return Draft([4], [-1], probs=[uniform])  # a lie: the draft is always 4

    counts = _first_token_counts(make, n, temperature, seed=3)
    assert _chi_square(counts, p * n) > CHI2_5DF_P1E4
    honest = _first_token_counts(lambda gen: Draft([4], [-1]), n, temperature, seed=3)
    assert _chi_square(honest, p * n) < CHI2_5DF_P1E4
