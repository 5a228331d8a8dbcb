"""Token healing and the text read-back rules (stop lines, loops, the healed prefix).

Scenarios on SmolLM2's tokenizer (through the tiny ``engine``, which carries it):
``"...):\\n"`` ends with a lone ``"\\n"`` that the model never saw before indentation;
healing backs it off and lets the first token be ``"\\n       "``.
"""

from __future__ import annotations

import pytest
import torch

from codespec.daemon.engine.engine import GenParams
from codespec.daemon.text.healing import Healing, TokenTexts, constraint, heal_prompt
from codespec.daemon.text.tracker import TextTracker
from codespec.speculators.registry import make_proposer


@pytest.fixture(scope="module")
def texts(engine) -> TokenTexts:
    return engine.token_texts


def ids_of(engine, text: str) -> list[int]:
    return engine.encode(text)


def test_token_texts_keep_leading_spaces_and_skip_specials(engine, texts):
    [space_if] = ids_of(engine, " if")
    assert texts.text[space_if] == " if"
    eos = engine.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert texts.text[eos] is None
    assert space_if in texts.allowed(" ").tolist()


def test_allowed_ids_are_those_that_start_with_the_rest_or_are_a_prefix_of_it(engine, texts):
    """The bisection over the sorted texts gives what a scan of every token would: the
    ids whose text starts with the rest or is a proper prefix of it. Rests: pieces of
    tokens, tokens, two tokens end to end, spaces and indents."""
    import random

    def scan(rest: str) -> list[int]:
        return [i for i, t in enumerate(texts.text) if t and (t.startswith(rest) or
                rest.startswith(t))]  # fmt: skip

    rng = random.Random(5)
    pieces = [t for t in texts.text if t]
    rests = [" ", "  ", "\n", "\n        ", " self._", "é", "\t", "(", "zzzzq"]
    rests += [rng.choice(pieces)[: rng.randint(1, 6)] for _ in range(150)]
    rests += [rng.choice(pieces) + rng.choice(pieces) for _ in range(50)]
    for rest in rests:
        assert sorted(texts.allowed(rest).tolist()) == scan(rest), rest


def test_heal_prompt_backs_off_the_last_token(engine):
    ids = ids_of(engine, "import re\n\nfrom ")
    healed, text = heal_prompt(engine, ids)
    assert healed == ids[:-1] and text == " "
    one = ids_of(engine, "x")
    assert heal_prompt(engine, one) == (one, "")  # nothing would be left


def test_the_constraint_allows_regrowing_splits_then_frees(engine, texts):
    """REST = "\\n": allowed are "\\n" itself and tokens starting with it ("\\n       ");
    after one of them the constraint is gone. REST = "\\n        " (8 spaces): the
    model's own split "\\n       " + " " is allowed, one step at a time."""
    nl = Healing(texts, "\n")
    mask = nl([])
    [lone] = ids_of(engine, "\n")
    indent = ids_of(engine, "):\n        if")[1]  # "\n       " (7 spaces)
    assert texts.text[indent] == "\n       "
    assert mask[lone] and mask[indent]
    [x] = ids_of(engine, "x")
    assert not mask[x]
    assert nl([indent]) is None and nl([lone]) is None
    deep = Healing(texts, "\n        ")
    assert deep([])[indent]  # a proper prefix of the rest
    after = deep([indent])
    [space_if] = ids_of(engine, " if")
    assert after is not None and after[space_if] and not after[indent]
    assert deep([indent, space_if]) is None


def _generate(engine, ids, heal, speculation, max_tokens=12):
    params = GenParams(max_tokens=max_tokens, constraint=constraint(engine, heal))
    engine.reset_cache()
    proposer = make_proposer(speculation, engine)
    tracker = TextTracker(engine.tokenizer.backend_tokenizer, ids, skip=heal)
    out = []
    text = ""
    for step in engine.stream(ids, params, proposer):
        new = [t for t in step.token_ids if t not in engine.stop_ids]
        out += new
        text += tracker.feed(new, final=step.done)[0]
    return out, text


@pytest.mark.parametrize("speculation", ["ngram", "auto"])
def test_healed_decoding_is_lossless(engine, speculation):
    """With the constraint on its first steps, every method gives plain decoding's ids,
    and the text starts after the backed-off piece (which the raw output begins with)."""
    prompt = "def f(x):\n    return x\n\ndef g(y):\n    return y\n\ndef h(z):\n"
    ids, heal = heal_prompt(engine, ids_of(engine, prompt * 2))
    assert heal == "\n"
    plain, text = _generate(engine, ids, heal, "off")
    got, got_text = _generate(engine, ids, heal, speculation)
    assert got == plain and got_text == text
    full = engine.decode(plain)
    assert full.startswith(heal) and full[len(heal) :].startswith(text)


def test_the_first_token_is_forced_even_when_the_model_prefers_another(engine, texts):
    """The tiny random model's argmax after the prompt is (almost surely) not a token
    that starts with the healed text; healing must still produce one."""
    ids, heal = heal_prompt(engine, ids_of(engine, "for i in range(10):\n    print(i)\nfrom "))
    out, _ = _generate(engine, ids, heal, "off", max_tokens=3)
    assert (texts.text[out[0]] or "").startswith(" ")


def feed_text(tracker: TextTracker, engine, text: str) -> tuple[str, bool]:
    """Feed ``text``'s tokens one step at a time: the pieces sent, whether a rule hit."""
    sent = ""
    for tok in engine.encode(text):
        piece, hit = tracker.feed([tok])
        sent += piece
        if hit:
            return sent, True
    piece, hit = tracker.feed([], final=True)
    return sent + piece, hit


def test_text_tracker_skips_the_healed_text_and_stops_at_the_next_line(engine):
    tok = engine.tokenizer.backend_tokenizer
    t = TextTracker(tok, skip="\n", stop_lines=["b = 2"])
    sent, hit = feed_text(t, engine, "\n    a = 1\n    b = 2\n    c = 3\n")
    assert hit and t.text == "    a = 1" and sent == "    a = 1"
    assert not t.looped


def test_text_tracker_cuts_loops(engine):
    tok = engine.tokenizer.backend_tokenizer
    looping = "x = 1\nprint(x)\nprint(x)\nprint(x)\nprint(x)\n"
    t = TextTracker(tok, cut_loops=True)
    sent, hit = feed_text(t, engine, looping)
    assert hit and t.looped and t.text == sent == "x = 1\nprint(x)\nprint(x)"
    t = TextTracker(tok, cut_loops=True)
    _, hit = feed_text(t, engine, "a = 1\nself.strict_strict_strict_strict_strict\n")
    assert hit and t.text == "a = 1"
    t = TextTracker(tok, cut_loops=True)  # indentation repeats, but is no loop
    _, hit = feed_text(t, engine, "if x:\n                y = 1\n")
    assert not hit
    t = TextTracker(tok, cut_loops=True)  # an unfinished last line that loops goes too
    _, hit = feed_text(t, engine, "a = 1\nf'{x} {x} {x} {x} {x} {x} {x} {x}")
    assert hit and t.looped and t.text == "a = 1"
    t = TextTracker(tok, cut_loops=False)
    _, hit = feed_text(t, engine, looping)
    assert not hit and t.text == looping


def test_text_tracker_holds_back_what_a_rule_may_take(engine):
    """Stop-string prefixes, and (with line rules) the last line and its line break:
    the pieces sent always add up to the finished text."""
    tok = engine.tokenizer.backend_tokenizer
    t = TextTracker(tok, stop=["END"])
    sent, hit = feed_text(t, engine, "aENxEND!")
    assert hit and sent == t.text == "aENx"
    t = TextTracker(tok, lead="def f():\n", region=(0, 1), trailing="\n")
    sent, hit = feed_text(t, engine, "    return 1\n\n\ndef g():\n")
    assert hit and sent == t.text == "def f():\n    return 1\n"
    t = TextTracker(tok)
    ids = engine.encode("é中🚀")
    pieces = [t.feed([i])[0] for i in ids]  # a character split over tokens is held back
    assert "".join(pieces) == "é中🚀" and "\ufffd" not in "".join(pieces)
    assert t.tokens_used == 0


def test_the_constraint_mask_is_boolean_over_the_vocabulary(engine, texts):
    mask = Healing(texts, " ")([])
    assert mask.dtype == torch.bool and mask.shape == (engine.runner.vocab_size,)
    assert 0 < int(mask.sum()) < mask.numel()
