"""Products with GGUF block-quantized weights on the CPU: the C++ code in ``csrc/qgemm.cpp``.

Owns the weights of one matrix in GGUF's own blocks (:class:`QuantMatrix`: Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, repacked once into 16-row panels of exactly the same
bytes, plus zero blocks for the rows that round ``n`` up to a multiple of 16), building
and loading that kernel, and the product :func:`linear` (``y = x @ W^T (+ bias) (+ res)``,
x fp32). It must not know models, nor a GGUF file's layout beyond one tensor's blocks:
callers hand it a reader tensor or raw block bytes, and plain fp32 tensors.

Exactness: the kernel widens every weight to exactly the fp32 value gguf's reference
dequantizer gives (a zero's sign aside) and sums each output over k in order with one FMA
per step, whatever the number of rows, the thread count or the ISA. So a row's result equals
the one-row product's bit for bit (what lossless speculation needs: verify rows must
equal decode rows), and the AVX-512, AVX2 and scalar paths agree bit for bit.

Dispatch: the best ISA this CPU has, AVX-512 (F/BW/VL/DQ), else AVX2+FMA+F16C, else
plain C++ (also what a non-x86 machine runs). ``CODESPEC_QGEMM_ISA=scalar|avx2|avx512``
forces one (a name this CPU lacks is an error, not a silent fallback); so does the
``isa`` argument of :func:`linear`. The library is built once with the system compiler
into :func:`codespec.native.kernel_dir`, without ``-march``: each ISA's code
carries its own target attributes (``#pragma GCC target``: g++ builds it, clang++ does
not). Its sources compile at once, ``qgemm.cpp`` cut into parts (``qgemm_*.cpp``).

:func:`linear_i8` is a separate, inexact variant (llama.cpp's way): x rounded to int8
per 32 inputs and blocks multiplied by integer dot products (AVX-512 VNNI, else AVX2).

Threads: products of at least :data:`cpu_gemm.THREADED_ROWS` rows or
:data:`cpu_gemm.THREADED_WEIGHTS` weights are split by output panels over torch's
OpenMP threads (the library is loaded after torch and shares its ``libgomp``).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from codespec.daemon.engine.cpu_gemm import THREADED_ROWS, THREADED_WEIGHTS, cpu_flags
from codespec.native import NativeLibrary

SOURCE = Path(__file__).parent / "csrc" / "qgemm.cpp"
_PARTS = ("qgemm", "qgemm_avx2", "qgemm_avx2_i8", "qgemm_avx512", "qgemm_avx512_i8", "stack")
SOURCES = tuple(SOURCE.parent / f"{n}.cpp" for n in _PARTS)  # qgemm.cpp's parts; qstack's stack
# included by stack.cpp / by qgemm.cpp (once per vector ISA; the AMX tiles' path once)
HEADERS = tuple(SOURCE.parent / f"{n}.inc.cpp" for n in ("lean_ops", "qgemm_exact", "qgemm_amx"))
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off"]
# a CPU without AVX-512F builds without the AVX-512 and AMX paths (~half the compile)
FLAGS += ["-DQG_NO_AVX512"] if cpu_flags() and "avx512f" not in cpu_flags() else []
PANEL = 16  # output rows per panel; a matrix's rows are padded with zero blocks to a multiple
ISA_ENV = "CODESPEC_QGEMM_ISA"
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}
_VNNI = 3  # the kernel's code for AVX-512 with VNNI (linear_i8 only)
# GGML type ids of the block types the kernel reads, and (k per block, bytes per block).
QTYPES = dict(Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)
BLOCKS = dict(Q4_0=(32, 18), Q4_1=(32, 20), Q5_0=(32, 22), Q5_1=(32, 24), Q8_0=(32, 34))
BLOCKS |= dict(Q4_K=(256, 144), Q5_K=(256, 176), Q6_K=(256, 210))


def _declare(lib: ctypes.CDLL) -> None:
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    for name, res, args in (
        ("cs_q_version", i32, []),
        *((n, i64, [i64]) for n in ("cs_q_prefetch_ahead", "cs_q_expand_rows")),
        *((n, i32, [i32]) for n in ("cs_q_prefetch_level", "cs_q_amx")),
        ("cs_q_isa_ok", i32, [i32]),
        ("cs_q_block_bytes", i64, [i32]),
        ("cs_q_pack", None, [i32, ptr, i64, i64, ptr]),
        ("cs_q_unpack", None, [i32, ptr, i64, i64, ptr]),
        ("cs_q_dequant", None, [i32, ptr, i64, i64, ptr, i32]),
        ("cs_q_rows", None, [i32, ptr, i64, i64, ptr, i64, ptr, i64]),
        ("cs_lean_version", i32, []),
        ("cs_lean_team_forwards", i64, []),
        ("cs_lean_att_ahead", i64, [i64]),
        ("cs_lean_att_lead", i32, [i32]),
        ("cs_lean_att_led", i64, []),
        ("cs_lean_att_gathered", i64, []),
        ("cs_lean_barrier_rounds", i64, []),
        ("cs_lean_split", ctypes.c_double, [ctypes.c_double]),
        ("cs_lean_row_share", ctypes.c_double, [ctypes.c_double]),
        ("cs_lean_split_adapt", i32, [i32]),
        ("cs_lean_row_split", i64, [i64]),
        ("cs_lean_row_forwards", i64, []),
        ("cs_lean_spin_ns", i64, [i64]),
        ("cs_lean_spin_observe", None, [i64, i64, i64, i64]),
        ("cs_lean_spin_reset", None, []),
        ("cs_lean_spin_forwards", i64, [i64]),
        ("cs_lean_spin_trips", i64, [i64]),
        ("cs_lean_spin_begin", i64, [i64, ctypes.POINTER(i32)]),
        ("cs_lean_spin_end", None, [i64, i32, i64, i64, i64]),
        ("cs_lean_spin_colds", i64, []),
        ("cs_lean_spin_cold_us", None, [ctypes.c_double]),
        ("cs_lean_forward", i32, [ptr, ptr]),
        ("cs_lean_keep", None, [ptr, i64, i64, i64, i64, i64, ptr, i64, i32]),
        ("cs_lean_bf16_native", i32, [i32]),
        ("cs_lean_argmax", i64, [ptr, i64, i64, i64, ptr, i64, i32]),
        ("cs_lean_bf16_probe", i32, [i32, i32, ptr, i64, ptr, ptr, ptr, i64, ptr]),
        ("cs_qgemm", i32, [i32, ptr, i64, i64, i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i32]),
        (
            "cs_qgemm_i8",
            i32,
            [i32, ptr, i64, i64, i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i32],
        ),
        ("cs_qgemm_i8_peak", ctypes.c_double, [i32, i64, i64, i64]),
        (
            "cs_qgemm_i8_many",
            i32,
            [i64, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i32],
        ),
    ):
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


_KERNEL = NativeLibrary(
    "qgemm",
    SOURCES,
    FLAGS,
    _declare,
    headers=HEADERS,
    timeout=300,
    label="the quantized CPU kernel",
)


# The loaded kernel, built on first use (None when it cannot be used); why not; the
# kernel or a RuntimeError saying why.
library = _KERNEL.library
unavailable_reason = _KERNEL.unavailable_reason
_required = _KERNEL.required


@functools.cache
def isa_supported(name: str) -> bool:
    """Whether this CPU runs the kernel's ``name`` path (a key of :data:`ISAS`)."""
    return bool(_required().cs_q_isa_ok(ISAS[name]))


def available_isas() -> list[str]:
    """The paths this CPU runs, best last."""
    return [name for name in ISAS if isa_supported(name)]


@functools.cache
def _resolve_isa(forced: str) -> str:
    if not forced:
        return available_isas()[-1]
    if forced not in ISAS:
        raise ValueError(f"{ISA_ENV}={forced!r}: expected one of {', '.join(ISAS)}")
    if not isa_supported(forced):
        raise RuntimeError(f"{ISA_ENV}={forced}: this CPU cannot run that path")
    return forced


def default_isa() -> str:
    """``$CODESPEC_QGEMM_ISA`` when set (it must name a path this CPU runs), else the best.
    Read on every call (tests switch it), resolved once per value."""
    return _resolve_isa(os.environ.get(ISA_ENV, "").strip().lower())


def _qtype_name(qtype: Any) -> str:
    """A block type's name from a name, a GGML type id or a ``gguf.GGMLQuantizationType``."""
    if isinstance(qtype, str):
        name = qtype.upper()
    elif hasattr(qtype, "name") and isinstance(qtype.name, str):
        name = qtype.name
    else:
        name = f"GGML type {int(qtype)}"
        try:
            import gguf

            name = gguf.GGMLQuantizationType(int(qtype)).name
        except (ImportError, ValueError):
            pass
    if name not in QTYPES:
        raise ValueError(
            f"{name} blocks are not supported by the quantized kernel "
            f"(it reads {', '.join(QTYPES)})"
        )
    return name


def _as_bytes(raw: Any) -> np.ndarray:
    if isinstance(raw, torch.Tensor):
        raw = raw.detach().cpu().contiguous().view(torch.uint8).numpy()
    elif isinstance(raw, bytes | bytearray | memoryview):
        raw = np.frombuffer(raw, dtype=np.uint8)
    return np.ascontiguousarray(np.asarray(raw).view(np.uint8).reshape(-1))


@dataclass(frozen=True)
class QuantMatrix:
    """An (n, k) weight matrix (n outputs, k inputs) in GGUF blocks of ``qtype``, held as
    16-row panels of the same bytes (``panels``: uint8, ``ceil(n / 16) * 16`` rows' worth),
    four panels interleaved group of four k by group (the layout is described in
    ``csrc/qgemm.cpp``)."""

    qtype: str
    n: int
    k: int
    panels: torch.Tensor

    @classmethod
    def from_bytes(cls, raw: Any, qtype: Any, n: int, k: int) -> QuantMatrix:
        """From GGUF's row-major blocks: ``n`` rows of ``k / block_k`` blocks each
        (bytes, a numpy array or a uint8 tensor)."""
        name = _qtype_name(qtype)
        bk, size = BLOCKS[name]
        if n <= 0 or k <= 0 or k % bk:
            raise ValueError(f"{name}: k must be a positive multiple of {bk}, got n={n}, k={k}")
        data = _as_bytes(raw)
        want = n * (k // bk) * size
        if data.size != want:
            raise ValueError(f"{name} ({n}, {k}) needs {want} bytes, got {data.size}")
        lib = _required()
        npanel = (n + PANEL - 1) // PANEL
        panels = torch.empty(npanel * (k // bk) * PANEL * size, dtype=torch.uint8)
        lib.cs_q_pack(QTYPES[name], data.ctypes.data, n, k, panels.data_ptr())
        return cls(name, n, k, panels)

    @classmethod
    def from_gguf_tensor(cls, tensor: Any) -> QuantMatrix:
        """From a ``gguf.GGUFReader`` tensor of a 2-D matrix (GGUF shape ``[k, n]``)."""
        shape = [int(s) for s in tensor.shape]
        if len(shape) != 2:
            raise ValueError(f"{tensor.name}: a 2-D matrix is needed, got shape {shape}")
        try:
            name = _qtype_name(tensor.tensor_type)
        except ValueError as e:
            raise ValueError(f"{tensor.name}: {e}") from None
        k, n = shape
        return cls.from_bytes(tensor.data, name, n, k)

    @property
    def ggml_type(self) -> int:
        return QTYPES[self.qtype]

    @property
    def block_k(self) -> int:
        return BLOCKS[self.qtype][0]

    @property
    def nbytes(self) -> int:
        """Bytes of weights held (and streamed by a product): GGUF's bytes for
        ``ceil(n / 16) * 16`` rows."""
        return self.panels.numel()

    def to_gguf_bytes(self) -> np.ndarray:
        """The GGUF blocks back, ``(n, k / block_k * block_bytes)`` uint8, byte for byte."""
        bk, size = BLOCKS[self.qtype]
        out = np.empty((self.n, self.k // bk * size), dtype=np.uint8)
        _required().cs_q_unpack(
            self.ggml_type, self.panels.data_ptr(), self.n, self.k, out.ctypes.data
        )
        return out

    def dequantize(self, isa: str | None = None) -> torch.Tensor:
        """The weights as the kernel widens them, ``(n, k)`` fp32 (for tests and tools)."""
        out = torch.empty((self.n, self.k), dtype=torch.float32)
        code = ISAS[isa or default_isa()]
        _required().cs_q_dequant(
            self.ggml_type, self.panels.data_ptr(), self.n, self.k, out.data_ptr(), code
        )
        return out

    def rows(self, ids: torch.Tensor | list[int]) -> torch.Tensor:
        """Rows ``ids`` widened to fp32, ``(len(ids), k)``: an embedding lookup from the
        blocks (ids outside ``0 .. n-1`` give zeros)."""
        idx = torch.as_tensor(ids, dtype=torch.int64).contiguous().reshape(-1)
        out = torch.empty((idx.numel(), self.k), dtype=torch.float32)
        _required().cs_q_rows(
            self.ggml_type,
            self.panels.data_ptr(),
            self.n,
            self.k,
            idx.data_ptr(),
            idx.numel(),
            out.data_ptr(),
            self.k,
        )
        return out


def _check(
    x: torch.Tensor, qm: QuantMatrix, bias: torch.Tensor | None, res: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    if x.dim() != 2 or x.shape[1] != qm.k or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be (M, {qm.k}) fp32 on the CPU, got {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        if bias.shape != (qm.n,) or bias.dtype != torch.float32:
            raise ValueError(f"bias must be ({qm.n},) fp32, got {tuple(bias.shape)} {bias.dtype}")
        bias = bias.contiguous()
    if res is not None:
        if res.shape != (x.shape[0], qm.n) or res.dtype != torch.float32:
            raise ValueError(f"res must be ({x.shape[0]}, {qm.n}) fp32, got {tuple(res.shape)}")
        if res.stride(1) != 1:
            res = res.contiguous()
    return x, bias, res


def _output(out: torch.Tensor | None, m: int, n: int) -> torch.Tensor:
    """``out`` (an (m, n) fp32 tensor with unit column stride, reused by the caller to save
    an allocation), else a new one."""
    if out is None:
        return torch.empty((m, n), dtype=torch.float32)
    if out.shape != (m, n) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be ({m}, {n}) fp32 with unit column stride")
    return out


def _threads(m: int, qm: QuantMatrix, threads: int | None) -> int:
    if threads is None:
        big = m >= THREADED_ROWS or qm.n * qm.k >= THREADED_WEIGHTS
        threads = torch.get_num_threads() if big else 1
    return max(1, int(threads))


def _product(
    fn: Any,
    x: torch.Tensor,
    qm: QuantMatrix,
    bias: torch.Tensor | None,
    res: torch.Tensor | None,
    y: torch.Tensor,
    threads: int | None,
    code: int,
) -> int:
    """Call the kernel's product ``fn`` (``cs_qgemm`` or ``cs_qgemm_i8``: the same
    arguments) for ``y = x @ W^T (+ bias) (+ res)`` on path ``code``; its return code."""
    m = x.shape[0]
    return fn(
        qm.ggml_type,
        x.data_ptr(),
        m,
        qm.k,
        x.stride(0),
        qm.panels.data_ptr(),
        qm.n,
        y.data_ptr(),
        y.stride(0),
        None if bias is None else bias.data_ptr(),
        None if res is None else res.data_ptr(),
        0 if res is None else res.stride(0),
        _threads(m, qm, threads),
        code,
    )


def linear(
    x: torch.Tensor,
    qm: QuantMatrix,
    bias: torch.Tensor | None = None,
    res: torch.Tensor | None = None,
    threads: int | None = None,
    isa: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias) (+ res)``: x ``(M, k)`` fp32, result ``(M, n)`` fp32.

    Each output is the sum over k in order (one FMA per step, weights widened exactly),
    then ``+ bias``, then ``+ res``; so row i of the result does not depend on the other
    rows, on ``threads`` or on ``isa`` (default :func:`default_isa`). ``out``: an (M, n)
    fp32 tensor to write into instead of a new one.
    """
    lib = _required()
    x, bias, res = _check(x, qm, bias, res)
    y = _output(out, x.shape[0], qm.n)  # (M, N)
    if x.shape[0] and _product(
        lib.cs_qgemm, x, qm, bias, res, y, threads, ISAS[isa or default_isa()]
    ):
        raise RuntimeError(f"the quantized kernel refused a {qm.qtype} product (isa {isa})")
    return y


_I8_CODES = {"scalar": 0, "avx2": 1, "avx512-vnni": _VNNI}


@functools.cache
def i8_isa() -> str | None:
    """The path :func:`linear_i8` takes by default: ``avx512-vnni``, ``avx2`` or ``None``
    (no integer dot products worth using; ``scalar`` remains, for tests)."""
    if library() is None:
        return None
    if _required().cs_q_isa_ok(_VNNI):
        return "avx512-vnni"
    return "avx2" if isa_supported("avx2") else None


def i8_available() -> bool:
    return i8_isa() is not None


def i8_peak_gmacs(
    threads: int, isa: str | None = None, iters: int = 200_000, rounds: int = 5
) -> float:
    """Billions of int8 multiply-adds a second that :func:`linear_i8`'s dot product
    instruction does on ``threads`` threads at once (``isa``: :func:`i8_isa` by default):
    independent chains of vpdpbusd (AVX-512 VNNI) or vpmaddubsw (AVX2) and nothing else,
    the best of ``rounds``. The products' compute floor; 0.0 without an int8 path."""
    isa = isa or i8_isa()
    if isa not in ("avx2", "avx512-vnni"):
        return 0.0
    return float(_required().cs_qgemm_i8_peak(_I8_CODES[isa], threads, iters, rounds))


def linear_i8(
    x: torch.Tensor,
    qm: QuantMatrix,
    bias: torch.Tensor | None = None,
    res: torch.Tensor | None = None,
    threads: int | None = None,
    isa: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`linear` the llama.cpp way: NOT exact. Each row of x is rounded to int8 per 32
    inputs (step max|x| / 127) and multiplied with the blocks' integer quants by integer dot
    products (AVX-512 VNNI ``vpdpbusd``, else AVX2 ``vpmaddubsw``); the block scales are
    applied per block in fp32. Its error is that of x's rounding (about 0.2-0.4% of each
    block's largest |x| per element); rows are still independent of M, ``threads`` and
    ``isa`` (``avx512-vnni``, ``avx2`` or ``scalar``; default :func:`i8_isa`).
    """
    lib = _required()
    x, bias, res = _check(x, qm, bias, res)
    chosen = isa or i8_isa()
    if chosen not in _I8_CODES:
        raise ValueError(f"linear_i8: isa must be one of {', '.join(_I8_CODES)}, got {chosen}")
    y = _output(out, x.shape[0], qm.n)  # (M, N)
    if x.shape[0] and _product(lib.cs_qgemm_i8, x, qm, bias, res, y, threads, _I8_CODES[chosen]):
        raise RuntimeError(f"linear_i8: the kernel refused a {qm.qtype} product on {chosen}")
    return y


def linear_i8_many(
    x: torch.Tensor,
    mats: Sequence[QuantMatrix],
    biases: Sequence[torch.Tensor | None] | None = None,
    threads: int | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """:func:`linear_i8` of the same x with up to 8 matrices (the same k), their outputs
    side by side in one ``(M, sum of n)`` tensor: x is rounded once and one parallel
    region shares out every matrix's panels (the lean stack's q/k/v and gate/up). Each
    matrix's columns equal :func:`linear_i8`'s for it alone, bit for bit."""
    lib = _required()
    if not 1 <= len(mats) <= 8:
        raise ValueError(f"linear_i8_many: 1 to 8 matrices, got {len(mats)}")
    if len({qm.k for qm in mats}) != 1:
        raise ValueError("linear_i8_many: the matrices' k differ")
    biases = list(biases) if biases is not None else [None] * len(mats)
    if len(biases) != len(mats):
        raise ValueError("linear_i8_many: one bias (or None) per matrix")
    checked = [_check(x, qm, b, None) for qm, b in zip(mats, biases, strict=True)]
    x = checked[0][0]
    chosen = isa or i8_isa()
    if chosen not in _I8_CODES:
        raise ValueError(f"linear_i8_many: isa must be one of {', '.join(_I8_CODES)}, got {chosen}")
    n = len(mats)
    y = torch.empty(x.shape[0], sum(qm.n for qm in mats), dtype=torch.float32)
    if not x.shape[0]:
        return y
    types = (ctypes.c_int * n)(*(qm.ggml_type for qm in mats))
    panels = (ctypes.c_void_p * n)(*(qm.panels.data_ptr() for qm in mats))
    sizes = (ctypes.c_int64 * n)(*(qm.n for qm in mats))
    bias_ptrs = (ctypes.c_void_p * n)(*(None if b is None else b.data_ptr() for _, b, _ in checked))
    rc = lib.cs_qgemm_i8_many(
        n, types, x.data_ptr(), x.shape[0], mats[0].k, x.stride(0), panels, sizes,
        y.data_ptr(), y.stride(0), bias_ptrs, None, 0,
        max(_threads(x.shape[0], qm, threads) for qm in mats), _I8_CODES[chosen],
    )  # fmt: skip
    if rc:
        raise RuntimeError(f"linear_i8_many: the kernel refused the products on {chosen}")
    return y


__all__ = [
    "ISAS",
    "ISA_ENV",
    "PANEL",
    "QTYPES",
    "QuantMatrix",
    "available_isas",
    "default_isa",
    "i8_available",
    "i8_isa",
    "isa_supported",
    "library",
    "linear",
    "linear_i8",
    "linear_i8_many",
    "unavailable_reason",
]
