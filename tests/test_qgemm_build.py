"""The quantized kernel's build: on a CPU without AVX-512F it leaves the AVX-512 and AMX
paths out (``-DQG_NO_AVX512``, about half the compile; the AVX-512 stack of ``stack.cpp``
too), and both sources are valid C++ both ways (checked with ``-fsyntax-only``, which
instantiates every template: a full build of the other way takes minutes)."""

from __future__ import annotations

import subprocess

import pytest

from codespec.daemon.engine import cpu_gemm, quant_gemm
from codespec.native import compiler

needs_cxx = pytest.mark.skipif(compiler() is None, reason="no C++ compiler")


@needs_cxx
@pytest.mark.parametrize("defines", [[], ["-DQG_NO_AVX512"]])
def test_the_source_compiles_with_and_without_the_avx512_paths(defines: list[str]) -> None:
    cmd = [str(compiler()), "-std=c++17", "-fopenmp", "-fsyntax-only", *defines,
           *map(str, quant_gemm.SOURCES)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_only_a_cpu_without_avx512f_builds_without_its_paths() -> None:
    flags = cpu_gemm.cpu_flags()
    left_out = "-DQG_NO_AVX512" in quant_gemm.FLAGS
    assert left_out == (bool(flags) and "avx512f" not in flags)
    if left_out and quant_gemm.library() is not None:
        assert not quant_gemm.isa_supported("avx512")
        assert int(quant_gemm.library().cs_q_amx(-1)) == -1  # no AMX path either
