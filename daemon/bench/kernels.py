"""`codespec bench kernels`: micro-benchmark of the quantized-weight products.

Owns one measurement: for SmolLM2-135M's matrix shapes (576->960
q+k+v, 576->576 o, 576->3072 gate+up, 1536->576 down in Q4_1; the 49152x576 LM head in
Q8_0; with ``--shapes``, Qwen2.5-Coder's Q5_0, Q4_K and Q6_K ones too) and rows M
in 1, 2, 4, 8, 16, the time of one product ``x @ W^T`` by

- ``gguf``: :func:`codespec.daemon.engine.quant_gemm.linear` on the GGUF blocks (exact widening);
- ``gguf-i8``: :func:`codespec.daemon.engine.quant_gemm.linear_i8` (x rounded to int8 per 32);
- ``fp32``: torch's ``F.linear`` on fp32 weights (MKL);
- ``panels-fp16``: :mod:`codespec.daemon.engine.cpu_gemm`'s fp16 panels;
- ``torch-int8``: ``torch.ops.aten._weight_int8pack_mm`` (int8 per output channel);
- ``torch-int4``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (int4, groups of 32);

printed as a table (ms per product, GB/s of the method's weight bytes at M=1, M rows'
cost relative to the first row count, and each method's relative error against a float64
product with the GGUF weights) and one final JSON line.

Weights are random (speed does not depend on values). By default each method cycles
through enough copies of each matrix (``--cold-mb`` of them) that its weights come from
memory, not cache, as they do in a decode step that streams the whole model. Methods are
interleaved within each repetition and the median of ``--reps`` is reported (fewer, at
least 3, for a method slower than ``--budget-s`` allows); each repetition times ``--calls``
consecutive products, so Python call overhead (a few microseconds) is included.

Must not touch: models, the engine, the daemon's state.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from codespec.daemon.engine import cpu_gemm, quant_gemm

# name, inputs k, outputs n, GGUF block type (SmolLM2-135M's)
SHAPES = [
    ("qkv", 576, 960, "Q4_1"),
    ("o", 576, 576, "Q4_1"),
    ("gate+up", 576, 3072, "Q4_1"),
    ("down", 1536, 576, "Q4_1"),
    ("lm_head", 576, 49152, "Q8_0"),
]
# Qwen2.5-Coder's block types (--shapes q5_0-ffn,q4k-ffn,q6k-down; not run by default):
# the 0.5B's Q5_0 gate+up, the 1.5B's Q4_K gate+up and Q6_K down
QWEN_SHAPES = [
    ("q5_0-ffn", 896, 9728, "Q5_0"),
    ("q4k-ffn", 1536, 17920, "Q4_K"),
    ("q6k-down", 8960, 1536, "Q6_K"),
]
QWEN_NAMES = ",".join(s[0] for s in QWEN_SHAPES)
ROWS = [1, 2, 4, 8, 16]
Product = Callable[[torch.Tensor, Any], torch.Tensor]


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF block bytes of ``qtype`` for an (n, k) matrix, with small fp16 scales."""
    bk, size = quant_gemm.BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(n, k // bk, size), dtype=np.uint8)
    d = (rng.random((n, k // bk, 1)) * 0.02).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":
        raw[..., 208:210] = d
    else:
        raw[..., 0:2] = d
        if qtype in ("Q4_1", "Q4_K", "Q5_K"):
            raw[..., 2:4] = (-d.view(np.float16)).view(np.uint8)
    return raw.reshape(n, -1)


class Method:
    """One way to compute the product: its weight copies, their bytes and the call."""

    def __init__(self, name: str, copies: list[Any], nbytes: int, call: Product) -> None:
        self.name = name
        self.copies = copies
        self.nbytes = nbytes
        self.call = call


def _copies(make: Callable[[], Any], nbytes: int, cold_mb: float) -> list[Any]:
    count = max(1, math.ceil(cold_mb * 2**20 / nbytes)) if cold_mb > 0 else 1
    return [make() for _ in range(count)]


def _torch_int8(w: torch.Tensor, cold_mb: float) -> Method:
    """torch's weight-only int8 product: ``w`` (n, k) rounded per output channel."""
    n, k = w.shape
    scale8 = w.abs().amax(dim=1).clamp_min(1e-8) / 127  # (n,)
    w8 = torch.round(w / scale8[:, None]).clamp(-127, 127).to(torch.int8)  # (n, k)
    bytes8 = n * k + 4 * n
    return Method(
        "torch-int8",
        _copies(lambda: (w8.clone(), scale8.clone()), bytes8, cold_mb),
        bytes8,
        lambda x, c: torch.ops.aten._weight_int8pack_mm(x, c[0], c[1]),
    )


def _torch_int4(w: torch.Tensor, cold_mb: float) -> Method:
    """torch's weight-only int4 product: ``w`` (n, k) in groups of 32 along k,
    ``w = (q - 8) * scale + zero``."""
    n, k = w.shape
    g = 32
    wg = w.reshape(n, k // g, g)
    lo, hi = wg.amin(dim=2), wg.amax(dim=2)  # (n, k / g)
    scale4 = ((hi - lo) / 15).clamp_min(1e-8)
    q4 = torch.round((wg - lo[..., None]) / scale4[..., None]).clamp(0, 15).to(torch.int32)
    zero4 = lo + 8 * scale4
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.reshape(n, k), 2)
    sz = torch.stack([scale4.T, zero4.T], dim=-1).contiguous()  # (k / g, n, 2)
    bytes4 = packed.numel() + sz.numel() * 4
    return Method(
        "torch-int4",
        _copies(lambda: (packed.clone(), sz.clone()), bytes4, cold_mb),
        bytes4,
        lambda x, c: torch.ops.aten._weight_int4pack_mm_for_cpu(x, c[0], g, c[1]),
    )


def methods_for(
    k: int, n: int, qtype: str, threads: int, cold_mb: float, rng: np.random.Generator
) -> tuple[list[Method], torch.Tensor]:
    """The methods for an (n, k) matrix of random ``qtype`` blocks, and those blocks'
    weights (n, k) fp32, which the float methods multiply (re-quantized for torch's)."""
    raw = random_blocks(qtype, n, k, rng)
    qm = quant_gemm.QuantMatrix.from_bytes(raw, qtype, n, k)
    w = qm.dequantize()  # (n, k) fp32: the same weights for the float methods
    out: list[Method] = []

    def q_copy() -> quant_gemm.QuantMatrix:
        return quant_gemm.QuantMatrix(qm.qtype, n, k, qm.panels.clone())

    qcopies = _copies(q_copy, qm.nbytes, cold_mb)
    out.append(
        Method(
            f"gguf-{qtype}",
            qcopies,
            qm.nbytes,
            lambda x, c: quant_gemm.linear(x, c, threads=threads),
        )
    )
    if quant_gemm.i8_available():
        out.append(
            Method(
                f"gguf-{qtype}-i8",
                qcopies,
                qm.nbytes,
                lambda x, c: quant_gemm.linear_i8(x, c, threads=threads),
            )
        )
    out.append(Method("fp32", _copies(w.clone, 4 * n * k, cold_mb), 4 * n * k, F.linear))
    if cpu_gemm.library() is not None:
        p16 = cpu_gemm.pack(w.T.contiguous(), torch.float16)  # (n / 16, k, 16)
        out.append(
            Method(
                "panels-fp16",
                _copies(p16.clone, p16.numel() * 2, cold_mb),
                p16.numel() * 2,
                lambda x, p: cpu_gemm.mm(x, p, threads=threads),
            )
        )
    out += [_torch_int8(w, cold_mb), _torch_int4(w, cold_mb)]
    return out, w


def relative_errors(methods: list[Method], w: torch.Tensor, seed: int) -> dict[str, float]:
    """Each method's ``||y - y64|| / ||y64||`` for 16 Gaussian rows, y64 the float64
    product with the GGUF weights ``w`` (n, k): rounding for the exact methods, x's int8
    rounding for ``-i8``, the weights' own re-quantization for torch's int4 / int8."""
    x = torch.randn(16, w.shape[1], generator=torch.Generator().manual_seed(seed + 1))  # (16, K)
    ref = x.double() @ w.double().T  # (16, N)
    return {
        meth.name: float((meth.call(x, meth.copies[0]).double() - ref).norm() / ref.norm())
        for meth in methods
    }


def time_methods(
    methods: list[Method],
    m: int,
    k: int,
    reps: int,
    calls: int,
    seed: int,
    budget_s: float,
    stat: str = "median",
) -> dict[str, float]:
    """Seconds per product of each method (the median, or with ``stat="min"`` the fastest,
    of interleaved repetitions: on a machine other work shares, a product that loses a
    core for a scheduler slice costs milliseconds, and the minimum shows the kernel alone).
    A method whose products are slow gets fewer repetitions (at least 3): about
    ``budget_s`` seconds."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))  # (M, K)
    samples: dict[str, list[float]] = {meth.name: [] for meth in methods}
    cursor = dict.fromkeys(samples, 0)
    wanted: dict[str, int] = {}
    for meth in methods:  # warm-up: code paths, thread pool, page faults
        t0 = time.perf_counter()
        for c in meth.copies[: 2 * calls]:
            meth.call(x, c)
        per_rep = (time.perf_counter() - t0) / min(2 * calls, len(meth.copies)) * calls
        wanted[meth.name] = min(reps, max(3, int(budget_s / max(per_rep, 1e-9))))
    for rep in range(reps):
        order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
        for meth in order:
            if len(samples[meth.name]) >= wanted[meth.name]:
                continue
            i = cursor[meth.name]
            cs = [meth.copies[(i + j) % len(meth.copies)] for j in range(calls)]
            cursor[meth.name] = (i + calls) % len(meth.copies)
            t0 = time.perf_counter()
            for c in cs:
                meth.call(x, c)
            samples[meth.name].append((time.perf_counter() - t0) / calls)
    pick = np.min if stat == "min" else np.median
    return {name: float(pick(v)) for name, v in samples.items()}


def _report_shape(
    name: str,
    k: int,
    n: int,
    qtype: str,
    methods: list[Method],
    errs: dict[str, float],
    secs: dict[int, dict[str, float]],
    rows: list[int],
) -> list[dict[str, Any]]:
    """One shape's table (ms per product and its ratio to the first row count's, per
    method and row count); the same as result records."""
    print(f"\n{name}: {k} -> {n} ({qtype} weights {methods[0].nbytes / 1e6:.2f} MB)")
    head = "".join(f"{'M=' + str(m):>16}" for m in rows)
    print(f"{'method':<16}{'MB':>7}{'rel err':>9}{'GB/s M=1':>10}{head}")
    results = []
    for meth in methods:
        base = secs[rows[0]][meth.name]
        cells = "".join(
            f"{secs[m][meth.name] * 1e3:>9.3f} x{secs[m][meth.name] / base:<5.2f}" for m in rows
        )
        gbps = meth.nbytes / base / 1e9
        err = errs[meth.name]
        print(f"{meth.name:<16}{meth.nbytes / 1e6:>7.2f}{err:>9.1e}{gbps:>10.1f}{cells}")
        for m in rows:
            results.append(
                {
                    "shape": name,
                    "k": k,
                    "n": n,
                    "method": meth.name,
                    "m": m,
                    "ms": round(secs[m][meth.name] * 1e3, 5),
                    "gb_per_s": round(meth.nbytes / secs[m][meth.name] / 1e9, 2),
                    "vs_first_rows": round(secs[m][meth.name] / base, 3),
                    "rel_err": float(f"{errs[meth.name]:.3g}"),
                }
            )
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="codespec bench kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="threads per product (default 2)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M to sweep")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES),
                    help=f"shapes to run (also: {QWEN_NAMES})")  # fmt: skip
    ap.add_argument("--reps", type=int, default=41, help="interleaved repetitions (median)")
    ap.add_argument("--calls", type=int, default=8, help="products timed per repetition")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=3.0,
        help="seconds of repetitions per method and row count at most (slow ones get fewer)",
    )
    ap.add_argument(
        "--cold-mb",
        type=float,
        default=128.0,
        help="weight copies per method, in MB, so they stream from memory (0: one, cached)",
    )
    ap.add_argument(
        "--stat",
        choices=["median", "min"],
        default="median",
        help="median of the repetitions, or the fastest (on a busy machine)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if quant_gemm.library() is None:
        print(
            f"codespec bench kernels: the kernel is unavailable: {quant_gemm.unavailable_reason()}"
        )
        return 1
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    wanted = set(args.shapes.split(","))
    rng = np.random.default_rng(args.seed)
    isa = quant_gemm.default_isa()
    print(
        f"threads {args.threads}, isa {isa} (i8: {quant_gemm.i8_isa() or 'unavailable'}), "
        f"torch {torch.__version__}, {args.stat} of {args.reps} x {args.calls} calls, "
        f"cold {args.cold_mb:g} MB per method"
    )
    results: list[dict[str, Any]] = []
    for name, k, n, qtype in SHAPES + QWEN_SHAPES:
        if name not in wanted:
            continue
        methods, w = methods_for(k, n, qtype, args.threads, args.cold_mb, rng)
        errs = relative_errors(methods, w, args.seed)
        secs = {
            m: time_methods(
                methods, m, k, args.reps, args.calls, args.seed, args.budget_s, args.stat
            )
            for m in rows
        }
        results += _report_shape(name, k, n, qtype, methods, errs, secs, rows)
        del methods, w
    summary = {"bench": "kernels", "threads": args.threads, "isa": isa, "stat": args.stat}
    print(json.dumps({**summary, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
