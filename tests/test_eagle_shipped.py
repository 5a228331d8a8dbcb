"""The EAGLE-3 head shipped for the default model: found by the model's exact weights,
loaded with it, its speculators files round-tripped, its drafts accepted and lossless.

The matching rules on fake folders; the shipped head itself against the real default
model (SmolLM2-135M-Instruct from its GGUF).
"""

from __future__ import annotations

import json

import pytest
import torch

from codespec.daemon.engine.engine import GenParams
from codespec.speculators.eagle import EagleProposer, LoadedHeads, head_dir, load_runtime
from codespec.speculators.eagle_head import load_head, save_head
from codespec.speculators.heads import HEADS_DIR, MANIFEST, index, packaged_head
from codespec.speculators.weights import weights, weights_summary
from conftest import heldout_prompts

SHA = "ab" * 32


def fake_heads(root, sha=SHA, files=("config.json", "model.safetensors")):
    folder = root / "h1"
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_text("{}")
    entry = {"folder": "h1", "gguf_sha256": [sha]}
    (root / "index.json").write_text(json.dumps({"heads": [entry]}))
    return folder


def fake_model(root, sha=SHA):
    root.mkdir(parents=True)
    (root / MANIFEST).write_text(json.dumps({"name": "m", "sha256": sha, "files": []}))
    return root


def test_a_shipped_head_fits_only_the_weights_it_was_trained_on(tmp_path):
    heads = tmp_path / "heads"
    folder = fake_heads(heads)
    assert packaged_head(fake_model(tmp_path / "m"), heads) == folder
    assert packaged_head(fake_model(tmp_path / "other", sha="cd" * 32), heads) is None
    (tmp_path / "plain").mkdir()  # a folder with no manifest (a user's HF checkpoint)
    assert packaged_head(tmp_path / "plain", heads) is None
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / MANIFEST).write_text("not json")
    assert packaged_head(tmp_path / "broken", heads) is None
    assert index(tmp_path / "nowhere") == []
    from codespec.daemon.engine import models

    assert models.MANIFEST == MANIFEST  # the name this module reads is the one written


def test_a_shipped_head_missing_its_weights_is_not_offered(tmp_path):
    heads = tmp_path / "heads"
    fake_heads(heads, files=("config.json",))
    assert packaged_head(fake_model(tmp_path / "m"), heads) is None


def test_a_head_put_beside_the_model_wins_over_the_shipped_one(default_model_dir, tmp_path):
    """``MODEL/eagle`` (a head trained here) is the model's head; without it, the shipped
    one for the default model's GGUF; a model folder of other weights has neither."""
    assert head_dir(default_model_dir) == HEADS_DIR / "smollm2-135m-instruct"
    model = tmp_path / "model"
    model.mkdir()
    (model / MANIFEST).write_text((default_model_dir / MANIFEST).read_text())
    assert head_dir(model) == HEADS_DIR / "smollm2-135m-instruct"
    (model / "eagle").mkdir()
    (model / "eagle" / "config.json").write_text("{}")
    assert head_dir(model) == model / "eagle"
    assert head_dir(tmp_path) == tmp_path / "eagle"


def test_the_shipped_head_is_small_and_round_trips(real_engine, tmp_path):
    """At most 15 MB; vLLM's speculators EAGLE-3 layout, read and written back unchanged;
    made for this model (vocabulary, width, taps inside its layers)."""
    from safetensors.torch import load_file

    folder = head_dir(real_engine.model_path)
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size <= 15 * 2**20, size
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["transformer_layer_config"]["vocab_size"] == real_engine.vocab_size
    assert cfg["transformer_layer_config"]["hidden_size"] == real_engine.hidden_size
    assert max(cfg["eagle_aux_hidden_state_layer_ids"]) <= real_engine.num_layers
    embed = real_engine.embedding().float()
    head = load_head(folder, embed)
    save_head(head, tmp_path / "again")  # fp16, as shipped
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == cfg
    a = load_file(str(folder / "model.safetensors"))
    b = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert weights(real_engine)["eagle"] == folder
    assert weights_summary(real_engine)["eagle"] == f"weights in {folder}"


def test_the_default_model_drafts_with_its_shipped_head(real_engine, one_thread):
    """Loaded with the default model; chain and tree drafts on held-out code are accepted
    (a head that learnt nothing would see almost none) and the output is plain decoding's."""
    rt = load_runtime(real_engine)
    assert rt.path == HEADS_DIR / "smollm2-135m-instruct"
    params = GenParams(max_tokens=24, max_draft=8)
    for topk in (1, 3):
        steps = accepted = 0
        for prompt in heldout_prompts(real_engine, 2, tokens=160, seed=21 + topk):
            real_engine.reset_cache()
            plain, _ = real_engine.generate(prompt, params)
            prop = EagleProposer(rt, depth=4, topk=topk, max_nodes=8)
            text, stats = real_engine.generate(prompt, params, prop)
            assert text == plain
            assert stats.drafted.get("eagle", 0) > 0
            steps += stats.decode_steps
            accepted += stats.accepted.get("eagle", 0)
        # trained: ~0.5 accepted tokens a step on held-out code; a random head ~0
        assert accepted >= 0.15 * steps, (topk, accepted, steps)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_the_real_index_names_existing_files(missing):
    entry = next(h for h in index() if h["folder"] == "smollm2-135m-instruct")
    assert (HEADS_DIR / entry["folder"] / missing).is_file()
    assert len(entry["gguf_sha256"][0]) == 64


def test_the_daemon_loads_the_head_before_the_first_request(real_engine, tmp_path):
    """A daemon on the default model builds auto's proposers at start: the shipped head's
    runner is loaded before any completion asks for it. (What earlier tests taught the
    policy on this engine is forgotten first, as a new daemon starts: a head they retired
    is not built.)"""
    from codespec.speculators.book import forget
    from conftest import ServerThread, daemon_config

    forget(real_engine)
    real_engine.speculator_state.drop(LoadedHeads)
    server = ServerThread(daemon_config(tmp_path), real_engine)
    try:
        loaded = real_engine.speculator_state.find(LoadedHeads) or {}
        assert [rt.path for rt in loaded.values()] == [HEADS_DIR / "smollm2-135m-instruct"]
    finally:
        server.stop()


def test_the_first_completion_after_open_reuses_the_warm_up_with_the_heads_taps(
    real_engine, tmp_path
):
    """On the default model auto's proposers read the target's taps (the shipped head):
    the daemon's warm-up after an open keeps them, so the first completion re-feeds ~1
    token. (Before, the warm-up kept no taps and that completion re-fed the whole prompt:
    780 ms against off's 344 in ``codespec bench latency``.)"""
    from codespec.daemon.client import Client
    from codespec.speculators.book import forget
    from conftest import ServerThread, daemon_config
    from helpers import wait_warmed

    forget(real_engine)  # a head earlier tests retired is built again, as in a new daemon
    server = ServerThread(daemon_config(tmp_path), real_engine)
    try:
        (runtime,) = real_engine.speculator_state.get(LoadedHeads).values()
        assert real_engine.warm_taps == tuple(runtime.runner.cfg.taps)
        text = "import os\n\n\ndef walk(root):\n" + "    x = os.path.join(root, 'a')\n" * 12
        with Client(server.socket_path) as c:
            before = c.request("stats")["requests"]["warmed"]
            c.request("open", {"uri": "file:///w.py", "text": text, "version": 1})
            wait_warmed(c, before + 1, "the open")
            end = {"line": 16, "character": 0}
            r = c.request(
                "complete",
                {"uri": "file:///w.py", "position": end, "max_tokens": 2, "speculation": "auto"},
            )
            assert r["stats"]["prompt_tokens"] - r["stats"]["cached_tokens"] <= 1
    finally:
        server.stop()
        real_engine.reset_cache()


def test_a_proposer_that_fails_to_load_does_not_stop_the_daemon(engine, tmp_path, monkeypatch):
    """Whatever building the default method's proposers raises at start is logged; the
    daemon starts and answers."""
    from codespec.daemon.client import Client
    from codespec.speculators import registry
    from conftest import ServerThread, daemon_config

    def broken(*args, **kwargs):
        raise RuntimeError("a head that cannot be read")

    monkeypatch.setattr(registry, "make_proposer", broken)
    server = ServerThread(daemon_config(tmp_path), engine)
    try:
        with Client(server.socket_path) as c:
            assert c.request("stats")["model"]
    finally:
        server.stop()
