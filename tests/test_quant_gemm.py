"""The quantized-weight product (``codespec.daemon.engine.quant_gemm``) against gguf's reference.

Checks: the kernel builds wherever a C++ compiler exists (a failed build fails here); the
repacked panels give back the GGUF bytes byte for byte; every ISA path widens each block
type to exactly the values ``gguf.quants.dequantize`` gives; products equal a float64
product of those weights within fp32 rounding, for 1 to 16 rows, odd row counts of W,
1 and 2 threads, with and without bias and residual; each row equals the one-row product
bit for bit whatever M, the thread count or the ISA (what lossless speculation needs);
``CODESPEC_QGEMM_ISA=scalar`` forces the plain C++ path; unsupported block types are
refused by name; and the default model's GGUF multiplies right, matrix type by type.

gguf 0.19 quantizes Q8_0, Q4_0 and Q4_1 but not the K-quants (NotImplementedError), so
K-quant blocks are random bytes with random finite fp16 scales, dequantized by gguf as
the reference; so are Q5_0 and Q5_1 blocks (every high bit and every quant value, which
gguf's quantizer of normal data rarely reaches).

Every test runs each path this CPU can execute, the portable one among them: no test skips
for a missing CPU feature, so every machine checks the same behaviour on what it has.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from quant_largest import at_largest  # noqa: E402

from codespec import native  # noqa: E402
from codespec.daemon.engine import cpu_gemm, quant_gemm  # noqa: E402
from codespec.daemon.engine.quant_gemm import QuantMatrix  # noqa: E402
from helpers import rounded_rows  # noqa: E402

TYPES = list(quant_gemm.QTYPES)
ROWS = [1, 2, 3, 4, 8, 16]

needs_kernel = pytest.mark.skipif(
    quant_gemm.library() is None,
    reason=f"quantized kernel unavailable: {quant_gemm.unavailable_reason()}",
)


def _isas() -> list[str]:
    """The exact product's paths this CPU runs (the portable one first); all of them where
    the kernel cannot be built (needs_kernel skips those with the reason)."""
    if quant_gemm.library() is None:
        return list(quant_gemm.ISAS)
    return quant_gemm.available_isas()


def random_gguf(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """GGUF blocks of ``qtype`` for an (n, k) matrix: ``(n, row bytes)`` uint8."""
    rng = np.random.default_rng(seed)
    qt = gguf.GGMLQuantizationType[qtype]
    if qtype in ("Q8_0", "Q4_0", "Q4_1"):
        w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 1.0, (n, 1))
        return gguf.quants.quantize(w.astype(np.float32), qt)
    bk, size = quant_gemm.BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(n, k // bk, size), dtype=np.uint8)
    d = (rng.standard_normal((n, k // bk, 1)) * 0.01).astype(np.float16).view(np.uint8)
    dmin = (rng.standard_normal((n, k // bk, 1)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":
        raw[..., 208:210] = d
    else:
        raw[..., 0:2] = d
        if qtype != "Q5_0":  # Q5_0's bytes 2-5 are its high bits
            raw[..., 2:4] = dmin
    return raw.reshape(n, k // bk * size)


def reference(raw: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    """gguf's dequantized weights, (n, k) fp32."""
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    return np.asarray(w, dtype=np.float32).reshape(n, k)


def k_for(qtype: str) -> int:
    return 512 if quant_gemm.BLOCKS[qtype][0] == 256 else 96


def assert_close(
    y: torch.Tensor, x: torch.Tensor, w: np.ndarray, extra: torch.Tensor | None, what: str
) -> None:
    """``y`` against ``x @ w.T (+ extra)`` in float64: each error within 1e-6 * sqrt(K) of
    the sum of |terms| (fp32 summation error; one wrong weight is ~1/K of that sum)."""
    wd = torch.from_numpy(w).double()  # (N, K)
    ref = x.double() @ wd.T  # (M, N)
    scale = x.double().abs() @ wd.abs().T  # (M, N)
    if extra is not None:
        ref = ref + extra.double()
        scale = scale + extra.double().abs()
    err = (y.double() - ref).abs()
    bound = 1e-6 * math.sqrt(x.shape[1]) * scale + 1e-30
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: error {err.max().item():.3g} is {worst:.2f}x the bound"


def test_builds_where_a_compiler_exists() -> None:
    if native.compiler() is None:
        pytest.skip("no C++ compiler")
    assert quant_gemm.library() is not None, quant_gemm.unavailable_reason()
    assert quant_gemm.library().cs_q_version() == 1
    isas = quant_gemm.available_isas()
    assert isas[0] == "scalar"
    flags = cpu_gemm.cpu_flags()
    if {"avx2", "fma", "f16c"} <= flags:
        assert "avx2" in isas
    if {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        assert "avx512" in isas


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
def test_panels_give_back_the_gguf_bytes(qtype: str) -> None:
    for n in (16, 35):
        k = k_for(qtype)
        raw = random_gguf(qtype, n, k, seed=n)
        qm = QuantMatrix.from_bytes(raw, qtype, n, k)
        assert np.array_equal(qm.to_gguf_bytes(), raw)
        padded = -(-n // 16) * 16
        assert qm.nbytes == padded * raw.shape[1]  # the format's bytes, nothing more
        assert qm.qtype == qtype and (qm.n, qm.k) == (n, k)


@needs_kernel
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("qtype", TYPES)
def test_widening_equals_gguf_dequantize(qtype: str, isa: str) -> None:
    n, k = 35, k_for(qtype)
    raw = random_gguf(qtype, n, k, seed=7)
    want = reference(raw, qtype, n, k)
    got = QuantMatrix.from_bytes(raw, qtype, n, k).dequantize(isa).numpy()
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    # equal values (== also equates +0 and -0, which no sum can tell apart)
    assert np.array_equal(got, want), f"{int((got != want).sum())} weights differ"


@needs_kernel
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("qtype", TYPES)
def test_product_equals_float64_reference(qtype: str, isa: str) -> None:
    n, k = 35, k_for(qtype)
    raw = random_gguf(qtype, n, k, seed=11)
    w = reference(raw, qtype, n, k)
    qm = QuantMatrix.from_bytes(raw, qtype, n, k)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(max(ROWS), k, generator=g)  # (16, K)
    bias = torch.randn(n, generator=g)  # (N,)
    res = torch.randn(max(ROWS), n, generator=g)  # (16, N)
    for m in ROWS:
        for threads in (1, 2):
            for b, r in ((None, None), (bias, None), (None, res[:m]), (bias, res[:m])):
                y = quant_gemm.linear(x[:m], qm, b, r, threads=threads, isa=isa)
                assert y.shape == (m, n)
                extra = None
                if b is not None or r is not None:
                    extra = torch.zeros(m, n)
                    extra = extra + (b if b is not None else 0) + (r if r is not None else 0)
                what = f"{qtype} {isa} M={m} threads={threads} bias={b is not None}"
                assert_close(y, x[:m], w, extra, f"{what} res={r is not None}")


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
def test_rows_equal_one_row_products_bit_for_bit(qtype: str) -> None:
    """Row i of any product equals the one-row product of x[i], whatever M (direct and
    scratch paths, their row tails), the thread count or the ISA."""
    n, k = 67, k_for(qtype)
    raw = random_gguf(qtype, n, k, seed=5)
    qm = QuantMatrix.from_bytes(raw, qtype, n, k)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(16, k, generator=g)  # (16, K)
    bias = torch.randn(n, generator=g)  # (N,)
    res = torch.randn(16, n, generator=g)  # (16, N)
    isas = quant_gemm.available_isas()
    one = torch.cat(
        [
            quant_gemm.linear(x[i : i + 1], qm, bias, res[i : i + 1], threads=1, isa=isas[-1])
            for i in range(16)
        ]
    )  # (16, N)
    for isa in isas:
        for threads in (1, 2):
            for m in (1, 2, 3, 4, 5, 8, 9, 13, 16):
                y = quant_gemm.linear(x[:m], qm, bias, res[:m], threads=threads, isa=isa)
                assert torch.equal(y, one[:m]), f"{qtype} {isa} threads={threads} M={m}"


@needs_kernel
def test_strided_rows_and_long_prefill() -> None:
    """x rows with a stride (a slice of a wider tensor) and more rows than one chunk."""
    n, k = 48, 256
    raw = random_gguf("Q4_K", n, k, seed=2)
    qm = QuantMatrix.from_bytes(raw, "Q4_K", n, k)
    big = torch.randn(150, k + 40)
    x = big[:, 8 : 8 + k]  # (150, K), stride(0) = K + 40
    y = quant_gemm.linear(x, qm, threads=2)
    assert_close(y, x, reference(raw, "Q4_K", n, k), None, "strided 150 rows")
    assert torch.equal(y[149:], quant_gemm.linear(x[149:].contiguous(), qm, threads=1))


@needs_kernel
def test_scalar_path_forced_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = 40, 256
    raw = random_gguf("Q6_K", n, k, seed=4)
    qm = QuantMatrix.from_bytes(raw, "Q6_K", n, k)
    x = torch.randn(5, k)
    best = quant_gemm.available_isas()[-1]
    vector = quant_gemm.linear(x, qm, isa=best)
    monkeypatch.setenv(quant_gemm.ISA_ENV, "scalar")
    assert quant_gemm.default_isa() == "scalar"
    assert torch.equal(quant_gemm.linear(x, qm), vector)
    monkeypatch.setenv(quant_gemm.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="sse9"):
        quant_gemm.linear(x, qm)
    monkeypatch.delenv(quant_gemm.ISA_ENV)
    assert quant_gemm.default_isa() == best


@needs_kernel
def test_unsupported_block_types_are_refused_by_name() -> None:
    raw = np.zeros((16, 22), dtype=np.uint8)
    with pytest.raises(ValueError, match="IQ4_NL"):
        QuantMatrix.from_bytes(raw, "IQ4_NL", 16, 32)
    with pytest.raises(ValueError, match="IQ4_NL"):
        QuantMatrix.from_bytes(raw, int(gguf.GGMLQuantizationType.IQ4_NL), 16, 32)
    with pytest.raises(ValueError, match="IQ4_XS"):
        QuantMatrix.from_bytes(raw, gguf.GGMLQuantizationType.IQ4_XS, 16, 256)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantMatrix.from_bytes(np.zeros(16 * 20, np.uint8), "Q4_1", 16, 48)
    with pytest.raises(ValueError, match="needs 320 bytes"):
        QuantMatrix.from_bytes(np.zeros(300, np.uint8), "Q4_1", 16, 32)
    qm = QuantMatrix.from_bytes(np.zeros(16 * 20, np.uint8), "Q4_1", 16, 32)
    with pytest.raises(ValueError, match=r"\(M, 32\)"):
        quant_gemm.linear(torch.zeros(2, 64), qm)


@needs_kernel
def test_the_default_models_matrices(default_model_dir: Path) -> None:
    """Each block type in the SmolLM2 GGUF (Q8_0 embedding / LM head, Q4_1 block matrices)
    multiplies as gguf's dequantized weights do; a 1-D F32 norm is refused by name."""
    from codespec.daemon.engine.models import GGUF_NAME

    reader = gguf.GGUFReader(str(default_model_dir / GGUF_NAME))
    tensors = {t.name: t for t in reader.tensors}
    seen: set[str] = set()
    g = torch.Generator().manual_seed(0)
    for name in (
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.3.ffn_down.weight",
        "blk.29.ffn_gate.weight",
    ):
        t = tensors[name]
        qm = QuantMatrix.from_gguf_tensor(t)
        k, n = (int(s) for s in t.shape)
        assert (qm.n, qm.k, qm.qtype) == (n, k, t.tensor_type.name)
        assert np.array_equal(qm.to_gguf_bytes(), np.asarray(t.data))
        w = reference(np.asarray(t.data), qm.qtype, n, k)
        assert np.array_equal(qm.dequantize().numpy(), w)
        x = torch.randn(3, k, generator=g)  # (3, K)
        y = quant_gemm.linear(x, qm, threads=2)
        assert_close(y, x, w, None, name)
        assert torch.equal(y[2:], quant_gemm.linear(x[2:], qm, threads=1))
        seen.add(qm.qtype)
    present = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    assert present == seen == {"Q8_0", "Q4_1"}
    norm = tensors["blk.0.attn_norm.weight"]
    with pytest.raises(ValueError, match="2-D"):
        QuantMatrix.from_gguf_tensor(norm)


def _i8_isas() -> list[str]:
    if quant_gemm.library() is None:
        return []
    isas = ["scalar"]
    if quant_gemm.isa_supported("avx2"):
        isas.append("avx2")
    if quant_gemm.i8_isa() == "avx512-vnni":
        isas.append("avx512-vnni")
    return isas


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
def test_i8_variant_is_exact_but_for_rounding_x(qtype: str) -> None:
    """linear_i8 equals, within fp32 rounding, the float64 product of the weights with x
    rounded to int8 per 32 inputs; that rounding is its whole error (and a visible one:
    the exact product is farther away than the bound)."""
    n, k = 35, k_for(qtype)
    raw = random_gguf(qtype, n, k, seed=21)
    w = reference(raw, qtype, n, k)
    qm = QuantMatrix.from_bytes(raw, qtype, n, k)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(9, k, generator=g)  # (9, K)
    bias = torch.randn(n, generator=g)  # (N,)
    res = torch.randn(9, n, generator=g)  # (9, N)
    xr = rounded_rows(x)  # (9, K) float64
    for isa in _i8_isas():
        y = quant_gemm.linear_i8(x, qm, bias, res, threads=2, isa=isa)
        assert_close(y, xr, w, bias + res, f"{qtype} i8 {isa}")
        with pytest.raises(AssertionError):
            assert_close(y, x, w, bias + res, "against unrounded x")


def _ten_panels(qtype: str, seed: int, rows: int) -> tuple[QuantMatrix, torch.Tensor]:
    """A matrix of 10 panels (two full groups of four and a partial one) and ``rows`` rows
    of x for it."""
    n, k = 16 * 9 + 5, k_for(qtype)
    qm = QuantMatrix.from_bytes(random_gguf(qtype, n, k, seed=seed), qtype, n, k)
    return qm, torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))  # (rows, K)


def _assert_same_products(qm: QuantMatrix, x: torch.Tensor, want: dict, label: str) -> None:
    """The int8 products of x's first M rows on 1 and 2 threads equal want[M] bit for bit."""
    for m, y in want.items():
        for threads in (1, 2):
            got = quant_gemm.linear_i8(x[:m], qm, threads=threads)
            assert torch.equal(got, y), f"{label} M={m} threads={threads}"


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K"])
def test_i8_prefetch_ahead_changes_no_number(qtype: str) -> None:
    """The 1-4 row products' software prefetch (any distance, also past the matrix's last
    group, and off) is a memory hint: the same products bit for bit."""
    qm, x = _ten_panels(qtype, 31, 4)
    lib = quant_gemm.library()
    before = lib.cs_q_prefetch_ahead(4)
    try:
        want = {m: quant_gemm.linear_i8(x[:m], qm, threads=1) for m in (1, 2, 3, 4)}
        for ahead in (0, 1, 3, 64):
            lib.cs_q_prefetch_ahead(ahead)
            _assert_same_products(qm, x, want, f"{qtype} ahead={ahead}")
    finally:
        lib.cs_q_prefetch_ahead(before)


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K"])
def test_i8_next_group_prefetch_level_changes_no_number(qtype: str) -> None:
    """The many-row products fetch the next group of panels into L2 (the default) or L1
    (cs_q_prefetch_level): a memory hint, the same products bit for bit for 5 to 16 rows;
    the setter keeps its value for anything but 1 or 2."""
    qm, x = _ten_panels(qtype, 37, 16)
    lib = quant_gemm.library()
    before = lib.cs_q_prefetch_level(2)
    try:
        assert lib.cs_q_prefetch_level(0) == 2 and lib.cs_q_prefetch_level(-1) == 2
        want = {m: quant_gemm.linear_i8(x[:m], qm, threads=1) for m in (5, 8, 9, 16)}
        assert lib.cs_q_prefetch_level(1) == 2
        _assert_same_products(qm, x, want, f"{qtype} L1")
    finally:
        lib.cs_q_prefetch_level(before)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
def test_i8_rows_equal_one_row_products_bit_for_bit(qtype: str) -> None:
    n, k = 67, k_for(qtype)
    raw = random_gguf(qtype, n, k, seed=13)
    qm = QuantMatrix.from_bytes(raw, qtype, n, k)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(2))  # (19, K)
    isas = _i8_isas()
    one = torch.cat(
        [quant_gemm.linear_i8(x[i : i + 1], qm, threads=1, isa="scalar") for i in range(19)]
    )
    for isa in isas:
        for threads in (1, 2):
            for m in range(1, 20):  # every split into passes (4 rows a pass, 6 from 12 rows)
                y = quant_gemm.linear_i8(x[:m], qm, threads=threads, isa=isa)
                assert torch.equal(y, one[:m]), f"{qtype} i8 {isa} threads={threads} M={m}"


@needs_kernel
def test_i8_rounding_of_x_agrees_on_every_path_at_its_edges() -> None:
    """x's rounding to int8 (each ISA has its own: AVX-512 takes 16 blocks a pass) on the
    blocks where it can go wrong: all zeros (d = 0), halves after scaling (ties to even),
    a block's max at either end or negative, tiny beside huge blocks, and row counts
    whose blocks do not fill a pass. Every path gives the scalar path's products."""
    qtype, n, k = "Q8_0", 40, 1536  # 48 blocks a row: passes of 16 end mid-row
    raw = random_gguf(qtype, n, k, seed=41)
    w = reference(raw, qtype, n, k)
    qm = QuantMatrix.from_bytes(raw, qtype, n, k)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(7, k, generator=g)  # (7, K)
    x[0, :32] = 0.0  # d = 0: every q 0
    x[1, :32] = torch.arange(32) - 15.5  # max 16.5 at the end: steps of 16.5 / 127
    x[1, 32:64] = 127.0 * (torch.arange(32) % 5 - 2) / 4  # 0.5 steps once scaled: ties
    x[1, 63] = -127.0  # the max negative, last
    x[2, 64:96] *= 1e-6  # tiny beside its neighbours
    x[3, ::7] *= 1e4
    want = rounded_rows(x)  # (7, K) float64
    for m in (1, 2, 3, 5, 7):
        scalar = quant_gemm.linear_i8(x[:m], qm, threads=1, isa="scalar")
        assert_close(scalar, want[:m], w, None, f"scalar M={m}")
        for isa in _i8_isas():
            for threads in (1, 2):
                y = quant_gemm.linear_i8(x[:m], qm, threads=threads, isa=isa)
                assert torch.equal(y, scalar), f"{isa} threads={threads} M={m}"


@needs_kernel
def test_i8_many_equals_each_product_alone_bit_for_bit() -> None:
    """Several matrices of different types over the same rows (the stack's q/k/v): one call
    quantizes x once; each matrix's columns equal its own product, with its bias."""
    k = 256
    mats, biases = [], []
    for i, (qtype, n) in enumerate(
        [("Q4_1", 67), ("Q8_0", 16), ("Q6_K", 33), ("Q4_K", 5), ("Q5_0", 21), ("Q5_1", 40)]
    ):
        mats.append(QuantMatrix.from_bytes(random_gguf(qtype, n, k, seed=30 + i), qtype, n, k))
        biases.append(torch.randn(n) if i % 2 else None)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(4))
    for isa in _i8_isas():
        for threads in (1, 2, 3):
            for m in (1, 3, 9, 16):
                got = quant_gemm.linear_i8_many(x[:m], mats, biases, threads=threads, isa=isa)
                alone = [
                    quant_gemm.linear_i8(x[:m], qm, b, threads=1, isa=isa)
                    for qm, b in zip(mats, biases, strict=True)
                ]
                assert torch.equal(got, torch.cat(alone, dim=1)), f"{isa} {threads} M={m}"
    with pytest.raises(ValueError, match="k differ"):
        quant_gemm.linear_i8_many(x, [mats[0], QuantMatrix.from_bytes(
            random_gguf("Q8_0", 16, 64, seed=1), "Q8_0", 16, 64)])  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_i8_largest_quants_do_not_overflow_the_integer_sums(qtype: str, sign: float) -> None:
    """Every quant at its largest magnitude (4-bit 15, 5-bit 31, Q6_K 63, Q8_0 -128) against
    x rounded to +-127 everywhere: the vector paths' 16-bit partial sums are at their bound
    and must still equal the scalar path's 32-bit ones bit for bit."""
    n, k = 33, k_for(qtype)
    raw, qm = at_largest(random_gguf(qtype, n, k, seed=5), qtype, n, k)
    x = torch.full((5, k), sign)  # every input rounds to +-127
    x[1] *= 3.0
    want = quant_gemm.linear_i8(x, qm, threads=1, isa="scalar")
    assert torch.isfinite(want).all()
    w = torch.from_numpy(reference(raw, qtype, n, k)).double()
    assert torch.allclose(want.double(), x.double() @ w.T, rtol=1e-5, atol=1e-4)
    for isa in _i8_isas():
        for threads in (1, 2):
            y = quant_gemm.linear_i8(x, qm, threads=threads, isa=isa)
            assert torch.equal(y, want), f"{qtype} i8 {isa} threads={threads}"


@needs_kernel
def test_bench_kernels_runs_and_ends_with_json(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from codespec.daemon.bench import kernels

    argv = ["--shapes", "o", "--rows", "1,2", "--reps", "3", "--calls", "1", "--cold-mb", "0"]
    assert kernels.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    methods = {r["method"] for r in summary["results"]}
    assert {"gguf-Q4_1", "fp32", "torch-int8", "torch-int4"} <= methods
    exact = [r for r in summary["results"] if r["method"] == "gguf-Q4_1"]
    assert [r["m"] for r in exact] == [1, 2] and all(r["ms"] > 0 for r in exact)
    assert exact[0]["rel_err"] < 1e-5


@needs_kernel
def test_out_buffer_is_written_in_place() -> None:
    n, k = 32, 64
    qm = QuantMatrix.from_bytes(random_gguf("Q8_0", n, k, seed=1), "Q8_0", n, k)
    x = torch.randn(3, k)
    big = torch.full((3, n + 5), 7.0)
    out = big[:, :n]  # (3, N), row stride N + 5
    y = quant_gemm.linear(x, qm, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(big[:, :n], quant_gemm.linear(x, qm))
    assert torch.equal(big[:, n:], torch.full((3, 5), 7.0))
    with pytest.raises(ValueError, match="out must be"):
        quant_gemm.linear(x, qm, out=torch.empty(3, n + 1))
