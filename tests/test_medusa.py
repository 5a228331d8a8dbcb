"""Medusa heads and proposer: files, the tree, the offsets, back-off, losslessness, training.

Tiny random models and stub heads on the CPU; the decoding tests run on the tiny
engine, with random heads and with the heads beside ``spec_engine``'s model (trained
for a few steps on the prompts they decode, so their drafts are accepted).
"""

from __future__ import annotations

import json
import shutil
import sysconfig
import time
from pathlib import Path

import pytest
import torch

from codespec.daemon.engine.engine import GenParams
from codespec.daemon.training import train_medusa
from codespec.speculators.draft import Draft, RequestInfo, StepResult
from codespec.speculators.medusa import (
    HeadsRunner,
    MedusaConfig,
    MedusaHeads,
    MedusaProposer,
    MedusaRuntime,
    NoMedusaHeads,
    NoMedusaWeights,
    build_tree,
    heads_dir,
    load_heads,
    load_runtime,
    save_heads,
)
from codespec.speculators.registry import make_proposer
from conftest import SPEC_PROMPTS, heldout_prompts, tiny_llama, tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")


def random_heads(hidden: int, vocab: int, draft_vocab: int, k: int = 3, seed: int = 0):
    cfg = MedusaConfig(
        hidden_size=hidden, vocab_size=vocab, draft_vocab_size=draft_vocab, num_heads=k, tap=4
    )
    torch.manual_seed(seed)
    heads = MedusaHeads(cfg)
    heads.set_draft_vocab(torch.randperm(vocab)[:draft_vocab])
    with torch.no_grad():  # away from the zero init so every weight matters
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return heads.eval()


# -- files and the forward -------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    """fp16 file, same config, same weights (to fp16), and the runner matches the module."""
    heads = random_heads(32, 96, 40)
    save_heads(heads, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "codespec-medusa" and cfg["num_heads"] == 3
    back = load_heads(tmp_path)
    assert back.cfg == heads.cfg
    for name, t in heads.state_dict().items():
        if t.is_floating_point():
            assert torch.allclose(back.state_dict()[name], t.half().float()), name
        else:
            assert torch.equal(back.state_dict()[name], t), name
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "model.safetensors"))["lm_heads"].dtype == torch.float16
    h = torch.randn(32)
    want = torch.log_softmax(back(h), -1)  # (k, Vd)
    got = HeadsRunner(back).log_probs(h)
    assert torch.allclose(got, want, atol=1e-4)
    assert torch.allclose(HeadsRunner(back).log_probs(h, depth=2), want[:2], atol=1e-4)
    assert torch.equal(back.draft_to_target(), torch.nonzero(back.t2d).flatten())


def test_bad_folder_is_an_error(tmp_path):
    save_heads(random_heads(32, 96, 40), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        load_heads(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "eagle3"}')
    with pytest.raises(ValueError, match="not codespec Medusa"):
        load_heads(tmp_path)


def test_missing_heads_is_a_clear_lookup_error(tmp_path):
    class FakeEngine:
        model_path = str(tmp_path)
        runner = None

    with pytest.raises(NoMedusaWeights, match="train-medusa") as info:
        make_proposer("medusa", FakeEngine())
    assert isinstance(info.value, NoMedusaHeads) and isinstance(info.value, LookupError)
    assert str(info.value).startswith("no medusa weights for this model (")
    assert str(heads_dir(tmp_path)) in str(info.value)
    with pytest.raises(NoMedusaHeads, match="needs an engine"):
        make_proposer("medusa", None)


def test_heads_for_another_model_are_refused(engine, tmp_path):
    save_heads(random_heads(32, 96, 40), tmp_path)
    with pytest.raises(NoMedusaHeads, match="vocab 96"):
        load_runtime(engine, tmp_path)


# -- the tree --------------------------------------------------------------------------


def test_tree_is_the_best_nodes_by_path_probability():
    """Every node's score is its path's log probability; the draft holds the best ones, each
    depth-d node's children are head d+1's candidates, parents come first."""
    torch.manual_seed(3)
    lp = torch.log_softmax(torch.randn(4, 50) * 3, -1)
    ids = torch.arange(1000, 1050)
    draft, depths, scores = build_tree(lp, ids, topk=3, max_nodes=10)
    assert len(draft) == 10
    assert draft.parents is not None
    top = lp.topk(3, -1)
    for i, (p, d) in enumerate(zip(draft.parents, depths, strict=True)):
        assert p < i and (d == 1) == (p == -1) and (p < 0 or depths[p] == d - 1)
        assert draft.tokens[i] - 1000 in top.indices[d - 1].tolist()
        own = float(lp[d - 1, draft.tokens[i] - 1000])
        assert scores[i] == pytest.approx((scores[p] if p >= 0 else 0.0) + own, abs=1e-5)
    # no node left out scores above the worst node kept (all 3 + 9 + 27 + 81 candidates)
    everything, _, all_scores = build_tree(lp, ids, topk=3, max_nodes=120)
    assert len(everything) == 3 + 9 + 27 + 81
    assert sorted(all_scores, reverse=True)[9] == pytest.approx(min(scores), abs=1e-6)
    chain, _, _ = build_tree(lp, ids, topk=1, max_nodes=10)
    assert chain.is_chain and chain.tokens == (lp.argmax(-1) + 1000).tolist()


# -- offsets: stub heads that know the answer -------------------------------------------


class OracleHeads:
    """Stub heads: the hidden state names its position ``p`` (by exact value or by the
    nearest row of ``table``); head ``i`` puts its mass on ``seq[p + 1 + i]``, the token
    ``i`` places after the bonus that ``p``'s logits gave. ``shift`` breaks the offset."""

    def __init__(self, seq: list[int], vocab: int, k: int, table=None, shift: int = 0):
        self.cfg = MedusaConfig(
            hidden_size=8, vocab_size=vocab, draft_vocab_size=vocab, num_heads=k, tap=4
        )
        self.seq, self.vocab, self.table, self.shift = seq, vocab, table, shift
        self.draft_ids = torch.arange(vocab)

    def position(self, hidden: torch.Tensor) -> int:
        if self.table is None:
            return int(hidden[0])
        return int((self.table - hidden.float()).norm(dim=-1).argmin())

    def log_probs(self, hidden: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        k = self.cfg.num_heads if depth is None else min(depth, self.cfg.num_heads)
        p = self.position(hidden)
        logits = torch.zeros(k, self.vocab)
        for i in range(1, k + 1):
            j = p + 1 + i + self.shift
            logits[i - 1, self.seq[j] if j < len(self.seq) else 0] = 10.0
        return torch.log_softmax(logits, -1)


class FakeClock:
    """Stands in for the proposer's ``time`` module: the simulation advances it."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr("codespec.speculators.medusa.time", fake)
    return fake


def simulate(
    prop: MedusaProposer,
    seq: list[int],
    prompt_len: int,
    steps: int,
    wrong=(),
    followed=(),
    clock=time,
):
    """A fake engine over the known sequence ``seq``: greedy verification accepts the draft
    path that follows ``seq``; the hidden state of a token at position p is ``[p, ...]``.
    On ``followed`` steps another proposer drafts (the next two true tokens) and the
    proposer only follows. Returns (drafted nodes, accepted) per step."""
    prop.begin(RequestInfo(prompt_ids=seq[:prompt_len]))
    prop.prefilled(torch.arange(prompt_len, dtype=torch.float32)[:, None, None].expand(-1, 1, 8))
    n = prompt_len + 1  # the context: prompt + the root (seq[prompt_len], sampled)
    out = []
    for s in range(steps):
        clock.sleep(0.002)  # the target's forward
        foreign = s in followed
        draft = Draft.chain(seq[n : n + 2]) if foreign else prop.propose(seq[:n], budget=8)
        rows = [n - 1]  # row 0: the root at position n - 1
        accepted: list[int] = []
        if draft is not None:
            assert draft.parents is not None
            depth = {}
            for i, p in enumerate(draft.parents):
                depth[i] = 1 if p < 0 else depth[p] + 1
                rows.append(n - 1 + depth[i])
            clock.sleep(0.0002 * len(draft))
            at = -1
            for i, (tok, p) in enumerate(zip(draft.tokens, draft.parents, strict=True)):
                if p == at and tok == seq[n + len(accepted)] and s not in wrong:
                    accepted.append(i)
                    at = i
        hidden = torch.tensor(rows, dtype=torch.float32)[:, None, None].expand(-1, 1, 8)
        bonus = seq[n + len(accepted)]
        result = StepResult(draft, accepted, bonus, [], hidden=hidden)
        if foreign:
            prop.follow(result)
        else:
            prop.observe(result)
        out.append((len(draft) if draft is not None and not foreign else 0, len(accepted)))
        n += len(accepted) + 1
    return out


def test_offsets_perfect_heads_are_fully_accepted():
    """Head i read at the last fed token drafts depth i: perfect heads are accepted to
    their full depth, step after step (after partial accepts too), and a head shifted
    by one position is never accepted."""
    seq = list(range(10, 400))
    heads = OracleHeads(seq, 500, k=3)
    prop = MedusaProposer(MedusaRuntime(heads, Path(".")), topk=2, max_nodes=6, adaptive=False)
    steps = simulate(prop, seq, prompt_len=20, steps=14, wrong={3, 7}, followed={10, 11})
    for s, (nodes, acc) in enumerate(steps):
        assert nodes == (0 if s in {10, 11} else 6)
        assert acc == (0 if s in {3, 7} else 2 if s in {10, 11} else 3), (s, steps)
    assert len(prop.history) == 12  # followed steps are not its own
    shifted = OracleHeads(seq, 500, k=3, shift=1)
    prop = MedusaProposer(MedusaRuntime(shifted, Path(".")), topk=2, max_nodes=6, adaptive=False)
    assert all(acc == 0 for _, acc in simulate(prop, seq, prompt_len=20, steps=6))


def test_backs_off_when_drafts_do_not_pay_and_drafts_when_they_do(clock):
    """Simulated costs: a plain step 2 ms, each draft node 0.2 ms more. Heads never
    accepted back off (and probe now and then); perfect heads draft every step, full depth."""
    seq = list(range(10, 600))
    wrong = OracleHeads(seq, 700, k=3, shift=1)
    prop = MedusaProposer(MedusaRuntime(wrong, Path(".")), topk=2, max_nodes=6)
    steps = simulate(prop, seq, prompt_len=20, steps=60, clock=clock)
    drafted = sum(1 for nodes, _ in steps if nodes)
    assert drafted < 20, steps
    assert any(nodes for nodes, _ in steps[30:]), "never probes again"
    good = OracleHeads(seq, 700, k=3)
    prop = MedusaProposer(MedusaRuntime(good, Path(".")), topk=2, max_nodes=6)
    steps = simulate(prop, seq, prompt_len=20, steps=40, clock=clock)
    assert sum(1 for nodes, _ in steps[10:] if nodes) == 30
    assert max(d for d, _, _ in prop.history[-10:]) == 3  # the full depth pays


def test_offsets_on_the_real_engine(engine):
    """Through the engine: stub heads that recognise the target's real last-layer state
    at each position and read the plain greedy continuation draft whole accepted chains."""
    prompt = heldout_prompts(engine, 1, tokens=100, seed=5)[0]
    params = GenParams(max_tokens=30, max_draft=8)
    engine.reset_cache()
    plain, _ = engine.generate(prompt, params)
    engine.reset_cache()
    out: list[int] = []
    for delta in engine.stream(prompt, params):
        out.extend(delta.token_ids)
    seq = prompt + out
    engine.reset_cache()
    table = engine.runner.forward(seq, taps=(engine.runner.num_layers,)).hidden[:, 0]
    engine.reset_cache()
    heads = OracleHeads(seq, engine.runner.vocab_size, k=3, table=table)
    heads.cfg.tap = engine.runner.num_layers
    prop = MedusaProposer(MedusaRuntime(heads, Path(".")), topk=2, max_nodes=6, adaptive=False)
    text, stats = engine.generate(prompt, params, prop)
    assert text == plain
    full = [m for d, _, m in prop.history if d == 3]
    assert len(full) >= 5 and all(m == 3 for m in full), prop.history
    assert stats.target_forwards <= 12  # 30 plain; up to 4 tokens a step with the oracle


# -- decoding on the tiny engine -------------------------------------------------------


@pytest.fixture(scope="module")
def random_runtime(engine, tmp_path_factory):
    where = tmp_path_factory.mktemp("medusa")
    r = engine.runner
    heads = random_heads(r.hidden_size, r.vocab_size, 512, k=3, seed=1)
    heads.cfg.tap = r.num_layers
    save_heads(heads, where)
    return load_runtime(engine, where)


def test_random_heads_keep_greedy_output(engine, random_runtime):
    params = GenParams(max_tokens=12, max_draft=8)
    for prompt in heldout_prompts(engine, 2, tokens=80, seed=13):
        engine.reset_cache()
        plain, _ = engine.generate(prompt, params)
        prop = MedusaProposer(random_runtime, topk=3, max_nodes=8, adaptive=False)
        text, _ = engine.generate(prompt, params, prop)
        assert text == plain
        assert prop.history and prop.history[0][1] == 8  # later: the budget left


@pytest.mark.parametrize("adaptive", [True, False])
def test_trained_heads_greedy_output_equals_plain_decoding(spec_engine, adaptive):
    """The heads beside the model (MODEL/medusa), through the registry as the daemon builds
    them: plain greedy output, and accepted drafts (adaptive and drafting every step)."""
    engine = spec_engine
    params = GenParams(max_tokens=SPEC_PROMPTS["max_tokens"], max_draft=12)
    accepted = 0
    prompts = heldout_prompts(engine, 5, tokens=SPEC_PROMPTS["tokens"], seed=SPEC_PROMPTS["seed"])
    for prompt in prompts:
        engine.reset_cache()
        plain, _ = engine.generate(prompt, params)
        prop = make_proposer("medusa", engine)
        prop.adaptive = adaptive
        text, stats = engine.generate(prompt, params, prop)
        assert text == plain
        accepted += sum(stats.accepted.values())
    assert load_runtime(engine) is load_runtime(engine)  # loaded once per engine
    assert accepted > 0, "the trained heads never had a draft token accepted"


def test_temperature_runs_finish(spec_engine):
    engine = spec_engine
    params = GenParams(max_tokens=20, max_draft=8, temperature=0.8, seed=3)
    drafted = 0
    for prompt in heldout_prompts(engine, 3, tokens=80, seed=17):
        # not adaptive: whether drafting pays on this machine's costs is not the point here
        prop = MedusaProposer.for_engine(engine, adaptive=False)
        _, stats = engine.generate(prompt, params, prop)
        assert stats.finish_reason in ("length", "stop") and stats.tokens >= 1
        drafted += len(prop.history)
    assert drafted, "never drafted"


# -- training --------------------------------------------------------------------------


def test_loss_goes_down_on_one_batch():
    model = tiny_llama(vocab=96, layers=2, seed=2)
    target = train_medusa.Target.__new__(train_medusa.Target)
    target.model, target.config, target.num_layers = model, model.config, 2
    cfg = MedusaConfig(hidden_size=32, vocab_size=96, draft_vocab_size=48, num_heads=3, tap=2)
    heads = MedusaHeads(cfg)
    heads.set_draft_vocab(torch.arange(48))
    heads.init_from_target(model.model.norm.weight, target.lm_head)
    torch.manual_seed(0)
    x = torch.randint(0, 96, (2, 33))
    taps, logits = target.run(x, (2,))
    opt = torch.optim.AdamW(heads.parameters(), lr=3e-3)
    first, first_acc = train_medusa.medusa_loss(heads, taps[:, :, 0], logits, 0.8)
    for _ in range(25):
        loss, accs = train_medusa.medusa_loss(heads, taps[:, :, 0], logits, 0.8)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.8 * first.item()
    assert len(accs) == 3 and sum(accs) > sum(first_acc)


def test_tiny_run_writes_a_loadable_folder_and_resumes(tmp_path, capsys, default_model_dir):
    model_dir = tiny_model_dir(
        tmp_path / "model", default_model_dir, hidden_size=32, max_position_embeddings=256
    )
    data = tmp_path / "data"
    data.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("bisect.py", "colorsys.py", "keyword.py"):
        shutil.copy(stdlib / name, data / name)
    out = tmp_path / "medusa"
    args = ["--model", str(model_dir), "--data", str(data), "--out", str(out)]
    args += ["--heads", "2", "--batch-size", "2", "--seq-len", "48", "--draft-vocab", "256"]
    args += ["--eval-windows", "1", "--eval-prompts", "1", "--eval-tokens", "6"]
    args += ["--checkpoint-every", "2"]
    assert train_medusa.main([*args, "--steps", "3"]) == 0
    heads = load_heads(out)
    assert heads.cfg.num_heads == 2 and heads.cfg.tap == 2 and heads.cfg.draft_vocab_size == 256
    metrics = json.loads((out / "training.json").read_text())
    assert len(metrics["heldout_teacher_forced_top1_per_head"]) == 2
    assert len(metrics["heldout_decoding"]["per_depth_acceptance"]) == 2
    assert metrics["steps"] == 3
    capsys.readouterr()
    assert train_medusa.main([*args, "--steps", "4", "--resume"]) == 0
    assert "resumed at step 3" in capsys.readouterr().out
    assert json.loads((out / "training.json").read_text())["steps"] == 4


def test_draft_class_is_used_unchanged():
    """The proposer's drafts are ordinary trees (guards against a private Draft variant)."""
    lp = torch.log_softmax(torch.randn(2, 10), -1)
    draft, _, _ = build_tree(lp, torch.arange(10), topk=2, max_nodes=4)
    assert isinstance(draft, Draft) and draft.probs is None
    assert draft.sources == ["medusa"] * 4
