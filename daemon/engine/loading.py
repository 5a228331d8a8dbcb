"""Loading a model: the device, the folder ``--model`` names, the runner over it.

Owns :class:`ModelLoadError` (one line for the user) and the choice of runner
(the lean runner where it supports the architecture, else Hugging Face's). Knows
nothing about decoding.
"""

from __future__ import annotations

import os
import threading

import torch

from codespec.daemon.engine import cpu_gemm, lean, lean_config, models, quant_gemm, row_split
from codespec.daemon.engine.runner import HFRunner, Runner


class ModelLoadError(RuntimeError):
    """The model could not be found or read; the message is one line for the user."""


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for, but CUDA is not available")
    if device not in ("cpu", "cuda"):
        raise ModelLoadError(f"unknown device {device!r} (cpu, cuda or auto)")
    return torch.device(device)


def build_cpu_kernels_meanwhile() -> list[threading.Thread]:
    """Build (or load) the CPU kernels, each library on a thread of its own, all started
    now, while the caller finds, fetches or reads the model: on a first run the model's
    fetch (~40-60 s for the default) and the kernels' compile (~35 s on a 2-core VM, its
    sources compiled at once) then overlap instead of adding up, and the small library
    no longer waits for the large one (it took 6 s after it). The runner's own first use
    of a kernel waits for its build (each library builds once: ``codespec.native``); a
    build that fails says why there, as before."""
    threads = [
        threading.Thread(target=lib.library, name="codespec-kernels", daemon=True)
        for lib in (quant_gemm, cpu_gemm)
    ]
    for t in threads:
        t.start()
    return threads


def resolve_model_path(model: str | os.PathLike | None) -> str:
    """The folder to load for ``model`` (see :func:`codespec.daemon.engine.models.resolve`)."""
    try:
        return str(models.resolve(model))
    except models.ModelError as exc:
        raise ModelLoadError(str(exc)) from None


def load_runner(
    path: str, device: torch.device, runner: str = "auto", max_length: int | None = None
) -> tuple[Runner, object]:
    """Return (runner, HF config). ``runner`` is auto | lean | hf. On the CPU a folder the
    model cache made from a GGUF runs from the GGUF's own blocks (``lean.from_model_folder``);
    everything else loads the checkpoint :func:`.models.hf_checkpoint` gives (made from
    the GGUF once, when the folder holds none)."""
    if runner not in ("auto", "lean", "hf"):
        raise ModelLoadError(f"unknown runner {runner!r} (auto, lean or hf)")
    if runner in ("auto", "lean") and device.type == "cpu":
        try:
            got = lean.from_model_folder(path, max_length)
        except Exception as exc:
            raise ModelLoadError(f"cannot load {path}: {one_line(exc)}") from exc
        if got is not None:
            row_split.calibrate_kept(got[0], path)  # this machine's way of sharing small forwards
            return got
    try:
        path = str(models.hf_checkpoint(path))
    except models.ModelError as exc:
        raise ModelLoadError(str(exc)) from None
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot read the model config in {path}: {one_line(exc)}") from exc
    if runner in ("auto", "lean"):
        if lean_config.supports(config):
            try:
                r = lean.LeanRunner.from_pretrained(
                    path, device=str(device), dtype=dtype, max_length=max_length
                )
                # An fp16 / bf16 checkpoint's weights as 16-bit panels: the same outputs
                # bit for bit, half the bytes each forward streams (a no-op without the
                # kernel).
                r.half_panels()
            except Exception as exc:
                raise ModelLoadError(f"cannot load {path}: {one_line(exc)}") from exc
            return r, config
        if runner == "lean":
            raise ModelLoadError(f"the lean runner does not support {config.model_type!r}")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except Exception as exc:
        raise ModelLoadError(f"cannot load {path}: {one_line(exc)}") from exc
    return HFRunner(model.to(device), max_length=max_length), config


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (for one-line errors)."""
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
