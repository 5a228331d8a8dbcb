"""The lean runner's forward in torch: what it runs without the C++ stack.

The path ``LeanRunner`` takes with ``kernels=False``, on CUDA, under ``torch.compile``, or
where the stack cannot be built (see ``lean.py``'s docstring for the layout and masks):
SDPA with an explicit float mask for more than one token, ``cpu_gemm``'s attention for
at most :data:`KERNEL_ATTENTION_ROWS` tokens when its kernel exists; products through
``cpu_gemm.linear`` (packed panels or torch's ``addmm``). Functions of the runner's
weights and cache; they advance nothing but the runner's length.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from codespec.daemon.engine import cpu_gemm
from codespec.daemon.engine.runner import ForwardOut

# Forwards of at most this many tokens take cpu_gemm's attention (with the kernels on):
# faster than SDPA for one token, about even for two, slower from four on (the kernel
# does not tile queries), over short and long caches alike.
KERNEL_ATTENTION_ROWS = 2


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint folder, on the CPU."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        shards = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors (or index) in {path}")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(path / shard)))
    return state


def load_state(runner: Any, state: dict[str, torch.Tensor], tied: bool) -> tuple[Any, ...]:
    """``(embed, lm_head_t, norm, layers)`` of a checkpoint's tensors on the runner's device
    and dtype: q/k/v and gate/up fused, matrices ``(in, out)``; biases wherever the
    checkpoint has them. A layer: ``(ln1, wqkv, bqkv, wo, bo, ln2, wgu, bgu, wd, bd)``."""

    def get(name: str) -> torch.Tensor:
        return state[name].to(device=runner.device, dtype=runner.dtype).contiguous()

    def opt(name: str) -> torch.Tensor | None:
        return get(name) if name in state else None

    def cat_opt(names: list[str], sizes: list[int]) -> torch.Tensor | None:
        if not any(n in state for n in names):
            return None
        parts = [
            get(n) if n in state else torch.zeros(s, device=runner.device, dtype=runner.dtype)
            for n, s in zip(names, sizes, strict=True)
        ]
        return torch.cat(parts)

    def t(w: torch.Tensor) -> torch.Tensor:  # (out, in) -> (in, out), see the docstring
        return w.t().contiguous()

    d = runner.head_dim
    embed = get("model.embed_tokens.weight")  # (V, H)
    if tied:
        head = embed
    elif "lm_head.weight" in state:
        head = get("lm_head.weight")
    else:
        raise KeyError("lm_head.weight missing and tie_word_embeddings is false")
    # The tied head is a (H, V) copy on the CPU (the fast layout there), a view on CUDA.
    lm_head_t = head.t() if runner.device.type == "cuda" and tied else t(head)  # (H, V)
    norm = get("model.norm.weight")
    q_out, kv_out = runner.n_heads * d, runner.n_kv * d
    layers = []
    for i in range(runner.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv_names = [a + "q_proj", a + "k_proj", a + "v_proj"]
        wqkv = t(torch.cat([get(n + ".weight") for n in qkv_names]))  # (H, Q+2K)
        bqkv = cat_opt([n + ".bias" for n in qkv_names], [q_out, kv_out, kv_out])
        gu_names = [m + "gate_proj", m + "up_proj"]
        wgu = t(torch.cat([get(n + ".weight") for n in gu_names]))  # (H, 2I)
        bgu = cat_opt([n + ".bias" for n in gu_names], [runner.inter, runner.inter])
        layers.append(
            (
                get(f"model.layers.{i}.input_layernorm.weight"),
                wqkv,
                bqkv,
                t(get(a + "o_proj.weight")),  # (NH*D, H)
                opt(a + "o_proj.bias"),
                get(f"model.layers.{i}.post_attention_layernorm.weight"),
                wgu,
                bgu,
                t(get(m + "down_proj.weight")),  # (I, H)
                opt(m + "down_proj.bias"),
            )
        )
    return embed, lm_head_t, norm, layers


def forward_chunk(
    runner: Any,
    ids: list[int],
    depth: list[int] | None,
    anc: torch.Tensor | None,
    taps: tuple[int, ...],
    rows: str = "all",
) -> ForwardOut:
    """Append ``ids`` (a chain when ``anc`` is None) after the cache; advance ``length``.
    ``rows``: which rows get logits, ``all``, ``last`` or ``none``."""
    n, past = len(ids), runner._len
    total = past + n
    x = F.embedding(torch.tensor(ids, device=runner.device), runner.embed)  # (T, H)
    if anc is None:
        cos, sin = runner.cos[past:total], runner.sin[past:total]  # (T, D)
    else:
        pos = torch.tensor(depth, device=runner.device) + past
        cos, sin = runner.cos[pos], runner.sin[pos]
    mask = None
    if n > 1:
        if anc is None:  # chain after the cache: key s visible to query t iff s <= past + t
            allowed = runner._arange[:total][None, :] <= runner._arange[past:total][:, None]
        else:
            allowed = torch.ones((n, total), dtype=torch.bool, device=runner.device)
            allowed[:, past:] = anc.to(runner.device)
        m = torch.zeros((n, total), dtype=runner.dtype, device=runner.device)
        m.masked_fill_(~allowed, float("-inf"))
        # rows of the grouped query are (t, g) pairs, t-major: repeat each row g times
        mask = m[:, None, :].expand(n, runner.group, total).reshape(n * runner.group, total)
    hidden = None
    if taps:
        hidden = torch.empty(
            (n, len(taps), runner.hidden_size), dtype=torch.float32, device=runner.device
        )
    x = runner._layers_fn(x, cos[:, None, :], sin[:, None, :], mask, anc, past, taps, hidden)
    if rows == "last":
        x = x[-1:]
    elif rows == "none":
        x = x[:0]
    logits = runner.project(cpu_gemm.norm(x, runner.norm, runner.eps, runner.kernels))
    runner._len = total
    return ForwardOut(logits=logits.float(), hidden=hidden)


def layers(
    runner: Any,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor | None,
    anc: torch.Tensor | None,
    past: int,
    taps: tuple[int, ...],
    hidden: torch.Tensor | None,
) -> torch.Tensor:
    """The decoder stack over ``x`` (T, H); writes this chunk's K/V and the taps."""
    n = x.shape[0]
    nh, nkv, g, d = runner.n_heads, runner.n_kv, runner.group, runner.head_dim
    total = past + n
    qk_w = (nh + nkv) * d
    slots: list[list[int]] = [[] for _ in range(runner.num_layers + 1)]  # tap l -> columns
    for j, t in enumerate(taps):
        slots[t].append(j)
    for j in slots[0]:
        hidden[:, j] = x
    for i, (ln1, wqkv, bqkv, wo, bo, ln2, wgu, bgu, wd, bd) in enumerate(runner.layers):
        kc, vc = runner.kv[i, 0], runner.kv[i, 1]  # (KV, S_max, D)
        a = cpu_gemm.norm(x, ln1, runner.eps, runner.kernels)
        a = cpu_gemm.linear(a, wqkv, bqkv, None)  # (T, (NH+2KV)*D)
        qk = a[:, :qk_w].view(n, nh + nkv, d)  # (T, NH+KV, D)
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)  # RoPE
        kc[:, past:total] = qk[:, nh:].transpose(0, 1)  # (KV, T, D)
        vc[:, past:total] = a[:, qk_w:].view(n, nkv, d).transpose(0, 1)
        q = qk[:, :nh].reshape(n, nkv, g, d).transpose(0, 1).reshape(1, nkv, n * g, d)
        if n <= KERNEL_ATTENTION_ROWS and runner.kernels:  # K and V read once for all rows
            o = cpu_gemm.attention(q[0], kc, vc, past, n, anc)
        else:
            o = F.scaled_dot_product_attention(
                q, kc[None, :, :total], vc[None, :, :total], attn_mask=mask
            )  # (1, KV, T*G, D)
        o = o.view(nkv, n, g * d).transpose(0, 1).reshape(n, nh * d)  # (T, NH*D)
        x = cpu_gemm.linear(o, wo, bo, x)  # residual fused in
        gu = cpu_gemm.norm(x, ln2, runner.eps, runner.kernels)
        gu = cpu_gemm.linear(gu, wgu, bgu, None)  # (T, 2I)
        gu = F.silu(gu[:, : runner.inter]) * gu[:, runner.inter :]  # (T, I)
        x = cpu_gemm.linear(gu, wd, bd, x)
        for j in slots[i + 1]:
            hidden[:, j] = x
    return x
