"""Small GGUF files written by the tests themselves (``gguf.GGUFWriter``): random weights,
a byte-level BPE tokenizer trained on the spot, the llama or qwen2 layout, any tensor type
the ``gguf`` library can quantize."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n\tdef __init__(self, x, y):\r\n\t\tself.x = x\r\n",
    "# café 中文 🚀 naïve\nprint('héllo, 世界')\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "import os\nimport sys\n\nfrom json import loads\n",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<file_sep>"]


def bpe_tokens(vocab: int = 400) -> tuple[list[str], list[str]]:
    """``(tokens, merges)`` of a byte-level BPE trained on :data:`CORPUS`, specials first."""
    from codespec.daemon.training.train_data import train_tokenizer

    tok = train_tokenizer(CORPUS * 20, vocab, specials=SPECIALS)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def write_gguf(
    path: Path,
    arch: str = "llama",
    qtype: str = "F32",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    seed: int = 0,
    extra_tensor: tuple[str, np.ndarray] | None = None,
    mix: dict[str, str] | None = None,
) -> Path:
    """A random model of ``arch`` (``llama``, ``qwen2`` or anything else, to be refused)
    whose block matrices are ``qtype`` (the embedding too, when it is a quantized type);
    norms (and qwen2's q/k/v biases) stay F32. Sizes are multiples of 32 so every block
    type fits. ``mix``: other block types by tensor kind (``attn_v``, ``ffn_down``,
    ``token_embd``, ...; ``output``: a separate LM head, which the file otherwise lacks),
    as llama.cpp's mixes (Q4_K_M) have them."""
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(seed)
    tokens, merges = bpe_tokens()
    vocab = len(tokens)
    vocab += (-vocab) % 32
    tokens += [f"<unused{i}>" for i in range(vocab - len(tokens))]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")
    w.add_token_list(tokens)
    types = [3 if t in SPECIALS else (5 if t.startswith("<unused") else 1) for t in tokens]
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    kinds = mix or {}

    def mat(name: str, rows: int, cols: int) -> None:
        data = (rng.standard_normal((rows, cols)) * 0.08).astype(np.float32)
        qt = T[kinds.get(name.split(".")[-2], qtype)]
        if qt == T.F32:
            w.add_tensor(name, data)
        elif qt == T.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qt), raw_dtype=qt)

    def vec(name: str, n: int, scale: float = 0.1, base: float = 1.0) -> None:
        w.add_tensor(name, (base + rng.standard_normal(n) * scale).astype(np.float32))

    d = hidden // heads
    mat("token_embd.weight", vocab, hidden)
    vec("output_norm.weight", hidden)
    if "output" in kinds:
        mat("output.weight", vocab, hidden)
    for i in range(layers):
        b = f"blk.{i}."
        vec(b + "attn_norm.weight", hidden)
        vec(b + "ffn_norm.weight", hidden)
        mat(b + "attn_q.weight", heads * d, hidden)
        mat(b + "attn_k.weight", kv_heads * d, hidden)
        mat(b + "attn_v.weight", kv_heads * d, hidden)
        mat(b + "attn_output.weight", hidden, heads * d)
        mat(b + "ffn_gate.weight", ffn, hidden)
        mat(b + "ffn_up.weight", ffn, hidden)
        mat(b + "ffn_down.weight", hidden, ffn)
        if arch == "qwen2":
            vec(b + "attn_q.bias", heads * d, 0.05, 0.0)
            vec(b + "attn_k.bias", kv_heads * d, 0.05, 0.0)
            vec(b + "attn_v.bias", kv_heads * d, 0.05, 0.0)
    if extra_tensor is not None:
        w.add_tensor(*extra_tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
