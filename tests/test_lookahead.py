"""LookaheadProposer: window tree shape, Jacobi update (also from a draft the policy
verified in part), pool, lossless decoding bare and under the policy."""

from __future__ import annotations

import torch

from codespec.speculators.draft import Draft, RequestInfo, StepResult
from codespec.speculators.lookahead import (
    POOL,
    WINDOW,
    LookaheadProposer,
    NgramPool,
    PoolStore,
    jacobi_step,
    make,
    store_for,
    window_nodes,
)
from codespec.speculators.target import SpeculatorState
from conftest import heldout_prompts

VOCAB = 64


def depths(draft: Draft) -> list[int]:
    assert draft.parents is not None
    out: list[int] = []
    for p in draft.parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def window_only(draft: Draft) -> list[int]:
    return [i for i in range(len(draft)) if draft.source(i) == WINDOW]


def logits_for(draft: Draft, best: dict[int, int]) -> torch.Tensor:
    """Logits rows (root + nodes) whose argmax is ``best[row]`` (default token 0)."""
    rows = torch.zeros((1 + len(draft), VOCAB))
    for r in range(rows.shape[0]):
        rows[r, best.get(r, 0)] = 1.0
    return rows


def test_window_tree_has_diagonal_parents_and_depths_equal_to_offsets() -> None:
    """Level 0 is a chain off the root; level l at column j hangs off level l-1 at j-1."""
    prop = LookaheadProposer(window=4, ngram=3, guesses=2)
    prompt = list(range(10, 30))  # no repeated token: the pool has nothing for the root
    prop.begin(RequestInfo(prompt_ids=prompt))
    d1 = prop.propose(prompt, budget=16)
    assert d1 is not None and d1.parents == [-1, 0, 1, 2]  # one level until the first update
    # a chain, but the update below reads its rows: the verify forward keeps them all
    assert d1.is_chain and d1.reads_rows
    # The update: the argmax at level-0 column j is the level-1 guess for column j + 1.
    prop.observe(StepResult(d1, [], 5, [5], logits=logits_for(d1, {1: 40, 2: 41, 3: 42, 4: 43})))
    context = [*prompt, 5]
    d2 = prop.propose(context, budget=16)
    assert d2 is not None and set(d2.sources or []) == {WINDOW}
    # slid by one emitted token: level 0 = its old columns 1..3 + a filled column, level 1 =
    # the new guesses 41, 42, 43 at columns 1..3 (40 was for column 0, the emitted token)
    assert d2.tokens[:3] == d1.tokens[1:]
    assert d2.parents == [-1, 0, 1, 2, 0, 1, 2]
    assert d2.tokens[4:] == [41, 42, 43]
    assert depths(d2) == [1, 2, 3, 4, 2, 3, 4]
    assert window_nodes(4, 2) == len(d2)


def test_jacobi_update_harvests_diagonal_ngrams_into_the_pool() -> None:
    """With N - 1 levels, each diagonal + its new token is an N-gram keyed by its first token."""
    levels, grams = jacobi_step([[1, 2, 3], [None, 4, 5]], [None, None, 6, 7], n=3, emitted=2)
    assert grams == [[1, 4, 6], [2, 5, 7]]
    assert levels == [[5, None, None], [6, 7, None]]  # slid two columns
    prop = LookaheadProposer(window=3, ngram=3, guesses=4)
    prompt = list(range(100, 120))
    prop.begin(RequestInfo(prompt_ids=prompt))
    ctx = list(prompt)
    for step in range(3):
        d = prop.propose(ctx, budget=16)
        assert d is not None
        nodes = window_only(d)
        best = {1 + i: 50 + step for i in nodes}
        prop.observe(StepResult(d, [], 7, [7], logits=logits_for(d, best)))
        ctx.append(7)
    # step 1 stacked level 1 (all 50); step 2's diagonals (level 0, 50, 51) are 3-grams
    assert any((50, 51) in conts for conts in prop.pool.table.values())


def test_a_window_verified_in_part_updates_only_the_columns_verified() -> None:
    """The policy may verify part of the draft (``Draft.select``): the Jacobi update reads
    the rows of the nodes it verified, found through ``StepResult.rows_of``, and leaves the
    other columns unlearned."""
    prop = LookaheadProposer(window=4, ngram=3, guesses=2)
    prompt = list(range(10, 30))
    prop.begin(RequestInfo(prompt_ids=prompt))
    d1 = prop.propose(prompt, budget=16)
    assert d1 is not None and d1.parents == [-1, 0, 1, 2]
    verified = d1.select([0, 1])  # columns 0 and 1 only
    rows = torch.zeros((1 + len(verified), VOCAB))
    rows[1, 40] = rows[2, 41] = 1.0  # the argmax at the verified nodes
    prop.observe(StepResult(verified, [], 5, [5], logits=rows))
    d2 = prop.propose([*prompt, 5], budget=16)
    assert d2 is not None
    # the argmax at column j is level 1's guess for column j + 1, and the window slid by
    # one: column 1 holds 41 (learned at column 1), columns 2 and 3 nothing learned (their
    # level-0 nodes were not verified), so they are filled from the level below
    level1 = {j: d2.tokens[i] for i, j in zip(range(4, 7), range(1, 4), strict=True)}
    assert level1[1] == 41
    assert level1[2] == d2.tokens[2] and level1[3] == d2.tokens[3]


def test_pool_keeps_at_most_g_per_key_and_lives_per_document_across_requests() -> None:
    """G bounds each key (the most recent first); pools are per uri and outlive a request."""
    pool = NgramPool(n=3, g=2)
    for gram in ([1, 2, 3], [1, 4, 5], [1, 6, 7], [1, 4, 5]):
        pool.add(gram)
    assert pool.get(1) == [(4, 5), (6, 7)]
    store = PoolStore(max_documents=2)
    a = LookaheadProposer(window=0, ngram=3, guesses=2, store=store)
    a.begin(RequestInfo(prompt_ids=[9, 1, 2, 9, 1, 3, 9, 1, 4], uri="file:///a.py"))
    assert a.pool.get(9) == [(1, 4), (1, 3)]  # three continuations seen, two kept
    b = LookaheadProposer(window=0, ngram=3, guesses=2, store=store)
    b.begin(RequestInfo(prompt_ids=[5, 5, 5], uri="file:///a.py"))
    assert b.pool is a.pool and b.pool.get(9) == [(1, 4), (1, 3)]
    c = LookaheadProposer(window=0, ngram=3, guesses=2, store=store)
    c.begin(RequestInfo(prompt_ids=[5, 5, 5], uri="file:///b.py"))
    assert c.pool is not a.pool and c.pool.get(9) == []
    d = c.propose([5, 5, 5, 9], budget=4)
    assert d is None  # nothing pooled under 9 for b.py and no window
    drafted = b.propose([5, 5, 9], budget=8)
    assert drafted is not None and drafted.sources == [POOL] * 3
    assert drafted.tokens == [1, 4, 3] and drafted.parents == [-1, 0, 0]  # shared prefix
    # a third document evicts the least recently used pool
    LookaheadProposer(window=0, ngram=3, guesses=2, store=store).begin(
        RequestInfo(prompt_ids=[1], uri="file:///c.py")
    )
    assert len(store) == 2
    assert store.pool("file:///a.py", 3, 2).get(9) == []


def test_pool_branch_comes_first_and_small_budgets_fit() -> None:
    """The verification branch precedes the window; budgets 1 and 2 give drafts within them."""
    prompt = [3, 4, 5, 6, 3, 4, 5, 7, 8, 9, 3]
    for budget in (1, 2, 3):
        prop = LookaheadProposer(window=4, ngram=3, guesses=2)
        prop.begin(RequestInfo(prompt_ids=prompt))
        d = prop.propose(prompt, budget=budget)
        assert d is not None and len(d) <= budget
        assert d.source(0) == POOL and d.tokens[0] == 4
        assert d.reads_rows == (WINDOW in (d.sources or []))
    prop = LookaheadProposer(window=4, ngram=3, guesses=2)
    prop.begin(RequestInfo(prompt_ids=prompt))
    d = prop.propose(prompt, budget=5)
    assert d is not None and d.sources == [POOL] * 2 + [WINDOW] * 3
    assert d.parents == [-1, 0, -1, 2, 3]


def test_make_keeps_pools_with_the_engine() -> None:
    """The registry's factory: one store per engine object, kept in its state."""

    class FakeEngine:
        def __init__(self) -> None:
            self.speculator_state = SpeculatorState()

    e1, e2 = FakeEngine(), FakeEngine()
    assert make(e1, None).store is store_for(e1) is make(e1, None).store
    assert make(e2, None).store is not store_for(e1)
    assert e1.speculator_state.find(PoolStore) is store_for(e1)


def run(engine, prompt: list[int], params, proposer=None) -> tuple[list[int], object]:
    """Token ids emitted (cut at the stop token: a step's ids may run past it) and stats."""
    ids: list[int] = []
    stats = None
    for delta in engine.stream(prompt, params, proposer):
        ids.extend(delta.token_ids)
        stats = delta.stats
    for i, t in enumerate(ids):
        if t in engine.stop_ids:
            return ids[:i], stats
    return ids[: params.max_tokens], stats


def plain(engine, prompt: list[int], max_tokens: int) -> list[int]:
    from codespec.daemon.engine.engine import GenParams

    return run(engine, prompt, GenParams(max_tokens=max_tokens))[0]


def test_greedy_outputs_equal_plain_decoding(engine, one_thread) -> None:
    """Temperature 0: lookahead emits plain decoding's tokens on held-out prompts, bare
    (every node verified every step) and under the policy, and the drafts get accepted."""
    from codespec.daemon.engine.engine import GenParams
    from codespec.speculators.book import PolicyStore
    from codespec.speculators.policy import Controller

    store = PoolStore()
    figures = PolicyStore()  # its own: what other tests taught the engine's does not mix in
    accepted = {POOL: 0, WINDOW: 0}
    drafted = {True: 0, False: 0}
    for prompt in heldout_prompts(engine, 4, tokens=120, seed=11):
        want = plain(engine, prompt, 40)
        for bare in (True, False):
            prop = LookaheadProposer(store=store)
            driver = prop if bare else Controller(engine, {"lookahead": prop}, figures, "lookahead")
            got, stats = run(engine, prompt, GenParams(max_tokens=40), driver)
            assert got == want
            assert stats is not None
            for src in accepted:
                accepted[src] += stats.accepted.get(src, 0)
            drafted[bare] += sum(stats.drafted.values())
    assert accepted[POOL] > 0
    assert drafted[True] > 0 and drafted[False] > 0


def test_tiny_budgets_and_sampling(engine, one_thread) -> None:
    """max_draft 1 and 2 still decode losslessly. Sampling with lookahead's drafts: a seed
    gives the same tokens twice, and with a nucleus of one token (tiny top_p) sampling is
    greedy decoding, so rejection sampling must accept exactly the drafts greedy would."""
    from codespec.daemon.engine.engine import GenParams

    prompt = heldout_prompts(engine, 1, tokens=100, seed=3)[0]
    want = plain(engine, prompt, 24)
    for cap in (1, 2):
        prop = LookaheadProposer()
        got, _ = run(engine, prompt, GenParams(max_tokens=24, max_draft=cap), prop)
        assert got == want

    def sampled(prompt, seed: int, top_p: float = 1.0, max_tokens: int = 24):
        info = RequestInfo(prompt_ids=prompt, temperature=0.8)
        params = GenParams(max_tokens=max_tokens, temperature=0.8, top_p=top_p, seed=seed)
        return engine.generate(prompt, params, LookaheadProposer(), info)

    drafted = 0
    for seed in range(3):
        (a, stats), (b, _) = sampled(prompt, seed), sampled(prompt, seed)
        assert a == b and stats.tokens > 0, f"seed {seed}: not reproducible"
        drafted += sum(stats.drafted.values())
    assert drafted > 0
    # a prompt whose greedy continuation lookahead's pool catches within 48 tokens
    prompt = heldout_prompts(engine, 1, tokens=100, seed=5)[0]
    info = RequestInfo(prompt_ids=prompt)
    want, greedy = engine.generate(prompt, GenParams(max_tokens=48), LookaheadProposer(), info)
    got, stats = sampled(prompt, 7, top_p=1e-6, max_tokens=48)
    assert got == want
    assert stats.accepted == greedy.accepted and sum(stats.accepted.values()) > 0
