"""The EAGLE-3 draft head: its weights, its training forward, its inference runner, its files.

Owns: :class:`EagleHead` (the trainable module and its
training-time-test forward), :class:`HeadRunner` (the inference forward over a
static KV cache, with the same cache verbs as a model runner) and the files
in vLLM's ``speculators`` EAGLE-3 layout (:func:`save_head`, :func:`load_head`).

Must not touch: the target model, the engine, drafting (that is ``eagle.py``).
The head's shape and the contents of its ``config.json`` are ``eagle_config.py``.
The head never owns the token embedding: it borrows the target's (frozen), as
vLLM does when the head's file has no ``embed_tokens``.

Architecture (one Llama decoder layer whose attention reads ``2h``):

- ``fc``: the target's hidden states at three taps (low, mid, high layers),
  concatenated ``(T, 3h)`` → ``(T, h)``. Tap ``l`` is the input of target layer
  ``l`` (0 = embeddings), which is both ``Runner.forward``'s tap numbering and
  vLLM's ``eagle_aux_hidden_state_layer_ids``.
- Entry ``t`` of the head pairs the target's state at position ``t`` with the
  embedding of token ``t + 1`` and sits at RoPE position ``t + 1``; its output
  predicts token ``t + 2``. Inside the layer: ``input_layernorm(embedding)`` and
  ``hidden_norm(hidden)`` are concatenated ``(T, 2h)`` for q/k/v; the residual
  stream is the (un-normalised) hidden; attention, MLP, then ``norm`` and
  ``lm_head`` over the draft vocabulary.
- Deeper drafts feed the head its own output: a draft entry pairs the
  embedding of a drafted token with the layer's *pre-norm* output of its
  parent entry (what vLLM passes along as ``hidden_prenorm``).
- Draft vocabulary: ``lm_head`` scores ``draft_vocab_size`` tokens; draft id
  ``i`` is target id ``i + d2t[i]`` (vLLM's convention); ``t2d`` is the boolean
  membership mask over the target vocabulary.

Files (``save_head`` / ``load_head``): ``config.json`` with
``speculators_model_type: "eagle3"``, ``transformer_layer_config`` (a one-layer
Llama config whose ``vocab_size`` is the target's), ``draft_vocab_size``,
``eagle_aux_hidden_state_layer_ids``, ``speculators_config`` (algorithm,
greedy proposal method, verifier); ``model.safetensors`` with ``fc.weight``,
``layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``layers.0.self_attn.{q,k,v,o}_proj.weight``,
``layers.0.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``,
``d2t`` (int64) and ``t2d`` (bool).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from codespec.speculators.eagle_config import EagleConfig, default_taps
from codespec.speculators.target import Kernels, TorchKernels

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
# Chains of up to this many new entries (a drafting step's forward over the accepted rows)
# go to the kernels' chain attention where there is one; longer ones (a request's first
# forward over the prompt's window) and trees to SDPA. A short chain through SDPA and its
# mask costs a noticeable part of a drafting step, run cold after a target forward.
KERNEL_CHAIN = 8


def rope_tables(positions: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` of shape ``(positions, head_dim)``, fp32, Llama's (rotate-half) layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)  # (P, D)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` over the last axis; cos/sin broadcast against x."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class _Attention(nn.Module):
    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)


class _Mlp(nn.Module):
    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class _Layer(nn.Module):
    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.hidden_norm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        self.self_attn = _Attention(cfg)
        self.mlp = _Mlp(cfg)


class DraftVocab(nn.Module):
    """A head's reduced draft vocabulary and its maps to the full one, in the speculators
    layout: ``d2t`` (draft id + offset = target id) and ``t2d`` (a mask over target ids).
    For modules whose ``cfg`` has ``draft_vocab_size`` and ``vocab_size``."""

    cfg: Any
    d2t: torch.Tensor
    t2d: torch.Tensor

    def init_draft_vocab(self) -> None:
        """Register the maps, the first ``draft_vocab_size`` ids to start with."""
        self.register_buffer("d2t", torch.zeros(self.cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(self.cfg.vocab_size, dtype=torch.bool))
        self.set_draft_vocab(torch.arange(self.cfg.draft_vocab_size))

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Draft id ``i`` ↦ target id ``target_ids[i]`` (sorted ascending, distinct)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).flatten()
        if ids.numel() != self.cfg.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError("the draft vocabulary needs draft_vocab_size distinct ids")
        ids = ids.sort().values
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self) -> torch.Tensor:
        """``(draft_vocab_size,)`` target id of each draft id."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t


class EagleHead(DraftVocab):
    """The trainable head. ``embed`` is the target's token embedding ``(V, h)``, frozen.

    State-dict names are the ``speculators`` names (``fc.weight``, ``layers.0.*``,
    ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``); the embedding is a
    non-persistent buffer, never saved.
    """

    def __init__(self, cfg: EagleConfig, embed: torch.Tensor) -> None:
        super().__init__()
        if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"target embedding {tuple(embed.shape)} does not fit the head "
                f"({cfg.vocab_size}, {cfg.hidden_size})"
            )
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.taps) * h, h, bias=False)
        self.layers = nn.ModuleList([_Layer(cfg)])
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.init_draft_vocab()
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)
        cos, sin = rope_tables(cfg.max_position_embeddings + 64, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    # -- vocabulary ----------------------------------------------------------------------

    def init_lm_head_from(self, weight: torch.Tensor) -> None:
        """Start ``lm_head`` from the target's LM head rows of the draft vocabulary."""
        with torch.no_grad():
            self.lm_head.weight.copy_(weight.detach().float()[self.draft_to_target()])

    # -- training forward ----------------------------------------------------------------

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """``(..., 3, h)`` target states → ``(..., h)``."""
        return self.fc(taps.flatten(-2))

    def _qkv(
        self, emb: torch.Tensor, hid: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``(B, NH, T, D)``, k/v ``(B, NH, T, D)`` (GQA expanded) and the residual."""
        layer, cfg = self.layers[0], self.cfg
        b, t, _ = emb.shape
        e = layer.input_layernorm(emb)
        hn = layer.hidden_norm(hid)
        residual = hn if cfg.norm_before_residual else hid
        x = torch.cat([e, hn], dim=-1)  # (B, T, 2h)
        att = layer.self_attn
        d, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]  # (B, T, 1, D)
        q = apply_rope(att.q_proj(x).view(b, t, nh, d), cos, sin).transpose(1, 2)
        k = apply_rope(att.k_proj(x).view(b, t, nkv, d), cos, sin).transpose(1, 2)
        v = att.v_proj(x).view(b, t, nkv, d).transpose(1, 2)
        g = nh // nkv
        return q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), residual

    def _finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output ``(B, NH, T, D)`` → the layer's pre-norm output ``(B, T, h)``."""
        layer = self.layers[0]
        b, _, t, _ = attn.shape
        x = residual + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        m = layer.post_attention_layernorm(x)
        return x + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(m)) * layer.mlp.up_proj(m))

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the layer's pre-norm output."""
        return self.lm_head(self.norm(prenorm))

    def ttt_forward(
        self, fused: torch.Tensor, next_ids: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """Training-time test: ``steps`` draft steps over every position at once.

        ``fused`` ``(B, T, h)`` is ``fc`` of the target's taps at positions ``0..T-1``;
        ``next_ids`` ``(B, T)`` the tokens ``1..T``. Step 0 is entry ``t`` as at
        inference; step ``k`` feeds each position its own step ``k-1`` prediction
        (argmax, mapped to target ids) with the step ``k-1`` output, at position
        ``t + 1 + k``, attending to the step-0 entries ``<= t`` and to its own
        chain's entries of steps ``1..k`` (the draft chain a real entry grows).
        Returns the draft logits of each step, ``(B, T, draft_vocab)``; step ``k``
        at ``t`` predicts token ``t + 2 + k``.
        """
        b, t, _ = fused.shape
        pos = torch.arange(1, t + 1, device=fused.device).expand(b, t)
        causal = torch.ones((t, t), dtype=torch.bool, device=fused.device).tril()
        scale = self.cfg.head_dim**-0.5
        hid, ids = fused, next_ids
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        d2t = self.draft_to_target()
        out: list[torch.Tensor] = []
        for k in range(steps):
            emb = F.embedding(ids, self.embed)  # (B, T, h)
            q, kk, vv, residual = self._qkv(emb, hid, pos + k)
            keys.append(kk)
            values.append(vv)
            s0 = (q @ keys[0].transpose(-1, -2)) * scale  # (B, NH, T, T)
            s0 = s0.masked_fill(~causal, float("-inf"))
            diag = [(q * kd).sum(-1, keepdim=True) * scale for kd in keys[1:]]  # (B, NH, T, 1)
            p = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1)
            attn = p[..., :t] @ values[0]
            for i, vd in enumerate(values[1:]):
                attn = attn + p[..., t + i : t + i + 1] * vd
            hid = self._finish(attn, residual)
            logits = self.logits(hid)
            out.append(logits)
            ids = d2t[logits.argmax(-1)].detach()
        return out


def head_state(head: EagleHead, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors of the head's file (no embedding), ``dtype`` for the float ones."""
    state = {}
    for name, tensor in head.state_dict().items():
        t = tensor.detach().cpu()
        if t.is_floating_point() and dtype is not None:
            t = t.to(dtype)
        state[name] = t.contiguous()
    return state


def save_head(head: EagleHead, out: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the speculators EAGLE-3 layout."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(head.cfg.to_speculators(), indent=2) + "\n")
    save_file(head_state(head, dtype), str(out / WEIGHTS), metadata={"format": "pt"})
    return out


def read_config(path: str | Path) -> EagleConfig:
    path = Path(path)
    try:
        data = json.loads((path / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path / CONFIG}: {exc}") from None
    return EagleConfig.from_speculators(data)


def load_head(path: str | Path, embed: torch.Tensor) -> EagleHead:
    """A head from a speculators EAGLE-3 folder; ``embed`` is the target's embedding.

    ``midlayer.*`` names (the original EAGLE repository's) are read as ``layers.0.*``;
    a missing ``d2t`` / ``t2d`` means the full vocabulary; an ``embed_tokens.weight``
    in the file is ignored (the target's embedding is the one the head was trained on).
    """
    from safetensors.torch import load_file

    path = Path(path)
    cfg = read_config(path)
    head = EagleHead(cfg, embed)
    if not (path / WEIGHTS).exists():
        raise ValueError(f"no {WEIGHTS} in {path}")
    try:
        raw = load_file(str(path / WEIGHTS))
    except Exception as exc:  # safetensors' own error type: a truncated or foreign file
        raise ValueError(f"cannot read {path / WEIGHTS}: {exc}") from None
    state = {k.replace("midlayer.", "layers.0."): v for k, v in raw.items()}
    state.pop("embed_tokens.weight", None)
    own = head.state_dict()
    if "d2t" not in state:
        state["d2t"] = own["d2t"]
    if "t2d" not in state:
        state["t2d"] = own["t2d"]
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise ValueError(f"head weights do not match the config: missing {missing}, extra {extra}")
    wrong = sorted(k for k, v in state.items() if tuple(v.shape) != tuple(own[k].shape))
    if wrong:
        raise ValueError(f"head weights do not match the config's shapes: {wrong}")
    head.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
    return head.eval()


class HeadRunner:
    """The head at inference: fused weights, a static KV cache, the runner's cache verbs.

    ``length`` entries are cached; :meth:`forward` appends ``T`` entries (a chain,
    or rows with an explicit ``allowed`` mask over ``length + T`` keys) and returns
    their pre-norm outputs ``(T, h)`` and draft logits ``(T, draft_vocab)``;
    :meth:`truncate` rolls back. Positions are passed in, never derived, so
    tree levels can share a depth.

    Products go through ``kernels`` (the target's, from
    :meth:`~codespec.speculators.target.TargetModel.kernels`: on an AVX2 CPU the
    lean runner's panels, 16-bit where a shipped head's weights are exact in 16
    bits); torch's by default.
    """

    def __init__(
        self,
        head: EagleHead,
        embed: torch.Tensor,
        max_length: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        kernels: Kernels | None = None,
    ) -> None:
        cfg = head.cfg
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_length = int(max_length)
        layer = head.layers[0]
        self.kernels: Kernels = kernels if kernels is not None else TorchKernels()
        kn = self.kernels

        def t(w: torch.Tensor) -> torch.Tensor:  # (out, in) -> (in, out): x @ W is fastest here
            return kn.pack(w.detach().to(self.device, dtype).t().contiguous())

        def v(w: torch.Tensor) -> torch.Tensor:
            return w.detach().to(self.device, dtype).contiguous()

        att, mlp = layer.self_attn, layer.mlp
        self.embed = embed.detach().to(self.device, dtype)  # (V, h)
        self.w_fc = t(head.fc.weight)  # (3h, h)
        self.w_qkv = t(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]))
        self.w_o = t(att.o_proj.weight)  # (NH*D, h)
        self.w_gu = t(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))  # (h, 2I)
        self.w_down = t(mlp.down_proj.weight)  # (I, h)
        self.ln_in, self.ln_hid = v(layer.input_layernorm.weight), v(layer.hidden_norm.weight)
        self.ln_post, self.ln_out = v(layer.post_attention_layernorm.weight), v(head.norm.weight)
        self.w_lm = t(head.lm_head.weight)  # (h, draft_vocab)
        self.draft_ids = head.draft_to_target().to(self.device)  # (draft_vocab,)
        cos, sin = rope_tables(self.max_length + 64, cfg.head_dim, cfg.rope_theta)
        self.cos, self.sin = cos.to(self.device, dtype), sin.to(self.device, dtype)
        self.kv = torch.zeros(
            (2, cfg.num_key_value_heads, self.max_length, cfg.head_dim),
            dtype=dtype,
            device=self.device,
        )  # (2, KV, S_max, D)
        self.length = 0

    @property
    def param_bytes(self) -> int:
        """Bytes of weights one forward reads (the embedding rows read are not counted)."""
        ws = [self.w_fc, self.w_qkv, self.w_o, self.w_gu, self.w_down, self.w_lm]
        return sum(w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes
                   for w in ws)  # fmt: skip

    def reset(self) -> None:
        self.length = 0

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a head cache of {self.length} entries to {n}")
        self.length = n

    @torch.inference_mode()
    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """``(T, 3, h)`` target taps → ``(T, h)``."""
        x = taps.to(self.device, self.dtype).flatten(-2)
        return self.kernels.linear(x.reshape(-1, x.shape[-1]), self.w_fc).view(*x.shape[:-1], -1)

    @torch.inference_mode()
    def forward(
        self,
        ids: list[int] | torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        allowed: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``T`` entries: token ``ids`` (target ids), ``hidden`` ``(T, h)``.

        ``allowed`` is a bool ``(T, length + T)`` mask; ``None`` means a chain after
        the cache (entry i sees every cached entry and entries ``0..i``).
        Returns ``(prenorm (T, h), logits (T, draft_vocab))``; with ``last_only`` the
        logits of the last row only ``(1, draft_vocab)``.
        """
        cfg = self.cfg
        ids_t = torch.as_tensor(ids, device=self.device)
        n, past = int(ids_t.numel()), self.length
        total = past + n
        if total > self.max_length:
            raise ValueError(f"head cache of {total} entries exceeds {self.max_length}")
        d = cfg.head_dim
        nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        eps = cfg.rms_norm_eps
        hid = hidden.to(self.device, self.dtype)
        kn = self.kernels
        e = kn.norm(F.embedding(ids_t, self.embed), self.ln_in, eps)
        hn = kn.norm(hid, self.ln_hid, eps)
        residual = hn if cfg.norm_before_residual else hid
        a = kn.linear(torch.cat([e, hn], dim=-1), self.w_qkv)  # (T, (NH+2KV)*D)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # (T, 1, D)
        qk = apply_rope(a[:, : (nh + nkv) * d].view(n, nh + nkv, d), cos, sin)
        self.kv[0, :, past:total] = qk[:, nh:].transpose(0, 1)  # (KV, T, D)
        self.kv[1, :, past:total] = a[:, (nh + nkv) * d :].view(n, nkv, d).transpose(0, 1)
        o = self._attend(qk[:, :nh], past, allowed)  # (T, NH*D)
        x = kn.linear(o, self.w_o, residual)
        post = kn.norm(x, self.ln_post, eps)
        gu = kn.linear(post, self.w_gu)  # (T, 2I)
        inter = cfg.intermediate_size
        x = kn.linear(F.silu(gu[:, :inter]) * gu[:, inter:], self.w_down, x)  # (T, h)
        last = x[-1:] if last_only else x
        logits = kn.linear(kn.norm(last, self.ln_out, eps), self.w_lm)
        self.length = total
        return x, logits.float()

    def _attend(self, q: torch.Tensor, past: int, allowed: torch.Tensor | None) -> torch.Tensor:
        """Attention of the ``T`` new entries' queries ``(T, NH, D)`` over the cache (their
        own keys already written at ``past..``); ``(T, NH*D)``.

        Grouped-query attention without repeating the cache: the g query heads of one kv
        head are folded into the query axis, rows (t, g) t-major (as the lean runner)."""
        n, nh, d = q.shape
        nkv = self.cfg.num_key_value_heads
        g, total = nh // nkv, past + n
        q = q.reshape(n, nkv, g, d).transpose(0, 1).reshape(1, nkv, n * g, d)
        o = None
        if allowed is None and n <= KERNEL_CHAIN:  # a short chain after the cache
            o = self.kernels.chain_attention(q[0], self.kv[0], self.kv[1], past, n)
        if o is None:
            if allowed is None and n > 1:
                ar = torch.arange(total, device=self.device)
                allowed = ar[None, :] <= ar[past:total, None]  # a chain after the cache
            mask = None
            if allowed is not None:
                mask = allowed.to(self.device)[:, None, :].expand(n, g, total).reshape(n * g, total)
            o = F.scaled_dot_product_attention(
                q, self.kv[None, 0, :, :total], self.kv[None, 1, :, :total], attn_mask=mask
            )  # (1, KV, T*G, D)
        return o.view(nkv, n, g * d).transpose(0, 1).reshape(n, nh * d)


def head_size(head: EagleHead) -> dict[str, Any]:
    """Parameter count and bytes of the head's file contents."""
    params = sum(p.numel() for p in head.parameters())
    return {"parameters": params, "config": asdict(head.cfg)}


__all__ = [
    "EagleConfig",
    "EagleHead",
    "HeadRunner",
    "apply_rope",
    "default_taps",
    "head_size",
    "load_head",
    "read_config",
    "rope_tables",
    "save_head",
]
