"""Block-quantized matrices with every quant at its largest magnitude, for the tests of
the int8 products' integer sums at their bounds (``test_quant_gemm``,
``test_quant_gemm_avx2``, ``test_quant_gemm_amx``): 4-bit 15, 5-bit 31, Q6_K 63, Q8_0 -128
(the signed bytes a biased type becomes: Q4_0's columns 8-15 reach -128), the scales
as the caller's random GGUF rows had them.
"""

from __future__ import annotations

import numpy as np

from codespec.daemon.engine import quant_gemm
from codespec.daemon.engine.quant_gemm import QuantMatrix

# The bytes of each type's quants within a block (the rest: its scales).
QUANT_BYTES = {
    "Q8_0": slice(2, 34),
    "Q4_0": slice(2, 18),
    "Q4_1": slice(4, 20),
    "Q5_0": slice(2, 22),
    "Q5_1": slice(4, 24),
    "Q4_K": slice(16, 144),
    "Q5_K": slice(16, 176),
    "Q6_K": slice(0, 192),
}


def at_largest(raw: np.ndarray, qtype: str, n: int, k: int) -> tuple[np.ndarray, QuantMatrix]:
    """``raw`` (``n`` GGUF rows of ``k`` values of ``qtype``) with every quant at its
    largest magnitude: the rows (n, bytes) and their matrix."""
    bk, size = quant_gemm.BLOCKS[qtype]
    blocks = raw.reshape(n, k // bk, size).copy()
    blocks[..., QUANT_BYTES[qtype]] = 0x80 if qtype == "Q8_0" else 0xFF
    rows = blocks.reshape(n, -1)
    return rows, QuantMatrix.from_bytes(rows, qtype, n, k)
