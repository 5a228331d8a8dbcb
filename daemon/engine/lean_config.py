"""What the lean runner can run, and the choices it makes at load from the machine.

Owns: :func:`supports` (the architectures :class:`~codespec.daemon.engine.lean.LeanRunner`
computes exactly as Hugging Face does: Llama, Qwen2, Mistral with SiLU MLPs and plain
RoPE), :func:`rope_params` (a config's RoPE, transformers 4.x or 5.x), and what the
environment and the CPU pick: the stack's attention (:func:`attention_for`) and how a
GGUF's blocks are multiplied (:func:`gguf_products`).
Must not touch: weights, the KV cache, forwards (``lean``, ``lean_torch``, ``qstack``);
it reads configs and the environment and returns names.
"""

from __future__ import annotations

import os
from typing import Any

from codespec.daemon.engine import qstack

SUPPORTED_TYPES = ("llama", "qwen2", "mistral")


def rope_params(config: Any) -> tuple[str, float, float]:
    """``(rope_type, rope_theta, partial_rotary_factor)`` from a transformers 4.x or 5.x config."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if "rope_theta" not in params and "rope_type" not in params:
            return "per-layer", 0.0, 1.0  # {layer_type: {...}}: not a plain Llama
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        partial = params.get("partial_rotary_factor", 1.0)
    else:
        scaling = getattr(config, "rope_scaling", None) or {}
        theta = getattr(config, "rope_theta", 10000.0)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        partial = getattr(config, "partial_rotary_factor", 1.0)
    partial = getattr(config, "partial_rotary_factor", partial) or 1.0
    return str(kind), float(theta), float(partial)


def supports(config: Any) -> bool:
    """Whether :class:`~codespec.daemon.engine.lean.LeanRunner` computes exactly what
    Hugging Face computes for ``config``.

    Llama, Qwen2 and Mistral with SiLU MLPs and plain (unscaled, full) RoPE.
    Mistral's sliding window is treated as full attention (equal while the context fits
    the window).
    """
    if getattr(config, "model_type", None) not in SUPPORTED_TYPES:
        return False
    if getattr(config, "hidden_act", "silu") != "silu":
        return False
    kind, _, partial = rope_params(config)
    if kind != "default" or partial != 1.0:
        return False
    if config.model_type == "qwen2" and getattr(config, "use_sliding_window", False):
        return False
    heads, kv = int(config.num_attention_heads), int(config.num_key_value_heads or 0)
    return kv > 0 and heads % kv == 0


def attention_for(int8: bool) -> str:
    """The stack's attention (``qstack.ATTENTION``): ``$CODESPEC_ATTENTION`` (``fp32`` or
    ``bf16``) when set, else ``bf16`` with int8 block products where the CPU has its own
    bf16 dot products (:func:`qstack.native_bf16`), and ``fp32`` otherwise.

    ``bf16`` rounds q, k, v and the softmax weights to bf16 and sums their exact products
    in fp32 in AVX512-BF16's ``vdpbf16ps`` order: that instruction does half the work of
    the fp32 path, whose FMAs bound a verification over a long cache, so such a
    verification takes less time with it. Without it the same numbers come from two
    FMAs a pair and cost more than fp32 (on the AVX2 and the AVX-512 path alike), so
    there it is only had by asking. It is
    for the path that is already inexact (int8 activations); the exact products keep fp32
    attention over fp16, the path tested against transformers."""
    chosen = os.environ.get("CODESPEC_ATTENTION", "").strip().lower()
    if chosen:
        if chosen not in qstack.ATTENTION:
            raise ValueError(f"CODESPEC_ATTENTION is one of {sorted(qstack.ATTENTION)}")
        return chosen
    return "bf16" if int8 and qstack.native_bf16() else "fp32"


def gguf_products() -> str:
    """How a GGUF's blocks are multiplied: ``$CODESPEC_GGUF_PRODUCTS`` (``int8``,
    ``exact`` or ``fp16``) when set, else ``int8`` where the CPU has an integer dot
    product path (AVX2, AVX-512 VNNI) and ``exact`` where it has not.

    ``int8`` rounds each activation row to int8 per 32 inputs, as llama.cpp does: decode
    steps faster than with the exact widening, at the same completion quality
    (``codespec bench quality``). Plain decoding with it is
    the reference every speculative method equals, token for token."""
    from codespec.daemon.engine import quant_gemm

    products = os.environ.get("CODESPEC_GGUF_PRODUCTS", "").strip().lower()
    if products:
        return products
    return "int8" if quant_gemm.i8_available() else "exact"
