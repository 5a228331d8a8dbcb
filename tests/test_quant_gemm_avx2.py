"""The AVX2 int8 products of several rows with each panel's groups kept as the first
row's pass expands them, for the passes of the rows after it (``v256::panels_kept``;
``cs_q_expand_rows`` sets from how many rows after the first, 0 never): the same
integers, so the same bits as without it and as one-row products, for every block type,
every count of rows around the passes' shapes, 1 and 2 threads (whose panels split a
group of four), and quants at their largest magnitude.
"""

from __future__ import annotations

import pytest
import torch
from quant_largest import at_largest
from test_quant_gemm import TYPES, k_for, needs_kernel, random_gguf

from codespec.daemon.engine import quant_gemm
from codespec.daemon.engine.quant_gemm import QuantMatrix

ROWS = (2, 3, 5, 6, 9, 10, 13, 17, 20, 33)

avx2 = pytest.mark.skipif(
    quant_gemm.library() is None or not quant_gemm.isa_supported("avx2"),
    reason="this CPU has no AVX2",
)


def _products(qm: QuantMatrix, x: torch.Tensor, expand_from: int) -> dict:
    before = int(quant_gemm.library().cs_q_expand_rows(expand_from))
    try:
        return {
            (m, t): quant_gemm.linear_i8(x[:m], qm, threads=t, isa="avx2")
            for m in ROWS
            for t in (1, 2)
        }
    finally:
        quant_gemm.library().cs_q_expand_rows(before)


@needs_kernel
@avx2
@pytest.mark.parametrize("qtype", TYPES)
def test_expanded_panels_give_the_same_bits(qtype: str) -> None:
    n, k = 16 * 9 + 5, k_for(qtype)  # 10 panels: two whole groups of four and a partial one
    qm = QuantMatrix.from_bytes(random_gguf(qtype, n, k, seed=51), qtype, n, k)
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(51))
    expanded, plain = _products(qm, x, 1), _products(qm, x, 0)
    one = torch.cat(
        [quant_gemm.linear_i8(x[i : i + 1], qm, threads=1, isa="avx2") for i in range(len(x))]
    )
    for (m, t), y in expanded.items():
        assert torch.equal(y, plain[(m, t)]), f"{qtype} M={m} threads={t}: expanded != not"
        assert torch.equal(y, one[:m]), f"{qtype} M={m} threads={t}: != one-row products"


@needs_kernel
@avx2
@pytest.mark.parametrize("qtype", TYPES)
def test_expanded_panels_take_the_largest_quants_exactly(qtype: str) -> None:
    """Every quant at its largest against x rounded to +-127: the scalar path's bits."""
    n, k = 37, k_for(qtype)
    _, qm = at_largest(random_gguf(qtype, n, k, seed=7), qtype, n, k)
    x = torch.cat([torch.full((17, k), 1.0), torch.full((16, k), -3.0)])  # (33, K)
    want = quant_gemm.linear_i8(x, qm, threads=1, isa="scalar")
    for (m, t), y in _products(qm, x, 1).items():
        assert torch.equal(y, want[:m]), f"{qtype} M={m} threads={t}"


@needs_kernel
def test_the_switch_returns_the_old_setting() -> None:
    lib = quant_gemm.library()
    before = int(lib.cs_q_expand_rows(3))
    try:
        assert int(lib.cs_q_expand_rows(0)) == 3 and int(lib.cs_q_expand_rows(before)) == 0
    finally:
        lib.cs_q_expand_rows(before)
