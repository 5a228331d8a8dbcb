"""The lean runner: a hand-written forward for the Llama family over a static KV cache.

This module owns :class:`LeanRunner` and :func:`supports`. It loads a Hugging
Face safetensors checkpoint directly (no ``transformers`` model object), fuses
q/k/v and gate/up into one matrix each, preallocates the whole KV cache once and
computes the RoPE tables once. One forward serves prefill, decode and draft-tree
verification; they differ only in how many positions are fed and in the mask.

It keeps the :class:`~codespec.daemon.engine.runner.Runner` contract of ``runner.py``
(cache verbs, ``ForwardOut``, positions and masks from
:func:`~codespec.daemon.engine.runner.tree_layout`) and must not change it: the engine
swaps runners freely and ``HFRunner`` is the reference the tests compare against.
It knows nothing about tokenizers, sampling or proposers.

Architectures (see :func:`supports`): Llama, Qwen2 / Qwen2.5-Coder (q/k/v bias;
any bias present in the checkpoint is used) and Mistral. Mistral's
``sliding_window`` is ignored: the runner always attends to the full cache, which
equals Hugging Face's Mistral only while the context is within the window (4,096
tokens for Mistral-7B-v0.1, no window for later versions). Qwen2 checkpoints with
``use_sliding_window`` set, RoPE scaling of any kind, partial rotary embeddings
or an activation other than SiLU are refused.

Attention layout: grouped-query attention is computed without repeating the
cache. The ``g = heads / kv_heads`` query heads sharing one kv head are folded
into the query-length axis, so SDPA sees queries ``(1, kv_heads, T * g, D)``
against keys ``(1, kv_heads, S, D)``, the cache slice itself. Decode of one token
needs no mask at all (it attends to every cached position); any ``T > 1`` gets an
explicit float mask built once per forward and shared by all layers. A chain
appended after a cache is *not* SDPA's ``is_causal`` (that one is aligned top
left: query t would see keys ``0..t``); it needs key ``s`` visible to query t when
``s <= length + t``, which is what the mask says.

Taps: tap 0 is the embeddings, tap ``l`` the output of decoder layer ``l`` and tap
``L`` (the last layer) its output *before* the final norm, as the contract in
``runner.py`` says. Hugging Face's ``output_hidden_states`` agrees for taps
``0 .. L-1``; its last entry is the output *after* the final norm (checked with
transformers 5.24), so ``HFRunner``'s tap ``L`` is ``norm(LeanRunner's tap L)``.

Long chains (prefill) are fed in chunks of ``chunk`` tokens so that masks stay
small; trees are never chunked.

Weights are stored transposed, ``(in, out)``, and applied as ``x @ W`` (residual
adds fused into ``addmm``): on this CPU (MKL, fp32) a one-row product runs at
~14 GB/s in that layout against ~9 GB/s for ``F.linear`` over ``(out, in)``, the
difference that matters for decode; for 16+ rows both layouts cost the same.

CPU kernel: with fp32 weights on an x86-64 CPU with AVX2 and FMA (``kernels=None``
picks it when it builds, ``False`` keeps torch's products), every weight is
repacked once into ``cpu_gemm`` panels and every product goes through that
kernel. MKL costs about M one-row products for M = 2 .. 8 rows here, the kernel
about one for M <= 4, so verifying a small draft is cheap; and its rows do not
depend on the other rows of a call (``codespec bench runner`` shows lean vs
torch). Every RMSNorm, and the attention of forwards of at most
``KERNEL_ATTENTION_ROWS`` tokens, go through the same library; larger forwards
keep SDPA, so their logits are not bit-equal to decode steps'.

Devices: fp32 on the CPU, bf16 on CUDA (``dtype`` overrides), the same code on
both; CUDA gets SDPA's fused kernels for the explicit masks. ``compile=True``
wraps the decoder stack in ``torch.compile(dynamic=True)`` (no CUDA graphs: the
cache length changes every step). It is off by default because on the CPU it
made decode slower, not faster (torch 2.13 inductor, embedded 4x384 model at
1,300 tokens, one thread: 4.2-4.7 ms eager vs 12-22 ms compiled, steady state).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from codespec.daemon.engine import cpu_gemm
from codespec.daemon.engine.runner import ForwardOut, check_forward, check_keep, tree_layout

SUPPORTED_TYPES = ("llama", "qwen2", "mistral")
# Forwards of at most this many tokens take cpu_gemm's attention (with the kernels on):
# 2x faster than SDPA for one token, about even for two, slower from four on (the
# kernel does not tile queries), measured at 256-4,000 cached tokens.
KERNEL_ATTENTION_ROWS = 2


def _rope_params(config: Any) -> tuple[str, float, float]:
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
    """Whether :class:`LeanRunner` computes exactly what Hugging Face computes for ``config``.

    Llama, Qwen2 and Mistral with SiLU MLPs and plain (unscaled, full) RoPE.
    Mistral's sliding window is treated as full attention (module docstring).
    """
    if getattr(config, "model_type", None) not in SUPPORTED_TYPES:
        return False
    if getattr(config, "hidden_act", "silu") != "silu":
        return False
    kind, _, partial = _rope_params(config)
    if kind != "default" or partial != 1.0:
        return False
    if config.model_type == "qwen2" and getattr(config, "use_sliding_window", False):
        return False
    heads, kv = int(config.num_attention_heads), int(config.num_key_value_heads or 0)
    return kv > 0 and heads % kv == 0


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
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


class LeanRunner:
    """Static-cache runner for the Llama family (the ``Runner`` protocol of ``runner.py``).

    The KV cache is one tensor ``(layers, 2, kv_heads, max_length, head_dim)``:
    ``forward`` writes rows ``length .. length+T`` by slice, ``truncate`` only moves
    ``length``, ``keep`` gathers the kept appended rows down in one op for all
    layers. Build it with :meth:`from_pretrained` or :meth:`from_hf_model`.
    """

    name = "lean"

    def __init__(
        self,
        config: Any,
        state: dict[str, torch.Tensor],
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        max_length: int | None = None,
        chunk: int = 256,
        compile: bool = False,
        kernels: bool | None = None,
    ) -> None:
        if not supports(config):
            raise ValueError(f"the lean runner does not support this config ({config.model_type})")
        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = dtype
        self.config = config
        self.vocab_size = int(config.vocab_size)
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.max_length = int(max_length or getattr(config, "max_position_embeddings", 2048))
        self.chunk = int(chunk)
        self.n_heads = int(config.num_attention_heads)
        self.n_kv = int(config.num_key_value_heads)
        self.group = self.n_heads // self.n_kv
        self.head_dim = int(getattr(config, "head_dim", None) or self.hidden_size // self.n_heads)
        self.eps = float(config.rms_norm_eps)
        self._load(state, bool(getattr(config, "tie_word_embeddings", False)))
        self.kernels = self._use_kernels(kernels, compile)
        if self.kernels:
            self._pack()

        # RoPE tables for every position, computed once (fp32 as HF, then cast).
        _, theta, _ = _rope_params(config)
        d = self.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        pos = torch.arange(self.max_length, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # (max_length, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_length, D)
        sin = emb.sin()
        self.cos = emb.cos().to(device=self.device, dtype=dtype)
        # rotate_half(x) * sin == roll(x, D/2) * [-sin | sin]
        self.sin = torch.cat([-sin[:, : d // 2], sin[:, d // 2 :]], -1).to(self.device, dtype)

        self.kv = torch.zeros(
            (self.num_layers, 2, self.n_kv, self.max_length, d), dtype=dtype, device=self.device
        )  # (L, 2, KV, S_max, D)
        self._arange = torch.arange(self.max_length + self.chunk, device=self.device)
        self._len = 0
        self._pending = 0  # tokens appended by the last forward, for keep()
        self._layers_fn = self._layers
        if compile:
            self._layers_fn = torch.compile(self._layers, dynamic=True)

    # -- construction --------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        max_length: int | None = None,
        compile: bool = False,
        kernels: bool | None = None,
    ) -> LeanRunner:
        """Load a local Hugging Face checkpoint folder (config.json + safetensors)."""
        from transformers import AutoConfig

        path = Path(path)
        config = AutoConfig.from_pretrained(str(path))
        state = _load_safetensors(path)
        return cls(config, state, device, dtype, max_length, compile=compile, kernels=kernels)

    @classmethod
    def from_hf_model(
        cls,
        model: torch.nn.Module,
        max_length: int | None = None,
        compile: bool = False,
        kernels: bool | None = None,
    ) -> LeanRunner:
        """Copy an in-memory HF causal LM's weights (same device and dtype as the model)."""
        p = next(model.parameters())
        state = {k: v.detach() for k, v in model.state_dict().items()}
        return cls(
            model.config, state, p.device, p.dtype, max_length, compile=compile, kernels=kernels
        )

    def _load(self, state: dict[str, torch.Tensor], tied: bool) -> None:
        """Fuse and move the weights; biases are used wherever the checkpoint has them."""

        def get(name: str) -> torch.Tensor:
            return state[name].to(device=self.device, dtype=self.dtype).contiguous()

        def opt(name: str) -> torch.Tensor | None:
            return get(name) if name in state else None

        def cat_opt(names: list[str], sizes: list[int]) -> torch.Tensor | None:
            if not any(n in state for n in names):
                return None
            parts = [
                get(n) if n in state else torch.zeros(s, device=self.device, dtype=self.dtype)
                for n, s in zip(names, sizes, strict=True)
            ]
            return torch.cat(parts)

        def t(w: torch.Tensor) -> torch.Tensor:  # (out, in) -> (in, out), see the docstring
            return w.t().contiguous()

        d = self.head_dim
        self.embed = get("model.embed_tokens.weight")  # (V, H)
        if tied:
            head = self.embed
        elif "lm_head.weight" in state:
            head = get("lm_head.weight")
        else:
            raise KeyError("lm_head.weight missing and tie_word_embeddings is false")
        # The tied head is a (H, V) copy on the CPU (the fast layout there), a view on CUDA.
        self.lm_head_t = head.t() if self.device.type == "cuda" and tied else t(head)  # (H, V)
        self.norm = get("model.norm.weight")
        q_out, kv_out = self.n_heads * d, self.n_kv * d
        self.inter = int(self.config.intermediate_size)
        layers = []
        for i in range(self.num_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            qkv_names = [a + "q_proj", a + "k_proj", a + "v_proj"]
            wqkv = t(torch.cat([get(n + ".weight") for n in qkv_names]))  # (H, Q+2K)
            bqkv = cat_opt([n + ".bias" for n in qkv_names], [q_out, kv_out, kv_out])
            gu_names = [m + "gate_proj", m + "up_proj"]
            wgu = t(torch.cat([get(n + ".weight") for n in gu_names]))  # (H, 2I)
            bgu = cat_opt([n + ".bias" for n in gu_names], [self.inter, self.inter])
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
        self.layers = layers

    def _use_kernels(self, wanted: bool | None, compile: bool) -> bool:
        """Whether products go through ``cpu_gemm`` (auto: fp32 on the CPU, not compiled)."""
        if wanted is False or (wanted is None and compile):
            return False
        if cpu_gemm.usable(self.device, self.dtype):
            return True
        if not wanted:
            return False
        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise ValueError("the CPU kernels need fp32 weights on the CPU")
        raise RuntimeError(f"CPU kernels unavailable: {cpu_gemm.unavailable_reason()}")

    def _pack(self) -> None:
        """Replace every ``(in, out)`` weight by its ``cpu_gemm`` panels (no extra copy kept)."""

        def p(w: torch.Tensor) -> torch.Tensor:
            return cpu_gemm.maybe_pack(w, use=True)

        self.lm_head_t = p(self.lm_head_t)
        self.layers = [
            (ln1, p(wqkv), bqkv, p(wo), bo, ln2, p(wgu), bgu, p(wd), bd)
            for (ln1, wqkv, bqkv, wo, bo, ln2, wgu, bgu, wd, bd) in self.layers
        ]

    def half_panels(self) -> int:
        """Hold the packed weights as 16-bit panels wherever that loses nothing (fp16 or
        bf16, whichever holds every weight of a matrix: those read from an fp16 or a bf16
        checkpoint): the same products, bit for bit, for half the bytes each forward
        streams. Returns the bytes saved (0 without the kernels)."""
        if not self.kernels:
            return 0
        saved = 0

        def h(w: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            if w.dim() != 3 or w.dtype != torch.float32:
                return w
            dtype = cpu_gemm.narrow_dtype(w)
            if dtype == torch.float32:
                return w
            saved += w.numel() * 2
            return w.to(dtype)

        self.lm_head_t = h(self.lm_head_t)
        self.layers = [
            (ln1, h(wqkv), bqkv, h(wo), bo, ln2, h(wgu), bgu, h(wd), bd)
            for (ln1, wqkv, bqkv, wo, bo, ln2, wgu, bgu, wd, bd) in self.layers
        ]
        return saved

    def project(self, normed: torch.Tensor) -> torch.Tensor:
        """LM-head logits of final-normed hidden states ``(T, H)``."""
        return cpu_gemm.linear(normed, self.lm_head_t, None, None)

    # -- cache verbs ---------------------------------------------------------------------

    @property
    def length(self) -> int:
        return self._len

    def reset(self) -> None:
        self._len = 0
        self._pending = 0

    def cache_state(self) -> object:
        return (self.kv, self._len)

    def set_cache_state(self, state: object) -> None:
        self.kv, self._len = state  # type: ignore[misc]
        self._pending = 0

    def new_cache_state(self) -> object:
        return (torch.zeros_like(self.kv), 0)

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self._len:
            raise ValueError(f"cannot truncate a cache of {self._len} tokens to {n}")
        self._len = n
        self._pending = 0

    def keep(self, indices: list[int]) -> None:
        t = self._pending
        base = self._len - t
        idx = list(indices)
        check_keep(idx, t)
        if idx != list(range(len(idx))):
            rows = torch.tensor(idx, device=self.device) + base
            self.kv[:, :, :, base : base + len(idx)] = self.kv.index_select(3, rows)
        self._len = base + len(idx)
        self._pending = 0

    # -- forward -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        ids: list[int],
        parents: list[int] | None = None,
        taps: tuple[int, ...] = (),
        last_only: bool = False,
    ) -> ForwardOut:
        n = len(ids)
        check_forward(n, self._len, self.max_length)
        for t in taps:
            if not 0 <= t <= self.num_layers:
                raise ValueError(f"tap {t} outside 0..{self.num_layers}")
        depth, anc = tree_layout(parents, n)
        start = self._len
        if anc is None and n > self.chunk:  # long chain: prefill in chunks
            outs = []
            for s in range(0, n, self.chunk):
                final = s + self.chunk >= n
                rows = ("last" if final else "none") if last_only else "all"
                outs.append(self._forward_chunk(ids[s : s + self.chunk], None, None, taps, rows))
            self._pending = n
            logits = torch.cat([o.logits for o in outs])
            hidden = torch.cat([o.hidden for o in outs]) if taps else None
            return ForwardOut(logits=logits, hidden=hidden)
        rows = "last" if last_only else "all"
        out = self._forward_chunk(ids, depth if anc is not None else None, anc, taps, rows)
        self._pending = n
        assert self._len == start + n
        return out

    def _forward_chunk(
        self,
        ids: list[int],
        depth: list[int] | None,
        anc: torch.Tensor | None,
        taps: tuple[int, ...],
        rows: str = "all",
    ) -> ForwardOut:
        """Append ``ids`` (a chain when ``anc`` is None) after the cache; advance ``length``.

        ``rows``: which rows get logits, ``all``, ``last`` or ``none``.
        """
        n, past = len(ids), self._len
        total = past + n
        x = F.embedding(torch.tensor(ids, device=self.device), self.embed)  # (T, H)
        if anc is None:
            cos, sin = self.cos[past:total], self.sin[past:total]  # (T, D)
        else:
            pos = torch.tensor(depth, device=self.device) + past
            cos, sin = self.cos[pos], self.sin[pos]
        mask = None
        if n > 1:
            if anc is None:  # chain after the cache: key s visible to query t iff s <= past + t
                allowed = self._arange[:total][None, :] <= self._arange[past:total][:, None]
            else:
                allowed = torch.ones((n, total), dtype=torch.bool, device=self.device)
                allowed[:, past:] = anc.to(self.device)
            m = torch.zeros((n, total), dtype=self.dtype, device=self.device)
            m.masked_fill_(~allowed, float("-inf"))
            # rows of the grouped query are (t, g) pairs, t-major: repeat each row g times
            mask = m[:, None, :].expand(n, self.group, total).reshape(n * self.group, total)
        hidden = None
        if taps:
            hidden = torch.empty(
                (n, len(taps), self.hidden_size), dtype=torch.float32, device=self.device
            )
        x = self._layers_fn(x, cos[:, None, :], sin[:, None, :], mask, anc, past, taps, hidden)
        if rows == "last":
            x = x[-1:]
        elif rows == "none":
            x = x[:0]
        logits = self.project(cpu_gemm.norm(x, self.norm, self.eps, self.kernels))
        self._len = total
        return ForwardOut(logits=logits.float(), hidden=hidden)

    def _layers(
        self,
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
        nh, nkv, g, d = self.n_heads, self.n_kv, self.group, self.head_dim
        total = past + n
        qk_w = (nh + nkv) * d
        slots: list[list[int]] = [[] for _ in range(self.num_layers + 1)]  # tap l -> columns
        for j, t in enumerate(taps):
            slots[t].append(j)
        for j in slots[0]:
            hidden[:, j] = x
        for i, (ln1, wqkv, bqkv, wo, bo, ln2, wgu, bgu, wd, bd) in enumerate(self.layers):
            kc, vc = self.kv[i, 0], self.kv[i, 1]  # (KV, S_max, D)
            a = cpu_gemm.norm(x, ln1, self.eps, self.kernels)
            a = cpu_gemm.linear(a, wqkv, bqkv, None)  # (T, (NH+2KV)*D)
            qk = a[:, :qk_w].view(n, nh + nkv, d)  # (T, NH+KV, D)
            qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)  # RoPE
            kc[:, past:total] = qk[:, nh:].transpose(0, 1)  # (KV, T, D)
            vc[:, past:total] = a[:, qk_w:].view(n, nkv, d).transpose(0, 1)
            q = qk[:, :nh].reshape(n, nkv, g, d).transpose(0, 1).reshape(1, nkv, n * g, d)
            if n <= KERNEL_ATTENTION_ROWS and self.kernels:  # K and V read once for all rows
                o = cpu_gemm.attention(q[0], kc, vc, past, n, anc)
            else:
                o = F.scaled_dot_product_attention(
                    q, kc[None, :, :total], vc[None, :, :total], attn_mask=mask
                )  # (1, KV, T*G, D)
            o = o.view(nkv, n, g * d).transpose(0, 1).reshape(n, nh * d)  # (T, NH*D)
            x = cpu_gemm.linear(o, wo, bo, x)  # residual fused in
            gu = cpu_gemm.norm(x, ln2, self.eps, self.kernels)
            gu = cpu_gemm.linear(gu, wgu, bgu, None)  # (T, 2I)
            gu = F.silu(gu[:, : self.inter]) * gu[:, self.inter :]  # (T, I)
            x = cpu_gemm.linear(gu, wd, bd, x)
            for j in slots[i + 1]:
                hidden[:, j] = x
        return x


def param_bytes(runner: LeanRunner) -> int:
    """Bytes of weights one forward reads (the tied embedding counted once, as the LM head)."""
    seen: set[int] = set()
    total = 0
    tensors = [runner.lm_head_t, runner.norm]
    for layer in runner.layers:
        tensors.extend(t for t in layer if t is not None)
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def kv_bytes(runner: LeanRunner, tokens: int) -> int:
    """Bytes of K and V that attention reads over ``tokens`` cached positions."""
    per_token = runner.num_layers * 2 * runner.n_kv * runner.head_dim * runner.kv.element_size()
    return per_token * tokens


__all__ = ["LeanRunner", "kv_bytes", "param_bytes", "supports"]
