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

__all__ = ["flat_weights", "kv_bytes", "param_bytes", "product_macs"]


def flat_weights(obj: Any) -> list[Any]:
    """Every matrix or vector in nested lists, tuples and dicts of them (None left out)."""
    if isinstance(obj, dict):
        return [w for v in obj.values() for w in flat_weights(v)]
    if isinstance(obj, list | tuple):
        return [w for v in obj for w in flat_weights(v)]
    return [] if obj is None else [obj]


def param_bytes(runner: Any) -> int:
    """Bytes of weights one forward reads (the tied embedding counted once, as the LM head;
    GGUF blocks as stored)."""
    seen: set[int] = set()
    total = 0
    for t in flat_weights([runner.lm_head_t, runner.norm, runner.layers]):
        if isinstance(t, torch.Tensor):
            ptr, size = t.data_ptr(), t.numel() * t.element_size()
        else:  # a QuantMatrix, or any matrix object that knows its bytes
            ptr, size = id(t), int(t.nbytes)
        if ptr not in seen:
            seen.add(ptr)
            total += size
    return total


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
    seen: set[int] = set()
    total = 0
    for t in flat_weights([runner.lm_head_t, runner.layers]):
        if isinstance(t, torch.Tensor):
            key, macs = t.data_ptr(), t.numel() if t.dim() >= 2 else 0  # (panels: 3-D)
        else:  # a QuantMatrix or another matrix object that knows its (n, k)
            key, macs = id(t), int(t.n) * int(t.k)
        if key not in seen:
            seen.add(key)
            total += macs
    return total
