"""The engine's model as proposers see it: :class:`ModelTarget` gives the engine the
members of :class:`codespec.speculators.target.TargetModel`.

Owns the mixin that reads them off the engine's runner (lean or Hugging Face):
its shape, its token embedding and its kernels (:class:`CpuGemmKernels`, the
lean runner's CPU kernels as :class:`~codespec.speculators.target.Kernels`;
:class:`Int8Kernels` where the runner itself multiplies by int8 blocks),
and :meth:`ModelTarget.time_forwards`, the timed forwards the daemon hands the
policy as its first cost table (``codespec.speculators.policy.seed_costs``).
Must not touch: the runner's cache contents (timing appends and cuts back).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from codespec.daemon.engine import cpu_gemm, quant_gemm
from codespec.speculators.costs import SEED_SIZES
from codespec.speculators.target import Kernels, SpeculatorState, TorchKernels

SAMPLES = 3  # timed forwards per size in time_forwards (the fastest counts)
# A draft head's products of fewer rows than this run on one thread. codespec runs OpenMP
# passive (OMP_WAIT_POLICY=PASSIVE, see codespec.daemon): a product split over the pool
# wakes a sleeping thread by futex, and a head forward is seven products with Python steps
# between them, right after a target forward that left the pool asleep: for products
# this small, waking the pool costs more than a second core saves, so on one thread the
# head's products, and the whole draft, take less time than split over two (EAGLE
# drafting one token a step).
FEW_ROWS = 8
# The blocks a draft head's matrices are held in for Int8Kernels. With the EAGLE proposer
# drafting every step, Q4_0 and Q4_1 heads draft faster than a Q8_0 one (fewer bytes,
# read cold every step) at about the same tokens per forward, and so decode faster; Q4_1
# is as fast as Q4_0, its min the closer fit.
HEAD_BLOCKS = "Q4_1"


def _threads(x: torch.Tensor) -> int | None:
    """One thread for a few rows, else the kernels' own rule (None)."""
    return 1 if x.shape[0] < FEW_ROWS else None


class CpuGemmKernels:
    """:mod:`cpu_gemm`'s products for fp32 weights on an AVX2 CPU, as the lean runner uses
    them: weights exact in 16 bits go to 16-bit panels (the same products, half the bytes);
    fewer than :data:`FEW_ROWS` rows on one thread."""

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.maybe_pack(w, True, half=True)

    def linear(
        self, x: torch.Tensor, w: torch.Tensor, res: torch.Tensor | None = None
    ) -> torch.Tensor:
        if isinstance(w, torch.Tensor) and w.dim() == 3:  # panels
            return cpu_gemm.mm(x, w, None, res, threads=_threads(x))
        return cpu_gemm.linear(x, w, None, res)

    def norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return cpu_gemm.rms_norm(x, w, eps)

    def chain_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, t: int = 1
    ) -> torch.Tensor | None:
        return cpu_gemm.attention(q, k, v, past, t)


class Int8Kernels(CpuGemmKernels):
    """:class:`CpuGemmKernels` with a draft head's matrices in GGUF blocks
    (:data:`HEAD_BLOCKS`) multiplied the way the int8 lean runner multiplies its own
    (``quant_gemm.linear_i8``: x rounded to int8 per 32 inputs, integer dot products), for
    a target whose products are already inexact so. A head's weights are read cold after
    every target forward (the target's weights, far larger than the caches, evict them),
    so its bytes are most of a drafting step, and Q4_1 holds them in under a third of
    their 16-bit size. A matrix whose inputs are no multiple of 32 keeps its 16-bit
    panels. The head only drafts, so its rounding can move acceptance, never an output."""

    def pack(self, w: torch.Tensor) -> Any:
        k, n = w.shape  # (in, out)
        if k % 32:
            return super().pack(w)
        blocks = quantize_blocks(w.detach().float().t().contiguous().numpy(), HEAD_BLOCKS)
        return quant_gemm.QuantMatrix.from_bytes(blocks, HEAD_BLOCKS, n, k)

    def linear(self, x: torch.Tensor, w: Any, res: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w, quant_gemm.QuantMatrix):
            return quant_gemm.linear_i8(x.float(), w, res=res, threads=_threads(x))
        return super().linear(x, w, res)


def quantize_blocks(w: np.ndarray, qtype: str) -> np.ndarray:
    """GGUF's ``qtype`` blocks (``Q8_0``, ``Q4_0``, ``Q4_1``: 32 values each) of the fp32
    rows ``w`` ``(n, k)``, ``k % 32 == 0``, as gguf's reference quantizer writes them."""
    import gguf

    kind = getattr(gguf.GGMLQuantizationType, qtype)
    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), kind)


class ModelTarget:
    """``TargetModel`` for a class with ``runner``, ``model_path``, ``max_length``,
    ``device`` and ``speculator_state`` (the engine)."""

    runner: Any
    speculator_state: SpeculatorState

    @property
    def vocab_size(self) -> int:
        return int(self.runner.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self.runner.hidden_size)

    @property
    def num_layers(self) -> int:
        return int(self.runner.num_layers)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(self.runner, "dtype", torch.float32)

    def embedding(self) -> torch.Tensor:
        """The token embedding ``(V, H)`` of a lean or a Hugging Face runner."""
        embed = getattr(self.runner, "embed", None)
        if isinstance(embed, torch.Tensor):
            return embed
        return self.runner.model.get_input_embeddings().weight

    def kernels(self, dtype: torch.dtype) -> Kernels:
        if cpu_gemm.usable(torch.device(self.runner.device), dtype):
            if getattr(self.runner, "int8", False) and quant_gemm.i8_available():
                return Int8Kernels()
            return CpuGemmKernels()
        return TorchKernels()

    def time_forwards(self, sizes: tuple[int, ...] = SEED_SIZES) -> dict[int, float]:
        """``{tokens: ms}``: forwards of each size on top of the runner's cache, each cut
        off again (the cache is left as it was): one untimed warm-up, then the fastest of
        ``SAMPLES`` (noise on a shared machine only adds time; one sample prices a size
        at a spike often enough to make the policy's first choices a coin toss). Token
        id 0 everywhere: only the time matters."""
        runner = self.runner
        base = runner.length
        out: dict[int, float] = {}
        for n in sizes:
            if n > runner.max_length - base - 1:
                break
            samples = []
            for _ in range(1 + SAMPLES):
                t0 = time.perf_counter()
                runner.forward([0] * n)
                samples.append((time.perf_counter() - t0) * 1000)
                runner.truncate(base)
            out[n] = min(samples[1:])
        return out
