"""The many-row int8 products on AMX tiles (``csrc/qgemm_amx.inc.cpp``) against the VNNI
path and the one-row products: the same bits for every block type, every count of rows
around the tiles' 16 (whole tiles, a last partial one), panels in full and partial groups,
1 and 2 threads, and quants at their largest magnitude. ``cs_q_amx`` switches the path.
Where the CPU or the kernel offers no AMX-INT8 the switch says so (-1) and changes
nothing, and the same products are checked on the path that runs instead.
"""

from __future__ import annotations

import pytest
import torch
from quant_largest import at_largest
from test_quant_gemm import TYPES, k_for, needs_kernel, random_gguf

from codespec.daemon.engine import quant_gemm
from codespec.daemon.engine.quant_gemm import QuantMatrix

ROWS = (32, 33, 45, 48, 63, 80)  # the tiles take products of 32 rows or more


def _switch(on: int) -> int:
    return int(quant_gemm.library().cs_q_amx(on))


def _products(qm: QuantMatrix, x: torch.Tensor, on: int) -> dict[tuple[int, int], torch.Tensor]:
    before = _switch(on)
    try:
        return {
            (m, t): quant_gemm.linear_i8(x[:m], qm, threads=t, isa="avx512-vnni")
            for m in ROWS
            for t in (1, 2)
        }
    finally:
        if before >= 0:
            _switch(before)


def _vnni() -> bool:
    return quant_gemm.library() is not None and quant_gemm.i8_isa() == "avx512-vnni"


@needs_kernel
def test_the_switch_reports_what_it_can_do() -> None:
    before = _switch(-1)
    if before < 0:  # no AMX here: every setting is refused the same way
        assert _switch(1) == -1 and _switch(0) == -1
        return
    try:
        assert _switch(0) == before and _switch(-1) == 0
        assert _switch(1) == 0 and _switch(-1) == 1
    finally:
        _switch(before)


@needs_kernel
@pytest.mark.skipif(not _vnni(), reason="the tiles back the AVX-512 VNNI path only")
@pytest.mark.parametrize("qtype", TYPES)
def test_tiles_give_the_vnni_paths_bits_and_the_one_row_products(qtype: str) -> None:
    n, k = 16 * 9 + 5, k_for(qtype)  # 10 panels: two whole groups of four and a partial one
    qm = QuantMatrix.from_bytes(random_gguf(qtype, n, k, seed=41), qtype, n, k)
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(41))
    tiles, plain = _products(qm, x, 1), _products(qm, x, 0)
    one = torch.cat([quant_gemm.linear_i8(x[i : i + 1], qm, threads=1) for i in range(len(x))])
    for (m, t), y in tiles.items():
        assert torch.equal(y, plain[(m, t)]), f"{qtype} M={m} threads={t}: tiles != VNNI"
        assert torch.equal(y, one[:m]), f"{qtype} M={m} threads={t}: != one-row products"


@needs_kernel
@pytest.mark.skipif(not _vnni(), reason="the tiles back the AVX-512 VNNI path only")
@pytest.mark.parametrize("qtype", TYPES)
def test_tiles_take_the_largest_quants_exactly(qtype: str) -> None:
    """Every quant at its largest (the signed bytes a biased type becomes: Q4_0's columns
    8-15 reach -128) against x rounded to +-127: the same bits as the scalar path."""
    n, k = 37, k_for(qtype)
    _, qm = at_largest(random_gguf(qtype, n, k, seed=6), qtype, n, k)
    x = torch.cat([torch.full((24, k), 1.0), torch.full((24, k), -3.0)])  # (48, K)
    want = quant_gemm.linear_i8(x, qm, threads=1, isa="scalar")
    for (m, t), y in _products(qm, x, 1).items():
        if m <= len(x):
            assert torch.equal(y, want[:m]), f"{qtype} M={m} threads={t}"
