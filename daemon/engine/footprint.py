"""What a lean runner's forward reads: its weights as it holds them and its KV cache.

Owns the byte counts the benchmarks set against memory bandwidth and ``stats`` reports:
:func:`param_bytes` (every weight once: fp32 or 16-bit panels, GGUF blocks, the tied
embedding counted once as the LM head) and :func:`kv_bytes` (K and V over the cached
positions, as the cache stores them); and the multiply-adds a token's products take
(:func:`product_macs`), which the benchmarks set against the CPU's dot product rate.
Must not touch: the runner's state.
"""

from __future__ import annotations

from typing import Any

import torch

from codespec.daemon.engine import qstack

__all__ = ["distinct_weights", "flat_weights", "kv_bytes", "param_bytes", "product_macs"]


def flat_weights(obj: Any) -> list[Any]:
    """Every matrix or vector in nested lists, tuples and dicts of them (None left out)."""
    if isinstance(obj, dict):
        return [w for v in obj.values() for w in flat_weights(v)]
    if isinstance(obj, list | tuple):
        return [w for v in obj for w in flat_weights(v)]
    return [] if obj is None else [obj]


def distinct_weights(obj: Any) -> list[Any]:
    """:func:`flat_weights`, each weight once: a tensor by its storage (the tied embedding
    is the LM head), a matrix object by identity."""
    seen: set[int] = set()
    out = []
    for t in flat_weights(obj):
        key = t.data_ptr() if isinstance(t, torch.Tensor) else id(t)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def param_bytes(runner: Any) -> int:
    """Bytes of weights one forward reads (the tied embedding counted once, as the LM head;
    GGUF blocks as stored)."""
    return sum(
        t.numel() * t.element_size() if isinstance(t, torch.Tensor) else int(t.nbytes)
        for t in distinct_weights([runner.lm_head_t, runner.norm, runner.layers])
    )  # a QuantMatrix, or any matrix object, knows its bytes


def kv_bytes(runner: Any, tokens: int) -> int:
    """Bytes of K and V that attention reads over ``tokens`` cached positions."""
    if runner.stack is not None:  # 16-bit K tiles and V rows of Dp (fp16 or bf16)
        d = runner.head_dim + qstack.head_dim_padded(runner.head_dim)
        return runner.num_layers * runner.n_kv * d * 2 * tokens
    per_token = runner.num_layers * 2 * runner.n_kv * runner.head_dim * runner.kv.element_size()
    return per_token * tokens


def product_macs(runner: Any) -> int:
    """Multiply-adds of one token's matrix products: every matrix of the layers and the LM
    head once (rows x columns; norms and biases left out, attention too: it grows with the
    context and is not a weight product)."""
    return sum(
        (t.numel() if t.dim() >= 2 else 0) if isinstance(t, torch.Tensor) else int(t.n) * int(t.k)
        for t in distinct_weights([runner.lm_head_t, runner.layers])
    )  # panels are 3-D; a QuantMatrix, or another matrix object, knows its (n, k)
