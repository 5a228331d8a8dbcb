"""`codespec train-model`: held-out split, seeded resumable training, a loadable export."""

from __future__ import annotations

from pathlib import Path

from codespec.daemon import train_model
from codespec.daemon.engine import Engine, GenParams

TINY = [
    "--hidden-size",
    "32",
    "--intermediate-size",
    "64",
    "--num-layers",
    "1",
    "--num-heads",
    "2",
    "--num-kv-heads",
    "1",
    "--seq-len",
    "64",
    "--batch-size",
    "2",
    "--vocab-size",
    "600",
    "--eval-windows",
    "2",
    "--checkpoint-every",
    "1",
]


def test_heldout_folder_is_not_trained_on():
    train, heldout = train_model.collect_sources()
    assert heldout and train
    assert all("test" not in p.parts[-2:-1] for p in train)
    assert all(p.parent.name == "test" or "test" in p.parts for p in heldout)
    assert not set(train) & set(heldout)


def test_samples_are_deterministic_and_mix_fim(tmp_path: Path):
    train, _ = train_model.collect_sources()
    texts = train_model.read_texts(train[:30])
    tok = train_model.train_tokenizer(texts, 600)
    cfg = train_model.TrainConfig(seq_len=64)
    b = train_model.SampleBuilder(tok, texts, cfg)
    assert b.row(3, 1) == b.row(3, 1)
    assert len(b.row(0, 0)) == 65
    fim_prefix = tok.token_to_id(train_model.FIM_PREFIX)
    rows = [b.row(s, i) for s in range(10) for i in range(4)]
    with_fim = sum(fim_prefix in r for r in rows)
    assert 0 < with_fim < len(rows)


def test_train_resume_and_export(tmp_path: Path, capsys):
    out = tmp_path / "run"
    assert train_model.main(["--out", str(out), "--steps", "2", *TINY]) == 0
    assert (out / "checkpoint.pt").exists()
    export = tmp_path / "export"
    assert (
        train_model.main(
            ["--out", str(out), "--steps", "3", "--resume", "--export", str(export), *TINY]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "resumed at step 2" in printed
    assert "held-out (stdlib test/): loss" in printed
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (export / name).exists()
    engine = Engine(export, runner="hf")
    _text, stats = engine.generate(engine.encode("def f():\n"), GenParams(max_tokens=3))
    assert stats.tokens >= 1


def test_copy_samples_use_the_edit_prompt_layout():
    """A fine-tuning sample in the edit layout: the prefix ends with the region's draft
    (the region itself, or edited), the middle is the region; copy_rate 0 draws nothing
    extra, so the shipped model's sample stream is unchanged."""
    import random

    train, _ = train_model.collect_sources()
    texts = train_model.read_texts(train[:30])
    tok = train_model.train_tokenizer(texts, 600)
    b = train_model.SampleBuilder(tok, texts, train_model.TrainConfig(seq_len=64))
    base = [b.row(s, 0) for s in range(5)]
    c = train_model.SampleBuilder(tok, texts, train_model.TrainConfig(seq_len=64, copy_rate=0.0))
    assert [c.row(s, 0) for s in range(5)] == base
    ids = {k: tok.token_to_id(k) for k in train_model.SPECIAL_TOKENS}
    text = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(10))
    wide = train_model.SampleBuilder(tok, texts, train_model.TrainConfig(seq_len=1024))
    for edited in (False, True):
        sample = wide._copy(random.Random(3), text, edited=edited)
        pre = sample[1 : sample.index(ids[train_model.FIM_SUFFIX])]
        mid = sample[sample.index(ids[train_model.FIM_MIDDLE]) + 1 : -1]
        assert sample[0] == ids[train_model.FIM_PREFIX] and sample[-1] == ids[train_model.EOT]
        region = tok.decode(mid)
        assert region and region in text
        if not edited:
            assert tok.decode(pre).endswith(region)  # the draft is the region itself
    # Sized like the daemon's prompt: a long file still yields a sample that fits a row,
    # so packing never cuts off the middle (the part that teaches copying).
    long_text = text * 40
    for seed in range(20):
        sample = wide._copy(random.Random(seed), long_text)
        assert len(sample) <= 1024 and ids[train_model.FIM_MIDDLE] in sample
        suffix = sample.index(ids[train_model.FIM_SUFFIX])
        assert sample.index(ids[train_model.FIM_MIDDLE]) - suffix - 1 <= train_model.SUFFIX_TOKENS


def test_fine_tune_from_an_export_reports_copy_accuracy(tmp_path: Path, capsys):
    out, export = tmp_path / "run", tmp_path / "export"
    assert (
        train_model.main(["--out", str(out), "--steps", "1", "--export", str(export), *TINY]) == 0
    )
    tuned = tmp_path / "tuned"
    args = ["--out", str(tmp_path / "ft"), "--steps", "1", "--export", str(tuned), *TINY]
    assert train_model.main([*args, "--init-from", str(export), "--copy-rate", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "copy top-1 before fine-tuning" in printed
    import json

    metrics = json.loads((tuned / "training.json").read_text())
    assert set(metrics["heldout_copy_top1"]) == {"exact", "edited", "repeat"}
    assert (tuned / "tokenizer.json").read_bytes() == (export / "tokenizer.json").read_bytes()


def test_repeat_samples_write_a_piece_several_times():
    """--repeat-rate samples: code before a piece, then the piece 2-4 times; the held-out
    probe's start index is the token before the second copy (what copying predicts)."""
    import random

    train, _ = train_model.collect_sources()
    texts = train_model.read_texts(train[:30])
    tok = train_model.train_tokenizer(texts, 600)
    b = train_model.SampleBuilder(tok, texts, train_model.TrainConfig(seq_len=1024))
    for seed in range(10):
        lead, piece, times = b._repeat_parts(random.Random(seed), texts[seed])
        sample = b._repeat(random.Random(seed), texts[seed])
        assert 2 <= times <= 4 and 1 <= len(piece) <= 160 and len(lead) <= 200
        assert sample == [*lead, *piece * times, tok.token_to_id(train_model.EOT)]
    for ids, start in train_model.repeat_samples(b, texts, 5, seed=1):
        n = next(
            n
            for n in range(16, 161)
            if ids[start + 1 : start + 1 + n] == ids[start + 1 - n : start + 1]
        )
        assert n >= 16  # the tokens after start repeat the ones just before
