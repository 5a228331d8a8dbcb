"""LeanRunner against HFRunner, the reference: same logits, same taps, same cache verbs.

Tiny random-initialised models (biases and norm weights randomised too, so a
dropped bias or a swapped norm shows), fp32 on the CPU. Each scenario drives
both runners through the same calls and compares every forward's logits.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from codespec.daemon.engine import cpu_gemm
from codespec.daemon.engine.lean import LeanRunner
from codespec.daemon.engine.lean_config import supports
from codespec.daemon.engine.runner import HFRunner

ATOL = 1e-4
# The C++ stack keeps K and V in fp16 (relative rounding 2^-11): logits move ~1e-4
STACK_ATOL = 1e-3
VOCAB = 96
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,  # GQA, 3 query heads per kv head
    max_position_embeddings=128,
)


pytestmark = pytest.mark.usefixtures("one_thread")


def _randomise(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def _llama_untied() -> torch.nn.Module:
    return LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False, rope_theta=500.0))


def _llama_tied() -> torch.nn.Module:
    return LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=True))


def _qwen2() -> torch.nn.Module:
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True))


def _mistral() -> torch.nn.Module:
    return MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=None))


MODELS = {
    "llama-untied": _llama_untied,
    "llama-tied": _llama_tied,
    "qwen2-bias": _qwen2,
    "mistral": _mistral,
}


NO_KERNEL = pytest.mark.skipif(
    cpu_gemm.library() is None,
    reason=f"the CPU kernel is unavailable: {cpu_gemm.unavailable_reason()}",
)
PAIRS = [
    pytest.param((m, k), id=f"{m}-{k}", marks=[NO_KERNEL] if k == "cpu_gemm" else [])
    for m in MODELS
    for k in ("cpu_gemm", "torch")
]


@pytest.fixture(params=PAIRS)
def pair(request, tmp_path) -> tuple[LeanRunner, HFRunner]:
    """(lean loaded from a saved checkpoint folder, HF reference) over the same weights.

    Each model runs twice where the CPU kernel builds: on ``cpu_gemm`` products and
    on torch's."""
    name, kernels = request.param
    torch.manual_seed(0)
    model = _randomise(MODELS[name]())
    model.save_pretrained(tmp_path)
    lean = LeanRunner.from_pretrained(tmp_path, kernels=kernels == "cpu_gemm")
    assert lean.dtype == torch.float32
    assert lean.kernels == (kernels == "cpu_gemm")
    return lean, HFRunner(model)


def _atol(lean: LeanRunner) -> float:
    return ATOL if lean.stack is None else STACK_ATOL


def _close(lean: LeanRunner, hf: HFRunner, ids, parents=None) -> None:
    a = lean.forward(ids, parents).logits
    b = hf.forward(ids, parents).logits
    assert a.shape == b.shape == (len(ids), VOCAB)
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, b, atol=_atol(lean), rtol=0)
    assert lean.length == hf.length


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def test_prefill_then_decode_steps(pair) -> None:
    """Prefill 11 tokens, then 4 single-token decode steps: logits equal at every step."""
    lean, hf = pair
    _close(lean, hf, _ids(11, 1))
    for tok in _ids(4, 2):
        _close(lean, hf, [tok])
    assert lean.length == 15


def test_chain_after_cache(pair) -> None:
    """A 6-token chain appended to a cache (verification): not SDPA's top-left is_causal."""
    lean, hf = pair
    _close(lean, hf, _ids(9, 3))
    _close(lean, hf, _ids(6, 4))


def test_truncate_then_reforward(pair) -> None:
    """Roll back 5 tokens (a rejected draft) and feed different ones: the old rows are gone."""
    lean, hf = pair
    _close(lean, hf, _ids(12, 5))
    _close(lean, hf, _ids(5, 6))
    lean.truncate(13)
    hf.truncate(13)
    _close(lean, hf, _ids(3, 7))
    _close(lean, hf, [7])
    lean.truncate(0)
    hf.truncate(0)
    _close(lean, hf, _ids(4, 8))


def test_tree_siblings_and_keep_non_prefix_path(pair) -> None:
    """Tree with sibling branches; keep the path 0 -> 2 -> 5 (not a prefix); decode on.

    Tree (indices):  -1 -> 0 -> {1, 2};  1 -> 3;  2 -> {4, 5};  -1 -> 6 (second root).
    """
    lean, hf = pair
    _close(lean, hf, _ids(10, 9))
    parents = [-1, 0, 0, 1, 2, 2, -1]
    _close(lean, hf, _ids(7, 10), parents)
    lean.keep([0, 2, 5])
    hf.keep([0, 2, 5])
    assert lean.length == hf.length == 13
    _close(lean, hf, [3])
    _close(lean, hf, _ids(3, 11))  # and a chain after the compacted path


def test_two_token_forwards(pair) -> None:
    """Two-token chains and two sibling roots (the runner's small-forward attention path)."""
    lean, hf = pair
    _close(lean, hf, _ids(9, 21))
    _close(lean, hf, _ids(2, 22))  # a chain
    _close(lean, hf, _ids(2, 23), [-1, -1])  # siblings: the second must not see the first
    lean.keep([1])
    hf.keep([1])
    _close(lean, hf, _ids(2, 24), [-1, 0])
    _close(lean, hf, [5])


def test_keep_prefix_path(pair) -> None:
    """keep() of a prefix of a chain only moves the length."""
    lean, hf = pair
    _close(lean, hf, _ids(5, 12))
    _close(lean, hf, _ids(4, 13))
    lean.keep([0, 1])
    hf.keep([0, 1])
    assert lean.length == 7
    _close(lean, hf, [1])


def test_chunked_prefill_matches(pair) -> None:
    """A prefill longer than the chunk size, fed in chunks, equals one HF forward."""
    lean, hf = pair
    lean.chunk = 8
    _close(lean, hf, _ids(21, 14))
    _close(lean, hf, _ids(9, 15))  # a chain longer than a chunk after a cache


def test_taps_equal_hf_hidden_states(pair) -> None:
    """Taps 0..L equal the HF runner's; tap L is the last layer's output before the final norm."""
    lean, hf = pair
    layers = lean.num_layers
    taps = (0, 1, layers)
    ids = _ids(7, 16)
    a = lean.forward(ids, taps=taps)
    b = hf.forward(ids, taps=taps)
    assert a.hidden is not None and b.hidden is not None
    assert a.hidden.shape == (7, 3, lean.hidden_size)
    torch.testing.assert_close(a.hidden, b.hidden, atol=_atol(lean), rtol=0)
    # the final norm of tap L gives the rows the LM head reads
    normed = torch.nn.functional.rms_norm(a.hidden[:, 2], (lean.hidden_size,), lean.norm, lean.eps)
    torch.testing.assert_close(lean.project(normed), a.logits, atol=_atol(lean), rtol=0)
    # tree forward with taps: same positions and masks for the hidden states
    parents = [-1, 0, 0]
    a = lean.forward(_ids(3, 17), parents, taps=(1,))
    b = hf.forward(_ids(3, 17), parents, taps=(1,))
    torch.testing.assert_close(a.hidden, b.hidden, atol=_atol(lean), rtol=0)
    torch.testing.assert_close(a.logits, b.logits, atol=_atol(lean), rtol=0)


def test_last_only_returns_the_last_row(pair) -> None:
    """A prefill asked for its last row only gives that row, in chunks too."""
    lean, hf = pair
    lean.chunk = 32  # smaller chunks so that 100 tokens go through the chunked path
    for n in (5, 100):
        ids = _ids(n, 23)
        full = lean.forward(ids).logits
        lean.reset()
        last = lean.forward(ids, last_only=True).logits
        lean.reset()
        assert last.shape == (1, full.shape[1])
        torch.testing.assert_close(last, full[-1:], atol=_atol(lean), rtol=0)
        ref = hf.forward(ids, last_only=True).logits
        hf.reset()
        torch.testing.assert_close(ref, full[-1:], atol=_atol(lean), rtol=0)


@NO_KERNEL
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_panels_give_the_same_logits_for_a_16_bit_checkpoint(tmp_path, dtype) -> None:
    """Weights saved in fp16 or bf16 are held as panels of that type by half_panels():
    half the bytes, and prefill, decode and tree logits equal the fp32 panels' bit for
    bit. A checkpoint whose weights neither type holds keeps fp32 panels."""
    torch.manual_seed(3)
    model = _randomise(_llama_untied())
    with torch.no_grad():  # an LM head beyond fp16's range: only bf16 holds it
        model.lm_head.weight.mul_(2.0**22 if dtype == torch.bfloat16 else 1.0)
    model.to(dtype).save_pretrained(tmp_path)
    full = LeanRunner.from_pretrained(tmp_path, kernels=True)
    half = LeanRunner.from_pretrained(tmp_path, kernels=True)
    assert half.half_panels() > 0
    assert half.lm_head_t.dtype == dtype
    assert half.layers[0][1].dtype in (torch.float16, torch.bfloat16)
    for ids, parents in ((_ids(40, 1), None), (_ids(1, 2), None), (_ids(5, 3), [-1, 0, 0, 1, 2])):
        assert torch.equal(half.forward(ids, parents).logits, full.forward(ids, parents).logits)
    rough = LeanRunner.from_hf_model(_randomise(_llama_untied()), kernels=True)  # fp32 weights
    assert rough.half_panels() == 0
    assert LeanRunner.from_pretrained(tmp_path, kernels=False).half_panels() == 0


def test_from_hf_model_and_long_positions() -> None:
    """from_hf_model copies an in-memory model; positions past max_position_embeddings work."""
    torch.manual_seed(1)
    model = _randomise(_llama_untied())
    lean = LeanRunner.from_hf_model(model, max_length=200)
    hf = HFRunner(model, max_length=200)
    _close(lean, hf, _ids(150, 18))  # beyond max_position_embeddings = 128
    _close(lean, hf, _ids(8, 19), [-1, 0, 1, 1, -1, 4, 5, 5])
    lean.keep([4, 5, 7])
    hf.keep([4, 5, 7])
    _close(lean, hf, [5])


def test_limits_and_bad_calls() -> None:
    """Overflowing max_length, empty forwards, bad keep() and truncate() raise."""
    torch.manual_seed(2)
    lean = LeanRunner.from_hf_model(_randomise(_llama_tied()), max_length=16)
    with pytest.raises(ValueError):
        lean.forward([])
    lean.forward(_ids(10, 20))
    with pytest.raises(ValueError):
        lean.forward(_ids(7, 21))
    assert lean.length == 10
    lean.forward(_ids(3, 22), [-1, 0, 0])
    with pytest.raises(ValueError):
        lean.keep([2, 1])
    with pytest.raises(ValueError):
        lean.keep([3])
    with pytest.raises(ValueError):
        lean.truncate(14)
    lean.reset()
    assert lean.length == 0


def test_supports() -> None:
    """Plain RoPE Llama/Qwen2/Mistral yes; scaled RoPE, Qwen2 sliding window, others no."""
    assert supports(LlamaConfig(**SHAPE))
    assert supports(Qwen2Config(**SHAPE))
    assert supports(MistralConfig(**SHAPE))
    scaled = LlamaConfig(**SHAPE)
    scaled.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    assert not supports(scaled)
    assert not supports(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=64))
    gelu = LlamaConfig(**SHAPE, hidden_act="gelu")
    assert not supports(gelu)
    from transformers import GPT2Config

    assert not supports(GPT2Config())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_matches_hf() -> None:
    """On CUDA (bf16, SDPA) the lean runner tracks HF in bf16 within bf16 noise."""
    torch.manual_seed(3)
    model = _randomise(_qwen2()).to("cuda", torch.bfloat16)
    lean = LeanRunner.from_hf_model(model)
    hf = HFRunner(model)
    assert lean.dtype == torch.bfloat16
    for ids, parents in ((_ids(20, 23), None), ([4], None), (_ids(5, 24), [-1, 0, 0, 2, -1])):
        a = lean.forward(ids, parents).logits
        b = hf.forward(ids, parents).logits
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)
