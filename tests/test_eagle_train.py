"""`codespec train-eagle`: the loss goes down, the run writes a loadable head, it resumes."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from codespec.daemon.training import train_eagle, trainer
from codespec.speculators.eagle_head import EagleConfig, EagleHead, load_head
from conftest import tiny_llama, tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")


def test_training_steps_lower_the_loss():
    """Twenty steps on one batch: the decayed TTT loss falls and step-0 accuracy rises."""
    model = tiny_llama(vocab=96, layers=2, seed=2)
    target = trainer.Target.__new__(trainer.Target)
    target.model, target.config, target.num_layers = model, model.config, 2
    target.runner = None  # transformers' path
    target.device = torch.device("cpu")
    cfg = train_eagle.EagleTrainConfig(ttt_steps=3, decay=0.8)
    head = EagleHead(
        EagleConfig.for_target(model.config, draft_vocab_size=48, taps=(0, 1, 2)),
        target.embed,
    )
    head.set_draft_vocab(torch.arange(48))
    head.init_lm_head_from(target.lm_head)
    torch.manual_seed(0)
    x = torch.randint(0, 96, (2, 33))
    taps, logits = target.run(x, head.cfg.taps)
    assert taps.shape == (2, 33, 3, 32) and logits.shape == (2, 33, 96)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first, first_acc = train_eagle.ttt_loss(head, taps, logits, x, cfg)
    for _ in range(20):
        loss, accs = train_eagle.ttt_loss(head, taps, logits, x, cfg)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.8 * first.item()
    assert accs[0] > first_acc[0]
    assert len(accs) == 3 and accs[0] >= accs[1] >= accs[2]  # cumulative


def test_last_layer_tap_is_before_the_final_norm():
    model = tiny_llama(vocab=96, layers=2, seed=2)
    target = trainer.Target.__new__(trainer.Target)
    target.model, target.config, target.num_layers = model, model.config, 2
    target.runner = None  # transformers' path
    target.device = torch.device("cpu")
    x = torch.randint(0, 96, (1, 9))
    taps, logits = target.run(x, (0, 1, 2))
    head = model.lm_head(model.model.norm(taps[:, :, 2]))
    assert torch.allclose(head, logits, atol=1e-5)


def test_target_from_a_gguf_runs_on_its_blocks(tmp_path):
    """A folder the model cache made from a GGUF: the head trains on the states the daemon
    runs (the GGUF's blocks through the lean stack), within the block rounding of
    transformers' fp32 states; ``hf`` asks for transformers; anything else is an error."""
    pytest.importorskip("gguf")
    from ggufs import write_gguf

    from codespec.daemon.engine import models

    (tmp_path / "src").mkdir()
    src = write_gguf(tmp_path / "src" / "q.gguf", qtype="Q8_0", hidden=128, layers=2, ffn=256)
    folder = str(models.import_gguf(src, tmp_path / "cache"))
    blocks, hf = trainer.Target(folder, max_length=16), trainer.Target(folder, "hf")
    assert blocks.runner is not None and "GGUF" in blocks.kind
    assert hf.runner is None and "transformers" in hf.kind
    x = torch.randint(
        0, int(hf.config.vocab_size), (2, 12), generator=torch.Generator().manual_seed(3)
    )
    taps_b, logits_b = blocks.run(x, (0, 1, 2))
    taps_h, logits_h = hf.run(x, (0, 1, 2))
    assert taps_b.shape == taps_h.shape == (2, 12, 3, 128)
    assert logits_b.shape == logits_h.shape
    assert blocks.runner.length == 0  # nothing left in its cache
    for got, want in ((taps_b, taps_h), (logits_b, logits_h)):
        assert (got - want).norm() <= 0.05 * want.norm()
    assert not torch.equal(logits_b, logits_h)  # really the other path
    with pytest.raises(ValueError, match="target runner"):
        trainer.Target(folder, "onnx")


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_tiny_run_writes_a_loadable_head_and_resumes(tmp_path, capsys, default_model_dir, device):
    """A tiny model with the default model's tokenizer (no FIM tokens: plain windows); on
    a GPU the target and the head train there (``--device cuda``) and the head comes back
    the same way."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir(
        tmp_path / "model", default_model_dir, hidden_size=32, max_position_embeddings=256
    )
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    data = tmp_path / "data"
    data.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("bisect.py", "colorsys.py", "keyword.py"):
        shutil.copy(stdlib / name, data / name)
    out = tmp_path / "head"
    args = [
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--out",
        str(out),
        "--batch-size",
        "2",
        "--seq-len",
        "48",
        "--ttt-steps",
        "2",
        "--draft-vocab",
        "256",
        "--eval-windows",
        "1",
        "--eval-prompts",
        "1",
        "--eval-tokens",
        "6",
        "--eval-depth",
        "2",
        "--checkpoint-every",
        "2",
        "--device",
        device,
    ]
    assert train_eagle.main([*args, "--steps", "3"]) == 0
    head = load_head(out, model.get_input_embeddings().weight)
    assert head.cfg.draft_vocab_size == 256 and head.cfg.taps == (1, 1, 1)
    metrics = json.loads((out / "training.json").read_text())
    assert len(metrics["heldout_teacher_forced_cumulative"]) == 2
    assert len(metrics["heldout_decoding"]["per_position_acceptance"]) == 2
    assert metrics["steps"] == 3
    capsys.readouterr()
    assert train_eagle.main([*args, "--steps", "4", "--resume"]) == 0
    assert "resumed at step 3" in capsys.readouterr().out
    assert json.loads((out / "training.json").read_text())["steps"] == 4


def test_a_device_that_is_not_there_is_an_error(tmp_path, capsys):
    """``--device`` names cpu, cuda or auto (as the engine's); cuda where torch sees no GPU
    is an error that says so."""
    assert train_eagle.main(["--device", "tpu", "--out", str(tmp_path)]) == 1
    assert "unknown device 'tpu'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert train_eagle.main(["--device", "cuda", "--out", str(tmp_path)]) == 1
        assert "CUDA is not available" in capsys.readouterr().err


def test_bad_data_folder_is_an_error(tmp_path, capsys):
    assert train_eagle.main(["--data", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 1
    assert "is not a folder" in capsys.readouterr().err


def test_sample_builder_rows_for_fim_and_plain_tokenizers():
    """With codespec's FIM tokens the rows mix prefix-suffix-middle samples (in that order)
    and left-to-right text; without them, plain windows. Rows are seq_len + 1 tokens and
    depend only on (seed, step, index), so a resumed run sees the same samples."""
    from codespec.daemon.training import train_data

    texts = train_data.read_texts(sorted(train_data.stdlib_root().glob("[b-c]*.py"))[:6])
    tok = train_data.train_tokenizer(texts, 600)
    cfg = train_eagle.EagleTrainConfig(seq_len=4096, seed=3, fim_rate=0.5)
    builder = trainer.sample_builder(tok, texts, cfg)
    assert isinstance(builder, train_data.SampleBuilder)
    ids = {s: tok.token_to_id(s) for s in train_data.SPECIAL_TOKENS}
    assert [ids[s] for s in train_data.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    rows = [builder.row(step, i) for step in range(3) for i in range(2)]
    assert all(len(r) == 4097 for r in rows)
    assert rows[0] == builder.row(0, 0) and rows[0] != rows[1]
    fim = 0
    for r in rows:
        for k, t in enumerate(r):
            if t == ids[train_data.FIM_PREFIX]:
                rest = r[k:]
                if ids[train_data.EOT] in rest:  # a whole sample inside the row
                    end = rest.index(ids[train_data.EOT])
                    sample = rest[:end]
                    assert sample.count(ids[train_data.FIM_SUFFIX]) == 1
                    assert sample.count(ids[train_data.FIM_MIDDLE]) == 1
                    assert sample.index(ids[train_data.FIM_SUFFIX]) < sample.index(
                        ids[train_data.FIM_MIDDLE]
                    )
                    fim += 1
    assert fim > 0
    plain = trainer.sample_builder(_without_fim(tok), texts, cfg)
    assert isinstance(plain, trainer.WindowBuilder) and len(plain.row(0, 0)) == 4097


def _without_fim(tok):
    """The same BPE as a tokenizer that does not know the FIM tokens' names."""

    class NoFim:
        def token_to_id(self, s):
            return None if "fim" in s else tok.token_to_id(s)

        def encode(self, text):
            return tok.encode(text)

    return NoFim()
