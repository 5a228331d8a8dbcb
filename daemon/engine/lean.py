"""The lean runner: a hand-written forward for the Llama family over a static KV cache.

Owns :class:`LeanRunner` and :func:`from_model_folder`. It loads a safetensors checkpoint
(:meth:`LeanRunner.from_pretrained`) or a GGUF's own blocks (:meth:`LeanRunner.from_gguf`,
:func:`from_model_folder`), allocates the KV cache and RoPE tables once; one forward serves
prefill, decode and tree verification. It keeps the ``Runner`` contract of ``runner.py``
(``HFRunner`` is the tests' reference) and knows nothing about tokenizers or proposers.
Which configs it runs and the choices made at load from the machine (attention, a
GGUF's products) are ``lean_config``'s.

Architectures (``lean_config.supports``): Llama, Qwen2 (biases used where present) and Mistral
(``sliding_window`` ignored: equal while the context fits the window). Scaled or partial
RoPE, Qwen2's sliding window and activations other than SiLU are refused.

Two ways to run, chosen at load:

- **The stack** (:mod:`~codespec.daemon.engine.qstack`, C++): on the CPU, with products
  through ``cpu_gemm`` panels (fp32 / fp16 / bf16: an fp32 checkpoint, or
  :meth:`LeanRunner.half_panels`) or GGUF blocks (``quant_gemm``), the whole decoder stack
  is one call per forward, over a 16-bit KV cache: fp16 with attention products in fp32,
  or, with int8 block products (the fast, inexact path) on a CPU with AVX512-BF16, bf16
  with bf16 attention (``lean_config.attention_for``). Every row equals, bit for bit, the
  one-token forward at its place (verify rows equal decode rows, chains and trees), on
  every ISA and thread count.
- **torch** (``kernels=False``, CUDA, no compiler; ``lean_torch``): q/k/v and gate/up fused,
  weights ``(in, out)`` applied as ``x @ W``, an fp32 (bf16 on CUDA) cache, SDPA with an
  explicit mask (a chain after a cache is not SDPA's top-left ``is_causal``).
  ``compile=True`` wraps the layers in ``torch.compile`` (on the CPU its decode steps of
  a small model are slower than eager's).

Taps: tap 0 is the embeddings, tap ``l`` the output of decoder layer ``l`` and tap ``L``
its output *before* the final norm (``HFRunner``'s last entry is after it). Long chains
(prefill) are fed in chunks of ``chunk`` tokens; trees never are.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from codespec.daemon.engine import cpu_gemm, gguf_weights, lean_torch, qstack, quant_gemm
from codespec.daemon.engine.lean_config import attention_for, gguf_products, rope_params, supports
from codespec.daemon.engine.runner import ForwardOut, check_forward, check_keep, tree_layout


class LeanRunner:
    """Static-cache runner for the Llama family (the ``Runner`` protocol of ``runner.py``).

    The KV cache is one tensor (``_fresh_cache``), written by ``forward`` at rows ``length ..
    length+T``; ``truncate`` only moves ``length``, ``keep`` gathers the kept rows down.
    Build it with :meth:`from_pretrained`, :meth:`from_hf_model` or :meth:`from_gguf`."""

    name = "lean"

    def __init__(
        self,
        config: Any,
        state: dict[str, torch.Tensor] | gguf_weights.GGUFWeights,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        max_length: int | None = None,
        chunk: int = 256,
        compile: bool = False,
        kernels: bool | None = None,
        int8: bool = False,
        attention: str | None = None,
    ) -> None:
        if not supports(config):
            raise ValueError(f"the lean runner does not support this config ({config.model_type})")
        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = dtype
        self._shape(config, max_length, chunk)
        self.gguf = isinstance(state, gguf_weights.GGUFWeights)
        self.int8 = bool(int8) and self.gguf  # block products x rounded to int8 (inexact)
        self.attention = attention or attention_for(self.int8)  # the stack's (qstack)
        if self.gguf:
            if self.device.type != "cpu" or dtype != torch.float32 or compile or kernels is False:
                raise ValueError("a GGUF's blocks run on the CPU, in fp32, uncompiled")
            self._load_gguf(state)
            self.kernels = True
        else:
            self._load(state, bool(getattr(config, "tie_word_embeddings", False)))
            self.kernels = self._use_kernels(kernels, compile)
            if self.kernels:
                self._pack()
        self._rope_tables(config)
        self._len = 0
        self._pending = 0  # tokens appended by the last forward, for keep()
        self._layers_fn = functools.partial(lean_torch.layers, self)
        if compile:
            self._layers_fn = torch.compile(self._layers_fn, dynamic=True)
        self.stack: qstack.Stack | None = None
        self._isa = quant_gemm.default_isa()  # the argmax's path (read once: it is per step)
        self._build_stack()
        if self.gguf and self.stack is None:
            raise RuntimeError(f"the decoder stack is unavailable: {self._stack_reason}")
        self.kv = self._fresh_cache()

    def _shape(self, config: Any, max_length: int | None, chunk: int) -> None:
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
        self.inter = int(config.intermediate_size)

    def _rope_tables(self, config: Any) -> None:
        """cos / signed sin for every position, computed once (fp32 as HF, then cast)."""
        _, theta, _ = rope_params(config)
        d, dtype = self.head_dim, self.dtype
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        pos = torch.arange(self.max_length, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # (max_length, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_length, D)
        sin = emb.sin()
        self.cos = emb.cos().to(device=self.device, dtype=dtype)
        # rotate_half(x) * sin == roll(x, D/2) * [-sin | sin]
        self.sin = torch.cat([-sin[:, : d // 2], sin[:, d // 2 :]], -1).to(self.device, dtype)
        self._arange = torch.arange(self.max_length + self.chunk, device=self.device)

    def _fresh_cache(self) -> torch.Tensor:
        """An empty KV cache: the stack's 16-bit one (``qstack.cache``: zero pages until
        written), else ``(L, 2, KV, S_max, D)`` zeros."""
        if self.stack is not None:
            return qstack.cache(self.num_layers, self.n_kv, self.head_dim, self.max_length)
        shape = (self.num_layers, 2, self.n_kv, self.max_length, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _build_stack(self) -> None:
        """Run through the C++ stack where every matrix is panels or blocks (CPU kernels)."""
        self.stack, self._stack_reason = None, "the CPU kernels are off"
        if not self.kernels:
            return
        specs = [_layer_spec(layer) for layer in self.layers]
        mats = [self.lm_head_t] + [w for s in specs for w, _ in s["qkv"] + s["gu"]]
        mats += [s[k][0] for s in specs for k in ("o", "down")]
        if not all(qstack.is_matrix(w) for w in mats):
            self._stack_reason = "a matrix is not in panels (a size not a multiple of 16)"
            return
        embed = self._embed_q if self.gguf else self.embed
        cfg = dict(hidden=self.hidden_size, heads=self.n_heads, kv_heads=self.n_kv)
        cfg.update(head_dim=self.head_dim, inter=self.inter, vocab=self.vocab_size, eps=self.eps)
        cfg.update(cos=self.cos, sin=self.sin, int8=self.int8, attention=self.attention)
        try:
            self.stack = qstack.Stack(cfg, specs, self.norm, embed, self.lm_head_t)
        except (RuntimeError, ValueError) as exc:
            self._stack_reason = str(exc)
        self.interrupt = qstack.Interrupt() if self.stack else None  # (the runner contract)

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
        state = lean_torch.load_safetensors(path)
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

    @classmethod
    def from_gguf(
        cls,
        path: str | Path | gguf_weights.GGUFFile,
        config: Any = None,
        max_length: int | None = None,
        chunk: int = 256,
        int8: bool = False,
        attention: str | None = None,
    ) -> LeanRunner:
        """Run a GGUF from its own blocks (see ``gguf_weights``); ``config``: an HF-style
        config (default: the GGUF's metadata); ``int8``: products with x rounded to int8
        (``quant_gemm.linear_i8``, not exact: plain decoding with it is its own reference);
        ``attention``: ``fp32`` or ``bf16`` (default: :func:`attention_for`)."""
        g = path if isinstance(path, gguf_weights.GGUFFile) else gguf_weights.read(path)
        config = config if config is not None else gguf_weights.config_from_meta(g)
        w = gguf_weights.load(g, config)
        return cls(config, w, max_length=max_length, chunk=chunk, int8=int8, attention=attention)

    def _load_gguf(self, w: gguf_weights.GGUFWeights) -> None:
        self.norm = w.norm
        self.layers: list[Any] = w.layers
        self.lm_head_t: Any = w.head  # a QuantMatrix, (V, H) blocks
        self._embed_q = w.embed
        self._embed_full: torch.Tensor | None = None

    @property
    def embed(self) -> torch.Tensor:
        """The token embedding ``(V, H)``: a GGUF's is widened on first use (for proposers
        that read it; the runner looks up rows from the blocks)."""
        if self.gguf:
            if self._embed_full is None:
                self._embed_full = self._embed_q.dequantize()
            return self._embed_full
        return self._embed

    @embed.setter
    def embed(self, value: torch.Tensor) -> None:
        self._embed = value

    def _load(self, state: dict[str, torch.Tensor], tied: bool) -> None:
        """Fuse and move the weights (``lean_torch.load_state``)."""
        self.embed, self.lm_head_t, self.norm, self.layers = lean_torch.load_state(
            self, state, tied
        )

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
        if not self.kernels or self.gguf:
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
        if saved and self.stack is not None:
            self._build_stack()  # the same cache: only the weights' pointers changed
        return saved

    def project(self, normed: torch.Tensor) -> torch.Tensor:
        """LM-head logits of final-normed hidden states ``(T, H)``."""
        if self.gguf:
            return quant_gemm.linear(normed.float().contiguous(), self.lm_head_t)
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
        return (self._fresh_cache(), 0)

    def copy_cache(self, state: object, n: int) -> object:
        """A new cache holding ``state``'s first ``n`` positions (whole 16-key tiles and
        value pairs are copied; rows past ``n`` are never read)."""
        kv, length = state  # type: ignore[misc]
        n = min(n, length)
        dst = self._fresh_cache()
        if n == 0:
            return (dst, 0)
        if self.stack is None:
            dst[:, :, :, :n].copy_(kv[:, :, :, :n])
            return (dst, n)
        s, d = qstack.cache_rows(self.max_length), self.head_dim
        dp = qstack.head_dim_padded(d)
        k_end = self.n_kv * s * d  # per layer: every head's keys, then every head's values
        for lo, hi, width, rows in ((0, k_end, d, -(-n // 16) * 16),  # whole 16-key tiles
                                    (k_end, None, dp, -(-n // 2) * 2)):  # value pairs  # fmt: skip
            shape = (self.num_layers, self.n_kv, s * width)
            part = slice(0, min(s, rows) * width)
            dst[:, lo:hi].view(shape)[:, :, part].copy_(kv[:, lo:hi].view(shape)[:, :, part])
        return (dst, n)

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
        if idx != list(range(len(idx))) and self.stack is not None:
            self.stack.keep(self.kv, base, idx)
        elif idx != list(range(len(idx))):
            rows = torch.tensor(idx, device=self.device) + base
            self.kv[:, :, :, base : base + len(idx)] = self.kv.index_select(3, rows)
        self._len = base + len(idx)
        self._pending = 0

    # -- forward -------------------------------------------------------------------------

    def argmax_rows(self, logits: torch.Tensor) -> list[int] | None:
        """Each row's argmax (torch's choice) by the stack's kernel; None without the stack."""
        if self.stack is None:
            return None
        return qstack.argmax_rows(logits, isa=self._isa)

    def _check(self, n: int, taps: tuple[int, ...]) -> None:
        check_forward(n, self._len, self.max_length)
        for t in taps:
            if not 0 <= t <= self.num_layers:
                raise ValueError(f"tap {t} outside 0..{self.num_layers}")

    @torch.inference_mode()
    def forward_unless_interrupted(
        self, ids: list[int], taps: tuple[int, ...] = ()
    ) -> ForwardOut | None:
        """``forward(ids, taps=taps, last_only=True)`` that stops between layers once
        :attr:`interrupt` is set: None then, the cache as it was (the runner contract)."""
        if self.interrupt is None or len(ids) > self.chunk:
            return self.forward(ids, taps=taps, last_only=True)
        self._check(len(ids), taps)
        try:
            out = self._forward_chunk(ids, None, None, taps, "last", self.interrupt)
        except qstack.Interrupted:
            return None
        self._pending = len(ids)
        return out

    @torch.inference_mode()
    def forward(
        self,
        ids: list[int],
        parents: list[int] | None = None,
        taps: tuple[int, ...] = (),
        last_only: bool = False,
        greedy: bool = False,
    ) -> ForwardOut:
        n = len(ids)
        self._check(n, taps)
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
            bests = [o.best for o in outs]
            best = None if any(b is None for b in bests) else [i for b in bests for i in b or []]
            return ForwardOut(logits=logits, hidden=hidden, best=best)
        rows = "last" if last_only else ("greedy" if greedy else "all")
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
        interrupt: qstack.Interrupt | None = None,
    ) -> ForwardOut:
        """Append ``ids`` (a chain when ``anc`` is None) after the cache; advance ``length``.

        ``rows``: which rows get logits, ``all``, ``last``, ``none`` or ``greedy`` (all,
        or the stack's stop where greedy verification's walk ends: see the runner
        contract's ``greedy``). ``interrupt`` (the stack's): raises
        ``qstack.Interrupted``, the length unmoved, once set.
        """
        n, past = len(ids), self._len
        total = past + n
        if self.stack is not None:  # the whole stack in one C++ call
            pos = None if anc is None else [past + d for d in depth or []]
            first = {"all": 0, "greedy": 0, "last": n - 1, "none": n}[rows]
            stop = rows == "greedy"
            logits, hidden, best = self.stack.forward(
                self.kv, past, ids, pos, anc, taps, first, stop=stop, interrupt=interrupt
            )
            self._len = total
            return ForwardOut(logits=logits, hidden=hidden, best=best)
        rows = "all" if rows == "greedy" else rows  # the torch path computes every row
        return lean_torch.forward_chunk(self, ids, depth, anc, taps, rows)


def from_model_folder(
    folder: str | Path, max_length: int | None = None, int8: bool | None = None
) -> tuple[LeanRunner, Any] | None:
    """The lean runner over the GGUF a cached model folder was made from (its manifest
    names it; ``models``), run from its blocks on the CPU; None when the folder has no
    GGUF or the runner cannot run it as it is (the caller loads the folder instead).
    Reads ``config.json`` as plain JSON: no ``transformers`` import. ``int8`` (default:
    :func:`gguf_products` is ``"int8"``): activations rounded to int8 for the block
    products, llama.cpp's way, else the exact products; ``fp16`` gives None (the
    folder's 16-bit weights as panels instead)."""
    from codespec.daemon.engine import models

    products = gguf_products()
    if products == "fp16":
        return None
    if int8 is None:
        int8 = products == "int8"
    folder = Path(folder)
    manifest = models.read_manifest(folder)
    path = models.CachedModel(folder, manifest).gguf if manifest else None
    if path is None:
        return None
    try:
        g = gguf_weights.read(path)
        cfg_file = folder / "config.json"
        config = (
            gguf_weights.config_from_json(cfg_file)
            if cfg_file.is_file()
            else gguf_weights.config_from_meta(g)
        )
    except (gguf_weights.GGUFError, OSError, ValueError):
        return None
    if not supports(config) or gguf_weights.unsupported(g, config):
        return None
    return LeanRunner.from_gguf(g, config, max_length=max_length, int8=int8), config


def _layer_spec(layer: Any) -> dict[str, Any]:
    """A layer as ``qstack.Stack`` takes it (a GGUF's layers already are)."""
    if isinstance(layer, dict):
        return layer
    ln1, wqkv, bqkv, wo, bo, ln2, wgu, bgu, wd, bd = layer
    return {"ln1": ln1, "ln2": ln2, "qkv": [(wqkv, bqkv)], "o": (wo, bo)} | {
        "gu": [(wgu, bgu)],
        "down": (wd, bd),
    }


__all__ = ["LeanRunner", "from_model_folder"]
