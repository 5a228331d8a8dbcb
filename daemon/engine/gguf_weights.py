"""A GGUF file's weights as the lean runner reads them: block matrices kept in their blocks.

Owns reading a GGUF (its own small parser: header, metadata scalars, the tensor table; the
``gguf`` package's reader parses every token of the vocabulary into Python objects first,
slow for a large vocabulary), the model's shape from the metadata (or from the HF
``config.json`` the model cache wrote beside it), and :func:`load`: every matrix as a
:class:`~codespec.daemon.engine.quant_gemm.QuantMatrix` of its own blocks, norms and biases
fp32. Nothing is dequantized: the embedding is looked up by widening the rows asked for.

llama.cpp's converter permutes the rows of q and k for the ``llama`` architecture (pairs
of RoPE dimensions interleaved); transformers un-permutes them when it loads a GGUF
(``modeling_gguf_pytorch_utils.LlamaTensorProcessor``), and so does :func:`load`: for
row-wise block formats that is a reorder of whole rows of blocks. q, k and v (and gate
and up) are fused into one matrix when their block types agree (one product, one
thread split). Which files qualify: :func:`unsupported` says why one does not (a block
type the kernel lacks, an architecture or RoPE the lean runner does not run).

It knows nothing about runners, tokenizers or the engine.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from codespec.daemon.engine import quant_gemm

GGUF_MAGIC = b"GGUF"
# GGML type id -> name, and name -> (values per block, bytes per block), for the types this
# module reads: the floats and every block type the kernel reads.
TYPE_NAMES = {0: "F32", 1: "F16", 30: "BF16", **{i: n for n, i in quant_gemm.QTYPES.items()}}
SIZES = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), **quant_gemm.BLOCKS}
ARCHITECTURES = ("llama", "qwen2")
# metadata value types: fixed-size scalars (struct format), 8 string, 9 array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_SCALARS[12] = "d"


class GGUFError(ValueError):
    """Not a GGUF this module can read, or one the lean runner cannot run as it is."""


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: shape[0] is the inner (k) dimension
    type_id: int
    offset: int  # absolute, in the file

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.type_id, f"type {self.type_id}")

    @property
    def nbytes(self) -> int:
        per, size = SIZES[self.type_name]
        return int(np.prod(self.shape)) // per * size


@dataclass
class GGUFFile:
    """A parsed GGUF: metadata scalars (arrays are skipped, their lengths kept) and tensors,
    their bytes read from a memory map of the file."""

    path: Path
    meta: dict[str, Any]
    tensors: dict[str, TensorInfo]
    _map: mmap.mmap = field(repr=False)

    def raw(self, name: str) -> np.ndarray:
        """A tensor's bytes (a view of the map)."""
        t = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def floats(self, name: str) -> torch.Tensor:
        """An F32 / F16 / BF16 tensor as fp32, shape reversed (rows first)."""
        t = self.tensors[name]
        raw = self.raw(name)
        if t.type_name == "F32":
            arr = raw.view(np.float32).astype(np.float32)
        elif t.type_name == "F16":
            arr = raw.view(np.float16).astype(np.float32)
        elif t.type_name == "BF16":
            arr = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise GGUFError(f"{name} is {t.type_name}, not a float tensor")
        return torch.from_numpy(arr.copy()).reshape(tuple(reversed(t.shape)))

    def drop(self, name: str | None = None) -> None:
        """Take a tensor's pages (None: the whole file's) out of this process once its bytes
        are copied: the map's file pages count in its resident memory while they stay
        mapped in; a later read maps them in again from the page cache."""
        t = self.tensors[name] if name is not None else None
        start = t.offset // mmap.PAGESIZE * mmap.PAGESIZE if t else 0
        end = t.offset + t.nbytes if t else len(self._map)
        with contextlib.suppress(AttributeError, OSError, ValueError):  # no madvise here:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)  # they stay mapped


def _read_string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    return bytes(buf[pos : pos + n]).decode("utf-8", "replace"), pos + n


def _skip_array(buf: memoryview, pos: int, kind: int, count: int) -> int:
    if kind in _SCALARS:
        return pos + count * struct.calcsize("<" + _SCALARS[kind])
    if kind != 8:
        raise GGUFError(f"unsupported GGUF array item type {kind}")
    unpack = struct.Struct("<Q").unpack_from
    for _ in range(count):
        pos += 8 + unpack(buf, pos)[0]
    return pos


def _read_value(buf: memoryview, pos: int, kind: int) -> tuple[Any, int]:
    if kind in _SCALARS:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if kind == 8:
        return _read_string(buf, pos)
    if kind == 9:
        item, count = struct.unpack_from("<IQ", buf, pos)
        return ("array", count), _skip_array(buf, pos + 12, item, count)
    raise GGUFError(f"unsupported GGUF value type {kind}")


def read(path: str | Path) -> GGUFFile:
    """Parse ``path``'s header, metadata and tensor table (version 2 or 3)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise GGUFError(f"cannot read {path}: {exc}") from None
    buf = memoryview(mm)
    try:
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported")
        pos, meta = 24, {}
        for _ in range(n_kv):
            key, pos = _read_string(buf, pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            meta[key], pos = _read_value(buf, pos + 4, kind)
        infos = []
        for _ in range(n_tensors):
            name, pos = _read_string(buf, pos)
            (ndim,) = struct.unpack_from("<I", buf, pos)
            shape = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
            type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
            pos += 4 + 8 * ndim + 12
            infos.append((name, tuple(int(s) for s in shape), int(type_id), int(offset)))
    except struct.error:
        raise GGUFError(f"{path} is truncated") from None
    finally:
        buf.release()
    align = int(meta.get("general.alignment", 32))
    start = (pos + align - 1) // align * align
    tensors = {n: TensorInfo(n, s, t, start + o) for n, s, t, o in infos}
    for t in tensors.values():
        if t.type_name in SIZES and t.offset + t.nbytes > len(mm):
            raise GGUFError(f"{path} is truncated ({t.name} ends past the file)")
    return GGUFFile(path, meta, tensors, mm)


def config_from_meta(g: GGUFFile) -> SimpleNamespace:
    """An HF-style config (the attributes the lean runner reads) from GGUF metadata."""
    arch = str(g.meta.get("general.architecture", "?"))
    if arch not in ARCHITECTURES:
        raise GGUFError(f"architecture {arch!r} (the lean runner reads {', '.join(ARCHITECTURES)})")

    def get(key: str, default: Any = None) -> Any:
        v = g.meta.get(f"{arch}.{key}", default)
        if v is None:
            raise GGUFError(f"{g.path.name} lacks {arch}.{key}")
        return v

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tokens = g.meta.get("tokenizer.ggml.tokens")
    vocab = g.meta.get(f"{arch}.vocab_size") or (tokens[1] if tokens else None)
    if vocab is None:
        vocab = g.tensors["token_embd.weight"].shape[1]
    scaling = str(g.meta.get(f"{arch}.rope.scaling.type", "none"))
    return SimpleNamespace(
        model_type=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=hidden // heads,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_parameters={
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "rope_type": "default" if scaling in ("none", "") else scaling,
        },
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in g.tensors,
        hidden_act="silu",
    )


def config_from_json(path: str | Path) -> SimpleNamespace:
    """An HF ``config.json`` as a plain namespace (no transformers import: a faster start)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    data.setdefault("hidden_act", "silu")
    data.setdefault("tie_word_embeddings", False)
    data.setdefault("head_dim", None)
    data.setdefault("max_position_embeddings", 2048)
    return SimpleNamespace(**data)


def _matrix_names(i: int) -> list[str]:
    b = f"blk.{i}."
    return [b + n for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate")] + [
        b + "ffn_up",
        b + "ffn_down",
    ]


def unsupported(g: GGUFFile, config: Any) -> str | None:
    """Why the lean runner cannot run ``g`` from its blocks (None: it can)."""
    arch = str(g.meta.get("general.architecture", "?"))
    if arch not in ARCHITECTURES:
        return f"architecture {arch!r} is not one of {', '.join(ARCHITECTURES)}"
    if quant_gemm.library() is None:
        return f"the quantized kernel is unavailable: {quant_gemm.unavailable_reason()}"
    names = ["token_embd.weight"] + (["output.weight"] if "output.weight" in g.tensors else [])
    for i in range(int(config.num_hidden_layers)):
        names += [n + ".weight" for n in _matrix_names(i)]
    for n in names:
        t = g.tensors.get(n)
        if t is None:
            return f"tensor {n} is missing"
        if t.type_name not in quant_gemm.QTYPES:
            return f"{n} is {t.type_name} (the kernel reads {', '.join(quant_gemm.QTYPES)})"
    return None


def _llama_rows(n: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation (transformers' reverse)."""
    dim = n // heads // 2
    return np.arange(n).reshape(heads, dim, 2).swapaxes(1, 2).reshape(-1)


@dataclass
class GGUFWeights:
    """What :func:`load` gives: per layer a dict of ``ln1``, ``ln2`` (fp32), ``qkv`` and
    ``gu`` (lists of ``(QuantMatrix, bias or None)``, one entry when fused), ``o``,
    ``down`` (one pair each); ``embed`` and ``head`` (the same object when tied)."""

    config: Any
    embed: quant_gemm.QuantMatrix
    head: quant_gemm.QuantMatrix
    norm: torch.Tensor
    layers: list[dict[str, Any]]
    path: Path


def _rows_of(g: GGUFFile, name: str) -> tuple[np.ndarray, str, int, int]:
    t = g.tensors[name]
    k, n = t.shape
    return g.raw(name).reshape(n, -1), t.type_name, n, k


def _group(g: GGUFFile, names: list[str], perms: list[np.ndarray | None], bias: list[str]):
    """``[(QuantMatrix, bias)]``: one fused matrix when the types agree, else one each."""
    parts = []
    for name, perm in zip(names, perms, strict=True):
        rows, kind, n, k = _rows_of(g, name + ".weight")
        parts.append((rows if perm is None else rows[perm], kind, n, k))
    biases = [g.floats(b) if b in g.tensors else None for b in bias] or [None] * len(names)
    if len({p[1] for p in parts}) == 1:
        rows = np.concatenate([p[0] for p in parts])
        b = None
        if any(x is not None for x in biases):
            zeros = [torch.zeros(p[2]) for p in parts]
            b = torch.cat([x if x is not None else z for x, z in zip(biases, zeros, strict=True)])
        qm = quant_gemm.QuantMatrix.from_bytes(rows, parts[0][1], rows.shape[0], parts[0][3])
        out = [(qm, b)]
    else:
        out = [
            (quant_gemm.QuantMatrix.from_bytes(r, kind, n, k), b)
            for (r, kind, n, k), b in zip(parts, biases, strict=True)
        ]
    for name in names:
        g.drop(name + ".weight")
    return out


def load(g: GGUFFile, config: Any) -> GGUFWeights:
    """Every weight of ``g`` as the lean runner holds it (see the module docstring). Each
    matrix's file pages leave the process once they are copied into its panels, so the
    file and the panels are never resident together (:meth:`GGUFFile.drop`)."""
    why = unsupported(g, config)
    if why:
        raise GGUFError(f"{g.path.name}: {why}")
    heads, kv = int(config.num_attention_heads), int(config.num_key_value_heads)
    llama = g.meta.get("general.architecture") == "llama"
    layers = []
    for i in range(int(config.num_hidden_layers)):
        b = f"blk.{i}."
        q_rows, k_rows = (g.tensors[b + n + ".weight"].shape[1] for n in ("attn_q", "attn_k"))
        perms = [_llama_rows(q_rows, heads), _llama_rows(k_rows, kv), None] if llama else [None] * 3
        qkv = [b + "attn_q", b + "attn_k", b + "attn_v"]
        layers.append(
            {
                "ln1": g.floats(b + "attn_norm.weight"),
                "ln2": g.floats(b + "ffn_norm.weight"),
                "qkv": _group(g, qkv, perms, [n + ".bias" for n in qkv]),
                "o": _group(g, [b + "attn_output"], [None], [b + "attn_output.bias"])[0],
                "gu": _group(g, [b + "ffn_gate", b + "ffn_up"], [None, None], []),
                "down": _group(g, [b + "ffn_down"], [None], [b + "ffn_down.bias"])[0],
            }
        )
    embed = quant_gemm.QuantMatrix.from_bytes(*_rows_of(g, "token_embd.weight"))
    g.drop("token_embd.weight")
    head = embed
    if "output.weight" in g.tensors:
        head = quant_gemm.QuantMatrix.from_bytes(*_rows_of(g, "output.weight"))
    g.drop()  # also the pages that reading the norms faulted in around them
    return GGUFWeights(config, embed, head, g.floats("output_norm.weight"), layers, g.path)


__all__ = [
    "GGUFError",
    "GGUFFile",
    "GGUFWeights",
    "config_from_json",
    "config_from_meta",
    "load",
    "read",
    "unsupported",
]
