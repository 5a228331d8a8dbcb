"""Loading a model on the CPU: the kernels build while the model is found or fetched
(``loading.build_cpu_kernels_meanwhile``), so a first run's compile and fetch overlap."""

from __future__ import annotations

import threading
import types

from codespec.daemon.engine import loading
from codespec.daemon.engine.engine import Engine


def test_the_kernels_build_while_the_model_is_resolved(tiny_model, monkeypatch):
    """A kernel build that waits for the model's resolution, and a resolution that waits
    for the build to have started: both finish only if they run at once."""
    started, resolved = threading.Event(), threading.Event()
    real_library, real_resolve = loading.quant_gemm.library, loading.models.resolve
    seen: list[str] = []

    def library():
        started.set()
        seen.append("build waited" if resolved.wait(10) else "build alone")
        return real_library()

    def resolve(model, root=None):
        seen.append("resolve saw the build" if started.wait(10) else "resolve alone")
        resolved.set()
        return real_resolve(model, root)

    monkeypatch.setattr(loading, "quant_gemm", types.SimpleNamespace(library=library))
    monkeypatch.setattr(loading.models, "resolve", resolve)
    engine = Engine(tiny_model, device="cpu")
    assert engine.model_path == str(tiny_model)
    for t in threading.enumerate():
        if t.name == "codespec-kernels":
            t.join(10)
    assert sorted(seen) == ["build waited", "resolve saw the build"], seen


def test_both_kernel_libraries_build_at_once(tiny_model, monkeypatch):
    """Each library's build waits for the other's to have started: both finish only if
    they run at once (the small one used to wait for the large one's compile)."""
    started = {"quant": threading.Event(), "cpu": threading.Event()}
    seen: list[str] = []

    def library(name: str, other: str, real):
        def build():
            started[name].set()
            seen.append(f"{name} saw {other}" if started[other].wait(10) else f"{name} alone")
            return real()

        return types.SimpleNamespace(library=build)

    monkeypatch.setattr(loading, "quant_gemm", library("quant", "cpu", loading.quant_gemm.library))
    monkeypatch.setattr(loading, "cpu_gemm", library("cpu", "quant", loading.cpu_gemm.library))
    threads = loading.build_cpu_kernels_meanwhile()
    for t in threads:
        t.join(20)
    assert sorted(seen) == ["cpu saw quant", "quant saw cpu"], seen


def test_the_hf_runner_builds_no_cpu_kernels(tiny_model, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr("codespec.daemon.engine.engine.build_cpu_kernels_meanwhile",
                        lambda: calls.append("built"))  # fmt: skip
    Engine(tiny_model, device="cpu", runner="hf")
    assert calls == []
    Engine(tiny_model, device="cpu")
    assert calls == ["built"]
