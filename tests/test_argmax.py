"""The stack's row argmax (``qstack.argmax_rows``, what greedy verification reads): torch's
choice on every ISA path, at the rows' edges (ties, signed zeros, infinities, NaNs,
lengths that leave a tail), and the engine's greedy steps unchanged by it."""

from __future__ import annotations

import pytest
import torch

from codespec.daemon.engine import qstack, quant_gemm

needs_kernel = pytest.mark.skipif(
    quant_gemm.library() is None,
    reason=f"the quantized kernel cannot be built here: {quant_gemm.unavailable_reason()}",
)


def _isas() -> list[str]:
    return [i for i in quant_gemm.ISAS if quant_gemm.library() and quant_gemm.isa_supported(i)]


def _edge_rows(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(12, n, generator=g)  # (12, n)
    x[1] = 0.0
    x[1, n // 2] = -0.0  # all zeros, one negative: the first place
    x[2] = float("-inf")  # all -inf: 0
    x[3, n - 1] = 50.0  # the largest last (in the tail when n is not a multiple of 16)
    x[4, 3] = x[4, n - 2] = 60.0  # a tie: the first
    x[5, 17 % n] = float("inf")
    x[6, n // 3] = float("nan")  # a NaN: torch names the first NaN
    x[6, n - 1] = float("nan")
    x[7, n - 1] = float("nan")
    x[8, 0] = 70.0  # the largest first
    x[9] = -1.0
    x[9, n - 1] = -0.5
    x[10] = float("-inf")
    x[10, n - 1] = -3.0e38  # finite only at the end
    x[11, ::16] = 9.0  # one tie in every lane's first place of each vector
    return x


@needs_kernel
@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 100, 49152, 49157])
def test_rows_argmax_is_torchs_on_every_path(n: int) -> None:
    x = _edge_rows(n) if n > 4 else torch.randn(12, n)
    want = x.argmax(dim=-1).tolist()
    for isa in _isas():
        for threads in (1, 2):
            assert qstack.argmax_rows(x, threads, isa) == want, f"{isa} threads={threads}"
    strided = torch.cat([x, x], dim=1)[:, :n]  # rows ld apart, not n
    assert qstack.argmax_rows(strided, 1) == want


@needs_kernel
def test_other_tensors_are_left_to_torch() -> None:
    assert qstack.argmax_rows(torch.randn(3, 8, dtype=torch.float64)) is None
    assert qstack.argmax_rows(torch.randn(8)) is None
    assert qstack.argmax_rows(torch.randn(8, 3).t()) is None  # rows not contiguous
    assert qstack.argmax_rows(torch.randn(0, 8)) is None
