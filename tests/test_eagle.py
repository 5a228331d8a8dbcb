"""The EAGLE-3 head and proposer: shapes, files, the inference runner, drafts, cache, losslessness.

Tiny random models on the CPU. The losslessness tests decode held-out prompts on the
tiny engine with the head beside ``spec_engine``'s model (trained for a few steps on
those prompts, so its drafts are accepted) and with a random head (never accepted):
verification must keep the output either way.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from codespec.daemon.engine import cpu_gemm, quant_gemm
from codespec.daemon.engine.engine import GenParams
from codespec.daemon.engine.lean import LeanRunner
from codespec.daemon.engine.target import (
    FEW_ROWS,
    HEAD_BLOCKS,
    CpuGemmKernels,
    Int8Kernels,
    quantize_blocks,
)
from codespec.speculators.book import PolicyStore
from codespec.speculators.draft import Draft, MissingWeights, StepResult
from codespec.speculators.eagle import (
    EagleProposer,
    EagleRuntime,
    NoEagleHead,
    NoEagleWeights,
    grow_draft,
    head_dir,
    load_runtime,
)
from codespec.speculators.eagle_head import (
    EagleConfig,
    EagleHead,
    HeadRunner,
    default_taps,
    load_head,
    save_head,
)
from codespec.speculators.policy import Controller
from codespec.speculators.registry import make_proposer
from codespec.speculators.target import SpeculatorState, TorchKernels
from conftest import SPEC_PROMPTS, heldout_prompts, tiny_llama
from helpers import rounded_rows

VOCAB = 96
TAPS = (1, 2, 3)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, layers=3, seed=1)


def make_head(target, draft_vocab: int = 64, seed: int = 0) -> EagleHead:
    cfg = EagleConfig.for_target(target.config, draft_vocab_size=draft_vocab, taps=TAPS)
    torch.manual_seed(seed)
    head = EagleHead(cfg, target.get_input_embeddings().weight)
    head.set_draft_vocab(torch.randperm(VOCAB)[:draft_vocab])
    with torch.no_grad():  # norms away from 1 so a swapped norm shows
        for name, p in head.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return head.eval()


def test_shapes_and_default_taps(target):
    head = make_head(target)
    b, t, h = 2, 7, target.config.hidden_size
    fused = head.fuse(torch.randn(b, t, 3, h))
    assert fused.shape == (b, t, h)
    outs = head.ttt_forward(fused, torch.randint(0, VOCAB, (b, t)), steps=3)
    assert [o.shape for o in outs] == [(b, t, 64)] * 3
    assert head.draft_to_target().shape == (64,)
    assert int(head.t2d.sum()) == 64
    assert torch.equal(head.draft_to_target(), torch.nonzero(head.t2d).flatten())
    assert default_taps(4) == (1, 2, 3) and default_taps(32) == (2, 16, 29)
    assert max(default_taps(2)) < 2


def test_speculators_round_trip(target, tmp_path):
    """The saved folder is vLLM's EAGLE-3 layout and loads back to the same head."""
    from safetensors.torch import load_file

    head = make_head(target)
    save_head(head, tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["draft_vocab_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(TAPS)
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    assert cfg["transformer_layer_config"]["vocab_size"] == VOCAB
    assert cfg["speculators_config"]["algorithm"] == "eagle3"
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {
        "fc.weight",
        "layers.0.hidden_norm.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.down_proj.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    } <= names
    assert not any("embed" in n for n in names)
    back = load_head(tmp_path, target.get_input_embeddings().weight)
    for k, v in head.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    x = torch.randn(1, 5, 3, target.config.hidden_size)
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        a = head.ttt_forward(head.fuse(x), ids, 2)
        b = back.ttt_forward(back.fuse(x), ids, 2)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert back.lm_head.weight.shape == (64, target.config.hidden_size)
    assert back.layers[0].self_attn.q_proj.weight.shape[1] == 2 * target.config.hidden_size


def test_fp16_file_and_bad_folder(target, tmp_path):
    head = make_head(target)
    save_head(head, tmp_path / "h")  # fp16 by default: half the bytes
    back = load_head(tmp_path / "h", target.get_input_embeddings().weight)
    assert torch.allclose(back.fc.weight, head.fc.weight, atol=1e-3)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"speculators_model_type": "x"}))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        load_head(tmp_path / "bad", target.get_input_embeddings().weight)
    # a truncated weights file, and one whose tensors have other shapes: ValueErrors too
    # (what load_runtime turns into "cannot load the EAGLE head", auto leaving it out)
    import shutil

    shutil.copytree(tmp_path / "h", tmp_path / "cut")
    data = (tmp_path / "h" / "model.safetensors").read_bytes()
    (tmp_path / "cut" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cannot read"):
        load_head(tmp_path / "cut", target.get_input_embeddings().weight)
    other = make_head(target, draft_vocab=32)
    save_head(other, tmp_path / "other")
    weights = "model.safetensors"
    shutil.copyfile(tmp_path / "other" / weights, tmp_path / "cut" / weights)
    with pytest.raises(ValueError, match="shapes"):
        load_head(tmp_path / "cut", target.get_input_embeddings().weight)


def test_runner_matches_the_training_forward(target):
    """HeadRunner over a chain (with its cache) computes what step 0 of ttt_forward does,
    and deeper ttt steps are what the runner computes for a chain drafted from each entry."""
    head = make_head(target)
    h = target.config.hidden_size
    t = 9
    taps = torch.randn(t, 3, h)
    ids = torch.randint(0, VOCAB, (t,))
    with torch.no_grad():
        outs = head.ttt_forward(head.fuse(taps)[None], ids[None], 3)
    run = HeadRunner(head, target.get_input_embeddings().weight, 64)
    fused = run.fuse(taps)
    prenorm, logits = run.forward(ids[:4].tolist(), fused[:4], torch.arange(1, 5))
    prenorm2, logits2 = run.forward(ids[4:].tolist(), fused[4:], torch.arange(5, t + 1))
    assert torch.allclose(torch.cat([logits, logits2]), outs[0][0], atol=1e-4)
    # depth 2 and 3 from entry j: feed the head its own argmax at positions j + 2, j + 3
    d2t = head.draft_to_target()
    pre, lg = torch.cat([prenorm, prenorm2]), torch.cat([logits, logits2])
    for j in (0, 4, t - 1):
        run.reset()
        run.forward(ids[: j + 1].tolist(), fused[: j + 1], torch.arange(1, j + 2))
        h1, lg1 = run.forward([int(d2t[lg[j].argmax()])], pre[j : j + 1], torch.tensor([j + 2]))
        assert torch.allclose(lg1[0], outs[1][0, j], atol=1e-4)
        _, lg2 = run.forward([int(d2t[lg1[0].argmax()])], h1, torch.tensor([j + 3]))
        assert torch.allclose(lg2[0], outs[2][0, j], atol=1e-4)


def test_tree_draft_is_a_tree_within_budget(target):
    head = make_head(target)
    run = HeadRunner(head, target.get_input_embeddings().weight, 64)
    h = target.config.hidden_size
    out, logits = run.forward([3, 4, 5], torch.randn(3, h), torch.arange(1, 4))
    draft, levels, forwards = grow_draft(run, out[-1], logits[-1:], 3, 4, 4, 100)
    assert run.length == 3, "speculative entries must be rolled back"
    assert len(draft) == 4 + 3 * 16 and forwards == 3  # every candidate: 4, then 16 per level
    assert max(levels) == 4
    draft, levels, forwards = grow_draft(run, out[-1], logits[-1:], 3, 4, 4, 10)
    assert len(draft) == 10 and run.length == 3
    assert not draft.is_chain and draft.probs is None
    assert all(p < i for i, p in enumerate(draft.parents))
    assert all(0 <= t < VOCAB for t in draft.tokens)
    assert all(levels[i] == (1 if p < 0 else levels[p] + 1) for i, p in enumerate(draft.parents))
    chain, levels, forwards = grow_draft(run, out[-1], logits[-1:], 3, 5, 1, 16)
    assert chain.is_chain and len(chain) == 5 and forwards == 4 and run.length == 3
    # the chain is greedy: its first token is the top draft token mapped to the target vocab
    assert chain.tokens[0] == int(run.draft_ids[logits[-1].argmax()])


def test_tree_nodes_see_only_their_ancestors(target):
    head = make_head(target)
    emb = target.get_input_embeddings().weight
    run = HeadRunner(head, emb, 64)
    h = target.config.hidden_size
    hid = torch.randn(4, h)
    run.forward([1, 2, 3, 4], hid, torch.arange(1, 5))
    # level 1: two siblings at position 5; level 2: a child of the second sibling
    root = torch.randn(h)
    allowed = torch.ones((2, 6), dtype=torch.bool)
    allowed[0, 5] = False
    allowed[1, 4] = False
    o1, l1 = run.forward([7, 9], torch.stack([root, root]), torch.tensor([5, 5]), allowed)
    allowed2 = torch.tensor([[1, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    _, l2 = run.forward([11], o1[1:2], torch.tensor([6]), allowed2)
    chain = HeadRunner(head, emb, 64)
    chain.forward([1, 2, 3, 4], hid, torch.arange(1, 5))
    c1, k1 = chain.forward([9], root[None], torch.tensor([5]))
    _, k2 = chain.forward([11], c1, torch.tensor([6]))
    assert torch.allclose(l1[1], k1[0], atol=1e-5)
    assert torch.allclose(l2, k2, atol=1e-5)


class _Sim:
    """An engine stand-in over a LeanRunner: the same calls, our choice of accepted tokens."""

    def __init__(self, target, taps):
        self.runner = LeanRunner.from_hf_model(target, max_length=256)
        self.taps = taps

    def prefill(self, prompt):
        self.runner.reset()
        out = self.runner.forward(prompt, taps=self.taps)
        return out.hidden

    def step(self, root, draft, accept: int, bonus: int):
        if draft is None:  # a plain step
            out = self.runner.forward([root], taps=self.taps)
            return StepResult(None, [], bonus, [bonus], hidden=out.hidden)
        ids = [root, *draft.tokens[:accept]]  # a chain: accept its first `accept` nodes
        out = self.runner.forward(ids, taps=self.taps)
        return StepResult(draft, list(range(accept)), bonus, [*ids[1:], bonus], hidden=out.hidden)


def assert_cache_rebuilt(prop, sim, head, emb, context):
    """The head's cache equals one built from scratch over ``context`` (its window)."""
    assert prop.sync(context)
    base = len(context) - 1 - prop.head.length  # the window's start
    fresh = HeadRunner(head, emb, 256)
    sim.runner.reset()
    taps = sim.runner.forward(context[:-1], taps=prop.taps).hidden
    _, logits = fresh.forward(
        context[base + 1 :], fresh.fuse(taps[base:]), torch.arange(base + 1, len(context))
    )
    n = fresh.length
    assert n == prop.head.length
    assert torch.allclose(prop.head.kv[:, :, :n], fresh.kv[:, :, :n], atol=1e-4)
    assert torch.allclose(prop._root[1], logits[-1:], atol=1e-4)
    return base


def _prefilled(target, window: int, seed: int, prompt: int):
    """A chain EAGLE proposer (depth 4) over a fresh head, prefilled on ``prompt`` random
    tokens through a :class:`_Sim`; the context ends with the first sampled token (the
    root). Returns (head, embedding, proposer, sim, rng, context)."""
    head = make_head(target)
    emb = target.get_input_embeddings().weight
    rt = EagleRuntime(HeadRunner(head, emb, 256), head_dir("."))
    prop = EagleProposer(rt, depth=4, topk=1, window=window)
    sim = _Sim(target, prop.taps)
    rng = random.Random(seed)
    context = [rng.randrange(VOCAB) for _ in range(prompt)]
    prop.begin(None)
    prop.prefilled(sim.prefill(context))
    context.append(rng.randrange(VOCAB))  # the first sampled token: the root
    return head, emb, prop, sim, rng, context


def test_head_cache_stays_in_step_with_partial_accepts(target):
    """After steps that accept 0, some or all draft tokens, the head's cache equals a
    cache rebuilt from scratch over the accepted tokens (the target's real states)."""
    head, emb, prop, sim, rng, context = _prefilled(target, window=16, seed=3, prompt=20)
    for step in range(8):
        draft = prop.propose(context, budget=4)
        assert draft is not None and draft.is_chain and len(draft) == 4
        accept = [0, 2, 4, 1][step % 4]
        bonus = rng.randrange(VOCAB)
        prop.observe(sim.step(context[-1], draft, accept, bonus))
        context += [*draft.tokens[:accept], bonus]
    assert assert_cache_rebuilt(prop, sim, head, emb, context) == 20 - 16
    assert prop.history and all(d == 4 for d, _, _ in prop.history)


def test_head_cache_stays_in_step_through_steps_others_drafted(target):
    """Steps another proposer drafted (``follow``) and plain ones, between its own: the
    head's cache still equals one rebuilt from scratch, and a budget caps the draft."""
    head, emb, prop, sim, rng, context = _prefilled(target, window=64, seed=5, prompt=12)
    for step in range(9):
        bonus = rng.randrange(VOCAB)
        if step % 3 == 0:  # its own step, budget 2: a chain of 2
            draft = prop.propose(context, budget=2)
            assert draft is not None and len(draft) == 2
            prop.observe(sim.step(context[-1], draft, 1, bonus))
            context += [draft.tokens[0], bonus]
        elif step % 3 == 1:  # another proposer's draft, 3 tokens of it accepted
            other = Draft.chain([rng.randrange(VOCAB) for _ in range(3)], "other")
            prop.follow(sim.step(context[-1], other, 3, bonus))
            context += [*other.tokens, bonus]
        else:  # a plain step
            prop.follow(sim.step(context[-1], None, 0, bonus))
            context.append(bonus)
    assert_cache_rebuilt(prop, sim, head, emb, context)
    assert [d for d, _, _ in prop.history] == [2, 2, 2]


def test_the_head_runs_through_the_targets_kernels(spec_engine):
    """The head loaded for an engine gets the engine's kernels (CPU panels where they
    build); its outputs match torch's products."""
    rt = load_runtime(spec_engine)
    assert type(rt.runner.kernels) is type(spec_engine.kernels(rt.runner.dtype))
    plain = HeadRunner(
        load_head(rt.path, spec_engine.embedding().float()), spec_engine.embedding(), 64,
        kernels=TorchKernels(),
    )  # fmt: skip
    h = spec_engine.hidden_size
    taps = torch.randn(5, 3, h)
    ids = [5, 6, 7, 8, 9]
    rt.runner.reset()
    a = rt.runner.forward(ids, rt.runner.fuse(taps), torch.arange(1, 6))
    b = plain.forward(ids, plain.fuse(taps), torch.arange(1, 6))
    one_a = rt.runner.forward([3], a[0][-1:], torch.tensor([6]))  # one row: decode attention
    one_b = plain.forward([3], b[0][-1:], torch.tensor([6]))
    rt.runner.reset()
    for x, y in zip([*a, *one_a], [*b, *one_b], strict=True):
        torch.testing.assert_close(x.float(), y.float(), rtol=2e-3, atol=2e-3)


needs_i8 = pytest.mark.skipif(
    not quant_gemm.i8_available(), reason="no int8 dot products (AVX2 / AVX-512 VNNI) here"
)


@needs_i8
def test_int8_kernels_hold_a_heads_matrices_in_gguf_blocks():
    """Int8Kernels packs an (in, out) weight into HEAD_BLOCKS blocks and multiplies as the
    int8 runner does: the same numbers as linear_i8 over those blocks, within x's int8
    rounding of the product with the blocks' own weights, the residual added; a matrix
    whose inputs are no multiple of 32 keeps CpuGemmKernels' panels and products."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 80, generator=g) * 0.1  # (in, out)
    x, res = torch.randn(3, 96, generator=g), torch.randn(3, 80, generator=g)
    kn = Int8Kernels()
    packed = kn.pack(w)
    assert isinstance(packed, quant_gemm.QuantMatrix) and packed.qtype == HEAD_BLOCKS
    assert (packed.n, packed.k) == (80, 96)
    blocks = quantize_blocks(w.t().contiguous().numpy(), HEAD_BLOCKS)
    ref = quant_gemm.QuantMatrix.from_bytes(blocks, HEAD_BLOCKS, 80, 96)
    assert torch.equal(kn.linear(x, packed), quant_gemm.linear_i8(x, ref))
    got = kn.linear(x, packed, res)
    assert torch.equal(got, quant_gemm.linear_i8(x, ref, res=res))
    want = x @ ref.dequantize().t() + res  # the blocks' own weights, exact x
    assert ((got - want).norm() / want.norm()).item() < 0.01
    assert ((got - (x @ w + res)).norm() / want.norm()).item() < 0.1  # 4-bit weights
    odd = torch.randn(40, 48, generator=g)  # 40 inputs: no blocks
    plain = CpuGemmKernels()
    assert isinstance(kn.pack(odd), torch.Tensor)
    xo = torch.randn(2, 40, generator=g)
    assert torch.equal(kn.linear(xo, kn.pack(odd)), plain.linear(xo, plain.pack(odd)))


class _RoundedReference(Int8Kernels):
    """Int8Kernels' own blocks, multiplied in float64 with x rounded to int8 as linear_i8
    rounds it (``helpers.rounded_rows``): the int8 products' arithmetic but for their fp32
    sums."""

    def linear(self, x: torch.Tensor, w, res: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(w, quant_gemm.QuantMatrix):
            return super().linear(x, w, res)
        y = rounded_rows(x.float()) @ w.dequantize("scalar").double().t()
        return (y if res is None else y + res.double()).float()


@needs_i8
def test_an_int8_target_gives_its_head_int8_kernels(spec_engine, monkeypatch):
    """A lean runner with int8 block products hands its draft head Int8Kernels; one with
    exact products CpuGemmKernels. The int8 head computes what its blocks and x's int8
    rounding give: against a head whose products are those in float64 (the same blocks,
    x rounded the same way, the same norms and attention), the outputs and logits differ
    by fp32 sums and, where a sum's last bit moves an input across a rounding boundary,
    one int8 step (1/127 of its block's largest |x|) of that input: ~1e-3 of the norm
    each time, so 1e-2 allows several. The 4-bit weights' own rounding (up to ~15% of the
    16-bit head's logits, CPU by CPU as training rounds differently) is no part of it."""
    assert type(spec_engine.kernels(torch.float32)) is CpuGemmKernels  # the tiny model
    monkeypatch.setattr(spec_engine.runner, "int8", True, raising=False)
    kn = spec_engine.kernels(torch.float32)
    assert type(kn) is Int8Kernels
    emb = spec_engine.embedding()
    rt = load_runtime(spec_engine)
    head = load_head(rt.path, emb.float())
    q8 = HeadRunner(head, emb, 64, kernels=kn)
    ref = HeadRunner(head, emb, 64, kernels=_RoundedReference())
    f16 = HeadRunner(head, emb, 64, kernels=CpuGemmKernels())
    assert q8.param_bytes < 0.6 * f16.param_bytes
    taps = torch.randn(6, 3, spec_engine.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = [5, 6, 7, 8, 9, 10]
    a = q8.forward(ids, q8.fuse(taps), torch.arange(1, 7))
    b = ref.forward(ids, ref.fuse(taps), torch.arange(1, 7))
    for x, y in zip(a, b, strict=True):  # outputs and logits
        err = ((x - y).norm() / y.norm()).item()
        assert err < 1e-2, err


def test_a_heads_few_row_products_run_on_one_thread(monkeypatch):
    """Fewer than FEW_ROWS rows: one thread (a product split over OpenMP's passive pool
    wakes a sleeping thread each time); more rows: the kernel's own rule."""
    seen: list[int | None] = []
    real = cpu_gemm.mm

    def spy(x, p, bias=None, res=None, threads=None):
        seen.append(threads)
        return real(x, p, bias, res, threads)

    monkeypatch.setattr(cpu_gemm, "mm", spy)
    kn = CpuGemmKernels()
    w = kn.pack(torch.randn(64, 48))
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        pytest.skip("no CPU panels here")
    few, many = torch.randn(FEW_ROWS - 1, 64), torch.randn(FEW_ROWS, 64)
    torch.testing.assert_close(kn.linear(few, w), few @ cpu_gemm.unpack(w))
    kn.linear(many, w)
    assert seen == [1, None]


def test_no_head_is_a_clear_error(tmp_path):
    """No MODEL/eagle: "no eagle weights for this model", where it looked, how to train."""

    class FakeTarget:
        model_path = str(tmp_path)
        speculator_state = SpeculatorState()

    with pytest.raises(NoEagleWeights, match="train-eagle") as err:
        make_proposer("eagle", FakeTarget())
    # MissingWeights' fields: where the weights were looked for, for whom (policy, stats)
    assert err.value.kind == "eagle" and err.value.where == head_dir(tmp_path)
    assert str(err.value).startswith("no eagle weights for this model (")
    assert str(head_dir(tmp_path)) in str(err.value)
    with pytest.raises(NoEagleHead, match="needs a target model"):
        make_proposer("eagle", None)


def test_the_default_tiny_model_has_no_head(engine):
    """The tiny engine's model has nothing beside it: a clear LookupError, not a crash."""
    with pytest.raises(MissingWeights, match="no eagle weights for this model"):
        make_proposer("eagle", engine)


@pytest.fixture(scope="module")
def eagle_runtime(spec_engine):
    """The head beside ``spec_engine``'s model, trained for a few steps on the
    ``SPEC_PROMPTS`` prompts (the tiny engine's own continuations of them)."""
    return load_runtime(spec_engine)


@pytest.fixture(scope="module")
def random_runtime(spec_engine, tmp_path_factory):
    """A random head for the same model, in a temporary folder."""
    where = tmp_path_factory.mktemp("head")
    cfg = EagleConfig.for_target(spec_engine.config, draft_vocab_size=1024)
    torch.manual_seed(0)
    head = EagleHead(cfg, spec_engine.runner.embed.float())
    head.init_lm_head_from(spec_engine.runner.embed.float())
    save_head(head, where)
    return load_runtime(spec_engine, where)


@pytest.mark.parametrize(("topk", "policy"), [(1, True), (3, False), (1, False)])
def test_greedy_output_equals_plain_decoding(spec_engine, eagle_runtime, topk, policy):
    """Held-out prompts decoded with EAGLE drafts (chain and tree; bare, every step, or
    under the policy's controller) give plain greedy output, and the trained head's
    drafts get accepted."""
    engine = spec_engine
    params = GenParams(max_tokens=SPEC_PROMPTS["max_tokens"], max_draft=8)
    accepted = drafted = 0
    store = PolicyStore()  # nothing measured before this test
    prompts = heldout_prompts(engine, 6, tokens=SPEC_PROMPTS["tokens"], seed=SPEC_PROMPTS["seed"])
    for prompt in prompts:
        engine.reset_cache()
        plain, _ = engine.generate(prompt, params)
        prop = EagleProposer(eagle_runtime, depth=4, topk=topk, max_nodes=8)
        driver = Controller(engine, {"eagle": prop}, store, "eagle") if policy else prop
        ids, stats = engine.generate(prompt, params, driver)
        assert ids == plain
        assert policy or prop.history, "the bare proposer drafts every step"
        drafted += len(prop.history)
        accepted += sum(stats.accepted.values())
    assert drafted > 0, "the proposer never drafted"
    # bare, the trained head's drafts get accepted; under the policy on this tiny model (a
    # head forward costs what a target forward does) it may get only its trial
    assert policy or accepted > 0, "the trained head never had a draft token accepted"
    assert load_runtime(spec_engine) is eagle_runtime  # loaded once per engine


def test_random_head_keeps_greedy_output(spec_engine, random_runtime):
    """A random head's drafts are (nearly) all rejected: the output is still plain's."""
    params = GenParams(max_tokens=16, max_draft=8)
    for prompt in heldout_prompts(spec_engine, 3, tokens=100, seed=13):
        spec_engine.reset_cache()
        plain, _ = spec_engine.generate(prompt, params)
        prop = EagleProposer(random_runtime, depth=4, topk=3, max_nodes=8)
        text, _ = spec_engine.generate(prompt, params, prop)
        assert text == plain
        assert len(prop.history) > 1


def test_bench_acceptance_and_projection_arithmetic():
    """Per-position acceptance is conditional on reaching the position; projections use
    the measured verify cost by draft size and the head cost given."""
    from codespec.daemon.bench.eagle import Acc, project

    acc = Acc(steps=[(3, 3, 3), (3, 3, 1), (3, 3, 0), (1, 1, 1)], plain_steps=2)
    pos = acc.per_position(3)
    assert pos[0] == pytest.approx(3 / 4) and pos[1] == pytest.approx(1 / 2)
    assert pos[2] == pytest.approx(1.0)
    verify = {0: 10.0, 1: 12.0, 3: 15.0}
    pr = project(acc, verify, head_ms=1.0)
    tokens = 4 + 2 + 1 + 2 + 2  # accepted + bonus per drafted step, 1 per plain step
    cpu_cost = 2 * 10 + 3 * (15 + 3) + (12 + 1)
    assert pr["cpu_model"] == pytest.approx(tokens * 10 / cpu_cost, abs=1e-3)
    flat_cost = 2 * 10 + 3 * (10 + 3 / 3) + (10 + 1 / 3)
    assert pr["head_1_30_flat_verify"] == pytest.approx(tokens * 10 / flat_cost, abs=1e-3)
