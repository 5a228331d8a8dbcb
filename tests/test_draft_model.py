"""Draft-model speculation: lossless greedy output, the draft cache kept in step with the
accepted tokens (partial accepts, full accepts and the catch-up), clear refusals, sampling."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from codespec.daemon.engine.engine import GenParams, load_runner
from codespec.speculators.draft import Draft, StepResult
from codespec.speculators.draft_model import (
    DraftModelProposer,
    NoDraftModel,
    NoDraftWeights,
    common_prefix,
    draft_dir,
    load_runtime,
    make,
)
from codespec.speculators.registry import make_proposer
from conftest import TOKENIZER_FILES, heldout_prompts, tiny_llama, tiny_model_dir


@pytest.fixture(scope="module")
def tiny_draft(engine, tmp_path_factory) -> Path:
    """Another randomly initialised 2-layer Llama with the target's tokenizer (drafts badly,
    fast)."""
    folder = tmp_path_factory.mktemp("tiny_draft")
    return tiny_model_dir(folder, Path(engine.model_path), seed=7, hidden_size=32)


@pytest.fixture(scope="module")
def target_as_draft(spec_engine, tmp_path_factory) -> Path:
    """The target itself as its own draft model: every greedy draft is fully accepted."""
    folder = tmp_path_factory.mktemp("self_draft")
    for name in ("config.json", "model.safetensors", *TOKENIZER_FILES):
        shutil.copyfile(Path(spec_engine.model_path) / name, folder / name)
    return folder


class Recording(DraftModelProposer):
    """Records every sync (context, the draft model's logits) and checks after every
    observe that the draft cache holds only accepted tokens."""

    def begin(self, request) -> None:
        super().begin(request)
        self.syncs: list[tuple[list[int], torch.Tensor]] = []
        self.kinds: set[str] = set()
        self.bases: set[int | None] = set()
        self._ctx: list[int] = []

    def sync(self, context: Sequence[int]) -> torch.Tensor:
        logits = super().sync(context)
        self.bases.add(self._base)
        view = list(context[self._base :])  # what the draft model reads (its window)
        self.syncs.append((view, logits.clone()))
        self._ctx = view
        return logits

    def observe(self, result: StepResult) -> None:
        depth = self._last_depth
        super().observe(result)
        if result.draft is None:
            return
        a = result.accepted_len
        self.kinds.add("full" if a == depth else "none" if a == 0 else "partial")
        accepted = self._ctx + [result.draft.tokens[i] for i in result.accepted]
        # the draft cache: context + accepted tokens, the last draft token not yet fed
        assert self.rt.ids == accepted[: len(self._ctx) + min(a, depth - 1)]
        assert self.rt.runner.length == len(self.rt.ids)


def plain(engine, prompt: list[int], max_tokens: int, **kw) -> tuple[str, object]:
    return engine.generate(prompt, GenParams(max_tokens=max_tokens, **kw))


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 3) == 3
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 2) == 2
    assert common_prefix([1, 2, 3, 5, 6], [1, 2, 3, 4], 4) == 3
    assert common_prefix([], [1], 0) == 0
    assert common_prefix([7, 2], [1, 2], 2) == 0


def test_missing_draft_model_is_a_clear_lookup_error(tmp_path: Path):
    """No MODEL/draft: a LookupError (the scheduler's bad_params) that says where it looked
    and what to put there."""

    class Fake:  # an engine whose model folder has no draft/ (weakly referenceable)
        model_path = str(tmp_path)

    fake = Fake()
    with pytest.raises(NoDraftWeights) as err:
        make(fake, None)
    assert isinstance(err.value, NoDraftModel) and isinstance(err.value, LookupError)
    msg = str(err.value)
    assert msg.startswith("no draft weights for this model (")
    assert str(draft_dir(tmp_path)) in msg
    assert f"with the tokenizer of {tmp_path}" in msg
    with pytest.raises(LookupError):
        make_proposer("draft", fake)
    with pytest.raises(NoDraftModel, match="needs an engine"):
        make(None, None)


def test_another_tokenizer_is_refused(engine, tmp_path: Path):
    """A draft model whose tokenizer differs from the target's is refused, with the counts."""
    from codespec.daemon.training.train_data import train_tokenizer, write_tokenizer_files

    texts = ["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 20]
    write_tokenizer_files(train_tokenizer(texts, 300), tmp_path)
    tiny_llama(vocab=300, layers=1).save_pretrained(tmp_path)
    with pytest.raises(NoDraftModel, match="another tokenizer"):
        load_runtime(engine, tmp_path)


def test_tiny_random_draft_greedy_equals_plain(engine, tiny_draft: Path, one_thread):
    """A draft model that is nearly always wrong (zero and partial accepts) changes nothing."""
    rt = load_runtime(engine, tiny_draft)
    assert rt.runner.name == "lean" and rt.runner.device == engine.device
    assert load_runtime(engine, tiny_draft) is rt  # once per engine
    drafted = 0
    for prompt in heldout_prompts(engine, 4, tokens=120, seed=3):
        want, _ = plain(engine, prompt, 24)
        proposer = DraftModelProposer(rt, depth=4, adaptive=False)
        got, stats = engine.generate(prompt, GenParams(max_tokens=24), proposer)
        assert got == want
        drafted += stats.drafted.get("draft", 0)
    assert drafted > 0


def test_model_draft_greedy_equals_plain(spec_engine, one_thread):
    """The draft model beside the model (MODEL/draft: the target with noise on its weights),
    adaptive and fixed length: outputs equal plain greedy decoding, and it gets tokens
    accepted."""
    engine = spec_engine
    assert (draft_dir(engine.model_path) / "config.json").exists()
    accepted = 0
    for i, prompt in enumerate(heldout_prompts(engine, 6, tokens=160, seed=5)):
        want, _ = plain(engine, prompt, 40)
        proposer = make(engine, None)
        if i % 2:  # every other prompt: a fixed length, so drafts run even where they lose
            proposer.adaptive, proposer.depth = False, 5
        got, stats = engine.generate(prompt, GenParams(max_tokens=40), proposer)
        assert got == want
        accepted += stats.accepted.get("draft", 0)
    assert accepted > 0


@pytest.mark.parametrize("which", ["beside", "target", "window"])
def test_draft_cache_equals_a_fresh_prefill(spec_engine, target_as_draft: Path, which, one_thread):
    """After partial accepts (the noisy draft beside the model) and full accepts with the
    catch-up (the target as its own draft), the draft model's next-token logits at every
    step equal those of a fresh prefill of the same tokens, and the cache holds only
    accepted tokens. ``window``: the noisy draft reading only the last 48 tokens (a window
    start past 0)."""
    engine = spec_engine
    path = draft_dir(engine.model_path) if which != "target" else target_as_draft
    rt = load_runtime(engine, path)
    fresh, _ = load_runner(str(path), engine.device, "auto", engine.max_length)
    # fp32 on the CPU: chunked prefill and one-token decode agree to rounding; bf16 (CUDA) less
    atol, rtol = (2e-3, 1e-3) if rt.runner.dtype == torch.float32 else (0.25, 0.05)
    kinds: set[str] = set()
    for prompt in heldout_prompts(engine, 3, tokens=100, seed=9):
        want, _ = plain(engine, prompt, 30)
        proposer = Recording(rt, depth=4, adaptive=False, window=48 if which == "window" else 256)
        got, _ = engine.generate(prompt, GenParams(max_tokens=30), proposer)
        assert got == want
        kinds |= proposer.kinds
        if which == "window":  # ~100-token prompts: the view starts past 0 and keeps <= 48
            assert len(proposer.bases) == 1 and min(proposer.bases) > 0
            assert all(len(view) <= 48 + 30 for view, _ in proposer.syncs)
        else:
            assert proposer.bases == {0}
        for context, logits in proposer.syncs:
            fresh.reset()
            expect = fresh.forward(context, last_only=True).logits[-1]
            torch.testing.assert_close(logits, expect, atol=atol, rtol=rtol)
    if which == "target":
        assert "full" in kinds  # the catch-up path ran (d_k and the bonus fed next step)
    else:
        assert "partial" in kinds or "none" in kinds


def test_adaptive_backs_off_when_drafts_fail(engine, tiny_draft: Path, one_thread):
    """A draft model whose drafts are rejected ends up proposing plain steps (with probes)."""
    prompt = heldout_prompts(engine, 1, tokens=120, seed=4)[0]
    want, _ = plain(engine, prompt, 48)
    proposer = make(engine, None, path=tiny_draft)
    got, stats = engine.generate(prompt, GenParams(max_tokens=48), proposer)
    assert got == want
    assert 0 < len(proposer.history) < stats.decode_steps


def test_temperature_runs_finish_and_pass_q(spec_engine, one_thread):
    """At temperature > 0 drafts are sampled and carry q; seeded runs repeat exactly."""
    engine = spec_engine
    prompt = heldout_prompts(engine, 1, tokens=120, seed=8)[0]
    seen: list[Draft] = []

    class Spy(DraftModelProposer):
        def observe(self, result: StepResult) -> None:
            if result.draft is not None:
                seen.append(result.draft)
            super().observe(result)

    rt = load_runtime(engine, draft_dir(engine.model_path))
    params = GenParams(max_tokens=32, temperature=0.8, seed=1)
    texts = []
    for _ in range(2):
        text, stats = engine.generate(prompt, params, Spy(rt, depth=3, adaptive=False))
        assert stats.finish_reason in ("length", "stop") and stats.tokens >= 1
        texts.append(text)
    assert texts[0] == texts[1]
    assert seen and all(d.probs is not None for d in seen)
    for d in seen:
        for tok, q in zip(d.tokens, d.probs, strict=True):
            assert q is not None and q.shape == (engine.runner.vocab_size,)
            assert float(q[tok]) > 0 and abs(float(q.sum()) - 1) < 1e-4
