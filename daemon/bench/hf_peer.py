"""transformers' ``generate()`` as a peer of our methods: ``hf`` and ``hf-pld``.

Owns: :class:`HFPeer` (the engine's checkpoint under transformers, greedy, with a forward
counter and the time to the first token; ``prompt_lookup_num_tokens`` for ``hf-pld``).
Must not touch: our engine's decoding (``decoding``), the workloads, the tables.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from codespec.daemon.bench.decoding import Run

if TYPE_CHECKING:
    from codespec.daemon.engine.engine import Engine


class HFPeer:
    """transformers' own generate() on the engine's checkpoint, with a forward counter."""

    def __init__(self, engine: Engine) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from codespec.daemon.engine.runner import HFRunner

        if isinstance(engine.runner, HFRunner):
            self.model = engine.runner.model
        else:
            dtype = torch.bfloat16 if engine.device.type == "cuda" else torch.float32
            from codespec.daemon.engine.models import hf_checkpoint

            self.model = AutoModelForCausalLM.from_pretrained(
                hf_checkpoint(engine.model_path), local_files_only=True, dtype=dtype
            ).to(engine.device)
        self.model.eval()
        self.engine = engine
        self.calls = 0
        self.model.register_forward_pre_hook(self._count)

    def _count(self, *_: object) -> None:
        self.calls += 1

    def run(self, prompt: list[int], max_tokens: int, lookup: int | None) -> Run:
        import torch

        stop = sorted(self.engine.stop_ids)
        x = torch.tensor([prompt], device=self.engine.device)
        kwargs: dict[str, Any] = {}
        if lookup:
            kwargs["prompt_lookup_num_tokens"] = lookup
        self.calls = 0
        timer = _FirstTokenTimer()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=stop,
                pad_token_id=stop[0],
                streamer=timer,
                **kwargs,
            )
        ms = (time.perf_counter() - t0) * 1000
        ids = out[0, len(prompt) :].tolist()
        for i, t in enumerate(ids):
            if t in self.engine.stop_ids:
                ids = ids[:i]
                break
        return Run(len(ids), self.calls, ms, ids, (timer.first - t0) * 1000 if timer.first else ms)


class _FirstTokenTimer:
    """A generate() streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first = 0.0

    def put(self, value: object) -> None:
        self.calls += 1
        if self.calls == 2:  # the first put is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass
