"""The speculation policy: the controller, the one place that measures, cuts drafts, picks
proposers and backs off (speculators/policy.py, book.py, acceptance.py, costs.py)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch

from codespec.daemon.engine.engine import GenParams
from codespec.speculators import policy
from codespec.speculators.acceptance import (
    PRIOR_FIRST,
    Acceptance,
    Count,
    best_cut,
    node_keys,
    walk,
)
from codespec.speculators.book import Avg, Book, PolicyStore, forget, temperature_class
from codespec.speculators.costs import CLIP, SIZES, ForwardCosts, Line
from codespec.speculators.draft import Draft, RequestInfo, StepResult
from codespec.speculators.ngram import NgramProposer
from codespec.speculators.policy import FIRST_PAUSE, TEMPERATURE_PRIOR, TRIAL_STEPS, Controller
from codespec.speculators.registry import make_proposer
from codespec.speculators.target import SpeculatorState
from conftest import heldout_prompts
from helpers import ScriptedProposer

REPEAT = (
    "def area(width, height):\n    return width * height\n\n\n"
    "def volume(width, height, depth):\n    return width * height * depth\n\n\n"
    "def area(width, height):\n    return width * height\n\n\n"
    "def volume(width, height, depth):\n    return width * height * depth\n\n\n"
    "def area("
)


class Slow(ScriptedProposer):
    """Drafts that take 50 ms to make: far behind plain decoding however busy the machine."""

    def propose(self, context, budget):
        time.sleep(0.05)
        return super().propose(context, budget)


class Fixed:
    """Offers the same chain every step and counts how often it was asked."""

    name = "fixed"

    def __init__(self, tokens: list[int], source: str = "fixed") -> None:
        self.tokens, self.source, self.asked, self.observed = tokens, source, 0, []

    def begin(self, request) -> None:
        pass

    def propose(self, context, budget):
        self.asked += 1
        return Draft.chain(self.tokens[:budget], self.source)

    def observe(self, result) -> None:
        self.observed.append(result)

    def follow(self, result) -> None:
        pass


# asked_every_step: the engine asks the proposer on every decode step but a last one
# with a single token left to write (no room for a draft), and whether a request ends so
# depends on how many nodes the timed cuts kept: a count of the steps the controller was
# asked (store.steps) is exact, decode_steps is one more in some runs.


def store_with(per_token: float, rest: float = 0.0) -> PolicyStore:
    """A store whose forward of n tokens takes 1 + per_token * (n - 1) ms and whose rest of
    a step takes ``rest`` ms."""
    store = PolicyStore()
    store.costs.seed({n: 1.0 + per_token * (n - 1) for n in (1, 2, 4, 8, 16, 32, 64)})
    store.rest.add(rest)
    return store


def plain(engine, prompt: list[int], n: int = 40) -> list[int]:
    engine.reset_cache()
    return engine.generate(prompt, GenParams(max_tokens=n))[0]


def run(engine, prompt: list[int], proposer, n: int = 40, temperature: float = 0.0):
    engine.reset_cache()
    return engine.generate(
        prompt, GenParams(max_tokens=n, temperature=temperature, seed=3), proposer
    )


def step(ctl: Controller, context: list[int], accepted: int) -> Draft | None:
    """One step by hand: propose, then the first ``accepted`` nodes accepted (a chain). No
    forward time: the store's seeded costs stand."""
    draft = ctl.propose(context, 8)
    n = len(draft) if draft is not None else 0
    acc = list(range(min(accepted, n)))
    tokens = [draft.tokens[a] for a in acc] + [0] if draft is not None else [0]
    ctl.observe(StepResult(draft, acc, 0, tokens, forward_tokens=1 + n))
    return draft


# -- costs and acceptance --------------------------------------------------------------


def test_forward_costs_interpolate_stay_monotone_and_take_a_seed():
    c = ForwardCosts()
    assert c.at(8) > c.at(1)  # a prior before any measurement
    c.seed({1: 4.0, 8: 8.0, 16: 6.0})  # noisy: a bigger forward measured cheaper
    assert c.seeded and c.at(1) == 4.0
    assert 4.0 < c.at(4) < 7.0
    assert c.at(16) == c.at(8) == 7.0  # the pair out of order is pooled, not floored
    assert c.relative(8) == 1.75 and c.at(200) >= c.at(16)
    assert c.table(3) == [4.0, 4.0, c.at(2), c.at(3)]
    line = Line()
    for n, ms in [(1, 5.0), (4, 8.0), (8, 12.0)] * 10:
        line.add(n, ms)
    assert line.at(1) == pytest.approx(5.0, abs=0.2) and line.at(8) == pytest.approx(12, abs=0.2)


def test_the_cost_table_is_at_for_every_size_bit_for_bit():
    """The policy reads a step's costs from ``table`` (one walk along the fit); every entry
    is exactly what ``at`` gives, between measured sizes, on them and past the last."""
    rng = random.Random(3)
    for trial in range(40):
        c = ForwardCosts()
        sizes = rng.sample([1, 2, 3, 5, 8, 12, 16, 20, 32, 48], rng.randint(1, 6))
        c.seed({n: rng.uniform(2.0, 40.0) for n in sizes})
        for _ in range(rng.randint(0, 30)):
            c.add(rng.randint(1, 70), rng.uniform(2.0, 60.0))
        most = rng.randint(0, 130)
        assert c.table(most) == [c.at(max(1, n)) for n in range(most + 1)], trial


def test_one_slow_forward_does_not_price_the_larger_sizes_for_good():
    """A spike measured once at a size the policy then avoids neither floors every larger
    size (it is pooled with its neighbours by weight) nor stays once it has faded between
    sizes measured since (they are interpolated): the failure seen on the edit workload,
    where one 42 ms forward of 7 tokens priced 7 and 8 tokens like 11 for the whole run."""
    c = ForwardCosts()

    def true_ms(n: int) -> float:
        return 15.0 + 3.5 * (n - 1)

    for _ in range(40):
        for n in (1, 2, 4, 6, 9, 16):
            c.add(n, true_ms(n))
    c.add(8, 50.0)  # one descheduled forward, slower than the size after it
    assert c.at(9) < true_ms(9) + 0.5  # pooled with size 9 by weight: not a floor for it
    assert c.at(16) == pytest.approx(true_ms(16), rel=0.01)
    c.add(11, 60.0)  # a slow one in order with its neighbours: pooling cannot see it
    for _ in range(40):
        for n in (1, 2, 4, 6, 9, 16):
            c.add(n, true_ms(n))
    # both have faded between sizes measured since: read by interpolation again
    assert c.at(8) == pytest.approx(true_ms(8), rel=0.01)
    assert c.at(11) == pytest.approx(true_ms(11), rel=0.01)
    # a size measured afresh after fading weighs the new forward above its faded figure
    c.add(8, true_ms(8))
    assert c.ms[SIZES.index(8)] - true_ms(8) < (50.0 - true_ms(8)) / 2


def test_a_forward_that_lost_the_cpu_moves_its_figure_little_a_lasting_rise_is_followed():
    """A timing far above a standing figure (the process was descheduled: a VM's steal, a
    neighbour's burst) counts as CLIP times the figure, so one spike moves it ~5%, where
    a plain decayed mean moved it by a tenth of the spike; a cost that truly doubled is
    reached within a few dozen forwards; the seed and a fresh size take timings as they
    are; the proposers' own-time lines the same."""
    clipped, plain = ForwardCosts(), ForwardCosts(clip=0.0)
    for c in (clipped, plain):
        for _ in range(30):
            c.add(1, 10.0)
            c.add(8, 20.0)
        c.add(8, 200.0)
    assert clipped.at(8) == pytest.approx(20.0 * (1 + (CLIP - 1) * 0.1), rel=1e-6)
    assert plain.at(8) == pytest.approx(38.0, rel=1e-6)
    for _ in range(40):
        clipped.add(8, 40.0)
    assert clipped.at(8) == pytest.approx(40.0, rel=0.02)
    fresh = ForwardCosts()
    fresh.add(4, 100.0)  # nothing stands behind size 4 yet: taken as it is
    fresh.seed({16: 500.0})
    assert fresh.at(4) == 100.0 and fresh.at(16) == 500.0
    line = Line()
    for _ in range(10):
        line.add(8, 0.1)
    line.add(8, 30.0)  # an n-gram lookup that lost the CPU
    assert line.at(8) < 0.2


def test_the_cut_keeps_the_likeliest_nodes_while_they_pay():
    """Nodes likeliest first, as many as give the most tokens per ms; none when a plain
    step is worth more; never more than the budget."""
    ms = [10.0, 11.0, 12.0, 13.0, 14.0]
    assert best_cut([0.9, 0.8, 0.7, 0.05], 4, ms)[0] == [0, 1, 2]
    assert best_cut([0.9, 0.8, 0.7, 0.05], 2, ms)[0] == [0, 1]
    assert best_cut([0.05, 0.01], 4, ms) == ([], 0.1)  # a plain step: 1 token per 10 ms
    # a tree: the sibling (node 2) is likelier than the grandchild (node 1)
    assert best_cut([0.9, 0.3, 0.6], 2, ms)[0] == [0, 2]
    expensive = [10.0, 30.0, 50.0]
    assert best_cut([0.9, 0.8], 2, expensive)[0] == []


def test_acceptance_counts_reached_nodes_and_drifts_back_to_the_prior():
    """A node is counted when its parent was accepted; a later sibling has its own key;
    unused figures decay towards the prior."""
    d = Draft([5, 6, 7, 8], [-1, 0, 1, -1], sources=["s"] * 4, match=9)
    keys = node_keys(d)
    assert keys[0] == ("s", 5, 1, False) and keys[3] == ("s", 5, 1, True)
    acc = Acceptance()
    acc.learn(d, [0], now=1)  # node 0 accepted, node 1 rejected: node 2 never reached
    assert acc.counts[keys[0]].hit == 1 and acc.counts[keys[1]].hit == 0
    assert keys[2] not in acc.counts and acc.counts[keys[3]].reach == 1
    for t in range(2, 30):
        acc.learn(d, [], now=t)
    assert acc.rate(keys[0], 30, PRIOR_FIRST) < 0.2
    assert acc.rate(keys[2], 30, 0.42) == 0.42  # never reached: the prior given
    later = acc.counts[keys[0]].rate(PRIOR_FIRST, 400)
    assert later == pytest.approx(PRIOR_FIRST, abs=0.02)


def test_a_cut_draft_remembers_its_rows():
    d = Draft([5, 6, 7, 8], [-1, 0, 1, 0])
    cut = d.select([0, 3])
    assert cut.parents == [-1, 0] and cut.origin == (d, [0, 3])
    res = StepResult(cut, [0], 9, [5, 9])
    assert res.rows_of(d) == {0: 1, 3: 2} and res.rows_of(cut) == {0: 1, 1: 2}
    assert res.rows_of(Draft([1])) == {}


# -- the controller by hand ------------------------------------------------------------


def test_drafts_are_cut_to_what_measured_acceptance_says_pays():
    """Depths 1-2 of this proposer are accepted, deeper ones never: two nodes verified,
    and the proposer observes the part verified (``rows_of`` finds its nodes)."""
    store = store_with(0.2)
    book = store.engine_wide.setdefault("greedy", Book())
    for depth, hits in ((1, 50), (2, 50), (3, 0)):
        book.accept.counts[("fixed", 0, depth, False)] = Count(hits, 50, 0)
    fixed = Fixed(list(range(10, 18)))
    ctl = Controller(None, {"fixed": fixed}, store, "fixed")
    ctl.begin(RequestInfo(prompt_ids=[1, 2, 3]))
    draft = ctl.propose([1, 2, 3], 8)
    assert draft is not None and draft.tokens == [10, 11]
    assert draft.origin is not None and draft.origin[1] == [0, 1]
    ctl.observe(StepResult(draft, [0, 1], 0, [10, 11, 0], forward_ms=5.0, forward_tokens=3))
    assert fixed.observed[-1].rows_of(draft.origin[0]) == {0: 1, 1: 2}
    assert store.costs.at(3) > store_with(0.2).costs.at(3)  # the forward it measured
    assert store.rest.n > 0


def test_expensive_verify_means_plain_steps(engine):
    prompt = engine.encode(REPEAT)
    ctl = Controller(engine, {"ngram": NgramProposer()}, store_with(1000.0))
    out, stats = run(engine, prompt, ctl)
    assert out == plain(engine, prompt)
    assert stats.target_forwards == stats.tokens  # the prefill gives the first token
    assert stats.drafted == {}  # nothing was worth a forward of two tokens or more


def test_a_rejected_draft_is_priced_not_skipped_one_not_worth_a_forward_backs_off():
    """Rejected drafts: the proposer is asked again the next step (its acceptance falls and
    the cut prices it; skipping it had cost edits ~5% of their decode speed); once its
    draft is not worth a forward it is not asked for 1, 2, 4 ... steps; one accepted token
    resets the pause. (A plain step of 100 ms: a proposer's own time, a few µs, stays far
    under CHEAP of it however busy the machine.)"""
    store = PolicyStore()
    store.costs.seed({n: 100.0 + 20.0 * (n - 1) for n in (1, 2, 4, 8, 16, 32, 64)})
    fixed = Fixed([7, 7, 7])
    ctl = Controller(None, {"fixed": fixed}, store, "fixed")
    ctl.begin(RequestInfo(prompt_ids=[1, 2, 3]))
    asked, verified = [], []
    for _ in range(16):
        before = fixed.asked
        verified.append(step(ctl, [1, 2, 3], accepted=0) is not None)
        asked.append(fixed.asked > before)
    first = verified.index(False)  # the first draft not worth a forward
    assert first >= 2 and all(asked[: first + 1])  # rejected twice or more, still asked
    assert asked[first : first + 6] == [True, False, True, False, False, True]
    book = store.engine_wide["greedy"]  # its drafts are accepted again: they pay
    for depth in (1, 2, 3):
        book.accept.counts[("fixed", 0, depth, False)] = Count(50, 50, store.steps)
    while True:  # the next probe is accepted...
        before = fixed.asked
        step(ctl, [1, 2, 3], accepted=3)
        if fixed.asked > before:
            break
    before = fixed.asked
    step(ctl, [1, 2, 3], accepted=3)
    assert fixed.asked == before + 1  # asked again the very next step


def test_temperature_has_its_own_figures_starting_below_greedy():
    store = store_with(0.1)
    greedy = store.engine_wide.setdefault("greedy", Book())
    greedy.tokens["eagle"], greedy.ms["eagle"] = Avg(4.0, 5), Avg(2.0, 5)  # 2 tokens per ms
    ctl = Controller(None, {"ngram": NgramProposer()}, store)
    ctl.begin(RequestInfo(prompt_ids=[1, 2, 3], temperature=0.8))
    assert ctl.tclass == "high"
    assert ctl._speed("eagle") == 2.0 * TEMPERATURE_PRIOR
    key = ("ngram:context", 4, 1, False)
    assert ctl._rate(key) == pytest.approx(PRIOR_FIRST * TEMPERATURE_PRIOR)
    ctl.glob.tokens["eagle"], ctl.glob.ms["eagle"] = Avg(1.0, 4), Avg(2.0, 4)  # its own
    assert ctl._speed("eagle") == 0.5
    ctl.begin(RequestInfo(prompt_ids=[1, 2, 3], temperature=0.0))
    assert ctl._speed("eagle") == 2.0 and ctl._rate(key) == PRIOR_FIRST
    assert [temperature_class(t) for t in (0.0, 0.3, 1.0)] == ["greedy", "low", "high"]


# -- on an engine ----------------------------------------------------------------------


def test_auto_output_equals_plain_decoding(engine):
    for prompt in heldout_prompts(engine, 5, tokens=160, seed=11):
        ref = plain(engine, prompt)
        out, _ = run(engine, prompt, make_proposer("auto", engine, None))
        assert out == ref


def test_a_named_proposer_runs_under_the_same_controller(engine):
    for name in ("ngram", "lookahead"):
        ctl = make_proposer(name, engine, None)
        assert isinstance(ctl, Controller) and list(ctl.children) == [name]
    assert make_proposer("off", engine, None) is None


def test_cheap_drafts_on_repeated_code_mean_ngram_steps(real_engine, one_thread):
    """The real model continues repeated code by repeating it: n-gram drafts from the
    context are verified and accepted, at temperature 0 and 0.8 (its own figures)."""
    engine = real_engine
    prompt = engine.encode(REPEAT)
    store = store_with(0.0)
    ctl = Controller(engine, {"ngram": NgramProposer()}, store)
    out, stats = run(engine, prompt, ctl)
    assert out == plain(engine, prompt)
    assert ctl.choices.get("ngram", 0) > 0 and stats.target_forwards < stats.tokens
    ctl = Controller(engine, {"ngram": NgramProposer()}, store)
    _, stats = run(engine, prompt, ctl, temperature=0.8)
    assert sum(stats.accepted.values()) > 0
    assert store.engine_wide["high"].accept.counts  # learnt apart from greedy


def test_the_faster_proposer_wins(real_engine, one_thread):
    """A slow proposer is asked once (unmeasured), then costly: with a fast proposer's
    drafts taken every step it is never in charge, and the fast one's drafts, accepted
    whole, grow deep. On the real model: a tiny model's steps are measured within the
    noise of a shared machine. The costs are seeded as the daemon seeds them (unseeded,
    one noisy early forward decided the depths: 12 to 30 forwards in runs here)."""
    engine = real_engine
    prompt = heldout_prompts(engine, 1, tokens=120, seed=5)[0]
    oracle = plain(engine, prompt, 120)
    good = ScriptedProposer(oracle, "correct", engine.runner.vocab_size)
    bad = Slow(oracle, "random", engine.runner.vocab_size, seed=1)
    store = PolicyStore()
    store.costs.seed(engine.time_forwards())  # as the daemon does at start
    ctl = Controller(engine, {"lookahead": good, "eagle": bad}, store)
    out, stats = run(engine, prompt, ctl, n=120)
    assert out == oracle
    assert set(ctl.choices) == {"lookahead"}  # the slow one never in charge
    # every step drafted but a last one with one token left (no room for a draft: the
    # engine does not ask; it happens or not with where the accepted runs end)
    assert ctl.choices["lookahead"] >= stats.decode_steps - 1
    assert stats.target_forwards < stats.tokens / 4


def test_a_measured_costly_proposer_beats_a_weaker_ngram_draft(engine):
    """When the n-gram proposer has a draft but a costly proposer's measured speed beats it
    by the margin, the costly proposer takes the step."""
    prompt = engine.encode(REPEAT)
    oracle = plain(engine, prompt, 60)
    store = store_with(0.3)
    store.own["eagle"] = Line()
    store.own["eagle"].add(1, 1000.0)  # far too slow to ask every step
    greedy = store.engine_wide.setdefault("greedy", Book())
    greedy.tokens["eagle"], greedy.ms["eagle"] = Avg(40.0, 8), Avg(1.0, 8)
    good = ScriptedProposer(oracle, "correct", engine.runner.vocab_size)
    ngram = NgramProposer()
    ctl = Controller(engine, {"ngram": ngram, "eagle": good}, store)
    out, _ = run(engine, prompt, ctl)
    assert out == plain(engine, prompt)
    assert ctl.choices.get("eagle", 0) > 0 and ctl.choices.get("ngram", 0) == 0


class SlowFirst(ScriptedProposer):
    """Correct drafts; the first ask of each request takes 50 ms (a catch-up on the prompt,
    as the n-gram proposer's context table once was)."""

    def begin(self, request) -> None:
        super().begin(request)
        self.first = True

    def propose(self, context, budget):
        if self.first:
            self.first = False
            time.sleep(0.05)
        return super().propose(context, budget)


def test_a_slow_first_ask_does_not_make_a_proposer_costly(engine):
    """The first ask of a request is not a step's cost: over two requests the proposer
    stays cheap (asked every step, in charge of every step) and is never retired."""
    prompt = heldout_prompts(engine, 1, tokens=120, seed=6)[0]
    oracle = plain(engine, prompt, 40)
    store = PolicyStore()
    for _ in range(2):
        ctl = Controller(
            engine, {"ngram": SlowFirst(oracle, "correct", engine.runner.vocab_size)}, store
        )
        before = store.steps
        out, stats = run(engine, prompt, ctl)
        assert out == oracle
        assert ctl.choices == {"ngram": store.steps - before}  # every step it was asked
        assert store.steps - before >= stats.decode_steps - 1  # see asked_every_step
    assert store.own["ngram"].at(16) < 25.0 and not store.retired


class CatchingUp(ScriptedProposer):
    """Correct drafts; its catch_up takes 150 ms on the request's first ask (what EAGLE does
    when it flushes the states it queued while other proposers drafted), 5 ms on later
    ones (a step's worth of states, when it was asked the step before)."""

    def begin(self, request) -> None:
        super().begin(request)
        self.behind = True

    def catch_up(self, context) -> None:
        time.sleep(0.15 if self.behind else 0.005)
        self.behind = False


def test_catching_up_is_a_switching_cost_not_a_step_cost(engine):
    """A proposer's catch_up after steps it was not asked is timed apart: its speed (the
    ms of the steps it was in charge of), its drafting time and the rest of a step never
    see it, so one 150 ms catch-up does not make a proposer that drafts right look slow.
    Asked the step before too, its catch-up is a step's work: its own time."""
    prompt = heldout_prompts(engine, 1, tokens=120, seed=6)[0]
    oracle = plain(engine, prompt, 40)
    store = PolicyStore()
    ctl = Controller(
        engine, {"ngram": CatchingUp(oracle, "correct", engine.runner.vocab_size)}, store
    )
    t0 = time.perf_counter()
    out, stats = run(engine, prompt, ctl)
    wall = (time.perf_counter() - t0) * 1000
    assert out == oracle and wall > 150  # it did catch up, once
    assert ctl.choices == {"ngram": store.steps}  # every step it was asked
    assert store.steps >= stats.decode_steps - 1  # see asked_every_step
    book = store.engine_wide["greedy"]
    assert book.ms["ngram"].n >= 2
    slowest = max(wall - 150, 1.0)  # every step's ms together, the catch-up left out
    assert book.ms["ngram"].value < slowest / 2  # an average step, not one with 150 ms in
    assert store.rest.value < 50 and 5 <= store.own["ngram"].at(8) < 50


def test_a_proposer_may_declare_where_its_acceptance_starts():
    """A proposer's prior_acceptance (per depth, each given its parent) is where the policy
    starts its first-child nodes' rates, before anything is measured; deeper than it
    declares, the rate one level shallower; later siblings and other proposers keep the
    generic prior. Measured hits move the rate from there."""
    store = store_with(0.3)
    declaring = Fixed([1, 2, 3, 4, 5, 6], source="eagle")
    declaring.prior_acceptance = (0.3, 0.2)
    ctl = Controller(None, {"eagle": declaring, "ngram": Fixed([7], "ngram:context")}, store)
    ctl.begin(RequestInfo(prompt_ids=[1, 2, 3], uri="u", max_tokens=8))
    assert ctl._rate(("eagle", 0, 1, False)) == pytest.approx(0.3)
    assert ctl._rate(("eagle", 0, 2, False)) == pytest.approx(0.2)
    assert ctl._rate(("eagle", 0, 3, False)) == pytest.approx(0.2)  # one level shallower
    assert ctl._rate(("eagle", 0, 1, True)) == pytest.approx(policy.prior(("eagle", 0, 1, True)))
    assert ctl._rate(("ngram:context", 3, 1, False)) == pytest.approx(PRIOR_FIRST)
    for _ in range(20):  # drafts of depth 1 always accepted
        ctl.glob.accept.learn(Draft.chain([1], "eagle"), [0], store.steps)
    ctl._rates = {}
    assert ctl._rate(("eagle", 0, 1, False)) > 0.8


def test_the_eagle_head_declares_its_held_out_acceptance(tmp_path):
    """training.json's held-out acceptance by depth is what an EAGLE runtime declares;
    no file, or figures that are not rates, declare nothing."""
    from codespec.speculators.eagle import measured_acceptance

    assert measured_acceptance(tmp_path) == ()
    (tmp_path / "training.json").write_text('{"heldout_teacher_forced_conditional": [0.4, 2]}')
    assert measured_acceptance(tmp_path) == ()
    (tmp_path / "training.json").write_text('{"heldout_teacher_forced_conditional": [0.4, 0.3]}')
    assert measured_acceptance(tmp_path) == (0.4, 0.3)
    shipped = Path(__file__).parent.parent / "speculators" / "heads" / "smollm2-135m-instruct"
    figures = json.loads((shipped / "training.json").read_text())
    assert measured_acceptance(shipped) == tuple(figures["heldout_teacher_forced_conditional"])


def test_later_cheap_proposers_are_not_asked_when_an_earlier_offer_is_enough(engine):
    """A cheap proposer whose drafts are accepted whole fills the step: the next cheap one
    is not asked (its own time would be spent for nothing); with nothing offered before
    it, it is asked every step."""
    prompt = heldout_prompts(engine, 1, tokens=120, seed=8)[0]
    oracle = plain(engine, prompt, 40)
    second = Fixed([1, 2, 3])
    good = ScriptedProposer(oracle, "correct", engine.runner.vocab_size)
    ctl = Controller(engine, {"ngram": good, "fixed": second}, PolicyStore())
    out, _ = run(engine, prompt, ctl)
    assert out == oracle and second.asked == 0
    alone = Fixed([1, 2, 3])
    silent = ScriptedProposer(oracle, "correct", engine.runner.vocab_size)
    silent.propose = lambda context, budget: None  # type: ignore[method-assign]
    ctl = Controller(engine, {"ngram": silent, "fixed": alone}, PolicyStore())
    run(engine, prompt, ctl)
    assert alone.asked > 0


def test_a_far_loser_retires_and_comes_back_for_one_trial(engine):
    """A costly proposer far slower than plain decoding stops being built (no per-step
    cost) until its retirement ends, then gets one fresh trial."""
    prompt = heldout_prompts(engine, 1, tokens=120, seed=4)[0]
    oracle = plain(engine, prompt, 40)
    store = PolicyStore()

    def build() -> Controller:
        slow = Slow(oracle, "random", engine.runner.vocab_size, seed=2)
        children = {"eagle": slow} if store.usable("eagle") else {}
        return Controller(engine, {"ngram": NgramProposer(use_context=False), **children}, store)

    ctl = build()
    run(engine, prompt, ctl)
    tried = ctl.choices["eagle"]
    # its first two asks (the first one's time is not a step's: it may catch up on the
    # prompt), then at most a trial
    assert 1 <= tried <= 2 + TRIAL_STEPS
    assert "eagle" not in ctl.children and not store.usable("eagle")
    assert list(build().children) == ["ngram"]  # not built while retired
    store.steps = store.retired["eagle"].until  # the retirement is over
    again = build()
    assert "eagle" in again.children
    run(engine, prompt, again)
    assert again.choices["eagle"] == TRIAL_STEPS  # one fresh trial
    assert store.pauses["eagle"] == 2 * FIRST_PAUSE  # and a longer pause after it


class TickingClock:
    """The policy's clock in a test whose choices must not follow this machine's speed:
    every reading is 10 µs after the last (a proposer's ask, a step's rest: all tiny)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-5
        return self.now


@pytest.mark.parametrize("name", ["eagle", "lookahead"])
def test_proposers_follow_steps_they_did_not_draft(spec_engine, name, monkeypatch):
    """With n-gram steps in between, a proposer is kept in step by ``follow`` and the
    output is still plain decoding's (the tiny model with an EAGLE head beside it). The
    policy's figures are fixed (forwards of every size 1 ms, its own clock ticking 10 µs a
    reading): with measured ones, a slow spell of the machine priced lookahead's drafts
    out, it never took a step and the test failed (once in a clean-clone CI run)."""
    from codespec.ngram_index import NgramIndex
    from codespec.speculators.registry import build

    engine = spec_engine
    monkeypatch.setattr(policy, "CLOSE", 0.0)  # never retired here, however slow it is
    monkeypatch.setattr(policy, "time", TickingClock())
    store = store_with(0.0)
    monkeypatch.setattr(store.costs, "add", lambda n, ms: None)  # the seeded 1 ms stand
    prompt = engine.encode(REPEAT)
    out = plain(engine, prompt, 48)
    # a random model does not repeat its context: the n-gram drafts come from two open
    # documents holding pieces of what it writes (tokens 0-13 and 24-37 of its output)
    index = NgramIndex(engine.tokenizer.backend_tokenizer)
    index.open("file:///a.py", engine.decode(prompt[-24:] + out[:14]))
    index.open("file:///b.py", engine.decode(out[20:38]))
    child = build(name, engine, None)
    ctl = Controller(engine, {"ngram": NgramProposer(index=index), name: child}, store)
    engine.reset_cache()
    ids = [t for s in engine.stream(prompt, GenParams(max_tokens=48), ctl) for t in s.token_ids]
    assert ids[:48] == out[:48]
    assert ctl.choices.get("ngram") and ctl.choices.get(name)
    if name == "eagle":  # its cache + queued states end where the context does
        assert child.sync(prompt + ids)


def test_auto_leaves_out_proposers_without_weights(engine, spec_engine):
    """The tiny model has no weights beside it: auto builds n-gram and lookahead and the
    summary says why EAGLE is missing; beside ``spec_engine``'s model it builds EAGLE too.
    (What earlier tests taught the policy on these engines is forgotten first: a proposer
    they retired would be left out.)"""
    forget(engine)
    forget(spec_engine)
    bare = make_proposer("auto", engine, None)
    assert list(bare.children) == ["ngram", "lookahead"]
    store = policy.store_for(engine)
    assert store.available["eagle"] is False
    assert store.why["eagle"].startswith("no eagle weights for this model (")
    assert policy.summary(engine)["weights"] == {
        "eagle": "no weights for this model",
        "lookahead": "needs no weights",
    }
    full = make_proposer("auto", spec_engine, None)
    retired = set(policy.store_for(spec_engine).retired)
    assert set(full.children) | retired == {"ngram", "eagle", "lookahead"}
    prompt = heldout_prompts(spec_engine, 1, tokens=100, seed=3)[0]
    out, _ = run(spec_engine, prompt, full, n=24)
    assert out == plain(spec_engine, prompt, 24)


def test_auto_minus_a_proposer_leaves_it_out(spec_engine):
    """``auto-eagle`` (a side-by-side method of the benches): auto without EAGLE, beside a
    model that has a head; n-gram cannot be left out, unknown names are not taken."""
    from codespec.speculators.registry import UnknownProposer, known

    forget(spec_engine)
    assert known("auto-eagle") and known("auto-eagle-lookahead") and known("auto")
    assert not known("auto-ngram") and not known("auto-nothing") and not known("auto-")
    ctl = make_proposer("auto-eagle", spec_engine, None)
    assert list(ctl.children) == ["ngram", "lookahead"]
    assert list(make_proposer("auto-eagle-lookahead", spec_engine, None).children) == ["ngram"]
    assert "eagle" in make_proposer("auto", spec_engine, None).children
    with pytest.raises(UnknownProposer):
        make_proposer("auto-ngram", spec_engine, None)
    prompt = heldout_prompts(spec_engine, 1, tokens=100, seed=5)[0]
    out, _ = run(spec_engine, prompt, ctl, n=16)
    assert out == plain(spec_engine, prompt, 16)


def test_weights_that_do_not_fit_are_reported(engine, tmp_path):
    """A head made for another model is left out by auto, and the summary says why."""
    import shutil

    from codespec.daemon.engine.engine import Engine
    from conftest import tiny_model_dir
    from helpers import eagle_head_for

    folder = tmp_path / "model"
    shutil.copytree(engine.model_path, folder)
    other = tiny_model_dir(tmp_path / "other", folder, hidden_size=32)
    eagle_head_for(other, folder / "eagle", draft_vocab=64)  # hidden size 32, not 64
    e = Engine(folder)
    auto = make_proposer("auto", e, None)
    assert "eagle" not in auto.children
    state = policy.summary(e)["weights"]["eagle"]
    assert state.startswith("not usable: ") and "hidden size 32" in state


def test_the_summary_reports_costs_and_speed_vs_plain(engine):
    """After a run: forward ms by size, the plain step's ms and the proposer's speed
    against plain decoding's, for the target the controller measured for (a stand-in
    here, so no other test's figures mix in)."""

    class Target:
        model_path = engine.model_path

        def __init__(self) -> None:
            self.speculator_state = SpeculatorState()

    target = Target()
    prompt = engine.encode(REPEAT)
    oracle = plain(engine, prompt, 30)
    fast = ScriptedProposer(oracle, "correct", engine.runner.vocab_size)
    ctl = Controller(target, {"lookahead": fast})
    assert ctl.store is policy.store_for(target) is not policy.store_for(engine)
    run(engine, prompt, ctl, n=30)
    s = policy.summary(target)
    assert s["forward_ms"] and min(s["forward_ms"].values()) > 0  # the verify forwards
    assert s["steps"] >= ctl.choices["lookahead"]
    greedy = s["classes"]["greedy"]
    assert greedy["plain_step_ms"] > 0 and greedy["vs_plain"]["lookahead"] > 1.0
    assert s["weights"]["lookahead"] == "needs no weights"


def test_the_engine_times_forwards_without_touching_its_cache(engine):
    """``time_forwards`` (what the daemon seeds the policy with) leaves the cache as it was."""
    prompt = heldout_prompts(engine, 1, tokens=64)[0]
    engine.reset_cache()
    engine.runner.forward(prompt)
    length = engine.runner.length
    table = engine.time_forwards((1, 4, 16))
    assert set(table) == {1, 4, 16} and all(ms > 0 for ms in table.values())
    assert engine.runner.length == length
    after = engine.runner.forward([prompt[-1]]).logits[-1]
    engine.reset_cache()
    fresh = engine.runner.forward([*prompt, prompt[-1]], last_only=True).logits[-1]
    torch.testing.assert_close(after, fresh, rtol=1e-4, atol=1e-4)
    store = PolicyStore()
    store.costs.seed(table)
    assert {s for s, _ in store.costs.known()} == {1, 4, 16}


def test_walk_finds_what_verification_would_have_accepted():
    d = Draft([5, 6, 7, 8, 9], [-1, 0, 0, 2, 3])
    assert walk(d, [5, 7, 8, 9]) == [0, 2, 3, 4]
    assert walk(d, [5, 7]) == [0, 2]  # no deeper than the tokens produced
    assert walk(d, [4, 7]) == []


def test_a_draft_not_verified_learns_from_the_tokens_the_step_produced():
    """The proposer whose draft lost the step (and the verified one, past its cut) is
    counted against the tokens the step produced, at most that deep: a source rejected
    early in a request wins its steps back once the text follows it again."""
    store = store_with(0.2)
    good = Fixed([10, 11, 12, 13, 14, 15, 16, 17], "good")
    rival = Fixed([10, 11, 12], "rival")
    ctl = Controller(None, {"good": good, "rival": rival}, store, "auto")
    ctl.begin(RequestInfo(prompt_ids=[1, 2, 3]))
    book = store.engine_wide["greedy"]
    for depth in (1, 2, 3):  # the rival's 3 nodes always accepted; the good one's rejected
        book.accept.counts[("rival", 0, depth, False)] = Count(50, 50, 0)
        book.accept.counts[("good", 0, depth, False)] = Count(0, 6, 0)
    chosen = []
    for _ in range(20):
        draft = ctl.propose([1, 2, 3], 8)
        assert draft is not None
        chosen.append((draft.source(0), len(draft)))
        acc = list(range(len(draft)))  # the text is 10, 11, ... 17: every node accepted
        tokens = [draft.tokens[a] for a in acc] + [10 + len(draft)]
        ctl.observe(StepResult(draft, acc, tokens[-1], tokens, forward_tokens=1 + len(draft)))
    assert chosen[0] == ("rival", 3) and chosen[-1] == ("good", 8)
    assert ctl._rate(("good", 0, 4, False)) > 0.9  # bonus tokens decided depth 4


def test_a_proposer_is_cheap_by_its_time_at_the_size_it_offers():
    """Own time grows with a draft's nodes: the cheap-or-costly test reads it at the size
    the proposer offers, not extrapolated to the whole budget (an n-gram proposer priced
    at 64 nodes after one slow ask was taken for a costly one and retired)."""
    store = store_with(0.2)
    line = store.own.setdefault("fixed", Line())
    for n, ms in [(4, 0.1), (8, 0.3)] * 4:  # 0.05 ms a node: 3.1 ms at 64 nodes
        line.add(n, ms)
    ctl = Controller(None, {"fixed": Fixed([1, 2])}, store, "fixed")
    plain_ms = store.costs.at(1)
    assert line.at(64) > policy.CHEAP * plain_ms >= line.at(line.mean_n)
    cheap, costly = ctl._split(plain_ms, 64)
    assert [c.name for c in cheap] == ["fixed"] and costly == []
