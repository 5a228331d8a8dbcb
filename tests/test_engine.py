"""Engine behaviour: prefix reuse, stop rules, streaming, seeded sampling, errors."""

from __future__ import annotations

import pytest
import torch

from codespec.daemon.engine.engine import STOPPABLE_CHUNK, Engine, GenParams, ModelLoadError
from codespec.daemon.text.tracker import TextTracker
from conftest import heldout_prompts
from helpers import ScriptedProposer


def run(engine, prompt, **kw):
    """The generated text and the stats."""
    ids, stats = engine.generate(prompt, GenParams(**kw))
    return engine.decode(ids), stats


def test_prefix_reuse_gives_the_same_output(engine):
    base = engine.encode("import os\n\n\ndef list_files(path):\n    ")
    longer = base + engine.encode("result = []\n    for name in os.listdir(path):\n        ")
    engine.reset_cache()
    cold, cold_stats = run(engine, longer, max_tokens=12)
    engine.reset_cache()
    run(engine, base, max_tokens=4)
    warm, warm_stats = run(engine, longer, max_tokens=12)
    assert warm == cold
    assert cold_stats.cached_tokens == 0
    assert warm_stats.cached_tokens >= len(base)


def test_prefix_reuse_logits_match_fresh_prefill(engine):
    """After generating, the cache rolled back to a shared prefix gives fresh-prefill logits."""
    a = engine.encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n")
    engine.reset_cache()
    run(engine, a, max_tokens=8)
    logits_reused, common = engine.prefill([*a[:-3], a[-1]])
    assert common == len(a) - 3
    engine.reset_cache()
    logits_fresh, _ = engine.prefill([*a[:-3], a[-1]])
    assert torch.allclose(logits_reused, logits_fresh, atol=1e-4)


def test_stop_string_truncates_and_streams_consistently(engine):
    prompt = engine.encode("class Point:\n    def __init__(self, x, y):\n        self.x = x\n")
    full, _ = run(engine, prompt, max_tokens=24)
    middle = len(full) // 2
    stop = full[middle : middle + 3]  # a stop string the model is sure to produce
    assert len(stop) == 3
    tracker = TextTracker(engine.tokenizer.backend_tokenizer, prompt, [stop])
    pieces = []
    for d in engine.stream(prompt, GenParams(max_tokens=24)):
        piece, hit = tracker.feed([t for t in d.token_ids if t not in engine.stop_ids], d.done)
        pieces.append(piece)
        if hit:
            break
    text = "".join(pieces)
    assert hit and text == tracker.text == full[: full.index(stop)]
    assert 0 < tracker.tokens_used <= 24


def test_max_tokens_and_stream_concatenation(engine):
    prompt = engine.encode("for i in range(10):\n")
    deltas = list(engine.stream(prompt, GenParams(max_tokens=7)))
    assert deltas[-1].done
    stats = deltas[-1].stats
    assert stats.tokens <= 7
    ids, _ = engine.generate(prompt, GenParams(max_tokens=7))
    assert [t for d in deltas for t in d.token_ids if t not in engine.stop_ids] == ids
    assert stats.target_forwards == len(deltas)


def test_seeded_sampling_is_reproducible(engine):
    prompt = engine.encode("def parse(line):\n")
    a, _ = run(engine, prompt, max_tokens=12, temperature=0.9, seed=11)
    b, _ = run(engine, prompt, max_tokens=12, temperature=0.9, seed=11)
    greedy, _ = run(engine, prompt, max_tokens=12)
    assert a == b
    # top-p keeps the smallest set of tokens whose mass reaches p: a tiny p keeps only the
    # most likely token, so sampling at any temperature is greedy decoding
    for seed in (1, 2, 3):
        c, _ = run(engine, prompt, max_tokens=12, temperature=1.5, seed=seed, top_p=1e-6)
        assert c == greedy


def test_top_p_samples_stay_in_the_nucleus(engine):
    """One sampled step, 200 seeds: every token lies in the top-p set of the prompt's
    next-token distribution at that temperature (and more than one token is seen)."""
    prompt = engine.encode("import ")
    engine.reset_cache()
    logits, _ = engine.prefill(prompt)
    probs = torch.softmax(logits[0] / 0.9, -1)
    order = probs.argsort(descending=True)
    mass = probs[order].cumsum(0)
    nucleus = set(order[: int((mass < 0.6).sum()) + 1].tolist())
    seen = set()
    for seed in range(200):
        ids, _ = engine.generate(prompt, GenParams(max_tokens=1, temperature=0.9, top_p=0.6,
                                                   seed=seed))  # fmt: skip
        seen.add(ids[0])
    assert seen <= nucleus and len(seen) > 1


def test_bad_requests_raise_value_errors(engine):
    with pytest.raises(ValueError):
        list(engine.stream([], GenParams()))
    with pytest.raises(ValueError):
        list(engine.stream([1] * engine.max_length, GenParams()))
    with pytest.raises(ValueError):
        list(engine.stream([1, 2], GenParams(max_tokens=0)))


def test_missing_model_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError):
        Engine(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError):
        Engine(tmp_path / "empty")


def test_stop_ids_of_the_default_tokenizer(engine):
    """SmolLM2's tokenizer: no FIM tokens; <|endoftext|>, <|im_end|> (its eos) and
    <file_sep> end a completion, ordinary tokens do not."""
    tok = engine.tokenizer
    assert engine.fim is None
    ids = {s: tok.convert_tokens_to_ids(s) for s in ("<|endoftext|>", "<|im_end|>", "<file_sep>")}
    assert ids == {"<|endoftext|>": 0, "<|im_end|>": 2, "<file_sep>": 5}
    assert tok.eos_token_id == 2
    assert engine.stop_ids == set(ids.values())
    assert not engine.stop_ids & set(engine.encode("def f(x):\n    return x\n"))


def test_fim_tokens_and_stop_ids(fim_engine):
    """A tokenizer with Qwen-style FIM tokens: found, and each of them stops a completion."""
    tok = fim_engine.tokenizer
    fim = fim_engine.fim
    assert fim is not None
    names = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    assert (fim.prefix, fim.suffix, fim.middle) == tuple(tok.convert_tokens_to_ids(names))
    assert min(fim.prefix, fim.suffix, fim.middle) >= 49152  # added after SmolLM2's vocabulary
    assert {fim.prefix, fim.suffix, fim.middle, 0, 2} <= fim_engine.stop_ids
    assert fim_engine.encode("<|fim_prefix|>x") == [fim.prefix, *fim_engine.encode("x")]


class _TapRecorder:
    """A proposer that drafts nothing and records the hidden states it is given."""

    name = "taps"
    taps = (1, 2)

    def __init__(self) -> None:
        self.prompt_hidden = None
        self.step_hidden = []

    def begin(self, request):
        pass

    def prefilled(self, hidden):
        self.prompt_hidden = hidden.clone()

    def propose(self, context, budget):
        return None

    def observe(self, result):
        self.step_hidden.append(result.hidden)


def _cold_taps_then_cache(engine, a, b) -> _TapRecorder:
    """What a cold prefill of ``b`` gives a proposer that reads taps; then the cache holds
    ``a``, fed by a request with taps."""
    engine.reset_cache()
    cold = _TapRecorder()
    engine.generate(b, GenParams(max_tokens=3), cold)
    engine.reset_cache()
    engine.generate(a, GenParams(max_tokens=3), _TapRecorder())
    return cold


def test_taps_survive_prefix_reuse(engine):
    """The prompt's taps after prefix reuse equal those of a cold prefill."""
    a = engine.encode("import re\n\n\ndef words(text):\n    return re.findall(")
    b = a + engine.encode("r'\\w+', text)\n\n\ndef lines(text):\n")
    cold = _cold_taps_then_cache(engine, a, b)
    warm = _TapRecorder()
    _, stats = engine.generate(b, GenParams(max_tokens=3), warm)
    assert stats.cached_tokens > 0
    assert warm.prompt_hidden.shape == (len(b), 2, engine.runner.hidden_size)
    assert torch.allclose(warm.prompt_hidden, cold.prompt_hidden, atol=1e-4)
    assert all(h is not None and h.shape[1] == 2 for h in warm.step_hidden)


def test_a_steps_taps_are_those_of_the_rows_it_kept():
    """record_step keeps the taps of the kept rows: a tree's path (rows 0, 2, 3 of a
    forward) as a chain's (its first rows), in cache order after the prompt's."""
    from types import SimpleNamespace

    from codespec.daemon.engine.slots import CacheSlots

    slots = CacheSlots(SimpleNamespace(max_length=16, length=0), 1)
    slots.reusable([1, 2, 3, 4], (1, 2))  # asks for two taps
    slots.record_prompt([1, 2, 3], 0, torch.zeros(3, 2, 4))
    tree = torch.arange(4 * 2 * 4, dtype=torch.float32).reshape(4, 2, 4)
    slots.record_step(3, [5, 7, 8], tree, [0, 2, 3])
    chain = -torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(3, 2, 4)
    slots.record_step(6, [9, 10], chain, [0, 1])
    assert slots.cached_ids == [1, 2, 3, 5, 7, 8, 9, 10]
    assert torch.equal(slots.prompt_hidden(8)[3:6], tree[[0, 2, 3]])
    assert torch.equal(slots.prompt_hidden(8)[6:8], chain[:2])


def test_a_warm_up_keeps_the_taps_the_last_request_read(engine):
    """A warm-up feeds the prompt with the taps the last request kept (an EAGLE head reads
    them), so the next request like it re-feeds only its last token and its proposer gets
    the taps a cold prefill gives. (Before, a warm-up kept none, and a request with taps
    re-fed every warmed token.)"""
    a = engine.encode("import re\n\n\ndef words(text):\n    return re.findall(")
    b = a + engine.encode("r'\\w+', text)\n\n\ndef lines(text):\n    return text.split(")
    cold = _cold_taps_then_cache(engine, a, b)
    assert engine.warm_taps == _TapRecorder.taps
    assert engine.warm(b, lambda: False, chunk=8) == len(b) - 1
    warm = _TapRecorder()
    _, stats = engine.generate(b, GenParams(max_tokens=3), warm)
    assert stats.cached_tokens == len(b) - 1
    assert torch.allclose(warm.prompt_hidden, cold.prompt_hidden, atol=1e-4)
    engine.generate(a, GenParams(max_tokens=3))  # no taps: the next warm-up keeps none
    assert engine.warm_taps == ()
    engine.reset_cache()


def test_cache_slots_keep_two_documents_warm(engine):
    """Alternating between two unrelated prompts reuses each one's own cached prefix."""
    a = engine.encode("import json\n\n\ndef load(path):\n    with open(path) as fh:\n")
    b = engine.encode("class Stack:\n    def __init__(self):\n        self.items = []\n")
    a2 = a + engine.encode("        return json.load(fh)\n\n\ndef dump(obj, path):\n")
    b2 = b + engine.encode("\n    def push(self, item):\n")
    engine.reset_cache()
    cold_a2, _ = run(engine, a2, max_tokens=6)
    engine.reset_cache()
    cold_b2, _ = run(engine, b2, max_tokens=6)
    engine.reset_cache()
    run(engine, a, max_tokens=4)
    run(engine, b, max_tokens=4)
    warm_a2, stats_a = run(engine, a2, max_tokens=6)
    warm_b2, stats_b = run(engine, b2, max_tokens=6)
    assert stats_a.cached_tokens >= len(a)
    assert stats_b.cached_tokens >= len(b)
    assert (warm_a2, warm_b2) == (cold_a2, cold_b2)


def test_a_warm_up_stopped_at_once_leaves_the_cache_usable(engine):
    """A warm-up that yields before feeding anything (a request arrived) has already cut
    the cache back to its shared prefix; the next request must see that cut (it asked to
    truncate the cache past its length: "cannot truncate a cache of 33 tokens to 36")."""
    a = engine.encode("import json\n\n\ndef load(path):\n    with open(path) as fh:\n")
    other = a[:3] + engine.encode("print('something else entirely')\n")
    slots = engine.slots.max_slots
    engine.slots.max_slots = 1  # the warm-up and the request share the one slot
    try:
        engine.reset_cache()
        cold, _ = run(engine, a + a[:2], max_tokens=6)
        engine.reset_cache()
        run(engine, a, max_tokens=4)
        assert engine.warm(other, lambda: True) == 3  # cut to the shared prefix, nothing fed
        warm, stats = run(engine, a + a[:2], max_tokens=6)
    finally:
        engine.slots.max_slots = slots
        engine.reset_cache()
    assert warm == cold and stats.cached_tokens == 3


def test_a_request_interrupts_a_warm_ups_forward_and_finds_what_was_fed(engine):
    """``interrupt()`` (the scheduler calls it as a request queues) stops a warm-up's
    forward between its layers: the chunk in flight is dropped, the chunks before it stay
    cached, and a request after it gives the output of a cold one. Here the request
    "arrives" while the third chunk is about to run (the flag set after ``warm`` cleared
    it, as a submit right after its check would). Such a runner feeds ``STOPPABLE_CHUNK``
    tokens a forward where the caller asks for less."""
    assert engine.runner.interrupt is not None  # the suite's model runs on the lean stack
    step = STOPPABLE_CHUNK
    a = engine.encode("import json\n\n\ndef load(path):\n    with open(path) as fh:\n" * 200)
    a = a[: 3 * step + 5]
    asks = []

    def request_arrives() -> bool:
        asks.append(1)
        if len(asks) == 3:
            engine.interrupt()
        return False

    engine.reset_cache()
    cold, _ = run(engine, a, max_tokens=8)
    engine.reset_cache()
    fed = 2 * step  # two chunks fed, the third dropped
    assert engine.warm(a, request_arrives, chunk=8) == fed
    assert len(asks) == 3 and engine.cached_tokens(a) == fed
    warm, stats = run(engine, a, max_tokens=8)
    assert warm == cold and stats.cached_tokens == fed
    engine.interrupt()  # a flag left set stops no request's forward, nor the next warm-up
    assert run(engine, a, max_tokens=8)[0] == cold
    assert engine.warm(a + a, lambda: False, chunk=8) == 2 * len(a) - 1
    engine.reset_cache()


def test_a_prompt_sharing_under_half_a_slot_starts_from_a_copy_of_it(engine):
    """A prompt that shares less than half of every slot (a prompt of a 512-token context
    after Enter moved its block: the prefix up to the old block start, ~130 of ~340
    tokens) starts from a copy of the longest shared prefix, and the slot it was copied
    from stays whole (it started from an empty slot: every token fed again)."""
    a = engine.encode("import json\n\n\ndef load(path):\n    with open(path) as fh:\n" * 12)
    b = a[:100] + engine.encode("class Stack:\n    def __init__(self):\n        x = []\n" * 8)
    assert min(256, len(a) // 2) > 100  # under half of a's slot: that slot is not cut
    engine.reset_cache()
    cold_b, _ = run(engine, b, max_tokens=6)
    engine.reset_cache()
    cold_a, _ = run(engine, a, max_tokens=6)
    forks = engine.slots.forks
    warm_b, stats_b = run(engine, b, max_tokens=6)
    assert (warm_b, stats_b.cached_tokens, engine.slots.forks) == (cold_b, 100, forks + 1)
    again, stats_a = run(engine, a, max_tokens=6)
    assert again == cold_a and stats_a.cached_tokens == len(a) - 1
    engine.reset_cache()


def test_single_slot_engine_refeeds(engine):
    """With one slot the second document evicts the first (the control for the test above)."""
    slots = engine.slots.max_slots
    engine.slots.max_slots = 1
    try:
        a = engine.encode("import json\n\n\ndef load(path):\n    with open(path) as fh:\n")
        b = engine.encode("class Stack:\n    def __init__(self):\n        self.items = []\n")
        engine.reset_cache()
        run(engine, a, max_tokens=4)
        run(engine, b, max_tokens=4)
        _, stats = run(engine, a + engine.encode("        pass\n"), max_tokens=4)
        assert stats.cached_tokens < len(a)
    finally:
        engine.slots.max_slots = slots


def test_the_least_recently_used_slot_is_evicted(engine):
    """Two slots, three documents A, B, C: C takes A's slot (the least recently used),
    so B stays cached and A is fed again."""
    slots = engine.slots.max_slots
    engine.slots.max_slots = 2
    docs = [engine.encode(f"def f{k}(x):\n" + "    y = x * 2\n" * (20 + k)) for k in range(3)]
    try:
        engine.reset_cache()
        for d in docs:
            run(engine, d, max_tokens=2)
        assert len(engine.slots.idle) == 1
        _, b = run(engine, docs[1] + engine.encode("    pass\n"), max_tokens=2)
        _, a = run(engine, docs[0] + engine.encode("    pass\n"), max_tokens=2)
        assert b.cached_tokens >= len(docs[1])
        assert a.cached_tokens < len(docs[0]) // 2
    finally:
        engine.slots.max_slots = slots
        engine.reset_cache()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the taps live there)")
def test_taps_on_cuda():
    """The tap buffer lives on the runner's device (it was allocated on the CPU)."""
    from conftest import tiny_llama

    model = tiny_llama().to("cuda")
    from codespec.daemon.engine.runner import HFRunner
    from codespec.daemon.engine.slots import CacheSlots

    slots = CacheSlots(HFRunner(model), 2)
    out = slots.runner.forward([1, 2, 3], taps=(1,))
    slots.reusable([1, 2, 3], (1,))
    slots.record_prompt([1, 2, 3], 0, out.hidden)
    assert slots.prompt_hidden(3).device.type == "cuda"


def test_stream_ids_end_at_the_stop_token_even_mid_draft(engine):
    """A step that accepts a stop token and tokens after it streams only up to the stop."""
    prompt = heldout_prompts(engine, 1, tokens=120, seed=9)[0]
    engine.reset_cache()
    oracle = [t for d in engine.stream(prompt, GenParams(max_tokens=40)) for t in d.token_ids]
    stop = oracle[12]
    first = oracle.index(stop)
    saved = engine.stop_ids
    engine.stop_ids = set(saved) | {stop}
    try:
        engine.reset_cache()
        proposer = ScriptedProposer(oracle, "correct", engine.runner.vocab_size)
        deltas = list(engine.stream(prompt, GenParams(max_tokens=40, max_draft=16), proposer))
    finally:
        engine.stop_ids = saved
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == oracle[: first + 1]
    assert deltas[-1].done and deltas[-1].stats.finish_reason == "stop"
    assert any(d.accepted > 1 for d in deltas)  # the stop came inside an accepted draft


def test_the_head_stop_is_asked_for_when_verification_likely_ends_early(engine, monkeypatch):
    """verify_step asks the runner for ``greedy`` (the LM head may stop where greedy
    verification's walk ends) at temperature 0 only, and only while the draft's chance of
    an accepted node past the head's first chunk is under STOP_BELOW (no chances: always);
    the tokens are the same either way."""
    from codespec.daemon.engine import engine as eng
    from codespec.speculators.draft import Draft

    asked: list[bool] = []
    forward = engine.runner.forward

    def spy(*args, **kwargs):
        asked.append(bool(kwargs.get("greedy")))
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", spy)
    prompt = heldout_prompts(engine, 1, tokens=24, seed=3)[0]
    n = eng.HEAD_FIRST_ROWS + 2  # nodes reaching past the first chunk
    likely, unlikely = [0.9] * n, [0.9, 0.8, 0.7, 0.3, 0.2, 0.1]
    outs = []
    for chances, temperature, want in [(None, 0.0, True), (likely, 0.0, False),
                                       (unlikely, 0.0, True), (unlikely, 0.7, False)]:  # fmt: skip
        engine.reset_cache()
        engine.prefill(prompt[:-1])
        draft = Draft(list(range(100, 100 + n)), chances=chances)
        asked.clear()
        v = engine.verify_step(prompt[-1], draft, GenParams(max_tokens=8, temperature=temperature),
                               torch.Generator().manual_seed(0))  # fmt: skip
        assert asked == [want], (chances, temperature)
        if temperature == 0:
            outs.append((v.accepted, v.bonus))
    assert len(set(map(str, outs))) == 1
    assert Draft(list(range(n)), chances=unlikely).past(eng.HEAD_FIRST_ROWS - 1) < eng.STOP_BELOW


def test_greedy_steps_read_the_runners_argmax(engine, monkeypatch):
    """At temperature 0 the engine takes each row's argmax from the runner where it gives
    one (the lean runner's stack: ForwardOut.best; the first token from its argmax_rows),
    and the tokens are torch.argmax's: the same output with both taken away; sampling
    never asks for them."""
    from codespec.daemon.engine import engine as eng

    if getattr(engine.runner, "stack", None) is None:
        pytest.skip("this runner has no argmax of its own")
    prompt = heldout_prompts(engine, 1, tokens=40, seed=5)[0]
    given: list[bool] = []
    verify = eng.verify

    def spy(draft, logits, temperature, top_p, gen, best=None):
        given.append(best is not None)
        if best is not None:
            assert best == logits.argmax(-1).tolist()
        return verify(draft, logits, temperature, top_p, gen, best)

    monkeypatch.setattr(eng, "verify", spy)
    engine.reset_cache()
    fast, _ = engine.generate(prompt, GenParams(max_tokens=24))
    assert len(given) >= 24 and all(given)  # the first token and every step
    forward = engine.runner.forward

    def without(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.best = None
        return out

    monkeypatch.setattr(engine.runner, "forward", without)
    monkeypatch.setattr(engine.runner, "argmax_rows", lambda logits: None)
    given.clear()
    engine.reset_cache()
    plain, _ = engine.generate(prompt, GenParams(max_tokens=24))
    assert fast == plain and not any(given)
    monkeypatch.undo()
    monkeypatch.setattr(eng, "verify", spy)
    given.clear()
    engine.reset_cache()
    engine.generate(prompt, GenParams(max_tokens=8, temperature=0.8, seed=1))
    assert given and not any(given)
