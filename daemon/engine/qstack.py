"""The lean runner's decoder stack in one C++ call: ``csrc/stack.cpp`` (+ ``lean_ops.inc.cpp``),
built into the quantized kernel's library (:mod:`~codespec.daemon.engine.quant_gemm`).

Owns the ctypes descriptors of a model's weights (GGUF block matrices, ``cpu_gemm``
panels, norms, RoPE tables), the KV cache layout the stack reads and writes (per layer:
K as fp16 tiles ``(KV, S_max / 16, D, 16)``, then V as fp16 rows ``(KV, S_max, Dp)``,
Dp = D rounded up to 16; with bf16 attention the same bytes hold bf16 in pairs, see
``csrc/stack.cpp``; see :func:`cache`), the two calls: :meth:`Stack.forward`
and :meth:`Stack.keep`, and the flag that stops a forward between layers
(:class:`Interrupt`). It knows nothing about files, tokenizers or the cache verbs'
bookkeeping (the runner keeps the length).

Why one call: run from Python, a decode step of a 30-layer model makes over a dozen
torch / ctypes calls a layer, whose dispatch costs as much as the products themselves.

Exactness (the C++ file says how): every row of a forward equals, bit for bit, the
one-token forward at its place (decode rows equal verify rows, chain or tree), on every
ISA (``CODESPEC_QGEMM_ISA`` picks the stack's path as it does the products') and thread
count. Attention (:data:`ATTENTION`): ``fp32`` products over an fp16 cache, or ``bf16``:
q, k, v and the softmax weights rounded to bf16, their products exact in fp32 and summed
in fp32 in the order of AVX512-BF16's ``vdpbf16ps`` (that instruction where the CPU has
it, half the instructions of the fp32 path; two FMAs elsewhere, the same numbers).
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import torch

from codespec.daemon.engine import cpu_gemm, quant_gemm

c_i32, c_i64, c_ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
PANEL_KINDS = {torch.float32: -1, torch.float16: -2, torch.bfloat16: -3}
MAX_HEAD_DIM = 256
ATTENTION = {"fp32": 0, "bf16": 1}  # the stack's Model::att


class Mat(ctypes.Structure):
    _fields_ = [("kind", c_i32), ("pad", c_i32), ("p", c_ptr), ("n", c_i64), ("k", c_i64)]
    _fields_ += [("bias", c_ptr)]


class Layer(ctypes.Structure):
    _fields_ = [("ln1", c_ptr), ("ln2", c_ptr), ("nqkv", c_i64), ("qkv", Mat * 3), ("o", Mat)]
    _fields_ += [("ngu", c_i64), ("gu", Mat * 2), ("down", Mat)]


class Model(ctypes.Structure):
    _fields_ = [
        (name, c_i64)
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab")
    ]
    _fields_ += [("rope_len", c_i64), ("eps", ctypes.c_float), ("int8", c_i32)]
    _fields_ += [("att", c_i32), ("pad", c_i32)]
    _fields_ += [("norm", c_ptr), ("cos", c_ptr), ("sin", c_ptr), ("embed", Mat), ("head", Mat)]
    _fields_ += [("layer", ctypes.POINTER(Layer)), ("gemm", c_ptr * 3)]


class Fwd(ctypes.Structure):
    _fields_ = [(n, c_i64) for n in ("T", "past", "s_max", "first", "threads", "ntaps")]
    _fields_ += [("isa", c_i32), ("stop", c_i32)]
    _fields_ += [(n, c_ptr) for n in ("ids", "pos", "anc", "kv", "taps", "hidden", "logits")]
    _fields_ += [("best", c_ptr), ("interrupt", c_ptr)]


INTERRUPTED = -4  # cs_lean_forward's code for a forward stopped by its interrupt flag


class Interrupt:
    """A flag that stops a forward between layers (Fwd::interrupt): :meth:`set` from any
    thread while a forward given it runs (a request came in behind a warm-up), and the
    forward stops after the layer in progress, leaving the cache as it was before it."""

    def __init__(self) -> None:
        self._flag = ctypes.c_int32(0)

    def set(self) -> None:
        self._flag.value = 1

    def clear(self) -> None:
        self._flag.value = 0

    def is_set(self) -> bool:
        return bool(self._flag.value)

    @property
    def address(self) -> int:
        return ctypes.addressof(self._flag)


class Interrupted(RuntimeError):
    """A forward stopped by its :class:`Interrupt` (nothing it computed is kept)."""


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(torch.float32).contiguous()


def is_matrix(w: Any) -> bool:
    """A weight the stack multiplies by: a QuantMatrix or cpu_gemm panels (3-D)."""
    if isinstance(w, quant_gemm.QuantMatrix):
        return True
    return isinstance(w, torch.Tensor) and w.dim() == 3 and w.dtype in PANEL_KINDS


def _mat(w: Any, bias: torch.Tensor | None, keep: list) -> Mat:
    b = _f32(bias)
    keep.append(b)
    if isinstance(w, quant_gemm.QuantMatrix):
        return Mat(w.ggml_type, 0, w.panels.data_ptr(), w.n, w.k, _ptr(b))
    if not is_matrix(w):
        raise ValueError(f"the stack multiplies by QuantMatrix or panels, not {type(w)}")
    npanel, k, _ = w.shape
    return Mat(PANEL_KINDS[w.dtype], 0, w.data_ptr(), npanel * cpu_gemm.PANEL, k, _ptr(b))


def _embed_mat(e: Any, keep: list) -> Mat:
    if isinstance(e, quant_gemm.QuantMatrix):
        return _mat(e, None, keep)
    if not isinstance(e, torch.Tensor) or e.dim() != 2 or e.dtype not in PANEL_KINDS:
        raise ValueError("the embedding must be a QuantMatrix or a 2-D fp32/fp16/bf16 table")
    e = e.contiguous()
    keep.append(e)
    return Mat(PANEL_KINDS[e.dtype], 0, e.data_ptr(), e.shape[0], e.shape[1], None)


def native_bf16(isa: str | None = None) -> bool:
    """Whether bf16 attention on the ``isa`` path (default: the products' default) runs on
    the CPU's own bf16 dot products (AVX512-BF16, and not turned off by
    ``CODESPEC_BF16_DOTS=emulate``), not the FMAs that stand in for them."""
    lib = quant_gemm.library()
    if lib is None or quant_gemm.ISAS[isa or quant_gemm.default_isa()] < 2:
        return False
    return lib.cs_lean_bf16_native(-1) == 1


def argmax_rows(
    logits: torch.Tensor, threads: int | None = None, isa: str | None = None
) -> list[int] | None:
    """``logits.argmax(-1).tolist()`` for 2-D fp32 CPU logits with contiguous rows, by the
    stack's one-pass argmax on the ``isa`` path (``csrc/stack.cpp``: the first NaN, else
    the first largest, as torch); None where the kernel is not loaded or the tensor is
    another kind."""
    lib = quant_gemm.library()
    if (
        lib is None
        or logits.dim() != 2
        or logits.dtype != torch.float32
        or logits.device.type != "cpu"
        or logits.stride(1) != 1
        or logits.shape[0] == 0
    ):
        return None
    rows, n = logits.shape
    out = (c_i64 * rows)()
    code = quant_gemm.ISAS[isa or quant_gemm.default_isa()]
    threads = max(1, int(threads or torch.get_num_threads()))
    lib.cs_lean_argmax(logits.data_ptr(), rows, n, logits.stride(0), out, threads, code)
    return list(out)


def head_dim_padded(d: int) -> int:
    return (d + 15) // 16 * 16


def cache_rows(max_length: int) -> int:
    """Rows of the cache (``max_length`` rounded up to whole tiles of 16 keys)."""
    return (max_length + 15) // 16 * 16


def cache(layers: int, kv_heads: int, head_dim: int, max_length: int) -> torch.Tensor:
    """A zeroed 16-bit KV cache for the stack: ``(layers, KV * S_max * (D + Dp))`` (typed
    fp16; a bf16-attention stack keeps bf16 bits in it, in its own layout).

    An anonymous memory map, not zeros written: its pages are the system's zero page
    until the stack writes them, so a cache costs the memory its cached tokens fill (23
    KB a token on SmolLM2-135M), not its whole length's (~190 MB at 8,192 tokens),
    which lets the engine keep several (``limits.kv_slots``). Each head's keys and
    values fill from their start. (``torch.zeros`` writes every page; numpy's zeroed
    arrays ask for huge pages, 2 MB a touch.) The tensor keeps the map alive."""
    s_max = cache_rows(max_length)
    per_layer = kv_heads * s_max * (head_dim + head_dim_padded(head_dim))
    buf = mmap.mmap(-1, max(1, layers * per_layer) * 2)
    return torch.frombuffer(buf, dtype=torch.float16)[: layers * per_layer].view(layers, per_layer)


class Stack:
    """A model's weights as the C++ stack reads them (references kept alive here).

    ``layers``: per layer a dict with ``ln1``, ``ln2`` (fp32 (H,)), ``qkv`` and ``gu``
    (lists of ``(matrix, bias)``: one fused entry, or q, k, v / gate, up side by side),
    ``o`` and ``down`` (one ``(matrix, bias)`` each). ``cos`` / ``sin``: (positions, D)
    fp32 RoPE tables (``sin`` with its first half negated, as the runner builds them).
    ``int8``: block products by ``cs_qgemm_i8`` (x rounded to int8 per 32, llama.cpp's
    way: faster, not exact; its rows too are independent of the other rows).
    ``attention``: ``fp32`` (default) or ``bf16`` (:data:`ATTENTION`); it fixes the
    cache's layout, so a cache serves the stacks of one attention only.
    """

    def __init__(self, cfg: dict[str, Any], layers: list[dict[str, Any]], norm, embed, head):
        lib = quant_gemm.library()
        if lib is None:
            raise RuntimeError(f"the stack is unavailable: {quant_gemm.unavailable_reason()}")
        self.lib = lib
        keep: list = []
        self._keep = keep
        self.dims = dict(cfg)
        d = int(cfg["head_dim"])
        if head_dim_padded(d) > MAX_HEAD_DIM or int(cfg["heads"]) % int(cfg["kv_heads"]):
            raise ValueError(f"the stack runs head dims up to {MAX_HEAD_DIM} and whole groups")
        self.attention = str(cfg.get("attention", "fp32"))
        if self.attention not in ATTENTION:
            raise ValueError(f"attention is one of {sorted(ATTENTION)}, not {self.attention!r}")
        if self.attention == "bf16" and d % 2:
            raise ValueError("bf16 attention needs an even head dim")
        descs = (Layer * len(layers))()
        for i, spec in enumerate(layers):
            desc = descs[i]
            ln1, ln2 = _f32(spec["ln1"]), _f32(spec["ln2"])
            keep += [ln1, ln2]
            desc.ln1, desc.ln2 = ln1.data_ptr(), ln2.data_ptr()
            if not 1 <= len(spec["qkv"]) <= 3 or not 1 <= len(spec["gu"]) <= 2:
                raise ValueError("qkv takes 1 to 3 matrices, gate/up 1 or 2")
            desc.nqkv, desc.ngu = len(spec["qkv"]), len(spec["gu"])
            for j, (w, b) in enumerate(spec["qkv"]):
                desc.qkv[j] = _mat(w, b, keep)
            for j, (w, b) in enumerate(spec["gu"]):
                desc.gu[j] = _mat(w, b, keep)
            desc.o = _mat(*spec["o"], keep)
            desc.down = _mat(*spec["down"], keep)
        cos, sin, norm = _f32(cfg["cos"]), _f32(cfg["sin"]), _f32(norm)
        keep += [descs, cos, sin, norm]
        gemm = (c_ptr * 3)()
        if cpu_gemm.library() is not None:
            g = cpu_gemm.library()
            for j, fn in enumerate((g.cs_gemm, g.cs_gemm_h, g.cs_gemm_b)):
                gemm[j] = ctypes.cast(fn, c_ptr).value
        self.model = Model(
            len(layers),
            int(cfg["hidden"]),
            int(cfg["heads"]),
            int(cfg["kv_heads"]),
            d,
            int(cfg["inter"]),
            int(cfg["vocab"]),
            cos.shape[0],
            float(cfg["eps"]),
            int(bool(cfg.get("int8", False))),
            ATTENTION[self.attention],
            0,
            norm.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            _embed_mat(embed, keep),
            _mat(head, None, keep),
            descs,
            gemm,
        )

    def forward(
        self,
        kv: torch.Tensor,
        past: int,
        ids: list[int],
        pos: list[int] | None = None,
        anc: torch.Tensor | None = None,
        taps: tuple[int, ...] = (),
        first: int = 0,
        threads: int | None = None,
        isa: str | None = None,
        stop: bool = False,
        interrupt: Interrupt | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """Append ``ids`` after ``past`` cached tokens of ``kv``; logits of rows ``first..``
        ``(T - first, V)``, the taps ``(T, len(taps), H)`` (None without taps) and each
        logit row's argmax (torch's choice; each thread scans the columns it computed).
        ``pos``: positions (default ``past .. past + T``); ``anc``: (T, T) bool, token t
        sees new token j (None: a chain). ``stop`` (a chain or tree verified greedily,
        ``first`` 0): the logits stop after the row where greedy verification's walk ends
        (give or take the rest of its chunk of rows): only the rows computed come back.
        ``interrupt``: once set, the forward stops between layers and raises
        :class:`Interrupted` (its rows' keys in ``kv`` are then not to be read)."""
        stop = bool(stop and first == 0 and len(ids) > 1)
        m, n = self.model, len(ids)
        ids_t = torch.tensor(ids, dtype=torch.int64)
        pos_t = torch.arange(past, past + n) if pos is None else torch.tensor(pos)
        anc_t = None if anc is None else anc.to(torch.uint8).contiguous()
        taps_t = torch.tensor(taps, dtype=torch.int64) if taps else None
        hidden = torch.empty((n, len(taps), m.hidden), dtype=torch.float32) if taps else None
        logits = torch.empty((n - first, m.vocab), dtype=torch.float32)
        best = (c_i64 * max(1, n - first))()
        s_max = kv.shape[1] // (m.kv_heads * (m.head_dim + head_dim_padded(m.head_dim)))
        f = Fwd(
            n,
            past,
            s_max,
            first,
            max(1, int(threads or torch.get_num_threads())),
            len(taps),
            quant_gemm.ISAS[isa or quant_gemm.default_isa()],
            int(stop),
            ids_t.data_ptr(),
            pos_t.data_ptr(),
            _ptr(anc_t),
            kv.data_ptr(),
            _ptr(taps_t),
            _ptr(hidden),
            logits.data_ptr() if n > first else None,
            ctypes.addressof(best) if n > first else None,
            interrupt.address if interrupt is not None else None,
        )
        rc = self.lib.cs_lean_forward(ctypes.byref(m), ctypes.byref(f))
        if rc == INTERRUPTED and interrupt is not None:
            raise Interrupted("the forward was interrupted")
        if rc < 0 or (rc > 0 and not stop):
            raise RuntimeError(f"the decoder stack refused the forward (code {rc})")
        rows = rc if stop else n - first
        return (logits[:rc] if stop else logits), hidden, list(best[:rows])

    def keep(self, kv: torch.Tensor, base: int, indices: list[int]) -> None:
        """Rows ``base + indices[j]`` become rows ``base + j`` in every layer."""
        m = self.model
        idx = torch.tensor(indices, dtype=torch.int64)
        s_max = kv.shape[1] // (m.kv_heads * (m.head_dim + head_dim_padded(m.head_dim)))
        self.lib.cs_lean_keep(
            kv.data_ptr(),
            m.layers,
            m.kv_heads,
            s_max,
            m.head_dim,
            base,
            idx.data_ptr(),
            len(idx),
            m.att,
        )


__all__ = [
    "Interrupt",
    "Interrupted",
    "Stack",
    "cache",
    "cache_rows",
    "head_dim_padded",
    "is_matrix",
    "native_bf16",
]
