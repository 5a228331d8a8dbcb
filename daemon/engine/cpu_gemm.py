"""Small-batch fp32 kernels on the CPU: the C++ code in ``csrc/gemm.cpp``.

Three kernels: :func:`mm` (products of a few rows with packed weights), :func:`attention`
(a decode step's grouped-query attention over the KV cache, reading it once) and
:func:`rms_norm` (torch's spends more on dispatch than on one row's arithmetic).

Owns when that kernel is built (once per machine, with the system C++ compiler, into
:func:`.native.kernel_dir`; :mod:`.native` builds and loads it), the packed weight layout it
reads, and the calls the lean runner and the EAGLE head make (:func:`linear`,
:func:`norm`, :func:`attention`). It must not know anything about models:
callers hand it plain tensors.

Why it exists: on this project's CPUs (AMD EPYC, torch's MKL, fp32) a product with
2 to 8 rows costs MKL about that many times a one-row product, so verifying a
draft of k tokens costs nearly k decode steps and speculation cannot pay. The
kernel reads each weight panel once for up to four rows and so costs about one
row's time for M <= 4 (``codespec bench runner``; the figures are in BENCHMARKS.md).
Each output is summed in the same order whatever the number of rows, so a
product's rows equal, bit for bit, what one-row calls give.

Threads: products of at least :data:`THREADED_ROWS` rows or :data:`THREADED_WEIGHTS`
weights (every weight matrix of a model) are split by output panels over OpenMP
threads (``torch.get_num_threads()`` of them). The library is
built with ``-fopenmp`` and loaded after torch, whose bundled ``libgomp.so.1``
then serves it too: one thread pool for both, no oversubscription.

When the kernel cannot be used (not x86-64 with AVX2 and FMA, no compiler, a
failed build, ``CODESPEC_CPU_KERNELS=0``) :func:`library` returns ``None``,
:func:`unavailable_reason` says why, and the runner keeps torch's products.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from codespec.native import NativeLibrary

SOURCE = Path(__file__).parent / "csrc" / "gemm.cpp"
PANEL = 16  # output columns per packed panel (two AVX2 vectors)
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-shared", "-fPIC", "-fopenmp"]
# From this many rows on, a product is split across torch's threads (its OpenMP pool):
# at 2 threads, verification forwards of 8 and 16 tokens run faster split from 8 rows
# on than from 32.
THREADED_ROWS = 8
# Products with at least this many weights are split across the threads whatever their
# rows: a decode step streams its weights from memory, and two cores stream faster than
# one. A threshold that splits every layer's matrices, not only the LM head (2^21 would),
# makes decode steps and small verifications faster.
THREADED_WEIGHTS = 1 << 16

_products: dict[torch.dtype, Callable[..., None]] = {}  # panel dtype -> the kernel's product


@functools.cache
def _cpuinfo() -> str:
    """``/proc/cpuinfo``'s text, read once (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as ``/proc/cpuinfo`` names them (empty where it cannot be
    read); read once."""
    return parse_flags(_cpuinfo())


def cpu_name() -> str:
    """The CPU's model name as ``/proc/cpuinfo`` gives it, else the platform's."""
    line = next((ln for ln in _cpuinfo().splitlines() if ln.startswith("model name")), "")
    return line.partition(":")[2].strip() or platform.processor() or platform.machine()


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of ``/proc/cpuinfo``'s text (its first ``flags`` line; empty
    without one: not x86 Linux)."""
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def _precheck() -> str | None:
    """Why the kernel must not be built here (switched off, not x86-64 with AVX2, FMA and
    F16C), or None."""
    if os.environ.get("CODESPEC_CPU_KERNELS", "1") == "0":
        return "switched off by CODESPEC_CPU_KERNELS=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernel is x86-64 only (this is {platform.machine()})"
    missing = {"avx2", "fma", "f16c"} - cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    return None


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.cs_gemm.restype = None
    lib.cs_gemm.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64]
    for narrow in (lib.cs_gemm_h, lib.cs_gemm_b):
        narrow.restype = None
        narrow.argtypes = lib.cs_gemm.argtypes
    lib.cs_gemm_version.restype = ctypes.c_int
    lib.cs_attention.restype = None
    lib.cs_attention.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, i64, i64, ptr]
    lib.cs_attention.argtypes += [ctypes.c_float, ptr, ptr]
    lib.cs_rmsnorm.restype = None
    lib.cs_rmsnorm.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_float, ptr, i64]
    _products.update(
        {torch.float32: lib.cs_gemm, torch.float16: lib.cs_gemm_h, torch.bfloat16: lib.cs_gemm_b}
    )


_KERNEL = NativeLibrary(
    "gemm", [SOURCE], FLAGS, _declare, timeout=120, precheck=_precheck, label="the CPU kernel"
)


# The loaded kernel, built on first use (None when it cannot be used); why not; the
# kernel or a RuntimeError saying why.
library = _KERNEL.library
unavailable_reason = _KERNEL.unavailable_reason
_required = _KERNEL.required


PANEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def packable(w: torch.Tensor) -> bool:
    """Whether ``w`` (in, out) can be packed: fp32, fp16 or bf16 on the CPU, ``out`` a
    multiple of 16."""
    on_cpu = w.dtype in PANEL_DTYPES and w.device.type == "cpu"
    return on_cpu and w.dim() == 2 and w.shape[1] % PANEL == 0


def narrow_dtype(w: torch.Tensor) -> torch.dtype:
    """The 16-bit type that holds every value of ``w`` unchanged (fp16 first, then bf16:
    weights read from an fp16 or a bf16 checkpoint), else fp32. Panels of that type give
    the very same products for half the bytes."""
    for dtype in (torch.float16, torch.bfloat16):
        if w.dtype == dtype or torch.equal(w.to(dtype).to(w.dtype), w):
            return dtype
    return torch.float32


def pack(w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(in, out)`` weights to panels ``(out / 16, in, 16)`` of ``dtype``: each panel
    contiguous.

    fp16 and bf16 panels halve the bytes every product streams; the kernel widens them
    to fp32 exactly, so the products equal fp32 panels of ``w.to(dtype)``.
    """
    if not packable(w) or dtype not in PANEL_DTYPES:
        raise ValueError(f"cannot pack a {tuple(w.shape)} {w.dtype} tensor on {w.device}")
    k, n = w.shape
    w = w.to(dtype)
    return w.reshape(k, n // PANEL, PANEL).permute(1, 0, 2).contiguous()


def unpack(p: torch.Tensor) -> torch.Tensor:
    """Panels back to ``(in, out)``."""
    npanel, k, _ = p.shape
    return p.permute(1, 0, 2).reshape(k, npanel * PANEL)


def mm(
    x: torch.Tensor,
    p: torch.Tensor,
    bias: torch.Tensor | None = None,
    res: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """``x @ W (+ bias) (+ res)`` for packed ``W``: x ``(M, in)``, result ``(M, out)``.

    The sum over ``in`` comes first, then ``bias``, then ``res`` (all fp32).
    ``threads`` defaults to torch's intra-op threads for ``M >= THREADED_ROWS`` or at least
    ``THREADED_WEIGHTS`` weights, else 1.
    """
    _required()  # loads the kernel (and _products), or says why it cannot
    npanel, k, _ = p.shape
    n = npanel * PANEL
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32:
        raise ValueError(f"x must be (M, {k}) fp32, got {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    if m == 0:
        return y
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous ({n},) tensor")
    if res is not None:
        if res.shape != (m, n):
            raise ValueError(f"res must be ({m}, {n}), got {tuple(res.shape)}")
        if res.stride(1) != 1:
            res = res.contiguous()
    if threads is None:
        big = m >= THREADED_ROWS or k * n >= THREADED_WEIGHTS
        threads = torch.get_num_threads() if big else 1
    call = _products.get(p.dtype)
    if call is None:
        raise ValueError(f"packed weights must be fp32, fp16 or bf16, got {p.dtype}")
    call(
        x.data_ptr(),
        m,
        k,
        x.stride(0),
        p.data_ptr(),
        n,
        y.data_ptr(),
        n,
        None if bias is None else bias.data_ptr(),
        None if res is None else res.data_ptr(),
        0 if res is None else res.stride(0),
        max(1, int(threads)),
    )
    return y


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of the rows of ``x`` (M, H) with weight ``w`` (H,), by the kernel."""
    lib = _required()
    if x.dim() != 2 or x.dtype != torch.float32 or w.shape != (x.shape[1],):
        raise ValueError(f"rms_norm wants (M, H) fp32 rows and an (H,) weight: {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if not w.is_contiguous():
        w = w.contiguous()
    m, h = x.shape
    y = torch.empty((m, h), dtype=torch.float32)
    lib.cs_rmsnorm(x.data_ptr(), m, h, x.stride(0), w.data_ptr(), float(eps), y.data_ptr(), h)
    return y


def norm(x: torch.Tensor, w: torch.Tensor, eps: float, kernel: bool) -> torch.Tensor:
    """RMSNorm of the rows of ``x``: by :func:`rms_norm` when ``kernel``, else torch's."""
    return rms_norm(x, w, eps) if kernel else F.rms_norm(x, (x.shape[-1],), w, eps)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: int,
    t: int,
    allowed: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Grouped-query attention of a few rows over a KV cache, by the kernel.

    ``q`` (KV, R, D), rows ``r = i * G + g`` for ``t`` new tokens (G = R / t query
    heads per kv head); ``k``, ``v`` (KV, S_max, D) caches whose rows ``0 .. past+t``
    are written. New token i sees every cached key and new key j when
    ``allowed[i, j]`` (``None``: a chain, j <= i). Returns (KV, R, D).
    """
    lib = _required()
    nkv, rows, d = q.shape
    if t < 1 or rows % t or d % 8 or d > 256 or q.dtype != torch.float32:
        raise ValueError(f"attention wants fp32 (KV, t*G, D) queries, D % 8 == 0: {q.shape}")
    if k.shape[0] != nkv or k.shape[2] != d or k.shape[1] < past + t or k.shape != v.shape:
        raise ValueError("k and v must be (KV, S_max >= past + t, D) caches matching q")
    if k.stride(2) != 1 or k.stride(1) != d or v.stride() != k.stride():
        raise ValueError("k and v must have contiguous rows of D")
    if allowed is not None:
        if allowed.shape != (t, t):
            raise ValueError(f"allowed must be ({t}, {t})")
        allowed = allowed.to(torch.uint8).contiguous()
    q = q.contiguous()
    total = past + t
    scores = torch.empty(rows * total, dtype=torch.float32)
    out = torch.empty((nkv, rows, d), dtype=torch.float32)
    lib.cs_attention(
        q.data_ptr(),
        nkv,
        rows,
        rows // t,
        d,
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        past,
        t,
        None if allowed is None else allowed.data_ptr(),
        float(d**-0.5 if scale is None else scale),
        scores.data_ptr(),
        out.data_ptr(),
    )
    return out


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    res: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w (+ bias) (+ res)``: packed panels (3-D ``w``) go to the kernel, an
    ``(in, out)`` matrix to torch (``addmm`` with the residual and bias fused), any other
    matrix object to its own ``linear(x, bias, res)``."""
    if not isinstance(w, torch.Tensor):
        return w.linear(x, bias, res)
    if w.dim() == 3:
        return mm(x, w, bias, res)
    if res is not None:
        return torch.addmm(res if bias is None else res + bias, x, w)
    return x @ w if bias is None else torch.addmm(bias, x, w)


def maybe_pack(w: torch.Tensor, use: bool, half: bool = False) -> torch.Tensor:
    """``pack(w)`` when ``use`` and it can be packed, else ``w`` unchanged (for
    :func:`linear`). ``half``: 16-bit panels where that loses nothing
    (:func:`narrow_dtype`), fp32 panels otherwise."""
    if not (use and packable(w)):
        return w
    return pack(w, narrow_dtype(w) if half else torch.float32)


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of this device and dtype can use the kernel here (builds it if needed)."""
    return device.type == "cpu" and dtype == torch.float32 and library() is not None


__all__ = [
    "PANEL",
    "attention",
    "library",
    "linear",
    "maybe_pack",
    "mm",
    "narrow_dtype",
    "norm",
    "pack",
    "packable",
    "rms_norm",
    "unavailable_reason",
    "unpack",
    "usable",
]
