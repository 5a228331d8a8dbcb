"""The speculation policy ("auto") and the forward-cost table it divides by."""

from __future__ import annotations

import time

import pytest
import torch

from codespec.daemon.engine.engine import GenParams
from codespec.speculators import policy
from codespec.speculators.costs import ForwardCosts
from codespec.speculators.draft import RequestInfo
from codespec.speculators.ngram import NgramProposer
from codespec.speculators.policy import (
    FIRST_PAUSE,
    TEMPERATURE_PRIOR,
    TRIAL_STEPS,
    AutoProposer,
    Avg,
    Book,
    PolicyStore,
    _rate,
    depth_bucket,
    temperature_class,
)
from codespec.speculators.registry import FACTORIES, make_proposer
from conftest import heldout_prompts
from helpers import ScriptedProposer

REPEAT = (
    "def area(width, height):\n    return width * height\n\n\n"
    "def volume(width, height, depth):\n    return width * height * depth\n\n\n"
    "def area(width, height):\n    return width * height\n\n\n"
    "def volume(width, height, depth):\n    return width * height * depth\n\n\n"
    "def area("
)


class Positional(ScriptedProposer):
    """Drafts by position in the oracle: nothing to keep in step when another proposer
    drafted a step."""

    def follow(self, result) -> None:
        pass


class Slow(Positional):
    """Drafts that also take 50 ms to make: far behind plain decoding however busy the
    machine is."""

    def propose(self, context, budget):
        time.sleep(0.05)
        return super().propose(context, budget)


def costs(per_token: float) -> ForwardCosts:
    """A cost table where a forward of n tokens takes 1 + per_token * (n - 1) ms (the
    measured rest of a step, tens of ms on a busy machine, comes on top)."""
    c = ForwardCosts()
    for n in (1, 2, 4, 8, 16, 32, 64):
        c.add(n, 1.0 + per_token * (n - 1))
    c.calibrated = True
    return c


def plain(engine, prompt: list[int], n: int = 40) -> str:
    engine.reset_cache()
    return engine.generate(prompt, GenParams(max_tokens=n))[0]


def run(engine, prompt: list[int], proposer, n: int = 40, temperature: float = 0.0):
    engine.reset_cache()
    return engine.generate(
        prompt, GenParams(max_tokens=n, temperature=temperature, seed=3), proposer
    )


def test_forward_costs_interpolate_and_stay_monotone():
    c = ForwardCosts()
    assert c.at(8) > c.at(1)  # a prior before any measurement
    c.add(1, 4.0)
    c.add(8, 8.0)
    c.add(16, 6.0)  # noisy: a bigger forward measured cheaper
    assert c.at(1) == 4.0
    assert 4.0 < c.at(4) < 8.0
    assert c.at(16) >= c.at(8)  # never cheaper than a smaller one
    assert c.relative(8) == 2.0
    assert c.at(200) >= c.at(16)


def test_calibration_leaves_the_cache_as_it_was(engine):
    prompt = heldout_prompts(engine, 1, tokens=64)[0]
    engine.reset_cache()
    engine.runner.forward(prompt)
    length = engine.runner.length
    c = ForwardCosts()
    c.calibrate(engine.runner, sizes=(1, 4, 16), reps=1)
    assert c.calibrated and {s for s, _ in c.known()} == {1, 4, 16}
    assert engine.runner.length == length
    after = engine.runner.forward([prompt[-1]]).logits[-1]
    engine.reset_cache()
    fresh = engine.runner.forward([*prompt, prompt[-1]], last_only=True).logits[-1]
    torch.testing.assert_close(after, fresh, rtol=1e-4, atol=1e-4)


def test_auto_output_equals_plain_decoding(engine):
    for prompt in heldout_prompts(engine, 5, tokens=160, seed=11):
        ref = plain(engine, prompt)
        out, _ = run(engine, prompt, make_proposer("auto", engine, None))
        assert out == ref


def test_expensive_drafts_mean_plain_steps(engine):
    prompt = engine.encode(REPEAT)
    auto = AutoProposer(engine, NgramProposer(min_gain=0.0), {}, PolicyStore(costs(1000.0)))
    out, stats = run(engine, prompt, auto)
    assert out == plain(engine, prompt)
    assert stats.target_forwards == stats.tokens  # the prefill gives the first token
    assert stats.drafted == {}
    assert set(auto.choices) == {"plain"}


def test_cheap_drafts_on_repeated_code_mean_ngram_steps(real_engine, one_thread):
    """The real model continues repeated code by repeating it: cheap n-gram drafts from
    the context are taken and accepted."""
    engine = real_engine
    prompt = engine.encode(REPEAT)
    auto = AutoProposer(engine, NgramProposer(min_gain=0.0), {}, PolicyStore(costs(0.0)))
    out, stats = run(engine, prompt, auto)
    assert out == plain(engine, prompt)
    assert auto.choices.get("ngram", 0) > 0
    assert stats.target_forwards < stats.tokens


def test_the_faster_model_proposer_wins(real_engine, one_thread):
    """Untried model proposers get a trial each; then the one with the better measured
    rate stays in charge (the other only gets a probe after a gap). On the real model: a
    tiny model's sub-millisecond steps are measured within the noise of a shared machine."""
    engine = real_engine
    prompt = heldout_prompts(engine, 1, tokens=120, seed=5)[0]
    engine.reset_cache()
    oracle = [t for d in engine.stream(prompt, GenParams(max_tokens=120)) for t in d.token_ids]
    good = Positional(oracle, "correct", engine.runner.vocab_size)
    bad = Slow(oracle, "random", engine.runner.vocab_size, seed=1)
    store = PolicyStore(ForwardCosts())  # measured: calibrated when the request begins
    models = {"eagle": bad, "lookahead": good}
    silent = NgramProposer(use_context=False)  # no index either: it never drafts
    auto = AutoProposer(engine, silent, models, store)
    out, stats = run(engine, prompt, auto, n=120)
    assert out == plain(engine, prompt, 120)
    glob = store.engine_wide["greedy"]
    assert _rate(glob, "lookahead", 1) > _rate(glob, "eagle", 1)
    assert auto.choices["eagle"] == TRIAL_STEPS  # its trial, and no second chance yet
    assert auto.choices["lookahead"] > TRIAL_STEPS
    assert stats.target_forwards < stats.tokens / 4


def test_temperature_has_its_own_figures_starting_below_greedy():
    store = PolicyStore(costs(0.1))
    greedy = store.engine_wide.setdefault("greedy", Book())
    greedy.tokens["eagle"], greedy.ms["eagle"] = Avg(4.0, 5), Avg(2.0, 5)  # 2 tokens per ms
    auto = AutoProposer(None, NgramProposer(), {}, store, calibrate=False)
    auto.begin(RequestInfo(prompt_ids=[1, 2, 3], temperature=0.8))
    assert auto.tclass == "high"
    assert auto._figure("rate", "eagle") == 2.0 * TEMPERATURE_PRIOR
    auto.glob.tokens["eagle"], auto.glob.ms["eagle"] = Avg(1.0, 4), Avg(2.0, 4)  # its own
    assert auto._figure("rate", "eagle") == 0.5
    auto.begin(RequestInfo(prompt_ids=[1, 2, 3], temperature=0.0))
    assert auto._figure("rate", "eagle") == 2.0
    assert [temperature_class(t) for t in (0.0, 0.3, 1.0)] == ["greedy", "low", "high"]


def test_sampling_runs_finish(engine):
    prompt = heldout_prompts(engine, 1, tokens=100, seed=2)[0]
    _out, stats = run(engine, prompt, make_proposer("auto", engine, None), temperature=0.8)
    assert stats.tokens > 0 and stats.finish_reason in ("length", "stop")


def test_depth_buckets():
    assert [depth_bucket(d) for d in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 3, 3, 4, 4, 5, 5, 6]


@pytest.mark.parametrize("name", ["eagle", "lookahead", "medusa", "draft"])
def test_model_proposers_follow_steps_they_did_not_draft(spec_engine, name, monkeypatch):
    """With n-gram steps in between, a model proposer is kept in step by ``follow`` (never
    restarted) and the output is still plain decoding's (the tiny model with weights for
    every model proposer beside it)."""
    from codespec.ngram_index import NgramIndex

    engine = spec_engine
    monkeypatch.setattr(policy, "CLOSE", 0.0)  # never retired here, however slow it is
    prompt = engine.encode(REPEAT)
    engine.reset_cache()
    out = [t for d in engine.stream(prompt, GenParams(max_tokens=48)) for t in d.token_ids]
    # a random model does not repeat its context: the n-gram drafts come from two open
    # documents holding pieces of what it writes (tokens 0-13 and 24-37 of its output)
    index = NgramIndex(engine.tokenizer.backend_tokenizer)
    index.open("file:///a.py", engine.decode(prompt[-24:] + out[:14]))
    index.open("file:///b.py", engine.decode(out[20:38]))
    child = FACTORIES[name](engine, None)
    ngram = NgramProposer(index=index, min_gain=0.0)
    auto = AutoProposer(engine, ngram, {name: child}, PolicyStore(costs(0.0)))
    restarts = []
    real_restart = auto._restart
    auto._restart = lambda c, ctx: (restarts.append(c.name), real_restart(c, ctx))
    engine.reset_cache()
    ids: list[int] = []
    text = []
    for delta in engine.stream(prompt, GenParams(max_tokens=48), auto):
        ids += delta.token_ids
        text.append(delta.text)
    assert ids[:48] == out and "".join(text) == plain(engine, prompt, 48)
    assert auto.choices.get("ngram") and auto.choices.get(name)
    assert restarts == []
    if name == "eagle":
        assert child.sync(prompt + ids)  # its cache + queued states end where the context does


def test_a_far_loser_retires_and_comes_back_for_one_trial(engine):
    """A model proposer far slower than plain decoding stops being built (no per-step cost)
    until its retirement ends, then gets one fresh trial."""
    prompt = heldout_prompts(engine, 1, tokens=120, seed=4)[0]
    engine.reset_cache()
    oracle = [t for d in engine.stream(prompt, GenParams(max_tokens=40)) for t in d.token_ids]
    store = PolicyStore(ForwardCosts())
    silent = NgramProposer(use_context=False)

    def build() -> AutoProposer:
        slow = Slow(oracle, "random", engine.runner.vocab_size, seed=2)
        models = {"eagle": slow} if store.usable("eagle") else {}
        return AutoProposer(engine, silent, models, store)

    auto = build()
    run(engine, prompt, auto)
    assert auto.choices["eagle"] == TRIAL_STEPS  # tried once, then retired
    assert "eagle" not in auto.models and not store.usable("eagle")
    assert build().models == {}  # not built while retired
    store.steps = store.retired["eagle"]  # the retirement is over
    again = build()
    run(engine, prompt, again)
    assert again.choices["eagle"] == TRIAL_STEPS  # one fresh trial
    assert store.pause["eagle"] == 2 * FIRST_PAUSE  # and a longer pause after it


def test_a_measured_model_proposer_beats_a_weaker_ngram_draft(engine):
    """When the n-gram proposer has a draft but a model proposer's measured rate is higher
    by the margin, the model proposer takes the step (before, any n-gram draft worth 80%
    of a plain step was taken)."""
    prompt = engine.encode(REPEAT)
    engine.reset_cache()
    oracle = [t for d in engine.stream(prompt, GenParams(max_tokens=60)) for t in d.token_ids]
    store = PolicyStore(costs(0.3))
    greedy = store.engine_wide.setdefault("greedy", Book())
    greedy.tokens["lookahead"], greedy.ms["lookahead"] = Avg(40.0, 8), Avg(1.0, 8)
    good = Positional(oracle, "correct", engine.runner.vocab_size)
    auto = AutoProposer(engine, NgramProposer(min_gain=0.0), {"lookahead": good}, store)
    out, _stats = run(engine, prompt, auto)
    assert out == plain(engine, prompt)
    assert auto.choices.get("lookahead", 0) > 0
    assert auto.choices.get("ngram", 0) == 0


def test_auto_leaves_out_model_proposers_without_weights(engine, spec_engine):
    """The tiny model has no weights beside it: auto builds lookahead alone and the summary
    says why the others are missing; beside ``spec_engine``'s model it builds all four."""
    bare = make_proposer("auto", engine, None)
    assert set(bare.models) <= {"lookahead"}
    store = policy.store_for(engine)
    assert {n: store.available[n] for n in ("eagle", "medusa", "draft")} == dict.fromkeys(
        ("eagle", "medusa", "draft"), False
    )
    assert store.why["eagle"].startswith("no eagle weights for this model (")
    assert policy.summary(engine)["weights"]["medusa"] == "no weights for this model"
    full = make_proposer("auto", spec_engine, None)
    retired = set(policy.store_for(spec_engine).retired)
    assert set(full.models) | retired == {"eagle", "medusa", "draft", "lookahead"}
    prompt = heldout_prompts(spec_engine, 1, tokens=100, seed=3)[0]
    out, _ = run(spec_engine, prompt, full, n=24)
    assert out == plain(spec_engine, prompt, 24)


def test_weights_that_do_not_fit_are_reported(engine, tmp_path):
    """Heads made for another model are left out by auto, and the summary says why."""
    import shutil

    from codespec.daemon.engine.engine import Engine
    from conftest import tiny_model_dir
    from helpers import medusa_heads_for

    folder = tmp_path / "model"
    shutil.copytree(engine.model_path, folder)
    other = tiny_model_dir(tmp_path / "other", folder, hidden_size=32)
    medusa_heads_for(other, folder / "medusa")  # hidden size 32: not this model's 64
    e = Engine(folder)
    auto = make_proposer("auto", e, None)
    assert "medusa" not in auto.models
    state = policy.summary(e)["weights"]["medusa"]
    assert state.startswith("not usable: ") and "hidden size 32" in state
