"""Recall: a greedy request whose whole prompt a cache slot holds, with the model's own
choices after it from an earlier request (typing along the ghost text), takes those
choices with no forward, and its output is what a cold request gives: healing included,
across slots and warm-ups; never for sampling, nor where ``GenParams.recall`` is off."""

from __future__ import annotations

import pytest
import torch

from codespec.daemon.config import Speculation
from codespec.daemon.engine.engine import GenParams
from codespec.daemon.service.scheduler import Job, Scheduler
from codespec.daemon.text.healing import Healing, constraint, heal_prompt
from codespec.speculators.registry import make_proposer

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul("
OTHER = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push("


def run(engine, prompt, params, method="off"):
    """(output ids, the first step's ids, the final stats) of one request."""
    proposer = None if method == "off" else make_proposer(method, engine)
    out, first, stats = [], None, None
    for step in engine.stream(prompt, params, proposer):
        first = step.token_ids if first is None else first
        out += step.token_ids
        stats = step.stats
    assert stats is not None and first is not None
    return out, first, stats


def cold(engine, prompt, params):
    """What the model alone gives: an empty cache, every token from a forward."""
    engine.reset_cache()
    p = GenParams(max_tokens=params.max_tokens, constraint=params.constraint, recall=False)
    out, _, stats = run(engine, prompt, p)
    assert stats.recalled == 0
    return out, stats


@pytest.mark.parametrize("method", ["off", "auto"])
def test_typing_along_the_output_takes_it_from_the_cache(engine, method):
    prompt = engine.encode(PROMPT)
    params = GenParams(max_tokens=12, recall=True)
    first, _ = cold(engine, prompt, params)
    assert len(first) == 12 and not set(first) & engine.stop_ids
    wants = {k: cold(engine, prompt + first[:k], params) for k in (1, 4, 7)}
    engine.reset_cache()
    run(engine, prompt, params, method)
    end = 12  # the model's choices are cached through the last request's output
    for k, (want, want_stats) in wants.items():
        got, step, stats = run(engine, prompt + first[:k], params, method)
        assert got == want
        assert stats.recalled == end - k  # all the last request chose after that prompt
        assert step == got[: end - k]  # the first step, before any forward
        assert stats.target_forwards < want_stats.target_forwards
        end = k + 12


def test_a_replay_recalls_all_and_recall_off_recalls_nothing(engine):
    prompt = engine.encode(PROMPT)
    want, _ = cold(engine, prompt, GenParams(max_tokens=8))
    got, step, stats = run(engine, prompt, GenParams(max_tokens=8, recall=True))
    assert got == want == step and stats.recalled == 8 and stats.target_forwards == 0
    got, _, stats = run(engine, prompt, GenParams(max_tokens=8, recall=False))
    assert got == want and stats.recalled == 0 and stats.target_forwards > 0


def test_sampling_never_recalls(engine):
    prompt = engine.encode(PROMPT)
    cold(engine, prompt, GenParams(max_tokens=8))
    params = GenParams(max_tokens=8, temperature=0.8, seed=1, recall=True)
    _, _, stats = run(engine, prompt, params)
    assert stats.recalled == 0


def test_a_healed_prompt_recalls_what_its_constraint_allows(engine):
    """A keystroke inside a token: healing backs the prompt off to the cached one and asks
    the output to regrow the typed text; the model's choice there regrows it, so it is
    recalled. A constraint it does not meet stops the recall before it."""
    prompt = engine.encode(PROMPT)
    first, _ = cold(engine, prompt, GenParams(max_tokens=10))
    typed = prompt + first[:3]
    ids, heal = heal_prompt(engine, typed)
    assert ids == prompt + first[:2] and heal
    params = GenParams(max_tokens=10, constraint=constraint(engine, heal), recall=True)
    want, _ = cold(engine, ids, params)
    engine.reset_cache()
    run(engine, prompt, GenParams(max_tokens=10))
    got, _, stats = run(engine, ids, params)
    assert got == want and stats.recalled == 8
    texts = engine.token_texts.text
    wrong = next(t for t in ("\u00a7", "\u00b6", "zq") if not (texts[first[2]] or "").startswith(t))
    params = GenParams(max_tokens=10, constraint=Healing(engine.token_texts, wrong), recall=True)
    want, _ = cold(engine, ids, params)
    engine.reset_cache()
    run(engine, prompt, GenParams(max_tokens=10))
    got, _, stats = run(engine, ids, params)
    assert got == want and stats.recalled == 0


def test_recall_survives_another_slot_and_a_warm_up(engine):
    """Another document's request parks the slot (its choices go with it), and a warm-up
    of a prompt the slot holds whole feeds nothing and cuts nothing."""
    prompt, other = engine.encode(PROMPT), engine.encode(OTHER)
    first, _ = cold(engine, prompt, GenParams(max_tokens=10))
    want, _ = cold(engine, prompt + first[:2], GenParams(max_tokens=10))
    engine.reset_cache()
    params = GenParams(max_tokens=10, recall=True)
    run(engine, prompt, params)
    run(engine, other, params)
    assert engine.warm(prompt + first[:2], lambda: False) == len(prompt) + 1
    got, _, stats = run(engine, prompt + first[:2], params)
    assert got == want and stats.recalled == 8


def test_the_daemon_recalls_by_its_config(engine):
    """The scheduler hands ``[speculation] recall`` to the engine: on, a request typing
    along the last one's output recalls it; off, it does not; the text is the same."""
    prompt = engine.encode(PROMPT)
    texts, recalled = [], []
    for on in (True, False):
        s = Scheduler(engine, None, Speculation(recall=on), max_queue=4)
        s.start()
        try:
            engine.reset_cache()
            a = Job(prompt, GenParams(max_tokens=12), "auto")
            out = s.submit(a).result(60)
            assert out.stats["recalled"] == 0
            b = s.submit(Job(prompt + a.out_ids[:3], GenParams(max_tokens=12), "auto"))
            r = b.result(60)
            texts.append(r.text)
            recalled.append(r.stats["recalled"])
        finally:
            s.stop()
    assert texts[0] == texts[1]
    assert recalled == [9, 0]


@pytest.mark.parametrize("first_step", ["prefill", "lead"])
def test_a_healed_request_keeps_the_unconstrained_choice(engine, first_step):
    """Typing inside one token asks again with the same backed-off prompt: the first
    request's constrained rows (its prefill's, or its lead step's root row) keep the
    model's unconstrained choice, so the next one, with a longer backed-off text that the
    choice still regrows, recalls it."""
    prompt = engine.encode(PROMPT)
    first, _ = cold(engine, prompt, GenParams(max_tokens=12))
    texts = engine.token_texts.text
    k = next(i for i in range(2, 12) if len(texts[first[i]] or "") >= 2)
    ids, whole = prompt + first[:k], texts[first[k]]
    assert whole
    typed = [Healing(engine.token_texts, whole[:1]), Healing(engine.token_texts, whole)]
    want, _ = cold(engine, ids, GenParams(max_tokens=10, constraint=typed[1]))
    engine.reset_cache()
    if first_step == "lead":  # the prompt cached: the constrained request's lead step
        run(engine, ids, GenParams(max_tokens=10))
    params = GenParams(max_tokens=10, constraint=typed[0])
    _, _, stats = run(engine, ids, params, "off" if first_step == "prefill" else "auto")
    assert stats.lead_steps == (first_step == "lead")
    got, step, stats = run(engine, ids, GenParams(max_tokens=10, constraint=typed[1], recall=True))
    assert got == want and stats.recalled == 10 and step == want


def test_a_narrower_constraint_recalls_the_constrained_choice(engine):
    """The model's own choice does not regrow the typed text, the choice under the first
    keystroke's mask does: a second keystroke inside the same token (a narrower mask
    that still allows that choice) recalls it and what followed; a mask that is not
    narrower does not."""
    prompt = engine.encode(PROMPT)
    first, _ = cold(engine, prompt, GenParams(max_tokens=1))
    texts = engine.token_texts
    start = next(c for c in "xqzjkv" if not (texts.text[first[0]] or "").startswith(c))
    params = GenParams(max_tokens=8, constraint=Healing(texts, start))
    chosen, _ = cold(engine, prompt, params)
    whole = texts.text[chosen[0]]
    assert whole and whole.startswith(start)
    narrower = GenParams(max_tokens=8, constraint=Healing(texts, whole), recall=True)
    want, _ = cold(engine, prompt, narrower)
    engine.reset_cache()
    run(engine, prompt, params)
    got, step, stats = run(engine, prompt, narrower)
    assert got == want and stats.recalled == 8 and step == want
    other = next(c for c in "xqzjkv" if c != start)
    wider = GenParams(max_tokens=8, constraint=Healing(texts, other), recall=True)
    want, _ = cold(engine, prompt, wider)
    engine.reset_cache()
    run(engine, prompt, params)
    got, _, stats = run(engine, prompt, wider)
    assert got == want and stats.recalled == 0


def test_choices_hold_free_and_masked_choices_and_keep_the_latest_masks():
    from codespec.daemon.engine.choices import KEEP_MASKED, Choices

    def mask(*ids: int) -> torch.Tensor:
        m = torch.zeros(8, dtype=torch.bool)
        m[list(ids)] = True
        return m

    c = Choices([3, -1, 5])
    assert c.at(0, None) == 3 and c.at(0, mask(3, 4)) == 3 and c.at(0, mask(4)) == -1
    assert c.at(1, None) == -1 and c.at(7, None) == -1
    c.note(1, 6, mask(1, 2, 7), 2)  # unconstrained 6; under {1, 2, 7}: 2
    assert c.at(1, None) == 6 and c.at(1, mask(2, 7)) == 2 and c.at(1, mask(2)) == 2
    assert c.at(1, mask(2, 4)) == -1  # 4 was not in the mask the choice was made under
    assert c.at(1, mask(1, 7)) == -1  # the choice made is not allowed
    assert c.copy(1).free == [3] and not c.copy(1).masked and c.copy(2).masked
    c.cut(1, 3)
    assert c.free == [3, -1, -1] and not c.masked
    c.extend([1] * (KEEP_MASKED + 2), {p: (mask(0), 0) for p in range(3, KEEP_MASKED + 5)})
    assert sorted(c.masked) == list(range(5, KEEP_MASKED + 5))


def test_any_sequence_of_requests_gives_what_cold_requests_give(engine):
    """A seeded random walk over what an editor does — type along the last output (a token
    or inside one, healed), type what it did not predict, switch to another document and
    back, warm a prompt, ask with another method — every request's output equals a cold
    request's on an empty cache, and the walk did recall."""
    import random

    rng = random.Random(7)
    docs = [engine.encode(PROMPT), engine.encode(OTHER)]
    texts = engine.token_texts
    last: dict[int, list[int]] = {0: [], 1: []}
    steps = []  # (ids, healed text, output): replayed cold afterwards
    recalled = 0
    engine.reset_cache()
    for _ in range(32):
        d = rng.randrange(2)
        ids = docs[d] + last[d][: rng.randrange(len(last[d]) + 1)]
        heal, r = "", rng.random()
        if r < 0.4 and len(ids) > len(docs[d]):  # typing inside the ghost text's token
            ids, heal = ids[:-1], texts.text[ids[-1]] or ""
            heal = heal[: rng.randrange(1, len(heal) + 1)] if heal else ""
        elif r < 0.6:  # a keystroke the ghost text did not predict
            heal = rng.choice("xqz(")
        if rng.random() < 0.2:
            engine.warm(ids, lambda: False)
        method = rng.choice(["off", "auto", "ngram"])
        params = GenParams(max_tokens=8, constraint=constraint(engine, heal), recall=True)
        out, _, stats = run(engine, ids, params, method)
        recalled += stats.recalled
        last[d] = ids[len(docs[d]) :] + out
        steps.append((ids, heal, out))
    assert recalled > 0
    for ids, heal, out in steps:
        want, _ = cold(engine, ids, GenParams(max_tokens=8, constraint=constraint(engine, heal)))
        assert out == want
