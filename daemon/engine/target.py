"""The engine's model as proposers see it: :class:`ModelTarget` gives the engine the
members of :class:`codespec.speculators.target.TargetModel`.

Owns the mixin that reads them off the engine's runner (lean or Hugging Face):
its shape, its token embedding and its kernels (:class:`CpuGemmKernels`, the
lean runner's CPU kernels as :class:`~codespec.speculators.target.Kernels`),
and :meth:`ModelTarget.time_forwards`, the timed forwards the daemon hands the
policy as its first cost table (``codespec.speculators.policy.seed_costs``).
Must not touch: the runner's cache contents (timing appends and cuts back).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from codespec.daemon.engine import cpu_gemm
from codespec.speculators.costs import SEED_SIZES
from codespec.speculators.target import Kernels, TorchKernels

SAMPLES = 3  # timed forwards per size in time_forwards (the fastest counts)


class CpuGemmKernels:
    """:mod:`cpu_gemm`'s products for fp32 weights on an AVX2 CPU, as the lean runner uses
    them: weights exact in 16 bits go to 16-bit panels (the same products, half the bytes)."""

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.maybe_pack(w, True, half=True)

    def linear(
        self, x: torch.Tensor, w: torch.Tensor, res: torch.Tensor | None = None
    ) -> torch.Tensor:
        return cpu_gemm.linear(x, w, None, res)

    def norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return cpu_gemm.rms_norm(x, w, eps)

    def decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int
    ) -> torch.Tensor | None:
        return cpu_gemm.attention(q, k, v, past, 1)


class ModelTarget:
    """``TargetModel`` for a class with ``runner``, ``model_path``, ``max_length`` and
    ``device`` (the engine)."""

    runner: Any

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
            return CpuGemmKernels()
        return TorchKernels()

    def time_forwards(self, sizes: tuple[int, ...] = SEED_SIZES) -> dict[int, float]:
        """``{tokens: ms}``: forwards of each size on top of the runner's cache, each cut
        off again (the cache is left as it was): one untimed warm-up, then the fastest of
        ``SAMPLES`` (noise on a shared machine only adds time; one sample priced a size
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
